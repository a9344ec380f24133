//! Cursor-expiry repair, the fold's side (seed 000, "Cursor-expiry repair"). When a watch cannot
//! resume — its cursor fell out of the stream at start, the live floor guard tripped mid-stream, or
//! a fold holds data but no cursor — `watch_applied` settles the fold and calls one of two repairs:
//!
//! - [`relist`]: where "not in the bucket" means "deleted" ([`protocol::listing_truth`]), the
//!   bucket's live keys are listed, sorted externally ([`KeySorter`]), merge-joined against the
//!   fold's own key-ordered scan, and every fold key the bucket no longer lists gets a synthetic
//!   delete (unknown version: it never moves the cursor) through parse/apply/store. The caller then
//!   starts a state-sync re-list, so a delete always precedes the re-list's put of the same key.
//! - [`restore`]: where eviction may have removed current values, the newest artifact from a
//!   [`RestoreSource`] that covers the watch's scope and is strictly ahead of the fold with its
//!   cursor still inside retention is imported into scratch, diffed against the fold in one
//!   key-ordered pass ([`protocol::restore_key`]: never a key backward, never a live key deleted),
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

use std::collections::{BinaryHeap, HashSet};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;

use crate::applied::{AppliedError, Apply, Fold};
use crate::artifact::{self, ArtifactError, ExportManifest};
use crate::crashpoint;
use crate::kv::{KvEntry, KvError, KvReader, KvUpdate, KvWatcher, VersionToken, WatchScope};
use crate::protocol::{self, KeyRestore, RepairMode};
use crate::retained::is_reserved;
use crate::snapshot::{SnapshotError, SnapshotStore};
use crate::storedir::{AnyStore, Backend};

/// Default size of one sorted run of listed keys held in memory before it is spilled (64 MiB).
pub const DEFAULT_SORT_RUN_BYTES: usize = 64 << 20;

/// Most stale keys (re-list) or delete candidates (restore) one repair holds: the one part of a
/// repair that grows with the gap rather than staying bounded.
pub const MAX_HELD_KEYS: usize = 50_000_000;

/// Entries read from the artifact per page of its key-ordered scan.
const PAGE: usize = 1024;

/// Longest key the spill files accept (NATS keys are far shorter; this guards the reader).
const MAX_SPILL_KEY: usize = 64 * 1024;

/// Largest value the spill file accepts (the store's own limit is lower).
const MAX_SPILL_VALUE: usize = 64 << 20;

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
    pub on_recreated: crate::protocol::OnRecreated,
}

impl Default for RepairConfig {
    fn default() -> Self {
        RepairConfig {
            mode: RepairMode::None,
            restore_from: None,
            lister: None,
            scratch: None,
            sort_run_bytes: DEFAULT_SORT_RUN_BYTES,
            on_recreated: crate::protocol::OnRecreated::Refuse,
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
    pub fn restore_armed(&self) -> bool {
        matches!(self.mode, RepairMode::Restore | RepairMode::Auto) && self.restore_from.is_some()
    }

    fn scratch_dir(&self) -> PathBuf {
        self.scratch.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("foldhost-repair-{}", std::process::id()))
        })
    }
}

impl std::str::FromStr for RepairMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(RepairMode::Auto),
            "relist" => Ok(RepairMode::Relist),
            "restore" => Ok(RepairMode::Restore),
            "none" => Ok(RepairMode::None),
            other => Err(format!(
                "{other:?} is not a repair mode (auto, relist, restore, none)"
            )),
        }
    }
}

impl std::str::FromStr for crate::protocol::OnRecreated {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "refuse" => Ok(crate::protocol::OnRecreated::Refuse),
            "relist" => Ok(crate::protocol::OnRecreated::Relist),
            other => Err(format!(
                "{other:?} is not what to do with a recreated bucket (refuse, relist)"
            )),
        }
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
    StoreDir(#[from] crate::storedir::StoreDirError),
    /// A blocking task failed.
    #[error("repair task: {0}")]
    Task(String),
}

