//! The NATS JetStream implementation of the key-value layer: [`NatsConnection`] and the bucket
//! handle [`NatsKv`] that implements [`KvReader`], [`KvWatcher`] and [`KvWriter`].
//!
//! Invariants:
//! - Every NATS call runs under the connection's operation timeout ([`timed`]).
//! - Listings (`keys`, `scan`) use one ephemeral `LastPerSubject` push consumer with
//!   `AckPolicy::None` (an explicit-ack consumer stops after 1 000 unacknowledged messages and would
//!   silently truncate a larger bucket), subscribed *before* the consumer is created so no early
//!   delivery is lost, answering flow-control requests so a large listing never stalls; delivered
//!   over a lean connection (`lean.rs`) wherever one can be made.
//! - No stored header block reaches the client library on the node's own connection: watches and
//!   listings are delivered lean, single reads and catch-ups are the leader's JSON answers. The
//!   client's ordered consumer (`FOLDHOST_LEAN_DELIVERY=off`, websocket URLs) runs on a
//!   connection of its own ([`DeliveryClient`]), replaced after any watch on it ends in an error.
//! - Watches are ordered push consumers: state-sync (`LastPerSubject`) without a cursor, a delta
//!   (`ByStartSequence(cursor + 1)`) with one. A delta is only started after
//!   [`protocol::resume_window_ok`] passes against the stream's live first sequence: the server would
//!   otherwise clamp silently and skip evicted messages. A watch of the whole bucket sends no
//!   filter when the stream stores nothing but the bucket's subjects ([`protocol::server_filters`]): the
//!   same messages, without the server's filtered pending count over the whole stream.
//! - A delta watch on a stream of nothing but the bucket's subjects whose gap is short reads the
//!   gap by direct gets first (keeping what its scope holds) and
//!   starts its consumer past it (`catchup.rs`, [`protocol::direct_catch_up_range`]): the same
//!   messages in the same order, each once; every read is the stream leader's, as JSON, so no
//!   stored header block reaches the client library's parser.
//! - Revisions come from the ACK subject through [`protocol::parse_ack_subject`]; an unparseable one
//!   becomes [`VersionToken::UNKNOWN`], never a made-up number.
//! - Opening a bucket is one stream-info request, and a node's identity refusal before its store
//!   opens uses that answer while it is younger than [`START_INFO_MAX_AGE`]
//!   ([`NatsKv::start_state`]). Everything else reads afresh: the resume gap's prefetch, the fold's
//!   identity and retention checks (one request for both), a watch's start point, the floor
//!   probes, and every check a repair makes.

mod catchup;
mod create;
#[cfg(test)]
mod differential;
mod floor;
mod lean;
pub mod lease;
pub use lean::{LEAN_DELIVERY_ENV, lean_allowed};
pub mod wire;

pub use create::{create_bucket_raw, kv_stream_config, parse_stream_create_reply};

use floor::FloorGuard;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv};
use async_trait::async_trait;
use bytes::Bytes;
use futures::{FutureExt as _, StreamExt};
use tokio::sync::{Mutex, mpsc};

use foldhost_core::bucket::{
    BucketConfig, BucketHandle, ConnectOptions, Connection, ConnectionCapabilities,
    CredentialSource, credential_source,
};
use foldhost_core::kv::{
    KvEntry, KvError, KvReader, KvUpdate, KvWatcher, KvWriter, StreamIdentity, StreamState,
    VersionToken, WatchCursor, WatchEvent, WatchScope,
};
use foldhost_core::protocol;

/// The header carrying a KV operation (absent, `DEL` or `PURGE`). A static name: looking a header
/// up by `&str` builds (and allocates) a name per message.
const KV_OPERATION: async_nats::header::HeaderName =
    async_nats::header::HeaderName::from_static("KV-Operation");
/// The header of the server's delete markers (NATS 2.11+): why the subject's last message went.
const NATS_MARKER_REASON: async_nats::header::HeaderName =
    async_nats::header::HeaderName::from_static("Nats-Marker-Reason");
pub use foldhost_core::kv::WATCH_CHUNK;

/// Longest a stop waits for the server to take what the client still holds (a flush, then a
/// drain). The fold is committed before the connection is shut down, and nothing of it depends on
/// the server by then; the operation timeout (30 s by default) is as long as the grace many
/// orchestrators give a SIGTERM before a SIGKILL.
pub const SHUTDOWN_BUDGET: Duration = Duration::from_secs(2);

/// Period of the floor guard's backstop probe: when no delivery arrives for this long, the stream's
/// first sequence is checked against the frontier directly (seed 000: 30 s).
pub const FLOOR_BACKSTOP: Duration = Duration::from_secs(30);

/// Least time between two delivery stamps (`WatchEvent::Stamp`) outside the level.
pub const STAMP_PERIOD: Duration = Duration::from_millis(100);

/// Longest the stream info read when a bucket was opened stands in for a fresh read in a node's
/// identity refusal before its store opens ([`NatsKv::start_state`]): the refusal costs no request
/// of its own, and a handle opened long before reads afresh.
pub const START_INFO_MAX_AGE: Duration = Duration::from_secs(2);

/// How many times the floor guard retries a failed probe at a delivery gap before ending the watch.
pub const FLOOR_PROBE_RETRIES: u32 = 4;

/// How long the floor guard trusts a stream-info answer that retention does not evict current
/// values (on such a bucket a skipped sequence was superseded, and its successor is delivered).
pub const FLOOR_NON_EVICTING_TRUST: Duration = Duration::from_secs(1);

/// The header a headers-only delivery carries with the payload's size.
const NATS_MSG_SIZE: async_nats::header::HeaderName =
    async_nats::header::HeaderName::from_static("Nats-Msg-Size");

/// Runs `fut` under `limit`; a timeout is [`KvError::Timeout`] naming `op`.
pub async fn timed<T>(
    op: &'static str,
    limit: Duration,
    fut: impl Future<Output = Result<T, KvError>>,
) -> Result<T, KvError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => Err(KvError::Timeout {
            op,
            secs: limit.as_secs(),
        }),
    }
}

fn backend(op: &'static str, e: impl std::fmt::Display) -> KvError {
    KvError::Backend {
        op,
        reason: e.to_string(),
    }
}

/// A NATS connection: dial, shut down, health, and bucket handles.
pub struct NatsConnection {
    opts: ConnectOptions,
    client: Mutex<Option<async_nats::Client>>,
    healthy: Arc<AtomicBool>,
    /// How many times the client's connection dropped: a watch delivered through the client's
    /// ordered consumer ends at a drop (see `run_watch`).
    drops: Arc<tokio::sync::watch::Sender<u64>>,
}

impl NatsConnection {
    /// A connection that has not dialled yet.
    pub fn new(opts: ConnectOptions) -> Self {
        NatsConnection {
            opts,
            client: Mutex::new(None),
            healthy: Arc::new(AtomicBool::new(false)),
            drops: Arc::new(tokio::sync::watch::channel(0).0),
        }
    }

    /// Dials and returns the connection (a convenience for `new` + `connect`).
    pub async fn open(opts: ConnectOptions) -> Result<Self, KvError> {
        let c = Self::new(opts);
        c.connect().await?;
        Ok(c)
    }

    /// The connected client.
    pub async fn client(&self) -> Result<async_nats::Client, KvError> {
        self.client
            .lock()
            .await
            .clone()
            .ok_or(KvError::NotConnected)
    }

    /// The limit every NATS call of this connection runs under.
    pub fn op_timeout(&self) -> Duration {
        self.opts.op_timeout
    }

    /// Opens a bucket and returns the concrete handle (the trait method wraps it in a [`BucketHandle`]).
    pub async fn bucket(&self, name: &str, config: &BucketConfig) -> Result<Arc<NatsKv>, KvError> {
        let client = self.client().await?;
        let kv = NatsKv::open(client, name, config, self.opts.op_timeout).await?;
        kv.set_lean_delivery(Some(&self.opts));
        if let Ok(mut d) = kv.drops.lock() {
            *d = Some(self.drops.subscribe());
        }
        Ok(kv)
    }
}

#[async_trait]
impl Connection for NatsConnection {
    async fn connect(&self) -> Result<(), KvError> {
        let mut guard = self.client.lock().await;
        if guard.is_some() {
            return Ok(());
        }
        let client = connect_client(&self.opts, self.healthy.clone(), self.drops.clone()).await?;
        self.healthy.store(true, Ordering::Release);
        *guard = Some(client);
        Ok(())
    }

