//! Import: an artifact (directory or tar stream) checked against its manifest file by file, staged, proven and renamed into place.

use super::*;

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
fn log_check_for(
    m: &ExportManifest,
    stage: &Path,
) -> Option<foldhost_core::snapshot::CompactLogCheck> {
    (m.backend == Backend::AppendLog.as_str()).then(|| {
        foldhost_core::snapshot::CompactLogCheck::new(
            &stage.join(foldhost_core::snapshot::LOG_FILE),
        )
    })
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
            .filter(|_| f.path == foldhost_core::snapshot::LOG_FILE);
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
    log_check: Option<foldhost_core::snapshot::CompactLogCheck>,
    syncs: Syncs,
) -> Result<(), ArtifactError> {
    tracing::debug!(stage = %stage.display(), "import: every file written, checking the copy");
    let got = match log_check {
        // The append log was checked as it was copied: no reopen (no map) needed.
        Some(c) => {
            let own = foldhost_core::storedir::backend_of(stage)?;
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
    check_imported_state(stage, m)?;
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

/// Each state bucket's staged fold must open as the manifest's backend and recover its entry's
/// cursor, like the main fold's.
fn check_imported_state(stage: &Path, m: &ExportManifest) -> Result<(), ArtifactError> {
    for st in &m.state {
        let dir = stage
            .join(foldhost_core::storedir::STATE_DIR)
            .join(&st.local);
        let (copy, _) = AnyStore::open_read_only(&dir)?;
        if copy.backend() != st.backend {
            return Err(ArtifactError::BackendMismatch {
                artifact: format!("state bucket {:?} in {}", st.local, st.backend),
                wanted: format!("the payload's own {}", copy.backend()),
            });
        }
        let got = copy.cursor().revision();
        if got != st.cursor {
            return Err(ArtifactError::StateCursorMismatch {
                local: st.local.clone(),
                want: st.cursor,
                got,
            });
        }
    }
    Ok(())
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
pub(crate) fn import_tar_stream(
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
) -> Result<(Option<foldhost_core::snapshot::CompactLogCheck>, Syncs), ArtifactError> {
    let bad = |reason: String| tar_error(stage, reason);
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
        let name = entry_name(&entry, stage)?;
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
            check_embedded_manifest(&mut entry, pointer, stage)?;
            manifest_seen = true;
            continue;
        }
        let (rel_name, f) = listed_entry(&name, entry.header(), &listed, &mut seen, stage)?;
        let mut tick = |got: u64| {
            done += got;
            progress(done, total);
        };
        let log = (rel_name == foldhost_core::snapshot::LOG_FILE)
            .then_some(log_check.as_mut())
            .flatten();
        write_entry(&mut entry, stage, rel_name, f, log, &mut tick, &mut syncs)?;
    }
    if !manifest_seen {
        return Err(bad(format!("no {MANIFEST_FILE} in the payload")));
    }
    if let Some(missing) = m.files.iter().find(|f| !seen.contains(&f.path)) {
        return Err(ArtifactError::MissingFile(missing.path.clone()));
    }
    Ok((log_check, syncs))
}

/// The refusal of the tar stream being imported into `stage`, for `reason`.
fn tar_error(stage: &Path, reason: String) -> ArtifactError {
    ArtifactError::Tar {
        path: stage.to_path_buf(),
        reason,
    }
}

/// The entry's path as UTF-8 without a trailing `/`, refused unless it is a safe relative path.
fn entry_name<R: Read>(entry: &tar::Entry<'_, R>, stage: &Path) -> Result<String, ArtifactError> {
    let raw = entry.path_bytes().into_owned();
    let name = String::from_utf8(raw)
        .map_err(|_| tar_error(stage, "an entry path is not UTF-8".into()))?;
    let name = name.trim_end_matches('/').to_string();
    check_path(&name)?;
    Ok(name)
}

/// Reads the tar's embedded manifest (at most one byte over the limit) and refuses it unless it
/// is byte for byte the pointer's.
fn check_embedded_manifest(
    entry: &mut impl Read,
    pointer: &[u8],
    stage: &Path,
) -> Result<(), ArtifactError> {
    let mut embedded = Vec::new();
    entry
        .take(MAX_MANIFEST_BYTES + 1)
        .read_to_end(&mut embedded)
        .map_err(|e| tar_error(stage, e.to_string()))?;
    if embedded != pointer {
        return Err(tar_error(
            stage,
            "its embedded manifest is not the pointer's".into(),
        ));
    }
    Ok(())
}

/// The payload file the entry `name` is (its path under the data directory and its manifest
/// line): refused unless the manifest lists it, once, with the size its header declares.
fn listed_entry<'n, 'm>(
    name: &'n str,
    header: &tar::Header,
    listed: &std::collections::BTreeMap<&str, &'m ArtifactFile>,
    seen: &mut std::collections::BTreeSet<String>,
    stage: &Path,
) -> Result<(&'n str, &'m ArtifactFile), ArtifactError> {
    let rel_name = name
        .strip_prefix(DATA_DIR)
        .and_then(|r| r.strip_prefix('/'))
        .ok_or_else(|| ArtifactError::ExtraFile(name.to_string()))?;
    let f = *listed
        .get(rel_name)
        .ok_or_else(|| ArtifactError::ExtraFile(rel_name.to_string()))?;
    if !seen.insert(rel_name.to_string()) {
        return Err(tar_error(stage, format!("{rel_name}: in the tar twice")));
    }
    let size = header.size().map_err(|e| tar_error(stage, e.to_string()))?;
    if size != f.size {
        return Err(ArtifactError::SizeMismatch {
            path: f.path.clone(),
            want: f.size,
            got: size,
        });
    }
    Ok((rel_name, f))
}

/// Copies one payload entry into the stage, hashing it (and feeding the log check, if given) as
/// it goes; refuses it unless its size and digest are the manifest's, then queues its fsync.
fn write_entry(
    entry: &mut impl Read,
    stage: &Path,
    rel_name: &str,
    f: &ArtifactFile,
    mut log_check: Option<&mut foldhost_core::snapshot::CompactLogCheck>,
    tick: &mut dyn FnMut(u64),
    syncs: &mut Syncs,
) -> Result<(), ArtifactError> {
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
        if let Some(c) = log_check.as_deref_mut() {
            c.feed(&spare[..got]);
        }
        out.commit(got).map_err(io_err(&dst, "write"))?;
        n += got as u64;
        tick(got as u64);
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
    out.finish_syncing_in(syncs)
        .map_err(io_err(&dst, "write and fsync"))?;
    Ok(())
}
