//! Benchmarks against a local nats-server, each figure beside its baseline measured in the same run:
//!
//! 1. **ingest** — on a bucket of KEYS keys (32 B keys, 100 B values): the raw async-nats drain of the
//!    stream (ordered push consumer, same filter and deliver policy as the fold) vs the fold's ingest
//!    (`watch_applied`, native counting apply, append log on disk).
//! 2. **guest** — on a bucket of KEYS routes (`route.<host>` → JSON): fold ingest with the native
//!    apply vs with the router guest, at batch 100 and 1 000; the per-batch cost of crossing into the
//!    guest (an empty `parse` + `apply`); and hydration of a fresh router from the fold vs the raw
//!    scan of the same fold.
//!
//! Runs alternate between the compared sides; every figure is the median of RUNS runs.
//!
//! `cargo run --release -p foldhost-tests --bin foldhost-bench -- [ingest|guest|all] [KEYS] [RUNS]`

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer;
use foldhost::applied::{
    Apply, BatchConfig, CountingApply, FoldStatus, WatchOptions, watch_applied,
};
use foldhost::guest::{GuestApply, GuestEngine, GuestLimits};
use foldhost::kv::WatchScope;
use foldhost::localnats::LocalNats;
use foldhost::nats::{NatsConnection, NatsKv};
use foldhost::snapshot::{
    AppendLogOptions, AppendLogSnapshot, FoldRead, SharedStore, SnapshotStore,
};
use foldhost::stores::{ConnectOptions, StoreConfig};
use futures::StreamExt;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

async fn seed(
    kv: &NatsKv,
    keys: u64,
    key: impl Fn(u64) -> String,
    value: impl Fn(u64) -> Vec<u8>,
) -> anyhow::Result<()> {
    let js = kv.jetstream().clone();
    let mut acks = Vec::with_capacity(1000);
    for i in 0..keys {
        acks.push(
            js.publish(format!("$KV.{}.{}", kv.bucket(), key(i)), value(i).into())
                .await?,
        );
        if acks.len() == 1000 {
            for a in acks.drain(..) {
                a.await?;
            }
        }
    }
    for a in acks {
        a.await?;
    }
    Ok(())
}

/// Folds the whole bucket into an empty append log; returns updates/s and the shared store.
async fn fold_rate(
    kv: &Arc<NatsKv>,
    apply: &mut dyn Apply,
    max: usize,
    scope: WatchScope,
    store: SharedStore<AppendLogSnapshot>,
) -> anyhow::Result<f64> {
    let status = Arc::new(FoldStatus::default());
    let t = Instant::now();
    watch_applied(
        kv.clone(),
        store,
        apply,
        WatchOptions {
            scope,
            batch: BatchConfig {
                max,
                channel_capacity: max.max(256),
                ..BatchConfig::default()
            },
            catch_up: true,
        },
        status.clone(),
        None,
        std::future::pending(),
    )
    .await?;
    let n = status.delivered.load(std::sync::atomic::Ordering::Relaxed);
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

fn empty_store() -> anyhow::Result<(tempfile::TempDir, SharedStore<AppendLogSnapshot>)> {
    let dir = tempfile::tempdir()?;
    let (store, _) = AppendLogSnapshot::open(dir.path(), AppendLogOptions::default())?;
    Ok((dir, SharedStore::new(store)))
}

async fn bench_ingest(conn: &NatsConnection, keys: u64, runs: usize) -> anyhow::Result<()> {
    let kv = conn.bucket("bench", &unlimited()).await?;
    let t = Instant::now();
    seed(&kv, keys, |i| format!("key.{i:026}"), |_| vec![b'v'; 100]).await?;
    println!(
        "ingest: seeded {keys} keys (32 B keys, 100 B values) in {:.2}s",
        t.elapsed().as_secs_f64()
    );
    let js = kv.jetstream().clone();
    let inbox = conn.client().await?;
    let mut raw = Vec::new();
    let mut fold = Vec::new();
    for run in 0..runs {
        let stream = js.get_stream("KV_bench").await?;
        let t = Instant::now();
        let c = stream
            .create_consumer(consumer::push::OrderedConfig {
                deliver_subject: inbox.new_inbox(),
                filter_subjects: vec!["$KV.bench.>".into()],
                deliver_policy: consumer::DeliverPolicy::LastPerSubject,
                ..Default::default()
            })
            .await?;
        let mut msgs = c.messages().await?;
        let mut n = 0u64;
        while let Some(m) = msgs.next().await {
            let m = m?;
            n += 1;
            let pending = m
                .message
                .reply
                .as_ref()
                .and_then(|r| foldhost::protocol::parse_ack_subject(r.as_str()))
                .map(|a| a.pending);
            if pending == Some(0) {
                break;
            }
        }
        let raw_rate = n as f64 / t.elapsed().as_secs_f64();
        drop(msgs);
        anyhow::ensure!(n == keys, "raw drain incomplete: {n}");

        let (_dir, store) = empty_store()?;
        let mut apply = CountingApply::default();
        let fold_r = fold_rate(&kv, &mut apply, 100, WatchScope::All, store.clone()).await?;
        anyhow::ensure!(store.read()?.len()? == keys, "fold incomplete");
        println!(
            "ingest run {run}: raw drain {raw_rate:>9.0} upd/s   fold ingest {fold_r:>9.0} upd/s   ratio {:.2}",
            fold_r / raw_rate
        );
        raw.push(raw_rate);
        fold.push(fold_r);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let ratios: Vec<f64> = raw.iter().zip(&fold).map(|(r, f)| f / r).collect();
    let (r, f) = (median(raw), median(fold));
    println!(
        "ingest, median of {runs}: raw async-nats drain {r:.0} updates/s; fold ingest (native apply, append log) {f:.0} updates/s; ratio of medians {:.2}, median of per-run ratios {:.2} (target >= 0.80)",
        f / r,
        median(ratios)
    );
    Ok(())
}

fn router_wasm() -> PathBuf {
    std::env::var("FOLDHOST_GUESTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../guests/target/wasm32-wasip2/release")
        })
        .join("router.wasm")
}

