//! Export: a store's copy staged, proven, hashed and sealed under its manifest, from a store at rest or a running fold.

use super::*;

/// What the first half of an export leaves for the second: the cursor the staged copy holds, and
/// what the store proved about it while writing it (see [`SnapshotStore::export_to`]).
#[derive(Clone, Debug)]
pub(crate) struct Staged {
    /// The cursor the copy must recover.
    pub cursor: WatchCursor,
    /// The store's digests and check of its copy, when it made them.
    pub proven: Option<ProvenCopy>,
    /// The stream the copied fold folds, when known.
    pub stream: Option<ManifestStream>,
    /// The state buckets' folds copied beside it, under `data/state/`.
    pub state: Vec<StagedState>,
}

/// A state bucket's fold copied into a stage: what its manifest entry will say once proven.
#[derive(Clone, Debug)]
pub(crate) struct StagedState {
    /// The name the guest uses: its directory under `data/state/`.
    pub local: String,
    /// The cursor its copy must recover.
    pub cursor: WatchCursor,
    /// The stream it folds, when recorded.
    pub stream: Option<ManifestStream>,
}

/// A state bucket's fold to carry in an artifact beside the main fold (docs/state.md): its name
/// as the guest uses it, and its store (a running node's, shared with its fold, or one opened at
/// rest), held weakly: an export never keeps a stopped fold's store open.
#[derive(Clone)]
pub struct StateFoldSource {
    /// The bucket as the guest names it (its directory under `state/`).
    pub local: String,
    /// Its store (`SharedStore::downgrade`).
    pub store: std::sync::Weak<std::sync::RwLock<AnyStore>>,
}

/// Copies each state bucket's fold into `data/state/<local>/` with its `FOLDHOST.json`, each
/// under its own store's read lock (no commit of that bucket lands mid-copy): every copy is
/// exactly its fold at its cursor. The main fold's `backend` is required of each (one node's
/// folds share a backend). Blocking.
pub(crate) fn copy_state_folds(
    sources: &[StateFoldSource],
    data: &Path,
    backend: Backend,
) -> Result<Vec<StagedState>, ArtifactError> {
    if sources.len() > MAX_STATE_FOLDS {
        return Err(ArtifactError::Fold(format!(
            "{} state buckets, over {MAX_STATE_FOLDS}",
            sources.len()
        )));
    }
    let mut out = Vec::with_capacity(sources.len());
    for src in sources {
        if !foldhost_core::protocol::is_state_local(&src.local) {
            return Err(ArtifactError::UnsafePath(src.local.clone()));
        }
        let dir = data
            .join(foldhost_core::storedir::STATE_DIR)
            .join(&src.local);
        std::fs::create_dir_all(&dir).map_err(io_err(&dir, "create stage"))?;
        let store = src.store.upgrade().ok_or_else(|| {
            ArtifactError::Fold(format!(
                "state bucket {:?}: its fold has stopped",
                src.local
            ))
        })?;
        let store = store.read().map_err(|_| {
            ArtifactError::Fold(format!(
                "state bucket {:?}: its store is poisoned",
                src.local
            ))
        })?;
        if store.backend() != backend.as_str() {
            return Err(ArtifactError::BackendMismatch {
                artifact: format!("state bucket {:?} in {}", src.local, store.backend()),
                wanted: backend.as_str().to_string(),
            });
        }
        let (cursor, stream) = (store.cursor(), stream_of(&*store)?);
        store.export_to(&dir)?;
        drop(store);
        foldhost_core::storedir::write_meta(&dir, backend)?;
        out.push(StagedState {
            local: src.local.clone(),
            cursor,
            stream,
        });
    }
    Ok(out)
}

/// The first half of an export, the part that needs the fold quiet: makes `stage` and copies the
/// committed fold into `stage/data` (with its `FOLDHOST.json`).
pub(crate) fn export_stage<S: SnapshotStore + ?Sized>(
    store: &S,
    backend: Backend,
    state: &[StateFoldSource],
    stage: &Path,
) -> Result<Staged, ArtifactError> {
    let data = make_stage(stage)?;
    let cursor = store.cursor();
    let stream = stream_of(store)?;
    let proven = store.export_to(&data)?;
    foldhost_core::storedir::write_meta(&data, backend)?;
    let state = copy_state_folds(state, &data, backend)?;
    Ok(Staged {
        cursor,
        proven,
        stream,
        state,
    })
}

