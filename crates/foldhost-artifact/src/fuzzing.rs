//! Not an API: the entry point the fuzz target (`fuzz/fuzz_targets/artifact.rs`) and the corpus
//! replay share (docs/fuzzing.md). Compiled only for this crate's tests and with the `fuzzing`
//! feature.
//!
//! [`artifact`] takes any bytes as an artifact someone handed a node — a manifest, or a tar — and
//! panics only when one of these fails:
//! - The manifest (`read_manifest`; `peek_tar_manifest` for a tar's first entry) is refused with
//!   an error or accepted within its bounds (a schema this build reads, at most `MAX_FILES`
//!   files, every path plain and relative), and what is accepted survives a round trip through
//!   its JSON.
//! - A tar may first be rebuilt with its manifest's sizes and digests made right (bit 1 of the
//!   first byte), so that what the payload's files hold is reached: the fold's log
//!   (`CompactLogCheck`, the reopen), its `FOLDHOST.json`, the state folds.
//! - Both imports — of the tar as a file (`import_artifact`: unpacked into a stage, then
//!   checked) and as a stream (`import_tar_stream`, with the tar's own first entry as the
//!   pointer's manifest) — answer an error or a store, never a panic; nothing is written outside
//!   the destination's directory (the tree above it, three levels deep, holds exactly the tar
//!   and the imported stores afterwards: no stage left, no link, no special file); a refused
//!   import leaves no destination; an accepted one opens at the manifest's cursor; and when
//!   both accept, they import the same manifest and the same fold.

use std::io::Read as _;
use std::path::{Path, PathBuf};

use foldhost_core::snapshot::SnapshotStore as _;
use foldhost_core::storedir::AnyStore;

use crate::artifact::{
    self, ArtifactError, ExportManifest, MAX_MANIFEST_BYTES, TarGuard, import_artifact,
};

/// A directory for one input's files (on the memory file system where there is one: an import
/// fsyncs), removed when dropped.
fn scratch_dir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    tempfile::Builder::new()
        .prefix("foldhost-fuzz-")
        .tempdir_in(base)
        .expect("a scratch directory")
}

/// Every path under `root` (relative, sorted), refusing a link or a special file.
fn tree(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).expect("list").flatten() {
            let ty = e.file_type().expect("file type");
            let rel = e.path().strip_prefix(root).expect("under").to_path_buf();
            assert!(
                ty.is_dir() || ty.is_file(),
                "an import left {} ({ty:?}): neither a file nor a directory",
                rel.display()
            );
            if ty.is_dir() {
                stack.push(e.path());
            }
            out.push(rel);
        }
    }
    out.sort();
    out
}

/// The manifest's bounds (module docs), and its round trip through its JSON.
fn check_manifest(m: &ExportManifest, scratch: &Path) {
    assert!((1..=2).contains(&m.schema), "schema {}", m.schema);
    assert!(m.files.len() <= 100_000);
    for f in &m.files {
        let p = artifact::check_path(&f.path).expect("an accepted manifest's path is plain");
        assert!(p.is_relative());
    }
    let dir = scratch.join("manifest");
    std::fs::create_dir_all(&dir).expect("create");
    std::fs::write(
        dir.join("MANIFEST.json"),
        serde_json::to_vec(m).expect("a manifest encodes"),
    )
    .expect("write");
    let again = artifact::read_manifest(&dir).expect("an accepted manifest, encoded, reads again");
    assert_eq!(&again, m, "a manifest does not survive its JSON");
    std::fs::remove_dir_all(&dir).expect("clean");
}

/// The bytes of the tar's first entry when it is the manifest (what a publish hands a
/// bootstrap as the pointer), else nothing.
fn embedded_manifest(tar: &[u8]) -> Vec<u8> {
    let mut archive = tar::Archive::new(TarGuard::new(tar));
    let Ok(mut entries) = archive.entries() else {
        return Vec::new();
    };
    let Some(Ok(first)) = entries.next() else {
        return Vec::new();
    };
    if *first.path_bytes() != *b"MANIFEST.json" {
        return Vec::new();
    }
    let mut bytes = Vec::new();
    let _ = first.take(MAX_MANIFEST_BYTES + 1).read_to_end(&mut bytes);
    bytes
}

