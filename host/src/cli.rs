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
use crate::snapshot::{SharedStore, SnapshotStore};
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
    Run(Box<RunArgs>),
    /// Show a store's cursor, seq, applied_through, applier and lag.
    Status(StatusArgs),
    /// Print the fold's entries in key order, one per line.
    Dump(DumpArgs),
    /// Everything local, end to end: a nats-server, a bucket, a fold, a restart that resumes.
    Demo(DemoArgs),
    /// Hot-swap the guest of a running host (`run --listen`): the fold never stops.
    Swap(SwapArgs),
    /// Scaffold a Rust guest that builds with one command.
    NewGuest(NewGuestArgs),
    /// Write a verified artifact of a fold (a directory, or a `.tar`), from a store no host is
    /// running on, or from a running host (`--listen`) without stopping it.
    Export(ExportArgs),
    /// Make a store from an artifact (every file's digest and the cursor re-checked first).
    Import(ImportArgs),
}

/// `foldhost export`.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// The store to export (no host may be running on it; use --listen for a running one).
    #[arg(long, conflicts_with = "listen", required_unless_present = "listen")]
    pub store: Option<PathBuf>,
    /// A running host's `--listen` address: it exports between batches, exactly at its cursor.
    #[arg(long)]
    pub listen: Option<String>,
    /// Where the artifact goes (must not exist): a directory, or a file ending `.tar`.
    #[arg(long)]
    pub out: PathBuf,
    /// The host's admin token, with --listen (default: read from the file the host names in its
    /// `/status`).
    #[arg(long, env = "FOLDHOST_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Read the admin token from this file (with --listen).
    #[arg(long, value_name = "FILE", conflicts_with = "admin_token")]
    pub admin_token_file: Option<PathBuf>,
}

/// `foldhost import`.
#[derive(Args, Debug)]
pub struct ImportArgs {
    /// The artifact: a directory with MANIFEST.json, or a `.tar` of one.
    #[arg(long)]
    pub artifact: PathBuf,
    /// The store to create (must not exist, or be an empty directory).
    #[arg(long)]
    pub store: PathBuf,
    /// The backend the store must have (refused before anything is written when the artifact
    /// holds another).
    #[arg(long)]
    pub backend: Option<Backend>,
}

/// `foldhost new-guest`.
#[derive(Args, Debug)]
pub struct NewGuestArgs {
    /// The guest's name (a Rust crate name: letters, digits, `-`, `_`).
    pub name: String,
    /// Where to create it (default: ./NAME).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// The SDK crate (a foldhost checkout's `sdk/rust`; found automatically beside this binary).
    #[arg(long)]
    pub sdk: Option<PathBuf>,
}

