//! `foldhost-bench queries [SECS] [RUNS]`: queries answered by a node against KV gets from the
//! server, on one machine.
//!
//! A local nats-server holds a bucket of 100 000 routes (`route.h<i>.example.com` → the router
//! guest's JSON); the release `foldhost run` folds it with the router guest, `--listen
//! 127.0.0.1:0` and `--query-subject`, and answers every query from its query instance
//! (docs/design.md, "Queries off the fold's path"). The load generator is this process: a closed
//! loop of N requesters, each sending its next request when its previous answer arrived, the hosts
//! drawn from the 100 000 by a seeded generator (splitmix64, one stream per requester), every answer
//! checked (HTTP 200 with a body; a NATS reply without `Foldhost-Error`; a KV get that found the
//! key). Each row runs one warm-up second, then SECS measured seconds (default 5); the figures of
//! a row are those of its median run by rate, of RUNS (default 3).
//!
//! - **HTTP**: `POST /query` over N keep-alive HTTP/1.1 connections (hyper's client), N = 16, 64.
//! - **NATS**: requests on the query subject, 16 concurrent requesters on one connection.
//! - **KV gets** (the baseline): async-nats's `jetstream::kv::Store::get` of the same keys
//!   (`route.<host>`), 16 and 64 concurrent, on one connection.
//! - **batched lookups** (when the node takes them: `Content-Type: application/x-foldhost-lookups`):
//!   16 lookups per request over 16 connections.
//!
//! Each idle, and each beside a writer task of this process putting route updates at 10 000/s
//! (paced every 5 ms, acknowledged; the rate it reached is printed). Under the writer `/status` is
//! sampled every 100 ms for the fold's lag; when the measured seconds end the writer stops and the
//! load goes on until the fold has applied the writer's last revision, or 10 s.
//!
//! CPU: utime + stime of this process (the load generator; the writer and the sampler too, under
//! the writer), the node and nats-server, from `/proc/PID/stat`, over the measured seconds, in
//! cores (CPU seconds per second). No figure is asserted. `FOLDHOST_BENCH_NODE_LOG=<filter>` runs
//! the node at that log level and prints its log at the end.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use foldhost_core::bucket::ConnectOptions;
use foldhost_localnats::LocalNats;
use foldhost_nats::NatsConnection;

use super::{guest_file, percentile, seed_routes, table, unlimited};

#[path = "queries/cpu.rs"]
mod cpu;
#[path = "queries/load.rs"]
mod load;

use cpu::{Cpu, nats_pids};
use load::{Driver, Http, Kind, Prng, Requester, check_results, encode_lookups, host_name};

/// Routes in the bucket.
const KEYS: u64 = 100_000;
const BUCKET: &str = "qbench";
const SUBJECT: &str = "bench.query.routes";
/// The writer's target rate, puts per second.
const WRITE_RATE: f64 = 10_000.0;
/// How often the writer publishes what is due.
const WRITE_TICK: Duration = Duration::from_millis(5);
/// Before the measured seconds of every row.
const WARMUP: Duration = Duration::from_secs(1);
/// How long the load goes on after the writer stopped, at most, for the fold to apply its last
/// revision.
const REACH_WITHIN: Duration = Duration::from_secs(10);
/// Lookups per batched request.
const BATCH: usize = 16;
const LOOKUPS_TYPE: &str = "application/x-foldhost-lookups";
/// The first state of every requester's generator (mixed with its index and the row's).
const PRNG_BASE: u64 = 0x0f01_d405_7bec_c0de;

/// What the writer and the status samples showed during one row.
#[derive(Clone, Copy, Default)]
struct WriterFigures {
    /// Puts acknowledged per second over the measured seconds.
    rate: f64,
    /// The writer's last acknowledged revision.
    last: u64,
    /// How long after the writer stopped the fold had applied `last` (None: not within
    /// [`REACH_WITHIN`]); the load still running.
    reached_ms: Option<f64>,
    /// The largest `lag` (delivered, not yet applied) of the `/status` samples.
    max_lag: u64,
    /// The largest gap between the writer's last acknowledged revision and the fold's
    /// `applied_through` at a sample.
    max_behind: u64,
    samples: usize,
}

