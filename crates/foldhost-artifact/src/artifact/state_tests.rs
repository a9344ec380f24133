//! State buckets' folds in an artifact: carried at their cursors, checked like the main fold's on
//! import, and refused (the destination untouched) when altered or misdescribed.

use super::*;
use foldhost_core::kv::{KvEntry, KvUpdate, VersionToken};
use foldhost_core::view::SharedStore;

/// An append-log store in `dir` holding `keys` keys with `prefix`, at cursor `at`.
fn log_store(dir: &Path, prefix: &str, keys: u64, at: u64) -> AnyStore {
    let (mut store, _) = AnyStore::open(dir, Backend::AppendLog).expect("open");
    let batch: Vec<KvUpdate> = (1..=keys)
        .map(|r| {
            KvUpdate::Put(KvEntry {
                key: format!("{prefix}{r:03}"),
                value: vec![b's'; 40].into(),
                version: VersionToken::from_u64(r),
            })
        })
        .collect();
    store.apply(&batch, WatchCursor::at(at)).expect("apply");
    store
}

/// A main fold at 50 and two state folds (`notes` at 7 with 5 keys, `agent.servers` at 30 with 12).
fn node(root: &Path) -> (AnyStore, Vec<SharedStore<AnyStore>>) {
    let main = log_store(&root.join("src"), "k", 50, 50);
    let lanes = [("notes", 5, 7), ("agent.servers", 12, 30)]
        .into_iter()
        .map(|(local, keys, at)| {
            SharedStore::new(log_store(
                &root.join("src").join("state").join(local),
                "s",
                keys,
                at,
            ))
        })
        .collect();
    (main, lanes)
}

fn export(root: &Path, out: &Path) -> ExportManifest {
    let (main, lanes) = node(root);
    let sources: Vec<StateFoldSource> = ["notes", "agent.servers"]
        .iter()
        .zip(&lanes)
        .map(|(local, store)| StateFoldSource {
            local: local.to_string(),
            store: store.downgrade(),
        })
        .collect();
    export_store(
        &main,
        Backend::AppendLog,
        &sources,
        out,
        None,
        &mut |_, _| {},
    )
    .expect("export")
}

fn rewrite_manifest(art: &Path, edit: impl FnOnce(&mut ExportManifest)) {
    let mut m = read_manifest(art).expect("manifest");
    edit(&mut m);
    std::fs::write(
        art.join(MANIFEST_FILE),
        serde_json::to_vec_pretty(&m).expect("json"),
    )
    .expect("write");
}

#[test]
fn an_artifact_carries_each_state_fold_at_its_cursor_and_an_import_restores_it_beside_the_main_fold()
 {
    let tmp = tempfile::tempdir().expect("tempdir");
    for out in [tmp.path().join("art"), tmp.path().join("art.tar")] {
        let root = tmp
            .path()
            .join(format!("n-{}", out.display().to_string().len()));
        let m = export(&root, &out);
        assert_eq!((m.cursor, m.keys), (Some(50), 50));
        let got: Vec<(&str, Option<u64>, u64)> = m
            .state
            .iter()
            .map(|s| (s.local.as_str(), s.cursor, s.keys))
            .collect();
        assert_eq!(
            got,
            vec![("notes", Some(7), 5), ("agent.servers", Some(30), 12)]
        );
        assert!(
            m.files.iter().any(|f| f.path == "state/notes/fold.log"),
            "each state fold's files are listed and hashed: {:?}",
            m.files
        );
        let dest = root.join("imported");
        let imported = import_artifact(&out, &dest, None, &mut |_, _| {}).expect("imports");
        assert_eq!(imported.state, m.state);
        for (local, keys, at) in [("notes", 5, 7), ("agent.servers", 12, 30)] {
            let (lane, _) = AnyStore::open_read_only(
                &dest.join(foldhost_core::storedir::STATE_DIR).join(local),
            )
            .expect("the state fold opens");
            assert_eq!(lane.cursor(), WatchCursor::at(at), "{local}");
            assert_eq!(lane.len().expect("len"), keys, "{local}");
        }
        let (main, _) = AnyStore::open_read_only(&dest).expect("the main fold opens");
        assert_eq!(
            (main.cursor(), main.len().expect("len")),
            (WatchCursor::at(50), 50)
        );
    }
}

