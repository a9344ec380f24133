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
//! 4. **artifact** — on a KEYS-key fold per backend (256 B values of hex digits, compressing about
//!    2:1 as configuration does): export (copy, verify-by-reopen,
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
//! 7. **queries** — on a bucket of 100 000 routes, through the release `foldhost` binary with the
//!    router guest: queries/s and p50/p99 latency over HTTP (`POST /query`, 16 and 64 keep-alive
//!    connections) and NATS request/reply (16 requesters), against KV gets from the server at the
//!    same concurrency, idle and beside a writer at 10 000 puts/s. See `bench/queries.rs`.
//!
//! Runs alternate between the compared sides; every figure is the median of RUNS runs.
//!
//! `cargo run --release -p foldhost-tests --bin foldhost-bench -- [ingest|guest|swap|artifact|all] [KEYS] [RUNS]`
//! `cargo run --release -p foldhost-tests --features fjall,rocksdb --bin foldhost-bench -- backends [KEYS]`
//! `make bench-bootstrap` (`foldhost-bench bootstrap [KEYS]`, needs `target/release/foldhost`)
//! `cargo run --release -p foldhost-tests --bin foldhost-bench -- queries [SECS] [RUNS]` (needs
//! `target/release/foldhost` and the router guest)

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer;
use foldhost_core::bucket::{BucketConfig, ConnectOptions};
use foldhost_core::kv::WatchScope;
use foldhost_core::snapshot::{AppendLogOptions, AppendLogSnapshot, SnapshotStore};
use foldhost_core::status::FoldStatus;
use foldhost_core::view::{FoldRead, SharedStore};
use foldhost_fold::applied::{Apply, BatchConfig, CountingApply, WatchOptions, watch_applied};
use foldhost_guest::guest::{GuestApply, GuestEngine, GuestLimits};
use foldhost_localnats::LocalNats;
use foldhost_nats::{NatsConnection, NatsKv};
use futures::StreamExt;

