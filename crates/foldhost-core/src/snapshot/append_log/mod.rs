//! [`AppendLogSnapshot`]: the default durable fold, an append-only CRC-framed log (`fold.log`, format
//! in [`super::format`]) replayed at open into an in-RAM ordered map.
//!
//! Guarantees:
//! - **One write per apply.** A batch's records and its cursor record are encoded into one buffer and
//!   handed to the kernel with one `write_all` on an append-mode file, so a *process* crash leaves
//!   either the whole batch or a tail that recovery discards. The write goes to the page cache, not
//!   to the disk: a batch survives a process crash, not a power loss (compaction fsyncs). After a
//!   power loss the fold may go back to an older cursor, never to a cursor without its data: data and
//!   cursor share one CRC-checked write, so if the kernel persisted a later page of the tail but not
//!   an earlier one, the open fails with [`SnapshotError::Corrupted`] instead of guessing.
//! - **Recovery is "every record up to the last cursor record".** Replay applies records to the map
//!   only when the cursor record that closes their batch is read; anything after the last cursor
//!   record, a record cut short at end of file, a zero-filled tail, or a bad-checksum record with
//!   nothing but zeros after it is a torn tail: discarded and reported in [`Recovery`]. Any other bad
//!   record (a CRC mismatch or an impossible record followed by more data, NULs followed by data) is
//!   [`SnapshotError::Corrupted`] naming the offset: the store never silently drops a valid suffix.
//! - **A failed write never leaves garbage mid-file.** After a failed append the file is cut back to
//!   the last committed length; if even that fails, the store is poisoned until reopened.
//! - **Compaction is atomic.** The live map is written to `.fold.log.tmp`, fsynced, renamed over
//!   `fold.log`, and the directory fsynced; until the rename the old file is intact, so a failure at
//!   any step loses nothing that a reopen cannot recover. A failed compaction poisons the writer.
//! - **One writer per directory.** A writable open holds an exclusive lock on `DIR/LOCK` for the
//!   store's lifetime; read-only opens take no lock and never write.
//!
//! Memory ([`super::live_map`]): the fold in RAM is the buffer the file was read into (or the last
//! compaction wrote), a sorted array of 8-byte offsets of its live Put records, a hash index of
//! those, and an ordered overlay of what changed since. Open sorts the records after the compacted
//! prefix into the array (8 bytes each), so a reopened fold holds no per-key map entries. Each
//! compaction encodes the live map once, writes it, and rebases on those bytes: the old buffer and
//! the overlay are freed. Compaction keeps the garbage in the log below
//! `max(compact_threshold, live fold)`, which bounds the buffer to about twice the live fold plus
//! the threshold. The price is the compaction's transient peak: the old buffer, the overlay (at most
//! what was appended since the last compaction, about the live fold) and the new bytes are alive
//! together until the rebase, up to about three times the live fold for a moment (it was the live
//! fold plus a 1 MiB chunk when the map was a B-tree that kept the open-time buffer for good).

use std::cmp;
use std::fmt;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::ops::{Bound, ControlFlow};
use std::path::{Path, PathBuf};

use bytes::Bytes;

use super::format::{self, Decoded, HEADER_LEN, Record};
use super::live_map::{self, LiveMap};
use super::{HashedFile, ProvenCopy, Recovery, SnapshotError, SnapshotStore};
use crate::kv::{KvEntry, KvUpdate, WatchCursor};
use crate::staged::StagedFile;

mod replay;

pub use replay::CompactLogCheck;
use replay::replay;

/// The log's file name inside the store directory.
const LOG_NAME: &str = "fold.log";
/// Compaction's temp file: same directory, so the rename is atomic.
const TMP_NAME: &str = ".fold.log.tmp";
/// The writer lock's file name. Never deleted: removing a lock file races with a concurrent opener.
const LOCK_NAME: &str = "LOCK";
/// Compaction hands the kernel the new file in chunks of about this size.
const COMPACT_CHUNK: usize = 1 << 20;

/// Tuning for [`AppendLogSnapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendLogOptions {
    /// Compact once the bytes appended since the last compaction reach the larger of this and the
    /// size of the live fold. The "live fold" term keeps compaction amortised (each rewrite is paid
    /// for by at least as many appended bytes); this term stops a small fold from being rewritten on
    /// almost every apply. Default: 32 MiB — a compaction rewrites and fsyncs the whole fold on the
    /// apply path, so a small threshold puts that pause into every few thousand batches of a
    /// hydration; the cost is up to this much garbage on disk (and in the replay on open).
    pub compact_threshold: u64,
}

impl Default for AppendLogOptions {
    fn default() -> Self {
        AppendLogOptions {
            compact_threshold: 32 * 1024 * 1024,
        }
    }
}

/// A failure tests can make the store hit, to prove the error paths (not part of the API).
#[cfg_attr(not(test), expect(dead_code, reason = "only the tests inject faults"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FaultPoint {
    /// The next apply's write lands half its bytes, then fails (a full disk); the cut-back works.
    PartialWrite,
    /// Like [`FaultPoint::PartialWrite`], and cutting the partial write back fails too.
    PartialWriteUncut,
    /// The next compaction fails after its temp file is written and fsynced, before the rename.
    CompactBeforeRename,
    /// The next compaction fails after the rename, when fsyncing the directory.
    CompactAfterRename,
}

impl FaultPoint {
    fn is_write(self) -> bool {
        matches!(
            self,
            FaultPoint::PartialWrite | FaultPoint::PartialWriteUncut
        )
    }
}

/// The durable fold as an append-only log replayed into an ordered in-RAM map. See the module docs
/// for what it guarantees.
pub struct AppendLogSnapshot {
    dir: PathBuf,
    path: PathBuf,
    fold: LiveMap,
    /// `None` for a read-only open.
    writer: Option<Writer>,
}

impl fmt::Debug for AppendLogSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AppendLogSnapshot")
            .field("path", &self.path)
            .field("keys", &self.fold.len())
            .field("cursor", &self.fold.cursor)
            .field("read_only", &self.writer.is_none())
            .field(
                "poisoned",
                &self.writer.as_ref().and_then(|w| w.poisoned.as_deref()),
            )
            .finish()
    }
}

impl AppendLogSnapshot {
    /// Opens the store in `dir` for writing, creating the directory and the log if absent.
    ///
    /// Takes an exclusive lock on `DIR/LOCK` ([`SnapshotError::Locked`] when another open holds it),
    /// replays the log, cuts off any discarded tail so appends continue right after the last cursor
    /// record, and compacts unless the file is already compact (no superseded or deleted keys, at
    /// most one cursor record, nothing discarded). Returns the store and what recovery discarded.
    pub fn open(dir: &Path, opts: AppendLogOptions) -> Result<(Self, Recovery), SnapshotError> {
        fs::create_dir_all(dir).map_err(io_err(dir, "create store directory"))?;
        let lock = lock_dir(dir)?;
        let path = dir.join(LOG_NAME);
        remove_stale_tmp(dir)?;
        let bytes = match fs::read(&path) {
            Ok(bytes) => Bytes::from(bytes),
            // Absent: a new store. The compaction below gives the file its header; a crash before
            // then leaves a 0-byte file, which the next open reads as an empty new fold.
            Err(e) if e.kind() == io::ErrorKind::NotFound => Bytes::new(),
            Err(e) => return Err(io_err(&path, "read")(e)),
        };
        let replayed = replay(&bytes, &path)?;
        let file = open_append(&path)?;
        if bytes.len() as u64 > replayed.valid_len {
            file.set_len(replayed.valid_len)
                .map_err(io_err(&path, "truncate discarded tail"))?;
        }
        let mut store = AppendLogSnapshot {
            dir: dir.to_owned(),
            path,
            fold: replayed.fold,
            writer: Some(Writer {
                file,
                _lock: lock,
                opts,
                committed_len: replayed.valid_len,
                compacted_len: replayed.valid_len,
                poisoned: None,
                fault: None,
            }),
        };
        // Rewritten at open only when a new file needs its header, or when the garbage (superseded
        // records, deletes, cursor records) is worth it by the same rule as a running store's
        // compaction: a log a few cursor records from compact opens without writing it again.
        let live_len = store.fold.compacted_len();
        if replayed.valid_len == 0
            || (!replayed.compact && should_compact(replayed.valid_len, live_len, opts))
        {
            store.rewrite()?;
        } else if let Some(w) = store.writer.as_mut() {
            // What a compaction would write: the garbage already here counts toward the next one.
            w.compacted_len = live_len.min(replayed.valid_len);
        }
        Ok((store, replayed.recovery))
    }

    /// Opens the store in `dir` for reading only: replays the log without writing, truncating,
    /// compacting or locking, so it works beside a running writer (whose in-flight append reads as a
    /// torn tail). [`SnapshotStore::apply`] and [`Self::compact`] on it return an error. A missing
    /// log is an [`SnapshotError::Io`] error (`NotFound`), not an empty fold.
    pub(crate) fn open_read_only(dir: &Path) -> Result<(Self, Recovery), SnapshotError> {
        let path = dir.join(LOG_NAME);
        let bytes = fs::read(&path).map_err(io_err(&path, "read"))?;
        let replayed = replay(&Bytes::from(bytes), &path)?;
        let store = AppendLogSnapshot {
            dir: dir.to_owned(),
            path,
            fold: replayed.fold,
            writer: None,
        };
        Ok((store, replayed.recovery))
    }