/// `foldhost swap`.
#[derive(Args, Debug)]
pub struct SwapArgs {
    /// The running host's `--listen` address.
    #[arg(long)]
    pub listen: String,
    /// The new guest component.
    #[arg(long)]
    pub guest: PathBuf,
    /// The host's admin token (default: read from the file the host names in its `/status`).
    #[arg(long, env = "FOLDHOST_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Read the admin token from this file.
    #[arg(long, value_name = "FILE", conflicts_with = "admin_token")]
    pub admin_token_file: Option<PathBuf>,
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
    /// What to watch: all, prefix:P, or prefixes:P1,P2 (default: the guest's manifest, else all).
    #[arg(long)]
    pub scope: Option<String>,
    /// Store directory.
    #[arg(long)]
    pub store: PathBuf,
    /// Storage backend: append-log, fjall or rocksdb (the last two when built with their features).
    #[arg(long, default_value = "append-log")]
    pub backend: String,
    /// Fsync every apply (fjall, rocksdb): a power loss then loses nothing committed. Without it a
    /// process crash loses nothing, a power loss may lose the tail since the last fsync.
    #[arg(long)]
    pub sync: bool,
    /// The guest: a WebAssembly component (see `wit/guest.wit`). Without it, `--apply` runs.
    #[arg(long)]
    pub guest: Option<PathBuf>,
    /// Guest configuration, `KEY=VALUE`, repeatable (handed to the guest's `init`).
    #[arg(long = "guest-config", value_name = "KEY=VALUE")]
    pub guest_config: Vec<String>,
    /// Guest configuration from a file: a JSON object of strings (`{"region": "eu"}`). Keys given
    /// with `--guest-config` override it.
    #[arg(long, value_name = "FILE")]
    pub guest_config_file: Option<PathBuf>,
    /// Deadline of one guest call, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub guest_deadline_ms: u64,
    /// Memory cap of a guest, in MiB.
    #[arg(long, default_value_t = 256)]
    pub guest_memory_mb: usize,
    /// Most key and value bytes passed to the guest in one call.
    #[arg(long, default_value_t = 16 * 1024 * 1024)]
    pub guest_max_batch_bytes: usize,
    /// The built-in native applier when no `--guest` is given: `count`.
    #[arg(long, default_value = "count")]
    pub apply: String,
    /// Serve `GET /status`, `POST /query`, `POST /swap` and `POST /export` on this address (e.g.
    /// 127.0.0.1:8080).
    #[arg(long)]
    pub listen: Option<String>,
    /// Bearer token the admin routes (`/swap`, `/export`) require. Without it (or
    /// `--admin-token-file`) the host generates one and writes it to `STORE/admin-token` (mode 0600),
    /// where `foldhost swap` and `foldhost export --listen` find it.
    #[arg(long, env = "FOLDHOST_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Read the admin token from this file (keeps it out of `ps`).
    #[arg(long, value_name = "FILE", conflicts_with = "admin_token")]
    pub admin_token_file: Option<PathBuf>,
    /// Bearer token `/status` and `/query` require (the admin token opens them too). Without it
    /// they are open to whoever reaches the listener.
    #[arg(long, env = "FOLDHOST_QUERY_TOKEN", hide_env_values = true)]
    pub query_token: Option<String>,
    /// Largest `/query` body, in bytes.
    #[arg(long, default_value_t = crate::serve::MAX_QUERY)]
    pub query_max_bytes: usize,
    /// Swap the guest whenever the `--guest` file's content changes (checked every second).
    #[arg(long)]
    pub watch_guest: bool,
    /// Also serve the guest's query as a NATS request/reply service on this subject.
    #[arg(long)]
    pub query_subject: Option<String>,
    /// `--query-subject` answers only requests whose reply subject starts with this prefix (a
    /// requester cannot have the host publish, with its credentials, to a subject it names).
    #[arg(long, default_value = "_INBOX.")]
    pub query_reply_prefix: String,
    /// Fold to the stream's last sequence as of start, then exit 0.
    #[arg(long)]
    pub catch_up: bool,
    /// How an expired cursor is repaired: `auto` (the key-listing diff where the bucket's listing
    /// is the truth, an artifact restore where retention evicts current values), `relist`,
    /// `restore`, or `none` (stop with the expiry).
    #[arg(long, default_value = "auto", value_name = "MODE")]
    pub repair: String,
    /// What to do when the bucket's stream is not the one the fold recorded (deleted and created
    /// again) or ends below the fold's cursor: `refuse` (stop with one line saying so, the fold
    /// untouched) or `relist` (re-fold the new bucket: the key-listing diff, then a re-list).
    #[arg(long, default_value = "refuse", value_name = "WHAT")]
    pub on_recreated: String,
    /// A directory of artifacts (directories or `.tar` files as `foldhost export` writes them); a
    /// restore takes the one with the newest cursor. Without it no restore is armed.
    #[arg(long, value_name = "DIR")]
    pub restore_from: Option<PathBuf>,
    /// Warn (log and status) about a record a guest deferred that stays retained longer than this
    /// many seconds.
    #[arg(long, default_value_t = 1800)]
    pub defer_grace_secs: u64,
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
#[command(group(clap::ArgGroup::new("source").required(true).args(["store", "listen"])))]
pub struct StatusArgs {
    /// Store directory (read-only; works beside a running host).
    #[arg(long)]
    pub store: Option<PathBuf>,
    /// A running host's `--listen` address (live figures).
    #[arg(long)]
    pub listen: Option<String>,
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
    /// The router guest (default: the one `guests/build.sh` builds).
    #[arg(long)]
    pub guest: Option<PathBuf>,
}

/// Runs a parsed command line.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run(a) => cmd_run(*a).await,
        Command::Status(a) => match a.listen.clone() {
            Some(addr) => cmd_status_live(&addr, a.json).await,
            None => cmd_status(a),
        },
        Command::Dump(a) => cmd_dump(a),
        Command::Demo(a) => cmd_demo(a).await,
        Command::Swap(a) => cmd_swap(a).await,
        Command::NewGuest(a) => cmd_new_guest(a),
        Command::Export(a) => cmd_export(a).await,
        Command::Import(a) => cmd_import(a).await,
    }
}

/// A byte-progress display for long copies and hashes: a bar on a terminal, nothing otherwise.
fn byte_progress(what: &'static str) -> impl FnMut(u64, u64) {
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new(0);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.set_message(what);
        b
    });
    move |done, total| {
        if let Some(b) = &bar {
            b.set_length(total);
            b.set_position(done);
            if done >= total {
                b.finish_and_clear();
            }
        }
    }
}

async fn cmd_export(a: ExportArgs) -> anyhow::Result<()> {
    let manifest = match (&a.listen, &a.store) {
        (Some(addr), _) => {
            let path = a.out.to_string_lossy().into_owned();
            let token =
                admin_token_for(addr, a.admin_token.clone(), a.admin_token_file.as_deref()).await?;
            let (code, body) = crate::serve::call_with_token(
                addr,
                "POST",
                "/export",
                path.as_bytes(),
                token.as_deref(),
            )
            .await
            .with_context(|| format!("export via {addr}"))?;
            let text = String::from_utf8_lossy(&body).trim_end().to_string();
            if code != 200 {
                bail!("export to {}: {text}", a.out.display());
            }
            text
        }
        (None, Some(dir)) => {
            let dir = dir.clone();
            let out = a.out.clone();
            let m = tokio::task::spawn_blocking(move || {
                // Opened for writing: its lock proves no host is running on it, and the copy is
                // taken from a writer's view (RocksDB cannot checkpoint a read-only instance).
                let backend = storedir::backend_of(&dir)?;
                let (store, _) = AnyStore::open(&dir, backend).with_context(|| {
                    format!(
                        "open {} (is a host running on it? export with --listen)",
                        dir.display()
                    )
                })?;
                let mut progress = byte_progress("hashing");
                crate::artifact::export_store(&store, backend, &out, None, &mut progress)
                    .with_context(|| format!("export to {}", out.display()))
            })
            .await
            .context("export task")??;
            serde_json::to_string(&m)?
        }
        (None, None) => bail!("export needs --store or --listen"),
    };
    println!("{manifest}");
    Ok(())
}

async fn cmd_import(a: ImportArgs) -> anyhow::Result<()> {
    let m = tokio::task::spawn_blocking(move || {
        let mut progress = byte_progress("verifying");
        crate::artifact::import_artifact(&a.artifact, &a.store, a.backend, &mut progress)
            .with_context(|| format!("import {} into {}", a.artifact.display(), a.store.display()))
    })
    .await
    .context("import task")??;
    println!("{}", serde_json::to_string(&m)?);
    Ok(())
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
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        let _ = shutdown_tx.send(true);
    });
    let summary = run_fold(&a, shutdown_rx).await?;
    eprintln!(
        "foldhost: stopped at cursor {} ({} updates delivered this run)",
        summary.cursor, summary.delivered
    );
    Ok(())
}

