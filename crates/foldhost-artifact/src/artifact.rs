//! Artifacts: a verified, self-describing copy of a fold that another node imports to start from
//! (seed 000, "Export/import").
//!
//! An artifact is a directory (or the same tree in one tar file, for transport):
//! - `data/` — the backend's own files, plus `FOLDHOST.json`: a complete store directory;
//! - `MANIFEST.json` — [`ExportManifest`]: schema, backend and format generation, the cursor the
//!   payload is exactly consistent with, the exporting watch's scope, and every file's size and
//!   BLAKE3 digest.
//!
//! Invariants:
//! - **An artifact that exists is complete.** Export writes into a hidden sibling directory
//!   (`.NAME.export-…`), proves the copy recovers the live cursor (every apply commits its cursor
//!   with its data, so equality is a complete tail-loss detector) — an LSM copy by reopening it,
//!   the append log by its own [`crate::snapshot::ProvenCopy`]: [`crate::snapshot::CompactLogCheck`]
//!   run over the bytes it wrote, in the pass that hashed them (what a reopen proves, without
//!   rebuilding the map or reading the copy back) — fsyncs every file, writes the manifest
//!   *last*, and renames the whole stage into place. A crash at any point leaves only the hidden
//!   stage. A file the store proved must still have the size it wrote when the seal lists it.
//! - **A bad artifact never becomes a fold.** Import treats the artifact as untrusted: it refuses an
//!   unknown schema, a backend this build lacks or the destination does not hold, any path that is
//!   not plain relative components (`..`, absolute, links, devices), a missing or unlisted file,
//!   before opening anything; it copies into a hidden stage beside the destination re-checking
//!   every size and digest (a download streams straight into the stage, [`import_tar_stream`]),
//!   proves the staged copy recovers the manifest's cursor (the same two ways as export), and only
//!   then renames it into place. The destination is untouched by every refusal.
//! - **Bounded.** The manifest is at most [`MAX_MANIFEST_BYTES`], at most [`MAX_FILES`] files, and a
//!   tar entry at most [`MAX_FILE_BYTES`]. Every tar is read through [`TarGuard`], which parses each
//!   512-byte header as it passes and refuses an extension entry (GNU long name or link, PAX) over
//!   [`MAX_TAR_EXTENSION_BYTES`] before the `tar` crate reads its body (which it buffers whole), so
//!   a hostile tar cannot take memory: a streamed import holds one buffer, never an entry.
//! - **Which stream.** An artifact exported from a fold records the fold's stream (name, creation
//!   time) in its manifest ([`ManifestStream`]); one of an earlier version, or exported through
//!   `--listen`, records none, and importing it checks as before (the node's own identity check).

use std::fs::File;
use std::io::{Read, Write};

use crate::staged::{StagedFile, Syncs};
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::kv::WatchCursor;
use crate::snapshot::{ProvenCopy, SnapshotError, SnapshotStore};
use crate::storedir::{AnyStore, Backend, StoreDirError};

/// The manifest's file name, at the artifact's root.
pub const MANIFEST_FILE: &str = "MANIFEST.json";
/// The payload directory, at the artifact's root.
pub const DATA_DIR: &str = "data";
/// The manifest schema this build writes (2: with the exporting watch's scope). Schema 1 (no
/// scope) is still read.
pub const SCHEMA: u32 = 2;
/// Largest manifest read.
pub const MAX_MANIFEST_BYTES: u64 = 16 * 1024 * 1024;
/// Most files an artifact may list.
pub const MAX_FILES: usize = 100_000;
/// Largest single file a tar may carry (1 TiB: a sanity bound, not a quota).
pub const MAX_FILE_BYTES: u64 = 1 << 40;
/// Largest tar extension entry (GNU long name `L` or link `K`, PAX `x` or `g`) read: the `tar`
/// crate buffers such an entry's body whole, so [`TarGuard`] refuses a larger one from its header.
pub const MAX_TAR_EXTENSION_BYTES: u64 = 64 << 10;
/// Most previous pointer targets a manifest lists ([`ExportManifest::previous`]).
pub const MAX_PREVIOUS_TARGETS: usize = 8;

/// The stream an artifact's fold folds (as [`crate::kv::StreamIdentity`] holds it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestStream {
    /// The stream's name (`KV_<bucket>` on NATS).
    pub name: String,
    /// When the server created the stream, Unix nanoseconds.
    pub created_unix_ns: u64,
}

impl From<&crate::kv::StreamIdentity> for ManifestStream {
    fn from(id: &crate::kv::StreamIdentity) -> Self {
        ManifestStream {
            name: id.name.clone(),
            created_unix_ns: id.created_unix_ns,
        }
    }
}

impl ManifestStream {
    /// The identity, for messages.
    pub fn identity(&self) -> crate::kv::StreamIdentity {
        crate::kv::StreamIdentity {
            name: self.name.clone(),
            created_unix_ns: self.created_unix_ns,
        }
    }

    /// As [`crate::protocol::stream_relation`] reads it.
    pub fn key(&self) -> (&str, u64) {
        (self.name.as_str(), self.created_unix_ns)
    }
}

/// A pointer target before this artifact: its cursor and when it was published (the pointer
/// object's last change when it named it). The first target above a payload's cursor was
/// published when that payload stopped being the target ([`crate::protocol::payload_superseded_at`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreviousTarget {
    /// The target's cursor.
    pub cursor: u64,
    /// When the pointer was moved to it, Unix milliseconds (the object store's clock).
    pub published_unix_ms: i64,
}

/// One payload file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArtifactFile {
    /// Path under `data/`, `/`-separated, plain relative components only.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// BLAKE3 digest, lowercase hex.
    pub blake3: String,
}

/// What an artifact says about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportManifest {
    /// Manifest schema ([`SCHEMA`]).
    pub schema: u32,
    /// The backend that wrote the payload (`append-log`, `fjall`, `rocksdb`).
    pub backend: String,
    /// The backend's on-disk format generation.
    pub format: u32,
    /// The watch cursor the payload is exactly consistent with (`None`: an empty fold).
    pub cursor: Option<u64>,
    /// The exporting watch's scope (`all`, `prefix:P`, `prefixes:P1,P2`), when exported by a host.
    #[serde(default)]
    pub scope: Option<String>,
    /// Keys in the fold (retained records included).
    pub keys: u64,
    /// When the export was taken, Unix milliseconds.
    pub created_unix_ms: u64,
    /// Every payload file.
    pub files: Vec<ArtifactFile>,
    /// The stream the fold folds; absent in artifacts of earlier versions and those exported
    /// without it (read as unknown: see [`crate::protocol::bootstrap_stream_allowed`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<ManifestStream>,
    /// The pointer's recent targets before this artifact, newest first (at most
    /// [`MAX_PREVIOUS_TARGETS`]), added by the publish: what prune counts its grace from. Empty in
    /// a local artifact and in those of earlier versions (older readers ignore the field).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub previous: Vec<PreviousTarget>,
}