fn io_err(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> RepairError + use<> {
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

// ---------------------------------------------------------------------------------------------
// External sort of the key listing.

/// Sorts a stream of keys in bounded memory: runs of up to `run_bytes` are sorted and spilled to
/// files in a scratch directory, then merged ([`SortedKeys`]). Duplicates are dropped.
pub struct KeySorter {
    dir: PathBuf,
    run_bytes: usize,
    buf: Vec<String>,
    buf_bytes: usize,
    runs: Vec<PathBuf>,
}

impl KeySorter {
    /// A sorter spilling into `dir` (created if missing).
    pub fn new(dir: &Path, run_bytes: usize) -> Result<Self, RepairError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir, "create"))?;
        Ok(KeySorter {
            dir: dir.to_path_buf(),
            run_bytes: run_bytes.max(1),
            buf: Vec::new(),
            buf_bytes: 0,
            runs: Vec::new(),
        })
    }

    /// Adds one key.
    pub fn push(&mut self, key: String) -> Result<(), RepairError> {
        if key.len() > MAX_SPILL_KEY {
            return Err(RepairError::Refused(format!(
                "a listed key of {} bytes is over the {MAX_SPILL_KEY}-byte limit",
                key.len()
            )));
        }
        self.buf_bytes += key.len() + std::mem::size_of::<String>();
        self.buf.push(key);
        if self.buf_bytes >= self.run_bytes {
            // Sorting and writing a run blocks; keep it off the runtime's async workers.
            block(|| self.spill())?;
        }
        Ok(())
    }

    /// Runs spilled so far (for tests and logs).
    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    fn spill(&mut self) -> Result<(), RepairError> {
        self.buf.sort_unstable();
        self.buf.dedup();
        let path = self.dir.join(format!("run-{:06}", self.runs.len()));
        let f = File::create(&path).map_err(io_err(&path, "create run"))?;
        let mut w = BufWriter::new(f);
        for k in self.buf.drain(..) {
            w.write_all(&(k.len() as u32).to_le_bytes())
                .and_then(|()| w.write_all(k.as_bytes()))
                .map_err(io_err(&path, "write run"))?;
        }
        w.flush().map_err(io_err(&path, "write run"))?;
        self.buf_bytes = 0;
        self.runs.push(path);
        Ok(())
    }

    /// Every key pushed, ascending, each once.
    pub fn finish(mut self) -> Result<SortedKeys, RepairError> {
        if self.runs.is_empty() {
            self.buf.sort_unstable();
            self.buf.dedup();
            return Ok(SortedKeys {
                memory: std::mem::take(&mut self.buf).into_iter(),
                runs: Vec::new(),
                heap: BinaryHeap::new(),
                last: None,
            });
        }
        if !self.buf.is_empty() {
            self.spill()?;
        }
        let mut runs = Vec::with_capacity(self.runs.len());
        let mut heap = BinaryHeap::new();
        for (i, p) in self.runs.iter().enumerate() {
            let f = File::open(p).map_err(io_err(p, "open run"))?;
            let mut r = RunReader {
                path: p.clone(),
                r: BufReader::new(f),
            };
            if let Some(k) = r.next_key()? {
                heap.push(std::cmp::Reverse((k, i)));
            }
            runs.push(r);
        }
        Ok(SortedKeys {
            memory: Vec::new().into_iter(),
            runs,
            heap,
            last: None,
        })
    }
}

struct RunReader {
    path: PathBuf,
    r: BufReader<File>,
}

impl RunReader {
    fn next_key(&mut self) -> Result<Option<String>, RepairError> {
        let mut len = [0u8; 4];
        match self.r.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(io_err(&self.path, "read run")(e)),
        }
        let n = u32::from_le_bytes(len) as usize;
        if n > MAX_SPILL_KEY {
            return Err(RepairError::Corrupt {
                path: self.path.clone(),
                reason: format!("a key length of {n} bytes"),
            });
        }
        let mut b = vec![0u8; n];
        self.r
            .read_exact(&mut b)
            .map_err(io_err(&self.path, "read run"))?;
        String::from_utf8(b)
            .map(Some)
            .map_err(|_| RepairError::Corrupt {
                path: self.path.clone(),
                reason: "a key is not UTF-8".into(),
            })
    }
}

/// The merged, ascending, de-duplicated output of a [`KeySorter`].
pub struct SortedKeys {
    memory: std::vec::IntoIter<String>,
    runs: Vec<RunReader>,
    heap: BinaryHeap<std::cmp::Reverse<(String, usize)>>,
    last: Option<String>,
}

