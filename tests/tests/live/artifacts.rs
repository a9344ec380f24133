//! Artifacts (export / import) with the real binary: a live export under writes bootstraps a second
//! node that resumes with exactly the tail; every kind of bad artifact is refused with its own error
//! and the destination untouched; a crash at any point of an export (placed by the binary's crash
//! points) never leaves a half artifact.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};

use bytes::Bytes;
use foldhost_core::crashpoint;
use foldhost_core::kv::{KvEntry, KvUpdate, KvWriter, VersionToken, WatchCursor};
use foldhost_core::snapshot::SnapshotStore;
use foldhost_core::storedir::{AnyStore, Backend};
use foldhost_tests::{
    Harness, bucket_contents, dump_store, first_difference, foldhost, run_command, run_to_crash,
    terminate, wait_status, wait_until,
};
use rand::{Rng, SeedableRng};

/// An append-log store of `n` keys (values of `value_len` bytes) at cursor `n`, written directly.
fn make_store(dir: &Path, n: u64, value_len: usize) -> anyhow::Result<()> {
    make_store_with(dir, Backend::AppendLog, n, value_len)
}

/// [`make_store`] on `backend`.
fn make_store_with(dir: &Path, backend: Backend, n: u64, value_len: usize) -> anyhow::Result<()> {
    let (mut store, _) = AnyStore::open(dir, backend)?;
    let value = Bytes::from(vec![b'v'; value_len]);
    let mut rev = 0u64;
    while rev < n {
        let batch: Vec<KvUpdate> = (rev + 1..=(rev + 1000).min(n))
            .map(|r| {
                KvUpdate::Put(KvEntry {
                    key: format!("k.{r:08}"),
                    value: value.clone(),
                    version: VersionToken::from_u64(r),
                })
            })
            .collect();
        rev += batch.len() as u64;
        store.apply(&batch, WatchCursor::at(rev))?;
    }
    Ok(())
}

fn run(args: &[&std::ffi::OsStr]) -> anyhow::Result<Output> {
    Ok(foldhost().args(args).output()?)
}

fn export_offline(store: &Path, out: &Path) -> anyhow::Result<serde_json::Value> {
    let o = run(&[
        "export".as_ref(),
        "--store".as_ref(),
        store.as_os_str(),
        "--out".as_ref(),
        out.as_os_str(),
    ])?;
    anyhow::ensure!(
        o.status.success(),
        "export failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(serde_json::from_slice(&o.stdout)?)
}

fn import(artifact: &Path, store: &Path, extra: &[&str]) -> anyhow::Result<Output> {
    let mut c = foldhost();
    c.args(["import", "--artifact"])
        .arg(artifact)
        .arg("--store")
        .arg(store)
        .args(extra);
    Ok(c.output()?)
}

fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let dst = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            copy_dir(&e.path(), &dst)?;
        } else {
            std::fs::copy(e.path(), &dst)?;
        }
    }
    Ok(())
}

