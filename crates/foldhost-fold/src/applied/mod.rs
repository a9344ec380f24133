//! `watch_applied`: the cursor-after-apply combinator, and [`Fold`], the one place a batch, the
//! applied cursor and the store change together.
//!
//! The invariant (docs/design.md, "Durability contract"): **a persisted or reported cursor C
//! implies every update with revision ≤ C has had `apply` return and is durable in the store.**
//! Concretely, on each flush: `parse` the batch, `apply` what it accepted, then `store.apply(raw
//! batch, cursor)` (data and cursor atomically), and only then `on_applied(cursor)` and the status
//! advance. Nothing moves the cursor on receipt.
//!
//! Further rules kept here:
//! - The cursor is the store's. After a transient store failure the raw batch is re-queued in front
//!   of the next one (never dropped: a dropped batch followed by a good flush would leave a hole the
//!   restart never re-reads), and after [`foldhost_core::protocol::MAX_STORE_APPLY_FAILURES`] in a row the fold
//!   fail-stops. A poisoned store fail-stops at once.
//! - `batch_high` covers rejected (skipped) updates; an update with the unknown version never mints
//!   or lowers the cursor ([`foldhost_core::protocol::commit_cursor`]).
//! - A failed `parse`/`apply` commits nothing of its batch; the batch is retried (with backoff) in
//!   halves, so the updates before a poison one still commit and the fold stops exactly at it; after
//!   [`MAX_APPLY_FAILURES`] failures in a row the fold fail-stops naming the applier and its message.
//! - Queries ([`Control::Query`]) run between flushes, never inside one, taking turns with the
//!   fold's own work ([`foldhost_core::protocol::loop_gates`]); a query never rebuilds a lost guest
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

use std::time::Duration;

use foldhost_core::kv::{KvError, WatchCursor, WatchScope};
use foldhost_core::snapshot::SnapshotError;

mod apply;
mod fold;
pub mod lane;
mod queries;
mod start;
mod watch;

pub use apply::{
    Apply, ApplyError, CapturedWrite, Control, CountingApply, GUEST_REBUILDING, MAX_SHADOW_COMPARE,
    MAX_SHADOW_DIFFERENCES_LISTED, MAX_SHADOW_QUOTE, MAX_SHADOW_REQUESTS, MAX_SHADOW_WRITES_LISTED,
    NODE_CONDITION, ShadowDifference, ShadowPlan, ShadowReport, ShadowRequests, ShadowWrite,
    SwapCandidate, SwapReport, Verdict,
};
pub use fold::Fold;
#[cfg(any(test, feature = "testkit"))]
pub use fold::flush_all;
pub use lane::{LaneApply, LaneLink, LaneSession};
pub use queries::{MAX_LOOKUPS_PER_ASK, Queries, Unanswered};
pub use start::identity_refusal;
pub use watch::watch_applied;

/// Batching knobs (defaults: 10 ms window, 100 updates, channel of 256; docs/design.md, "The fold
/// loop").
#[derive(Clone, Copy, Debug)]
pub struct BatchConfig {
    /// Longest a batch stays open before it flushes.
    pub window: Duration,
    /// Updates per batch before an early flush.
    pub max: usize,
    /// Depth of the watch → fold channel, in updates (it carries chunks of up to
    /// [`foldhost_core::kv::WATCH_CHUNK`], so it is rounded up to whole chunks). A full channel
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
    /// The log holds another record at the fold's checkpoint (`log_diverged`,
    /// `--on-diverged refuse`); the fold is untouched.
    #[error("{0}")]
    LogDiverged(String),
}

use foldhost_core::status::{FoldStatus, MAX_WARNINGS};

/// Most delivery time stamps a fold keeps (one arrives per chunk of at most 64 updates).
pub(crate) const MAX_STAMPS: usize = 1024;

#[cfg(test)]
mod skipped_tests {
    use super::FoldStatus;
    use foldhost_core::protocol::Undecodable;
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

/// How long a record may stay retained before a warning names it (the default of
/// `--defer-grace-secs`: docs/guests.md, deferral).
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
    /// The fold's query route, when its queries should be answered off the fold's path: the
    /// loop keeps a query instance level beside it and installs it there ([`Queries`]). `None`:
    /// no query instance (queries, if any, are answered between batches).
    pub queries: Option<Queries>,
}

/// What a finished fold reports.
#[derive(Debug, Clone, Copy)]
pub struct Finished {
    /// The store's cursor: everything through it is applied and committed.
    pub cursor: WatchCursor,
}

/// How often retention is re-read during a live watch while a key-listing repair could still be
/// planned and the memo is unset.
pub(crate) const RETENTION_PERIOD: Duration = Duration::from_secs(60);

/// Exports the fold of a running host through its control channel ([`Control::Export`]): the
/// fold flushes and copies itself into a stage between batches (paused only for the copy), then
/// the stage is verified, hashed and sealed off the fold's path
/// ([`foldhost_artifact::artifact::export_live_with`]), recording `stream` in the manifest and carrying the
/// `state` buckets' folds beside the fold's own.
pub async fn export_live_of(
    control: &tokio::sync::mpsc::Sender<Control>,
    backend: foldhost_core::storedir::Backend,
    out: std::path::PathBuf,
    scope: Option<String>,
    stream: Option<foldhost_artifact::artifact::ManifestStream>,
    state: Vec<foldhost_artifact::artifact::StateFoldSource>,
) -> Result<foldhost_artifact::artifact::ExportManifest, foldhost_artifact::artifact::ArtifactError>
{
    use foldhost_artifact::artifact::ArtifactError;
    let copy = |dir: std::path::PathBuf| async move {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if control
            .send(Control::Export { dir, reply: tx })
            .await
            .is_err()
        {
            return Err(ArtifactError::Fold("not running".into()));
        }
        rx.await
            .map_err(|_| ArtifactError::Fold("stopped before the export".into()))?
            .map_err(ArtifactError::from)
    };
    foldhost_artifact::artifact::export_live_with(copy, backend, out, scope, stream, state).await
}

/// [`export_live_of`] without a stream recorded.
pub async fn export_live(
    control: &tokio::sync::mpsc::Sender<Control>,
    backend: foldhost_core::storedir::Backend,
    out: std::path::PathBuf,
    scope: Option<String>,
) -> Result<foldhost_artifact::artifact::ExportManifest, foldhost_artifact::artifact::ArtifactError>
{
    export_live_of(control, backend, out, scope, None, Vec::new()).await
}
