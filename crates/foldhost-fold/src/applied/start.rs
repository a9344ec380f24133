//! What a fold does before and between watches: the bucket identity check, the eviction memo from
//! live retention, the cursor-less start, and the dispatch of a cursor-expiry repair.
//!
//! Invariant: each runs on a settled fold (nothing delivered waits uncommitted), and each decision is
//! a `protocol` function; this module only reads the inputs and carries the verdict out.

use std::sync::atomic::Ordering;

use foldhost_core::kv::{KvError, KvWatcher, StreamState, WatchCursor};
use foldhost_core::protocol;
use foldhost_core::snapshot::SnapshotStore;

use super::{AppliedError, Apply, Fold, FoldStatus, WatchOptions};

/// Readies a fold for its first watch; returns whether that watch is a state-sync re-list. Records
/// retained by an earlier run are offered first (this may be a version that decodes them: a restart
/// is an upgrade path as much as a swap); then the identity check (a fold of another stream is
/// refused, or reset, before any repair or watch trusts its cursor); retention is read (the memo);
/// and a start without a cursor repairs first when the fold holds data (a re-list would never remove
/// what it does not deliver) or when a restore is armed and the listing is not the truth.
pub(super) async fn prepare<S: SnapshotStore, A: Apply + ?Sized>(
    fold: &mut Fold<S>,
    apply: &mut A,
    watcher: &dyn KvWatcher,
    opts: &WatchOptions,
    status: &FoldStatus,
) -> Result<bool, AppliedError> {
    let store_err = |e| AppliedError::Store { streak: 0, last: e };
    fold.release(apply).await?;
    fold.check_grace(opts.defer_grace).map_err(store_err)?;
    // Identity and retention as of one moment (one request on NATS); after a reset for a
    // recreated stream, whose re-list took its time, retention is read again.
    let (found, retention) = watcher.state_and_retention().await?;
    let reset = check_identity_of(found, fold, apply, watcher, opts, status).await?;
    let retention = if reset {
        watcher.retention().await?
    } else {
        retention
    };
    note_retention(fold, apply, retention).await?;
    if reset || fold.cursor().revision().is_some() {
        return Ok(reset);
    }
    let has_data = fold
        .store()
        .read()
        .and_then(|s| foldhost_core::snapshot::bucket_len(&*s))
        .map_err(store_err)?
        > 0;
    let armed = if opts.repair.restore_armed() {
        opts.repair.mode
    } else {
        protocol::RepairMode::None
    };
    let truth = protocol::listing_truth(retention, fold.cursor().memo().is_some());
    if !protocol::cursorless_start_needs_repair(armed, has_data, truth) {
        // A plain state-sync re-list is all this start needs.
        return Ok(false);
    }
    if opts.repair.mode == protocol::RepairMode::None {
        // No repair allowed: the state-sync re-list alone, which cannot remove a key it does not
        // deliver.
        tracing::warn!(
            event = "fold_relist_keeping_keys",
            "the fold holds data but no cursor and --repair is none: re-listing without removing keys the bucket no longer has"
        );
        return Ok(false);
    }
    let why = KvError::CursorExpired {
        resume_from: 1,
        first_sequence: retention.map_or(0, |r| r.first_revision),
    };
    repair_expired(fold, apply, watcher, opts, status, why).await
}

pub(super) fn watches_for_eviction<S: SnapshotStore>(opts: &WatchOptions, fold: &Fold<S>) -> bool {
    matches!(
        opts.repair.mode,
        protocol::RepairMode::Relist | protocol::RepairMode::Auto
    ) && fold.cursor().memo().is_none()
}

/// Commits the eviction memo the first time retention is seen to have evicted a current value.
pub(super) async fn note_retention<S: SnapshotStore, A: Apply + ?Sized>(
    fold: &mut Fold<S>,
    apply: &mut A,
    retention: Option<protocol::Retention>,
) -> Result<(), AppliedError> {
    if let Some(r) = retention
        && protocol::retention_has_evicted(r)
        && fold.cursor().memo().is_none()
    {
        fold.remember_eviction(apply).await?;
    }
    Ok(())
}

