//! Deferral: retained records, the hold on their keys, their release, and `applied_through`
//! (docs/design.md, "Deferral": a key's applied history is a prefix of its log; `retained.rs`,
//! `applied/fold/mod.rs`).
//!
//! A log of [`LOG`] updates to two keys is delivered in order into batches of at most
//! [`MAX_BATCH`]. A flush offers the batch to the guest, which may defer any update it is offered
//! (a nondeterministic verdict, at most [`MAX_DEFERS`] in a run). What follows a deferred update of
//! its key is held, by [`protocol::held_after_defers`] — within the batch as `parse_with_deferral`
//! asks it, and across batches with the key's retained records put before the batch (deferred, in
//! log order), which is what `RetainedIndex::is_blocked` answers in production — re-offering until
//! nothing more is held; deferred and held updates become retained records, committed with the
//! batch and the cursor [`protocol::commit_cursor`] gives. After a swap (a new guest) and at every
//! start the retained records are released: offered in log order through the same loop; what the
//! guest applies is released, what it defers again stays retained. A crash loses memory (the open
//! batch); the fold's store — cursor, retained records, what guests applied — is durable. After
//! every commit the fold publishes `applied_through` ([`protocol::applied_through`] of the cursor,
//! the oldest retained revision and the unseen floor).
//!
//! A run starts either as a delta watch (every revision delivered) or as a state-sync start (a
//! fold with no cursor: each key's latest record only, [`sync_log`]); the revisions such a start
//! skips are tracked ([`protocol::first_unseen`]) and the first is durably recorded as unseen
//! ([`protocol::Unseen`]), which holds `applied_through` below it until the fold is level with
//! nothing retained. A watch is level once it delivered its last revision (a state-sync: the last
//! of [`sync_log`]; a delta: the log's end).
//!
//! Properties:
//! - "a key's applied history is a prefix of its log": per key, the revisions guests applied, in
//!   the order they applied them, are a prefix of that key's revisions in the log;
//! - "applied_through never covers a revision its key's state is older than": every revision at or
//!   below it is one whose key's last applied revision is at least it (in a delta run: applied);
//! - sometimes "a deferred update released and the whole log applied".
//!
//! Mutations (each must produce a counterexample):
//! - `NoHold` — `held_after_defers` is handed no deferred update, so nothing is held;
//! - `RetainedNotDurable` — retained records live in memory only: a crash loses them while the
//!   cursor covers them;
//! - `ReleaseDropsRetained` — a release drops the records the guest defers again;
//! - `AppliedThroughIgnoresRetained` — `applied_through` is handed no oldest retained revision;
//! - `AppliedThroughIgnoresUnseen` — `applied_through` is handed no unseen floor.

use stateright::{Checker, Model, Property};

use crate::protocol;

/// The keys.
const KEYS: [&str; 2] = ["a", "b"];
/// The log: revision `r` updates `KEYS[SCRIPT[r - 1]]`.
const SCRIPT: [usize; 4] = [0, 0, 1, 0];
/// Revisions in the log.
const LOG: u64 = SCRIPT.len() as u64;
/// Updates a batch holds at most.
const MAX_BATCH: usize = 2;
/// Defer verdicts a run may have.
const MAX_DEFERS: u32 = 2;
/// Crashes a run may have.
const MAX_CRASHES: u8 = 2;
/// Swaps a run may have.
const MAX_SWAPS: u8 = 1;

/// One decision forged, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mutation {
    None,
    NoHold,
    RetainedNotDurable,
    ReleaseDropsRetained,
    AppliedThroughIgnoresRetained,
    AppliedThroughIgnoresUnseen,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    /// The highest revision received (in memory).
    received: u64,
    /// The open batch (in memory).
    batch: Vec<u64>,
    /// The durable cursor.
    cursor: Option<u64>,
    /// Retained records, in log order (durable, committed with their batch).
    retained: Vec<u64>,
    /// Revisions guests applied, in the order they applied them (durable, with their commit).
    applied: Vec<u64>,
    /// `applied_through` as the fold last published it.
    reported: Option<u64>,
    /// Retained records are to be offered before anything new (after a swap or a start).
    release_due: bool,
    /// The run began with a state-sync start.
    sync: bool,
    /// A state-sync watch is delivering (in memory: a start with no cursor).
    syncing: bool,
    /// The revision the state-sync expects next (in memory).
    next_expected: u64,
    /// What the state-sync left unseen (durable, committed with its batch; its level recorded at
    /// once when the watch is level).
    unseen: Option<protocol::Unseen>,
    /// The revision the running watch reported level at (in memory).
    level: Option<u64>,
    defers: u32,
    crashes: u8,
    swaps: u8,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Action {
    /// The next update joins the open batch.
    Deliver,
    /// The batch is flushed; the guest defers the updates of these batch positions when offered.
    Flush { defer: u8 },
    /// The retained records are offered; the guest defers these positions again.
    Release { defer: u8 },
    /// A new guest version takes over.
    Swap,
    /// The node crashes and starts again.
    Crash,
}