/// Why an export or an import failed.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    /// A filesystem call failed.
    #[error("{path}: {op}: {source}")]
    Io {
        /// Where.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The output or destination already holds something.
    #[error("{0}: already exists (refusing to overwrite)")]
    Exists(PathBuf),
    /// The manifest is unreadable, too large, or of an unknown schema.
    #[error("{path}: bad manifest: {reason}")]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A path in the manifest or the tar is not plain relative components.
    #[error("unsafe path {0:?} in the artifact (only plain relative paths are accepted)")]
    UnsafePath(String),
    /// A tar entry is not a regular file or directory.
    #[error("tar entry {path:?} is a {kind}, not a regular file or directory")]
    EntryType {
        /// The entry.
        path: String,
        /// Its type.
        kind: String,
    },
    /// A listed file is absent.
    #[error("{0}: listed in the manifest but missing from the artifact")]
    MissingFile(String),
    /// A file is present that the manifest does not list.
    #[error("{0}: in the artifact but not listed in the manifest")]
    ExtraFile(String),
    /// A file's size differs from the manifest.
    #[error("{path}: size {got} bytes, the manifest says {want}")]
    SizeMismatch {
        /// The file.
        path: String,
        /// Per the manifest.
        want: u64,
        /// As found.
        got: u64,
    },
    /// A file's digest differs from the manifest.
    #[error("{path}: BLAKE3 {got} differs from the manifest's {want} (tampered or torn)")]
    HashMismatch {
        /// The file.
        path: String,
        /// Per the manifest.
        want: String,
        /// As computed.
        got: String,
    },
    /// The artifact's backend is not the one asked for, or not compiled in.
    #[error("artifact backend {artifact} does not match {wanted}")]
    BackendMismatch {
        /// Per the manifest.
        artifact: String,
        /// What the destination or the caller wants.
        wanted: String,
    },
    /// The reopened copy's cursor differs from the one it must equal.
    #[error("{what}: recovered cursor {got:?} differs from {want:?}")]
    CursorMismatch {
        /// Which gate.
        what: &'static str,
        /// The cursor it must equal.
        want: Option<u64>,
        /// The cursor recovered.
        got: Option<u64>,
    },
    /// The store layer failed.
    #[error(transparent)]
    Store(#[from] StoreDirError),
    /// The backend failed.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// The running fold could not take the export.
    #[error("the fold: {0}")]
    Fold(String),
    /// The tar file is unreadable.
    #[error("{path}: bad tar: {reason}")]
    Tar {
        /// The tar file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

fn io_err<'a>(
    path: &'a Path,
    op: &'static str,
) -> impl FnOnce(std::io::Error) -> ArtifactError + 'a {
    move |source| ArtifactError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

/// The on-disk format generation of `backend`'s files (bumped when a backend's layout changes).
pub fn format_generation(backend: Backend) -> u32 {
    match backend {
        // `FHLG` v1 records.
        Backend::AppendLog => 1,
        // fjall 3's on-disk format with our value-record codec and meta partition.
        Backend::Fjall => 1,
        // RocksDB 11's format with our value-record codec and meta column family.
        Backend::RocksDb => 1,
    }
}

/// Checks a payload path: non-empty, relative, `/`-separated plain components (no `.`, `..`, root
/// or prefix), at most 4 096 bytes. Pure.
pub fn check_path(p: &str) -> Result<PathBuf, ArtifactError> {
    let unsafe_path = || ArtifactError::UnsafePath(p.to_string());
    if p.is_empty() || p.len() > 4096 || p.contains('\0') || p.contains('\\') {
        return Err(unsafe_path());
    }
    let mut out = PathBuf::new();
    for part in p.split('/') {
        let mut comps = Path::new(part).components();
        match (comps.next(), comps.next()) {
            (Some(Component::Normal(c)), None) if c == part => out.push(c),
            _ => return Err(unsafe_path()),
        }
    }
    Ok(out)
}

/// A hidden sibling of `path` for staging (`.NAME.TAG-PID-NANOS`).
///
/// Before naming a new stage it removes the stale ones beside `path` ([`sweep_stale_stages`]): a
/// process killed mid-import or mid-export leaves its stage behind, as large as the fold.
pub fn stage_path(path: &Path, tag: &str) -> PathBuf {
    sweep_stale_stages(path);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "artifact".into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let parent = path.parent().unwrap_or_else(|| Path::new("."));
    parent.join(format!(".{name}.{tag}-{}-{nanos}", std::process::id()))
}

/// The tags [`stage_path`] is called with.
const STAGE_TAGS: [&str; 5] = ["export", "artifact", "unpack", "import", "tar"];

/// A stage left behind is removed only once it is this old, whatever its process: a process in
/// another PID namespace sharing the directory is not visible in `/proc`.
pub const STALE_STAGE_AGE: std::time::Duration = std::time::Duration::from_secs(3600);

/// The process id in `entry` when it is a stage of the file or directory named `name`, as
/// [`stage_path`] names one (`.<name>.<tag>-<pid>-<nanos>`). Pure.
pub fn stage_owner(name: &str, entry: &str) -> Option<u32> {
    let rest = entry
        .strip_prefix('.')?
        .strip_prefix(name)?
        .strip_prefix('.')?;
    let (tag, rest) = rest.split_once('-')?;
    if !STAGE_TAGS.contains(&tag) {
        return None;
    }
    let (pid, nanos) = rest.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(nanos) || !digits(pid) {
        return None;
    }
    pid.parse().ok()
}

/// Removes the stages beside `path` whose process is no longer running on this machine and that
/// are older than [`STALE_STAGE_AGE`]; best effort (a failure leaves the stage, never fails the
/// caller). Returns how many went. Nothing is removed where `/proc` cannot tell a live process.
pub fn sweep_stale_stages(path: &Path) -> usize {
    let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return 0;
    };
    let proc = Path::new("/proc");
    if !proc.join("self").exists() {
        return 0;
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let entry_name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = stage_owner(&name, &entry_name) else {
            continue;
        };
        if pid == std::process::id() || proc.join(pid.to_string()).exists() {
            continue;
        }
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > STALE_STAGE_AGE);
        if !old {
            continue;
        }
        let at = entry.path();
        let r = if at.is_dir() {
            std::fs::remove_dir_all(&at)
        } else {
            std::fs::remove_file(&at)
        };
        match r {
            Ok(()) => {
                removed += 1;
                tracing::warn!(stage = %at.display(), pid, "removed a stage left by a process that is gone");
            }
            Err(e) => {
                tracing::warn!(stage = %at.display(), error = %e, "could not remove a stale stage")
            }
        }
    }
    removed
}

/// Removes a stage on a failure path (best effort: it is hidden and named as a stage).
fn discard(stage: &Path) {
    let _ = std::fs::remove_dir_all(stage);
}

/// `r`, with `stage` removed when it is an error: every failure path of a staged step.
fn or_discard<T>(stage: &Path, r: Result<T, ArtifactError>) -> Result<T, ArtifactError> {
    if r.is_err() {
        discard(stage);
    }
    r
}

/// Creates `stage/data` and returns it.
fn make_stage(stage: &Path) -> Result<PathBuf, ArtifactError> {
    let data = stage.join(DATA_DIR);
    std::fs::create_dir_all(&data).map_err(io_err(&data, "create stage"))?;
    Ok(data)
}

fn sync_dir(dir: &Path) -> Result<(), ArtifactError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir, "fsync directory"))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Progress of a long copy or hash: `(bytes done, bytes total)`.
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64);

/// Streams `src` through BLAKE3, reporting bytes to `tick`.
fn hash_file(src: &Path, tick: &mut dyn FnMut(u64)) -> Result<(u64, String), ArtifactError> {
    let mut f = File::open(src).map_err(io_err(src, "open"))?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let got = f.read(&mut buf).map_err(io_err(src, "read"))?;
        if got == 0 {
            break;
        }
        hasher.update(&buf[..got]);
        n += got as u64;
        tick(got as u64);
    }
    Ok((n, hasher.finalize().to_hex().to_string()))
}

/// [`hash_file`] copying into a staged import file, with a streaming check of the contents: reads
/// straight into its block, so each byte is read once, hashed and checked there, and written from
/// there.
fn copy_hashed(
    src: &Path,
    out: &mut StagedFile,
    tick: &mut dyn FnMut(u64),
    mut check: Option<&mut crate::snapshot::CompactLogCheck>,
) -> Result<(u64, String), ArtifactError> {
    let mut f = File::open(src).map_err(io_err(src, "open"))?;
    let mut hasher = blake3::Hasher::new();
    let mut n = 0u64;
    loop {
        let spare = out.spare();
        let got = f.read(spare).map_err(io_err(src, "read"))?;
        if got == 0 {
            break;
        }
        hasher.update(&spare[..got]);
        if let Some(c) = check.as_deref_mut() {
            c.feed(&spare[..got]);
        }
        out.commit(got).map_err(io_err(src, "copy"))?;
        n += got as u64;
        tick(got as u64);
    }
    Ok((n, hasher.finalize().to_hex().to_string()))
}

