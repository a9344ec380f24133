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
//! 3. **swap** — on a KEYS-key fold followed live by `kvstore`: the pause of a hot swap to
//!    `kvstore-v2` and back (the time the fold applies nothing) and the rebuild rate, against the raw
//!    scan of the same store; and query latency (p50/p99 of 2 000 queries) with and without a
//!    concurrent writer.
//!
//! 4. **artifact** — on a KEYS-key append-log fold (256 B values): export (copy, verify-by-reopen,
//!    BLAKE3 of every file, manifest) and import (copy + re-hash, reopen gate) throughput, against
//!    reading and BLAKE3-hashing the same bytes (what `b3sum` does) in the same run.
//! 5. **backends** — no NATS: each compiled-in storage backend (append-log, and fjall / rocksdb when
//!    built with those features) in its own child process: `apply` throughput folding KEYS keys
//!    (batch 100 and 1 000, 128 B and 1 KiB values, keys in scattered order), the time to reopen
//!    the KEYS-key fold, and peak RSS (`VmHWM`) of the ingest and of open + full scan. Every figure
//!    is printed beside the append log's as a ratio. Default KEYS for this one is 1 000 000.
//!
//! 6. **bootstrap** — on a KEYS-key bucket (default 1 000 000), for fjall and RocksDB, through the
//!    release `foldhost` binary: a full replay from revision 1 against an artifact's export and
//!    upload, and its download and import (S3 on moto, and the local file system), with the peak
//!    RSS of each. See `bench/bootstrap.rs`.
//!
//! Runs alternate between the compared sides; every figure is the median of RUNS runs.
//!
//! `cargo run --release -p foldhost-tests --bin foldhost-bench -- [ingest|guest|swap|artifact|all] [KEYS] [RUNS]`
//! `cargo run --release -p foldhost-tests --features fjall,rocksdb --bin foldhost-bench -- backends [KEYS]`
//! `make bench-bootstrap` (`foldhost-bench bootstrap [KEYS]`, needs `target/release/foldhost`)

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer;
use foldhost::applied::{
    Apply, BatchConfig, CountingApply, FoldStatus, WatchOptions, watch_applied,
};
use foldhost::bucket::{BucketConfig, ConnectOptions};
use foldhost::guest::{GuestApply, GuestEngine, GuestLimits};
use foldhost::kv::WatchScope;
use foldhost::localnats::LocalNats;
use foldhost::nats::{NatsConnection, NatsKv};
use foldhost::snapshot::{AppendLogOptions, AppendLogSnapshot, SnapshotStore};
use foldhost::view::{FoldRead, SharedStore};
use futures::StreamExt;

#[path = "bench/bootstrap.rs"]
mod bootstrap;

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
    let bucket = kv.bucket();
    let msgs = (0..keys).map(|i| (format!("$KV.{bucket}.{}", key(i)), value(i).into()));
    foldhost_tests::publish_all(kv.jetstream(), msgs).await
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
            defer_grace: foldhost::applied::DEFAULT_DEFER_GRACE,
            repair: Default::default(),
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
        anyhow::ensure!(
            foldhost::snapshot::bucket_len(&*store.read()?)? == keys,
            "fold incomplete"
        );
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

fn guest_file(name: &str) -> PathBuf {
    std::env::var("FOLDHOST_GUESTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../guests/target/wasm32-wasip2/release")
        })
        .join(format!("{name}.wasm"))
}

fn read_guest(name: &str) -> anyhow::Result<Vec<u8>> {
    let p = guest_file(name);
    std::fs::read(&p).map_err(|e| anyhow::anyhow!("{}: {e} (run guests/build.sh)", p.display()))
}

