//! The `--listen` endpoint: `GET /status`, `POST /query`, and the admin routes `POST /swap`,
//! `POST /shadow` and `POST /export`, over HTTP/1.1 (hyper) with keep-alive — a connection
//! carries several requests, one after the other (pipelined ones too), each admitted on its own —
//! and over HTTP/2 cleartext for a client that opens with the HTTP/2 preface (prior knowledge:
//! h2c), each stream a request admitted on its own, at most [`conn::H2_MAX_STREAMS`] at once per
//! connection; and `GET /`, the status page for people ([`page`]: `page.html`, which shows what
//! `/status` answers).
//!
//! Every decision about a request before its body is read is a pure function over its head
//! ([`admit`], over [`RequestHead::from_parts`]); the hyper plumbing around it (`conn.rs`, and
//! `slot.rs`: a connection's requests in service, its answers and their deadlines) is thin, and
//! so is the client (`client.rs`: [`call`] and its variants, which the CLI uses).
//!
//! Invariants — what an unauthenticated or hostile client cannot do:
//! - **No body byte is read before the request is admitted**: the route known, the caller
//!   authorized (admin routes: the admin token; with a query token, `/status` and `/query` too),
//!   the Host and Origin checked, and the declared length under the route's own limit (`/status`
//!   none, `/query` [`Limits::query_body`], `/swap` [`Limits::swap_body`], `/export` 4 KiB). A
//!   chunked body is read only while its bytes stay within that limit: the chunk that would pass
//!   it is refused (413) unkept, so no more than the limit is ever buffered; an HTTP/2 body
//!   without a `Content-Length` is read as a chunked one. A refused HTTP/1.1 request's connection
//!   is closed, its body left unread; a refused HTTP/2 stream is reset, its body unread, the
//!   connection's other streams going on.
//! - **Bodies and answers in flight are bounded in total**: unauthenticated bodies (queries) share
//!   one byte budget ([`QUERY_BODY_BUDGET`]) taken before the read (a chunked body takes the
//!   route's limit), answers waiting to be written another ([`ANSWER_BUDGET`]) — a request that
//!   cannot get its share at once is refused with 503 — and admin bodies are read one at a time. A
//!   query waits at most [`IO_TIMEOUT`] for room in the fold's control channel (64 deep), then for
//!   its answer. Memory held for clients is therefore bounded by the budgets, one component, the
//!   channel's queries, and per connection a read buffer of at most [`MAX_HEAD`] (HTTP/1.1) or
//!   (HTTP/2) one header list of at most [`MAX_HEAD`], [`conn::H2_WINDOW`] of body bytes not yet
//!   read (the connection's receive window, all its streams together) and, per stream, at most
//!   [`conn::H2_CHUNK`] twice of an answer beyond its client's window — whatever they announce.
//! - **Every connection is bounded in time**: a connection with no request in service for
//!   [`HEAD_DEADLINE`] is closed — the wait for its first head (the HTTP/2 preface included), the
//!   idle time between two requests, an HTTP/2 header block that never ends —, each whole request
//!   (an HTTP/2 stream's too) within [`REQUEST_DEADLINE`] (a trickling client is cut, not waited
//!   for), each answer written within [`WRITE_DEADLINE`] (an HTTP/2 stream's client that opens no
//!   window for it included), or the connection is cut. Idle clients cannot hold every slot
//!   either: with all taken, a new connection evicts the oldest one that is waiting for a request
//!   or whose requests are not yet whole and not authenticated ([`HeadPhase`]); one with a whole
//!   request (an HTTP/2 stream) is never evicted before that answer is written.
//! - **Admin routes always need the token** (`--admin-token`, `--admin-token-file`, or one the
//!   host generates into a 0600 file beside the store); tokens are compared in constant time
//!   ([`token_matches`]).
//! - **No query from just anyone beyond loopback**: a listener on any address but a loopback one
//!   (a wildcard `0.0.0.0` / `::` one included) answers `/status` and `/query` only with the query
//!   token (`--query-token-file`, or one the host generates into `STORE/query-token`, 0600), unless
//!   the operator started it with `--query-open` ([`foldhost_core::protocol::query_access`]).
//! - **No cross-site or rebound request**: the `Host` header must name the listener — a
//!   `--listen-host` name, or an address it listens on (on loopback `127.0.0.1:PORT`,
//!   `localhost:PORT`, …; on a wildcard the IP literal of the address the connection arrived on;
//!   [`foldhost_core::protocol::host_names_listener`]) — and a browser's `Origin`, when present, must be
//!   that same origin. Checked on every request of a connection, not once for it.
//! - **No data in the page, and no script in it but its own**: `GET /` answers a fixed file
//!   compiled into the binary; every figure it shows it fetches from `/status` (with the token
//!   its address's fragment holds, which never reaches the server in a URL) and sets as text,
//!   never as markup. It goes out with [`PAGE_HEADERS`]: a Content-Security-Policy that lets it
//!   run only its inline script and style, fetch only from this origin and load nothing else,
//!   and `nosniff`.
//!
//! Queries are handed to the fold loop ([`foldhost_fold::applied::Control::Query`]) and answered between
//! batches: a query never sees a half-applied batch. Every query goes through one of two
//! functions, over HTTP and over NATS alike: [`ask_one`] (one lookup) and [`ask_many`] (a batch:
//! a `POST /query` whose `Content-Type` is [`LOOKUPS_CONTENT_TYPE`], its lookups and results
//! framed as [`lookups`] says, at most [`MAX_LOOKUPS`] of them; a body that is not frames is a
//! 400 naming the byte offset).

