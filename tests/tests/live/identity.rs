//! Bucket identity (docs/design.md, "Bucket identity"): a fold records which stream it folds (name
//! and creation time) and checks it at every start and every watch (re)start, so a bucket deleted
//! and created again under the same name is never folded as if it were the old one — under a
//! stopped node and under a running one. By default the run refuses with one line and leaves the
//! fold byte for byte as it was; with `--on-recreated relist` the fold becomes exactly the new
//! bucket.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Output;

use bytes::Bytes;
use foldhost_core::kv::KvWriter;
use foldhost_tests::{
    Harness, bucket_contents, dump_store, first_difference, publish_all, run_command, spawn_logged,
    status_store, wait_status,
};

/// 3 000 writes over 1 000 keys (`old.0000`…`old.0999`), then the node catches up.
async fn fold_old_bucket(h: &Harness, bucket: &str, store: &Path) -> anyhow::Result<u64> {
    let kv = h.bucket(bucket).await?;
    publish_all(
        kv.jetstream(),
        (0..3000u32).map(|i| {
            (
                format!("$KV.{bucket}.old.{:04}", i % 1000),
                Bytes::from(format!("old-{i}")),
            )
        }),
    )
    .await?;
    let o = run_command(h, bucket, store, None)
        .arg("--catch-up")
        .output()?;
    ok(&o, "first catch-up")?;
    let cursor = status_store(store)?.cursor.unwrap_or(0);
    assert_eq!(cursor, 3000);
    Ok(cursor)
}

/// Deletes the bucket's stream and creates the bucket again with 500 writes: 450 new keys and 50
/// of the old names with new values.
async fn recreate(
    h: &Harness,
    bucket: &str,
) -> anyhow::Result<std::sync::Arc<foldhost_nats::NatsKv>> {
    let kv = h.bucket(bucket).await?;
    kv.jetstream().delete_stream(format!("KV_{bucket}")).await?;
    let kv = h.bucket(bucket).await?;
    for i in 0..450u32 {
        kv.put(&format!("new.{i:04}"), Bytes::from(format!("new-{i}")))
            .await?;
    }
    for i in 0..50u32 {
        kv.put(&format!("old.{i:04}"), Bytes::from(format!("again-{i}")))
            .await?;
    }
    assert_eq!(kv.positions().await?.last_sequence, 500);
    Ok(kv)
}

/// Waits until the node serving `addr` is watching live: a write after its start is applied.
async fn watching(h: &Harness, bucket: &str, addr: &str) -> anyhow::Result<()> {
    h.bucket(bucket)
        .await?
        .put("old.live", Bytes::from_static(b"live"))
        .await?;
    wait_status(addr, |s| s.applied_through == 3001).await?;
    Ok(())
}

fn ok(o: &Output, what: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        o.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(())
}

/// Every file of the store's fold, byte for byte (the status file a run rewrites on exit, and the
/// lock, left out).
fn fold_files(store: &Path) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![store.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let p = e.path();
            let rel = p.strip_prefix(store)?.to_string_lossy().to_string();
            if e.file_type()?.is_dir() {
                dirs.push(p);
            } else if !rel.ends_with("status.json") && !rel.ends_with(".lock") && rel != "LOCK" {
                out.insert(rel, std::fs::read(&p)?);
            }
        }
    }
    Ok(out)
}

