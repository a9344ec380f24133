//! `foldhost run`: the node's flags, their defaults and checks, the guest's configuration, and the run until a signal.

use super::*;

/// `foldhost run`. Every default comes from [`NodeConfig::new`] and the types it holds.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// A TOML file of folds, every flag of `run` a key of the same name (docs/operations.md, "Several folds
    /// from one file"): every fold runs in this process. Flags given beside it override the file
    /// when it holds one fold.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The fold's name, in its log lines and its metrics (default: its bucket).
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// How to reach and authenticate to NATS (`cli/nats.rs`).
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Bucket to fold (must exist).
    #[arg(long, required_unless_present = "config")]
    pub bucket: Option<String>,
    /// What to watch: all, prefix:P, or prefixes:P1,P2 (default: the guest's manifest, else all).
    #[arg(long, value_parser = parse_scope)]
    pub scope: Option<WatchScope>,
    /// Store directory.
    #[arg(long, required_unless_present = "config")]
    pub store: Option<PathBuf>,
    /// Storage backend: append-log, fjall or rocksdb (the last two when built with their features).
    #[arg(long, default_value_t = defaults().backend)]
    pub backend: Backend,
    /// Fsync every apply (fjall, rocksdb): a power loss then loses nothing committed. Without it a
    /// process crash loses nothing, a power loss may lose the tail since the last fsync.
    #[arg(long)]
    pub sync: bool,
    /// The guest: a WebAssembly component (see `wit/guest.wit`). Without it, `--apply` runs.
    #[arg(long)]
    pub guest: Option<PathBuf>,
    /// Guest configuration, `KEY=VALUE`, repeatable (handed to the guest's `init`).
    #[arg(long = "guest-config", value_name = "KEY=VALUE", value_parser = parse_config_item)]
    pub guest_config: Vec<(String, String)>,
    /// Guest configuration from a file: a JSON object of strings (`{"region": "eu"}`). Keys given
    /// with `--guest-config` override it.
    #[arg(long, value_name = "FILE")]
    pub guest_config_file: Option<PathBuf>,
    /// Deadline of one guest call, in milliseconds (or `2s`).
    #[arg(long, value_name = "MS", default_value_t = defaults().guest_limits.call_deadline.as_millis() as u64, value_parser = units::millis)]
    pub guest_deadline_ms: u64,
    /// Memory cap of a guest, in MiB (or `1GiB`).
    #[arg(long, value_name = "MIB", default_value_t = defaults().guest_limits.memory_bytes >> 20, value_parser = units::mebibytes)]
    pub guest_memory_mb: usize,
    /// Most key and value bytes passed to the guest in one call (or `8MiB`).
    #[arg(long, value_name = "BYTES", default_value_t = defaults().guest_limits.max_batch_bytes, value_parser = units::bytes_usize)]
    pub guest_max_batch_bytes: usize,
    /// The compiled-component cache: a directory private to this user (created mode 0700) where a
    /// compiled guest is kept, so the next start or a swap back loads it in milliseconds. Default:
    /// `$XDG_CACHE_HOME/foldhost/wasm`, else `~/.cache/foldhost/wasm`.
    #[arg(long, value_name = "DIR", env = "FOLDHOST_GUEST_CACHE")]
    pub guest_cache: Option<PathBuf>,
    /// Compile the guest at every start; never read or write the compiled-component cache.
    #[arg(long, conflicts_with = "guest_cache")]
    pub no_guest_cache: bool,
    /// The seed of the guests' random numbers (64 hex digits). Default: the store's own secret
    /// (`STORE/guest-seed`, made by the first run). Give every host the same seed for guests that
    /// draw the same numbers fleet-wide; keep it secret, as guests' hash tables are seeded from it.
    #[arg(long, value_name = "HEX", env = "FOLDHOST_GUEST_SEED", hide_env_values = true, value_parser = parse_seed)]
    pub guest_seed: Option<[u8; 32]>,
    /// The built-in native applier when no `--guest` is given.
    #[arg(long, value_enum, default_value_t = defaults().apply)]
    pub apply: NativeApply,
    /// Serve `GET /status`, `POST /query`, `POST /swap` and `POST /export` on this address (e.g.
    /// 127.0.0.1:8080; port 0: the system's choice, named as `listen` in `STORE/status.json`).
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
    /// Bearer token `POST /write` requires (only it: the admin token does not open `/write`).
    /// Without it (or `--write-token-file`) the host uses the one in `STORE/write-token` (mode
    /// 0600, generated there at the first run and kept across restarts), where `foldhost put` and
    /// `foldhost delete` find it.
    #[arg(long, env = "FOLDHOST_WRITE_TOKEN", hide_env_values = true)]
    pub write_token: Option<String>,
    /// Read the write token from this file (keeps it out of `ps`).
    #[arg(long, value_name = "FILE", conflicts_with = "write_token")]
    pub write_token_file: Option<PathBuf>,
    /// How long the operation ledger keeps a write's row after its record was folded (`30d`,
    /// `12h`, `90s`): a retry within it is answered from the row; a later one (minted before the
    /// swept rows) is answered `unknown`, never applied twice.
    #[arg(long, value_name = "DURATION", default_value = "30d", value_parser = parse_retention)]
    pub ledger_retention: Duration,
    /// Read the bearer token `/status` and `/query` require from this file (the admin token opens
    /// them too). Without it, a loopback listener answers them to anyone on this machine, and any
    /// other (0.0.0.0 and :: included) only with the token it generates into `STORE/query-token`
    /// (mode 0600, kept across restarts) — unless `--query-open`.
    #[arg(long, value_name = "FILE", conflicts_with = "query_open")]
    pub query_token_file: Option<PathBuf>,
    /// Refused: a query token is read from a file (`--query-token-file`), never from the command
    /// line (where `ps` shows it) or the environment.
    #[arg(
        long,
        env = "FOLDHOST_QUERY_TOKEN",
        hide = true,
        hide_env_values = true
    )]
    pub query_token: Option<String>,
    /// RISK: on a listener beyond loopback, answer `/status` and `/query` without a token. Anyone
    /// who can reach the address can then query the guest, read the fold through it, and flood
    /// the guest with queries (the fold slows with them). For a network you trust entirely, or
    /// a proxy in front that authenticates.
    #[arg(long)]
    pub query_open: bool,
    /// A name clients reach the listener by, as they send it in `Host` (`node7.internal`, or
    /// with the port they use: `fold.example:443`); repeatable. A request whose `Host` is none of
    /// these nor an address the listener is bound to (on 0.0.0.0 / ::, the IP address a client
    /// connected to) is refused (403): a DNS-rebound name reaches nothing.
    #[arg(long, value_name = "NAME")]
    pub listen_host: Vec<String>,
    /// Largest `/query` body, in bytes (or `1MiB`).
    #[arg(long, value_name = "BYTES", default_value_t = crate::serve::MAX_QUERY, value_parser = units::bytes_usize)]
    pub query_max_bytes: usize,
    /// `GET /readyz` answers ready while the fold (and each state bucket's) is at most this many
    /// records behind its stream, once it has been level with it.
    #[arg(long, value_name = "RECORDS", default_value_t = crate::serve::DEFAULT_READY_MAX_LAG)]
    pub ready_max_lag: u64,
    /// Swap the guest whenever the `--guest` file's content changes (checked every second).
    #[arg(long)]
    pub watch_guest: bool,
    /// Follow a guest channel instead of `--guest`: run the version its release gives this
    /// node, shadow new ones as a canary, swap as the rollout allows, and return to the last good
    /// one when it halts (docs/channels.md). This node's name in the channel is `--node-id`, else
    /// the host's name.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["guest", "watch_guest"])]
    pub guest_channel: Option<String>,
    /// The NATS Object Store bucket holding the channel's components.
    #[arg(long, value_name = "BUCKET", default_value_t = foldhost_nats::channel::ChannelBuckets::default().objects)]
    pub guest_objects: String,
    /// The NATS KV bucket holding the channel's releases and node reports.
    #[arg(long, value_name = "BUCKET", default_value_t = foldhost_nats::channel::ChannelBuckets::default().channels)]
    pub channel_bucket: String,
    /// Also serve the guest's query as a NATS request/reply service on this subject.
    #[arg(long)]
    pub query_subject: Option<String>,
    /// `--query-subject` answers only requests whose reply subject starts with this prefix (a
    /// requester cannot have the host publish, with its credentials, to a subject it names).
    #[arg(long, default_value_t = defaults().query_reply_prefix)]
    pub query_reply_prefix: String,
    /// The NATS queue group `--query-subject` and `--write-subject` are subscribed in: nodes in
    /// one group share the subjects, each request going to exactly one of them.
    #[arg(long, value_name = "NAME", default_value_t = defaults().query_group, value_parser = parse_queue_group)]
    pub query_group: String,
    /// Also take writes as NATS request/reply on this subject: the request is `/write`'s JSON,
    /// the reply its answer (docs/writes.md). Who may write is who may publish to the subject
    /// (the NATS account's permissions); replies go only to subjects under
    /// `--query-reply-prefix`.
    #[arg(long, value_name = "SUBJ")]
    pub write_subject: Option<String>,
    /// Create the bucket when it does not exist (one value per key, file storage, one replica, a
    /// 10 MiB cap: for a quick start on a server of your own — make production buckets with the
    /// limits they need, e.g. `nats kv add`). Needs the permission to create the bucket's
    /// stream, which `foldhost grants` does not grant. Without it, a missing bucket is an error.
    #[arg(long)]
    pub create_bucket: bool,
    /// Fold to the stream's last sequence as of start, then exit 0.
    #[arg(long)]
    pub catch_up: bool,
    /// How an expired cursor is repaired: `auto` (the key-listing diff where the bucket's listing
    /// is the truth, an artifact restore where retention evicts current values), `relist`,
    /// `restore`, or `none` (stop with the expiry).
    #[arg(long, default_value_t = defaults().repair, value_name = "MODE")]
    pub repair: RepairMode,
    /// What to do when the bucket's stream is not the one the fold recorded (deleted and created
    /// again) or ends below the fold's cursor: `refuse` (stop with one line saying so, the fold
    /// untouched) or `relist` (re-fold the new bucket: the key-listing diff, then a re-list).
    #[arg(long, default_value_t = defaults().on_recreated, value_name = "WHAT")]
    pub on_recreated: OnRecreated,
    /// What to do when the log holds another record at the fold's checkpoint revision than the
    /// one it folded (`log_diverged`: a broker restored from an older copy and written past this
    /// fold): `refuse` (stop with one line saying so, the fold untouched) or `relist` (re-fold
    /// the bucket: the key-listing diff, then a re-list).
    #[arg(long, default_value_t = defaults().on_diverged, value_name = "WHAT")]
    pub on_diverged: OnRecreated,
    /// A directory of artifacts (directories or `.tar` files as `foldhost export` writes them); a
    /// restore takes the one with the newest cursor. Without it no restore is armed.
    #[arg(long, value_name = "DIR")]
    pub restore_from: Option<PathBuf>,
    /// Warn (log and status) about a record a guest deferred that stays retained longer than this
    /// many seconds (or `30m`).
    #[arg(long, value_name = "SECS", default_value_t = defaults().defer_grace.as_secs(), value_parser = units::secs)]
    pub defer_grace_secs: u64,
    /// Batch window in milliseconds (or `1s`).
    #[arg(long, value_name = "MS", default_value_t = defaults().batch.window.as_millis() as u64, value_parser = units::millis)]
    pub batch_window_ms: u64,
    /// Maximum updates per batch.
    #[arg(long, default_value_t = defaults().batch.max)]
    pub batch_max: usize,
    /// Watch → fold channel depth, in updates.
    #[arg(long, default_value_t = defaults().batch.channel_capacity)]
    pub channel: usize,
    /// Longest one NATS operation may take before it fails (a stream read, a consumer's
    /// creation, a put), in seconds (or `2m`; 1 s to 1 h).
    #[arg(long, value_name = "SECS", default_value_t = foldhost_core::bucket::DEFAULT_OP_TIMEOUT.as_secs(), value_parser = units::secs_within::<1, 3600>)]
    pub nats_op_timeout: u64,
    /// The idle heartbeat asked of each watch's consumer, in seconds: a watch silent for three
    /// of them ends and resumes from the cursor (a deleted consumer, a dead route); 1 to 60 s.
    #[arg(long, value_name = "SECS", default_value_t = foldhost_core::bucket::DEFAULT_WATCH_HEARTBEAT.as_secs(), value_parser = units::secs_within::<1, 60>)]
    pub watch_heartbeat: u64,
    /// Restore an expired fold from the artifact published here (an object store URL, see
    /// `foldhost publish`); with `--artifact-key`.
    #[arg(
        long,
        value_name = "URL",
        requires = "artifact_key",
        conflicts_with = "restore_from"
    )]
    pub artifacts: Option<String>,
    /// The artifact key under `--artifacts`.
    #[arg(long, value_name = "KEY", value_parser = parse_artifact_key, requires = "artifacts")]
    pub artifact_key: Option<String>,
    /// Development only: export rounds publish on a store that cannot replace the pointer
    /// atomically (the local file system); every publish says so in the log.
    #[arg(long, requires = "artifacts")]
    pub allow_non_atomic_pointer: bool,
    /// Run an export round every this many seconds (with `--artifacts`): win the export lease,
    /// export live, upload, move the pointer, prune. One node of a fleet exports per round (or
    /// `5m`).
    #[arg(long, value_name = "SECS", requires = "artifacts", value_parser = units::secs)]
    pub export_every: Option<u64>,
    /// How long a won export lease lasts, in seconds (or `10m`).
    #[arg(long, value_name = "SECS", default_value_t = defaults().export_lease.as_secs(), value_parser = units::secs)]
    pub export_lease_secs: u64,
    /// The NATS KV bucket holding export leases (created when absent).
    #[arg(long, default_value_t = defaults().lease_bucket)]
    pub lease_bucket: String,
    /// This node's name in the export lease (default: the store's path and the process id).
    #[arg(long)]
    pub node_id: Option<String>,
    /// The largest value a guest may write to a state bucket, in bytes or `256KiB` (docs/state.md).
    #[arg(long, value_name = "BYTES", default_value_t = defaults().state_caps.max_value, value_parser = units::bytes)]
    pub state_max_value: u64,
    /// The most a state bucket may hold, in bytes or `64MiB`: a declaration above it is refused at
    /// load.
    #[arg(long, value_name = "BYTES", default_value_t = defaults().state_caps.max_bucket, value_parser = units::bytes)]
    pub state_max_bucket: u64,
    /// Test builds only: a guest's state writes skip the host's own checks (to show what the
    /// server does with them).
    #[cfg(feature = "crashpoints")]
    #[arg(long, hide = true)]
    pub state_unchecked_writes: bool,
}

