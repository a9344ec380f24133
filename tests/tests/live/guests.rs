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

mod folding;
mod limits;

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
    let writer = spawn_route_writer(&kv);
    warm_the_compiled_guest(&h, &router, tmp.path())?;
    let kills = sigkill_while_the_writer_writes(&h, &router, &store, &writer, &mut rng).await?;
    writer.await??;

    // Final run: live, serving queries; wait until it has applied the whole stream.
    let last = kv.positions().await?.last_sequence;
    let port = foldhost_localnats::reserved_port()?;
    let addr = format!("127.0.0.1:{port}");
    let mut host = spawn_a_live_host(&h, &router, &store, &addr)?;
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

/// Routes the router test writes.
const HOSTS: u32 = 20_000;

/// Writes [`HOSTS`] routes, rewriting every tenth a little later, deleting every 25th and writing
/// out of the router's scope every 500th.
fn spawn_route_writer(
    kv: &Arc<foldhost_nats::NatsKv>,
) -> tokio::task::JoinHandle<anyhow::Result<()>> {
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
}

/// Compiles `router` once into the tests' compiled-component cache (a catch-up run under `tmp`).
fn warm_the_compiled_guest(
    h: &Harness,
    router: &std::path::Path,
    tmp: &std::path::Path,
) -> anyhow::Result<()> {
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
        .arg(router)
        .arg("--store")
        .arg(tmp.join("warm"))
        .output()?;
    anyhow::ensure!(
        warm.status.success(),
        "{}",
        String::from_utf8_lossy(&warm.stderr)
    );
    Ok(())
}

/// Starts a host folding `router` into `store` and SIGKILLs it at a random moment, again until the
/// writer finished and at least three kills; returns the kills.
async fn sigkill_while_the_writer_writes(
    h: &Harness,
    router: &std::path::Path,
    store: &std::path::Path,
    writer: &tokio::task::JoinHandle<anyhow::Result<()>>,
    rng: &mut rand::rngs::StdRng,
) -> anyhow::Result<u32> {
    let mut kills = 0;
    while !writer.is_finished() || kills < 3 {
        let mut child = foldhost()
            .args(["run", "--bucket", "routes", "--nats", &h.url(), "--guest"])
            .arg(router)
            .arg("--store")
            .arg(store)
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
    Ok(kills)
}

/// The final run: a live host folding `router` into `store`, serving queries on `addr`.
fn spawn_a_live_host(
    h: &Harness,
    router: &std::path::Path,
    store: &std::path::Path,
    addr: &str,
) -> anyhow::Result<std::process::Child> {
    Ok(foldhost()
        .args([
            "run",
            "--bucket",
            "routes",
            "--nats",
            &h.url(),
            "--listen",
            addr,
        ])
        .arg("--guest")
        .arg(router)
        .arg("--store")
        .arg(store)
        .stderr(Stdio::null())
        .spawn()?)
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
