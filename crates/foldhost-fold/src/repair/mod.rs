//! Cursor-expiry repair, the fold's side (docs/design.md, "Cursor-expiry repair"). When a watch
//! cannot resume — its cursor fell out of the stream at start, the live floor guard tripped
//! mid-stream, or a fold holds data but no cursor — `watch_applied` settles the fold and calls one
//! of two repairs:
//!
//! - [`relist`]: where "not in the bucket" means "deleted" ([`foldhost_core::protocol::listing_truth`]), the
//!   bucket's live keys are listed, sorted externally ([`KeySorter`]), merge-joined against the
//!   fold's own key-ordered scan, and every fold key the bucket no longer lists gets a synthetic
//!   delete (unknown version: it never moves the cursor) through parse/apply/store. The caller then
//!   starts a state-sync re-list, so a delete always precedes the re-list's put of the same key.
//! - [`restore`]: where eviction may have removed current values, the newest artifact from a
//!   [`RestoreSource`] that covers the watch's scope and is strictly ahead of the fold with its
//!   cursor still inside retention is imported into scratch, diffed against the fold in one
//!   key-ordered pass ([`foldhost_core::protocol::restore_key`]: never a key backward, never a live key deleted),
//!   and the difference is folded through parse/apply/store; the cursor moves to the artifact's in
//!   the final commit only.
//!
//! Invariants:
//! - Nothing here moves the cursor before a repair's last step: every change commits under the old
//!   cursor, so a crash at any point re-runs the repair from the start on restart, and both diffs
//!   are idempotent (a key already deleted or taken diffs as equal the second time).
//! - Memory is bounded by the stale keys (re-list) or the delete candidates (restore), never the
//!   fold, the listing or the artifact: the listing is sorted in runs of at most
//!   [`RepairConfig::sort_run_bytes`] spilled to scratch, the restore's replacement entries are
//!   spilled to scratch and read back a batch at a time.
//! - Every decision is a `protocol` function; this module only moves bytes between them.
//! - Scratch lives in [`RepairConfig::scratch`] and is removed after a repair; a crash leaves it,
//!   and the next repair clears it first.

//!
//! Code map: `extsort` — the bounded external sort of a key listing; `relist` — the key-listing
//! diff; `restore` — the artifact restore. Both repairs commit through [`RepairTarget`], the one
//! thing they need of the fold: they never see the fold loop.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;

use foldhost_artifact::artifact::ArtifactError;
use foldhost_core::kv::{KvError, KvReader, KvUpdate, WatchCursor};
use foldhost_core::protocol::RepairMode;
use foldhost_core::snapshot::{SnapshotError, SnapshotStore};
use foldhost_core::view::SharedStore;

mod extsort;
mod relist;
mod restore;

pub use extsort::{KeySorter, SortedKeys};
pub use relist::relist;
pub use restore::{RestoreSource, restore};

/// Default size of one sorted run of listed keys held in memory before it is spilled (64 MiB).
pub(crate) const DEFAULT_SORT_RUN_BYTES: usize = 64 << 20;

/// Most stale keys (re-list) or delete candidates (restore) one repair holds: the one part of a
/// repair that grows with the gap rather than staying bounded.
pub(crate) const MAX_HELD_KEYS: usize = 50_000_000;

/// How an expired cursor is repaired, and with what.
#[derive(Clone)]
pub struct RepairConfig {
    /// `--repair`: which repairs are allowed.
    pub mode: RepairMode,
    /// Where artifacts for a restore come from (`--restore-from`); `None` disarms the restore.
    pub restore_from: Option<RestoreSource>,
    /// The bucket's key listing (for the re-list diff and the restore's delete check).
    pub lister: Option<Arc<dyn KvReader>>,
    /// Scratch directory for sort runs, the imported artifact and the spill (created, and
    /// cleared before each repair). `None`: a directory under the system temp dir.
    pub scratch: Option<PathBuf>,
    /// Bytes of keys held in memory per sorted run before spilling.
    pub sort_run_bytes: usize,
    /// `--on-recreated`: what a fold does when its bucket's stream was recreated.
    pub on_recreated: foldhost_core::protocol::OnRecreated,
    /// `--on-diverged`: what a fold does when the log holds another record at its checkpoint
    /// (a broker restored from an older copy and written past the fold): the same two choices.
    pub on_diverged: foldhost_core::protocol::OnRecreated,
}

