//! [`Fold`]: the one place a batch, the applied cursor and the store change together — flush
//! (parse, apply, commit, `on-applied`), retain and release deferred records, the eviction memo and
//! the stream identity records.
//!
//! Invariants: a cursor is committed only with (or after) the data it covers; a re-queued batch
//! (applied, its commit failed) commits before the applier sees anything newer; a re-queued batch
//! retried on another applier generation than the one it was applied to (the instance was lost and
//! rebuilt from a fold without it, meanwhile) discards that generation before it commits, so the
//! next one is built from a fold that holds it; a retained record commits with its batch.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use foldhost_core::crashpoint;
use foldhost_core::kv::{KvEntry, KvUpdate, WatchCursor};
use foldhost_core::protocol;
use foldhost_core::retained::{Base, ON_APPLIED_KEY, RetainedIndex, RetainedRecord, is_reserved};
use foldhost_core::snapshot::{SnapshotError, SnapshotStore};
use foldhost_core::view::SharedStore;

use super::{
    AppliedError, Apply, ApplyError, FoldStatus, MAX_APPLY_FAILURES, MAX_STAMPS, MAX_WARNINGS,
    Verdict,
};

pub(super) fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

mod intent;
mod positions;
mod retention;

/// Most operation ids queued ahead of the commits that record them.
pub(crate) const MAX_PENDING_OPS: usize = 1 << 16;

/// The batch, the applied cursor and the store: every change to the fold goes through here.
pub struct Fold<S: SnapshotStore> {
    store: SharedStore<S>,
    applied: WatchCursor,
    /// Raw updates whose `apply` returned but whose store commit failed: committed first next time.
    requeued: Vec<KvUpdate>,
    /// The applier generation ([`Apply::generation`]) `requeued` was applied to.
    requeued_generation: Option<u64>,
    store_streak: u32,
    pub(super) apply_streak: u32,
    status: Arc<FoldStatus>,
    /// When the flush being committed began its parse (the batch's duration, `/metrics`); kept
    /// across a failed commit's retry, so a retried batch counts its whole time.
    flush_started: Option<Instant>,
    /// Store keys of retained records already warned about (each is warned about once per run).
    warned: std::collections::BTreeSet<String>,
    /// While set (a restore folding its difference), commits keep the cursor where it is.
    frozen: bool,
    /// The highest revision of a skipped reserved-space bucket key ([`protocol::bucket_key_admitted`])
    /// whose batch is re-queued whole after a failed store commit: it rides with `requeued`.
    requeued_skipped: Option<u64>,
    /// Server times of recently delivered revisions (ascending), for the memo's time.
    stamps: std::collections::VecDeque<(u64, u64)>,
    /// Operation ids delivered ahead of their records, ascending by revision: each becomes a
    /// ledger row in the commit that moves the cursor over its revision (at most
    /// [`MAX_PENDING_OPS`]).
    ops: std::collections::VecDeque<foldhost_core::kv::OpRecord>,
    /// The recorded checkpoint: a revision the cursor covers and when its record was stored.
    checkpoint: Option<(u64, u64)>,
    /// During a state-sync start: the revision expected next ([`Fold::begin_state_sync`]).
    state_sync: Option<u64>,
    /// The revision the running watch reported level at ([`Fold::state_sync_level`]).
    level: Option<u64>,
    /// The stream identity to record with the next committed batch (a fold that records none yet:
    /// it is committed with the first cursor, see `check_identity`).
    pub(super) pending_identity: Option<foldhost_core::kv::StreamIdentity>,
    /// The operation ledger's life as committed (docs/writes.md, "When a node cannot vouch"),
    /// and whether ids were dropped since the last commit.
    life: protocol::LedgerLife,
    ids_dropped: bool,
}