/// The defaults of a run, from the one place they are defined.
pub(super) fn defaults() -> NodeConfig {
    NodeConfig::new("", "", "")
}

/// A NATS queue group's name: a non-empty token of the protocol (no whitespace, no wildcard).
pub(super) fn parse_queue_group(s: &str) -> Result<String, String> {
    if s.is_empty()
        || s.bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control() || b == b'*' || b == b'>')
    {
        return Err(format!(
            "{s:?} is not a queue group: one word, no whitespace or wildcard"
        ));
    }
    Ok(s.to_string())
}

pub(super) fn parse_scope(s: &str) -> Result<WatchScope, String> {
    WatchScope::parse(s).map_err(|e| e.to_string())
}

pub(super) fn parse_seed(hex: &str) -> Result<[u8; 32], String> {
    let digits = hex.trim();
    if digits.len() != 64 || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("expected 64 hex digits (32 bytes)".into());
    }
    let mut seed = [0u8; 32];
    for (i, byte) in seed.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&digits[2 * i..2 * i + 2], 16)
            .map_err(|e| format!("hex digit: {e}"))?;
    }
    Ok(seed)
}

pub(super) fn parse_config_item(kv: &str) -> Result<(String, String), String> {
    kv.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{kv:?}: expected KEY=VALUE"))
}

