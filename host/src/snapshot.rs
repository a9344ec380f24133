//! The durable fold: the [`SnapshotStore`] contract every backend keeps, and the default backend,
//! [`AppendLogSnapshot`] (an append-only CRC-framed log replayed into an in-RAM ordered map).
//!
//! Invariants (seed 000, "The durable fold"):
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
//!
//! Backends: [`AppendLogSnapshot`] (always built), `FjallSnapshot` (cargo feature `fjall`) and
//! `RocksDbSnapshot` (feature `rocksdb`). The two LSM backends share the value-record codec
//! ([`value_codec`]) and keep the same contract; `conformance` (tests) checks every backend against
//! it with one suite.

mod append_log;
#[cfg(test)]
mod conformance;
#[cfg(feature = "fjall")]
mod fjall;
mod format;
#[cfg(any(feature = "fjall", feature = "rocksdb"))]
mod lsm;
#[cfg(feature = "rocksdb")]
mod rocks;
pub mod value_codec;

use std::ops::ControlFlow;
use std::path::PathBuf;

pub use append_log::{AppendLogOptions, AppendLogSnapshot};
#[cfg(feature = "fjall")]
pub use fjall::{FjallOptions, FjallSnapshot};
pub use format::{MAX_KEY_LEN, MAX_VALUE_LEN};
#[cfg(feature = "rocksdb")]
pub use rocks::{RocksDbOptions, RocksDbSnapshot};

use crate::kv::{KvEntry, KvUpdate, WatchCursor};
use crate::retained::{Base, RetainedIndex, is_reserved};

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
    /// contents.
    fn export_to(&self, dest: &std::path::Path) -> Result<(), SnapshotError>;

    /// True when the fold holds no key.
    fn is_empty(&self) -> Result<bool, SnapshotError> {
        Ok(self.len()? == 0)
    }
}

/// How many of the store's keys are the host's own (retained records, the stream identity): they
/// sort before every bucket key, so this visits only them.
pub fn reserved_len<S: SnapshotStore + ?Sized>(store: &S) -> Result<u64, SnapshotError> {
    let mut n = 0u64;
    store.for_each_in_range(crate::retained::RESERVED_PREFIX, &mut |_| {
        n += 1;
        ControlFlow::Continue(())
    })?;
    Ok(n)
}

/// How many bucket keys the fold holds (its live keys less the host's own).
pub fn bucket_len<S: SnapshotStore + ?Sized>(store: &S) -> Result<u64, SnapshotError> {
    Ok(store.len()?.saturating_sub(reserved_len(store)?))
}

/// Read access to a committed fold, for appliers (a guest's `get`/`scan` imports, hydration).
pub trait FoldRead: Send + Sync {
    /// The live entry for `key`.
    fn get(&self, key: &str) -> Result<Option<KvEntry>, SnapshotError>;
    /// Entries under `prefix`, in key order, strictly after `start_after`, at most `limit`.
    fn scan(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<KvEntry>, SnapshotError>;
    /// Visits every entry under `prefix` in key order (for hydration: never materialises the fold).
    fn visit(
        &self,
        prefix: &str,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError>;
}

/// A store shared between the fold (the only writer) and readers of its committed state, with the
/// fold's retained records ([`RetainedIndex`]) beside it.
///
/// The fold takes the write lock only inside `apply`; appliers read between applies, so the lock
/// is never contended on the hot path. A panic while holding it (a bug) reads as a poisoned store.
///
/// As a [`FoldRead`] it is the *guest's view*: reserved keys never show, and a key with retained
/// records shows the entry the guest last applied (its base), not the fold's latest raw value.
pub struct SharedStore<S> {
    store: std::sync::Arc<std::sync::RwLock<S>>,
    /// Loaded from the store on first use.
    retained: std::sync::Arc<std::sync::Mutex<Option<RetainedIndex>>>,
}

impl<S> Clone for SharedStore<S> {
    fn clone(&self) -> Self {
        SharedStore {
            store: self.store.clone(),
            retained: self.retained.clone(),
        }
    }
}

fn poisoned() -> SnapshotError {
    SnapshotError::Poisoned {
        path: PathBuf::new(),
        cause: "a thread panicked while holding the store".into(),
    }
}

impl<S: SnapshotStore> SharedStore<S> {
    /// Shares `store`.
    pub fn new(store: S) -> Self {
        SharedStore {
            store: std::sync::Arc::new(std::sync::RwLock::new(store)),
            retained: std::sync::Arc::new(std::sync::Mutex::new(None)),
        }
    }

    /// Reads the store.
    pub fn read(&self) -> Result<std::sync::RwLockReadGuard<'_, S>, SnapshotError> {
        self.store.read().map_err(|_| poisoned())
    }

    /// Writes the store (the fold only).
    pub fn write(&self) -> Result<std::sync::RwLockWriteGuard<'_, S>, SnapshotError> {
        self.store.write().map_err(|_| poisoned())
    }

    /// Runs `f` on the retained records, loading them from the store the first time.
    pub fn with_retained<R>(
        &self,
        f: impl FnOnce(&mut RetainedIndex) -> R,
    ) -> Result<R, SnapshotError> {
        let mut guard = self.retained.lock().map_err(|_| poisoned())?;
        if guard.is_none() {
            *guard = Some(RetainedIndex::load(&*self.read()?)?);
        }
        match guard.as_mut() {
            Some(index) => Ok(f(index)),
            None => Err(poisoned()),
        }
    }

