//! The tasks that run beside the fold: the `--listen` endpoint, `--watch-guest`, the guest
//! channel's follower (`--guest-channel`: `channel.rs`), the NATS
//! services (`--query-subject`, `--write-subject`: `side/nats.rs`) and the status reporter
//! (`status.json`, hydration progress). They reach the fold only through its control channel,
//! between batches. The node has one `ServeState`: what the endpoint serves is what the NATS
//! query service asks through, so every query, whichever way it came, goes through
//! `serve::ask_one` or `serve::ask_many`.

use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use foldhost_core::kv::WatchScope;
use foldhost_core::status::FoldStatus;
use foldhost_core::status::StatusReport;
use foldhost_fold::applied::{AppliedError, Control, Finished};
use foldhost_guest::guest::GuestEngine;
use foldhost_nats::NatsConnection;

use super::{
    NodeConfig, NodeError, RunSummary, final_status, live_status, signalled, write_status_file,
};

mod nats;

/// The running side tasks of a node.
pub(super) struct SideTasks {
    /// The `--listen` server, if any.
    server: Option<JoinHandle<()>>,
    /// A channel follower's name claim, freed once the follower has stopped.
    claim: Option<Arc<super::claim::NameClaim>>,
    /// `--watch-guest`, `--query-subject`, the reporter.
    others: Vec<JoinHandle<()>>,
    /// The reason the fold stopped, shown by `/status` once it has.
    fatal: Arc<std::sync::Mutex<Option<String>>>,
    /// The host's fixed facts.
    base: StatusReport,
    /// The last export round, shown by `/status`.
    last_export: Arc<std::sync::Mutex<Option<foldhost_core::status::ExportRoundReport>>>,
}

impl SideTasks {
    /// Starts the side tasks `cfg` asks for; `control` is the fold's control channel.
    #[allow(clippy::too_many_arguments)] // one call site; each argument a different part of the node
    pub(super) async fn start(
        cfg: &NodeConfig,
        conn: &NatsConnection,
        base: &StatusReport,
        status: &Arc<FoldStatus>,
        scope: &WatchScope,
        engine: Option<Arc<GuestEngine>>,
        transport: Option<Arc<foldhost_artifact::transport::ArtifactTransport>>,
        control: mpsc::Sender<Control>,
        follower: Option<super::channel::Follower>,
        fold: FoldAccess,
    ) -> Result<SideTasks, NodeError> {
        let (write, mut others) =
            start_write_path(cfg, &fold.kv, scope, status, fold.ledger, &control);
        let fatal: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
        let last_export: Arc<std::sync::Mutex<Option<foldhost_core::status::ExportRoundReport>>> =
            Arc::default();
        let mut base = base.clone();
        // The fold as every query reaches it, over HTTP and over NATS: one state, so both go
        // through `serve::ask_one` and `serve::ask_many`.
        let parts = StateParts {
            base: base.clone(),
            status: status.clone(),
            scope: scope.to_string(),
            engine: engine.clone(),
            control: control.clone(),
            fatal: fatal.clone(),
            last_export: last_export.clone(),
            stream: fold.stream.clone(),
            write: write.clone(),
            read_key: fold.read_key,
            state_folds: fold.state.clone(),
            queries: fold.queries,
        };
        let (server, served) = serve(cfg, &mut base, status, parts).await?;
        if cfg.watch_guest
            && let (Some(path), Some(engine)) = (cfg.guest.clone(), engine)
        {
            others.push(in_span(watch_guest_file(path, engine, control.clone())));
        }
        let mut claim = None;
        if let Some(follower) = follower {
            claim = Some(follower.claim());
            others.push(in_span(follower.run()));
        }
        others.extend(nats::start(cfg, conn, served, &write).await?);
        others.extend(freshness_watch(
            cfg,
            &transport,
            &fold.kv,
            &fold.stream,
            scope,
            status,
        ));
        if let (Some(every), Some(transport), Some((_, key))) =
            (cfg.export_every, transport, &cfg.artifacts)
        {
            let mut rounds =
                export_rounds(cfg, conn, transport, scope, &control, &last_export, status).await?;
            (rounds.stream, rounds.state) = (fold.stream, fold.state);
            tracing::info!(event = "export_rounds_started", every_s = every.as_secs_f64(), key = %key, "export rounds on");
            others.push(in_span(rounds.run(every)));
        }
        others.push(in_span(report_progress(
            cfg.store.clone(),
            base.clone(),
            status.clone(),
            last_export.clone(),
        )));
        Ok(SideTasks {
            server,
            claim,
            others,
            fatal,
            base,
            last_export,
        })
    }

