//! The artifact restore (for buckets whose retention evicts current values): the newest artifact
//! that covers the scope, is strictly ahead of the fold and still inside retention is imported
//! (every digest checked), diffed against the fold key by key ([`protocol::restore_key`]), and the
//! difference folded through the applier under the old cursor; the cursor moves to the artifact's
//! in the last commit only, so a crash re-runs the restore.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use bytes::Bytes;

use foldhost_artifact::artifact::{self, ExportManifest};
use foldhost_core::crashpoint;
use foldhost_core::kv::{KvEntry, KvUpdate, KvWatcher, VersionToken, WatchScope};
use foldhost_core::ledger;
use foldhost_core::protocol::{self, KeyRestore};
use foldhost_core::retained::is_reserved;
use foldhost_core::snapshot::{SnapshotError, SnapshotStore};
use foldhost_core::storedir::{AnyStore, Backend};
use foldhost_core::view::SharedStore;

use super::extsort::MAX_SPILL_KEY;
use super::relist::fold_deletes;
use super::{
    MAX_HELD_KEYS, RepairConfig, RepairError, RepairReport, RepairTarget, block, clear_dir, io_err,
};

/// Entries read from the artifact per page of its key-ordered scan.
const PAGE: usize = 1024;

/// Largest value the spill file accepts (the store's own limit is lower).
const MAX_SPILL_VALUE: usize = 64 << 20;

/// Where artifacts for a restore come from: a local directory holding artifact directories and
/// `.tar` files (names starting with `.`, stages being written, are ignored), or the published
/// artifact of a key in an object store ([`foldhost_artifact::transport::ArtifactTransport`]).
#[derive(Clone)]
pub enum RestoreSource {
    /// A local directory of artifacts.
    Dir(PathBuf),
    /// The artifact published under `key`.
    Transport {
        /// The object store.
        transport: std::sync::Arc<foldhost_artifact::transport::ArtifactTransport>,
        /// The artifact key.
        key: String,
    },
}

impl std::fmt::Debug for RestoreSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

/// Where a chosen artifact is: on disk already, or to be downloaded.
pub(crate) enum Located {
    /// A local artifact directory or `.tar`.
    Local(PathBuf),
    /// The published artifact of the transport's key.
    Remote,
}

impl RestoreSource {
    /// A source reading `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        RestoreSource::Dir(dir.into())
    }

    /// The source in words, for messages.
    pub(crate) fn describe(&self) -> String {
        match self {
            RestoreSource::Dir(d) => d.display().to_string(),
            RestoreSource::Transport { transport, key } => {
                format!("{} (key {key})", transport.url())
            }
        }
    }

    /// The artifacts to try, newest (highest cursor) first, with their manifests (peeked, not
    /// verified: the import verifies) — for a transport, the pointer's manifest, before anything
    /// is downloaded.
    pub(crate) async fn candidates(&self) -> Result<Vec<(Located, ExportManifest)>, RepairError> {
        match self {
            RestoreSource::Dir(dir) => {
                let dir = dir.clone();
                Ok(block(|| artifacts_in(&dir))?
                    .into_iter()
                    .map(|(p, m)| (Located::Local(p), m))
                    .collect())
            }
            RestoreSource::Transport { transport, key } => Ok(transport
                .pointer(key)
                .await
                .map_err(|e| RepairError::Refused(e.to_string()))?
                .map(|p| (Located::Remote, p.manifest))
                .into_iter()
                .collect()),
        }
    }

    /// Imports the artifact at `located` as the store `dest`: a local one through
    /// [`artifact::import_artifact`], a remote one streamed from the object store straight into
    /// the import ([`foldhost_artifact::transport::ArtifactTransport::bootstrap_into`]: each file written
    /// once; `live`, the bucket's stream, refuses another's before the download, and a payload
    /// pruned mid-download is retried once from the pointer read again). Returns the manifest of
    /// what arrived.
    pub(crate) async fn import(
        &self,
        located: Located,
        dest: &Path,
        live: Option<&artifact::ManifestStream>,
    ) -> Result<ExportManifest, RepairError> {
        match (located, self) {
            (Located::Local(p), _) => {
                let dest = dest.to_path_buf();
                tokio::task::spawn_blocking(move || {
                    artifact::import_artifact(&p, &dest, None, &mut |_, _| {})
                })
                .await
                .map_err(|e| RepairError::Task(e.to_string()))?
                .map_err(RepairError::from)
            }
            (Located::Remote, RestoreSource::Transport { transport, key }) => transport
                .bootstrap_into(key, dest, None, live)
                .await
                .map_err(|e| RepairError::Refused(e.to_string())),
            (Located::Remote, RestoreSource::Dir(d)) => Err(RepairError::Refused(format!(
                "{}: no remote artifacts here",
                d.display()
            ))),
        }
    }
}