#[path = "bench/artifact.rs"]
mod artifact;
#[path = "bench/backends.rs"]
mod backends;
#[path = "bench/bootstrap.rs"]
mod bootstrap;
#[path = "bench/guest.rs"]
mod guest;
#[path = "bench/languages.rs"]
mod languages;
#[path = "bench/matrix.rs"]
mod matrix;
/// Queries through a node against KV gets.
#[path = "bench/queries.rs"]
mod queries;
/// The operation ledger's sweep in steps against one commit.
#[path = "bench/swap.rs"]
mod swap;
#[path = "bench/sweep.rs"]
mod sweep;
#[path = "bench/table.rs"]
mod table;
/// Writes through a host against bare puts.
#[path = "bench/writes.rs"]
mod writes;

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
async fn fold_rate<S: SnapshotStore>(
    kv: &Arc<NatsKv>,
    apply: &mut dyn Apply,
    max: usize,
    scope: WatchScope,
    store: SharedStore<S>,
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
            defer_grace: foldhost_fold::applied::DEFAULT_DEFER_GRACE,
            repair: Default::default(),
            queries: None,
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
    let mut raw = Vec::new();
    let mut fold = Vec::new();
    for run in 0..runs {
        let raw_rate = raw_drain(conn, &kv, keys).await?;
        let (_dir, store) = empty_store()?;
        let mut apply = CountingApply::default();
        let fold_r = fold_rate(&kv, &mut apply, 100, WatchScope::All, store.clone()).await?;
        anyhow::ensure!(
            foldhost_core::snapshot::bucket_len(&*store.read()?)? == keys,
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
    table::row(
        format!("ingest {keys} keys (32 B, 100 B values), native apply, append log"),
        format!("{}/s", table::rate(f)),
        format!("raw async-nats drain {}/s", table::rate(r)),
        f / r,
        "",
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
    Ok(GuestApply::load(engine, what, bytes, bench_limits(), vec![], fold).await?)
}

/// The rate at which a fresh instance of `bytes` takes the entries of `fold` under `prefix` fed
/// straight in (no NATS, no store): `parse` + `apply` in batches of 1 000, from entries read into
/// memory first. The baseline of hydration. Median of `runs`.
async fn direct_rate<S: SnapshotStore>(
    engine: &Arc<GuestEngine>,
    name: &str,
    bytes: &[u8],
    fold: &SharedStore<S>,
    prefix: &str,
    runs: usize,
) -> anyhow::Result<f64> {
    use foldhost_core::kv::KvUpdate;
    let mut entries = Vec::new();
    fold.visit(prefix, &mut |e| {
        entries.push(KvUpdate::Put(e.clone()));
        ControlFlow::Continue(())
    })?;
    let mut rates = Vec::new();
    for _ in 0..runs.max(1) {
        let mut g = GuestApply::load(
            engine,
            name,
            bytes,
            bench_limits(),
            vec![],
            Arc::new(foldhost_core::view::EmptyFold),
        )
        .await?;
        g.hydrate().await?;
        let t = Instant::now();
        for batch in entries.chunks(1000) {
            let verdicts = g.parse(batch).await?;
            g.apply(batch, &verdicts).await?;
        }
        rates.push(entries.len() as f64 / t.elapsed().as_secs_f64());
    }
    Ok(median(rates))
}

/// The default guest limits with room for a million-key guest (two of them during a swap).
fn bench_limits() -> GuestLimits {
    GuestLimits {
        memory_bytes: 2 << 30,
        ..GuestLimits::default()
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The raw async-nats drain of `kv`'s stream: an ordered push consumer with the fold's filter and
/// deliver policy, counting messages until the server says none are pending. Returns updates/s.
async fn raw_drain(conn: &NatsConnection, kv: &NatsKv, keys: u64) -> anyhow::Result<f64> {
    let bucket = kv.bucket();
    let js = kv.jetstream().clone();
    let inbox = conn.client().await?;
    let stream = js.get_stream(format!("KV_{bucket}")).await?;
    let t = Instant::now();
    let c = stream
        .create_consumer(consumer::push::OrderedConfig {
            deliver_subject: inbox.new_inbox(),
            filter_subjects: vec![format!("$KV.{bucket}.>")],
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
            .and_then(|r| foldhost_core::protocol::parse_ack_subject(r.as_str()))
            .map(|a| a.pending);
        if pending == Some(0) {
            break;
        }
    }
    let rate = n as f64 / t.elapsed().as_secs_f64();
    anyhow::ensure!(n == keys, "raw drain incomplete: {n} of {keys}");
    Ok(rate)
}

/// Seeds `keys` routes (`route.h<i>.example.com` → a JSON upstream), as the router guest reads them.
async fn seed_routes(kv: &NatsKv, keys: u64) -> anyhow::Result<()> {
    seed(
        kv,
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
    .await
}

fn unlimited() -> BucketConfig {
    BucketConfig {
        max_bytes: None,
        ..BucketConfig::default()
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let what = args.get(1).map_or("all", String::as_str);
    if let Some(done) = without_nats(what, &args).await {
        return done;
    }
    let keys: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let runs: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5);
    with_nats(what, keys, runs).await
}

/// The benchmarks that start their own servers or none (`backends`, `bootstrap`, the backend
/// child, `feed`, `writes`, `sweep`, `queries`, `table`): `None` when `what` is none of them.
async fn without_nats(what: &str, args: &[String]) -> Option<anyhow::Result<()>> {
    let arg = |i: usize| args.get(i).and_then(|s| s.parse::<u64>().ok());
    Some(match what {
        "backends" => backends::run(arg(2).unwrap_or(1_000_000)),
        "bootstrap" => bootstrap::run(arg(2).unwrap_or(1_000_000)).await,
        backends::CHILD => backends::child(&args[2..]),
        // The guest boundary alone (for profiles): KEYS route updates fed to a fresh guest in
        // batches of RUNS, no NATS, no store. FOLDHOST_BENCH_GUEST picks the guest.
        "feed" => {
            let keys: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(100_000);
            let runs: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5);
            guest::feed(keys, runs.max(1)).await
        }
        "writes" => writes::run()
            .await
            .map(|()| table::print("foldhost-bench writes")),
        "sweep" => {
            let rows = arg(2).unwrap_or(1_000_000);
            sweep::run(rows)
                .await
                .map(|()| table::print(&format!("foldhost-bench sweep {rows}")))
        }
        "queries" => {
            // `queries [SECS] [RUNS]`: each row SECS measured seconds, the median of RUNS runs.
            let secs: f64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5.0);
            let runs: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(3);
            queries::run(secs, runs)
                .await
                .map(|()| table::print(&format!("foldhost-bench queries {secs} {runs}")))
        }
        "table" => table_all(args.get(2).and_then(|s| s.parse().ok()).unwrap_or(3)).await,
        _ => return None,
    })
}

/// The benchmarks against one local nats-server: `matrix`, `languages`, and `ingest`, `guest`,
/// `swap`, `artifact` (each, or `all` of them in that order).
async fn with_nats(what: &str, keys: u64, runs: usize) -> anyhow::Result<()> {
    let server = LocalNats::start()?;
    let conn = NatsConnection::open(ConnectOptions::new(server.url())).await?;
    if what == "matrix" {
        matrix::run(&conn, &server.url(), keys, runs).await?;
        table::print(&format!("foldhost-bench matrix {keys} {runs}"));
        return Ok(());
    }
    if what == "languages" {
        languages::run(&conn, keys, runs).await?;
        table::print(&format!("foldhost-bench languages {keys} {runs}"));
        return Ok(());
    }
    if matches!(what, "ingest" | "all") {
        bench_ingest(&conn, keys, runs).await?;
    }
    if matches!(what, "guest" | "all") {
        guest::bench_guest(&conn, keys, runs).await?;
    }
    if matches!(what, "swap" | "all") {
        swap::bench_swap(&conn, keys, runs).await?;
    }
    if matches!(what, "artifact" | "all") {
        artifact::bench_artifact(keys.max(1), runs.max(1))?;
    }
    if !matches!(what, "ingest" | "guest" | "swap" | "artifact" | "all") {
        anyhow::bail!(
            "usage: foldhost-bench [table [RUNS]|ingest|matrix|languages|guest|swap|artifact|all|backends|bootstrap|writes|queries [SECS] [RUNS]] [KEYS] [RUNS]"
        );
    }
    Ok(())
}

/// `make bench`: every benchmark at the sizes its targets name, then the one table. Ingest, guest
/// and the matrix at 100 000 keys; swap at 100 000 and 1 000 000; artifacts, backends, bootstrap
/// and resume at 1 000 000; queries on 100 000 routes, 5 s a row.
async fn table_all(runs: usize) -> anyhow::Result<()> {
    let server = LocalNats::start()?;
    let conn = NatsConnection::open(ConnectOptions::new(server.url())).await?;
    bench_ingest(&conn, 100_000, runs).await?;
    matrix::run(&conn, &server.url(), 100_000, runs).await?;
    languages::run(&conn, 100_000, runs).await?;
    guest::bench_guest(&conn, 100_000, runs).await?;
    swap::bench_swap(&conn, 100_000, runs).await?;
    swap::bench_swap(&conn, 1_000_000, runs.min(2)).await?;
    drop(conn);
    drop(server);
    artifact::bench_artifact(1_000_000, runs)?;
    backends::run(1_000_000)?;
    bootstrap::run(1_000_000).await?;
    writes::run().await?;
    sweep::run(1_000_000).await?;
    queries::run(5.0, runs).await?;
    table::print(&format!("make bench (foldhost-bench table {runs})"));
    Ok(())
}
