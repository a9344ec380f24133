//! The command line: a contract (scripts and tests outside the project use it).
//!
//! Exit codes: 0 success, 2 usage (clap), 1 anything else with one line on stderr. Only this module
//! and `main.rs` use `anyhow`; the library layers return their own error enums.

use std::io::{IsTerminal, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use base64::Engine as _;
use clap::{Args, Parser, Subcommand};

use crate::applied::BatchConfig;
use crate::kv::WatchScope;
use crate::node::{ListenConfig, NativeApply, Node, NodeConfig};
use crate::protocol::{OnRecreated, RepairMode};
use crate::snapshot::SnapshotStore;
use crate::status::StatusReport;
use crate::storedir::{self, AnyStore, Backend};

mod demo;
mod scaffold;

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
    /// Hot-swap the guest of a running host (`run --listen`): the fold never stops. With
    /// `--shadow N`, try the new guest beside the running one on live traffic first.
    Swap(SwapArgs),
    /// Scaffold a guest (Rust, JavaScript, Python or C) that builds with one command.
    NewGuest(NewGuestArgs),
    /// Write a verified artifact of a fold (a directory, or a `.tar`), from a store no host is
    /// running on, or from a running host (`--listen`) without stopping it.
    Export(ExportArgs),
    /// Make a store from an artifact (every file's digest and the cursor re-checked first).
    Import(ImportArgs),
    /// Publish an artifact directory to object storage (`--artifacts URL`): the payload, then the
    /// pointer, which never moves backward.
    Publish(PublishArgs),
    /// Make a store from the artifact published under a key (every file re-checked first).
    Bootstrap(BootstrapArgs),
    /// Delete a key's published payloads older than a grace, never the pointer's target.
    Prune(PruneArgs),
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

/// Where a fleet's artifacts live (`publish`, `bootstrap`, `prune`, `run`).
#[derive(Args, Debug, Clone)]
pub struct ArtifactsArgs {
    /// The object store and prefix: `s3://bucket/prefix`, `gs://…`, `az://…`, `file:///dir`.
    /// Credentials and endpoints come from the environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`).
    #[arg(long, value_name = "URL")]
    pub artifacts: String,
    /// The artifact key (one per bucket and scope): letters, digits, `.`, `-`, `_`.
    #[arg(long, value_name = "KEY", value_parser = parse_artifact_key)]
    pub artifact_key: String,
    /// Development only: publish on a store that cannot replace the pointer atomically (the
    /// local file system); every publish says so in the log.
    #[arg(long)]
    pub allow_non_atomic_pointer: bool,
}

fn parse_artifact_key(k: &str) -> Result<String, String> {
    if crate::transport::key_allowed(k) {
        Ok(k.to_string())
    } else {
        Err(format!(
            "{k:?}: use letters, digits, '.', '-' and '_', not starting with '.'"
        ))
    }
}

impl ArtifactsArgs {
    fn transport(&self) -> anyhow::Result<crate::transport::ArtifactTransport> {
        Ok(crate::transport::ArtifactTransport::from_url(
            &self.artifacts,
            self.allow_non_atomic_pointer,
        )?)
    }
}

/// `foldhost publish`.
#[derive(Args, Debug)]
pub struct PublishArgs {
    /// The artifact directory (as `foldhost export` writes it).
    #[arg(long)]
    pub artifact: PathBuf,
    /// Where to publish.
    #[command(flatten)]
    pub to: ArtifactsArgs,
}

/// `foldhost bootstrap`.
#[derive(Args, Debug)]
pub struct BootstrapArgs {
    /// Where the artifact is published.
    #[command(flatten)]
    pub from: ArtifactsArgs,
    /// The store to create (must not exist, or be an empty directory).
    #[arg(long)]
    pub store: PathBuf,
    /// The backend the store must have.
    #[arg(long)]
    pub backend: Option<Backend>,
    /// NATS server URL: with --bucket, the bucket's stream is read first and an artifact of
    /// another stream (an earlier incarnation of a recreated bucket) is refused before the
    /// download.
    #[arg(long, requires = "bucket")]
    pub nats: Option<String>,
    /// The bucket the store will fold (with --nats).
    #[arg(long, requires = "nats")]
    pub bucket: Option<String>,
    /// A `.creds` file for the NATS connection (with --nats).
    #[arg(long, requires = "nats")]
    pub creds_file: Option<PathBuf>,
}

/// `foldhost prune`.
#[derive(Args, Debug)]
pub struct PruneArgs {
    /// Where the payloads are.
    #[command(flatten)]
    pub at: ArtifactsArgs,
    /// Keep every payload uploaded, or replaced as the pointer's target, less than this many
    /// seconds ago (a node may still be downloading one a newer pointer has just replaced).
    #[arg(long, default_value_t = 4 * 60)]
    pub grace_secs: u64,
}

/// `foldhost new-guest`.
#[derive(Args, Debug)]
pub struct NewGuestArgs {
    /// The guest's name (letters, digits, `-`, `_`, starting with a letter).
    pub name: String,
    /// The guest's language.
    #[arg(long, value_enum, default_value_t = scaffold::Lang::Rust)]
    pub lang: scaffold::Lang,
    /// Where to create it (default: ./NAME).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// The SDK (a foldhost checkout's `sdk/rust`, `sdk/js` or `sdk/python`; found automatically
    /// beside this binary).
    #[arg(long)]
    pub sdk: Option<PathBuf>,
    /// The WIT directory (a foldhost checkout's `wit/`; found automatically beside this binary).
    #[arg(long)]
    pub wit: Option<PathBuf>,
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
    /// Shadow first: hydrate the new guest beside the running one, feed it the fold's next N
    /// batches too, then send the same requests to both and list what they answer differently.
    /// The running guest stays unless `--promote` is given and nothing differed. Exits 1 when
    /// something differed.
    #[arg(long, value_name = "N")]
    pub shadow: Option<u64>,
    /// With `--shadow`: ask this many keys in scope (those the batches changed first), each as the
    /// key without its scope prefix.
    #[arg(long, value_name = "K", default_value_t = 100, requires = "shadow")]
    pub sample: usize,
    /// With `--shadow`: send these requests instead of a sample, one per line.
    #[arg(long, value_name = "FILE", requires = "shadow")]
    pub requests: Option<PathBuf>,
    /// With `--shadow`: swap to the new guest when it answered every request as the running one.
    #[arg(long, requires = "shadow")]
    pub promote: bool,
    /// With `--shadow`: the longest wait for the N batches, in seconds (an idle bucket may never
    /// commit them; the comparison then runs on what came).
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 60,
        requires = "shadow"
    )]
    pub shadow_wait: u64,
}

