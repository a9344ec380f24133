//! The clean-stop record, `CLOSED.json`: what a run that stopped cleanly leaves beside its store,
//! so the next run's identity check reads the fold's stream identity and cursor without opening
//! the store (for fjall, a private copy and a whole LSM recovery; for the append log, a replay).
//!
//! Invariants:
//! - **Written last.** Only after the store was closed (dropped: fjall has flushed its memtable),
//!   atomically: a temp file, fsynced, renamed, the directory fsynced.
//! - **Removed first.** Every writable open removes it, durably, before the backend touches a
//!   file ([`super::AnyStore::open_with`]); read-only opens leave it alone.
//! - **Trusted only while the store is exactly as it was closed.** The record lists every file of
//!   the backend with its size, modification time and inode; when any differs, or a file appeared
//!   or vanished, or the record does not parse, [`read`] answers `None` and the check opens the
//!   store read-only as before.
//! - **Advisory.** The fold's own start checks the identity again against the store itself; the
//!   record only lets a refusal happen before anything is opened.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use super::{Backend, META_FILE, StoreDirError};
use crate::kv::WatchCursor;
use crate::snapshot::SnapshotError;

/// The record's file name in the store directory.
pub const CLOSED_FILE: &str = "CLOSED.json";
/// The record's format version.
const FORMAT: u32 = 1;
/// Most files a stamp lists: a store with more is not stamped (the check opens it instead).
const MAX_FILES: usize = 100_000;

/// What a clean stop recorded: the fold's cursor and its stream identity record's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closed {
    /// The fold's cursor at the stop.
    pub cursor: WatchCursor,
    /// The value of the fold's identity record ([`crate::retained::IDENTITY_KEY`]), if it had one.
    pub identity: Option<Vec<u8>>,
}

/// One file of the backend as the stop left it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Stamp {
    /// Relative to the store directory.
    path: String,
    len: u64,
    mtime_ns: i128,
    ino: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Record {
    format: u32,
    backend: Backend,
    cursor: String,
    identity: Option<String>,
    files: Vec<Stamp>,
}

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

fn io(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> StoreDirError {
    let path = path.to_path_buf();
    move |source| StoreDirError::Snapshot(SnapshotError::Io { path, op, source })
}

/// Writes the record for a store closed at `closed`. The store must be dropped already.
pub fn write(dir: &Path, backend: Backend, closed: &Closed) -> Result<(), StoreDirError> {
    let files = stamps(dir, backend)
        .map_err(io(dir, "stamp the store's files"))?
        .ok_or_else(|| StoreDirError::Meta {
            path: dir.to_path_buf(),
            reason: format!("more than {MAX_FILES} files: not stamped"),
        })?;
    let record = Record {
        format: FORMAT,
        backend,
        cursor: b64().encode(closed.cursor.to_bytes()),
        identity: closed.identity.as_ref().map(|i| b64().encode(i)),
        files,
    };
    let bytes = serde_json::to_vec(&record).map_err(|e| StoreDirError::Meta {
        path: dir.join(CLOSED_FILE),
        reason: format!("encode: {e}"),
    })?;
    let path = dir.join(CLOSED_FILE);
    let tmp = dir.join(".CLOSED.json.tmp");
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(&tmp).map_err(io(&tmp, "create"))?;
        f.write_all(&bytes).map_err(io(&tmp, "write"))?;
        f.sync_all().map_err(io(&tmp, "fsync"))?;
    }
    std::fs::rename(&tmp, &path).map_err(io(&path, "rename into place"))?;
    sync_dir(dir)
}

/// The record, if there is one and the store's files are exactly as it lists them.
pub fn read(dir: &Path) -> Option<Closed> {
    let bytes = std::fs::read(dir.join(CLOSED_FILE)).ok()?;
    let record: Record = match serde_json::from_slice(&bytes) {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(dir = %dir.display(), error = %e, "clean-stop record does not parse: ignored");
            return None;
        }
    };
    if record.format != FORMAT {
        return None;
    }
    let now = stamps(dir, record.backend).ok()??;
    if now != record.files {
        tracing::debug!(dir = %dir.display(), "the store changed since its clean stop: record ignored");
        return None;
    }
    let cursor = WatchCursor::from_bytes(&b64().decode(&record.cursor).ok()?)?;
    let identity = match record.identity {
        Some(i) => Some(b64().decode(i).ok()?),
        None => None,
    };
    Some(Closed { cursor, identity })
}

/// Removes the record, durably, if there is one.
pub(crate) fn remove(dir: &Path) -> Result<(), StoreDirError> {
    let path = dir.join(CLOSED_FILE);
    match std::fs::remove_file(&path) {
        Ok(()) => sync_dir(dir),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(&path, "remove")(e)),
    }
}