/// The artifacts in `dir` with their manifests, highest cursor first. Entries whose manifest cannot
/// be read are skipped with a warning.
fn artifacts_in(dir: &Path) -> Result<Vec<(PathBuf, ExportManifest)>, RepairError> {
    let rd = std::fs::read_dir(dir).map_err(io_err(dir, "list artifacts"))?;
    let mut found: Vec<(PathBuf, ExportManifest)> = Vec::new();
    for ent in rd {
        let ent = ent.map_err(io_err(dir, "list artifacts"))?;
        let path = ent.path();
        if ent.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let m = if path.is_dir() {
            artifact::read_manifest(&path)
        } else {
            artifact::peek_tar_manifest(&path)
        };
        match m {
            Ok(m) => found.push((path, m)),
            Err(e) => {
                tracing::warn!(event = "restore_artifact_skipped", artifact = %path.display(), error = %e, "restore source: skipping an unreadable artifact")
            }
        }
    }
    found.sort_by(|a, b| b.1.cursor.cmp(&a.1.cursor).then_with(|| a.0.cmp(&b.0)));
    Ok(found)
}

/// Chooses, fetches and imports the newest usable artifact into `scratch/artifact`: each candidate
/// is checked from its manifest before anything is downloaded (`check_artifact`), imported (every
/// digest and the cursor verified) and checked again against the fold's cursor now; one that fails
/// verification is skipped for the next newest, never for nothing. Returns its local path, its
/// manifest and its cursor.
async fn choose_and_import(
    source: &RestoreSource,
    scratch: &Path,
    scope: &WatchScope,
    local: Option<u64>,
    first: u64,
    live: Option<&artifact::ManifestStream>,
) -> Result<(PathBuf, ExportManifest, u64), RepairError> {
    let candidates = source.candidates().await?;
    if candidates.is_empty() {
        return Err(RepairError::Refused(format!(
            "no artifact in {} to restore from",
            source.describe()
        )));
    }
    let mut last: Option<RepairError> = None;
    for (located, peeked) in candidates {
        let named = match &located {
            Located::Local(p) => p.clone(),
            Located::Remote => PathBuf::from(source.describe()),
        };
        // Checked before anything is downloaded or imported.
        if let Err(e) = check_artifact(&named, &peeked, scope, local, first)
            .and_then(|_| check_stream(&named, &peeked, live))
        {
            last = Some(e);
            continue;
        }
        block(|| clear_dir(scratch))?;
        let imported = async {
            let manifest = source
                .import(located, &scratch.join("artifact"), live)
                .await?;
            // Re-checked against what actually arrived.
            let rev = check_artifact(&named, &manifest, scope, local, first)?;
            Ok::<_, RepairError>((named.clone(), manifest, rev))
        }
        .await;
        match imported {
            Ok(chosen) => return Ok(chosen),
            Err(e) => {
                tracing::warn!(event = "restore_artifact_rejected", artifact = %named.display(), error = %e, "restore: this artifact failed verification; trying the next newest");
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| RepairError::Refused("no usable artifact".into())))
}

/// Refuses, from its manifest, an artifact of another stream than the bucket's `live` one (one
/// that records none passes: [`refuse_other_stream`] checks its fold's own record after the
/// import).
fn check_stream(
    path: &Path,
    m: &ExportManifest,
    live: Option<&artifact::ManifestStream>,
) -> Result<(), RepairError> {
    let Some(live) = live else { return Ok(()) };
    let relation = protocol::stream_relation(
        Some(live.key()),
        m.stream.as_ref().map(artifact::ManifestStream::key),
    );
    if protocol::bootstrap_stream_allowed(relation) {
        return Ok(());
    }
    Err(RepairError::Refused(format!(
        "artifact {} folds {}, but the bucket is {}: not restored from another incarnation",
        path.display(),
        m.stream.as_ref().map_or_else(
            || "an unrecorded stream".into(),
            |s| s.identity().to_string()
        ),
        live.identity()
    )))
}

/// The prefixes an artifact's recorded scope covers; `None` when it recorded none.
fn artifact_prefixes(m: &ExportManifest) -> Option<Vec<String>> {
    let s = WatchScope::parse(m.scope.as_deref()?).ok()?;
    Some(s.disjoint_prefixes())
}

/// Refuses an artifact that does not cover `scope` or may not replace the fold.
fn check_artifact(
    path: &Path,
    m: &ExportManifest,
    scope: &WatchScope,
    local: Option<u64>,
    first_sequence: u64,
) -> Result<u64, RepairError> {
    let what = path.display();
    let Some(rev) = m.cursor else {
        return Err(RepairError::Refused(format!(
            "artifact {what} has no cursor"
        )));
    };
    let Some(covers) = artifact_prefixes(m) else {
        return Err(RepairError::Refused(format!(
            "artifact {what} records no watch scope (exported offline?): it cannot vouch for a scope; export from a running host"
        )));
    };
    let a: Vec<&str> = covers.iter().map(String::as_str).collect();
    let want = scope.disjoint_prefixes();
    let w: Vec<&str> = want.iter().map(String::as_str).collect();
    if !protocol::scope_covers(&a, &w) {
        return Err(RepairError::Refused(format!(
            "artifact {what} covers scope {} but the watch is {scope}",
            m.scope.as_deref().unwrap_or("?")
        )));
    }
    if !protocol::restore_allowed(rev, local, first_sequence) {
        return Err(RepairError::Refused(format!(
            "stale artifact {what}: its cursor {rev}, the fold's {}, the stream's first retained revision {first_sequence} (a restore needs an artifact strictly ahead of the fold whose cursor is still inside retention)",
            local.map_or("none".to_string(), |l| l.to_string())
        )));
    }
    Ok(rev)
}

/// Appends one entry to the spill.
fn spill_entry(w: &mut impl Write, e: &KvEntry) -> std::io::Result<()> {
    w.write_all(&(e.key.len() as u32).to_le_bytes())?;
    w.write_all(e.key.as_bytes())?;
    let v = e.version.as_bytes();
    w.write_all(&[v.len() as u8])?;
    w.write_all(v)?;
    w.write_all(&(e.value.len() as u32).to_le_bytes())?;
    w.write_all(&e.value)
}

/// Reads one spilled entry back (`None` at the end), bounds-checked.
fn read_spilled(r: &mut impl Read, path: &Path) -> Result<Option<KvEntry>, RepairError> {
    let corrupt = |reason: &str| RepairError::Corrupt {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(io_err(path, "read spill")(e)),
    }
    let kl = u32::from_le_bytes(len) as usize;
    if kl > MAX_SPILL_KEY {
        return Err(corrupt("key length over the limit"));
    }
    let mut key = vec![0u8; kl];
    r.read_exact(&mut key).map_err(io_err(path, "read spill"))?;
    let key = String::from_utf8(key).map_err(|_| corrupt("key not UTF-8"))?;
    let mut vl = [0u8; 1];
    r.read_exact(&mut vl).map_err(io_err(path, "read spill"))?;
    let mut ver = vec![0u8; vl[0] as usize];
    r.read_exact(&mut ver).map_err(io_err(path, "read spill"))?;
    let version = VersionToken::from_bytes(&ver).ok_or_else(|| corrupt("version too long"))?;
    r.read_exact(&mut len).map_err(io_err(path, "read spill"))?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_SPILL_VALUE {
        return Err(corrupt("value length over the limit"));
    }
    let mut value = vec![0u8; n];
    r.read_exact(&mut value)
        .map_err(io_err(path, "read spill"))?;
    Ok(Some(KvEntry {
        key,
        value: Bytes::from(value),
        version,
    }))
}

/// A local entry's revision for [`protocol::restore_key`]: an unknown version counts as 0.
fn local_revision(e: &KvEntry) -> u64 {
    e.version.as_u64().unwrap_or(0)
}

/// Pages through `store`'s entries under `prefix` in key order (a pull iterator over a push scan).
struct Paged<'a, T: SnapshotStore + ?Sized> {
    store: &'a T,
    prefix: &'a str,
    buf: std::collections::VecDeque<KvEntry>,
    last: Option<String>,
    done: bool,
}