async fn signalled(mut rx: tokio::sync::watch::Receiver<bool>) {
    while !*rx.borrow_and_update() {
        if rx.changed().await.is_err() {
            // The sender is gone without a signal: never shut down from here.
            std::future::pending::<()>().await;
        }
    }
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

/// Refuses, before the store is opened for writing, a fold of another stream than the bucket's
/// (recreated, or another bucket's store): the fold's recorded identity and cursor are read
/// through a read-only open, so a refused run leaves every file of the store as it was.
async fn refuse_another_stream(
    store: &std::path::Path,
    bucket: &str,
    kv: &crate::nats::NatsKv,
) -> anyhow::Result<()> {
    use crate::kv::KvWatcher as _;
    if storedir::backend_of(store).is_err() {
        return Ok(()); // no fold yet (or not one: the writable open reports that)
    }
    let dir = store.to_path_buf();
    let (recorded, cursor) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let (ro, _) = AnyStore::open_read_only(&dir)?;
        let recorded = match ro.get(crate::retained::IDENTITY_KEY)? {
            Some(e) => Some(
                crate::kv::StreamIdentity::from_bytes(&e.value).ok_or_else(|| {
                    anyhow!(
                        "{}: the fold's stream identity record does not decode",
                        dir.display()
                    )
                })?,
            ),
            None => None,
        };
        Ok((recorded, ro.cursor()))
    })
    .await
    .context("store identity read task")??;
    if let Some(found) = kv.stream_state().await?
        && let Some(line) =
            crate::applied::identity_refusal(bucket, recorded.as_ref(), cursor, &found)
    {
        bail!(line);
    }
    Ok(())
}