    /// Rewrites the log as the live map plus one cursor record (see the module docs for the steps).
    /// A no-op when nothing was appended since the last compaction. On failure the store is
    /// poisoned; the log on disk still holds every applied batch, so a reopen recovers.
    #[cfg(test)]
    pub(crate) fn compact(&mut self) -> Result<(), SnapshotError> {
        let w = writable(&mut self.writer, &self.path)?;
        if w.appended() == 0 {
            return Ok(());
        }
        self.rewrite()
    }

    /// The log file's path (`DIR/fold.log`).
    #[cfg(test)]
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Makes the next write or compaction fail at `point` (tests only; no-op on a read-only store).
    #[cfg(test)]
    pub(crate) fn inject_fault(&mut self, point: FaultPoint) {
        if let Some(w) = self.writer.as_mut() {
            w.fault = Some(point);
        }
    }

    fn rewrite(&mut self) -> Result<(), SnapshotError> {
        let w = writable(&mut self.writer, &self.path)?;
        w.rewrite(&self.dir, &self.path, &mut self.fold)
    }
}

impl SnapshotStore for AppendLogSnapshot {
    fn backend(&self) -> &'static str {
        "append-log"
    }

    fn cursor(&self) -> WatchCursor {
        self.fold.cursor
    }

    /// Appends the batch and its cursor record in one write (see the module docs for durability),
    /// then folds it in RAM. Sizes are checked before anything is written. A compaction the apply
    /// triggers and that fails is returned as the error, with the store poisoned: the batch itself
    /// is already in the log, so a reopen recovers it.
    fn apply(&mut self, batch: &[KvUpdate], cursor: WatchCursor) -> Result<(), SnapshotError> {
        let w = writable(&mut self.writer, &self.path)?;
        let mut len = format::cursor_record_len(cursor);
        for update in batch {
            format::check_update(update)?;
            len += format::update_record_len(update);
        }
        // A fresh buffer per batch: once written, its bytes are the overlay's keys and values
        // (`LiveMap::apply_encoded`).
        let mut buf = Vec::with_capacity(len);
        let mut starts = Vec::with_capacity(batch.len());
        for update in batch {
            starts.push(buf.len());
            format::encode_update(&mut buf, update)?;
        }
        format::encode_cursor(&mut buf, cursor);
        w.append(&self.path, &buf)?;
        let chunk = Bytes::from(buf);
        for (update, at) in batch.iter().zip(starts) {
            self.fold.apply_encoded(update, &chunk, at);
        }
        self.fold.cursor = cursor;
        if w.appended() >= cmp::max(w.opts.compact_threshold, self.fold.compacted_len()) {
            w.rewrite(&self.dir, &self.path, &mut self.fold)?;
        }
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<KvEntry>, SnapshotError> {
        Ok(self.fold.get(key).map(|(value, version)| KvEntry {
            key: key.to_owned(),
            value,
            version,
        }))
    }

    fn for_each_in_range(
        &self,
        prefix: &str,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        self.fold.walk(prefix, Bound::Included(prefix), visit);
        Ok(())
    }

    fn for_each_in_range_after(
        &self,
        prefix: &str,
        after: Option<&str>,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        // Seek past `after` when it lies inside (or beyond) the range; otherwise start at the prefix.
        let from = match after.filter(|a| *a >= prefix) {
            Some(a) => Bound::Excluded(a),
            None => Bound::Included(prefix),
        };
        self.fold.walk(prefix, from, visit);
        Ok(())
    }

    fn len(&self) -> Result<u64, SnapshotError> {
        Ok(self.fold.len())
    }

    /// A compacted copy: the live map and cursor written as one fresh log, hashed and checked as
    /// it is written (`export_compacted`). The in-RAM fold is the committed state, so no file of
    /// the live store is read or touched. Not fsynced here: the artifact layer fsyncs every staged
    /// file before its manifest (`foldhost::artifact::seal`), off the fold's pause.
    fn export_to(&self, dest: &Path) -> Result<Option<ProvenCopy>, SnapshotError> {
        export_compacted(&dest.join(LOG_NAME), &self.fold).map(Some)
    }
}

/// The writable half of an open store.
struct Writer {
    /// `fold.log`, opened in append mode.
    file: File,
    /// Holds the exclusive `DIR/LOCK` lock until the store is dropped.
    _lock: File,
    opts: AppendLogOptions,
    /// The file's length after the last successful append: a record boundary right after a cursor
    /// record, where a failed append is cut back to.
    committed_len: u64,
    /// The file's length right after the last compaction (or at open, when it was already compact).
    compacted_len: u64,
    /// The first failure that left the file's state unknown.
    poisoned: Option<String>,
    fault: Option<FaultPoint>,
}

impl Writer {
    /// Bytes appended since the last compaction.
    fn appended(&self) -> u64 {
        self.committed_len.saturating_sub(self.compacted_len)
    }

    /// Appends one encoded batch. On failure, cuts the file back to `committed_len` so a retry
    /// appends at a record boundary; poisons the writer if even that fails.
    fn append(&mut self, path: &Path, buf: &[u8]) -> Result<(), SnapshotError> {
        let fault = self.fault.take_if(|f| f.is_write());
        let source = match write_batch(&mut self.file, buf, fault) {
            Ok(()) => {
                self.committed_len += buf.len() as u64;
                return Ok(());
            }
            Err(source) => source,
        };
        let err = SnapshotError::Io {
            path: path.to_owned(),
            op: "append batch",
            source,
        };
        let cut = match fault {
            Some(FaultPoint::PartialWriteUncut) => Err(io::Error::other("injected truncate fault")),
            _ => self.file.set_len(self.committed_len),
        };
        if let Err(cut) = cut {
            self.poison(format!(
                "{err}; cutting the partial write back to {} bytes also failed: {cut}",
                self.committed_len
            ));
        }
        Err(err)
    }

    /// Compacts (see [`AppendLogSnapshot::compact`]) and rebases the in-RAM fold on the new file's
    /// bytes, which frees the old buffer and empties the overlay; poisons on failure (the fold in RAM
    /// is then unchanged).
    fn rewrite(
        &mut self,
        dir: &Path,
        path: &Path,
        fold: &mut LiveMap,
    ) -> Result<(), SnapshotError> {
        let tmp = dir.join(TMP_NAME);
        // Encoded once, in memory: the same bytes go to the file and become the new base.
        let (bytes, offsets) = live_map::encode_compacted(fold);
        match self.try_rewrite(dir, path, &tmp, &bytes) {
            Ok(file) => {
                let len = bytes.len() as u64;
                tracing::debug!(path = %path.display(), bytes = len, "compacted");
                self.file = file;
                self.committed_len = len;
                self.compacted_len = len;
                fold.rebase(Bytes::from(bytes), offsets);
                Ok(())
            }
            Err(e) => {
                // The temp file is never read (open truncates or removes it); removing it now only
                // saves space, so a failure here does not matter.
                let _ = fs::remove_file(&tmp);
                self.poison(e.to_string());
                Err(e)
            }
        }
    }

    fn try_rewrite(
        &mut self,
        dir: &Path,
        path: &Path,
        tmp: &Path,
        bytes: &[u8],
    ) -> Result<File, SnapshotError> {
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(tmp)
            .map_err(io_err(tmp, "create compaction temp file"))?;
        file.write_all(bytes)
            .map_err(io_err(tmp, "write compaction temp file"))?;
        file.sync_all()
            .map_err(io_err(tmp, "fsync compaction temp file"))?;
        self.fault_at(FaultPoint::CompactBeforeRename, tmp)?;
        fs::rename(tmp, path).map_err(io_err(path, "rename compacted log into place"))?;
        self.fault_at(FaultPoint::CompactAfterRename, dir)?;
        sync_dir(dir)?;
        open_append(path)
    }

    /// Fails with an injected I/O error when `point` was injected.
    fn fault_at(&mut self, point: FaultPoint, path: &Path) -> Result<(), SnapshotError> {
        match self.fault.take_if(|f| *f == point) {
            Some(p) => Err(SnapshotError::Io {
                path: path.to_owned(),
                op: "compact",
                source: io::Error::other(format!("injected fault {p:?}")),
            }),
            None => Ok(()),
        }
    }

    fn poison(&mut self, cause: String) {
        tracing::warn!(event = "store_poisoned", %cause, "append-log writer poisoned; reopen the store to recover");
        // Keep the first cause: later failures are usually consequences of it.
        self.poisoned.get_or_insert(cause);
    }
}

/// The writer, if the store is writable and not poisoned.
fn writable<'a>(
    writer: &'a mut Option<Writer>,
    path: &Path,
) -> Result<&'a mut Writer, SnapshotError> {
    let Some(w) = writer.as_mut() else {
        return Err(SnapshotError::Io {
            path: path.to_owned(),
            op: "write",
            source: io::Error::new(
                io::ErrorKind::PermissionDenied,
                "the store was opened read-only",
            ),
        });
    };
    if let Some(cause) = &w.poisoned {
        return Err(SnapshotError::Poisoned {
            path: path.to_owned(),
            cause: cause.clone(),
        });
    }
    Ok(w)
}