/// One row's figures.
#[derive(Clone, Copy)]
struct Figures {
    /// Requests per second (a batch of lookups is one request).
    rate: f64,
    p50_us: f64,
    p99_us: f64,
    cpu: Cpu,
    writer: Option<WriterFigures>,
}

/// The node under test and what the rows need to reach it.
struct Setup {
    url: String,
    addr: String,
    node_pid: u32,
    nats_pids: Vec<u32>,
    js: async_nats::jetstream::Context,
    lookups: bool,
}

/// Runs the writer until `until`: puts due at [`WRITE_RATE`] every [`WRITE_TICK`], their acks
/// awaited before the next tick. Publishes the last acknowledged revision in `last`; returns the
/// rate reached from `from` to `until`.
async fn writer(
    js: async_nats::jetstream::Context,
    from: Instant,
    until: Instant,
    last: Arc<AtomicU64>,
    seed: u64,
) -> anyhow::Result<f64> {
    let mut rng = Prng(seed);
    let start = Instant::now();
    let (mut sent, mut in_window) = (0u64, 0u64);
    let mut tick = tokio::time::interval(WRITE_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while Instant::now() < until {
        tick.tick().await;
        let due = (start.elapsed().as_secs_f64() * WRITE_RATE) as u64;
        let mut acks = Vec::with_capacity((due - sent) as usize);
        while sent < due {
            let i = rng.host();
            let value = format!(
                "{{\"upstream\":\"10.{}.{}.{}:{}\"}}",
                i >> 16,
                (i >> 8) & 255,
                i & 255,
                1024 + sent % 60_000
            );
            acks.push(
                js.publish(format!("$KV.{BUCKET}.route.{}", host_name(i)), value.into())
                    .await?,
            );
            sent += 1;
        }
        let n = acks.len() as u64;
        for a in acks {
            let seq = a.await?.sequence;
            last.fetch_max(seq, Ordering::Relaxed);
        }
        let now = Instant::now();
        if now > from && now <= until {
            in_window += n;
        }
    }
    Ok(in_window as f64 / until.duration_since(from).as_secs_f64())
}

async fn status(addr: &str) -> anyhow::Result<foldhost_core::status::StatusReport> {
    let (code, body) = foldhost::serve::call(addr, "GET", "/status", b"").await?;
    anyhow::ensure!(code == 200, "/status answered {code}");
    Ok(serde_json::from_slice(&body)?)
}

/// Measures one row: `conns` requesters of `kind` for `secs` after [`WARMUP`], beside the writer
/// when `writing`.
async fn measure(
    s: &Setup,
    kind: Kind,
    conns: usize,
    writing: bool,
    secs: f64,
    row_seed: u64,
) -> anyhow::Result<Figures> {
    // Every requester connected before the clock starts.
    let requesters = connect(s, kind, conns).await?;
    let start = Instant::now();
    let from = start + WARMUP;
    let until = from + Duration::from_secs_f64(secs);
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = spawn_requesters(requesters, kind, row_seed, (from, until), &stop);
    // The writer and the status samples.
    let last = Arc::new(AtomicU64::new(0));
    let sampling = Arc::new(AtomicBool::new(true));
    let (writer_task, sampler) = if writing {
        let w = tokio::spawn(writer(
            s.js.clone(),
            from,
            until,
            last.clone(),
            PRNG_BASE ^ row_seed,
        ));
        let sampler = tokio::spawn(sample(s.addr.clone(), last.clone(), sampling.clone()));
        (Some(w), Some(sampler))
    } else {
        (None, None)
    };
    tokio::time::sleep_until(from.into()).await;
    let (c0, t0) = (Cpu::now(s.node_pid, &s.nats_pids), Instant::now());
    tokio::time::sleep_until(until.into()).await;
    let (c1, t1) = (Cpu::now(s.node_pid, &s.nats_pids), Instant::now());
    let cpu = c0.cores(c1, t1.duration_since(t0).as_secs_f64());
    let mut writer = None;
    if let Some(w) = writer_task {
        writer = Some(writer_figures(s, w.await??, &last, &sampling, sampler).await?);
    }
    stop.store(true, Ordering::Relaxed);
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await??);
    }
    anyhow::ensure!(!lat.is_empty(), "{kind:?}: nothing answered in the window");
    let count = lat.len();
    let mut lat: Vec<f64> = lat.into_iter().map(|ns| ns as f64 / 1e3).collect();
    lat.sort_by(f64::total_cmp);
    Ok(Figures {
        rate: count as f64 / secs,
        p50_us: percentile(&lat, 0.5),
        p99_us: percentile(&lat, 0.99),
        cpu,
        writer,
    })
}