/// The body of `foldhost run`, reusable by the demo: connects, opens the store, loads the guest and
/// hydrates it, folds until `shutdown` is set (or caught up), keeps `status.json` current, and
/// serves `--listen`. When the fold fails and `--listen` is set, the process stays up serving the
/// failure in `/status` until `shutdown`.
pub async fn run_fold(
    a: &RunArgs,
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<RunSummary> {
    let backend: Backend = a.backend.parse().map_err(|e| anyhow!("--backend: {e}"))?;
    let guest_config = match &a.guest_config_file {
        Some(path) => {
            let text = std::fs::read(path)
                .with_context(|| format!("--guest-config-file {}", path.display()))?;
            merge_config(
                config_from_json(&text)
                    .map_err(|e| anyhow!("--guest-config-file {}: {e}", path.display()))?,
                parse_config(&a.guest_config)?,
            )
        }
        None => parse_config(&a.guest_config)?,
    };
    let repair_mode: crate::protocol::RepairMode = a
        .repair
        .parse()
        .map_err(|e| anyhow!("--repair {}: {e}", a.repair))?;
    let on_recreated: crate::protocol::OnRecreated = a
        .on_recreated
        .parse()
        .map_err(|e| anyhow!("--on-recreated {}: {e}", a.on_recreated))?;
    if let Some(d) = &a.restore_from
        && !d.is_dir()
    {
        bail!("--restore-from {}: not a directory", d.display());
    }
    let limits = crate::guest::GuestLimits {
        call_deadline: Duration::from_millis(a.guest_deadline_ms.max(1)),
        memory_bytes: a.guest_memory_mb.max(1) * 1024 * 1024,
        max_batch_bytes: a.guest_max_batch_bytes.max(1),
        ..crate::guest::GuestLimits::default()
    };
    // Read, compile, link-check and start the guest (instantiate, `manifest`, `init`, against an
    // empty fold) before touching anything: a bad guest is refused with the reason (a missing
    // import named, a trap in `init`) and nothing is connected or written.
    let (engine, guest_bytes) = match &a.guest {
        Some(p) => {
            let bytes = crate::guest::read_guest_file(p)?;
            let engine = crate::guest::GuestEngine::new()?;
            engine.prepare(&p.display().to_string(), &bytes)?;
            let probe = crate::guest::GuestApply::load(
                &engine,
                &p.display().to_string(),
                &bytes,
                limits,
                guest_config.clone(),
                Arc::new(crate::snapshot::EmptyFold),
            )
            .await?;
            drop(probe);
            (Some(engine), Some(bytes))
        }
        None => (None, None),
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
    if on_recreated == crate::protocol::OnRecreated::Refuse {
        refuse_another_stream(&a.store, &a.bucket, &kv).await?;
    }
    let store_dir = a.store.clone();
    let sync = a.sync;
    let (store, recovery) =
        tokio::task::spawn_blocking(move || AnyStore::open_with(&store_dir, backend, sync))
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
    // Without a repair a re-list would never remove what the bucket no longer has; with one, the
    // fold repairs this like an expiry at revision 0.
    if repair_mode == crate::protocol::RepairMode::None
        && store.cursor().revision().is_none()
        && crate::snapshot::bucket_len(&store)? > 0
    {
        bail!(
            "{}: the fold holds {} keys but no cursor and --repair is none; it cannot be resumed safely (allow a repair, import an artifact, or start from an empty store)",
            a.store.display(),
            crate::snapshot::bucket_len(&store)?
        );
    }
    let shared = SharedStore::new(store);

    let (mut apply, manifest_scope): (Box<dyn Apply>, Option<WatchScope>) =
        match (&a.guest, guest_bytes) {
            (Some(path), Some(bytes)) => {
                let engine = engine
                    .clone()
                    .ok_or_else(|| anyhow!("guest engine missing"))?;
                let mut g = crate::guest::GuestApply::load(
                    &engine,
                    &path.display().to_string(),
                    &bytes,
                    limits,
                    guest_config,
                    Arc::new(shared.clone()),
                )
                .await?;
                g.hydrate().await.map_err(|e| anyhow!("hydrate: {e}"))?;
                let scope = g.manifest().watch_scope();
                (Box::new(g), Some(scope))
            }
            _ => match a.apply.as_str() {
                "count" => (Box::new(CountingApply::default()), None),
                other => bail!("--apply {other:?}: the built-in appliers are: count"),
            },
        };
    let scope = match (&a.scope, manifest_scope) {
        (Some(s), _) => WatchScope::parse(s).map_err(|e| anyhow!("--scope: {e}"))?,
        (None, Some(m)) => m,
        (None, None) => WatchScope::All,
    };
    tracing::info!(bucket = %a.bucket, scope = %scope, store = %a.store.display(), backend = backend.as_str(), guest = %apply.describe(), cursor = %shared.read()?.cursor(), "folding");

    let status = Arc::new(FoldStatus::default());
    let base = HostStatus {
        state: "running".into(),
        pid: std::process::id(),
        guest: Some(apply.describe()),
        bucket: a.bucket.clone(),
        scope: scope.to_string(),
        ..HostStatus::default()
    };
    let fatal: Arc<std::sync::Mutex<Option<String>>> = Arc::new(std::sync::Mutex::new(None));
    let (control_tx, control_rx) = tokio::sync::mpsc::channel(64);
    let server = match &a.listen {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("--listen {addr}"))?;
            let local = listener.local_addr()?;
            let (admin_token, token_file) = match (&a.admin_token, &a.admin_token_file) {
                (Some(t), _) => (t.clone(), None),
                (None, Some(f)) => (crate::serve::read_token_file(f)?, Some(f.clone())),
                (None, None) => {
                    let f = a.store.join(crate::serve::ADMIN_TOKEN_FILE);
                    let t = crate::serve::generate_token_file(&f)?;
                    tracing::info!(file = %f.display(), "admin token generated (mode 0600): foldhost swap and export --listen read it from there");
                    (t, Some(f))
                }
            };
            tracing::info!(addr = %local, "serving /status, /query, /swap and /export");
            if a.query_max_bytes > crate::serve::QUERY_BODY_BUDGET {
                bail!(
                    "--query-max-bytes {}: over the {} bytes all query bodies in flight may hold together",
                    a.query_max_bytes,
                    crate::serve::QUERY_BODY_BUDGET
                );
            }
            let policy = crate::serve::AccessPolicy {
                admin_token,
                query_token: a.query_token.clone(),
                listen: local,
                limits: crate::serve::Limits {
                    query_body: a.query_max_bytes,
                    ..Default::default()
                },
            };
            let mut base = base.clone();
            base.admin_token_file =
                token_file.map(|f| std::path::absolute(&f).unwrap_or(f).display().to_string());
            let state = Arc::new(crate::serve::ServeState {
                status: status_renderer(base, status.clone(), backend, fatal.clone()),
                control: control_tx.clone(),
                engine: engine.clone(),
                policy,
                backend,
                scope: scope.to_string(),
            });
            Some(tokio::spawn(crate::serve::serve(listener, state)))
        }
        None => None,
    };
    let mut side_tasks = Vec::new();
    if a.watch_guest {
        let (Some(path), Some(engine)) = (a.guest.clone(), engine.clone()) else {
            bail!("--watch-guest needs --guest");
        };
        side_tasks.push(tokio::spawn(watch_guest_file(
            path,
            engine,
            control_tx.clone(),
        )));
    }
    if let Some(subject) = &a.query_subject {
        let client = conn.client().await?;
        let sub = client
            .subscribe(subject.clone())
            .await
            .with_context(|| format!("--query-subject {subject}"))?;
        tracing::info!(subject = %subject, "serving queries over NATS request/reply");
        side_tasks.push(tokio::spawn(serve_nats_queries(
            client,
            sub,
            a.query_reply_prefix.clone(),
            control_tx.clone(),
        )));
    }
    drop(control_tx);
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
        defer_grace: Duration::from_secs(a.defer_grace_secs),
        repair: crate::repair::RepairConfig {
            mode: repair_mode,
            restore_from: a
                .restore_from
                .clone()
                .map(crate::repair::RestoreSource::new),
            lister: Some(kv.clone() as Arc<dyn crate::kv::KvReader>),
            scratch: Some(repair_scratch(&a.store)),
            on_recreated,
            ..Default::default()
        },
    };
    let result = watch_applied(
        kv,
        shared,
        apply.as_mut(),
        opts,
        status.clone(),
        Some(control_rx),
        signalled(shutdown.clone()),
    )
    .await;
    reporter.abort();
    for t in side_tasks {
        t.abort();
    }
    let mut last = snapshot_status(&base, &status);
    let outcome = match result {
        Ok(finished) => {
            last.state = "stopped".into();
            // The one rule (`RetainedIndex::applied_through`), as the fold published it with its
            // last commit — what `/status` showed and `status --store` computes.
            last.applied_through = status.applied_through.load(Ordering::Relaxed);
            Ok(RunSummary {
                cursor: finished.cursor,
                delivered: status.delivered.load(Ordering::Relaxed),
            })
        }
        Err(e) => {
            last.state = "failed".into();
            last.error = Some(e.to_string());
            if let Ok(mut f) = fatal.lock() {
                *f = Some(e.to_string());
            }
            Err(anyhow!(e))
        }
    };
    if let Err(e) = storedir::write_status(&a.store, &last) {
        tracing::warn!(error = %e, "status file not written");
    }
    if let (Some(server), Err(e)) = (&server, &outcome) {
        // The fold has stopped; the host stays up so `/status` can say why.
        tracing::error!(error = %e, "fold failed; still serving /status until signalled");
        signalled(shutdown).await;
        server.abort();
    }
    conn_shutdown(conn).await;
    outcome
}

