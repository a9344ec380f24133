//! The fold as its readers see it: [`SharedStore`] (the store shared between the fold, its only
//! writer, and the readers of its committed state, with the fold's retained records beside it) and
//! [`FoldRead`], the read access an applier gets (a guest's `get`/`scan` imports, hydration).
//!
//! Invariants: a reader never sees a reserved key; a key with retained records reads as its base
//! (what the guest last applied), not the fold's latest raw value; reads happen between applies, so
//! the lock is never contended on the hot path.

use std::ops::ControlFlow;
use std::path::PathBuf;

use crate::kv::KvEntry;
use crate::retained::{Base, RetainedIndex};
use crate::snapshot::{SnapshotError, SnapshotStore, is_reserved};

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
    use crate::kv::{KvUpdate, VersionToken, WatchCursor};
    use crate::snapshot::{AppendLogOptions, AppendLogSnapshot};

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