impl<S: SnapshotStore> Fold<S> {
    /// A fold over `store`, resuming from the store's own cursor.
    pub fn new(store: SharedStore<S>, status: Arc<FoldStatus>) -> Result<Self, SnapshotError> {
        let applied = store.read()?.cursor();
        status
            .seq
            .fetch_max(applied.revision_or_zero(), Ordering::Relaxed);
        let mut fold = Fold {
            store,
            applied,
            requeued: Vec::new(),
            requeued_generation: None,
            store_streak: 0,
            apply_streak: 0,
            status,
            flush_started: None,
            warned: Default::default(),
            frozen: false,
            requeued_skipped: None,
            stamps: Default::default(),
            ops: Default::default(),
            checkpoint: None,
            state_sync: None,
            level: None,
            pending_identity: None,
            life: protocol::LedgerLife::default(),
            ids_dropped: false,
        };
        // The migration of folds written before bucket keys in the host's space were skipped:
        // forged retained records go, in one commit that does not move the cursor.
        let forged = fold.store.with_retained(RetainedIndex::take_forged)?;
        if !forged.is_empty() {
            let deletes: Vec<KvUpdate> = forged
                .into_iter()
                .map(|key| KvUpdate::Delete {
                    key,
                    version: foldhost_core::kv::VersionToken::UNKNOWN,
                })
                .collect();
            tracing::warn!(
                event = "retained_forged_deleted",
                records = deletes.len(),
                "deleting retained records no host wrote (a raw publish into the host's key space, folded by an older version)"
            );
            fold.store.write()?.apply(&deletes, applied)?;
        }
        fold.publish_retained()?;
        fold.load_life()?;
        fold.checkpoint = foldhost_core::retained::read_checkpoint(&*fold.store.read()?)?;
        fold.publish_checkpoint();
        if let Err(e) = fold.publish_watermark() {
            tracing::warn!(event = "ledger_watermark_unreadable", error = %e, "the operation ledger's watermark is unreadable");
        }
        Ok(fold)
    }

    /// Brings the status's applied-through and retained figures in line with the fold.
    fn publish_retained(&self) -> Result<(), SnapshotError> {
        let cursor = self.applied.revision();
        let (n, oldest, through) = self.store.with_retained(|r| {
            (
                r.len() as u64,
                r.oldest().map(|o| (o.position(), o.retained_unix_ms)),
                r.applied_through(cursor),
            )
        })?;
        let s = &self.status;
        s.cursor
            .store(self.applied.revision_or_zero(), Ordering::Relaxed);
        s.eviction_seen
            .store(u64::from(self.applied.memo().is_some()), Ordering::Relaxed);
        debug_assert!(
            through.unwrap_or(0) <= self.applied.revision_or_zero(),
            "applied-through never passes the cursor"
        );
        s.applied_through
            .store(through.unwrap_or(0), Ordering::Release);
        s.retained.store(n, Ordering::Relaxed);
        s.oldest_retained_revision
            .store(oldest.map_or(0, |o| o.0), Ordering::Relaxed);
        s.oldest_retained_unix_ms
            .store(oldest.map_or(0, |o| o.1), Ordering::Relaxed);
        s.applied_moved.notify_waiters();
        Ok(())
    }

    /// The applied (committed) cursor.
    pub fn cursor(&self) -> WatchCursor {
        self.applied
    }

    /// Notes when the server stored the message at `revision` (at most [`MAX_STAMPS`] kept).
    pub(crate) fn note_stamp(&mut self, revision: u64, server_time_unix_ns: u64) {
        if self.stamps.back().is_some_and(|(r, _)| *r >= revision) {
            return;
        }
        if self.stamps.len() >= MAX_STAMPS {
            self.stamps.pop_front();
        }
        self.stamps.push_back((revision, server_time_unix_ns));
    }

    /// `cursor` with its memo's time moved to the newest known server time of a message at or
    /// below its revision (never later than its own message's time: a resume judged by it is
    /// conservative). Stamps below the one used are dropped.
    fn stamped(&mut self, cursor: WatchCursor) -> WatchCursor {
        let (Some(memo), Some(rev)) = (cursor.memo(), cursor.revision()) else {
            return cursor;
        };
        let mut best = None;
        while let Some(&(r, t)) = self.stamps.front() {
            if r > rev {
                break;
            }
            best = Some(t);
            if self.stamps.len() > 1 && self.stamps[1].0 <= rev {
                self.stamps.pop_front();
            } else {
                break;
            }
        }
        match best {
            Some(t) if t > memo.server_time_unix_ns => {
                cursor.with_memo(Some(foldhost_core::kv::EvictionMemo {
                    server_time_unix_ns: t,
                }))
            }
            _ => cursor,
        }
    }

    /// Keeps the cursor where it is on every commit while `frozen` (the restore's difference
    /// carries real, older revisions that must not move it).
    pub(crate) fn freeze_cursor(&mut self, frozen: bool) {
        self.frozen = frozen;
    }