/// Every regular file under `root`, as sorted `/`-separated relative paths. Anything that is not
/// a regular file or a directory (a symlink, a device) is refused.
fn list_files(root: &Path) -> Result<Vec<String>, ArtifactError> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = root.join(&rel);
        for entry in std::fs::read_dir(&dir).map_err(io_err(&dir, "list"))? {
            let entry = entry.map_err(io_err(&dir, "list"))?;
            let ty = entry.file_type().map_err(io_err(&entry.path(), "stat"))?;
            let name = entry.file_name();
            let child = rel.join(&name);
            let text = child
                .to_str()
                .ok_or_else(|| ArtifactError::UnsafePath(child.to_string_lossy().into_owned()))?
                .replace(std::path::MAIN_SEPARATOR, "/");
            if ty.is_dir() {
                stack.push(child);
            } else if ty.is_file() {
                out.push(text);
            } else {
                return Err(ArtifactError::EntryType {
                    path: text,
                    kind: "link or special file".into(),
                });
            }
            if out.len() > MAX_FILES {
                return Err(ArtifactError::Manifest {
                    path: root.to_path_buf(),
                    reason: format!("more than {MAX_FILES} files"),
                });
            }
        }
    }
    out.sort();
    Ok(out)
}

/// What the first half of an export leaves for the second: the cursor the staged copy holds, and
/// what the store proved about it while writing it (see [`SnapshotStore::export_to`]).
#[derive(Clone, Debug)]
pub struct Staged {
    /// The cursor the copy must recover.
    pub cursor: WatchCursor,
    /// The store's digests and check of its copy, when it made them.
    pub proven: Option<ProvenCopy>,
    /// The stream the copied fold folds, when known.
    pub stream: Option<ManifestStream>,
}

/// The first half of an export, the part that needs the fold quiet: makes `stage` and copies the
/// committed fold into `stage/data` (with its `FOLDHOST.json`).
pub fn export_stage<S: SnapshotStore + ?Sized>(
    store: &S,
    backend: Backend,
    stage: &Path,
) -> Result<Staged, ArtifactError> {
    let data = make_stage(stage)?;
    let cursor = store.cursor();
    let stream = stream_of(store)?;
    let proven = store.export_to(&data)?;
    crate::storedir::write_meta(&data, backend)?;
    Ok(Staged {
        cursor,
        proven,
        stream,
    })
}

/// The stream `store` records (its reserved identity key), if any.
pub fn stream_of<S: SnapshotStore + ?Sized>(
    store: &S,
) -> Result<Option<ManifestStream>, ArtifactError> {
    Ok(store
        .get(crate::retained::IDENTITY_KEY)?
        .and_then(|e| crate::kv::StreamIdentity::from_bytes(&e.value))
        .map(|id| ManifestStream::from(&id)))
}

/// The second half of an export, off the fold's path: proves the staged copy (by the store's own
/// check made while writing it, or by reopening it: cursor equality), hashes every file the store
/// did not, fsyncs them all, writes the manifest last, and renames the stage to `out`. The stage
/// is removed on any failure.
pub fn seal(
    stage: &Path,
    out: &Path,
    staged: &Staged,
    scope: Option<String>,
    progress: Progress<'_>,
) -> Result<ExportManifest, ArtifactError> {
    or_discard(stage, seal_inner(stage, out, staged, scope, progress))
}

fn seal_inner(
    stage: &Path,
    out: &Path,
    staged: &Staged,
    scope: Option<String>,
    progress: Progress<'_>,
) -> Result<ExportManifest, ArtifactError> {
    let cursor = staged.cursor;
    crate::crashpoint::hit(crate::crashpoint::EXPORT_STAGED);
    let data = stage.join(DATA_DIR);
    let backend = crate::storedir::backend_of(&data)?;
    let names = list_files(&data)?;
    let mut total = 0u64;
    for n in &names {
        let p = data.join(check_path(n)?);
        total += std::fs::metadata(&p).map_err(io_err(&p, "stat"))?.len();
    }
    let proven = staged.proven.as_ref();
    let mut done = 0u64;
    let mut files = Vec::with_capacity(names.len());
    let mut syncs = Syncs::default();
    for n in names {
        let p = data.join(check_path(&n)?);
        let (size, blake3) = match proven.and_then(|c| c.files.iter().find(|f| f.path == n)) {
            Some(f) => {
                // Hashed as the store wrote it: check the file still has that size (assert after
                // writing), without reading it back.
                let got = std::fs::metadata(&p).map_err(io_err(&p, "stat"))?.len();
                if got != f.size {
                    return Err(ArtifactError::SizeMismatch {
                        path: n,
                        want: f.size,
                        got,
                    });
                }
                done += got;
                progress(done, total);
                (f.size, f.blake3.clone())
            }
            None => hash_file(&p, &mut |b| {
                done += b;
                progress(done, total);
            })?,
        };
        // Durable before the manifest names it (the backend's copy need not have been): the
        // disk wrote it back while it was hashed, so this is mostly a wait for the tail. Each
        // fsync runs beside the next file's hashing; all are waited for below.
        let f = File::open(&p).map_err(io_err(&p, "open to fsync"))?;
        syncs.push(p.clone(), f).map_err(io_err(&p, "fsync"))?;
        files.push(ArtifactFile {
            path: n,
            size,
            blake3,
        });
        crate::crashpoint::hit(crate::crashpoint::EXPORT_FILE);
    }
    if let Some(c) = proven
        && let Some(f) = c
            .files
            .iter()
            .find(|f| !files.iter().any(|a| a.path == f.path))
    {
        return Err(ArtifactError::MissingFile(f.path.clone()));
    }
    syncs
        .wait()
        .map_err(io_err(&data, "fsync the payload's files"))?;
    // Every directory of the payload, so each file's entry is durable too.
    let mut dirs: std::collections::BTreeSet<PathBuf> = std::collections::BTreeSet::new();
    dirs.insert(data.clone());
    for f in &files {
        if let Some(parent) = data.join(check_path(&f.path)?).parent() {
            dirs.insert(parent.to_path_buf());
        }
    }
    for d in &dirs {
        sync_dir(d)?;
    }
    let (got, keys) = match proven {
        Some(c) => (c.cursor, c.keys),
        None => {
            let (copy, _) = AnyStore::open_read_only(&data)?;
            if copy.backend() != backend.as_str() {
                return Err(ArtifactError::BackendMismatch {
                    artifact: backend.as_str().to_string(),
                    wanted: format!("the payload's own {}", copy.backend()),
                });
            }
            (copy.cursor(), copy.len()?)
        }
    };
    if got != cursor {
        return Err(ArtifactError::CursorMismatch {
            what: "verify of the exported copy",
            want: cursor.revision(),
            got: got.revision(),
        });
    }
    let manifest = ExportManifest {
        schema: SCHEMA,
        backend: backend.as_str().to_string(),
        format: format_generation(backend),
        cursor: cursor.revision(),
        scope,
        keys,
        created_unix_ms: now_ms(),
        files,
        stream: staged.stream.clone(),
        previous: Vec::new(),
    };
    let bytes = serde_json::to_vec_pretty(&manifest).map_err(|e| ArtifactError::Manifest {
        path: stage.join(MANIFEST_FILE),
        reason: e.to_string(),
    })?;
    let mpath = stage.join(MANIFEST_FILE);
    let mut f = File::create(&mpath).map_err(io_err(&mpath, "create"))?;
    f.write_all(&bytes).map_err(io_err(&mpath, "write"))?;
    f.sync_all().map_err(io_err(&mpath, "fsync"))?;
    sync_dir(stage)?;
    if out.exists() {
        return Err(ArtifactError::Exists(out.to_path_buf()));
    }
    std::fs::rename(stage, out).map_err(io_err(out, "rename stage into place"))?;
    sync_dir(out.parent().unwrap_or_else(|| Path::new(".")))?;
    Ok(manifest)
}