    /// Hands the server what the client still holds, within [`SHUTDOWN_BUDGET`], and only while
    /// connected: a stop must not wait on a server that is gone (the flush waited out the whole
    /// operation timeout, 30 s, on a SIGTERM after the server had stopped).
    async fn shutdown(&self) {
        if let Some(c) = self.client.lock().await.take()
            && c.connection_state() == async_nats::connection::State::Connected
        {
            let budget = self.opts.op_timeout.min(SHUTDOWN_BUDGET);
            // A flush that fails means the socket is already gone; nothing more to do.
            let _ = timed("flush", budget, async {
                c.flush().await.map_err(|e| backend("flush", e))
            })
            .await;
            let _ = tokio::time::timeout(budget, c.drain()).await;
        }
        self.healthy.store(false, Ordering::Release);
    }

    fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    async fn open_bucket(
        &self,
        bucket: &str,
        config: &BucketConfig,
    ) -> Result<BucketHandle, KvError> {
        let kv = self.bucket(bucket, config).await?;
        Ok(BucketHandle::new(bucket, kv.clone(), kv.clone(), kv))
    }

    fn capabilities(&self) -> ConnectionCapabilities {
        let server_version = self
            .client
            .try_lock()
            .ok()
            .and_then(|c| c.as_ref().map(|c| c.server_info().version))
            .unwrap_or_default();
        let (message_ttl, conditional_publish, direct_get) =
            protocol::server_features(&server_version);
        ConnectionCapabilities {
            cas: true,
            streaming_watch: true,
            writes: true,
            server_version,
            message_ttl,
            conditional_publish,
            direct_get,
        }
    }
}