/// The bucket identity check ([`protocol::stream_identity_check`]) at a watch (re)start: pins the
/// stream on the watcher and returns `false` when the fold folds it (recording it first when the
/// fold has none); refuses with [`AppliedError::Recreated`] when the stream is another one, or —
/// with `--on-recreated relist` — resets the fold for it and returns `true` (the next watch is a
/// state-sync re-list). The fold must be settled.
///
/// The reset, step by step, each a commit (a crash between two reruns the check, which finds the
/// stream still unrecorded and resets again): the old stream's retained records go (the guest
/// rebuilds from the fold); the key-listing diff deletes every fold key the new stream does not
/// list; the cursor goes to none (the eviction memo with it) and the new identity is recorded.
pub(super) async fn check_identity<S: SnapshotStore, A: Apply + ?Sized>(
    fold: &mut Fold<S>,
    apply: &mut A,
    watcher: &dyn KvWatcher,
    opts: &WatchOptions,
    status: &FoldStatus,
) -> Result<bool, AppliedError> {
    let found = watcher.stream_state().await?;
    check_identity_of(found, fold, apply, watcher, opts, status).await
}

/// [`check_identity`] against `found`, the stream's state read just before.
async fn check_identity_of<S: SnapshotStore, A: Apply + ?Sized>(
    found: Option<StreamState>,
    fold: &mut Fold<S>,
    apply: &mut A,
    watcher: &dyn KvWatcher,
    opts: &WatchOptions,
    status: &FoldStatus,
) -> Result<bool, AppliedError> {
    let Some(found) = found else {
        return Ok(false);
    };
    let store_err = |e| AppliedError::Store { streak: 0, last: e };
    let recorded = fold.identity().map_err(store_err)?;
    let cursor = fold.cursor();
    let verdict = protocol::stream_identity_check(
        recorded.as_ref().map(|r| *r == found.identity),
        cursor.revision(),
        found.last_sequence,
    );
    let bucket = watcher.bucket_name();
    status
        .stream_created_unix_ns
        .store(found.identity.created_unix_ns, Ordering::Relaxed);
    match verdict {
        protocol::IdentityVerdict::Same => {
            if let Some(why) = diverged(fold, watcher).await? {
                if opts.repair.on_diverged == protocol::OnRecreated::Refuse {
                    return Err(AppliedError::LogDiverged(format!(
                        "bucket {bucket}: log_diverged: {why}; the fold is untouched: rerun with --on-diverged relist to re-fold the bucket, or start from an empty store"
                    )));
                }
                tracing::warn!(event = "fold_reset_diverged", bucket = %bucket, reason = %why, "log_diverged, --on-diverged relist: re-folding the bucket as a cursor-less start");
                reset_for(
                    fold,
                    apply,
                    watcher,
                    opts,
                    status,
                    &found.identity,
                    "log_diverged",
                )
                .await?;
                watcher.pin_identity(found.identity);
                return Ok(true);
            }
        }
        protocol::IdentityVerdict::Record => {
            if cursor.revision().is_some() {
                tracing::warn!(event = "stream_identity_recorded", bucket = %bucket, identity = %found.identity, cursor = %cursor, "the fold records no stream identity (written by an older version): recording this stream's, which still covers the cursor");
            }
            // Committed with the next batch (the first cursor, on a new fold).
            fold.pending_identity = Some(found.identity.clone());
        }
        protocol::IdentityVerdict::Recreated | protocol::IdentityVerdict::CursorAhead => {
            let why = other_stream(verdict, recorded.as_ref(), cursor, &found);
            if opts.repair.on_recreated == protocol::OnRecreated::Refuse {
                return Err(AppliedError::Recreated(refusal(&bucket, &why)));
            }
            tracing::warn!(event = "fold_reset_recreated", bucket = %bucket, reason = %why, "--on-recreated relist: re-folding the new bucket as a cursor-less start");
            reset_for(
                fold,
                apply,
                watcher,
                opts,
                status,
                &found.identity,
                "recreated bucket",
            )
            .await?;
            watcher.pin_identity(found.identity);
            return Ok(true);
        }
    }
    watcher.pin_identity(found.identity);
    Ok(false)
}

