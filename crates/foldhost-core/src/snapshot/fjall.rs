//! [`FjallSnapshot`] (cargo feature `fjall`): the durable fold in fjall, a pure-Rust LSM, for folds
//! too large for RAM. Files live in `STORE/fjall/`.
//!
//! Invariants:
//! - **One keyspace, two key spaces, one atomic batch per apply.** Everything lives in a single
//!   fjall keyspace (one LSM tree: one journal, one version file), with a tag byte in front of
//!   every stored key: `d` + the KV key for data (values in the [`super::value_codec`] format),
//!   `m` + a name for meta (`mcursor`, `mcount`). A data key — even one of the host's `\x01…`
//!   reserved keys — is always `d…`, so it can never collide with a meta key. A batch's data
//!   writes, its cursor and the new key count are one fjall write batch: after any crash, either
//!   all of it is recovered or none of it. (One tree rather than two keyspaces also makes a file
//!   copy of the store consistent as a whole: there is a single version file to check.)
//! - **Durability.** With [`FjallOptions::sync`] `false` (the default) a committed apply is handed to
//!   the OS (the journal's in-process buffer is flushed on every batch, `PersistMode::Buffer`; fjall
//!   would otherwise keep it in the process until its buffer fills): it survives a *process* crash, not a
//!   power loss; a power loss can take the fold back to an earlier cursor, never to a cursor
//!   without its data (journal recovery drops a torn last batch). With `sync` `true` every apply
//!   fsyncs the journal before returning and survives a power loss too.
//! - **`len` is kept, not scanned**: the count is stored under `mcount` in the same batch; each
//!   apply probes whether its keys existed (one point read per distinct key).
//! - **Scans iterate** over a range of the tree; nothing materialises the fold.
//! - **Poisoned after a failed write** until reopened (fjall poisons its own handle as well).
//! - **Read-only opens never write into the store.** fjall has no read-only mode: every open takes
//!   the directory's lock and may repair the journal. So [`FjallSnapshot::open_read_only`] opens a
//!   *private copy*: the store's table and blob files hard-linked (immutable in fjall; byte-copied
//!   when the temporary directory is on another filesystem), the journal and metadata byte-copied,
//!   into a temporary directory that is removed when the store is dropped. It works beside a
//!   running host and sees a consistent earlier-or-equal state (a torn last batch in the copied
//!   journal is dropped by recovery, in the copy). The copy is retried (bounded) when the tree's
//!   version changes or a file vanishes mid-copy.
//! - **A clean stop leaves at most [`CLEAN_STOP_JOURNAL_BYTES`] of journal to replay**
//!   ([`FjallSnapshot::close_durably`]): a small journal is fsynced and kept (no table, so no
//!   compaction for the close to wait for); a larger one, or a fresh preallocated one, is flushed
//!   into a table and emptied ([`FjallSnapshot::close_flushed`]).
//! - **Export is flush + the same copy without the journals' contents + verify.**
//!   [`SnapshotStore::export_to`] flushes the memtable into a table, copies the directory into
//!   `DEST/fjall` as above but with each journal an empty file (everything it held is in a table),
//!   opens the copy and requires the same cursor and count (bounded retry). An imported artifact
//!   therefore opens from tables alone, replaying no journal.

use std::ops::{Bound, ControlFlow};
use std::path::{Path, PathBuf};

use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};

use super::lsm::{self, Op};
use super::{ProvenCopy, SnapshotError, SnapshotStore};
use crate::kv::{KvEntry, KvUpdate, WatchCursor};

/// The subdirectory of the store directory that holds fjall's files.
pub(crate) const DB_DIR: &str = "fjall";
/// The keyspace holding data and meta.
const KEYSPACE: &str = "fold";
/// Tag of data keys.
const DATA_TAG: u8 = b'd';
/// Meta key of the cursor.
const CURSOR_KEY: &[u8] = b"mcursor";
/// Meta key of the live-key count.
const COUNT_KEY: &[u8] = b"mcount";
/// Longest a flush of the memtable (at a clean stop, an export) may take before it fails.
const FLUSH_WAIT: std::time::Duration = std::time::Duration::from_secs(60);
/// Attempts at a consistent copy before giving up.
const COPY_ATTEMPTS: usize = 5;

/// Tuning for [`FjallSnapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FjallOptions {
    /// Fsync the journal on every apply (survive a power loss), not only hand it to the OS (survive
    /// a process crash). Default `false`.
    pub sync: bool,
    /// Block cache capacity in bytes. Default 64 MiB.
    pub cache_bytes: u64,
}

impl Default for FjallOptions {
    fn default() -> Self {
        FjallOptions {
            sync: false,
            cache_bytes: 64 << 20,
        }
    }
}

/// The durable fold in fjall. See the module docs for what it guarantees.
pub struct FjallSnapshot {
    path: PathBuf,
    db: Database,
    tree: Keyspace,
    cursor: WatchCursor,
    count: u64,
    sync: bool,
    read_only: bool,
    poisoned: Option<String>,
    fail_next_write: bool,
    /// A clean stop kept the journal (small enough to replay): the drop must not flush.
    journal_kept: bool,
    /// The private copy a read-only open reads (removed on drop, after `db`).
    _copy: Option<tempfile::TempDir>,
}

