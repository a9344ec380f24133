//! Artifacts: a verified, self-describing copy of a fold that another node imports to start from
//! (docs/design.md, "Artifacts").
//!
//! An artifact is a directory (or the same tree in one tar file, for transport):
//! - `data/` — the backend's own files, plus `FOLDHOST.json`: a complete store directory, with the
//!   guest's state buckets' folds under `data/state/<local>/` as a store keeps them
//!   (docs/state.md), each listed in the manifest's `state` with its own cursor;
//! - `MANIFEST.json` — [`ExportManifest`]: schema, backend and format generation, the cursor the
//!   payload is exactly consistent with, the exporting watch's scope, and every file's size and
//!   BLAKE3 digest.
//!
//! Invariants:
//! - **An artifact that exists is complete.** Export writes into a hidden sibling directory
//!   (`.NAME.export-…`), proves the copy recovers the live cursor (every apply commits its cursor
//!   with its data, so equality is a complete tail-loss detector) — an LSM copy by reopening it,
//!   the append log by its own [`foldhost_core::snapshot::ProvenCopy`]: [`foldhost_core::snapshot::CompactLogCheck`]
//!   run over the bytes it wrote, in the pass that hashed them (what a reopen proves, without
//!   rebuilding the map or reading the copy back) — fsyncs every file, writes the manifest
//!   *last*, and renames the whole stage into place. A crash at any point leaves only the hidden
//!   stage. A file the store proved must still have the size it wrote when the seal lists it.
//! - **A bad artifact never becomes a fold.** Import treats the artifact as untrusted: it refuses an
//!   unknown schema, a backend this build lacks or the destination does not hold, any path that is
//!   not plain relative components (`..`, absolute, links, devices), a missing or unlisted file,
//!   before opening anything; it copies into a hidden stage beside the destination re-checking
//!   every size and digest (a download streams straight into the stage, [`import_tar_stream`]),
//!   proves the staged copy recovers the manifest's cursor (the same two ways as export) and each
//!   state bucket's copy its entry's cursor (reopened), and only then renames it into place. A
//!   state entry names one directory ([`foldhost_core::protocol::is_state_local`]); no file under
//!   `state/` lies outside a listed one. The destination is untouched by every refusal.
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

use foldhost_core::staged::{StagedFile, Syncs};
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use foldhost_core::kv::WatchCursor;
use foldhost_core::snapshot::{ProvenCopy, SnapshotError, SnapshotStore};
use foldhost_core::storedir::{AnyStore, Backend, StoreDirError};

mod export;
mod import;
mod tarball;

pub use export::*;
pub use import::*;
pub(crate) use tarball::*;

/// The manifest's file name, at the artifact's root.
pub(crate) const MANIFEST_FILE: &str = "MANIFEST.json";
/// The payload directory, at the artifact's root.
pub(crate) const DATA_DIR: &str = "data";
/// The manifest schema this build writes (2: with the exporting watch's scope). Schema 1 (no
/// scope) is still read.
pub(crate) const SCHEMA: u32 = 2;
/// Largest manifest read.
pub const MAX_MANIFEST_BYTES: u64 = 16 * 1024 * 1024;
/// Most files an artifact may list.
pub(crate) const MAX_FILES: usize = 100_000;
/// Largest single file a tar may carry (1 TiB: a sanity bound, not a quota).
pub(crate) const MAX_FILE_BYTES: u64 = 1 << 40;
/// Largest tar extension entry (GNU long name `L` or link `K`, PAX `x` or `g`) read: the `tar`
/// crate buffers such an entry's body whole, so [`TarGuard`] refuses a larger one from its header.
pub const MAX_TAR_EXTENSION_BYTES: u64 = 64 << 10;
/// Most previous pointer targets a manifest lists ([`ExportManifest::previous`]).
pub(crate) const MAX_PREVIOUS_TARGETS: usize = 8;
/// Most state bucket folds a manifest lists ([`ExportManifest::state`]): those the guest declares
/// and those kept under the store after their declaration went.
pub(crate) const MAX_STATE_FOLDS: usize = 256;

/// The stream an artifact's fold folds (as [`foldhost_core::kv::StreamIdentity`] holds it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestStream {
    /// The stream's name (`KV_<bucket>` on NATS).
    pub name: String,
    /// When the server created the stream, Unix nanoseconds.
    pub created_unix_ns: u64,
}

impl From<&foldhost_core::kv::StreamIdentity> for ManifestStream {
    fn from(id: &foldhost_core::kv::StreamIdentity) -> Self {
        ManifestStream {
            name: id.name.clone(),
            created_unix_ns: id.created_unix_ns,
        }
    }
}

impl ManifestStream {
    /// The identity, for messages.
    pub fn identity(&self) -> foldhost_core::kv::StreamIdentity {
        foldhost_core::kv::StreamIdentity {
            name: self.name.clone(),
            created_unix_ns: self.created_unix_ns,
        }
    }

    /// As [`foldhost_core::protocol::stream_relation`] reads it.
    pub fn key(&self) -> (&str, u64) {
        (self.name.as_str(), self.created_unix_ns)
    }
}

