//! The live floor guard (docs/design.md, "Cursor-expiry repair"), for a whole-bucket watch and for
//! a prefix watch.
//!
//! A log of [`LOG`] writes — `p/x` put, `q/x` put, `p/y` put, `p/x` deleted, `q/x` put; `p/` is
//! the prefix scope — is written while a watch folds it. Retention removes a superseded message
//! anywhere (a history limit) and, on a bucket whose retention evicts current values, the oldest
//! message whatever it is. The watch delivers the next retained message in its scope after its
//! position, in order, and skips removed ones silently, as NATS does. The guard (as
//! `nats/floor.rs` runs it):
//! - in-band: a delivery past `frontier + 1` is checked before it is passed on;
//! - backstop: a probe at any time (no delivery for a period);
//! - quiet watermark (prefix scope): after a passing probe, three reads — the stream's last
//!   sequence, no in-scope message retained after the frontier, the first sequence still inside
//!   [`protocol::resume_window_ok`] — move the frontier over out-of-scope messages; writes and
//!   evictions interleave between the reads.
//!
//! Each check is [`protocol::floor_guard_trips`] against the live first sequence. A trip ends the
//! watch with `CursorExpired`; the repair is planned by [`protocol::plan_repair`] (`Auto`) on
//! [`protocol::listing_truth`]: the key-listing diff and a state-sync re-list (guarded from its
//! level), or a restore from an artifact — the truth at any revision, covering the whole bucket
//! ([`protocol::scope_covers`]) — gated by [`protocol::restore_allowed`], diffed key by key with
//! [`protocol::restore_key`], its cursor committed, and the watch resumed from it after
//! [`protocol::resume_window_ok`]. A refused restore stops the fold. A restart resumes from the
//! fold's cursor when [`protocol::resume_window_ok`] allows, and is `CursorExpired` otherwise (a
//! fold without a cursor asks [`protocol::cursorless_start_needs_repair`], else watches
//! state-sync).
//!
//! Properties:
//! - "a settled watch's fold is every write minus every real delete": when the watch is running,
//!   level (nothing in its scope retained after its position) and a backstop probe has passed
//!   since the last write, removal or delivery, the fold is the truth of its scope;
//! - "a repair never moves the fold backward": the cursor never decreases, and no key holds a value
//!   older than the newest update of it the fold has applied;
//! - sometimes "the whole log folded and settled"; sometimes "a guard trip repaired by a restore"
//!   (exactly where retention evicts) and "an expired cursor repaired by a re-list" (exactly where
//!   it keeps current values).
//!
//! Mutations (each must produce a counterexample, for both scopes, on an evicting bucket):
//! - `Unguarded` — the guard never trips (`floor_guard_trips` handed `evicts_current_values =
//!   false`): permanent silent divergence;
//! - `RelistOnEvictingBucket` — the listing is taken for the truth (`Some(true)` handed to
//!   `plan_repair`): the re-list deletes evicted-but-live keys, or misses them;
//! - `RestoreWithoutAllowed` — `restore_allowed` is not asked: a restore from an artifact behind
//!   the fold moves it backward;
//! - `PeriodicOnly` — no in-band check (the kernel is not called at a gap), only the backstop:
//!   deliveries catch the frontier up past the gap and erase the evidence.

use stateright::{Checker, Model, Property};

use crate::protocol::{self, KeyRestore, RepairMode, RepairPlan, Retention};

/// The keys: two in the prefix scope, one outside it.
const KEYS: [&str; K] = ["p/x", "p/y", "q/x"];
/// How many keys.
const K: usize = 3;
/// The prefix of the prefix scope.
const PREFIX: &str = "p/";
/// What every artifact covers (exported by a whole-bucket fold).
const ARTIFACT_SCOPE: &str = "";
/// The log: revision `r` is `SCRIPT[r - 1]`, a put (`true`) or a delete of `KEYS[.0]`.
const SCRIPT: [(usize, bool); 5] = [(0, true), (2, true), (1, true), (0, false), (2, true)];
/// Revisions in the log.
const LOG: u8 = SCRIPT.len() as u8;
/// Restarts a run may have (bounds the state space).
const MAX_RESTARTS: u8 = 1;

/// What the watch folds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scope {
    Whole,
    Prefix,
}

/// One decision forged, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mutation {
    None,
    Unguarded,
    RelistOnEvictingBucket,
    RestoreWithoutAllowed,
    PeriodicOnly,
}

/// A quiet watermark in progress (prefix scope), between its reads.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Mark {
    /// The stream's last sequence was read (`before`); next, the in-scope read after the frontier.
    Scan { before: u8 },
    /// No in-scope message after the frontier; next, the first sequence read again.
    Recheck { before: u8 },
}