/// A std mutex's guard, poisoned or not (what these mutexes hold is replaced whole).
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Dials a client with `opts`: its health kept in `healthy`, each drop (a disconnection or the
/// connection's close) counted in `drops`.
async fn connect_client(
    opts: &ConnectOptions,
    healthy: Arc<AtomicBool>,
    drops: Arc<tokio::sync::watch::Sender<u64>>,
) -> Result<async_nats::Client, KvError> {
    // The client library builds its TLS configuration with the process's default provider, and
    // the build has two (ring through the client, aws-lc-rs through the object store's HTTP
    // client): without one installed, a `tls://` connection panics. Installing an already
    // installed one is a no-op.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let url = opts.url.clone();
    let err = |reason: String| KvError::Connect {
        url: url.clone(),
        reason,
    };
    let mut o = async_nats::ConnectOptions::new()
        .connection_timeout(opts.op_timeout.min(Duration::from_secs(10)))
        .request_timeout(Some(opts.op_timeout))
        .event_callback(move |ev| {
            let healthy = healthy.clone();
            let drops = drops.clone();
            async move {
                match ev {
                    async_nats::Event::Connected => healthy.store(true, Ordering::Release),
                    async_nats::Event::Disconnected | async_nats::Event::Closed => {
                        drops.send_modify(|n| *n += 1);
                        healthy.store(false, Ordering::Release)
                    }
                    _ => {}
                }
            }
        });
    if let Some(n) = &opts.name {
        o = o.name(n);
    }
    o = match credential_source(opts) {
        CredentialSource::Creds => {
            let creds = opts.creds.as_deref().unwrap_or_default();
            o.credentials(creds).map_err(|e| err(e.to_string()))?
        }
        CredentialSource::CredsFile(p) => o
            .credentials_file(&p)
            .await
            .map_err(|e| err(format!("{}: {e}", p.display())))?,
        CredentialSource::Url => match foldhost_core::bucket::url_credentials(&opts.url) {
            Some((user, Some(pass))) => o.user_and_password(user, pass),
            Some((token, None)) => o.token(token),
            None => o,
        },
        CredentialSource::None => o,
    };
    // Every member of the cluster named: the client connects to one and, when that server
    // dies, reconnects to another (the watch then resumes from the applied cursor).
    let servers = foldhost_core::bucket::server_urls(&opts.url);
    if servers.is_empty() {
        return Err(err("no server URL".into()));
    }
    timed("connect", opts.op_timeout, async {
        o.connect(servers).await.map_err(|e| err(e.to_string()))
    })
    .await
}

/// The connection the client's ordered consumer delivers a watch on: a client of its own, so a
/// stored message the library cannot read takes down this connection only (async-nats 0.51
/// panics its connection task on a CR inside a header value), never the one the node's requests
/// share. Discarded when a watch on it ends by a drop or a library failure; the next watch dials
/// a new one.
struct DeliveryClient {
    stream: jetstream::stream::Stream,
    /// Its drop count.
    drops: tokio::sync::watch::Receiver<u64>,
}

/// One bucket on a NATS server: reads, watches and writes.
pub struct NatsKv {
    client: async_nats::Client,
    js: jetstream::Context,
    kv: kv::Store,
    bucket: String,
    stream_name: String,
    subject_prefix: String,
    timeout: Duration,
    /// The stream identity the fold checked and recorded ([`KvWatcher::pin_identity`]): every
    /// watch compares the stream it starts on, and every floor probe the stream it reads, with it.
    pinned: std::sync::Mutex<Option<StreamIdentity>>,
    /// Whether a delta watch may read a short gap by direct gets ([`catchup`]); on by default.
    direct_catch_up: AtomicBool,
    /// Set when a watch on the client's ordered consumer ended because the connection dropped;
    /// the next watch start takes it and reads past the message that dropped it
    /// ([`protocol::catch_up_range`]).
    recovering: AtomicBool,
    /// Messages handed over by direct catch-ups so far (diagnostics and tests).
    direct_reads: std::sync::atomic::AtomicU64,
    /// A resume gap read ahead of its watch (`catchup.rs`).
    prefetch: std::sync::Mutex<Option<catchup::Prefetch>>,
    /// Where a watch's lean delivery connection dials (`lean.rs`); `None`: the client's own
    /// ordered consumer delivers every watch.
    lean_dial: std::sync::Mutex<Option<lean::LeanDial>>,
    /// Where a listing's lean connection dials: the same, whatever [`LEAN_DELIVERY_ENV`] says
    /// (that turns off lean delivery of watches only); `None`: listings go through the client.
    listing_dial: std::sync::Mutex<Option<lean::LeanDial>>,
    /// The options the handle's connection was dialled with, for the ordered consumer's own
    /// connection ([`DeliveryClient`]); `None`: that consumer runs on `client`.
    connect_opts: std::sync::Mutex<Option<ConnectOptions>>,
    /// The ordered consumer's connection, once dialled.
    delivery: Mutex<Option<DeliveryClient>>,
    /// Watches delivered over a lean connection so far (diagnostics and tests).
    lean_watches: std::sync::atomic::AtomicU64,
    /// When the bucket was opened; its stream info then is `kv.stream`'s cached info
    /// ([`NatsKv::start_state`]).
    opened_at: std::time::Instant,
    /// Stream-info requests this handle sent, the open's included (diagnostics and tests).
    info_reads: std::sync::atomic::AtomicU64,
    /// The connection's drop count, when the handle came from a [`NatsConnection`].
    drops: std::sync::Mutex<Option<tokio::sync::watch::Receiver<u64>>>,
}

/// Whether `e` (from `get_key_value`) says the bucket's stream does not exist.
fn bucket_missing(e: &jetstream::context::KeyValueError) -> bool {
    matches!(e.kind(), jetstream::context::KeyValueErrorKind::GetBucket)
        && std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<jetstream::context::GetStreamError>())
            .is_some_and(|g| {
                matches!(g.kind(), jetstream::context::GetStreamErrorKind::JetStream(j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
            })
}

/// Live stream positions, read from the server (not the client's creation-time cache).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamPositions {
    /// The first retained sequence.
    pub first_sequence: u64,
    /// The last sequence written.
    pub last_sequence: u64,
    /// Messages currently held.
    pub messages: u64,
}

impl NatsKv {
    /// Opens `bucket` on a connected client (creating it under `config` when absent and
    /// `config.create`), every call under `timeout`.
    pub async fn open(
        client: async_nats::Client,
        bucket: &str,
        config: &BucketConfig,
        timeout: Duration,
    ) -> Result<Arc<Self>, KvError> {
        let js = jetstream::new(client.clone());
        let stream_name = format!("KV_{bucket}");
        // One request: the bucket's stream info, which says both whether it exists and what the
        // node's first checks need (`start_state`).
        let opened_at = std::time::Instant::now();
        let found = timed("get bucket", timeout, async {
            match js.get_key_value(bucket).await {
                Ok(kv) => Ok(Some(kv)),
                Err(e) if bucket_missing(&e) => Ok(None),
                Err(e) => Err(backend("get bucket", e)),
            }
        })
        .await?;
        let kv = match found {
            Some(kv) => kv,
            None if config.create => {
                create::create_bucket(&client, &js, bucket, config, timeout).await?
            }
            None => return Err(KvError::BucketNotFound(bucket.to_string())),
        };
        Ok(Arc::new(NatsKv {
            subject_prefix: format!("$KV.{bucket}."),
            client,
            js,
            kv,
            bucket: bucket.to_string(),
            stream_name,
            timeout,
            pinned: std::sync::Mutex::new(None),
            direct_catch_up: AtomicBool::new(true),
            recovering: AtomicBool::new(false),
            direct_reads: std::sync::atomic::AtomicU64::new(0),
            prefetch: std::sync::Mutex::new(None),
            lean_dial: std::sync::Mutex::new(None),
            listing_dial: std::sync::Mutex::new(None),
            connect_opts: std::sync::Mutex::new(None),
            delivery: Mutex::new(None),
            lean_watches: std::sync::atomic::AtomicU64::new(0),
            opened_at,
            info_reads: std::sync::atomic::AtomicU64::new(1),
            drops: std::sync::Mutex::new(None),
        }))
    }

    /// Turns the lean connections on (with what `opts` allow; see `lean.rs`) or off. On, watches
    /// are delivered lean unless [`LEAN_DELIVERY_ENV`] turns that off, and listings always are;
    /// the client's ordered consumer, where a watch takes it, runs on a connection of its own
    /// dialled with `opts`. Off, every watch and listing goes through the client. A handle from
    /// [`NatsConnection::bucket`] starts with them on where the options allow it.
    pub fn set_lean_delivery(&self, opts: Option<&ConnectOptions>) {
        let dial = opts.and_then(lean::LeanDial::from_options);
        let watches = lean_allowed(std::env::var(LEAN_DELIVERY_ENV).ok().as_deref());
        *lock(&self.lean_dial) = dial.clone().filter(|_| watches);
        *lock(&self.listing_dial) = dial;
        *lock(&self.connect_opts) = opts.cloned();
    }

    /// Watches delivered over a lean connection so far.
    pub fn lean_watches(&self) -> u64 {
        self.lean_watches.load(Ordering::Relaxed)
    }

    /// The bucket name.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// Turns the direct catch-up of short resume gaps on or off (on by default; off, every delta
    /// watch reads its gap through its consumer). For tests that compare the two paths.
    pub fn set_direct_catch_up(&self, on: bool) {
        self.direct_catch_up.store(on, Ordering::Relaxed);
    }

    /// How many messages direct catch-ups have handed over on this handle.
    pub fn direct_catch_up_reads(&self) -> u64 {
        self.direct_reads.load(Ordering::Relaxed)
    }

    /// Reads the stream's live positions.
    pub async fn positions(&self) -> Result<StreamPositions, KvError> {
        let info = self.stream_info().await?;
        Ok(StreamPositions {
            first_sequence: info.state.first_sequence,
            last_sequence: info.state.last_sequence,
            messages: info.state.messages,
        })
    }

    /// Stream-info requests this handle has sent, the open's included.
    pub fn stream_info_reads(&self) -> u64 {
        self.info_reads.load(Ordering::Relaxed)
    }

    /// The stream's identity and last sequence for a node's identity refusal before its store
    /// opens: from the stream info read when this handle opened the bucket, while that is younger
    /// than [`START_INFO_MAX_AGE`], else fresh. Sound there because nothing of the fold depends on
    /// it: a stream recreated after the open is caught by the fold's own identity check, which
    /// reads afresh once the store is open (see the module invariants).
    pub async fn start_state(&self) -> Result<StreamState, KvError> {
        let state = |info: &async_nats::jetstream::stream::Info| StreamState {
            identity: identity_of(info),
            last_sequence: info.state.last_sequence,
        };
        if self.opened_at.elapsed() <= START_INFO_MAX_AGE {
            return Ok(state(self.kv.stream.cached_info()));
        }
        Ok(state(&self.stream_info().await?))
    }

    /// The stream's info (config and state), fresh from the server.
    async fn stream_info(&self) -> Result<async_nats::jetstream::stream::Info, KvError> {
        self.info_reads.fetch_add(1, Ordering::Relaxed);
        timed("stream info", self.timeout, async {
            self.kv
                .stream
                .get_info()
                .await
                .map_err(|e| backend("stream info", e))
        })
        .await
    }

    /// The stream's retention, read live: whether it can evict a current value, and its first
    /// retained sequence.
    pub async fn read_retention(&self) -> Result<foldhost_core::protocol::Retention, KvError> {
        let info = self.stream_info().await?;
        Ok(retention_of(&info))
    }

    /// The identity the watch holds the stream to: the pinned one, else the one it started on.
    fn pinned(&self) -> Option<StreamIdentity> {
        self.pinned.lock().ok().and_then(|p| p.clone())
    }
}

/// The identity of the stream `info` describes.
fn identity_of(info: &async_nats::jetstream::stream::Info) -> StreamIdentity {
    StreamIdentity {
        name: info.config.name.clone(),
        created_unix_ns: u64::try_from(info.created.unix_timestamp_nanos()).unwrap_or(0),
    }
}

impl NatsKv {
    /// The supersession-only resume (seed 000): when a cursor with the eviction memo looks expired
    /// on a bucket where age is the only eviction and the cursor's message is at most half of
    /// `max_age` old by the server's clock, every later message is younger still, so none aged
    /// out and each one missing was superseded by a later write: the resume may start at the
    /// first retained revision. `None` when that cannot be shown (no memo time, other limits, an
    /// older cursor, a server that does not report its clock).
    async fn supersession_resume(&self, cursor: WatchCursor) -> Result<Option<u64>, KvError> {
        let Some(t) = cursor
            .memo()
            .map(|m| m.server_time_unix_ns)
            .filter(|t| *t > 0)
        else {
            return Ok(None);
        };
        // The raw reply: the typed one drops the server's clock (`ts`).
        let subject = format!("$JS.API.STREAM.INFO.{}", self.stream_name);
        let reply = timed("stream info", self.timeout, async {
            self.client
                .request(subject, Bytes::new())
                .await
                .map_err(|e| backend("stream info", e))
        })
        .await?;
        let v: serde_json::Value = serde_json::from_slice(&reply.payload)
            .map_err(|e| backend("stream info", format!("unreadable reply: {e}")))?;
        let Some(now) = v["ts"].as_str().and_then(rfc3339_unix_ns) else {
            return Ok(None);
        };
        let c = &v["config"];
        let max_age = Duration::from_nanos(c["max_age"].as_u64().unwrap_or(0));
        let age_only = protocol::StreamLimits {
            max_age,
            max_bytes: c["max_bytes"].as_i64().unwrap_or(-1),
            max_messages: c["max_msgs"].as_i64().unwrap_or(-1),
            discard_old: c["discard"].as_str() == Some("old"),
            message_ttl: c["allow_msg_ttl"].as_bool().unwrap_or(false),
        }
        .age_only();
        let first = v["state"]["first_seq"].as_u64().unwrap_or(0);
        let age = Duration::from_nanos(now.saturating_sub(t));
        if first == 0 || !protocol::gap_holds_no_eviction(age_only, max_age, age) {
            return Ok(None);
        }
        tracing::info!(bucket = %self.bucket, cursor = %cursor, first, cursor_message_age_ms = age.as_millis() as u64, "supersession-only gap: every message after the cursor was superseded, none aged out; resuming at the first retained revision");
        Ok(Some(first))
    }
}

/// What a message the client library delivered means: its header block was accepted by the
/// library's parser (else the connection failed before the message reached here), and for every
/// block it accepts the first `KV-Operation` and `Nats-Marker-Reason` it answers are the ones
/// [`protocol::decode_stored`] reads (checked against the library by the proptest
/// `the_decoder_agrees_with_the_client_library`). A status line never reaches here as a stored
/// message: the library takes it for a server notice.
fn header_map_verdict(
    headers: Option<&async_nats::HeaderMap>,
) -> Result<protocol::KvOp, protocol::Undecodable> {
    let header = |name: &async_nats::header::HeaderName| {
        headers
            .and_then(|h| h.get(name.clone()))
            .map(|v| v.as_str())
    };
    Ok(protocol::kv_op(
        header(&KV_OPERATION),
        header(&NATS_MARKER_REASON),
    ))
}

/// Parses an RFC 3339 time into Unix nanoseconds.
fn rfc3339_unix_ns(s: &str) -> Option<u64> {
    let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()?;
    u64::try_from(t.unix_timestamp_nanos()).ok()
}

/// Whether anything reaches a stream other than its own subjects: a mirror, a source or a subject
/// transform.
fn other_inputs(c: &async_nats::jetstream::stream::Config) -> bool {
    c.mirror.is_some()
        || c.sources.as_ref().is_some_and(|s| !s.is_empty())
        || c.subject_transform.is_some()
}

/// A stream's retention from its info: whether it can evict a current value, and its first
/// retained sequence.
fn retention_of(info: &async_nats::jetstream::stream::Info) -> foldhost_core::protocol::Retention {
    let c = &info.config;
    foldhost_core::protocol::Retention {
        evicts_current_values: foldhost_core::protocol::StreamLimits {
            max_age: c.max_age,
            max_bytes: c.max_bytes,
            max_messages: c.max_messages,
            discard_old: c.discard == async_nats::jetstream::stream::DiscardPolicy::Old,
            message_ttl: c.allow_message_ttl,
        }
        .evicts_current_values(),
        first_revision: info.state.first_sequence,
    }
}

impl NatsKv {
    /// The subject filters for a scope ([`protocol::scope_filters`]: never overlapping).
    pub fn filter_subjects(&self, scope: &WatchScope) -> Result<Vec<String>, KvError> {
        let prefixes: Vec<&str> = match scope {
            WatchScope::All => return Ok(vec![format!("{}>", self.subject_prefix)]),
            WatchScope::Prefix(p) => vec![p.as_str()],
            WatchScope::Prefixes(ps) => ps.iter().map(String::as_str).collect(),
        };
        protocol::scope_filters(&self.subject_prefix, prefixes).map_err(KvError::Invalid)
    }

    /// Whether the bucket's stream stores nothing but the bucket's subjects
    /// ([`protocol::plain_stream`]).
    fn plain_stream(&self, c: &async_nats::jetstream::stream::Config) -> bool {
        protocol::plain_stream(
            &c.subjects,
            other_inputs(c),
            &format!("{}>", self.subject_prefix),
        )
    }

    fn key_of<'a>(&self, subject: &'a str) -> Option<&'a str> {
        subject.strip_prefix(self.subject_prefix.as_str())
    }

    /// Turns one delivered message into an update (`None` for a subject outside this bucket).
    /// `parsed`: what the delivery path already read from its ACK subject, if it did.
    fn to_update(
        &self,
        msg: &async_nats::Message,
        parsed: Option<protocol::AckMeta>,
        verdict: Option<Result<protocol::KvOp, protocol::Undecodable>>,
    ) -> Option<(KvUpdate, Option<protocol::AckMeta>)> {
        let meta = parsed.or_else(|| {
            msg.reply
                .as_ref()
                .and_then(|r| protocol::parse_ack_subject(r.as_str()))
        });
        let version = meta
            .map(|m| VersionToken::from_u64(m.stream_sequence))
            .unwrap_or(VersionToken::UNKNOWN);
        let verdict = verdict.unwrap_or_else(|| header_map_verdict(msg.headers.as_ref()));
        let update = self.update_of(msg.subject.as_str(), verdict, &msg.payload, version)?;
        Some((update, meta))
    }

    /// The update one stored message of `subject` stands for, from what it means
    /// ([`protocol::decode_stored`]; `None` for a subject outside this bucket): a delivered
    /// message's and a direct read's alike. An undecodable message is the reserved key
    /// [`protocol::undecodable_key`], which the fold skips and counts, its revision passed.
    fn update_of(
        &self,
        subject: &str,
        verdict: Result<protocol::KvOp, protocol::Undecodable>,
        payload: &Bytes,
        version: VersionToken,
    ) -> Option<KvUpdate> {
        let key = self.key_of(subject)?.to_string();
        Some(match verdict {
            Ok(protocol::KvOp::Delete) => KvUpdate::Delete { key, version },
            Ok(protocol::KvOp::Purge) => KvUpdate::Purge { key, version },
            Ok(protocol::KvOp::Put) => KvUpdate::Put(KvEntry {
                key,
                value: payload.clone(),
                version,
            }),
            Err(reason) => KvUpdate::Delete {
                key: protocol::undecodable_key(subject, reason),
                version,
            },
        })
    }

    /// The bucket key an update is about, for a scope check: an undecodable message's own key.
    fn scope_key<'a>(subject_prefix: &str, update: &'a KvUpdate) -> &'a str {
        protocol::parse_undecodable_key(update.key())
            .and_then(|(subject, _)| subject.strip_prefix(subject_prefix))
            .unwrap_or(update.key())
    }

    /// Lists the latest message of every key under `prefix` through one ephemeral consumer, in key
    /// order. `headers_only` skips the values (for `keys`). Deleted keys and tombstones are dropped.
    async fn list(&self, prefix: &str, headers_only: bool) -> Result<Vec<KvEntry>, KvError> {
        let scope = if prefix.is_empty() {
            WatchScope::All
        } else {
            WatchScope::Prefix(prefix.to_string())
        };
        let mut out = Vec::new();
        self.list_each(&scope, headers_only, &mut |e| {
            out.push(e);
            Ok(())
        })
        .await?;
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// Streams the latest live entry of every key in `scope` into `each`, in delivery order, through
    /// one ephemeral consumer (nothing is collected here). Returns how many were live.
    ///
    /// Delivered over a lean connection ([`lean`]) wherever the options allow one, whatever
    /// [`LEAN_DELIVERY_ENV`] says: a stored header block is then decoded by
    /// [`protocol::decode_stored`], never by the client library, and an undecodable latest
    /// message lists no entry for its key. Only where no lean connection can be made (a websocket
    /// URL, a handle without options) does the listing go through the client.
    async fn list_each(
        &self,
        scope: &WatchScope,
        headers_only: bool,
        each: &mut (dyn FnMut(KvEntry) -> Result<(), KvError> + Send),
    ) -> Result<u64, KvError> {
        let filters = self.filter_subjects(scope)?;
        let inbox = self.client.new_inbox();
        let cfg = consumer::push::Config {
            deliver_subject: inbox.clone(),
            deliver_policy: consumer::DeliverPolicy::LastPerSubject,
            ack_policy: consumer::AckPolicy::None,
            filter_subjects: filters,
            headers_only,
            flow_control: true,
            idle_heartbeat: lean::IDLE_HEARTBEAT,
            inactive_threshold: Duration::from_secs(30),
            memory_storage: true,
            ..Default::default()
        };
        let mut listed = Listed {
            scope,
            headers_only,
            live: 0,
            remaining: 0,
            each,
        };
        let dial = lock(&self.listing_dial).clone();
        if let Some(d) = dial {
            match lean::dial(&d, &inbox).await {
                Ok(conn) => return self.list_lean(conn, cfg, &mut listed).await,
                Err(lean::DialError::Unsupported(why)) => {
                    tracing::info!(bucket = %self.bucket, reason = %why, "listings go through the client");
                    *lock(&self.listing_dial) = None;
                }
                Err(lean::DialError::Transient(why)) => {
                    return Err(backend("list connection", why));
                }
            }
        }
        self.list_through_client(cfg, &mut listed).await
    }

    /// A listing's consumer delivered to a lean connection already subscribed to its deliver
    /// subject.
    async fn list_lean(
        &self,
        conn: lean::Conn,
        cfg: consumer::push::Config,
        listed: &mut Listed<'_, '_>,
    ) -> Result<u64, KvError> {
        let (name, total) = self.create_list_consumer(cfg).await?;
        let _cleanup = ConsumerCleanup {
            stream: self.kv.stream.clone(),
            name,
            timeout: self.timeout,
        };
        let mut deliveries = lean::LeanDeliveries::start(conn, self.bucket.clone());
        listed.remaining = total;
        while listed.remaining > 0 {
            let chunk = match tokio::time::timeout(self.timeout, deliveries.next()).await {
                Ok(Some(c)) => c?,
                Ok(None) => return Err(backend("list", "delivery connection closed")),
                Err(_) => {
                    return Err(KvError::Timeout {
                        op: "list",
                        secs: self.timeout.as_secs(),
                    });
                }
            };
            for d in chunk {
                if let lean::Delivered::Message(msg, meta, verdict) = d {
                    self.list_take(&msg, meta, verdict, listed)?;
                }
            }
        }
        Ok(listed.live)
    }

    /// A listing through the client's own subscription (no lean connection can be made).
    async fn list_through_client(
        &self,
        cfg: consumer::push::Config,
        listed: &mut Listed<'_, '_>,
    ) -> Result<u64, KvError> {
        // Subscribe before the consumer exists: the server may deliver before a later subscribe.
        let mut sub = timed("list subscribe", self.timeout, async {
            self.client
                .subscribe(cfg.deliver_subject.clone())
                .await
                .map_err(|e| backend("list subscribe", e))
        })
        .await?;
        let (name, total) = self.create_list_consumer(cfg).await?;
        listed.remaining = total;
        let result = async {
            while listed.remaining > 0 {
                let msg = match tokio::time::timeout(self.timeout, sub.next()).await {
                    Ok(Some(m)) => m,
                    Ok(None) => return Err(backend("list", "subscription closed")),
                    Err(_) => {
                        return Err(KvError::Timeout {
                            op: "list",
                            secs: self.timeout.as_secs(),
                        });
                    }
                };
                if msg.status.is_some() {
                    // Flow control requests carry a reply subject; answering resumes delivery.
                    if let Some(reply) = &msg.reply {
                        let _ = self.client.publish(reply.clone(), Bytes::new()).await;
                    }
                    continue;
                }
                self.list_take(&msg, None, None, listed)?;
            }
            Ok(listed.live)
        }
        .await;
        drop(sub);
        // Best effort: the consumer also expires by its inactivity threshold.
        let _ = tokio::time::timeout(self.timeout, self.kv.stream.delete_consumer(&name)).await;
        result
    }

    /// Creates a listing's consumer: its name and how many messages it will deliver.
    async fn create_list_consumer(
        &self,
        cfg: consumer::push::Config,
    ) -> Result<(String, u64), KvError> {
        let consumer: consumer::Consumer<consumer::push::Config> =
            timed("list consumer", self.timeout, async {
                self.kv
                    .stream
                    .create_consumer(cfg)
                    .await
                    .map_err(|e| backend("list consumer", e))
            })
            .await?;
        let info = consumer.cached_info();
        Ok((info.name.clone(), info.num_pending))
    }

    /// One delivered message of a listing: counted off what remains, and handed to `each` when
    /// it is a live entry in scope (a CAS tombstone is an empty value; a headers-only delivery
    /// reports the size).
    fn list_take(
        &self,
        msg: &async_nats::Message,
        meta: Option<protocol::AckMeta>,
        verdict: Option<Result<protocol::KvOp, protocol::Undecodable>>,
        listed: &mut Listed<'_, '_>,
    ) -> Result<(), KvError> {
        let Some((update, meta)) = self.to_update(msg, meta, verdict) else {
            return Ok(());
        };
        listed.remaining = match meta {
            Some(m) => m.pending,
            None => listed.remaining.saturating_sub(1),
        };
        if !listed.scope.contains(update.key()) {
            return Ok(());
        }
        if let KvUpdate::Put(e) = update {
            let size = if listed.headers_only {
                msg.headers
                    .as_ref()
                    .and_then(|h| h.get(NATS_MSG_SIZE))
                    .and_then(|v| v.as_str().parse::<u64>().ok())
                    .unwrap_or(1)
            } else {
                e.value.len() as u64
            };
            if size > 0 {
                listed.live += 1;
                (listed.each)(e)?;
            }
        }
        Ok(())
    }

    /// Opens the ordered push consumer of a watch on the stream the fold pinned (which must be the
    /// one here now: read before the consumer exists, so a recreation after this read is caught by
    /// the floor probes, which compare against it). Returns that stream's identity, the message
    /// stream and the consumer's initial backlog.
    async fn open_consumer(
        &self,
        filters: &[String],
        policy: consumer::DeliverPolicy,
        ordered: &AtomicBool,
    ) -> Result<(StreamIdentity, Deliveries, u64, Vec<catchup::Decoded>), KvError> {
        let deliver_subject = self.client.new_inbox();
        let dial = self
            .lean_dial
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        // The watch's own delivery connection opens while the stream is read and the gap caught
        // up: nothing on it depends on them, and a resume waits for both.
        let dialing = async {
            match &dial {
                Some(d) => Some(lean::dial(d, &deliver_subject).await),
                None => None,
            }
        };
        let (start, dialed) = tokio::join!(self.start_point(filters, policy), dialing);
        let (start_identity, filter_subjects, policy, caught_up) = start?;
        let cfg = consumer::push::OrderedConfig {
            deliver_subject,
            filter_subjects,
            deliver_policy: policy,
            ..Default::default()
        };
        let (messages, initial_pending) = match dialed {
            Some(Ok(conn)) => {
                let (name, pending) = self.create_lean_consumer(cfg).await?;
                self.lean_watches.fetch_add(1, Ordering::Relaxed);
                let lean = lean::LeanDeliveries::start(conn, self.bucket.clone());
                (
                    Deliveries::Lean {
                        lean,
                        _cleanup: ConsumerCleanup {
                            stream: self.kv.stream.clone(),
                            name,
                            timeout: self.timeout,
                        },
                    },
                    pending,
                )
            }
            Some(Err(e)) => {
                if let lean::DialError::Unsupported(why) = &e {
                    tracing::info!(bucket = %self.bucket, reason = %why, "watches are delivered through the client's ordered consumer");
                    *lock(&self.lean_dial) = None;
                    *lock(&self.listing_dial) = None;
                } else {
                    tracing::debug!(bucket = %self.bucket, error = %e, "no delivery connection for this watch");
                }
                ordered.store(true, Ordering::Relaxed);
                self.create_ordered_consumer(cfg).await?
            }
            None => {
                ordered.store(true, Ordering::Relaxed);
                self.create_ordered_consumer(cfg).await?
            }
        };
        let head = self.decode_caught_up(&caught_up, initial_pending);
        let initial_pending = initial_pending.saturating_add(head.len() as u64);
        Ok((start_identity, messages, initial_pending, head))
    }

    /// Where a watch's consumer starts: the stream's identity (refused when the fold is pinned
    /// to another), the server-side filters, the deliver policy, and the gap before it when a
    /// short one was read directly ([`catchup`]; the policy then starts past it).
    async fn start_point(
        &self,
        filters: &[String],
        policy: consumer::DeliverPolicy,
    ) -> Result<
        (
            StreamIdentity,
            Vec<String>,
            consumer::DeliverPolicy,
            Vec<catchup::StoredMessage>,
        ),
        KvError,
    > {
        let here_info = self.stream_info().await?;
        let here = identity_of(&here_info);
        let start_identity = match self.pinned() {
            Some(p) if p != here => {
                return Err(KvError::StreamChanged {
                    bucket: self.bucket.clone(),
                    detail: format!("the fold folds {p}, the bucket is now {here}"),
                });
            }
            Some(p) => p,
            None => here,
        };
        let stream_cfg = &here_info.config;
        let recovering = self.recovering.swap(false, Ordering::Relaxed);
        let policy = match policy {
            // A state-sync start whose consumer met a message the client library cannot read
            // (the fold has no cursor yet, so a re-list would meet it again): the stream is read
            // from its first sequence instead, its first stretch through the stream API. The
            // same fold: each key's later messages replace its earlier ones.
            consumer::DeliverPolicy::LastPerSubject if recovering => {
                let first = here_info.state.first_sequence.max(1);
                tracing::info!(bucket = %self.bucket, first, "the state-sync start met a message the client library cannot read: reading the stream from its first sequence instead");
                consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: first,
                }
            }
            p => p,
        };
        let filter_subjects = protocol::server_filters(
            filters,
            &stream_cfg.subjects,
            other_inputs(stream_cfg),
            matches!(policy, consumer::DeliverPolicy::LastPerSubject),
        );
        // A short gap is read directly and the consumer starts past it ([`catchup`]).
        let mut caught_up = Vec::new();
        let mut policy = policy;
        // A prefetch is taken by the first watch, used or not.
        let prefetched = match policy {
            consumer::DeliverPolicy::ByStartSequence { start_sequence } => {
                self.take_prefetch(start_sequence, &start_identity).await
            }
            _ => None,
        };
        if let consumer::DeliverPolicy::ByStartSequence { start_sequence } = policy
            && self.direct_catch_up.load(Ordering::Relaxed)
            && let Some(range) = protocol::catch_up_range(
                start_sequence,
                here_info.state.last_sequence,
                self.plain_stream(stream_cfg),
                protocol::direct_reads_allowed(stream_cfg.allow_direct, stream_cfg.num_replicas),
                recovering,
            )
        {
            if recovering {
                tracing::info!(bucket = %self.bucket, first = *range.start(), last = *range.end(), "reading past the message the client's connection dropped on: these sequences through the stream API, then the consumer");
            }
            let read = match prefetched {
                Some(p) => Some(p),
                None => {
                    let last = *range.end();
                    self.direct_catch_up(range, recovering)
                        .await
                        .map(|m| (last, m))
                }
            };
            if let Some((last, m)) = read {
                caught_up = m;
                policy = consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: last + 1,
                };
            }
        }
        Ok((start_identity, filter_subjects, policy, caught_up))
    }

    /// The client's ordered consumer and its initial backlog, on the ordered consumer's own
    /// connection ([`DeliveryClient`]) when the handle knows how to dial one.
    async fn create_ordered_consumer(
        &self,
        cfg: consumer::push::OrderedConfig,
    ) -> Result<(Deliveries, u64), KvError> {
        let (stream, drops) = self.delivery_stream().await?;
        let consumer = timed("watch consumer", self.timeout, async {
            stream
                .create_consumer(cfg)
                .await
                .map_err(|e| backend("watch consumer", e))
        })
        .await?;
        let initial_pending = consumer.cached_info().num_pending;
        let messages = timed("watch subscribe", self.timeout, async {
            consumer
                .messages()
                .await
                .map_err(|e| backend("watch subscribe", e))
        })
        .await?;
        Ok((
            Deliveries::Ordered {
                chunks: messages.ready_chunks(WATCH_CHUNK),
                drops,
                failed: None,
            },
            initial_pending,
        ))
    }

    /// The stream handle the ordered consumer is created through, and the drop count of its
    /// connection: the [`DeliveryClient`] (dialled when there is none), or the node's client
    /// when the handle has no options to dial with.
    async fn delivery_stream(
        &self,
    ) -> Result<
        (
            jetstream::stream::Stream,
            Option<tokio::sync::watch::Receiver<u64>>,
        ),
        KvError,
    > {
        let Some(opts) = lock(&self.connect_opts).clone() else {
            let drops = lock(&self.drops).clone();
            return Ok((self.kv.stream.clone(), drops));
        };
        let mut delivery = self.delivery.lock().await;
        if let Some(d) = delivery.as_ref() {
            return Ok((d.stream.clone(), Some(d.drops.clone())));
        }
        let drops = Arc::new(tokio::sync::watch::channel(0).0);
        let mut opts = opts;
        opts.name = opts.name.map(|n| format!("{n}-ordered"));
        let client = connect_client(&opts, Arc::new(AtomicBool::new(true)), drops.clone()).await?;
        let stream = timed("delivery stream", self.timeout, async {
            jetstream::new(client)
                .get_stream(&self.stream_name)
                .await
                .map_err(|e| backend("delivery stream", e))
        })
        .await?;
        let d = DeliveryClient {
            stream: stream.clone(),
            drops: drops.subscribe(),
        };
        *delivery = Some(d);
        Ok((stream, Some(drops.subscribe())))
    }

    /// Forgets the ordered consumer's connection (dropped, or failed in the library): the next
    /// watch dials a new one.
    async fn discard_delivery(&self) {
        self.delivery.lock().await.take();
    }

    /// The same consumer as the ordered one (its very configuration), delivered to a lean
    /// connection already subscribed to its deliver subject: its name and initial backlog.
    async fn create_lean_consumer(
        &self,
        cfg: consumer::push::OrderedConfig,
    ) -> Result<(String, u64), KvError> {
        use consumer::IntoConsumerConfig as _;
        let config: consumer::Config = cfg.into_consumer_config();
        let consumer = timed("watch consumer", self.timeout, async {
            self.kv
                .stream
                .create_consumer(config)
                .await
                .map_err(|e| backend("watch consumer", e))
        })
        .await?;
        let info = consumer.cached_info();
        Ok((info.name.clone(), info.num_pending))
    }

    /// Runs a watch ([`NatsKv::deliver_watch`]); when it ends in an error after taking the
    /// client's ordered consumer, whatever ended it (a drop, the library's failure on a stored
    /// message, the subscription's end when its connection task died, a request on that dead
    /// connection), that connection is discarded and the next watch reads the first sequences
    /// after the cursor through the stream API ([`protocol::catch_up_range`]).
    async fn run_watch(
        &self,
        scope: &WatchScope,
        policy: consumer::DeliverPolicy,
        tx: mpsc::Sender<WatchEvent>,
    ) -> Result<(), KvError> {
        let ordered = AtomicBool::new(false);
        let r = self.deliver_watch(scope, policy, tx, &ordered).await;
        if r.is_err() && ordered.load(Ordering::Relaxed) {
            self.recovering.store(true, Ordering::Relaxed);
            self.discard_delivery().await;
        }
        r
    }

    /// Runs an ordered push consumer with `policy` over `scope`, pushing events into `tx` until the
    /// receiver is dropped (`Ok`) or the watch fails. Every chunk passes the floor guard
    /// ([`floor::FloorGuard`]) before it is forwarded ([`Forwarder`]). (A little over 80 lines: the
    /// one `select!` and the chunk decode stay together so the order "check, then forward" is read
    /// in one place.)
    async fn deliver_watch(
        &self,
        scope: &WatchScope,
        policy: consumer::DeliverPolicy,
        tx: mpsc::Sender<WatchEvent>,
        ordered: &AtomicBool,
    ) -> Result<(), KvError> {
        let filters = self.filter_subjects(scope)?;
        let start_frontier = match &policy {
            consumer::DeliverPolicy::ByStartSequence { start_sequence } => {
                Some(start_sequence.saturating_sub(1))
            }
            _ => None,
        };
        let (start_identity, messages, initial_pending, head) =
            self.open_consumer(&filters, policy, ordered).await?;
        let mut out = Forwarder::new(tx, self.subject_prefix.clone());
        if !out.start(initial_pending).await {
            return Ok(());
        }
        // A delta watch is guarded from its cursor, a state-sync one once it is level (its re-list
        // skips superseded sequences by design).
        let prefix_scope = !matches!(scope, WatchScope::All);
        let mut guard = FloorGuard::new(start_frontier, start_identity, filters, prefix_scope);
        // A delta watch's highest delivered stream sequence (see the loop).
        let mut passed: Option<u64> = start_frontier.and_then(|f| {
            head.iter()
                .filter_map(|(_, m)| m.as_ref().map(|m| m.stream_sequence))
                .max()
                .or(if f > 0 { Some(f) } else { None })
        });
        if !head.is_empty() {
            // The directly read gap goes first, checked as any delivered chunk is; the consumer
            // after it is a new one, its first delivery numbered 1.
            guard
                .before_chunk(self, head.iter().filter_map(|(_, m)| m.as_ref()))
                .await?;
            if !out.forward(scope, head, &mut guard).await {
                return Ok(());
            }
            guard.consumer_started();
        }
        if out.level && !guard.is_guarded() {
            // A state-sync start with nothing pending is level at once: guard from the stream's
            // last sequence, read after the consumer exists (a message written in between is
            // delivered anyway, so a frontier ahead of it only forgoes one check).
            guard.guard_from(self.positions().await?.last_sequence);
        }
        let mut consecutive_errors = 0u32;
        // The client's ordered consumer re-creates itself after its connection dropped, silently:
        // when a stored message the library cannot read dropped it, every re-creation meets that
        // message again. The watch ends instead, and the fold's resume reads the gap after its
        // cursor through the stream API (`catchup.rs`), which decodes that message as
        // undecodable and passes it.
        let mut drops = match &messages {
            Deliveries::Ordered { drops, .. } => drops.clone(),
            Deliveries::Lean { .. } => None,
        };
        if let Some(d) = &mut drops {
            d.mark_unchanged();
        }
        let mut backstop = tokio::time::interval(FLOOR_BACKSTOP);
        backstop.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        backstop.reset();
        // Whatever the client already holds is taken as one chunk: one channel send (and at most
        // one wake-up of the fold) per chunk instead of per update.
        let mut messages = messages;
        loop {
            let chunk = tokio::select! {
                c = messages.next() => match c {
                    Some(Ok(c)) => c,
                    Some(Err(e)) => {
                        if let Deliveries::Ordered { failed: Some(why), .. } = &messages {
                            tracing::warn!(bucket = %self.bucket, error = %why, "the client library failed on a delivery; the next watch reads past it through the stream API on a new connection");
                        }
                        return Err(e);
                    }
                    None => break,
                },
                _ = backstop.tick() => {
                    guard.backstop(self, out.level).await?;
                    continue;
                }
                () = dropped(&mut drops) => {
                    return Err(KvError::WatchError(format!(
                        "bucket {}: the client's connection dropped; resuming from the cursor",
                        self.bucket
                    )));
                }
            };
            let mut decoded = Vec::with_capacity(chunk.len());
            for item in chunk {
                match item {
                    lean::Delivered::Message(m, meta, verdict) => {
                        consecutive_errors = 0;
                        if let Some(d) = self.to_update(&m, meta, verdict) {
                            decoded.push(d);
                        }
                    }
                    lean::Delivered::Recreating(e) => {
                        // The ordered consumer recreates itself after a gap or missed heartbeats;
                        // a long run of errors means it cannot.
                        consecutive_errors += 1;
                        guard.consumer_error();
                        tracing::warn!(bucket = %self.bucket, error = %e, "watch: consumer error (recreating)");
                        if consecutive_errors >= 30 {
                            return Err(KvError::WatchError(format!(
                                "bucket {}: {consecutive_errors} consecutive consumer errors, last: {e}",
                                self.bucket
                            )));
                        }
                    }
                }
            }
            if decoded.is_empty() {
                guard.after_errors(self).await?;
                continue;
            }
            // An ordered consumer re-created before its first delivery starts over at the
            // stream's first message (async-nats: `DeliverPolicy::All` when it has delivered
            // nothing) — after a direct catch-up, or on a quiet bucket, that is a replay of the
            // whole stream. A delta watch ends instead, and the fold restarts it from its cursor.
            if let Some(passed) = passed
                && let Some(m) = decoded
                    .iter()
                    .filter_map(|(_, m)| m.as_ref())
                    .find(|m| m.stream_sequence <= passed)
            {
                return Err(KvError::WatchError(format!(
                    "bucket {}: the watch's consumer was re-created behind it (sequence {} after {passed}); restarting from the cursor",
                    self.bucket, m.stream_sequence
                )));
            }
            if start_frontier.is_some() {
                passed = decoded
                    .iter()
                    .filter_map(|(_, m)| m.as_ref().map(|m| m.stream_sequence))
                    .chain(passed)
                    .max();
            }
            guard
                .before_chunk(self, decoded.iter().filter_map(|(_, m)| m.as_ref()))
                .await?;
            if !out.forward(scope, decoded, &mut guard).await {
                return Ok(());
            }
        }
        if matches!(messages, Deliveries::Ordered { .. }) {
            tracing::warn!(bucket = %self.bucket, "the client's ordered consumer ended: its connection is gone (the client library fails on some stored messages); the next watch reads past it through the stream API on a new connection");
        }
        Err(KvError::WatchError(format!(
            "bucket {}: watch stream ended",
            self.bucket
        )))
    }
}