impl RunArgs {
    /// The typed configuration these arguments describe (reading `--guest-config-file`).
    pub(crate) fn into_config(self) -> anyhow::Result<NodeConfig> {
        if self.query_token.is_some() {
            bail!(
                "--query-token / FOLDHOST_QUERY_TOKEN: the query token is read from a file only (the command line shows in ps): give --query-token-file FILE"
            );
        }
        let guest_config = self.guest_config()?;
        let nats = self.nats.required()?;
        let (Some(bucket), Some(store)) = (self.bucket.clone(), self.store.clone()) else {
            bail!("run needs --bucket and --store (or --config FILE)");
        };
        let guest_limits = self.guest_limits(defaults().guest_limits);
        let batch = self.batch();
        let guest_channel = self.guest_channel();
        Ok(NodeConfig {
            nats,
            op_timeout: Duration::from_secs(self.nats_op_timeout),
            watch_heartbeat: Duration::from_secs(self.watch_heartbeat),
            ledger_retention: self.ledger_retention,
            name: self.name.clone(),
            bucket,
            scope: self.scope,
            store,
            backend: self.backend,
            sync: self.sync,
            guest: self.guest,
            guest_config,
            guest_limits,
            guest_cache: guest_cache(self.no_guest_cache, self.guest_cache),
            guest_seed: self.guest_seed,
            apply: self.apply,
            listen: self.listen.map(|addr| ListenConfig {
                admin_token: self.admin_token,
                admin_token_file: self.admin_token_file,
                write_token: self.write_token,
                write_token_file: self.write_token_file,
                query_token: None,
                query_token_file: self.query_token_file,
                query_open: self.query_open,
                hosts: self.listen_host,
                query_max_bytes: self.query_max_bytes,
                ready_max_lag: self.ready_max_lag,
                ..ListenConfig::new(addr)
            }),
            watch_guest: self.watch_guest,
            guest_channel,
            query_subject: self.query_subject,
            query_reply_prefix: self.query_reply_prefix,
            query_group: self.query_group,
            write_subject: self.write_subject,
            create_bucket: self.create_bucket,
            catch_up: self.catch_up,
            repair: self.repair,
            on_recreated: self.on_recreated,
            on_diverged: self.on_diverged,
            restore_from: self.restore_from,
            artifacts: self.artifacts.zip(self.artifact_key),
            allow_non_atomic_pointer: self.allow_non_atomic_pointer,
            export_every: self.export_every.map(|s| Duration::from_secs(s.max(1))),
            export_lease: Duration::from_secs(self.export_lease_secs.max(1)),
            lease_bucket: self.lease_bucket,
            node_id: self.node_id,
            defer_grace: Duration::from_secs(self.defer_grace_secs),
            batch,
            state_caps: foldhost_core::protocol::StateCaps {
                max_value: self.state_max_value,
                max_bucket: self.state_max_bucket,
            },
            #[cfg(feature = "crashpoints")]
            state_unchecked_writes: self.state_unchecked_writes,
            #[cfg(not(feature = "crashpoints"))]
            state_unchecked_writes: false,
        })
    }
}

