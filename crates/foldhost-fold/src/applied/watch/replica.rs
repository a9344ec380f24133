//! The fold loop's query instance (docs/design.md, "Queries off the fold's path"): a second
//! instance of the applier, hydrated beside the fold from a capture of its own
//! ([`CaptureSlot::Queries`]), then kept level in rounds — each round restarts the capture between
//! batches and hands the instance the keys changed since the last one (each once, its value at the
//! round's start, read through the instance's view) and the state buckets' batches committed
//! since. It answers [`Queries`] asks on a task of its own.
//!
//! Invariants:
//! - **Nothing reaches the fold's path but a round's start**: the capture restart (a swap of the
//!   recorded map) and, once per instance, the state buckets' current values handed to it when it
//!   first becomes level. Hydration, catch-up and queries run on their own tasks.
//! - **Whole states only**: the instance applies a round whole before it answers the next ask,
//!   and a round starts only with the fold settled (nothing applied and uncommitted), so an
//!   answer is always the committed fold at one round's start — what a fresh instance hydrated
//!   from the fold at that cursor would answer.
//! - **Never stale across a swap**: it is withdrawn before a swap's reply is sent, and a new one
//!   of the new version is built. It depends on the committed fold only, never on the running
//!   applier's instance, so a rebuild of that instance leaves it alone.
//! - **Never torn**: a capture that overflowed, or state-bucket batches dropped over their bound,
//!   drop it; the next one hydrates from the fold.
//! - A failed instance (a trap while hydrating, catching up or answering) is dropped, and the
//!   fold loop answers until the next one is level; rebuilds back off
//!   ([`protocol::Backoff::QUERY_INSTANCE`]), so a query that traps it cannot make the node
//!   rehydrate in a loop.
//! - `on-applied` never runs on it: the running applier's writes are made once.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{Notify, mpsc};

use crate::applied::lane::LaneFeed;
use crate::applied::queries::{ASK_QUEUE, Ask};
use crate::applied::{AppliedError, Apply, ApplyError, Queries, SwapCandidate};
use foldhost_core::kv::KvUpdate;
use foldhost_core::protocol;
use foldhost_core::snapshot::{SnapshotError, SnapshotStore};
use foldhost_core::view::{CaptureSlot, FoldRead, PreImages};

use super::swap::{Hydrated, store_err};
use super::{AbortOnDrop, FoldLoop, Turn};

/// A round: the keys changed since the last one, and the state buckets' batches committed since.
pub(super) struct Round {
    pre: PreImages,
    lanes: Vec<(String, Vec<KvUpdate>)>,
    /// The committed revision at the round's start: the instance is level with it once applied.
    revision: u64,
}

/// Restarts the instance's capture at the cursor now (moving its view there); the old capture.
type Restart = Box<dyn Fn() -> Result<Option<PreImages>, SnapshotError> + Send>;
/// Keys the instance's capture recorded and whether it overflowed (`None`: it is over).
type Recorded = Box<dyn Fn() -> Result<Option<(usize, bool)>, SnapshotError> + Send>;

/// The query instance as the loop keeps it.
pub(super) struct QueryInstance {
    phase: Phase,
    view: Arc<dyn FoldRead>,
    restart: Restart,
    recorded: Recorded,
    end: Box<dyn Fn() + Send>,
    /// The state buckets' batches since the instance's lanes were handed to it.
    pub(super) lanes: LaneFeed,
    queries: Queries,
    /// The epoch of [`Queries`] this instance belongs to.
    epoch: u64,
}

enum Phase {
    Hydrating(AbortOnDrop<(Box<dyn SwapCandidate>, Result<u64, ApplyError>)>),
    Serving {
        task: AbortOnDrop<ApplyError>,
        rounds: mpsc::Sender<Round>,
        wants: Arc<Notify>,
        /// The instance finished its last round and waits for the next.
        wanting: bool,
    },
}

impl Drop for QueryInstance {
    fn drop(&mut self) {
        self.queries.withdraw();
        (self.end)();
    }
}