    /// After the fold returned: stops the side tasks, writes the final `status.json`, and — when
    /// the fold failed and `--listen` is up — keeps serving `/status` (saying why) until
    /// `shutdown`.
    pub(super) async fn finish(
        &mut self,
        cfg: &NodeConfig,
        status: &FoldStatus,
        result: Result<Finished, AppliedError>,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<RunSummary, NodeError> {
        for t in &self.others {
            t.abort();
        }
        // Awaited so each task's future (and the store handle it holds) is gone before the store
        // is closed; an aborted task resolves at its next await point.
        for t in self.others.drain(..) {
            let _ = t.await;
        }
        // The follower has stopped: its name is free for the next start.
        if let Some(claim) = self.claim.take() {
            claim.release().await;
        }
        let mut last = final_status(&self.base, status, &result);
        last.last_export = self.last_export.lock().ok().and_then(|l| l.clone());
        write_status_file(&cfg.store, &last);
        let outcome = match result {
            Ok(finished) => Ok(RunSummary {
                cursor: finished.cursor,
                delivered: status.delivered.load(Ordering::Relaxed),
            }),
            Err(e) => {
                if let Ok(mut f) = self.fatal.lock() {
                    *f = Some(e.to_string());
                }
                Err(NodeError::Applied(e))
            }
        };
        if let Some(server) = self.server.take() {
            if let Err(e) = &outcome {
                // The fold has stopped; the host stays up so `/status` can say why.
                tracing::error!(event = "fold_failed", error = %e, "fold failed; still serving /status until signalled");
                signalled(shutdown).await;
            }
            server.abort();
        }
        outcome
    }
}

/// A side task, spawned in the fold's span.
fn in_span<F>(task: F) -> JoinHandle<()>
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    tokio::spawn(tracing::Instrument::in_current_span(task))
}

/// The fold's write path, with the tasks that keep it: the apply-rate sampler, the ledger's
/// sweep and the stream's positions.
fn start_write_path(
    cfg: &NodeConfig,
    kv: &Arc<foldhost_nats::NatsKv>,
    scope: &WatchScope,
    status: &Arc<FoldStatus>,
    ledger: crate::write::LedgerLookup,
    control: &mpsc::Sender<Control>,
) -> (Arc<crate::write::WritePath>, Vec<JoinHandle<()>>) {
    let mut others = Vec::new();
    let (rate, sampler) = crate::write::ApplyRate::start(status.clone());
    others.push(sampler);
    let write = Arc::new(crate::write::WritePath {
        kv: kv.clone(),
        bucket: cfg.bucket.clone(),
        scope: scope.clone(),
        status: status.clone(),
        ledger,
        rate,
    });
    others.push(in_span(sweep_ledger(cfg.ledger_retention, control.clone())));
    others.push(in_span(read_positions(write.kv.clone(), status.clone())));
    (write, others)
}

/// The node's one serve state, and the `--listen` server serving it if there is one (`base`
/// then names its address, and `status.json` says so at once).
async fn serve(
    cfg: &NodeConfig,
    base: &mut StatusReport,
    status: &Arc<FoldStatus>,
    parts: StateParts,
) -> Result<(Option<JoinHandle<()>>, Arc<crate::serve::ServeState>), NodeError> {
    Ok(match &cfg.listen {
        Some(l) => {
            let (server, served) = listen(cfg, l, base, parts).await?;
            // At once, not at the reporter's first write: with `--listen HOST:0` this is where
            // the port the system chose is found.
            write_status_file(&cfg.store, &live_status(base, status));
            (Some(server), served)
        }
        None => {
            let policy = unserved_policy()
                .map_err(|e| NodeError::Config(format!("a query state's tokens: {e}")))?;
            let ready_max_lag = crate::serve::DEFAULT_READY_MAX_LAG;
            (None, Arc::new(parts.build(cfg, policy, ready_max_lag)))
        }
    })
}

/// The newest artifact's freshness, watched when the node has an artifact store and key.
fn freshness_watch(
    cfg: &NodeConfig,
    transport: &Option<Arc<foldhost_artifact::transport::ArtifactTransport>>,
    kv: &Arc<foldhost_nats::NatsKv>,
    stream: &super::export::StreamSource,
    scope: &WatchScope,
    status: &Arc<FoldStatus>,
) -> Option<JoinHandle<()>> {
    let (Some(transport), Some((_, key))) = (transport, &cfg.artifacts) else {
        return None;
    };
    Some(in_span(super::freshness::watch(
        super::freshness::Checked {
            kv: kv.clone(),
            transport: transport.clone(),
            key: key.clone(),
            stream: stream.clone(),
            scope: scope.clone(),
        },
        status.clone(),
    )))
}