impl RunArgs {
    /// `--guest-config` over what `--guest-config-file` (JSON) gives, if one is given.
    fn guest_config(&self) -> anyhow::Result<Vec<(String, String)>> {
        Ok(match &self.guest_config_file {
            Some(path) => {
                let text = std::fs::read(path)
                    .with_context(|| format!("--guest-config-file {}", path.display()))?;
                merge_config(
                    config_from_json(&text)
                        .map_err(|e| anyhow!("--guest-config-file {}: {e}", path.display()))?,
                    self.guest_config.clone(),
                )
            }
            None => self.guest_config.clone(),
        })
    }

    /// The guest's limits: the flags' (each at least 1) over `defaults`.
    fn guest_limits(
        &self,
        defaults: foldhost_guest::guest::GuestLimits,
    ) -> foldhost_guest::guest::GuestLimits {
        foldhost_guest::guest::GuestLimits {
            call_deadline: Duration::from_millis(self.guest_deadline_ms.max(1)),
            memory_bytes: self.guest_memory_mb.max(1) * 1024 * 1024,
            max_batch_bytes: self.guest_max_batch_bytes.max(1),
            ..defaults
        }
    }

    /// `--guest-channel`, with its buckets and this node's name in it.
    fn guest_channel(&self) -> Option<crate::node::GuestChannel> {
        self.guest_channel
            .clone()
            .map(|channel| crate::node::GuestChannel {
                channel,
                buckets: foldhost_nats::channel::ChannelBuckets {
                    objects: self.guest_objects.clone(),
                    channels: self.channel_bucket.clone(),
                },
                node: self
                    .node_id
                    .clone()
                    .unwrap_or_else(crate::node::default_node_name),
            })
    }