/// A clean close of a writable store flushes the active memtable into a table, so the next open
/// (and a read-only open's private copy) has no journal to replay: a resume after a clean stop
/// reads tables, not a replay of up to 64 MiB of journal. Best effort: a failure here loses nothing
/// (the journal still holds every batch) and only costs the next open its replay.
impl Drop for FjallSnapshot {
    fn drop(&mut self) {
        if self.read_only || self.poisoned.is_some() || self.journal_kept {
            return;
        }
        if let Err(e) = self.flush_memtable() {
            tracing::warn!(event = "store_close_flush_failed", store = %self.path.display(), error = %e, "flushing the memtable at close failed; the next open replays the journal");
        }
    }
}

impl std::fmt::Debug for FjallSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FjallSnapshot")
            .field("path", &self.path)
            .field("keys", &self.count)
            .field("cursor", &self.cursor)
            .field("read_only", &self.read_only)
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

fn ferr(path: &Path, op: &'static str) -> impl FnOnce(fjall::Error) -> SnapshotError {
    let path = path.to_owned();
    move |e| match e {
        fjall::Error::Locked => SnapshotError::Locked {
            path: path.join("lock"),
        },
        e => SnapshotError::Backend(format!("{}: fjall {op}: {e}", path.display())),
    }
}

fn data_key(key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + key.len());
    k.push(DATA_TAG);
    k.extend_from_slice(key.as_bytes());
    k
}

/// Journal cap (fjall's minimum).
const MAX_JOURNALING_BYTES: u64 = 64 << 20;
/// Memtable size before it is sealed and flushed to a table.
const MAX_MEMTABLE_BYTES: u64 = 16 << 20;

/// The data blocks' compression: LZ4 at every level. fjall's default leaves levels 0 and 1
/// uncompressed, which is where a 1 000 000-key fold sits after its replay: its store and artifact
/// were 124 MB, with LZ4 82 MB, and a bootstrap through S3 (moto) took 0.10–0.11 s instead of
/// 0.14, an export round 0.5–0.7 s instead of 1.0–1.3, a resume the same 0.025–0.026 s; the replay
/// that builds the store pays for the compression, 3.3–3.4 s instead of 2.85–2.9 on two cores
/// (`foldhost-bench bootstrap`, alternating, three runs of each; LZ4 from level 1 only measured
/// the same). fjall keeps a keyspace's policy in its own metadata from its creation, so a store
/// created before keeps its own.
fn data_block_compression() -> fjall::config::CompressionPolicy {
    fjall::config::CompressionPolicy::all(fjall::CompressionType::Lz4)
}

fn open_db(path: &Path, opts: &FjallOptions) -> Result<(Database, Keyspace), SnapshotError> {
    // Journals are what an open replays and what an export copies beside the tables. Capped at
    // fjall's minimum (64 MiB; default 512 MiB) with 16 MiB memtables (default 64 MiB), a
    // 1 000 000-key fold (`foldhost-bench bootstrap`) exported 151 MB instead of 179 MB, resumed
    // in 0.72 s instead of 0.97 s, and its full replay peaked at 139 MiB instead of 259 MiB.
    let db = Database::builder(path)
        .cache_size(opts.cache_bytes)
        .max_journaling_size(MAX_JOURNALING_BYTES)
        .open()
        .map_err(ferr(path, "open"))?;
    let tree = db
        .keyspace(KEYSPACE, || {
            KeyspaceCreateOptions::default()
                .max_memtable_size(MAX_MEMTABLE_BYTES)
                .data_block_compression_policy(data_block_compression())
        })
        .map_err(ferr(path, "open keyspace"))?;
    Ok((db, tree))
}

impl FjallSnapshot {
    /// Opens (creating when absent) the store in `STORE/fjall` for writing. fjall's lock refuses a
    /// second writer ([`SnapshotError::Locked`]).
    pub fn open(store_dir: &Path, opts: FjallOptions) -> Result<Self, SnapshotError> {
        let path = store_dir.join(DB_DIR);
        let (db, tree) = open_db(&path, &opts)?;
        Self::load(path, db, tree, opts.sync, None)
    }

    /// Opens a private copy of `STORE/fjall` for reading (see the module docs): never writes into
    /// the store, works beside a running host. [`SnapshotStore::apply`] is refused.
    pub(crate) fn open_read_only(store_dir: &Path) -> Result<Self, SnapshotError> {
        let path = store_dir.join(DB_DIR);
        if !path.join("version").exists() {
            return Err(SnapshotError::Io {
                path: path.clone(),
                op: "open read-only",
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no fjall store here"),
            });
        }
        let tmp = tempfile::Builder::new()
            .prefix("foldhost-fjall-ro-")
            .tempdir()
            .map_err(|source| SnapshotError::Io {
                path: std::env::temp_dir(),
                op: "create temporary directory",
                source,
            })?;
        let copy = tmp.path().join(DB_DIR);
        copy_consistent(&path, &copy, Journals::Copied)?;
        let (db, tree) = open_db(&copy, &FjallOptions::default())?;
        let mut store = Self::load(copy, db, tree, false, Some(tmp))?;
        store.read_only = true;
        Ok(store)
    }

