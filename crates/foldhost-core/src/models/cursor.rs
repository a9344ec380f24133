//! Cursor authority across delivery, flush, transient store failure and crash/restart.
//!
//! A log of [`LOG`] revisions is delivered in order into an open batch; a flush commits the batch
//! (its updates and the cursor [`protocol::commit_cursor`] gives, together) or fails transiently
//! (the batch is re-queued, and [`protocol::store_failures_fatal`] decides when the fold stops); a
//! crash loses everything in memory and the fold resumes after the durable cursor. The property:
//! the durable cursor never covers a revision the durable store has not applied, and the whole log
//! can be applied.
//!
//! Mutations (each must produce a counterexample):
//! - `DropFailedBatch` — a failed batch is dropped instead of re-queued;
//! - `ResumeFromMemory` — a restart resumes after what was *received*, not after the durable cursor;
//! - `AdvanceOnReceipt` — the cursor is committed when an update is received, before it is applied
//!   (`commit_cursor` handed the received revision).

use stateright::{Checker, Model, Property};

use crate::protocol;

/// Revisions in the log.
const LOG: u64 = 4;
/// Crashes a run may have (bounds the state space).
const MAX_CRASHES: u8 = 2;

/// One decision forged, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mutation {
    None,
    DropFailedBatch,
    ResumeFromMemory,
    AdvanceOnReceipt,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    /// The highest revision received (in memory).
    received: u64,
    /// The open batch (in memory).
    batch: Vec<u64>,
    /// The durable cursor.
    cursor: Option<u64>,
    /// The durable store: which revisions were applied (bit `r`).
    applied: u64,
    /// Consecutive failed flushes.
    failures: u32,
    crashes: u8,
    /// Fail-stopped (too many failed flushes).
    stopped: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Action {
    Deliver,
    FlushOk,
    FlushFail,
    Crash,
}

struct CursorModel {
    mutation: Mutation,
}

impl Model for CursorModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            received: 0,
            batch: Vec::new(),
            cursor: None,
            applied: 0,
            failures: 0,
            crashes: 0,
            stopped: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.stopped {
            return;
        }
        if s.received < LOG {
            actions.push(Action::Deliver);
        }
        if !s.batch.is_empty() {
            actions.push(Action::FlushOk);
            actions.push(Action::FlushFail);
        }
        if s.crashes < MAX_CRASHES {
            actions.push(Action::Crash);
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        match action {
            Action::Deliver => {
                n.received += 1;
                n.batch.push(n.received);
                if self.mutation == Mutation::AdvanceOnReceipt {
                    n.cursor = protocol::commit_cursor(n.cursor, Some(n.received));
                }
            }
            Action::FlushOk => {
                for r in &n.batch {
                    n.applied |= 1 << r;
                }
                n.cursor = protocol::commit_cursor(n.cursor, n.batch.iter().copied().max());
                n.batch.clear();
                n.failures = 0;
            }
            Action::FlushFail => {
                n.failures += 1;
                if self.mutation == Mutation::DropFailedBatch {
                    n.batch.clear();
                }
                n.stopped = protocol::store_failures_fatal(n.failures);
            }
            Action::Crash => {
                n.crashes += 1;
                n.batch.clear();
                n.failures = 0;
                if self.mutation != Mutation::ResumeFromMemory {
                    n.received = n.cursor.unwrap_or(0);
                }
            }
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "the cursor never covers an unapplied revision",
                |_, s: &State| {
                    let through = s.cursor.unwrap_or(0);
                    (1..=through).all(|r| s.applied & (1 << r) != 0)
                },
            ),
            Property::sometimes("the whole log applied", |_, s: &State| {
                s.cursor == Some(LOG) && (1..=LOG).all(|r| s.applied & (1 << r) != 0)
            }),
        ]
    }
}

fn check(mutation: Mutation) -> impl Checker<CursorModel> {
    CursorModel { mutation }.checker().spawn_bfs().join()
}

#[test]
fn the_cursor_never_covers_an_unapplied_revision_through_failures_and_crashes() {
    let c = check(Mutation::None);
    c.assert_no_discovery("the cursor never covers an unapplied revision");
    assert!(
        c.discovery("the whole log applied").is_some(),
        "the model can apply the whole log"
    );
    assert!(
        c.unique_state_count() > 100,
        "{} states",
        c.unique_state_count()
    );
}

#[test]
fn each_mutation_of_cursor_authority_has_a_counterexample() {
    for mutation in [
        Mutation::DropFailedBatch,
        Mutation::ResumeFromMemory,
        Mutation::AdvanceOnReceipt,
    ] {
        let c = check(mutation);
        let path = c
            .discovery("the cursor never covers an unapplied revision")
            .unwrap_or_else(|| panic!("{mutation:?} found no counterexample"));
        let steps: Vec<Action> = path.into_actions();
        assert!(!steps.is_empty(), "{mutation:?}");
    }
}