/// The refusal: one error line naming the bucket, both identities and what to do.
fn assert_refused(o: &Output, bucket: &str) {
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "a recreated bucket was folded:\n{stderr}"
    );
    let line = stderr
        .lines()
        .find(|l| l.starts_with("foldhost: error: "))
        .unwrap_or_default();
    assert!(
        line.contains(&format!("bucket {bucket}:"))
            && line.contains(&format!("the fold folds stream KV_{bucket} created"))
            && line.contains(&format!("the bucket is now stream KV_{bucket} created"))
            && line.contains("--on-recreated relist"),
        "not the one-line refusal: {line:?}\n{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_recreated_under_a_stopped_node_is_refused_untouched_and_relisted_on_request()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("node");
    fold_old_bucket(&h, "recr", &store).await?;
    let before = fold_files(&store)?;
    let kv = recreate(&h, "recr").await?;

    // Refused by default, the fold byte for byte as it was (a catch-up and a long-running start).
    let o = run_command(&h, "recr", &store, None)
        .arg("--catch-up")
        .output()?;
    assert_refused(&o, "recr");
    let o = run_command(&h, "recr", &store, None)
        .args(["--on-recreated", "refuse"])
        .output()?;
    assert_refused(&o, "recr");
    let after = fold_files(&store)?;
    let changed: Vec<&String> = before
        .keys()
        .chain(after.keys())
        .filter(|k| before.get(*k) != after.get(*k))
        .collect();
    assert!(
        changed.is_empty(),
        "a refused run changed the fold: {changed:?}"
    );

    // On request: re-folded to exactly the new bucket, its cursor the new stream's.
    let o = run_command(&h, "recr", &store, None)
        .args(["--catch-up", "--on-recreated", "relist"])
        .output()?;
    ok(&o, "relisting catch-up")?;
    let want = bucket_contents(&kv).await?;
    assert_eq!(want.len(), 500);
    assert_eq!(first_difference(&want, &dump_store(&store)?), None);
    assert_eq!(status_store(&store)?.cursor, Some(500));

    // The new identity is recorded: a plain restart resumes with a delta.
    kv.put("new.late", Bytes::from_static(b"late")).await?;
    let o = run_command(&h, "recr", &store, None)
        .arg("--catch-up")
        .output()?;
    ok(&o, "restart on the new bucket")?;
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&store)?),
        None
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_recreated_under_a_running_node_stops_it_untouched_or_is_relisted_live()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let bucket = "live";

    // Default: the running node stops with the refusal, the fold as it was.
    let store = tmp.path().join("refusing");
    fold_old_bucket(&h, bucket, &store).await?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    // A recreation ends the watch by its silence: three heartbeats of one second each.
    let mut child = run_command(&h, bucket, &store, Some(&addr))
        .args(["--watch-heartbeat", "1"])
        .stderr(std::process::Stdio::null())
        .spawn()?;
    watching(&h, bucket, &addr).await?;
    recreate(&h, bucket).await?;
    // A node serving `--listen` stays up to report its failure.
    let st = wait_status(&addr, |s| s.state == "failed").await?;
    let error = st.error.as_deref().unwrap_or_default();
    assert!(
        error.starts_with(&format!(
            "bucket {bucket}: the fold folds stream KV_{bucket} created"
        )) && error.contains("--on-recreated relist"),
        "{st:?}"
    );
    foldhost_tests::terminate(&mut child)?;
    let o = run_command(&h, bucket, &store, None)
        .arg("--catch-up")
        .output()?;
    assert_refused(&o, bucket);
    let old: Vec<String> = dump_store(&store)?.into_keys().collect();
    assert_eq!(old.len(), 1001, "the refused fold keeps the old keys");
    assert!(old.iter().all(|k| k.starts_with("old.")));

    // With --on-recreated relist: the running node re-folds the new bucket in process.
    h.bucket(bucket)
        .await?
        .jetstream()
        .delete_stream(format!("KV_{bucket}"))
        .await?;
    let store = tmp.path().join("relisting");
    fold_old_bucket(&h, bucket, &store).await?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut cmd = run_command(&h, bucket, &store, Some(&addr));
    cmd.args(["--on-recreated", "relist", "--watch-heartbeat", "1"]);
    let (mut child, mut log) = spawn_logged(cmd)?;
    watching(&h, bucket, &addr).await?;
    let kv = recreate(&h, bucket).await?;
    log.wait_for("recreated bucket: fold reset")?;
    kv.put("new.after", Bytes::from_static(b"after")).await?;
    let st = wait_status(&addr, |s| s.applied_through == 501).await?;
    assert_eq!(st.repairs, 1, "{st:?}");
    assert_eq!(st.state, "running", "{st:?}");
    foldhost_tests::terminate(&mut child)?;
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&store)?),
        None
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_artifact_of_the_buckets_earlier_incarnation_is_never_restored() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let exporter = tmp.path().join("exporter");
    fold_old_bucket(&h, "incarn", &exporter).await?;
    let artifacts = tmp.path().join("artifacts");
    std::fs::create_dir_all(&artifacts)?;
    // Exported from a running host (an artifact records the scope it vouches for).
    let ea = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut ex = run_command(&h, "incarn", &exporter, Some(&ea))
        .stderr(std::process::Stdio::null())
        .spawn()?;
    wait_status(&ea, |s| s.applied_through == 3000).await?;
    let o = foldhost_tests::foldhost()
        .args(["export", "--listen", &ea, "--out"])
        .arg(artifacts.join("old"))
        .output()?;
    ok(&o, "export")?;
    foldhost_tests::terminate(&mut ex)?;

    // The bucket is created again, evicting by age, with more writes than the artifact's cursor:
    // by revisions alone the old artifact would look ahead of a fresh node and inside retention.
    let kv = h.bucket("incarn").await?;
    kv.jetstream().delete_stream("KV_incarn").await?;
    let kv = h
        .conn
        .bucket(
            "incarn",
            &foldhost_core::bucket::BucketConfig {
                max_bytes: None,
                max_age: Some(std::time::Duration::from_secs(3600)),
                ..foldhost_core::bucket::BucketConfig::default()
            },
        )
        .await?;
    publish_all(
        kv.jetstream(),
        (0..3500u32).map(|i| (format!("$KV.incarn.new.{:04}", i % 700), Bytes::from("new"))),
    )
    .await?;

    let node = tmp.path().join("node");
    let o = run_command(&h, "incarn", &node, None)
        .args(["--catch-up", "--restore-from"])
        .arg(&artifacts)
        .output()?;
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "restored an artifact of another stream:\n{stderr}"
    );
    assert!(
        stderr.contains("folds stream KV_incarn created")
            && stderr.contains("but the bucket is stream KV_incarn created"),
        "{stderr}"
    );
    assert!(
        foldhost_tests::dump_store(&node).map_or(true, |d| d.is_empty()),
        "nothing of the old stream reached the fold"
    );
    Ok(())
}