mod admission;
mod client;
mod conn;
mod folds;
mod lookups;
mod slot;
mod token_file;

pub use folds::FoldRegistry;
pub(crate) use folds::fold_name_refusal;

use std::sync::Arc;
use std::time::Duration;

use hyper::header::{HeaderName, HeaderValue};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use foldhost_fold::applied::Control;

pub use admission::{
    AccessPolicy, HeadPhase, HttpError, Limits, Refusal, RequestHead, Route, admit, token_matches,
};
pub use client::{call, call_with_deadline, call_with_headers, call_with_token, split_listen};
pub use conn::serve;
pub use lookups::{
    FrameError, LOOKUPS_CONTENT_TYPE, MAX_LOOKUPS, Outcome, decode_lookups, decode_results,
    encode_lookups, encode_results,
};
pub(crate) use lookups::{encode_looked, is_lookups};
pub(crate) use token_file::{
    ADMIN_TOKEN_FILE, QUERY_TOKEN_FILE, generate_token_file, query_token_from_store, random_token,
    read_generated_token, read_token_file,
};

/// Largest request head accepted.
pub(crate) const MAX_HEAD: usize = 16 * 1024;
/// Largest body any route accepts (the default component size limit for `/swap`); each route
/// has its own, lower or equal ([`Limits`]).
pub(crate) const MAX_BODY: usize = 64 * 1024 * 1024;
/// Largest query body by default.
pub(crate) const MAX_QUERY: usize = 1024 * 1024;
/// Largest `/get` body (a key).
pub(crate) const MAX_GET_BODY: usize = 4096;
/// Largest `/export` body (a path).
pub(crate) const MAX_EXPORT_BODY: usize = 4096;
/// The bytes of query bodies all connections together may hold while they are read.
pub(crate) const QUERY_BODY_BUDGET: usize = 32 * 1024 * 1024;
/// The bytes of query answers all connections together may hold while they are written.
pub(crate) const ANSWER_BUDGET: usize = 64 * 1024 * 1024;
/// Most `--listen-host` names a listener takes.
pub(crate) const MAX_LISTEN_HOSTS: usize = 64;
/// How long a client may take to send its request head, and how long a connection may stay idle
/// between two requests (the wait for the next head is the same clock).
pub(crate) const HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// How long a client may take to send its whole request (head and body): the body has what the
/// head's deadline leaves of it.
pub(crate) const REQUEST_DEADLINE: Duration = Duration::from_secs(30);
/// How long writing a response may take.
pub(crate) const WRITE_DEADLINE: Duration = Duration::from_secs(10);
/// How long a query may wait for its answer.
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// What the server needs from the host.
pub struct ServeState {
    /// The host's status, now.
    pub status: Box<dyn Fn() -> foldhost_core::status::StatusReport + Send + Sync>,
    /// Writes through the host (`None`: this host takes none).
    pub(crate) write: Option<Arc<crate::write::WritePath>>,
    /// The fold's positions and apply rate, for reads that wait for a revision (`None`: no fold).
    pub(crate) positions: Option<crate::write::Positions>,
    /// One key of the committed fold (`POST /get`; `None`: no fold).
    pub(crate) read_key: Option<crate::write::KeyReader>,
    /// The fold's control channel (`None` once the fold stopped).
    pub control: mpsc::Sender<Control>,
    /// Where queries go: the fold's query instance once one is level, the fold loop before
    /// ([`foldhost_fold::applied::Queries`]).
    pub(crate) queries: foldhost_fold::applied::Queries,
    /// Compiles a swapped-in guest off the fold's path (`None`: no guest, no swap).
    pub engine: Option<Arc<foldhost_guest::guest::GuestEngine>>,
    /// Tokens, limits and the listener's address.
    pub policy: AccessPolicy,
    /// The store's backend (for `/export`).
    pub backend: foldhost_core::storedir::Backend,
    /// The watch scope (recorded in exported artifacts).
    pub scope: String,
    /// The stream the fold records now (recorded in exported artifacts, so that a bootstrap of
    /// another incarnation refuses them).
    pub stream: std::sync::Arc<
        dyn Fn() -> Option<foldhost_artifact::artifact::ManifestStream> + Send + Sync,
    >,
    /// The guest's state buckets' folds, carried in exported artifacts beside the fold's own.
    pub state_folds: Vec<foldhost_artifact::artifact::StateFoldSource>,
    /// How many records a fold (and each of its state buckets') may be behind and still be
    /// ready (`GET /readyz`, `--ready-max-lag`).
    pub ready_max_lag: u64,
    /// The folds `/metrics` reads.
    pub(crate) folds: Vec<crate::metrics::FoldSource>,
    /// Set on a listener serving every fold of the process (`/folds/NAME/…`, [`FoldRegistry`]):
    /// this state is then the process's own, and a fold's routes go to the fold's.
    pub(crate) registry: Option<Arc<FoldRegistry>>,
    /// The guest channel the node follows (`None`: none). Its version is the channel's: a swap,
    /// or a shadow that would promote, is refused (a trial shadow is not).
    pub(crate) channel: Option<String>,
}