/// Binds `--listen`, settles the admin token (given, read from a file, or generated beside the
/// store), and serves `/status`, `/query`, `/swap` and `/export`; returns the server's task and
/// the state it serves, which the NATS services serve too.
async fn listen(
    cfg: &NodeConfig,
    l: &super::ListenConfig,
    base: &mut StatusReport,
    mut parts: StateParts,
) -> Result<(JoinHandle<()>, Arc<crate::serve::ServeState>), NodeError> {
    let io = |source| NodeError::Listen {
        addr: l.addr.clone(),
        source,
    };
    // On a listener of every fold of the process, the fold registers instead of binding.
    let (listener, local) = match &l.shared {
        Some(shared) => (None, shared.addr),
        None => {
            let listener = tokio::net::TcpListener::bind(&l.addr).await.map_err(io)?;
            let local = listener.local_addr().map_err(io)?;
            (Some(listener), local)
        }
    };
    let super::tokens::Settled {
        policy,
        admin_file: token_file,
        write_file: write_token_file,
        ..
    } = super::tokens::settle(cfg, l, local).map_err(io)?;
    base.listen = Some(local.to_string());
    base.admin_token_file =
        token_file.map(|f| std::path::absolute(&f).unwrap_or(f).display().to_string());
    base.write_token_file =
        write_token_file.map(|f| std::path::absolute(&f).unwrap_or(f).display().to_string());
    parts.base = base.clone();
    let state = Arc::new(parts.build(cfg, policy, l.ready_max_lag));
    match (listener, &l.shared) {
        (Some(listener), _) => Ok((
            tokio::spawn(tracing::Instrument::in_current_span(crate::serve::serve(
                listener,
                state.clone(),
            ))),
            state,
        )),
        (None, Some(shared)) => {
            shared.registry.insert(cfg.fold_name(), state.clone());
            // Nothing to serve of its own: the process's listener serves the fold.
            Ok((tokio::spawn(std::future::pending()), state))
        }
        (None, None) => unreachable!("a listener is bound unless one is shared"),
    }
}

/// What a node's [`crate::serve::ServeState`] is built from, but its policy.
struct StateParts {
    /// The host's fixed facts (with the listener's address and token files once bound).
    base: StatusReport,
    status: Arc<FoldStatus>,
    scope: String,
    engine: Option<Arc<GuestEngine>>,
    control: mpsc::Sender<Control>,
    fatal: Arc<std::sync::Mutex<Option<String>>>,
    last_export: Arc<std::sync::Mutex<Option<foldhost_core::status::ExportRoundReport>>>,
    stream: super::export::StreamSource,
    write: Arc<crate::write::WritePath>,
    read_key: crate::write::KeyReader,
    state_folds: Vec<foldhost_artifact::artifact::StateFoldSource>,
    queries: foldhost_fold::applied::Queries,
}

impl StateParts {
    /// The node's one serve state: what `--listen` serves, and what the NATS services ask the
    /// fold through.
    fn build(
        self,
        cfg: &NodeConfig,
        policy: crate::serve::AccessPolicy,
        ready_max_lag: u64,
    ) -> crate::serve::ServeState {
        let StateParts {
            base,
            status,
            scope,
            engine,
            control,
            fatal,
            last_export,
            stream,
            write,
            read_key,
            state_folds,
            queries,
        } = self;
        let render_status = status.clone();
        crate::serve::ServeState {
            status: Box::new(move || {
                let mut r = live_status(&base, &render_status);
                r.last_export = last_export.lock().ok().and_then(|l| l.clone());
                if let Some(f) = fatal.lock().ok().and_then(|f| f.clone()) {
                    r.state = "failed".into();
                    r.error = Some(f);
                }
                r
            }),
            control,
            queries,
            engine,
            policy,
            backend: cfg.backend,
            scope,
            stream,
            state_folds,
            ready_max_lag,
            folds: vec![crate::metrics::FoldSource {
                name: cfg.fold_name().to_string(),
                status: status.clone(),
            }],
            registry: None,
            channel: cfg.guest_channel.as_ref().map(|g| g.channel.clone()),
            positions: Some(crate::write::Positions {
                status,
                rate: write.rate.clone(),
            }),
            read_key: Some(read_key),
            write: Some(write),
        }
    }
}