/// The clean-stop record's life on a real node: a running node has none (its writable open removed
/// it), a SIGTERM stop leaves one naming the committed cursor and the stream's identity, the next
/// run's open removes it again, and a SIGKILL leaves none behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_leaves_the_record_the_next_open_removes_it_and_a_kill_leaves_none()
-> anyhow::Result<()> {
    use foldhost_core::storedir::closed;
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("s");
    let kv = h.bucket("closing").await?;
    publish_all(
        kv.jetstream(),
        (0..200u32).map(|i| (format!("$KV.closing.k.{i:03}"), Bytes::from("v"))),
    )
    .await?;
    let record = store.join(closed::CLOSED_FILE);
    let start = || -> anyhow::Result<(std::process::Child, String)> {
        let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
        let child = run_command(&h, "closing", &store, Some(&addr))
            .stderr(std::process::Stdio::null())
            .spawn()?;
        Ok((child, addr))
    };

    let (mut a, addr) = start()?;
    wait_status(&addr, |s| s.applied_through == 200).await?;
    assert!(!record.exists(), "a running node has no clean-stop record");
    foldhost_tests::terminate(&mut a)?;
    let found = closed::read(&store)
        .ok_or_else(|| anyhow::anyhow!("no usable clean-stop record after SIGTERM"))?;
    assert_eq!(found.cursor.revision(), Some(200));
    assert!(found.identity.is_some(), "the record carries the identity");

    let (mut b, addr) = start()?;
    wait_status(&addr, |s| s.applied_through == 200).await?;
    assert!(!record.exists(), "the next run's open removed the record");
    b.kill()?;
    b.wait()?;
    assert!(!record.exists(), "a killed node left a record");
    assert_eq!(closed::read(&store), None);
    Ok(())
}

/// A put that retries while the client reconnects to a restarted server.
async fn put_retrying(kv: &foldhost_nats::NatsKv, key: &str, value: &str) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while kv.put(key, Bytes::from(value.to_string())).await.is_err() {
        anyhow::ensure!(std::time::Instant::now() < deadline, "writes never resumed");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Copies a directory tree (`cp -a`).
fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    let st = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()?;
    anyhow::ensure!(st.success(), "cp -a {} {}", from.display(), to.display());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restored_from_an_older_copy_and_written_past_the_fold_is_refused_as_log_diverged()
-> anyhow::Result<()> {
    let mut h = Harness::start().await?;
    let kv = h.bucket("div").await?;
    for i in 0..10 {
        kv.put(&format!("k.{i:02}"), "old".into()).await?;
    }
    // The broker's store as it was at sequence 10.
    let tmp = tempfile::tempdir()?;
    let copy = tmp.path().join("copy");
    h.server.stop();
    copy_tree(h.server.store_dir(), &copy)?;
    h.server.restart()?;
    for i in 10..20 {
        put_retrying(&kv, &format!("k.{i:02}"), "later").await?;
    }
    let store = tmp.path().join("fold");
    let o = run_command(&h, "div", &store, None)
        .arg("--catch-up")
        .output()?;
    ok(&o, "the first catch-up")?;
    let stopped = foldhost_core::storedir::read_status(&store).expect("status.json");
    assert_eq!(stopped.cursor, Some(20));
    assert_eq!(
        stopped.checkpoint_revision,
        Some(20),
        "the checkpoint covers the last record: {stopped:?}"
    );
    assert!(stopped.checkpoint_stored_at.is_some(), "{stopped:?}");
    let folded = dump_store(&store)?;
    // The broker comes back from the copy and is written past the fold: sequences 11..=22 are
    // other records now.
    h.server.stop();
    std::fs::remove_dir_all(h.server.store_dir())?;
    copy_tree(&copy, h.server.store_dir())?;
    h.server.restart()?;
    for i in 0..12 {
        put_retrying(&kv, &format!("n.{i:02}"), "new").await?;
    }
    assert_eq!(kv.positions().await?.last_sequence, 22);
    let o = run_command(&h, "div", &store, None)
        .arg("--catch-up")
        .output()?;
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    let last = stderr.trim_end().lines().last().unwrap_or_default();
    assert!(
        last.contains("log_diverged")
            && last.contains("revision 20")
            && last.contains("--on-diverged relist"),
        "{stderr}"
    );
    assert_eq!(
        first_difference(&folded, &dump_store(&store)?),
        None,
        "the fold is untouched"
    );
    // Re-listed on request, the fold is exactly the log as it is now.
    let o = run_command(&h, "div", &store, None)
        .args(["--catch-up", "--on-diverged", "relist"])
        .output()?;
    ok(&o, "the relist")?;
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&store)?),
        None
    );
    // And the next start verifies the new checkpoint and resumes.
    let o = run_command(&h, "div", &store, None)
        .arg("--catch-up")
        .output()?;
    ok(&o, "a resume on the re-listed fold")?;
    Ok(())
}
