//! The simulation's world: its seeded random source, the scenario a seed picks, and the truth every
//! fold is held to (every write minus every real delete), kept beside the simulated bucket.

use std::collections::BTreeMap;
use std::path::Path;

use bytes::Bytes;
use foldhost_core::kv::{KvEntry, KvUpdate, VersionToken, WatchCursor, WatchScope};
use foldhost_core::snapshot::SnapshotStore;
use foldhost_core::storedir::{AnyStore, Backend};

/// splitmix64: tiny, seedable, and the same on every machine (no dependency that may change its
/// stream between versions, so a printed seed replays the same run forever).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    pub fn pick<T: Clone>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize].clone()
    }
}

/// The keys every scenario writes: three prefixes, so prefix and multi-prefix scopes leave keys out.
pub const KEYS: [&str; 10] = [
    "a.0", "a.1", "a.2", "a.3", "b.0", "b.1", "b.2", "b.3", "c.0", "c.1",
];

/// Which applier folds: a native map, or the real `kvstore` component under the guest host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestKind {
    Native,
    Wasm,
}

/// What one seed runs.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub seed: u64,
    pub backend: Backend,
    pub scope: WatchScope,
    /// The fold's batch size (`max`).
    pub batch_max: usize,
    /// The bucket's retention evicts current values (age or `discard: old`); otherwise it keeps
    /// one value per key and removes only superseded messages.
    pub evicting: bool,
    pub guest: GuestKind,
    /// Process lifetimes (each ends in a crash, a kill or a clean stop).
    pub lives: u32,
    /// Rounds of writes per lifetime.
    pub rounds: u32,
    /// The pinned case instead of random rounds: one batch's commit fails, and a query traps
    /// before its retry (`Sim::trap_a_query_before_a_retry`).
    pub pinned_query_trap: bool,
}

/// Every backend compiled into this build.
pub fn backends() -> Vec<Backend> {
    let mut b = vec![Backend::AppendLog];
    if Backend::Fjall.is_compiled() {
        b.push(Backend::Fjall);
    }
    if Backend::RocksDb.is_compiled() {
        b.push(Backend::RocksDb);
    }
    b
}

impl Scenario {
    /// [`Self::from_seed`] on a chosen backend.
    pub fn on_backend(seed: u64, backend: Backend) -> Self {
        Scenario {
            backend,
            ..Self::from_seed(seed)
        }
    }

    /// The scenario seed `seed` picks: every dimension drawn from the seed alone.
    pub fn from_seed(seed: u64) -> Self {
        let mut r = Rng::new(seed ^ 0x5CE0_A810);
        let scope = match r.below(3) {
            0 => WatchScope::All,
            1 => WatchScope::Prefix("a.".into()),
            _ => WatchScope::Prefixes(vec!["a.".into(), "c.".into()]),
        };
        Scenario {
            seed,
            backend: r.pick(&backends()),
            scope,
            batch_max: r.pick(&[1, 3, 16, 256]),
            evicting: r.chance(50),
            guest: if r.chance(40) {
                GuestKind::Wasm
            } else {
                GuestKind::Native
            },
            lives: 2 + r.below(3) as u32,
            rounds: 2 + r.below(3) as u32,
            pinned_query_trap: false,
        }
    }

    /// The pinned case on `backend` with `guest`: one life, a whole-bucket scope, a bucket that
    /// keeps current values.
    pub fn query_trap_before_a_retry(seed: u64, backend: Backend, guest: GuestKind) -> Self {
        Scenario {
            seed,
            backend,
            scope: WatchScope::All,
            batch_max: 16,
            evicting: false,
            guest,
            lives: 1,
            rounds: 1,
            pinned_query_trap: true,
        }
    }
}

/// One write as the bucket took it.
#[derive(Clone, Debug)]
pub enum Op {
    Put(Bytes),
    Delete,
    Purge,
}

/// Every write ever made to the bucket, by sequence: the reference the fold is held to. Eviction
/// removes messages from the bucket, never from here.
#[derive(Default)]
pub struct Truth {
    pub log: Vec<(u64, String, Op)>,
}

impl Truth {
    pub fn record(&mut self, seq: u64, key: &str, op: Op) {
        assert!(
            self.log.last().is_none_or(|(s, _, _)| *s < seq),
            "sequences increase"
        );
        self.log.push((seq, key.to_string(), op));
    }

    /// Every key's value and revision at `cursor` (every write ≤ it minus every real delete ≤ it),
    /// restricted to `scope`.
    pub fn at(&self, cursor: u64, scope: &WatchScope) -> BTreeMap<String, (Bytes, u64)> {
        let mut out = BTreeMap::new();
        for (seq, key, op) in self.log.iter().take_while(|(s, _, _)| *s <= cursor) {
            if !scope.contains(key) {
                continue;
            }
            match op {
                Op::Put(v) => {
                    out.insert(key.clone(), (v.clone(), *seq));
                }
                Op::Delete | Op::Purge => {
                    out.remove(key);
                }
            }
        }
        out
    }

    /// The truth now, in `scope`.
    pub fn now(&self, scope: &WatchScope) -> BTreeMap<String, (Bytes, u64)> {
        self.at(u64::MAX, scope)
    }

    /// Whether `key` was really deleted (a delete or a purge) after revision `after`: what makes a
    /// delete that carries no revision (a repair's) legitimate.
    pub fn deleted_after(&self, key: &str, after: u64) -> bool {
        self.log
            .iter()
            .any(|(s, k, op)| *s > after && k == key && matches!(op, Op::Delete | Op::Purge))
    }

    /// Writes a store holding the truth at `cursor` (every key) into `dir`: what a correct peer's
    /// fold at that cursor holds, for its artifact.
    pub fn write_store(&self, dir: &Path, backend: Backend, cursor: u64) -> AnyStore {
        let (mut store, _) = AnyStore::open(dir, backend).expect("open the peer store");
        let batch: Vec<KvUpdate> = self
            .at(cursor, &WatchScope::All)
            .into_iter()
            .map(|(key, (value, rev))| {
                KvUpdate::Put(KvEntry {
                    key,
                    value,
                    version: VersionToken::from_u64(rev),
                })
            })
            .collect();
        store
            .apply(&batch, WatchCursor::at(cursor))
            .expect("write the peer store");
        store
    }
}