/// The watch.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Watch {
    Running {
        /// The consumer's position: the last sequence it delivered.
        pos: u8,
        /// The guard's frontier.
        frontier: u8,
        /// A backstop probe passed since the last write, removal or delivery.
        probed: bool,
        mark: Option<Mark>,
    },
    /// Ended with `CursorExpired`: the repair is next.
    Expired,
    /// The fold stopped (no repair possible or a restore refused).
    Stopped,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    /// Revisions written.
    written: u8,
    /// Retained messages: bit `r` for revision `r`.
    retained: u8,
    watch: Watch,
    /// The fold: each key's value (the revision that wrote it), `None` when absent.
    fold: [Option<u8>; K],
    /// The fold's cursor.
    cursor: Option<u64>,
    /// The highest cursor before this step (observed, for the backward property).
    cursor_high: Option<u64>,
    /// Per key, the newest revision of it the fold has applied (observed).
    seen: [u8; K],
    /// The guard has tripped (observed, for the reachability property).
    tripped: bool,
    /// A restore has run (observed, for the reachability property).
    restored: bool,
    /// A key-listing repair has run (observed, for the reachability property).
    relisted: bool,
    /// A restore moved the fold to a cursor its resume cannot continue from (observed).
    restored_past_retention: bool,
    restarts: u8,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Action {
    /// The bucket takes its next write.
    Write,
    /// The history limit removes this superseded message.
    Supersede(u8),
    /// Retention evicts the oldest message (an evicting bucket only).
    Evict,
    /// The watch delivers its next message (checked first at a gap).
    Deliver,
    /// The backstop probe.
    Probe,
    /// The watermark's in-scope read.
    MarkScan,
    /// The watermark's second read of the first sequence.
    MarkRecheck,
    /// The key-listing diff and the state-sync re-list.
    Relist,
    /// A restore from the artifact at this revision.
    Restore(u8),
    /// No repair: the fold stops.
    Stop,
    /// The node restarts: the watch resumes from the fold's cursor.
    Restart,
}

/// Bit of revision `r`.
fn bit(r: u8) -> u8 {
    1 << r
}

/// The key revision `r` writes, and whether it is a put.
fn op(r: u8) -> (usize, bool) {
    SCRIPT[usize::from(r - 1)]
}

/// The stream's first retained sequence (`last + 1` for an empty log).
fn first_sequence(s: &State) -> u64 {
    (1..=s.written)
        .find(|r| s.retained & bit(*r) != 0)
        .map_or(u64::from(s.written) + 1, u64::from)
}

/// Every write minus every real delete of the first `written` revisions.
fn truth_at(written: u8) -> [Option<u8>; K] {
    let mut t = [None; K];
    for r in 1..=written {
        let (k, put) = op(r);
        t[k] = put.then_some(r);
    }
    t
}

/// Whether a later message of the same key was written after `r`.
fn superseded(s: &State, r: u8) -> bool {
    (r + 1..=s.written).any(|l| op(l).0 == op(r).0)
}

/// Whether the bucket's live listing has `key`: its last message is a retained put.
fn listed(s: &State, key: usize) -> bool {
    (1..=s.written)
        .rev()
        .find(|r| op(*r).0 == key)
        .is_some_and(|r| op(r).1 && s.retained & bit(r) != 0)
}

/// The fold has settled: running, level, a probe passed since the last change.
fn settled(m: &FloorModel, s: &State) -> bool {
    match s.watch {
        Watch::Running {
            pos,
            probed,
            mark: None,
            ..
        } => probed && m.next_delivery(s, pos).is_none(),
        _ => false,
    }
}

struct FloorModel {
    scope: Scope,
    /// Retention evicts current values.
    evicts: bool,
    mutation: Mutation,
}