/// The policy of a serve state no listener serves (a node with `--query-subject` and no
/// `--listen`): its tokens random and held by no one, its address none.
fn unserved_policy() -> std::io::Result<crate::serve::AccessPolicy> {
    Ok(crate::serve::AccessPolicy {
        admin_token: crate::serve::random_token()?,
        write_token: crate::serve::random_token()?,
        query_token: Some(crate::serve::random_token()?),
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        hosts: Vec::new(),
        query_open: false,
        limits: crate::serve::Limits::default(),
    })
}

/// What the side tasks read of the fold: its stream identity (exports), its operation ledger and
/// its bucket (writes).
pub(super) struct FoldAccess {
    /// The stream the fold records (weak: `None` once the fold stopped).
    pub(super) stream: super::export::StreamSource,
    /// The ledger's rows and watermark.
    pub(super) ledger: crate::write::LedgerLookup,
    /// The bucket writes publish to.
    pub(super) kv: Arc<foldhost_nats::NatsKv>,
    /// One key of the committed fold (`POST /get`).
    pub(super) read_key: crate::write::KeyReader,
    /// The state buckets' folds, carried in every export beside the fold's own.
    pub(super) state: Vec<foldhost_artifact::artifact::StateFoldSource>,
    /// Where every query goes: the query instance once level, the fold loop before
    /// (docs/design.md, "Queries off the fold's path").
    pub(super) queries: foldhost_fold::applied::Queries,
}

/// Sweeps the operation ledger every [`LEDGER_SWEEP_PERIOD`] (the first time at once): rows
/// recorded more than `retention` ago go, in steps of at most [`foldhost_core::ledger::SWEEP_STEP`] rows,
/// each one commit of the fold between two of its batches ([`Control::SweepLedger`]).
pub(super) async fn sweep_ledger(retention: std::time::Duration, control: mpsc::Sender<Control>) {
    let mut tick = tokio::time::interval(LEDGER_SWEEP_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let cutoff = foldhost_core::protocol::ledger_cutoff(now, retention.as_millis() as u64);
        let mut after: Option<String> = None;
        let mut removed = 0u64;
        let failed = loop {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let asked = Control::SweepLedger {
                cutoff_unix_ms: cutoff,
                after: after.take(),
                reply: tx,
            };
            if control.send(asked).await.is_err() {
                return;
            }
            match rx.await {
                Err(_) => return,
                Ok(Ok((n, next))) => {
                    removed += n;
                    match next {
                        Some(k) => after = Some(k),
                        None => break None,
                    }
                }
                Ok(Err(e)) => break Some(e),
            }
        };
        match failed {
            Some(e) => {
                tracing::warn!(event = "ledger_sweep_failed", error = %e, "the operation ledger could not be swept; the next period tries again")
            }
            None if removed > 0 => {
                tracing::info!(
                    event = "ledger_swept",
                    rows = removed,
                    cutoff_unix_ms = cutoff,
                    "operation ledger swept"
                )
            }
            None => {}
        }
    }
}

/// Reads the stream's first and last sequence into the status every [`POSITIONS_PERIOD`] (one
/// stream-info request each; a failed read leaves the last figures).
async fn read_positions(kv: Arc<foldhost_nats::NatsKv>, status: Arc<FoldStatus>) {
    let mut tick = tokio::time::interval(POSITIONS_PERIOD);
    loop {
        tick.tick().await;
        if let Ok(p) = kv.positions().await {
            status
                .stream_first_sequence
                .store(p.first_sequence, Ordering::Relaxed);
            status
                .stream_last_sequence
                .store(p.last_sequence, Ordering::Relaxed);
        }
    }
}

/// How often the stream's first and last sequence are read for the status.
const POSITIONS_PERIOD: std::time::Duration = std::time::Duration::from_secs(5);

/// How often the operation ledger is swept.
const LEDGER_SWEEP_PERIOD: std::time::Duration = std::time::Duration::from_secs(3600);