/// What a state-sync start delivers: each key's latest revision, in log order.
fn sync_log() -> Vec<u64> {
    (1..=LOG)
        .filter(|r| !(r + 1..=LOG).any(|later| key_of(later) == key_of(*r)))
        .collect()
}

/// The revisions of `key` a run delivers: all of them, or the state-sync's.
fn delivered_of(sync: bool, key: &str) -> Vec<u64> {
    let all: Vec<u64> = if sync {
        sync_log()
    } else {
        (1..=LOG).collect()
    };
    all.into_iter().filter(|r| key_of(*r) == key).collect()
}

/// The next revision the watch delivers after `received`.
fn next_delivery(s: &State) -> Option<u64> {
    if s.syncing {
        sync_log().into_iter().find(|r| *r > s.received)
    } else {
        (s.received < LOG).then_some(s.received + 1)
    }
}

/// The key revision `r` updates.
fn key_of(r: u64) -> &'static str {
    KEYS[SCRIPT[(r - 1) as usize]]
}

/// Whether the defer verdicts of `mask` fit the run's bound.
fn within(s: &State, mask: u8) -> bool {
    s.defers + mask.count_ones() <= MAX_DEFERS
}

struct DeferralModel {
    mutation: Mutation,
}

impl DeferralModel {
    /// `held_after_defers`, or its forged input under `NoHold`.
    fn held_after_defers(&self, keys: &[&str], deferred: &[bool]) -> Vec<usize> {
        if self.mutation == Mutation::NoHold {
            protocol::held_after_defers(keys, &vec![false; deferred.len()])
        } else {
            protocol::held_after_defers(keys, deferred)
        }
    }

    /// `parse_with_deferral` over `offered` (after `before`, retained records of earlier batches,
    /// which are deferred): which of `offered` end up deferred, held or deferred by the guest
    /// (`defer`, by position in `offered`).
    fn deferral(&self, before: &[u64], offered: &[u64], defer: u8) -> Vec<bool> {
        let n = before.len();
        let keys: Vec<&str> = before.iter().chain(offered).map(|r| key_of(*r)).collect();
        // What follows a retained record of its key is held before the guest sees it.
        let mut held: Vec<bool> = (0..keys.len()).map(|i| i < n).collect();
        for i in self.held_after_defers(&keys, &held) {
            held[i] = true;
        }
        loop {
            let mut deferred = held.clone();
            for (i, d) in deferred.iter_mut().enumerate().skip(n) {
                *d |= defer & (1 << (i - n)) != 0;
            }
            let later = self.held_after_defers(&keys, &deferred);
            if later.is_empty() {
                return deferred.split_off(n);
            }
            held = deferred;
            for i in later {
                held[i] = true;
            }
        }
    }

    /// What the fold publishes after a commit.
    fn applied_through(&self, s: &State) -> Option<u64> {
        let oldest = match self.mutation {
            Mutation::AppliedThroughIgnoresRetained => None,
            _ => s.retained.first().copied(),
        };
        let unseen = match self.mutation {
            Mutation::AppliedThroughIgnoresUnseen => None,
            _ => s.unseen,
        };
        protocol::applied_through(s.cursor, oldest, unseen)
    }

    /// What the state-sync left unseen after a commit of `batch` (`n` still at the cursor and the
    /// retained records before it): a skipped revision found (the lowest stands), the level
    /// added, or the record removed once settled with no state-sync tracking — as the fold does.
    fn unseen_after(n: &mut State, batch: &[u64]) {
        let mut first = None;
        if n.syncing {
            let (skipped, next) = protocol::first_unseen(n.next_expected, batch.iter().copied());
            n.next_expected = next;
            first = skipped;
        }
        let after = protocol::unseen_after(
            n.unseen,
            first,
            n.level,
            n.syncing,
            n.cursor,
            !n.retained.is_empty(),
        );
        n.unseen = after;
    }
}