impl<'a, T: SnapshotStore + ?Sized> Paged<'a, T> {
    fn new(store: &'a T, prefix: &'a str) -> Self {
        Paged {
            store,
            prefix,
            buf: Default::default(),
            last: None,
            done: false,
        }
    }

    fn peek(&mut self) -> Result<Option<&KvEntry>, SnapshotError> {
        while self.buf.is_empty() && !self.done {
            let mut page = Vec::with_capacity(PAGE);
            self.store
                .for_each_in_range_after(self.prefix, self.last.as_deref(), &mut |e| {
                    page.push(e.clone());
                    if page.len() >= PAGE {
                        ControlFlow::Break(())
                    } else {
                        ControlFlow::Continue(())
                    }
                })?;
            if page.len() < PAGE {
                self.done = true;
            }
            self.last = page.last().map(|e| e.key.clone());
            // The artifact's own reserved keys (its exporter's retained records) are not ours.
            self.buf
                .extend(page.into_iter().filter(|e| !is_reserved(&e.key)));
        }
        Ok(self.buf.front())
    }

    fn pop(&mut self) -> Option<KvEntry> {
        self.buf.pop_front()
    }
}

/// One key-ordered pass over the fold and the artifact: entries to take go to `spill`, local keys
/// the artifact lacks are returned as delete candidates (with the listing not yet consulted). A
/// merge-join over two paged cursors; each case is one method of [`Diff`], decided by
/// [`protocol::restore_key`].
fn restore_diff<L: SnapshotStore + ?Sized, R: SnapshotStore + ?Sized>(
    local: &L,
    art: &R,
    scope: &WatchScope,
    spill: &mut impl Write,
    spill_path: &Path,
) -> Result<(u64, Vec<String>), RepairError> {
    let mut d = Diff {
        // An artifact entry at or below the fold's cursor is never news.
        fold_cursor: local.cursor().revision(),
        taken: 0,
        candidates: Vec::new(),
        spill,
        spill_path,
    };
    let mut failed: Option<RepairError> = None;
    for prefix in scope.disjoint_prefixes() {
        let mut a = Paged::new(art, &prefix);
        local.for_each_in_range(&prefix, &mut |l| {
            if is_reserved(&l.key) {
                return ControlFlow::Continue(());
            }
            match d.local_key(&mut a, l) {
                Ok(()) => ControlFlow::Continue(()),
                Err(e) => {
                    failed = Some(e);
                    ControlFlow::Break(())
                }
            }
        })?;
        if let Some(e) = failed.take() {
            return Err(e);
        }
        while a.peek()?.is_some() {
            let ae = a.pop().expect("peeked");
            d.absent_locally(&ae)?;
        }
    }
    Ok((d.taken, d.candidates))
}

