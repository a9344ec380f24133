//! [`watch_applied`]: the fold loop. One `select!` (in [`FoldLoop::turn`]) waits on shutdown, the
//! batch timer, the grace and retention ticks, the control channel and the watch; each event is
//! handed to one short step — [`FoldLoop::on_control`], [`FoldLoop::on_events`],
//! [`FoldLoop::flush_ready`] — and every change to the fold goes through [`Fold`].
//!
//! Invariants: nothing here moves a cursor (only [`Fold::flush`] and the repairs do); a query, an
//! export or a swap runs between flushes, after everything delivered so far is committed; a watch
//! never outlives the loop that feeds on it (its task is aborted on every exit path); queries and
//! the fold's own work (deliveries, flushes, the rebuild of a lost guest instance) take turns by
//! [`protocol::loop_gates`] while both wait, so no query flood holds back a ready batch by more than
//! [`protocol::MAX_QUERIES_BETWEEN_FLUSHES`] queries (nor by more than
//! [`protocol::QUERY_TIME_BETWEEN_FLUSHES`] of query time and the one query running), and no
//! delivery flood holds back a query by more than [`protocol::MAX_FLUSHES_BETWEEN_QUERIES`]
//! flushes; a lost guest instance is rebuilt here, as fold work, never by a query, and only once
//! no batch waits re-queued.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;

use foldhost_core::crashpoint;
use foldhost_core::kv::{KvError, KvUpdate, KvWatcher, WatchEvent};
use foldhost_core::protocol;
use foldhost_core::snapshot::SnapshotStore;
use foldhost_core::view::SharedStore;

mod replica;
mod swap;

use replica::{QueryInstance, QueryInstanceLife};
use swap::{PendingSwap, hydrated};

use super::fold::{STORE_RETRY_DELAY, flush_all};
use super::start::{check_identity, note_retention, prepare, repair_expired, watches_for_eviction};
use super::{
    AppliedError, Apply, Control, Finished, Fold, FoldStatus, RETENTION_PERIOD, WatchOptions,
};

/// Watches `scope` from the store's cursor and folds every update through `apply` into `store`,
/// keeping cursor-after-apply. Returns when `shutdown` resolves, when the watch ends cleanly, or (with
/// `catch_up`) once everything the stream held at the start is applied; every path flushes first.
pub async fn watch_applied<S, A>(
    watcher: Arc<dyn KvWatcher>,
    store: SharedStore<S>,
    apply: &mut A,
    opts: WatchOptions,
    status: Arc<FoldStatus>,
    control: Option<mpsc::Receiver<Control>>,
    shutdown: impl Future<Output = ()>,
) -> Result<Finished, AppliedError>
where
    S: SnapshotStore,
    A: Apply + ?Sized,
{
    let mut fold =
        Fold::new(store, status.clone()).map_err(|e| AppliedError::Store { streak: 0, last: e })?;
    status.set_applier(&apply.describe(), apply.contract());
    let relist = prepare(&mut fold, apply, &*watcher, &opts, &status).await?;
    let mut grace_tick = tokio::time::interval(Duration::from_secs(1));
    grace_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Retention is read live at every watch start and every expiry, and periodically while a
    // key-listing repair could still be planned and the memo is unset (the fold reads retention
    // while eviction is in force: docs/design.md, "Cursor-expiry repair").
    let mut retention_tick = tokio::time::interval(RETENTION_PERIOD);
    retention_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    retention_tick.reset();
    // The channel carries chunks of updates; size it so it holds about `channel_capacity` updates.
    let depth = opts
        .batch
        .channel_capacity
        .div_ceil(foldhost_core::kv::WATCH_CHUNK)
        .max(2);
    let mut lp = FoldLoop {
        fold,
        apply,
        watcher,
        opts,
        status,
        control,
        grace_tick,
        retention_tick,
        depth,
        swap: None,
        query_instance: None,
        query_life: QueryInstanceLife::default(),
        share: protocol::LoopShare::default(),
        rebuild_held: false,
    };
    tokio::pin!(shutdown);
    lp.run(relist, shutdown).await
}