    /// Commits `cursor` with no data (a restore's final step, the eviction memo). The fold must
    /// be settled.
    pub(crate) async fn commit_position<A: Apply + ?Sized>(
        &mut self,
        cursor: WatchCursor,
        apply: &mut A,
    ) -> Result<(), AppliedError> {
        debug_assert!(self.is_settled(), "commit_position on an unsettled fold");
        let mut records = Vec::new();
        let intent = intent::with_intent(apply, cursor, &mut records);
        commit_settled(&self.store, records, cursor, &self.status).await?;
        self.applied = cursor;
        self.publish_retained()
            .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
        intent::on_applied_with(apply, cursor, intent).await;
        Ok(())
    }

    /// The stream identity committed with the fold (`None`: none recorded yet). A record that does
    /// not decode is corruption, reported as such.
    pub(crate) fn identity(
        &self,
    ) -> Result<Option<foldhost_core::kv::StreamIdentity>, SnapshotError> {
        let Some(e) = self
            .store
            .read()?
            .get(foldhost_core::retained::IDENTITY_KEY)?
        else {
            return Ok(None);
        };
        foldhost_core::kv::StreamIdentity::from_bytes(&e.value)
            .map(Some)
            .ok_or_else(|| {
                SnapshotError::Backend(format!(
                    "the fold's stream identity record ({} bytes) does not decode",
                    e.value.len()
                ))
            })
    }

    /// Commits `identity` as the stream this fold folds, with `cursor` ([`WatchCursor::NONE`]: the
    /// reset for a recreated stream). The fold must be settled.
    pub(super) async fn commit_identity<A: Apply + ?Sized>(
        &mut self,
        identity: &foldhost_core::kv::StreamIdentity,
        cursor: WatchCursor,
        apply: &mut A,
    ) -> Result<(), AppliedError> {
        debug_assert!(self.is_settled(), "commit_identity on an unsettled fold");
        self.pending_identity = None;
        let mut records = vec![identity_record(identity)];
        let intent = intent::with_intent(apply, cursor, &mut records);
        commit_settled(&self.store, records, cursor, &self.status).await?;
        self.applied = cursor;
        self.publish_retained()
            .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
        intent::on_applied_with(apply, cursor, intent).await;
        Ok(())
    }

    /// Drops every retained record (they belong to a stream that no longer exists), in one
    /// commit that keeps the cursor, and has the applier rebuild from the fold: a blocked key's
    /// guest view was its base, and is the fold's latest value from here on. The fold must be
    /// settled.
    pub(super) async fn drop_retained<A: Apply + ?Sized>(
        &mut self,
        apply: &mut A,
    ) -> Result<u64, AppliedError> {
        let store_err = |e| AppliedError::Store { streak: 0, last: e };
        let (deletes, keys): (Vec<KvUpdate>, Vec<String>) = self
            .store
            .with_retained(|r| {
                r.records()
                    .map(|r| (r.to_delete(), r.update.key().to_string()))
                    .unzip()
            })
            .map_err(store_err)?;
        if deletes.is_empty() {
            return Ok(0);
        }
        self.store
            .capture_pre_images(keys.iter().map(String::as_str))
            .map_err(store_err)?;
        let n = deletes.len() as u64;
        commit_settled(&self.store, deletes, self.applied, &self.status).await?;
        self.store
            .with_retained(|r| *r = RetainedIndex::default())
            .map_err(store_err)?;
        self.warned.clear();
        self.publish_retained().map_err(store_err)?;
        apply.discard();
        Ok(n)
    }

    /// Records durably, on the cursor, that this fold has seen retention evict a current value.
    pub(crate) async fn remember_eviction<A: Apply + ?Sized>(
        &mut self,
        apply: &mut A,
    ) -> Result<(), AppliedError> {
        if self.applied.memo().is_some() {
            return Ok(());
        }
        let cursor = self
            .applied
            .with_memo(Some(foldhost_core::kv::EvictionMemo::default()));
        self.commit_position(cursor, apply).await?;
        tracing::warn!(event = "eviction_memo_recorded", cursor = %cursor, "retention has evicted current values from this bucket: the fold will never trust its key listing again (eviction memo)");
        Ok(())
    }

    /// True when nothing waits to be committed.
    pub fn is_settled(&self) -> bool {
        self.requeued.is_empty() && self.requeued_skipped.is_none()
    }

    /// The store (for reads between flushes).
    pub fn store(&self) -> &SharedStore<S> {
        &self.store
    }