/// Exports `store` to the artifact directory `out` (which must not exist): stage, verify, hash,
/// manifest, rename. For a store no host is writing; a running host exports through
/// `foldhost::applied::export_live` instead.
pub fn export_store<S: SnapshotStore + ?Sized>(
    store: &S,
    backend: Backend,
    out: &Path,
    scope: Option<String>,
    progress: Progress<'_>,
) -> Result<ExportManifest, ArtifactError> {
    if out.exists() {
        return Err(ArtifactError::Exists(out.to_path_buf()));
    }
    let stage = stage_path(out, "export");
    let staged = or_discard(&stage, export_stage(store, backend, &stage))?;
    seal_to(&stage, out, &staged, scope, progress)
}

/// True when `out` names a tar file rather than an artifact directory.
pub fn is_tar(out: &Path) -> bool {
    out.extension().is_some_and(|e| e == "tar")
}

/// [`seal`] into `out`, or, when `out` ends in `.tar`, into a hidden directory packed into `out`.
pub fn seal_to(
    stage: &Path,
    out: &Path,
    staged: &Staged,
    scope: Option<String>,
    progress: Progress<'_>,
) -> Result<ExportManifest, ArtifactError> {
    if !is_tar(out) {
        return seal(stage, out, staged, scope, progress);
    }
    let dir = stage_path(out, "artifact");
    let m = seal(stage, &dir, staged, scope, progress)?;
    let r = pack_tar(&dir, out);
    discard(&dir);
    r.map(|()| m)
}

/// What a running fold's copy of itself into a stage answers: the cursor the copy holds and what
/// the store proved of it while writing it, or why it failed.
pub type LiveCopy = Result<(WatchCursor, Option<crate::snapshot::ProvenCopy>), ArtifactError>;

/// Exports the fold of a running host: `copy` has the fold flush and copy itself into the
/// directory it is given, between batches (paused only for the copy; the fold's loop does it,
/// `foldhost::applied::export_live`), then the stage is verified, hashed and sealed here, off the
/// fold's path, recording `stream` (the fold's stream, read by the caller before and after) in
/// the manifest.
pub async fn export_live_with<F, Fut>(
    copy: F,
    backend: Backend,
    out: PathBuf,
    scope: Option<String>,
    stream: Option<ManifestStream>,
) -> Result<ExportManifest, ArtifactError>
where
    F: FnOnce(PathBuf) -> Fut,
    Fut: std::future::Future<Output = LiveCopy>,
{
    if out.exists() {
        return Err(ArtifactError::Exists(out));
    }
    let stage = stage_path(&out, "export");
    let copied = async {
        let data = make_stage(&stage)?;
        let (cursor, proven) = copy(data.clone()).await?;
        crate::storedir::write_meta(&data, backend)?;
        Ok(Staged {
            cursor,
            proven,
            stream,
        })
    };
    let staged = or_discard(&stage, copied.await)?;
    tokio::task::spawn_blocking(move || seal_to(&stage, &out, &staged, scope, &mut |_, _| {}))
        .await
        .map_err(|e| ArtifactError::Fold(format!("export task: {e}")))?
}

/// Reads and checks an artifact's manifest: size cap, schema, file count, every path.
pub fn read_manifest(artifact: &Path) -> Result<ExportManifest, ArtifactError> {
    let path = artifact.join(MANIFEST_FILE);
    let f = File::open(&path).map_err(io_err(&path, "open manifest"))?;
    let mut bytes = Vec::new();
    f.take(MAX_MANIFEST_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err(&path, "read manifest"))?;
    parse_manifest(&bytes, &path)
}

/// Reads and checks the manifest of a `.tar` artifact without unpacking it: the manifest is the
/// tar's first entry ([`pack_tar`] writes it first).
pub fn peek_tar_manifest(tar_path: &Path) -> Result<ExportManifest, ArtifactError> {
    let bad = |reason: String| ArtifactError::Tar {
        path: tar_path.to_path_buf(),
        reason,
    };
    let file = File::open(tar_path).map_err(io_err(tar_path, "open"))?;
    let mut archive = tar::Archive::new(TarGuard::new(std::io::BufReader::new(file)));
    let mut entries = archive.entries().map_err(|e| bad(e.to_string()))?;
    let mut first = entries
        .next()
        .ok_or_else(|| bad("empty".into()))?
        .map_err(|e| bad(e.to_string()))?;
    if *first.path_bytes() != *MANIFEST_FILE.as_bytes() {
        return Err(bad(format!("the first entry is not {MANIFEST_FILE}")));
    }
    let mut bytes = Vec::new();
    (&mut first)
        .take(MAX_MANIFEST_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| bad(e.to_string()))?;
    parse_manifest(&bytes, &tar_path.join(MANIFEST_FILE))
}

/// Parses and checks manifest bytes read from `path`.
fn parse_manifest(bytes: &[u8], path: &Path) -> Result<ExportManifest, ArtifactError> {
    let bad = |reason: String| ArtifactError::Manifest {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(bad(format!("larger than {MAX_MANIFEST_BYTES} bytes")));
    }
    let m: ExportManifest =
        serde_json::from_slice(bytes).map_err(|e| bad(format!("unreadable: {e}")))?;
    if !(1..=SCHEMA).contains(&m.schema) {
        return Err(bad(format!(
            "schema {} is not one this build reads (1..={SCHEMA})",
            m.schema
        )));
    }
    if m.files.len() > MAX_FILES {
        return Err(bad(format!("{} files, over {MAX_FILES}", m.files.len())));
    }
    for f in &m.files {
        check_path(&f.path)?;
    }
    if m.previous.len() > MAX_PREVIOUS_TARGETS {
        return Err(bad(format!(
            "{} previous targets, over {MAX_PREVIOUS_TARGETS}",
            m.previous.len()
        )));
    }
    if let Some(s) = &m.stream
        && (s.name.is_empty() || s.name.len() > 255)
    {
        return Err(bad("the stream's name is empty or over 255 bytes".into()));
    }
    Ok(m)
}

/// Imports the artifact at `artifact` (a directory, or a `.tar` of one) as the store `dest`, which
/// must not exist (or be an empty directory). `want` is the backend the caller expects (`None`:
/// whatever the artifact holds, if this build has it). Returns the manifest. On every refusal
/// `dest` is untouched.
pub fn import_artifact(
    artifact: &Path,
    dest: &Path,
    want: Option<Backend>,
    progress: Progress<'_>,
) -> Result<ExportManifest, ArtifactError> {
    if artifact.is_file() {
        let unpacked = stage_path(dest, "unpack");
        let r = unpack_tar(artifact, &unpacked)
            .and_then(|()| import_dir(&unpacked, dest, want, progress));
        discard(&unpacked);
        return r;
    }
    import_dir(artifact, dest, want, progress)
}