/// `conns` requesters of `kind`, each connected (HTTP: a connection of its own and its driver;
/// NATS and KV gets: one shared connection).
async fn connect(
    s: &Setup,
    kind: Kind,
    conns: usize,
) -> anyhow::Result<Vec<(Requester, Option<Driver>)>> {
    let mut requesters = Vec::with_capacity(conns);
    let shared = match kind {
        Kind::Nats | Kind::KvGet => Some(async_nats::connect(&s.url).await?),
        _ => None,
    };
    let store = match (kind, &shared) {
        (Kind::KvGet, Some(c)) => Some(
            async_nats::jetstream::new(c.clone())
                .get_key_value(BUCKET)
                .await?,
        ),
        _ => None,
    };
    for _ in 0..conns {
        requesters.push(match (kind, &shared, &store) {
            (Kind::Http | Kind::Lookups, _, _) => {
                let (http, driver) = Http::connect(&s.addr).await?;
                (Requester::Http(http), Some(driver))
            }
            (Kind::Nats, Some(c), _) => (Requester::Nats(c.clone()), None),
            (Kind::KvGet, _, Some(st)) => (Requester::KvGet(Box::new(st.clone())), None),
            _ => anyhow::bail!("no client for {kind:?}"),
        });
    }
    Ok(requesters)
}