    /// `batch` without the bucket keys in the host's reserved space and the undecodable stored
    /// messages ([`protocol::undecodable_key`]; they never reach the guest or the store, the
    /// undecodable ones are counted in `status`, each once), the highest revision among those,
    /// and — when there were any — the batch as delivered (an apply failure hands that back, so a
    /// retry in halves never commits a cursor over a skipped key it has not reached).
    fn split_reserved(
        batch: Vec<KvUpdate>,
        status: &FoldStatus,
    ) -> (Vec<KvUpdate>, Option<u64>, Option<Vec<KvUpdate>>) {
        if batch.iter().all(|u| protocol::bucket_key_admitted(u.key())) {
            return (batch, None, None);
        }
        let original = batch.clone();
        let mut high = None;
        let kept = batch
            .into_iter()
            .filter(|u| {
                let admitted = protocol::bucket_key_admitted(u.key());
                if admitted {
                    return true;
                }
                high = high.max(u.revision());
                match protocol::parse_undecodable_key(u.key()) {
                    Some((subject, reason)) => {
                        let revision = u.revision().unwrap_or(0);
                        if status.note_skipped(revision, subject, reason) {
                            tracing::warn!(event = "message_skipped", revision, subject, reason = %reason, "skipped an undecodable stored message (see docs/design.md, \"What a stored message means\"): never folded, its revision passed");
                        }
                    }
                    None => {
                        tracing::warn!(event = "reserved_key_skipped", key = ?u.key(), revision = ?u.revision(), "skipped a bucket key in or before the host's reserved space (it starts with \\x01 or \\x00): never folded, never shown to a guest");
                    }
                }
                false
            })
            .collect();
        (kept, high, Some(original))
    }

    /// Runs one flush of `batch` through `apply` and the store. On an apply failure the batch is
    /// handed back in `Err`-free form (returned as `Some(batch)`) for a retry; on a transient store
    /// failure it is re-queued internally, and committed before any later batch reaches the guest
    /// (a later batch is handed back untouched while that commit still fails). Errors are
    /// fail-stops.
    pub async fn flush<A: Apply + ?Sized>(
        &mut self,
        batch: Vec<KvUpdate>,
        apply: &mut A,
    ) -> Result<Option<Vec<KvUpdate>>, AppliedError> {
        // A re-queued batch (applied by the guest, its commit failed) commits before the guest
        // sees anything newer: should the guest fail on the next batch and be rebuilt, it is
        // rebuilt from a fold that holds every batch the dropped instance applied.
        if !self.is_settled() && !batch.is_empty() {
            Box::pin(self.flush(Vec::new(), apply)).await?;
            if !self.is_settled() {
                // Still failing: the new batch goes back untouched (the guest never saw it).
                return Ok(Some(batch));
            }
        }
        // A swap candidate hydrating from the fold at C keeps seeing C: the keys this flush can
        // change record their views first ([`SharedStore::capture_pre_images`]).
        self.store
            .capture_pre_images(batch.iter().map(KvUpdate::key))
            .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
        let (batch, skipped_high, delivered) = Self::split_reserved(batch, &self.status);
        if batch.is_empty() && skipped_high.is_none() && self.is_settled() {
            return Ok(None);
        }
        let retained_now = if batch.is_empty() {
            Vec::new()
        } else {
            match self.parse_and_apply(&batch, apply).await? {
                Ok(retained) => retained,
                // Nothing of it committed: the batch as delivered goes back for a retry.
                Err(()) => return Ok(Some(delivered.unwrap_or(batch))),
            }
        };
        self.commit_batch(batch, retained_now, skipped_high, apply)
            .await
    }

