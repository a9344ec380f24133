//! `watch_applied`: the cursor-after-apply combinator, and [`Fold`], the one place a batch, the
//! applied cursor and the store change together.
//!
//! The invariant (seed 000, "The resume guarantee"): **a persisted or reported cursor C implies every
//! update with revision ≤ C has had `apply` return and is durable in the store.** Concretely, on each
//! flush: `parse` the batch, `apply` what it accepted, then `store.apply(raw batch, cursor)` (data
//! and cursor atomically), and only then `on_applied(cursor)` and the status advance. Nothing moves
//! the cursor on receipt.
//!
//! Further rules kept here:
//! - The cursor is the store's. After a transient store failure the raw batch is re-queued in front
//!   of the next one (never dropped: a dropped batch followed by a good flush would leave a hole the
//!   restart never re-reads), and after [`protocol::MAX_STORE_APPLY_FAILURES`] in a row the fold
//!   fail-stops. A poisoned store fail-stops at once.
//! - `batch_high` covers rejected (skipped) updates; an update with the unknown version never mints
//!   or lowers the cursor ([`protocol::commit_cursor`]).
//! - A failed `parse`/`apply` commits nothing of its batch; the batch is retried (with backoff) in
//!   halves, so the updates before a poison one still commit and the fold stops exactly at it; after
//!   [`MAX_APPLY_FAILURES`] failures in a row the fold fail-stops naming the applier and its message.
//! - Queries ([`Control::Query`]) run between flushes, never inside one.
//! - A batch flushes when the window elapses, when it reaches `max`, on shutdown, and when the watch
//!   channel closes.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::mpsc;

use crate::crashpoint;
use crate::kv::{KvEntry, KvError, KvUpdate, KvWatcher, WatchCursor, WatchEvent, WatchScope};
use crate::protocol;
use crate::retained::{Base, RetainedIndex, RetainedRecord, is_reserved};
use crate::snapshot::{SharedStore, SnapshotError, SnapshotStore};

/// Batching knobs (seed defaults: 10 ms window, 100 updates, channel of 256).
#[derive(Clone, Copy, Debug)]
pub struct BatchConfig {
    /// Longest a batch stays open before it flushes.
    pub window: Duration,
    /// Updates per batch before an early flush.
    pub max: usize,
    /// Depth of the watch → fold channel, in updates (it carries chunks of up to
    /// [`crate::nats::WATCH_CHUNK`], so it is rounded up to whole chunks). A full channel
    /// backpressures the watch (by design).
    pub channel_capacity: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            window: Duration::from_millis(10),
            max: 100,
            channel_capacity: 256,
        }
    }
}

/// Consecutive failed `parse`/`apply` calls before the fold fail-stops.
pub const MAX_APPLY_FAILURES: u32 = 5;

/// What `parse` says of one update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Apply it.
    Accept,
    /// Irrelevant or corrupt: nothing to apply, but the cursor covers it.
    Skip,
    /// This version cannot decode it: the host retains it (durably, in the fold) for a later
    /// version, and holds back every later update of its key ([`crate::retained`]).
    Defer,
}

/// A failed `parse` or `apply`, with the applier's own words.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
#[error("{applier}: {call} failed: {message}")]
pub struct ApplyError {
    /// Who failed (a guest's name and version, or a native applier's name).
    pub applier: String,
    /// Which call (`parse`, `apply`).
    pub call: &'static str,
    /// The applier's message.
    pub message: String,
}

/// The domain-logic seam: what turns a batch of updates into live structures. A native Rust
/// implementation and a WebAssembly guest sit behind the same trait. Calls cross it once per batch.
#[async_trait]
pub trait Apply: Send {
    /// Name and version, for status and errors.
    fn describe(&self) -> String;

    /// One verdict per update of `batch`, in order.
    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError>;

    /// Applies the updates of `batch` that `verdicts` accepted (the batch `parse` just saw).
    async fn apply(&mut self, batch: &[KvUpdate], verdicts: &[Verdict]) -> Result<(), ApplyError>;

    /// Called after the store committed through `cursor`.
    async fn on_applied(&mut self, cursor: WatchCursor);

    /// Drops whatever state the applier built that the committed fold does not back (after a
    /// failed release of retained records): the next call rebuilds it from the fold.
    fn discard(&mut self) {}

    /// Replaces the applier's logic with the component `bytes` (named `what`), rebuilt from the
    /// committed fold, keeping the old one when anything fails. Called between batches with the fold
    /// settled (everything applied is committed).
    async fn swap(&mut self, what: &str, _bytes: &[u8]) -> Result<SwapReport, ApplyError> {
        Err(ApplyError {
            applier: self.describe(),
            call: "swap",
            message: format!("this applier cannot be replaced by {what}"),
        })
    }

    /// Answers a query against the structure the applier built. Called between batches only, so it
    /// never sees a half-applied batch.
    async fn query(&mut self, _request: &[u8]) -> Result<Vec<u8>, ApplyError> {
        Err(ApplyError {
            applier: self.describe(),
            call: "query",
            message: "this applier answers no queries".into(),
        })
    }
}

/// What a hot swap did.
#[derive(Clone, Debug, serde::Serialize, PartialEq, Eq)]
pub struct SwapReport {
    /// The applier before (name@version).
    pub from: String,
    /// The applier after.
    pub to: String,
    /// Entries the new instance was rebuilt from.
    pub hydrated_entries: u64,
    /// How long the rebuild took, milliseconds.
    pub hydrate_ms: u64,
    /// How long the fold was paused (settling, rebuild, switch, release), milliseconds.
    pub paused_ms: u64,
    /// Retained records the new version applied and released.
    pub released: u64,
    /// Retained records still retained after the swap (the new version deferred them too).
    pub still_retained: u64,
}

/// A request to the running fold, handled between batches.
pub enum Control {
    /// Replace the applier (a hot swap).
    Swap {
        /// The new component.
        bytes: Vec<u8>,
        /// What to call it in errors (a file name).
        what: String,
        /// Where the outcome goes.
        reply: tokio::sync::oneshot::Sender<Result<SwapReport, ApplyError>>,
    },
    /// Copy the committed fold into `dir` (an existing empty directory) with
    /// [`SnapshotStore::export_to`], after flushing everything pending: the copy's cursor is the
    /// applied cursor, exactly. The rest of an export (verify, hash, manifest) runs off the fold's
    /// path ([`crate::artifact::seal`]).
    Export {
        /// Where the backend's files go.
        dir: std::path::PathBuf,
        /// The cursor the copy holds, and the number of keys in it, or why it failed.
        reply: tokio::sync::oneshot::Sender<Result<(WatchCursor, u64), SnapshotError>>,
    },
    /// Run a query against the applier.
    Query {
        /// The request bytes.
        request: Vec<u8>,
        /// Where the answer goes.
        reply: tokio::sync::oneshot::Sender<Result<Vec<u8>, ApplyError>>,
    },
}