/// Visible (not dot-hidden) entries of `dir`.
fn visible(dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut v: Vec<String> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    v.sort();
    Ok(v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_export_under_writes_bootstraps_a_node_that_replays_only_the_tail()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("art").await?;
    for i in 0..3000 {
        kv.put(&format!("k.{i:04}"), format!("seed{i}").into())
            .await?;
    }
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("node1");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = run_command(&h, "art", &store, Some(&addr))
        .stderr(Stdio::null())
        .spawn()?;
    wait_status(&addr, |s| s.applied_through >= 3000).await?;

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The writer's last acknowledged stream sequence: the test waits on it, not on a clock.
    let acked = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    // The writer keeps each key's last revision: a KV stream keeps one message per key, so the tail
    // a resumed node must receive is the keys whose last message is after the artifact's cursor.
    let writer = {
        let (kv, stop, acked) = (kv.clone(), stop.clone(), acked.clone());
        tokio::spawn(async move {
            let js = kv.jetstream().clone();
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            let mut last_rev: std::collections::HashMap<u32, u64> = Default::default();
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let k = rng.random_range(0..4000u32);
                let subject = format!("$KV.art.k.{k:04}");
                let ack = if n % 10 == 9 {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("KV-Operation", "DEL");
                    js.publish_with_headers(subject, headers, Bytes::new())
                        .await?
                } else {
                    js.publish(subject, format!("w{n}").into()).await?
                };
                let seq = ack.await?.sequence;
                last_rev.insert(k, seq);
                acked.store(seq, std::sync::atomic::Ordering::Relaxed);
                n += 1;
            }
            anyhow::Ok((n, last_rev))
        })
    };
    // Exported mid-stream: the host has folded some of the writer's updates, the writer goes on.
    wait_status(&addr, |s| s.applied_through >= 3200).await?;
    let art = tmp.path().join("art.tar");
    let o = run(&[
        "export".as_ref(),
        "--listen".as_ref(),
        addr.as_ref(),
        "--out".as_ref(),
        art.as_os_str(),
    ])?;
    assert!(
        o.status.success(),
        "live export: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let manifest: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    let cursor = manifest["cursor"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no cursor in {manifest}"))?;
    // A tail to replay: the writer has gone 200 writes past the artifact's cursor.
    wait_until("the writer to pass the artifact's cursor by 200", || {
        acked.load(std::sync::atomic::Ordering::Relaxed) > cursor + 200
    })
    .await?;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (writes, last_rev) = writer.await??;
    terminate(&mut host)?;
    let last = kv.positions().await?.last_sequence;
    assert_eq!(manifest["scope"], "all");
    assert!(
        cursor > 3000 && cursor < last,
        "exported mid-stream: cursor {cursor}, stream at {last}"
    );

    let node2 = tmp.path().join("node2");
    let o = import(&art, &node2, &["--backend", "append-log"])?;
    assert!(
        o.status.success(),
        "import: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = run_command(&h, "art", &node2, None)
        .arg("--catch-up")
        .env("FOLDHOST_LOG", "foldhost=debug")
        .output()?;
    let log = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{log}");
    let status = foldhost_core::storedir::read_status(&node2)
        .ok_or_else(|| anyhow::anyhow!("no status.json after the catch-up run"))?;
    let tail = last_rev.values().filter(|r| **r > cursor).count() as u64;
    assert_eq!(
        status.delivered,
        tail,
        "the imported node replays exactly the tail after the artifact's cursor ({writes} writes in all); stream at {last}, artifact at {cursor}\n{}",
        log.lines()
            .filter(|l| !l.contains("batch parsed"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let want = bucket_contents(&kv).await?;
    assert_eq!(first_difference(&want, &dump_store(&node2)?), None);
    Ok(())
}

#[test]
fn every_kind_of_bad_artifact_is_refused_and_the_destination_is_untouched() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let src = tmp.path().join("src");
    make_store(&src, 2000, 64)?;
    let good = tmp.path().join("good");
    let m = export_offline(&src, &good)?;
    assert_eq!(m["cursor"], 2000);
    assert_eq!(m["backend"], "append-log");

    // Each case: a fresh copy of the good artifact, broken one way, and the words its refusal names.
    each_broken_copy_is_refused(tmp.path(), &good)?;
    // A backend the caller did not ask for is refused before anything is opened.
    let dest = tmp.path().join("dest-wanted-backend");
    let o = import(&good, &dest, &["--backend", "fjall"])?;
    assert_ne!(o.status.code(), Some(0));
    assert!(!dest.exists());

    // A tar carrying a `../` entry: refused, nothing written outside or at the destination.
    let evil = tmp.path().join("evil.tar");
    write_an_escaping_tar(&evil, &good)?;
    let dest = tmp.path().join("dest-tar");
    let o = import(&evil, &dest, &[])?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("unsafe path"), "{err}");
    assert!(!dest.exists());
    assert!(!tmp.path().join("escaped.txt").exists());
    assert!(
        !tmp.path()
            .parent()
            .map(|p| p.join("escaped.txt").exists())
            .unwrap_or(false)
    );

    the_good_artifact_imports_as_a_directory_and_a_tar(tmp.path(), &src, &good)?;
    // An existing fold is never overwritten.
    let o = import(&good, &src, &[])?;
    assert!(String::from_utf8_lossy(&o.stderr).contains("already exists"));
    Ok(())
}

/// A way to break a copy of a good artifact (the directory it is in).
type Break = Box<dyn Fn(&Path) -> anyhow::Result<()>>;

/// A [`Break`] editing the manifest with `f`.
fn edit_manifest(f: fn(&mut serde_json::Value)) -> Break {
    Box::new(move |dir: &Path| {
        let p = dir.join("MANIFEST.json");
        let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p)?)?;
        f(&mut v);
        std::fs::write(&p, serde_json::to_vec(&v)?)?;
        Ok(())
    })
}

