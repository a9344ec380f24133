//! The durable fold: the [`SnapshotStore`] contract every backend keeps, and the default backend,
//! [`AppendLogSnapshot`] (an append-only CRC-framed log replayed into an in-RAM ordered map).
//!
//! Invariants (docs/design.md, "Durability contract"):
//! - **Cursor-after-apply.** [`SnapshotStore::apply`] makes a batch's data and its cursor durable
//!   together: a reader never recovers a cursor whose data is absent. On the append log the batch and
//!   its cursor record go out in one `write(2)`; recovery drops any records after the last cursor
//!   record (an apply that did not finish), so a recovered fold is always "every record up to some
//!   cursor".
//! - **Never silently empty.** A bad header, a CRC mismatch followed by more data, or NULs followed by
//!   data are errors naming the file and offset. Only a torn *tail* (a record cut short at end of
//!   file, a zero-filled tail, or records after the last cursor) is discarded, and the discard is
//!   reported in [`Recovery`] so the caller can log it.
//! - **Limits.** A value is at most [`MAX_VALUE_LEN`] (64 MiB, NATS's payload ceiling) on write and
//!   on read; keys are at most [`MAX_KEY_LEN`] bytes; versions at most 10 bytes.
//! - **Poisoned after a failed durable write.** If a write or compaction fails in a way that leaves
//!   the file's state unknown, the writer is poisoned: every later write returns
//!   [`SnapshotError::Poisoned`] until the store is reopened (the old file is intact until the atomic
//!   rename, so a reopen recovers a consistent fold).
//! - **Read-only opens never write.** [`AppendLogSnapshot::open_read_only`] replays without
//!   truncating, compacting or locking, so `status` and `dump` work beside a running host.
//! - **An export says what it proved.** [`SnapshotStore::export_to`] returns a [`ProvenCopy`] only
//!   for bytes the store hashed and checked as it wrote them (the append log); `None` leaves the
//!   hashing and the verifying reopen to the caller.
//!
//! Backends: [`AppendLogSnapshot`] (always built), `FjallSnapshot` (cargo feature `fjall`) and
//! `RocksDbSnapshot` (feature `rocksdb`). The two LSM backends share the value-record codec
//! (`value_codec`) and keep the same contract; `conformance` (tests) checks every backend against
//! it with one suite.

mod append_log;
#[cfg(test)]
mod conformance;
#[cfg(feature = "fjall")]
mod fjall;
mod format;
/// The append log's in-RAM fold: a sorted base over the file buffer and an overlay of changes.
mod live_map;
#[cfg(any(feature = "fjall", feature = "rocksdb"))]
mod lsm;
#[cfg(feature = "rocksdb")]
mod rocks;
#[cfg(any(feature = "fjall", feature = "rocksdb"))]
mod value_codec;

use std::ops::ControlFlow;
use std::path::PathBuf;

pub use append_log::{AppendLogOptions, AppendLogSnapshot, CompactLogCheck, LOG_FILE};
#[cfg(feature = "fjall")]
pub use fjall::{FjallOptions, FjallSnapshot};
pub use format::{MAX_KEY_LEN, MAX_VALUE_LEN};
#[cfg(feature = "rocksdb")]
pub use rocks::{RocksDbOptions, RocksDbSnapshot};

use crate::kv::{KvEntry, KvUpdate, WatchCursor};

/// Errors of the durable fold.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// An I/O call failed.
    #[error("{path}: {op}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a fold of a format this build reads (bad magic, unknown version).
    #[error("{path}: invalid format: {reason}")]
    InvalidFormat {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A record in the middle of the file fails its check: the fold cannot be trusted.
    #[error("{path}: corrupted at byte offset {offset}: {reason}")]
    Corrupted {
        /// The file.
        path: PathBuf,
        /// Byte offset of the bad record.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// The caller passed something the format cannot hold (an oversized value or key).
    #[error("refused before writing: {0}")]
    TooLarge(String),
    /// An earlier durable write failed; the store must be reopened.
    #[error("{path}: store poisoned by an earlier failed write ({cause}); reopen it")]
    Poisoned {
        /// The file.
        path: PathBuf,
        /// The first failure.
        cause: String,
    },
    /// Another process holds the store's writer lock.
    #[error("{path}: locked by another process (is a host already running on this store?)")]
    Locked {
        /// The lock file.
        path: PathBuf,
    },
    /// A backend-specific failure (LSM engines).
    #[error("{0}")]
    Backend(String),
}

/// What opening a store had to discard or repair, for the caller to log. Never silent.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// Bytes at the end of the file that were discarded (a torn tail or an unfinished apply).
    pub discarded_tail_bytes: u64,
    /// Records discarded with them (whole records after the last cursor).
    pub discarded_records: u64,
    /// Why, in words, when anything was discarded.
    pub reason: Option<String>,
}

