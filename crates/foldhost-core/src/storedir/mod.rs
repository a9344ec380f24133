//! The store directory: which backend it holds, opening it for writing or read-only, and the status
//! file a running host keeps current beside it.
//!
//! Layout of `--store DIR`:
//! - `FOLDHOST.json` — `{"backend": "append-log", "layout": 1}`, written once when the store is
//!   created; a later open with another `--backend` is refused rather than silently ignored.
//! - the backend's own files: `fold.log` and `LOCK` for the append log; the `fjall/` or `rocksdb/`
//!   subdirectory for the LSM backends (cargo features `fjall`, `rocksdb`).
//! - `status.json` — written by a running host (atomically: temp file + rename), read by
//!   `foldhost status --store`. The cursor always comes from the store itself; the status file only
//!   adds what the store cannot know (`seq`, the applier, the host's state and last error).
//! - `CLOSED.json` — the clean-stop record ([`closed`]): left by a run that stopped cleanly, removed
//!   by every writable open before the backend touches a file, trusted only while every file of the
//!   store is exactly as it stamps them.
//! - `guest-seed` — the seed of the guests' random streams ([`guest_seed`]), private to the user;
//!   made by the first run with a guest, never part of an artifact.
//!
//! Invariants: read-only opens never create, lock, truncate or rewrite anything.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub mod closed;
pub mod guest_seed;

use crate::kv::{KvEntry, KvUpdate, WatchCursor};
use crate::snapshot::{
    AppendLogOptions, AppendLogSnapshot, ProvenCopy, Recovery, SnapshotError, SnapshotStore,
};
#[cfg(feature = "fjall")]
use crate::snapshot::{FjallOptions, FjallSnapshot};
#[cfg(feature = "rocksdb")]
use crate::snapshot::{RocksDbOptions, RocksDbSnapshot};

/// The meta file's name.
pub(crate) const META_FILE: &str = "FOLDHOST.json";
/// The status file's name.
pub const STATUS_FILE: &str = "status.json";
/// The directory under a store that holds its state buckets' folds, one store directory each,
/// named as the guest names the bucket (docs/state.md). An artifact's payload keeps the same
/// layout under its `data/`.
pub const STATE_DIR: &str = "state";

/// A storage backend. Every variant exists in every build (so `FOLDHOST.json` always parses);
/// [`Backend::is_compiled`] says whether this build can open it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Backend {
    /// The append-only CRC log with an in-RAM fold.
    #[serde(rename = "append-log")]
    AppendLog,
    /// fjall, a pure-Rust LSM (cargo feature `fjall`).
    #[serde(rename = "fjall")]
    Fjall,
    /// RocksDB (cargo feature `rocksdb`).
    #[serde(rename = "rocksdb")]
    RocksDb,
}

