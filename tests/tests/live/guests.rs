//! WebAssembly guests against a real nats-server: the router (in Rust and in C) through SIGKILLs, a
//! trap that stops the fold exactly before its key, runaway, memory-hungry and handle-leaking guests
//! stopped at their limits while the host stays up (and, for the leak, small), hydration equivalence
//! on 50 000 keys, and components refused at load.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use foldhost_core::kv::{KvWriter, WatchScope};
use foldhost_core::snapshot::{AppendLogOptions, AppendLogSnapshot};
use foldhost_core::status::FoldStatus;
use foldhost_core::status::StatusReport;
use foldhost_core::view::SharedStore;
use foldhost_fold::applied::{Apply, BatchConfig, WatchOptions, watch_applied};
use foldhost_guest::guest::{GuestApply, GuestEngine, GuestLimits};
use foldhost_tests::{
    Harness, bucket_contents, dump_store, first_difference, foldhost, guest_wasm, hostile_wat,
    run_command, status_store, terminate, wait_status, wait_until,
};
use rand::{Rng, SeedableRng};

/// A guest with the default limits and no configuration.
async fn load_default(
    engine: &Arc<GuestEngine>,
    what: &str,
    bytes: &[u8],
    fold: Arc<dyn foldhost_core::view::FoldRead>,
) -> anyhow::Result<GuestApply> {
    Ok(GuestApply::load(engine, what, bytes, GuestLimits::default(), vec![], fold).await?)
}

fn upstream(i: u32, generation: u32) -> String {
    format!(
        "{{\"upstream\":\"10.{generation}.{}.{}:80\"}}",
        i / 250,
        i % 250
    )
}

/// The Rust router, built with the SDK: a `foldhost:guest@0.2.0` guest (packed batches).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_guest_survives_sigkills_and_answers_every_host_like_the_bucket()
-> anyhow::Result<()> {
    router_survives_sigkills_and_answers_every_host_like_the_bucket("router", "0.2.0").await
}

/// The same test, the same guest semantics, written in C (`guests/router-c`) against
/// `foldhost:guest@0.1.0`: the older contract keeps loading and folding unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c_router_guest_survives_sigkills_and_answers_every_host_like_the_bucket()
-> anyhow::Result<()> {
    router_survives_sigkills_and_answers_every_host_like_the_bucket("router_c", "0.1.0").await
}