impl Default for RepairConfig {
    fn default() -> Self {
        RepairConfig {
            mode: RepairMode::None,
            restore_from: None,
            lister: None,
            scratch: None,
            sort_run_bytes: DEFAULT_SORT_RUN_BYTES,
            on_recreated: foldhost_core::protocol::OnRecreated::Refuse,
            on_diverged: foldhost_core::protocol::OnRecreated::Refuse,
        }
    }
}

impl std::fmt::Debug for RepairConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RepairConfig")
            .field("mode", &self.mode)
            .field("restore_from", &self.restore_from)
            .field("lister", &self.lister.is_some())
            .field("scratch", &self.scratch)
            .field("sort_run_bytes", &self.sort_run_bytes)
            .field("on_recreated", &self.on_recreated)
            .finish()
    }
}

impl RepairConfig {
    /// Whether an artifact restore can run (the mode allows it and a source is configured).
    pub(crate) fn restore_armed(&self) -> bool {
        matches!(self.mode, RepairMode::Restore | RepairMode::Auto) && self.restore_from.is_some()
    }

    fn scratch_dir(&self) -> PathBuf {
        self.scratch.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("foldhost-repair-{}", std::process::id()))
        })
    }
}

/// Why a repair did not run or did not finish. The fold is untouched by every refusal.
#[derive(Debug, thiserror::Error)]
pub enum RepairError {
    /// The repair is not allowed or not safe; the reason names why.
    #[error("cursor-expiry repair refused: {0}")]
    Refused(String),
    /// Reading or writing scratch failed.
    #[error("repair scratch {path}: {op}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// A scratch file read back is not what was written.
    #[error("repair scratch {path}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The bucket's listing or retention could not be read.
    #[error("repair: {0}")]
    Kv(#[from] KvError),
    /// The fold's store failed while being read.
    #[error("repair: reading the fold: {0}")]
    Snapshot(#[from] SnapshotError),
    /// The artifact failed a check on import.
    #[error("repair: {0}")]
    Artifact(#[from] ArtifactError),
    /// The imported artifact's store could not be opened.
    #[error("repair: {0}")]
    StoreDir(#[from] foldhost_core::storedir::StoreDirError),
    /// A blocking task failed.
    #[error("repair task: {0}")]
    Task(String),
}

pub(super) fn io_err(
    path: &Path,
    op: &'static str,
) -> impl FnOnce(std::io::Error) -> RepairError + use<> {
    let path = path.to_path_buf();
    move |source| RepairError::Io { path, op, source }
}

/// What a repair did, for the log and the tests.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RepairReport {
    /// `relist` or `restore`.
    pub kind: &'static str,
    /// Keys the bucket listed (re-list, or the restore's delete check).
    pub listed: u64,
    /// Fold keys deleted (synthetic deletes).
    pub deleted: u64,
    /// Entries taken from the artifact.
    pub taken: u64,
    /// The artifact restored from.
    pub artifact: Option<PathBuf>,
    /// The cursor after the repair (restore: the artifact's).
    pub cursor: Option<u64>,
}

/// What a repair needs of the fold it repairs, and nothing more: reads of the committed fold, its
/// cursor, and commits of the repair's own batches through the applier. The fold loop implements
/// it for the running fold (`applied`); a repair never sees the loop.
#[async_trait]
pub trait RepairTarget: Send {
    /// The fold's store.
    type Store: SnapshotStore;
    /// What a failed commit reports (the fold's own error).
    type Error: From<RepairError> + Send;
    /// The committed fold, for reads between commits.
    fn store(&self) -> SharedStore<Self::Store>;
    /// The fold's committed cursor.
    fn cursor(&self) -> WatchCursor;
    /// Folds `batch` through the applier and commits it, all of it, in batches of at most `max`
    /// (`batch` is empty afterwards).
    async fn commit_all(
        &mut self,
        batch: &mut Vec<KvUpdate>,
        max: usize,
    ) -> Result<(), Self::Error>;
    /// While set, commits keep the cursor where it is (a restore's difference carries real, older
    /// revisions that must not move it).
    fn freeze_cursor(&mut self, frozen: bool);
    /// Commits `cursor` with no data (a restore's last step).
    async fn commit_position(&mut self, cursor: WatchCursor) -> Result<(), Self::Error>;
}

pub(super) fn clear_dir(dir: &Path) -> Result<(), RepairError> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(dir, "clear")(e)),
    }
    std::fs::create_dir_all(dir).map_err(io_err(dir, "create"))
}

pub(super) fn block<T>(f: impl FnOnce() -> T) -> T {
    let multi = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}