async fn bench_guest(conn: &NatsConnection, keys: u64, runs: usize) -> anyhow::Result<()> {
    let kv = conn.bucket("routes", &unlimited()).await?;
    let t = Instant::now();
    seed(
        &kv,
        keys,
        |i| format!("route.h{i:08}.example.com"),
        |i| {
            format!(
                "{{\"upstream\":\"10.{}.{}.{}:8080\"}}",
                i >> 16,
                (i >> 8) & 255,
                i & 255
            )
            .into_bytes()
        },
    )
    .await?;
    println!(
        "guest: seeded {keys} routes in {:.2}s",
        t.elapsed().as_secs_f64()
    );
    let path = router_wasm();
    let bytes = std::fs::read(&path)
        .map_err(|e| anyhow::anyhow!("{}: {e} (run guests/build.sh)", path.display()))?;
    let engine = GuestEngine::new()?;
    let scope = WatchScope::Prefix("route.".into());
    for max in [100usize, 1000] {
        let mut native = Vec::new();
        let mut guest = Vec::new();
        for _ in 0..runs {
            let (_d1, s1) = empty_store()?;
            native
                .push(fold_rate(&kv, &mut CountingApply::default(), max, scope.clone(), s1).await?);
            let (_d2, s2) = empty_store()?;
            let mut g = GuestApply::load(
                &engine,
                "router",
                &bytes,
                GuestLimits::default(),
                vec![],
                Arc::new(s2.clone()),
            )
            .await?;
            g.hydrate().await?;
            guest.push(fold_rate(&kv, &mut g, max, scope.clone(), s2.clone()).await?);
            anyhow::ensure!(s2.read()?.len()? == keys, "guest fold incomplete");
        }
        let (n, g) = (median(native), median(guest));
        println!(
            "guest, batch {max:>4}, median of {runs}: native apply {n:.0} updates/s; router guest {g:.0} updates/s; ratio {:.2} (target >= {})",
            g / n,
            if max == 100 { "0.80" } else { "0.90" }
        );
    }

    // The fixed cost of one batch crossing into the guest: an empty parse + apply.
    let (_d, store) = empty_store()?;
    let mut g = GuestApply::load(
        &engine,
        "router",
        &bytes,
        GuestLimits::default(),
        vec![],
        Arc::new(store.clone()),
    )
    .await?;
    g.hydrate().await?;
    let calls = 20_000;
    let t = Instant::now();
    for _ in 0..calls {
        g.parse(&[]).await?;
        g.apply(&[], &[]).await?;
    }
    let per_call = t.elapsed().as_secs_f64() * 1e6 / f64::from(calls);
    println!(
        "guest: one empty batch (parse + apply) costs {per_call:.2} µs; over a batch of 100 updates that is {:.3} µs per update",
        per_call / 100.0
    );

    // Hydration of a fresh router from a full fold vs the raw scan of the same fold.
    let (_d, full) = empty_store()?;
    fold_rate(
        &kv,
        &mut CountingApply::default(),
        1000,
        scope.clone(),
        full.clone(),
    )
    .await?;
    let mut scan = Vec::new();
    let mut hyd = Vec::new();
    for _ in 0..runs {
        let t = Instant::now();
        let mut n = 0u64;
        let mut bytes_seen = 0usize;
        full.visit("route.", &mut |e| {
            n += 1;
            bytes_seen += e.value.len();
            ControlFlow::Continue(())
        })?;
        anyhow::ensure!(n == keys && bytes_seen > 0, "scan incomplete");
        scan.push(n as f64 / t.elapsed().as_secs_f64());
        let mut g = GuestApply::load(
            &engine,
            "router",
            &bytes,
            GuestLimits::default(),
            vec![],
            Arc::new(full.clone()),
        )
        .await?;
        let t = Instant::now();
        g.hydrate().await?;
        let rate = keys as f64 / t.elapsed().as_secs_f64();
        anyhow::ensure!(
            g.last_hydration.map(|(n, _)| n) == Some(keys),
            "hydration incomplete"
        );
        hyd.push(rate);
    }
    let (s, h) = (median(scan), median(hyd));
    println!(
        "guest: hydration of a fresh router from the fold {h:.0} keys/s vs raw fold scan {s:.0} keys/s; ratio {:.2}",
        h / s
    );
    Ok(())
}

fn unlimited() -> StoreConfig {
    StoreConfig {
        max_bytes: None,
        ..StoreConfig::default()
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let what = args.get(1).map_or("all", String::as_str);
    let keys: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let runs: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5);
    let server = LocalNats::start()?;
    let conn = NatsConnection::open(ConnectOptions::new(server.url())).await?;
    if matches!(what, "ingest" | "all") {
        bench_ingest(&conn, keys, runs).await?;
    }
    if matches!(what, "guest" | "all") {
        bench_guest(&conn, keys, runs).await?;
    }
    if !matches!(what, "ingest" | "guest" | "all") {
        anyhow::bail!("usage: foldhost-bench [ingest|guest|all] [KEYS] [RUNS]");
    }
    Ok(())
}