/// `foldhost run`. Every default comes from [`NodeConfig::new`] and the types it holds.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// NATS server URL.
    #[arg(long, env = "FOLDHOST_NATS")]
    pub nats: String,
    /// Bucket to fold (must exist).
    #[arg(long)]
    pub bucket: String,
    /// What to watch: all, prefix:P, or prefixes:P1,P2 (default: the guest's manifest, else all).
    #[arg(long, value_parser = parse_scope)]
    pub scope: Option<WatchScope>,
    /// Store directory.
    #[arg(long)]
    pub store: PathBuf,
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
    /// Deadline of one guest call, in milliseconds.
    #[arg(long, default_value_t = defaults().guest_limits.call_deadline.as_millis() as u64)]
    pub guest_deadline_ms: u64,
    /// Memory cap of a guest, in MiB.
    #[arg(long, default_value_t = defaults().guest_limits.memory_bytes >> 20)]
    pub guest_memory_mb: usize,
    /// Most key and value bytes passed to the guest in one call.
    #[arg(long, default_value_t = defaults().guest_limits.max_batch_bytes)]
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
    #[arg(long, default_value_t = defaults().query_reply_prefix)]
    pub query_reply_prefix: String,
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
    /// A directory of artifacts (directories or `.tar` files as `foldhost export` writes them); a
    /// restore takes the one with the newest cursor. Without it no restore is armed.
    #[arg(long, value_name = "DIR")]
    pub restore_from: Option<PathBuf>,
    /// Warn (log and status) about a record a guest deferred that stays retained longer than this
    /// many seconds.
    #[arg(long, default_value_t = defaults().defer_grace.as_secs())]
    pub defer_grace_secs: u64,
    /// Batch window in milliseconds.
    #[arg(long, default_value_t = defaults().batch.window.as_millis() as u64)]
    pub batch_window_ms: u64,
    /// Maximum updates per batch.
    #[arg(long, default_value_t = defaults().batch.max)]
    pub batch_max: usize,
    /// Watch → fold channel depth, in updates.
    #[arg(long, default_value_t = defaults().batch.channel_capacity)]
    pub channel: usize,
    /// A `.creds` file for the NATS connection.
    #[arg(long)]
    pub creds_file: Option<PathBuf>,
    /// Longest one NATS operation may take before it fails (a stream read, a consumer's
    /// creation, a put), in seconds.
    #[arg(long, value_name = "SECS", default_value_t = crate::bucket::DEFAULT_OP_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub nats_op_timeout: u64,
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
    /// export live, upload, move the pointer, prune. One node of a fleet exports per round.
    #[arg(long, value_name = "SECS", requires = "artifacts")]
    pub export_every: Option<u64>,
    /// How long a won export lease lasts, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = defaults().export_lease.as_secs())]
    pub export_lease_secs: u64,
    /// The NATS KV bucket holding export leases (created when absent).
    #[arg(long, default_value_t = defaults().lease_bucket)]
    pub lease_bucket: String,
    /// This node's name in the export lease (default: the store's path and the process id).
    #[arg(long)]
    pub node_id: Option<String>,
}