    fn load(
        path: PathBuf,
        db: Database,
        tree: Keyspace,
        sync: bool,
        copy: Option<tempfile::TempDir>,
    ) -> Result<Self, SnapshotError> {
        let c = tree.get(CURSOR_KEY).map_err(ferr(&path, "read cursor"))?;
        let n = tree.get(COUNT_KEY).map_err(ferr(&path, "read count"))?;
        let cursor = lsm::decode_cursor(&path, c.as_deref())?;
        let count = lsm::decode_count(&path, n.as_deref())?;
        Ok(FjallSnapshot {
            path,
            db,
            tree,
            cursor,
            count,
            sync,
            read_only: copy.is_some(),
            poisoned: None,
            fail_next_write: false,
            journal_kept: false,
            _copy: copy,
        })
    }

    /// Seals the active memtable and waits until every sealed memtable is in a table (fjall fsyncs
    /// the table and the version listing it before it drops the sealed memtable). fjall's own
    /// `rotate_memtable_and_wait` polls every 10 ms: a clean stop waited about 8 ms for a flush of
    /// 1 ms. Bounded by [`FLUSH_WAIT`].
    fn flush_memtable(&self) -> Result<(), SnapshotError> {
        // `false` means empty, or a rotation already under way: wait for it either way.
        self.tree
            .rotate_memtable()
            .map_err(ferr(&self.path, "flush the memtable"))?;
        let deadline = std::time::Instant::now() + FLUSH_WAIT;
        while self.tree.sealed_memtable_count() > 0 {
            if std::time::Instant::now() >= deadline {
                return Err(SnapshotError::Backend(format!(
                    "{}: fjall flush of the memtable did not finish within {} s",
                    self.path.display(),
                    FLUSH_WAIT.as_secs()
                )));
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        Ok(())
    }

    /// A clean stop, after which everything applied survives a power loss. When the journals hold
    /// at most [`CLEAN_STOP_JOURNAL_BYTES`] (a short run, or a resume, after an earlier clean
    /// stop emptied them), the journal is fsynced and left for the next open to replay: no table
    /// is written, so no compaction is started that the close would wait for (fjall's `Database`
    /// joins its workers on drop: every fourth stop in a row waited 0.86–0.92 s for one at
    /// 1 000 000 keys). Over that bound the store is closed as [`Self::close_flushed`] closes it.
    ///
    /// Why a journal file's size measures what an open replays here: fjall preallocates a *new*
    /// journal (64 MiB of zeros, which reads as large, so that store is flushed), but appends to
    /// an existing one, and its recovery cuts a journal back to its last valid batch; a journal
    /// emptied by [`Self::close_flushed`] therefore grows by exactly what is written into it.
    pub(crate) fn close_durably(self) -> Result<(), SnapshotError> {
        self.close_keeping_journal(CLEAN_STOP_JOURNAL_BYTES)
    }

    /// [`Self::close_durably`] with another bound on the journal left to replay (tests, probes).
    #[doc(hidden)]
    pub(crate) fn close_keeping_journal(
        mut self,
        max_journal_bytes: u64,
    ) -> Result<(), SnapshotError> {
        self.writable()?;
        // Journals that cannot be listed are treated as large: flushing is never wrong.
        if journal_bytes(&self.path).is_some_and(|n| n <= max_journal_bytes) {
            self.db
                .persist(PersistMode::SyncAll)
                .map_err(ferr(&self.path, "persist"))?;
            self.journal_kept = true;
            return Ok(());
        }
        self.close_flushed()
    }

    /// Closes the store at a clean stop and leaves it opening without a journal replay: flushes
    /// the memtable into a table, fsyncs the journal, then empties every journal file in place.
    ///
    /// Why this is safe: once the flush has returned, every batch a journal holds is in a table
    /// that fjall has fsynced along with the version that lists it, which is the very condition
    /// under which fjall deletes a sealed journal itself; `self` is owned, so nothing is written
    /// between the flush and the truncation. Why it matters: fjall 3.1 replays its whole active
    /// journal (up to 64 MiB, an `lseek` per entry) at every open, even when its tables hold all
    /// of it; a resume after a clean stop would pay that replay before its first delivery. A
    /// failure before the truncation leaves the journals as they were (the next open replays
    /// them); the empty journal files stay, because fjall recovers its sequence number from the
    /// tables only when an active journal file exists.
    pub(crate) fn close_flushed(self) -> Result<(), SnapshotError> {
        self.writable()?;
        self.flush_memtable()?;
        self.db
            .persist(PersistMode::SyncAll)
            .map_err(ferr(&self.path, "persist"))?;
        let io = |path: &Path, op: &'static str| {
            let path = path.to_owned();
            move |source| SnapshotError::Io { path, op, source }
        };
        for item in std::fs::read_dir(&self.path).map_err(io(&self.path, "list directory"))? {
            let item = item.map_err(io(&self.path, "list directory"))?;
            if is_journal(Path::new(&item.file_name())) {
                let path = item.path();
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(io(&path, "open journal"))?;
                file.set_len(0).map_err(io(&path, "empty journal"))?;
                file.sync_all().map_err(io(&path, "fsync journal"))?;
            }
        }
        Ok(())
    }

    /// Makes the next apply's commit fail as an I/O error would (tests only).
    #[cfg(test)]
    pub(crate) fn inject_write_fault(&mut self) {
        self.fail_next_write = true;
    }

    fn writable(&self) -> Result<(), SnapshotError> {
        if self.read_only {
            return Err(SnapshotError::Io {
                path: self.path.clone(),
                op: "write",
                source: std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    "the store was opened read-only",
                ),
            });
        }
        if let Some(cause) = &self.poisoned {
            return Err(SnapshotError::Poisoned {
                path: self.path.clone(),
                cause: cause.clone(),
            });
        }
        Ok(())
    }