/// [`restore_diff`] in progress: what it has taken and which local keys it may delete.
struct Diff<'a, W: Write> {
    fold_cursor: Option<u64>,
    taken: u64,
    candidates: Vec<String>,
    spill: &'a mut W,
    spill_path: &'a Path,
}

impl<W: Write> Diff<'_, W> {
    fn take(&mut self, e: &KvEntry) -> Result<(), RepairError> {
        self.taken += 1;
        spill_entry(self.spill, e).map_err(io_err(self.spill_path, "write spill"))
    }

    /// An artifact key the fold does not hold: taken when it is news.
    fn absent_locally(&mut self, ae: &KvEntry) -> Result<(), RepairError> {
        let revision = Some(ae.version.as_u64().unwrap_or(0));
        if protocol::restore_key(None, revision, false, false, self.fold_cursor) == KeyRestore::Take
        {
            self.take(ae)?;
        }
        Ok(())
    }

    /// One local key: the artifact keys before it (absent locally), then the same key on both
    /// sides (taken when news), or a local key the artifact lacks (a delete candidate).
    fn local_key<T: SnapshotStore + ?Sized>(
        &mut self,
        a: &mut Paged<'_, T>,
        l: &KvEntry,
    ) -> Result<(), RepairError> {
        while let Some(ae) = a.peek()? {
            if ae.key.as_str() >= l.key.as_str() {
                break;
            }
            let ae = a.pop().expect("peeked");
            self.absent_locally(&ae)?;
        }
        if a.peek()?.is_some_and(|ae| ae.key == l.key) {
            let ae = a.pop().expect("peeked");
            let identical = ae.version == l.version && ae.value == l.value;
            let artifact = Some(ae.version.as_u64().unwrap_or(0));
            let d = protocol::restore_key(
                Some(local_revision(l)),
                artifact,
                identical,
                false,
                self.fold_cursor,
            );
            if d == KeyRestore::Take {
                self.take(&ae)?;
            }
        } else if protocol::restore_key(
            Some(local_revision(l)),
            None,
            false,
            false,
            self.fold_cursor,
        ) == KeyRestore::Delete
        {
            if self.candidates.len() >= MAX_HELD_KEYS {
                return Err(RepairError::Refused(format!(
                    "more than {MAX_HELD_KEYS} delete candidates"
                )));
            }
            self.candidates.push(l.key.clone());
        }
        Ok(())
    }
}