/// `--watch-guest`: swaps the guest when the file's bytes change. A file that fails to compile or
/// is refused leaves the running guest in place (and is retried only when it changes again).
async fn watch_guest_file(
    path: PathBuf,
    engine: Arc<crate::guest::GuestEngine>,
    control: tokio::sync::mpsc::Sender<crate::applied::Control>,
) {
    let mut current = std::fs::read(&path)
        .map(|b| *blake3::hash(&b).as_bytes())
        .ok();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let Ok(bytes) = tokio::fs::read(&path).await else {
            continue; // mid-replacement, or removed: keep the running guest
        };
        let hash = *blake3::hash(&bytes).as_bytes();
        if current == Some(hash) {
            continue;
        }
        current = Some(hash);
        let what = path.display().to_string();
        tracing::info!(guest = %what, "guest file changed; swapping");
        // Compile off the fold's path; the fold's swap then finds it in the cache.
        let compiled = {
            let (engine, bytes, what) = (engine.clone(), bytes.clone(), what.clone());
            tokio::task::spawn_blocking(move || engine.prepare(&what, &bytes).map(|_| ())).await
        };
        if let Ok(Err(e)) = compiled {
            tracing::warn!(error = %e, "swap refused; the running guest stays");
            continue;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let swap = crate::applied::Control::Swap {
            bytes,
            what,
            reply: tx,
        };
        if control.send(swap).await.is_err() {
            return;
        }
        // The fold logs the outcome; nothing more to do here.
        let _ = rx.await;
    }
}

/// `--query-subject`: each request's payload goes to the guest's `query` (between batches); the
/// reply is the answer, or the error text with a `Foldhost-Error: true` header.
async fn serve_nats_queries(
    client: async_nats::Client,
    mut sub: async_nats::Subscriber,
    reply_prefix: String,
    control: tokio::sync::mpsc::Sender<crate::applied::Control>,
) {
    use futures::StreamExt;
    while let Some(msg) = sub.next().await {
        let Some(reply_to) = msg.reply.clone() else {
            continue;
        };
        if !crate::protocol::reply_subject_allowed(&reply_to, &reply_prefix) {
            tracing::warn!(reply = %reply_to, prefix = %reply_prefix, "query refused: its reply subject is not an inbox");
            continue;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let q = crate::applied::Control::Query {
            request: msg.payload.to_vec(),
            reply: tx,
        };
        if control.send(q).await.is_err() {
            return;
        }
        let published = match rx.await {
            Ok(Ok(answer)) => client.publish(reply_to, answer.into()).await,
            Ok(Err(e)) => {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Foldhost-Error", "true");
                client
                    .publish_with_headers(reply_to, headers, e.to_string().into())
                    .await
            }
            Err(_) => return,
        };
        if let Err(e) = published {
            tracing::warn!(error = %e, "query reply not sent");
        }
    }
}

fn parse_config(items: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    items
        .iter()
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(|| anyhow!("--guest-config {kv:?}: expected KEY=VALUE"))
        })
        .collect()
}

/// A guest configuration file: one JSON object whose values are all strings (at most
/// [`MAX_CONFIG_ENTRIES`] of them), in key order.
fn config_from_json(bytes: &[u8]) -> Result<Vec<(String, String)>, String> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v.as_object().ok_or("expected a JSON object of strings")?;
    if obj.len() > MAX_CONFIG_ENTRIES {
        return Err(format!(
            "{} entries, over the limit of {MAX_CONFIG_ENTRIES}",
            obj.len()
        ));
    }
    let mut out: Vec<(String, String)> = obj
        .iter()
        .map(|(k, v)| match v.as_str() {
            Some(s) => Ok((k.clone(), s.to_string())),
            None => Err(format!("{k:?} is not a string (got {v})")),
        })
        .collect::<Result<_, _>>()?;
    out.sort();
    Ok(out)
}

/// Most entries a guest configuration file may hold.
const MAX_CONFIG_ENTRIES: usize = 4096;

/// `base` with every key of `over` replaced or added (`over` wins).
fn merge_config(
    mut base: Vec<(String, String)>,
    over: Vec<(String, String)>,
) -> Vec<(String, String)> {
    for (k, v) in over {
        match base.iter_mut().find(|(bk, _)| *bk == k) {
            Some(slot) => slot.1 = v,
            None => base.push((k, v)),
        }
    }
    base
}

/// Where a run's repairs keep their scratch: a hidden directory beside the store (same file
/// system, so the imported artifact is a rename away and the disk is the one the fold lives on).
fn repair_scratch(store: &Path) -> PathBuf {
    let name = store
        .file_name()
        .map_or_else(|| "store".into(), |n| n.to_string_lossy().into_owned());
    store
        .parent()
        .unwrap_or_else(|| Path::new("."))
        .join(format!(".{name}.repair"))
}

