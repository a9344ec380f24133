//! The composition root of a running host: [`Node::run`] takes a typed [`NodeConfig`] and wires
//! the guest, the NATS bucket, the store, the `--listen` endpoint, the NATS query service, the
//! status file and the fold loop, in that order, and takes them down again.
//!
//! Invariants (each a step of [`Node::run`], in this order):
//! - **No connection before a proven guest**: the guest is read, compiled, link-checked and started
//!   (instantiate, `manifest`, `init` against an empty fold) before anything is connected. A node
//!   following a guest channel (`channel.rs`) first reads the channel and fetches its version on a
//!   client of its own, read-only; the fold's connection and the store still wait for the proof.
//! - **No store before the server answers and the stream is the fold's**: the bucket is opened
//!   first, and a fold of another stream is refused through a read-only open
//!   (`identity::refuse_another_stream`), so a refused run writes nothing.
//! - **Every default is defined once**, in [`NodeConfig::new`] and the types it holds
//!   ([`BatchConfig`], [`GuestLimits`]); the command line takes its defaults from there.
//! - **A failed fold with `--listen` keeps serving `/status`** (saying why) until shutdown.

mod channel;
mod claim;
mod config;
mod denial;
mod export;
mod freshness;
mod identity;
pub(crate) mod lanes;
mod shared;
mod side;
mod stop;
mod tokens;

pub use channel::GuestChannel;
pub(crate) use claim::default_node_name;
pub(crate) use shared::{SharedListen, bind_shared};

pub use config::DEFAULT_LEASE_BUCKET;
pub(crate) use config::{DEFAULT_QUERY_REPLY_PREFIX, NodeConfig, RunSummary};
pub use export::{ExportRounds, RoundOutcome};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use foldhost_core::bucket::{BucketConfig, ConnectOptions};
use foldhost_core::kv::{KvError, WatchCursor, WatchScope};
use foldhost_core::protocol::{OnRecreated, RepairMode};
use foldhost_core::snapshot::{SnapshotError, SnapshotStore};
use foldhost_core::status::FoldStatus;
use foldhost_core::status::StatusReport;
use foldhost_core::storedir::{self, AnyStore, Backend, StoreDirError};
use foldhost_core::view::SharedStore;
use foldhost_fold::applied::{
    AppliedError, Apply, ApplyError, BatchConfig, CountingApply, WatchOptions, watch_applied,
};
use foldhost_guest::guest::{GuestApply, GuestEngine, GuestError, GuestLimits};
use foldhost_nats::NatsConnection;