/// The artifact restore. The fold must be settled. On success the cursor is the artifact's and
/// the caller resumes from it; on a refusal the fold is untouched.
pub async fn restore<T: RepairTarget>(
    target: &mut T,
    cfg: &RepairConfig,
    watcher: &dyn KvWatcher,
    scope: &WatchScope,
    max: usize,
) -> Result<RepairReport, T::Error> {
    let source = cfg.restore_from.as_ref().ok_or_else(|| {
        RepairError::Refused("no artifact source to restore from (give --restore-from DIR)".into())
    })?;
    let first = first_sequence(watcher.retention().await.map_err(RepairError::from)?)?;
    let local = target.cursor().revision();
    let scratch = cfg.scratch_dir();
    // The fold is settled: its cursor stays `local` until this repair commits.
    let live = watcher
        .stream_state()
        .await
        .map_err(RepairError::from)?
        .map(|s| artifact::ManifestStream::from(&s.identity));
    let (path, manifest, rev) =
        choose_and_import(source, &scratch, scope, local, first, live.as_ref()).await?;
    let imported_dir = scratch.join("artifact");
    let backend: Backend = manifest
        .backend
        .parse()
        .map_err(|e: String| RepairError::Refused(format!("artifact {}: {e}", path.display())))?;
    let (art, _) = block(|| AnyStore::open(&imported_dir, backend)).map_err(RepairError::from)?;
    let art_cursor = art.cursor();
    refuse_other_stream(watcher, &art, &path, rev).await?;
    let spill_path = scratch.join("take.spill");
    let store = target.store();
    let (taken, candidates) = block(|| -> Result<(u64, Vec<String>), RepairError> {
        let f = File::create(&spill_path).map_err(io_err(&spill_path, "create spill"))?;
        let mut w = BufWriter::new(f);
        let s = store.read()?;
        let r = restore_diff(&*s, &art, scope, &mut w, &spill_path)?;
        w.flush().map_err(io_err(&spill_path, "write spill"))?;
        Ok(r)
    })?;
    let fold_cursor = target.cursor();
    let adopted = block(|| adopt_ledger(&store, &art, fold_cursor))?;
    drop(art);
    let (deletes, listed) = filter_deletes(cfg, watcher, scope, candidates, rev).await?;
    tracing::info!(event = "repair_restore_diff", artifact = %path.display(), cursor = rev, taken, deletes = deletes.len(), ledger_rows_adopted = adopted, "repair: restore diff");
    // Fold the difference under the old cursor, then move the cursor in one last commit.
    target.freeze_cursor(true);
    let folded = fold_difference(target, &spill_path, deletes, max).await;
    target.freeze_cursor(false);
    let deleted = folded?;
    let memo = target.cursor().memo().or(art_cursor.memo());
    let cursor = foldhost_core::kv::WatchCursor::at(rev).with_memo(memo);
    crashpoint::hit(crashpoint::RESTORE_BEFORE_CURSOR);
    target.commit_position(cursor).await?;
    block(|| {
        let _ = std::fs::remove_dir_all(&scratch);
    });
    Ok(RepairReport {
        kind: "restore",
        listed,
        deleted,
        taken,
        artifact: Some(path),
        cursor: Some(rev),
    })
}

