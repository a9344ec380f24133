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
pub mod channel;
mod connection;
mod create;
#[cfg(test)]
mod differential;
mod floor;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
mod lean;
pub mod lease;
mod listing;
mod publish;
mod tls;
mod traits;
mod watch;
pub use lean::{LEAN_DELIVERY_ENV, lean_allowed};
pub use tls::check_tls;
pub mod wire;

pub use create::{create_bucket_raw, kv_stream_config, parse_stream_create_reply};

use connection::{DeliveryClient, connect_client, lock};
pub use connection::{Denials, NatsConnection, nkey_user_public_key};
use floor::FloorGuard;
pub use publish::{ACK_WAIT, Published, WriteKind};
use watch::ConsumerCleanup;

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
    CredentialSource, DEFAULT_WATCH_HEARTBEAT, Secret, credential_source,
};
use foldhost_core::kv::{
    KvEntry, KvError, KvReader, KvUpdate, KvWatcher, KvWriter, OpRecord, StreamIdentity,
    StreamState, VersionToken, WatchCursor, WatchEvent, WatchScope,
};
use foldhost_core::protocol;

/// The header carrying a KV operation (absent, `DEL` or `PURGE`). A static name: looking a header
/// up by `&str` builds (and allocates) a name per message.
const KV_OPERATION: async_nats::header::HeaderName =
    async_nats::header::HeaderName::from_static("KV-Operation");
/// The header of the server's delete markers (NATS 2.11+): why the subject's last message went.
const NATS_MARKER_REASON: async_nats::header::HeaderName =
    async_nats::header::HeaderName::from_static("Nats-Marker-Reason");

/// Longest a stop waits for the server to take what the client still holds (a flush, then a
/// drain). The fold is committed before the connection is shut down, and nothing of it depends on
/// the server by then; the operation timeout (30 s by default) is as long as the grace many
/// orchestrators give a SIGTERM before a SIGKILL.
pub(crate) const SHUTDOWN_BUDGET: Duration = Duration::from_secs(2);

/// Least time between two delivery stamps (`WatchEvent::Stamp`) outside the level.
pub(crate) const STAMP_PERIOD: Duration = Duration::from_millis(100);

/// Longest the stream info read when a bucket was opened stands in for a fresh read in a node's
/// identity refusal before its store opens ([`NatsKv::start_state`]): the refusal costs no request
/// of its own, and a handle opened long before reads afresh.
pub(crate) const START_INFO_MAX_AGE: Duration = Duration::from_secs(2);

/// How many times the floor guard retries a failed probe at a delivery gap before ending the watch.
pub(crate) const FLOOR_PROBE_RETRIES: u32 = 4;

/// How long the floor guard trusts a stream-info answer that retention does not evict current
/// values (on such a bucket a skipped sequence was superseded, and its successor is delivered).
pub(crate) const FLOOR_NON_EVICTING_TRUST: Duration = Duration::from_secs(1);

/// The header a headers-only delivery carries with the payload's size.
const NATS_MSG_SIZE: async_nats::header::HeaderName =
    async_nats::header::HeaderName::from_static("Nats-Msg-Size");

/// Runs `fut` under `limit`; a timeout is [`KvError::Timeout`] naming `op`.
pub(crate) async fn timed<T>(
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
    /// The connection's permission violations, when the handle came from a [`NatsConnection`].
    denials: std::sync::Mutex<Option<tokio::sync::watch::Receiver<connection::Denials>>>,
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
            denials: std::sync::Mutex::new(None),
        }))
    }

    /// Turns the lean connections on (with what `opts` allow; see `lean.rs`) or off. On, watches
    /// are delivered lean unless [`LEAN_DELIVERY_ENV`] turns that off, and listings always are;
    /// the client's ordered consumer, where a watch takes it, runs on a connection of its own
    /// dialled with `opts`. Off, every watch and listing goes through the client. A handle from
    /// [`NatsConnection::bucket`] starts with them on where the options allow it.
    pub fn set_lean_delivery(&self, opts: Option<&ConnectOptions>) {
        let dial = opts.and_then(|o| {
            lean::LeanDial::from_options(o)
                .inspect_err(|why| {
                    tracing::info!(event = "lean_delivery_off", bucket = %self.bucket, reason = %why, "watches and listings are delivered through the client's ordered consumer");
                })
                .ok()
        });
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

    /// The stream's live positions, its age limit in milliseconds (0: none) and whether its
    /// retention can evict a current value, from one fresh stream info (the configuration can
    /// change under a running node).
    pub async fn positions_and_retention(&self) -> Result<(StreamPositions, u64, bool), KvError> {
        let info = self.stream_info().await?;
        let max_age_ms = u64::try_from(info.config.max_age.as_millis()).unwrap_or(u64::MAX);
        let evicts = retention_of(&info).evicts_current_values;
        Ok((
            StreamPositions {
                first_sequence: info.state.first_sequence,
                last_sequence: info.state.last_sequence,
                messages: info.state.messages,
            },
            max_age_ms,
            evicts,
        ))
    }

    /// The bucket's limits as its stream is configured (read when this handle opened it).
    pub fn limits(&self) -> foldhost_core::protocol::BucketLimits {
        let c = &self.kv.stream.cached_info().config;
        foldhost_core::protocol::BucketLimits {
            history: c.max_messages_per_subject,
            max_age_ms: u64::try_from(c.max_age.as_millis()).unwrap_or(u64::MAX),
            max_bytes: c.max_bytes,
        }
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
    /// The supersession-only resume: when a cursor with the eviction memo looks expired
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
        tracing::info!(event = "resume_superseded_gap", bucket = %self.bucket, cursor = %cursor, first, cursor_message_age_ms = age.as_millis() as u64, "supersession-only gap: every message after the cursor was superseded, none aged out; resuming at the first retained revision");
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
    pub(crate) fn filter_subjects(&self, scope: &WatchScope) -> Result<Vec<String>, KvError> {
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
        op_id: Option<protocol::OpId>,
    ) -> Option<catchup::Decoded> {
        let meta = parsed.or_else(|| {
            msg.reply
                .as_ref()
                .and_then(|r| protocol::parse_ack_subject(r.as_str()))
        });
        let version = meta
            .map(|m| VersionToken::from_u64(m.stream_sequence))
            .unwrap_or(VersionToken::UNKNOWN);
        // The client library's delivery (no verdict of ours): its header map says both.
        let op_id = match verdict {
            Some(_) => op_id,
            None => msg
                .headers
                .as_ref()
                .and_then(|h| h.get(protocol::OP_ID_HEADER))
                .and_then(|v| protocol::OpId::parse(v.as_str()).ok()),
        };
        let verdict = verdict.unwrap_or_else(|| header_map_verdict(msg.headers.as_ref()));
        let update = self.update_of(msg.subject.as_str(), verdict, &msg.payload, version)?;
        Some((update, meta, op_id))
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