/// The defaults of a run, from the one place they are defined.
fn defaults() -> NodeConfig {
    NodeConfig::new("", "", "")
}

fn parse_scope(s: &str) -> Result<WatchScope, String> {
    WatchScope::parse(s).map_err(|e| e.to_string())
}

fn parse_seed(hex: &str) -> Result<[u8; 32], String> {
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

fn parse_config_item(kv: &str) -> Result<(String, String), String> {
    kv.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{kv:?}: expected KEY=VALUE"))
}

impl RunArgs {
    /// The typed configuration these arguments describe (reading `--guest-config-file`).
    pub fn into_config(self) -> anyhow::Result<NodeConfig> {
        if self.query_token.is_some() {
            bail!(
                "--query-token / FOLDHOST_QUERY_TOKEN: the query token is read from a file only (the command line shows in ps): give --query-token-file FILE"
            );
        }
        let guest_config = match &self.guest_config_file {
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
        };
        let d = defaults();
        Ok(NodeConfig {
            nats: self.nats,
            creds_file: self.creds_file,
            op_timeout: Duration::from_secs(self.nats_op_timeout),
            bucket: self.bucket,
            scope: self.scope,
            store: self.store.clone(),
            backend: self.backend,
            sync: self.sync,
            guest: self.guest,
            guest_config,
            guest_limits: crate::guest::GuestLimits {
                call_deadline: Duration::from_millis(self.guest_deadline_ms.max(1)),
                memory_bytes: self.guest_memory_mb.max(1) * 1024 * 1024,
                max_batch_bytes: self.guest_max_batch_bytes.max(1),
                ..d.guest_limits
            },
            guest_cache: if self.no_guest_cache {
                None
            } else {
                self.guest_cache.or_else(crate::guest::cache::default_dir)
            },
            guest_seed: self.guest_seed,
            apply: self.apply,
            listen: self.listen.map(|addr| ListenConfig {
                admin_token: self.admin_token,
                admin_token_file: self.admin_token_file,
                query_token: None,
                query_token_file: self.query_token_file,
                query_open: self.query_open,
                hosts: self.listen_host,
                query_max_bytes: self.query_max_bytes,
                ..ListenConfig::new(addr)
            }),
            watch_guest: self.watch_guest,
            query_subject: self.query_subject,
            query_reply_prefix: self.query_reply_prefix,
            catch_up: self.catch_up,
            repair: self.repair,
            on_recreated: self.on_recreated,
            restore_from: self.restore_from,
            artifacts: self.artifacts.zip(self.artifact_key),
            allow_non_atomic_pointer: self.allow_non_atomic_pointer,
            export_every: self.export_every.map(|s| Duration::from_secs(s.max(1))),
            export_lease: Duration::from_secs(self.export_lease_secs.max(1)),
            lease_bucket: self.lease_bucket,
            node_id: self.node_id,
            defer_grace: Duration::from_secs(self.defer_grace_secs),
            batch: BatchConfig {
                window: Duration::from_millis(self.batch_window_ms),
                max: self.batch_max.max(1),
                channel_capacity: self.channel.max(1),
            },
        })
    }
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
    /// A file holding the token `/status` needs on that listener: its query token (a listener
    /// beyond loopback has one, `STORE/query-token` unless given) or its admin token.
    #[arg(long, requires = "listen")]
    pub token_file: Option<PathBuf>,
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
            Some(addr) => cmd_status_live(&addr, a.token_file.as_deref(), a.json).await,
            None => cmd_status(a),
        },
        Command::Dump(a) => cmd_dump(a),
        Command::Demo(a) => demo::cmd_demo(a).await,
        Command::Swap(a) => cmd_swap(a).await,
        Command::NewGuest(a) => scaffold::cmd_new_guest(a),
        Command::Export(a) => cmd_export(a).await,
        Command::Import(a) => cmd_import(a).await,
        Command::Publish(a) => cmd_publish(a).await,
        Command::Bootstrap(a) => cmd_bootstrap(a).await,
        Command::Prune(a) => cmd_prune(a).await,
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

async fn cmd_publish(a: PublishArgs) -> anyhow::Result<()> {
    let t = a.to.transport()?;
    let scratch = a
        .artifact
        .parent()
        .unwrap_or_else(|| Path::new("."))
        .join(".foldhost-publish");
    let published = t.upload(&a.to.artifact_key, &a.artifact, &scratch).await;
    let _ = std::fs::remove_dir_all(&scratch);
    let p = published?;
    println!(
        "{}",
        serde_json::json!({"cursor": p.cursor, "payload": p.payload, "segments": p.segments})
    );
    Ok(())
}

async fn cmd_bootstrap(a: BootstrapArgs) -> anyhow::Result<()> {
    let t = a.from.transport()?;
    let live = match (&a.nats, &a.bucket) {
        (Some(url), Some(bucket)) => live_stream(url, bucket, a.creds_file.clone()).await?,
        _ => None,
    };
    let m = t
        .bootstrap_into(&a.from.artifact_key, &a.store, a.backend, live.as_ref())
        .await
        .with_context(|| format!("bootstrap {}", a.store.display()))?;
    println!("{}", serde_json::to_string(&m)?);
    Ok(())
}

/// The stream of `bucket` now, as a bootstrap checks an artifact against it.
async fn live_stream(
    url: &str,
    bucket: &str,
    creds_file: Option<PathBuf>,
) -> anyhow::Result<Option<crate::artifact::ManifestStream>> {
    use crate::bucket::Connection as _;
    use crate::kv::KvWatcher as _;
    let mut opts = crate::bucket::ConnectOptions::new(url);
    opts.creds_file = creds_file;
    let conn = crate::nats::NatsConnection::open(opts).await?;
    let kv = conn
        .bucket(
            bucket,
            &crate::bucket::BucketConfig {
                create: false,
                ..crate::bucket::BucketConfig::default()
            },
        )
        .await?;
    let state = kv
        .stream_state()
        .await
        .with_context(|| format!("bucket {bucket}: its stream"))?;
    conn.shutdown().await;
    Ok(state.map(|s| crate::artifact::ManifestStream::from(&s.identity)))
}

async fn cmd_prune(a: PruneArgs) -> anyhow::Result<()> {
    let t = a.at.transport()?;
    let n = t
        .prune(
            &a.at.artifact_key,
            Duration::from_secs(a.grace_secs),
            crate::transport::clock::Now::system(),
        )
        .await?;
    println!("{}", serde_json::json!({"pruned": n}));
    Ok(())
}

async fn cmd_run(a: RunArgs) -> anyhow::Result<()> {
    let cfg = a.into_config()?;
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        let _ = shutdown_tx.send(true);
    });
    let summary = Node::run(cfg, shutdown_rx).await?;
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