    /// The fold's batches: window, size and channel (each at least 1).
    fn batch(&self) -> BatchConfig {
        BatchConfig {
            window: Duration::from_millis(self.batch_window_ms),
            max: self.batch_max.max(1),
            channel_capacity: self.channel.max(1),
        }
    }
}

/// The compiled-guest cache: none with `--no-guest-cache`, else `--guest-cache` or the default.
fn guest_cache(no_cache: bool, dir: Option<PathBuf>) -> Option<PathBuf> {
    if no_cache {
        None
    } else {
        dir.or_else(foldhost_guest::guest::cache::default_dir)
    }
}

pub(super) async fn cmd_run(a: RunArgs) -> anyhow::Result<()> {
    if let Some(file) = &a.config {
        return cmd_run_config(file).await;
    }
    let cfg = a.into_config()?;
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        let _ = shutdown_tx.send(true);
    });
    let fold = cfg.bucket.clone();
    let summary = Node::run(cfg, shutdown_rx).await?;
    if json_logs() {
        tracing::info!(
            event = "fold_stopped",
            fold = %fold,
            cursor = summary.cursor.revision_or_zero(),
            delivered = summary.delivered,
            "stopped"
        );
    } else {
        eprintln!(
            "foldhost: stopped at cursor {} ({} updates delivered this run)",
            summary.cursor, summary.delivered
        );
    }
    Ok(())
}