/// What happened to the query instance.
pub(super) enum Event {
    Hydrated(Hydrated),
    Ended(Result<ApplyError, tokio::task::JoinError>),
    Wants,
}

/// The query instance's next event; pending while there is none.
pub(super) async fn next_event(q: &mut Option<QueryInstance>) -> Event {
    let Some(q) = q.as_mut() else {
        return std::future::pending().await;
    };
    match &mut q.phase {
        Phase::Hydrating(task) => Event::Hydrated((&mut task.0).await),
        Phase::Serving {
            task,
            wants,
            wanting,
            ..
        } => {
            if *wanting {
                Event::Ended((&mut task.0).await)
            } else {
                tokio::select! {
                    ended = &mut task.0 => Event::Ended(ended),
                    () = wants.notified() => Event::Wants,
                }
            }
        }
    }
}

/// Where the loop stands with its query instance across rebuilds.
#[derive(Debug, Default)]
pub(super) struct QueryInstanceLife {
    /// The applier offers none (a native one): never asked again.
    pub(super) unsupported: bool,
    /// Instances lost in a row (reset once one is level).
    pub(super) failures: u32,
    /// No rebuild before this.
    pub(super) not_before: Option<Instant>,
}

impl<S: SnapshotStore, A: Apply + ?Sized> FoldLoop<'_, S, A> {
    /// Starts a query instance when the fold has a query route, none runs, the applier offers
    /// one, and the backoff allows: settles, begins its capture, and hydrates it on a task.
    pub(super) async fn begin_query_instance(&mut self, t: &mut Turn) -> Result<(), AppliedError> {
        let Some(queries) = self.opts.queries.clone() else {
            return Ok(());
        };
        if self.query_instance.is_some()
            || self.query_life.unsupported
            || self
                .query_life
                .not_before
                .is_some_and(|t| Instant::now() < t)
        {
            return Ok(());
        }
        self.settle(t).await?;
        let store = self.fold.store().clone();
        let pinned = store
            .begin_capture_in(CaptureSlot::Queries)
            .map_err(store_err)?;
        let view: Arc<dyn FoldRead> = Arc::new(pinned.clone());
        let Some(mut candidate) = self.apply.query_instance(view.clone()) else {
            let _ = store.end_capture(&pinned);
            self.query_life.unsupported = true;
            return Ok(());
        };
        tracing::debug!(cursor = %self.fold.cursor(), "query instance: hydrating beside the fold");
        let task = tokio::spawn(tracing::Instrument::in_current_span(async move {
            let r = candidate.hydrate().await;
            (candidate, r)
        }));
        let (restart_store, recorded_store, end_store) = (store.clone(), store.clone(), store);
        let (restart_view, recorded_view) = (pinned.clone(), pinned.clone());
        self.query_instance = Some(QueryInstance {
            phase: Phase::Hydrating(AbortOnDrop(task)),
            view,
            restart: Box::new(move || restart_store.restart_pre_images(&restart_view)),
            recorded: Box::new(move || recorded_store.capture_len(&recorded_view)),
            end: Box::new(move || {
                let _ = end_store.end_capture(&pinned);
            }),
            lanes: LaneFeed::default(),
            epoch: queries.epoch(),
            queries,
        });
        Ok(())
    }

    /// One event of the query instance.
    pub(super) async fn on_query_instance(
        &mut self,
        event: Event,
        t: &mut Turn,
    ) -> Result<(), AppliedError> {
        match event {
            Event::Hydrated(done) => self.query_instance_hydrated(done, t).await,
            Event::Ended(why) => {
                let why = match why {
                    Ok(e) => e.to_string(),
                    Err(e) => format!("its task failed: {e}"),
                };
                self.lose_query_instance(&why);
                Ok(())
            }
            Event::Wants => {
                if let Some(Phase::Serving { wanting, .. }) =
                    self.query_instance.as_mut().map(|q| &mut q.phase)
                {
                    *wanting = true;
                }
                self.query_round()
            }
        }
    }

    /// The instance hydrated: on the fold's path, with no lane batch between its apply and its
    /// commit, hand it the state buckets and start its first round; then it serves.
    async fn query_instance_hydrated(
        &mut self,
        done: Hydrated,
        t: &mut Turn,
    ) -> Result<(), AppliedError> {
        let mut candidate = match done {
            Ok((c, Ok(_))) => c,
            Ok((_, Err(e))) => {
                self.lose_query_instance(&e.to_string());
                return Ok(());
            }
            Err(e) => {
                self.lose_query_instance(&format!("its hydration's task failed: {e}"));
                return Ok(());
            }
        };
        self.settle(t).await?;
        if let Err(e) = candidate.catch_up_lanes().await {
            self.lose_query_instance(&e.to_string());
            return Ok(());
        }
        let Some(q) = self.query_instance.as_mut() else {
            return Ok(());
        };
        q.lanes = LaneFeed::default();
        let pre = match (q.restart)().map_err(store_err)? {
            Some(pre) if !pre.overflowed() => pre,
            _ => {
                self.lose_query_instance("its capture overflowed or was lost while it hydrated");
                return Ok(());
            }
        };
        let (rounds, rounds_rx) = mpsc::channel(1);
        let wants = Arc::new(Notify::new());
        let task = tokio::spawn(tracing::Instrument::in_current_span(serve(
            candidate,
            q.view.clone(),
            Round {
                pre,
                lanes: Vec::new(),
                revision: self.fold.cursor().revision_or_zero(),
            },
            rounds_rx,
            q.queries.clone(),
            q.epoch,
            wants.clone(),
        )));
        q.phase = Phase::Serving {
            task: AbortOnDrop(task),
            rounds,
            wants,
            wanting: false,
        };
        Ok(())
    }

    /// The instance is gone: the fold loop answers until the next one, which waits out the
    /// backoff.
    fn lose_query_instance(&mut self, why: &str) {
        if self.query_instance.take().is_none() {
            return;
        }
        let failures = self.query_life.failures;
        self.query_life.failures = failures.saturating_add(1);
        let delay = protocol::Backoff::QUERY_INSTANCE.after(failures);
        self.query_life.not_before = Some(Instant::now() + delay);
        tracing::warn!(event = "query_instance_lost", error = %why, retry_ms = delay.as_millis() as u64, "the query instance was dropped; the fold loop answers queries until another is level");
    }

    /// Drops the query instance now (the fold loop answers from here on) and lets the next one
    /// start at once: the running applier changed.
    pub(super) fn retire_query_instance(&mut self) {
        self.query_instance = None;
        self.query_life.not_before = None;
    }

    /// Whether a query instance serves and waits for its next round (the round goes at the next
    /// settled point).
    pub(super) fn query_round_due(&self) -> bool {
        matches!(
            self.query_instance.as_ref().map(|q| &q.phase),
            Some(Phase::Serving { wanting: true, .. })
        )
    }

    /// Starts the instance's next round when it waits for one and there is something to hand it;
    /// drops it when what it must be handed was lost (a capture overflowed, the lane feed did).
    pub(super) fn query_round(&mut self) -> Result<(), AppliedError> {
        let settled = self.fold.is_settled();
        let revision = self.fold.cursor().revision_or_zero();
        let Some(q) = self.query_instance.as_mut() else {
            return Ok(());
        };
        let Phase::Serving {
            rounds, wanting, ..
        } = &mut q.phase
        else {
            return Ok(());
        };
        // A commit that failed is retried with the keys it recorded in this capture: a round now
        // would restart the capture before the retry commits them.
        if !*wanting || !settled {
            return Ok(());
        }
        if q.lanes.overflowed() {
            self.lose_query_instance(
                "the state buckets' batches waiting for it passed their bound",
            );
            return Ok(());
        }
        let recorded = (q.recorded)().map_err(store_err)?;
        let pre = match recorded {
            Some((0, false)) if !q.lanes.has_committed() => {
                // Nothing changed since its last round: it is level with the fold as it is now.
                q.queries.set_level(revision, q.epoch);
                return Ok(());
            }
            Some((_, false)) => (q.restart)().map_err(store_err)?,
            _ => None,
        };
        let Some(pre) = pre.filter(|p| !p.overflowed()) else {
            self.lose_query_instance("its capture overflowed or was lost");
            return Ok(());
        };
        let round = Round {
            pre,
            lanes: q.lanes.take_committed(),
            revision,
        };
        if rounds.try_send(round).is_ok() {
            *wanting = false;
        }
        Ok(())
    }
}