impl ServeState {
    /// The state of a listener serving the folds of `registry` under `policy`: its own routes are
    /// the process's (`/healthz`, `/readyz`, `/metrics`, `/status`, the page); every fold route
    /// goes to a registered fold, so the fold fields here are never used.
    pub(crate) fn process(
        policy: AccessPolicy,
        registry: Arc<FoldRegistry>,
        ready_max_lag: u64,
    ) -> ServeState {
        let (control, _) = mpsc::channel(1);
        ServeState {
            status: Box::new(foldhost_core::status::StatusReport::default),
            write: None,
            positions: None,
            read_key: None,
            queries: foldhost_fold::applied::Queries::new(control.clone()),
            control,
            engine: None,
            policy,
            backend: foldhost_core::storedir::Backend::AppendLog,
            scope: String::new(),
            stream: Arc::new(|| None),
            state_folds: Vec::new(),
            ready_max_lag,
            folds: Vec::new(),
            registry: Some(registry),
            channel: None,
        }
    }
}

/// Most connections served at once; more wait in the listen backlog. An unauthenticated one holds
/// its slot until it is evicted ([`HeadPhase`]) or, while a request of it is whole, for at most the
/// time its answer takes ([`IO_TIMEOUT`] twice) + [`WRITE_DEADLINE`]; between two requests it is
/// evictable again, and closed after [`HEAD_DEADLINE`] without one.
pub(crate) const MAX_CONNECTIONS: usize = 256;

/// Connections beyond [`MAX_CONNECTIONS`], taken only when every slot is in service and none can
/// be evicted; they serve probes, writes and the operator's routes, and refuse the rest (503).
pub(crate) const RESERVED_CONNECTIONS: usize = 16;

/// Reads (`/query`, `/get`) waiting for a `Foldhost-Min-Revision` at once; one more is refused
/// (503, retry). A waiting read holds no body budget: it waits before its body is read.
pub(crate) const WAITING_READS: usize = 64;

/// A response before it is put on the wire: status, content type, body, the headers beyond
/// those, and whether the connection closes after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) content_type: &'static str,
    pub(crate) body: Vec<u8>,
    /// Headers sent besides `Content-Type` (and `Connection` when it closes): none but the
    /// page's ([`PAGE_HEADERS`]).
    pub(crate) headers: &'static [(HeaderName, HeaderValue)],
    /// Close the connection once written (a refusal: its body, if any, was not read).
    pub(crate) close: bool,
}