impl Backend {
    /// The CLI spelling.
    pub fn as_str(&self) -> &'static str {
        match self {
            Backend::AppendLog => "append-log",
            Backend::Fjall => "fjall",
            Backend::RocksDb => "rocksdb",
        }
    }

    /// Whether this build includes the backend.
    pub fn is_compiled(&self) -> bool {
        match self {
            Backend::AppendLog => true,
            Backend::Fjall => cfg!(feature = "fjall"),
            Backend::RocksDb => cfg!(feature = "rocksdb"),
        }
    }

    /// Why this build cannot open the backend, naming the cargo feature; `None` when it can.
    pub(crate) fn not_compiled_reason(&self) -> Option<String> {
        (!self.is_compiled()).then(|| {
            format!(
                "backend {} is not built into this foldhost: rebuild with `--features {}`",
                self.as_str(),
                self.as_str()
            )
        })
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Backend {
    type Err = String;
    /// Parses the CLI spelling; a backend this build lacks is an error naming its cargo feature.
    fn from_str(s: &str) -> Result<Self, String> {
        let b = match s {
            "append-log" => Backend::AppendLog,
            "fjall" => Backend::Fjall,
            "rocksdb" => Backend::RocksDb,
            _ => {
                return Err(format!(
                    "unknown backend {s:?}: expected append-log, fjall or rocksdb"
                ));
            }
        };
        match b.not_compiled_reason() {
            Some(reason) => Err(reason),
            None => Ok(b),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct Meta {
    backend: Backend,
    layout: u32,
}

/// Errors opening a store directory.
#[derive(Debug, thiserror::Error)]
pub enum StoreDirError {
    /// The backend failed.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// The meta file is unreadable or disagrees with the request.
    #[error("{path}: {reason}")]
    Meta {
        /// The meta file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// No store at this path.
    #[error("{0}: no foldhost store here")]
    Missing(PathBuf),
}

fn read_meta(dir: &Path) -> Result<Option<Backend>, StoreDirError> {
    let path = dir.join(META_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => {
            let m: Meta = serde_json::from_slice(&bytes).map_err(|e| StoreDirError::Meta {
                path: path.clone(),
                reason: format!("unreadable: {e}"),
            })?;
            if m.layout != 1 {
                return Err(StoreDirError::Meta {
                    path,
                    reason: format!("layout {} is not one this build reads (1)", m.layout),
                });
            }
            Ok(Some(m.backend))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(StoreDirError::Meta {
            path,
            reason: e.to_string(),
        }),
    }
}

/// The backend of the store at `dir` (from `FOLDHOST.json`; a bare `fold.log` is an append log).
pub fn backend_of(dir: &Path) -> Result<Backend, StoreDirError> {
    match read_meta(dir)? {
        Some(b) => Ok(b),
        None if dir.join("fold.log").exists() => Ok(Backend::AppendLog),
        None => Err(StoreDirError::Missing(dir.to_path_buf())),
    }
}

/// Writes `FOLDHOST.json` for `backend` into `dir` (atomically): what makes a directory of backend
/// files a store directory (an artifact's payload carries one).
pub fn write_meta(dir: &Path, backend: Backend) -> Result<(), StoreDirError> {
    write_atomic(
        &dir.join(META_FILE),
        &serde_json::to_vec(&Meta { backend, layout: 1 }).unwrap_or_default(),
    )
}

/// A store of any compiled-in backend, behind one type (the fold is generic over it).
pub enum AnyStore {
    /// The append log.
    AppendLog(AppendLogSnapshot),
    /// fjall.
    #[cfg(feature = "fjall")]
    Fjall(FjallSnapshot),
    /// RocksDB.
    #[cfg(feature = "rocksdb")]
    RocksDb(RocksDbSnapshot),
}

/// Calls `$body` with `$s` bound to the store inside whichever variant `$self` is.
macro_rules! each {
    ($self:expr, $s:ident => $body:expr) => {
        match $self {
            AnyStore::AppendLog($s) => $body,
            #[cfg(feature = "fjall")]
            AnyStore::Fjall($s) => $body,
            #[cfg(feature = "rocksdb")]
            AnyStore::RocksDb($s) => $body,
        }
    };
}

fn not_compiled(dir: &Path, backend: Backend) -> StoreDirError {
    StoreDirError::Meta {
        path: dir.join(META_FILE),
        reason: backend
            .not_compiled_reason()
            .unwrap_or_else(|| format!("backend {} unavailable", backend.as_str())),
    }
}

impl AnyStore {
    /// Opens `dir` for writing with `backend`, creating it when absent. Refuses a directory that
    /// holds another backend.
    pub fn open(dir: &Path, backend: Backend) -> Result<(Self, Recovery), StoreDirError> {
        Self::open_with(dir, backend, false)
    }

    /// [`Self::open`], with `sync`: fsync every apply (fjall and RocksDB: what survives a power
    /// loss, not only a process crash). The append log has one mode (process-crash durable) and
    /// refuses `sync` rather than pretend.
    pub fn open_with(
        dir: &Path,
        backend: Backend,
        sync: bool,
    ) -> Result<(Self, Recovery), StoreDirError> {
        if sync && backend == Backend::AppendLog {
            return Err(StoreDirError::Meta {
                path: dir.to_path_buf(),
                reason: "--sync: the append-log backend is process-crash durable only (it fsyncs at compaction); use --backend fjall or rocksdb for an fsync per apply".into(),
            });
        }
        if !backend.is_compiled() {
            return Err(not_compiled(dir, backend));
        }
        std::fs::create_dir_all(dir).map_err(|e| {
            StoreDirError::Snapshot(SnapshotError::Io {
                path: dir.to_path_buf(),
                op: "create store dir",
                source: e,
            })
        })?;
        match read_meta(dir)? {
            Some(b) if b != backend => {
                return Err(StoreDirError::Meta {
                    path: dir.join(META_FILE),
                    reason: format!(
                        "this store holds backend {}, not {}",
                        b.as_str(),
                        backend.as_str()
                    ),
                });
            }
            Some(_) => {}
            None => write_atomic(
                &dir.join(META_FILE),
                &serde_json::to_vec(&Meta { backend, layout: 1 }).unwrap_or_default(),
            )?,
        }
        // Before the backend touches a file: a clean-stop record must never outlive the state it
        // describes.
        closed::remove(dir)?;
        match backend {
            Backend::AppendLog => {
                let (s, r) = AppendLogSnapshot::open(dir, AppendLogOptions::default())?;
                Ok((AnyStore::AppendLog(s), r))
            }
            #[cfg(feature = "fjall")]
            Backend::Fjall => Ok((
                AnyStore::Fjall(FjallSnapshot::open(
                    dir,
                    FjallOptions {
                        sync,
                        ..FjallOptions::default()
                    },
                )?),
                Recovery::default(),
            )),
            #[cfg(feature = "rocksdb")]
            Backend::RocksDb => Ok((
                AnyStore::RocksDb(RocksDbSnapshot::open(
                    dir,
                    RocksDbOptions {
                        sync,
                        ..RocksDbOptions::default()
                    },
                )?),
                Recovery::default(),
            )),
            #[allow(unreachable_patterns)]
            other => Err(not_compiled(dir, other)),
        }
    }

    /// Closes a store opened writable from `dir` after a clean stop and leaves the clean-stop record
    /// ([`closed`]) the next run's identity check reads instead of opening the store.
    pub fn close_cleanly(self, dir: &Path) -> Result<(), StoreDirError> {
        let backend = match self {
            AnyStore::AppendLog(_) => Backend::AppendLog,
            #[cfg(feature = "fjall")]
            AnyStore::Fjall(_) => Backend::Fjall,
            #[cfg(feature = "rocksdb")]
            AnyStore::RocksDb(_) => Backend::RocksDb,
        };
        let record = closed::Closed {
            cursor: self.cursor(),
            identity: self
                .get(crate::retained::IDENTITY_KEY)?
                .map(|e| e.value.to_vec()),
        };
        // Closed first, so the stamps are of the final files: fjall and RocksDB each fsync a
        // small journal (write-ahead log) or flush their memtables (fjall then empties its journals)
        // (best effort: the next open then replays the journals or the write-ahead log).
        match self {
            #[cfg(feature = "fjall")]
            AnyStore::Fjall(s) => {
                if let Err(e) = s.close_durably() {
                    tracing::warn!(event = "store_close_sync_failed", store = %dir.display(), error = %e, "making fjall's journal durable at a clean stop failed; the next open replays what reached it");
                }
            }
            #[cfg(feature = "rocksdb")]
            AnyStore::RocksDb(s) => {
                if let Err(e) = s.close_durably() {
                    tracing::warn!(event = "store_close_sync_failed", store = %dir.display(), error = %e, "making RocksDB's log durable at a clean stop failed; the next open replays what reached it");
                }
            }
            other => drop(other),
        }
        closed::write(dir, backend, &record)
    }

    /// Opens `dir` read-only, whatever backend it holds. Never writes into the store: the append log
    /// replays without a lock, RocksDB opens in its read-only mode, fjall (which has no read-only
    /// mode) opens a private hard-linked copy in a temporary directory. All work beside a running
    /// host.
    pub fn open_read_only(dir: &Path) -> Result<(Self, Recovery), StoreDirError> {
        if !dir.is_dir() {
            return Err(StoreDirError::Missing(dir.to_path_buf()));
        }
        let backend = backend_of(dir)?;
        match backend {
            Backend::AppendLog => {
                let (s, r) = AppendLogSnapshot::open_read_only(dir)?;
                Ok((AnyStore::AppendLog(s), r))
            }
            #[cfg(feature = "fjall")]
            Backend::Fjall => Ok((
                AnyStore::Fjall(FjallSnapshot::open_read_only(dir)?),
                Recovery::default(),
            )),
            #[cfg(feature = "rocksdb")]
            Backend::RocksDb => Ok((
                AnyStore::RocksDb(RocksDbSnapshot::open_read_only(dir)?),
                Recovery::default(),
            )),
            #[allow(unreachable_patterns)]
            other => Err(not_compiled(dir, other)),
        }
    }
}

impl SnapshotStore for AnyStore {
    fn backend(&self) -> &'static str {
        each!(self, s => s.backend())
    }
    fn cursor(&self) -> WatchCursor {
        each!(self, s => s.cursor())
    }
    fn apply(&mut self, batch: &[KvUpdate], cursor: WatchCursor) -> Result<(), SnapshotError> {
        each!(self, s => s.apply(batch, cursor))
    }
    fn get(&self, key: &str) -> Result<Option<KvEntry>, SnapshotError> {
        each!(self, s => s.get(key))
    }
    fn for_each_in_range(
        &self,
        prefix: &str,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        each!(self, s => s.for_each_in_range(prefix, visit))
    }
    fn for_each_in_range_after(
        &self,
        prefix: &str,
        after: Option<&str>,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        each!(self, s => s.for_each_in_range_after(prefix, after, visit))
    }
    fn len(&self) -> Result<u64, SnapshotError> {
        each!(self, s => s.len())
    }
    fn export_to(&self, dest: &Path) -> Result<Option<ProvenCopy>, SnapshotError> {
        each!(self, s => s.export_to(dest))
    }
}

/// Writes the status file atomically.
pub fn write_status(dir: &Path, status: &crate::status::StatusReport) -> Result<(), StoreDirError> {
    let bytes = serde_json::to_vec_pretty(status).unwrap_or_default();
    write_atomic(&dir.join(STATUS_FILE), &bytes)
}

/// Reads the status file, if any (an unreadable one reads as absent: it is advisory).
pub fn read_status(dir: &Path) -> Option<crate::status::StatusReport> {
    let bytes = std::fs::read(dir.join(STATUS_FILE)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StoreDirError> {
    let tmp = path.with_extension("tmp");
    let io = |op: &'static str, e: std::io::Error| {
        StoreDirError::Snapshot(SnapshotError::Io {
            path: path.to_path_buf(),
            op,
            source: e,
        })
    };
    std::fs::write(&tmp, bytes).map_err(|e| io("write", e))?;
    std::fs::rename(&tmp, path).map_err(|e| io("rename", e))
}

/// Every backend this build can open (tests run over each).
#[cfg(test)]
pub(crate) fn compiled_backends() -> Vec<Backend> {
    [Backend::AppendLog, Backend::Fjall, Backend::RocksDb]
        .into_iter()
        .filter(Backend::is_compiled)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::VersionToken;

    fn compiled() -> Vec<Backend> {
        compiled_backends()
    }

    #[test]
    fn backend_names_parse_and_round_trip_through_the_meta_file() {
        for b in [Backend::AppendLog, Backend::Fjall, Backend::RocksDb] {
            let json = serde_json::to_string(&b).expect("serialize");
            assert_eq!(json, format!("\"{}\"", b.as_str()));
            let back: Backend = serde_json::from_str(&json).expect("deserialize");
            assert_eq!(back, b);
            match b.as_str().parse::<Backend>() {
                Ok(p) => assert_eq!(p, b),
                Err(e) => {
                    assert!(!b.is_compiled());
                    assert!(e.contains(&format!("--features {}", b.as_str())), "{e}");
                }
            }
        }
        let err = "leveldb".parse::<Backend>().expect_err("unknown");
        assert!(
            err.contains("expected append-log, fjall or rocksdb"),
            "{err}"
        );
    }

    #[test]
    fn every_compiled_backend_opens_records_itself_and_reads_back_read_only() {
        for b in compiled() {
            let dir = tempfile::tempdir().expect("tempdir");
            let (mut s, _) = AnyStore::open(dir.path(), b).expect("open");
            assert_eq!(s.backend(), b.as_str());
            s.apply(
                &[KvUpdate::Put(KvEntry {
                    key: "k".into(),
                    value: bytes::Bytes::from_static(b"v"),
                    version: VersionToken::from_u64(1),
                })],
                WatchCursor::at(1),
            )
            .expect("apply");
            let meta = std::fs::read_to_string(dir.path().join(META_FILE)).expect("meta");
            assert!(meta.contains(b.as_str()), "{meta}");
            // Read-only beside the writer.
            let (r, _) = AnyStore::open_read_only(dir.path()).expect("read-only");
            assert_eq!(r.backend(), b.as_str());
            assert_eq!(r.cursor(), WatchCursor::at(1));
            assert_eq!(r.len().expect("len"), 1);
            drop(r);
            drop(s);
            // Any other backend is refused for this directory.
            for other in compiled().into_iter().filter(|o| *o != b) {
                let err = AnyStore::open(dir.path(), other).err().expect("refused");
                assert!(err.to_string().contains("holds backend"), "{err}");
            }
        }
    }

    #[test]
    fn a_store_of_a_backend_not_built_in_is_refused_naming_the_feature() {
        for b in [Backend::Fjall, Backend::RocksDb] {
            if b.is_compiled() {
                continue;
            }
            let dir = tempfile::tempdir().expect("tempdir");
            write_atomic(
                &dir.path().join(META_FILE),
                &serde_json::to_vec(&Meta {
                    backend: b,
                    layout: 1,
                })
                .expect("json"),
            )
            .expect("write meta");
            let err = AnyStore::open_read_only(dir.path()).err().expect("refused");
            assert!(err.to_string().contains("--features"), "{err}");
            let err = AnyStore::open(dir.path(), b).err().expect("refused");
            assert!(err.to_string().contains("--features"), "{err}");
        }
    }
}