/// Each way to break an artifact: what it is, the break, and the words its refusal names.
fn bad_artifact_cases() -> Vec<(&'static str, Break, &'static str)> {
    vec![
        (
            "tampered payload byte",
            Box::new(|dir: &Path| {
                let p = dir.join("data/fold.log");
                let mut b = std::fs::read(&p)?;
                let mid = b.len() / 2;
                b[mid] ^= 0x01;
                std::fs::write(&p, b)?;
                Ok(())
            }),
            "BLAKE3",
        ),
        (
            "missing file",
            Box::new(|dir: &Path| Ok(std::fs::remove_file(dir.join("data/fold.log"))?)),
            "missing from the artifact",
        ),
        (
            "unlisted file",
            Box::new(|dir: &Path| Ok(std::fs::write(dir.join("data/extra.bin"), b"x")?)),
            "not listed in the manifest",
        ),
        (
            "manifest cursor differs from the payload's",
            edit_manifest(|v| v["cursor"] = 1999.into()),
            "recovered cursor",
        ),
        (
            "wrong backend",
            edit_manifest(|v| v["backend"] = "vaxdb".into()),
            "artifact backend vaxdb",
        ),
        (
            "path traversal in the manifest",
            edit_manifest(|v| v["files"][0]["path"] = "../../etc/passwd".into()),
            "unsafe path",
        ),
        (
            "unknown schema",
            edit_manifest(|v| v["schema"] = 99.into()),
            "schema 99",
        ),
    ]
}

/// Each case on a fresh copy of `good` under `tmp`: refused in one line naming its words, the
/// destination untouched.
fn each_broken_copy_is_refused(tmp: &Path, good: &Path) -> anyhow::Result<()> {
    let cases = bad_artifact_cases();
    for (what, breaker, words) in cases {
        let bad = tmp.join(format!("bad-{}", what.replace(' ', "-")));
        copy_dir(good, &bad)?;
        breaker(&bad)?;
        let dest = tmp.join(format!("dest-{}", what.replace(' ', "-")));
        let o = import(&bad, &dest, &[])?;
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{what}: {err}");
        assert!(
            err.contains(words),
            "{what}: the error names {words:?}: {err}"
        );
        assert_eq!(err.trim_end().lines().count(), 1, "{what}: one line: {err}");
        assert!(!dest.exists(), "{what}: the destination was touched");
    }
    Ok(())
}

/// Writes at `evil` a tar of `good`'s manifest and an entry whose path climbs out with `../`.
fn write_an_escaping_tar(evil: &Path, good: &Path) -> anyhow::Result<()> {
    let mut b = tar::Builder::new(std::fs::File::create(evil)?);
    let manifest = std::fs::read(good.join("MANIFEST.json"))?;
    let mut h = tar::Header::new_gnu();
    h.set_size(manifest.len() as u64);
    h.set_mode(0o644);
    h.set_path("MANIFEST.json")?;
    h.set_cksum();
    b.append(&h, manifest.as_slice())?;
    let payload = b"escaped";
    let mut h = tar::Header::new_gnu();
    h.set_size(payload.len() as u64);
    h.set_mode(0o644);
    // `set_path` refuses `..`; a hostile tar is written byte by byte.
    let name = b"data/../../escaped.txt";
    h.as_old_mut().name[..name.len()].copy_from_slice(name);
    h.set_cksum();
    b.append(&h, &payload[..])?;
    b.finish()?;
    Ok(())
}

/// The good artifact imports, as a directory and as a tar, and equals the source.
fn the_good_artifact_imports_as_a_directory_and_a_tar(
    tmp: &Path,
    src: &Path,
    good: &Path,
) -> anyhow::Result<()> {
    // The good one imports, as a directory and as a tar, and equals the source.
    let tar = tmp.join("good.tar");
    let o = run(&[
        "export".as_ref(),
        "--store".as_ref(),
        src.as_os_str(),
        "--out".as_ref(),
        tar.as_os_str(),
    ])?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for (from, to) in [(good, "imported-dir"), (tar.as_path(), "imported-tar")] {
        let dest = tmp.join(to);
        let o = import(from, &dest, &[])?;
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(
            first_difference(&dump_store(src)?, &dump_store(&dest)?),
            None
        );
    }
    Ok(())
}