/// A guest with the default limits and no configuration.
async fn load_guest(
    engine: &Arc<GuestEngine>,
    what: &str,
    bytes: &[u8],
    fold: Arc<dyn FoldRead>,
) -> anyhow::Result<GuestApply> {
    Ok(GuestApply::load(engine, what, bytes, GuestLimits::default(), vec![], fold).await?)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn query_latencies(
    control: &tokio::sync::mpsc::Sender<foldhost::applied::Control>,
    keys: u64,
    n: usize,
) -> anyhow::Result<(f64, f64)> {
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("key.{:026}", (i as u64 * 7919) % keys);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let t = Instant::now();
        control
            .send(foldhost::applied::Control::Query {
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

async fn bench_swap(conn: &NatsConnection, keys: u64, runs: usize) -> anyhow::Result<()> {
    use foldhost::applied::Control;
    let kv = conn.bucket("swapb", &unlimited()).await?;
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
            watch_applied(
                kv,
                store,
                &mut g,
                WatchOptions {
                    scope: WatchScope::All,
                    batch: BatchConfig::default(),
                    catch_up: false,
                    defer_grace: foldhost::applied::DEFAULT_DEFER_GRACE,
                    repair: Default::default(),
                },
                status,
                Some(rx),
                async {
                    let _ = stop_rx.await;
                },
            )
            .await
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
    let mut pauses = Vec::new();
    let mut rebuild = Vec::new();
    let mut scan = Vec::new();
    for run in 0..runs * 2 {
        let bytes = if run % 2 == 0 { v2.clone() } else { v1.clone() };
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
        anyhow::ensure!(r.hydrated_entries == keys, "rebuild incomplete: {r:?}");
        pauses.push(r.paused_ms as f64);
        rebuild.push(keys as f64 / (r.hydrate_ms.max(1) as f64 / 1000.0));
        let t = Instant::now();
        let mut n = 0u64;
        store.visit("", &mut |_| {
            n += 1;
            ControlFlow::Continue(())
        })?;
        scan.push(n as f64 / t.elapsed().as_secs_f64());
    }
    let (p, rb, sc) = (median(pauses), median(rebuild), median(scan));
    println!(
        "swap, {keys}-key fold, median of {} swaps: fold paused {p:.0} ms; rebuild {rb:.0} keys/s through parse/apply vs raw fold scan {sc:.0} keys/s (ratio {:.3})",
        runs * 2,
        rb / sc
    );

    let (q50, q99) = query_latencies(&control, keys, 2000).await?;
    let writer = {
        let kv = kv.clone();
        tokio::spawn(async move {
            let js = kv.jetstream().clone();
            let t = Instant::now();
            let mut n = 0u64;
            while t.elapsed() < Duration::from_secs(4) {
                let mut acks = Vec::with_capacity(200);
                for _ in 0..200 {
                    acks.push(
                        js.publish(
                            format!("$KV.swapb.key.{:026}", n % keys),
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
    let (w50, w99) = query_latencies(&control, keys, 2000).await?;
    let rate = writer.await??;
    println!(
        "swap: query latency idle p50 {q50:.0} µs / p99 {q99:.0} µs; under a {rate:.0} updates/s writer p50 {w50:.0} µs / p99 {w99:.0} µs"
    );
    let _ = stop_tx.send(());
    fold.await??;
    Ok(())
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
    // FOLDHOST_BENCH_GUEST picks another guest for the comparison (default: the router).
    let guest_name = std::env::var("FOLDHOST_BENCH_GUEST").unwrap_or_else(|_| "router".into());
    let bytes = read_guest(&guest_name)?;
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
            let mut g = load_guest(&engine, "router", &bytes, Arc::new(s2.clone())).await?;
            g.hydrate().await?;
            guest.push(fold_rate(&kv, &mut g, max, scope.clone(), s2.clone()).await?);
            anyhow::ensure!(
                foldhost::snapshot::bucket_len(&*s2.read()?)? == keys,
                "guest fold incomplete"
            );
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
    let mut g = load_guest(&engine, "router", &bytes, Arc::new(store.clone())).await?;
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
        let mut g = load_guest(&engine, "router", &bytes, Arc::new(full.clone())).await?;
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

fn unlimited() -> BucketConfig {
    BucketConfig {
        max_bytes: None,
        ..BucketConfig::default()
    }
}

/// Reads and BLAKE3-hashes every file under `dir` (the `b3sum` baseline); returns bytes hashed.
fn hash_tree(dir: &std::path::Path) -> anyhow::Result<u64> {
    let mut total = 0u64;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            total += hash_tree(&e.path())?;
        } else {
            let mut h = blake3::Hasher::new();
            let mut f = std::fs::File::open(e.path())?;
            total += std::io::copy(&mut f, &mut h)?;
            std::hint::black_box(h.finalize());
        }
    }
    Ok(total)
}

fn bench_artifact(keys: u64, runs: usize) -> anyhow::Result<()> {
    use foldhost::kv::{KvEntry, KvUpdate, VersionToken, WatchCursor};
    use foldhost::storedir::{AnyStore, Backend};
    let tmp = tempfile::tempdir()?;
    let src = tmp.path().join("src");
    {
        let (mut store, _) = AnyStore::open(&src, Backend::AppendLog)?;
        let value = bytes::Bytes::from(vec![b'v'; 256]);
        let mut rev = 0u64;
        while rev < keys {
            let batch: Vec<KvUpdate> = (rev + 1..=(rev + 1000).min(keys))
                .map(|r| {
                    KvUpdate::Put(KvEntry {
                        key: format!("key.{r:012}"),
                        value: value.clone(),
                        version: VersionToken::from_u64(r),
                    })
                })
                .collect();
            rev += batch.len() as u64;
            store.apply(&batch, WatchCursor::at(rev))?;
        }
    }
    let (mut exp, mut imp, mut hash) = (Vec::new(), Vec::new(), Vec::new());
    let mut bytes = 0u64;
    for i in 0..runs {
        let art = tmp.path().join(format!("art{i}"));
        // The export of an open store (a running host's is): the open itself is not timed.
        let (store, _) = AnyStore::open_read_only(&src)?;
        let t = Instant::now();
        foldhost::artifact::export_store(&store, Backend::AppendLog, &art, None, &mut |_, _| {})?;
        let e = t.elapsed().as_secs_f64();
        drop(store);
        let t = Instant::now();
        bytes = hash_tree(&art.join("data"))?;
        let hsec = t.elapsed().as_secs_f64();
        let dest = tmp.path().join(format!("node{i}"));
        let t = Instant::now();
        foldhost::artifact::import_artifact(&art, &dest, None, &mut |_, _| {})?;
        let isec = t.elapsed().as_secs_f64();
        let mb = bytes as f64 / 1e6;
        exp.push(mb / e);
        imp.push(mb / isec);
        hash.push(mb / hsec);
        std::fs::remove_dir_all(&art)?;
        std::fs::remove_dir_all(&dest)?;
    }
    let (e, i, h) = (median(exp), median(imp), median(hash));
    println!(
        "artifact: {keys} keys, {:.1} MB payload; export {e:.0} MB/s, import {i:.0} MB/s; read+BLAKE3 of the same bytes {h:.0} MB/s; ratios export {:.2}, import {:.2} (median of {runs})",
        bytes as f64 / 1e6,
        e / h,
        i / h
    );
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let what = args.get(1).map_or("all", String::as_str);
    let keys: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let runs: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5);
    if what == "backends" {
        let keys = args
            .get(2)
            .and_then(|s| s.parse().ok())
            .unwrap_or(1_000_000);
        return backends::run(keys);
    }
    if what == "bootstrap" {
        let keys = args
            .get(2)
            .and_then(|s| s.parse().ok())
            .unwrap_or(1_000_000);
        return bootstrap::run(keys).await;
    }
    if what == backends::CHILD {
        return backends::child(&args[2..]);
    }
    let server = LocalNats::start()?;
    let conn = NatsConnection::open(ConnectOptions::new(server.url())).await?;
    if matches!(what, "ingest" | "all") {
        bench_ingest(&conn, keys, runs).await?;
    }
    if matches!(what, "guest" | "all") {
        bench_guest(&conn, keys, runs).await?;
    }
    if matches!(what, "swap" | "all") {
        bench_swap(&conn, keys, runs).await?;
    }
    if matches!(what, "artifact" | "all") {
        bench_artifact(keys.max(1), runs.max(1))?;
    }
    if !matches!(what, "ingest" | "guest" | "swap" | "artifact" | "all") {
        anyhow::bail!(
            "usage: foldhost-bench [ingest|guest|swap|artifact|all|backends|bootstrap] [KEYS] [RUNS]"
        );
    }
    Ok(())
}

/// The `backends` benchmark: storage backends compared without NATS, one child process each.
mod backends {
    use std::ops::ControlFlow;
    use std::path::Path;
    use std::time::Instant;

    use anyhow::Context;
    use bytes::Bytes;
    use foldhost::kv::{KvEntry, KvUpdate, VersionToken, WatchCursor};
    use foldhost::snapshot::SnapshotStore;
    use foldhost::storedir::{AnyStore, Backend};

    /// The hidden subcommand a child runs: `__backend-child PHASE BACKEND KEYS DIR`.
    pub const CHILD: &str = "__backend-child";
    const CONFIGS: [(usize, usize); 4] = [(100, 128), (1000, 128), (100, 1024), (1000, 1024)];

    fn peak_rss_kib() -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmHWM:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|n| n.parse().ok())
            })
            .unwrap_or(0)
    }

    /// A multiplier coprime with `keys`: `i * m % keys` visits 0..keys once each, scattered.
    fn scatter(keys: u64) -> u64 {
        let mut m: u64 = 2_654_435_761 % keys.max(1);
        while gcd(m, keys) != 1 {
            m += 1;
        }
        m
    }

    /// Key `i` of a KEYS-key fold, in scattered (not sorted) order.
    fn key(i: u64, keys: u64, m: u64) -> String {
        format!(
            "bench/{:010}",
            (i % keys.max(1)).wrapping_mul(m) % keys.max(1)
        )
    }

    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 { a } else { gcd(b, a % b) }
    }

    /// Folds `keys` keys into a new store in `dir`; returns updates/s.
    fn ingest(
        backend: Backend,
        dir: &Path,
        keys: u64,
        batch: usize,
        value_len: usize,
    ) -> anyhow::Result<f64> {
        let (mut store, _) = AnyStore::open(dir, backend)?;
        let m = scatter(keys);
        let value = Bytes::from(vec![0x5a; value_len]);
        let mut buf = Vec::with_capacity(batch);
        let t = Instant::now();
        let mut i = 0;
        while i < keys {
            buf.clear();
            for j in i..(i + batch as u64).min(keys) {
                buf.push(KvUpdate::Put(KvEntry {
                    key: key(j, keys, m),
                    value: value.clone(),
                    version: VersionToken::from_u64(j + 1),
                }));
            }
            i += buf.len() as u64;
            store.apply(&buf, WatchCursor::at(i))?;
        }
        let secs = t.elapsed().as_secs_f64();
        anyhow::ensure!(
            store.len()? == keys,
            "{}: len {} != {keys}",
            backend.as_str(),
            store.len()?
        );
        Ok(keys as f64 / secs)
    }

    /// Child: runs one phase for one backend and prints one JSON line.
    pub fn child(args: &[String]) -> anyhow::Result<()> {
        let [phase, backend, keys, dir] = args else {
            anyhow::bail!("usage: {CHILD} ingest|open BACKEND KEYS DIR");
        };
        let backend: Backend = backend.parse().map_err(anyhow::Error::msg)?;
        let keys: u64 = keys.parse()?;
        let dir = Path::new(dir);
        let out = match phase.as_str() {
            "ingest" => {
                let mut rates = Vec::new();
                for (i, (batch, value_len)) in CONFIGS.iter().enumerate() {
                    let sub = dir.join(format!("c{i}"));
                    rates.push(ingest(backend, &sub, keys, *batch, *value_len)?);
                    // Keep the last (1 KiB values) fold for the open phase.
                    if i + 1 < CONFIGS.len() {
                        std::fs::remove_dir_all(&sub)?;
                    }
                }
                serde_json::json!({ "rates": rates, "rss_kib": peak_rss_kib() })
            }
            "open" => {
                let sub = dir.join(format!("c{}", CONFIGS.len() - 1));
                let t = Instant::now();
                let (store, _) = AnyStore::open(&sub, backend)?;
                let open_s = t.elapsed().as_secs_f64();
                anyhow::ensure!(store.len()? == keys, "reopened len");
                let t = Instant::now();
                let mut n = 0u64;
                store.for_each_in_range("", &mut |_| {
                    n += 1;
                    ControlFlow::Continue(())
                })?;
                let scan_s = t.elapsed().as_secs_f64();
                anyhow::ensure!(n == keys, "scanned {n} != {keys}");
                serde_json::json!({ "open_s": open_s, "scan_s": scan_s, "rss_kib": peak_rss_kib() })
            }
            other => anyhow::bail!("unknown phase {other}"),
        };
        println!("{out}");
        Ok(())
    }

    fn run_child(
        phase: &str,
        backend: Backend,
        keys: u64,
        dir: &Path,
    ) -> anyhow::Result<serde_json::Value> {
        let out = std::process::Command::new(std::env::current_exe()?)
            .args([CHILD, phase, backend.as_str(), &keys.to_string()])
            .arg(dir)
            .stderr(std::process::Stdio::inherit())
            .output()
            .with_context(|| format!("{} {phase} child", backend.as_str()))?;
        anyhow::ensure!(
            out.status.success(),
            "{} {phase} child failed: {}",
            backend.as_str(),
            out.status
        );
        let line = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(line.trim()).with_context(|| format!("child output {line:?}"))
    }

    struct Figures {
        backend: Backend,
        rates: Vec<f64>,
        ingest_rss_mib: f64,
        open_s: f64,
        scan_s: f64,
        open_rss_mib: f64,
    }

    /// Runs every compiled-in backend in child processes and prints the table.
    pub fn run(keys: u64) -> anyhow::Result<()> {
        let backends: Vec<Backend> = [Backend::AppendLog, Backend::Fjall, Backend::RocksDb]
            .into_iter()
            .filter(Backend::is_compiled)
            .collect();
        println!("backends — {keys} keys, each backend in its own process (ratios: ÷ append-log)");
        let mut all = Vec::new();
        for b in backends {
            let dir = tempfile::tempdir()?;
            let ing = run_child("ingest", b, keys, dir.path())?;
            let open = run_child("open", b, keys, dir.path())?;
            let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
            all.push(Figures {
                backend: b,
                rates: ing["rates"]
                    .as_array()
                    .map(|a| a.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect())
                    .unwrap_or_default(),
                ingest_rss_mib: f(&ing, "rss_kib") / 1024.0,
                open_s: f(&open, "open_s"),
                scan_s: f(&open, "scan_s"),
                open_rss_mib: f(&open, "rss_kib") / 1024.0,
            });
        }
        let Some(base) = all.first().map(|f| {
            (
                f.rates.clone(),
                f.ingest_rss_mib,
                f.open_s,
                f.scan_s,
                f.open_rss_mib,
            )
        }) else {
            return Ok(());
        };
        let ratio = |x: f64, b: f64| if b > 0.0 { x / b } else { f64::NAN };
        for fig in &all {
            println!("  {}", fig.backend.as_str());
            for (i, (batch, value_len)) in CONFIGS.iter().enumerate() {
                let r = fig.rates.get(i).copied().unwrap_or(f64::NAN);
                let b = base.0.get(i).copied().unwrap_or(f64::NAN);
                println!(
                    "    apply batch {batch:>4}, {value_len:>4} B values: {:>10.0} updates/s  ({:.2}×)",
                    r,
                    ratio(r, b)
                );
            }
            println!(
                "    peak RSS, ingest:            {:>8.1} MiB  ({:.2}×)",
                fig.ingest_rss_mib,
                ratio(fig.ingest_rss_mib, base.1)
            );
            println!(
                "    open the fold:               {:>8.3} s    ({:.2}×)",
                fig.open_s,
                ratio(fig.open_s, base.2)
            );
            println!(
                "    full scan after open:        {:>8.3} s    ({:.2}×)",
                fig.scan_s,
                ratio(fig.scan_s, base.3)
            );
            println!(
                "    peak RSS, open + scan:       {:>8.1} MiB  ({:.2}×)",
                fig.open_rss_mib,
                ratio(fig.open_rss_mib, base.4)
            );
        }
        Ok(())
    }
}