impl FloorModel {
    /// The watch's prefix.
    fn prefix(&self) -> &'static str {
        match self.scope {
            Scope::Whole => "",
            Scope::Prefix => PREFIX,
        }
    }

    fn in_scope(&self, key: usize) -> bool {
        KEYS[key].starts_with(self.prefix())
    }

    /// The truth of the watch's scope after `written` revisions.
    fn truth(&self, written: u8) -> [Option<u8>; K] {
        let t = truth_at(written);
        std::array::from_fn(|k| t[k].filter(|_| self.in_scope(k)))
    }

    /// The next retained in-scope message after `pos`.
    fn next_delivery(&self, s: &State, pos: u8) -> Option<u8> {
        (pos + 1..=s.written).find(|r| s.retained & bit(*r) != 0 && self.in_scope(op(*r).0))
    }

    /// The guard's check, as `check_floor` makes it.
    fn trips(&self, s: &State, frontier: u8) -> bool {
        let evicts = self.evicts && self.mutation != Mutation::Unguarded;
        protocol::floor_guard_trips(evicts, u64::from(frontier), first_sequence(s))
    }

    fn retention(&self, s: &State) -> Retention {
        Retention {
            evicts_current_values: self.evicts,
            first_revision: first_sequence(s),
        }
    }

    /// The repair `watch_applied` plans for an expired cursor.
    fn plan(&self, s: &State) -> RepairPlan {
        let listing = if self.mutation == Mutation::RelistOnEvictingBucket {
            Some(true)
        } else {
            protocol::listing_truth(Some(self.retention(s)), false)
        };
        protocol::plan_repair(RepairMode::Auto, listing)
    }

    /// Folds revision `r`.
    fn apply(n: &mut State, r: u8) {
        let (k, put) = op(r);
        n.fold[k] = put.then_some(r);
        n.seen[k] = n.seen[k].max(r);
        n.cursor = protocol::commit_cursor(n.cursor, Some(u64::from(r)));
    }

    /// The key-listing diff, then the state-sync re-list, guarded from its level.
    fn relist(&self, n: &mut State) {
        for k in (0..KEYS.len()).filter(|k| self.in_scope(*k)) {
            if n.fold[k].is_some() && !listed(n, k) {
                n.fold[k] = None;
                n.cursor = protocol::commit_cursor(n.cursor, None);
            }
        }
        let mut level = None;
        for r in 1..=n.written {
            let (k, _) = op(r);
            let last = !superseded(n, r);
            if last && n.retained & bit(r) != 0 && self.in_scope(k) {
                Self::apply(n, r);
                level = Some(r);
            }
        }
        // Nothing pending: guarded from the stream's last sequence.
        let f = level.unwrap_or(n.written);
        n.watch = Watch::Running {
            pos: f,
            frontier: f,
            probed: false,
            mark: None,
        };
    }

    /// A start: a delta watch from the fold's cursor when it is inside retention, `CursorExpired`
    /// otherwise; a fold without a cursor repairs first when it must, else watches state-sync.
    fn start(&self, n: &mut State) {
        let first = first_sequence(n);
        n.watch = match n.cursor {
            Some(c) if protocol::resume_window_ok(c, first) => {
                let c = u8::try_from(c).unwrap_or(u8::MAX);
                Watch::Running {
                    pos: c,
                    frontier: c,
                    probed: false,
                    mark: None,
                }
            }
            Some(_) => Watch::Expired,
            None => {
                let listing = protocol::listing_truth(Some(self.retention(n)), false);
                let has_data = n.fold.iter().any(Option::is_some);
                if protocol::cursorless_start_needs_repair(RepairMode::Auto, has_data, listing) {
                    Watch::Expired
                } else {
                    self.relist(n);
                    return;
                }
            }
        };
    }

    /// A restore from the artifact at `a` (the truth at `a`), then the resume from its cursor.
    fn restore(&self, n: &mut State, a: u8) {
        let first = first_sequence(n);
        let covers = protocol::scope_covers(&[ARTIFACT_SCOPE], &[self.prefix()]);
        let allowed = self.mutation == Mutation::RestoreWithoutAllowed
            || protocol::restore_allowed(u64::from(a), n.cursor, first);
        if !covers || !allowed {
            n.watch = Watch::Stopped;
            return;
        }
        let artifact = truth_at(a);
        for k in (0..KEYS.len()).filter(|k| self.in_scope(*k)) {
            let local = n.fold[k];
            let identical = local.is_some() && local == artifact[k];
            match protocol::restore_key(
                local.map(u64::from),
                artifact[k].map(u64::from),
                identical,
                listed(n, k),
                n.cursor,
            ) {
                KeyRestore::Keep => {}
                KeyRestore::Take => {
                    n.fold[k] = artifact[k];
                    n.seen[k] = n.seen[k].max(artifact[k].unwrap_or(0));
                }
                KeyRestore::Delete => n.fold[k] = None,
            }
        }
        n.cursor = Some(u64::from(a));
        n.restored = true;
        n.restored_past_retention |= !protocol::resume_window_ok(u64::from(a), first);
        n.watch = if protocol::resume_window_ok(u64::from(a), first) {
            Watch::Running {
                pos: a,
                frontier: a,
                probed: false,
                mark: None,
            }
        } else {
            Watch::Expired
        };
    }

    /// The next write: revision `written + 1`, retained.
    fn write(n: &mut State) {
        n.written += 1;
        n.retained |= bit(n.written);
    }

    /// Retention removes the oldest retained message, whatever it is.
    fn evict(n: &mut State) -> Option<()> {
        let first = (1..=n.written).find(|r| n.retained & bit(*r) != 0)?;
        n.retained &= !bit(first);
        Some(())
    }

    /// The watch delivers its next retained in-scope message.
    fn deliver(&self, n: &mut State) -> Option<()> {
        let Watch::Running { pos, frontier, .. } = n.watch else {
            return None;
        };
        let r = self.next_delivery(n, pos)?;
        // In-band: a gap is checked before the message is passed on.
        let in_band = self.mutation != Mutation::PeriodicOnly;
        if in_band && r > frontier + 1 && self.trips(n, frontier) {
            n.tripped = true;
            n.watch = Watch::Expired;
            return Some(());
        }
        Self::apply(n, r);
        n.watch = Watch::Running {
            pos: r,
            frontier: frontier.max(r),
            probed: false,
            mark: None,
        };
        Some(())
    }

    /// The backstop's probe; a passing one starts a prefix watch's quiet watermark.
    fn probe(&self, n: &mut State) -> Option<()> {
        let Watch::Running { pos, frontier, .. } = n.watch else {
            return None;
        };
        if self.trips(n, frontier) {
            n.tripped = true;
            n.watch = Watch::Expired;
            return Some(());
        }
        // The same stream-info read gives the last sequence a prefix watch's watermark starts
        // from.
        let before = n.written;
        let mark =
            (self.scope == Scope::Prefix && before > frontier).then_some(Mark::Scan { before });
        n.watch = Watch::Running {
            pos,
            frontier,
            probed: true,
            mark,
        };
        Some(())
    }

    /// The watermark's second read: no in-scope message retained after the frontier.
    fn mark_scan(&self, n: &mut State) -> Option<()> {
        let Watch::Running {
            pos,
            frontier,
            probed,
            mark: Some(Mark::Scan { before }),
        } = n.watch
        else {
            return None;
        };
        let found = self.next_delivery(n, frontier).is_some();
        n.watch = Watch::Running {
            pos,
            frontier,
            probed,
            mark: (!found).then_some(Mark::Recheck { before }),
        };
        Some(())
    }

    /// The watermark's third read: the frontier moves over out-of-scope messages when the first
    /// sequence is still inside [`protocol::resume_window_ok`].
    fn mark_recheck(n: &mut State) -> Option<()> {
        let Watch::Running {
            pos,
            frontier,
            probed,
            mark: Some(Mark::Recheck { before }),
        } = n.watch
        else {
            return None;
        };
        let moved = protocol::resume_window_ok(u64::from(frontier), first_sequence(n));
        n.watch = Watch::Running {
            pos,
            frontier: if moved {
                frontier.max(before)
            } else {
                frontier
            },
            probed,
            mark: None,
        };
        Some(())
    }
}