fn sync_dir(dir: &Path) -> Result<(), StoreDirError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir, "fsync directory"))
}

/// The backend's files (and the meta file), sorted by path; `None` past [`MAX_FILES`].
fn stamps(dir: &Path, backend: Backend) -> std::io::Result<Option<Vec<Stamp>>> {
    let roots: &[&str] = match backend {
        Backend::AppendLog => &[crate::snapshot::LOG_FILE],
        Backend::Fjall => &["fjall"],
        Backend::RocksDb => &["rocksdb"],
    };
    let mut out = Vec::new();
    let mut pending: Vec<PathBuf> = std::iter::once(META_FILE)
        .chain(roots.iter().copied())
        .map(PathBuf::from)
        .collect();
    while let Some(rel) = pending.pop() {
        if out.len() > MAX_FILES {
            return Ok(None);
        }
        let full = dir.join(&rel);
        let meta = std::fs::symlink_metadata(&full)?;
        if meta.is_dir() {
            for entry in std::fs::read_dir(&full)? {
                pending.push(rel.join(entry?.file_name()));
            }
            continue;
        }
        out.push(stamp(&rel, &meta));
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(Some(out))
}

fn stamp(rel: &Path, meta: &std::fs::Metadata) -> Stamp {
    let mtime_ns = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(-1, |d| d.as_nanos() as i128);
    #[cfg(unix)]
    let ino = std::os::unix::fs::MetadataExt::ino(meta);
    #[cfg(not(unix))]
    let ino = 0;
    Stamp {
        path: rel.to_string_lossy().into_owned(),
        len: meta.len(),
        mtime_ns,
        ino,
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::kv::{KvEntry, KvUpdate, VersionToken};
    use crate::snapshot::SnapshotStore as _;
    use crate::storedir::AnyStore;
    use crate::storedir::compiled_backends as compiled;

    fn put(key: &str, value: &[u8], revision: u64) -> KvUpdate {
        KvUpdate::Put(KvEntry {
            key: key.into(),
            value: Bytes::copy_from_slice(value),
            version: VersionToken::from_u64(revision),
        })
    }

    /// A store of `backend` in `dir` with an identity record and a cursor at `revision`.
    fn folded(dir: &Path, backend: Backend, revision: u64) -> AnyStore {
        let (mut store, _) = AnyStore::open(dir, backend).expect("open");
        store
            .apply(
                &[
                    put(crate::retained::IDENTITY_KEY, b"stream-identity", 1),
                    put(&format!("k{revision}"), b"v", revision),
                ],
                WatchCursor::at(revision),
            )
            .expect("apply");
        store
    }

    #[test]
    fn a_clean_stop_record_reads_back_while_the_store_is_exactly_as_it_was_closed() {
        for backend in compiled() {
            let dir = tempfile::tempdir().expect("tempdir");
            folded(dir.path(), backend, 3)
                .close_cleanly(dir.path())
                .expect("close");
            assert_eq!(
                read(dir.path()),
                Some(Closed {
                    cursor: WatchCursor::at(3),
                    identity: Some(b"stream-identity".to_vec()),
                }),
                "{backend:?}"
            );
            // A read-only open (the fallback path, or `foldhost status`) leaves it in place.
            drop(AnyStore::open_read_only(dir.path()).expect("read-only open"));
            assert!(read(dir.path()).is_some(), "{backend:?}");
        }
    }

    /// The record must never describe a store that moved on: a writable open removes it, and a
    /// stale copy put back afterwards is refused by its stamps.
    #[test]
    fn a_record_is_removed_by_a_writable_open_and_a_stale_one_is_ignored() {
        for backend in compiled() {
            let dir = tempfile::tempdir().expect("tempdir");
            folded(dir.path(), backend, 3)
                .close_cleanly(dir.path())
                .expect("close");
            let stale = std::fs::read(dir.path().join(CLOSED_FILE)).expect("record");
            let store = folded(dir.path(), backend, 4);
            assert!(
                !dir.path().join(CLOSED_FILE).exists(),
                "{backend:?}: the writable open removed the record"
            );
            drop(store);
            std::fs::write(dir.path().join(CLOSED_FILE), &stale)
                .expect("put the stale record back");
            assert_eq!(read(dir.path()), None, "{backend:?}: stale record trusted");
        }
    }

    #[test]
    fn a_record_that_does_not_parse_is_ignored() {
        let dir = tempfile::tempdir().expect("tempdir");
        folded(dir.path(), Backend::AppendLog, 3)
            .close_cleanly(dir.path())
            .expect("close");
        let path = dir.path().join(CLOSED_FILE);
        let mut bytes = std::fs::read(&path).expect("record");
        bytes.truncate(bytes.len() / 2);
        std::fs::write(&path, &bytes).expect("write");
        assert_eq!(read(dir.path()), None);
    }
}