/// The durable-fold contract. Every backend keeps the same invariants (see the module docs), and
/// the conformance suite checks them for each.
pub trait SnapshotStore: Send + Sync + 'static {
    /// Short backend name as the CLI spells it (`append-log`, `fjall`, `rocksdb`).
    fn backend(&self) -> &'static str;

    /// The cursor the store holds: every update with revision ≤ it is in the store.
    fn cursor(&self) -> WatchCursor;

    /// Folds `batch` (in order; deletes and purges remove the key) and advances the cursor to
    /// `cursor`, atomically: after a crash either both are durable or neither is visible.
    /// An error leaves the store exactly as before the call, or poisoned.
    fn apply(&mut self, batch: &[KvUpdate], cursor: WatchCursor) -> Result<(), SnapshotError>;

    /// The live entry for `key`.
    fn get(&self, key: &str) -> Result<Option<KvEntry>, SnapshotError>;

    /// Visits every entry whose key starts with `prefix`, in key order, without materialising the
    /// fold; the visitor may stop early with `ControlFlow::Break`.
    fn for_each_in_range(
        &self,
        prefix: &str,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError>;

    /// Like [`Self::for_each_in_range`], starting strictly after `after` (for paging). Backends
    /// with ordered iteration override it to seek instead of skipping.
    fn for_each_in_range_after(
        &self,
        prefix: &str,
        after: Option<&str>,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        self.for_each_in_range(prefix, &mut |e| match after {
            Some(a) if e.key.as_str() <= a => ControlFlow::Continue(()),
            _ => visit(e),
        })
    }

    /// Every entry under `prefix`, in key order (materialised: for small ranges).
    fn range(&self, prefix: &str) -> Result<Vec<KvEntry>, SnapshotError> {
        let mut out = Vec::new();
        self.for_each_in_range(prefix, &mut |e| {
            out.push(e.clone());
            ControlFlow::Continue(())
        })?;
        Ok(out)
    }

    /// Number of live keys.
    fn len(&self) -> Result<u64, SnapshotError>;

    /// Writes a consistent copy of the committed fold (data and cursor) into `dest`, an existing
    /// empty directory: the backend's own files, exactly as [`crate::storedir::AnyStore`] would
    /// open them (without `FOLDHOST.json`, which the artifact layer writes). Reopening `dest`
    /// must recover [`Self::cursor`] as it was when the call began. Never modifies the live store's
    /// contents. Need not be durable: the caller fsyncs what it keeps
    /// (`foldhost::artifact::seal` fsyncs every staged file before the manifest).
    ///
    /// Returns [`ProvenCopy`] when the store hashed and checked its copy as it wrote it (the
    /// append log), so the seal need not read it back; `None` when the caller must hash the files
    /// and verify the copy by reopening it (the LSM backends, whose copies are hard links).
    fn export_to(&self, dest: &std::path::Path) -> Result<Option<ProvenCopy>, SnapshotError>;

    /// True when the fold holds no key.
    fn is_empty(&self) -> Result<bool, SnapshotError> {
        Ok(self.len()? == 0)
    }
}

/// One file of an exported copy, hashed as it was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HashedFile {
    /// Its path under the copy's directory, `/`-separated.
    pub path: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its BLAKE3 digest, lowercase hex.
    pub blake3: String,
}

/// What a store proved about its exported copy while writing it: the digest of every file it
/// wrote, and what a streaming check of those exact bytes recovered (the checks a reopen would
/// make: every record's checksum, key order, the final cursor). An artifact seals such a copy
/// without reading it back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProvenCopy {
    /// Every file the store wrote into the copy.
    pub files: Vec<HashedFile>,
    /// The cursor the written bytes recover.
    pub cursor: WatchCursor,
    /// The keys the written bytes hold.
    pub keys: u64,
}

/// Keys starting with this byte are the host's own (retained records, the stream identity). A raw
/// publish can put such a key in a bucket; the fold skips those at its edge
/// (`protocol::bucket_key_admitted`), so none reaches the store.
pub const RESERVED_PREFIX: &str = "\u{1}";

/// True for the host's own keys (never shown to guests, `dump` or listings).
pub fn is_reserved(key: &str) -> bool {
    key.starts_with(RESERVED_PREFIX)
}

/// A key past every key the host writes in its reserved space (each is [`RESERVED_PREFIX`] and
/// ASCII), and before every bucket key (a bucket key NATS takes starts with an ASCII letter,
/// digit or one of `-/_=.`).
const PAST_RESERVED: &str = "\u{1}\u{10ffff}";

/// Where a scan of the bucket's keys under `prefix` starts: after `start_after`, and never among
/// the host's reserved keys, which sort before every bucket key (the operation ledger's rows
/// among them): a scan of the whole fold starts past them instead of walking them.
pub fn scan_start<'a>(prefix: &str, start_after: Option<&'a str>) -> Option<&'a str> {
    if prefix.is_empty() && start_after.is_none_or(|a| a < PAST_RESERVED) {
        Some(PAST_RESERVED)
    } else {
        start_after
    }
}

/// How many of the store's keys are the host's own (retained records, the stream identity): they
/// sort before every bucket key, so this visits only them.
pub(crate) fn reserved_len<S: SnapshotStore + ?Sized>(store: &S) -> Result<u64, SnapshotError> {
    let mut n = 0u64;
    store.for_each_in_range(RESERVED_PREFIX, &mut |_| {
        n += 1;
        ControlFlow::Continue(())
    })?;
    Ok(n)
}

/// How many bucket keys the fold holds (its live keys less the host's own).
pub fn bucket_len<S: SnapshotStore + ?Sized>(store: &S) -> Result<u64, SnapshotError> {
    Ok(store.len()?.saturating_sub(reserved_len(store)?))
}