/// After an import into `dest` (inside `inner`, three levels under `root`): nothing outside
/// `inner` but the levels themselves, nothing in `inner` but `keep`, no destination on a
/// refusal, and the store at the manifest's cursor on an acceptance. The store's cursor and key
/// count.
fn check_import(
    root: &Path,
    inner: &Path,
    keep: &[&str],
    dest: &Path,
    got: &Result<ExportManifest, ArtifactError>,
) -> Option<(Option<u64>, u64)> {
    let levels: Vec<PathBuf> = ["a", "a/b", "a/b/c"].iter().map(PathBuf::from).collect();
    let outside: Vec<PathBuf> = tree(root)
        .into_iter()
        .filter(|p| !p.starts_with("a/b/c/in") || p == Path::new("a/b/c/in"))
        .filter(|p| p != Path::new("a/b/c/in") && !levels.contains(p))
        .collect();
    assert!(
        outside.is_empty(),
        "written outside the import: {outside:?}"
    );
    let mut names: Vec<String> = std::fs::read_dir(inner)
        .expect("list")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut want: Vec<String> = keep.iter().map(|s| s.to_string()).collect();
    let dest_name = dest
        .file_name()
        .expect("a name")
        .to_string_lossy()
        .into_owned();
    if got.is_ok() {
        want.push(dest_name);
    }
    want.sort();
    assert_eq!(names, want, "after an import answering {got:?}");
    let m = got.as_ref().ok()?;
    let _ = tree(dest);
    let (store, _) = AnyStore::open_read_only(dest).expect("an imported store opens");
    assert_eq!(
        store.cursor().revision(),
        m.cursor,
        "the imported cursor is not the manifest's"
    );
    Some((m.cursor, store.len().expect("len")))
}

/// The tar rebuilt with its manifest (its first entry) listing the size and BLAKE3 digest of
/// each payload entry it names, so that the fuzzer reaches what the payload's files hold past
/// the digest check; `None` when it does not read as a tar with its manifest first.
fn resealed(tar: &[u8]) -> Option<Vec<u8>> {
    let mut archive = tar::Archive::new(TarGuard::new(tar));
    let mut entries = Vec::new();
    for e in archive.entries().ok()? {
        let mut e = e.ok()?;
        let name = e.path_bytes().into_owned();
        let kind = e.header().entry_type();
        let mut body = Vec::new();
        (&mut e).take(1 << 20).read_to_end(&mut body).ok()?;
        entries.push((name, kind, body));
        if entries.len() > 64 {
            return None;
        }
    }
    let (first, payload) = entries.split_first_mut()?;
    if first.0 != b"MANIFEST.json" {
        return None;
    }
    let mut m: serde_json::Value = serde_json::from_slice(&first.2).ok()?;
    for f in m.get_mut("files")?.as_array_mut()? {
        let name = format!("data/{}", f.get("path")?.as_str()?);
        if let Some((_, _, body)) = payload
            .iter()
            .find(|(n, k, _)| k.is_file() && n.as_slice() == name.as_bytes())
        {
            f["size"] = body.len().into();
            f["blake3"] = blake3::hash(body).to_hex().to_string().into();
        }
    }
    first.2 = serde_json::to_vec_pretty(&m).ok()?;
    let mut b = tar::Builder::new(Vec::new());
    for (name, kind, body) in &entries {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(*kind);
        h.set_size(body.len() as u64);
        h.set_mode(0o644);
        let n = name.len().min(100);
        h.as_old_mut().name[..n].copy_from_slice(&name[..n]);
        h.set_cksum();
        b.append(&h, body.as_slice()).ok()?;
    }
    b.into_inner().ok()
}