/// The query instance's task: its first round, then asks and rounds, a round whole before the
/// next ask. Returns why it ended (a failed call; the loop dropping it aborts it instead).
async fn serve(
    mut candidate: Box<dyn SwapCandidate>,
    view: Arc<dyn FoldRead>,
    first: Round,
    mut rounds: mpsc::Receiver<Round>,
    queries: Queries,
    epoch: u64,
    wants: Arc<Notify>,
) -> ApplyError {
    let revision = first.revision;
    if let Err(e) = apply_round(&mut *candidate, &*view, first).await {
        return e;
    }
    let (asks_tx, mut asks) = mpsc::channel::<Ask>(ASK_QUEUE);
    queries.install(asks_tx, epoch);
    queries.set_level(revision, epoch);
    tracing::info!(
        event = "query_instance_level",
        revision,
        "a query instance answers queries beside the fold"
    );
    wants.notify_one();
    loop {
        tokio::select! {
            biased;
            round = rounds.recv() => {
                let Some(round) = round else {
                    return gone(&*candidate);
                };
                let revision = round.revision;
                if let Err(e) = apply_round(&mut *candidate, &*view, round).await {
                    return e;
                }
                queries.set_level(revision, epoch);
                wants.notify_one();
            }
            ask = asks.recv() => {
                let Some(ask) = ask else {
                    return gone(&*candidate);
                };
                if let Err(e) = answer(&mut *candidate, ask).await {
                    return e;
                }
            }
        }
    }
}