/// The stream `store` records (its reserved identity key), if any.
pub fn stream_of<S: SnapshotStore + ?Sized>(
    store: &S,
) -> Result<Option<ManifestStream>, ArtifactError> {
    Ok(store
        .get(foldhost_core::retained::IDENTITY_KEY)?
        .and_then(|e| foldhost_core::kv::StreamIdentity::from_bytes(&e.value))
        .map(|id| ManifestStream::from(&id)))
}

/// The second half of an export, off the fold's path: proves the staged copy (by the store's own
/// check made while writing it, or by reopening it: cursor equality), hashes every file the store
/// did not, fsyncs them all, writes the manifest last, and renames the stage to `out`. The stage
/// is removed on any failure.
pub(crate) fn seal(
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
    foldhost_core::crashpoint::hit(foldhost_core::crashpoint::EXPORT_STAGED);
    let data = stage.join(DATA_DIR);
    let backend = foldhost_core::storedir::backend_of(&data)?;
    let names = list_files(&data)?;
    let proven = staged.proven.as_ref();
    let files = hash_and_sync_files(&data, names, proven, progress)?;
    sync_payload_dirs(&data, &files)?;
    let keys = check_copy_cursor(&data, backend, proven, cursor)?;
    let state = check_state_copies(&data, backend, &staged.state)?;
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
        state,
    };
    write_manifest(stage, &manifest)?;
    rename_into_place(stage, out)?;
    Ok(manifest)
}

/// The total size of the payload's files `names` under `data`, the denominator of the progress.
fn payload_size(data: &Path, names: &[String]) -> Result<u64, ArtifactError> {
    let mut total = 0u64;
    for n in names {
        let p = data.join(check_path(n)?);
        total += std::fs::metadata(&p).map_err(io_err(&p, "stat"))?.len();
    }
    Ok(total)
}

/// Hashes (or, where the store proved it, size-checks) every payload file and fsyncs each; returns
/// once all fsyncs are done, and refuses a copy missing a file the store proved.
fn hash_and_sync_files(
    data: &Path,
    names: Vec<String>,
    proven: Option<&ProvenCopy>,
    progress: Progress<'_>,
) -> Result<Vec<ArtifactFile>, ArtifactError> {
    let total = payload_size(data, &names)?;
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
        foldhost_core::crashpoint::hit(foldhost_core::crashpoint::EXPORT_FILE);
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
        .map_err(io_err(data, "fsync the payload's files"))?;
    Ok(files)
}

/// Fsyncs every directory of the payload (`data` and each file's parent), so each file's entry
/// is durable too.
fn sync_payload_dirs(data: &Path, files: &[ArtifactFile]) -> Result<(), ArtifactError> {
    let mut dirs: std::collections::BTreeSet<PathBuf> = std::collections::BTreeSet::new();
    dirs.insert(data.to_path_buf());
    for f in files {
        if let Some(parent) = data.join(check_path(&f.path)?).parent() {
            dirs.insert(parent.to_path_buf());
        }
    }
    for d in &dirs {
        sync_dir(d)?;
    }
    Ok(())
}

