//! The command line: a contract (scripts and tests outside the project use it).
//!
//! Exit codes: 0 success, 2 usage (clap), 1 anything else with one line on stderr. Only this module
//! and `main.rs` use `anyhow`; the library layers return their own error enums.

use std::io::{IsTerminal, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};
use base64::Engine as _;
use clap::{Args, Parser, Subcommand};

use crate::applied::{Apply, BatchConfig, CountingApply, FoldStatus, WatchOptions, watch_applied};
use crate::kv::{WatchCursor, WatchScope};
use crate::nats::NatsConnection;
use crate::snapshot::SnapshotStore;
use crate::storedir::{self, AnyStore, Backend, HostStatus};
use crate::stores::{ConnectOptions, StoreConfig};

/// foldhost: a local, durable fold of NATS JetStream KV buckets.
#[derive(Parser, Debug)]
#[command(name = "foldhost", version, about)]
pub struct Cli {
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Fold a bucket into a local store and keep it current.
    Run(RunArgs),
    /// Show a store's cursor, seq, applied_through, applier and lag.
    Status(StatusArgs),
    /// Print the fold's entries in key order, one per line.
    Dump(DumpArgs),
    /// Everything local, end to end: a nats-server, a bucket, a fold, a restart that resumes.
    Demo(DemoArgs),
}

/// `foldhost run`.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// NATS server URL.
    #[arg(long, env = "FOLDHOST_NATS")]
    pub nats: String,
    /// Bucket to fold (must exist).
    #[arg(long)]
    pub bucket: String,
    /// What to watch: all, prefix:P, or prefixes:P1,P2.
    #[arg(long, default_value = "all")]
    pub scope: String,
    /// Store directory.
    #[arg(long)]
    pub store: PathBuf,
    /// Storage backend.
    #[arg(long, default_value = "append-log")]
    pub backend: String,
    /// Built-in applier until guests arrive: `count`.
    #[arg(long, default_value = "count")]
    pub apply: String,
    /// Fold to the stream's last sequence as of start, then exit 0.
    #[arg(long)]
    pub catch_up: bool,
    /// Batch window in milliseconds.
    #[arg(long, default_value_t = 10)]
    pub batch_window_ms: u64,
    /// Maximum updates per batch.
    #[arg(long, default_value_t = 100)]
    pub batch_max: usize,
    /// Watch → fold channel depth.
    #[arg(long, default_value_t = 256)]
    pub channel: usize,
    /// A `.creds` file for the NATS connection.
    #[arg(long)]
    pub creds_file: Option<PathBuf>,
}

/// `foldhost status`.
#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Store directory (read-only).
    #[arg(long)]
    pub store: PathBuf,
    /// One JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `foldhost dump`.
#[derive(Args, Debug)]
pub struct DumpArgs {
    /// Store directory (read-only).
    #[arg(long)]
    pub store: PathBuf,
    /// Only keys with this prefix.
    #[arg(long, default_value = "")]
    pub prefix: String,
    /// One JSON object per line: {"key", "value_b64", "revision"}.
    #[arg(long)]
    pub json: bool,
}

/// `foldhost demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Routes to seed.
    #[arg(long, default_value_t = 2000)]
    pub routes: u32,
}

/// Runs a parsed command line.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run(a) => cmd_run(a).await,
        Command::Status(a) => cmd_status(a),
        Command::Dump(a) => cmd_dump(a),
        Command::Demo(a) => cmd_demo(a).await,
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The outcome of one `run`: the store's cursor and what was delivered.
#[derive(Debug, Clone, Copy)]
pub struct RunSummary {
    /// The committed cursor at exit.
    pub cursor: WatchCursor,
    /// Updates the watch delivered in this run.
    pub delivered: u64,
}