fn dest_is_free(dest: &Path) -> Result<bool, ArtifactError> {
    match std::fs::read_dir(dest) {
        Ok(mut it) => Ok(it.next().is_none()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(ArtifactError::Io {
            path: dest.to_path_buf(),
            op: "inspect destination",
            source: e,
        }),
    }
}

/// A streaming check of the append log's file, when `m` is an append-log artifact.
fn log_check_for(m: &ExportManifest, stage: &Path) -> Option<crate::snapshot::CompactLogCheck> {
    (m.backend == Backend::AppendLog.as_str())
        .then(|| crate::snapshot::CompactLogCheck::new(&stage.join(crate::snapshot::LOG_FILE)))
}

/// The refusals that need nothing opened: the manifest's backend (this build's, and `want`),
/// its format generation, and a free destination.
fn check_importable(
    m: &ExportManifest,
    dest: &Path,
    want: Option<Backend>,
) -> Result<(), ArtifactError> {
    let backend: Backend =
        m.backend
            .parse()
            .map_err(|reason: String| ArtifactError::BackendMismatch {
                artifact: m.backend.clone(),
                wanted: reason,
            })?;
    if let Some(w) = want
        && w != backend
    {
        return Err(ArtifactError::BackendMismatch {
            artifact: m.backend.clone(),
            wanted: w.as_str().to_string(),
        });
    }
    if m.format != format_generation(backend) {
        return Err(ArtifactError::BackendMismatch {
            artifact: format!("{} format {}", m.backend, m.format),
            wanted: format!("{} format {}", backend.as_str(), format_generation(backend)),
        });
    }
    if !dest_is_free(dest)? {
        return Err(ArtifactError::Exists(dest.to_path_buf()));
    }
    Ok(())
}

fn import_dir(
    artifact: &Path,
    dest: &Path,
    want: Option<Backend>,
    progress: Progress<'_>,
) -> Result<ExportManifest, ArtifactError> {
    let m = read_manifest(artifact)?;
    check_importable(&m, dest, want)?;
    let data = artifact.join(DATA_DIR);
    let present = list_files(&data)?;
    let listed: std::collections::BTreeSet<&str> =
        m.files.iter().map(|f| f.path.as_str()).collect();
    if let Some(extra) = present.iter().find(|p| !listed.contains(p.as_str())) {
        return Err(ArtifactError::ExtraFile(extra.clone()));
    }
    let present: std::collections::BTreeSet<&str> = present.iter().map(String::as_str).collect();
    if let Some(missing) = m.files.iter().find(|f| !present.contains(f.path.as_str())) {
        return Err(ArtifactError::MissingFile(missing.path.clone()));
    }
    let stage = stage_path(dest, "import");
    or_discard(&stage, import_stage(artifact, &m, &stage, dest, progress)).map(|()| m)
}

fn import_stage(
    artifact: &Path,
    m: &ExportManifest,
    stage: &Path,
    dest: &Path,
    progress: Progress<'_>,
) -> Result<(), ArtifactError> {
    let data = artifact.join(DATA_DIR);
    let total: u64 = m.files.iter().map(|f| f.size).sum();
    let mut done = 0u64;
    let mut log_check = log_check_for(m, stage);
    let mut syncs = Syncs::default();
    for f in &m.files {
        let rel = check_path(&f.path)?;
        let src = data.join(&rel);
        let got_size = std::fs::metadata(&src).map_err(io_err(&src, "stat"))?.len();
        if got_size != f.size {
            return Err(ArtifactError::SizeMismatch {
                path: f.path.clone(),
                want: f.size,
                got: got_size,
            });
        }
        let dst = stage.join(&rel);
        if let Some(parent) = dst.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(parent, "create stage"))?;
        }
        let mut out = StagedFile::create(&dst, true).map_err(io_err(&dst, "create"))?;
        let check = log_check
            .as_mut()
            .filter(|_| f.path == crate::snapshot::LOG_FILE);
        let (size, digest) = copy_hashed(
            &src,
            &mut out,
            &mut |b| {
                done += b;
                progress(done, total);
            },
            check,
        )?;
        if size != f.size {
            return Err(ArtifactError::SizeMismatch {
                path: f.path.clone(),
                want: f.size,
                got: size,
            });
        }
        if digest != f.blake3 {
            return Err(ArtifactError::HashMismatch {
                path: f.path.clone(),
                want: f.blake3.clone(),
                got: digest,
            });
        }
        out.finish_syncing_in(&mut syncs)
            .map_err(io_err(&dst, "write and fsync"))?;
    }
    seal_import(stage, m, dest, log_check, syncs)
}

/// The last step of every import: the staged copy must open as the manifest's backend and recover
/// the manifest's cursor; then it is synced and renamed into `dest`.
fn seal_import(
    stage: &Path,
    m: &ExportManifest,
    dest: &Path,
    log_check: Option<crate::snapshot::CompactLogCheck>,
    syncs: Syncs,
) -> Result<(), ArtifactError> {
    tracing::debug!(stage = %stage.display(), "import: every file written, checking the copy");
    let got = match log_check {
        // The append log was checked as it was copied: no reopen (no map) needed.
        Some(c) => {
            let own = crate::storedir::backend_of(stage)?;
            if own.as_str() != m.backend {
                return Err(ArtifactError::BackendMismatch {
                    artifact: m.backend.clone(),
                    wanted: format!("the payload's own {}", own.as_str()),
                });
            }
            c.finish()?.0.revision()
        }
        None => {
            let (copy, _) = AnyStore::open_read_only(stage)?;
            if copy.backend() != m.backend {
                return Err(ArtifactError::BackendMismatch {
                    artifact: m.backend.clone(),
                    wanted: format!("the payload's own {}", copy.backend()),
                });
            }
            copy.cursor().revision()
        }
    };
    if got != m.cursor {
        return Err(ArtifactError::CursorMismatch {
            what: "the imported copy",
            want: m.cursor,
            got,
        });
    }
    tracing::debug!(cursor = got, "import: the copy reopened at its cursor");
    // Every file's fsync (started as each was written) before the stage is renamed into place.
    syncs
        .wait()
        .map_err(io_err(stage, "fsync the imported files"))?;
    sync_dir(stage)?;
    tracing::debug!("import: every file synced");
    if dest.exists() {
        // An empty directory (checked free before): replace it.
        std::fs::remove_dir(dest).map_err(io_err(dest, "replace empty destination"))?;
    }
    std::fs::rename(stage, dest).map_err(io_err(dest, "rename stage into place"))?;
    sync_dir(dest.parent().unwrap_or_else(|| Path::new(".")))
}

/// Imports an artifact straight from its tar stream `reader` (a download, never stored as a tar):
/// each payload file is written once, into the stage, while it is hashed. `pointer` is the
/// manifest the caller was given (an object store's pointer): the tar's embedded manifest must be
/// byte for byte the same, and every file must be listed in it, once, with its size and digest.
/// Then the same gate as every import (reopen, cursor) before the rename into `dest`. On every
/// refusal `dest` is untouched and the stage removed. Memory: the import's one block buffer (the
/// staged file's), the manifest entry (at most [`MAX_MANIFEST_BYTES`], compared with the pointer)
/// and an extension entry at most [`MAX_TAR_EXTENSION_BYTES`] ([`TarGuard`]); never a payload
/// entry, whatever its header announces.
pub fn import_tar_stream(
    reader: impl Read,
    pointer: &[u8],
    dest: &Path,
    want: Option<Backend>,
    progress: Progress<'_>,
) -> Result<ExportManifest, ArtifactError> {
    let m = parse_manifest(pointer, &dest.join(MANIFEST_FILE))?;
    check_importable(&m, dest, want)?;
    let stage = stage_path(dest, "import");
    let (log_check, syncs) = or_discard(
        &stage,
        import_tar_entries(reader, pointer, &m, &stage, progress),
    )?;
    or_discard(&stage, seal_import(&stage, &m, dest, log_check, syncs)).map(|()| m)
}