/// One `write_all` of the whole batch (or, under an injected fault, half of it and an error).
fn write_batch(file: &mut File, buf: &[u8], fault: Option<FaultPoint>) -> io::Result<()> {
    if fault.is_some() {
        // What a full disk does: part of the batch lands, then the write fails.
        file.write_all(&buf[..buf.len() / 2])?;
        return Err(io::Error::other("injected write fault"));
    }
    file.write_all(buf)
}

/// Writes the compacted log to `tmp` and fsyncs it; returns its length.
/// A map key as text. Every key entered the map from a `&str` (or a record whose key decoded as
/// UTF-8), so this borrows; the lossy form only keeps a bug from becoming a panic.
fn key_str(key: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(key)
}

/// Whether a log of `file_len` bytes whose live part would compact to `live_len` bytes is
/// compacted at open: when what a compaction would drop reaches the live size (and the threshold)
/// — the rule a running store applies to what it appended since its last compaction.
fn should_compact(file_len: u64, live_len: u64, opts: AppendLogOptions) -> bool {
    file_len.saturating_sub(live_len) >= cmp::max(opts.compact_threshold, live_len)
}

/// Writes `fold` as a compacted log at `path`, an export's copy, and proves it as it goes: each
/// chunk of encoded records is hashed (BLAKE3) and checked ([`CompactLogCheck`]: every record's
/// CRC, key order, the one cursor record last) before it is written, and written past the page
/// cache on a writer thread ([`crate::staged::StagedFile`]). The copy is never read back: its
/// digest and what it recovers are those of the bytes handed to the kernel, and a file the disk
/// later spoils fails the importer's digest check instead. Never held whole in memory. Not fsynced
/// here: the artifact's seal fsyncs it, off the fold's pause.
fn export_compacted(path: &Path, fold: &LiveMap) -> Result<ProvenCopy, SnapshotError> {
    let out = ExportWriter {
        path,
        file: StagedFile::create(path, true).map_err(io_err(path, "create exported log"))?,
        hasher: blake3::Hasher::new(),
        check: CompactLogCheck::new(path),
        len: 0,
    };
    // Encoding runs here; hashing, checking and handing the bytes to the writer on a second
    // thread, so the two overlap (chunks go by value through a queue of two, and come back to be
    // reused).
    let (full_tx, full_rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(2);
    let (empty_tx, empty_rx) = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::scope(|scope| {
        let sink = std::thread::Builder::new()
            .name("foldhost-export-hash".into())
            .spawn_scoped(scope, move || {
                let mut out = out;
                for mut chunk in full_rx {
                    out.emit(&chunk)?;
                    chunk.clear();
                    // The encoder may be done already: nothing to hand back to then.
                    let _ = empty_tx.send(chunk);
                }
                Ok::<_, SnapshotError>(out)
            })
            .map_err(io_err(path, "start the export's hashing thread"))?;
        let mut buffers = ChunkBuffers {
            returned: empty_rx,
            made: 1,
        };
        let complete = encode_chunks(fold, full_tx, &mut buffers);
        let out = sink
            .join()
            .map_err(|_| SnapshotError::Backend("the export's hashing thread panicked".into()))??;
        if !complete {
            // Unreachable in practice: the sink only stops early on an error, returned above.
            return Err(SnapshotError::Backend(
                "the export's hashing thread stopped early".into(),
            ));
        }
        out.finish(fold)
    })
}

/// Encodes `fold` as a compacted log in chunks handed to [`export_compacted`]'s sink through
/// `full`: the header, every record, the cursor record last. False when the sink ended early (on
/// an error, which its join returns).
fn encode_chunks(
    fold: &LiveMap,
    full: std::sync::mpsc::SyncSender<Vec<u8>>,
    buffers: &mut ChunkBuffers,
) -> bool {
    let mut chunk = ChunkBuffers::fresh();
    format::encode_header(&mut chunk);
    let mut records = fold.iter_from(Bound::Unbounded);
    loop {
        let last = match records.next() {
            Some(item) => {
                match item.record {
                    // A base record is already what a compacted log holds (framed, its CRC
                    // computed; the check on the other thread recomputes it).
                    Some(record) => chunk.extend_from_slice(record),
                    None => {
                        format::encode_put(&mut chunk, &key_str(item.key), item.value, item.version)
                    }
                }
                if chunk.len() < COMPACT_CHUNK {
                    continue;
                }
                false
            }
            None => {
                format::encode_cursor(&mut chunk, fold.cursor);
                true
            }
        };
        let Some(next) = buffers.next() else {
            return false;
        };
        if full.send(std::mem::replace(&mut chunk, next)).is_err() {
            return false;
        }
        if last {
            return true;
        }
    }
}

/// [`export_compacted`]'s supply of chunk buffers: one the sink handed back, else a new one while
/// fewer than three exist, else (the sink holds them all) the next it hands back; `None` once the
/// sink has ended (on an error, which its join returns).
struct ChunkBuffers {
    returned: std::sync::mpsc::Receiver<Vec<u8>>,
    made: usize,
}

impl ChunkBuffers {
    /// A record may carry a chunk past [`COMPACT_CHUNK`]: room for one more of the usual size.
    fn fresh() -> Vec<u8> {
        Vec::with_capacity(COMPACT_CHUNK + 64 * 1024)
    }

    fn next(&mut self) -> Option<Vec<u8>> {
        match self.returned.try_recv() {
            Ok(b) => Some(b),
            Err(_) if self.made < 3 => {
                self.made += 1;
                Some(Self::fresh())
            }
            Err(_) => self.returned.recv().ok(),
        }
    }
}

/// [`export_compacted`]'s sink: every byte is hashed, checked and written, in that order.
struct ExportWriter<'a> {
    path: &'a Path,
    file: StagedFile,
    hasher: blake3::Hasher,
    check: CompactLogCheck,
    /// Bytes emitted so far.
    len: u64,
}

impl ExportWriter<'_> {
    fn emit(&mut self, chunk: &[u8]) -> Result<(), SnapshotError> {
        self.hasher.update(chunk);
        self.check.feed(chunk);
        self.file
            .write_all(chunk)
            .map_err(io_err(self.path, "write exported log"))?;
        self.len += chunk.len() as u64;
        Ok(())
    }

    /// Closes the file and states what it proved; the check must recover exactly the fold's cursor
    /// and size, and the file must hold every byte emitted (asserted after writing).
    fn finish(self, fold: &LiveMap) -> Result<ProvenCopy, SnapshotError> {
        let written = self
            .file
            .finish(false)
            .map_err(io_err(self.path, "write exported log"))?;
        let (cursor, keys) = self.check.finish()?;
        let on_disk = fs::metadata(self.path)
            .map_err(io_err(self.path, "stat exported log"))?
            .len();
        if written.bytes != self.len || on_disk != self.len {
            return Err(SnapshotError::InvalidFormat {
                path: self.path.to_owned(),
                reason: format!(
                    "exported log holds {on_disk} bytes ({} written), {} were encoded",
                    written.bytes, self.len
                ),
            });
        }
        if cursor != fold.cursor || keys != fold.len() {
            return Err(SnapshotError::InvalidFormat {
                path: self.path.to_owned(),
                reason: format!(
                    "exported log recovers cursor {:?} with {keys} keys, the fold is at {:?} with {}",
                    cursor.revision(),
                    fold.cursor.revision(),
                    fold.len()
                ),
            });
        }
        Ok(ProvenCopy {
            files: vec![HashedFile {
                path: LOG_NAME.to_owned(),
                size: self.len,
                blake3: self.hasher.finalize().to_hex().to_string(),
            }],
            cursor,
            keys,
        })
    }
}

fn open_append(path: &Path) -> Result<File, SnapshotError> {
    OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .map_err(io_err(path, "open for append"))
}

/// Makes a rename in `dir` durable.
fn sync_dir(dir: &Path) -> Result<(), SnapshotError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir, "fsync directory"))
}

fn lock_dir(dir: &Path) -> Result<File, SnapshotError> {
    let path = dir.join(LOCK_NAME);
    let lock = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io_err(&path, "open lock file"))?;
    match lock.try_lock() {
        Ok(()) => Ok(lock),
        Err(TryLockError::WouldBlock) => Err(SnapshotError::Locked { path }),
        Err(TryLockError::Error(e)) => Err(io_err(&path, "lock")(e)),
    }
}

/// Removes a temp file left by a compaction that crashed (we hold the lock, so no one is writing it).
fn remove_stale_tmp(dir: &Path) -> Result<(), SnapshotError> {
    let tmp = dir.join(TMP_NAME);
    match fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(io_err(&tmp, "remove stale temp file")(e))
        }
        _ => Ok(()),
    }
}

fn io_err(path: &Path, op: &'static str) -> impl FnOnce(io::Error) -> SnapshotError {
    let path = path.to_owned();
    move |source| SnapshotError::Io { path, op, source }
}

/// The name of the append log's one file in a store directory.
pub const LOG_FILE: &str = LOG_NAME;

