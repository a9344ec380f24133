//! Crash safety of the real binary: `foldhost run` is killed with SIGKILL at random moments while a
//! writer puts 20 000 keys (with overwrites and deletes), and restarted each time; at the end the
//! fold's `dump` equals the bucket exactly — every key, value and revision, and no key that the
//! bucket no longer holds.
//!
//! The kill schedule comes from a seed printed at the start; `FOLDHOST_TEST_SEED=N` replays it.

use std::time::Duration;

use foldhost::kv::KvWriter;
use foldhost_tests::{
    Harness, bucket_contents, dump_store, first_difference, foldhost, status_store,
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
            let c = status_store(&store)?["applied_through"]
                .as_u64()
                .unwrap_or(0);
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
    eprintln!("killed foldhost run {kills} times; cursors after each kill: {cursors:?}");
    assert!(
        cursors.windows(2).filter(|w| w[1] > w[0]).count() >= 2,
        "the fold made progress across restarts (a resume, not a re-list each time): {cursors:?}"
    );

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