#[test]
fn a_crash_at_every_point_of_an_export_leaves_only_a_hidden_stage_never_a_half_artifact()
-> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let src = tmp.path().join("src");
    make_store(&src, 20_000, 256)?;
    let outs = tmp.path().join("outs");
    std::fs::create_dir_all(&outs)?;
    let whole = export_offline(&src, &outs.join("whole"))?;
    let files = whole["files"]
        .as_array()
        .map(Vec::len)
        .ok_or_else(|| anyhow::anyhow!("no files in {whole}"))? as u64;
    anyhow::ensure!(files >= 2, "an export of {files} file(s) has no middle");
    // After the copy into the stage, and after every staged file is hashed (the last one: just
    // before the manifest would be written).
    let mut arms = vec![(crashpoint::EXPORT_STAGED, 1)];
    arms.extend((1..=files).map(|n| (crashpoint::EXPORT_FILE, n)));
    let export = |out: &Path| {
        let mut c = foldhost();
        c.args(["export", "--store"])
            .arg(&src)
            .arg("--out")
            .arg(out);
        c
    };
    for (i, (point, n)) in arms.iter().enumerate() {
        let out: PathBuf = outs.join(format!("a{i}"));
        run_to_crash(export(&out), point, *n)?;
        assert!(!out.exists(), "{point}:{n} left a visible artifact");
        // Visible: the whole export and the earlier iterations' re-exports, nothing of this one.
        let mut want: Vec<String> = (0..i).map(|j| format!("a{j}")).collect();
        want.push("whole".into());
        want.sort();
        assert_eq!(
            visible(&outs)?,
            want,
            "nothing but whole artifacts is visible after a crash at {point}:{n}"
        );
        let stages = std::fs::read_dir(&outs)?
            .filter_map(Result::ok)
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!(".a{i}."))
            })
            .count();
        assert_eq!(stages, 1, "the crash at {point}:{n} left its hidden stage");
        // The same export, run again, succeeds beside the dead stage and imports to the source.
        let m = export_offline(&src, &out)?;
        assert_eq!(m["cursor"], 20_000);
        let check = tmp.path().join(format!("check{i}"));
        let o = import(&out, &check, &[])?;
        assert!(
            o.status.success(),
            "a{i} re-exported but does not import: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(
            first_difference(&dump_store(&src)?, &dump_store(&check)?),
            None
        );
    }
    Ok(())
}

/// The backends this build has.
fn compiled_backends() -> Vec<Backend> {
    #[allow(unused_mut)]
    let mut v = vec![Backend::AppendLog];
    #[cfg(feature = "fjall")]
    v.push(Backend::Fjall);
    #[cfg(feature = "rocksdb")]
    v.push(Backend::RocksDb);
    v
}

#[test]
fn every_compiled_backend_round_trips_an_artifact_and_refuses_another_backends()
-> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let backends = compiled_backends();
    for &b in &backends {
        let name = b.as_str();
        let src = tmp.path().join(format!("src-{name}"));
        make_store_with(&src, b, 5000, 100)?;
        let art = tmp.path().join(format!("{name}.tar"));
        let m = export_offline(&src, &art)?;
        assert_eq!(m["backend"], name);
        assert_eq!(m["cursor"], 5000);
        assert_eq!(m["keys"], 5000);
        for &other in backends.iter().filter(|o| **o != b) {
            let dest = tmp.path().join(format!("{name}-as-{}", other.as_str()));
            let o = import(&art, &dest, &["--backend", other.as_str()])?;
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(
                o.status.code(),
                Some(1),
                "{name} as {}: {err}",
                other.as_str()
            );
            assert!(err.contains("does not match"), "{err}");
            assert!(!dest.exists());
        }
        let dest = tmp.path().join(format!("{name}-imported"));
        let o = import(&art, &dest, &["--backend", name])?;
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(
            first_difference(&dump_store(&src)?, &dump_store(&dest)?),
            None,
            "{name}"
        );
    }
    Ok(())
}
