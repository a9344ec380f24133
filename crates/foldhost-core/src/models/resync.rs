//! Resync ordering: the key-listing repair's ack barrier (docs/design.md, "Cursor-expiry repair").
//!
//! A fold holds `a@1` and `b@2` (cursor 2) when its cursor expires. The bucket goes on meanwhile —
//! `a` is deleted (3) and created again (4), `b` is deleted (5) — and every write interleaves with
//! every step of the repair. The repair: the planner ([`protocol::listing_truth`] on the bucket's
//! retention, which keeps current values, then [`protocol::plan_repair`]) chooses the key-listing
//! diff; the bucket's live keys are listed; every fold key the listing lacks gets a synthetic
//! delete, each its own step, carrying the unknown version ([`protocol::commit_cursor`] with
//! `None`: no cursor move); the ack barrier waits for every one of them; then the state-sync
//! re-list delivers the last message of every key, then live writes, each delivery its own step
//! (cursor by [`protocol::commit_cursor`]). A delete marker written before the listing counts as
//! purged (the worst case the diff exists for); one written after it is delivered (the repair's one
//! axiom: no marker is evicted between the listing and the re-list). A crash loses the repair in
//! memory; the fold (data and cursor) is durable, and the next start repairs again from a listing.
//!
//! Properties:
//! - "a synthetic delete never lands after the re-list put of its key";
//! - "a repaired fold is every write minus every real delete": once no synthetic delete is
//!   pending and the re-list has delivered everything, the fold is the bucket's truth;
//! - sometimes "a deleted-then-recreated key converges" (the scenario is reachable).
//!
//! Mutation (must produce a counterexample):
//! - `NoBarrier` — the ack goes out at once: the re-list may start, and deliver, before every
//!   synthetic delete has landed (the lost recreate).

use stateright::{Checker, Model, Property};

use crate::protocol::{self, RepairMode, RepairPlan, Retention};

/// Keys (`a`, `b`).
const KEYS: usize = 2;
/// The log: revision `r` is `SCRIPT[r - 1]`, a put (`true`) or a delete of key `.0`.
const SCRIPT: [(usize, bool); 5] = [(0, true), (1, true), (0, false), (0, true), (1, false)];
/// Revisions in the log.
const LOG: u8 = SCRIPT.len() as u8;
/// Revisions the fold had folded when its cursor expired.
const FOLDED: u8 = 2;
/// The bucket's retention as the repair reads it: current values kept, first retained revision
/// past the fold's cursor.
const RETENTION: Retention = Retention {
    evicts_current_values: false,
    first_revision: 4,
};
/// Crashes a run may have (bounds the state space).
const MAX_CRASHES: u8 = 1;

/// One decision forged, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mutation {
    None,
    NoBarrier,
}

/// Where the fold is.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Phase {
    /// The cursor is expired; the repair has not listed yet.
    Expired,
    /// Listed: synthetic deletes, the ack, the re-list.
    Repairing,
    /// The planner chose no key-listing repair.
    Stopped,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    /// Revisions written to the bucket.
    written: u8,
    /// The durable fold: each key's value (the revision that wrote it), `None` when absent.
    fold: [Option<u8>; KEYS],
    /// The durable cursor.
    cursor: Option<u64>,
    phase: Phase,
    /// Revisions written when the listing was taken.
    listed_at: u8,
    /// Synthetic deletes planned and not yet landed (in memory).
    pending: [bool; KEYS],
    /// Once the ack is out: the revisions the re-list has still to deliver (in memory).
    relist: Option<Vec<u8>>,
    /// A re-list put of the key has landed in this repair.
    relisted: [bool; KEYS],
    /// A synthetic delete landed after a re-list put of its key (observed, never decided on).
    late_delete: bool,
    /// A synthetic delete of the key has landed (observed, for the reachability property).
    synthetic: [bool; KEYS],
    crashes: u8,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Action {
    /// The bucket takes its next write.
    Write,
    /// The repair reads retention, plans, lists the bucket and diffs the fold against it.
    List,
    /// A synthetic delete of this key lands.
    SyntheticDelete(usize),
    /// The ack: the re-list starts.
    Ack,
    /// The re-list delivers its next message.
    Deliver,
    /// The node crashes and starts again.
    Crash,
}

/// The last message of `key` among the first `written` revisions: its revision and whether it is
/// a put.
fn last_of(key: usize, written: u8) -> Option<(u8, bool)> {
    (1..=written)
        .rev()
        .map(|r| (r, SCRIPT[usize::from(r - 1)]))
        .find(|(_, (k, _))| *k == key)
        .map(|(r, (_, put))| (r, put))
}

/// Every write minus every real delete, after `written` revisions.
fn truth(written: u8) -> [Option<u8>; KEYS] {
    std::array::from_fn(|k| last_of(k, written).and_then(|(r, put)| put.then_some(r)))
}