/// A listing in progress: what it keeps, what it has counted, what remains to be delivered.
struct Listed<'a, 'b> {
    scope: &'a WatchScope,
    headers_only: bool,
    live: u64,
    remaining: u64,
    each: &'a mut (dyn FnMut(KvEntry) -> Result<(), KvError> + Send + 'b),
}

/// Resolves when the connection's drop count moves; never without one.
async fn dropped(drops: &mut Option<tokio::sync::watch::Receiver<u64>>) {
    if let Some(d) = drops
        && d.changed().await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// A watch's consumer deliveries: through the client's ordered consumer, or over a lean
/// connection of the watch's own (`lean.rs`).
enum Deliveries {
    Ordered {
        chunks: futures::stream::ReadyChunks<consumer::push::Ordered>,
        /// The drop count of the connection it delivers on.
        drops: Option<tokio::sync::watch::Receiver<u64>>,
        /// Set when the library panicked while delivering: never polled again.
        failed: Option<String>,
    },
    Lean {
        lean: lean::LeanDeliveries,
        _cleanup: ConsumerCleanup,
    },
}

impl Deliveries {
    /// The next chunk (cancel-safe: both sources are); `None` when the deliveries ended, an error
    /// when a lean connection failed (the watch ends; the fold resumes from its cursor).
    ///
    /// A panic of the client library while delivering (async-nats 0.51 asserts on a CR inside a
    /// header value, and its consumer then polls a finished future) is caught here: the watch
    /// ends with an error naming it, and `failed` says so.
    async fn next(&mut self) -> Option<Result<Vec<lean::Delivered>, KvError>> {
        match self {
            Deliveries::Ordered { chunks, failed, .. } => {
                if let Some(why) = failed {
                    return Some(Err(KvError::WatchError(why.clone())));
                }
                match std::panic::AssertUnwindSafe(chunks.next())
                    .catch_unwind()
                    .await
                {
                    Ok(c) => c.map(|c| {
                        Ok(c.into_iter()
                            .map(|item| match item {
                                Ok(m) => lean::Delivered::Message(m.message, None, None),
                                Err(e) => lean::Delivered::Recreating(e.to_string()),
                            })
                            .collect())
                    }),
                    Err(panic) => {
                        let what = panic
                            .downcast_ref::<&str>()
                            .map(|s| (*s).to_string())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "a panic".into());
                        let why = format!(
                            "the client library failed while delivering ({what}); a stored message it cannot read is read through the stream API"
                        );
                        *failed = Some(why.clone());
                        Some(Err(KvError::WatchError(why)))
                    }
                }
            }
            Deliveries::Lean { lean, .. } => lean.next().await,
        }
    }
}

