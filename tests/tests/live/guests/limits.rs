//! A guest past its limits: a runaway loop, a sleep or a memory, table or handle bomb is stopped at
//! its limit and the host stays up; a loud guest's output is cut at its limits.

use super::*;

async fn runaway_guest_is_stopped_and_reported(
    guest: &str,
    limit_args: &[&str],
    expect: &[&str],
) -> anyhow::Result<()> {
    runaway_guest_stopped(guest, limit_args, expect)
        .await
        .map(|_| ())
}

/// The most resident memory the host process has had (`VmHWM` in /proc/PID/status), in bytes.
fn peak_rss(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmHWM in /proc/{pid}/status"))?;
    Ok(kib * 1024)
}

/// [`runaway_guest_is_stopped_and_reported`], answering the host's peak resident memory, read
/// while it still runs after the fold failed.
async fn runaway_guest_stopped(
    guest: &str,
    limit_args: &[&str],
    expect: &[&str],
) -> anyhow::Result<u64> {
    let h = Harness::start().await?;
    let kv = h.bucket("runaway").await?;
    // One update (the key hostile-sleep naps on; the others take any key), so that nothing at all
    // can commit.
    kv.put("sleep.apply", "v".into()).await?;
    let tmp = tempfile::tempdir()?;
    let port = foldhost_localnats::reserved_port()?;
    let addr = format!("127.0.0.1:{port}");
    let mut host = foldhost()
        .args([
            "run",
            "--bucket",
            "runaway",
            "--nats",
            &h.url(),
            "--listen",
            &addr,
        ])
        .args(limit_args)
        .arg("--guest")
        .arg(guest_wasm(guest))
        .arg("--store")
        .arg(tmp.path().join("fold"))
        .stderr(Stdio::null())
        .spawn()?;
    let s = wait_status(&addr, |s| s.state == "failed").await?;
    let error = s.error.as_deref().unwrap_or_default().to_string();
    for part in expect {
        assert!(error.contains(part), "status error names {part:?}: {error}");
    }
    assert_eq!(s.applied_through, 0, "nothing of the batch is committed");
    // The CLI reads the same live status.
    let out = foldhost()
        .args(["status", "--json", "--listen", &addr])
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cli: StatusReport = serde_json::from_slice(&out.stdout)?;
    assert_eq!(cli.state, "failed");
    assert_eq!(cli.error, s.error);
    // The host is still up and answering.
    let (code, _) = foldhost::serve::call(&addr, "GET", "/status", b"").await?;
    assert_eq!(code, 200);
    assert!(host.try_wait()?.is_none(), "the host process stays up");
    let peak = peak_rss(host.id())?;
    let exit = terminate(&mut host)?;
    assert_eq!(
        exit.code(),
        Some(1),
        "a failed fold exits 1 once told to stop"
    );
    Ok(peak)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn infinite_loop_guest_is_interrupted_at_its_deadline_and_the_host_stays_up()
-> anyhow::Result<()> {
    runaway_guest_is_stopped_and_reported(
        "hostile_loop",
        &["--guest-deadline-ms", "200"],
        &["hostile-loop@0.1.0", "apply", "deadline of 200 ms"],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_sleeping_in_apply_is_cut_at_its_deadline_and_the_host_stays_up()
-> anyhow::Result<()> {
    // The helper writes `sleep.apply`: a WASI sleep, no wasm running, so only the wall-clock bound
    // can stop it.
    runaway_guest_is_stopped_and_reported(
        "hostile_sleep",
        &["--guest-deadline-ms", "200"],
        &["hostile-sleep@0.1.0", "apply", "deadline of 200 ms"],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_sleeping_in_query_or_init_is_cut_at_its_deadline() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("napper").await?;
    kv.put("k", "v".into()).await?;
    let tmp = tempfile::tempdir()?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = run_command(&h, "napper", &tmp.path().join("fold"), Some(&addr))
        .args(["--guest-deadline-ms", "300", "--guest"])
        .arg(guest_wasm("hostile_sleep"))
        .stderr(Stdio::null())
        .spawn()?;
    wait_status(&addr, |s| s.applied_through >= 1).await?;
    let (code, body) = foldhost::serve::call(&addr, "POST", "/query", b"sleep").await?;
    let text = String::from_utf8_lossy(&body);
    assert_eq!(code, 422, "{text}");
    assert!(
        text.contains("hostile-sleep@0.1.0")
            && text.contains("query")
            && text.contains("deadline of 300 ms"),
        "the error names the guest, the call and the limit: {text}"
    );
    // The fold goes on: a later write is folded and served by a fresh instance.
    let r = kv.put("k2", "v2".into()).await?.as_u64().unwrap_or(0);
    let s = wait_status(&addr, |s| s.applied_through >= r).await?;
    assert_eq!(s.state, "running", "{s:?}");
    assert_eq!(
        foldhost::serve::call(&addr, "POST", "/query", b"k2").await?,
        (200, b"v2".to_vec())
    );
    let exit = terminate(&mut host)?;
    assert!(exit.success(), "SIGTERM stops the host cleanly: {exit}");

    // In init: refused at start, nothing written.
    let store = tmp.path().join("never");
    let o = foldhost()
        .args([
            "run",
            "--catch-up",
            "--bucket",
            "napper",
            "--nats",
            &h.url(),
        ])
        .args([
            "--guest-deadline-ms",
            "300",
            "--guest-config",
            "sleep_in_init=1",
            "--guest",
        ])
        .arg(guest_wasm("hostile_sleep"))
        .arg("--store")
        .arg(&store)
        .output()?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("init") && err.contains("deadline of 300 ms"),
        "{err}"
    );
    assert!(!store.exists(), "a guest that never started wrote nothing");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loud_guests_log_lines_errors_and_answers_are_cut_at_their_limits() -> anyhow::Result<()>
{
    let h = Harness::start().await?;
    let kv = h.bucket("loud").await?;
    kv.put("k", "v".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let log_path = tmp.path().join("host.log");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = run_command(&h, "loud", &store, Some(&addr))
        // The deadline is not under test here: generous, so the size limits are what stop it.
        .args(["--guest-deadline-ms", "60000"])
        .env("FOLDHOST_LOG", "info")
        .arg("--guest")
        .arg(guest_wasm("hostile_loud"))
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()?;
    // A 10 MiB log line is written cut, its length marked.
    let r = kv.put("loud.log", "x".into()).await?.as_u64().unwrap_or(0);
    wait_status(&addr, |s| s.applied_through >= r).await?;
    // A 120 MiB answer is refused with the limit named.
    let (code, body) = foldhost::serve::call(&addr, "POST", "/query", b"big").await?;
    let text = String::from_utf8_lossy(&body);
    assert_eq!(code, 422, "{}", &text[..text.len().min(200)]);
    assert!(
        text.contains("hostile-loud@0.1.0")
            && text.contains("query")
            && text.contains("over the limit"),
        "{text}"
    );
    assert_eq!(
        foldhost::serve::call(&addr, "POST", "/query", b"k").await?,
        (200, b"v".to_vec())
    );
    // A 100 MiB error stops the fold with a short status.
    kv.put("loud.error", "x".into()).await?;
    let s = wait_status(&addr, |s| s.state == "failed").await?;
    let error = s.error.as_deref().unwrap_or_default();
    assert!(
        error.len() < 8192,
        "the error is cut: {} bytes",
        error.len()
    );
    assert!(
        error.contains("hostile-loud@0.1.0")
            && error.contains("apply")
            && error.contains("[cut: 104857600 bytes in all]"),
        "{}",
        &error[..error.len().min(300)]
    );
    let peak = std::fs::read_to_string(format!("/proc/{}/status", host.id()))?
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(u64::MAX);
    terminate(&mut host)?;
    let status_file = std::fs::metadata(store.join("status.json"))?.len();
    assert!(
        status_file < 64 * 1024,
        "status.json is {status_file} bytes"
    );
    let log = std::fs::read_to_string(&log_path)?;
    let longest = log.lines().map(str::len).max().unwrap_or(0);
    assert!(
        longest < 16 * 1024,
        "the longest log line is {longest} bytes"
    );
    assert!(
        log.contains("[cut: 10485760 bytes in all]") && log.contains("hostile-loud@0.1.0"),
        "the cut line names its guest and its length"
    );
    assert!(peak < 512 * 1024, "peak RSS {} MiB", peak / 1024);
    Ok(())
}

/// Runs `guest` (failing in `init`) with `args` and checks it is refused with one line naming the
/// guest, the call and `limit`, and that nothing was written.
async fn refused_in_init(
    guest: &str,
    args: &[&str],
    name: &str,
    limit: &str,
) -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("bomb").await?;
    kv.put("k", "v".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let o = foldhost()
        .args(["run", "--catch-up", "--bucket", "bomb", "--nats", &h.url()])
        .args(args)
        .arg("--guest")
        .arg(guest_wasm(guest))
        .arg("--store")
        .arg(&store)
        .output()?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("foldhost: error: "))
        .unwrap_or_default();
    assert!(
        line.contains(name) && line.contains("init") && line.contains(limit),
        "one line names the guest, the call and the limit: {err}"
    );
    assert!(!store.exists(), "nothing written");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_grow_bomb_is_stopped_at_the_table_limit() -> anyhow::Result<()> {
    refused_in_init(
        "table_bomb",
        &[],
        "hostile-table-bomb@0.1.0",
        "table limit of 1000000 elements",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_memories_are_capped_together_not_each() -> anyhow::Result<()> {
    // Four memories of 9 MiB each: under a per-memory cap of 32 MiB they would all fit.
    refused_in_init(
        "four_memories",
        &["--guest-memory-mb", "32"],
        "hostile-4-memories@0.1.0",
        "memory cap of 32 MiB",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_bomb_guest_fails_at_its_cap_and_the_host_stays_up() -> anyhow::Result<()> {
    runaway_guest_is_stopped_and_reported(
        "hostile_membomb",
        &["--guest-memory-mb", "32"],
        &["hostile-membomb@0.1.0", "apply", "memory cap of 32 MiB"],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_leaking_wasi_handles_is_stopped_at_the_resource_limit_and_the_host_stays_small()
-> anyhow::Result<()> {
    // Every apply leaks handles until the host refuses one: the fold stops naming the limit, and
    // the host never held more than its table's worth. Without the limit, wasmtime's own bound
    // (100 000 component handles a store) let each call leak ~25 MiB of host memory (a peak of
    // ~80 MiB against ~55 MiB here, as for a guest that only loops).
    let peak = runaway_guest_stopped(
        "hostile_handles",
        &[],
        &[
            "hostile-handles@0.1.0",
            "apply",
            &format!(
                "host resource table limit ({} entries)",
                foldhost_guest::guest::DEFAULT_RESOURCE_ENTRIES
            ),
        ],
    )
    .await?;
    assert!(
        peak < 256 << 20,
        "the host's resident memory peaked at {} MiB",
        peak >> 20
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handles_leaked_by_calls_that_return_count_toward_the_limit_and_go_with_the_instance()
-> anyhow::Result<()> {
    // An empty fold: the guest is only queried. `leak:N` leaks N rounds of four table entries
    // (a stream, a network, a pollable and the deadline under it) and returns normally.
    let tmp = tempfile::tempdir()?;
    let (store, _) = AppendLogSnapshot::open(tmp.path(), AppendLogOptions::default())?;
    let engine = GuestEngine::new()?;
    let bytes = std::fs::read(guest_wasm("hostile_handles"))?;
    let fold = Arc::new(SharedStore::new(store));
    let mut g = load_default(&engine, "hostile_handles", &bytes, fold).await?;
    g.hydrate().await?;
    let limit = foldhost_guest::guest::DEFAULT_RESOURCE_ENTRIES;
    let named = format!("host resource table limit ({limit} entries)");
    // Each call alone stays under the limit (3/8 of it), so only what earlier calls left can
    // make one fail.
    let rounds = (limit * 3 / 8 / 4).to_string();
    let leak = format!("leak:{rounds}");
    assert_eq!(
        g.query(leak.as_bytes()).await?,
        format!("leaked {rounds}").into_bytes()
    );
    assert_eq!(
        g.query(leak.as_bytes()).await?,
        format!("leaked {rounds}").into_bytes()
    );
    assert_eq!(g.hydrations, 1, "the instance lived on");
    let e = g
        .query(leak.as_bytes())
        .await
        .expect_err("the third call finds the first two's handles still held");
    assert!(
        e.to_string().contains("hostile-handles@0.1.0") && e.to_string().contains(&named),
        "{e}"
    );
    // The failed call dropped the instance; the fold loop rebuilds it (a query never does).
    let waiting = g.query(leak.as_bytes()).await;
    assert!(
        waiting.as_ref().is_err_and(|e| e.is_rebuilding()),
        "{waiting:?}"
    );
    g.rebuild().await?;
    // A fresh instance, with an empty table: the same call fits again, twice.
    for _ in 0..2 {
        assert_eq!(
            g.query(leak.as_bytes()).await?,
            format!("leaked {rounds}").into_bytes()
        );
    }
    assert_eq!(g.hydrations, 2, "rebuilt once, after the failed call");
    // A call leaking without end fails at the limit, and the next call runs on a fresh instance.
    let e = g.query(b"leak").await.expect_err("leaks until refused");
    assert!(e.to_string().contains(&named), "{e}");
    g.rebuild().await?;
    let e = g.query(b"k").await.expect_err("an empty store");
    assert!(e.to_string().contains("missing"), "{e}");
    assert_eq!(g.hydrations, 3);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_guests_in_every_language_hold_a_small_share_of_the_resource_limit()
-> anyhow::Result<()> {
    use foldhost_core::kv::{KvEntry, KvUpdate, VersionToken, WatchCursor};
    use foldhost_core::snapshot::SnapshotStore as _;
    // A sixteenth of the default: each guest loads, hydrates 2 000 routes, folds a batch that
    // changes and deletes some three times, and answers queries under it. (They hold none at all
    // in these calls: each passes with a limit of 0.)
    let limits = GuestLimits {
        resource_entries: foldhost_guest::guest::DEFAULT_RESOURCE_ENTRIES / 16,
        hydrate_chunk: 250,
        ..GuestLimits::default()
    };
    let put = |i: u32, generation: u32, revision: u64| {
        KvUpdate::Put(KvEntry {
            key: format!("route.h{i:05}"),
            value: upstream(i, generation).into(),
            version: VersionToken::from_u64(revision),
        })
    };
    for guest in ["router", "router_c", "router_js", "router_py", "kvstore"] {
        let dir = tempfile::tempdir()?;
        let (mut store, _) = AppendLogSnapshot::open(dir.path(), AppendLogOptions::default())?;
        let routes: Vec<KvUpdate> = (0..2000u32).map(|i| put(i, 1, u64::from(i) + 1)).collect();
        store.apply(&routes, WatchCursor::at(2000))?;
        let engine = GuestEngine::new()?;
        let bytes = std::fs::read(guest_wasm(guest))?;
        let mut g = GuestApply::load(
            &engine,
            guest,
            &bytes,
            limits,
            vec![],
            Arc::new(SharedStore::new(store)),
        )
        .await?;
        g.hydrate().await?;
        let batch: Vec<KvUpdate> = (0..200u32)
            .map(|i| put(i, 2, 2001 + u64::from(i)))
            .chain((200..300u32).map(|i| KvUpdate::Delete {
                key: format!("route.h{i:05}"),
                version: VersionToken::from_u64(2001 + u64::from(i)),
            }))
            .collect();
        for _ in 0..3 {
            let verdicts = g.parse(&batch).await?;
            g.apply(&batch, &verdicts).await?;
            g.on_applied(WatchCursor::at(2300)).await;
            for i in 0..50u32 {
                // The guest's own answer, found or not; a failed call is an error of the host's.
                if let Err(e) = g.query(format!("h{i:05}").as_bytes()).await {
                    assert!(!e.to_string().contains("limit"), "{guest}: {e}");
                }
            }
        }
        assert_eq!(g.hydrations, 1, "{guest}: never rebuilt");
    }
    Ok(())
}