fn gone(candidate: &dyn SwapCandidate) -> ApplyError {
    ApplyError {
        applier: candidate.describe(),
        call: "query",
        message: "the fold loop let go of its query instance".into(),
    }
}

/// A round whole: the state buckets' batches, then the keys changed since the last round, read
/// through the instance's view (the fold at this round's start).
async fn apply_round(
    candidate: &mut dyn SwapCandidate,
    view: &dyn FoldRead,
    round: Round,
) -> Result<(), ApplyError> {
    for (bucket, batch) in &round.lanes {
        candidate.apply_lane(bucket, batch).await?;
    }
    let updates = round.pre.catch_up(view).map_err(|e| ApplyError {
        applier: candidate.describe(),
        call: "catch-up",
        message: format!("read the fold for a round: {e}"),
    })?;
    if !updates.is_empty() {
        candidate.catch_up(&updates).await?;
    }
    Ok(())
}

/// Answers an ask's lookups in order. A failed call (a trap, a deadline) ends the instance: the
/// lookups after it are answered "rebuilding", as a lost instance's queries are.
async fn answer(candidate: &mut dyn SwapCandidate, ask: Ask) -> Result<(), ApplyError> {
    let mut answers = Vec::with_capacity(ask.lookups.len());
    let mut failed = None;
    for request in &ask.lookups {
        if failed.is_some() {
            answers.push(Err(ApplyError::rebuilding(
                candidate.describe(),
                "a query before this one failed",
            )));
            continue;
        }
        match candidate.query(request).await {
            Ok(Ok(a)) => answers.push(Ok(a)),
            Ok(Err(message)) => answers.push(Err(ApplyError {
                applier: candidate.describe(),
                call: "query",
                message,
            })),
            Err(e) => {
                answers.push(Err(e.clone()));
                failed = Some(e);
            }
        }
    }
    let _ = ask.reply.send(answers);
    failed.map_or(Ok(()), Err)
}
