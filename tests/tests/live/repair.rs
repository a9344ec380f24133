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
async fn evicting_bucket_refuses_a_listing_diff_and_restores_from_an_artifact_like_the_exporter()
-> anyhow::Result<()> {
    let mut e = evicted("aging", 50, 10, 5).await?;
    let before = dump_store(&e.node)?;
    assert!(before.contains_key("x") && before.contains_key("k.000000"));

    // A listing diff here would delete every key: refused, fold untouched.
    let o = catch_up(&e.h, "aging", &e.node, &["--repair", "relist"])?;
    assert!(!o.status.success());
    let err = error_line(&o);
    assert!(
        err.contains("key-listing repair") && err.contains("evict"),
        "{err}"
    );
    assert_eq!(
        dump_store(&e.node)?,
        before,
        "refused: the fold is untouched"
    );
    // Auto without an artifact source: refused too, naming what is missing.
    let o = catch_up(&e.h, "aging", &e.node, &[])?;
    assert!(!o.status.success());
    assert!(
        error_line(&o).contains("--restore-from"),
        "{}",
        error_line(&o)
    );
    assert_eq!(dump_store(&e.node)?, before);

    let arts = e.artifacts.display().to_string();
    let o = catch_up(&e.h, "aging", &e.node, &["--restore-from", &arts])?;
    ok(&o, "restoring catch-up")?;
    let got = dump_store(&e.node)?;
    let want = dump_store(&e.exporter)?;
    assert_eq!(
        first_difference(&want, &got),
        None,
        "identical to the exporter"
    );
    assert!(got.contains_key("k.000049"), "an aged-out key is kept");
    assert!(
        got.contains_key("w"),
        "an aged-out write from the gap is recovered"
    );
    assert!(
        !got.contains_key("x") && !got.contains_key("k.000000"),
        "real deletes applied"
    );
    assert!(
        bucket_contents(&e.kv).await?.is_empty(),
        "NATS itself holds nothing"
    );
    let st = status_store(&e.node)?;
    assert_eq!(st.cursor, Some(e.cursor));
    assert!(st.eviction_seen);

    // An empty fold on this bucket would re-list nothing (everything aged out): with a restore
    // armed it seeds from the artifact instead.
    let fresh = e.tmp.path().join("fresh");
    ok(
        &catch_up(&e.h, "aging", &fresh, &["--restore-from", &arts])?,
        "seeding a fresh node",
    )?;
    assert_eq!(first_difference(&want, &dump_store(&fresh)?), None);

    // A later gap the artifact does not reach: the stale artifact fails the watch, fold untouched.
    e.kv.put("late", "after the artifact".into()).await?;
    wait_aged_out(&e.kv).await?;
    terminate(&mut e.host)?;
    let before = dump_store(&e.node)?;
    let o = catch_up(&e.h, "aging", &e.node, &["--restore-from", &arts])?;
    assert!(!o.status.success());
    let err = error_line(&o);
    assert!(err.contains("stale artifact"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert_eq!(dump_store(&e.node)?, before, "the fold is untouched");
    drop(e.tmp);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_eviction_was_seen_the_listing_is_never_trusted_again_even_with_eviction_off()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.aging_bucket("memo", Duration::from_secs(1)).await?;
    kv.put("a", "aged out before the node saw it".into())
        .await?;
    wait_aged_out(&kv).await?;
    // Still evicting, but slowly enough that `c` outlives the node's catch-up.
    set_max_age(&kv, "memo", Duration::from_secs(3600)).await?;
    kv.put("c", "c1".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("node");
    ok(&catch_up(&h, "memo", &store, &[])?, "catch-up")?;
    assert!(status_store(&store)?.eviction_seen, "the memo is committed");
    // The fold still has `c`; then the operator turns eviction off.
    set_max_age(&kv, "memo", Duration::ZERO).await?;
    let r = kv
        .retention()
        .await?
        .ok_or_else(|| anyhow::anyhow!("no retention"))?;
    assert!(!r.evicts_current_values, "{r:?}");
    // The node's cursor expires by rewrites; a listing now looks like the truth, but the fold
    // remembers.
    kv.put("d", "d1".into()).await?;
    for i in 0..3 {
        kv.put("c", format!("c{i}").into()).await?;
        kv.put("d", format!("d{i}").into()).await?;
    }
    let before = dump_store(&store)?;
    let o = catch_up(&h, "memo", &store, &["--repair", "relist"])?;
    assert!(!o.status.success());
    let err = error_line(&o);
    assert!(err.contains("eviction memo"), "{err}");
    assert_eq!(dump_store(&store)?, before);
    // A fold without the memo (a fresh copy of the data at the same cursor) would be re-listed:
    // the memo, not the bucket, is what refuses.
    let bare = tmp.path().join("bare");
    {
        let (src, _) = AnyStore::open_read_only(&store)?;
        let (mut dst, _) = AnyStore::open(&bare, Backend::AppendLog)?;
        let rows = src.range("")?;
        let updates: Vec<KvUpdate> = rows.into_iter().map(KvUpdate::Put).collect();
        dst.apply(&updates, WatchCursor::at(src.cursor().revision_or_zero()))?;
    }
    ok(
        &catch_up(&h, "memo", &bare, &["--repair", "relist"])?,
        "bare fold re-list",
    )?;
    Ok(())
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

/// The log lines that open and close a repair, and the one every committed batch writes.
const REPAIR_START: &str = "cursor expired: repairing";
const REPAIR_DONE: &str = "cursor-expiry repair done";
const BATCH: &str = "batch parsed and applied";

/// How many batches the repair of `cmd` commits: the committed-batch lines between its start and
/// done lines, counted in the finished run's log (the count depends on the data, not on timing).
fn repair_batches(mut cmd: std::process::Command) -> anyhow::Result<usize> {
    let o = cmd
        .env("FOLDHOST_LOG", "warn,foldhost_fold::applied=debug")
        .output()?;
    ok(&o, "measuring run")?;
    let log = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = log.lines().collect();
    let start = lines.iter().position(|l| l.contains(REPAIR_START));
    let done = lines.iter().position(|l| l.contains(REPAIR_DONE));
    match (start, done) {
        (Some(a), Some(b)) => Ok(lines[a..b].iter().filter(|l| l.contains(BATCH)).count()),
        _ => anyhow::bail!("the measuring run logged no repair:\n{log}"),
    }
}

/// Crashes a repair of a copy of `node` at the crash point `point` (a repair-batch point) after
/// each fraction of the batches one whole repair commits, and after the last of them; and once
/// at [`crashpoint::RESTORE_BEFORE_CURSOR`] when `restore` is set. After every crash the fold's
/// cursor is where it was before the repair (no repair moves the cursor early), and a re-run ends
/// at `want`.
async fn crashes_inside_the_repair_converge(
    cmd: &dyn Fn(&Path) -> std::process::Command,
    node: &Path,
    scratch: &Path,
    want: &Contents,
    point: &'static str,
    fractions: &[f64],
) -> anyhow::Result<()> {
    let measured = scratch.join("measured");
    copy_dir(node, &measured)?;
    let batches = repair_batches(cmd(&measured))?;
    assert!(
        batches >= 20,
        "a repair of {batches} batches is too short to crash inside"
    );
    assert_eq!(first_difference(want, &dump_store(&measured)?), None);
    let before = status_store(node)?.cursor;
    let mut arms: Vec<(&'static str, usize)> = fractions
        .iter()
        .map(|f| (point, ((batches as f64 * f) as usize).clamp(1, batches)))
        .collect();
    arms.push((point, batches));
    if point == crashpoint::RESTORE_BATCH {
        arms.push((crashpoint::RESTORE_BEFORE_CURSOR, 1));
    }
    for (i, (at, n)) in arms.into_iter().enumerate() {
        let dir = scratch.join(format!("crashed{i}"));
        copy_dir(node, &dir)?;
        run_to_crash(cmd(&dir), at, n as u64)?;
        assert_eq!(
            status_store(&dir)?.cursor,
            before,
            "the cursor moved before the repair finished (crashed at {at}:{n} of {batches} batches)"
        );
        let o = cmd(&dir).output()?;
        ok(
            &o,
            &format!("re-run after a crash at {at}:{n} ({batches} batches)"),
        )?;
        assert_eq!(
            first_difference(want, &dump_store(&dir)?),
            None,
            "crashed at {at}:{n} of {batches} batches"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_every_point_of_a_restore_reruns_it_on_restart_to_the_same_result()
-> anyhow::Result<()> {
    let mut e = evicted("crashrestore", 20_000, 15_000, 2_000).await?;
    let arts = e.artifacts.display().to_string();
    let want = dump_store(&e.exporter)?;
    terminate(&mut e.host)?;
    let url = e.h.url();
    let cmd = |dir: &Path| {
        let mut c = foldhost();
        c.args([
            "run",
            "--bucket",
            "crashrestore",
            "--nats",
            &url,
            "--catch-up",
        ])
        .args(["--restore-from", &arts, "--store"])
        .arg(dir);
        c
    };
    crashes_inside_the_repair_converge(
        &cmd,
        &e.node,
        e.tmp.path(),
        &want,
        crashpoint::RESTORE_BATCH,
        &[0.0, 0.35, 0.7],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_inside_a_listing_diff_reruns_it_on_restart_to_the_same_result()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("crashrelist").await?;
    let js = kv.jetstream().clone();
    publish_all(
        &js,
        (0..20_000u32).map(|i| {
            let k = if i % 4 == 0 { "del" } else { "keep" };
            (format!("$KV.crashrelist.{k}.{i:06}"), "v1".into())
        }),
    )
    .await?;
    let tmp = tempfile::tempdir()?;
    let node = tmp.path().join("node");
    ok(&catch_up(&h, "crashrelist", &node, &[])?, "first catch-up")?;
    // Delete every del.* key, rewrite every keep.* key, purge the delete markers: expired.
    for i in (0..20_000u32).step_by(4) {
        kv.delete(&format!("del.{i:06}")).await?;
    }
    publish_all(
        &js,
        (0..20_000u32)
            .filter(|i| i % 4 != 0)
            .map(|i| (format!("$KV.crashrelist.keep.{i:06}"), "v2".into())),
    )
    .await?;
    let stream = kv.jetstream().get_stream("KV_crashrelist").await?;
    stream.purge().filter("$KV.crashrelist.del.>").await?;
    let want = bucket_contents(&kv).await?;
    assert_eq!(want.len(), 15_000);
    let url = h.url();
    let cmd = |dir: &Path| {
        let mut c = foldhost();
        c.args([
            "run",
            "--bucket",
            "crashrelist",
            "--nats",
            &url,
            "--catch-up",
            "--store",
        ])
        .arg(dir);
        c
    };
    crashes_inside_the_repair_converge(
        &cmd,
        &node,
        tmp.path(),
        &want,
        crashpoint::RELIST_BATCH,
        &[0.0, 0.5],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn supersession_only_restart_resumes_on_a_max_age_bucket_without_an_artifact()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.aging_bucket("supersede", Duration::from_secs(1)).await?;
    kv.put("x", "aged out".into()).await?;
    wait_aged_out(&kv).await?;
    // Age-only eviction with room: the node sees it has evicted (memo, with its message's time).
    set_max_age(&kv, "supersede", Duration::from_secs(3600)).await?;
    kv.put("a", "a0".into()).await?;
    kv.put("b", "b0".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("node");
    ok(&catch_up(&h, "supersede", &store, &[])?, "catch-up")?;
    assert!(status_store(&store)?.eviction_seen);
    {
        let (s, _) = AnyStore::open_read_only(&store)?;
        let memo = s
            .cursor()
            .memo()
            .ok_or_else(|| anyhow::anyhow!("no memo"))?;
        assert!(
            memo.server_time_unix_ns > 0,
            "the memo keeps its message's server time"
        );
    }
    // While the node is down every key is rewritten: the messages after its cursor are all gone,
    // superseded, none aged out. The cursor looks expired.
    for i in 1..4 {
        kv.put("a", format!("a{i}").into()).await?;
        kv.put("b", format!("b{i}").into()).await?;
    }
    let cursor = status_store(&store)?.cursor.unwrap_or(0);
    let first = kv.positions().await?.first_sequence;
    assert!(
        first > cursor + 1,
        "expired-looking: cursor {cursor}, first {first}"
    );
    // No artifact anywhere: only the supersession-only resume can bring it back.
    let o = catch_up(&h, "supersede", &store, &[])?;
    ok(&o, "supersession-only resume")?;
    let log = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!log.contains("cursor expired: repairing"), "{log}");
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&store)?),
        None
    );

    // The same gap under an oldest-first limit is not age-only: it reads as expired, and with no
    // artifact it is refused, the fold untouched.
    let mut stream = kv.jetstream().get_stream("KV_supersede").await?;
    let mut config = stream.info().await?.config.clone();
    config.max_messages = 1000;
    config.discard = async_nats::jetstream::stream::DiscardPolicy::Old;
    kv.jetstream().update_stream(config).await?;
    for i in 4..7 {
        kv.put("a", format!("a{i}").into()).await?;
        kv.put("b", format!("b{i}").into()).await?;
    }
    let before = dump_store(&store)?;
    let o = catch_up(&h, "supersede", &store, &[])?;
    assert!(!o.status.success());
    assert!(
        error_line(&o).contains("--restore-from"),
        "{}",
        error_line(&o)
    );
    assert_eq!(dump_store(&store)?, before);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fold_with_data_but_no_cursor_is_repaired_like_an_expiry_at_revision_zero()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("nocursor").await?;
    kv.put("live", "in the bucket".into()).await?;
    // A fold that holds a key the bucket no longer has, and no cursor (say, a first batch whose
    // cursor record was torn off): a plain re-list would never remove `gone`.
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("node");
    {
        let (mut s, _) = AnyStore::open(&store, Backend::AppendLog)?;
        s.apply(
            &[KvUpdate::Put(KvEntry {
                key: "gone".into(),
                value: Bytes::from_static(b"stale"),
                version: VersionToken::UNKNOWN,
            })],
            WatchCursor::NONE,
        )?;
    }
    let o = catch_up(&h, "nocursor", &store, &[])?;
    ok(&o, "cursor-less catch-up")?;
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("cursor-expiry repair done"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&store)?),
        None
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_only_buckets_are_re_listed_to_exactly_the_bucket_without_an_artifact()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("ttlonly").await?;
    // As nats-py creates every KV stream: per-message TTLs allowed, no age or size limit.
    let js = kv.jetstream().clone();
    let mut config = js
        .get_stream("KV_ttlonly")
        .await?
        .info()
        .await?
        .config
        .clone();
    config.allow_message_ttl = true;
    js.update_stream(config).await?;
    publish_all(
        &js,
        (0..400u32).map(|i| {
            let k = if i % 4 == 0 { "del" } else { "keep" };
            (format!("$KV.ttlonly.{k}.{i:04}"), "v1".into())
        }),
    )
    .await?;
    let tmp = tempfile::tempdir()?;
    let node = tmp.path().join("node");
    ok(&catch_up(&h, "ttlonly", &node, &[])?, "first catch-up")?;
    // The gap: deletes (their markers purged), rewrites, and one key written with a 1 s TTL that
    // expires before the node returns.
    for i in (0..400u32).step_by(4) {
        kv.delete(&format!("del.{i:04}")).await?;
    }
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-TTL", "1s");
    js.publish_with_headers("$KV.ttlonly.gone.soon", headers, "brief".into())
        .await?
        .await?;
    publish_all(
        &js,
        (0..400u32)
            .filter(|i| i % 4 != 0)
            .map(|i| (format!("$KV.ttlonly.keep.{i:04}"), "v2".into())),
    )
    .await?;
    let stream = js.get_stream("KV_ttlonly").await?;
    stream.purge().filter("$KV.ttlonly.del.>").await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while foldhost_core::kv::KvReader::get(&*kv, "gone.soon")
        .await?
        .is_some()
    {
        anyhow::ensure!(Instant::now() < deadline, "the TTL'd key never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let want = bucket_contents(&kv).await?;
    assert_eq!(want.len(), 300);
    assert!(!want.contains_key("gone.soon"));
    // The cursor is expired; the default repair re-lists (no artifact anywhere) to the bucket.
    let o = catch_up(&h, "ttlonly", &node, &[])?;
    ok(&o, "catch-up over the expired cursor")?;
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("relist"),
        "repaired by re-list: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(first_difference(&want, &dump_store(&node)?), None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_watch_cut_off_while_in_scope_messages_age_out_trips_the_floor_guard_never_skips()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.aging_bucket("cutoff", Duration::from_secs(3600)).await?;
    for i in 0..20 {
        kv.put(
            &format!("route.h{i}"),
            format!("{{\"upstream\":\"10.0.0.{i}:80\"}}").into(),
        )
        .await?;
        kv.put(&format!("other.{i}"), "noise".into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let node = tmp.path().join("node");
    let na = addr()?;
    let log_path = tmp.path().join("node.log");
    let mut nd = run_command(&h, "cutoff", &node, Some(&na))
        .arg("--guest")
        .arg(foldhost_tests::guest_wasm("router"))
        .env("FOLDHOST_LOG", "warn")
        // The client's ordered consumer, which re-creates itself at the first retained message
        // (a lean connection's watch ends instead, and the resume window refuses the cursor).
        .env(foldhost_nats::LEAN_DELIVERY_ENV, "off")
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()?;
    let last = kv.positions().await?.last_sequence;
    let before = wait_status(&na, |s| s.applied_through >= last - 1).await?;
    let cursor = before.cursor.unwrap_or(0);
    let (code, _) = foldhost::serve::call(&na, "POST", "/query", b"h1").await?;
    assert_eq!(code, 200);

    // Cut off: the node is stopped and its consumer deleted on the server, so nothing more is
    // pushed to it. Meanwhile in-scope writes (a delete, a change) and out-of-scope noise happen
    // and every message ages out (the operator shortens max_age), then a new in-scope write.
    signal(&nd, "-STOP")?;
    let stream = kv.jetstream().get_stream("KV_cutoff").await?;
    let names: Vec<String> = stream.consumer_names().try_collect().await?;
    assert!(!names.is_empty(), "the node's watch consumer exists");
    for n in &names {
        stream.delete_consumer(n).await?;
    }
    kv.delete("route.h1").await?;
    kv.put("route.h2", "{\"upstream\":\"10.9.9.9:80\"}".into())
        .await?;
    kv.put("other.x", "noise".into()).await?;
    set_max_age(&kv, "cutoff", Duration::from_secs(2)).await?;
    let first = wait_aged_out(&kv).await?;
    assert!(first > cursor + 1, "the in-scope writes aged out unseen");
    kv.put("route.h99", "{\"upstream\":\"10.0.0.99:80\"}".into())
        .await?;
    signal(&nd, "-CONT")?;

    // The re-created consumer starts at the first retained message: the guard trips before
    // anything after the gap is applied. With no artifact armed the node stops.
    let st = wait_status(&na, |s| s.state == "failed").await?;
    terminate(&mut nd)?;
    let log = std::fs::read_to_string(&log_path)?;
    assert!(
        log.contains("floor guard: retention overran the watch"),
        "{st:?}\n{log}"
    );
    assert!(
        st.error
            .as_deref()
            .unwrap_or_default()
            .contains("cursor expired"),
        "{st:?}"
    );
    let fold = dump_store(&node)?;
    assert!(!fold.contains_key("route.h99"), "the fold skipped the gap");
    assert!(
        fold.contains_key("route.h1"),
        "the fold moved past the lost delete"
    );
    assert_eq!(status_store(&node)?.cursor, Some(cursor));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_skips_an_artifact_that_fails_verification_for_the_next_newest()
-> anyhow::Result<()> {
    let mut e = evicted("fallback", 50, 10, 5).await?;
    // A copy of the artifact, tried first (same cursor, earlier name), with one payload byte
    // flipped: its import fails the digest check.
    let bad = e.artifacts.join("art0");
    copy_dir(&e.artifacts.join("art1"), &bad)?;
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bad.join("MANIFEST.json"))?)?;
    let file = manifest["files"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["size"].as_u64().unwrap_or(0) > 0))
        .and_then(|f| f["path"].as_str())
        .ok_or_else(|| anyhow::anyhow!("no non-empty payload file in {manifest}"))?;
    let path = bad.join("data").join(file);
    let mut bytes = std::fs::read(&path)?;
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&path, bytes)?;

    let arts = e.artifacts.display().to_string();
    let o = catch_up(&e.h, "fallback", &e.node, &["--restore-from", &arts])?;
    ok(&o, "restoring catch-up")?;
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(
        log.contains("failed verification; trying the next newest"),
        "{log}"
    );
    assert_eq!(
        first_difference(&dump_store(&e.exporter)?, &dump_store(&e.node)?),
        None,
        "restored from the good artifact, identical to the exporter"
    );
    terminate(&mut e.host)?;
    Ok(())
}
