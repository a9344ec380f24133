//! The `swap` benchmark: the pause of a hot swap between `kvstore` and `kvstore-v2` on a fold a
//! writer keeps busy, the rebuild rate beside the fold against the same entries fed directly, and
//! query latency with and without a concurrent writer.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use foldhost_core::kv::WatchScope;
use foldhost_core::status::FoldStatus;
use foldhost_fold::applied::{BatchConfig, Control, WatchOptions, watch_applied};
use foldhost_guest::guest::GuestEngine;
use foldhost_nats::{NatsConnection, NatsKv};

use super::{
    direct_rate, empty_store, load_guest, median, percentile, read_guest, seed, table, unlimited,
};

/// The p50 and p99 latency (µs) of `n` queries of the fold through its `control`.
async fn query_latencies(
    control: &tokio::sync::mpsc::Sender<Control>,
    keys: u64,
    n: usize,
) -> anyhow::Result<(f64, f64)> {
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("key.{:026}", (i as u64 * 7919) % keys);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let t = Instant::now();
        control
            .send(Control::Query {
                request: key.into_bytes(),
                reply: tx,
            })
            .await
            .map_err(|_| anyhow::anyhow!("fold stopped"))?;
        rx.await??;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    Ok((percentile(&lat, 0.5), percentile(&lat, 0.99)))
}

/// The `swap` benchmark on a `keys`-key fold followed live by `kvstore`: `runs` swaps to
/// `kvstore-v2` and as many back under a busy writer, then (on folds up to 200 000 keys) query
/// latency idle and under a writer.
pub(crate) async fn bench_swap(
    conn: &NatsConnection,
    keys: u64,
    runs: usize,
) -> anyhow::Result<()> {
    let bucket = format!("swapb{keys}");
    let kv = conn.bucket(&bucket, &unlimited()).await?;
    seed(&kv, keys, |i| format!("key.{i:026}"), |_| vec![b'v'; 100]).await?;
    let engine = GuestEngine::new()?;
    let (v1, v2) = (read_guest("kvstore")?, read_guest("kvstore_v2")?);
    let (_dir, store) = empty_store()?;
    let mut g = load_guest(&engine, "kvstore", &v1, Arc::new(store.clone())).await?;
    g.hydrate().await?;
    let (control, rx) = tokio::sync::mpsc::channel(16);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let status = Arc::new(FoldStatus::default());
    let fold = {
        let (kv, store, status) = (kv.clone(), store.clone(), status.clone());
        tokio::spawn(async move {
            let options = WatchOptions {
                scope: WatchScope::All,
                batch: BatchConfig::default(),
                catch_up: false,
                defer_grace: foldhost_fold::applied::DEFAULT_DEFER_GRACE,
                repair: Default::default(),
                queries: None,
            };
            let stop = async {
                let _ = stop_rx.await;
            };
            watch_applied(kv, store, &mut g, options, status, Some(rx), stop).await
        })
    };
    while status
        .applied_through
        .load(std::sync::atomic::Ordering::Relaxed)
        < keys
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    engine.prepare("kvstore-v2", &v2)?; // compiled off the fold's path, as `swap` does
    engine.prepare("kvstore", &v1)?;
    // A writer keeps the fold busy through every swap: the pause is the cut-over's catch-up of
    // what it wrote during the hydration, not the fold's size.
    let writing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let writer = busy_writer(&kv, &bucket, keys, &writing);
    let swaps = swap_runs(&control, (&v1, &v2), keys, runs).await?;
    writing.store(false, std::sync::atomic::Ordering::Relaxed);
    let rate = writer.await??;
    // The baseline of the rebuild: kvstore-v2 fed the same entries directly, no fold around it.
    let direct = direct_rate(&engine, "kvstore-v2", &v2, &store, "", runs).await?;
    report_swaps(keys, runs, rate, swaps, direct);
    if keys <= 200_000 {
        latency_under_writer(&kv, &bucket, &control, keys).await?;
    }
    let _ = stop_tx.send(());
    fold.await??;
    Ok(())
}