    fn walk(
        &self,
        prefix: &str,
        after: Option<&str>,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        let (start, skip_equal) = lsm::seek_start(prefix, after);
        let start = data_key(start);
        let lower = if skip_equal {
            Bound::Excluded(start.as_slice())
        } else {
            Bound::Included(start.as_slice())
        };
        let tagged_prefix = data_key(prefix);
        let mut entry = lsm::blank_entry();
        for guard in self.tree.range::<&[u8], _>((lower, Bound::Unbounded)) {
            let (key, record) = guard.into_inner().map_err(ferr(&self.path, "iterate"))?;
            if !key.starts_with(&tagged_prefix) {
                break;
            }
            lsm::decode_entry_into(&self.path, &key[1..], &record, &mut entry)?;
            if visit(&entry).is_break() {
                break;
            }
        }
        Ok(())
    }
}

/// Whether a path inside a fjall directory is an immutable file (a table or a blob file).
fn is_immutable(rel: &Path) -> bool {
    rel.components()
        .any(|c| c.as_os_str() == "tables" || c.as_os_str() == "blobs")
}

/// The contents of every version pointer (`version`, each tree's `current`) under `dir`, in path
/// order: unchanged across a copy means no flush or compaction was installed meanwhile.
fn version_state(dir: &Path) -> Result<Vec<(PathBuf, Vec<u8>)>, SnapshotError> {
    fn walk(dir: &Path, out: &mut Vec<(PathBuf, Vec<u8>)>) -> std::io::Result<()> {
        for item in std::fs::read_dir(dir)? {
            let item = item?;
            let path = item.path();
            if item.file_type()?.is_dir() {
                if !is_immutable(Path::new(&item.file_name())) {
                    walk(&path, out)?;
                }
            } else if item.file_name() == "current" || item.file_name() == "version" {
                out.push((path.clone(), std::fs::read(&path)?));
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, &mut out).map_err(|source| SnapshotError::Io {
        path: dir.to_owned(),
        op: "read version pointers",
        source,
    })?;
    out.sort();
    Ok(out)
}

/// What a copy of a fjall directory does with its journals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Journals {
    /// Byte-copied: the copy recovers whatever the journals hold (a running store's copy).
    Copied,
    /// Each written as an empty file of the same name: only for a store whose every journaled
    /// batch is already in its tables (flushed, nothing written since). The copy then opens
    /// without replaying a journal; fjall recovers the sequence number from the tables, which it
    /// does only when the active journal file exists, hence the empty file rather than none.
    Emptied,
}

/// The most journal a clean stop leaves for the next open to replay instead of flushing it into
/// a table ([`FjallSnapshot::close_durably`]); the same bound as RocksDB's log.
pub(crate) const CLEAN_STOP_JOURNAL_BYTES: u64 = 1 << 20;

/// The bytes of every journal file in a fjall directory (`None` when it cannot be listed).
fn journal_bytes(dir: &Path) -> Option<u64> {
    let mut n = 0u64;
    for item in std::fs::read_dir(dir).ok()? {
        let item = item.ok()?;
        if is_journal(Path::new(&item.file_name())) {
            n = n.saturating_add(item.metadata().ok()?.len());
        }
    }
    Some(n)
}

/// Whether a path inside a fjall directory is one of its journals (`N.jnl` at the top).
fn is_journal(rel: &Path) -> bool {
    rel.components().count() == 1 && rel.extension().is_some_and(|e| e == "jnl")
}

/// Writes an empty file in `dest` for each journal of `src` (see [`Journals::Emptied`]).
fn empty_journals(src: &Path, dest: &Path) -> Result<(), SnapshotError> {
    let io = |path: &Path, op: &'static str| {
        let path = path.to_owned();
        move |source| SnapshotError::Io { path, op, source }
    };
    let mut found = false;
    for item in std::fs::read_dir(src).map_err(io(src, "list directory"))? {
        let item = item.map_err(io(src, "list directory"))?;
        if is_journal(Path::new(&item.file_name())) {
            let to = dest.join(item.file_name());
            std::fs::File::create_new(&to).map_err(io(&to, "create empty journal"))?;
            found = true;
        }
    }
    if found {
        Ok(())
    } else {
        Err(SnapshotError::Backend(format!(
            "{}: no journal file to stand in for",
            src.display()
        )))
    }
}