/// The `/status` JSON: the same fields as `status --json`, live.
fn status_renderer(
    base: HostStatus,
    status: Arc<FoldStatus>,
    backend: Backend,
    fatal: Arc<std::sync::Mutex<Option<String>>>,
) -> Box<dyn Fn() -> serde_json::Value + Send + Sync> {
    Box::new(move || {
        let applied = status.applied_through.load(Ordering::Relaxed);
        let cursor = status.cursor.load(Ordering::Relaxed);
        let seq = status.seq.load(Ordering::Relaxed).max(cursor);
        let fatal = fatal.lock().ok().and_then(|f| f.clone());
        let state = if fatal.is_some() { "failed" } else { "running" };
        let oldest = status.oldest_retained_revision.load(Ordering::Relaxed);
        let oldest_ms = status.oldest_retained_unix_ms.load(Ordering::Relaxed);
        serde_json::json!({
            "cursor": (cursor > 0).then_some(cursor),
            "seq": seq,
            "applied_through": applied,
            "lag": seq - applied,
            "guest": status.guest(),
            "backend": backend.as_str(),
            "bucket": base.bucket,
            "scope": base.scope,
            "state": state,
            "error": fatal.or_else(|| status.last_error()),
            "delivered": status.delivered.load(Ordering::Relaxed),
            "batches": status.batches.load(Ordering::Relaxed),
            "last_apply_us": status.last_apply_us.load(Ordering::Relaxed),
            "last_commit_us": status.last_commit_us.load(Ordering::Relaxed),
            "retained": status.retained.load(Ordering::Relaxed),
            "oldest_retained_revision": (oldest_ms > 0).then_some(oldest),
            "oldest_retained_age_s": (oldest_ms > 0).then(|| now_ms().saturating_sub(oldest_ms) / 1000),
            "warnings": status.warnings(),
            "eviction_seen": status.eviction_seen.load(Ordering::Relaxed) == 1,
            "repairs": status.repairs.load(Ordering::Relaxed),
            "admin_token_file": base.admin_token_file,
        })
    })
}

async fn conn_shutdown(conn: NatsConnection) {
    use crate::stores::Connection;
    conn.shutdown().await;
}

fn snapshot_status(base: &HostStatus, s: &FoldStatus) -> HostStatus {
    let guest = s.guest();
    HostStatus {
        guest: if guest.is_empty() {
            base.guest.clone()
        } else {
            Some(guest)
        },
        seq: s.seq.load(Ordering::Relaxed),
        applied_through: s.applied_through.load(Ordering::Relaxed),
        retained: s.retained.load(Ordering::Relaxed),
        oldest_retained_revision: (s.oldest_retained_unix_ms.load(Ordering::Relaxed) > 0)
            .then(|| s.oldest_retained_revision.load(Ordering::Relaxed)),
        oldest_retained_unix_ms: (s.oldest_retained_unix_ms.load(Ordering::Relaxed) > 0)
            .then(|| s.oldest_retained_unix_ms.load(Ordering::Relaxed)),
        warnings: s.warnings(),
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
    retained: u64,
    oldest_retained_revision: Option<u64>,
    oldest_retained_age_s: Option<u64>,
    warnings: Vec<String>,
    /// The fold has seen retention evict current values (the cursor carries the eviction memo).
    eviction_seen: bool,
    guest: Option<String>,
    backend: &'static str,
    keys: u64,
    state: String,
    error: Option<String>,
    store: String,
}

async fn cmd_status_live(addr: &str, json: bool) -> anyhow::Result<()> {
    let (code, body) = crate::serve::call(addr, "GET", "/status", b"")
        .await
        .with_context(|| format!("status via {addr}"))?;
    if code != 200 {
        bail!("{addr}: /status answered {code}");
    }
    let v: serde_json::Value = serde_json::from_slice(&body).context("status JSON")?;
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer(&mut out, &v)?;
        writeln!(out)?;
    } else if let Some(map) = v.as_object() {
        for (k, val) in map {
            let text = match val {
                serde_json::Value::String(t) => t.clone(),
                serde_json::Value::Null => "-".into(),
                other => other.to_string(),
            };
            writeln!(out, "{:<17}{text}", format!("{k}:"))?;
        }
    }
    Ok(())
}