/// Why a fold stopped.
#[derive(Debug, thiserror::Error)]
pub enum AppliedError {
    /// The watch failed (including `CursorExpired`).
    #[error(transparent)]
    Watch(#[from] KvError),
    /// The store failed too many times in a row, or is poisoned.
    #[error("store failed {streak} time(s) in a row, fail-stop: {last}")]
    Store {
        /// Consecutive failures.
        streak: u32,
        /// The last error.
        last: SnapshotError,
    },
    /// The applier failed too many times in a row.
    #[error("apply failed {streak} time(s) in a row, fail-stop: {last}")]
    Apply {
        /// Consecutive failures.
        streak: u32,
        /// The last error.
        last: ApplyError,
    },
    /// A blocking store task panicked or was cancelled.
    #[error("store task: {0}")]
    Task(String),
    /// An expired cursor could not be repaired (the fold is untouched by every refusal).
    #[error(transparent)]
    Repair(#[from] crate::repair::RepairError),
    /// The bucket's stream is not the one the fold folds (`--on-recreated refuse`); the fold is
    /// untouched.
    #[error("{0}")]
    Recreated(String),
}

/// Live figures of a running fold, shared with status, metrics and progress displays.
#[derive(Debug, Default)]
pub struct FoldStatus {
    /// Highest revision delivered by the watch (`seq`); 0 before any.
    pub seq: AtomicU64,
    /// Highest revision every update at or below which is applied and committed
    /// (`applied_through`: the cursor, held below the oldest retained record); 0 before any.
    pub applied_through: AtomicU64,
    /// The store's cursor: everything through it is applied or retained, and committed; 0 before
    /// any.
    pub cursor: AtomicU64,
    /// Updates delivered since start.
    pub delivered: AtomicU64,
    /// Updates committed since start.
    pub committed: AtomicU64,
    /// Batches committed since start.
    pub batches: AtomicU64,
    /// Updates the server still had pending at the last progress report (hydration).
    pub pending: AtomicU64,
    /// Duration of the last `apply` call, microseconds.
    pub last_apply_us: AtomicU64,
    /// Duration of the last store commit, microseconds.
    pub last_commit_us: AtomicU64,
    /// Consecutive store failures right now.
    pub store_failure_streak: AtomicU64,
    /// 1 once the watch reported it is level with the stream as of its start.
    pub caught_up: AtomicU64,
    /// The last apply or store failure (cleared by the next successful commit).
    pub last_error: std::sync::Mutex<Option<String>>,
    /// The applier now running (name@version).
    pub guest: std::sync::Mutex<String>,
    /// Records retained (deferred by a guest), waiting for a version that can decode them.
    pub retained: AtomicU64,
    /// Revision of the oldest retained record (0: none).
    pub oldest_retained_revision: AtomicU64,
    /// When the oldest retained record was retained, Unix milliseconds (0: none).
    pub oldest_retained_unix_ms: AtomicU64,
    /// Records retained longer than the grace, named (key and revision), at most
    /// [`MAX_WARNINGS`] of them.
    pub warnings: std::sync::Mutex<Vec<String>>,
    /// 1 once the fold's cursor carries the eviction memo (it has seen retention evict a current
    /// value, and never trusts the bucket's listing again).
    pub eviction_seen: AtomicU64,
    /// Cursor-expiry repairs completed since start.
    pub repairs: AtomicU64,
}

/// Most delivery time stamps a fold keeps (one arrives per chunk of at most 64 updates).
pub const MAX_STAMPS: usize = 1024;

/// Most warnings kept in [`FoldStatus::warnings`].
pub const MAX_WARNINGS: usize = 16;

impl FoldStatus {
    /// Records the applier now running.
    pub fn set_guest(&self, name: &str) {
        if let Ok(mut g) = self.guest.lock() {
            *g = name.to_string();
        }
    }

    /// The applier now running.
    pub fn guest(&self) -> String {
        self.guest.lock().map(|g| g.clone()).unwrap_or_default()
    }

    fn set_error(&self, e: Option<String>) {
        if let Ok(mut g) = self.last_error.lock() {
            *g = e;
        }
    }

    /// The last failure, if the fold has not committed since.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().ok().and_then(|g| g.clone())
    }

    /// The current warnings.
    pub fn warnings(&self) -> Vec<String> {
        self.warnings.lock().map(|g| g.clone()).unwrap_or_default()
    }
}

/// How long a record may stay retained before a warning names it (seed 004's default).
pub const DEFAULT_DEFER_GRACE: Duration = Duration::from_secs(30 * 60);

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Options for one run of [`watch_applied`].
#[derive(Clone, Debug)]
pub struct WatchOptions {
    /// What to watch.
    pub scope: WatchScope,
    /// Batching.
    pub batch: BatchConfig,
    /// Return once the fold has applied everything the stream held when the watch started.
    pub catch_up: bool,
    /// A record retained longer than this raises a warning naming it.
    pub defer_grace: Duration,
    /// How an expired cursor is repaired (`--repair`, `--restore-from`).
    pub repair: crate::repair::RepairConfig,
}

/// What a finished fold reports.
#[derive(Debug, Clone, Copy)]
pub struct Finished {
    /// The store's cursor: everything through it is applied and committed.
    pub cursor: WatchCursor,
}

/// The batch, the applied cursor and the store: every change to the fold goes through here.
pub struct Fold<S: SnapshotStore> {
    store: SharedStore<S>,
    applied: WatchCursor,
    /// Raw updates whose `apply` returned but whose store commit failed: committed first next time.
    requeued: Vec<KvUpdate>,
    store_streak: u32,
    apply_streak: u32,
    status: Arc<FoldStatus>,
    /// Store keys of retained records already warned about (each is warned about once per run).
    warned: std::collections::BTreeSet<String>,
    /// While set (a restore folding its difference), commits keep the cursor where it is.
    frozen: bool,
    /// The highest revision of a skipped reserved-space bucket key ([`protocol::bucket_key_admitted`])
    /// whose batch is re-queued whole after a failed store commit: it rides with `requeued`.
    requeued_skipped: Option<u64>,
    /// Server times of recently delivered revisions (ascending), for the memo's time.
    stamps: std::collections::VecDeque<(u64, u64)>,
    /// The stream identity to record with the next committed batch (a fold that records none yet:
    /// it is committed with the first cursor, see `check_identity`).
    pending_identity: Option<crate::kv::StreamIdentity>,
}

impl<S: SnapshotStore> Fold<S> {
    /// A fold over `store`, resuming from the store's own cursor.
    pub fn new(store: SharedStore<S>, status: Arc<FoldStatus>) -> Result<Self, SnapshotError> {
        let applied = store.read()?.cursor();
        status
            .seq
            .fetch_max(applied.revision_or_zero(), Ordering::Relaxed);
        let fold = Fold {
            store,
            applied,
            requeued: Vec::new(),
            store_streak: 0,
            apply_streak: 0,
            status,
            warned: Default::default(),
            frozen: false,
            requeued_skipped: None,
            stamps: Default::default(),
            pending_identity: None,
        };
        // The migration of folds written before bucket keys in the host's space were skipped:
        // forged retained records go, in one commit that does not move the cursor.
        let forged = fold.store.with_retained(RetainedIndex::take_forged)?;
        if !forged.is_empty() {
            let deletes: Vec<KvUpdate> = forged
                .into_iter()
                .map(|key| KvUpdate::Delete {
                    key,
                    version: crate::kv::VersionToken::UNKNOWN,
                })
                .collect();
            tracing::warn!(
                records = deletes.len(),
                "deleting retained records no host wrote (a raw publish into the host's key space, folded by an older version)"
            );
            fold.store.write()?.apply(&deletes, applied)?;
        }
        fold.publish_retained()?;
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
        s.applied_through
            .store(through.unwrap_or(0), Ordering::Relaxed);
        s.retained.store(n, Ordering::Relaxed);
        s.oldest_retained_revision
            .store(oldest.map_or(0, |o| o.0), Ordering::Relaxed);
        s.oldest_retained_unix_ms
            .store(oldest.map_or(0, |o| o.1), Ordering::Relaxed);
        Ok(())
    }