/// A pointer target before this artifact: its cursor and when it was published (the pointer
/// object's last change when it named it). The first target above a payload's cursor was
/// published when that payload stopped being the target ([`foldhost_core::protocol::payload_superseded_at`]).
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
    /// without it (read as unknown: see [`foldhost_core::protocol::bootstrap_stream_allowed`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<ManifestStream>,
    /// The pointer's recent targets before this artifact, newest first (at most
    /// [`MAX_PREVIOUS_TARGETS`]), added by the publish: what prune counts its grace from. Empty in
    /// a local artifact and in those of earlier versions (older readers ignore the field).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub previous: Vec<PreviousTarget>,
    /// The state buckets' folds the payload carries beside the main fold, each a store directory
    /// under `data/state/<local>/` whose files are listed in [`Self::files`] (docs/state.md).
    /// Empty for a guest without state buckets and in artifacts of earlier versions (older
    /// readers ignore the field and import the directories as plain files).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state: Vec<ManifestState>,
}

/// A state bucket's fold carried in an artifact: where its store is, and the cursor it is
/// exactly consistent with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestState {
    /// The name the guest uses (`notes`, `<module>.<name>`): its directory under `data/state/`.
    pub local: String,
    /// The backend that wrote it (the main fold's).
    pub backend: String,
    /// The watch cursor its store is exactly consistent with (`None`: nothing folded).
    pub cursor: Option<u64>,
    /// Keys in its fold.
    pub keys: u64,
    /// The stream it folds, when recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<ManifestStream>,
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
    /// A state bucket's fold in the artifact does not recover the cursor its manifest entry
    /// names.
    #[error("state bucket {local:?}: recovered cursor {got:?} differs from {want:?}")]
    StateCursorMismatch {
        /// The bucket, as the guest names it.
        local: String,
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
pub(crate) fn format_generation(backend: Backend) -> u32 {
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
pub(crate) fn check_path(p: &str) -> Result<PathBuf, ArtifactError> {
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
pub(crate) fn stage_path(path: &Path, tag: &str) -> PathBuf {
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
pub(crate) const STALE_STAGE_AGE: std::time::Duration = std::time::Duration::from_secs(3600);

/// The process id in `entry` when it is a stage of the file or directory named `name`, as
/// [`stage_path`] names one (`.<name>.<tag>-<pid>-<nanos>`). Pure.
pub(crate) fn stage_owner(name: &str, entry: &str) -> Option<u32> {
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
pub(crate) fn sweep_stale_stages(path: &Path) -> usize {
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
                tracing::warn!(event = "stage_removed", stage = %at.display(), pid, "removed a stage left by a process that is gone");
            }
            Err(e) => {
                tracing::warn!(event = "stage_remove_failed", stage = %at.display(), error = %e, "could not remove a stale stage")
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
pub(crate) type Progress<'a> = &'a mut dyn FnMut(u64, u64);

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
    mut check: Option<&mut foldhost_core::snapshot::CompactLogCheck>,
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
    check_state_entries(&m).map_err(bad)?;
    Ok(m)
}

/// The manifest's state entries: at most [`MAX_STATE_FOLDS`], each a state bucket's name (one
/// plain path component, [`foldhost_core::protocol::is_state_local`]) listed once, of the main fold's
/// backend; and every payload file under `state/` inside a listed bucket's directory. Pure.
fn check_state_entries(m: &ExportManifest) -> Result<(), String> {
    if m.state.len() > MAX_STATE_FOLDS {
        return Err(format!(
            "{} state buckets, over {MAX_STATE_FOLDS}",
            m.state.len()
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for st in &m.state {
        if !foldhost_core::protocol::is_state_local(&st.local) {
            return Err(format!("{:?} is not a state bucket's name", st.local));
        }
        if !seen.insert(st.local.as_str()) {
            return Err(format!("state bucket {:?} listed twice", st.local));
        }
        if st.backend != m.backend {
            return Err(format!(
                "state bucket {:?} is {}, the fold {}",
                st.local, st.backend, m.backend
            ));
        }
        if let Some(s) = &st.stream
            && (s.name.is_empty() || s.name.len() > 255)
        {
            return Err(format!(
                "state bucket {:?}: the stream's name is empty or over 255 bytes",
                st.local
            ));
        }
    }
    for f in &m.files {
        let Some(rest) = f
            .path
            .strip_prefix(foldhost_core::storedir::STATE_DIR)
            .and_then(|r| r.strip_prefix('/'))
        else {
            continue;
        };
        match rest.split_once('/') {
            Some((local, _)) if seen.contains(local) => {}
            _ => {
                return Err(format!(
                    "{}: under {}/ but in no state bucket the manifest lists",
                    f.path,
                    foldhost_core::storedir::STATE_DIR
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod state_tests;

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
        use foldhost_core::kv::{KvEntry, KvUpdate, VersionToken};
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
        let m = export_store(&store, Backend::AppendLog, &[], &out, None, &mut |_, _| {})
            .expect("export");
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
        let staged = export_stage(&store, Backend::AppendLog, &[], &stage).expect("stage");
        assert!(staged.proven.is_some(), "the append log proves its copy");
        let log = stage.join(DATA_DIR).join(foldhost_core::snapshot::LOG_FILE);
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
            state: vec![],
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