    /// The applier's half of a flush: `parse` (holding back the updates of blocked keys and those
    /// after a deferred one), `apply`, then the retained records of what was deferred. `Ok(Err(()))`
    /// is a failed call below the streak limit (nothing of the batch applied), retried by the
    /// caller.
    async fn parse_and_apply<A: Apply + ?Sized>(
        &mut self,
        batch: &[KvUpdate],
        apply: &mut A,
    ) -> Result<Result<Vec<RetainedRecord>, ()>, AppliedError> {
        let t = Instant::now();
        self.flush_started.get_or_insert(t);
        // Updates of keys with retained records are held back before the guest sees them.
        let held = self
            .store
            .with_retained(|r| {
                if r.is_empty() {
                    vec![false; batch.len()]
                } else {
                    batch.iter().map(|u| r.is_blocked(u.key())).collect()
                }
            })
            .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
        let outcome = retention::parse_with_deferral(apply, batch, held).await;
        tracing::debug!(
            updates = batch.len(),
            first = ?batch.first().and_then(KvUpdate::revision),
            last = ?batch.last().and_then(KvUpdate::revision),
            deferred = ?outcome.as_ref().map(|d| d.iter().filter(|x| **x).count()),
            "batch parsed and applied"
        );
        let apply_us = t.elapsed().as_micros() as u64;
        self.status.last_apply_us.store(apply_us, Ordering::Relaxed);
        self.status.apply_us.observe(apply_us);
        self.status
            .longest_apply_us
            .fetch_max(apply_us, Ordering::Relaxed);
        let deferred = match outcome {
            Ok(d) => d,
            Err(e) => {
                self.status.set_error(Some(e.to_string()));
                self.apply_streak += 1;
                if self.apply_streak >= MAX_APPLY_FAILURES {
                    return Err(AppliedError::Apply {
                        streak: self.apply_streak,
                        last: e,
                    });
                }
                tracing::warn!(event = "fold_apply_retrying", error = %e, streak = self.apply_streak, "apply failed; the batch will be retried, nothing of it is committed");
                return Ok(Err(()));
            }
        };
        self.apply_streak = 0;
        if !deferred.contains(&true) {
            return Ok(Ok(Vec::new()));
        }
        self.retain(batch, &deferred)
            .map(Ok)
            .map_err(|e| AppliedError::Store { streak: 0, last: e })
    }

    /// The store's half of a flush: the re-queued updates, `batch`, the pending identity record
    /// and the retained records, committed with the cursor the batch moves to (or the old one while
    /// frozen); then `on-applied`. A failed commit re-queues all of it (fail-stop after
    /// [`protocol::MAX_STORE_APPLY_FAILURES`], or at once on a poisoned store).
    async fn commit_batch<A: Apply + ?Sized>(
        &mut self,
        batch: Vec<KvUpdate>,
        retained_now: Vec<RetainedRecord>,
        skipped_high: Option<u64>,
        apply: &mut A,
    ) -> Result<Option<Vec<KvUpdate>>, AppliedError> {
        self.settle_generation(apply);
        let generation = self.requeued_generation.unwrap_or(apply.generation());
        let mut raw = std::mem::take(&mut self.requeued);
        // A re-queued intent is replaced by this commit's own.
        raw.retain(|u| u.key() != ON_APPLIED_KEY);
        raw.extend(batch);
        // A re-queue after a failed commit carries it along.
        if let Some(identity) = self.pending_identity.take() {
            raw.push(identity_record(&identity));
        }
        // Retained records commit with their batch (reserved keys, unknown version: the cursor
        // is the batch's).
        raw.extend(retained_now.iter().map(RetainedRecord::to_put));
        let deferred_now = (
            retained_now.len(),
            retained_now.first().map(|r| r.update.key().to_string()),
        );
        let batch_high = raw
            .iter()
            .filter_map(KvUpdate::revision)
            .max()
            .max(skipped_high)
            .max(self.requeued_skipped);
        // The memo rides along with every cursor; a frozen fold (a restore in progress) commits
        // its data under the old cursor, so a crash re-runs the restore.
        let cursor = if self.frozen {
            self.applied
        } else {
            let moved = self
                .applied
                .moved_to(protocol::commit_cursor(self.applied.revision(), batch_high));
            self.stamped(moved)
        };
        let carried = self
            .carry_positions(&mut raw, cursor)
            .await
            .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
        let intent = intent::with_intent(apply, cursor, &mut raw);
        debug_assert!(
            cursor.revision_or_zero() >= self.applied.revision_or_zero(),
            "a commit never moves the cursor backward ({:?} after {:?})",
            cursor.revision(),
            self.applied.revision()
        );
        let t = Instant::now();
        let (raw, result) = commit(&self.store, raw, cursor).await?;
        let commit_us = t.elapsed().as_micros() as u64;
        self.status
            .last_commit_us
            .store(commit_us, Ordering::Relaxed);
        self.status.commit_us.observe(commit_us);
        match result {
            Ok(()) => {
                self.status.set_error(None);
                self.requeued_skipped = None;
                self.requeued_generation = None;
                self.store_streak = 0;
                self.status.store_failure_streak.store(0, Ordering::Relaxed);
                self.applied = cursor;
                self.positions_committed(carried)
                    .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
                self.publish_retained()
                    .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
                self.count_committed(&raw, deferred_now, cursor);
                crashpoint::hit(crashpoint::FOLD_BEFORE_ON_APPLIED);
                intent::on_applied_with(apply, cursor, intent).await;
                crashpoint::hit(crashpoint::FOLD_COMMITTED);
                Ok(None)
            }
            Err(e) => self.requeue_failed(e, raw, generation, skipped_high),
        }
    }

