//! Crash safety of the real binary.
//!
//! - Random points: `foldhost run` is killed with SIGKILL at random moments while a writer puts
//!   20 000 keys (with overwrites and deletes), and restarted each time; the cursor never moves
//!   backward across a kill, and at the end the fold's `dump` equals the bucket exactly — every
//!   key, value and revision, and no key that the bucket no longer holds. Where the kills land is
//!   up to the scheduler, so nothing is asserted about it. The kill schedule comes from a seed
//!   printed at the start; `FOLDHOST_TEST_SEED=N` replays it.
//! - Placed points: the binary's crash points (`FOLDHOST_CRASH_AT`) abort it after the N-th
//!   committed batch, and between a batch's commit and the guest's `on-applied`; the fold then
//!   holds exactly the revisions up to its cursor, and the restart resumes with a delta.

use std::time::Duration;

use foldhost_core::crashpoint;
use foldhost_core::kv::KvWriter;
use foldhost_tests::{
    Contents, Harness, bucket_contents, check_routes_served, dump_store, first_difference,
    foldhost, guest_wasm, publish_all, run_command, run_to_crash, status_store, terminate,
    wait_status,
};
use rand::{Rng, SeedableRng};

const KEYS: u32 = 20_000;

fn seed() -> u64 {
    std::env::var("FOLDHOST_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(7)
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_fold_converges_to_the_bucket_exactly() -> anyhow::Result<()> {
    let seed = seed();
    eprintln!("crash_safety seed = {seed} (replay with FOLDHOST_TEST_SEED={seed})");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let h = Harness::start().await?;
    let kv = h.bucket("crash").await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");

    // The writer: 20 000 distinct keys, every 10th overwritten later, every 25th deleted later.
    let writer = {
        let kv = kv.clone();
        tokio::spawn(async move {
            for i in 0..KEYS {
                kv.put(&format!("k.{i:06}"), format!("v{i}").into_bytes().into())
                    .await?;
                if i % 10 == 9 {
                    kv.put(
                        &format!("k.{:06}", i - 5),
                        format!("v{i}-again").into_bytes().into(),
                    )
                    .await?;
                }
                if i % 25 == 24 {
                    kv.delete(&format!("k.{:06}", i - 12)).await?;
                }
            }
            anyhow::Ok(())
        })
    };

    let mut kills = 0;
    let mut cursors: Vec<u64> = Vec::new();
    while !writer.is_finished() || kills < 3 {
        let mut child = foldhost()
            .args(["run", "--bucket", "crash", "--nats", &h.url(), "--store"])
            .arg(&store)
            .spawn()?;
        let alive_ms = rng.random_range(50..900);
        tokio::time::sleep(Duration::from_millis(alive_ms)).await;
        if let Some(status) = child.try_wait()? {
            anyhow::bail!("foldhost run exited on its own before the kill: {status}");
        }
        child.kill()?; // SIGKILL
        child.wait()?;
        kills += 1;
        if store.join("fold.log").exists() {
            // Read-only, beside nothing: the cursor a restart will resume from.
            let c = status_store(&store)?.applied_through;
            if let Some(prev) = cursors.last() {
                assert!(
                    c >= *prev,
                    "cursor moved backward across a SIGKILL: {prev} -> {c}"
                );
            }
            cursors.push(c);
        }
        if kills > 200 {
            anyhow::bail!("writer did not finish");
        }
    }
    writer.await??;
    // How far each run got depends on the scheduler: only monotonicity (above) and convergence
    // (below) must hold. That a restart resumes with a delta is the placed-crash test's to show.
    eprintln!("killed foldhost run {kills} times; cursors after each kill: {cursors:?}");

    let out = foldhost()
        .args([
            "run",
            "--catch-up",
            "--bucket",
            "crash",
            "--nats",
            &h.url(),
            "--store",
        ])
        .arg(&store)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "final catch-up failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let want = bucket_contents(&kv).await?;
    let got = dump_store(&store)?;
    assert_eq!(
        want.len() as u32,
        KEYS - KEYS / 25,
        "the writer's deletes should leave this many keys"
    );
    if let Some(diff) = first_difference(&want, &got) {
        panic!("fold differs from the bucket after {kills} SIGKILLs (seed {seed}): {diff}");
    }
    Ok(())
}

/// Publishes `n` distinct keys `{prefix}{i:05}` (revisions 1..=n on a fresh bucket) with the
/// value `value(i)`.
async fn publish_distinct(
    h: &Harness,
    bucket: &str,
    prefix: &str,
    n: u32,
    value: impl Fn(u32) -> String,
) -> anyhow::Result<std::sync::Arc<foldhost_nats::NatsKv>> {
    let kv = h.bucket(bucket).await?;
    let msgs = (0..n).map(|i| (format!("$KV.{bucket}.{prefix}{i:05}"), value(i).into()));
    publish_all(kv.jetstream(), msgs).await?;
    Ok(kv)
}

/// The committed cursor of a store (read-only).
fn store_cursor(store: &std::path::Path) -> anyhow::Result<u64> {
    status_store(store)?
        .cursor
        .ok_or_else(|| anyhow::anyhow!("the store has no cursor"))
}

/// `want` cut to the entries at or below revision `cursor`.
fn up_to(want: &Contents, cursor: u64) -> Contents {
    want.iter()
        .filter(|(_, (_, rev))| *rev <= cursor)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_n_committed_batches_keeps_exactly_the_prefix_to_its_cursor_and_resumes_with_a_delta()
-> anyhow::Result<()> {
    const N: u32 = 5000;
    let h = Harness::start().await?;
    let kv = publish_distinct(&h, "placed", "k.", N, |i| format!("v{i}")).await?;
    let want = bucket_contents(&kv).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let catch_up = || {
        let mut c = run_command(&h, "placed", &store, None);
        c.args(["--catch-up", "--batch-max", "100"]);
        c
    };
    run_to_crash(catch_up(), crashpoint::FOLD_COMMITTED, 10)?;
    // Ten committed batches of at most 100 updates, every revision a distinct key.
    let cursor = store_cursor(&store)?;
    assert!(
        (10..=1000).contains(&cursor),
        "ten batches of at most 100 updates commit a cursor in 10..=1000, not {cursor}"
    );
    assert_eq!(
        first_difference(&up_to(&want, cursor), &dump_store(&store)?),
        None,
        "the crashed fold holds every revision up to its cursor {cursor} and nothing after it"
    );
    let o = catch_up().output()?;
    anyhow::ensure!(
        o.status.success(),
        "restart: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let status = foldhost_core::storedir::read_status(&store)
        .ok_or_else(|| anyhow::anyhow!("no status.json after the restart"))?;
    assert_eq!(
        status.delivered,
        u64::from(N) - cursor,
        "the restart resumed after cursor {cursor}: a delta, not a replay"
    );
    assert_eq!(first_difference(&want, &dump_store(&store)?), None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_commit_and_on_applied_keeps_the_batch_and_the_rebuilt_guest_serves_it()
-> anyhow::Result<()> {
    const N: u32 = 3000;
    let h = Harness::start().await?;
    let upstream = |i: u32| format!("{{\"upstream\":\"10.0.{}.{}:80\"}}", i / 250, i % 250);
    let kv = publish_distinct(&h, "onapplied", "route.h", N, upstream).await?;
    let want = bucket_contents(&kv).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let router = guest_wasm("router");
    let mut c = run_command(&h, "onapplied", &store, None);
    c.args(["--catch-up", "--batch-max", "100", "--guest"])
        .arg(&router);
    run_to_crash(c, crashpoint::FOLD_BEFORE_ON_APPLIED, 5)?;
    // The fifth batch is durable although its on-applied never ran.
    let cursor = store_cursor(&store)?;
    assert!(
        (5..=500).contains(&cursor),
        "five batches of at most 100 updates commit a cursor in 5..=500, not {cursor}"
    );
    assert_eq!(
        first_difference(&up_to(&want, cursor), &dump_store(&store)?),
        None,
        "the crashed fold holds every revision up to its cursor {cursor} and nothing after it"
    );
    // A restart rebuilds the router from the fold (hydration) and folds the rest.
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = run_command(&h, "onapplied", &store, Some(&addr))
        .arg("--guest")
        .arg(&router)
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let s = wait_status(&addr, |s| {
        s.applied_through >= u64::from(N) || s.state == "failed"
    })
    .await?;
    assert_eq!(s.state, "running", "{s:?}");
    assert_eq!(check_routes_served(&addr, &want).await?, N as usize);
    terminate(&mut host)?;
    assert_eq!(first_difference(&want, &dump_store(&store)?), None);
    Ok(())
}