/// Deletes a lean watch's consumer when the watch ends (best effort: the server also removes it
/// after its inactivity threshold once the socket has closed).
struct ConsumerCleanup {
    stream: jetstream::stream::Stream,
    name: String,
    timeout: Duration,
}

impl Drop for ConsumerCleanup {
    fn drop(&mut self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (stream, name, timeout) = (
            self.stream.clone(),
            std::mem::take(&mut self.name),
            self.timeout,
        );
        rt.spawn(async move {
            let _ = tokio::time::timeout(timeout, stream.delete_consumer(&name)).await;
        });
    }
}

/// Forwards a watch's decoded chunks into the fold's channel: the updates in scope, the level
/// marker once the consumer has nothing pending (everything before it first), progress counts, and
/// sparse delivery stamps. Every method answers `false` once the fold has gone (the receiver was
/// dropped): the watch then ends quietly.
struct Forwarder {
    tx: mpsc::Sender<WatchEvent>,
    /// The bucket's subject prefix (`$KV.<bucket>.`): an undecodable message's key is its
    /// subject's ([`NatsKv::scope_key`]).
    subject_prefix: String,
    /// The watch reported it is level with the stream.
    level: bool,
    last_delivered: Option<u64>,
    since_progress: u32,
    last_stamp: std::time::Instant,
}