/// `run --config FILE`: every fold of the file in this process, each checked before any starts,
/// each its own `Node` — one fold's fail-stop never stops another; a signal stops them all. Fails
/// (after the others stopped) when a fold failed.
async fn cmd_run_config(file: &Path) -> anyhow::Result<()> {
    let super::config::Loaded { folds, listen, .. } = super::config::load(file)?;
    let overrides = super::config::run_overrides();
    if folds.len() > 1 && !overrides.is_empty() {
        bail!(
            "{}: flags beside --config override the file only when it holds one fold ({} here): put them in the file",
            file.display(),
            folds.len()
        );
    }
    let mut cfgs = Vec::with_capacity(folds.len());
    for fold in &folds {
        cfgs.push(fold_config(file, fold, &overrides, listen.as_ref())?);
    }
    // One listener for every fold: bound before any fold starts, so no fold's failure takes it.
    let _serving = match &listen {
        Some(_) => bind_one_listener(&mut cfgs).await?,
        None => None,
    };
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        let _ = shutdown_tx.send(true);
    });
    let mut running = tokio::task::JoinSet::new();
    for cfg in cfgs {
        let name = cfg.fold_name().to_string();
        let stop = shutdown_rx.clone();
        running.spawn(async move { (name, Node::run(cfg, stop).await) });
    }
    let mut failed = Vec::new();
    while let Some(done) = running.join_next().await {
        match done {
            Ok((name, Ok(summary))) => tracing::info!(
                event = "fold_stopped",
                fold = %name,
                cursor = summary.cursor.revision_or_zero(),
                delivered = summary.delivered,
                "stopped"
            ),
            Ok((name, Err(e))) => {
                tracing::error!(event = "fold_failed", fold = %name, error = %e, "fold failed");
                failed.push(format!("{name}: {e}"));
            }
            Err(e) => failed.push(format!("a fold's task: {e}")),
        }
    }
    if !failed.is_empty() {
        bail!(
            "{} of {} folds failed: {}",
            failed.len(),
            folds.len(),
            failed.join("; ")
        );
    }
    Ok(())
}