impl Reply {
    pub fn new(status: u16, content_type: &'static str, body: impl Into<Vec<u8>>) -> Self {
        Reply {
            status,
            content_type,
            body: body.into(),
            headers: &[],
            close: false,
        }
    }

    /// A refusal: its message as text, and the connection closed after it.
    pub(crate) fn refused(r: &Refusal) -> Self {
        Reply {
            close: true,
            ..Reply::new(r.status, "text/plain", format!("{}\n", r.message))
        }
    }
}

/// The status page (`GET /`): one self-contained file — markup, style and script inline, no
/// asset from anywhere — that fetches `/status` every 2 s and sets its figures as text.
pub(crate) const PAGE: &str = include_str!("page.html");

/// The page's Content-Security-Policy: its own inline script and style only, fetches to this
/// origin only, images only as `data:` URLs (its icon), nothing else.
pub(crate) const PAGE_CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; \
     style-src 'unsafe-inline'; connect-src 'self'; img-src data:";

/// The headers the page goes out with: [`PAGE_CSP`], and no content sniffing.
pub(crate) static PAGE_HEADERS: [(HeaderName, HeaderValue); 2] = [
    (
        hyper::header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(PAGE_CSP),
    ),
    (
        hyper::header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    ),
];

/// `GET /`: the status page ([`PAGE`], with [`PAGE_HEADERS`]).
pub(crate) fn page() -> Reply {
    Reply {
        headers: &PAGE_HEADERS,
        ..Reply::new(200, "text/html; charset=utf-8", PAGE)
    }
}

/// `GET /status`: the host's status as JSON.
pub(crate) fn status(state: &ServeState) -> Reply {
    if let Some(r) = &state.registry {
        return match r.only() {
            Some(fold) => status(&fold),
            None => folds::status(r),
        };
    }
    let v = (state.status)();
    let mut b = serde_json::to_vec(&v).unwrap_or_default();
    b.push(b'\n');
    Reply::new(200, "application/json", b)
}

/// The default of `--ready-max-lag`, records.
pub const DEFAULT_READY_MAX_LAG: u64 = 1000;

/// `GET /metrics`: every fold's figures in the Prometheus text format (`crate::metrics`).
pub(crate) fn metrics(state: &ServeState) -> Reply {
    match &state.registry {
        Some(r) => folds::metrics(r),
        None => metrics_of(&state.folds),
    }
}

/// The metrics of `folds`.
fn metrics_of(folds: &[crate::metrics::FoldSource]) -> Reply {
    match crate::metrics::render(folds) {
        Ok(text) => Reply::new(200, crate::metrics::CONTENT_TYPE, text.into_bytes()),
        Err(_) => Reply::new(500, "text/plain", b"the metrics could not be encoded\n"),
    }
}

/// `GET /healthz`: the process answers.
pub(crate) fn health() -> Reply {
    Reply::new(200, "text/plain", b"ok\n")
}

/// `GET /readyz`: 200 `ready` when the fold runs, has been level with its stream since the host
/// started and is within `--ready-max-lag` records, and so is each state bucket's fold; else 503
/// naming the fold (or the state bucket) and why ([`foldhost_core::protocol::fold_unready`]).
pub(crate) fn ready(state: &ServeState) -> Reply {
    if let Some(r) = &state.registry {
        return folds::ready(r);
    }
    let s = (state.status)();
    let name = state
        .folds
        .first()
        .map_or(s.bucket.as_str(), |f| f.name.as_str());
    match unready(state) {
        // Ready either way: a stale artifact endangers the next expired cursor, not this fold.
        None => match s.artifact.as_ref().and_then(|a| a.warning()) {
            Some(w) => Reply::new(200, "text/plain", format!("ready: fold {name} ({w})\n")),
            None => Reply::new(200, "text/plain", format!("ready: fold {name}\n")),
        },
        Some(w) => Reply::new(503, "text/plain", format!("not ready: {w}\n")),
    }
}

/// Why the fold of `state` is not ready (naming it, or its state bucket), or `None`.
fn unready(state: &ServeState) -> Option<String> {
    let s = (state.status)();
    let name = state
        .folds
        .first()
        .map_or(s.bucket.as_str(), |f| f.name.as_str());
    let mut why = foldhost_core::protocol::fold_unready(
        foldhost_core::protocol::Readiness {
            state: &s.state,
            caught_up: s.caught_up,
            applied_through: s.applied_through,
            seq: s.seq,
            stream_last: s.stream_last_sequence,
        },
        state.ready_max_lag,
    )
    .map(|w| format!("fold {name}: {w}"));
    for b in s.state_buckets.iter().filter(|b| b.declared) {
        if why.is_some() {
            break;
        }
        why = (b.lag > state.ready_max_lag).then(|| {
            format!(
                "fold {name}: state bucket {}: {} records behind (the limit is {})",
                b.local, b.lag, state.ready_max_lag
            )
        });
    }
    why
}