/// An artifact someone handed a node (module docs): the first byte's bit 0 says whether the rest
/// is a manifest's JSON or a tar, and for a tar its bit 1 whether the manifest's sizes and
/// digests are first made those of the payload it carries ([`resealed`]).
pub fn artifact(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let root = scratch_dir();
    let inner = root.path().join("a/b/c/in");
    std::fs::create_dir_all(&inner).expect("create");
    if mode & 1 == 1 {
        let dir = inner.join("art");
        std::fs::create_dir_all(dir.join("data")).expect("create");
        std::fs::write(dir.join("MANIFEST.json"), rest).expect("write");
        if let Ok(m) = artifact::read_manifest(&dir) {
            check_manifest(&m, root.path());
        }
        let dest = inner.join("dest");
        let got = import_artifact(&dir, &dest, None, &mut |_, _| {});
        check_import(root.path(), &inner, &["art"], &dest, &got);
        return;
    }
    let resealed = (mode & 2 == 2).then(|| resealed(rest)).flatten();
    let rest = resealed.as_deref().unwrap_or(rest);
    let tar_path = inner.join("in.tar");
    std::fs::write(&tar_path, rest).expect("write");
    if let Ok(m) = artifact::peek_tar_manifest(&tar_path) {
        check_manifest(&m, root.path());
    }
    let by_file = inner.join("dest-file");
    let got_file = import_artifact(&tar_path, &by_file, None, &mut |_, _| {});
    let file_fold = check_import(root.path(), &inner, &["in.tar"], &by_file, &got_file);

    let pointer = embedded_manifest(rest);
    let by_stream = inner.join("dest-stream");
    let got_stream = artifact::import_tar_stream(rest, &pointer, &by_stream, None, &mut |_, _| {});
    let mut keep = vec!["in.tar"];
    if got_file.is_ok() {
        keep.push("dest-file");
    }
    let stream_fold = check_import(root.path(), &inner, &keep, &by_stream, &got_stream);
    if let (Ok(a), Ok(b)) = (&got_file, &got_stream) {
        assert_eq!(a, b, "the two imports read different manifests");
        assert_eq!(
            file_fold, stream_fold,
            "the two imports hold different folds"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus_dirs() -> [PathBuf; 2] {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
        [
            root.join("corpus/artifact"),
            root.join("regressions/artifact"),
        ]
    }

    #[test]
    fn every_artifact_in_the_fuzz_corpus_is_refused_or_imported_without_writing_outside_its_destination()
     {
        let [corpus, regressions] = corpus_dirs();
        let mut files = Vec::new();
        for dir in [&corpus, &regressions] {
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                files.push(e.path());
            }
        }
        files.sort();
        assert!(
            files.iter().any(|f| f.starts_with(&corpus)),
            "no corpus at {}",
            corpus.display()
        );
        for f in files {
            eprintln!("replay {}", f.display());
            artifact(&std::fs::read(&f).expect("read a corpus file"));
        }
    }

    /// Writes the seeds of `fuzz/corpus/artifact/` from a real export (docs/fuzzing.md,
    /// "Seeds"): the tar `export_store` writes, it cut short and with its manifest changed, its
    /// manifest alone, and hostile tars (a path out of the directory, a link, a long-name
    /// extension, a PAX size record).
    /// `cargo test -p foldhost-artifact --features fuzzing write_the_seed_corpus -- --ignored`.
    #[test]
    #[ignore = "writes fuzz/corpus: run by hand to regenerate the seeds"]
    fn write_the_seed_corpus() {
        let [dir, _] = corpus_dirs();
        std::fs::create_dir_all(&dir).expect("corpus directory");
        let write = |mode: u8, bytes: &[u8]| {
            let mut seed = vec![mode];
            seed.extend_from_slice(bytes);
            let name = blake3::hash(&seed).to_hex();
            std::fs::write(dir.join(&name[..40]), &seed).expect("write a seed");
        };
        let tar = exported_tar();
        write(0, &tar);
        write(2, &tar);
        write(0, &tar[..tar.len() / 2]);
        let manifest = embedded_manifest(&tar);
        write(1, &manifest);
        let text = String::from_utf8(manifest.clone()).expect("JSON");
        let moved = text.replace("\"cursor\": 2", "\"cursor\": 3");
        assert_ne!(moved, text, "the manifest names its cursor");
        write(1, moved.as_bytes());
        // The same tar with its manifest's cursor moved (same length: the tar still frames).
        let mut bad = tar.clone();
        if let Some(at) = bad.windows(11).position(|w| w == b"\"cursor\": 2") {
            bad[at + 10] = b'3';
            write(0, &bad);
        }
        use tar::EntryType::{Directory, GNULongName, Link, Regular, Symlink, XHeader};
        for (kind, name, body, link) in [
            (Regular, &b"../escaped"[..], &b"x"[..], None),
            (Regular, b"data/../../x", b"x", None),
            (Symlink, b"data/fold.log", b"", Some("/etc/passwd")),
            (Link, b"data/fold.log", b"", Some("MANIFEST.json")),
            (GNULongName, b"././@LongLink", b"data/fold.log\0", None),
            (XHeader, b"pax", b"13 size=999\n", None),
            (Directory, b"data/sub/", b"", None),
        ] {
            write(0, &hostile_tar(&manifest, kind, name, body, link));
        }
    }

    /// The tar `export_store` writes for a small append-log fold.
    fn exported_tar() -> Vec<u8> {
        use foldhost_core::kv::{KvEntry, KvUpdate, VersionToken, WatchCursor};
        use foldhost_core::storedir::Backend;

        let work = scratch_dir();
        let (mut store, _) =
            AnyStore::open(&work.path().join("store"), Backend::AppendLog).expect("a store");
        let put = |k: &str, v: &'static [u8], rev| {
            KvUpdate::Put(KvEntry {
                key: k.into(),
                value: bytes::Bytes::from_static(v),
                version: VersionToken::from_u64(rev),
            })
        };
        store
            .apply(
                &[put("a", b"1", 1), put("b/c", b"two", 2)],
                WatchCursor::at(2),
            )
            .expect("apply");
        let out = work.path().join("x.tar");
        artifact::export_store(&store, Backend::AppendLog, &[], &out, None, &mut |_, _| {})
            .expect("export");
        std::fs::read(&out).expect("read the tar")
    }

    /// A tar of `manifest` then one entry of `kind` named `name` (raw bytes: `..` passes).
    fn hostile_tar(
        manifest: &[u8],
        kind: tar::EntryType,
        name: &[u8],
        body: &[u8],
        link: Option<&str>,
    ) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(manifest.len() as u64);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_path("MANIFEST.json").expect("path");
        h.set_cksum();
        b.append(&h, manifest).expect("append");
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(body.len() as u64);
        h.set_mode(0o644);
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        if let Some(l) = link {
            h.set_link_name(l).expect("link");
        }
        h.set_cksum();
        b.append(&h, body).expect("append");
        b.into_inner().expect("tar")
    }
}
