//! The cursor-expiry repair as steps (docs/design.md, "Cursor-expiry repair"), interleaved with the
//! bucket's writers, its retention, an artifact's publisher, and the fold's own crashes.
//!
//! Modelled: a bucket of [`KEYS`] keys whose log takes up to [`MAX_OPS`] puts and deletes; its
//! retention, which advances the first retained revision and can be switched to evict current
//! values and back; an artifact another node publishes; and one fold — durable: its key → revision
//! map, its cursor and its eviction memo (`seen_evicting`); in memory: the watch's position, a
//! state-sync re-list's initial values and the delivered batch. The fold starts (cursor-less at
//! first: [`protocol::cursorless_start_needs_repair`]), watches (a delivery gap goes to
//! [`protocol::floor_guard_trips`]; a resume to [`protocol::resume_window_ok`]; the retention tick
//! commits the memo), commits a batch with the cursor [`protocol::commit_cursor`] gives, and
//! crashes (everything in memory is lost; the restart re-runs whatever repair was under way from
//! its start). An expired cursor is repaired in production's steps: drain (the store holds every
//! delivered update before anything else), plan (retention read: the memo committed when
//! [`protocol::retention_has_evicted`] says so; then [`protocol::listing_truth`] with the memo,
//! [`protocol::plan_repair`], and for a restore [`protocol::restore_allowed`]), diff (re-list: a
//! synthetic delete for every fold key the bucket does not list; restore: [`protocol::restore_key`]
//! per key, the delete candidates checked against the live listing, retention read again), apply
//! the difference one key per chunk under the old cursor, and the last step (re-list: the cursor
//! stays and a state-sync re-list starts, which re-checks [`protocol::relist_still_vouched`] at its
//! first event while the fold has no memo; restore: the cursor becomes the artifact's, then the
//! resume check).
//!
//! Abstractions: a transient store failure re-queues the batch, which is the state of a flush not
//! yet made, so the model's flushes are simply optional and the drain is "a plan waits until the
//! batch is committed". The artifact is published (once) at the moment the fold first needs it —
//! expired and drained: an artifact published earlier is one of these too, since a later publish
//! allows a superset of contents.
//!
//! Axioms (what the environment never does):
//! - Retention that does not evict current values removes only superseded messages (a current
//!   value or delete marker stays: axiom 6, no purge of markers).
//! - A fold reads retention while eviction is in force: after an evicting advance, retention is
//!   not switched back before the fold's next read (its start, its plan, or the watch's retention
//!   tick with the floor guard's probe).
//! - The re-list window: retention removes no current value from a state-sync re-list's first
//!   event until it is level (the floor guard has no frontier there; what is evicted before the
//!   first event, the re-check finds). A key-listing repair's own window, from its plan to its
//!   listing, needs no axiom: retention is read again after the listing
//!   (`RelistListingNotRechecked` is the mutation without that read).
//! - An artifact is complete together with the log after its cursor (it may have been exported
//!   mid catch-up): a key not written after the cursor holds exactly its value at the cursor; a key
//!   written after it may be absent or hold any earlier value of that key.
//!
//! Properties (always): the durable cursor is monotone; no key moves backward (a value is never
//! replaced by an older one); no phantom delete (every delete the fold applies removes a value a
//! real delete superseded); a level fold (watching, everything delivered and committed) is the
//! truth — every write minus every real delete. Sometimes: a repair completes and the fold
//! converges. A known gap, pinned: a restore can bring back, older, a key the fold had deleted
//! (`no_deleted_key_comes_back_older_is_violated_by_a_mid_catch_up_artifact`).
//!
//! Mutations (each must produce a counterexample):
//! - `NoEvictionMemo` — the memo is never consulted (`seen_evicting` forged `false`);
//! - `RelistOnEvictingBucket` — the listing is forged to be the truth (`Some(true)`);
//! - `RestoreKeyBackward` — `restore_key`'s `local` is forged to 0, so an older artifact entry
//!   overwrites a newer local one;
//! - `PhantomDelete` — `restore_key`'s `listed_live` is forged `false`;
//! - `CursorBeforeLastChunk` — the artifact's cursor is committed before the last chunk is applied
//!   (a crash in between resumes past it);
//! - `RestoreNotAhead` — `restore_allowed` is skipped;
//! - `RelistNotVouched` — `relist_still_vouched` is forged `true` (a state-sync re-list keeps
//!   trusting a listing that eviction overtook before its first event);
//! - `RelistListingNotRechecked` — a key-listing repair deletes what its listing lacks without
//!   reading retention again after it (eviction begun since the plan deletes an aged-out key).