/// A 503 response with `message`.
fn unavailable(message: &str) -> Reply {
    Reply::new(503, "text/plain", format!("{message}\n"))
}

/// What one lookup came to: the guest's answer, or its error.
pub(crate) type Looked = Result<Vec<u8>, foldhost_fold::applied::ApplyError>;

/// One lookup handed to the fold and answered between two batches: the guest's answer or its
/// error; `Err`, the reply to send when it could not be asked or answered (the fold not
/// running, no room for it within [`IO_TIMEOUT`], no answer within another). The one path every
/// single query takes, over HTTP and over NATS.
pub(crate) async fn ask_one(state: &ServeState, request: Vec<u8>) -> Result<Looked, Reply> {
    match tokio::time::timeout(IO_TIMEOUT, state.queries.ask(request)).await {
        Ok(Ok(looked)) => Ok(looked),
        Ok(Err(e)) => Err(unanswered(e)),
        Err(_) => Err(no_answer_in_time()),
    }
}

/// Several lookups, answered one per lookup in their order, by one instance with nothing applied
/// between them ([`foldhost_fold::applied::Queries::ask_many`]); `Err`, the reply to send when the batch
/// could not be asked or answered whole (as [`ask_one`]'s). The one path every batch takes, over
/// HTTP and over NATS, within the time one query may take (twice [`IO_TIMEOUT`]).
pub(crate) async fn ask_many(
    state: &ServeState,
    lookups: Vec<Vec<u8>>,
) -> Result<Vec<Looked>, Reply> {
    match tokio::time::timeout(2 * IO_TIMEOUT, state.queries.ask_many(lookups)).await {
        Ok(Ok(looked)) => Ok(looked),
        Ok(Err(e)) => Err(unanswered(e)),
        Err(_) => Err(no_answer_in_time()),
    }
}

/// The reply to an ask that got no answers at all.
fn unanswered(e: foldhost_fold::applied::Unanswered) -> Reply {
    match e {
        foldhost_fold::applied::Unanswered::Stopped => unavailable("the fold is not running"),
        foldhost_fold::applied::Unanswered::TooMany => {
            Reply::new(400, "text/plain", format!("{e}\n"))
        }
    }
}

/// The 504 of a query the fold did not answer in time.
fn no_answer_in_time() -> Reply {
    Reply::new(504, "text/plain", b"no answer in time\n")
}

/// `reply` (an answer) holding its share of [`ANSWER_BUDGET`] (KiB of `answer_kib`) until it is
/// written, or a 503 when the budget has no room for it now.
fn budgeted(reply: Reply, answer_kib: &Arc<Semaphore>) -> (Reply, Option<OwnedSemaphorePermit>) {
    let kib = reply.body.len().div_ceil(1024);
    let budget = u32::try_from(kib)
        .ok()
        .and_then(|k| answer_kib.clone().try_acquire_many_owned(k).ok());
    match budget {
        Some(b) => (reply, Some(b)),
        None => (unavailable("too many answers in flight; retry"), None),
    }
}

/// `POST /query`: the body handed to the fold ([`ask_one`]), the answer held under `answer_kib`
/// (KiB of [`ANSWER_BUDGET`]) until it is written.
pub(crate) async fn query(
    body: Vec<u8>,
    state: &ServeState,
    answer_kib: &Arc<Semaphore>,
) -> (Reply, Option<OwnedSemaphorePermit>) {
    match ask_one(state, body).await {
        Err(reply) => (reply, None),
        Ok(Ok(answer)) => budgeted(
            Reply::new(200, "application/octet-stream", answer),
            answer_kib,
        ),
        // No guest instance right now: the fold loop rebuilds it as fold work, never for a
        // query (docs/design.md, "The fold loop"), so the caller retries shortly.
        Ok(Err(e)) if e.is_rebuilding() => (unavailable(&e.to_string()), None),
        Ok(Err(e)) => (
            Reply::new(422, "text/plain", format!("{e}\n").as_bytes()),
            None,
        ),
    }
}