    /// The store back, when this is the last handle.
    pub fn into_inner(self) -> Result<S, Self> {
        let retained = self.retained;
        match std::sync::Arc::try_unwrap(self.store) {
            Ok(lock) => lock.into_inner().map_err(|p| SharedStore {
                store: std::sync::Arc::new(std::sync::RwLock::new(p.into_inner())),
                retained,
            }),
            Err(store) => Err(SharedStore { store, retained }),
        }
    }
}

/// A fold with nothing in it: what a guest sees while it is proven to start (instantiate,
/// `manifest`, `init`) before any store is opened.
#[derive(Debug, Default, Clone, Copy)]
pub struct EmptyFold;

impl FoldRead for EmptyFold {
    fn get(&self, _key: &str) -> Result<Option<KvEntry>, SnapshotError> {
        Ok(None)
    }

    fn scan(
        &self,
        _prefix: &str,
        _start_after: Option<&str>,
        _limit: usize,
    ) -> Result<Vec<KvEntry>, SnapshotError> {
        Ok(Vec::new())
    }

    fn visit(
        &self,
        _prefix: &str,
        _visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        Ok(())
    }
}

impl<S: SnapshotStore> FoldRead for SharedStore<S> {
    fn get(&self, key: &str) -> Result<Option<KvEntry>, SnapshotError> {
        if is_reserved(key) {
            return Ok(None);
        }
        if let Some(base) = self.with_retained(|r| r.base(key).cloned())? {
            return Ok(base);
        }
        self.read()?.get(key)
    }

    fn scan(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<KvEntry>, SnapshotError> {
        let mut out = Vec::new();
        if limit == 0 {
            return Ok(out);
        }
        // Blocked keys in range show their base instead of the fold's entry (usually there are
        // none). Collected first: the index lock is not taken per entry.
        let in_range: Vec<(String, Base)> = self.with_retained(|r| {
            r.bases_in(prefix)
                .filter(|(k, _)| start_after.is_none_or(|a| k.as_str() > a))
                .map(|(k, b)| (k.clone(), b.clone()))
                .collect()
        })?;
        let blocked = |k: &str| {
            in_range
                .binary_search_by(|(b, _)| b.as_str().cmp(k))
                .is_ok()
        };
        self.read()?
            .for_each_in_range_after(prefix, start_after, &mut |e| {
                if is_reserved(&e.key) || (!in_range.is_empty() && blocked(&e.key)) {
                    return ControlFlow::Continue(());
                }
                out.push(e.clone());
                if out.len() >= limit {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })?;
        if !in_range.is_empty() {
            // A full page covers keys up to its last one; a short one, everything after start_after.
            let bound = if out.len() >= limit {
                out.last().map(|e| e.key.clone())
            } else {
                None
            };
            out.extend(
                in_range
                    .into_iter()
                    .filter_map(|(_, b)| b)
                    .filter(|b| bound.as_ref().is_none_or(|k| b.key <= *k)),
            );
            out.sort_by(|a, b| a.key.cmp(&b.key));
            out.truncate(limit);
        }
        Ok(out)
    }

    fn visit(
        &self,
        prefix: &str,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        // Pages through `scan`, so the guest's view is the same whichever way it is read.
        const PAGE: usize = 4096;
        let mut after: Option<String> = None;
        loop {
            let page = self.scan(prefix, after.as_deref(), PAGE)?;
            for e in &page {
                if visit(e).is_break() {
                    return Ok(());
                }
            }
            match page.last() {
                Some(last) if page.len() == PAGE => after = Some(last.key.clone()),
                _ => return Ok(()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvUpdate, VersionToken};

    fn keys(v: Vec<KvEntry>) -> Vec<String> {
        v.into_iter().map(|e| e.key).collect()
    }

    #[test]
    fn scan_pages_through_a_prefix_with_start_after() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) =
            AppendLogSnapshot::open(dir.path(), AppendLogOptions::default()).expect("open");
        let batch: Vec<KvUpdate> = ["a.1", "a.2", "a.3", "a.4", "a.5", "b.1", "ab"]
            .iter()
            .map(|k| {
                KvUpdate::Put(KvEntry {
                    key: (*k).to_string(),
                    value: bytes::Bytes::from_static(b"v"),
                    version: VersionToken::from_u64(1),
                })
            })
            .collect();
        store.apply(&batch, WatchCursor::at(1)).expect("apply");
        let shared = SharedStore::new(store);
        assert_eq!(
            keys(shared.scan("a.", None, 2).expect("scan")),
            ["a.1", "a.2"]
        );
        assert_eq!(
            keys(shared.scan("a.", Some("a.2"), 2).expect("scan")),
            ["a.3", "a.4"]
        );
        assert_eq!(
            keys(shared.scan("a.", Some("a.4"), 9).expect("scan")),
            ["a.5"]
        );
        assert!(shared.scan("a.", Some("a.5"), 9).expect("scan").is_empty());
        // `start_after` before the prefix starts at the prefix; after the range, nothing.
        assert_eq!(
            keys(shared.scan("b.", Some("a.3"), 9).expect("scan")),
            ["b.1"]
        );
        assert!(shared.scan("a.", Some("zz"), 9).expect("scan").is_empty());
        assert!(shared.scan("a.", None, 0).expect("scan").is_empty());
    }
}
