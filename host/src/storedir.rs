//! The store directory: which backend it holds, opening it for writing or read-only, and the status
//! file a running host keeps current beside it.
//!
//! Layout of `--store DIR`:
//! - `FOLDHOST.json` — `{"backend": "append-log", "layout": 1}`, written once when the store is
//!   created; a later open with another `--backend` is refused rather than silently ignored.
//! - the backend's own files (`fold.log` and `LOCK` for the append log).
//! - `status.json` — written by a running host (atomically: temp file + rename), read by
//!   `foldhost status --store`. The cursor always comes from the store itself; the status file only
//!   adds what the store cannot know (`seq`, the applier, the host's state and last error).
//!
//! Invariants: read-only opens never create, lock, truncate or rewrite anything.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::kv::{KvEntry, KvUpdate, WatchCursor};
use crate::snapshot::{
    AppendLogOptions, AppendLogSnapshot, Recovery, SnapshotError, SnapshotStore,
};

/// The meta file's name.
pub const META_FILE: &str = "FOLDHOST.json";
/// The status file's name.
pub const STATUS_FILE: &str = "status.json";

/// A storage backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// The append-only CRC log with an in-RAM fold.
    AppendLog,
}

impl Backend {
    /// The CLI spelling.
    pub fn as_str(&self) -> &'static str {
        match self {
            Backend::AppendLog => "append-log",
        }
    }
}

impl FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "append-log" => Ok(Backend::AppendLog),
            "fjall" | "rocksdb" => Err(format!(
                "backend {s:?} is not built into this foldhost (only append-log)"
            )),
            _ => Err(format!(
                "unknown backend {s:?}: expected append-log, fjall or rocksdb"
            )),
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
}

impl AnyStore {
    /// Opens `dir` for writing with `backend`, creating it when absent. Refuses a directory that
    /// holds another backend.
    pub fn open(dir: &Path, backend: Backend) -> Result<(Self, Recovery), StoreDirError> {
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
        match backend {
            Backend::AppendLog => {
                let (s, r) = AppendLogSnapshot::open(dir, AppendLogOptions::default())?;
                Ok((AnyStore::AppendLog(s), r))
            }
        }
    }

    /// Opens `dir` read-only, whatever backend it holds. Never writes.
    pub fn open_read_only(dir: &Path) -> Result<(Self, Recovery), StoreDirError> {
        if !dir.is_dir() {
            return Err(StoreDirError::Missing(dir.to_path_buf()));
        }
        let backend = match read_meta(dir)? {
            Some(b) => b,
            None if dir.join("fold.log").exists() => Backend::AppendLog,
            None => return Err(StoreDirError::Missing(dir.to_path_buf())),
        };
        match backend {
            Backend::AppendLog => {
                let (s, r) = AppendLogSnapshot::open_read_only(dir)?;
                Ok((AnyStore::AppendLog(s), r))
            }
        }
    }
}

impl SnapshotStore for AnyStore {
    fn backend(&self) -> &'static str {
        match self {
            AnyStore::AppendLog(s) => s.backend(),
        }
    }
    fn cursor(&self) -> WatchCursor {
        match self {
            AnyStore::AppendLog(s) => s.cursor(),
        }
    }
    fn apply(&mut self, batch: &[KvUpdate], cursor: WatchCursor) -> Result<(), SnapshotError> {
        match self {
            AnyStore::AppendLog(s) => s.apply(batch, cursor),
        }
    }
    fn get(&self, key: &str) -> Result<Option<KvEntry>, SnapshotError> {
        match self {
            AnyStore::AppendLog(s) => s.get(key),
        }
    }
    fn for_each_in_range(
        &self,
        prefix: &str,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        match self {
            AnyStore::AppendLog(s) => s.for_each_in_range(prefix, visit),
        }
    }
    fn for_each_in_range_after(
        &self,
        prefix: &str,
        after: Option<&str>,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        match self {
            AnyStore::AppendLog(s) => s.for_each_in_range_after(prefix, after, visit),
        }
    }
    fn len(&self) -> Result<u64, SnapshotError> {
        match self {
            AnyStore::AppendLog(s) => s.len(),
        }
    }

    fn export_to(&self, dest: &Path) -> Result<(), SnapshotError> {
        match self {
            AnyStore::AppendLog(s) => s.export_to(dest),
        }
    }
}

/// What a running host reports in `status.json`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct HostStatus {
    /// `running`, `stopped` or `failed`.
    pub state: String,
    /// The host's process id.
    pub pid: u32,
    /// Highest revision delivered.
    pub seq: u64,
    /// Highest revision every update at or below which is applied and committed.
    pub applied_through: u64,
    /// Records retained (deferred by a guest) in the fold.
    #[serde(default)]
    pub retained: u64,
    /// Revision of the oldest retained record.
    #[serde(default)]
    pub oldest_retained_revision: Option<u64>,
    /// When the oldest retained record was retained (Unix milliseconds).
    #[serde(default)]
    pub oldest_retained_unix_ms: Option<u64>,
    /// Records retained longer than the grace.
    #[serde(default)]
    pub warnings: Vec<String>,
    /// The applier (guest name and version, or `native:count`).
    pub guest: Option<String>,
    /// The bucket folded.
    pub bucket: String,
    /// The watch scope.
    pub scope: String,
    /// Updates delivered since the host started.
    pub delivered: u64,
    /// Batches committed since the host started.
    pub batches: u64,
    /// Last apply time, microseconds.
    pub last_apply_us: u64,
    /// Last store commit time, microseconds.
    pub last_commit_us: u64,
    /// Why the host stopped, when it failed.
    pub error: Option<String>,
    /// When this was written (Unix milliseconds).
    pub updated_unix_ms: u64,
}

/// Writes the status file atomically.
pub fn write_status(dir: &Path, status: &HostStatus) -> Result<(), StoreDirError> {
    let bytes = serde_json::to_vec_pretty(status).unwrap_or_default();
    write_atomic(&dir.join(STATUS_FILE), &bytes)
}

/// Reads the status file, if any (an unreadable one reads as absent: it is advisory).
pub fn read_status(dir: &Path) -> Option<HostStatus> {
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