/// The state the loop keeps across watches.
struct FoldLoop<'a, S: SnapshotStore, A: Apply + ?Sized> {
    fold: Fold<S>,
    apply: &'a mut A,
    watcher: Arc<dyn KvWatcher>,
    opts: WatchOptions,
    status: Arc<FoldStatus>,
    control: Option<mpsc::Receiver<Control>>,
    grace_tick: tokio::time::Interval,
    retention_tick: tokio::time::Interval,
    /// Depth of the watch channel, in chunks.
    depth: usize,
    /// The swap whose candidate is hydrating, if any.
    swap: Option<PendingSwap>,
    /// The query instance, when the fold has a query route and one is built or building.
    query_instance: Option<QueryInstance>,
    query_life: QueryInstanceLife,
    /// Queries and flushes since the loop last switched between them ([`protocol::loop_gates`]).
    share: protocol::LoopShare,
    /// A rebuild of the lost guest instance failed: none is tried between batches again until the
    /// next grace tick (the next batch still tries, as it needs the instance).
    rebuild_held: bool,
}

/// The state of one watch: the open batch and what the loop waits for.
struct Turn {
    batch: Vec<KvUpdate>,
    /// `Some(through)` once the watch reported it is level with the stream.
    level: Option<Option<u64>>,
    timer_armed: bool,
    /// After a failed apply: no new deliveries until the backoff timer fires.
    backing_off: bool,
    /// The batch size to try next: halved after a failed apply (so the updates before a poison one
    /// commit and the fold stops exactly at it), doubled back after successes.
    cap: usize,
}

impl Turn {
    /// Opens the batch window when a batch has begun and no timer runs for it yet.
    fn arm_timer(&mut self, timer: Pin<&mut tokio::time::Sleep>, window: Duration) {
        if !self.timer_armed && !self.batch.is_empty() {
            timer.reset(tokio::time::Instant::now() + window);
            self.timer_armed = true;
        }
    }

    /// A turn's state at its start: an empty batch of at most `max` updates, nothing level yet.
    fn new(max: usize) -> Self {
        Turn {
            batch: Vec::with_capacity(max),
            level: None,
            timer_armed: false,
            backing_off: false,
            cap: max,
        }
    }
}

/// How a watch ended.
enum TurnEnd {
    /// Shutdown, caught up, or the watch ended cleanly: the fold is done.
    Done,
    /// The cursor expired (at start or by the floor guard): repair, then watch again.
    Expired(KvError),
    /// The stream changed under the watch: check its identity again, then watch again.
    Changed,
    /// The watch broke (the connection, the server or the consumer failed): resume from the
    /// applied cursor after a backoff.
    Broken(KvError),
}

/// What one look at the watch channel asks for.
enum Step {
    Continue,
    Closed,
}

/// What the loop may take this time round ([`FoldLoop::gates`]).
struct Gates {
    /// The batch has room and no apply is backing off.
    intake_open: bool,
    /// A lost applier instance waits to be rebuilt.
    rebuild_waiting: bool,
    /// A query may be served now.
    queries_open: bool,
    /// The fold's own work may run now.
    fold_open: bool,
}