impl SortedKeys {
    /// The next key, or `None` at the end.
    pub fn next_key(&mut self) -> Result<Option<String>, RepairError> {
        if self.runs.is_empty() {
            return Ok(self.memory.next());
        }
        loop {
            let Some(std::cmp::Reverse((k, i))) = self.heap.pop() else {
                return Ok(None);
            };
            if let Some(next) = self.runs[i].next_key()? {
                self.heap.push(std::cmp::Reverse((next, i)));
            }
            if self.last.as_deref() == Some(k.as_str()) {
                continue;
            }
            self.last = Some(k.clone());
            return Ok(Some(k));
        }
    }
}

/// A one-key lookahead over [`SortedKeys`].
struct Peekable {
    keys: SortedKeys,
    head: Option<String>,
}

impl Peekable {
    fn new(mut keys: SortedKeys) -> Result<Self, RepairError> {
        let head = keys.next_key()?;
        Ok(Peekable { keys, head })
    }
    fn advance(&mut self) -> Result<(), RepairError> {
        self.head = self.keys.next_key()?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Shared steps.

/// Lists `scope`'s live keys into a sorter under `dir`.
async fn list_sorted(
    lister: &dyn KvReader,
    scope: &WatchScope,
    dir: &Path,
    run_bytes: usize,
) -> Result<(SortedKeys, u64), RepairError> {
    let mut sorter = KeySorter::new(dir, run_bytes)?;
    let mut failed: Option<RepairError> = None;
    let n = lister
        .for_each_key(scope, &mut |k| {
            if failed.is_none()
                && let Err(e) = sorter.push(k)
            {
                failed = Some(e);
            }
            Ok(())
        })
        .await?;
    if let Some(e) = failed {
        return Err(e);
    }
    tracing::info!(keys = n, runs = sorter.runs(), "repair: bucket listed");
    Ok((block(|| sorter.finish())?, n))
}

/// Fold keys in `scope` the sorted listing does not have (reserved keys excluded): one
/// merge-join of two key-ordered streams. Memory: the result.
fn stale_keys<S: SnapshotStore + ?Sized>(
    store: &S,
    scope: &WatchScope,
    listing: SortedKeys,
) -> Result<Vec<String>, RepairError> {
    let mut listing = Peekable::new(listing)?;
    let mut stale = Vec::new();
    let mut failed: Option<RepairError> = None;
    for prefix in scope.disjoint_prefixes() {
        store.for_each_in_range(&prefix, &mut |e| {
            if is_reserved(&e.key) {
                return ControlFlow::Continue(());
            }
            loop {
                match listing.head.as_deref() {
                    Some(l) if l < e.key.as_str() => {
                        if let Err(err) = listing.advance() {
                            failed = Some(err);
                            return ControlFlow::Break(());
                        }
                    }
                    Some(l) if l == e.key.as_str() => {
                        if let Err(err) = listing.advance() {
                            failed = Some(err);
                            return ControlFlow::Break(());
                        }
                        return ControlFlow::Continue(());
                    }
                    _ => break,
                }
            }
            if stale.len() >= MAX_HELD_KEYS {
                failed = Some(RepairError::Refused(format!(
                    "more than {MAX_HELD_KEYS} stale keys"
                )));
                return ControlFlow::Break(());
            }
            stale.push(e.key.clone());
            ControlFlow::Continue(())
        })?;
        if let Some(e) = failed.take() {
            return Err(e);
        }
    }
    Ok(stale)
}

/// Folds synthetic deletes of `keys` (unknown version: no cursor move) in batches of `max`,
/// passing the crash point `point` after each committed batch.
async fn fold_deletes<S: SnapshotStore, A: Apply + ?Sized>(
    fold: &mut Fold<S>,
    apply: &mut A,
    keys: Vec<String>,
    max: usize,
    point: &'static str,
) -> Result<u64, AppliedError> {
    let n = keys.len() as u64;
    let mut batch: Vec<KvUpdate> = Vec::with_capacity(max);
    for key in keys {
        batch.push(KvUpdate::Delete {
            key,
            version: VersionToken::UNKNOWN,
        });
        if batch.len() >= max {
            crate::applied::flush_all(fold, &mut batch, max, apply).await?;
            crashpoint::hit(point);
        }
    }
    if !batch.is_empty() {
        crate::applied::flush_all(fold, &mut batch, max, apply).await?;
        crashpoint::hit(point);
    }
    Ok(n)
}

fn clear_dir(dir: &Path) -> Result<(), RepairError> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(dir, "clear")(e)),
    }
    std::fs::create_dir_all(dir).map_err(io_err(dir, "create"))
}