    /// Warns (once per record and run) about records retained longer than `grace`, and lists them
    /// in the status.
    pub fn check_grace(&mut self, grace: Duration) -> Result<(), SnapshotError> {
        if self.status.retained.load(Ordering::Relaxed) == 0 {
            if let Ok(mut w) = self.status.warnings.lock() {
                w.clear();
            }
            return Ok(());
        }
        let now = now_unix_ms();
        let grace_ms = grace.as_millis() as u64;
        let overdue: Vec<(String, String, u64, u64)> = self.store.with_retained(|r| {
            r.records()
                .filter(|rec| now.saturating_sub(rec.retained_unix_ms) > grace_ms)
                .map(|rec| {
                    (
                        rec.store_key(),
                        rec.update.key().to_string(),
                        rec.position(),
                        now.saturating_sub(rec.retained_unix_ms) / 1000,
                    )
                })
                .collect()
        })?;
        let mut lines = Vec::new();
        for (store_key, key, revision, age_s) in &overdue {
            if self.warned.insert(store_key.clone()) {
                tracing::warn!(key = %key, revision, age_s, grace_s = grace.as_secs(), "record retained longer than the grace: no running guest version can decode it");
            }
            if lines.len() < MAX_WARNINGS {
                lines.push(format!(
                    "{key} at revision {revision} retained {age_s} s, longer than the {} s grace",
                    grace.as_secs()
                ));
            }
        }
        if overdue.len() > MAX_WARNINGS {
            lines.push(format!(
                "and {} more retained records past the grace",
                overdue.len() - MAX_WARNINGS
            ));
        }
        if let Ok(mut w) = self.status.warnings.lock() {
            *w = lines;
        }
        Ok(())
    }

    /// Records of `batch` marked in `deferred`, as retained records; the first of each key not
    /// blocked yet carries the key's base (its entry just before it). Updates the index.
    fn retain(
        &mut self,
        batch: &[KvUpdate],
        deferred: &[bool],
    ) -> Result<Vec<RetainedRecord>, SnapshotError> {
        let now = now_unix_ms();
        let store = self.store.clone();
        let requeued = &self.requeued;
        let at = self.applied.revision_or_zero();
        self.store.with_retained(|index| {
            let mut out = Vec::new();
            // The position of an update of unknown revision: the highest revision before it, in
            // the committed fold or earlier in this batch (log order, never 0).
            let mut position = at;
            let mut positions = Vec::with_capacity(batch.len());
            for u in batch {
                positions.push(position);
                position = position.max(u.revision().unwrap_or(0));
            }
            for (i, u) in batch.iter().enumerate().filter(|(i, _)| deferred[*i]) {
                let key = u.key();
                let base = if index.is_blocked(key) {
                    None
                } else {
                    // The key's last update before this one is applied (else the key would be
                    // blocked): in this batch, in the re-queued updates, or committed.
                    let before = batch[..i]
                        .iter()
                        .rev()
                        .chain(requeued.iter().rev().filter(|r| !is_reserved(r.key())))
                        .find(|p| p.key() == key);
                    Some(match before {
                        Some(p) => entry_of(p),
                        None => store.read()?.get(key)?,
                    })
                };
                let order = u
                    .revision()
                    .is_none()
                    .then(|| (positions[i], index.next_sequence()));
                let r = RetainedRecord {
                    update: u.clone(),
                    retained_unix_ms: now,
                    base,
                    order,
                };
                index.insert(r.clone());
                out.push(r);
            }
            Ok(out)
        })?
    }