impl Forwarder {
    fn new(tx: mpsc::Sender<WatchEvent>, subject_prefix: String) -> Self {
        Forwarder {
            tx,
            subject_prefix,
            level: false,
            last_delivered: None,
            since_progress: 0,
            last_stamp: std::time::Instant::now() - STAMP_PERIOD,
        }
    }

    /// Reports the consumer's initial backlog: level at once when nothing is pending.
    async fn start(&mut self, initial_pending: u64) -> bool {
        if initial_pending == 0 {
            self.level = true;
            self.send(WatchEvent::CaughtUp { through: None }).await
        } else {
            self.send(WatchEvent::Pending(initial_pending)).await
        }
    }

    async fn send(&self, ev: WatchEvent) -> bool {
        self.tx.send(ev).await.is_ok()
    }

    /// Forwards one checked chunk; live after the level, the guard's frontier follows every
    /// delivered sequence, and the level itself guards a state-sync watch from there.
    async fn forward(
        &mut self,
        scope: &WatchScope,
        decoded: Vec<(KvUpdate, Option<protocol::AckMeta>)>,
        guard: &mut FloorGuard,
    ) -> bool {
        let mut out: Vec<KvUpdate> = Vec::with_capacity(decoded.len());
        let mut stamp: Option<(u64, u64)> = None;
        for (update, meta) in decoded {
            if scope.contains(NatsKv::scope_key(&self.subject_prefix, &update)) {
                self.last_delivered = update.revision().or(self.last_delivered);
                if let (Some(r), Some(m)) = (update.revision(), meta)
                    && m.timestamp_unix_ns > 0
                {
                    stamp = Some((r, m.timestamp_unix_ns));
                }
                out.push(update);
            }
            let Some(m) = meta else { continue };
            if self.level {
                guard.follow(m.stream_sequence);
                continue;
            }
            if m.pending == 0 {
                // Level: everything before this point goes first, then the marker.
                self.level = true;
                guard.guard_from(m.stream_sequence);
                let done = std::mem::take(&mut out);
                // The stamp goes before the level: a `--catch-up` fold commits and stops on the
                // level, and its memo should carry the time of what it committed.
                if !done.is_empty() && !self.send(WatchEvent::Updates(done)).await {
                    return false;
                }
                if !send_stamp(&self.tx, stamp).await {
                    return false;
                }
                let through = self.last_delivered;
                if !self.send(WatchEvent::CaughtUp { through }).await {
                    return false;
                }
            } else {
                self.since_progress += 1;
                if self.since_progress >= 1024 {
                    self.since_progress = 0;
                    if !self.send(WatchEvent::Pending(m.pending)).await {
                        return false;
                    }
                }
            }
        }
        if !out.is_empty() && !self.send(WatchEvent::Updates(out)).await {
            return false;
        }
        // Stamps are sparse (one per period, and one before the level): an older stamp only makes
        // the memo's time older, which errs on the safe side, and a send per chunk would double
        // the channel traffic of the hot path.
        if stamp.is_some() && self.last_stamp.elapsed() >= STAMP_PERIOD {
            self.last_stamp = std::time::Instant::now();
            if !send_stamp(&self.tx, stamp).await {
                return false;
            }
        }
        true
    }
}