/// Starts every requester's closed loop until `stop`; each returns the latencies (ns) of the
/// requests it sent and had answered within `(from, until)`.
fn spawn_requesters(
    requesters: Vec<(Requester, Option<Driver>)>,
    kind: Kind,
    row_seed: u64,
    (from, until): (Instant, Instant),
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<Vec<u64>>>> {
    let per = if kind == Kind::Lookups { BATCH } else { 1 };
    let mut tasks = Vec::with_capacity(requesters.len());
    for (n, (mut r, driver)) in requesters.into_iter().enumerate() {
        let stop = stop.clone();
        let mut rng = Prng(PRNG_BASE ^ row_seed.wrapping_mul(1_000_003) ^ n as u64);
        let asking = async move {
            let mut lat: Vec<u64> = Vec::with_capacity(1 << 16);
            let mut hosts: Vec<String> = Vec::with_capacity(per);
            while !stop.load(Ordering::Relaxed) {
                hosts.clear();
                hosts.extend((0..per).map(|_| host_name(rng.host())));
                let t = Instant::now();
                r.ask(kind, &hosts).await?;
                let end = Instant::now();
                if t >= from && end <= until {
                    lat.push(end.duration_since(t).as_nanos() as u64);
                }
            }
            anyhow::Ok(lat)
        };
        tasks.push(tokio::spawn(async move {
            match driver {
                Some(d) => {
                    let (lat, ended) = tokio::join!(asking, d);
                    ended?;
                    lat
                }
                None => asking.await,
            }
        }));
    }
    tasks
}

/// Samples the node's `/status` at `addr` every 100 ms while `sampling`: the largest lag, the
/// largest gap behind the writer's `last` revision, and the samples taken.
async fn sample(
    addr: String,
    last: Arc<AtomicU64>,
    sampling: Arc<AtomicBool>,
) -> (u64, u64, usize) {
    let (mut max_lag, mut max_behind, mut samples) = (0u64, 0u64, 0usize);
    while sampling.load(Ordering::Relaxed) {
        let written = last.load(Ordering::Relaxed);
        if let Ok(st) = status(&addr).await {
            max_lag = max_lag.max(st.lag);
            max_behind = max_behind.max(written.saturating_sub(st.applied_through));
            samples += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (max_lag, max_behind, samples)
}

/// After the writer stopped at `rate`: how long the fold took to apply its `last` revision (the
/// load still running, at most [`REACH_WITHIN`]), then the sampler stopped and its figures.
async fn writer_figures(
    s: &Setup,
    rate: f64,
    last: &AtomicU64,
    sampling: &AtomicBool,
    sampler: Option<tokio::task::JoinHandle<(u64, u64, usize)>>,
) -> anyhow::Result<WriterFigures> {
    let stopped = Instant::now();
    let last = last.load(Ordering::Relaxed);
    let mut reached_ms = None;
    while stopped.elapsed() < REACH_WITHIN {
        if status(&s.addr).await?.applied_through >= last {
            reached_ms = Some(stopped.elapsed().as_secs_f64() * 1e3);
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    sampling.store(false, Ordering::Relaxed);
    let (max_lag, max_behind, samples) = match sampler {
        Some(t) => t.await?,
        None => (0, 0, 0),
    };
    Ok(WriterFigures {
        rate,
        last,
        reached_ms,
        max_lag,
        max_behind,
        samples,
    })
}

fn foldhost_release() -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var("FOLDHOST_BIN") {
        return Ok(PathBuf::from(p));
    }
    let bin = std::env::current_exe()?.with_file_name("foldhost");
    anyhow::ensure!(
        bin.exists(),
        "{} is missing: cargo build --release -p foldhost --features fjall,rocksdb",
        bin.display()
    );
    Ok(bin)
}

struct Node(Child);
impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `what` every 20 ms until it gives a value, at most `within`.
async fn poll<T>(
    what: &str,
    within: Duration,
    mut f: impl AsyncFnMut() -> Option<T>,
) -> anyhow::Result<T> {
    let t = Instant::now();
    while t.elapsed() < within {
        if let Some(v) = f().await {
            return Ok(v);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    anyhow::bail!("{what}: not within {within:?}")
}

/// One configuration of the table: what, how many requesters, beside the writer or not.
type Config = (Kind, usize, bool);

fn label(c: Config) -> String {
    let (kind, n, w) = c;
    let who = match kind {
        Kind::Http | Kind::Lookups => "connections",
        _ => "concurrent",
    };
    format!(
        "{}, {n} {who}, {}",
        kind.name(),
        if w { "beside the writer" } else { "idle" }
    )
}

/// Runs every row `runs` times (in turn, the order reversed every other run) and adds the rows
/// to the table.
pub async fn run(secs: f64, runs: usize) -> anyhow::Result<()> {
    let runs = runs.max(1);
    let server = LocalNats::start()?;
    let url = server.url();
    let conn = NatsConnection::open(ConnectOptions::new(url.clone())).await?;
    let kv = conn.bucket(BUCKET, &unlimited()).await?;
    let t = Instant::now();
    seed_routes(&kv, KEYS).await?;
    let last = kv.positions().await?.last_sequence;
    println!(
        "queries — {KEYS} routes seeded in {:.1} s (last revision {last}); every row {secs} s measured after {} s of warm-up, median run by rate of {runs}",
        t.elapsed().as_secs_f64(),
        WARMUP.as_secs()
    );
    let guest = guest_file("router");
    anyhow::ensure!(
        guest.exists(),
        "{}: missing (run guests/build.sh)",
        guest.display()
    );
    let dir = tempfile::tempdir()?;
    let store = dir.path().join("fold");
    let log = dir.path().join("node.log");
    let mut node = start_node(&url, &store, &log, &guest)?;
    let node_pid = node.0.id();
    let addr = ready(&mut node, &store, &log, last).await?;
    let lookups = takes_lookups(&addr).await?;
    let nats_pids = nats_pids(server.port());
    anyhow::ensure!(
        !nats_pids.is_empty(),
        "no nats-server process on port {}",
        server.port()
    );
    let setup = Setup {
        url: url.clone(),
        addr: addr.clone(),
        node_pid,
        nats_pids,
        js: kv.jetstream().clone(),
        lookups,
    };
    println!(
        "queries: node pid {node_pid} on {addr}, query subject {SUBJECT}; nats-server pids {:?}",
        setup.nats_pids
    );
    let configs = configs(setup.lookups);
    let med = median_runs(&setup, &configs, (secs, runs), &mut node, &log).await?;
    let find = |k: Kind, n: usize, w: bool| -> Option<Figures> {
        configs.iter().position(|c| *c == (k, n, w)).map(|i| med[i])
    };
    println!("queries, median runs:");
    for (c, f) in configs.iter().zip(&med) {
        print_row(usize::MAX, *c, f);
    }
    add_rows(&find, secs, runs);
    let _ = foldhost_tests::terminate(&mut node.0);
    if std::env::var_os("FOLDHOST_BENCH_NODE_LOG").is_some() {
        eprintln!("{}", std::fs::read_to_string(&log)?);
    }
    Ok(())
}

/// The release `foldhost run` on the bucket of the server at `url` with the router `guest`,
/// listening on a free port and on the query subject, its log into `log`.
fn start_node(url: &str, store: &Path, log: &Path, guest: &Path) -> anyhow::Result<Node> {
    let mut cmd = Command::new(foldhost_release()?);
    cmd.args(["run", "--bucket", BUCKET, "--nats", url, "--store"])
        .arg(store)
        .arg("--guest")
        .arg(guest)
        .args(["--listen", "127.0.0.1:0", "--query-subject", SUBJECT])
        .env(
            "FOLDHOST_LOG",
            std::env::var("FOLDHOST_BENCH_NODE_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log)?);
    Ok(Node(cmd.spawn()?))
}

/// `e`, with whether the node exited and its log.
fn failed(node: &mut Node, log: &Path, e: anyhow::Error) -> anyhow::Error {
    let exited = node.0.try_wait().ok().flatten();
    let text = std::fs::read_to_string(log).unwrap_or_default();
    anyhow::anyhow!("{e}; node exited: {exited:?}; its log:\n{text}")
}

/// Waits for the node to name its listen address, catch up to `last` and answer a query (the
/// query instance hydrates from the fold beside it); its address.
async fn ready(node: &mut Node, store: &Path, log: &Path, last: u64) -> anyhow::Result<String> {
    let node_pid = node.0.id();
    let addr = poll(
        "status.json names the listen address",
        Duration::from_secs(60),
        async || {
            foldhost_core::storedir::read_status(store)
                .filter(|s| s.pid == node_pid)
                .and_then(|s| s.listen)
        },
    )
    .await
    .map_err(|e| failed(node, log, e))?;
    // Caught up, then answering: the query instance hydrates from the fold beside it.
    foldhost_tests::wait_status(&addr, |s| s.caught_up && s.applied_through == last)
        .await
        .map_err(|e| failed(node, log, e))?;
    let probe = host_name(KEYS - 1);
    poll(
        "a query answered 200",
        Duration::from_secs(60),
        async || match foldhost::serve::call(&addr, "POST", "/query", probe.as_bytes()).await {
            Ok((200, body)) if !body.is_empty() => Some(()),
            _ => None,
        },
    )
    .await
    .map_err(|e| failed(node, log, e))?;
    let s = status(&addr).await?;
    anyhow::ensure!(s.applied_through == last, "the fold moved: {s:?}");
    Ok(addr)
}

/// Whether the node at `addr` takes batched lookups (answered in kind and checked).
async fn takes_lookups(addr: &str) -> anyhow::Result<bool> {
    let (mut h, driver) = Http::connect(addr).await?;
    tokio::spawn(driver);
    let hosts: Vec<String> = (0..BATCH as u64).map(host_name).collect();
    Ok(
        match h.post(encode_lookups(&hosts), Some(LOOKUPS_TYPE)).await? {
            (200, Some(t), body) if t == LOOKUPS_TYPE => {
                check_results(&body, BATCH)?;
                true
            }
            (code, t, _) => {
                println!(
                    "queries: batched lookups not taken by this node ({code}, {t:?}): no lookups row"
                );
                false
            }
        },
    )
}

/// Every row of the table, idle then beside the writer (batched lookups idle, when the node
/// takes them).
fn configs(lookups: bool) -> Vec<Config> {
    let mut configs: Vec<Config> = Vec::new();
    for writing in [false, true] {
        for (kind, n) in [
            (Kind::KvGet, 16),
            (Kind::Http, 16),
            (Kind::Nats, 16),
            (Kind::KvGet, 64),
            (Kind::Http, 64),
        ] {
            configs.push((kind, n, writing));
        }
        if lookups && !writing {
            configs.push((Kind::Lookups, 16, false));
        }
    }
    configs
}

/// Measures every configuration `runs` times, `secs` each (in turn, the order reversed every
/// other run), printing each run; each configuration's median run by rate.
async fn median_runs(
    setup: &Setup,
    configs: &[Config],
    (secs, runs): (f64, usize),
    node: &mut Node,
    log: &Path,
) -> anyhow::Result<Vec<Figures>> {
    let mut results: Vec<Vec<Figures>> = vec![Vec::new(); configs.len()];
    for run in 0..runs {
        let order: Vec<usize> = if run % 2 == 0 {
            (0..configs.len()).collect()
        } else {
            (0..configs.len()).rev().collect()
        };
        for i in order {
            let c = configs[i];
            let f = measure(setup, c.0, c.1, c.2, secs, (run * 100 + i) as u64)
                .await
                .map_err(|e| failed(node, log, e))?;
            print_row(run, c, &f);
            results[i].push(f);
        }
    }
    Ok(results
        .into_iter()
        .map(|mut v| {
            v.sort_by(|a, b| a.rate.total_cmp(&b.rate));
            v[v.len() / 2]
        })
        .collect())
}

fn print_row(run: usize, c: Config, f: &Figures) {
    let what = if run == usize::MAX {
        "  median".to_string()
    } else {
        format!("  run {run}")
    };
    let mut line = format!(
        "{what}: {:<55} {:>9.0}/s  p50 {:>6.0} µs  p99 {:>6.0} µs  CPU bench {:.2} node {:.2} nats-server {:.2} cores",
        label(c),
        f.rate,
        f.p50_us,
        f.p99_us,
        f.cpu.bench,
        f.cpu.node,
        f.cpu.nats
    );
    if let Some(w) = f.writer {
        line.push_str(&format!(
            "; writer {:.0}/s through revision {}, fold {} (max lag {}, max {} behind the writer, {} samples)",
            w.rate,
            w.last,
            reached(&w),
            w.max_lag,
            w.max_behind,
            w.samples
        ));
    }
    println!("{line}");
}

fn reached(w: &WriterFigures) -> String {
    match w.reached_ms {
        Some(ms) => format!("reached it {ms:.0} ms after the writer stopped"),
        None => format!("did not reach it within {} s", REACH_WITHIN.as_secs()),
    }
}

/// What a row's figures name beside its rate: its latency and the load generator's cores.
fn latency(f: &Figures) -> String {
    format!(
        "p50 {:.0} µs, p99 {:.0} µs; load generator {:.2} cores",
        f.p50_us, f.p99_us, f.cpu.bench
    )
}

/// A configuration's median run, when it ran.
type Find<'a> = &'a dyn Fn(Kind, usize, bool) -> Option<Figures>;

/// The table's rows, from each configuration's median run.
fn add_rows(find: Find, secs: f64, runs: usize) {
    let how = format!("{secs} s, median of {runs}");
    idle_rows(find, &how);
    writer_rows(find);
    if let (Some(l), Some(q), Some(kv)) = (
        find(Kind::Lookups, 16, false),
        find(Kind::Http, 16, false),
        find(Kind::KvGet, 16, false),
    ) {
        table::row(
            format!(
                "lookups/s, HTTP /query, {BATCH} lookups per request, 16 connections, idle ({}/s requests, {}; one lookup per request {}/s; {how})",
                table::rate(l.rate),
                latency(&l),
                table::rate(q.rate)
            ),
            format!("{}/s", table::rate(l.rate * BATCH as f64)),
            format!("KV gets, 16 concurrent {}/s", table::rate(kv.rate)),
            l.rate * BATCH as f64 / kv.rate,
            "",
        );
    }
}

/// The idle rows: queries/s against KV gets at the same concurrency, and the p99 latency.
fn idle_rows(find: Find, how: &str) {
    for (kind, n, target) in [
        (Kind::Http, 16, "≥ 3"),
        (Kind::Http, 64, ""),
        (Kind::Nats, 16, "≥ 1"),
    ] {
        let (Some(q), Some(kv)) = (find(kind, n, false), find(Kind::KvGet, n, false)) else {
            continue;
        };
        table::row(
            format!(
                "queries/s, {}, {KEYS} routes, router guest ({}; {how})",
                label((kind, n, false)),
                latency(&q)
            ),
            format!("{}/s", table::rate(q.rate)),
            format!(
                "KV gets (async-nats Store::get), {n} concurrent, same keys {}/s ({})",
                table::rate(kv.rate),
                latency(&kv)
            ),
            q.rate / kv.rate,
            target,
        );
    }
    if let (Some(q), Some(kv)) = (find(Kind::Http, 16, false), find(Kind::KvGet, 16, false)) {
        table::row(
            "query p99 latency, HTTP /query, 16 connections, idle",
            format!("{:.0} µs", q.p99_us),
            format!("KV get p99, 16 concurrent {:.0} µs", kv.p99_us),
            q.p99_us / kv.p99_us,
            "≤ 1 ms",
        );
    }
}

/// The rows beside the writer: each configuration's rate against its idle rate, with what the
/// same writer costs KV gets at the same concurrency as the control.
fn writer_rows(find: Find) {
    for (kind, n) in [
        (Kind::Http, 16),
        (Kind::Http, 64),
        (Kind::Nats, 16),
        (Kind::KvGet, 16),
        (Kind::KvGet, 64),
    ] {
        let (Some(w), Some(idle)) = (find(kind, n, true), find(kind, n, false)) else {
            continue;
        };
        let Some(wf) = w.writer else { continue };
        // The control: what the same writer costs KV gets at the same concurrency.
        let control = match (
            kind,
            find(Kind::KvGet, n, true),
            find(Kind::KvGet, n, false),
        ) {
            (Kind::KvGet, ..) | (_, None, _) | (_, _, None) => String::new(),
            (_, Some(kw), Some(ki)) => format!(
                "; KV gets, {n} concurrent, beside the writer {}/s, ÷ idle {:.3}",
                table::rate(kw.rate),
                kw.rate / ki.rate
            ),
        };
        table::row(
            format!(
                "queries/s, {} at {}/s (fold {}; max lag {}, max {} behind the writer's last ack, in {} /status samples; {})",
                label((kind, n, true)),
                table::rate(wf.rate),
                reached(&wf),
                wf.max_lag,
                wf.max_behind,
                wf.samples,
                latency(&w)
            ),
            format!("{}/s", table::rate(w.rate)),
            format!("the same, idle {}/s{control}", table::rate(idle.rate)),
            w.rate / idle.rate,
            if kind == Kind::KvGet { "" } else { "≥ 0.8" },
        );
    }
}