    /// Offers every retained record, in log order, to `apply` (after a swap or at start); what it
    /// accepts or skips is released, in one commit that does not move the cursor. What it defers
    /// again stays retained, with its key's base moved past what was released. A failed offer
    /// leaves everything retained and has the applier rebuild from the fold.
    pub async fn release<A: Apply + ?Sized>(
        &mut self,
        apply: &mut A,
    ) -> Result<(u64, u64), AppliedError> {
        let store_err = |e| AppliedError::Store { streak: 0, last: e };
        let (records, old) = self
            .store
            .with_retained(|r| (r.records().cloned().collect::<Vec<_>>(), r.clone()))
            .map_err(store_err)?;
        if records.is_empty() {
            return Ok((0, 0));
        }
        let batch: Vec<KvUpdate> = records.iter().map(|r| r.update.clone()).collect();
        let deferred = match parse_with_deferral(apply, &batch, vec![false; batch.len()]).await {
            Ok(d) => d,
            Err(e) => {
                apply.discard();
                tracing::warn!(error = %e, retained = records.len(), "retained records could not be applied; they stay retained");
                return Ok((0, records.len() as u64));
            }
        };
        let mut index = RetainedIndex::default();
        let mut writes = Vec::new();
        let mut released_last: std::collections::HashMap<&str, Base> = Default::default();
        for (r, d) in records.iter().zip(&deferred) {
            let key = r.update.key();
            if !d {
                writes.push(r.to_delete());
                released_last.insert(key, entry_of(&r.update));
                continue;
            }
            let base = if index.is_blocked(key) {
                None
            } else {
                match released_last.get(key) {
                    Some(b) => Some(b.clone()),
                    None => old.base(key).cloned(),
                }
            };
            let kept = RetainedRecord { base, ..r.clone() };
            if kept != *r {
                writes.push(kept.to_put());
            }
            index.insert(kept);
        }
        let released = records.len() - index.len();
        let cursor = self.applied;
        let (_, result) = commit(&self.store, writes, cursor).await?;
        if let Err(e) = result {
            apply.discard();
            self.status.set_error(Some(e.to_string()));
            if matches!(e, SnapshotError::Poisoned { .. }) {
                return Err(store_err(e));
            }
            tracing::warn!(error = %e, "releasing retained records failed to commit; they stay retained");
            return Ok((0, records.len() as u64));
        }
        let still = index.len() as u64;
        self.store
            .with_retained(|r| *r = index)
            .map_err(store_err)?;
        self.warned.clear();
        if still == 0
            && let Ok(mut w) = self.status.warnings.lock()
        {
            w.clear();
        }
        self.publish_retained().map_err(store_err)?;
        apply.on_applied(cursor).await;
        tracing::info!(
            released,
            still_retained = still,
            "retained records released"
        );
        Ok((released as u64, still))
    }

    /// The applied (committed) cursor.
    pub fn cursor(&self) -> WatchCursor {
        self.applied
    }