/// 20 000 routes written while a host folding them with `guest` is SIGKILLed at random moments;
/// then a live host answers every route exactly as the bucket holds it, a deleted host is unknown,
/// and the fold equals the bucket's `route.*` keys; the live host reports the guest bound to
/// `contract`. (Also the JavaScript and Python routers: `languages.rs`.)
pub(crate) async fn router_survives_sigkills_and_answers_every_host_like_the_bucket(
    guest: &str,
    contract: &str,
) -> anyhow::Result<()> {
    let seed: u64 = std::env::var("FOLDHOST_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("seed = {seed} (replay with FOLDHOST_TEST_SEED={seed})");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let h = Harness::start().await?;
    let kv = h.bucket("routes").await?;
    let router = guest_wasm(guest);
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    const HOSTS: u32 = 20_000;
    let writer = {
        let kv = kv.clone();
        tokio::spawn(async move {
            for i in 0..HOSTS {
                kv.put(&format!("route.h{i:05}"), upstream(i, 0).into())
                    .await?;
                if i % 10 == 9 {
                    kv.put(&format!("route.h{:05}", i - 3), upstream(i, 1).into())
                        .await?;
                }
                if i % 25 == 24 {
                    kv.delete(&format!("route.h{:05}", i - 12)).await?;
                }
                if i % 500 == 0 {
                    kv.put(&format!("other.{i}"), "out of the router's scope".into())
                        .await?;
                }
            }
            anyhow::Ok(())
        })
    };
    // Compiled once into the tests' compiled-component cache before the kills, so every start below
    // loads in milliseconds and the kills land while it folds, not while a large guest (a
    // JavaScript or Python runtime) compiles.
    let warm = foldhost()
        .args([
            "run",
            "--catch-up",
            "--bucket",
            "routes",
            "--nats",
            &h.url(),
            "--guest",
        ])
        .arg(&router)
        .arg("--store")
        .arg(tmp.path().join("warm"))
        .output()?;
    anyhow::ensure!(
        warm.status.success(),
        "{}",
        String::from_utf8_lossy(&warm.stderr)
    );
    let mut kills = 0;
    while !writer.is_finished() || kills < 3 {
        let mut child = foldhost()
            .args(["run", "--bucket", "routes", "--nats", &h.url(), "--guest"])
            .arg(&router)
            .arg("--store")
            .arg(&store)
            .spawn()?;
        tokio::time::sleep(Duration::from_millis(rng.random_range(100..1200))).await;
        if let Some(status) = child.try_wait()? {
            anyhow::bail!("foldhost run exited on its own: {status}");
        }
        child.kill()?;
        child.wait()?;
        kills += 1;
        anyhow::ensure!(kills < 200, "writer did not finish");
    }
    writer.await??;

    // Final run: live, serving queries; wait until it has applied the whole stream.
    let last = kv.positions().await?.last_sequence;
    let port = foldhost_localnats::reserved_port()?;
    let addr = format!("127.0.0.1:{port}");
    let mut host = foldhost()
        .args([
            "run",
            "--bucket",
            "routes",
            "--nats",
            &h.url(),
            "--listen",
            &addr,
        ])
        .arg("--guest")
        .arg(&router)
        .arg("--store")
        .arg(&store)
        .stderr(Stdio::null())
        .spawn()?;
    // The router's scope is route.*: the last route write may precede the stream's last sequence.
    let want = bucket_contents(&kv).await?;
    let last_route = want
        .iter()
        .filter(|(k, _)| k.starts_with("route."))
        .map(|(_, (_, r))| *r)
        .max()
        .unwrap_or(0);
    let running = wait_status(&addr, |s| {
        s.applied_through >= last_route && s.state == "running"
    })
    .await?;
    assert_eq!(
        running.guest_contract.as_deref(),
        Some(contract),
        "{guest} bound to the wrong contract"
    );
    eprintln!("{kills} SIGKILLs; stream at {last}, routes through {last_route}");

    let in_scope: foldhost_tests::Contents = want
        .into_iter()
        .filter(|(k, _)| k.starts_with("route."))
        .collect();
    assert_eq!(in_scope.len() as u32, HOSTS - HOSTS / 25);
    let checked = foldhost_tests::check_routes_served(&addr, &in_scope).await?;
    // A deleted host is unknown to the router.
    let (code, _) = foldhost::serve::call(&addr, "POST", "/query", b"h00012").await?;
    assert_eq!(code, 422, "deleted hosts are gone from the router");
    terminate(&mut host)?;
    let fold = dump_store(&store)?;
    assert_eq!(first_difference(&in_scope, &fold), None);
    eprintln!("checked {checked} hosts");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_trapping_on_one_key_stops_the_fold_just_before_it() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("poison").await?;
    for i in 0..40 {
        kv.put(&format!("a.{i:02}"), "before".into()).await?;
    }
    let poison = kv.put("trap.me", "boom".into()).await?;
    let poison_rev = poison.as_u64().unwrap_or(0);
    for i in 0..40 {
        kv.put(&format!("b.{i:02}"), "after".into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let out = foldhost()
        .args([
            "run",
            "--catch-up",
            "--bucket",
            "poison",
            "--nats",
            &h.url(),
        ])
        .arg("--guest")
        .arg(guest_wasm("hostile_trap"))
        .arg("--store")
        .arg(&store)
        .output()?;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err
        .lines()
        .rfind(|l| l.starts_with("foldhost: error:"))
        .unwrap_or_default();
    for part in ["hostile-trap@0.1.0", "apply", "trap.me"] {
        assert!(line.contains(part), "the error names {part:?}: {line}");
    }
    let s = status_store(&store)?;
    let cursor = s.cursor.unwrap_or(0);
    assert_eq!(
        cursor,
        poison_rev - 1,
        "the fold stops exactly before the poison revision"
    );
    assert_eq!(s.state, "failed");
    let fold = dump_store(&store)?;
    assert_eq!(fold.len(), 40, "every key before the poison is applied");
    assert!(fold.keys().all(|k| k.starts_with("a.")));

    // A restart does not skip it: the same guest stops at the same place.
    let again = foldhost()
        .args([
            "run",
            "--catch-up",
            "--bucket",
            "poison",
            "--nats",
            &h.url(),
        ])
        .arg("--guest")
        .arg(guest_wasm("hostile_trap"))
        .arg("--store")
        .arg(&store)
        .output()?;
    assert_eq!(again.status.code(), Some(1));
    assert_eq!(status_store(&store)?.cursor, Some(cursor));

    // With the trap moved to a key nobody writes, the same guest folds on past it.
    let fixed = foldhost()
        .args([
            "run",
            "--catch-up",
            "--bucket",
            "poison",
            "--nats",
            &h.url(),
        ])
        .args(["--guest-config", "trap_key=never.written"])
        .arg("--guest")
        .arg(guest_wasm("hostile_trap"))
        .arg("--store")
        .arg(&store)
        .output()?;
    assert!(
        fixed.status.success(),
        "{}",
        String::from_utf8_lossy(&fixed.stderr)
    );
    assert_eq!(dump_store(&store)?.len(), 81);
    Ok(())
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_parse_output_fails_the_batch_with_the_count_named() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("badparse").await?;
    kv.put("k.1", "v".into()).await?;
    let tmp = tempfile::tempdir()?;
    let out = foldhost()
        .args([
            "run",
            "--catch-up",
            "--bucket",
            "badparse",
            "--nats",
            &h.url(),
        ])
        .arg("--guest")
        .arg(guest_wasm("hostile_badparse"))
        .arg("--store")
        .arg(tmp.path().join("fold"))
        .output()?;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("hostile-badparse@0.1.0: parse failed: answered 0 verdicts for a batch of 1"),
        "{err}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_with_an_unprovided_import_is_refused_at_load_naming_it() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let out = foldhost()
        .args([
            "run",
            "--bucket",
            "b",
            "--nats",
            "nats://127.0.0.1:1",
            "--guest",
        ])
        .arg(hostile_wat("bad_import.wat"))
        .arg("--store")
        .arg(&store)
        .output()?;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("refused at load"), "{err}");
    assert!(
        err.contains("evil:net/exfil@1.0.0"),
        "the import is named: {err}"
    );
    assert!(!store.exists(), "nothing was written");
    // The same check through the library.
    let engine = GuestEngine::new()?;
    let bytes = std::fs::read(hostile_wat("bad_import.wat"))?;
    let e = engine
        .prepare("bad_import.wat", &bytes)
        .err()
        .ok_or_else(|| anyhow::anyhow!("must be refused"))?;
    assert!(e.to_string().contains("evil:net/exfil@1.0.0"), "{e}");
    // And garbage is not a component.
    let e = engine
        .prepare("garbage", b"\0asm\x01\0\0\0not really")
        .err()
        .ok_or_else(|| anyhow::anyhow!("must be refused"))?;
    assert!(e.to_string().contains("not a loadable component"), "{e}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hydrated_guest_answers_like_one_that_watched_from_the_start() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("hydrate").await?;
    const N: u32 = 50_000;
    let msgs = (0..N).map(|i| (format!("$KV.hydrate.route.h{i:05}"), upstream(i, 0).into()));
    foldhost_tests::publish_all(kv.jetstream(), msgs).await?;
    for i in (0..N).step_by(7) {
        kv.delete(&format!("route.h{i:05}")).await?;
    }
    let engine = GuestEngine::new()?;
    let bytes = std::fs::read(guest_wasm("router"))?;
    let tmp = tempfile::tempdir()?;
    let (store, _) = AppendLogSnapshot::open(tmp.path(), AppendLogOptions::default())?;
    let shared = SharedStore::new(store);

    // One instance watches from the start.
    let mut watched = load_default(&engine, "router", &bytes, Arc::new(shared.clone())).await?;
    watched.hydrate().await?;
    watch_applied(
        kv.clone(),
        shared.clone(),
        &mut watched,
        WatchOptions {
            scope: WatchScope::Prefix("route.".into()),
            batch: BatchConfig::default(),
            catch_up: true,
            defer_grace: foldhost_fold::applied::DEFAULT_DEFER_GRACE,
            repair: Default::default(),
            queries: None,
        },
        Arc::new(FoldStatus::default()),
        None,
        std::future::pending(),
    )
    .await?;

    // Another starts on the existing fold and is rebuilt from it.
    let mut hydrated = load_default(&engine, "router", &bytes, Arc::new(shared.clone())).await?;
    hydrated.hydrate().await?;
    let (entries, _) = hydrated
        .last_hydration
        .ok_or_else(|| anyhow::anyhow!("no hydration recorded"))?;
    assert_eq!(entries, u64::from(N - N.div_ceil(7)));
    for i in 0..N {
        let q = format!("h{i:05}");
        let a = watched.query(q.as_bytes()).await;
        let b = hydrated.query(q.as_bytes()).await;
        match (&a, &b) {
            (Ok(x), Ok(y)) => assert_eq!(x, y, "{q}"),
            (Err(x), Err(y)) => assert_eq!(x.message, y.message, "{q}"),
            _ => panic!("{q}: watched {a:?} vs hydrated {b:?}"),
        }
        assert_eq!(a.is_err(), i % 7 == 0, "{q}: deleted hosts are unknown");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hashring_removing_a_node_moves_only_the_keys_it_owned() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("ring").await?;
    for (id, w) in [("a", "1"), ("b", "2"), ("c", "1"), ("d", "3"), ("e", "1")] {
        kv.put(&format!("node.{id}"), w.into()).await?;
    }
    kv.put("node.bad", "not a weight".into()).await?; // not in the ring
    let engine = GuestEngine::new()?;
    let bytes = std::fs::read(guest_wasm("hashring"))?;
    let tmp = tempfile::tempdir()?;
    let (store, _) = AppendLogSnapshot::open(tmp.path(), AppendLogOptions::default())?;
    let shared = SharedStore::new(store);
    let mut ring = load_default(&engine, "hashring", &bytes, Arc::new(shared.clone())).await?;
    ring.hydrate().await?;
    let opts = WatchOptions {
        scope: ring.manifest().watch_scope(),
        batch: BatchConfig::default(),
        catch_up: true,
        defer_grace: foldhost_fold::applied::DEFAULT_DEFER_GRACE,
        repair: Default::default(),
        queries: None,
    };
    let fold = async |ring: &mut GuestApply| {
        watch_applied(
            kv.clone(),
            shared.clone(),
            ring,
            opts.clone(),
            Arc::new(FoldStatus::default()),
            None,
            std::future::pending(),
        )
        .await
    };
    fold(&mut ring).await?;
    async fn owners(ring: &mut GuestApply) -> anyhow::Result<Vec<String>> {
        let mut out = Vec::new();
        for i in 0..2000 {
            let answer = ring.query(format!("user-{i}").as_bytes()).await?;
            let v: serde_json::Value = serde_json::from_slice(&answer)?;
            out.push(v["node"].as_str().unwrap_or_default().to_string());
        }
        Ok(out)
    }
    let before = owners(&mut ring).await?;
    for id in ["a", "b", "c", "d", "e"] {
        assert!(before.iter().any(|n| n == id), "node {id} owns some keys");
    }
    assert!(
        !before.iter().any(|n| n == "bad"),
        "a node whose value is not a weight owns nothing"
    );
    kv.delete("node.c").await?;
    fold(&mut ring).await?;
    let after = owners(&mut ring).await?;
    for (i, (b, a)) in before.iter().zip(&after).enumerate() {
        if b == "c" {
            assert_ne!(a, "c", "user-{i} still maps to the removed node");
        } else {
            assert_eq!(
                a, b,
                "user-{i} moved from {b} to {a} though {b} is still there"
            );
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_over_the_guest_byte_limit_are_split_and_a_single_oversized_update_stops_the_fold()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("bytes").await?;
    for i in 0..20 {
        kv.put(&format!("k.{i:02}"), vec![b'x'; 1000].into())
            .await?;
    }
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let run = || {
        let mut c = foldhost();
        c.args(["run", "--catch-up", "--bucket", "bytes", "--nats", &h.url()])
            .args(["--guest-max-batch-bytes", "5000"])
            .arg("--guest")
            .arg(guest_wasm("kvstore"))
            .arg("--store")
            .arg(&store);
        c
    };
    let out = run().output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(dump_store(&store)?.len(), 20, "split batches all committed");

    // One update larger than the limit can never pass: the fold stops before it, naming the limit
    // (and the restart first rebuilds the guest from the fold in chunks under the limit).
    let big = kv.put("k.big", vec![b'y'; 6000].into()).await?;
    let out = run().output()?;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("kvstore@0.1.0: parse failed")
            && err.contains("max-batch-bytes limit of 5000"),
        "{err}"
    );
    assert_eq!(status_store(&store)?.cursor, big.as_u64().map(|r| r - 1));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_expiring_by_per_message_ttl_leave_the_fold_and_the_router_live_and_across_a_restart()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("ttl").await?;
    // Per-message TTLs, and the server's delete markers when a subject's last message expires.
    let js = kv.jetstream().clone();
    let mut config = js.get_stream("KV_ttl").await?.info().await?.config.clone();
    config.allow_message_ttl = true;
    config.subject_delete_marker_ttl = Some(Duration::from_secs(1));
    js.update_stream(config).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = run_command(&h, "ttl", &store, Some(&addr))
        .arg("--guest")
        .arg(guest_wasm("router"))
        .stderr(Stdio::null())
        .spawn()?;
    wait_status(&addr, |s| s.state == "running").await?;
    // Ten hosts that stay, ten that expire after 2 s.
    for i in 0..20u32 {
        let subject = format!("$KV.ttl.route.h{i:02}");
        let value = bytes::Bytes::from(upstream(i, 0));
        let ack = if i % 2 == 0 {
            js.publish(subject, value).await?
        } else {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-TTL", "2s");
            js.publish_with_headers(subject, headers, value).await?
        };
        ack.await?;
    }
    let expiring: Vec<String> = (0..20u32)
        .filter(|i| i % 2 == 1)
        .map(|i| format!("route.h{i:02}"))
        .collect();
    // Folded first (the router answers for every host), then gone once the server expires them.
    let s = wait_status(&addr, |s| s.applied_through >= 20).await?;
    assert_eq!(s.state, "running", "{s:?}");
    wait_until("the expired keys to leave the fold", || {
        dump_store(&store)
            .is_ok_and(|d| d.len() == 10 && expiring.iter().all(|k| !d.contains_key(k)))
    })
    .await?;
    for i in 0..20u32 {
        let (code, body) =
            foldhost::serve::call(&addr, "POST", "/query", format!("h{i:02}").as_bytes()).await?;
        let want = if i % 2 == 0 { 200 } else { 422 };
        assert_eq!(code, want, "h{i:02}: {}", String::from_utf8_lossy(&body));
    }
    terminate(&mut host)?;
    // A restart (a delta from the cursor) and a fresh node (a re-list) agree with the bucket.
    let fresh = tmp.path().join("fresh");
    for dir in [&store, &fresh] {
        let o = run_command(&h, "ttl", dir, None)
            .args(["--catch-up", "--guest"])
            .arg(guest_wasm("router"))
            .output()?;
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let d = dump_store(dir)?;
        assert_eq!(
            d.len(),
            10,
            "{}: {:?}",
            dir.display(),
            d.keys().collect::<Vec<_>>()
        );
        assert!(expiring.iter().all(|k| !d.contains_key(k)));
    }
    Ok(())
}

/// A guest call runs to its end without yielding, so a hydration of many chunks must yield between
/// them: a swap's candidate hydrates on the fold's own runtime, and on a runtime with one worker the
/// fold beside it would otherwise stop until the whole hydration ended.
#[tokio::test(flavor = "current_thread")]
async fn a_hydration_yields_between_chunks_so_the_fold_beside_it_keeps_running()
-> anyhow::Result<()> {
    use foldhost_core::kv::{KvEntry, KvUpdate, VersionToken, WatchCursor};
    use foldhost_core::snapshot::SnapshotStore as _;
    use std::sync::atomic::{AtomicU64, Ordering};
    let dir = tempfile::tempdir()?;
    let (mut store, _) = AppendLogSnapshot::open(dir.path(), AppendLogOptions::default())?;
    let routes: Vec<KvUpdate> = (0..5000u32)
        .map(|i| {
            KvUpdate::Put(KvEntry {
                key: format!("route.h{i:05}"),
                value: upstream(i, 1).into(),
                version: VersionToken::from_u64(u64::from(i) + 1),
            })
        })
        .collect();
    store.apply(&routes, WatchCursor::at(5000))?;
    let shared = SharedStore::new(store);
    let engine = GuestEngine::new()?;
    let bytes = std::fs::read(guest_wasm("router"))?;
    let limits = GuestLimits {
        hydrate_chunk: 250,
        ..GuestLimits::default()
    };
    let mut g =
        GuestApply::load(&engine, "router", &bytes, limits, vec![], Arc::new(shared)).await?;
    // Another task on the same (single) thread: it runs only when the hydration yields.
    let ticks = Arc::new(AtomicU64::new(0));
    let ticker = {
        let ticks = ticks.clone();
        tokio::spawn(async move {
            loop {
                ticks.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        })
    };
    tokio::task::yield_now().await; // the ticker starts
    let before = ticks.load(Ordering::Relaxed);
    g.hydrate().await?;
    let during = ticks.load(Ordering::Relaxed) - before;
    ticker.abort();
    assert_eq!(g.last_hydration.map(|(n, _)| n), Some(5000));
    assert!(
        during >= 19,
        "the task beside the hydration ran {during} times during its 20 chunks"
    );
    Ok(())
}