/// The repair is done: nothing pending, the re-list delivered everything written so far.
fn repaired(s: &State) -> bool {
    s.phase == Phase::Repairing
        && !s.pending.contains(&true)
        && s.relist.as_ref().is_some_and(Vec::is_empty)
}

struct ResyncModel {
    mutation: Mutation,
}

impl Model for ResyncModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            written: FOLDED,
            fold: truth(FOLDED),
            cursor: Some(u64::from(FOLDED)),
            phase: Phase::Expired,
            listed_at: 0,
            pending: [false; KEYS],
            relist: None,
            relisted: [false; KEYS],
            late_delete: false,
            synthetic: [false; KEYS],
            crashes: 0,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.written < LOG {
            actions.push(Action::Write);
        }
        match s.phase {
            Phase::Expired => actions.push(Action::List),
            Phase::Repairing => {
                for (k, p) in s.pending.iter().enumerate() {
                    if *p {
                        actions.push(Action::SyntheticDelete(k));
                    }
                }
                let barrier_open =
                    !s.pending.contains(&true) || self.mutation == Mutation::NoBarrier;
                if s.relist.is_none() && barrier_open {
                    actions.push(Action::Ack);
                }
                if s.relist.as_ref().is_some_and(|q| !q.is_empty()) {
                    actions.push(Action::Deliver);
                }
                if s.crashes < MAX_CRASHES {
                    actions.push(Action::Crash);
                }
            }
            Phase::Stopped => {}
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        match action {
            Action::Write => {
                n.written += 1;
                if let Some(q) = n.relist.as_mut() {
                    // Live after the re-list's snapshot: every write is delivered, in order.
                    q.push(n.written);
                }
            }
            Action::List => {
                let listing = protocol::listing_truth(Some(RETENTION), false);
                if protocol::plan_repair(RepairMode::Auto, listing) != RepairPlan::Relist {
                    n.phase = Phase::Stopped;
                    return Some(n);
                }
                let live = truth(n.written);
                n.phase = Phase::Repairing;
                n.listed_at = n.written;
                n.pending = std::array::from_fn(|k| n.fold[k].is_some() && live[k].is_none());
                n.relist = None;
                n.relisted = [false; KEYS];
            }
            Action::SyntheticDelete(k) => {
                n.late_delete |= n.relisted[k];
                n.fold[k] = None;
                n.pending[k] = false;
                n.synthetic[k] = true;
                n.cursor = protocol::commit_cursor(n.cursor, None);
            }
            Action::Ack => {
                // Last message per key, in revision order; a marker from before the listing is
                // purged, one written after it is still there.
                let mut q: Vec<u8> = (0..KEYS)
                    .filter_map(|k| last_of(k, n.written))
                    .filter(|(r, put)| *put || *r > n.listed_at)
                    .map(|(r, _)| r)
                    .collect();
                q.sort_unstable();
                n.relist = Some(q);
            }
            Action::Deliver => {
                let q = n.relist.as_mut()?;
                let r = q.remove(0);
                let (k, put) = SCRIPT[usize::from(r - 1)];
                n.fold[k] = put.then_some(r);
                n.relisted[k] |= put;
                n.cursor = protocol::commit_cursor(n.cursor, Some(u64::from(r)));
            }
            Action::Crash => {
                n.crashes += 1;
                n.phase = Phase::Expired;
                n.pending = [false; KEYS];
                n.relist = None;
                n.relisted = [false; KEYS];
            }
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "a synthetic delete never lands after the re-list put of its key",
                |_, s: &State| !s.late_delete,
            ),
            Property::always(
                "a repaired fold is every write minus every real delete",
                |_, s: &State| !repaired(s) || s.fold == truth(s.written),
            ),
            Property::sometimes("a deleted-then-recreated key converges", |_, s: &State| {
                repaired(s) && s.written == LOG && s.synthetic[0] && s.fold == truth(LOG)
            }),
        ]
    }
}

fn check(mutation: Mutation) -> impl Checker<ResyncModel> {
    ResyncModel { mutation }.checker().spawn_bfs().join()
}

#[test]
fn synthetic_deletes_always_precede_relist_puts_of_the_same_key() {
    let c = check(Mutation::None);
    c.assert_no_discovery("a synthetic delete never lands after the re-list put of its key");
    c.assert_no_discovery("a repaired fold is every write minus every real delete");
    assert!(
        c.discovery("a deleted-then-recreated key converges")
            .is_some(),
        "delete-then-recreate during the gap is reachable"
    );
    assert!(
        c.unique_state_count() > 100,
        "{} states",
        c.unique_state_count()
    );
}

#[test]
fn without_the_ack_barrier_a_recreated_key_is_lost() {
    let c = check(Mutation::NoBarrier);
    for property in [
        "a synthetic delete never lands after the re-list put of its key",
        "a repaired fold is every write minus every real delete",
    ] {
        let path = c
            .discovery(property)
            .unwrap_or_else(|| panic!("NoBarrier found no counterexample to {property:?}"));
        let steps: Vec<Action> = path.into_actions();
        assert!(!steps.is_empty(), "{property}");
    }
}
