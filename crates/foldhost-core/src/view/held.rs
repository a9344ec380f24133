//! The bytes a fold holds, kept by its commits: what a state bucket's size cap admits a guest's
//! write against (docs/state.md, "Limits") without reading the fold at each write.
//!
//! Invariants:
//! - **Counted once, then kept**: the tally is unknown until first asked; the first ask counts the
//!   bucket's keys under the store's read lock, and from then on every commit through
//!   [`StoreWrite::apply`] moves it by exactly what the commit changed (each key it touches read
//!   before and after, under the write lock), so the tally always equals a fresh count.
//! - **No cost to a fold nobody asks**: while the tally is unknown a commit reads nothing extra
//!   (the main fold never asks; only state buckets' folds do).
//! - **A failed commit forgets the tally**: the store may hold part of the batch, so the next ask
//!   counts again rather than trust a figure that may be wrong.
//! - Reserved keys (the ledger's rows, retained records, the fold's own records) are never counted,
//!   and every other key is, wherever it sorts (the count walks around the reserved space).

use std::collections::BTreeSet;
use std::ops::{ControlFlow, Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::kv::{KvEntry, KvUpdate, WatchCursor};
use crate::snapshot::{SnapshotError, SnapshotStore, is_reserved};

/// The tally's value while it is unknown.
const UNKNOWN: u64 = u64::MAX;

/// The bytes (keys and values) of a fold's bucket keys, or unknown; and how many times the fold
/// was counted whole.
#[derive(Debug)]
pub(crate) struct HeldTally(AtomicU64, AtomicU64);

impl Default for HeldTally {
    fn default() -> Self {
        HeldTally(AtomicU64::new(UNKNOWN), AtomicU64::new(0))
    }
}

fn size(e: &KvEntry) -> u64 {
    (e.key.len() + e.value.len()) as u64
}

impl HeldTally {
    /// The tally, counted from `store` first if unknown. The caller holds the store's read lock,
    /// so no commit moves the store while it is counted.
    pub(crate) fn get_or_count<S: SnapshotStore + ?Sized>(
        &self,
        store: &S,
    ) -> Result<u64, SnapshotError> {
        let known = self.0.load(Ordering::Acquire);
        if known != UNKNOWN {
            return Ok(known);
        }
        self.1.fetch_add(1, Ordering::Relaxed);
        let mut total = 0u64;
        // The keys before the host's record space (only a store written before those were
        // refused at the fold's edge holds any), then the keys past it: never its rows.
        store.for_each_in_range_after("", None, &mut |e| {
            if e.key.as_str() >= crate::snapshot::RESERVED_PREFIX {
                return ControlFlow::Break(());
            }
            total = total.saturating_add(size(e));
            ControlFlow::Continue(())
        })?;
        let past = crate::snapshot::scan_start("", None);
        store.for_each_in_range_after("", past, &mut |e| {
            if !is_reserved(&e.key) {
                total = total.saturating_add(size(e));
            }
            ControlFlow::Continue(())
        })?;
        // A commit cannot run while the caller holds the read lock; two counters agree.
        self.0.store(total.min(UNKNOWN - 1), Ordering::Release);
        Ok(total)
    }

    /// How many times the fold was counted whole.
    #[cfg(test)]
    pub(crate) fn counts(&self) -> u64 {
        self.1.load(Ordering::Relaxed)
    }

    fn forget(&self) {
        self.0.store(UNKNOWN, Ordering::Release);
    }
}

/// The store under its write lock: the fold's only way to change it. Its own
/// [`StoreWrite::apply`] keeps the [`HeldTally`], and a call `guard.apply(..)` resolves to it
/// before the store's (an inherent method comes first); the store itself is reached through
/// `Deref`/`DerefMut` (a test store's fault plan), never to commit.
pub struct StoreWrite<'a, S> {
    pub(crate) guard: std::sync::RwLockWriteGuard<'a, S>,
    pub(crate) held: &'a HeldTally,
}