/// `POST /query` with `Content-Type: application/x-foldhost-lookups`: the body's lookups
/// ([`lookups`]) handed to the fold as one batch ([`ask_many`]), the framed results held under
/// `answer_kib` until written. A body that is not a sequence of frames, or holds more than
/// [`MAX_LOOKUPS`], is a 400 naming the byte offset where it went wrong.
pub(crate) async fn query_lookups(
    body: &[u8],
    state: &ServeState,
    answer_kib: &Arc<Semaphore>,
) -> (Reply, Option<OwnedSemaphorePermit>) {
    let asked = match lookups::decode_lookups(body) {
        Ok(l) => l,
        Err(e) => {
            return (
                Reply::new(400, "text/plain", format!("lookups: {e}\n")),
                None,
            );
        }
    };
    match ask_many(state, asked).await {
        Err(reply) => (reply, None),
        Ok(results) => budgeted(
            Reply::new(200, LOOKUPS_CONTENT_TYPE, lookups::encode_looked(&results)),
            answer_kib,
        ),
    }
}

/// How long a swap (settle, compile, rebuild from the fold) may take before the caller gives up
/// waiting (the swap itself still completes or is refused).
pub(crate) const SWAP_TIMEOUT: Duration = Duration::from_secs(300);

/// Waits, at most `wait_ms` (a read's `Foldhost-Wait-Ms`, default
/// [`foldhost_core::protocol::READ_WAIT_MS`]), for the fold to apply `min` (its `Foldhost-Min-Revision`);
/// past the bound, the 503 `behind` answer: one JSON object with the lag and
/// `retry_after_seconds`, computed from it and the fold's measured apply rate.
pub(crate) async fn wait_revision(state: &ServeState, min: u64, wait_ms: u64) -> Result<(), Reply> {
    let Some(p) = &state.positions else {
        return Err(unavailable("this host has no fold to wait for"));
    };
    let deadline = tokio::time::Instant::now() + Duration::from_millis(wait_ms);
    let through = p.status.wait_applied(min, deadline).await;
    foldhost_core::protocol::read_gate(min, through, p.rate.per_second()).map_err(|lag| {
        let body = serde_json::json!({
            "behind": true,
            "min_revision": min,
            "applied_through": through,
            "lag_records": lag.records,
            "retry_after_seconds": lag.seconds,
        });
        Reply::new(503, "application/json", format!("{body}\n"))
    })
}

/// `POST /get`: the body is a key; the answer the fold's entry for it, one JSON object —
/// `{"key", "value" (UTF-8) or "value_base64", "revision", "applied_through"}`, or 404 with
/// `"found": false` when the fold does not hold the key.
pub(crate) fn get(body: &[u8], state: &ServeState) -> Reply {
    let Some(read) = &state.read_key else {
        return unavailable("this host has no fold to read");
    };
    let Ok(key) = std::str::from_utf8(body).map(str::trim) else {
        return Reply::new(400, "text/plain", b"the key is not UTF-8\n");
    };
    if !foldhost_core::protocol::kv_key_valid(key) {
        return Reply::new(400, "text/plain", format!("{key:?} is not a valid key\n"));
    }
    let through = state.positions.as_ref().map(|p| {
        p.status
            .applied_through
            .load(std::sync::atomic::Ordering::Acquire)
    });
    let answer = match read(key) {
        Err(e) => return unavailable(&e),
        Ok(None) => {
            let body = serde_json::json!({"key": key, "found": false, "applied_through": through});
            return Reply::new(404, "application/json", format!("{body}\n"));
        }
        Ok(Some(e)) => {
            let mut v = serde_json::json!({
                "key": key,
                "found": true,
                "revision": e.version.as_u64(),
                "applied_through": through,
            });
            match std::str::from_utf8(&e.value) {
                Ok(text) => v["value"] = text.into(),
                Err(_) => {
                    use base64::Engine as _;
                    v["value_base64"] = base64::engine::general_purpose::STANDARD
                        .encode(&e.value)
                        .into()
                }
            }
            v
        }
    };
    Reply::new(200, "application/json", format!("{answer}\n"))
}

/// `POST /write`: the body is a [`crate::write::WriteRequest`]; the answer its
/// [`crate::write::WriteAnswer`], one JSON line, with the status the outcome goes with.
pub(crate) async fn write(body: Vec<u8>, state: &ServeState) -> Reply {
    let Some(w) = &state.write else {
        return unavailable("this host takes no writes");
    };
    let answer = w.write_json(&body).await;
    let mut b = serde_json::to_vec(&answer).unwrap_or_default();
    b.push(b'\n');
    Reply::new(answer.http_status(), "application/json", b)
}