/// One fold of the file, as `run` would take it with `overrides`. With a process-wide listen,
/// each fold is parsed with it (its tokens, names and limits are the process's), then
/// registered on the one listener.
fn fold_config(
    file: &Path,
    fold: &super::config::Fold,
    overrides: &[String],
    listen: Option<&String>,
) -> anyhow::Result<NodeConfig> {
    let mut extra = overrides.to_vec();
    if let Some(addr) = listen {
        extra.extend(["--listen".to_string(), addr.clone()]);
    }
    super::config::fold_args(file, fold, &extra)?
        .into_config()
        .with_context(|| format!("{}: fold {}", file.display(), fold.name))
}

/// Binds the process's one listener (the first fold's listen) with every fold registered on it;
/// its task, `None` when there is no fold.
async fn bind_one_listener(
    cfgs: &mut [NodeConfig],
) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
    let Some(first) = cfgs.first() else {
        return Ok(None);
    };
    let l = first.listen.clone().context("the process's listen")?;
    let (each, serving) = crate::node::bind_shared(first, &l).await?;
    if let Some(shared) = &each.shared {
        shared
            .registry
            .expect(cfgs.iter().map(|c| c.fold_name().to_string()).collect());
    }
    // The listener's settings are the process's (a fold table may not set them: see
    // `config::SHARED_LISTENER_KEYS`); only the readiness lag is each fold's.
    for cfg in cfgs.iter_mut() {
        if let Some(own) = cfg.listen.take() {
            cfg.listen = Some(crate::node::ListenConfig {
                query_max_bytes: own.query_max_bytes,
                ready_max_lag: own.ready_max_lag,
                ..each.clone()
            });
        }
    }
    Ok(Some(serving))
}

pub(super) async fn wait_for_signal() {
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

/// A guest configuration file: one JSON object whose values are all strings (at most
/// [`MAX_CONFIG_ENTRIES`] of them), in key order.
pub(super) fn config_from_json(bytes: &[u8]) -> Result<Vec<(String, String)>, String> {
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
pub(super) const MAX_CONFIG_ENTRIES: usize = 4096;

/// `base` with every key of `over` replaced or added (`over` wins).
pub(super) fn merge_config(
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

/// A ledger retention: a human duration (`humantime`: `30d`, `12h`, `90s`), at least a second and
/// at most ten years.
fn parse_retention(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e}"))?;
    if d < Duration::from_secs(1) || d > Duration::from_secs(3650 * 24 * 3600) {
        return Err(format!("{s:?}: between 1s and 3650d"));
    }
    Ok(d)
}