    /// Notes when the server stored the message at `revision` (at most [`MAX_STAMPS`] kept).
    pub fn note_stamp(&mut self, revision: u64, server_time_unix_ns: u64) {
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
                cursor.with_memo(Some(crate::kv::EvictionMemo {
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
    pub async fn commit_position<A: Apply + ?Sized>(
        &mut self,
        cursor: WatchCursor,
        apply: &mut A,
    ) -> Result<(), AppliedError> {
        debug_assert!(self.is_settled(), "commit_position on an unsettled fold");
        let (_, r) = commit(&self.store, Vec::new(), cursor).await?;
        r.map_err(|e| AppliedError::Store { streak: 0, last: e })?;
        self.applied = cursor;
        self.publish_retained()
            .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
        apply.on_applied(cursor).await;
        Ok(())
    }

    /// The stream identity committed with the fold (`None`: none recorded yet). A record that does
    /// not decode is corruption, reported as such.
    pub fn identity(&self) -> Result<Option<crate::kv::StreamIdentity>, SnapshotError> {
        let Some(e) = self.store.read()?.get(crate::retained::IDENTITY_KEY)? else {
            return Ok(None);
        };
        crate::kv::StreamIdentity::from_bytes(&e.value)
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
    async fn commit_identity<A: Apply + ?Sized>(
        &mut self,
        identity: &crate::kv::StreamIdentity,
        cursor: WatchCursor,
        apply: &mut A,
    ) -> Result<(), AppliedError> {
        debug_assert!(self.is_settled(), "commit_identity on an unsettled fold");
        self.pending_identity = None;
        let record = vec![identity_record(identity)];
        let (_, r) = commit(&self.store, record, cursor).await?;
        r.map_err(|e| AppliedError::Store { streak: 0, last: e })?;
        self.applied = cursor;
        self.publish_retained()
            .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
        apply.on_applied(cursor).await;
        Ok(())
    }

    /// Drops every retained record (they belong to a stream that no longer exists), in one
    /// commit that keeps the cursor, and has the applier rebuild from the fold: a blocked key's
    /// guest view was its base, and is the fold's latest value from here on. The fold must be
    /// settled.
    async fn drop_retained<A: Apply + ?Sized>(
        &mut self,
        apply: &mut A,
    ) -> Result<u64, AppliedError> {
        let store_err = |e| AppliedError::Store { streak: 0, last: e };
        let deletes: Vec<KvUpdate> = self
            .store
            .with_retained(|r| r.records().map(RetainedRecord::to_delete).collect())
            .map_err(store_err)?;
        if deletes.is_empty() {
            return Ok(0);
        }
        let n = deletes.len() as u64;
        let (_, r) = commit(&self.store, deletes, self.applied).await?;
        r.map_err(store_err)?;
        self.store
            .with_retained(|r| *r = RetainedIndex::default())
            .map_err(store_err)?;
        self.warned.clear();
        self.publish_retained().map_err(store_err)?;
        apply.discard();
        Ok(n)
    }

    /// Records durably, on the cursor, that this fold has seen retention evict a current value.
    pub async fn remember_eviction<A: Apply + ?Sized>(
        &mut self,
        apply: &mut A,
    ) -> Result<(), AppliedError> {
        if self.applied.memo().is_some() {
            return Ok(());
        }
        let cursor = self
            .applied
            .with_memo(Some(crate::kv::EvictionMemo::default()));
        self.commit_position(cursor, apply).await?;
        tracing::warn!(cursor = %cursor, "retention has evicted current values from this bucket: the fold will never trust its key listing again (eviction memo)");
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

    /// `batch` without the bucket keys in the host's reserved space (they never reach the guest
    /// or the store), the highest revision among those, and — when there were any — the batch as
    /// delivered (an apply failure hands that back, so a retry in halves never commits a cursor
    /// over a skipped key it has not reached).
    fn split_reserved(batch: Vec<KvUpdate>) -> (Vec<KvUpdate>, Option<u64>, Option<Vec<KvUpdate>>) {
        if batch.iter().all(|u| protocol::bucket_key_admitted(u.key())) {
            return (batch, None, None);
        }
        let original = batch.clone();
        let mut high = None;
        let kept = batch
            .into_iter()
            .filter(|u| {
                let admitted = protocol::bucket_key_admitted(u.key());
                if !admitted {
                    tracing::warn!(key = ?u.key(), revision = ?u.revision(), "skipped a bucket key in the host's reserved space (it starts with \\x01): never folded, never shown to a guest");
                    high = high.max(u.revision());
                }
                admitted
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
        let (batch, skipped_high, delivered) = Self::split_reserved(batch);
        if batch.is_empty() && skipped_high.is_none() && self.is_settled() {
            return Ok(None);
        }
        let mut retained_now = Vec::new();
        if !batch.is_empty() {
            let t = Instant::now();
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
            let outcome = parse_with_deferral(apply, &batch, held).await;
            tracing::debug!(
                updates = batch.len(),
                first = ?batch.first().and_then(KvUpdate::revision),
                last = ?batch.last().and_then(KvUpdate::revision),
                deferred = ?outcome.as_ref().map(|d| d.iter().filter(|x| **x).count()),
                "batch parsed and applied"
            );
            self.status
                .last_apply_us
                .store(t.elapsed().as_micros() as u64, Ordering::Relaxed);
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
                    tracing::warn!(error = %e, streak = self.apply_streak, "apply failed; the batch will be retried, nothing of it is committed");
                    return Ok(Some(delivered.unwrap_or(batch)));
                }
            };
            self.apply_streak = 0;
            if deferred.contains(&true) {
                retained_now = self
                    .retain(&batch, &deferred)
                    .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
            }
        }
        let mut raw = std::mem::take(&mut self.requeued);
        raw.extend(batch);
        // A re-queue after a failed commit carries it along.
        if let Some(identity) = self.pending_identity.take() {
            raw.push(identity_record(&identity));
        }
        // Retained records commit with their batch (reserved keys, unknown version: the cursor
        // is the batch's).
        raw.extend(retained_now.iter().map(RetainedRecord::to_put));
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
        let t = Instant::now();
        let (raw, result) = commit(&self.store, raw, cursor).await?;
        self.status
            .last_commit_us
            .store(t.elapsed().as_micros() as u64, Ordering::Relaxed);
        match result {
            Ok(()) => {
                self.status.set_error(None);
                self.requeued_skipped = None;
                self.store_streak = 0;
                self.status.store_failure_streak.store(0, Ordering::Relaxed);
                self.applied = cursor;
                self.publish_retained()
                    .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
                let updates = raw.iter().filter(|u| !is_reserved(u.key())).count();
                self.status
                    .committed
                    .fetch_add(updates as u64, Ordering::Relaxed);
                self.status.batches.fetch_add(1, Ordering::Relaxed);
                crashpoint::hit(crashpoint::FOLD_BEFORE_ON_APPLIED);
                apply.on_applied(cursor).await;
                crashpoint::hit(crashpoint::FOLD_COMMITTED);
                Ok(None)
            }
            Err(e) => {
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
                tracing::warn!(error = %e, streak = self.store_streak, "store apply failed; batch re-queued");
                self.requeued = raw;
                // The whole batch is re-queued, so its skipped keys' revisions ride with it.
                self.requeued_skipped = self.requeued_skipped.max(skipped_high);
                Ok(None)
            }
        }
    }
}

/// Commits `raw` with `cursor` (data and cursor atomically) and hands `raw` back with the outcome.
///
/// The commit blocks (a write, sometimes a compaction with fsync). On a multi-threaded runtime it
/// runs in place, handing this worker's other tasks to another thread — no thread hop per batch;
/// elsewhere it goes to the blocking pool.
async fn commit<S: SnapshotStore>(
    store: &SharedStore<S>,
    raw: Vec<KvUpdate>,
    cursor: WatchCursor,
) -> Result<(Vec<KvUpdate>, Result<(), SnapshotError>), AppliedError> {
    let multi = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi {
        let r = tokio::task::block_in_place(|| store.write()?.apply(&raw, cursor));
        Ok((raw, r))
    } else {
        let store = store.clone();
        tokio::task::spawn_blocking(move || {
            let r = store.write().and_then(|mut s| s.apply(&raw, cursor));
            (raw, r)
        })
        .await
        .map_err(|e| AppliedError::Task(e.to_string()))
    }
}

/// The store update that records `identity` (a reserved key, unknown version: no cursor move).
fn identity_record(identity: &crate::kv::StreamIdentity) -> KvUpdate {
    KvUpdate::Put(KvEntry {
        key: crate::retained::IDENTITY_KEY.to_string(),
        value: bytes::Bytes::from(identity.to_bytes()),
        version: crate::kv::VersionToken::UNKNOWN,
    })
}

/// The entry an update leaves its key with (`None` after a delete or purge).
fn entry_of(u: &KvUpdate) -> Base {
    match u {
        KvUpdate::Put(e) => Some(e.clone()),
        KvUpdate::Delete { .. } | KvUpdate::Purge { .. } => None,
    }
}

/// Parses and applies `batch` except the updates already `held`, holding back every update that
/// follows a deferred one of its key (re-parsing without them: the guest applies what the *last*
/// `parse` accepted). Returns which updates are deferred (held or deferred by the guest). Each
/// re-parse holds at least one more update, so there are at most `batch.len()` rounds; in the
/// usual batch (no defer) there is exactly one.
async fn parse_with_deferral<A: Apply + ?Sized>(
    apply: &mut A,
    batch: &[KvUpdate],
    mut held: Vec<bool>,
) -> Result<Vec<bool>, ApplyError> {
    let keys: Vec<&str> = batch.iter().map(KvUpdate::key).collect();
    loop {
        let offered: Vec<usize> = (0..batch.len()).filter(|&i| !held[i]).collect();
        if offered.is_empty() {
            return Ok(held);
        }
        let owned: Vec<KvUpdate>;
        let sub: &[KvUpdate] = if offered.len() == batch.len() {
            batch
        } else {
            owned = offered.iter().map(|&i| batch[i].clone()).collect();
            &owned
        };
        let verdicts = apply.parse(sub).await?;
        if verdicts.len() != sub.len() {
            return Err(ApplyError {
                applier: apply.describe(),
                call: "parse",
                message: format!(
                    "answered {} verdicts for a batch of {}",
                    verdicts.len(),
                    sub.len()
                ),
            });
        }
        let mut deferred = held.clone();
        for (j, &i) in offered.iter().enumerate() {
            if verdicts[j] == Verdict::Defer {
                deferred[i] = true;
            }
        }
        let later = protocol::held_after_defers(&keys, &deferred);
        if later.is_empty() {
            apply.apply(sub, &verdicts).await?;
            return Ok(deferred);
        }
        held = deferred;
        for i in later {
            held[i] = true;
        }
    }
}

/// Delay before re-committing a batch re-queued by a failed store apply.
const STORE_RETRY_DELAY: Duration = Duration::from_millis(20);

/// Backoff before retrying a failed apply: grows with the streak, capped.
fn apply_backoff(streak: u32) -> Duration {
    Duration::from_millis(50u64.saturating_mul(1 << streak.min(6)))
}

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
    let mut control = control;
    status.set_guest(&apply.describe());
    // Records retained by an earlier run are offered first: this may be a version that decodes
    // them (a restart is an upgrade path as much as a swap).
    fold.release(apply).await?;
    fold.check_grace(opts.defer_grace)
        .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
    let mut grace_tick = tokio::time::interval(Duration::from_secs(1));
    grace_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Retention is read live at every watch start and every expiry, and periodically while a
    // key-listing repair could still be planned and the memo is unset (seed 000: the fold reads
    // retention while eviction is in force).
    // The identity check comes first: a fold of another stream is refused (or reset) before any
    // repair or watch trusts its cursor.
    let reset = check_identity(&mut fold, apply, &*watcher, &opts, &status).await?;
    let retention = watcher.retention().await?;
    note_retention(&mut fold, apply, retention).await?;
    let mut retention_tick = tokio::time::interval(RETENTION_PERIOD);
    retention_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    retention_tick.reset();
    // The channel carries chunks of updates; size it so it holds about `channel_capacity` updates.
    let depth = opts
        .batch
        .channel_capacity
        .div_ceil(crate::nats::WATCH_CHUNK)
        .max(2);
    // A start without a cursor repairs first when the fold holds data (a re-list would never
    // remove what it does not deliver) or when a restore is armed and the listing is not the truth.
    let mut relist_next = reset;
    if fold.cursor().revision().is_none() && !reset {
        let has_data = fold
            .store()
            .read()
            .and_then(|s| crate::snapshot::bucket_len(&*s))
            .map_err(|e| AppliedError::Store { streak: 0, last: e })?
            > 0;
        let armed = if opts.repair.restore_armed() {
            opts.repair.mode
        } else {
            protocol::RepairMode::None
        };
        let truth = protocol::listing_truth(retention, fold.cursor().memo().is_some());
        if !protocol::cursorless_start_needs_repair(armed, has_data, truth) {
            // A plain state-sync re-list is all this start needs.
        } else if opts.repair.mode == protocol::RepairMode::None {
            // No repair allowed: the state-sync re-list alone, which cannot remove a key it does
            // not deliver.
            tracing::warn!(
                "the fold holds data but no cursor and --repair is none: re-listing without removing keys the bucket no longer has"
            );
        } else {
            let why = KvError::CursorExpired {
                resume_from: 1,
                first_sequence: retention.map_or(0, |r| r.first_revision),
            };
            relist_next = repair_expired(&mut fold, apply, &*watcher, &opts, &status, why).await?;
        }
    }
    // Aborting on every exit path: the watch must not outlive the fold it feeds.
    struct AbortOnDrop(tokio::task::JoinHandle<Result<(), KvError>>);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    tokio::pin!(shutdown);

    // One turn per watch: a repaired expiry starts the next (a delta from the restored cursor, or
    // a state-sync re-list after the key-listing diff).
    let mut first_turn = true;
    'watch: loop {
        // Every watch (re)start checks the stream again (the first one was checked above).
        if !std::mem::take(&mut first_turn)
            && check_identity(&mut fold, apply, &*watcher, &opts, &status).await?
        {
            relist_next = true;
        }
        let (tx, mut rx) = mpsc::channel::<WatchEvent>(depth);
        let start = fold.cursor();
        let scope = opts.scope.clone();
        let w = watcher.clone();
        let relist = std::mem::take(&mut relist_next);
        let watch_task = tokio::spawn(async move {
            if relist {
                w.watch(&scope, tx).await
            } else {
                w.watch_from(&scope, start, tx).await
            }
        });
        let mut watch_task = AbortOnDrop(watch_task);
        let mut expired: Option<KvError> = None;
        let mut changed = false;
        let mut batch: Vec<KvUpdate> = Vec::with_capacity(opts.batch.max);
        // One timer, re-armed when the batch opens: a fresh timer per delivery costs more than the
        // delivery. A full batch never waits for it (the timer wheel ticks in milliseconds).
        let timer = tokio::time::sleep(Duration::from_secs(3600));
        tokio::pin!(timer);
        let mut timer_armed = false;
        let mut level: Option<Option<u64>> = None;
        let mut backing_off = false;
        // After a failed apply the batch is retried in halves, so the updates before a poison one are
        // committed and the fold stops exactly at it; the size grows back after successes.
        let mut cap = opts.batch.max;

        'fold: loop {
            if opts.catch_up
                && let Some(through) = level
                && protocol::caught_up(fold.cursor().revision(), through)
                && batch.is_empty()
                && fold.is_settled()
            {
                break;
            }
            let mut flush_now = false;
            tokio::select! {
                biased;
                _ = &mut shutdown => {
                    flush_all(&mut fold, &mut batch, opts.batch.max, apply).await?;
                    break;
                }
                _ = &mut timer, if timer_armed => {
                    flush_now = true;
                }
                _ = grace_tick.tick() => {
                    fold.check_grace(opts.defer_grace)
                        .map_err(|e| AppliedError::Store { streak: 0, last: e })?;
                }
                _ = retention_tick.tick(), if watches_for_eviction(&opts, &fold) => {
                    // Bounded: a slow server delays the fold by at most this, never stops it.
                    if let Ok(Ok(Some(r))) = tokio::time::timeout(Duration::from_secs(5), watcher.retention()).await
                        && protocol::retention_has_evicted(r)
                    {
                        flush_all(&mut fold, &mut batch, opts.batch.max, apply).await?;
                        timer_armed = false;
                        note_retention(&mut fold, apply, Some(r)).await?;
                    }
                }
                c = recv_control(&mut control) => {
                    match c {
                        Some(Control::Query { request, reply }) => {
                            // Between batches: the applier's structure is whole.
                            let answer = apply.query(&request).await;
                            let _ = reply.send(answer);
                        }
                        Some(Control::Export { dir, reply }) => {
                            // Everything delivered so far is applied and committed first, so the copy
                            // is exactly the applied cursor; deliveries wait in the channel meanwhile.
                            flush_all(&mut fold, &mut batch, opts.batch.max, apply).await?;
                            timer_armed = false;
                            let store = fold.store().clone();
                            let copied = tokio::task::spawn_blocking(move || {
                                let s = store.read()?;
                                s.export_to(&dir)?;
                                Ok((s.cursor(), s.len()?))
                            })
                            .await
                            .map_err(|e| AppliedError::Task(e.to_string()))?;
                            let _ = reply.send(copied);
                        }
                        Some(Control::Swap { bytes, what, reply }) => {
                            // Settle first: the new instance is rebuilt from the committed fold, so
                            // everything the old one applied must be committed. Deliveries wait in the
                            // channel meanwhile; the watch never stops.
                            let t = Instant::now();
                            flush_all(&mut fold, &mut batch, opts.batch.max, apply).await?;
                            timer_armed = false;
                            let mut outcome = apply.swap(&what, &bytes).await;
                            if let Ok(r) = &mut outcome {
                                // The new version is offered the retained records first.
                                let (released, still) = fold.release(apply).await?;
                                r.released = released;
                                r.still_retained = still;
                                r.paused_ms = t.elapsed().as_millis() as u64;
                            }
                            match &outcome {
                                Ok(r) => {
                                    status.set_guest(&r.to);
                                    tracing::info!(from = %r.from, to = %r.to, hydrated = r.hydrated_entries, hydrate_ms = r.hydrate_ms, paused_ms = r.paused_ms, "guest swapped");
                                }
                                Err(e) => tracing::warn!(error = %e, "swap refused; the running guest stays"),
                            }
                            let _ = reply.send(outcome);
                        }
                        None => control = None,
                    }
                }
                ev = rx.recv(), if !backing_off && batch.len() < opts.batch.max => {
                    let mut next = ev;
                    // Take whatever else is already queued, up to a full batch, without re-entering
                    // the select for each update.
                    loop {
                        match on_event(next, &mut batch, &mut level, &status, &mut fold) {
                            EventOutcome::Continue => {}
                            EventOutcome::FlushNow => flush_now = true,
                            EventOutcome::Closed => {
                                // The watch ended: flush what it delivered, then report why it ended.
                                flush_all(&mut fold, &mut batch, opts.batch.max, apply).await?;
                                let result = (&mut watch_task.0).await;
                                match result {
                                    Ok(Ok(())) => return Ok(Finished { cursor: fold.cursor() }),
                                    Ok(Err(e @ KvError::CursorExpired { .. }))
                                        if opts.repair.mode != protocol::RepairMode::None =>
                                    {
                                        expired = Some(e);
                                        break 'fold;
                                    }
                                    // The stream changed under the watch: the next turn's
                                    // identity check refuses, or resets for the new stream.
                                    Ok(Err(e @ KvError::StreamChanged { .. })) => {
                                        tracing::warn!(error = %e, "watch ended: checking the bucket's identity again");
                                        changed = true;
                                        break 'fold;
                                    }
                                    Ok(Err(e)) => return Err(AppliedError::Watch(e)),
                                    Err(e) => return Err(AppliedError::Task(e.to_string())),
                                }
                            }
                        }
                        if batch.len() >= opts.batch.max {
                            flush_now = true;
                            break;
                        }
                        match rx.try_recv() {
                            Ok(ev) => next = Some(ev),
                            Err(mpsc::error::TryRecvError::Empty) => break,
                            Err(mpsc::error::TryRecvError::Disconnected) => next = None,
                        }
                    }
                    if opts.catch_up && level.is_some() {
                        flush_now = true;
                    }
                    if !flush_now && !timer_armed && !batch.is_empty() {
                        timer.as_mut().reset(tokio::time::Instant::now() + opts.batch.window);
                        timer_armed = true;
                    }
                }
            }
            if flush_now {
                timer_armed = false;
                backing_off = false;
                loop {
                    // A batch is at most `max` updates; a chunk from the watch can overfill it.
                    let b = if batch.len() > cap {
                        let rest = batch.split_off(cap);
                        std::mem::replace(&mut batch, rest)
                    } else {
                        std::mem::take(&mut batch)
                    };
                    let tried = b.len();
                    if let Some(mut back) = fold.flush(b, apply).await? {
                        cap = (tried / 2).max(1);
                        // apply failed: nothing committed; retry the same batch after a backoff,
                        // taking no new deliveries meanwhile (the channel backpressures the watch).
                        back.append(&mut batch);
                        batch = back;
                        backing_off = true;
                        timer
                            .as_mut()
                            .reset(tokio::time::Instant::now() + apply_backoff(fold.apply_streak));
                        timer_armed = true;
                        break;
                    }
                    cap = cap.saturating_mul(2).min(opts.batch.max);
                    if !fold.is_settled() {
                        // A store failure re-queued the batch: retry even if nothing new arrives.
                        timer
                            .as_mut()
                            .reset(tokio::time::Instant::now() + STORE_RETRY_DELAY);
                        timer_armed = true;
                        break;
                    }
                    if batch.is_empty() || (batch.len() < opts.batch.max && cap == opts.batch.max) {
                        break;
                    }
                }
                if !timer_armed && !batch.is_empty() {
                    timer
                        .as_mut()
                        .reset(tokio::time::Instant::now() + opts.batch.window);
                    timer_armed = true;
                }
            }
        }
        match expired {
            // Everything delivered is committed (the close flushed it); repair, then watch again.
            Some(why) => {
                relist_next =
                    repair_expired(&mut fold, apply, &*watcher, &opts, &status, why).await?;
            }
            None if changed => {}
            None => break 'watch,
        }
    }
    Ok(Finished {
        cursor: fold.cursor(),
    })
}

/// How often retention is re-read during a live watch while a key-listing repair could still be
/// planned and the memo is unset.
pub const RETENTION_PERIOD: Duration = Duration::from_secs(60);

fn watches_for_eviction<S: SnapshotStore>(opts: &WatchOptions, fold: &Fold<S>) -> bool {
    matches!(
        opts.repair.mode,
        protocol::RepairMode::Relist | protocol::RepairMode::Auto
    ) && fold.cursor().memo().is_none()
}

/// Commits the eviction memo the first time retention is seen to have evicted a current value.
async fn note_retention<S: SnapshotStore, A: Apply + ?Sized>(
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
async fn check_identity<S: SnapshotStore, A: Apply + ?Sized>(
    fold: &mut Fold<S>,
    apply: &mut A,
    watcher: &dyn KvWatcher,
    opts: &WatchOptions,
    status: &FoldStatus,
) -> Result<bool, AppliedError> {
    let Some(found) = watcher.stream_state().await? else {
        return Ok(false);
    };
    let store_err = |e| AppliedError::Store { streak: 0, last: e };
    let recorded = fold.identity().map_err(store_err)?;
    let cursor = fold.cursor();
    let verdict = protocol::stream_identity_check(
        recorded.as_ref(),
        &found.identity,
        cursor.revision(),
        found.last_sequence,
    );
    let bucket = watcher.bucket_name();
    match verdict {
        protocol::IdentityVerdict::Same => {}
        protocol::IdentityVerdict::Record => {
            if cursor.revision().is_some() {
                tracing::warn!(bucket = %bucket, identity = %found.identity, cursor = %cursor, "the fold records no stream identity (written by an older version): recording this stream's, which still covers the cursor");
            }
            // Committed with the next batch (the first cursor, on a new fold).
            fold.pending_identity = Some(found.identity.clone());
        }
        protocol::IdentityVerdict::Recreated | protocol::IdentityVerdict::CursorAhead => {
            let why = other_stream(verdict, recorded.as_ref(), cursor, &found);
            if opts.repair.on_recreated == protocol::OnRecreated::Refuse {
                return Err(AppliedError::Recreated(refusal(&bucket, &why)));
            }
            tracing::warn!(bucket = %bucket, reason = %why, "--on-recreated relist: re-folding the new bucket as a cursor-less start");
            let dropped = fold.drop_retained(apply).await?;
            let report =
                crate::repair::relist(fold, apply, &opts.repair, &opts.scope, opts.batch.max)
                    .await?;
            fold.commit_identity(&found.identity, WatchCursor::NONE, apply)
                .await?;
            status.seq.store(0, Ordering::Relaxed);
            status.repairs.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(bucket = %bucket, retained_dropped = dropped, listed = report.listed, deleted = report.deleted, "recreated bucket: fold reset; re-listing the new bucket");
            watcher.pin_identity(found.identity);
            return Ok(true);
        }
    }
    watcher.pin_identity(found.identity);
    Ok(false)
}

/// Why a fold may not resume on `found` (for a [`protocol::IdentityVerdict::Recreated`] or
/// [`protocol::IdentityVerdict::CursorAhead`] verdict), in words naming both streams.
fn other_stream(
    verdict: protocol::IdentityVerdict,
    recorded: Option<&crate::kv::StreamIdentity>,
    cursor: WatchCursor,
    found: &crate::kv::StreamState,
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
    recorded: Option<&crate::kv::StreamIdentity>,
    cursor: WatchCursor,
    found: &crate::kv::StreamState,
) -> Option<String> {
    let verdict = protocol::stream_identity_check(
        recorded,
        &found.identity,
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
async fn repair_expired<S: SnapshotStore, A: Apply + ?Sized>(
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
    tracing::warn!(reason = %why, ?plan, cursor = %fold.cursor(), "cursor expired: repairing");
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
            repair::relist(fold, apply, &opts.repair, &opts.scope, opts.batch.max).await?
        }
        protocol::RepairPlan::Restore => repair::restore(
            fold,
            apply,
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
    status.repairs.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(kind = report.kind, listed = report.listed, deleted = report.deleted, taken = report.taken, cursor = ?report.cursor, "cursor-expiry repair done");
    Ok(report.kind == "relist")
}

/// Flushes until the batch and the re-queued updates are committed (shutdown, channel close, and
/// the repairs' own batches).
pub(crate) async fn flush_all<S: SnapshotStore, A: Apply + ?Sized>(
    fold: &mut Fold<S>,
    batch: &mut Vec<KvUpdate>,
    max: usize,
    apply: &mut A,
) -> Result<(), AppliedError> {
    loop {
        let b = if batch.len() > max {
            let rest = batch.split_off(max);
            std::mem::replace(batch, rest)
        } else {
            std::mem::take(batch)
        };
        match fold.flush(b, apply).await? {
            Some(mut back) => {
                back.append(batch);
                *batch = back;
                tokio::time::sleep(apply_backoff(fold.apply_streak)).await;
            }
            None if fold.is_settled() && batch.is_empty() => return Ok(()),
            None if fold.is_settled() => {}
            None => tokio::time::sleep(STORE_RETRY_DELAY).await,
        }
    }
}

async fn recv_control(control: &mut Option<mpsc::Receiver<Control>>) -> Option<Control> {
    match control {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

enum EventOutcome {
    Continue,
    FlushNow,
    Closed,
}

/// Takes one event off the watch channel into the batch and the progress figures.
fn on_event<S: SnapshotStore>(
    ev: Option<WatchEvent>,
    batch: &mut Vec<KvUpdate>,
    level: &mut Option<Option<u64>>,
    status: &FoldStatus,
    fold: &mut Fold<S>,
) -> EventOutcome {
    match ev {
        Some(WatchEvent::Stamp {
            revision,
            server_time_unix_ns,
        }) => {
            fold.note_stamp(revision, server_time_unix_ns);
            EventOutcome::Continue
        }
        Some(WatchEvent::Updates(us)) => {
            if let Some(r) = us.iter().rev().find_map(KvUpdate::revision) {
                status.seq.fetch_max(r, Ordering::Relaxed);
            }
            status
                .delivered
                .fetch_add(us.len() as u64, Ordering::Relaxed);
            if batch.is_empty() {
                *batch = us;
            } else {
                batch.extend(us);
            }
            EventOutcome::Continue
        }
        Some(WatchEvent::CaughtUp { through }) => {
            *level = Some(through);
            status.caught_up.store(1, Ordering::Relaxed);
            status.pending.store(0, Ordering::Relaxed);
            EventOutcome::FlushNow
        }
        Some(WatchEvent::Pending(n)) => {
            status.pending.store(n, Ordering::Relaxed);
            EventOutcome::Continue
        }
        None => EventOutcome::Closed,
    }
}

/// A native applier that counts what it sees: the built-in `apply` of `foldhost run` until a guest
/// is loaded, and the reference applier of the tests.
#[derive(Debug, Default, Clone)]
pub struct CountingApply {
    /// Updates parsed (deliveries that reached the applier).
    pub parsed: u64,
    /// Puts applied.
    pub puts: u64,
    /// Deletes and purges applied.
    pub deletes: u64,
    /// The last committed cursor seen by `on_applied`.
    pub last_cursor: WatchCursor,
}

#[async_trait]
impl Apply for CountingApply {
    fn describe(&self) -> String {
        "native:count".into()
    }

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        self.parsed += batch.len() as u64;
        Ok(vec![Verdict::Accept; batch.len()])
    }

    async fn apply(&mut self, batch: &[KvUpdate], verdicts: &[Verdict]) -> Result<(), ApplyError> {
        for (u, v) in batch.iter().zip(verdicts) {
            if *v == Verdict::Accept {
                match u {
                    KvUpdate::Put(_) => self.puts += 1,
                    KvUpdate::Delete { .. } | KvUpdate::Purge { .. } => self.deletes += 1,
                }
            }
        }
        Ok(())
    }

    async fn on_applied(&mut self, cursor: WatchCursor) {
        self.last_cursor = cursor;
    }
}