    /// A committed batch's figures (status and `/metrics`), and its deferrals said once.
    fn count_committed(
        &mut self,
        raw: &[KvUpdate],
        (deferred, first): (usize, Option<String>),
        cursor: WatchCursor,
    ) {
        let updates = raw.iter().filter(|u| !is_reserved(u.key())).count() as u64;
        self.status.committed.fetch_add(updates, Ordering::Relaxed);
        self.status
            .longest_batch
            .fetch_max(updates, Ordering::Relaxed);
        self.status.batches.fetch_add(1, Ordering::Relaxed);
        self.status.batch_updates.observe(updates);
        let through = self.status.applied_through.load(Ordering::Relaxed);
        if let Some((_, ns)) = self.stamps.iter().rev().find(|(r, _)| *r <= through) {
            self.status
                .applied_server_time_unix_ns
                .store(*ns, Ordering::Relaxed);
        }
        if let Some(started) = self.flush_started.take() {
            self.status
                .batch_us
                .observe(started.elapsed().as_micros() as u64);
        }
        if let (n @ 1.., Some(first)) = (deferred, first) {
            tracing::info!(event = "record_deferred", records = n, first_key = %first, cursor = %cursor, "records the guest deferred are retained until a guest version takes them");
        }
    }

    /// The generation rule: a re-queued batch was applied to one generation of the applier's
    /// state; when another is running now (the one that applied it was lost — a query trapped,
    /// say — and rebuilt from the committed fold, which lacks the batch), that state misses the
    /// batch. Dropped here, before the commit, so the next call rebuilds from a fold that holds
    /// it.
    fn settle_generation<A: Apply + ?Sized>(&self, apply: &mut A) {
        if !self.requeued.is_empty()
            && self
                .requeued_generation
                .is_some_and(|g| g != apply.generation())
        {
            tracing::warn!(event = "guest_build_discarded",
                applied_on = ?self.requeued_generation,
                now = apply.generation(),
                "a re-queued batch is retried on another build of the applier than the one that applied it: that build is dropped and rebuilt from the fold once the batch commits"
            );
            apply.discard();
        }
    }

    /// A failed commit: everything it carried is re-queued, with the applier generation that
    /// applied it (fail-stop after [`protocol::MAX_STORE_APPLY_FAILURES`], or at once on a
    /// poisoned store).
    fn requeue_failed(
        &mut self,
        e: SnapshotError,
        raw: Vec<KvUpdate>,
        generation: u64,
        skipped_high: Option<u64>,
    ) -> Result<Option<Vec<KvUpdate>>, AppliedError> {
        self.status.set_error(Some(e.to_string()));
        self.store_streak += 1;
        self.status
            .store_failure_streak
            .store(u64::from(self.store_streak), Ordering::Relaxed);
        let poisoned = matches!(e, SnapshotError::Poisoned { .. });
        if poisoned || protocol::store_failures_fatal(self.store_streak) {
            return Err(AppliedError::Store {
                streak: self.store_streak,
                last: e,
            });
        }
        tracing::warn!(event = "store_apply_retrying", error = %e, streak = self.store_streak, "store apply failed; batch re-queued");
        self.requeued = raw;
        self.requeued_generation = Some(generation);
        // The whole batch is re-queued, so its skipped keys' revisions ride with it.
        self.requeued_skipped = self.requeued_skipped.max(skipped_high);
        Ok(None)
    }
}