async fn cmd_status_live(addr: &str, token_file: Option<&Path>, json: bool) -> anyhow::Result<()> {
    let token = token_file.map(crate::serve::read_token_file).transpose()?;
    let (code, body) = crate::serve::call_with_token(addr, "GET", "/status", b"", token.as_deref())
        .await
        .with_context(|| format!("status via {addr}"))?;
    if code == 401 {
        bail!(
            "{addr}: /status needs a token: pass --token-file with the host's query token \
             (STORE/query-token unless it was given one) or its admin token"
        );
    }
    if code != 200 {
        bail!("{addr}: /status answered {code}");
    }
    let report: StatusReport = serde_json::from_slice(&body).context("status JSON")?;
    print_status(&report, json)
}

/// The status of a store at rest (read-only: works beside a running host): the fold's own figures,
/// and what the host last wrote in `status.json`.
fn cmd_status(a: StatusArgs) -> anyhow::Result<()> {
    let Some(dir) = a.store.clone() else {
        bail!("status needs --store or --listen");
    };
    let (store, _recovery) = AnyStore::open_read_only(&dir)?;
    let cursor = store.cursor();
    let host = storedir::read_status(&dir).unwrap_or_else(|| StatusReport {
        state: "unknown".into(),
        ..StatusReport::default()
    });
    let retained = crate::retained::RetainedIndex::load(&store)?;
    let oldest = retained.oldest();
    let applied_through = retained.applied_through(cursor.revision()).unwrap_or(0);
    let seq = host.seq.max(cursor.revision_or_zero());
    let report = StatusReport {
        store: Some(dir.display().to_string()),
        backend: store.backend().to_string(),
        cursor: cursor.revision(),
        seq,
        applied_through,
        lag: crate::status::lag(seq, applied_through),
        retained: retained.len() as u64,
        oldest_retained_revision: oldest.map(|o| o.position()),
        oldest_retained_unix_ms: oldest.map(|o| o.retained_unix_ms),
        oldest_retained_age_s: oldest
            .and_then(|o| crate::status::age_s(o.retained_unix_ms, crate::status::now_unix_ms())),
        eviction_seen: cursor.memo().is_some(),
        keys: Some(crate::snapshot::bucket_len(&store)?),
        ..host
    };
    print_status(&report, a.json)
}