fn block<T>(f: impl FnOnce() -> T) -> T {
    let multi = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

// ---------------------------------------------------------------------------------------------
// Re-list.

/// The key-listing diff: deletes every fold key in `scope` the bucket no longer lists. The fold
/// must be settled. The caller starts a state-sync re-list afterwards (the cursor is unchanged).
pub async fn relist<S: SnapshotStore, A: Apply + ?Sized>(
    fold: &mut Fold<S>,
    apply: &mut A,
    cfg: &RepairConfig,
    scope: &WatchScope,
    max: usize,
) -> Result<RepairReport, AppliedError> {
    let lister = cfg
        .lister
        .clone()
        .ok_or_else(|| RepairError::Refused("no key listing available for a re-list".into()))?;
    let scratch = cfg.scratch_dir();
    block(|| clear_dir(&scratch))?;
    let (listing, listed) =
        list_sorted(&*lister, scope, &scratch.join("sort"), cfg.sort_run_bytes).await?;
    let store = fold.store().clone();
    let stale = block(|| -> Result<Vec<String>, RepairError> {
        let s = store.read()?;
        stale_keys(&*s, scope, listing)
    })?;
    tracing::info!(listed, stale = stale.len(), "repair: re-list diff");
    let deleted = fold_deletes(fold, apply, stale, max, crashpoint::RELIST_BATCH).await?;
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(RepairReport {
        kind: "relist",
        listed,
        deleted,
        cursor: fold.cursor().revision(),
        ..Default::default()
    })
}

// ---------------------------------------------------------------------------------------------
// Restore.

/// Where artifacts for a restore come from: a local directory holding artifact directories and
/// `.tar` files (the object-store transport plugs in here later). Names starting with `.` (stages
/// being written) are ignored.
#[derive(Clone, Debug)]
pub struct RestoreSource {
    dir: PathBuf,
}

impl RestoreSource {
    /// A source reading `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        RestoreSource { dir: dir.into() }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The artifact with the highest cursor and its manifest (peeked, not verified: the import
    /// verifies). Entries whose manifest cannot be read are skipped with a warning.
    pub fn newest(&self) -> Result<Option<(PathBuf, ExportManifest)>, RepairError> {
        let rd = std::fs::read_dir(&self.dir).map_err(io_err(&self.dir, "list artifacts"))?;
        let mut best: Option<(PathBuf, ExportManifest)> = None;
        for ent in rd {
            let ent = ent.map_err(io_err(&self.dir, "list artifacts"))?;
            let path = ent.path();
            if ent.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let m = if path.is_dir() {
                artifact::read_manifest(&path)
            } else {
                artifact::peek_tar_manifest(&path)
            };
            match m {
                Ok(m) => {
                    let better = best
                        .as_ref()
                        .is_none_or(|(_, b)| m.cursor.unwrap_or(0) > b.cursor.unwrap_or(0));
                    if better {
                        best = Some((path, m));
                    }
                }
                Err(e) => {
                    tracing::warn!(artifact = %path.display(), error = %e, "restore source: skipping an unreadable artifact")
                }
            }
        }
        Ok(best)
    }
}

/// The prefixes an artifact's recorded scope covers; `None` when it recorded none.
fn artifact_prefixes(m: &ExportManifest) -> Option<Vec<String>> {
    let s = WatchScope::parse(m.scope.as_deref()?).ok()?;
    Some(s.disjoint_prefixes())
}

/// Refuses an artifact that does not cover `scope` or may not replace the fold.
fn check_artifact(
    path: &Path,
    m: &ExportManifest,
    scope: &WatchScope,
    local: Option<u64>,
    first_sequence: u64,
) -> Result<u64, RepairError> {
    let what = path.display();
    let Some(rev) = m.cursor else {
        return Err(RepairError::Refused(format!(
            "artifact {what} has no cursor"
        )));
    };
    let Some(covers) = artifact_prefixes(m) else {
        return Err(RepairError::Refused(format!(
            "artifact {what} records no watch scope (exported offline?): it cannot vouch for a scope; export from a running host"
        )));
    };
    let a: Vec<&str> = covers.iter().map(String::as_str).collect();
    let want = scope.disjoint_prefixes();
    let w: Vec<&str> = want.iter().map(String::as_str).collect();
    if !protocol::scope_covers(&a, &w) {
        return Err(RepairError::Refused(format!(
            "artifact {what} covers scope {} but the watch is {scope}",
            m.scope.as_deref().unwrap_or("?")
        )));
    }
    if !protocol::restore_allowed(rev, local, first_sequence) {
        return Err(RepairError::Refused(format!(
            "stale artifact {what}: its cursor {rev}, the fold's {}, the stream's first retained revision {first_sequence} (a restore needs an artifact strictly ahead of the fold whose cursor is still inside retention)",
            local.map_or("none".to_string(), |l| l.to_string())
        )));
    }
    Ok(rev)
}

/// Appends one entry to the spill.
fn spill_entry(w: &mut impl Write, e: &KvEntry) -> std::io::Result<()> {
    w.write_all(&(e.key.len() as u32).to_le_bytes())?;
    w.write_all(e.key.as_bytes())?;
    let v = e.version.as_bytes();
    w.write_all(&[v.len() as u8])?;
    w.write_all(v)?;
    w.write_all(&(e.value.len() as u32).to_le_bytes())?;
    w.write_all(&e.value)
}

/// Reads one spilled entry back (`None` at the end), bounds-checked.
fn read_spilled(r: &mut impl Read, path: &Path) -> Result<Option<KvEntry>, RepairError> {
    let corrupt = |reason: &str| RepairError::Corrupt {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(io_err(path, "read spill")(e)),
    }
    let kl = u32::from_le_bytes(len) as usize;
    if kl > MAX_SPILL_KEY {
        return Err(corrupt("key length over the limit"));
    }
    let mut key = vec![0u8; kl];
    r.read_exact(&mut key).map_err(io_err(path, "read spill"))?;
    let key = String::from_utf8(key).map_err(|_| corrupt("key not UTF-8"))?;
    let mut vl = [0u8; 1];
    r.read_exact(&mut vl).map_err(io_err(path, "read spill"))?;
    let mut ver = vec![0u8; vl[0] as usize];
    r.read_exact(&mut ver).map_err(io_err(path, "read spill"))?;
    let version = VersionToken::from_bytes(&ver).ok_or_else(|| corrupt("version too long"))?;
    r.read_exact(&mut len).map_err(io_err(path, "read spill"))?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_SPILL_VALUE {
        return Err(corrupt("value length over the limit"));
    }
    let mut value = vec![0u8; n];
    r.read_exact(&mut value)
        .map_err(io_err(path, "read spill"))?;
    Ok(Some(KvEntry {
        key,
        value: Bytes::from(value),
        version,
    }))
}

/// A local entry's revision for [`protocol::restore_key`]: an unknown version counts as 0.
fn local_revision(e: &KvEntry) -> u64 {
    e.version.as_u64().unwrap_or(0)
}

/// Pages through `store`'s entries under `prefix` in key order (a pull iterator over a push scan).
struct Paged<'a, T: SnapshotStore + ?Sized> {
    store: &'a T,
    prefix: &'a str,
    buf: std::collections::VecDeque<KvEntry>,
    last: Option<String>,
    done: bool,
}