fn import_tar_entries(
    reader: impl Read,
    pointer: &[u8],
    m: &ExportManifest,
    stage: &Path,
    progress: Progress<'_>,
) -> Result<(Option<crate::snapshot::CompactLogCheck>, Syncs), ArtifactError> {
    let bad = |reason: String| ArtifactError::Tar {
        path: stage.to_path_buf(),
        reason,
    };
    std::fs::create_dir_all(stage).map_err(io_err(stage, "create stage"))?;
    let mut log_check = log_check_for(m, stage);
    let listed: std::collections::BTreeMap<&str, &ArtifactFile> =
        m.files.iter().map(|f| (f.path.as_str(), f)).collect();
    let mut seen = std::collections::BTreeSet::new();
    let mut manifest_seen = false;
    let total: u64 = m.files.iter().map(|f| f.size).sum();
    let mut done = 0u64;
    let mut syncs = Syncs::default();
    let mut archive = tar::Archive::new(TarGuard::new(reader));
    let entries = archive.entries().map_err(|e| bad(e.to_string()))?;
    for (count, entry) in entries.enumerate() {
        let mut entry = entry.map_err(|e| bad(e.to_string()))?;
        if count > MAX_FILES + 1 {
            return Err(bad(format!("more than {MAX_FILES} entries")));
        }
        let raw = entry.path_bytes().into_owned();
        let name = String::from_utf8(raw).map_err(|_| bad("an entry path is not UTF-8".into()))?;
        let name = name.trim_end_matches('/').to_string();
        check_path(&name)?;
        let kind = entry.header().entry_type();
        if kind.is_dir() {
            continue;
        }
        if !kind.is_file() {
            return Err(ArtifactError::EntryType {
                path: name,
                kind: format!("{kind:?}"),
            });
        }
        if name == MANIFEST_FILE {
            let mut embedded = Vec::new();
            (&mut entry)
                .take(MAX_MANIFEST_BYTES + 1)
                .read_to_end(&mut embedded)
                .map_err(|e| bad(e.to_string()))?;
            if embedded != pointer {
                return Err(bad("its embedded manifest is not the pointer's".into()));
            }
            manifest_seen = true;
            continue;
        }
        let rel_name = name
            .strip_prefix(DATA_DIR)
            .and_then(|r| r.strip_prefix('/'))
            .ok_or_else(|| ArtifactError::ExtraFile(name.clone()))?;
        let f = listed
            .get(rel_name)
            .ok_or_else(|| ArtifactError::ExtraFile(rel_name.to_string()))?;
        if !seen.insert(rel_name.to_string()) {
            return Err(bad(format!("{rel_name}: in the tar twice")));
        }
        let size = entry.header().size().map_err(|e| bad(e.to_string()))?;
        if size != f.size {
            return Err(ArtifactError::SizeMismatch {
                path: f.path.clone(),
                want: f.size,
                got: size,
            });
        }
        let dst = stage.join(check_path(rel_name)?);
        if let Some(parent) = dst.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(parent, "create stage"))?;
        }
        let mut out = StagedFile::create(&dst, true).map_err(io_err(&dst, "create"))?;
        let mut hasher = blake3::Hasher::new();
        let mut n = 0u64;
        loop {
            let spare = out.spare();
            let got = entry
                .read(spare)
                .map_err(io_err(&dst, "read the download"))?;
            if got == 0 {
                break;
            }
            hasher.update(&spare[..got]);
            if rel_name == crate::snapshot::LOG_FILE
                && let Some(c) = log_check.as_mut()
            {
                c.feed(&spare[..got]);
            }
            out.commit(got).map_err(io_err(&dst, "write"))?;
            n += got as u64;
            done += got as u64;
            progress(done, total);
        }
        let digest = hasher.finalize().to_hex().to_string();
        if n != f.size {
            return Err(ArtifactError::SizeMismatch {
                path: f.path.clone(),
                want: f.size,
                got: n,
            });
        }
        if digest != f.blake3 {
            return Err(ArtifactError::HashMismatch {
                path: f.path.clone(),
                want: f.blake3.clone(),
                got: digest,
            });
        }
        out.finish_syncing_in(&mut syncs)
            .map_err(io_err(&dst, "write and fsync"))?;
    }
    if !manifest_seen {
        return Err(bad(format!("no {MANIFEST_FILE} in the payload")));
    }
    if let Some(missing) = m.files.iter().find(|f| !seen.contains(&f.path)) {
        return Err(ArtifactError::MissingFile(missing.path.clone()));
    }
    Ok((log_check, syncs))
}

/// Packs the artifact directory `artifact` into the tar file `out` (written beside, then renamed).
pub fn pack_tar(artifact: &Path, out: &Path) -> Result<(), ArtifactError> {
    pack_tar_with(artifact, out, None)
}