/// Resets the fold for `identity`: the retained records go (the guest rebuilds from the fold),
/// the key-listing diff deletes every fold key the stream does not list, the checkpoint goes, the
/// operation ledger starts a new life, and
/// the cursor goes to none with the identity recorded; the next watch is a state-sync re-list.
async fn reset_for<S: SnapshotStore, A: Apply + ?Sized>(
    fold: &mut Fold<S>,
    apply: &mut A,
    watcher: &dyn KvWatcher,
    opts: &WatchOptions,
    status: &FoldStatus,
    identity: &foldhost_core::kv::StreamIdentity,
    why: &str,
) -> Result<(), AppliedError> {
    // The rows so far answer for the bucket's previous life, not this one: they stop answering
    // before anything of the new one is folded.
    fold.new_ledger_life()
        .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
    let dropped = fold.drop_retained(apply).await?;
    let report = crate::repair::relist(
        &mut Repairing { fold, apply },
        &opts.repair,
        watcher,
        &opts.scope,
        opts.batch.max,
    )
    .await?;
    fold.forget_checkpoint()
        .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
    fold.commit_identity(identity, WatchCursor::NONE, apply)
        .await?;
    status.seq.store(0, Ordering::Relaxed);
    status.repairs.fetch_add(1, Ordering::Relaxed);
    status.count_repair("reset", "done");
    tracing::warn!(event = "fold_reset", bucket = %watcher.bucket_name(), retained_dropped = dropped, listed = report.listed, deleted = report.deleted, "{why}: fold reset; re-listing the bucket");
    Ok(())
}

/// Why the fold may not resume on this log (`log_diverged`): the log holds another record at the
/// fold's checkpoint ([`protocol::checkpoint_verdict`]). `None`: the same record, or nothing to
/// compare.
async fn diverged<S: SnapshotStore>(
    fold: &Fold<S>,
    watcher: &dyn KvWatcher,
) -> Result<Option<String>, AppliedError> {
    let Some(recorded) = fold.checkpoint() else {
        return Ok(None);
    };
    let found = watcher.stored_at(recorded.0).await?;
    Ok(match protocol::checkpoint_verdict(Some(recorded), found) {
        protocol::CheckpointVerdict::Diverged {
            revision,
            recorded_unix_ns,
            found_unix_ns,
        } => Some(format!(
            "the log holds another record at the fold's checkpoint revision {revision} (stored at {}, the one folded at {}): the broker was restored from an older copy and written past this fold",
            foldhost_core::status::rfc3339(found_unix_ns).unwrap_or_default(),
            foldhost_core::status::rfc3339(recorded_unix_ns).unwrap_or_default()
        )),
        protocol::CheckpointVerdict::Same | protocol::CheckpointVerdict::Unverified => None,
    })
}

/// Why a fold may not resume on `found` (for a [`protocol::IdentityVerdict::Recreated`] or
/// [`protocol::IdentityVerdict::CursorAhead`] verdict), in words naming both streams.
fn other_stream(
    verdict: protocol::IdentityVerdict,
    recorded: Option<&foldhost_core::kv::StreamIdentity>,
    cursor: WatchCursor,
    found: &foldhost_core::kv::StreamState,
) -> String {
    let was = match recorded {
        Some(r) => r.to_string(),
        None => "a stream it did not record".to_string(),
    };
    if verdict == protocol::IdentityVerdict::Recreated {
        format!(
            "the fold folds {was} but the bucket is now {} (deleted and created again, or another bucket's fold)",
            found.identity
        )
    } else {
        format!(
            "the fold's cursor {cursor} is above the last sequence {} of {} (recreated, or the server lost its tail)",
            found.last_sequence, found.identity
        )
    }
}

/// The one line a refused run ends with.
fn refusal(bucket: &str, why: &str) -> String {
    format!(
        "bucket {bucket}: {why}; the fold is untouched: rerun with --on-recreated relist to re-fold the new bucket, or start from an empty store"
    )
}

/// The refusal line for a fold (its recorded identity and cursor, read without opening it for
/// writing) on the stream `found`, or `None` when the fold may go on (or needs only to record the
/// identity). The run checks this before it opens the store, so a refused run writes nothing —
/// not even the store's own open-time housekeeping.
pub fn identity_refusal(
    bucket: &str,
    recorded: Option<&foldhost_core::kv::StreamIdentity>,
    cursor: WatchCursor,
    found: &foldhost_core::kv::StreamState,
) -> Option<String> {
    let verdict = protocol::stream_identity_check(
        recorded.map(|r| *r == found.identity),
        cursor.revision(),
        found.last_sequence,
    );
    match verdict {
        protocol::IdentityVerdict::Same | protocol::IdentityVerdict::Record => None,
        _ => Some(refusal(
            bucket,
            &other_stream(verdict, recorded, cursor, found),
        )),
    }
}