/// Aborts a task on every exit path: a watch must not outlive the fold it feeds, nor a swap's
/// hydration the fold it would join.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<S: SnapshotStore, A: Apply + ?Sized> FoldLoop<'_, S, A> {
    /// One turn per watch: a repaired expiry starts the next (a delta from the restored cursor, or
    /// a state-sync re-list after the key-listing diff), and so does a broken watch, after a
    /// bounded backoff ([`protocol::Backoff::WATCH_RESUME`]); every restart checks the stream again.
    async fn run(
        &mut self,
        mut relist: bool,
        mut shutdown: Pin<&mut impl Future<Output = ()>>,
    ) -> Result<Finished, AppliedError> {
        let mut first_turn = true;
        // Consecutive broken watches, and the cursor at the last break: a resumed watch that
        // commits resets the count.
        let mut broken = 0u32;
        let mut broken_at = self.fold.cursor();
        loop {
            // The first watch's identity was checked by `prepare`.
            let end = if std::mem::take(&mut first_turn) {
                self.turn(std::mem::take(&mut relist), shutdown.as_mut())
                    .await?
            } else {
                match check_identity(
                    &mut self.fold,
                    self.apply,
                    &*self.watcher,
                    &self.opts,
                    &self.status,
                )
                .await
                {
                    Ok(reset) => {
                        relist |= reset;
                        self.turn(std::mem::take(&mut relist), shutdown.as_mut())
                            .await?
                    }
                    // The server is not back yet: the same as a broken watch.
                    Err(AppliedError::Watch(e)) if e.watch_resumable() => TurnEnd::Broken(e),
                    Err(e) => return Err(e),
                }
            };
            match end {
                TurnEnd::Done => {
                    return Ok(Finished {
                        cursor: self.fold.cursor(),
                    });
                }
                // Everything delivered is committed (the close flushed it); repair, then watch
                // again.
                TurnEnd::Expired(why) => {
                    relist = repair_expired(
                        &mut self.fold,
                        self.apply,
                        &*self.watcher,
                        &self.opts,
                        &self.status,
                        why,
                    )
                    .await?;
                }
                TurnEnd::Changed => {}
                TurnEnd::Broken(e) => {
                    if self.fold.cursor() != broken_at {
                        broken = 0;
                        broken_at = self.fold.cursor();
                    }
                    let delay = protocol::Backoff::WATCH_RESUME.after(broken);
                    broken = broken.saturating_add(1);
                    self.status
                        .set_error(Some(format!("watch broke, resuming: {e}")));
                    tracing::warn!(event = "watch_resumed", error = %e, attempt = broken, delay_ms = delay.as_millis() as u64, cursor = %self.fold.cursor(), "watch broke; resuming from the applied cursor");
                    tokio::select! {
                        biased;
                        _ = shutdown.as_mut() => {
                            return Ok(Finished {
                                cursor: self.fold.cursor(),
                            });
                        }
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    /// The watch of one turn, on a task of its own: a state-sync re-list, or a delta from `start`.
    fn spawn_watch(
        &self,
        relist: bool,
        start: foldhost_core::kv::WatchCursor,
        tx: mpsc::Sender<WatchEvent>,
    ) -> AbortOnDrop<Result<(), foldhost_core::kv::KvError>> {
        let scope = self.opts.scope.clone();
        let w = self.watcher.clone();
        AbortOnDrop(tokio::spawn(tracing::Instrument::in_current_span(
            async move {
                if relist {
                    w.watch(&scope, tx).await
                } else {
                    w.watch_from(&scope, start, tx).await
                }
            },
        )))
    }

    /// `--catch-up`: the fold is level with the stream as of the watch's start, everything
    /// committed.
    fn caught_up_done(&self, t: &Turn) -> bool {
        self.opts.catch_up
            && t.level
                .is_some_and(|through| protocol::caught_up(self.fold.cursor().revision(), through))
            && t.batch.is_empty()
            && self.fold.is_settled()
    }

    /// Whose turn it is when queries and the fold's own work both wait ([`protocol::loop_gates`]);
    /// `deliveries_waiting`: the watch's channel holds events.
    fn gates(&self, t: &Turn, deliveries_waiting: bool) -> Gates {
        let intake_open = !t.backing_off && t.batch.len() < self.opts.batch.max;
        let rebuild_waiting =
            !self.rebuild_held && self.fold.is_settled() && self.apply.rebuild_due();
        let fold_waiting = (intake_open && deliveries_waiting) || rebuild_waiting;
        let query_waiting = self.control.as_ref().is_some_and(|c| !c.is_empty());
        let (queries_open, fold_open) =
            protocol::loop_gates(self.share, fold_waiting, query_waiting);
        Gates {
            intake_open,
            rebuild_waiting,
            queries_open,
            fold_open,
        }
    }

    /// Starts one watch and folds what it delivers until it ends or the loop is done.
    async fn turn(
        &mut self,
        relist: bool,
        mut shutdown: Pin<&mut impl Future<Output = ()>>,
    ) -> Result<TurnEnd, AppliedError> {
        let (tx, mut rx) = mpsc::channel::<WatchEvent>(self.depth);
        let start = self.fold.cursor();
        let mut watch_task = self.spawn_watch(relist, start, tx);
        let max = self.opts.batch.max;
        let mut t = Turn::new(max);
        // A state-sync re-list (or cursor-less start) that trusted the key listing (no eviction
        // memo) re-checks that trust once its snapshot exists, before anything of it is folded.
        let mut vouch_pending =
            (relist || start.revision().is_none()) && self.fold.cursor().memo().is_none();
        self.fold.watch_starts(relist, start);
        // One timer, re-armed when the batch opens: a fresh timer per delivery costs more than the
        // delivery. A full batch never waits for it (the timer wheel ticks in milliseconds).
        let timer = tokio::time::sleep(Duration::from_secs(3600));
        tokio::pin!(timer);
        loop {
            if self.caught_up_done(&t) {
                return Ok(TurnEnd::Done);
            }
            let mut flush_now = false;
            let Gates {
                intake_open,
                rebuild_waiting,
                queries_open,
                fold_open,
            } = self.gates(&t, !rx.is_empty());
            tokio::select! {
                biased;
                _ = &mut shutdown => {
                    flush_all(&mut self.fold, &mut t.batch, max, self.apply).await?;
                    return Ok(TurnEnd::Done);
                }
                _ = &mut timer, if t.timer_armed => flush_now = true,
                // A writer began waiting for applied_through while the batch lingered: flush it
                // now rather than at the end of the window.
                _ = self.status.waiter_arrived.notified(), if t.timer_armed => flush_now = true,
                _ = self.grace_tick.tick() => self.on_grace_tick(&mut t).await?,
                ev = replica::next_event(&mut self.query_instance) => self.on_query_instance(ev, &mut t).await?,
                _ = self.retention_tick.tick(), if watches_for_eviction(&self.opts, &self.fold) => {
                    self.on_retention_tick(&mut t).await?;
                }
                c = recv_control(&mut self.control), if queries_open => {
                    let started = tokio::time::Instant::now();
                    self.on_control(c, &mut t).await?;
                    self.share.served_query(started.elapsed());
                }
                done = hydrated(&mut self.swap) => self.on_swap_task(done, &mut t).await?,
                ev = rx.recv(), if fold_open && intake_open => {
                    if std::mem::take(&mut vouch_pending)
                        && let Some(why) = self.relist_unvouched().await?
                    {
                        return self.expired_now(why);
                    }
                    if let Step::Closed = self.on_events(ev, &mut rx, &mut t, &mut flush_now) {
                        return self.on_closed(&mut t, &mut watch_task).await;
                    }
                    if !flush_now {
                        t.arm_timer(timer.as_mut(), self.opts.batch.window);
                    }
                }
                // Last: only when no delivery waits (a delivery's flush rebuilds the instance
                // itself, as it needs it).
                _ = std::future::ready(()), if fold_open && rebuild_waiting => {
                    self.rebuild_lost().await;
                }
            }
            if flush_now {
                self.flush_and_round(&mut t, timer.as_mut()).await?;
            }
        }
    }

    /// [`protocol::relist_still_vouched`] at a state-sync watch's first event: when retention now
    /// shows eviction the listing-trusting start did not see, commits the eviction memo (the
    /// fold is settled: nothing of this watch was folded) and answers why the watch must end as
    /// expired. A retention that cannot be read in 5 s is retried at the next watch start, never
    /// taken as "nothing evicted": the watch ends as broken.
    async fn relist_unvouched(&mut self) -> Result<Option<KvError>, AppliedError> {
        let r = match tokio::time::timeout(Duration::from_secs(5), self.watcher.retention()).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => return Ok(Some(e)),
            Err(_) => {
                return Ok(Some(KvError::Timeout {
                    op: "retention read at a re-list's first event",
                    secs: 5,
                }));
            }
        };
        if protocol::relist_still_vouched(r) {
            return Ok(None);
        }
        note_retention(&mut self.fold, self.apply, r).await?;
        let first_sequence = r.map_or(0, |r| r.first_revision);
        tracing::warn!(
            event = "relist_evicting",
            first_sequence,
            "retention began evicting during a re-list: the key listing cannot vouch for every key"
        );
        Ok(Some(KvError::CursorExpired {
            resume_from: self.fold.cursor().revision_or_zero() + 1,
            first_sequence,
        }))
    }

    /// How a watch ended by the fold's own finding `why` ends the turn, as [`Self::on_closed`]
    /// would for the same error from the watch.
    fn expired_now(&self, why: KvError) -> Result<TurnEnd, AppliedError> {
        match why {
            e @ KvError::CursorExpired { .. }
                if self.opts.repair.mode != protocol::RepairMode::None =>
            {
                Ok(TurnEnd::Expired(e))
            }
            e if e.watch_resumable() => Ok(TurnEnd::Broken(e)),
            e => Err(AppliedError::Watch(e)),
        }
    }

    /// Commits everything delivered so far (the open batch and anything re-queued), so what runs
    /// next sees the fold exactly at the applied cursor; the batch timer is disarmed with the batch.
    async fn settle(&mut self, t: &mut Turn) -> Result<(), AppliedError> {
        flush_all(
            &mut self.fold,
            &mut t.batch,
            self.opts.batch.max,
            self.apply,
        )
        .await?;
        // Everything delivered is committed: no batch is left to back off from. Left set, with
        // the timer disarmed, it would close the watch branch of the loop for good (found by the
        // simulation: a swap arriving during an apply backoff wedged the fold).
        t.timer_armed = false;
        t.backing_off = false;
        Ok(())
    }

    /// Rebuilds the lost guest instance from the committed fold, as fold work between batches (the
    /// fold is settled: no batch waits re-queued, so the fold holds every batch an instance
    /// applied). A failure is not the fold's: queries go on being answered "guest rebuilding", and
    /// the next batch (or the next grace tick) tries again.
    async fn rebuild_lost(&mut self) {
        self.share.flushed();
        if let Err(e) = self.apply.rebuild().await {
            tracing::warn!(event = "guest_rebuild_failed", error = %e, "the guest could not be rebuilt between batches; the next batch tries again");
            self.rebuild_held = true;
        }
    }

    /// The periodic retention read: when it shows a current value evicted, commits the memo
    /// (after flushing, so the memo rides on everything delivered). Bounded: a slow server delays
    /// the fold by at most 5 s, never stops it.
    async fn on_retention_tick(&mut self, t: &mut Turn) -> Result<(), AppliedError> {
        if let Ok(Ok(Some(r))) =
            tokio::time::timeout(Duration::from_secs(5), self.watcher.retention()).await
            && protocol::retention_has_evicted(r)
        {
            self.settle(t).await?;
            note_retention(&mut self.fold, self.apply, Some(r)).await?;
        }
        Ok(())
    }

    /// Flushes what is ready; then a shadow waiting for the fold's batches looks again, and a
    /// query instance waiting for its next round gets it.
    async fn flush_and_round(
        &mut self,
        t: &mut Turn,
        timer: Pin<&mut tokio::time::Sleep>,
    ) -> Result<(), AppliedError> {
        let before = self.fold.cursor();
        self.flush_ready(t, timer).await?;
        self.on_committed(t).await?;
        if self.fold.cursor() != before && self.query_round_due() {
            crashpoint::hold(crashpoint::QUERY_ROUND).await;
        }
        self.query_round()
    }

    /// A query, an export or a swap, between batches.
    async fn on_control(&mut self, c: Option<Control>, t: &mut Turn) -> Result<(), AppliedError> {
        match c {
            // A state bucket's flush: served whole, nothing else reaching the guest meanwhile.
            Some(Control::Lane(session)) => {
                let feed = self.query_instance.as_mut().map(|q| &mut q.lanes);
                super::lane::serve(self.apply, session, feed).await;
                self.query_round()?;
            }
            Some(Control::Queries { lookups, reply }) => {
                // Between batches, in a row: the applier's structure is whole and stays so.
                let mut answers = Vec::with_capacity(lookups.len());
                for request in &lookups {
                    answers.push(self.apply.query(request).await);
                }
                let _ = reply.send(answers);
            }
            Some(Control::Query { request, reply }) => {
                // Between batches: the applier's structure is whole.
                let answer = self.apply.query(&request).await;
                let _ = reply.send(answer);
            }
            Some(Control::Export { dir, reply }) => {
                // Everything delivered so far is applied and committed first, so the copy is
                // exactly the applied cursor; deliveries wait in the channel meanwhile.
                self.settle(t).await?;
                let store = self.fold.store().clone();
                let copied = tokio::task::spawn_blocking(move || {
                    let s = store.read()?;
                    let proven = s.export_to(&dir)?;
                    Ok((s.cursor(), proven))
                })
                .await
                .map_err(|e| AppliedError::Task(e.to_string()))?;
                let _ = reply.send(copied);
            }
            Some(Control::SweepLedger {
                cutoff_unix_ms,
                after,
                reply,
            }) => {
                let swept = self.fold.sweep_ledger(cutoff_unix_ms, after.as_deref());
                let _ = reply.send(swept);
            }
            Some(Control::Swap { bytes, what, reply }) => {
                self.start_swap(bytes, what, reply, t).await?;
            }
            Some(Control::Shadow {
                bytes,
                what,
                plan,
                reply,
            }) => {
                self.start_shadow(bytes, what, plan, reply, t).await?;
            }
            Some(Control::AbandonShadow { what }) => self.abandon_shadow(&what),
            None => self.control = None,
        }
        Ok(())
    }

    /// Takes `first` and whatever else is already queued, up to a full batch, without re-entering
    /// the `select!` for each chunk. Sets `flush_now` when the batch is full or the watch is level.
    fn on_events(
        &mut self,
        first: Option<WatchEvent>,
        rx: &mut mpsc::Receiver<WatchEvent>,
        t: &mut Turn,
        flush_now: &mut bool,
    ) -> Step {
        let mut next = first;
        loop {
            match next.take() {
                None => return Step::Closed,
                Some(ev) => {
                    if self.on_event(ev, t) {
                        *flush_now = true;
                    }
                }
            }
            if t.batch.len() >= self.opts.batch.max {
                *flush_now = true;
                break;
            }
            match rx.try_recv() {
                Ok(ev) => next = Some(ev),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => return Step::Closed,
            }
        }
        if self.opts.catch_up && t.level.is_some() {
            *flush_now = true;
        }
        // A writer (or a read) waiting for applied_through: no lingering for the batch window.
        if self.status.applied_waiters.load(Ordering::Acquire) > 0 {
            *flush_now = true;
        }
        Step::Continue
    }

    /// Once a second: a held rebuild may be tried again, deferred records past their grace are
    /// warned of, and a shadow on an idle bucket may have run out its wait.
    async fn on_grace_tick(&mut self, t: &mut Turn) -> Result<(), AppliedError> {
        self.rebuild_held = false;
        self.fold
            .check_grace(self.opts.defer_grace)
            .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
        self.on_committed(t).await?;
        // A query instance starts here (at the loop's first tick, and after a backoff).
        self.begin_query_instance(t).await?;
        self.query_round()
    }

    /// One event into the batch and the progress figures; true when it asks for a flush (the
    /// watch is level).
    fn on_event(&mut self, ev: WatchEvent, t: &mut Turn) -> bool {
        let status = &self.status;
        match ev {
            WatchEvent::Stamp {
                revision,
                server_time_unix_ns,
            } => {
                self.fold.note_stamp(revision, server_time_unix_ns);
                false
            }
            WatchEvent::Updates(us) => {
                debug_assert!(
                    us.iter().filter_map(KvUpdate::revision).is_sorted(),
                    "a watch delivers revisions in stream order"
                );
                if let Some(r) = us.iter().rev().find_map(KvUpdate::revision) {
                    status.seq.fetch_max(r, Ordering::Relaxed);
                }
                status
                    .delivered
                    .fetch_add(us.len() as u64, Ordering::Relaxed);
                if t.batch.is_empty() {
                    t.batch = us;
                } else {
                    t.batch.extend(us);
                }
                false
            }
            WatchEvent::CaughtUp { through } => {
                if let Err(e) = self.fold.state_sync_level(through) {
                    // Unrecorded, the level only keeps applied_through lower (never higher).
                    tracing::warn!(event = "fold_level_unrecorded", error = %e, "the level of a state-sync start was not recorded");
                }
                t.level = Some(through);
                // Said once per run of the fold: a watch that resumes is level again quietly.
                if status.caught_up.swap(1, Ordering::Relaxed) != 1 {
                    tracing::info!(event = "fold_caught_up", through = ?through, "level with the stream; following live updates");
                }
                status.pending.store(0, Ordering::Relaxed);
                true
            }
            WatchEvent::Pending(n) => {
                status.pending.store(n, Ordering::Relaxed);
                false
            }
            WatchEvent::Ops(ops) => {
                self.fold.note_ops(ops);
                false
            }
        }
    }

    /// The watch ended: flush what it delivered, then say why it ended.
    async fn on_closed(
        &mut self,
        t: &mut Turn,
        watch_task: &mut AbortOnDrop<Result<(), KvError>>,
    ) -> Result<TurnEnd, AppliedError> {
        flush_all(
            &mut self.fold,
            &mut t.batch,
            self.opts.batch.max,
            self.apply,
        )
        .await?;
        match (&mut watch_task.0).await {
            Ok(Ok(())) => Ok(TurnEnd::Done),
            Ok(Err(e @ KvError::CursorExpired { .. }))
                if self.opts.repair.mode != protocol::RepairMode::None =>
            {
                Ok(TurnEnd::Expired(e))
            }
            // The stream changed under the watch: the next turn's identity check refuses, or
            // resets for the new stream.
            Ok(Err(e @ KvError::StreamChanged { .. })) => {
                tracing::warn!(event = "watch_identity_recheck", error = %e, "watch ended: checking the bucket's identity again");
                Ok(TurnEnd::Changed)
            }
            // The connection, the server or the consumer failed: resumed from the applied cursor.
            Ok(Err(e)) if e.watch_resumable() => Ok(TurnEnd::Broken(e)),
            Ok(Err(e)) => Err(AppliedError::Watch(e)),
            Err(e) => Err(AppliedError::Task(e.to_string())),
        }
    }

    /// Flushes the open batch in batches of at most `cap`. After a failed apply the batch comes
    /// back, `cap` halves and deliveries wait for a backoff; after a store failure the fold retries
    /// the re-queued batch even if nothing new arrives.
    async fn flush_ready(
        &mut self,
        t: &mut Turn,
        mut timer: Pin<&mut tokio::time::Sleep>,
    ) -> Result<(), AppliedError> {
        let max = self.opts.batch.max;
        t.timer_armed = false;
        t.backing_off = false;
        self.share.flushed();
        loop {
            // A batch is at most `cap` updates; a chunk from the watch can overfill it.
            let b = if t.batch.len() > t.cap {
                let rest = t.batch.split_off(t.cap);
                std::mem::replace(&mut t.batch, rest)
            } else {
                std::mem::take(&mut t.batch)
            };
            let tried = b.len();
            if let Some(mut back) = self.fold.flush(b, self.apply).await? {
                // Nothing of it committed: retry the same updates after a backoff, taking no new
                // deliveries meanwhile (the channel backpressures the watch).
                t.cap = (tried / 2).max(1);
                back.append(&mut t.batch);
                t.batch = back;
                t.backing_off = true;
                timer.as_mut().reset(
                    tokio::time::Instant::now()
                        + protocol::Backoff::APPLY.after(self.fold.apply_streak),
                );
                t.timer_armed = true;
                break;
            }
            t.cap = t.cap.saturating_mul(2).min(max);
            if !self.fold.is_settled() {
                // A store failure re-queued the batch: retry even if nothing new arrives.
                timer
                    .as_mut()
                    .reset(tokio::time::Instant::now() + STORE_RETRY_DELAY);
                t.timer_armed = true;
                break;
            }
            if t.batch.is_empty() || (t.batch.len() < max && t.cap == max) {
                break;
            }
        }
        if !t.timer_armed && !t.batch.is_empty() {
            timer
                .as_mut()
                .reset(tokio::time::Instant::now() + self.opts.batch.window);
            t.timer_armed = true;
        }
        Ok(())
    }
}

async fn recv_control(control: &mut Option<mpsc::Receiver<Control>>) -> Option<Control> {
    match control {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}