fn corrupted(path: &Path, offset: usize, reason: String) -> SnapshotError {
    SnapshotError::Corrupted {
        path: path.to_owned(),
        offset: offset as u64,
        reason,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::os::unix::fs::MetadataExt;

    use super::*;
    use crate::kv::VersionToken;
    use crate::snapshot::MAX_VALUE_LEN;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/append_log");

    fn put(key: &str, value: &[u8], revision: u64) -> KvUpdate {
        put_v(key, value, VersionToken::from_u64(revision))
    }

    fn put_v(key: &str, value: &[u8], version: VersionToken) -> KvUpdate {
        KvUpdate::Put(KvEntry {
            key: key.into(),
            value: Bytes::copy_from_slice(value),
            version,
        })
    }

    fn del(key: &str, revision: u64) -> KvUpdate {
        KvUpdate::Delete {
            key: key.into(),
            version: VersionToken::from_u64(revision),
        }
    }

    fn ten_byte_version() -> VersionToken {
        VersionToken::from_bytes(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).expect("10 bytes fit")
    }

    fn open(dir: &Path) -> (AppendLogSnapshot, Recovery) {
        AppendLogSnapshot::open(dir, AppendLogOptions::default()).expect("open")
    }

    fn open_ro(dir: &Path) -> (AppendLogSnapshot, Recovery) {
        AppendLogSnapshot::open_read_only(dir).expect("open read-only")
    }

    /// The whole fold as comparable tuples, in key order.
    fn contents(store: &AppendLogSnapshot) -> Vec<(String, Vec<u8>, VersionToken)> {
        store
            .range("")
            .expect("range")
            .into_iter()
            .map(|e| (e.key, e.value.to_vec(), e.version))
            .collect()
    }

    fn entry(key: &str, value: &[u8], version: VersionToken) -> (String, Vec<u8>, VersionToken) {
        (key.into(), value.to_vec(), version)
    }

    fn log_bytes(dir: &Path) -> Vec<u8> {
        fs::read(dir.join(LOG_NAME)).expect("read fold.log")
    }

    fn write_log(dir: &Path, bytes: &[u8]) {
        fs::write(dir.join(LOG_NAME), bytes).expect("write fold.log");
    }

    fn fixture(name: &str) -> Vec<u8> {
        fs::read(Path::new(FIXTURES).join(name)).expect("read fixture")
    }

    /// A temp store directory holding `fixture` as its log.
    fn store_with_fixture(name: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        write_log(dir.path(), &fixture(name));
        dir
    }

    /// Encodes a log: header, then each batch followed by its cursor record.
    fn encode_log(batches: &[(&[KvUpdate], WatchCursor)]) -> Vec<u8> {
        let mut buf = Vec::new();
        format::encode_header(&mut buf);
        for (batch, cursor) in batches {
            for u in *batch {
                format::encode_update(&mut buf, u).expect("fits");
            }
            format::encode_cursor(&mut buf, *cursor);
        }
        buf
    }

    fn inode(path: &Path) -> u64 {
        fs::metadata(path).expect("metadata").ino()
    }

    /// The fold `current.log` holds at its first cursor record (revision 4).
    fn fixture_fold_at_4() -> Vec<(String, Vec<u8>, VersionToken)> {
        vec![
            entry("beta", b"two", ten_byte_version()),
            entry("gamma", b"three", VersionToken::from_u64(3)),
        ]
    }

    /// The fold `current.log` holds at its last cursor record (revision 6).
    fn fixture_fold_at_6() -> Vec<(String, Vec<u8>, VersionToken)> {
        vec![
            entry("beta", b"two again", VersionToken::from_u64(6)),
            entry("delta", b"four", VersionToken::from_u64(5)),
            entry("gamma", b"three", VersionToken::from_u64(3)),
        ]
    }

    fn fixture_batches() -> (Vec<KvUpdate>, Vec<KvUpdate>) {
        let first = vec![
            put("alpha", b"one", 1),
            put_v("beta", b"two", ten_byte_version()),
            put("gamma", b"three", 3),
            del("alpha", 4),
        ];
        let second = vec![put("delta", b"four", 5), put("beta", b"two again", 6)];
        (first, second)
    }

    #[test]
    fn apply_then_reopen_round_trips_puts_deletes_purges_and_versions() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        store
            .apply(
                &[
                    put("a", b"1", 1),
                    put_v("ten", b"ten-byte version", ten_byte_version()),
                    put("doomed", b"x", 3),
                    put("purged", b"y", 4),
                ],
                WatchCursor::at(4),
            )
            .expect("apply");
        store
            .apply(
                &[
                    del("doomed", 5),
                    KvUpdate::Purge {
                        key: "purged".into(),
                        version: VersionToken::from_u64(6),
                    },
                    put("a", b"2", 7),
                ],
                WatchCursor::at(7),
            )
            .expect("apply");
        let expected = vec![
            entry("a", b"2", VersionToken::from_u64(7)),
            entry("ten", b"ten-byte version", ten_byte_version()),
        ];
        assert_eq!(contents(&store), expected);
        drop(store);

        let (store, recovery) = open(dir.path());
        assert_eq!(recovery, Recovery::default());
        assert_eq!(contents(&store), expected);
        assert_eq!(store.cursor(), WatchCursor::at(7));
        assert_eq!(store.len().expect("len"), 2);
        let got = store.get("ten").expect("get").expect("present");
        assert_eq!(got.version.as_bytes(), ten_byte_version().as_bytes());
        assert_eq!(store.get("doomed").expect("get"), None);
    }

    #[test]
    fn empty_values_and_unknown_versions_round_trip() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        store
            .apply(
                &[
                    put("empty", b"", 1),
                    put_v("unversioned", b"v", VersionToken::UNKNOWN),
                ],
                WatchCursor::at(1),
            )
            .expect("apply");
        drop(store);
        let (store, _) = open_ro(dir.path());
        assert_eq!(
            contents(&store),
            vec![
                entry("empty", b"", VersionToken::from_u64(1)),
                entry("unversioned", b"v", VersionToken::UNKNOWN),
            ]
        );
    }

    #[test]
    fn cursor_moves_from_none_to_at_n_and_survives_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        assert_eq!(store.cursor(), WatchCursor::NONE);
        assert!(store.is_empty().expect("is_empty"));
        store
            .apply(&[put("k", b"v", 1)], WatchCursor::NONE)
            .expect("apply");
        drop(store);
        let (mut store, _) = open(dir.path());
        assert_eq!(store.cursor(), WatchCursor::NONE);
        assert_eq!(store.len().expect("len"), 1);
        store.apply(&[], WatchCursor::at(42)).expect("apply");
        assert_eq!(store.cursor(), WatchCursor::at(42));
        drop(store);
        let (store, _) = open(dir.path());
        assert_eq!(store.cursor(), WatchCursor::at(42));
    }

    #[test]
    fn for_each_in_range_visits_the_prefix_in_key_order_and_stops_early() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        let keys = ["b/2", "a/1", "b/1", "b", "b/3", "ba", "c"];
        let batch: Vec<KvUpdate> = keys.iter().map(|k| put(k, k.as_bytes(), 1)).collect();
        store.apply(&batch, WatchCursor::at(1)).expect("apply");

        let mut seen = Vec::new();
        store
            .for_each_in_range("b/", &mut |e| {
                assert_eq!(e.value.as_ref(), e.key.as_bytes());
                seen.push(e.key.clone());
                ControlFlow::Continue(())
            })
            .expect("scan");
        assert_eq!(seen, ["b/1", "b/2", "b/3"]);

        seen.clear();
        store
            .for_each_in_range("b", &mut |e| {
                seen.push(e.key.clone());
                if seen.len() == 2 {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
            .expect("scan");
        assert_eq!(seen, ["b", "b/1"]);

        let all: Vec<String> = store
            .range("")
            .expect("range")
            .into_iter()
            .map(|e| e.key)
            .collect();
        assert_eq!(all, ["a/1", "b", "b/1", "b/2", "b/3", "ba", "c"]);
        assert!(store.range("zz").expect("range").is_empty());
    }

    #[test]
    fn oversized_value_is_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        store
            .apply(&[put("keep", b"v", 1)], WatchCursor::at(1))
            .expect("apply");
        let before = log_bytes(dir.path());
        let huge = KvUpdate::Put(KvEntry {
            key: "huge".into(),
            value: Bytes::from(vec![0u8; MAX_VALUE_LEN + 1]),
            version: VersionToken::from_u64(3),
        });
        let err = store
            .apply(&[put("small", b"s", 2), huge], WatchCursor::at(3))
            .expect_err("over the cap");
        assert!(matches!(err, SnapshotError::TooLarge(_)), "{err}");
        assert_eq!(log_bytes(dir.path()), before);
        assert_eq!(store.get("small").expect("get"), None);
        assert_eq!(store.cursor(), WatchCursor::at(1));
        // Not poisoned: the refusal happened before any I/O.
        store
            .apply(&[put("small", b"s", 2)], WatchCursor::at(2))
            .expect("apply");
    }

    #[test]
    fn value_declared_over_the_cap_on_disk_is_corrupted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut log = Vec::new();
        format::encode_header(&mut log);
        let start = log.len();
        log.extend_from_slice(&[0, 0, 0, 0, 1, 1, 0, b'k']);
        log.extend_from_slice(&(MAX_VALUE_LEN as u32 + 1).to_le_bytes());
        log.extend_from_slice(b"a few bytes, not 64 MiB");
        let crc = crc32fast::hash(&log[start + 4..]);
        log[start..start + 4].copy_from_slice(&crc.to_le_bytes());
        write_log(dir.path(), &log);

        let err = AppendLogSnapshot::open_read_only(dir.path()).expect_err("corrupted");
        match err {
            SnapshotError::Corrupted {
                offset,
                reason,
                path,
            } => {
                assert_eq!(offset, HEADER_LEN as u64);
                assert!(reason.contains("cap"), "{reason}");
                assert_eq!(path, dir.path().join(LOG_NAME));
            }
            other => panic!("expected Corrupted, got {other}"),
        }
        // The writable open refuses too, and leaves the evidence alone.
        let err = AppendLogSnapshot::open(dir.path(), AppendLogOptions::default())
            .expect_err("corrupted");
        assert!(matches!(err, SnapshotError::Corrupted { .. }), "{err}");
        assert_eq!(log_bytes(dir.path()), log);
    }

    fn assert_invalid_format(log: &[u8], needle: &str) {
        let dir = tempfile::tempdir().expect("tempdir");
        write_log(dir.path(), log);
        for err in [
            AppendLogSnapshot::open_read_only(dir.path()).expect_err("invalid"),
            AppendLogSnapshot::open(dir.path(), AppendLogOptions::default()).expect_err("invalid"),
        ] {
            match err {
                SnapshotError::InvalidFormat { reason, .. } => {
                    assert!(reason.contains(needle), "{reason:?} lacks {needle:?}")
                }
                other => panic!("expected InvalidFormat, got {other}"),
            }
        }
        assert_eq!(
            log_bytes(dir.path()),
            log,
            "a refused open must not touch the file"
        );
    }

    #[test]
    fn bad_magic_is_invalid_format() {
        assert_invalid_format(b"FHLX\x01\x00rest", "magic");
    }

    #[test]
    fn unknown_version_is_invalid_format_naming_the_version() {
        assert_invalid_format(b"FHLG\x09\x00", "version 9");
    }

    #[test]
    fn three_byte_file_is_invalid_format() {
        assert_invalid_format(b"FHL", "3-byte");
    }

    #[test]
    fn empty_file_opens_as_an_empty_fold() {
        let dir = tempfile::tempdir().expect("tempdir");
        write_log(dir.path(), b"");
        let (store, recovery) = open_ro(dir.path());
        assert_eq!(recovery, Recovery::default());
        assert!(store.is_empty().expect("is_empty"));
        assert_eq!(store.cursor(), WatchCursor::NONE);

        let (mut store, recovery) = open(dir.path());
        assert_eq!(recovery, Recovery::default());
        assert!(store.is_empty().expect("is_empty"));
        // The writable open gave the file its header, so it is appendable.
        assert_eq!(&log_bytes(dir.path())[..4], b"FHLG");
        store
            .apply(&[put("k", b"v", 1)], WatchCursor::at(1))
            .expect("apply");
        drop(store);
        assert_eq!(open_ro(dir.path()).0.cursor(), WatchCursor::at(1));
    }

    #[test]
    fn missing_log_is_created_by_open_and_an_error_for_read_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store_dir = dir.path().join("nested/store");
        let err = AppendLogSnapshot::open_read_only(&store_dir).expect_err("no log");
        assert!(
            matches!(&err, SnapshotError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound),
            "{err}"
        );
        let (store, recovery) = open(&store_dir);
        assert_eq!(recovery, Recovery::default());
        assert!(store.path().is_file());
        assert_eq!(store.path(), store_dir.join(LOG_NAME));
    }

    #[test]
    fn records_after_the_last_cursor_are_discarded_and_counted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut log = encode_log(&[(&[put("a", b"1", 1)], WatchCursor::at(1))]);
        let committed = log.len();
        format::encode_update(&mut log, &put("b", b"2", 2)).expect("fits");
        format::encode_update(&mut log, &del("a", 3)).expect("fits");
        write_log(dir.path(), &log);

        let (store, recovery) = open_ro(dir.path());
        assert_eq!(
            contents(&store),
            vec![entry("a", b"1", VersionToken::from_u64(1))]
        );
        assert_eq!(store.cursor(), WatchCursor::at(1));
        assert_eq!(recovery.discarded_records, 2);
        assert_eq!(
            recovery.discarded_tail_bytes,
            (log.len() - committed) as u64
        );
        let reason = recovery.reason.expect("a reason");
        assert!(reason.contains("did not finish"), "{reason}");
    }

    #[test]
    fn zero_filled_tail_is_discarded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut log = encode_log(&[(&[put("a", b"1", 1)], WatchCursor::at(1))]);
        let valid = log.len();
        log.extend_from_slice(&[0; 100]);
        write_log(dir.path(), &log);

        let (store, recovery) = open_ro(dir.path());
        assert_eq!(store.cursor(), WatchCursor::at(1));
        assert_eq!(store.len().expect("len"), 1);
        assert_eq!(recovery.discarded_tail_bytes, 100);
        assert_eq!(recovery.discarded_records, 0);
        assert!(recovery.reason.expect("reason").contains("zero-filled"));

        // The writable open cuts the zeros off before appending.
        let (mut store, _) = open(dir.path());
        assert!(log_bytes(dir.path()).len() <= valid);
        store
            .apply(&[put("b", b"2", 2)], WatchCursor::at(2))
            .expect("apply");
        drop(store);
        let (store, recovery) = open_ro(dir.path());
        assert_eq!(recovery, Recovery::default());
        assert_eq!(store.len().expect("len"), 2);
    }

    #[test]
    fn bad_checksum_on_the_last_record_is_a_torn_tail() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = encode_log(&[(&[put("a", b"1", 1)], WatchCursor::at(1))]);
        let mut log = encode_log(&[
            (&[put("a", b"1", 1)], WatchCursor::at(1)),
            (&[put("b", b"2", 2)], WatchCursor::at(2)),
        ]);
        let last = log.len() - 1;
        log[last] ^= 0xff; // inside the last cursor record
        // Zeros after the bad record are still a tail: a page that never reached the disk.
        log.extend_from_slice(&[0; 7]);
        write_log(dir.path(), &log);

        let (store, recovery) = open_ro(dir.path());
        assert_eq!(store.cursor(), WatchCursor::at(1));
        assert_eq!(
            contents(&store),
            vec![entry("a", b"1", VersionToken::from_u64(1))]
        );
        assert_eq!(
            recovery.discarded_tail_bytes,
            (log.len() - first.len()) as u64
        );
        assert_eq!(recovery.discarded_records, 1);
        assert!(recovery.reason.expect("reason").contains("bad checksum"));
    }

    #[test]
    fn bad_checksum_followed_by_data_is_corrupted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut log = encode_log(&[
            (&[put("a", b"1", 1)], WatchCursor::at(1)),
            (&[put("b", b"2", 2)], WatchCursor::at(2)),
        ]);
        // The first record's value: crc 4 + type 1 + key_len 2 + "a" 1 + value_len 4.
        log[HEADER_LEN + 12] ^= 0x01;
        write_log(dir.path(), &log);
        let err = AppendLogSnapshot::open_read_only(dir.path()).expect_err("corrupted");
        assert!(
            matches!(&err, SnapshotError::Corrupted { offset, .. } if *offset == HEADER_LEN as u64),
            "{err}"
        );
    }

    #[test]
    fn length_running_past_end_of_file_is_a_reported_torn_tail() {
        // The rule the format allows: a record whose declared length runs past the end of the file
        // cannot be told from a torn write, so it is discarded with everything after it, and the
        // discard is reported. (This includes a flipped bit in a length field, which rolls the fold
        // back to an earlier cursor: consistent, never silent.)
        let dir = tempfile::tempdir().expect("tempdir");
        let first = encode_log(&[(&[put("a", b"1", 1)], WatchCursor::at(1))]);
        let mut log = encode_log(&[
            (&[put("a", b"1", 1)], WatchCursor::at(1)),
            (&[put("b", b"2", 2)], WatchCursor::at(2)),
        ]);
        // The second put's value_len (crc 4 + type 1 + key_len 2 + "b" 1).
        log[first.len() + 8] = 0xff;
        write_log(dir.path(), &log);
        let (store, recovery) = open_ro(dir.path());
        assert_eq!(store.cursor(), WatchCursor::at(1));
        assert_eq!(
            recovery.discarded_tail_bytes,
            (log.len() - first.len()) as u64
        );
        let reason = recovery.reason.expect("reason");
        assert!(
            reason.contains(&format!("cut short at offset {}", first.len())),
            "{reason}"
        );
    }

    #[test]
    fn encoder_reproduces_the_current_fixture_byte_for_byte() {
        // The fixture was written by an independent generator (see the fixture README), so this pins
        // the on-disk format: a change to the encoder that breaks old files fails here.
        let (first, second) = fixture_batches();
        let log = encode_log(&[(&first, WatchCursor::at(4)), (&second, WatchCursor::at(6))]);
        assert_eq!(log, fixture("current.log"));
    }

    #[test]
    fn current_fixture_loads_the_fold_at_its_last_cursor() {
        let dir = store_with_fixture("current.log");
        let (store, recovery) = open_ro(dir.path());
        assert_eq!(recovery, Recovery::default());
        assert_eq!(store.cursor(), WatchCursor::at(6));
        assert_eq!(contents(&store), fixture_fold_at_6());
    }

    #[test]
    fn memo_cursor_fixture_loads_the_memo_and_the_old_format_loads_without_one() {
        let dir = store_with_fixture("memo_cursor.log");
        let (store, recovery) = open_ro(dir.path());
        assert_eq!(recovery, Recovery::default());
        assert_eq!(store.cursor().revision(), Some(6));
        assert_eq!(
            store.cursor().memo(),
            Some(crate::kv::EvictionMemo {
                server_time_unix_ns: 1_700_000_000_000_000_000
            })
        );
        assert_eq!(contents(&store), fixture_fold_at_6());
        let old = store_with_fixture("current.log");
        assert_eq!(open_ro(old.path()).0.cursor().memo(), None);
    }

    #[test]
    fn truncated_tail_recovers_to_last_whole_record() {
        let dir = store_with_fixture("torn_tail.log");
        let (store, recovery) = open_ro(dir.path());
        assert_eq!(store.cursor(), WatchCursor::at(4));
        assert_eq!(contents(&store), fixture_fold_at_4());
        // Everything after the cursor-4 record, which ends at byte 128.
        assert_eq!(
            recovery.discarded_tail_bytes,
            fixture("torn_tail.log").len() as u64 - 128
        );
        assert_eq!(recovery.discarded_records, 2);
        assert!(
            recovery
                .reason
                .expect("reason")
                .contains("cut short at offset 190")
        );
    }

    #[test]
    fn open_cuts_a_torn_tail_so_appends_follow_the_last_cursor() {
        let dir = store_with_fixture("torn_tail.log");
        let (mut store, recovery) = open(dir.path());
        assert!(recovery.discarded_tail_bytes > 0);
        store
            .apply(&[put("epsilon", b"five", 7)], WatchCursor::at(7))
            .expect("apply");
        drop(store);
        let (store, recovery) = open_ro(dir.path());
        assert_eq!(recovery, Recovery::default());
        assert_eq!(store.cursor(), WatchCursor::at(7));
        let mut expected = fixture_fold_at_4();
        expected.push(entry("epsilon", b"five", VersionToken::from_u64(7)));
        expected.sort();
        assert_eq!(contents(&store), expected);
    }

    #[test]
    fn flipped_byte_mid_file_is_corrupted_at_that_record() {
        let dir = store_with_fixture("mid_file_corrupt.log");
        let err = AppendLogSnapshot::open_read_only(dir.path()).expect_err("corrupted");
        match err {
            // The second record ("beta"), which starts at byte 34.
            SnapshotError::Corrupted { offset, reason, .. } => {
                assert_eq!(offset, 34);
                assert!(reason.contains("checksum"), "{reason}");
            }
            other => panic!("expected Corrupted, got {other}"),
        }
        let err = AppendLogSnapshot::open(dir.path(), AppendLogOptions::default())
            .expect_err("corrupted");
        assert!(
            matches!(err, SnapshotError::Corrupted { offset: 34, .. }),
            "{err}"
        );
        assert_eq!(log_bytes(dir.path()), fixture("mid_file_corrupt.log"));
    }

    #[test]
    fn nuls_mid_file_followed_by_valid_records_are_corrupted_not_truncated() {
        let dir = store_with_fixture("mid_file_nuls.log");
        let err = AppendLogSnapshot::open_read_only(dir.path()).expect_err("corrupted");
        match err {
            SnapshotError::Corrupted { offset, reason, .. } => {
                assert_eq!(offset, HEADER_LEN as u64);
                assert!(reason.contains("NUL"), "{reason}");
            }
            other => panic!("expected Corrupted, got {other}"),
        }
        let err = AppendLogSnapshot::open(dir.path(), AppendLogOptions::default())
            .expect_err("corrupted");
        assert!(matches!(err, SnapshotError::Corrupted { .. }), "{err}");
        assert_eq!(log_bytes(dir.path()), fixture("mid_file_nuls.log"));
    }

    #[test]
    fn compaction_preserves_the_fold_and_cursor_and_shrinks_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        for rev in 1..=50 {
            let batch = [
                put("hot", &[rev as u8; 64], rev),
                put(&format!("k{rev:02}"), b"v", rev),
            ];
            store.apply(&batch, WatchCursor::at(rev)).expect("apply");
            if rev % 3 == 0 {
                store
                    .apply(&[del(&format!("k{rev:02}"), rev)], WatchCursor::at(rev))
                    .expect("apply");
            }
        }
        let before_len = log_bytes(dir.path()).len();
        let before = contents(&store);
        let before_inode = inode(store.path());
        store.compact().expect("compact");
        let after_len = log_bytes(dir.path()).len();
        assert!(after_len < before_len, "{after_len} >= {before_len}");
        assert_eq!(after_len as u64, store.fold.compacted_len());
        assert_ne!(inode(store.path()), before_inode);
        assert_eq!(contents(&store), before);
        assert_eq!(store.cursor(), WatchCursor::at(50));
        assert!(!dir.path().join(TMP_NAME).exists());

        // Appends continue on the new file.
        store
            .apply(&[put("after", b"x", 51)], WatchCursor::at(51))
            .expect("apply");
        drop(store);
        let (store, recovery) = open_ro(dir.path());
        assert_eq!(recovery, Recovery::default());
        assert_eq!(store.cursor(), WatchCursor::at(51));
        assert_eq!(store.len().expect("len"), before.len() as u64 + 1);
    }

    #[test]
    fn compact_is_a_no_op_when_nothing_was_appended() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        store
            .apply(&[put("a", b"1", 1)], WatchCursor::at(1))
            .expect("apply");
        store.compact().expect("compact");
        let compacted = inode(store.path());
        store.compact().expect("compact");
        assert_eq!(inode(store.path()), compacted);
    }

    #[test]
    fn open_of_an_already_compact_file_does_not_rewrite_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        store
            .apply(&[put("a", b"1", 1), put("b", b"2", 2)], WatchCursor::at(2))
            .expect("apply");
        store.compact().expect("compact");
        let path = store.path().to_owned();
        drop(store);
        let (before_inode, before) = (inode(&path), log_bytes(dir.path()));

        let (store, recovery) = open(dir.path());
        assert_eq!(recovery, Recovery::default());
        assert_eq!(inode(&path), before_inode);
        assert_eq!(log_bytes(dir.path()), before);
        assert_eq!(store.len().expect("len"), 2);
    }

    /// Logs of random batches (puts, overwrites, deletes, in and out of key order, some after a
    /// compaction) reopen to exactly the fold an ordered map computes from the same batches. The
    /// replay's sorted tail and the base must agree with it on every key, version and count.
    #[test]
    fn random_logs_reopen_to_the_fold_an_ordered_map_computes() {
        for seed in 1..=60u64 {
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let dir = tempfile::tempdir().expect("tempdir");
            let mut model: BTreeMap<String, (Vec<u8>, VersionToken)> = BTreeMap::new();
            let mut rev = 0u64;
            for round in 0..4 {
                let (mut store, _) = open(dir.path());
                for _ in 0..(next() % 6) {
                    let batch: Vec<KvUpdate> = (0..(1 + next() % 20))
                        .map(|_| {
                            rev += 1;
                            let key = format!("k{:03}", next() % 64);
                            if next().is_multiple_of(4) {
                                model.remove(&key);
                                del(&key, rev)
                            } else {
                                let value = vec![round as u8; (next() % 5) as usize];
                                model.insert(
                                    key.clone(),
                                    (value.clone(), VersionToken::from_u64(rev)),
                                );
                                put(&key, &value, rev)
                            }
                        })
                        .collect();
                    store.apply(&batch, WatchCursor::at(rev)).expect("apply");
                }
                if next().is_multiple_of(3) {
                    store.compact().expect("compact");
                }
                drop(store);
                let (store, _) = open(dir.path());
                let expected: Vec<_> = model
                    .iter()
                    .map(|(k, (v, ver))| entry(k, v, *ver))
                    .collect();
                assert_eq!(contents(&store), expected, "seed {seed} round {round}");
                assert_eq!(store.len().expect("len"), model.len() as u64, "seed {seed}");
                for k in 0..64 {
                    let key = format!("k{k:03}");
                    assert_eq!(
                        store
                            .get(&key)
                            .expect("get")
                            .map(|e| (e.value.to_vec(), e.version)),
                        model.get(&key).cloned(),
                        "seed {seed} round {round} key {key}"
                    );
                }
                assert_eq!(
                    store.fold.layers().1,
                    0,
                    "a replay leaves the overlay empty"
                );
            }
        }
    }

    /// The memory layout that keeps the fold near the size of its data: a log opens into the dense
    /// base alone (8 bytes per key), later batches go to the overlay, and a compaction folds the
    /// overlay back into a base over the new file.
    #[test]
    fn a_log_opens_into_the_dense_base_and_a_compaction_empties_the_overlay() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let (mut store, _) = open(dir.path());
            let batch: Vec<KvUpdate> = (0..50).map(|i| put(&format!("k{i:03}"), b"v", 1)).collect();
            store.apply(&batch, WatchCursor::at(1)).expect("apply");
            store.compact().expect("compact");
            assert_eq!(store.fold.layers(), (50, 0), "a compaction rebases");
        }
        let (mut store, _) = open(dir.path());
        assert_eq!(
            store.fold.layers(),
            (50, 0),
            "a compacted log opens as base only"
        );
        store
            .apply(
                &[put("k007", b"w", 2), del("k008", 2), put("zz", b"n", 2)],
                WatchCursor::at(2),
            )
            .expect("apply");
        assert_eq!(store.fold.layers(), (50, 3));
        assert_eq!(store.len().expect("len"), 50);
        assert_eq!(store.get("k008").expect("get"), None);
        drop(store);
        // Reopened: the compacted prefix and the appended batch, sorted in, make one base.
        let (mut store, _) = open(dir.path());
        assert_eq!(store.fold.layers(), (50, 0));
        assert_eq!(
            store.get("k007").expect("get").map(|e| e.value),
            Some(Bytes::from_static(b"w"))
        );
        store.compact().expect("compact");
        assert_eq!(store.fold.layers(), (50, 0));
        let keys: Vec<String> = contents(&store).into_iter().map(|e| e.0).collect();
        assert_eq!(keys.len(), 50);
        assert!(!keys.contains(&"k008".to_owned()) && keys.contains(&"zz".to_owned()));
    }

    #[test]
    fn open_compacts_a_file_whose_garbage_reaches_its_live_data() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = AppendLogOptions {
            compact_threshold: 0,
        };
        {
            // Written with automatic compaction out of reach, so the garbage is still there.
            let (mut store, _) = open(dir.path());
            store
                .apply(&[put("a", b"1", 1)], WatchCursor::at(1))
                .expect("apply");
            store
                .apply(&[put("a", b"2", 2)], WatchCursor::at(2))
                .expect("apply");
        }
        let path = dir.path().join(LOG_NAME);
        let (before_inode, before_len) = (inode(&path), log_bytes(dir.path()).len());

        let (store, _) = AppendLogSnapshot::open(dir.path(), opts).expect("open");
        assert_ne!(inode(&path), before_inode);
        assert!(log_bytes(dir.path()).len() < before_len);
        assert_eq!(
            contents(&store),
            vec![entry("a", b"2", VersionToken::from_u64(2))]
        );
        assert_eq!(store.cursor(), WatchCursor::at(2));
    }

    #[test]
    fn open_leaves_a_log_with_little_garbage_as_it_is_and_counts_it_toward_the_next_compaction() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let (mut store, _) = open(dir.path());
            for rev in 1..=3 {
                store
                    .apply(
                        &[put(&format!("k{rev}"), &[7; 100], rev)],
                        WatchCursor::at(rev),
                    )
                    .expect("apply");
            }
        }
        let path = dir.path().join(LOG_NAME);
        let before = (inode(&path), log_bytes(dir.path()));
        // Three cursor records where a compacted log has one: not worth a rewrite at open.
        let (mut store, _) = open(dir.path());
        assert_eq!((inode(&path), log_bytes(dir.path())), before);
        assert_eq!(store.cursor(), WatchCursor::at(3));
        assert_eq!(store.len().expect("len"), 3);
        let garbage = before.1.len() as u64 - store.fold.compacted_len();
        assert_eq!(
            store.writer.as_ref().map(Writer::appended),
            Some(garbage),
            "the garbage found at open counts toward the next compaction"
        );
        // And the log keeps working: appends land after the last cursor record.
        store
            .apply(&[put("k4", b"v", 4)], WatchCursor::at(4))
            .expect("apply");
        drop(store);
        let (store, recovery) = open(dir.path());
        assert_eq!(recovery, Recovery::default());
        assert_eq!(store.len().expect("len"), 4);
        assert_eq!(store.cursor(), WatchCursor::at(4));
    }

    #[test]
    fn automatic_compaction_bounds_file_growth() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = AppendLogOptions {
            compact_threshold: 0,
        };
        let (mut store, _) = AppendLogSnapshot::open(dir.path(), opts).expect("open");
        let mut largest = 0;
        for rev in 1..=500 {
            store
                .apply(&[put("k", &[7; 100], rev)], WatchCursor::at(rev))
                .expect("apply");
            largest = largest.max(log_bytes(dir.path()).len());
        }
        // Without compaction the log would hold 500 copies (> 60 KB); with it, garbage stays below
        // the live fold, so the file never exceeds about twice the compacted size plus one batch.
        let compacted = store.fold.compacted_len() as usize;
        assert!(
            largest <= 2 * compacted + 200,
            "{largest} vs compacted {compacted}"
        );
        drop(store);
        let (store, _) = open_ro(dir.path());
        assert_eq!(store.cursor(), WatchCursor::at(500));
        assert_eq!(store.len().expect("len"), 1);
    }

    #[test]
    fn read_only_open_beside_a_writer_sees_the_fold_and_leaves_the_file_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut writer, _) = open(dir.path());
        writer
            .apply(&[put("a", b"1", 1)], WatchCursor::at(1))
            .expect("apply");
        writer
            .apply(&[put("a", b"2", 2)], WatchCursor::at(2))
            .expect("apply");
        // Simulate the writer's next append caught half-way.
        let mut half = Vec::new();
        format::encode_update(&mut half, &put("b", b"in flight", 3)).expect("fits");
        half.truncate(half.len() / 2);
        let mut file = OpenOptions::new()
            .append(true)
            .open(writer.path())
            .expect("open");
        file.write_all(&half).expect("write");
        let before = log_bytes(dir.path());
        let before_inode = inode(writer.path());

        let (reader, recovery) = open_ro(dir.path());
        assert_eq!(
            contents(&reader),
            vec![entry("a", b"2", VersionToken::from_u64(2))]
        );
        assert_eq!(reader.cursor(), WatchCursor::at(2));
        assert_eq!(recovery.discarded_tail_bytes, half.len() as u64);
        assert_eq!(
            log_bytes(dir.path()),
            before,
            "read-only open must not truncate or compact"
        );
        assert_eq!(inode(writer.path()), before_inode);
        drop(reader);
    }

    #[test]
    fn read_only_store_refuses_apply_and_compact() {
        let dir = tempfile::tempdir().expect("tempdir");
        drop(open(dir.path()));
        let before = log_bytes(dir.path());
        let (mut reader, _) = open_ro(dir.path());
        let err = reader
            .apply(&[put("a", b"1", 1)], WatchCursor::at(1))
            .expect_err("read-only");
        assert!(
            matches!(&err, SnapshotError::Io { source, .. } if source.kind() == io::ErrorKind::PermissionDenied),
            "{err}"
        );
        assert!(reader.compact().is_err());
        assert_eq!(log_bytes(dir.path()), before);
        assert_eq!(reader.cursor(), WatchCursor::NONE);
    }

    #[test]
    fn second_writable_open_is_locked_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (first, _) = open(dir.path());
        let err =
            AppendLogSnapshot::open(dir.path(), AppendLogOptions::default()).expect_err("locked");
        match err {
            SnapshotError::Locked { path } => assert_eq!(path, dir.path().join(LOCK_NAME)),
            other => panic!("expected Locked, got {other}"),
        }
        // A reader needs no lock.
        open_ro(dir.path());
        drop(first);
        open(dir.path());
    }

    #[test]
    fn failed_write_is_cut_back_and_a_later_apply_succeeds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        store
            .apply(&[put("a", b"1", 1)], WatchCursor::at(1))
            .expect("apply");
        let before = log_bytes(dir.path());

        store.inject_fault(FaultPoint::PartialWrite);
        let batch = [put("b", b"2", 2), del("a", 3)];
        let err = store
            .apply(&batch, WatchCursor::at(3))
            .expect_err("injected");
        assert!(matches!(err, SnapshotError::Io { .. }), "{err}");
        assert_eq!(
            log_bytes(dir.path()),
            before,
            "the partial write was cut back"
        );
        assert_eq!(store.cursor(), WatchCursor::at(1));
        assert_eq!(
            contents(&store),
            vec![entry("a", b"1", VersionToken::from_u64(1))]
        );

        store.apply(&batch, WatchCursor::at(3)).expect("retry");
        drop(store);
        let (store, recovery) = open(dir.path());
        assert_eq!(recovery, Recovery::default());
        assert_eq!(store.cursor(), WatchCursor::at(3));
        assert_eq!(
            contents(&store),
            vec![entry("b", b"2", VersionToken::from_u64(2))]
        );
    }

    #[test]
    fn failed_cut_back_poisons_until_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        store
            .apply(&[put("a", b"1", 1)], WatchCursor::at(1))
            .expect("apply");
        store.inject_fault(FaultPoint::PartialWriteUncut);
        store
            .apply(&[put("b", b"2", 2)], WatchCursor::at(2))
            .expect_err("injected");
        for err in [
            store
                .apply(&[put("c", b"3", 3)], WatchCursor::at(3))
                .expect_err("poisoned"),
            store.compact().expect_err("poisoned"),
        ] {
            match err {
                SnapshotError::Poisoned { cause, .. } => {
                    assert!(cause.contains("injected write fault"), "{cause}")
                }
                other => panic!("expected Poisoned, got {other}"),
            }
        }
        // Reads still serve the last applied state.
        assert_eq!(store.cursor(), WatchCursor::at(1));
        drop(store);

        let (store, recovery) = open(dir.path());
        assert!(
            recovery.discarded_tail_bytes > 0,
            "the half batch is a torn tail"
        );
        assert_eq!(store.cursor(), WatchCursor::at(1));
        assert_eq!(
            contents(&store),
            vec![entry("a", b"1", VersionToken::from_u64(1))]
        );
    }

    fn assert_failed_compaction_poisons_and_reopen_recovers(point: FaultPoint) {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        store
            .apply(&[put("a", b"1", 1)], WatchCursor::at(1))
            .expect("apply");
        store
            .apply(&[put("a", b"2", 2), put("b", b"3", 3)], WatchCursor::at(3))
            .expect("apply");
        let expected = contents(&store);

        store.inject_fault(point);
        let err = store.compact().expect_err("injected");
        assert!(matches!(err, SnapshotError::Io { .. }), "{err}");
        assert!(!dir.path().join(TMP_NAME).exists(), "temp file left behind");
        let err = store
            .apply(&[put("c", b"4", 4)], WatchCursor::at(4))
            .expect_err("poisoned");
        assert!(matches!(err, SnapshotError::Poisoned { .. }), "{err}");
        drop(store);

        let (store, _) = open(dir.path());
        assert_eq!(store.cursor(), WatchCursor::at(3));
        assert_eq!(contents(&store), expected);
    }

    #[test]
    fn failed_compaction_before_rename_poisons_and_reopen_recovers_the_last_cursor() {
        assert_failed_compaction_poisons_and_reopen_recovers(FaultPoint::CompactBeforeRename);
    }

    #[test]
    fn failed_compaction_after_rename_poisons_and_reopen_recovers_the_last_cursor() {
        assert_failed_compaction_poisons_and_reopen_recovers(FaultPoint::CompactAfterRename);
    }

    #[test]
    fn the_store_keeps_no_delivered_read_alive_and_its_entries_are_the_batch_records() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        // A read as a watch hands it over: every value a slice of it.
        let read = Bytes::from(vec![b'r'; 64 * 1024]);
        let batch: Vec<KvUpdate> = (0..50u64)
            .map(|i| {
                let at = (i as usize) * 100;
                KvUpdate::Put(KvEntry {
                    key: format!("k{i:02}"),
                    value: read.slice(at..at + 40),
                    version: VersionToken::from_u64(i + 1),
                })
            })
            .collect();
        store.apply(&batch, WatchCursor::at(50)).expect("apply");
        store
            .apply(
                &[del("k07", 51), put("k08", b"again", 52)],
                WatchCursor::at(52),
            )
            .expect("apply");
        drop(batch);
        assert!(
            read.try_into_mut().is_ok(),
            "the store keeps a slice of the read"
        );
        let got = store.get("k09").expect("get").expect("live");
        assert_eq!(got.value, vec![b'r'; 40]);
        assert!(store.get("k07").expect("get").is_none());
        assert_eq!(
            store.get("k08").expect("get").expect("live").value,
            b"again"[..]
        );
        assert_eq!(store.len().expect("len"), 49);
        let expected = contents(&store);
        drop(store);
        let (store, _) = open(dir.path());
        assert_eq!(contents(&store), expected);
    }

    #[test]
    fn apply_whose_compaction_fails_reports_it_and_the_batch_survives_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = AppendLogOptions {
            compact_threshold: 0,
        };
        let (mut store, _) = AppendLogSnapshot::open(dir.path(), opts).expect("open");
        store.inject_fault(FaultPoint::CompactBeforeRename);
        // Appending to an empty fold makes garbage ≥ live fold, so this apply compacts.
        let err = store
            .apply(&[put("a", b"1", 1), del("a", 2)], WatchCursor::at(2))
            .expect_err("injected compaction fault");
        assert!(
            matches!(err, SnapshotError::Io { op: "compact", .. }),
            "{err}"
        );
        drop(store);
        let (store, recovery) = open(dir.path());
        assert_eq!(recovery, Recovery::default());
        assert_eq!(store.cursor(), WatchCursor::at(2));
        assert!(store.is_empty().expect("is_empty"));
    }

    #[test]
    fn stale_compaction_temp_file_is_removed_on_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        drop(open(dir.path()));
        fs::write(dir.path().join(TMP_NAME), b"half a compaction").expect("write");
        drop(open(dir.path()));
        assert!(!dir.path().join(TMP_NAME).exists());
    }

    #[test]
    fn backend_is_named_append_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(open(dir.path()).0.backend(), "append-log");
    }

    fn check_bytes(bytes: &[u8], chunk: usize) -> Result<(WatchCursor, u64), SnapshotError> {
        let mut c = CompactLogCheck::new(Path::new("fold.log"));
        for part in bytes.chunks(chunk.max(1)) {
            c.feed(part);
        }
        c.finish()
    }

    #[test]
    fn the_streaming_check_of_an_exported_log_agrees_with_a_reopen_and_refuses_anything_else() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        store
            .apply(
                &[
                    put("b", b"2", 1),
                    put("a", &[7u8; 300], 2),
                    put("c", b"3", 3),
                ],
                WatchCursor::at(3),
            )
            .expect("apply");
        store
            .apply(&[del("c", 4), put("b", b"22", 5)], WatchCursor::at(5))
            .expect("apply");
        let out = tempfile::tempdir().expect("tempdir");
        store.export_to(out.path()).expect("export");
        let bytes = fs::read(out.path().join(LOG_NAME)).expect("read");
        let (reopened, _) = open_ro(out.path());
        let want = (reopened.cursor(), reopened.len().expect("len"));
        assert_eq!(want, (WatchCursor::at(5), 2));
        // Whatever the chunking, the same answer as the reopen.
        for chunk in [1, 7, 64, 4096] {
            assert_eq!(check_bytes(&bytes, chunk).expect("a compacted log"), want);
        }
        // A flipped byte anywhere after the header, a cut tail, or bytes after the cursor: refused.
        for at in HEADER_LEN..bytes.len() {
            let mut b = bytes.clone();
            b[at] ^= 0x40;
            assert!(check_bytes(&b, 13).is_err(), "flipped byte at {at} passed");
        }
        for cut in 0..bytes.len() {
            assert!(
                check_bytes(&bytes[..cut], 5).is_err(),
                "cut at {cut} passed"
            );
        }
        let mut extra = bytes.clone();
        format::encode_cursor(&mut extra, WatchCursor::at(6));
        assert!(check_bytes(&extra, 9).is_err(), "a second cursor passed");
        // The live store's own log (superseded puts, a delete, two cursors) is not a compacted one.
        let live = fs::read(dir.path().join(LOG_NAME)).expect("read");
        assert!(
            check_bytes(&live, 4096).is_err(),
            "an uncompacted log passed"
        );
    }

    #[test]
    fn an_export_proves_the_bytes_it_wrote_digest_size_cursor_and_keys_whatever_their_chunking() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        // Values past the check's first 4 KiB step and past a whole export chunk, so records are
        // cut by chunk ends and completed from the next chunk in several steps.
        let big = vec![0x5au8; 70_000];
        let huge = vec![0xa5u8; COMPACT_CHUNK + 12_345];
        let mut batch = vec![put("m", &big, 1), put("z", &huge, 2)];
        for i in 0..2_000u64 {
            batch.push(put(&format!("k{i:05}"), format!("v{i}").as_bytes(), 3 + i));
        }
        store.apply(&batch, WatchCursor::at(2_002)).expect("apply");
        // Reopened, the entries are the base's records (copied as they lie); what follows is the
        // overlay's (encoded): the export merges both.
        drop(store);
        let (mut store, _) = open(dir.path());
        store
            .apply(
                &[del("k00007", 2_003), put("k00009", b"new", 2_003)],
                WatchCursor::at(2_003),
            )
            .expect("apply");
        let out = tempfile::tempdir().expect("tempdir");
        let proven = store
            .export_to(out.path())
            .expect("export")
            .expect("the append log proves its copy");
        let bytes = fs::read(out.path().join(LOG_NAME)).expect("read");
        let (reopened, _) = open_ro(out.path());
        assert_eq!(
            (proven.cursor, proven.keys),
            (reopened.cursor(), reopened.len().expect("len"))
        );
        assert_eq!(
            (proven.cursor, proven.keys),
            (WatchCursor::at(2_003), 2_001)
        );
        assert_eq!(
            proven.files,
            vec![HashedFile {
                path: LOG_NAME.to_owned(),
                size: bytes.len() as u64,
                blake3: blake3::hash(&bytes).to_hex().to_string(),
            }]
        );
        let want = (proven.cursor, proven.keys);
        for chunk in [1, 4095, 4097, 65_536, COMPACT_CHUNK, bytes.len()] {
            assert_eq!(check_bytes(&bytes, chunk).expect("a compacted log"), want);
        }
        // Irregular chunks: a record completed across several feeds of different sizes.
        let mut c = CompactLogCheck::new(Path::new("fold.log"));
        let (mut at, mut i) = (0, 0);
        while at < bytes.len() {
            let n = [1usize, 5_000, 3, 70_001, 9][i % 5].min(bytes.len() - at);
            c.feed(&bytes[at..at + n]);
            at += n;
            i += 1;
        }
        assert_eq!(c.finish().expect("a compacted log"), want);
        // A flipped byte inside the huge value, checked in 64 KiB chunks: refused.
        let mut b = bytes.clone();
        let in_huge = bytes.len() - 100 - huge.len() / 2;
        b[in_huge] ^= 1;
        assert!(check_bytes(&b, 65_536).is_err(), "a flipped byte passed");
    }
}