impl<'a, T: SnapshotStore + ?Sized> Paged<'a, T> {
    fn new(store: &'a T, prefix: &'a str) -> Self {
        Paged {
            store,
            prefix,
            buf: Default::default(),
            last: None,
            done: false,
        }
    }

    fn peek(&mut self) -> Result<Option<&KvEntry>, SnapshotError> {
        while self.buf.is_empty() && !self.done {
            let mut page = Vec::with_capacity(PAGE);
            self.store
                .for_each_in_range_after(self.prefix, self.last.as_deref(), &mut |e| {
                    page.push(e.clone());
                    if page.len() >= PAGE {
                        ControlFlow::Break(())
                    } else {
                        ControlFlow::Continue(())
                    }
                })?;
            if page.len() < PAGE {
                self.done = true;
            }
            self.last = page.last().map(|e| e.key.clone());
            // The artifact's own reserved keys (its exporter's retained records) are not ours.
            self.buf
                .extend(page.into_iter().filter(|e| !is_reserved(&e.key)));
        }
        Ok(self.buf.front())
    }

    fn pop(&mut self) -> Option<KvEntry> {
        self.buf.pop_front()
    }
}

/// One key-ordered pass over the fold and the artifact: entries to take go to `spill`, local keys
/// the artifact lacks are returned as delete candidates (with the listing not yet consulted).
fn restore_diff<L: SnapshotStore + ?Sized, R: SnapshotStore + ?Sized>(
    local: &L,
    art: &R,
    scope: &WatchScope,
    spill: &mut impl Write,
    spill_path: &Path,
) -> Result<(u64, Vec<String>), RepairError> {
    let mut taken = 0u64;
    let mut candidates = Vec::new();
    let mut failed: Option<RepairError> = None;
    let mut take = |e: &KvEntry, taken: &mut u64| -> Result<(), RepairError> {
        *taken += 1;
        spill_entry(spill, e).map_err(io_err(spill_path, "write spill"))
    };
    for prefix in scope.disjoint_prefixes() {
        let mut a = Paged::new(art, &prefix);
        local.for_each_in_range(&prefix, &mut |l| {
            if is_reserved(&l.key) {
                return ControlFlow::Continue(());
            }
            let step = (|| -> Result<(), RepairError> {
                // Artifact keys before this local key: absent locally.
                while let Some(ae) = a.peek()? {
                    if ae.key.as_str() >= l.key.as_str() {
                        break;
                    }
                    let ae = a.pop().expect("peeked");
                    if protocol::restore_key(
                        None,
                        Some(ae.version.as_u64().unwrap_or(0)),
                        false,
                        false,
                    ) == KeyRestore::Take
                    {
                        take(&ae, &mut taken)?;
                    }
                }
                let same_key = a.peek()?.is_some_and(|ae| ae.key == l.key);
                if same_key {
                    let ae = a.pop().expect("peeked");
                    let identical = ae.version == l.version && ae.value == l.value;
                    let d = protocol::restore_key(
                        Some(local_revision(l)),
                        Some(ae.version.as_u64().unwrap_or(0)),
                        identical,
                        false,
                    );
                    if d == KeyRestore::Take {
                        take(&ae, &mut taken)?;
                    }
                } else if protocol::restore_key(Some(local_revision(l)), None, false, false)
                    == KeyRestore::Delete
                {
                    if candidates.len() >= MAX_HELD_KEYS {
                        return Err(RepairError::Refused(format!(
                            "more than {MAX_HELD_KEYS} delete candidates"
                        )));
                    }
                    candidates.push(l.key.clone());
                }
                Ok(())
            })();
            match step {
                Ok(()) => ControlFlow::Continue(()),
                Err(e) => {
                    failed = Some(e);
                    ControlFlow::Break(())
                }
            }
        })?;
        if let Some(e) = failed.take() {
            return Err(e);
        }
        while a.peek()?.is_some() {
            let ae = a.pop().expect("peeked");
            if protocol::restore_key(None, Some(ae.version.as_u64().unwrap_or(0)), false, false)
                == KeyRestore::Take
            {
                take(&ae, &mut taken)?;
            }
        }
    }
    Ok((taken, candidates))
}