/// Copies the fjall directory `src` to `dest` (absent) so that the copy is one consistent state:
/// retried when a file vanishes mid-copy or the tree's version changes meanwhile.
fn copy_consistent(src: &Path, dest: &Path, journals: Journals) -> Result<(), SnapshotError> {
    let mut last_err = None;
    for attempt in 0..COPY_ATTEMPTS {
        if attempt > 0 {
            let _ = std::fs::remove_dir_all(dest);
            std::thread::sleep(std::time::Duration::from_millis(20 << attempt));
        }
        let before = version_state(src)?;
        let skip = |rel: &Path| journals == Journals::Emptied && is_journal(rel);
        let copied =
            lsm::copy_tree(src, dest, &is_immutable, &skip).and_then(|()| match journals {
                Journals::Copied => Ok(()),
                Journals::Emptied => empty_journals(src, dest),
            });
        match copied {
            Ok(()) if version_state(src)? == before => return Ok(()),
            Ok(()) => {
                last_err = Some(SnapshotError::Backend(format!(
                    "{}: the tree's version changed during the copy",
                    src.display()
                )))
            }
            Err(e) => last_err = Some(e),
        }
    }
    let _ = std::fs::remove_dir_all(dest);
    Err(last_err.unwrap_or_else(|| SnapshotError::Backend("copy failed".into())))
}