/// A writer of about 20 000 updates/s to the bucket's `keys` keys (batches of 100 acknowledged
/// puts, 5 ms apart) until `writing` is cleared; returns its rate.
fn busy_writer(
    kv: &Arc<NatsKv>,
    bucket: &str,
    keys: u64,
    writing: &Arc<AtomicBool>,
) -> tokio::task::JoinHandle<anyhow::Result<f64>> {
    let (kv, writing, bucket) = (kv.clone(), writing.clone(), bucket.to_string());
    tokio::spawn(async move {
        let js = kv.jetstream().clone();
        let t = Instant::now();
        let mut n = 0u64;
        while writing.load(std::sync::atomic::Ordering::Relaxed) {
            let mut acks = Vec::with_capacity(100);
            for _ in 0..100 {
                let k = (n.wrapping_mul(2_654_435_761)) % keys;
                acks.push(
                    js.publish(format!("$KV.{bucket}.key.{k:026}"), vec![b'w'; 100].into())
                        .await?,
                );
                n += 1;
            }
            for a in acks {
                a.await?;
            }
            // About 20 000 updates/s: a busy fleet's bucket, not a bulk load.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        anyhow::Ok(n as f64 / t.elapsed().as_secs_f64())
    })
}

/// What the swaps measured: each swap's pause (ms), each hydration rate of `kvstore-v2` (keys/s)
/// and each catch-up (keys).
struct Swaps {
    pauses: Vec<f64>,
    rebuild: Vec<f64>,
    caught: Vec<f64>,
}

/// `runs` swaps to `kvstore-v2` (`v2`) and as many back to `kvstore` (`v1`), in turn, through the
/// fold's `control`.
async fn swap_runs(
    control: &tokio::sync::mpsc::Sender<Control>,
    (v1, v2): (&[u8], &[u8]),
    keys: u64,
    runs: usize,
) -> anyhow::Result<Swaps> {
    let mut s = Swaps {
        pauses: Vec::new(),
        rebuild: Vec::new(),
        caught: Vec::new(),
    };
    for run in 0..runs * 2 {
        let bytes = if run % 2 == 0 {
            v2.to_vec()
        } else {
            v1.to_vec()
        };
        let (tx, reply) = tokio::sync::oneshot::channel();
        control
            .send(Control::Swap {
                bytes,
                what: "bench".into(),
                reply: tx,
            })
            .await
            .map_err(|_| anyhow::anyhow!("fold stopped"))?;
        let r = reply.await??;
        anyhow::ensure!(r.hydrated_entries >= keys, "rebuild incomplete: {r:?}");
        println!(
            "swap {run}: {} → {}: hydrated {} in {} ms beside the fold; caught up {} keys; paused {} ms",
            r.from, r.to, r.hydrated_entries, r.hydrate_ms, r.caught_up, r.paused_ms
        );
        s.pauses.push(r.paused_ms as f64);
        s.caught.push(r.caught_up as f64);
        if run % 2 == 0 {
            // kvstore-v2's hydrations, compared below with kvstore-v2 fed directly.
            s.rebuild
                .push(r.hydrated_entries as f64 / (r.hydrate_ms.max(1) as f64 / 1000.0));
        }
    }
    Ok(s)
}

/// Prints the swaps' medians and adds the pause and the hydration rate (against `direct`, the
/// same entries fed directly) to the table.
fn report_swaps(keys: u64, runs: usize, rate: f64, swaps: Swaps, direct: f64) {
    let worst = swaps.pauses.iter().copied().fold(0.0, f64::max);
    let (p, rb, c) = (
        median(swaps.pauses),
        median(swaps.rebuild),
        median(swaps.caught),
    );
    println!(
        "swap, {keys}-key fold, {} swaps under a {rate:.0} updates/s writer: fold paused median {p:.0} ms (worst {worst:.0} ms), catch-up median {c:.0} keys; hydration {rb:.0} keys/s beside the fold vs {direct:.0} keys/s fed directly (ratio {:.2})",
        runs * 2,
        rb / direct
    );
    table::row(
        format!(
            "swap pause, kvstore ⇄ kvstore-v2 on a {keys}-key fold, writer at {}/s (median; worst {worst:.0} ms)",
            table::rate(rate)
        ),
        format!("{p:.0} ms"),
        format!(
            "its hydration beside the fold {:.0} ms",
            keys as f64 / rb * 1000.0
        ),
        p / (keys as f64 / rb * 1000.0),
        "≤ 50 ms",
    );
    table::row(
        format!(
            "swap hydration of kvstore-v2, {keys}-key fold, beside the running fold and its writer (sharing the cores)"
        ),
        format!("{}/s", table::rate(rb)),
        format!(
            "the same entries fed directly on an idle machine, parse + apply in batches of 1 000 {}/s",
            table::rate(direct)
        ),
        rb / direct,
        "",
    );
}

/// Query latency (p50/p99 of 2 000 queries) idle, then beside a writer flat out for 4 s; prints
/// both.
async fn latency_under_writer(
    kv: &Arc<NatsKv>,
    bucket: &str,
    control: &tokio::sync::mpsc::Sender<Control>,
    keys: u64,
) -> anyhow::Result<()> {
    let (q50, q99) = query_latencies(control, keys, 2000).await?;
    let writer = {
        let (kv, bucket) = (kv.clone(), bucket.to_string());
        tokio::spawn(async move {
            let js = kv.jetstream().clone();
            let t = Instant::now();
            let mut n = 0u64;
            while t.elapsed() < Duration::from_secs(4) {
                let mut acks = Vec::with_capacity(200);
                for _ in 0..200 {
                    acks.push(
                        js.publish(
                            format!("$KV.{bucket}.key.{:026}", n % keys),
                            vec![b'w'; 100].into(),
                        )
                        .await?,
                    );
                    n += 1;
                }
                for a in acks {
                    a.await?;
                }
            }
            anyhow::Ok(n as f64 / t.elapsed().as_secs_f64())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (w50, w99) = query_latencies(control, keys, 2000).await?;
    let rate = writer.await??;
    println!(
        "swap: query latency idle p50 {q50:.0} µs / p99 {q99:.0} µs; under a {rate:.0} updates/s writer p50 {w50:.0} µs / p99 {w99:.0} µs"
    );
    Ok(())
}