/// Commits `raw` with `cursor` (data and cursor atomically) and hands `raw` back with the outcome.
///
/// The commit blocks (a write, sometimes a compaction with fsync). On a multi-threaded runtime it
/// runs in place, handing this worker's other tasks to another thread — no thread hop per batch;
/// on a current-thread runtime it runs inline.
async fn commit<S: SnapshotStore>(
    store: &SharedStore<S>,
    raw: Vec<KvUpdate>,
    cursor: WatchCursor,
) -> Result<(Vec<KvUpdate>, Result<(), SnapshotError>), AppliedError> {
    let multi = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    // The binary runs a multi-thread runtime: the write blocks this worker only. On a
    // current-thread runtime (tests, the seeded simulation) it runs inline, on the one thread,
    // so a run's interleaving depends on nothing but its inputs: no blocking thread to race with.
    let r = if multi {
        tokio::task::block_in_place(|| store.write()?.apply(&raw, cursor))
    } else {
        store.write().and_then(|mut s| s.apply(&raw, cursor))
    };
    Ok((raw, r))
}

/// [`commit`] for a fold that is settled (a restore's last step, the eviction memo, the stream
/// identity, dropped retained records), retrying a failed write every [`STORE_RETRY_DELAY`] as a
/// flush does and fail-stopping only when [`protocol::store_failures_fatal`] says so: one
/// transient failure is never fatal by itself. A retry is safe because a failed apply leaves the
/// store exactly as before (or poisoned, which fails every retry).
async fn commit_settled<S: SnapshotStore>(
    store: &SharedStore<S>,
    mut raw: Vec<KvUpdate>,
    cursor: WatchCursor,
    status: &FoldStatus,
) -> Result<(), AppliedError> {
    let mut streak = 0u32;
    loop {
        let (back, r) = commit(store, raw, cursor).await?;
        let Err(e) = r else {
            status.store_failure_streak.store(0, Ordering::Relaxed);
            return Ok(());
        };
        streak += 1;
        status
            .store_failure_streak
            .store(u64::from(streak), Ordering::Relaxed);
        if protocol::store_failures_fatal(streak) {
            return Err(AppliedError::Store { streak, last: e });
        }
        tracing::warn!(event = "store_commit_retrying", error = %e, streak, "store commit failed; retrying");
        status.set_error(Some(e.to_string()));
        raw = back;
        tokio::time::sleep(STORE_RETRY_DELAY).await;
    }
}

/// The store update that records `identity` (a reserved key, unknown version: no cursor move).
fn identity_record(identity: &foldhost_core::kv::StreamIdentity) -> KvUpdate {
    KvUpdate::Put(KvEntry {
        key: foldhost_core::retained::IDENTITY_KEY.to_string(),
        value: bytes::Bytes::from(identity.to_bytes()),
        version: foldhost_core::kv::VersionToken::UNKNOWN,
    })
}

/// The entry an update leaves its key with (`None` after a delete or purge).
fn entry_of(u: &KvUpdate) -> Base {
    match u {
        KvUpdate::Put(e) => Some(e.clone()),
        KvUpdate::Delete { .. } | KvUpdate::Purge { .. } => None,
    }
}

/// Delay before re-committing a batch re-queued by a failed store apply.
pub(super) const STORE_RETRY_DELAY: Duration = Duration::from_millis(20);

/// Flushes until the batch and the re-queued updates are committed (shutdown, channel close, a
/// swap's or an export's settle, and the repairs' own batches).
///
/// A failed apply halves the next try, as the watch loop's `flush_ready` does: retried whole, a
/// batch holding one poison update would reach the streak limit with none of the updates before
/// it committed, and the fold would stop short of where it stops without a swap or an export.
pub async fn flush_all<S: SnapshotStore, A: Apply + ?Sized>(
    fold: &mut Fold<S>,
    batch: &mut Vec<KvUpdate>,
    max: usize,
    apply: &mut A,
) -> Result<(), AppliedError> {
    let mut cap = max.max(1);
    loop {
        let b = if batch.len() > cap {
            let rest = batch.split_off(cap);
            std::mem::replace(batch, rest)
        } else {
            std::mem::take(batch)
        };
        let tried = b.len();
        match fold.flush(b, apply).await? {
            Some(mut back) => {
                cap = (tried / 2).max(1);
                back.append(batch);
                *batch = back;
                tokio::time::sleep(
                    foldhost_core::protocol::Backoff::APPLY.after(fold.apply_streak),
                )
                .await;
            }
            None if fold.is_settled() && batch.is_empty() => return Ok(()),
            None if fold.is_settled() => cap = cap.saturating_mul(2).min(max.max(1)),
            None => tokio::time::sleep(STORE_RETRY_DELAY).await,
        }
    }
}