/// The artifact restore. The fold must be settled. On success the cursor is the artifact's and
/// the caller resumes from it; on a refusal the fold is untouched.
pub async fn restore<S: SnapshotStore, A: Apply + ?Sized>(
    fold: &mut Fold<S>,
    apply: &mut A,
    cfg: &RepairConfig,
    watcher: &dyn KvWatcher,
    scope: &WatchScope,
    max: usize,
) -> Result<RepairReport, AppliedError> {
    let source = cfg.restore_from.as_ref().ok_or_else(|| {
        RepairError::Refused("no artifact source to restore from (give --restore-from DIR)".into())
    })?;
    let first_sequence = |r: Option<protocol::Retention>| {
        r.map(|r| r.first_revision)
            .ok_or_else(|| RepairError::Refused("the bucket cannot report its retention".into()))
    };
    let first = first_sequence(watcher.retention().await.map_err(RepairError::from)?)?;
    let local = fold.cursor().revision();
    let (path, peeked) = block(|| source.newest())?.ok_or_else(|| {
        RepairError::Refused(format!(
            "no artifact in {} to restore from",
            source.dir().display()
        ))
    })?;
    // Checked before anything is downloaded or imported.
    check_artifact(&path, &peeked, scope, local, first)?;
    let scratch = cfg.scratch_dir();
    block(|| clear_dir(&scratch))?;
    let imported_dir = scratch.join("artifact");
    let (p2, d2) = (path.clone(), imported_dir.clone());
    let manifest = tokio::task::spawn_blocking(move || {
        artifact::import_artifact(&p2, &d2, None, &mut |_, _| {})
    })
    .await
    .map_err(|e| RepairError::Task(e.to_string()))?
    .map_err(RepairError::from)?;
    // Re-checked against what actually arrived, and against the fold's own cursor now.
    let rev = check_artifact(&path, &manifest, scope, fold.cursor().revision(), first)?;
    let backend: Backend = manifest
        .backend
        .parse()
        .map_err(|e: String| RepairError::Refused(format!("artifact {}: {e}", path.display())))?;
    let (art, _) = block(|| AnyStore::open(&imported_dir, backend)).map_err(RepairError::from)?;
    let art_cursor = art.cursor();
    // An artifact of another stream (the bucket's earlier incarnation, another bucket) would mix
    // two streams' keys: refused by the identity check the fold's own start makes.
    if let Some(live) = watcher.stream_state().await.map_err(RepairError::from)? {
        let recorded = match art
            .get(crate::retained::IDENTITY_KEY)
            .map_err(RepairError::from)?
        {
            Some(e) => Some(
                crate::kv::StreamIdentity::from_bytes(&e.value).ok_or_else(|| {
                    RepairError::Refused(format!(
                        "artifact {}: its stream identity record does not decode",
                        path.display()
                    ))
                })?,
            ),
            None => None,
        };
        let verdict = protocol::stream_identity_check(
            recorded.as_ref(),
            &live.identity,
            Some(rev),
            live.last_sequence,
        );
        if matches!(
            verdict,
            protocol::IdentityVerdict::Recreated | protocol::IdentityVerdict::CursorAhead
        ) {
            let was =
                recorded.map_or_else(|| "an unrecorded stream".to_string(), |r| r.to_string());
            return Err(RepairError::Refused(format!(
                "artifact {} folds {was} at cursor {rev}, but the bucket is {} with last sequence {}",
                path.display(),
                live.identity,
                live.last_sequence
            ))
            .into());
        }
    }
    let spill_path = scratch.join("take.spill");
    let store = fold.store().clone();
    let (taken, candidates) = block(|| -> Result<(u64, Vec<String>), RepairError> {
        let f = File::create(&spill_path).map_err(io_err(&spill_path, "create spill"))?;
        let mut w = BufWriter::new(f);
        let s = store.read()?;
        let r = restore_diff(&*s, &art, scope, &mut w, &spill_path)?;
        w.flush().map_err(io_err(&spill_path, "write spill"))?;
        Ok(r)
    })?;
    drop(art);
    let mut listed = 0;
    let mut deletes = candidates;
    if !deletes.is_empty() {
        // A key the artifact lacks is deleted only if the bucket does not list it live: a live
        // key's latest write is after the artifact's cursor, and the resume delivers it.
        let lister = cfg.lister.clone().ok_or_else(|| {
            RepairError::Refused("no key listing to check delete candidates against".into())
        })?;
        let mut live: HashSet<String> = HashSet::new();
        let cands: HashSet<&str> = deletes.iter().map(String::as_str).collect();
        listed = lister
            .for_each_key(scope, &mut |k| {
                if cands.contains(k.as_str()) {
                    live.insert(k);
                }
                Ok(())
            })
            .await
            .map_err(RepairError::from)?;
        drop(cands);
        deletes.retain(|k| {
            protocol::restore_key(Some(1), None, false, live.contains(k)) == KeyRestore::Delete
        });
        // The listing vouches for writes after the artifact's cursor only while the log still
        // holds all of them.
        let first = first_sequence(watcher.retention().await.map_err(RepairError::from)?)?;
        if !protocol::resume_window_ok(rev, first) {
            return Err(RepairError::Refused(format!(
                "retention passed the artifact's cursor {rev} during the restore (first retained revision now {first})"
            ))
            .into());
        }
    }
    tracing::info!(artifact = %path.display(), cursor = rev, taken, deletes = deletes.len(), "repair: restore diff");
    // Fold the difference under the old cursor, then move the cursor in one last commit.
    fold.freeze_cursor(true);
    let folded = async {
        let f = File::open(&spill_path).map_err(io_err(&spill_path, "open spill"))?;
        let mut r = BufReader::new(f);
        let mut batch: Vec<KvUpdate> = Vec::with_capacity(max);
        loop {
            let next = read_spilled(&mut r, &spill_path)?;
            let end = next.is_none();
            if let Some(e) = next {
                batch.push(KvUpdate::Put(e));
            }
            if batch.len() >= max || (end && !batch.is_empty()) {
                crate::applied::flush_all(fold, &mut batch, max, apply).await?;
                crashpoint::hit(crashpoint::RESTORE_BATCH);
            }
            if end {
                break;
            }
        }
        let deletes = std::mem::take(&mut deletes);
        fold_deletes(fold, apply, deletes, max, crashpoint::RESTORE_BATCH).await
    }
    .await;
    fold.freeze_cursor(false);
    let deleted = folded?;
    let memo = fold.cursor().memo().or(art_cursor.memo());
    let cursor = crate::kv::WatchCursor::at(rev).with_memo(memo);
    crashpoint::hit(crashpoint::RESTORE_BEFORE_CURSOR);
    fold.commit_position(cursor, apply).await?;
    block(|| {
        let _ = std::fs::remove_dir_all(&scratch);
    });
    Ok(RepairReport {
        kind: "restore",
        listed,
        deleted,
        taken,
        artifact: Some(path),
        cursor: Some(rev),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(keys: &[&str], run_bytes: usize) -> (Vec<String>, usize) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = KeySorter::new(dir.path(), run_bytes).expect("sorter");
        for k in keys {
            s.push(k.to_string()).expect("push");
        }
        let runs = s.runs();
        let mut out = Vec::new();
        let mut it = s.finish().expect("finish");
        while let Some(k) = it.next_key().expect("next") {
            out.push(k);
        }
        (out, runs)
    }

    #[test]
    fn the_key_sorter_sorts_and_dedups_in_memory_and_across_spilled_runs() {
        let keys: Vec<String> = (0..5000u32)
            .map(|i| format!("k{:05}", (i * 7919) % 3000))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut want: Vec<String> = keys.clone();
        want.sort();
        want.dedup();
        let (mem, runs) = sorted(&refs, usize::MAX);
        assert_eq!(runs, 0);
        assert_eq!(mem, want);
        // Tiny runs: many spills, the same answer.
        let (spilled, runs) = sorted(&refs, 2048);
        assert!(runs > 10, "{runs} runs");
        assert_eq!(spilled, want);
    }

    #[test]
    fn spilled_entries_read_back_exactly_and_a_bad_length_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("s");
        let entries = [
            KvEntry {
                key: "a".into(),
                value: Bytes::from_static(b"1"),
                version: VersionToken::from_u64(7),
            },
            KvEntry {
                key: "b/c".into(),
                value: Bytes::new(),
                version: VersionToken::from_bytes(&[9; 10]).expect("ten"),
            },
        ];
        let mut buf = Vec::new();
        for e in &entries {
            spill_entry(&mut buf, e).expect("write");
        }
        let mut r = &buf[..];
        for e in &entries {
            assert_eq!(read_spilled(&mut r, &p).expect("read").as_ref(), Some(e));
        }
        assert!(read_spilled(&mut r, &p).expect("end").is_none());
        let mut bad = buf.clone();
        bad[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            read_spilled(&mut &bad[..], &p),
            Err(RepairError::Corrupt { .. })
        ));
    }
}