/// Adopts the artifact's operation ledger (docs/writes.md, "The operation ledger"): the rows the
/// fold lacks — operations its donor folded from records this fold never saw — and its watermark
/// where it is higher, committed as reserved keys under the fold's `cursor` (before the restore
/// moves it: a crash in between adopts them again, the same rows). Returns how many rows.
fn adopt_ledger<S: SnapshotStore>(
    store: &SharedStore<S>,
    art: &AnyStore,
    cursor: foldhost_core::kv::WatchCursor,
) -> Result<u64, RepairError> {
    const BATCH: usize = 4096;
    let mut adopted = 0u64;
    let mut batch: Vec<KvUpdate> = Vec::new();
    let mut last: Option<String> = None;
    let refused = |e: ledger::LedgerError| RepairError::Refused(e.to_string());
    let theirs = ledger::read_life(art).map_err(refused)?;
    let ours = ledger::read_life(&*store.read()?).map_err(refused)?;
    loop {
        let mut seen = 0usize;
        let mut next = None;
        art.for_each_in_range_after(ledger::LEDGER_PREFIX, last.as_deref(), &mut |e| {
            seen += 1;
            next = Some(e.key.clone());
            // Only rows of the donor's current life answer anything; they join this fold's life.
            if let Ok(row) = protocol::LedgerRow::decode(&e.value)
                && row.epoch == theirs.epoch
            {
                let row = protocol::LedgerRow {
                    epoch: ours.epoch,
                    ..row
                };
                batch.push(KvUpdate::Put(KvEntry {
                    key: e.key.clone(),
                    value: row.encode().into(),
                    version: VersionToken::UNKNOWN,
                }));
            }
            if seen >= BATCH {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })?;
        let full = seen >= BATCH;
        last = next;
        {
            let local = store.read()?;
            let mut missing = Vec::with_capacity(batch.len());
            for u in batch.drain(..) {
                let mine = ledger::read_row(&*local, &op_of(u.key())?).map_err(refused)?;
                if protocol::row_of_life(mine, ours).is_none() {
                    missing.push(u);
                }
            }
            drop(local);
            if !missing.is_empty() {
                adopted += missing.len() as u64;
                store.write()?.apply(&missing, cursor)?;
            }
        }
        if !full {
            break;
        }
    }
    let mut meta = Vec::new();
    let theirs_mark = ledger::read_watermark(art).map_err(refused)?;
    let ours_mark = ledger::read_watermark(&*store.read()?).map_err(refused)?;
    if theirs_mark > ours_mark {
        meta.push(ledger::watermark_put(theirs_mark));
    }
    // The donor's rows are complete back to its horizon, this fold's to its own: together, back
    // to the later of the two.
    if theirs.horizon_unix_ms > ours.horizon_unix_ms {
        meta.push(ledger::life_put(&protocol::LedgerLife {
            horizon_unix_ms: theirs.horizon_unix_ms,
            ..ours
        }));
    }
    if !meta.is_empty() {
        store.write()?.apply(&meta, cursor)?;
    }
    Ok(adopted)
}

/// The operation id a ledger row's store key names.
fn op_of(key: &str) -> Result<protocol::OpId, RepairError> {
    key.strip_prefix(ledger::LEDGER_PREFIX)
        .and_then(|id| protocol::OpId::parse(id).ok())
        .ok_or_else(|| RepairError::Refused(format!("ledger entry {key:?}: not an operation id")))
}

/// The retention's first revision, or a refusal when the bucket cannot say.
fn first_sequence(r: Option<protocol::Retention>) -> Result<u64, RepairError> {
    r.map(|r| r.first_revision)
        .ok_or_else(|| RepairError::Refused("the bucket cannot report its retention".into()))
}

/// Refuses an artifact of another stream (the bucket's earlier incarnation, another bucket): it
/// would mix two streams' keys. The same identity check the fold's own start makes.
async fn refuse_other_stream(
    watcher: &dyn KvWatcher,
    art: &AnyStore,
    path: &Path,
    rev: u64,
) -> Result<(), RepairError> {
    let Some(live) = watcher.stream_state().await? else {
        return Ok(());
    };
    let recorded = match art.get(foldhost_core::retained::IDENTITY_KEY)? {
        Some(e) => Some(
            foldhost_core::kv::StreamIdentity::from_bytes(&e.value).ok_or_else(|| {
                RepairError::Refused(format!(
                    "artifact {}: its stream identity record does not decode",
                    path.display()
                ))
            })?,
        ),
        None => None,
    };
    let verdict = protocol::stream_identity_check(
        recorded.as_ref().map(|r| *r == live.identity),
        Some(rev),
        live.last_sequence,
    );
    if matches!(
        verdict,
        protocol::IdentityVerdict::Recreated | protocol::IdentityVerdict::CursorAhead
    ) {
        let was = recorded.map_or_else(|| "an unrecorded stream".to_string(), |r| r.to_string());
        return Err(RepairError::Refused(format!(
            "artifact {} folds {was} at cursor {rev}, but the bucket is {} with last sequence {}",
            path.display(),
            live.identity,
            live.last_sequence
        )));
    }
    Ok(())
}

/// The delete candidates (keys the artifact lacks) the bucket does not list live, and how many
/// keys the listing held: a live key's latest write is after the artifact's cursor, and the resume
/// delivers it. The listing vouches for those writes only while the log still holds all of them,
/// so retention is read again after it.
async fn filter_deletes(
    cfg: &RepairConfig,
    watcher: &dyn KvWatcher,
    scope: &WatchScope,
    mut deletes: Vec<String>,
    rev: u64,
) -> Result<(Vec<String>, u64), RepairError> {
    if deletes.is_empty() {
        return Ok((deletes, 0));
    }
    let lister = cfg.lister.clone().ok_or_else(|| {
        RepairError::Refused("no key listing to check delete candidates against".into())
    })?;
    let mut live: HashSet<String> = HashSet::new();
    let cands: HashSet<&str> = deletes.iter().map(String::as_str).collect();
    let listed = lister
        .for_each_key(scope, &mut |k| {
            if cands.contains(k.as_str()) {
                live.insert(k);
            }
            Ok(())
        })
        .await?;
    drop(cands);
    deletes.retain(|k| {
        protocol::restore_key(Some(1), None, false, live.contains(k), None) == KeyRestore::Delete
    });
    let first = first_sequence(watcher.retention().await?)?;
    if !protocol::resume_window_ok(rev, first) {
        return Err(RepairError::Refused(format!(
            "retention passed the artifact's cursor {rev} during the restore (first retained revision now {first})"
        )));
    }
    Ok((deletes, listed))
}

/// Folds the spilled entries to take, then the deletes, through `target` in batches of `max`
/// (the caller has frozen the cursor), passing the restore's crash point after each batch.
async fn fold_difference<T: RepairTarget>(
    target: &mut T,
    spill_path: &Path,
    deletes: Vec<String>,
    max: usize,
) -> Result<u64, T::Error> {
    let f = File::open(spill_path).map_err(io_err(spill_path, "open spill"))?;
    let mut r = BufReader::new(f);
    let mut batch: Vec<KvUpdate> = Vec::with_capacity(max);
    loop {
        let next = read_spilled(&mut r, spill_path)?;
        let end = next.is_none();
        if let Some(e) = next {
            batch.push(KvUpdate::Put(e));
        }
        if batch.len() >= max || (end && !batch.is_empty()) {
            target.commit_all(&mut batch, max).await?;
            crashpoint::hit(crashpoint::RESTORE_BATCH);
        }
        if end {
            break;
        }
    }
    fold_deletes(target, deletes, max, crashpoint::RESTORE_BATCH).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An op id minted at `ms` (a UUIDv7 with `n` in its random bits).
    fn op(ms: u64, n: u8) -> protocol::OpId {
        let mut b = [n; 16];
        b[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
        b[6] = 0x70 | (b[6] & 0x0f);
        b[8] = 0x80 | (b[8] & 0x3f);
        protocol::OpId::from_bytes(b).expect("a v7")
    }

    #[test]
    fn a_restore_adopts_the_rows_and_the_watermark_of_the_artifacts_ledger() {
        let dirs = (
            tempfile::tempdir().expect("tmp"),
            tempfile::tempdir().expect("tmp"),
        );
        let row = |rev: u64, key: &str| protocol::LedgerRow {
            revision: rev,
            key: key.into(),
            recorded_unix_ms: 1,
            epoch: 0,
            digest: Some([7; 16]),
        };
        let stale = protocol::LedgerRow {
            epoch: 9,
            ..row(13, "d")
        };
        let cursor = foldhost_core::kv::WatchCursor::at(10);
        // The donor folded three operations and swept up to 500; the fold holds one of them.
        let (mut art, _) = AnyStore::open(dirs.0.path(), Backend::AppendLog).expect("open");
        art.apply(
            &[
                ledger::row_put(&op(1_000, 1), &row(5, "a")),
                ledger::row_put(&op(2_000, 2), &row(12, "b")),
                ledger::row_put(&op(3_000, 3), &row(14, "c")),
                // A row of an earlier life of the donor's ledger answers nothing: not adopted.
                ledger::row_put(&op(2_500, 4), &stale),
                ledger::watermark_put(500),
            ],
            foldhost_core::kv::WatchCursor::at(14),
        )
        .expect("donor");
        let (mut local, _) = AnyStore::open(dirs.1.path(), Backend::AppendLog).expect("open");
        local
            .apply(&[ledger::row_put(&op(1_000, 1), &row(5, "a"))], cursor)
            .expect("local");
        let shared = SharedStore::new(local);
        assert_eq!(adopt_ledger(&shared, &art, cursor).expect("adopt"), 2);
        let s = shared.read().expect("read");
        for (id, want) in [(op(2_000, 2), row(12, "b")), (op(3_000, 3), row(14, "c"))] {
            assert_eq!(ledger::read_row(&*s, &id).expect("row"), Some(want));
        }
        assert_eq!(ledger::read_row(&*s, &op(2_500, 4)).expect("row"), None);
        assert_eq!(ledger::read_watermark(&*s).expect("watermark"), 500);
        assert_eq!(s.cursor(), cursor, "the cursor is the restore's to move");
        drop(s);
        // Again: nothing more to adopt.
        assert_eq!(adopt_ledger(&shared, &art, cursor).expect("again"), 0);
    }

    #[test]
    fn spilled_entries_read_back_exactly_and_a_bad_length_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("s");
        let entries = [
            KvEntry {
                key: "a".into(),
                value: Bytes::from_static(b"1"),
                version: VersionToken::from_u64(7),
            },
            KvEntry {
                key: "b/c".into(),
                value: Bytes::new(),
                version: VersionToken::from_bytes(&[9; 10]).expect("ten"),
            },
        ];
        let mut buf = Vec::new();
        for e in &entries {
            spill_entry(&mut buf, e).expect("write");
        }
        let mut r = &buf[..];
        for e in &entries {
            assert_eq!(read_spilled(&mut r, &p).expect("read").as_ref(), Some(e));
        }
        assert!(read_spilled(&mut r, &p).expect("end").is_none());
        let mut bad = buf.clone();
        bad[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            read_spilled(&mut &bad[..], &p),
            Err(RepairError::Corrupt { .. })
        ));
    }
}