/// Prints a status: one JSON line, or `field: value` lines for a person.
fn print_status(s: &StatusReport, json: bool) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer(&mut out, s)?;
        writeln!(out)?;
        return Ok(());
    }
    let opt = |v: Option<u64>| v.map_or_else(|| "none".to_string(), |v| v.to_string());
    if let Some(store) = &s.store {
        writeln!(out, "store:           {store}")?;
    }
    writeln!(out, "backend:         {}", s.backend)?;
    if !s.bucket.is_empty() {
        writeln!(out, "bucket:          {} (scope {})", s.bucket, s.scope)?;
    }
    writeln!(out, "cursor:          {}", opt(s.cursor))?;
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
    if let Some(keys) = s.keys {
        writeln!(out, "keys:            {keys}")?;
    }
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
    if let Some(l) = &s.listen {
        writeln!(out, "listen:          {l}")?;
    }
    if let Some(f) = &s.admin_token_file {
        writeln!(out, "admin_token_file: {f}")?;
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
    let Some(file) = named else {
        return Ok(None);
    };
    // Whatever answers at `listen` names the file: only a host whose own store says it listens
    // there (its `status.json`, beside the generated token file, written by that host) is given
    // the token, and only over loopback.
    let store_status = file.parent().and_then(storedir::read_status);
    if let Err(why) = token_file_followable(listen, &file, store_status.as_ref()) {
        bail!(
            "{listen}: not sending the admin token of {}: {why}; pass --admin-token or --admin-token-file",
            file.display()
        );
    }
    Ok(crate::serve::read_generated_token(&file).ok())
}

