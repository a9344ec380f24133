//! [`NodeConfig`]: everything a running host is configured by, with every default in one place
//! ([`NodeConfig::new`]) and the combinations that cannot run refused before anything is read.

use super::*;

/// Everything a running host is configured by, typed. [`NodeConfig::new`] holds every default.
#[derive(Clone, Debug)]
pub(crate) struct NodeConfig {
    /// How to reach and authenticate to NATS: the URL(s), the credentials, TLS (its
    /// `op_timeout` and `watch_heartbeat` are the two fields below). Its `Debug` redacts every
    /// secret.
    pub nats: ConnectOptions,
    /// Longest one NATS operation may take ([`foldhost_core::bucket::DEFAULT_OP_TIMEOUT`] by default).
    pub op_timeout: Duration,
    /// The idle heartbeat of the watches' consumers
    /// ([`foldhost_core::bucket::ConnectOptions::watch_heartbeat`]).
    pub watch_heartbeat: Duration,
    /// How long the operation ledger keeps a row after folding its record
    /// ([`foldhost_core::protocol::DEFAULT_LEDGER_RETENTION_MS`] by default).
    pub ledger_retention: Duration,
    /// The fold's name: in its log lines' span and its metrics' `fold` label (`None`: the
    /// bucket's). Several folds of one process have distinct names (a config file's `name`).
    pub name: Option<String>,
    /// The bucket to fold.
    pub bucket: String,
    /// What to watch (`None`: the guest's manifest scope, or the whole bucket).
    pub scope: Option<WatchScope>,
    /// The store directory (the local fold).
    pub store: PathBuf,
    /// The store's backend.
    pub backend: Backend,
    /// fsync every commit (append log: survive a power loss, not only a crash).
    pub sync: bool,
    /// The guest component (`None`: the native applier).
    pub guest: Option<PathBuf>,
    /// The guest's configuration (`init`), in order.
    pub guest_config: Vec<(String, String)>,
    /// Limits on every guest call.
    pub guest_limits: GuestLimits,
    /// The compiled-component cache directory (`None`: compile at every start).
    pub guest_cache: Option<PathBuf>,
    /// The seed of the guests' random streams (`None`: the store's own, `guest-seed`).
    pub guest_seed: Option<[u8; 32]>,
    /// The native applier used without a guest.
    pub apply: NativeApply,
    /// The `--listen` endpoint.
    pub listen: Option<ListenConfig>,
    /// Swap the guest whenever its file's content changes.
    pub watch_guest: bool,
    /// Follow a guest channel instead of a guest file (docs/channels.md).
    pub guest_channel: Option<super::GuestChannel>,
    /// Also serve queries as NATS request/reply on this subject.
    pub query_subject: Option<String>,
    /// Reply subjects of NATS queries (and writes) must start with this.
    pub query_reply_prefix: String,
    /// The queue group `query_subject` and `write_subject` are subscribed in: each request goes
    /// to one node of the group.
    pub query_group: String,
    /// Also take writes as NATS request/reply on this subject.
    pub write_subject: Option<String>,
    /// Create the bucket when it does not exist (with [`foldhost_core::bucket::BucketConfig`]'s
    /// defaults); otherwise a missing bucket is an error.
    pub create_bucket: bool,
    /// Fold to the stream's last sequence as of start, then return.
    pub catch_up: bool,
    /// Which cursor-expiry repairs are allowed.
    pub repair: RepairMode,
    /// What to do with a recreated bucket.
    pub on_recreated: OnRecreated,
    /// What to do when the log holds another record at the fold's checkpoint (`log_diverged`).
    pub on_diverged: OnRecreated,
    /// Where artifacts for a restore come from: a local directory…
    pub restore_from: Option<PathBuf>,
    /// …or the artifact published under a key in an object store (URL, key).
    pub artifacts: Option<(String, String)>,
    /// Development only: export rounds may publish on a store that cannot replace the pointer
    /// atomically (the local file system); every such publish says so in the log.
    pub allow_non_atomic_pointer: bool,
    /// Run an export round this often (needs `artifacts`): lease, live export, upload, pointer.
    pub export_every: Option<Duration>,
    /// How long a won export lease lasts (a round must finish within it; payloads younger than
    /// 4× it are never pruned).
    pub export_lease: Duration,
    /// The NATS KV bucket holding export leases (created when absent).
    pub lease_bucket: String,
    /// This node's name in the lease (default: the store's path and the process id).
    pub node_id: Option<String>,
    /// A retained record older than this is warned about.
    pub defer_grace: Duration,
    /// Batching.
    pub batch: BatchConfig,
    /// The host's caps on a guest's state buckets.
    pub state_caps: foldhost_core::protocol::StateCaps,
    /// Test builds only (`--state-unchecked-writes`): a guest's state writes skip the host's own
    /// checks, so a test sees what the server does with them.
    pub state_unchecked_writes: bool,
}

