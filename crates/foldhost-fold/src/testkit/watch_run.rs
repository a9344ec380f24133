//! One watch of the simulated bucket, mirroring `nats.rs`'s `run_watch`: its start (the resume
//! window, the pinned identity, the state-sync or delta position and the first event), its looks at
//! the stream (chunks in sequence order, the in-band floor guard, the level reported once) and the
//! backstop after a quiet period (the floor check and a level prefix watch's quiet watermark).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::mpsc;

use foldhost_core::kv::{
    FLOOR_BACKSTOP, KvError, KvUpdate, StreamIdentity, WATCH_CHUNK, WatchEvent, WatchScope,
};
use foldhost_core::protocol;

use super::{Inner, SimBucket, SimMessage, State, stream_changed};

/// Decrements the open-watch gauge when a watch ends (returns, fails or is aborted).
struct OpenWatch(Arc<Inner>);

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.0.open_watches.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One open watch's position (the simulated ordered consumer and `run_watch`'s bookkeeping).
struct WatchRun {
    scope: WatchScope,
    /// The stream the watch folds (the pinned identity, else the one it started on).
    identity: StreamIdentity,
    /// The injected-error epoch at the start.
    epoch: u64,
    /// A state-sync watch's initial messages not delivered yet (sequences, ascending).
    initial: VecDeque<u64>,
    /// The next sequence the live phase looks at.
    next: u64,
    /// The last stream sequence the watch is known to have passed (`None`: not guarded yet).
    frontier: Option<u64>,
    level_reported: bool,
    last_delivered: Option<u64>,
}

/// What one look at the stream found.
enum Step {
    /// Send these updates, then (`Some`) the level through that revision.
    Deliver {
        updates: Vec<KvUpdate>,
        level: Option<Option<u64>>,
    },
    /// Nothing to deliver now (or deliveries are held).
    Wait,
}

impl WatchRun {
    /// A watch's start over the stream as it is now: state-sync when `from` is `None`, else a delta
    /// from `from + 1`; with the first event it sends (`Pending`, or `CaughtUp` when nothing in
    /// scope is left to deliver).
    fn start(
        st: &State,
        scope: &WatchScope,
        from: Option<u64>,
    ) -> Result<(Self, WatchEvent), KvError> {
        if let Some(rev) = from {
            let first_sequence = st.first_sequence();
            if !protocol::resume_window_ok(rev, first_sequence) {
                return Err(KvError::CursorExpired {
                    resume_from: rev.saturating_add(1),
                    first_sequence,
                });
            }
        }
        let here = st.identity();
        let identity = match &st.pinned {
            Some(p) if *p != here => {
                return Err(stream_changed(format!(
                    "the fold folds {p}, the bucket is now {here}"
                )));
            }
            Some(p) => p.clone(),
            None => here,
        };
        let (initial, next, frontier) = Self::position(st, scope, from);
        let pending = initial.len() as u64
            + st.log
                .range(next..)
                .filter(|(_, m)| scope.contains(&m.key))
                .count() as u64;
        let mut run = WatchRun {
            scope: scope.clone(),
            identity,
            epoch: st.break_epoch,
            initial,
            next,
            frontier,
            level_reported: false,
            last_delivered: None,
        };
        let first = if pending == 0 {
            run.level_reported = true;
            // A state-sync start that is level at once guards from the stream's last sequence.
            run.frontier = run.frontier.or(Some(st.last_sequence));
            WatchEvent::CaughtUp { through: None }
        } else {
            WatchEvent::Pending(pending)
        };
        Ok((run, first))
    }

    /// Where a watch starts: a state-sync watch's initial messages (the last of each key in scope,
    /// ascending) and its live phase after the last sequence, unguarded; a delta's live phase from
    /// `from + 1`, guarded from `from`.
    fn position(
        st: &State,
        scope: &WatchScope,
        from: Option<u64>,
    ) -> (VecDeque<u64>, u64, Option<u64>) {
        match from {
            None => {
                let mut initial: Vec<u64> = st
                    .by_key
                    .iter()
                    .filter(|(k, _)| scope.contains(k))
                    .filter_map(|(_, seqs)| seqs.last().copied())
                    .collect();
                initial.sort_unstable();
                (initial.into(), st.last_sequence.saturating_add(1), None)
            }
            Some(rev) => (VecDeque::new(), rev.saturating_add(1), Some(rev)),
        }
    }

