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
//!   restart never re-reads), and after [`crate::protocol::MAX_STORE_APPLY_FAILURES`] in a row the fold
//!   fail-stops. A poisoned store fail-stops at once.
//! - `batch_high` covers rejected (skipped) updates; an update with the unknown version never mints
//!   or lowers the cursor ([`crate::protocol::commit_cursor`]).
//! - A failed `parse`/`apply` commits nothing of its batch; the batch is retried (with backoff) in
//!   halves, so the updates before a poison one still commit and the fold stops exactly at it; after
//!   [`MAX_APPLY_FAILURES`] failures in a row the fold fail-stops naming the applier and its message.
//! - Queries ([`Control::Query`]) run between flushes, never inside one, taking turns with the
//!   fold's own work ([`crate::protocol::loop_gates`]); a query never rebuilds a lost guest
//!   instance (it is answered [`ApplyError::is_rebuilding`]): the loop does, as fold work.
//! - A re-queued batch remembers the applier generation it was applied to ([`Apply::generation`]);
//!   its retry on another generation discards that state before the commit, so no state is built
//!   from a fold missing it.
//! - A batch flushes when the window elapses, when it reaches `max`, on shutdown, and when the watch
//!   channel closes.
//!
//! Code map: [`apply`](self) — the seam ([`Apply`], [`Verdict`], [`Control`], [`CountingApply`]);
//! `fold` — [`Fold`], flush, retain and release; `watch` — [`watch_applied`], the loop; `start` —
//! the identity check, the cursor-less start and the repair dispatch.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use crate::kv::{KvError, WatchCursor, WatchScope};
use crate::snapshot::SnapshotError;

mod apply;
mod fold;
mod start;
mod watch;

pub use apply::{
    Apply, ApplyError, Control, CountingApply, GUEST_REBUILDING, MAX_SHADOW_COMPARE,
    MAX_SHADOW_DIFFERENCES_LISTED, MAX_SHADOW_QUOTE, MAX_SHADOW_REQUESTS, ShadowDifference,
    ShadowPlan, ShadowReport, ShadowRequests, SwapCandidate, SwapReport, Verdict,
};
pub use fold::Fold;
#[cfg(test)]
pub(crate) use fold::flush_all;
pub use start::identity_refusal;
pub use watch::watch_applied;

/// Batching knobs (seed defaults: 10 ms window, 100 updates, channel of 256).
#[derive(Clone, Copy, Debug)]
pub struct BatchConfig {
    /// Longest a batch stays open before it flushes.
    pub window: Duration,
    /// Updates per batch before an early flush.
    pub max: usize,
    /// Depth of the watch → fold channel, in updates (it carries chunks of up to
    /// [`crate::kv::WATCH_CHUNK`], so it is rounded up to whole chunks). A full channel
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
    /// The running applier's guest contract version (`None`: native, or not yet known).
    pub guest_contract: std::sync::Mutex<Option<&'static str>>,
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
    /// Stored messages skipped as undecodable since start ([`crate::protocol::decode_stored`]):
    /// never folded, their revisions passed by the cursor.
    pub skipped_messages: AtomicU64,
    /// The last of them: revision, subject and reason.
    pub last_skipped: std::sync::Mutex<Option<(u64, String, &'static str)>>,
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

    /// Records the applier now running, with the guest contract it was bound to.
    pub fn set_applier<A: Apply + ?Sized>(&self, apply: &A) {
        self.set_guest(&apply.describe());
        if let Ok(mut c) = self.guest_contract.lock() {
            *c = apply.contract();
        }
    }

    /// The running applier's guest contract version.
    pub fn guest_contract(&self) -> Option<&'static str> {
        self.guest_contract.lock().ok().and_then(|c| *c)
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

    /// Counts an undecodable message skipped at `revision`, once: a batch flushed again (an apply
    /// retried, a watch resumed before its commit) meets the same revisions, which are not
    /// counted again. True when it was counted now.
    pub(crate) fn note_skipped(
        &self,
        revision: u64,
        subject: &str,
        reason: crate::protocol::Undecodable,
    ) -> bool {
        let Ok(mut last) = self.last_skipped.lock() else {
            return false;
        };
        if last.as_ref().is_some_and(|(r, _, _)| *r >= revision) {
            return false;
        }
        *last = Some((revision, subject.to_string(), reason.as_str()));
        self.skipped_messages
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        true
    }

    /// The last undecodable message skipped: revision, subject, reason.
    pub fn last_skipped(&self) -> Option<(u64, String, &'static str)> {
        self.last_skipped.lock().ok().and_then(|g| g.clone())
    }
}

#[cfg(test)]
mod skipped_tests {
    use super::FoldStatus;
    use crate::protocol::Undecodable;
    use std::sync::atomic::Ordering;

    #[test]
    fn an_undecodable_message_is_counted_once_however_often_its_batch_is_flushed() {
        let s = FoldStatus::default();
        assert!(s.note_skipped(7, "$KV.b.x", Undecodable::BadName));
        // The same batch again (an apply retried, a watch resumed before its commit).
        assert!(!s.note_skipped(7, "$KV.b.x", Undecodable::BadName));
        assert!(!s.note_skipped(5, "$KV.b.w", Undecodable::NotUtf8));
        assert!(s.note_skipped(9, "$KV.b.y", Undecodable::CrInValue));
        assert_eq!(s.skipped_messages.load(Ordering::Relaxed), 2);
        assert_eq!(
            s.last_skipped(),
            Some((9, "$KV.b.y".to_string(), "cr-inside-header-value"))
        );
    }
}

/// How long a record may stay retained before a warning names it (seed 004's default).
pub const DEFAULT_DEFER_GRACE: Duration = Duration::from_secs(30 * 60);

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

/// How often retention is re-read during a live watch while a key-listing repair could still be
/// planned and the memo is unset.
pub const RETENTION_PERIOD: Duration = Duration::from_secs(60);