/// Whether the CLI may send the token in `file`, which the listener at `listen` named in its
/// `/status`, to that listener: only when `listen` is a loopback address and the store the file
/// belongs to (its directory) has a `status.json` of a running host that listens at that same
/// address and names that same file. A listener squatting a port cannot make another store's
/// status say it listens there. Pure.
fn token_file_followable(
    listen: &str,
    file: &Path,
    store_status: Option<&StatusReport>,
) -> Result<(), String> {
    let addr: std::net::SocketAddr = listen
        .parse()
        .map_err(|_| "the address is not a literal IP address and port".to_string())?;
    if !addr.ip().is_loopback() {
        return Err("the listener is not on a loopback address".into());
    }
    let Some(status) = store_status else {
        return Err("its store has no readable status.json".into());
    };
    let listens = status
        .listen
        .as_deref()
        .and_then(|l| l.parse::<std::net::SocketAddr>().ok());
    if listens != Some(addr) {
        return Err(format!(
            "its store's status.json says its host listens at {}",
            status.listen.as_deref().unwrap_or("no address")
        ));
    }
    let names_file = status.admin_token_file.as_deref().map(Path::new) == Some(file);
    if !names_file || status.state == "stopped" {
        return Err("its store's status.json is not of a running host using that file".into());
    }
    Ok(())
}