use super::log::{self, Op};
use stateright::{Checker, HasDiscoveries, Model, Property};

use crate::protocol::{self, RepairMode, Retention};

mod steps;

/// Keys in the bucket.
const KEYS: u8 = 2;
/// Puts and deletes the log takes.
const MAX_OPS: usize = 4;
/// Updates a batch holds (`--batch-max`).
const MAX_BATCH: usize = 1;
/// Crashes (or operator restarts) a run may have.
const MAX_CRASHES: u8 = 2;
/// Times retention may be switched to evicting current values or back.
const MAX_RETENTION_EDITS: u8 = 2;
/// `--repair auto`, with a restore source configured.
const MODE: RepairMode = RepairMode::Auto;

const MONOTONE: &str = "the cursor is monotone";
const NOT_BACKWARD: &str = "no key moves backward";
const NO_PHANTOM: &str = "no phantom delete";
const LEVEL_IS_TRUTH: &str = "a level fold is the truth";
const NOT_RESURRECTED: &str = "no deleted key comes back older";
const CONVERGES: &str = "a repair completes and the fold converges";

/// One decision forged, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mutation {
    None,
    NoEvictionMemo,
    RelistOnEvictingBucket,
    RestoreKeyBackward,
    PhantomDelete,
    CursorBeforeLastChunk,
    RestoreNotAhead,
    RelistNotVouched,
    RelistListingNotRechecked,
}

/// The bucket's log.
type Log = log::Log<MAX_OPS>;

/// A published artifact: its cursor and each key's revision in it.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Artifact {
    cursor: u8,
    entries: [Option<u8>; KEYS as usize],
}

/// One chunk of a repair's difference.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Change {
    /// Take the artifact's entry (key, revision).
    Take(u8, u8),
    /// Delete the key.
    Delete(u8),
}