    fn step(&mut self, st: &State) -> Result<Step, KvError> {
        if st.break_epoch > self.epoch {
            return Err(st
                .break_error
                .clone()
                .unwrap_or_else(|| KvError::WatchError("injected".into())));
        }
        st.check_same_stream(&self.identity)?;
        if st.held {
            return Ok(Step::Wait);
        }
        let mut chunk: Vec<&SimMessage> = Vec::new();
        while chunk.len() < WATCH_CHUNK
            && let Some(seq) = self.initial.pop_front()
        {
            // An initial message evicted or superseded before delivery is skipped, as NATS does.
            if let Some(m) = st.log.get(&seq) {
                chunk.push(m);
            }
        }
        if self.initial.is_empty() {
            for (&seq, m) in st.log.range(self.next..) {
                if chunk.len() >= WATCH_CHUNK {
                    break;
                }
                self.next = seq.saturating_add(1);
                if self.scope.contains(&m.key) {
                    chunk.push(m);
                }
            }
        }
        let Some(last) = chunk.last().map(|m| m.sequence) else {
            return Ok(Step::Wait);
        };
        // In-band: a gap after the frontier is checked before anything after it is passed on
        // (one check per chunk, at its first gap: the first sequence only grows).
        if let Some(mut f) = self.frontier {
            let mut check_after = None;
            for m in &chunk {
                if check_after.is_none() && m.sequence > f.saturating_add(1) {
                    check_after = Some(f);
                }
                f = f.max(m.sequence);
            }
            if let Some(g) = check_after {
                st.check_floor(g, &self.identity)?;
            }
            self.frontier = Some(f);
        }
        self.last_delivered = Some(last);
        let mut level = None;
        if self.level_reported {
            self.frontier = Some(self.frontier.map_or(last, |f| f.max(last)));
        } else {
            let left = self.initial.iter().any(|s| st.log.contains_key(s))
                || st.any_in_scope_from(self.next, &self.scope);
            if !left {
                self.level_reported = true;
                if self.frontier.is_none() {
                    self.frontier = Some(last);
                }
                level = Some(self.last_delivered);
            }
        }
        Ok(Step::Deliver {
            updates: chunk.iter().map(|m| m.to_update()).collect(),
            level,
        })
    }

    /// The backstop after a quiet period: the floor check, and a level prefix watch's quiet
    /// watermark.
    fn backstop(&mut self, st: &State) -> Result<(), KvError> {
        let Some(f) = self.frontier else {
            return Ok(());
        };
        st.check_floor(f, &self.identity)?;
        let prefix_scope = !matches!(self.scope, WatchScope::All);
        if prefix_scope
            && self.level_reported
            && st.last_sequence > f
            && !st.any_in_scope_from(f.saturating_add(1), &self.scope)
            && protocol::resume_window_ok(f, st.first_sequence())
        {
            self.frontier = Some(st.last_sequence);
        }
        Ok(())
    }
}

impl SimBucket {
    /// Runs one watch: state-sync when `from` is `None`, else a delta from `from + 1`.
    pub(super) async fn run(
        &self,
        scope: &WatchScope,
        from: Option<u64>,
        tx: mpsc::Sender<WatchEvent>,
    ) -> Result<(), KvError> {
        self.inner.watches_started.fetch_add(1, Ordering::Relaxed);
        self.inner.open_watches.fetch_add(1, Ordering::Relaxed);
        let _open = OpenWatch(self.inner.clone());
        let mut changes = self.inner.changes.subscribe();
        let (mut run, first) = WatchRun::start(&self.state(), scope, from)?;
        if tx.send(first).await.is_err() {
            return Ok(());
        }
        let mut backstop = tokio::time::interval(FLOOR_BACKSTOP);
        backstop.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        backstop.reset();
        let mut quiet = true;
        loop {
            // Marked seen before the look: a change after it wakes the wait below.
            changes.borrow_and_update();
            let step = run.step(&self.state())?;
            match step {
                Step::Deliver { updates, level } => {
                    quiet = false;
                    if !deliver(&tx, updates, level).await {
                        return Ok(());
                    }
                }
                Step::Wait => {
                    tokio::select! {
                        changed = changes.changed() => {
                            if changed.is_err() {
                                return Ok(()); // the bucket is gone
                            }
                        }
                        _ = tx.closed() => return Ok(()),
                        _ = backstop.tick() => {
                            if quiet {
                                run.backstop(&self.state())?;
                            }
                            quiet = true;
                        }
                    }
                }
            }
        }
    }
}

/// Sends one look's updates (when any), then the level when it was reached; `false` when the
/// receiver is gone (the watch ends quietly).
async fn deliver(
    tx: &mpsc::Sender<WatchEvent>,
    updates: Vec<KvUpdate>,
    level: Option<Option<u64>>,
) -> bool {
    if !updates.is_empty() && tx.send(WatchEvent::Updates(updates)).await.is_err() {
        return false;
    }
    if let Some(through) = level
        && tx.send(WatchEvent::CaughtUp { through }).await.is_err()
    {
        return false;
    }
    true
}