/// Why a node did not start, or stopped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NodeError {
    /// The configuration cannot run (a flag combination, a limit over its ceiling).
    #[error("{0}")]
    Config(String),
    /// The guest could not be read, compiled, linked or started.
    #[error(transparent)]
    Guest(#[from] GuestError),
    /// The NATS server or the bucket could not be reached or opened.
    #[error(transparent)]
    Nats(#[from] KvError),
    /// The store could not be opened or read.
    #[error("open store {}", path.display())]
    Store {
        /// The store directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: StoreDirError,
    },
    /// Reading the fold failed.
    #[error(transparent)]
    Fold(#[from] SnapshotError),
    /// The store holds a fold this run must not resume (another stream's, or data without a
    /// cursor and no repair allowed); the fold is untouched.
    #[error("{0}")]
    Refused(String),
    /// Hydrating the guest from the fold failed.
    #[error("hydrate: {0}")]
    Hydrate(ApplyError),
    /// The `--listen` endpoint could not be set up.
    #[error("--listen {addr}: {source}")]
    Listen {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The fold stopped (the watch, the store, the applier or a repair).
    #[error(transparent)]
    Applied(#[from] AppliedError),
    /// The server refused something the node's own work needs for its user's permissions.
    #[error(
        "the server refused this node's {denied} to {subject}: its user lacks the grant (`foldhost grants` prints what a node needs)"
    )]
    Denied {
        /// `publish` or `subscribe`.
        denied: &'static str,
        /// The subject.
        subject: String,
    },
    /// The artifact transport (`--artifacts`).
    #[error(transparent)]
    Transport(#[from] foldhost_artifact::transport::TransportError),
    /// A state bucket's fold stopped (docs/state.md).
    #[error("{0}")]
    State(String),
    /// A task of the node panicked or was cancelled.
    #[error("{0}: {1}")]
    Task(&'static str, String),
}

/// The built-in native appliers (`--apply`), used when no guest is given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum NativeApply {
    /// Counts updates (the reference applier).
    #[default]
    Count,
}

/// The `--listen` endpoint's settings.
#[derive(Clone, Debug)]
pub(crate) struct ListenConfig {
    /// Address to bind (`127.0.0.1:0` picks a free port).
    pub addr: String,
    /// The admin token (`/swap`, `/export`); `None` with no file: one is generated beside the store.
    pub admin_token: Option<String>,
    /// A file holding the admin token.
    pub admin_token_file: Option<PathBuf>,
    /// The write token (`/write`); `None` with no file: one is generated beside the store.
    pub write_token: Option<String>,
    /// A file holding the write token.
    pub write_token_file: Option<PathBuf>,
    /// A token `/status` and `/query` must present. With none (and no `query_token_file`), a
    /// loopback listener answers them to anyone, and any other listener (a wildcard one
    /// included) to the token it generates into `STORE/query-token` (mode 0600), unless
    /// `query_open` ([`foldhost_core::protocol::query_access`]).
    pub query_token: Option<String>,
    /// A file holding the query token.
    pub query_token_file: Option<PathBuf>,
    /// Answer `/status` and `/query` without a token on a listener beyond loopback: anyone who
    /// can reach the address can query the guest and flood it with queries.
    pub query_open: bool,
    /// The names clients reach the listener by (`Host`, with or without a port); beside its own
    /// addresses, the only ones it admits ([`foldhost_core::protocol::host_names_listener`]).
    pub hosts: Vec<String>,
    /// Largest `/query` body accepted.
    pub query_max_bytes: usize,
    /// Records a fold may be behind and still be ready (`GET /readyz`).
    pub ready_max_lag: u64,
    /// Set when one listener serves every fold of the process ([`bind_shared`]): the fold
    /// registers there instead of binding `addr`.
    pub shared: Option<SharedListen>,
}

impl ListenConfig {
    /// Serving `addr` with every other setting at its default.
    pub fn new(addr: impl Into<String>) -> Self {
        ListenConfig {
            addr: addr.into(),
            admin_token: None,
            admin_token_file: None,
            write_token: None,
            write_token_file: None,
            query_token: None,
            query_token_file: None,
            query_open: false,
            hosts: Vec::new(),
            query_max_bytes: crate::serve::MAX_QUERY,
            ready_max_lag: crate::serve::DEFAULT_READY_MAX_LAG,
            shared: None,
        }
    }
}

/// A running host (see the module docs for the order of its steps).
pub(crate) struct Node;

impl Node {
    /// Runs a host with `cfg` until `shutdown` turns true (or, with `catch_up`, until it is level
    /// with the stream). Writes the final `status.json` on every exit after the store opened.
    pub async fn run(
        cfg: NodeConfig,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<RunSummary, NodeError> {
        // Every line of the fold, its side tasks and its state buckets' folds names the fold
        // (docs/operations.md, "Log events").
        let span = tracing::info_span!("fold", fold = %cfg.fold_name());
        tracing::Instrument::instrument(Self::run_fold(cfg, shutdown), span).await
    }

    async fn run_fold(
        cfg: NodeConfig,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<RunSummary, NodeError> {
        let Opened {
            channel_start,
            proven,
            conn,
            kv,
            shared,
        } = open(&cfg).await?;
        let status = Arc::new(FoldStatus::default());
        let (mut apply, scope, lanes, link) =
            build_applier(&cfg, proven.as_ref(), &shared, &conn, &status).await?;
        tracing::info!(event = "fold_started", bucket = %cfg.bucket, scope = %scope, store = %cfg.store.display(), backend = cfg.backend.as_str(), guest = %apply.describe(), cursor = %shared.read()?.cursor(), "folding");
        let mut base = base_report(&cfg, apply.describe(), proven.as_ref(), &scope);
        let (live_lanes, gone_lanes) = lanes::reports(&cfg, &lanes);
        base.state_buckets = gone_lanes;
        let _ = status.lanes.set(live_lanes);
        let mut written = vec![cfg.bucket.clone()];
        written.extend(lanes.iter().map(|l| l.decl.bucket.clone()));
        let (control_tx, control_rx) = tokio::sync::mpsc::channel(64);
        // Where queries go: a query instance beside the fold once one is level (docs/design.md,
        // "Queries off the fold's path"), the fold loop until then.
        let queries =
            foldhost_fold::applied::Queries::reporting(control_tx.clone(), status.clone());
        let state_exports = lanes::export_sources(&lanes);
        let mut running =
            lanes::Running::start(&cfg, lanes, apply.describe(), &control_tx, &link, &shutdown);
        let engine = proven.map(|p| p.engine);
        let follower = follower(&cfg, channel_start, &engine, &control_tx, &status);
        let transport = artifact_transport(&cfg)?;
        let mut tasks = side::SideTasks::start(
            &cfg,
            &conn,
            &base,
            &status,
            &scope,
            engine,
            transport.clone(),
            control_tx,
            follower,
            side::FoldAccess {
                stream: stream_source(&shared),
                ledger: ledger_lookup(&shared),
                kv: kv.clone(),
                read_key: key_reader(&shared),
                state: state_exports,
                queries: queries.clone(),
            },
        )
        .await?;
        let mut opts = watch_options(&cfg, scope, transport, kv.clone());
        if cfg.listen.is_some() || cfg.query_subject.is_some() {
            opts.queries = Some(queries.clone());
        }
        // Kept to close the store after a clean stop (see `close_store`).
        let closing = shared.clone();
        let cause = stop::StopCause::default();
        let stop = cause.wait(&mut running, &shutdown, &conn, &written);
        let result = watch_applied(
            kv,
            shared,
            apply.as_mut(),
            opts,
            status.clone(),
            Some(control_rx),
            stop,
        )
        .await;
        let outcome = tasks.finish(&cfg, &status, result, shutdown).await;
        let outcome = cause.apply(outcome);
        drop(apply);
        drop(tasks);
        take_down(outcome.is_ok(), closing, &cfg.store, conn).await;
        outcome
    }
}

/// What a fold runs on, opened in the order the module's invariants ask: the guest proven (a
/// channel's read first), then the connection and the bucket, then the store.
struct Opened {
    channel_start: Option<channel::ChannelStart>,
    proven: Option<ProvenGuest>,
    conn: NatsConnection,
    kv: Arc<foldhost_nats::NatsKv>,
    shared: SharedStore<AnyStore>,
}

async fn open(cfg: &NodeConfig) -> Result<Opened, NodeError> {
    cfg.check()?;
    // A channel's node reads the channel (a client of its own) for the guest it starts with.
    let mut channel_start = match &cfg.guest_channel {
        Some(gc) => Some(channel::start(cfg, gc).await?),
        None => None,
    };
    let proven = prove_guest(cfg, channel_start.as_mut()).await?;
    // Connect before touching the store: a run that cannot reach its server writes nothing.
    let (conn, kv) = connect(cfg).await?;
    let shared = open_store(cfg).await?;
    tracing::debug!(store = %cfg.store.display(), "store opened");
    if let Some(p) = &proven {
        p.engine.set_random_seed(guest_seed(cfg)?);
    }
    Ok(Opened {
        channel_start,
        proven,
        conn,
        kv,
        shared,
    })
}

/// The guest channel's follower, when the node follows a channel with a guest of its own.
fn follower(
    cfg: &NodeConfig,
    channel_start: Option<channel::ChannelStart>,
    engine: &Option<Arc<GuestEngine>>,
    control_tx: &tokio::sync::mpsc::Sender<foldhost_fold::applied::Control>,
    status: &Arc<FoldStatus>,
) -> Option<channel::Follower> {
    match (channel_start, &cfg.guest_channel, engine) {
        (Some(start), Some(gc), Some(engine)) => Some(channel::Follower::new(
            start,
            gc.clone(),
            engine.clone(),
            control_tx.clone(),
            status.clone(),
        )),
        _ => None,
    }
}

/// After the fold stopped: the store closed on a clean stop (see `close_store`), then the
/// connection.
async fn take_down(
    clean: bool,
    closing: SharedStore<AnyStore>,
    store: &Path,
    conn: NatsConnection,
) {
    if clean {
        close_store(closing, store).await;
    }
    {
        use foldhost_core::bucket::Connection as _;
        conn.shutdown().await;
    }
}

/// Opens the connection and the bucket; with `--on-recreated refuse`, refuses a store whose
/// stream is not the bucket's (before the store is opened for writing).
async fn connect(
    cfg: &NodeConfig,
) -> Result<(NatsConnection, Arc<foldhost_nats::NatsKv>), NodeError> {
    let mut copts = cfg.nats.clone();
    copts.op_timeout = cfg.op_timeout;
    copts.watch_heartbeat = cfg.watch_heartbeat;
    let conn = NatsConnection::open(copts).await?;
    {
        use foldhost_core::bucket::Connection as _;
        let caps = conn.capabilities();
        tracing::info!(event = "nats_server_capabilities", server = %caps.server_version, message_ttl = caps.message_ttl, conditional_publish = caps.conditional_publish, direct_get = caps.direct_get, "server capabilities");
    }
    let kv = conn
        .bucket(
            &cfg.bucket,
            &BucketConfig {
                create: cfg.create_bucket,
                ..BucketConfig::default()
            },
        )
        .await?;
    if cfg.on_recreated == OnRecreated::Refuse {
        let cursor = identity::refuse_another_stream(&cfg.store, &cfg.bucket, &kv).await?;
        // The resume's gap is read while the store opens (a watch from another cursor, or of
        // a narrower scope, discards it).
        if let Some(rev) = cursor.revision() {
            kv.prefetch_resume_gap(rev);
        }
    }
    Ok((conn, kv))
}

/// The guests' random seed: the configured one, or the store's own (made at its first run).
fn guest_seed(cfg: &NodeConfig) -> Result<[u8; 32], NodeError> {
    match cfg.guest_seed {
        Some(seed) => Ok(seed),
        None => foldhost_core::storedir::guest_seed::load_or_create(&cfg.store).map_err(|source| {
            NodeError::Store {
                path: cfg.store.clone(),
                source,
            }
        }),
    }
}

/// The operation ledger as the write path reads it: the row of an id in the ledger's life, the
/// watermark, the life and the cursor they were read at, from one view of the committed fold
/// (weak, as the stream source: the listener outlives the fold).
/// The stream the fold records. Weak: the listener and the export rounds outlive the fold, and a
/// store still shared at the stop leaves no clean-stop record (`close_store`).
fn stream_source(shared: &SharedStore<AnyStore>) -> export::StreamSource {
    let store = shared.downgrade();
    Arc::new(move || {
        let store = store.upgrade()?;
        let store = store.read().ok()?;
        foldhost_artifact::artifact::stream_of(&*store)
            .ok()
            .flatten()
    })
}

/// The artifact transport of `--artifacts`, if any.
fn artifact_transport(
    cfg: &NodeConfig,
) -> Result<Option<Arc<foldhost_artifact::transport::ArtifactTransport>>, NodeError> {
    Ok(match &cfg.artifacts {
        Some((url, _)) => Some(Arc::new(
            foldhost_artifact::transport::ArtifactTransport::from_url(
                url,
                cfg.allow_non_atomic_pointer,
            )?,
        )),
        None => None,
    })
}

fn ledger_lookup(shared: &SharedStore<AnyStore>) -> crate::write::LedgerLookup {
    let store = shared.downgrade();
    Arc::new(move |op| {
        let store = store.upgrade().ok_or("the fold has stopped")?;
        let s = store
            .read()
            .map_err(|_| "the store is poisoned".to_string())?;
        let (row, watermark, life) =
            foldhost_core::ledger::lookup(&*s, op).map_err(|e| e.to_string())?;
        Ok(crate::write::LedgerView {
            row,
            watermark,
            life,
            cursor: s.cursor().revision_or_zero(),
        })
    })
}

/// One key of the committed fold, as `POST /get` reads it (weak, as the stream source).
fn key_reader(shared: &SharedStore<AnyStore>) -> crate::write::KeyReader {
    let store = shared.downgrade();
    Arc::new(move |key| {
        let store = store.upgrade().ok_or("the fold has stopped")?;
        let s = store
            .read()
            .map_err(|_| "the store is poisoned".to_string())?;
        s.get(key).map_err(|e| e.to_string())
    })
}

/// The status every report of this run starts from.
fn base_report(
    cfg: &NodeConfig,
    guest: String,
    proven: Option<&ProvenGuest>,
    scope: &WatchScope,
) -> StatusReport {
    StatusReport {
        state: "running".into(),
        pid: std::process::id(),
        guest: Some(guest),
        guest_compiled: proven.map(|p| p.prepared.source.as_str().to_string()),
        guest_compile_ms: proven.map(|p| p.prepared.elapsed.as_millis() as u64),
        guest_contract: proven.map(|p| p.prepared.contract.to_string()),
        bucket: cfg.bucket.clone(),
        scope: scope.to_string(),
        backend: cfg.backend.as_str().to_string(),
        ..StatusReport::default()
    }
}

/// The fold loop's options: the batch, the catch-up, the deferral grace and the repairs.
fn watch_options(
    cfg: &NodeConfig,
    scope: WatchScope,
    transport: Option<Arc<foldhost_artifact::transport::ArtifactTransport>>,
    kv: Arc<foldhost_nats::NatsKv>,
) -> WatchOptions {
    WatchOptions {
        scope,
        batch: cfg.batch,
        catch_up: cfg.catch_up,
        defer_grace: cfg.defer_grace,
        repair: foldhost_fold::repair::RepairConfig {
            mode: cfg.repair,
            restore_from: restore_source(cfg, transport),
            lister: Some(kv as Arc<dyn foldhost_core::kv::KvReader>),
            scratch: Some(repair_scratch(&cfg.store)),
            on_recreated: cfg.on_recreated,
            on_diverged: cfg.on_diverged,
            ..Default::default()
        },
        queries: None,
    }
}

/// After a clean stop: closes the store and leaves its clean-stop record, so the next run's
/// identity check needs no read-only open ([`foldhost_core::storedir::closed`]). Best effort: when a
/// handle is still held elsewhere, or the record cannot be written, the next run opens the store
/// to check it, as it would without a record.
async fn close_store(shared: SharedStore<AnyStore>, dir: &Path) {
    let Some(store) = shared.try_into_inner() else {
        tracing::debug!("store still shared at the stop: no clean-stop record");
        return;
    };
    let dir = dir.to_path_buf();
    let closed = tokio::task::spawn_blocking(move || store.close_cleanly(&dir)).await;
    match closed {
        Ok(Ok(())) => tracing::debug!("clean-stop record written"),
        Ok(Err(e)) => {
            tracing::warn!(event = "store_clean_stop_failed", error = %e, "no clean-stop record")
        }
        Err(e) => {
            tracing::warn!(event = "store_clean_stop_failed", error = %e, "no clean-stop record")
        }
    }
}

/// A guest proven to start: its engine (which caches the compiled component) and bytes.
struct ProvenGuest {
    engine: Arc<GuestEngine>,
    bytes: Vec<u8>,
    path: PathBuf,
    /// Where its compiled code came from.
    prepared: foldhost_guest::guest::Prepared,
}

/// Reads, compiles, link-checks and starts the guest (instantiate, `manifest`, `init`, against an
/// empty fold) before anything is touched: a bad guest is refused with the reason (a missing
/// import named, a trap in `init`) and nothing is connected or written.
async fn prove_guest(
    cfg: &NodeConfig,
    channel: Option<&mut channel::ChannelStart>,
) -> Result<Option<ProvenGuest>, NodeError> {
    let (path, bytes) = match (&cfg.guest, channel) {
        (Some(path), _) => (path.clone(), foldhost_guest::guest::read_guest_file(path)?),
        // Named in errors and status by its version, digest first.
        (None, Some(c)) => (PathBuf::from(c.version.label()), c.bytes.clone()),
        (None, None) => return Ok(None),
    };
    let engine = GuestEngine::with_options(foldhost_guest::guest::EngineOptions {
        cache_dir: cfg.guest_cache.clone(),
        // The store's seed is set once the store is open; this probe instance draws nothing kept.
        random_seed: [0; 32],
    })?;
    let what = path.display().to_string();
    let (_, prepared) = engine.prepare_traced(&what, &bytes)?;
    tracing::info!(event = "guest_compiled",
        guest = %what,
        from = prepared.source.as_str(),
        ms = prepared.elapsed.as_millis() as u64,
        cache = %engine.cache_dir().map(|d| d.display().to_string()).unwrap_or_else(|| "none".into()),
        "guest compiled code ready"
    );
    let probe = GuestApply::load(
        &engine,
        &what,
        &bytes,
        cfg.guest_limits,
        cfg.guest_config.clone(),
        Arc::new(foldhost_core::view::EmptyFold),
    )
    .await?;
    drop(probe);
    Ok(Some(ProvenGuest {
        engine,
        bytes,
        path,
        prepared,
    }))
}

/// Opens the store (off the async threads: a replay or an LSM open blocks), logs what recovery
/// discarded, and refuses a fold with data but no cursor when no repair is allowed (a re-list would
/// never remove what the bucket no longer has).
async fn open_store(cfg: &NodeConfig) -> Result<SharedStore<AnyStore>, NodeError> {
    let (dir, backend, sync) = (cfg.store.clone(), cfg.backend, cfg.sync);
    let (store, recovery) =
        tokio::task::spawn_blocking(move || AnyStore::open_with(&dir, backend, sync))
            .await
            .map_err(|e| NodeError::Task("store open", e.to_string()))?
            .map_err(|source| NodeError::Store {
                path: cfg.store.clone(),
                source,
            })?;
    if let Some(reason) = &recovery.reason {
        tracing::warn!(event = "store_recovered",
            store = %cfg.store.display(),
            discarded_bytes = recovery.discarded_tail_bytes,
            discarded_records = recovery.discarded_records,
            "store recovered: {reason}"
        );
    }
    if cfg.repair == RepairMode::None
        && store.cursor().revision().is_none()
        && foldhost_core::snapshot::bucket_len(&store)? > 0
    {
        return Err(NodeError::Refused(format!(
            "{}: the fold holds {} keys but no cursor and --repair is none; it cannot be resumed safely (allow a repair, import an artifact, or start from an empty store)",
            cfg.store.display(),
            foldhost_core::snapshot::bucket_len(&store)?
        )));
    }
    Ok(SharedStore::new(store))
}

/// The applier (the proven guest, hydrated from the fold, or the native one) and the scope to
/// watch (`--scope`, else the guest's manifest, else the whole bucket).
async fn build_applier(
    cfg: &NodeConfig,
    proven: Option<&ProvenGuest>,
    shared: &SharedStore<AnyStore>,
    conn: &NatsConnection,
    status: &FoldStatus,
) -> Result<Built, NodeError> {
    let mut lanes = Vec::new();
    let mut link = Arc::new(foldhost_fold::applied::LaneLink::default());
    let (apply, manifest_scope): (Box<dyn Apply>, Option<WatchScope>) = match proven {
        Some(p) => {
            let mut g = GuestApply::load(
                &p.engine,
                &p.path.display().to_string(),
                &p.bytes,
                cfg.guest_limits,
                cfg.guest_config.clone(),
                Arc::new(shared.clone()),
            )
            .await?;
            g.count_into(status.guest_counters.clone());
            // The state buckets first: asserted, folded level, attached — so the guest's first
            // instance is hydrated from every bucket's current values.
            let decls = lanes::declarations(cfg, g.manifest())?;
            lanes = lanes::open(cfg, conn, decls).await?;
            lanes::catch_up(cfg, &lanes).await?;
            if !lanes.is_empty() {
                g.attach_state(lanes::access(cfg, &lanes))
                    .map_err(NodeError::Hydrate)?;
            }
            link = g.lane_link();
            g.hydrate().await.map_err(NodeError::Hydrate)?;
            let scope = g.manifest().watch_scope();
            (Box::new(g), Some(scope))
        }
        None => match cfg.apply {
            NativeApply::Count => (Box::new(CountingApply::default()), None),
        },
    };
    let scope = match (&cfg.scope, manifest_scope) {
        (Some(s), _) => s.clone(),
        (None, Some(m)) => m,
        (None, None) => WatchScope::All,
    };
    Ok((apply, scope, lanes, link))
}

/// What [`build_applier`] builds: the applier, the scope, the guest's state buckets (caught up,
/// not yet folding live) and what they share with the guest.
type Built = (
    Box<dyn Apply>,
    WatchScope,
    Vec<lanes::Lane>,
    Arc<foldhost_fold::applied::LaneLink>,
);

/// The run's restore source: `--artifacts URL --artifact-key K`, or `--restore-from DIR`.
fn restore_source(
    cfg: &NodeConfig,
    transport: Option<Arc<foldhost_artifact::transport::ArtifactTransport>>,
) -> Option<foldhost_fold::repair::RestoreSource> {
    if let (Some(transport), Some((_, key))) = (transport, &cfg.artifacts) {
        return Some(foldhost_fold::repair::RestoreSource::Transport {
            transport,
            key: key.clone(),
        });
    }
    cfg.restore_from
        .clone()
        .map(foldhost_fold::repair::RestoreSource::new)
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

/// Resolves once `rx` turns true; never, if its sender goes away without that.
pub(crate) async fn signalled(mut rx: tokio::sync::watch::Receiver<bool>) {
    while !*rx.borrow_and_update() {
        if rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// The status a host's fixed facts and its fold's live figures make, as of now.
fn live_status(base: &StatusReport, status: &FoldStatus) -> StatusReport {
    base.with_live(status)
}

/// The final status: `stopped` with the fold's `applied_through` (the one rule, as the fold
/// published it with its last commit), or `failed` with the reason.
fn final_status(
    base: &StatusReport,
    status: &FoldStatus,
    result: &Result<foldhost_fold::applied::Finished, AppliedError>,
) -> StatusReport {
    let mut last = live_status(base, status);
    match result {
        Ok(_) => {
            last.state = "stopped".into();
            last.applied_through = status.applied_through.load(Ordering::Relaxed);
        }
        Err(e) => {
            last.state = "failed".into();
            last.error = Some(e.to_string());
        }
    }
    last
}

/// Writes `status.json`, warning (not failing) when it cannot: the file is advisory.
fn write_status_file(store: &Path, report: &StatusReport) {
    if let Err(e) = storedir::write_status(store, report) {
        tracing::warn!(event = "status_file_failed", error = %e, "status file not written");
    }
}