/// Repairs an expired cursor (`why`) as `--repair` and the bucket's live retention allow; returns
/// whether the next watch is a state-sync re-list. The fold must be settled.
pub(super) async fn repair_expired<S: SnapshotStore, A: Apply + ?Sized>(
    fold: &mut Fold<S>,
    apply: &mut A,
    watcher: &dyn KvWatcher,
    opts: &WatchOptions,
    status: &FoldStatus,
    why: KvError,
) -> Result<bool, AppliedError> {
    use crate::repair::{self, RepairError};
    let retention = watcher.retention().await?;
    note_retention(fold, apply, retention).await?;
    let seen = fold.cursor().memo().is_some();
    let plan = protocol::plan_repair(opts.repair.mode, protocol::listing_truth(retention, seen));
    tracing::warn!(event = "repair_started", reason = %why, ?plan, cursor = %fold.cursor(), "cursor expired: repairing");
    let kind = match plan {
        protocol::RepairPlan::Restore => "restore",
        _ => "relist",
    };
    let repaired: Result<_, AppliedError> = async {
        let report = match plan {
        protocol::RepairPlan::None => return Err(AppliedError::Watch(why)),
        protocol::RepairPlan::RefuseRelist => {
            let because = if seen {
                "this fold has seen the bucket's retention evict current values (eviction memo)"
            } else if retention.is_none() {
                "the bucket cannot report its retention"
            } else {
                "the bucket's retention evicts current values (max_age, a discard-old limit or per-message TTLs) and has evicted"
            };
            return Err(RepairError::Refused(format!(
                "{why}; a key-listing repair would delete keys that only aged out: {because} (use --repair restore with --restore-from)"
            ))
            .into());
        }
        protocol::RepairPlan::Relist => {
            repair::relist(
                &mut Repairing { fold, apply },
                &opts.repair,
                watcher,
                &opts.scope,
                opts.batch.max,
            )
            .await?
        }
        protocol::RepairPlan::Restore => repair::restore(
            &mut Repairing { fold, apply },
            &opts.repair,
            watcher,
            &opts.scope,
            opts.batch.max,
        )
        .await
        .map_err(|e| match e {
            AppliedError::Repair(RepairError::Refused(r)) => {
                AppliedError::Repair(RepairError::Refused(format!("{why}; {r}")))
            }
            other => other,
        })?,
        };
        Ok(report)
    }
    .await;
    match &repaired {
        Ok(_) => status.count_repair(kind, "done"),
        Err(AppliedError::Repair(RepairError::Refused(_))) => status.count_repair(kind, "refused"),
        Err(AppliedError::Watch(_)) => {}
        Err(_) => status.count_repair(kind, "failed"),
    }
    let report = repaired?;
    status.repairs.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(event = "repair_finished", kind = report.kind, listed = report.listed, deleted = report.deleted, taken = report.taken, cursor = ?report.cursor, "cursor-expiry repair done");
    Ok(report.kind == "relist")
}

/// The running fold as a repair sees it ([`crate::repair::RepairTarget`]): the fold and its
/// applier, committing through [`Fold::flush`] like every other batch.
struct Repairing<'a, S: SnapshotStore, A: Apply + ?Sized> {
    fold: &'a mut Fold<S>,
    apply: &'a mut A,
}

#[async_trait::async_trait]
impl<S: SnapshotStore, A: Apply + ?Sized> crate::repair::RepairTarget for Repairing<'_, S, A> {
    type Store = S;
    type Error = AppliedError;

    fn store(&self) -> foldhost_core::view::SharedStore<S> {
        self.fold.store().clone()
    }

    fn cursor(&self) -> WatchCursor {
        self.fold.cursor()
    }

    async fn commit_all(
        &mut self,
        batch: &mut Vec<foldhost_core::kv::KvUpdate>,
        max: usize,
    ) -> Result<(), AppliedError> {
        super::fold::flush_all(self.fold, batch, max, self.apply).await
    }

    fn freeze_cursor(&mut self, frozen: bool) {
        self.fold.freeze_cursor(frozen);
    }

    async fn commit_position(&mut self, cursor: WatchCursor) -> Result<(), AppliedError> {
        self.fold.commit_position(cursor, self.apply).await
    }
}