/// [`pack_tar`] with `manifest` (checked, and naming the same files) as the tar's manifest
/// instead of the artifact's own: a publish adds the pointer's previous targets.
pub fn pack_tar_with(
    artifact: &Path,
    out: &Path,
    manifest: Option<&[u8]>,
) -> Result<(), ArtifactError> {
    let m = read_manifest(artifact)?;
    if let Some(bytes) = manifest {
        let given = parse_manifest(bytes, &artifact.join(MANIFEST_FILE))?;
        if given.files != m.files {
            return Err(ArtifactError::Manifest {
                path: artifact.join(MANIFEST_FILE),
                reason: "the manifest to publish lists other files than the artifact's".into(),
            });
        }
    }
    let tmp = stage_path(out, "tar");
    let r = (|| {
        let file = File::create(&tmp).map_err(io_err(&tmp, "create"))?;
        let mut b = tar::Builder::new(std::io::BufWriter::new(file));
        let tar_err = |e: std::io::Error| ArtifactError::Io {
            path: out.to_path_buf(),
            op: "write tar",
            source: e,
        };
        match manifest {
            None => b
                .append_path_with_name(artifact.join(MANIFEST_FILE), MANIFEST_FILE)
                .map_err(tar_err)?,
            Some(bytes) => {
                let mut h = tar::Header::new_gnu();
                h.set_size(bytes.len() as u64);
                h.set_mode(0o644);
                h.set_mtime(0);
                h.set_entry_type(tar::EntryType::Regular);
                b.append_data(&mut h, MANIFEST_FILE, bytes)
                    .map_err(tar_err)?;
            }
        }
        for f in &m.files {
            let rel = check_path(&f.path)?;
            b.append_path_with_name(
                artifact.join(DATA_DIR).join(&rel),
                Path::new(DATA_DIR).join(&rel),
            )
            .map_err(tar_err)?;
        }
        let w = b.into_inner().map_err(tar_err)?;
        let file = w.into_inner().map_err(|e| tar_err(e.into_error()))?;
        file.sync_all().map_err(io_err(&tmp, "fsync"))?;
        std::fs::rename(&tmp, out).map_err(io_err(out, "rename tar into place"))
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// Unpacks a tar into the new directory `into`, refusing unsafe paths and anything but regular
/// files and directories.
fn unpack_tar(tar_path: &Path, into: &Path) -> Result<(), ArtifactError> {
    let bad = |reason: String| ArtifactError::Tar {
        path: tar_path.to_path_buf(),
        reason,
    };
    std::fs::create_dir_all(into).map_err(io_err(into, "create unpack dir"))?;
    let file = File::open(tar_path).map_err(io_err(tar_path, "open"))?;
    let mut archive = tar::Archive::new(TarGuard::new(std::io::BufReader::new(file)));
    let entries = archive.entries().map_err(|e| bad(e.to_string()))?;
    let mut count = 0usize;
    for entry in entries {
        let mut entry = entry.map_err(|e| bad(e.to_string()))?;
        count += 1;
        if count > MAX_FILES + 1 {
            return Err(bad(format!("more than {MAX_FILES} entries")));
        }
        let raw = entry.path_bytes().into_owned();
        let name = String::from_utf8(raw).map_err(|_| bad("an entry path is not UTF-8".into()))?;
        let name = name.trim_end_matches('/');
        let rel = check_path(name)?;
        let kind = entry.header().entry_type();
        if kind.is_dir() {
            let d = into.join(&rel);
            std::fs::create_dir_all(&d).map_err(io_err(&d, "create"))?;
            continue;
        }
        if !kind.is_file() {
            return Err(ArtifactError::EntryType {
                path: name.to_string(),
                kind: format!("{kind:?}"),
            });
        }
        let size = entry.header().size().map_err(|e| bad(e.to_string()))?;
        if size > MAX_FILE_BYTES {
            return Err(bad(format!("{name}: {size} bytes, over {MAX_FILE_BYTES}")));
        }
        let dst = into.join(&rel);
        if let Some(parent) = dst.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(parent, "create"))?;
        }
        let mut out = File::create(&dst).map_err(io_err(&dst, "create"))?;
        std::io::copy(&mut (&mut entry).take(size), &mut out).map_err(io_err(&dst, "unpack"))?;
    }
    Ok(())
}

/// The tar entry types whose body the `tar` crate reads whole into memory: GNU long name and long
/// link, PAX local and global extensions.
const TAR_EXTENSIONS: [u8; 4] = [b'L', b'K', b'x', b'g'];

/// A reader in front of the `tar` crate that parses every 512-byte header as it passes and
/// refuses, before any byte of its body is read, an extension entry larger than
/// [`MAX_TAR_EXTENSION_BYTES`] (the `tar` crate would read it whole: a 1 GiB `L` entry would be a
/// 1 GiB allocation), a GNU sparse entry (its extra header blocks would move the entry
/// boundaries this reader counts; no artifact holds one) and a PAX `size` record (it would
/// override the header's length). It follows the archive entry by entry: a header, then the
/// body rounded up to 512 bytes; an all-zero header ends the archive, and what follows passes
/// unchecked (the `tar` crate reads nothing after it). Its own memory: one header block and a PAX
/// body (bounded as above).
pub struct TarGuard<R> {
    inner: R,
    /// Offset in the archive of the next byte read.
    offset: u64,
    header: [u8; 512],
    /// Bytes of `header` collected.
    filled: usize,
    /// Body (and padding) bytes left before the next header.
    body_left: u64,
    /// A PAX body being collected, and how many of its bytes are still to come.
    pax: Option<(Vec<u8>, u64)>,
    ended: bool,
    /// The refusal, repeated to every later read.
    refused: Option<String>,
}

impl<R> TarGuard<R> {
    /// Guards `inner`.
    pub fn new(inner: R) -> Self {
        TarGuard {
            inner,
            offset: 0,
            header: [0; 512],
            filled: 0,
            body_left: 0,
            pax: None,
            ended: false,
            refused: None,
        }
    }

    /// A tar header's size field as the `tar` crate reads it (octal text up to a NUL, spaces
    /// trimmed; or, with the high bit set, binary in its last 8 bytes); `None` when it is neither.
    fn size_field(field: &[u8]) -> Option<u64> {
        if field.first()? & 0x80 != 0 {
            let tail = field.get(field.len().checked_sub(8)?..)?;
            return Some(u64::from_be_bytes(tail.try_into().ok()?));
        }
        let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
        let text = std::str::from_utf8(&field[..end]).ok()?;
        u64::from_str_radix(text.trim(), 8).ok()
    }

    /// Checks the header just collected (which started at `at`) and sets up its body.
    fn header_done(&mut self, at: u64) -> Result<(), String> {
        if self.header.iter().all(|&b| b == 0) {
            self.ended = true;
            return Ok(());
        }
        let kind = self.header[156];
        let size = Self::size_field(&self.header[124..136])
            .ok_or_else(|| format!("tar header at byte {at}: an unreadable size field"))?;
        if kind == b'S' {
            return Err(format!(
                "tar header at byte {at}: a GNU sparse entry (never part of an artifact)"
            ));
        }
        if TAR_EXTENSIONS.contains(&kind) && size > MAX_TAR_EXTENSION_BYTES {
            return Err(format!(
                "tar header at byte {at}: a {} extension entry of {size} bytes, over the limit of {MAX_TAR_EXTENSION_BYTES}",
                match kind {
                    b'L' => "GNU long-name (L)",
                    b'K' => "GNU long-link (K)",
                    b'x' => "PAX (x)",
                    _ => "PAX global (g)",
                }
            ));
        }
        if kind == b'x' && size > 0 {
            self.pax = Some((Vec::with_capacity(size as usize), size));
        }
        self.body_left = size
            .checked_add(511)
            .map(|s| s & !511)
            .ok_or_else(|| format!("tar header at byte {at}: size {size} overflows"))?;
        Ok(())
    }

    /// Follows the archive over `bytes` (just read, starting at `self.offset`).
    fn follow(&mut self, mut bytes: &[u8]) -> Result<(), String> {
        while !bytes.is_empty() && !self.ended {
            if self.body_left > 0 {
                let n = bytes
                    .len()
                    .min(usize::try_from(self.body_left).unwrap_or(usize::MAX));
                if let Some((buf, left)) = &mut self.pax {
                    let take = n.min(usize::try_from(*left).unwrap_or(usize::MAX));
                    buf.extend_from_slice(&bytes[..take]);
                    *left -= take as u64;
                    if *left == 0 {
                        let body = std::mem::take(buf);
                        self.pax = None;
                        if body.windows(6).any(|w| w == b" size=") {
                            return Err(format!(
                                "tar entry before byte {}: a PAX size record (entry lengths are read from the headers)",
                                self.offset
                            ));
                        }
                    }
                }
                self.body_left -= n as u64;
                self.offset += n as u64;
                bytes = &bytes[n..];
                continue;
            }
            let n = bytes.len().min(512 - self.filled);
            self.header[self.filled..self.filled + n].copy_from_slice(&bytes[..n]);
            self.filled += n;
            self.offset += n as u64;
            bytes = &bytes[n..];
            if self.filled == 512 {
                self.filled = 0;
                self.header_done(self.offset - 512)?;
            }
        }
        Ok(())
    }
}

impl<R: Read> Read for TarGuard<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(why) = &self.refused {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                why.clone(),
            ));
        }
        let n = self.inner.read(buf)?;
        if let Err(why) = self.follow(&buf[..n]) {
            self.refused = Some(why.clone());
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, why));
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_relative_paths_pass() {
        for ok in [
            "fold.log",
            "data/fold.log",
            "a/b/c",
            "FOLDHOST.json",
            "x..y",
        ] {
            assert!(check_path(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../b",
            "a/./b",
            ".",
            "..",
            "a//b",
            "a/",
            "a\\b",
            "a\0b",
        ] {
            assert!(
                matches!(check_path(bad), Err(ArtifactError::UnsafePath(_))),
                "{bad:?} passed"
            );
        }
    }

    /// An append-log store of a few keys, opened writable in `dir`.
    fn small_log(dir: &Path) -> AnyStore {
        use crate::kv::{KvEntry, KvUpdate, VersionToken};
        let (mut store, _) = AnyStore::open(dir, Backend::AppendLog).expect("open");
        let batch: Vec<KvUpdate> = (1..=50u64)
            .map(|r| {
                KvUpdate::Put(KvEntry {
                    key: format!("k{r:03}"),
                    value: vec![b'v'; 100].into(),
                    version: VersionToken::from_u64(r),
                })
            })
            .collect();
        store.apply(&batch, WatchCursor::at(50)).expect("apply");
        store
    }

    #[test]
    fn a_sealed_export_lists_the_digest_the_store_computed_and_it_is_the_files_own() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let store = small_log(&tmp.path().join("src"));
        let out = tmp.path().join("art");
        let m =
            export_store(&store, Backend::AppendLog, &out, None, &mut |_, _| {}).expect("export");
        assert_eq!((m.cursor, m.keys), (Some(50), 50));
        for f in &m.files {
            let bytes = std::fs::read(out.join(DATA_DIR).join(&f.path)).expect("read");
            assert_eq!(f.size, bytes.len() as u64, "{}", f.path);
            assert_eq!(
                f.blake3,
                blake3::hash(&bytes).to_hex().to_string(),
                "{}",
                f.path
            );
        }
        let dest = tmp.path().join("node");
        import_artifact(&out, &dest, None, &mut |_, _| {}).expect("the export imports");
    }

    #[test]
    fn a_proven_file_changed_between_the_copy_and_the_seal_is_refused_and_leaves_no_artifact() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let store = small_log(&tmp.path().join("src"));
        let out = tmp.path().join("art");
        let stage = stage_path(&out, "export");
        let staged = export_stage(&store, Backend::AppendLog, &stage).expect("stage");
        assert!(staged.proven.is_some(), "the append log proves its copy");
        let log = stage.join(DATA_DIR).join(crate::snapshot::LOG_FILE);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&log)
            .expect("open");
        f.write_all(b"x").expect("append");
        drop(f);
        let err = seal(&stage, &out, &staged, None, &mut |_, _| {}).expect_err("refused");
        assert!(
            matches!(err, ArtifactError::SizeMismatch { .. }),
            "refused as a size mismatch: {err}"
        );
        assert!(!out.exists(), "no artifact");
        assert!(!stage.exists(), "the stage is discarded");
    }

    #[test]
    fn a_stage_is_recognised_by_its_name_and_nothing_else_is() {
        assert_eq!(stage_owner("art", ".art.import-123-456"), Some(123));
        assert_eq!(stage_owner("a.tar", ".a.tar.tar-9-0"), Some(9));
        for other in [
            "art",
            ".art.import-123",
            ".art.import-x-1",
            ".art.import--1",
            ".art.copy-1-2",
            ".other.import-1-2",
            ".artx.import-1-2",
            ".art.import-1-2-3",
        ] {
            assert_eq!(stage_owner("art", other), None, "{other}");
        }
    }

    #[test]
    fn a_stage_left_by_a_process_that_is_gone_is_removed_by_the_next_one_beside_it() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dest = tmp.path().join("node");
        // Above any pid_max Linux allows (2^22): no process has it.
        let dead = tmp.path().join(".node.import-4194400-1");
        let young = tmp.path().join(".node.import-4194401-1");
        let mine = tmp
            .path()
            .join(format!(".node.import-{}-1", std::process::id()));
        let unrelated = tmp.path().join(".other.import-4194400-1");
        for d in [&dead, &young, &mine, &unrelated] {
            std::fs::create_dir_all(d.join("data")).expect("mkdir");
            std::fs::write(d.join("data/f"), b"x").expect("write");
        }
        let tar = tmp.path().join(".node.tar-4194400-2");
        std::fs::write(&tar, b"x").expect("write");
        let old = std::time::SystemTime::now() - STALE_STAGE_AGE * 2;
        for p in [&dead, &mine, &unrelated, &tar] {
            File::open(p)
                .and_then(|f| f.set_modified(old))
                .expect("age the stage");
        }
        let stage = stage_path(&dest, "import");
        assert!(!dead.exists() && !tar.exists(), "stale stages removed");
        assert!(
            young.exists(),
            "a young stage may belong to a live process elsewhere"
        );
        assert!(mine.exists(), "this process's own stage is kept");
        assert!(unrelated.exists(), "another target's stage is kept");
        assert!(!stage.exists());
    }

    /// A reader of `head` followed by zeros without end, counting what was read.
    struct Endless<'a> {
        head: Vec<u8>,
        at: usize,
        read: &'a std::cell::Cell<u64>,
    }

    impl Read for Endless<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = buf.len();
            for (i, b) in buf.iter_mut().enumerate() {
                *b = self.head.get(self.at + i).copied().unwrap_or(0);
            }
            self.at += n;
            self.read.set(self.read.get() + n as u64);
            Ok(n)
        }
    }

    /// A tar header of `kind` announcing `size` bytes.
    fn header(kind: tar::EntryType, name: &str, size: u64) -> Vec<u8> {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(0o644);
        h.set_path(name).expect("path");
        h.set_cksum();
        h.as_bytes().to_vec()
    }

    #[test]
    fn a_tar_extension_entry_over_the_limit_is_refused_from_its_header_before_its_body_is_read() {
        use tar::EntryType as E;
        let tmp = tempfile::tempdir().expect("tempdir");
        let pointer = serde_json::to_vec(&ExportManifest {
            schema: SCHEMA,
            backend: "append-log".into(),
            format: 1,
            cursor: Some(1),
            scope: None,
            keys: 0,
            created_unix_ms: 0,
            files: vec![],
            stream: None,
            previous: vec![],
        })
        .expect("json");
        for (kind, words) in [
            (E::GNULongName, "GNU long-name (L)"),
            (E::GNULongLink, "GNU long-link (K)"),
            (E::XHeader, "PAX (x)"),
            (E::XGlobalHeader, "PAX global (g)"),
        ] {
            // 1 GiB announced; the body would be zeros without end.
            let read = std::cell::Cell::new(0);
            let src = Endless {
                head: header(kind, "x", 1 << 30),
                at: 0,
                read: &read,
            };
            let dest = tmp.path().join(format!("node-{kind:?}"));
            let err =
                import_tar_stream(src, &pointer, &dest, None, &mut |_, _| {}).expect_err("refused");
            let line = err.to_string();
            assert!(
                line.contains(words)
                    && line.contains("1073741824 bytes")
                    && line.contains(&format!("limit of {MAX_TAR_EXTENSION_BYTES}")),
                "{kind:?}: {line}"
            );
            assert!(!line.contains('\n'), "one line: {line}");
            assert!(
                read.get() < 1 << 20,
                "{kind:?}: {} bytes read before the refusal",
                read.get()
            );
            assert!(!dest.exists());
            // The same through the guard alone, for a tar file's readers (peek, unpack).
            let read = std::cell::Cell::new(0);
            let mut archive = tar::Archive::new(TarGuard::new(Endless {
                head: header(kind, "x", 1 << 30),
                at: 0,
                read: &read,
            }));
            let first = archive.entries().expect("entries").next();
            assert!(matches!(first, Some(Err(_))), "{kind:?}");
            assert!(read.get() < 1 << 20, "{kind:?}: {} bytes read", read.get());
        }
    }

    #[test]
    fn a_tar_file_with_a_huge_long_name_is_refused_by_peek_and_import_without_reading_it() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let tar_path = tmp.path().join("a.tar");
        // A sparse file: a 1 GiB `L` entry's header, then a hole the size of its body.
        let f = File::create(&tar_path).expect("create");
        {
            use std::os::unix::fs::FileExt as _;
            f.write_all_at(&header(tar::EntryType::GNULongName, "x", 1 << 30), 0)
                .expect("write");
        }
        f.set_len((1 << 30) + 4096).expect("sparse");
        drop(f);
        for line in [
            peek_tar_manifest(&tar_path).expect_err("peek").to_string(),
            import_artifact(&tar_path, &tmp.path().join("node"), None, &mut |_, _| {})
                .expect_err("import")
                .to_string(),
        ] {
            assert!(
                line.contains("GNU long-name (L)") && line.contains("over the limit"),
                "{line}"
            );
        }
        assert!(!tmp.path().join("node").exists());
    }

    #[test]
    fn small_extension_entries_pass_and_a_pax_size_record_or_a_sparse_entry_is_refused() {
        // A long path (a GNU `L` entry of its own) packs and reads back through the guard.
        let mut b = tar::Builder::new(Vec::new());
        let long = format!("data/{}", "d".repeat(150));
        let mut h = tar::Header::new_gnu();
        h.set_size(3);
        h.set_mode(0o644);
        b.append_data(&mut h, &long, &b"abc"[..]).expect("append");
        let bytes = b.into_inner().expect("finish");
        let mut archive = tar::Archive::new(TarGuard::new(&bytes[..]));
        let names: Vec<String> = archive
            .entries()
            .expect("entries")
            .map(|e| String::from_utf8(e.expect("entry").path_bytes().into_owned()).expect("utf8"))
            .collect();
        assert_eq!(names, vec![long]);

        // A PAX record overriding the next entry's size.
        let record = b"20 size=9999999999\n";
        let mut tar = header(tar::EntryType::XHeader, "pax", record.len() as u64);
        tar.extend_from_slice(record);
        tar.resize(1024, 0);
        tar.extend_from_slice(&header(tar::EntryType::Regular, "f", 0));
        tar.resize(4096, 0);
        let mut archive = tar::Archive::new(TarGuard::new(&tar[..]));
        let e = archive
            .entries()
            .expect("entries")
            .find_map(|e| e.err())
            .expect("refused");
        assert!(e.to_string().contains("PAX size record"), "{e}");

        let mut tar = header(tar::EntryType::GNUSparse, "s", 0);
        tar.resize(2048, 0);
        let mut archive = tar::Archive::new(TarGuard::new(&tar[..]));
        let e = archive
            .entries()
            .expect("entries")
            .find_map(|e| e.err())
            .expect("refused");
        assert!(e.to_string().contains("GNU sparse"), "{e}");
    }

    #[test]
    fn stages_are_hidden_siblings() {
        let s = stage_path(Path::new("/x/y/art"), "export");
        assert_eq!(s.parent(), Some(Path::new("/x/y")));
        assert!(
            s.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(".art.export-"))
        );
    }
}