async fn cmd_run(a: RunArgs) -> anyhow::Result<()> {
    let (shutdown_tx, shutdown_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        wait_for_signal().await;
        let _ = shutdown_tx.send(());
    });
    let summary = run_fold(&a, async {
        let _ = shutdown_rx.await;
    })
    .await?;
    eprintln!(
        "foldhost: stopped at cursor {} ({} updates delivered this run)",
        summary.cursor, summary.delivered
    );
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// The body of `foldhost run`, reusable by the demo: opens the store, connects, folds until
/// `shutdown` (or caught up), keeps `status.json` current.
pub async fn run_fold(
    a: &RunArgs,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<RunSummary> {
    let scope = WatchScope::parse(&a.scope).map_err(|e| anyhow!("--scope: {e}"))?;
    let backend: Backend = a.backend.parse().map_err(|e| anyhow!("--backend: {e}"))?;
    let mut apply: Box<dyn Apply> = match a.apply.as_str() {
        "count" => Box::new(CountingApply::default()),
        other => bail!("--apply {other:?}: the built-in appliers are: count"),
    };
    // Connect before touching the store: a run that cannot reach its server writes nothing.
    let mut copts = ConnectOptions::new(a.nats.clone());
    copts.creds_file = a.creds_file.clone();
    let conn = NatsConnection::open(copts).await?;
    let kv = conn
        .bucket(
            &a.bucket,
            &StoreConfig {
                create: false,
                ..StoreConfig::default()
            },
        )
        .await?;
    let store_dir = a.store.clone();
    let (store, recovery) =
        tokio::task::spawn_blocking(move || AnyStore::open(&store_dir, backend))
            .await
            .context("store open task")?
            .with_context(|| format!("open store {}", a.store.display()))?;
    if let Some(reason) = &recovery.reason {
        tracing::warn!(
            store = %a.store.display(),
            discarded_bytes = recovery.discarded_tail_bytes,
            discarded_records = recovery.discarded_records,
            "store recovered: {reason}"
        );
    }
    if store.cursor().revision().is_none() && !store.is_empty()? {
        bail!(
            "{}: the fold holds {} keys but no cursor; it cannot be resumed safely (import an artifact or start from an empty store)",
            a.store.display(),
            store.len()?
        );
    }
    tracing::info!(bucket = %a.bucket, scope = %scope, store = %a.store.display(), backend = backend.as_str(), cursor = %store.cursor(), "folding");

    let status = Arc::new(FoldStatus::default());
    let base = HostStatus {
        state: "running".into(),
        pid: std::process::id(),
        guest: Some(apply.describe()),
        bucket: a.bucket.clone(),
        scope: scope.to_string(),
        ..HostStatus::default()
    };
    let reporter = tokio::spawn(report_progress(
        a.store.clone(),
        base.clone(),
        status.clone(),
    ));
    let opts = WatchOptions {
        scope,
        batch: BatchConfig {
            window: Duration::from_millis(a.batch_window_ms),
            max: a.batch_max.max(1),
            channel_capacity: a.channel.max(1),
        },
        catch_up: a.catch_up,
    };
    let result = watch_applied(kv, store, apply.as_mut(), opts, status.clone(), shutdown).await;
    reporter.abort();
    let mut last = snapshot_status(&base, &status);
    let outcome = match result {
        Ok(finished) => {
            last.state = "stopped".into();
            last.applied_through = finished.cursor.revision_or_zero();
            Ok(RunSummary {
                cursor: finished.cursor,
                delivered: status.delivered.load(Ordering::Relaxed),
            })
        }
        Err(e) => {
            last.state = "failed".into();
            last.error = Some(e.to_string());
            Err(anyhow!(e))
        }
    };
    if let Err(e) = storedir::write_status(&a.store, &last) {
        tracing::warn!(error = %e, "status file not written");
    }
    conn_shutdown(conn).await;
    outcome
}

async fn conn_shutdown(conn: NatsConnection) {
    use crate::stores::Connection;
    conn.shutdown().await;
}

fn snapshot_status(base: &HostStatus, s: &FoldStatus) -> HostStatus {
    HostStatus {
        seq: s.seq.load(Ordering::Relaxed),
        applied_through: s.applied_through.load(Ordering::Relaxed),
        delivered: s.delivered.load(Ordering::Relaxed),
        batches: s.batches.load(Ordering::Relaxed),
        last_apply_us: s.last_apply_us.load(Ordering::Relaxed),
        last_commit_us: s.last_commit_us.load(Ordering::Relaxed),
        updated_unix_ms: now_ms(),
        ..base.clone()
    }
}

/// Keeps `status.json` current and shows hydration progress: a bar on a terminal, log lines
/// otherwise.
async fn report_progress(dir: PathBuf, base: HostStatus, status: Arc<FoldStatus>) {
    let bar = if std::io::stderr().is_terminal() {
        let b = indicatif::ProgressBar::new(0);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} hydrating [{bar:40}] {pos}/{len} updates ({per_sec}, eta {eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Some(b)
    } else {
        None
    };
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut n = 0u64;
    let mut hydrated_logged = false;
    loop {
        tick.tick().await;
        n += 1;
        let committed = status.committed.load(Ordering::Relaxed);
        let pending = status.pending.load(Ordering::Relaxed);
        let delivered = status.delivered.load(Ordering::Relaxed);
        let level = status.caught_up.load(Ordering::Relaxed) == 1;
        if !level {
            let total = delivered + pending;
            if let Some(b) = &bar {
                b.set_length(total);
                b.set_position(committed);
            } else if n.is_multiple_of(8) {
                tracing::info!(committed, total, "hydrating");
            }
        } else if !hydrated_logged {
            hydrated_logged = true;
            if let Some(b) = &bar {
                b.finish_and_clear();
            }
            tracing::info!(
                committed,
                applied_through = status.applied_through.load(Ordering::Relaxed),
                "level with the stream; following live updates"
            );
        }
        if n.is_multiple_of(4)
            && let Err(e) = storedir::write_status(&dir, &snapshot_status(&base, &status))
        {
            tracing::warn!(error = %e, "status file not written");
        }
    }
}

/// The JSON shape of `status --json`.
#[derive(serde::Serialize)]
struct StatusJson {
    cursor: Option<u64>,
    seq: u64,
    applied_through: u64,
    lag: u64,
    guest: Option<String>,
    backend: &'static str,
    keys: u64,
    state: String,
    error: Option<String>,
    store: String,
}

fn cmd_status(a: StatusArgs) -> anyhow::Result<()> {
    let (store, _recovery) = AnyStore::open_read_only(&a.store)?;
    let cursor = store.cursor();
    let host = storedir::read_status(&a.store);
    let applied = cursor.revision_or_zero();
    let seq = host.as_ref().map_or(applied, |h| h.seq.max(applied));
    let s = StatusJson {
        cursor: cursor.revision(),
        seq,
        applied_through: applied,
        lag: seq.saturating_sub(applied),
        guest: host.as_ref().and_then(|h| h.guest.clone()),
        backend: store.backend(),
        keys: store.len()?,
        state: host
            .as_ref()
            .map_or_else(|| "unknown".to_string(), |h| h.state.clone()),
        error: host.as_ref().and_then(|h| h.error.clone()),
        store: a.store.display().to_string(),
    };
    let mut out = std::io::stdout().lock();
    if a.json {
        serde_json::to_writer(&mut out, &s)?;
        writeln!(out)?;
    } else {
        writeln!(out, "store:           {}", s.store)?;
        writeln!(out, "backend:         {}", s.backend)?;
        writeln!(out, "cursor:          {cursor}")?;
        writeln!(out, "seq:             {}", s.seq)?;
        writeln!(out, "applied_through: {}", s.applied_through)?;
        writeln!(out, "lag:             {}", s.lag)?;
        writeln!(out, "keys:            {}", s.keys)?;
        writeln!(
            out,
            "guest:           {}",
            s.guest.as_deref().unwrap_or("(none recorded)")
        )?;
        writeln!(out, "state:           {}", s.state)?;
        if let Some(e) = &s.error {
            writeln!(out, "error:           {e}")?;
        }
    }
    Ok(())
}

fn cmd_dump(a: DumpArgs) -> anyhow::Result<()> {
    let (store, _recovery) = AnyStore::open_read_only(&a.store)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut err: Option<std::io::Error> = None;
    store.for_each_in_range(&a.prefix, &mut |e| {
        let r = if a.json {
            let line = serde_json::json!({
                "key": e.key,
                "value_b64": base64::engine::general_purpose::STANDARD.encode(&e.value),
                "revision": e.version.as_u64(),
            });
            writeln!(out, "{line}")
        } else {
            writeln!(
                out,
                "{}\t{}\t{}",
                e.key,
                printable(&e.value),
                e.version
                    .as_u64()
                    .map_or("-".to_string(), |r| r.to_string())
            )
        };
        match r {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                err = Some(e);
                ControlFlow::Break(())
            }
        }
    })?;
    if let Some(e) = err {
        // A closed pipe (`dump | head`) is not a failure of the dump.
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e.into());
        }
        return Ok(());
    }
    match out.flush() {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Text form of a value: as-is when it is printable UTF-8, else `b64:` + base64.
fn printable(v: &[u8]) -> String {
    match std::str::from_utf8(v) {
        Ok(s) if !s.chars().any(|c| c.is_control()) => s.to_string(),
        _ => format!(
            "b64:{}",
            base64::engine::general_purpose::STANDARD.encode(v)
        ),
    }
}

async fn cmd_demo(a: DemoArgs) -> anyhow::Result<()> {
    use crate::localnats::LocalNats;
    use crate::stores::Connection;
    println!("== foldhost demo: a local nats-server, a bucket of routes, a fold, a resume ==");
    let server = LocalNats::start()?;
    println!("nats-server on {}", server.url());
    let work = tempfile::Builder::new()
        .prefix("foldhost-demo-")
        .tempdir()?;
    let store_dir = work.path().join("store");
    let conn = NatsConnection::open(ConnectOptions::new(server.url())).await?;
    let kv = conn
        .store(
            "routes",
            &StoreConfig {
                max_bytes: None,
                ..StoreConfig::default()
            },
        )
        .await?;
    let w = kv.writer();
    for i in 0..a.routes {
        w.put(
            &format!("route.host{i:05}.example"),
            format!("{{\"upstream\":\"10.0.{}.{}:8080\"}}", i / 250, i % 250).into(),
        )
        .await?;
    }
    println!("seeded {} routes into bucket 'routes'", a.routes);
    let args = RunArgs {
        nats: server.url(),
        bucket: "routes".into(),
        scope: "prefix:route.".into(),
        store: store_dir.clone(),
        backend: "append-log".into(),
        apply: "count".into(),
        catch_up: true,
        batch_window_ms: 10,
        batch_max: 100,
        channel: 256,
        creds_file: None,
    };
    let first = run_fold(&args, std::future::pending()).await?;
    println!(
        "first run: folded to cursor {} ({} updates delivered: the state-sync re-list)",
        first.cursor, first.delivered
    );
    for i in 0..10u32 {
        w.put(
            &format!("route.new{i}.example"),
            "{\"upstream\":\"10.9.9.9:8080\"}".into(),
        )
        .await?;
    }
    w.delete("route.host00000.example").await?;
    let second = run_fold(&args, std::future::pending()).await?;
    println!(
        "after 11 more writes, second run resumed from its cursor: {} updates delivered (a delta, not a replay), cursor {}",
        second.delivered, second.cursor
    );
    println!("\n$ foldhost status --store {}", store_dir.display());
    cmd_status(StatusArgs {
        store: store_dir.clone(),
        json: false,
    })?;
    println!(
        "\n$ foldhost dump --store {} --prefix route.new",
        store_dir.display()
    );
    cmd_dump(DumpArgs {
        store: store_dir.clone(),
        prefix: "route.new".into(),
        json: false,
    })?;
    conn.shutdown().await;
    if second.delivered != 11 {
        bail!(
            "demo: expected the resume to deliver exactly 11 updates, got {}",
            second.delivered
        );
    }
    println!("\ndemo ok");
    Ok(())
}

/// Exit code for an error: 1 (clap's usage errors exit 2 on their own).
pub fn report_error(e: &anyhow::Error) -> i32 {
    // One line: the chain joined, no backtrace.
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        // thiserror messages often embed their source already; don't say it twice.
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    let _ = writeln!(
        std::io::stderr(),
        "foldhost: error: {}",
        line.replace('\n', " ")
    );
    1
}

/// The path of a store's status file (for tools).
pub fn status_path(store: &Path) -> PathBuf {
    store.join(storedir::STATUS_FILE)
}