impl NodeConfig {
    /// The fold's name ([`NodeConfig::name`], else its bucket).
    pub fn fold_name(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.bucket)
    }

    /// Folding `bucket` on the server at `nats` into `store`, every other setting at its default.
    pub fn new(
        nats: impl Into<String>,
        bucket: impl Into<String>,
        store: impl Into<PathBuf>,
    ) -> Self {
        NodeConfig {
            nats: ConnectOptions::new(nats),
            op_timeout: foldhost_core::bucket::DEFAULT_OP_TIMEOUT,
            watch_heartbeat: foldhost_core::bucket::DEFAULT_WATCH_HEARTBEAT,
            ledger_retention: Duration::from_millis(
                foldhost_core::protocol::DEFAULT_LEDGER_RETENTION_MS,
            ),
            name: None,
            bucket: bucket.into(),
            scope: None,
            store: store.into(),
            backend: Backend::AppendLog,
            sync: false,
            guest: None,
            guest_config: Vec::new(),
            guest_limits: GuestLimits::default(),
            guest_cache: None,
            guest_seed: None,
            apply: NativeApply::Count,
            listen: None,
            watch_guest: false,
            guest_channel: None,
            query_subject: None,
            query_reply_prefix: DEFAULT_QUERY_REPLY_PREFIX.to_string(),
            query_group: DEFAULT_QUERY_GROUP.to_string(),
            write_subject: None,
            create_bucket: false,
            catch_up: false,
            repair: RepairMode::Auto,
            on_recreated: OnRecreated::Refuse,
            on_diverged: OnRecreated::Refuse,
            restore_from: None,
            artifacts: None,
            allow_non_atomic_pointer: false,
            export_every: None,
            export_lease: DEFAULT_EXPORT_LEASE,
            lease_bucket: DEFAULT_LEASE_BUCKET.to_string(),
            node_id: None,
            defer_grace: foldhost_fold::applied::DEFAULT_DEFER_GRACE,
            batch: BatchConfig::default(),
            state_caps: foldhost_core::protocol::StateCaps::default(),
            state_unchecked_writes: false,
        }
    }

    /// Refuses combinations that cannot run, before anything is read or connected.
    pub(super) fn check(&self) -> Result<(), NodeError> {
        if let Some(d) = &self.restore_from
            && !d.is_dir()
        {
            return Err(NodeError::Config(format!(
                "--restore-from {}: not a directory",
                d.display()
            )));
        }
        if self.watch_guest && self.guest.is_none() {
            return Err(NodeError::Config("--watch-guest needs --guest".into()));
        }
        if let Some(gc) = &self.guest_channel {
            if self.guest.is_some() {
                return Err(NodeError::Config(
                    "--guest-channel and --guest exclude each other: the channel gives the guest"
                        .into(),
                ));
            }
            for (what, name) in [("--guest-channel", &gc.channel), ("--node-id", &gc.node)] {
                if let Some(why) = foldhost_core::protocol::name_refusal(what, name) {
                    return Err(NodeError::Config(why));
                }
            }
        }
        if self.export_every.is_some() && self.artifacts.is_none() {
            return Err(NodeError::Config(
                "--export-every needs --artifacts and --artifact-key".into(),
            ));
        }
        if let Some(l) = &self.listen {
            if l.query_token.is_some() && l.query_token_file.is_some() {
                return Err(NodeError::Config(
                    "a query token and a query token file exclude each other: give one".into(),
                ));
            }
            let token_given = l.query_token.is_some() || l.query_token_file.is_some();
            // Whether the address is loopback is known only once bound; the conflict is not.
            foldhost_core::protocol::query_access(false, token_given, l.query_open)
                .map_err(|e| NodeError::Config(e.into()))?;
            if l.hosts.len() > crate::serve::MAX_LISTEN_HOSTS {
                return Err(NodeError::Config(format!(
                    "--listen-host given {} times: at most {}",
                    l.hosts.len(),
                    crate::serve::MAX_LISTEN_HOSTS
                )));
            }
            if let Some(bad) = l
                .hosts
                .iter()
                .find(|h| foldhost_core::protocol::split_host_port(h).is_none())
            {
                return Err(NodeError::Config(format!(
                    "--listen-host {bad:?}: not a host name, IP address or [IPv6], with an optional :PORT"
                )));
            }
        }
        if let Some(l) = &self.listen
            && l.query_max_bytes > crate::serve::QUERY_BODY_BUDGET
        {
            return Err(NodeError::Config(format!(
                "--query-max-bytes {}: over the {} bytes all query bodies in flight may hold together",
                l.query_max_bytes,
                crate::serve::QUERY_BODY_BUDGET
            )));
        }
        Ok(())
    }
}

/// How long a won export lease lasts by default.
pub(crate) const DEFAULT_EXPORT_LEASE: Duration = Duration::from_secs(600);

/// The NATS KV bucket holding export leases by default.
pub const DEFAULT_LEASE_BUCKET: &str = "foldhost_leases";

/// The default prefix a NATS query's reply subject must have.
pub(crate) const DEFAULT_QUERY_REPLY_PREFIX: &str = "_INBOX.";

/// The queue group NATS queries and writes are taken in by default.
pub(crate) const DEFAULT_QUERY_GROUP: &str = "foldhost";

/// What a finished run reports.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunSummary {
    /// The store's cursor at the end.
    pub cursor: WatchCursor,
    /// Updates delivered during the run.
    pub delivered: u64,
}