/// What a repair's last step does.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Finish {
    /// Keep the cursor; start a state-sync re-list.
    Relist,
    /// Commit the artifact's cursor.
    Restore(u8),
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Phase {
    /// Not started yet.
    Starting,
    /// A watch: `recv` is the last revision it passed, `queue` a state-sync re-list's initial
    /// values still to deliver, `vouch` a state-sync re-list's check still to make at its first
    /// event (the backlog report every watch sends first, even with nothing to deliver).
    Watching {
        recv: u8,
        queue: Vec<u8>,
        vouch: bool,
    },
    /// The watch ended with `CursorExpired` (or a cursor-less start must repair): drain, then plan.
    Expired,
    /// A key-listing repair is planned.
    RelistDiff,
    /// A restore from this artifact is planned.
    RestoreDiff(Artifact),
    /// The difference, applied one chunk at a time under the old cursor.
    Applying {
        pending: Vec<Change>,
        finish: Finish,
        cursor_moved: bool,
    },
    /// The fold stopped (a refused repair); a restart runs it again.
    Stopped,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    /// The bucket's log.
    log: Log,
    /// The first retained revision.
    first: u8,
    /// Retention evicts current values.
    evicting: bool,
    /// The published artifact.
    artifact: Option<Artifact>,
    /// The durable fold: each key's revision.
    applied: [Option<u8>; KEYS as usize],
    /// The durable cursor.
    cursor: Option<u8>,
    /// The durable eviction memo.
    memo: bool,
    phase: Phase,
    /// Delivered, not yet committed (in memory).
    batch: Vec<u8>,
    crashes: u8,
    edits: u8,
    /// Axiom bookkeeping: an evicting advance the fold has not read retention since.
    unread_eviction: bool,
    /// What the properties look at.
    cursor_regressed: bool,
    moved_backward: bool,
    phantom_delete: bool,
    resurrected: bool,
    repaired: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Action {
    Write { key: u8, put: bool },
    Evict,
    SetEvicting(bool),
    Publish(Artifact),
    Start,
    FirstEvent,
    Deliver,
    Flush,
    ReadRetention,
    Plan,
    Diff,
    ApplyChunk,
    CommitCursorEarly,
    Finish,
    Crash,
}

/// The latest message of `key` among the first `upto`: its revision and whether it is a put.
fn latest(log: &[Op], upto: usize, key: u8) -> Option<(u8, bool)> {
    log[..upto]
        .iter()
        .enumerate()
        .rev()
        .find(|(_, o)| o.key == key)
        .map(|(i, o)| (i as u8 + 1, o.put))
}

/// The truth after the first `upto` messages: the key's latest put, unless deleted since.
fn truth_at(log: &[Op], upto: usize, key: u8) -> Option<u8> {
    latest(log, upto, key).and_then(|(rev, put)| put.then_some(rev))
}

/// Whether revision `rev` was superseded by a later message of its key.
fn superseded(log: &[Op], rev: u8) -> bool {
    let key = log[rev as usize - 1].key;
    log[rev as usize..].iter().any(|o| o.key == key)
}

impl State {
    fn len(&self) -> u8 {
        self.log.len() as u8
    }

    fn retention(&self) -> Retention {
        Retention {
            evicts_current_values: self.evicting,
            first_revision: u64::from(self.first),
        }
    }

    /// The bucket's live listing has `key`: its latest message is a retained put.
    fn listed(&self, key: u8) -> bool {
        matches!(latest(&self.log, self.log.len(), key), Some((rev, true)) if rev >= self.first)
    }

    /// Every write minus every real delete.
    fn truth(&self) -> [Option<u8>; KEYS as usize] {
        [0, 1].map(|k| truth_at(&self.log, self.log.len(), k))
    }

    /// Watching, everything in the log delivered and committed.
    fn level(&self) -> bool {
        self.batch.is_empty()
            && matches!(&self.phase, Phase::Watching { recv, queue, vouch } if !vouch && queue.is_empty() && *recv == self.len())
    }

    /// A state-sync re-list's initial values: each key's latest retained message, in log order.
    fn state_sync(&self) -> Vec<u8> {
        let mut q: Vec<u8> = (0..KEYS)
            .filter_map(|k| latest(&self.log, self.log.len(), k).map(|(rev, _)| rev))
            .filter(|rev| *rev >= self.first)
            .collect();
        q.sort_unstable();
        q
    }

    /// From a state-sync re-list's first event until it is level (the floor guard has no
    /// frontier there), and with `whole` also from a key-listing repair's plan until its listing.
    fn in_relist_window(&self, whole: bool) -> bool {
        match &self.phase {
            Phase::RelistDiff => whole,
            Phase::Watching { queue, vouch, .. } => !vouch && !queue.is_empty(),
            _ => false,
        }
    }

    fn put(&mut self, key: u8, rev: u8) {
        match self.applied[key as usize] {
            Some(l) if l > rev => self.moved_backward = true,
            // Absent here, though the fold has passed a delete of the key newer than `rev`.
            None if self.log[rev as usize..]
                .iter()
                .enumerate()
                .any(|(i, o)| o.key == key && !o.put && Some(rev + 1 + i as u8) <= self.cursor) =>
            {
                self.resurrected = true
            }
            _ => {}
        }
        self.applied[key as usize] = Some(rev);
    }

    fn delete(&mut self, key: u8) {
        if let Some(l) = self.applied[key as usize] {
            let real = self.log[l as usize..]
                .iter()
                .any(|o| o.key == key && !o.put);
            if !real {
                self.phantom_delete = true;
            }
        }
        self.applied[key as usize] = None;
    }

    fn apply_message(&mut self, rev: u8) {
        let op = self.log[rev as usize - 1];
        if op.put {
            self.put(op.key, rev);
        } else {
            self.delete(op.key);
        }
    }

    fn move_cursor(&mut self, to: Option<u8>) {
        if to < self.cursor {
            self.cursor_regressed = true;
        }
        self.cursor = to;
    }

    /// Production's `note_retention`: the memo is committed the first time a read of retention
    /// shows it has evicted.
    fn note_retention(&mut self) {
        if protocol::retention_has_evicted(self.retention()) && !self.memo {
            self.memo = true;
        }
        self.unread_eviction = false;
    }
}

struct RepairModel {
    mutation: Mutation,
    /// The re-list window's axiom also over a key-listing repair's diff (`false`: only over its
    /// state-sync re-list).
    whole_relist_window: bool,
}

impl RepairModel {
    /// The eviction memo, as the fold consults it.
    fn seen_evicting(&self, s: &State) -> bool {
        s.memo && self.mutation != Mutation::NoEvictionMemo
    }

    /// Whether the listing is the truth, as the fold decides it (the memo consulted).
    fn listing_truth(&self, s: &State) -> Option<bool> {
        match self.mutation {
            Mutation::RelistOnEvictingBucket => Some(true),
            _ => protocol::listing_truth(Some(s.retention()), self.seen_evicting(s)),
        }
    }

    /// The artifacts another node may publish now: at any cursor, every key not written after it
    /// exact, every other key absent or at any of its earlier values.
    fn artifacts(s: &State, actions: &mut Vec<Action>) {
        for cursor in 1..=s.len() {
            let upto = cursor as usize;
            let options = |key: u8| -> Vec<Option<u8>> {
                let mut o = vec![truth_at(&s.log, upto, key)];
                if s.log[upto..].iter().any(|op| op.key == key) {
                    o.push(None);
                    for (i, op) in s.log[..upto].iter().enumerate() {
                        if op.key == key && op.put {
                            o.push(Some(i as u8 + 1));
                        }
                    }
                }
                o.sort_unstable();
                o.dedup();
                o
            };
            for a in options(0) {
                for b in options(1) {
                    actions.push(Action::Publish(Artifact {
                        cursor,
                        entries: [a, b],
                    }));
                }
            }
        }
    }
}

impl Model for RepairModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            log: Log::default(),
            first: 1,
            evicting: false,
            artifact: None,
            applied: [None; KEYS as usize],
            cursor: None,
            memo: false,
            phase: Phase::Starting,
            batch: Vec::new(),
            crashes: 0,
            edits: 0,
            unread_eviction: false,
            cursor_regressed: false,
            moved_backward: false,
            phantom_delete: false,
            resurrected: false,
            repaired: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        // The environment.
        if s.log.len() < MAX_OPS {
            for key in 0..KEYS {
                actions.push(Action::Write { key, put: true });
                if s.truth()[key as usize].is_some() {
                    actions.push(Action::Write { key, put: false });
                }
            }
        }
        if s.first <= s.len()
            && (superseded(&s.log, s.first)
                || (s.evicting && !s.in_relist_window(self.whole_relist_window)))
        {
            actions.push(Action::Evict);
        }
        if s.edits < MAX_RETENTION_EDITS && (!s.evicting || !s.unread_eviction) {
            actions.push(Action::SetEvicting(!s.evicting));
        }
        let settled = s.batch.is_empty();
        if s.artifact.is_none() && s.phase == Phase::Expired && settled {
            Self::artifacts(s, actions);
        }
        // The fold.
        if s.crashes < MAX_CRASHES && s.phase != Phase::Starting {
            actions.push(Action::Crash);
        }
        match &s.phase {
            Phase::Starting => actions.push(Action::Start),
            Phase::Watching { vouch: true, .. } => actions.push(Action::FirstEvent),
            Phase::Watching { recv, queue, .. } => {
                if s.batch.len() < MAX_BATCH && (!queue.is_empty() || *recv < s.len()) {
                    actions.push(Action::Deliver);
                }
                if settled && s.unread_eviction {
                    actions.push(Action::ReadRetention);
                }
            }
            Phase::Expired if settled => actions.push(Action::Plan),
            Phase::RelistDiff | Phase::RestoreDiff(_) => actions.push(Action::Diff),
            Phase::Applying {
                pending,
                finish,
                cursor_moved,
            } => {
                if pending.is_empty() {
                    actions.push(Action::Finish);
                } else {
                    actions.push(Action::ApplyChunk);
                }
                if self.mutation == Mutation::CursorBeforeLastChunk
                    && matches!(finish, Finish::Restore(_))
                    && pending.len() == 1
                    && !cursor_moved
                {
                    actions.push(Action::CommitCursorEarly);
                }
            }
            Phase::Expired | Phase::Stopped => {}
        }
        if !settled && matches!(s.phase, Phase::Watching { .. } | Phase::Expired) {
            actions.push(Action::Flush);
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        match action {
            Action::Write { key, put } => n.log.push(Op { key, put }),
            Action::Evict => Self::evict(&mut n),
            Action::SetEvicting(on) => Self::set_evicting(&mut n, on),
            Action::Publish(a) => n.artifact = Some(a),
            Action::Crash => self.crash(&mut n),
            Action::Start => self.start(&mut n),
            Action::FirstEvent => self.first_event(&mut n),
            Action::Deliver => Self::deliver(&mut n)?,
            Action::Flush => Self::flush(&mut n),
            Action::ReadRetention => Self::read_retention(&mut n),
            Action::Plan => self.plan(&mut n),
            Action::Diff => self.diff(&mut n)?,
            Action::ApplyChunk => Self::apply_chunk(&mut n)?,
            Action::CommitCursorEarly => Self::commit_cursor_early(&mut n)?,
            Action::Finish => self.finish(&mut n)?,
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(MONOTONE, |_, s: &State| !s.cursor_regressed),
            Property::always(NOT_BACKWARD, |_, s: &State| !s.moved_backward),
            Property::always(NO_PHANTOM, |_, s: &State| !s.phantom_delete),
            Property::always(LEVEL_IS_TRUTH, |_, s: &State| {
                !s.level() || s.applied == s.truth()
            }),
            Property::always(NOT_RESURRECTED, |_, s: &State| !s.resurrected),
            Property::sometimes(CONVERGES, |_, s: &State| {
                s.repaired && s.level() && s.applied == s.truth()
            }),
        ]
    }
}