impl Model for DeferralModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        [false, true]
            .into_iter()
            .map(|sync| State {
                received: 0,
                batch: Vec::new(),
                cursor: None,
                retained: Vec::new(),
                applied: Vec::new(),
                reported: None,
                release_due: false,
                sync,
                syncing: sync,
                next_expected: 1,
                unseen: None,
                level: None,
                defers: 0,
                crashes: 0,
                swaps: 0,
            })
            .collect()
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.crashes < MAX_CRASHES {
            actions.push(Action::Crash);
        }
        if s.release_due {
            for defer in 0..1u8 << s.retained.len() {
                if within(s, defer) {
                    actions.push(Action::Release { defer });
                }
            }
            return;
        }
        if next_delivery(s).is_some() && s.batch.len() < MAX_BATCH {
            actions.push(Action::Deliver);
        }
        if !s.batch.is_empty() {
            for defer in 0..1u8 << s.batch.len() {
                if within(s, defer) {
                    actions.push(Action::Flush { defer });
                }
            }
        }
        if !s.retained.is_empty() && s.swaps < MAX_SWAPS {
            actions.push(Action::Swap);
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        match action {
            Action::Deliver => {
                n.received = next_delivery(s)?;
                n.batch.push(n.received);
                if next_delivery(&n).is_none() {
                    // The watch is level: recorded at once where something is unseen.
                    n.level = Some(n.received);
                    if let Some(u) = n.unseen.as_mut()
                        && u.level.is_none()
                    {
                        u.level = Some(n.received);
                    }
                }
            }
            Action::Flush { defer } => {
                let batch = std::mem::take(&mut n.batch);
                Self::unseen_after(&mut n, &batch);
                let deferred = self.deferral(&n.retained, &batch, defer);
                for (r, d) in batch.iter().zip(&deferred) {
                    if *d {
                        n.retained.push(*r);
                    } else {
                        n.applied.push(*r);
                    }
                }
                n.defers += defer.count_ones();
                n.cursor = protocol::commit_cursor(n.cursor, batch.iter().copied().max());
                if n.level.is_some_and(|l| n.cursor >= Some(l)) {
                    n.syncing = false;
                }
                n.reported = self.applied_through(&n);
            }
            Action::Release { defer } => {
                let records = std::mem::take(&mut n.retained);
                let deferred = self.deferral(&[], &records, defer);
                for (r, d) in records.iter().zip(&deferred) {
                    if !d {
                        n.applied.push(*r);
                    } else if self.mutation != Mutation::ReleaseDropsRetained {
                        n.retained.push(*r);
                    }
                }
                n.defers += defer.count_ones();
                n.release_due = false;
                n.reported = self.applied_through(&n);
            }
            Action::Swap => {
                n.swaps += 1;
                n.release_due = true;
            }
            Action::Crash => {
                n.crashes += 1;
                n.batch.clear();
                n.received = n.cursor.unwrap_or(0);
                // A start with no cursor is a state-sync again; one with a cursor a delta.
                n.syncing = n.sync && n.cursor.is_none();
                n.next_expected = n.received + 1;
                n.level = None;
                if self.mutation == Mutation::RetainedNotDurable {
                    n.retained.clear();
                }
                n.release_due = !n.retained.is_empty();
                n.reported = self.applied_through(&n);
            }
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "a key's applied history is a prefix of its log",
                |_, s: &State| {
                    KEYS.iter().all(|k| {
                        let log = delivered_of(s.sync, k).into_iter();
                        let applied: Vec<u64> = s
                            .applied
                            .iter()
                            .copied()
                            .filter(|r| key_of(*r) == *k)
                            .collect();
                        applied.iter().copied().eq(log.take(applied.len()))
                    })
                },
            ),
            Property::always(
                "applied_through never covers a revision its key's state is older than",
                |_, s: &State| {
                    s.reported.is_none_or(|t| {
                        (1..=t)
                            .all(|r| s.applied.iter().any(|a| key_of(*a) == key_of(r) && *a >= r))
                    })
                },
            ),
            Property::sometimes(
                "a deferred update released and the whole log applied",
                |_, s: &State| {
                    s.defers > 0
                        && s.retained.is_empty()
                        && s.cursor == Some(LOG)
                        && (1..=LOG).all(|r| s.applied.contains(&r))
                },
            ),
        ]
    }
}

fn check(mutation: Mutation) -> impl Checker<DeferralModel> {
    DeferralModel { mutation }.checker().spawn_bfs().join()
}

#[test]
fn a_keys_applied_history_is_always_a_prefix_of_its_log() {
    let c = check(Mutation::None);
    c.assert_no_discovery("a key's applied history is a prefix of its log");
    c.assert_no_discovery("applied_through never covers a revision its key's state is older than");
    assert!(
        c.discovery("a deferred update released and the whole log applied")
            .is_some(),
        "deferred updates can be released and the whole log applied"
    );
    assert!(
        c.unique_state_count() > 100,
        "{} states",
        c.unique_state_count()
    );
}

#[test]
fn each_mutation_of_deferral_has_a_counterexample() {
    for (mutation, property) in [
        (
            Mutation::NoHold,
            "a key's applied history is a prefix of its log",
        ),
        (
            Mutation::RetainedNotDurable,
            "applied_through never covers a revision its key's state is older than",
        ),
        (
            Mutation::ReleaseDropsRetained,
            "applied_through never covers a revision its key's state is older than",
        ),
        (
            Mutation::AppliedThroughIgnoresUnseen,
            "applied_through never covers a revision its key's state is older than",
        ),
        (
            Mutation::AppliedThroughIgnoresRetained,
            "applied_through never covers a revision its key's state is older than",
        ),
    ] {
        let c = check(mutation);
        let path = c
            .discovery(property)
            .unwrap_or_else(|| panic!("{mutation:?} found no counterexample"));
        let steps: Vec<Action> = path.into_actions();
        assert!(!steps.is_empty(), "{mutation:?}");
    }
}