/// The export rounds `--export-every` asks for: the lease in its own NATS KV bucket (created when
/// absent), this node's name in it, a scratch directory beside the store.
async fn export_rounds(
    cfg: &NodeConfig,
    conn: &NatsConnection,
    transport: Arc<foldhost_artifact::transport::ArtifactTransport>,
    scope: &WatchScope,
    control: &mpsc::Sender<Control>,
    last: &Arc<std::sync::Mutex<Option<foldhost_core::status::ExportRoundReport>>>,
    fold: &Arc<FoldStatus>,
) -> Result<super::ExportRounds, NodeError> {
    let key = cfg
        .artifacts
        .as_ref()
        .map(|(_, k)| k.as_str())
        .ok_or_else(|| NodeError::Config("export rounds need --artifact-key".into()))?;
    let node_id = cfg.node_id.clone().unwrap_or_else(|| {
        format!(
            "{}#{}",
            std::path::absolute(&cfg.store)
                .unwrap_or_else(|_| cfg.store.clone())
                .display(),
            std::process::id()
        )
    });
    let name = cfg
        .store
        .file_name()
        .map_or_else(|| "store".into(), |n| n.to_string_lossy().into_owned());
    Ok(super::ExportRounds {
        transport,
        key: key.to_string(),
        lease: lease_slot(conn, cfg, key, node_id).await?,
        lease_ttl: cfg.export_lease,
        scratch: cfg
            .store
            .parent()
            .unwrap_or_else(|| std::path::Path::new("."))
            .join(format!(".{name}.export")),
        backend: cfg.backend,
        scope: scope.to_string(),
        control: control.clone(),
        last: last.clone(),
        fold: fold.clone(),
        stream: Arc::new(|| None),
        state: Vec::new(),
    })
}

/// The lease of `key` in `--lease-bucket` (created when absent), opened by the first round that
/// needs it: a cluster still electing a leader at start fails that round, never the node.
async fn lease_slot(
    conn: &NatsConnection,
    cfg: &NodeConfig,
    key: &str,
    node_id: String,
) -> Result<super::export::LeaseSlot, NodeError> {
    let client = conn.client().await?;
    let timeout = conn.op_timeout();
    let bucket = cfg.lease_bucket.clone();
    let (lease_key, ttl) = (format!("export.{key}"), cfg.export_lease);
    Ok(super::export::LeaseSlot::opening(Box::new(move || {
        let (client, bucket, lease_key, node_id) = (
            client.clone(),
            bucket.clone(),
            lease_key.clone(),
            node_id.clone(),
        );
        Box::pin(async move {
            let config = foldhost_core::bucket::BucketConfig {
                create: true,
                max_bytes: None,
                ..foldhost_core::bucket::BucketConfig::default()
            };
            let kv = foldhost_nats::NatsKv::open(client, &bucket, &config, timeout)
                .await
                .map_err(|e| format!("lease bucket {bucket}: {e}"))?;
            Ok(foldhost_nats::lease::Lease::new(
                kv, lease_key, node_id, ttl,
            ))
        })
    })))
}

/// `--watch-guest`: swaps the guest when the file's bytes change. A file that fails to compile or
/// is refused leaves the running guest in place (and is retried only when it changes again).
async fn watch_guest_file(path: PathBuf, engine: Arc<GuestEngine>, control: mpsc::Sender<Control>) {
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
        tracing::info!(event = "guest_file_changed", guest = %what, "guest file changed; swapping");
        // Compile off the fold's path; the fold's swap then finds it in the cache.
        let compiled = {
            let (engine, bytes, what) = (engine.clone(), bytes.clone(), what.clone());
            tokio::task::spawn_blocking(move || engine.prepare(&what, &bytes).map(|_| ())).await
        };
        if let Ok(Err(e)) = compiled {
            tracing::warn!(event = "swap_refused", error = %e, "swap refused; the running guest stays");
            continue;
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let swap = Control::Swap {
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

/// Keeps `status.json` current, shows hydration progress (a bar on a terminal, log lines
/// otherwise) and samples the lag into the status's bounded `lag_history` (`sample_lag`) at its
/// first tick, then every [`foldhost_core::status::LAG_SAMPLE_PERIOD`].
async fn report_progress(
    dir: PathBuf,
    base: StatusReport,
    status: Arc<FoldStatus>,
    last_export: Arc<std::sync::Mutex<Option<foldhost_core::status::ExportRoundReport>>>,
) {
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
    let period = Duration::from_millis(250);
    let mut tick = tokio::time::interval(period);
    let sample_every =
        (foldhost_core::status::LAG_SAMPLE_PERIOD.as_millis() / period.as_millis()) as u64;
    let mut n = 0u64;
    let mut hydrated_logged = false;
    loop {
        tick.tick().await;
        if n.is_multiple_of(sample_every) {
            status.sample_lag();
        }
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
                tracing::info!(event = "fold_hydrating", committed, total, "hydrating");
            }
        } else if !hydrated_logged {
            hydrated_logged = true;
            // The fold says it is level (`fold_caught_up`).
            if let Some(b) = &bar {
                b.finish_and_clear();
            }
        }
        if n.is_multiple_of(4) {
            let mut report = live_status(&base, &status);
            report.last_export = last_export.lock().ok().and_then(|l| l.clone());
            write_status_file(&dir, &report);
        }
    }
}