async fn cmd_swap(a: SwapArgs) -> anyhow::Result<()> {
    let bytes = crate::guest::read_guest_file(&a.guest)?;
    let token = admin_token_for(
        &a.listen,
        a.admin_token.clone(),
        a.admin_token_file.as_deref(),
    )
    .await?;
    if let Some(batches) = a.shadow {
        return shadow_swap(&a, batches, bytes, token.as_deref()).await;
    }
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

/// `foldhost swap --shadow N`: prints the report; an error when anything differed.
async fn shadow_swap(
    a: &SwapArgs,
    batches: u64,
    component: Vec<u8>,
    token: Option<&str>,
) -> anyhow::Result<()> {
    let requests = match &a.requests {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("--requests {}", path.display()))?
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect(),
        None => Vec::new(),
    };
    let header = crate::serve::ShadowHeader {
        batches,
        sample: a.sample,
        requests,
        promote: a.promote,
        max_wait_s: a.shadow_wait,
    };
    let mut body = serde_json::to_vec(&header)?;
    body.push(b'\n');
    body.extend_from_slice(&component);
    let deadline = crate::serve::shadow_deadline(Duration::from_secs(
        a.shadow_wait.min(crate::serve::MAX_SHADOW_WAIT_S),
    ));
    let (code, answer) =
        crate::serve::call_with_deadline(&a.listen, "POST", "/shadow", &body, token, deadline)
            .await
            .with_context(|| format!("shadow via {}", a.listen))?;
    let text = String::from_utf8_lossy(&answer).trim_end().to_string();
    if code != 200 {
        bail!("{}: {text}", a.guest.display());
    }
    println!("{text}");
    let report: crate::applied::ShadowReport =
        serde_json::from_slice(&answer).context("the shadow report")?;
    if report.differing > 0 {
        bail!(
            "{} answered {} of {} requests differently from {}; {}",
            report.candidate,
            report.differing,
            report.requests,
            report.live,
            if report.promoted {
                "promoted"
            } else {
                "not promoted"
            }
        );
    }
    if a.promote && !report.promoted {
        bail!(
            "{} not promoted: {}",
            report.candidate,
            report.not_promoted.as_deref().unwrap_or("unknown")
        );
    }
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
    fn a_token_file_is_followed_only_for_a_loopback_listener_its_own_store_says_is_its_host() {
        let file = Path::new("/srv/a/admin-token");
        let running = |listen: &str| StatusReport {
            state: "running".into(),
            listen: Some(listen.into()),
            admin_token_file: Some(file.display().to_string()),
            ..StatusReport::default()
        };
        let ok = running("127.0.0.1:7000");
        assert_eq!(
            token_file_followable("127.0.0.1:7000", file, Some(&ok)),
            Ok(())
        );
        // A listener squatting another port that names the store's token file.
        let squat = token_file_followable("127.0.0.1:7001", file, Some(&ok)).expect_err("refused");
        assert!(squat.contains("listens at 127.0.0.1:7000"), "{squat}");
        for (listen, status, words) in [
            (
                "10.0.0.5:7000",
                Some(running("10.0.0.5:7000")),
                "not on a loopback",
            ),
            ("host:7000", Some(ok.clone()), "not a literal IP"),
            ("127.0.0.1:7000", None, "no readable status.json"),
            (
                "127.0.0.1:7000",
                Some(StatusReport {
                    state: "stopped".into(),
                    ..ok.clone()
                }),
                "not of a running host",
            ),
            (
                "127.0.0.1:7000",
                Some(StatusReport {
                    admin_token_file: Some("/srv/b/admin-token".into()),
                    ..ok.clone()
                }),
                "not of a running host",
            ),
        ] {
            let why = token_file_followable(listen, file, status.as_ref()).expect_err(listen);
            assert!(why.contains(words), "{listen}: {why}");
        }
    }

    #[test]
    fn a_config_file_is_a_json_object_of_strings_and_the_command_line_overrides_it() {
        let file = config_from_json(br#"{"region": "eu", "tier": "edge"}"#).expect("parses");
        let cli = ["tier=core", "x=1"]
            .map(|kv| parse_config_item(kv).expect("parses"))
            .to_vec();
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

    /// The README's limit tables name a default beside each flag; they must be the defaults the
    /// command line really has (one definition: `NodeConfig::new` and the types it holds).
    #[test]
    fn the_readme_states_the_defaults_the_command_line_has() {
        use clap::CommandFactory as _;
        let readme = include_str!("../../../README.md");
        let cli = Cli::command();
        let run = cli.find_subcommand("run").expect("run exists");
        let default_of = |flag: &str| -> String {
            let arg = run
                .get_arguments()
                .find(|a| a.get_long() == Some(flag))
                .unwrap_or_else(|| panic!("--{flag} exists"));
            arg.get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect()
        };
        // (flag, the README's words for its default, the default as clap prints it)
        let stated = [
            ("guest-deadline-ms", "1 000 ms", "1000"),
            ("guest-memory-mb", "256 MiB", "256"),
            ("guest-max-batch-bytes", "16 MiB", "16777216"),
            ("query-max-bytes", "1 MiB", "1048576"),
            ("batch-max", "100 updates", "100"),
        ];
        for (flag, words, value) in stated {
            let row = format!("| {words} | `--{flag}` |");
            assert!(
                readme.contains(&row),
                "the README states no `{row}` for --{flag}"
            );
            assert_eq!(default_of(flag), value, "--{flag}'s default");
        }
    }
}