impl<S: SnapshotStore> StoreWrite<'_, S> {
    /// Commits `batch` at `cursor` ([`SnapshotStore::apply`]), moving the held bytes by what it
    /// changed when they are known.
    pub fn apply(&mut self, batch: &[KvUpdate], cursor: WatchCursor) -> Result<(), SnapshotError> {
        let known = self.held.0.load(Ordering::Acquire);
        if known == UNKNOWN {
            return self.guard.apply(batch, cursor);
        }
        let keys: BTreeSet<&str> = batch
            .iter()
            .map(KvUpdate::key)
            .filter(|k| !is_reserved(k))
            .collect();
        let sum = |s: &S| -> Result<u64, SnapshotError> {
            keys.iter().try_fold(0u64, |acc, k| {
                Ok(acc.saturating_add(s.get(k)?.as_ref().map_or(0, size)))
            })
        };
        // A read that fails forgets the tally (the next ask counts again); the commit goes on.
        let Ok(before) = sum(&self.guard) else {
            self.held.forget();
            return self.guard.apply(batch, cursor);
        };
        if let Err(e) = self.guard.apply(batch, cursor) {
            self.held.forget();
            return Err(e);
        }
        match sum(&self.guard) {
            Ok(after) => {
                let next = known.saturating_sub(before).saturating_add(after);
                self.held.0.store(next.min(UNKNOWN - 1), Ordering::Release);
            }
            Err(_) => self.held.forget(),
        }
        Ok(())
    }
}

impl<S> Deref for StoreWrite<'_, S> {
    type Target = S;
    fn deref(&self) -> &S {
        &self.guard
    }
}

impl<S> DerefMut for StoreWrite<'_, S> {
    fn deref_mut(&mut self) -> &mut S {
        &mut self.guard
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::VersionToken;
    use crate::snapshot::{AppendLogOptions, AppendLogSnapshot};
    use crate::view::SharedStore;

    fn fresh_count(store: &SharedStore<AppendLogSnapshot>) -> u64 {
        let mut total = 0;
        store
            .read()
            .expect("read")
            .for_each_in_range("", &mut |e| {
                if !is_reserved(&e.key) {
                    total += size(e);
                }
                ControlFlow::Continue(())
            })
            .expect("scan");
        total
    }

    /// Puts (new keys and overwrites, one key several times in a batch), deletes, purges and
    /// reserved keys, in seeded batches: after every commit the kept tally equals a fresh count
    /// of the fold, a commit made before anyone asked is counted at the first ask, and the fold
    /// is read whole only then — never again at a later ask (a guest write's admission).
    #[test]
    fn the_held_bytes_kept_by_each_commit_equal_a_fresh_count_and_the_fold_is_read_whole_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, _) =
            AppendLogSnapshot::open(dir.path(), AppendLogOptions::default()).expect("open");
        let shared = SharedStore::new(store);
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut rev = 0u64;
        for round in 0..200 {
            let mut batch = Vec::new();
            for _ in 0..=next(6) {
                rev += 1;
                let key = if next(10) == 0 {
                    format!("\u{1}op/{}", next(8))
                } else if next(20) == 0 {
                    format!("\u{0}nul{}", next(3))
                } else {
                    format!("k{}", next(12))
                };
                let version = VersionToken::from_u64(rev);
                batch.push(match next(4) {
                    0 => KvUpdate::Delete { key, version },
                    1 => KvUpdate::Purge { key, version },
                    _ => KvUpdate::Put(KvEntry {
                        key,
                        value: bytes::Bytes::from(vec![b'v'; next(40) as usize]),
                        version,
                    }),
                });
            }
            shared
                .write()
                .expect("write")
                .apply(&batch, WatchCursor::at(rev))
                .expect("apply");
            // The first rounds commit before anyone asks: the first ask counts them.
            if round >= 5 {
                assert_eq!(
                    shared.held_bytes().expect("held"),
                    fresh_count(&shared),
                    "round {round}"
                );
            }
        }
        assert!(fresh_count(&shared) > 0, "the workload leaves keys behind");
        assert_eq!(shared.held.counts(), 1, "the fold was counted whole once");
    }
}