#[test]
fn an_artifact_without_state_buckets_writes_no_state_field_for_older_readers() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let main = log_store(&tmp.path().join("src"), "k", 3, 3);
    let out = tmp.path().join("art");
    export_store(&main, Backend::AppendLog, &[], &out, None, &mut |_, _| {}).expect("export");
    let text = std::fs::read_to_string(out.join(MANIFEST_FILE)).expect("read");
    assert!(!text.contains("\"state\""), "{text}");
}

#[test]
fn an_altered_state_fold_is_refused_and_the_destination_is_untouched() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("art");
    export(tmp.path(), &out);
    let log = out.join(DATA_DIR).join("state/notes/fold.log");
    let mut bytes = std::fs::read(&log).expect("read");
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&log, bytes).expect("write");
    let dest = tmp.path().join("node");
    let err = import_artifact(&out, &dest, None, &mut |_, _| {}).expect_err("refused");
    assert!(
        matches!(&err, ArtifactError::HashMismatch { path, .. } if path == "state/notes/fold.log"),
        "{err}"
    );
    assert!(!dest.exists(), "the destination is untouched");
}

#[test]
fn a_state_entry_naming_another_cursor_is_refused_by_the_reopened_copy() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("art");
    export(tmp.path(), &out);
    rewrite_manifest(&out, |m| m.state[1].cursor = Some(31));
    let dest = tmp.path().join("node");
    let err = import_artifact(&out, &dest, None, &mut |_, _| {}).expect_err("refused");
    assert!(
        matches!(&err, ArtifactError::StateCursorMismatch { local, want: Some(31), got: Some(30) } if local == "agent.servers"),
        "{err}"
    );
    assert!(!dest.exists(), "the destination is untouched");
}

#[test]
fn a_state_entry_that_is_no_bucket_name_or_a_file_in_no_listed_bucket_is_refused_before_any_copy() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("art");
    export(tmp.path(), &out);
    let original = std::fs::read(out.join(MANIFEST_FILE)).expect("read");
    type Edit = Box<dyn FnOnce(&mut ExportManifest)>;
    let edits: Vec<(&str, Edit)> = vec![
        ("a path", Box::new(|m| m.state[0].local = "../notes".into())),
        (
            "dotted twice",
            Box::new(|m| m.state[0].local = "a.b.c".into()),
        ),
        (
            "listed twice",
            Box::new(|m| m.state[1].local = "notes".into()),
        ),
        ("unlisted", Box::new(|m| m.state.remove(0).local.clear())),
        (
            "another backend",
            Box::new(|m| m.state[0].backend = "rocksdb".into()),
        ),
        (
            "too many",
            Box::new(|m| {
                let one = m.state[0].clone();
                m.state = vec![one; MAX_STATE_FOLDS + 1];
            }),
        ),
    ];
    for (what, edit) in edits {
        std::fs::write(out.join(MANIFEST_FILE), &original).expect("restore");
        rewrite_manifest(&out, edit);
        let dest = tmp.path().join("node");
        let err = import_artifact(&out, &dest, None, &mut |_, _| {}).expect_err(what);
        assert!(
            matches!(err, ArtifactError::Manifest { .. }),
            "{what}: refused as a bad manifest: {err}"
        );
        assert!(!dest.exists(), "{what}: the destination is untouched");
    }
}

#[test]
fn a_downloaded_tar_stream_restores_the_state_folds_as_a_directory_import_does() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let tar_path = tmp.path().join("art.tar");
    let m = export(tmp.path(), &tar_path);
    let pointer = serde_json::to_vec_pretty(&m).expect("json");
    assert_eq!(
        peek_tar_manifest(&tar_path).expect("peek"),
        m,
        "the tar's embedded manifest"
    );
    let dest = tmp.path().join("node");
    let src = File::open(&tar_path).expect("open");
    let got = import_tar_stream(src, &pointer, &dest, None, &mut |_, _| {}).expect("imports");
    assert_eq!(got.state, m.state);
    let (lane, _) = AnyStore::open_read_only(&dest.join("state/agent.servers")).expect("opens");
    assert_eq!(lane.cursor(), WatchCursor::at(30));
}