fn cmd_status(a: StatusArgs) -> anyhow::Result<()> {
    let Some(dir) = a.store.clone() else {
        bail!("status needs --store or --listen");
    };
    let (store, _recovery) = AnyStore::open_read_only(&dir)?;
    let cursor = store.cursor();
    let host = storedir::read_status(&dir);
    let retained = crate::retained::RetainedIndex::load(&store)?;
    let oldest = retained.oldest();
    let applied = retained.applied_through(cursor.revision()).unwrap_or(0);
    let seq = host.as_ref().map_or(cursor.revision_or_zero(), |h| {
        h.seq.max(cursor.revision_or_zero())
    });
    let s = StatusJson {
        cursor: cursor.revision(),
        seq,
        applied_through: applied,
        lag: seq.saturating_sub(applied),
        retained: retained.len() as u64,
        oldest_retained_revision: oldest.map(|o| o.position()),
        oldest_retained_age_s: oldest.map(|o| now_ms().saturating_sub(o.retained_unix_ms) / 1000),
        warnings: host
            .as_ref()
            .map(|h| h.warnings.clone())
            .unwrap_or_default(),
        eviction_seen: cursor.memo().is_some(),
        guest: host.as_ref().and_then(|h| h.guest.clone()),
        backend: store.backend(),
        keys: crate::snapshot::bucket_len(&store)?,
        state: host
            .as_ref()
            .map_or_else(|| "unknown".to_string(), |h| h.state.clone()),
        error: host.as_ref().and_then(|h| h.error.clone()),
        store: dir.display().to_string(),
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
        if let Some(oldest) = s.oldest_retained_revision {
            writeln!(
                out,
                "retained:        {} (oldest revision {oldest}, {} s ago)",
                s.retained,
                s.oldest_retained_age_s.unwrap_or(0)
            )?;
        }
        for w in &s.warnings {
            writeln!(out, "warning:         {w}")?;
        }
        writeln!(out, "keys:            {}", s.keys)?;
        if s.eviction_seen {
            writeln!(
                out,
                "eviction_seen:   true (retention evicted current values; the bucket's listing is never trusted)"
            )?;
        }
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
        if crate::retained::is_reserved(&e.key) {
            return ControlFlow::Continue(());
        }
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

/// The admin token for the host at `listen`: given, read from `file`, or read from the file the
/// host names in its `/status` (`admin_token_file`: readable only by the host's user, so only a
/// local caller with the same rights finds it; and only a file the host generated is followed,
/// see [`crate::serve::read_generated_token`]). `None` when none of these has one.
async fn admin_token_for(
    listen: &str,
    token: Option<String>,
    file: Option<&Path>,
) -> anyhow::Result<Option<String>> {
    if token.is_some() {
        return Ok(token);
    }
    if let Some(f) = file {
        return Ok(Some(crate::serve::read_token_file(f)?));
    }
    let Ok((200, body)) = crate::serve::call(listen, "GET", "/status", b"").await else {
        return Ok(None);
    };
    let named = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["admin_token_file"].as_str().map(PathBuf::from));
    Ok(named.and_then(|f| crate::serve::read_generated_token(&f).ok()))
}

async fn cmd_swap(a: SwapArgs) -> anyhow::Result<()> {
    let bytes = crate::guest::read_guest_file(&a.guest)?;
    let token = admin_token_for(
        &a.listen,
        a.admin_token.clone(),
        a.admin_token_file.as_deref(),
    )
    .await?;
    let (code, body) =
        crate::serve::call_with_token(&a.listen, "POST", "/swap", &bytes, token.as_deref())
            .await
            .with_context(|| format!("swap via {}", a.listen))?;
    let text = String::from_utf8_lossy(&body).trim_end().to_string();
    if code != 200 {
        bail!("{}: {text}", a.guest.display());
    }
    println!("{text}");
    Ok(())
}

/// `rel` in the current directory, else in the checkout the running binary was built in
/// (`target/<profile>/foldhost` → `../../rel`).
fn find_in_checkout(rel: &Path) -> Option<PathBuf> {
    let mut candidates = vec![rel.to_path_buf()];
    if let Ok(exe) = std::env::current_exe()
        && let Some(root) = exe.parent().and_then(Path::parent).and_then(Path::parent)
    {
        candidates.push(root.join(rel));
    }
    candidates.into_iter().find(|p| p.exists())
}

fn find_sdk() -> Option<PathBuf> {
    find_in_checkout(Path::new("sdk/rust/Cargo.toml"))
        .and_then(|p| p.parent().map(Path::to_path_buf))
}

fn cmd_new_guest(a: NewGuestArgs) -> anyhow::Result<()> {
    let name = a.name.as_str();
    let valid = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic());
    if !valid {
        bail!("guest name {name:?}: use letters, digits, '-' and '_', starting with a letter");
    }
    let sdk = match a.sdk.clone().or_else(find_sdk) {
        Some(p) => std::fs::canonicalize(&p).with_context(|| format!("--sdk {}", p.display()))?,
        None => bail!("the SDK (sdk/rust of a foldhost checkout) was not found: pass --sdk PATH"),
    };
    let dir = a.dir.clone().unwrap_or_else(|| PathBuf::from(name));
    if dir.exists() {
        bail!("{}: already exists; not overwriting", dir.display());
    }
    std::fs::create_dir_all(dir.join("src"))
        .with_context(|| format!("create {}", dir.display()))?;
    let manifest = format!(
        r#"[package]
name = "{name}"
version = "0.1.0"
edition = "2024"

[lib]
crate-type = ["cdylib"]

[dependencies]
foldhost-guest = {{ path = "{sdk}" }}

# A standalone workspace: the guest builds on its own, for wasm32-wasip2.
[workspace]

[profile.release]
opt-level = "s"
lto = true
strip = true
codegen-units = 1
"#,
        sdk = sdk.display()
    );
    let lib = format!(
        r#"//! `{name}`: a foldhost guest. It keeps a copy of the keys in its scope and answers a query
//! (a key) with the key's value. Change `manifest`, `parse`, `apply` and `query` to build your
//! structure; the host rebuilds it from the fold whenever an instance starts, so there is no
//! rebuild code to write.

use std::collections::BTreeMap;

use foldhost_guest::{{Change, Folder, Manifest, Verdict}};

#[derive(Default)]
struct Guest {{
    entries: BTreeMap<String, Vec<u8>>,
}}

impl Folder for Guest {{
    type Value = Vec<u8>;

    fn manifest() -> Manifest {{
        // The key prefixes this guest watches; `Manifest::whole_bucket` watches everything.
        Manifest::new("{name}", "0.1.0", ["{name}."])
    }}

    fn parse(&self, _key: &str, value: &[u8]) -> Verdict<Vec<u8>> {{
        Verdict::Accept(value.to_vec())
    }}

    fn apply(&mut self, changes: Vec<Change<Vec<u8>>>) -> Result<(), String> {{
        for change in changes {{
            match change {{
                Change::Put {{ key, value, .. }} => {{
                    self.entries.insert(key, value);
                }}
                Change::Delete {{ key, .. }} => {{
                    self.entries.remove(&key);
                }}
            }}
        }}
        Ok(())
    }}

    fn query(&self, request: &[u8]) -> Result<Vec<u8>, String> {{
        let key = String::from_utf8_lossy(request);
        self.entries
            .get(key.as_ref())
            .cloned()
            .ok_or_else(|| format!("unknown key: {{key}}"))
    }}
}}

foldhost_guest::export_folder!(Guest);
"#
    );
    let crate_file = name.replace('-', "_");
    let readme = format!(
        "# {name}\n\nA foldhost guest.\n\n```sh\ncargo build --release --target wasm32-wasip2\nfoldhost run --guest target/wasm32-wasip2/release/{crate_file}.wasm --nats URL --bucket B --store DIR --listen 127.0.0.1:8080\n```\n"
    );
    let write = |p: PathBuf, text: &str| {
        std::fs::write(&p, text).with_context(|| format!("write {}", p.display()))
    };
    write(dir.join("Cargo.toml"), &manifest)?;
    write(dir.join("src/lib.rs"), &lib)?;
    write(dir.join("README.md"), &readme)?;
    write(dir.join(".gitignore"), "target/\n")?;
    println!(
        "created {}: build it with `cargo build --release --target wasm32-wasip2` (→ target/wasm32-wasip2/release/{crate_file}.wasm)",
        dir.display()
    );
    Ok(())
}