/// `POST /export`: the body is the output path (a directory, or a file ending `.tar`) on the host's
/// machine; the answer is the artifact's manifest.
pub(crate) async fn export(body: Vec<u8>, state: &ServeState) -> Reply {
    let Ok(out) = String::from_utf8(body) else {
        return Reply::new(400, "text/plain", b"the path is not UTF-8\n");
    };
    let out = std::path::PathBuf::from(out.trim());
    match foldhost_fold::applied::export_live_of(
        &state.control,
        state.backend,
        out,
        Some(state.scope.clone()),
        (state.stream)(),
        state.state_folds.clone(),
    )
    .await
    {
        Ok(m) => {
            let mut b = serde_json::to_vec(&m).unwrap_or_default();
            b.push(b'\n');
            Reply::new(200, "application/json", b)
        }
        Err(e) => Reply::new(409, "text/plain", format!("{e}\n").as_bytes()),
    }
}

/// How long a `/shadow` caller waits for the answer of a shadow that waits up to `max_wait` for
/// its batches: a minute longer than the host waits, so the host's own answer (or its 504) comes
/// first.
pub(crate) fn shadow_deadline(max_wait: Duration) -> Duration {
    SWAP_TIMEOUT + max_wait + Duration::from_secs(60)
}

/// Longest wait for a shadow's batches the host accepts, seconds (a day).
pub(crate) const MAX_SHADOW_WAIT_S: u64 = 24 * 3600;

/// Largest JSON header of a `/shadow` body (its request list included).
pub(crate) const MAX_SHADOW_HEADER: usize = 4 * 1024 * 1024;

/// The JSON header line of a `/shadow` body.
#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub(crate) struct ShadowHeader {
    /// Batches to feed the candidate before the comparison.
    pub batches: u64,
    /// Keys to sample when `requests` is empty.
    #[serde(default)]
    pub sample: usize,
    /// The operator's requests (UTF-8 text each).
    #[serde(default)]
    pub requests: Vec<String>,
    /// Swap when the candidate answered every request as the running guest did.
    #[serde(default)]
    pub promote: bool,
    /// Longest wait for the batches, seconds.
    pub max_wait_s: u64,
}

/// Splits a `/shadow` body into its plan and the component: one line of JSON
/// ([`ShadowHeader`]), a newline, then the component's bytes. Pure.
pub(crate) fn parse_shadow_body(
    body: &[u8],
) -> Result<(foldhost_fold::applied::ShadowPlan, &[u8]), String> {
    use foldhost_fold::applied::{MAX_SHADOW_REQUESTS, ShadowPlan, ShadowRequests};
    let end = body
        .iter()
        .take(MAX_SHADOW_HEADER)
        .position(|&b| b == b'\n')
        .ok_or_else(|| {
            format!("the body must start with one line of JSON (at most {MAX_SHADOW_HEADER} bytes)")
        })?;
    let header: ShadowHeader =
        serde_json::from_slice(&body[..end]).map_err(|e| format!("the header: {e}"))?;
    if header.requests.len() > MAX_SHADOW_REQUESTS || header.sample > MAX_SHADOW_REQUESTS {
        return Err(format!("at most {MAX_SHADOW_REQUESTS} requests"));
    }
    let requests = if header.requests.is_empty() {
        if header.sample == 0 {
            return Err("nothing to compare: give requests or a sample of at least one key".into());
        }
        ShadowRequests::Sample(header.sample)
    } else {
        ShadowRequests::List(
            header
                .requests
                .into_iter()
                .map(String::into_bytes)
                .collect(),
        )
    };
    Ok((
        ShadowPlan {
            batches: header.batches,
            requests,
            promote: header.promote,
            tolerated: 0,
            max_wait: Duration::from_secs(header.max_wait_s.min(MAX_SHADOW_WAIT_S)),
        },
        &body[end + 1..],
    ))
}