/// Explores every state.
fn check(mutation: Mutation) -> impl Checker<RepairModel> {
    RepairModel {
        mutation,
        whole_relist_window: false,
    }
    .checker()
    .spawn_bfs()
    .join()
}

/// Explores until `property` has a discovery. Depth first, which finds one in a fraction of the
/// states; `spawn_bfs` instead gives a shortest counterexample, to read one.
fn find(mutation: Mutation, property: &'static str) -> impl Checker<RepairModel> {
    let model = RepairModel {
        mutation,
        whole_relist_window: false,
    };
    find_all(model, &[property])
}

/// Explores `model` until each of `properties` has a discovery.
fn find_all(model: RepairModel, properties: &[&'static str]) -> impl Checker<RepairModel> + use<> {
    model
        .checker()
        .finish_when(HasDiscoveries::AllOf(properties.iter().copied().collect()))
        .spawn_dfs()
        .join()
}

#[test]
fn a_level_fold_is_the_truth_and_no_repair_regresses_moves_backward_or_deletes_a_live_key() {
    let c = check(Mutation::None);
    for property in [
        MONOTONE,
        NOT_BACKWARD,
        NO_PHANTOM,
        LEVEL_IS_TRUTH,
        NOT_RESURRECTED,
    ] {
        c.assert_no_discovery(property);
    }
    assert!(
        c.discovery(CONVERGES).is_some(),
        "the model can repair and converge"
    );
    assert!(
        c.unique_state_count() > 100_000,
        "{} states",
        c.unique_state_count()
    );
}

#[test]
fn each_mutation_of_the_repair_has_a_counterexample() {
    let table = [
        (Mutation::NoEvictionMemo, NO_PHANTOM),
        (Mutation::RelistOnEvictingBucket, NO_PHANTOM),
        (Mutation::RestoreKeyBackward, NOT_BACKWARD),
        (Mutation::PhantomDelete, NO_PHANTOM),
        (Mutation::CursorBeforeLastChunk, LEVEL_IS_TRUTH),
        (Mutation::RestoreNotAhead, MONOTONE),
        (Mutation::RelistNotVouched, LEVEL_IS_TRUTH),
        (Mutation::RelistListingNotRechecked, NO_PHANTOM),
    ];
    // The checks are independent: one thread each.
    std::thread::scope(|scope| {
        for (mutation, property) in table {
            scope.spawn(move || {
                let c = find(mutation, property);
                let path = c.discovery(property).unwrap_or_else(|| {
                    panic!("{mutation:?} found no counterexample to {property:?}")
                });
                let steps: Vec<Action> = path.into_actions();
                assert!(!steps.is_empty(), "{mutation:?}");
            });
        }
    });
}