impl SnapshotStore for FjallSnapshot {
    fn backend(&self) -> &'static str {
        "fjall"
    }

    fn cursor(&self) -> WatchCursor {
        self.cursor
    }

    /// One fjall write batch: the data writes, the cursor and the new count (see the module docs).
    fn apply(&mut self, batch: &[KvUpdate], cursor: WatchCursor) -> Result<(), SnapshotError> {
        self.writable()?;
        let plan = lsm::plan(batch, self.count, |key| {
            self.tree
                .contains_key(data_key(key))
                .map_err(ferr(&self.path, "read"))
        })?;
        // fjall's journal writer is buffered in the process; `Buffer` hands each batch to the OS
        // (survives a process crash), `SyncAll` also fsyncs it (survives a power loss).
        let durability = if self.sync {
            PersistMode::SyncAll
        } else {
            PersistMode::Buffer
        };
        let mut wb = self.db.batch().durability(Some(durability));
        for op in plan.ops {
            match op {
                Op::Put(key, record) => wb.insert(&self.tree, data_key(key), record),
                Op::Delete(key) => wb.remove(&self.tree, data_key(key)),
            }
        }
        wb.insert(&self.tree, CURSOR_KEY, cursor.to_bytes());
        wb.insert(
            &self.tree,
            COUNT_KEY,
            lsm::encode_count(plan.count).to_vec(),
        );
        let res = if std::mem::take(&mut self.fail_next_write) {
            Err(SnapshotError::Io {
                path: self.path.clone(),
                op: "commit batch",
                source: std::io::Error::other("injected write fault"),
            })
        } else {
            wb.commit().map_err(ferr(&self.path, "commit batch"))
        };
        if let Err(e) = res {
            tracing::warn!(event = "store_poisoned", cause = %e, "fjall store poisoned; reopen it to recover");
            self.poisoned.get_or_insert_with(|| e.to_string());
            return Err(e);
        }
        self.cursor = cursor;
        self.count = plan.count;
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<KvEntry>, SnapshotError> {
        let Some(record) = self
            .tree
            .get(data_key(key))
            .map_err(ferr(&self.path, "get"))?
        else {
            return Ok(None);
        };
        let mut entry = lsm::blank_entry();
        lsm::decode_entry_into(&self.path, key.as_bytes(), &record, &mut entry)?;
        Ok(Some(entry))
    }

    fn for_each_in_range(
        &self,
        prefix: &str,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        self.walk(prefix, None, visit)
    }

    fn for_each_in_range_after(
        &self,
        prefix: &str,
        after: Option<&str>,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        self.walk(prefix, after, visit)
    }

    fn len(&self) -> Result<u64, SnapshotError> {
        Ok(self.count)
    }

    /// Flush the memtable into a table, then copy into `DEST/fjall` with the tables hard-linked
    /// and the journals empty (`Journals::Emptied`: every batch they hold is in a table now, and
    /// nothing is written meanwhile, the store being borrowed), reopen the copy and require the
    /// same cursor and count; the copy is retried a bounded number of times.
    ///
    /// Why empty journals: fjall replays its whole active journal (up to 64 MiB) entry by entry at
    /// every open, skipping what its tables already hold. An artifact carrying it made every
    /// import pay that replay twice (its verify and the node's open). The verify here proves the
    /// journals were redundant: the cursor and the count are written in every batch, so a batch
    /// missing from the tables would show as an older cursor in the copy.
    fn export_to(&self, dest: &Path) -> Result<Option<ProvenCopy>, SnapshotError> {
        self.flush_memtable()?;
        self.db
            .persist(PersistMode::SyncAll)
            .map_err(ferr(&self.path, "persist"))?;
        let target = dest.join(DB_DIR);
        let mut last_err = None;
        for _ in 0..COPY_ATTEMPTS {
            copy_consistent(&self.path, &target, Journals::Emptied)?;
            let verified = open_db(&target, &FjallOptions::default()).and_then(|(db, tree)| {
                let copy = Self::load(target.clone(), db, tree, false, None)?;
                if copy.cursor == self.cursor && copy.count == self.count {
                    Ok(())
                } else {
                    Err(SnapshotError::Backend(format!(
                        "{}: the exported copy recovers {} with {} keys, the store is at {} with {} keys",
                        target.display(),
                        copy.cursor,
                        copy.count,
                        self.cursor,
                        self.count
                    )))
                }
            });
            match verified {
                Ok(()) => return Ok(None),
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&target);
                    last_err = Some(e);
                }
            }
        }
        Err(last_err.unwrap_or_else(|| SnapshotError::Backend("export failed".into())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::VersionToken;

    fn put(key: &str, rev: u64) -> KvUpdate {
        KvUpdate::Put(KvEntry {
            key: key.into(),
            value: bytes::Bytes::from_static(b"v"),
            version: VersionToken::from_u64(rev),
        })
    }

    #[test]
    fn a_flushed_table_is_compressed_and_reads_back_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = FjallSnapshot::open(dir.path(), FjallOptions::default()).expect("open");
        let n = 20_000u64;
        let raw = lsm::testing::fill_with_hex_values(&mut s, n);
        // One flush: one table at level 0, which fjall's default would leave uncompressed
        // (2.4 MB for these 2.2 MB of keys and values, its index and filter included).
        s.flush_memtable().expect("flush");
        let tables: Vec<u64> = walk(&s.path)
            .into_iter()
            .filter(|p| p.components().any(|c| c.as_os_str() == "tables"))
            .map(|p| std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0))
            .collect();
        let largest = tables.iter().copied().max().unwrap_or(0);
        assert!(largest > 0, "the flush wrote a table: {tables:?}");
        assert!(
            largest * 10 < raw * 8,
            "a table of {largest} bytes for {raw} bytes of keys and values: not compressed"
        );
        for i in [0, 1, n / 2, n - 1] {
            let got = s.get(&lsm::testing::key(i)).expect("get").expect("present");
            assert_eq!(got.value, lsm::testing::hex_value(i), "key {i}");
        }
    }

    /// Every file under `dir`, recursively.
    fn walk(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                let p = e.path();
                if p.is_dir() {
                    todo.push(p);
                } else {
                    out.push(p);
                }
            }
        }
        out
    }

    #[test]
    fn sync_mode_commits_and_reopens() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = FjallOptions {
            sync: true,
            ..FjallOptions::default()
        };
        let mut s = FjallSnapshot::open(dir.path(), opts).expect("open");
        s.apply(&[put("a", 1), put("b", 2)], WatchCursor::at(2))
            .expect("apply");
        drop(s);
        let s = FjallSnapshot::open(dir.path(), opts).expect("reopen");
        assert_eq!((s.cursor(), s.len().expect("len")), (WatchCursor::at(2), 2));
    }

    /// Bytes of the table files under `dir` (what an open reads instead of replaying a journal;
    /// journal files are preallocated, so their sizes say nothing).
    fn table_bytes(dir: &Path) -> u64 {
        fn walk(dir: &Path, in_tables: bool) -> u64 {
            let mut n = 0;
            for e in std::fs::read_dir(dir).expect("list").flatten() {
                let p = e.path();
                let tables = in_tables || e.file_name() == "tables";
                if p.is_dir() {
                    n += walk(&p, tables);
                } else if tables {
                    n += e.metadata().map(|m| m.len()).unwrap_or(0);
                }
            }
            n
        }
        walk(dir, false)
    }

    #[test]
    fn a_clean_close_flushes_the_memtable_so_the_next_open_replays_no_journal() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = FjallSnapshot::open(dir.path(), FjallOptions::default()).expect("open");
        // 8 MB that do not compress, under the 16 MiB memtable: nothing is flushed while open.
        for b in 0..8u64 {
            let batch: Vec<KvUpdate> = (0..1000u64)
                .map(|i| {
                    let n = b * 1000 + i;
                    let mut value = Vec::with_capacity(1024);
                    for j in 0..32u64 {
                        value.extend_from_slice(
                            blake3::hash(&(n * 32 + j).to_le_bytes()).as_bytes(),
                        );
                    }
                    KvUpdate::Put(KvEntry {
                        key: format!("k{n:06}"),
                        value: value.into(),
                        version: VersionToken::from_u64(n + 1),
                    })
                })
                .collect();
            s.apply(&batch, WatchCursor::at((b + 1) * 1000))
                .expect("apply");
        }
        let before = table_bytes(dir.path());
        assert!(
            before < 1 << 20,
            "nothing flushed yet: {before} bytes of tables"
        );
        drop(s);
        let after = table_bytes(dir.path());
        assert!(
            after > 4 << 20,
            "a clean close flushed the memtable into tables: {after} bytes (was {before})"
        );
        let s = FjallSnapshot::open(dir.path(), FjallOptions::default()).expect("reopen");
        assert_eq!(
            (s.cursor(), s.len().expect("len")),
            (WatchCursor::at(8000), 8000)
        );
    }

    fn journal_bytes(dir: &Path) -> u64 {
        super::journal_bytes(dir).expect("list journals")
    }

    /// 2 000 unflushed puts at revisions 1..=2000 (cursor 2000), then `k0001` deleted (2001).
    fn unflushed_store(dir: &Path) -> FjallSnapshot {
        let mut s = FjallSnapshot::open(dir, FjallOptions::default()).expect("open");
        for b in 0..4u64 {
            let batch: Vec<KvUpdate> = (0..500u64)
                .map(|i| put(&format!("k{:04}", b * 500 + i), b * 500 + i + 1))
                .collect();
            s.apply(&batch, WatchCursor::at((b + 1) * 500))
                .expect("apply");
        }
        let delete = KvUpdate::Delete {
            key: "k0001".into(),
            version: VersionToken::from_u64(2001),
        };
        s.apply(&[delete], WatchCursor::at(2001))
            .expect("apply delete");
        assert!(
            journal_bytes(&s.path) > 0,
            "the store journals what it holds"
        );
        s
    }

    /// The store in `store_dir` (an [`unflushed_store`] carried over by a copy or a close) has
    /// everything, and a later write wins over a table entry: its sequence number was recovered
    /// above the tables' (were it restarted at 0, the overwrite would read back as the old value
    /// and the delete would not hide it).
    fn assert_opens_whole_and_takes_later_writes(store_dir: &Path, seqno_before: u64) {
        let mut c = FjallSnapshot::open(store_dir, FjallOptions::default()).expect("open");
        assert!(
            c.db.seqno() >= seqno_before,
            "the sequence number was recovered: {} against {seqno_before} before",
            c.db.seqno()
        );
        assert_eq!(
            (c.cursor(), c.len().expect("len")),
            (WatchCursor::at(2001), 1999)
        );
        assert!(
            c.get("k0001").expect("get").is_none(),
            "the delete survived"
        );
        let v = c.get("k1999").expect("get").expect("k1999 is there");
        assert_eq!(v.version, VersionToken::from_u64(2000));
        let overwrite = KvUpdate::Put(KvEntry {
            key: "k0002".into(),
            value: bytes::Bytes::from_static(b"new"),
            version: VersionToken::from_u64(2002),
        });
        let delete = KvUpdate::Delete {
            key: "k0003".into(),
            version: VersionToken::from_u64(2003),
        };
        c.apply(&[overwrite, delete], WatchCursor::at(2003))
            .expect("apply after the open");
        for reopened in [false, true] {
            if reopened {
                // Through a flush and a compaction too: the table merge keeps the entry with the
                // higher sequence number, so a write numbered below the tables' would lose there.
                c.flush_memtable().expect("flush");
                c.tree.major_compact().expect("compact");
                drop(c);
                c = FjallSnapshot::open(store_dir, FjallOptions::default()).expect("reopen");
            }
            let v = c.get("k0002").expect("get").expect("k0002 is there");
            assert_eq!(
                (&v.value[..], v.version),
                (&b"new"[..], VersionToken::from_u64(2002)),
                "reopened: {reopened}"
            );
            assert!(
                c.get("k0003").expect("get").is_none(),
                "reopened: {reopened}"
            );
            assert_eq!(
                (c.cursor(), c.len().expect("len")),
                (WatchCursor::at(2003), 1998),
                "reopened: {reopened}"
            );
        }
    }

    fn has_journal_file(dir: &Path) -> bool {
        std::fs::read_dir(dir)
            .expect("list")
            .flatten()
            .any(|e| is_journal(Path::new(&e.file_name())))
    }

    #[test]
    fn an_export_carries_empty_journals_and_its_copy_takes_later_writes_over_its_tables() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = unflushed_store(dir.path());
        let seqno = s.db.seqno();
        let out = tempfile::tempdir().expect("tempdir");
        s.export_to(out.path()).expect("export");
        let copy_dir = out.path().join(DB_DIR);
        assert!(has_journal_file(&copy_dir), "the copy keeps a journal file");
        assert_eq!(journal_bytes(&copy_dir), 0, "the copy's journals are empty");
        assert!(journal_bytes(&s.path) > 0, "the store's own are untouched");
        drop(s);
        assert_opens_whole_and_takes_later_writes(out.path(), seqno);
    }

    #[test]
    fn a_clean_close_empties_the_journals_and_the_store_reopens_whole_from_its_tables() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = unflushed_store(dir.path());
        let seqno = s.db.seqno();
        let path = s.path.clone();
        s.close_flushed().expect("close");
        assert!(has_journal_file(&path), "the active journal file stays");
        assert_eq!(journal_bytes(&path), 0, "every journal is empty");
        assert_opens_whole_and_takes_later_writes(dir.path(), seqno);
    }

    #[test]
    fn a_clean_close_of_a_small_journal_writes_no_table_and_the_reopen_replays_it_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A fresh store's journal is preallocated (64 MiB of zeros): its first clean stop reads
        // it as large, flushes and empties it.
        let s = FjallSnapshot::open(dir.path(), FjallOptions::default()).expect("open");
        let path = s.path.clone();
        assert!(journal_bytes(&path) > CLEAN_STOP_JOURNAL_BYTES);
        s.close_durably().expect("close");
        assert_eq!(
            journal_bytes(&path),
            0,
            "the preallocated journal was emptied"
        );
        // A short run after it journals a little, and its clean stop keeps that.
        let s = unflushed_store(dir.path());
        let seqno = s.db.seqno();
        let (journal, tables) = (journal_bytes(&path), table_bytes(&path));
        assert!(
            journal > 0 && journal <= CLEAN_STOP_JOURNAL_BYTES,
            "appended to the emptied journal: {journal} bytes"
        );
        s.close_durably().expect("close");
        assert_eq!(
            journal_bytes(&path),
            journal,
            "the journal is kept as it was"
        );
        assert_eq!(table_bytes(&path), tables, "no table was written");
        // The next open replays it: every key, the delete, and later writes numbered above it.
        assert_opens_whole_and_takes_later_writes(dir.path(), seqno);
    }

    #[test]
    fn many_short_runs_add_no_table_and_leave_at_most_the_bound_of_journal_to_replay() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(DB_DIR);
        let value = [7u8; 200];
        let mut rev = 0u64;
        let (mut flushed, mut kept) = (0, 0);
        // Each run: open, 1 000 updates of 200 bytes (about 0.25 MiB of journal), a clean stop.
        // The first stop flushes (a fresh journal is preallocated), then the journal grows past
        // the bound every fifth run or so; those stops flush, the others write nothing.
        for run in 0..10 {
            let mut s = FjallSnapshot::open(dir.path(), FjallOptions::default()).expect("open");
            if run > 0 {
                assert_eq!(
                    s.cursor(),
                    WatchCursor::at(rev),
                    "run {run} resumes where the last stopped"
                );
            }
            for chunk in 0..10 {
                let batch: Vec<_> = (0..100)
                    .map(|i| {
                        rev += 1;
                        KvUpdate::Put(KvEntry {
                            key: format!("k{}", (chunk * 100 + i) % 700),
                            value: bytes::Bytes::copy_from_slice(&value),
                            version: VersionToken::from_u64(rev),
                        })
                    })
                    .collect();
                s.apply(&batch, WatchCursor::at(rev)).expect("apply");
            }
            let (before, tables) = (journal_bytes(&path), table_bytes(&path));
            s.close_durably().expect("close");
            if before > CLEAN_STOP_JOURNAL_BYTES {
                flushed += 1;
                assert_eq!(
                    journal_bytes(&path),
                    0,
                    "run {run}: a large journal is emptied"
                );
                assert!(table_bytes(&path) > tables, "run {run}: into a table");
            } else {
                kept += 1;
                assert_eq!(
                    journal_bytes(&path),
                    before,
                    "run {run}: a small journal is kept"
                );
                assert_eq!(table_bytes(&path), tables, "run {run}: no table written");
            }
            assert!(
                journal_bytes(&path) <= CLEAN_STOP_JOURNAL_BYTES,
                "run {run}: at most the bound is left to replay"
            );
        }
        assert!(flushed >= 2 && kept >= 5, "flushed {flushed}, kept {kept}");
        let s = FjallSnapshot::open(dir.path(), FjallOptions::default()).expect("reopen");
        assert_eq!(
            (s.cursor(), s.len().expect("len")),
            (WatchCursor::at(rev), 700)
        );
        // The last update of the last run (chunk 9, i 99: key 999 % 700) reads back at its revision.
        let v = s.get("k299").expect("get").expect("k299");
        assert_eq!(v.version, VersionToken::from_u64(rev));
    }

    #[test]
    fn journals_are_the_top_level_jnl_files_only() {
        assert!(is_journal(Path::new("0.jnl")));
        assert!(is_journal(Path::new("17.jnl")));
        assert!(!is_journal(Path::new("keyspaces/1/0.jnl")));
        assert!(!is_journal(Path::new("version")));
    }

    #[test]
    fn data_keys_and_meta_keys_never_share_a_tag() {
        assert_eq!(data_key("\u{1}retained/x")[0], DATA_TAG);
        assert_ne!(CURSOR_KEY[0], DATA_TAG);
        assert_ne!(COUNT_KEY[0], DATA_TAG);
    }

    #[test]
    fn only_tables_and_blobs_are_hard_linked() {
        assert!(is_immutable(Path::new("keyspaces/1/tables/7")));
        assert!(is_immutable(Path::new("keyspaces/1/blobs/3")));
        assert!(!is_immutable(Path::new("keyspaces/1/current")));
        assert!(!is_immutable(Path::new("0.jnl")));
    }
}