/// Where the demo looks for the router guest when `--guest` is not given.
fn find_router_guest() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("FOLDHOST_GUESTS_DIR") {
        let p = Path::new(&dir).join("router.wasm");
        if p.is_file() {
            return Some(p);
        }
    }
    find_in_checkout(Path::new("guests/target/wasm32-wasip2/release/router.wasm"))
}

async fn cmd_demo(a: DemoArgs) -> anyhow::Result<()> {
    use crate::localnats::LocalNats;
    use crate::stores::Connection;
    println!(
        "== foldhost demo: a local nats-server, a bucket of routes, the router guest, a fold =="
    );
    let guest = match a.guest.clone().or_else(find_router_guest) {
        Some(g) => g,
        None => bail!(
            "router.wasm not found: build the guests with `guests/build.sh` (`make demo` does), or pass --guest"
        ),
    };
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
    let port = crate::localnats::free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let mut args = RunArgs {
        nats: server.url(),
        bucket: "routes".into(),
        scope: None,
        store: store_dir.clone(),
        backend: "append-log".into(),
        sync: false,
        guest: Some(guest.clone()),
        guest_config: Vec::new(),
        guest_config_file: None,
        guest_deadline_ms: 1000,
        guest_memory_mb: 256,
        guest_max_batch_bytes: 16 * 1024 * 1024,
        apply: "count".into(),
        listen: None,
        admin_token: None,
        admin_token_file: None,
        query_token: None,
        query_max_bytes: crate::serve::MAX_QUERY,
        watch_guest: false,
        query_subject: None,
        query_reply_prefix: "_INBOX.".into(),
        catch_up: true,
        repair: "auto".into(),
        on_recreated: "refuse".into(),
        restore_from: None,
        defer_grace_secs: 1800,
        batch_window_ms: 10,
        batch_max: 100,
        channel: 256,
        creds_file: None,
    };
    let (_keep, never) = tokio::sync::watch::channel(false);
    let first = run_fold(&args, never.clone()).await?;
    println!(
        "first run ({}): folded to cursor {} ({} updates delivered: the state-sync re-list)",
        guest.display(),
        first.cursor,
        first.delivered
    );

    // Second run: live, serving queries, resuming from the cursor.
    args.catch_up = false;
    args.listen = Some(listen.clone());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let live_args = args.clone();
    let host = tokio::spawn(async move { run_fold(&live_args, stop_rx).await });
    for i in 0..10u32 {
        w.put(
            &format!("route.new{i}.example"),
            "{\"upstream\":\"10.9.9.9:8080\"}".into(),
        )
        .await?;
    }
    w.delete("route.host00000.example").await?;
    let target = first.cursor.revision_or_zero() + 11;
    let mut status = serde_json::Value::Null;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let Ok((200, body)) = crate::serve::call(&listen, "GET", "/status", b"").await {
            status = serde_json::from_slice(&body).unwrap_or_default();
            if status["applied_through"].as_u64() >= Some(target) {
                break;
            }
        }
    }
    println!("\n$ curl -s http://{listen}/status");
    println!("{status}");
    for host_name in ["host00042.example", "new7.example", "host00000.example"] {
        let (code, body) =
            crate::serve::call(&listen, "POST", "/query", host_name.as_bytes()).await?;
        println!(
            "\n$ curl -s -d {host_name} http://{listen}/query\n{code} {}",
            String::from_utf8_lossy(&body).trim_end()
        );
    }
    let _ = stop_tx.send(true);
    let second = host.await.context("host task")??;
    println!(
        "\nsecond run resumed from its cursor: {} updates delivered (a delta, not a replay), stopped at cursor {}",
        second.delivered, second.cursor
    );
    conn.shutdown().await;
    if second.delivered != 11 || second.cursor.revision_or_zero() != target {
        bail!(
            "demo: expected the resume to deliver exactly 11 updates through {target}, got {} through {}",
            second.delivered,
            second.cursor
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_file_is_a_json_object_of_strings_and_the_command_line_overrides_it() {
        let file = config_from_json(br#"{"region": "eu", "tier": "edge"}"#).expect("parses");
        let cli = parse_config(&["tier=core".to_string(), "x=1".to_string()]).expect("parses");
        assert_eq!(
            merge_config(file, cli),
            [("region", "eu"), ("tier", "core"), ("x", "1")]
                .map(|(k, v)| (k.to_string(), v.to_string()))
        );
        for (bad, why) in [
            (&br#"{"n": 3}"#[..], "is not a string"),
            (b"[\"a\"]", "JSON object"),
            (b"{", "not JSON"),
        ] {
            let e = config_from_json(bad).expect_err("refused");
            assert!(e.contains(why), "{e}");
        }
    }
}