/// Proves the copy recovers `cursor` (by the store's own check, or by reopening it read-only with
/// the same backend) and returns the keys it holds.
fn check_copy_cursor(
    data: &Path,
    backend: Backend,
    proven: Option<&ProvenCopy>,
    cursor: WatchCursor,
) -> Result<u64, ArtifactError> {
    let (got, keys) = match proven {
        Some(c) => (c.cursor, c.keys),
        None => {
            let (copy, _) = AnyStore::open_read_only(data)?;
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
    Ok(keys)
}

/// Proves each state bucket's copy recovers its cursor (reopened read-only, as the main fold's
/// copy is when its store proved nothing) and returns the manifest's entries.
fn check_state_copies(
    data: &Path,
    backend: Backend,
    staged: &[StagedState],
) -> Result<Vec<ManifestState>, ArtifactError> {
    let mut out = Vec::with_capacity(staged.len());
    for st in staged {
        let dir = data
            .join(foldhost_core::storedir::STATE_DIR)
            .join(&st.local);
        let keys = check_copy_cursor(&dir, backend, None, st.cursor).map_err(|e| match e {
            ArtifactError::CursorMismatch { want, got, .. } => ArtifactError::StateCursorMismatch {
                local: st.local.clone(),
                want,
                got,
            },
            e => e,
        })?;
        out.push(ManifestState {
            local: st.local.clone(),
            backend: backend.as_str().to_string(),
            cursor: st.cursor.revision(),
            keys,
            stream: st.stream.clone(),
        });
    }
    Ok(out)
}

/// Writes `manifest` into the stage and fsyncs it and the stage: the manifest is written last.
fn write_manifest(stage: &Path, manifest: &ExportManifest) -> Result<(), ArtifactError> {
    let bytes = serde_json::to_vec_pretty(manifest).map_err(|e| ArtifactError::Manifest {
        path: stage.join(MANIFEST_FILE),
        reason: e.to_string(),
    })?;
    let mpath = stage.join(MANIFEST_FILE);
    let mut f = File::create(&mpath).map_err(io_err(&mpath, "create"))?;
    f.write_all(&bytes).map_err(io_err(&mpath, "write"))?;
    f.sync_all().map_err(io_err(&mpath, "fsync"))?;
    sync_dir(stage)
}

/// Renames the sealed stage to `out` (refused if `out` exists) and fsyncs `out`'s parent.
fn rename_into_place(stage: &Path, out: &Path) -> Result<(), ArtifactError> {
    if out.exists() {
        return Err(ArtifactError::Exists(out.to_path_buf()));
    }
    std::fs::rename(stage, out).map_err(io_err(out, "rename stage into place"))?;
    sync_dir(out.parent().unwrap_or_else(|| Path::new(".")))
}

/// Exports `store` to the artifact directory `out` (which must not exist): stage, verify, hash,
/// manifest, rename. For a store no host is writing; a running host exports through
/// `foldhost::applied::export_live` instead.
/// `state` are the state buckets' folds to carry beside it (opened at rest too).
pub fn export_store<S: SnapshotStore + ?Sized>(
    store: &S,
    backend: Backend,
    state: &[StateFoldSource],
    out: &Path,
    scope: Option<String>,
    progress: Progress<'_>,
) -> Result<ExportManifest, ArtifactError> {
    if out.exists() {
        return Err(ArtifactError::Exists(out.to_path_buf()));
    }
    let stage = stage_path(out, "export");
    let staged = or_discard(&stage, export_stage(store, backend, state, &stage))?;
    seal_to(&stage, out, &staged, scope, progress)
}

/// True when `out` names a tar file rather than an artifact directory.
pub(crate) fn is_tar(out: &Path) -> bool {
    out.extension().is_some_and(|e| e == "tar")
}

/// [`seal`] into `out`, or, when `out` ends in `.tar`, into a hidden directory packed into `out`.
pub(crate) fn seal_to(
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
pub type LiveCopy =
    Result<(WatchCursor, Option<foldhost_core::snapshot::ProvenCopy>), ArtifactError>;

/// Exports the fold of a running host: `copy` has the fold flush and copy itself into the
/// directory it is given, between batches (paused only for the copy; the fold's loop does it,
/// `foldhost::applied::export_live`), then the stage is verified, hashed and sealed here, off the
/// fold's path, recording `stream` (the fold's stream, read by the caller before and after) in
/// the manifest. Each of `state`, the node's state buckets' folds, is copied after the main fold,
/// under its own store's read lock (each exact at its own cursor; the buckets are separate
/// streams, so no cut across them is promised).
pub async fn export_live_with<F, Fut>(
    copy: F,
    backend: Backend,
    out: PathBuf,
    scope: Option<String>,
    stream: Option<ManifestStream>,
    state: Vec<StateFoldSource>,
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
        foldhost_core::storedir::write_meta(&data, backend)?;
        let state = tokio::task::spawn_blocking(move || copy_state_folds(&state, &data, backend))
            .await
            .map_err(|e| ArtifactError::Fold(format!("state export task: {e}")))??;
        Ok(Staged {
            cursor,
            proven,
            stream,
            state,
        })
    };
    let staged = or_discard(&stage, copied.await)?;
    tokio::task::spawn_blocking(move || seal_to(&stage, &out, &staged, scope, &mut |_, _| {}))
        .await
        .map_err(|e| ArtifactError::Fold(format!("export task: {e}")))?
}