/// Sends a chunk's delivery stamp (`(revision, server time)`), if it has one. False when the
/// receiver is gone.
async fn send_stamp(tx: &mpsc::Sender<WatchEvent>, stamp: Option<(u64, u64)>) -> bool {
    match stamp {
        Some((revision, server_time_unix_ns)) => tx
            .send(WatchEvent::Stamp {
                revision,
                server_time_unix_ns,
            })
            .await
            .is_ok(),
        None => true,
    }
}

fn version_u64(v: VersionToken) -> Result<u64, KvError> {
    v.as_u64()
        .ok_or_else(|| KvError::Invalid(format!("{v:?} is not a NATS revision")))
}

#[async_trait]
impl KvReader for NatsKv {
    async fn get(&self, key: &str) -> Result<Option<KvEntry>, KvError> {
        Ok(self.entry(key).await?.filter(|e| !e.value.is_empty()))
    }

    /// The key's latest message, read from the stream leader as JSON
    /// (`$JS.API.STREAM.MSG.GET`, `last_by_subj`) and decoded by [`protocol::decode_stored`]: no
    /// stored header block reaches the client library (a direct get hands it the block as
    /// stored). An undecodable latest message is an error naming it: what the key holds is then
    /// unknown.
    async fn entry(&self, key: &str) -> Result<Option<KvEntry>, KvError> {
        if !protocol::kv_key_valid(key) {
            return Err(KvError::Invalid(format!("{key:?} is not a valid key")));
        }
        let request =
            serde_json::json!({ "last_by_subj": format!("{}{key}", self.subject_prefix) });
        let answer = timed("entry", self.timeout, async {
            self.client
                .request(
                    format!("$JS.API.STREAM.MSG.GET.{}", self.stream_name),
                    request.to_string().into(),
                )
                .await
                .map_err(|e| backend("entry", e))
        })
        .await?;
        let Some(m) =
            catchup::parse_msg_get_reply(&answer.payload).map_err(|e| backend("entry", e))?
        else {
            return Ok(None);
        };
        let version = VersionToken::from_u64(m.sequence);
        match m.verdict {
            Ok(protocol::KvOp::Put) => Ok(Some(KvEntry {
                key: key.to_string(),
                value: m.payload,
                version,
            })),
            Ok(protocol::KvOp::Delete | protocol::KvOp::Purge) => Ok(Some(KvEntry {
                key: key.to_string(),
                value: Bytes::new(),
                version,
            })),
            Err(reason) => Err(backend(
                "entry",
                format!(
                    "the latest message of {key:?} (revision {}) is undecodable: {reason}",
                    m.sequence
                ),
            )),
        }
    }