impl Model for FloorModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            written: 0,
            retained: 0,
            watch: Watch::Running {
                pos: 0,
                frontier: 0,
                probed: false,
                mark: None,
            },
            fold: [None; K],
            cursor: None,
            cursor_high: None,
            seen: [0; K],
            tripped: false,
            restored: false,
            relisted: false,
            restored_past_retention: false,
            restarts: 0,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.watch == Watch::Stopped {
            return;
        }
        if s.written < LOG {
            actions.push(Action::Write);
        }
        for r in 1..=s.written {
            if s.retained & bit(r) != 0 && superseded(s, r) {
                actions.push(Action::Supersede(r));
            }
        }
        if self.evicts && s.retained != 0 {
            actions.push(Action::Evict);
        }
        match s.watch {
            Watch::Running { pos, mark, .. } => match mark {
                None => {
                    if self.next_delivery(s, pos).is_some() {
                        actions.push(Action::Deliver);
                    }
                    actions.push(Action::Probe);
                }
                Some(Mark::Scan { .. }) => actions.push(Action::MarkScan),
                Some(Mark::Recheck { .. }) => actions.push(Action::MarkRecheck),
            },
            Watch::Expired => match self.plan(s) {
                RepairPlan::Relist => actions.push(Action::Relist),
                RepairPlan::Restore => {
                    for a in 0..=s.written {
                        actions.push(Action::Restore(a));
                    }
                }
                RepairPlan::None | RepairPlan::RefuseRelist => actions.push(Action::Stop),
            },
            Watch::Stopped => {}
        }
        if s.restarts < MAX_RESTARTS {
            actions.push(Action::Restart);
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        n.cursor_high = s.cursor_high.max(s.cursor);
        let changed = matches!(
            action,
            Action::Write | Action::Supersede(_) | Action::Evict | Action::Deliver
        );
        if let (
            true,
            Watch::Running {
                pos,
                frontier,
                mark,
                ..
            },
        ) = (changed, n.watch)
        {
            n.watch = Watch::Running {
                pos,
                frontier,
                probed: false,
                mark,
            };
        }
        match action {
            Action::Write => Self::write(&mut n),
            Action::Supersede(r) => n.retained &= !bit(r),
            Action::Evict => Self::evict(&mut n)?,
            Action::Deliver => self.deliver(&mut n)?,
            Action::Probe => self.probe(&mut n)?,
            Action::MarkScan => self.mark_scan(&mut n)?,
            Action::MarkRecheck => Self::mark_recheck(&mut n)?,
            Action::Relist => {
                n.relisted = true;
                self.relist(&mut n);
            }
            Action::Restore(a) => self.restore(&mut n, a),
            Action::Stop => n.watch = Watch::Stopped,
            Action::Restart => {
                n.restarts += 1;
                self.start(&mut n);
            }
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "a settled watch's fold is every write minus every real delete",
                |m: &FloorModel, s: &State| !settled(m, s) || s.fold == m.truth(s.written),
            ),
            Property::always(
                "a restore lands where its resume is gap-free",
                |_, s: &State| !s.restored_past_retention,
            ),
            Property::always("a repair never moves the fold backward", |_, s: &State| {
                s.cursor >= s.cursor_high
                    && s.fold
                        .iter()
                        .zip(s.seen)
                        .all(|(v, seen)| v.is_none_or(|r| r >= seen))
            }),
            Property::sometimes("the whole log folded and settled", |m, s: &State| {
                settled(m, s) && s.written == LOG
            }),
            Property::sometimes("a guard trip repaired by a restore", |m, s: &State| {
                settled(m, s) && s.tripped && s.restored
            }),
            Property::sometimes("an expired cursor repaired by a re-list", |m, s: &State| {
                settled(m, s) && s.relisted
            }),
        ]
    }
}