/// Compiles `bytes` off the fold's path (the fold keeps applying meanwhile; the engine's caches
/// hand the compiled component to the fold's swap or shadow); the error is the response to send.
async fn compile_off_path(
    engine: Arc<foldhost_guest::guest::GuestEngine>,
    bytes: Vec<u8>,
    what: &'static str,
    refused: &'static str,
) -> Result<Vec<u8>, Reply> {
    let compiled =
        tokio::task::spawn_blocking(move || engine.prepare(what, &bytes).map(|_| bytes)).await;
    match compiled {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => Err(Reply::new(
            409,
            "text/plain",
            format!("{refused}: {e}\n").as_bytes(),
        )),
        Err(e) => Err(Reply::new(500, "text/plain", e.to_string().as_bytes())),
    }
}

/// Hands `control` to the fold and answers with what comes back on `rx` within `wait`: the
/// report as JSON (200), the refusal (409), or why there was no answer (503, 504).
async fn ask_fold<T: serde::Serialize, E: std::fmt::Display>(
    state: &ServeState,
    control: Control,
    rx: oneshot::Receiver<Result<T, E>>,
    wait: Duration,
) -> Reply {
    match tokio::time::timeout(SWAP_TIMEOUT, state.control.send(control)).await {
        Ok(Ok(())) => {}
        Ok(Err(_)) => return unavailable("the fold is not running"),
        Err(_) => return unavailable("the fold is busy: no room for the request in time"),
    }
    match tokio::time::timeout(wait, rx).await {
        Ok(Ok(Ok(report))) => {
            let mut b = serde_json::to_vec(&report).unwrap_or_default();
            b.push(b'\n');
            Reply::new(200, "application/json", b)
        }
        Ok(Ok(Err(e))) => Reply::new(409, "text/plain", format!("{e}\n").as_bytes()),
        Ok(Err(_)) => Reply::new(503, "text/plain", b"the fold stopped\n"),
        Err(_) => Reply::new(504, "text/plain", b"no answer in time\n"),
    }
}

/// `POST /shadow`: compile the candidate off the fold's path, then hand it to the fold as a
/// shadow; the answer is the [`foldhost_fold::applied::ShadowReport`] (200), or why the shadow failed (409).
pub(crate) async fn shadow(body: Vec<u8>, state: &ServeState) -> Reply {
    let Some(engine) = state.engine.clone() else {
        return Reply::new(409, "text/plain", b"this host runs no guest to shadow\n");
    };
    let (plan, component) = match parse_shadow_body(&body) {
        Ok((plan, component)) => (plan, component.to_vec()),
        Err(e) => {
            return Reply::new(400, "text/plain", format!("{e}\n").as_bytes());
        }
    };
    drop(body);
    if plan.promote
        && let Some(refused) = follows_channel(state, "a shadow that promotes")
    {
        return refused;
    }
    let bytes = match compile_off_path(engine, component, "the candidate", "shadow refused").await {
        Ok(bytes) => bytes,
        Err(answer) => return answer,
    };
    // The host gives up first ([`shadow_deadline`] gives the caller a minute more): dropping the
    // reply ends the shadow in the fold without a promotion nobody would hear of.
    let wait = SWAP_TIMEOUT + plan.max_wait;
    let (tx, rx) = oneshot::channel();
    let control = Control::Shadow {
        bytes,
        what: "the candidate".into(),
        plan,
        reply: tx,
    };
    ask_fold(state, control, rx, wait).await
}

/// The refusal of `what` on a node that follows a guest channel: the channel alone moves its
/// version (a version it does not know would run unjudged, and be judged as the release's).
fn follows_channel(state: &ServeState, what: &str) -> Option<Reply> {
    state.channel.as_ref().map(|channel| {
        let said = format!(
            "{what} refused: this node follows guest channel {channel:?}, which alone moves its version: publish a release (foldhost guest publish), or shadow without --promote to try one here\n"
        );
        Reply::new(409, "text/plain", said.as_bytes())
    })
}

pub(crate) async fn swap(body: Vec<u8>, state: &ServeState) -> Reply {
    let Some(engine) = state.engine.clone() else {
        return Reply::new(409, "text/plain", b"this host runs no guest to swap\n");
    };
    if let Some(refused) = follows_channel(state, "a swap") {
        return refused;
    }
    let bytes = match compile_off_path(engine, body, "the new guest", "swap refused").await {
        Ok(bytes) => bytes,
        Err(answer) => return answer,
    };
    let (tx, rx) = oneshot::channel();
    let control = Control::Swap {
        bytes,
        what: "the new guest".into(),
        reply: tx,
    };
    ask_fold(state, control, rx, SWAP_TIMEOUT).await
}
