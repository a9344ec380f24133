//! Cursor-expiry repair with the real binary on live evicting buckets: NATS's silent clamp
//! is pinned and reported as `CursorExpired`; a keep-values bucket is repaired by the key-listing
//! diff; an evicting one refuses that diff and restores from an artifact, identical to the exporter;
//! a stale artifact fails with the fold untouched; the eviction memo outlives the eviction; a
//! stalled watcher overrun mid-stream trips the floor guard and restores in process; and a crash
//! at any point of a repair (placed by the binary's crash points) re-runs it to the same result.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use foldhost_core::crashpoint;
use foldhost_core::kv::{
    KvEntry, KvError, KvUpdate, KvWatcher, KvWriter, VersionToken, WatchCursor, WatchScope,
};
use foldhost_core::snapshot::SnapshotStore;
use foldhost_core::status::StatusReport;
use foldhost_core::storedir::{AnyStore, Backend};
use foldhost_nats::NatsKv;
use foldhost_tests::{
    Contents, Harness, bucket_contents, dump_store, first_difference, foldhost, publish_all,
    run_command, run_to_crash, set_max_age, status_store, terminate, wait_status,
};
use futures::{StreamExt, TryStreamExt};

mod crashes;
mod eviction;
mod relist;

/// Waits until every message of the bucket has aged out (the stream is empty).
async fn wait_aged_out(kv: &NatsKv) -> anyhow::Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let p = kv.positions().await?;
        if p.messages == 0 {
            return Ok(p.first_sequence);
        }
        anyhow::ensure!(Instant::now() < deadline, "messages never aged out: {p:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `foldhost run --catch-up` of `bucket` into `store` with `extra` arguments.
fn catch_up(h: &Harness, bucket: &str, store: &Path, extra: &[&str]) -> anyhow::Result<Output> {
    Ok(run_command(h, bucket, store, None)
        .arg("--catch-up")
        .args(extra)
        .output()?)
}

fn ok(o: &Output, what: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        o.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(())
}

/// The one error line of a failed run.
fn error_line(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .filter(|l| l.starts_with("foldhost: error: "))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A live export from the host serving `addr` into `out`; returns the manifest.
fn export_live(addr: &str, out: &Path) -> anyhow::Result<serde_json::Value> {
    let o = foldhost()
        .args(["export", "--listen", addr, "--out"])
        .arg(out)
        .output()?;
    ok(&o, "live export")?;
    Ok(serde_json::from_slice(&o.stdout)?)
}

fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    let st = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()?;
    anyhow::ensure!(st.success(), "cp -a {} {}", from.display(), to.display());
    Ok(())
}

fn signal(child: &std::process::Child, sig: &str) -> anyhow::Result<()> {
    std::process::Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()?;
    Ok(())
}

fn addr() -> anyhow::Result<String> {
    Ok(format!(
        "127.0.0.1:{}",
        foldhost_localnats::reserved_port()?
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_clamps_a_resume_below_its_first_sequence_silently_and_foldhost_reports_cursor_expired()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("clamp").await?;
    for i in 0..10 {
        kv.put("only", format!("v{i}").into()).await?;
    }
    assert_eq!(kv.positions().await?.first_sequence, 10);
    // The server itself: a consumer asked to start at 4 starts at 10 without a word.
    let stream = kv.jetstream().get_stream("KV_clamp").await?;
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::ByStartSequence {
                start_sequence: 4,
            },
            ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
            ..Default::default()
        })
        .await?;
    let mut msgs = consumer.fetch().max_messages(1).messages().await?;
    let first = msgs
        .next()
        .await
        .ok_or_else(|| anyhow::anyhow!("nothing delivered"))?
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let info = first.info().map_err(|e| anyhow::anyhow!("{e}"))?;
    assert_eq!(info.stream_sequence, 10, "the server clamps silently");

    // foldhost: the same resume is CursorExpired, at the watch and at the command line.
    let (tx, _rx) = tokio::sync::mpsc::channel(8);
    let r = kv
        .watch_from(&WatchScope::All, WatchCursor::at(3), tx)
        .await;
    assert!(
        matches!(
            r,
            Err(KvError::CursorExpired {
                resume_from: 4,
                first_sequence: 10
            })
        ),
        "{r:?}"
    );
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("s");
    {
        let (mut s, _) = AnyStore::open(&store, Backend::AppendLog)?;
        s.apply(
            &[KvUpdate::Put(KvEntry {
                key: "only".into(),
                value: Bytes::from_static(b"v2"),
                version: VersionToken::from_u64(3),
            })],
            WatchCursor::at(3),
        )?;
    }
    let before = dump_store(&store)?;
    let o = catch_up(&h, "clamp", &store, &["--repair", "none"])?;
    assert!(!o.status.success());
    let err = error_line(&o);
    assert!(
        err.contains("expired") && err.contains("first retained"),
        "{err}"
    );
    assert_eq!(dump_store(&store)?, before, "the fold is untouched");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_values_bucket_relist_deletes_keys_deleted_past_retention_and_keeps_a_recreated_one()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("keep").await?;
    for k in ["a", "b", "c", "d"] {
        kv.put(k, format!("{k}1").into()).await?;
    }
    for i in 0..20 {
        kv.put(&format!("del.{i:02}"), "doomed".into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("node");
    ok(&catch_up(&h, "keep", &store, &[])?, "first catch-up")?;
    let cursor = status_store(&store)?.cursor.unwrap_or(0);
    assert_eq!(cursor, 24);

    // While the node is down: deletes, a delete then a re-create, rewrites; then the delete
    // markers are purged from the stream (as a KV "purge deletes" would), so the node's cursor
    // falls out of the log and the deletes survive nowhere but in the listing's silence.
    kv.delete("a").await?;
    kv.delete("b").await?;
    kv.put("b", "b2".into()).await?;
    kv.put("c", "c2".into()).await?;
    kv.put("d", "d2".into()).await?;
    for i in 0..20 {
        kv.delete(&format!("del.{i:02}")).await?;
    }
    let stream = kv.jetstream().get_stream("KV_keep").await?;
    stream.purge().filter("$KV.keep.a").await?;
    stream.purge().filter("$KV.keep.del.>").await?;
    let first = kv.positions().await?.first_sequence;
    assert!(first > cursor + 1, "the cursor is expired: first {first}");

    let o = catch_up(&h, "keep", &store, &[])?;
    ok(&o, "repairing catch-up")?;
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(
        log.contains("cursor-expiry repair done") && log.contains("relist"),
        "{log}"
    );
    let want = bucket_contents(&kv).await?;
    let got = dump_store(&store)?;
    assert_eq!(first_difference(&want, &got), None);
    assert!(!got.contains_key("a") && !got.contains_key("del.00"));
    assert_eq!(got.get("b").map(|(v, _)| v.as_slice()), Some(&b"b2"[..]));
    Ok(())
}

/// The evicting-bucket scenario shared by the restore tests: a node `node` that caught up early,
/// an exporter `exporter` that ran through a gap (a delete, a write), an artifact of it in
/// `artifacts/`, and a stream whose every message has aged out since.
struct Evicted {
    h: Harness,
    kv: Arc<NatsKv>,
    tmp: tempfile::TempDir,
    node: PathBuf,
    exporter: PathBuf,
    artifacts: PathBuf,
    host: std::process::Child,
    cursor: u64,
}

async fn evicted(
    bucket: &str,
    keys: usize,
    rewrites: usize,
    deletes: usize,
) -> anyhow::Result<Evicted> {
    let h = Harness::start().await?;
    // A long age limit while the scene is set (no process has to race it), cut to one second once
    // the artifact exists, so everything ages out at once.
    let kv = h.aging_bucket(bucket, Duration::from_secs(3600)).await?;
    let js = kv.jetstream().clone();
    publish_all(
        &js,
        (0..keys).map(|i| (format!("$KV.{bucket}.k.{i:06}"), format!("old{i}").into())),
    )
    .await?;
    kv.put("x", "to be deleted".into()).await?;
    let tmp = tempfile::tempdir()?;
    let node = tmp.path().join("node");
    ok(&catch_up(&h, bucket, &node, &[])?, "node's first catch-up")?;
    let exporter = tmp.path().join("exporter");
    let a = addr()?;
    let host = run_command(&h, bucket, &exporter, Some(&a))
        .stderr(Stdio::null())
        .spawn()?;
    // The gap: a real delete, a write that will age out before the node returns, rewrites.
    kv.delete("x").await?;
    for i in 0..deletes {
        kv.delete(&format!("k.{i:06}")).await?;
    }
    kv.put("w", "written during the gap".into()).await?;
    publish_all(
        &js,
        (0..rewrites).map(|i| {
            (
                format!("$KV.{bucket}.k.{:06}", keys - 1 - i),
                format!("new{i}").into(),
            )
        }),
    )
    .await?;
    let last = kv.positions().await?.last_sequence;
    wait_status(&a, |s| s.applied_through >= last).await?;
    let artifacts = tmp.path().join("artifacts");
    std::fs::create_dir_all(&artifacts)?;
    let m = export_live(&a, &artifacts.join("art1"))?;
    let cursor = m["cursor"].as_u64().unwrap_or(0);
    assert_eq!(cursor, last);
    set_max_age(&kv, bucket, Duration::from_secs(1)).await?;
    wait_aged_out(&kv).await?;
    Ok(Evicted {
        h,
        kv,
        tmp,
        node,
        exporter,
        artifacts,
        host,
        cursor,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_watcher_overrun_by_a_burst_trips_the_floor_guard_and_restores_in_process()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("burst").await?;
    // Oldest-first discard under an 8 MiB limit: a burst evicts current values.
    let mut stream = kv.jetstream().get_stream("KV_burst").await?;
    let mut config = stream.info().await?.config.clone();
    config.max_bytes = 8 << 20;
    config.discard = async_nats::jetstream::stream::DiscardPolicy::Old;
    kv.jetstream().update_stream(config).await?;
    for i in 0..200 {
        kv.put(&format!("k.{i:05}"), "seed".into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let artifacts = tmp.path().join("artifacts");
    std::fs::create_dir_all(&artifacts)?;
    let (ea, na) = (addr()?, addr()?);
    let exporter = tmp.path().join("exporter");
    let node = tmp.path().join("node");
    let mut ex = run_command(&h, "burst", &exporter, Some(&ea))
        .stderr(Stdio::null())
        .spawn()?;
    let node_log = tmp.path().join("node.log");
    let mut nd = run_command(&h, "burst", &node, Some(&na))
        .args(["--restore-from"])
        .arg(&artifacts)
        .env("FOLDHOST_LOG", "warn")
        .stderr(std::fs::File::create(&node_log)?)
        .spawn()?;
    wait_status(&ea, |s| s.applied_through >= 200).await?;
    wait_status(&na, |s| s.applied_through >= 200).await?;

    signal(&nd, "-STOP")?;
    // ~32 MB over 6 000 keys: the stream keeps ~8 MiB of it.
    let js = kv.jetstream().clone();
    let value = Bytes::from(vec![b'z'; 1000]);
    publish_all(
        &js,
        (0..32_000u32).map(|i| (format!("$KV.burst.k.{:05}", i % 6000), value.clone())),
    )
    .await?;
    let p = kv.positions().await?;
    assert!(
        p.first_sequence > 201,
        "the burst evicted the node's position: {p:?}"
    );
    wait_status(&ea, |s| s.applied_through >= p.last_sequence).await?;
    let m = export_live(&ea, &artifacts.join("after-burst"))?;
    assert_eq!(m["cursor"].as_u64(), Some(p.last_sequence));

    signal(&nd, "-CONT")?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let st = loop {
        if let Ok((200, body)) = foldhost::serve::call(&na, "GET", "/status", b"").await {
            let s: StatusReport = serde_json::from_slice(&body)?;
            if s.repairs >= 1 && s.applied_through >= p.last_sequence {
                break s;
            }
            anyhow::ensure!(s.state != "failed", "node failed: {s:?}");
        }
        anyhow::ensure!(Instant::now() < deadline, "the node never repaired");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(st.state, "running", "{st:?}");
    terminate(&mut nd)?;
    // The trip came from the live floor guard (no restart): the watch ended with CursorExpired
    // in process and the restore followed.
    let log = std::fs::read_to_string(&node_log)?;
    assert!(
        log.contains("floor guard: retention overran the watch")
            && log.contains("kind=\"restore\""),
        "{log}"
    );
    terminate(&mut ex)?;
    let want = dump_store(&exporter)?;
    let got = dump_store(&node)?;
    assert_eq!(
        first_difference(&want, &got),
        None,
        "restored in process, like the exporter"
    );
    Ok(())
}