fn check(scope: Scope, evicts: bool, mutation: Mutation) -> impl Checker<FloorModel> {
    FloorModel {
        scope,
        evicts,
        mutation,
    }
    .checker()
    .spawn_bfs()
    .join()
}

#[test]
fn a_settled_watchs_fold_is_every_write_minus_every_real_delete_in_both_scopes() {
    for scope in [Scope::Whole, Scope::Prefix] {
        for evicts in [true, false] {
            let c = check(scope, evicts, Mutation::None);
            c.assert_no_discovery("a settled watch's fold is every write minus every real delete");
            c.assert_no_discovery("a repair never moves the fold backward");
            c.assert_no_discovery("a restore lands where its resume is gap-free");
            assert!(
                c.discovery("the whole log folded and settled").is_some(),
                "{scope:?} evicts={evicts}: the whole log can be folded"
            );
            assert_eq!(
                c.discovery("a guard trip repaired by a restore").is_some(),
                evicts,
                "{scope:?} evicts={evicts}: the guard trips exactly where retention evicts"
            );
            assert_eq!(
                c.discovery("an expired cursor repaired by a re-list")
                    .is_some(),
                !evicts,
                "{scope:?} evicts={evicts}: a re-list repairs exactly where retention keeps values"
            );
            assert!(
                c.unique_state_count() > 100,
                "{scope:?} evicts={evicts}: {} states",
                c.unique_state_count()
            );
        }
    }
}

#[test]
fn each_mutation_of_the_floor_guard_and_its_repair_has_a_counterexample() {
    for scope in [Scope::Whole, Scope::Prefix] {
        for (mutation, property) in [
            (
                Mutation::Unguarded,
                "a settled watch's fold is every write minus every real delete",
            ),
            (
                Mutation::RelistOnEvictingBucket,
                "a settled watch's fold is every write minus every real delete",
            ),
            (
                Mutation::RestoreWithoutAllowed,
                "a repair never moves the fold backward",
            ),
            (
                Mutation::PeriodicOnly,
                "a settled watch's fold is every write minus every real delete",
            ),
        ] {
            let c = check(scope, true, mutation);
            let path = c
                .discovery(property)
                .unwrap_or_else(|| panic!("{scope:?} {mutation:?} found no counterexample"));
            let steps: Vec<Action> = path.into_actions();
            assert!(!steps.is_empty(), "{scope:?} {mutation:?}");
        }
    }
}