    async fn keys(&self, prefix: &str) -> Result<Vec<String>, KvError> {
        Ok(self
            .list(prefix, true)
            .await?
            .into_iter()
            .map(|e| e.key)
            .collect())
    }

    async fn scan(&self, prefix: &str) -> Result<Vec<KvEntry>, KvError> {
        self.list(prefix, false).await
    }

    async fn for_each_key(
        &self,
        scope: &WatchScope,
        each: &mut (dyn FnMut(String) -> Result<(), KvError> + Send),
    ) -> Result<u64, KvError> {
        self.list_each(scope, true, &mut |e| each(e.key)).await
    }
}

#[async_trait]
impl KvWriter for NatsKv {
    async fn put(&self, key: &str, value: Bytes) -> Result<VersionToken, KvError> {
        timed("put", self.timeout, async {
            self.kv
                .put(key, value)
                .await
                .map(VersionToken::from_u64)
                .map_err(|e| backend("put", e))
        })
        .await
    }

    async fn create(&self, key: &str, value: Bytes) -> Result<VersionToken, KvError> {
        timed("create", self.timeout, async {
            match self.kv.create(key, value).await {
                Ok(r) => Ok(VersionToken::from_u64(r)),
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                    Err(KvError::AlreadyExists(key.to_string()))
                }
                Err(e) => Err(backend("create", e)),
            }
        })
        .await
    }

    async fn update(
        &self,
        key: &str,
        value: Bytes,
        expected: VersionToken,
    ) -> Result<VersionToken, KvError> {
        let rev = version_u64(expected)?;
        timed("update", self.timeout, async {
            match self.kv.update(key, value, rev).await {
                Ok(r) => Ok(VersionToken::from_u64(r)),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                    Err(KvError::RevisionMismatch {
                        key: key.to_string(),
                        expected,
                    })
                }
                Err(e) => Err(backend("update", e)),
            }
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<bool, KvError> {
        timed("delete", self.timeout, async {
            self.kv.delete(key).await.map_err(|e| backend("delete", e))
        })
        .await?;
        Ok(true)
    }

    async fn delete_with_version(
        &self,
        key: &str,
        expected: VersionToken,
    ) -> Result<bool, KvError> {
        // A CAS write of an empty value: concurrent writers see a conflict, readers a tombstone.
        self.update(key, Bytes::new(), expected).await?;
        Ok(true)
    }
}

#[async_trait]
impl KvWatcher for NatsKv {
    async fn retention(&self) -> Result<Option<foldhost_core::protocol::Retention>, KvError> {
        self.read_retention().await.map(Some)
    }

    async fn stream_state(&self) -> Result<Option<StreamState>, KvError> {
        let info = self.stream_info().await?;
        Ok(Some(StreamState {
            identity: identity_of(&info),
            last_sequence: info.state.last_sequence,
        }))
    }

    async fn state_and_retention(
        &self,
    ) -> Result<
        (
            Option<StreamState>,
            Option<foldhost_core::protocol::Retention>,
        ),
        KvError,
    > {
        let info = self.stream_info().await?;
        let state = StreamState {
            identity: identity_of(&info),
            last_sequence: info.state.last_sequence,
        };
        Ok((Some(state), Some(retention_of(&info))))
    }

    fn bucket_name(&self) -> String {
        self.bucket.clone()
    }

    fn pin_identity(&self, identity: StreamIdentity) {
        if let Ok(mut p) = self.pinned.lock() {
            *p = Some(identity);
        }
    }

    async fn watch(&self, scope: &WatchScope, tx: mpsc::Sender<WatchEvent>) -> Result<(), KvError> {
        self.run_watch(scope, consumer::DeliverPolicy::LastPerSubject, tx)
            .await
    }

    async fn watch_from(
        &self,
        scope: &WatchScope,
        cursor: WatchCursor,
        tx: mpsc::Sender<WatchEvent>,
    ) -> Result<(), KvError> {
        let Some(rev) = cursor.revision() else {
            return self.watch(scope, tx).await;
        };
        let pos = self.positions().await?;
        if !protocol::resume_window_ok(rev, pos.first_sequence) {
            if let Some(start) = self.supersession_resume(cursor).await? {
                return self
                    .run_watch(
                        scope,
                        consumer::DeliverPolicy::ByStartSequence {
                            start_sequence: start,
                        },
                        tx,
                    )
                    .await;
            }
            return Err(KvError::CursorExpired {
                resume_from: rev.saturating_add(1),
                first_sequence: pos.first_sequence,
            });
        }
        self.run_watch(
            scope,
            consumer::DeliverPolicy::ByStartSequence {
                start_sequence: rev.saturating_add(1),
            },
            tx,
        )
        .await
    }
}

impl std::fmt::Debug for NatsKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsKv")
            .field("bucket", &self.bucket)
            .field("stream", &self.stream_name)
            .finish_non_exhaustive()
    }
}

impl NatsKv {
    /// The JetStream context (for tests and tools that need raw access).
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }
}
