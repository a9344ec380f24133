//! The `--listen` endpoint: `GET /status`, `POST /query`, and the admin routes `POST /swap` and
//! `POST /export`, over a deliberately small HTTP/1.1.
//!
//! Parsing is a pure function over bytes ([`parse_request`]), and so is every decision about a
//! request before its body is read ([`admit`]); the I/O loop around them is thin. One request per
//! connection (`Connection: close`).
//!
//! Invariants — what an unauthenticated or hostile client cannot do:
//! - **No body byte is read before the request is admitted**: the route known, the caller
//!   authorized (admin routes: the admin token; with a query token, `/status` and `/query` too),
//!   the Host and Origin checked, and the declared length under the route's own limit (`/status`
//!   none, `/query` [`Limits::query_body`], `/swap` [`Limits::swap_body`], `/export` 4 KiB).
//! - **Bodies and answers in flight are bounded in total**: unauthenticated bodies (queries) share
//!   one byte budget ([`QUERY_BODY_BUDGET`]) taken before the read, answers waiting to be written
//!   another ([`ANSWER_BUDGET`]) — a request that cannot get its share at once is refused with
//!   503 — and admin bodies are read one at a time. A query waits at most [`IO_TIMEOUT`] for room
//!   in the fold's control channel (64 deep), then for its answer. Memory held for clients is
//!   therefore bounded by the budgets, one component, and the channel's queries, whatever they
//!   announce.
//! - **Every connection is bounded in time**: the head within [`HEAD_DEADLINE`], the whole request
//!   within [`REQUEST_DEADLINE`] (a trickling client is cut, not waited for), the response written
//!   within [`WRITE_DEADLINE`]. Idle clients cannot hold every slot either: with all taken, a new
//!   connection evicts the oldest one whose request is not yet whole and not authenticated
//!   ([`HeadPhase`]).
//! - **Admin routes always need the token** (`--admin-token`, `--admin-token-file`, or one the
//!   host generates into a 0600 file beside the store); tokens are compared in constant time.
//! - **No query from just anyone beyond loopback**: a listener on any address but a loopback one
//!   (a wildcard `0.0.0.0` / `::` one included) answers `/status` and `/query` only with the query
//!   token (`--query-token-file`, or one the host generates into `STORE/query-token`, 0600), unless
//!   the operator started it with `--query-open` ([`crate::protocol::query_access`]).
//! - **No cross-site or rebound request**: the `Host` header must name the listener — a
//!   `--listen-host` name, or an address it listens on (on loopback `127.0.0.1:PORT`,
//!   `localhost:PORT`, …; on a wildcard the IP literal of the address the connection arrived on;
//!   [`crate::protocol::host_names_listener`]) — and a browser's `Origin`, when present, must be
//!   that same origin.
//!
//! Queries are handed to the fold loop ([`crate::applied::Control::Query`]) and answered between
//! batches: a query never sees a half-applied batch.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::applied::Control;

/// Largest request head accepted.
pub const MAX_HEAD: usize = 16 * 1024;
/// Largest body any route accepts (the default component size limit for `/swap`); each route
/// has its own, lower or equal ([`Limits`]).
pub const MAX_BODY: usize = 64 * 1024 * 1024;
/// Largest query body by default.
pub const MAX_QUERY: usize = 1024 * 1024;
/// Largest `/export` body (a path).
pub const MAX_EXPORT_BODY: usize = 4096;
/// The bytes of query bodies all connections together may hold while they are read.
pub const QUERY_BODY_BUDGET: usize = 32 * 1024 * 1024;
/// The bytes of query answers all connections together may hold while they are written.
pub const ANSWER_BUDGET: usize = 64 * 1024 * 1024;
/// Most `--listen-host` names a listener takes.
pub const MAX_LISTEN_HOSTS: usize = 64;
/// How long a client may take to send its request head.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// How long a client may take to send its whole request (head and body).
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(30);
/// How long writing a response may take.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(10);
/// How long a query may wait for its answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// A parsed request head.
#[derive(Debug, PartialEq, Eq)]
pub struct RequestHead {
    /// `GET`, `POST`, …
    pub method: String,
    /// The path, without the query string.
    pub path: String,
    /// The declared body length.
    pub content_length: usize,
    /// The bearer token of an `Authorization: Bearer …` header.
    pub bearer: Option<String>,
    /// The `Host` header.
    pub host: Option<String>,
    /// The `Origin` header (browsers send it on cross-site requests).
    pub origin: Option<String>,
    /// Bytes of the head, including the blank line.
    pub head_len: usize,
}

/// Why a request was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    /// Malformed.
    #[error("bad request: {0}")]
    Bad(&'static str),
    /// Over a limit.
    #[error("too large")]
    TooLarge,
}

/// Parses a request head from the bytes received so far: `Ok(None)` means "need more bytes".
pub fn parse_request(buf: &[u8]) -> Result<Option<RequestHead>, HttpError> {
    let Some(end) = find(buf, b"\r\n\r\n") else {
        return if buf.len() > MAX_HEAD {
            Err(HttpError::TooLarge)
        } else {
            Ok(None)
        };
    };
    let head_len = end + 4;
    if head_len > MAX_HEAD {
        return Err(HttpError::TooLarge);
    }
    let head = std::str::from_utf8(&buf[..end]).map_err(|_| HttpError::Bad("head is not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let request_line = lines.next().ok_or(HttpError::Bad("empty request"))?;
    let mut parts = request_line.split(' ');
    let method = parts.next().ok_or(HttpError::Bad("no method"))?;
    let target = parts.next().ok_or(HttpError::Bad("no target"))?;
    let version = parts.next().ok_or(HttpError::Bad("no version"))?;
    if !version.starts_with("HTTP/1.") || parts.next().is_some() {
        return Err(HttpError::Bad("not HTTP/1.x"));
    }
    let mut content_length = 0usize;
    let mut bearer = None;
    let mut host = None;
    let mut origin = None;
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .ok_or(HttpError::Bad("header without a colon"))?;
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("content-length") {
            content_length = value
                .parse()
                .map_err(|_| HttpError::Bad("bad content-length"))?;
        } else if name.eq_ignore_ascii_case("authorization") {
            bearer = value.strip_prefix("Bearer ").map(|t| t.trim().to_string());
        } else if name.eq_ignore_ascii_case("host") {
            if host.is_some() {
                return Err(HttpError::Bad("more than one Host header"));
            }
            host = Some(value.to_string());
        } else if name.eq_ignore_ascii_case("origin") {
            origin = Some(value.to_string());
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(HttpError::Bad("chunked bodies are not accepted"));
        }
    }
    if content_length > MAX_BODY {
        return Err(HttpError::TooLarge);
    }
    let path = target.split('?').next().unwrap_or(target).to_string();
    Ok(Some(RequestHead {
        method: method.to_string(),
        path,
        content_length,
        bearer,
        host,
        origin,
        head_len,
    }))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Renders a response.
pub fn response(status: u16, reason: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// The routes the endpoint serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `GET /status`.
    Status,
    /// `POST /query`.
    Query,
    /// `POST /swap` (admin).
    Swap,
    /// `POST /shadow` (admin): a JSON header line, then the candidate component.
    Shadow,
    /// `POST /export` (admin).
    Export,
}

impl Route {
    /// True for the routes that change the host (they need the admin token).
    pub fn is_admin(self) -> bool {
        matches!(self, Route::Swap | Route::Shadow | Route::Export)
    }
}

/// Body limits per route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest `/query` body.
    pub query_body: usize,
    /// Largest `/swap` body (a component).
    pub swap_body: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            query_body: MAX_QUERY,
            swap_body: MAX_BODY,
        }
    }
}

/// Who may call what, and where the endpoint listens: everything [`admit`] decides with.
#[derive(Debug, Clone)]
pub struct AccessPolicy {
    /// The token admin routes require (always set: given, or generated by the host).
    pub admin_token: String,
    /// The token `/status` and `/query` require, when set (the admin token also opens them).
    /// Always set on a listener beyond loopback unless the operator chose `--query-open`
    /// ([`crate::protocol::query_access`]).
    pub query_token: Option<String>,
    /// The listener's bound address (`Host` is checked against it, or against the address a
    /// connection arrived on when it is a wildcard: [`crate::protocol::host_names_listener`]).
    pub listen: SocketAddr,
    /// The names clients reach the listener by (`--listen-host`), with or without a port.
    pub hosts: Vec<String>,
    /// `--query-open`: `/status` and `/query` answer without a token on a listener beyond
    /// loopback. Without it (and without `query_token`) such a listener answers them to the admin
    /// token only.
    pub query_open: bool,
    /// Body limits.
    pub limits: Limits,
}

/// A refused request: the status, its reason phrase, and a one-line message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// HTTP status.
    pub status: u16,
    /// Reason phrase.
    pub reason: &'static str,
    /// What was wrong.
    pub message: String,
}

impl Refusal {
    fn new(status: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Refusal {
            status,
            reason,
            message: message.into(),
        }
    }

    /// The response for this refusal.
    pub fn response(&self) -> Vec<u8> {
        response(
            self.status,
            self.reason,
            "text/plain",
            format!("{}\n", self.message).as_bytes(),
        )
    }
}

/// `a == b` in time independent of where they differ (both are hashed first, and BLAKE3 hashes
/// compare in constant time), so a token cannot be guessed byte by byte from response times.
pub fn token_matches(given: Option<&str>, want: &str) -> bool {
    given.is_some_and(|g| blake3::hash(g.as_bytes()) == blake3::hash(want.as_bytes()))
}

/// Decides, from the head alone, whether a request that came in on the local address
/// `arrived_on` may proceed, and returns its route and the largest body it may then read. Checked
/// in this order: route and method (404, 405), Host and Origin (403: a rebound name or a
/// cross-site browser request; [`crate::protocol::host_names_listener`]), the token (401), the
/// declared body length against the route's limit (413).
pub fn admit(
    head: &RequestHead,
    policy: &AccessPolicy,
    arrived_on: SocketAddr,
) -> Result<(Route, usize), Refusal> {
    let route = match head.path.as_str() {
        "/status" => Route::Status,
        "/query" => Route::Query,
        "/swap" => Route::Swap,
        "/shadow" => Route::Shadow,
        "/export" => Route::Export,
        _ => return Err(Refusal::new(404, "Not Found", "not found")),
    };
    let method = if route == Route::Status {
        "GET"
    } else {
        "POST"
    };
    if head.method != method {
        return Err(Refusal::new(
            405,
            "Method Not Allowed",
            format!("{} takes {method}", head.path),
        ));
    }
    if !crate::protocol::host_names_listener(
        head.host.as_deref(),
        policy.listen,
        arrived_on,
        &policy.hosts,
    ) {
        return Err(Refusal::new(
            403,
            "Forbidden",
            format!(
                "Host {:?} does not name this listener ({}): a name clients use needs --listen-host",
                head.host.as_deref().unwrap_or(""),
                policy.listen
            ),
        ));
    }
    if let Some(origin) = &head.origin {
        let same = head
            .host
            .as_deref()
            .is_some_and(|h| origin.eq_ignore_ascii_case(&format!("http://{h}")));
        if !same {
            return Err(Refusal::new(
                403,
                "Forbidden",
                format!("cross-origin request from {origin:?} refused"),
            ));
        }
    }
    let bearer = head.bearer.as_deref();
    let admin = token_matches(bearer, &policy.admin_token);
    if route.is_admin() && !admin {
        return Err(Refusal::new(
            401,
            "Unauthorized",
            format!("{} needs the admin bearer token", head.path),
        ));
    }
    let query_allowed = || {
        use crate::protocol::QueryAccess;
        let loopback = policy.listen.ip().to_canonical().is_loopback();
        match crate::protocol::query_access(
            loopback,
            policy.query_token.is_some(),
            policy.query_open,
        ) {
            Ok(QueryAccess::Open | QueryAccess::OpenByChoice) => true,
            // A listener beyond loopback with no token and no `--query-open`: nobody but the admin.
            Ok(QueryAccess::GeneratedToken) => false,
            Ok(QueryAccess::GivenToken) | Err(_) => policy
                .query_token
                .as_deref()
                .is_some_and(|q| token_matches(bearer, q)),
        }
    };
    if !route.is_admin() && !admin && !query_allowed() {
        return Err(Refusal::new(
            401,
            "Unauthorized",
            format!("{} needs the query bearer token", head.path),
        ));
    }
    let limit = match route {
        Route::Status => 0,
        Route::Query => policy.limits.query_body,
        Route::Swap => policy.limits.swap_body,
        Route::Shadow => policy.limits.swap_body.saturating_add(MAX_SHADOW_HEADER),
        Route::Export => MAX_EXPORT_BODY,
    };
    if head.content_length > limit {
        return Err(Refusal::new(
            413,
            "Payload Too Large",
            format!(
                "{} takes at most {limit} body bytes, {} announced",
                head.path, head.content_length
            ),
        ));
    }
    Ok((route, limit))
}

/// The admin token file a host generates in its store directory when no token is given.
pub const ADMIN_TOKEN_FILE: &str = "admin-token";
/// The query token file a host listening beyond loopback generates in its store directory when
/// no query token is given (and `--query-open` is not).
pub const QUERY_TOKEN_FILE: &str = "query-token";
/// Largest token file read.
const MAX_TOKEN_FILE: u64 = 4096;

/// Reads a token file: its content, trimmed, must be non-empty and at most 4 KiB.
pub fn read_token_file(path: &std::path::Path) -> std::io::Result<String> {
    use std::io::Read as _;
    let f = std::fs::File::open(path).map_err(|e| {
        std::io::Error::new(e.kind(), format!("token file {}: {e}", path.display()))
    })?;
    let mut text = String::new();
    f.take(MAX_TOKEN_FILE + 1)
        .read_to_string(&mut text)
        .map_err(|e| {
            std::io::Error::new(e.kind(), format!("token file {}: {e}", path.display()))
        })?;
    let t = text.trim();
    if t.is_empty() || text.len() as u64 > MAX_TOKEN_FILE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("token file {}: empty or over 4 KiB", path.display()),
        ));
    }
    Ok(t.to_string())
}

/// Reads a token file a host generated ([`generate_token_file`]), refusing anything else: the
/// file must be named [`ADMIN_TOKEN_FILE`], be a regular file no one but its owner can read
/// (mode 0600 or stricter), and hold 64 hex digits. A client that follows the path a listener
/// names in `/status` uses this, so a listener that is not the host (a squatter on the port)
/// cannot make it send some other file (a private key) as a bearer token.
pub fn read_generated_token(path: &std::path::Path) -> std::io::Result<String> {
    use std::os::unix::fs::PermissionsExt as _;
    let refuse = |why: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{}: not a generated admin token file: {why}",
                path.display()
            ),
        )
    };
    if path.file_name() != Some(std::ffi::OsStr::new(ADMIN_TOKEN_FILE)) {
        return Err(refuse("wrong name"));
    }
    let meta = std::fs::symlink_metadata(path)?;
    if !meta.file_type().is_file() || meta.permissions().mode() & 0o077 != 0 {
        return Err(refuse("not a private regular file"));
    }
    let token = read_token_file(path)?;
    if token.len() != 64 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(refuse("not 64 hex digits"));
    }
    Ok(token)
}

/// The query token a host listening beyond loopback uses when given none: the one in `path`
/// ([`QUERY_TOKEN_FILE`] in the store) if a run before generated it and it is still private,
/// else a new one generated there ([`generate_token_file`]). Kept across restarts, so remote
/// clients that copied it once keep working; delete the file to change it.
pub fn query_token_from_store(path: &std::path::Path) -> std::io::Result<String> {
    use std::os::unix::fs::PermissionsExt as _;
    let private = std::fs::symlink_metadata(path)
        .is_ok_and(|m| m.file_type().is_file() && m.permissions().mode() & 0o077 == 0);
    match read_token_file(path) {
        Ok(t) if private && t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()) => Ok(t),
        _ => generate_token_file(path),
    }
}

/// Generates a token (32 bytes from the OS's random source, hex) and writes it to `path`
/// readable and writable by this user only (mode 0600, written beside and renamed into place).
pub fn generate_token_file(path: &std::path::Path) -> std::io::Result<String> {
    use std::io::{Read as _, Write as _};
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut raw = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut raw))
        .map_err(|e| std::io::Error::new(e.kind(), format!("/dev/urandom: {e}")))?;
    let token: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(token.as_bytes())?;
            f.write_all(b"\n")?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    written.map_err(|e| {
        std::io::Error::new(e.kind(), format!("token file {}: {e}", path.display()))
    })?;
    Ok(token)
}

/// What the server needs from the host.
pub struct ServeState {
    /// The host's status, now.
    pub status: Box<dyn Fn() -> crate::status::StatusReport + Send + Sync>,
    /// The fold's control channel (`None` once the fold stopped).
    pub control: mpsc::Sender<Control>,
    /// Compiles a swapped-in guest off the fold's path (`None`: no guest, no swap).
    pub engine: Option<Arc<crate::guest::GuestEngine>>,
    /// Tokens, limits and the listener's address.
    pub policy: AccessPolicy,
    /// The store's backend (for `/export`).
    pub backend: crate::storedir::Backend,
    /// The watch scope (recorded in exported artifacts).
    pub scope: String,
    /// The stream the fold records now (recorded in exported artifacts, so that a bootstrap of
    /// another incarnation refuses them).
    pub stream: std::sync::Arc<dyn Fn() -> Option<crate::artifact::ManifestStream> + Send + Sync>,
}

/// Most connections served at once; more wait in the listen backlog. An unauthenticated one holds
/// its slot until it is evicted ([`HeadPhase`]) or, once whole, for at most the time its answer
/// takes ([`IO_TIMEOUT`] twice) + [`WRITE_DEADLINE`].
pub const MAX_CONNECTIONS: usize = 256;

/// The connections still sending their request, oldest first: when every slot is taken, a new
/// connection takes the slot of the oldest of these (it is told to close), so clients that open
/// connections and send nothing — or a head and never the body — cannot lock out one that sends
/// its request at once. A connection leaves the queue once its request is whole, or once it is
/// admitted with the admin token; from then on only its deadlines end it.
#[derive(Debug, Default)]
pub struct HeadPhase {
    next: u64,
    queue: std::collections::VecDeque<(u64, Arc<tokio::sync::Notify>)>,
}

impl HeadPhase {
    /// Enters a connection; returns its ticket and what tells it to close.
    pub fn enter(&mut self) -> (u64, Arc<tokio::sync::Notify>) {
        let id = self.next;
        self.next += 1;
        let n = Arc::new(tokio::sync::Notify::new());
        self.queue.push_back((id, n.clone()));
        (id, n)
    }

    /// The connection `id` has sent its whole request, was authenticated, or ended: it can no
    /// longer be evicted.
    pub fn leave(&mut self, id: u64) {
        self.queue.retain(|(i, _)| *i != id);
    }

    /// Tells the oldest connection still in its head phase to close; its ticket, if there was one.
    pub fn evict_oldest(&mut self) -> Option<u64> {
        let (id, n) = self.queue.pop_front()?;
        n.notify_one();
        Some(id)
    }

    /// Connections in their head phase.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// True when no connection is in its head phase.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

/// The byte budgets bodies are read under and answers written under (see the module invariants).
struct Budgets {
    /// Query bodies, in KiB.
    query_kib: Arc<Semaphore>,
    /// Query answers waiting to be written, in KiB.
    answer_kib: Arc<Semaphore>,
    /// One admin body at a time.
    admin: Arc<Semaphore>,
}

/// Serves until the listener fails; each connection on its own task, at most
/// [`MAX_CONNECTIONS`] at once. With every slot taken, a new connection evicts the oldest one that
/// has not yet sent a whole unauthenticated request ([`HeadPhase`]), retrying while it waits.
pub async fn serve(listener: TcpListener, state: Arc<ServeState>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let budgets = Arc::new(Budgets {
        query_kib: Arc::new(Semaphore::new(QUERY_BODY_BUDGET / 1024)),
        answer_kib: Arc::new(Semaphore::new(ANSWER_BUDGET / 1024)),
        admin: Arc::new(Semaphore::new(1)),
    });
    let heads = Arc::new(std::sync::Mutex::new(HeadPhase::default()));
    loop {
        let (sock, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "listen: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let permit = loop {
            match slots.clone().try_acquire_owned() {
                Ok(p) => break Some(p),
                Err(tokio::sync::TryAcquireError::Closed) => break None,
                Err(tokio::sync::TryAcquireError::NoPermits) => {}
            }
            if let Ok(mut h) = heads.lock() {
                h.evict_oldest();
            }
            // The evicted connection gives its slot back (or, with none to evict, one whose
            // deadlines run out); evict again if another took it first.
            if let Ok(p) =
                tokio::time::timeout(Duration::from_millis(50), slots.clone().acquire_owned()).await
            {
                break p.ok();
            }
        };
        let Some(permit) = permit else {
            return;
        };
        // Registered before its task runs, so an accept burst always finds someone to evict.
        let Ok((ticket, evicted)) = heads.lock().map(|mut h| h.enter()) else {
            return;
        };
        let (state, budgets, heads) = (state.clone(), budgets.clone(), heads.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let conn = Conn {
                state: &state,
                budgets: &budgets,
                heads: &heads,
                ticket,
            };
            if let Err(e) = conn.handle(sock, &evicted).await {
                tracing::debug!(error = %e, "listen: connection ended");
            }
            conn.leave();
        });
    }
}

/// Reads what the client sent next into `buf`, at most `max` bytes more; `false` at end of
/// stream.
async fn read_more(sock: &mut TcpStream, buf: &mut Vec<u8>, max: usize) -> std::io::Result<bool> {
    let mut chunk = [0u8; 16 * 1024];
    let take = chunk.len().min(max.max(1));
    let n = sock.read(&mut chunk[..take]).await?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n > 0)
}

fn timed_out(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, what.to_string())
}

async fn write_response(sock: &mut TcpStream, resp: &[u8]) -> std::io::Result<()> {
    tokio::time::timeout(WRITE_DEADLINE, async {
        sock.write_all(resp).await?;
        sock.shutdown().await
    })
    .await
    .map_err(|_| timed_out("response write deadline"))?
}

/// The head, read under [`HEAD_DEADLINE`]: `Ok(Err(response))` for a malformed one, `Ok(Ok(None))`
/// when the client hung up first. The blank line is searched only in what each read added, so a
/// head sent a byte at a time costs linear, not quadratic, work.
async fn read_head(
    sock: &mut TcpStream,
    buf: &mut Vec<u8>,
) -> std::io::Result<Result<Option<RequestHead>, Vec<u8>>> {
    tokio::time::timeout(HEAD_DEADLINE, async {
        let mut searched = 0usize;
        loop {
            let complete = find(&buf[searched.saturating_sub(3)..], b"\r\n\r\n").is_some();
            searched = buf.len();
            if complete || buf.len() > MAX_HEAD {
                match parse_request(buf) {
                    Ok(Some(h)) => return Ok(Ok(Some(h))),
                    Ok(None) => {}
                    Err(e) => {
                        let r =
                            response(400, "Bad Request", "text/plain", e.to_string().as_bytes());
                        return Ok(Err(r));
                    }
                }
            }
            if !read_more(sock, buf, MAX_HEAD + 4 - buf.len().min(MAX_HEAD)).await? {
                return Ok(Ok(None));
            }
        }
    })
    .await
    .map_err(|_| timed_out("request head deadline"))?
}

/// A whole request, admitted and read: its route, its body, and the budget its body holds.
struct Request {
    route: Route,
    body: Vec<u8>,
    _budget: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// One connection's view of the server.
struct Conn<'a> {
    state: &'a ServeState,
    budgets: &'a Budgets,
    heads: &'a std::sync::Mutex<HeadPhase>,
    ticket: u64,
}

impl Conn<'_> {
    /// Leaves the eviction queue (idempotent).
    fn leave(&self) {
        if let Ok(mut h) = self.heads.lock() {
            h.leave(self.ticket);
        }
    }

    async fn handle(
        &self,
        mut sock: TcpStream,
        evicted: &tokio::sync::Notify,
    ) -> std::io::Result<()> {
        // Evictable until the request is whole (an authenticated one leaves at admission).
        let request = tokio::select! {
            r = self.read_request(&mut sock) => r?,
            () = evicted.notified() => {
                return Err(std::io::Error::other(
                    "evicted before its request was whole: every slot was taken",
                ));
            }
        };
        self.leave();
        let Some(request) = request else {
            return Ok(());
        };
        let (resp, _answer_budget) = self.route_request(request).await;
        write_response(&mut sock, &resp).await
    }

    /// Reads the head, admits it, takes the body's budget and reads the body, under the deadlines.
    /// `Ok(None)` when the request was refused (the refusal written) or the client went away.
    async fn read_request(&self, sock: &mut TcpStream) -> std::io::Result<Option<Request>> {
        let started = tokio::time::Instant::now();
        let mut buf = Vec::with_capacity(1024);
        let head = match read_head(sock, &mut buf).await? {
            Ok(Some(h)) => h,
            Ok(None) => return Ok(None),
            Err(resp) => {
                write_response(sock, &resp).await?;
                return Ok(None);
            }
        };
        let arrived_on = sock.local_addr()?;
        let (route, _limit) = match admit(&head, &self.state.policy, arrived_on) {
            Ok(r) => r,
            Err(refusal) => {
                write_response(sock, &refusal.response()).await?;
                return Ok(None);
            }
        };
        // The body's share of a budget, taken before a byte of it is read.
        let budget = match route {
            Route::Query if head.content_length > 0 => {
                let kib = head.content_length.div_ceil(1024);
                match u32::try_from(kib).ok().and_then(|k| {
                    self.budgets
                        .query_kib
                        .clone()
                        .try_acquire_many_owned(k)
                        .ok()
                }) {
                    Some(p) => Some(p),
                    None => {
                        let busy = Refusal::new(
                            503,
                            "Service Unavailable",
                            "too many query bodies in flight; retry",
                        );
                        write_response(sock, &busy.response()).await?;
                        return Ok(None);
                    }
                }
            }
            Route::Swap | Route::Shadow | Route::Export => {
                // Admitted with the admin token: no longer a stranger to evict.
                self.leave();
                match self.budgets.admin.clone().try_acquire_owned() {
                    Ok(p) => Some(p),
                    Err(_) => {
                        let busy = Refusal::new(
                            503,
                            "Service Unavailable",
                            "another admin request is in flight; retry",
                        );
                        write_response(sock, &busy.response()).await?;
                        return Ok(None);
                    }
                }
            }
            _ => None,
        };
        let want = head.head_len + head.content_length;
        buf.truncate(want.min(buf.len()));
        let rest = REQUEST_DEADLINE.saturating_sub(started.elapsed());
        let complete = tokio::time::timeout(rest, async {
            while buf.len() < want {
                let left = want - buf.len();
                if !read_more(sock, &mut buf, left).await? {
                    return Ok::<bool, std::io::Error>(false);
                }
            }
            Ok(true)
        })
        .await
        .map_err(|_| timed_out("request deadline"))??;
        if !complete {
            return Ok(None);
        }
        let body = buf.split_off(head.head_len);
        Ok(Some(Request {
            route,
            body,
            _budget: budget,
        }))
    }

    /// Serves an admitted request; a query's answer holds its share of [`ANSWER_BUDGET`] until it
    /// is written (the second value).
    async fn route_request(
        &self,
        request: Request,
    ) -> (Vec<u8>, Option<tokio::sync::OwnedSemaphorePermit>) {
        let Request {
            route,
            body,
            _budget,
        } = request;
        let state = self.state;
        match route {
            Route::Status => {
                let v = (state.status)();
                let mut b = serde_json::to_vec(&v).unwrap_or_default();
                b.push(b'\n');
                (response(200, "OK", "application/json", &b), None)
            }
            Route::Query => query(body, state, self.budgets).await,
            Route::Swap => (swap(body, state).await, None),
            Route::Shadow => (shadow(body, state).await, None),
            Route::Export => (export(body, state).await, None),
        }
    }
}

/// A 503 response with `message`.
fn unavailable(message: &str) -> Vec<u8> {
    response(
        503,
        "Service Unavailable",
        "text/plain",
        format!("{message}\n").as_bytes(),
    )
}

async fn query(
    body: Vec<u8>,
    state: &ServeState,
    budgets: &Budgets,
) -> (Vec<u8>, Option<tokio::sync::OwnedSemaphorePermit>) {
    let (tx, rx) = oneshot::channel();
    let sent = tokio::time::timeout(
        IO_TIMEOUT,
        state.control.send(Control::Query {
            request: body,
            reply: tx,
        }),
    )
    .await;
    match sent {
        Ok(Ok(())) => {}
        Ok(Err(_)) => return (unavailable("the fold is not running"), None),
        Err(_) => {
            return (
                unavailable("the fold is busy: no room for the query in time"),
                None,
            );
        }
    }
    match tokio::time::timeout(IO_TIMEOUT, rx).await {
        Ok(Ok(Ok(answer))) => {
            let kib = answer.len().div_ceil(1024);
            let budget = u32::try_from(kib)
                .ok()
                .and_then(|k| budgets.answer_kib.clone().try_acquire_many_owned(k).ok());
            match budget {
                Some(b) => (
                    response(200, "OK", "application/octet-stream", &answer),
                    Some(b),
                ),
                None => (unavailable("too many answers in flight; retry"), None),
            }
        }
        // No guest instance right now: the fold loop rebuilds it as fold work, never for a
        // query (docs/design.md, "The fold loop"), so the caller retries shortly.
        Ok(Ok(Err(e))) if e.is_rebuilding() => (unavailable(&e.to_string()), None),
        Ok(Ok(Err(e))) => (
            response(
                422,
                "Unprocessable Entity",
                "text/plain",
                format!("{e}\n").as_bytes(),
            ),
            None,
        ),
        Ok(Err(_)) => (unavailable("the fold stopped"), None),
        Err(_) => (
            response(504, "Gateway Timeout", "text/plain", b"no answer in time\n"),
            None,
        ),
    }
}

/// How long a swap (settle, compile, rebuild from the fold) may take before the caller gives up
/// waiting (the swap itself still completes or is refused).
pub const SWAP_TIMEOUT: Duration = Duration::from_secs(300);

/// `POST /export`: the body is the output path (a directory, or a file ending `.tar`) on the host's
/// machine; the answer is the artifact's manifest.
async fn export(body: Vec<u8>, state: &ServeState) -> Vec<u8> {
    let Ok(out) = String::from_utf8(body) else {
        return response(400, "Bad Request", "text/plain", b"the path is not UTF-8\n");
    };
    let out = std::path::PathBuf::from(out.trim());
    match crate::applied::export_live_of(
        &state.control,
        state.backend,
        out,
        Some(state.scope.clone()),
        (state.stream)(),
    )
    .await
    {
        Ok(m) => {
            let mut b = serde_json::to_vec(&m).unwrap_or_default();
            b.push(b'\n');
            response(200, "OK", "application/json", &b)
        }
        Err(e) => response(409, "Conflict", "text/plain", format!("{e}\n").as_bytes()),
    }
}

/// How long a `/shadow` caller waits for the answer of a shadow that waits up to `max_wait` for
/// its batches: a minute longer than the host waits, so the host's own answer (or its 504) comes
/// first.
pub fn shadow_deadline(max_wait: Duration) -> Duration {
    SWAP_TIMEOUT + max_wait + Duration::from_secs(60)
}

/// Longest wait for a shadow's batches the host accepts, seconds (a day).
pub const MAX_SHADOW_WAIT_S: u64 = 24 * 3600;

/// Largest JSON header of a `/shadow` body (its request list included).
pub const MAX_SHADOW_HEADER: usize = 4 * 1024 * 1024;

/// The JSON header line of a `/shadow` body.
#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ShadowHeader {
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
pub fn parse_shadow_body(body: &[u8]) -> Result<(crate::applied::ShadowPlan, &[u8]), String> {
    use crate::applied::{MAX_SHADOW_REQUESTS, ShadowPlan, ShadowRequests};
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
            max_wait: Duration::from_secs(header.max_wait_s.min(MAX_SHADOW_WAIT_S)),
        },
        &body[end + 1..],
    ))
}

/// Compiles `bytes` off the fold's path (the fold keeps applying meanwhile; the engine's caches
/// hand the compiled component to the fold's swap or shadow); the error is the response to send.
async fn compile_off_path(
    engine: Arc<crate::guest::GuestEngine>,
    bytes: Vec<u8>,
    what: &'static str,
    refused: &'static str,
) -> Result<Vec<u8>, Vec<u8>> {
    let compiled =
        tokio::task::spawn_blocking(move || engine.prepare(what, &bytes).map(|_| bytes)).await;
    match compiled {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => Err(response(
            409,
            "Conflict",
            "text/plain",
            format!("{refused}: {e}\n").as_bytes(),
        )),
        Err(e) => Err(response(
            500,
            "Internal Server Error",
            "text/plain",
            e.to_string().as_bytes(),
        )),
    }
}

/// Hands `control` to the fold and answers with what comes back on `rx` within `wait`: the
/// report as JSON (200), the refusal (409), or why there was no answer (503, 504).
async fn ask_fold<T: serde::Serialize, E: std::fmt::Display>(
    state: &ServeState,
    control: Control,
    rx: oneshot::Receiver<Result<T, E>>,
    wait: Duration,
) -> Vec<u8> {
    match tokio::time::timeout(SWAP_TIMEOUT, state.control.send(control)).await {
        Ok(Ok(())) => {}
        Ok(Err(_)) => return unavailable("the fold is not running"),
        Err(_) => return unavailable("the fold is busy: no room for the request in time"),
    }
    match tokio::time::timeout(wait, rx).await {
        Ok(Ok(Ok(report))) => {
            let mut b = serde_json::to_vec(&report).unwrap_or_default();
            b.push(b'\n');
            response(200, "OK", "application/json", &b)
        }
        Ok(Ok(Err(e))) => response(409, "Conflict", "text/plain", format!("{e}\n").as_bytes()),
        Ok(Err(_)) => response(
            503,
            "Service Unavailable",
            "text/plain",
            b"the fold stopped\n",
        ),
        Err(_) => response(504, "Gateway Timeout", "text/plain", b"no answer in time\n"),
    }
}

/// `POST /shadow`: compile the candidate off the fold's path, then hand it to the fold as a
/// shadow; the answer is the [`crate::applied::ShadowReport`] (200), or why the shadow failed (409).
async fn shadow(body: Vec<u8>, state: &ServeState) -> Vec<u8> {
    let Some(engine) = state.engine.clone() else {
        return response(
            409,
            "Conflict",
            "text/plain",
            b"this host runs no guest to shadow\n",
        );
    };
    let (plan, component) = match parse_shadow_body(&body) {
        Ok((plan, component)) => (plan, component.to_vec()),
        Err(e) => {
            return response(
                400,
                "Bad Request",
                "text/plain",
                format!("{e}\n").as_bytes(),
            );
        }
    };
    drop(body);
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

async fn swap(body: Vec<u8>, state: &ServeState) -> Vec<u8> {
    let Some(engine) = state.engine.clone() else {
        return response(
            409,
            "Conflict",
            "text/plain",
            b"this host runs no guest to swap\n",
        );
    };
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

/// A minimal client for this endpoint (the demo and the tests use it): one request, one response.
pub async fn call(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
) -> std::io::Result<(u16, Vec<u8>)> {
    call_with_token(addr, method, path, body, None).await
}

/// [`call`] with an `Authorization: Bearer` token.
pub async fn call_with_token(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
    token: Option<&str>,
) -> std::io::Result<(u16, Vec<u8>)> {
    call_with_deadline(addr, method, path, body, token, SWAP_TIMEOUT).await
}

/// [`call_with_token`], waiting at most `read` for the whole response (a shadow's answer comes
/// after its wait for batches: the caller must outwait the host, which gives up first).
pub async fn call_with_deadline(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
    token: Option<&str>,
    read: Duration,
) -> std::io::Result<(u16, Vec<u8>)> {
    let mut sock = tokio::time::timeout(IO_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| std::io::Error::other("connect timeout"))??;
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    sock.write_all(&req).await?;
    let mut resp = Vec::new();
    tokio::time::timeout(read, sock.read_to_end(&mut resp))
        .await
        .map_err(|_| std::io::Error::other("read timeout"))??;
    let end = find(&resp, b"\r\n\r\n").ok_or_else(|| std::io::Error::other("no response head"))?;
    let status_line = std::str::from_utf8(&resp[..end])
        .ok()
        .and_then(|h| h.lines().next())
        .unwrap_or_default();
    let code = status_line
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {status_line:?}")))?;
    Ok((code, resp[end + 4..].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_post_with_a_body_length_and_waits_for_the_blank_line() {
        let raw = b"POST /query?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello";
        let h = parse_request(raw).expect("valid").expect("complete");
        assert_eq!(h.method, "POST");
        assert_eq!(h.path, "/query");
        assert_eq!(h.content_length, 5);
        assert_eq!(&raw[h.head_len..], b"hello");
        assert_eq!(
            parse_request(b"GET /status HTTP/1.1\r\nHost: a\r\n"),
            Ok(None)
        );
    }

    #[test]
    fn refuses_oversized_heads_and_bodies_and_malformed_lines() {
        let big = vec![b'a'; MAX_HEAD + 1];
        assert_eq!(parse_request(&big), Err(HttpError::TooLarge));
        let body = format!(
            "POST / HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY + 1
        );
        assert_eq!(parse_request(body.as_bytes()), Err(HttpError::TooLarge));
        assert!(parse_request(b"GARBAGE\r\n\r\n").is_err());
        assert!(parse_request(b"GET / HTTP/1.1\r\nnocolon\r\n\r\n").is_err());
        assert!(parse_request(b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n").is_err());
        assert!(parse_request(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n").is_err());
        assert!(parse_request(b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n").is_err());
    }

    fn head(method: &str, path: &str, host: &str, len: usize) -> RequestHead {
        RequestHead {
            method: method.into(),
            path: path.into(),
            content_length: len,
            bearer: None,
            host: Some(host.into()),
            origin: None,
            head_len: 0,
        }
    }

    fn policy(listen: &str, query_token: Option<&str>) -> AccessPolicy {
        AccessPolicy {
            admin_token: "admin-secret".into(),
            query_token: query_token.map(Into::into),
            listen: listen.parse().expect("addr"),
            hosts: Vec::new(),
            query_open: false,
            limits: Limits::default(),
        }
    }

    fn status_of(r: Result<(Route, usize), Refusal>) -> u16 {
        r.map_or_else(|e| e.status, |_| 200)
    }

    #[test]
    fn admin_routes_always_need_the_admin_token_even_on_loopback() {
        let p = policy("127.0.0.1:8080", None);
        for path in ["/swap", "/export"] {
            let mut h = head("POST", path, "127.0.0.1:8080", 10);
            assert_eq!(
                status_of(admit(&h, &p, p.listen)),
                401,
                "{path} without a token"
            );
            h.bearer = Some("admin-secre".into());
            assert_eq!(
                status_of(admit(&h, &p, p.listen)),
                401,
                "{path} with a near miss"
            );
            h.bearer = Some("admin-secret".into());
            assert_eq!(
                status_of(admit(&h, &p, p.listen)),
                200,
                "{path} with the token"
            );
        }
        // Without a query token, status and query are open; with one, they need it (or the admin's).
        let h = head("GET", "/status", "127.0.0.1:8080", 0);
        assert_eq!(status_of(admit(&h, &p, p.listen)), 200);
        let q = policy("127.0.0.1:8080", Some("reader"));
        let mut h = head("POST", "/query", "127.0.0.1:8080", 3);
        assert_eq!(status_of(admit(&h, &q, q.listen)), 401);
        h.bearer = Some("reader".into());
        assert_eq!(status_of(admit(&h, &q, q.listen)), 200);
        h.bearer = Some("admin-secret".into());
        assert_eq!(status_of(admit(&h, &q, q.listen)), 200);
        // The query token does not open admin routes.
        let mut h = head("POST", "/swap", "127.0.0.1:8080", 3);
        h.bearer = Some("reader".into());
        assert_eq!(status_of(admit(&h, &q, q.listen)), 401);
    }

    #[test]
    fn every_route_has_its_own_body_limit_checked_before_the_body() {
        let p = policy("127.0.0.1:8080", None);
        let mut h = head("GET", "/status", "127.0.0.1:8080", 1);
        assert_eq!(
            status_of(admit(&h, &p, p.listen)),
            413,
            "/status takes no body"
        );
        h = head("POST", "/query", "127.0.0.1:8080", MAX_QUERY);
        assert_eq!(admit(&h, &p, p.listen), Ok((Route::Query, MAX_QUERY)));
        h.content_length = MAX_QUERY + 1;
        assert_eq!(status_of(admit(&h, &p, p.listen)), 413);
        h = head("POST", "/export", "127.0.0.1:8080", MAX_EXPORT_BODY + 1);
        h.bearer = Some("admin-secret".into());
        assert_eq!(status_of(admit(&h, &p, p.listen)), 413);
        // An unauthenticated swap is refused for its token before its size is even looked at.
        h = head("POST", "/swap", "127.0.0.1:8080", MAX_BODY);
        assert_eq!(status_of(admit(&h, &p, p.listen)), 401);
        assert_eq!(
            status_of(admit(
                &head("PUT", "/query", "127.0.0.1:8080", 0),
                &p,
                p.listen
            )),
            405
        );
        assert_eq!(
            status_of(admit(
                &head("GET", "/nope", "127.0.0.1:8080", 0),
                &p,
                p.listen
            )),
            404
        );
    }

    #[test]
    fn a_loopback_listener_refuses_foreign_hosts_and_cross_site_origins() {
        let p = policy("127.0.0.1:8080", None);
        for ok in ["127.0.0.1:8080", "localhost:8080", "LOCALHOST:8080"] {
            assert_eq!(
                status_of(admit(&head("GET", "/status", ok, 0), &p, p.listen)),
                200,
                "{ok}"
            );
        }
        for bad in ["evil.example:8080", "127.0.0.1:9090", "localhost"] {
            assert_eq!(
                status_of(admit(&head("GET", "/status", bad, 0), &p, p.listen)),
                403,
                "{bad}"
            );
        }
        let mut h = head("GET", "/status", "127.0.0.1:8080", 0);
        h.host = None;
        assert_eq!(status_of(admit(&h, &p, p.listen)), 403, "no Host header");
        let mut h = head("POST", "/query", "localhost:8080", 0);
        h.origin = Some("http://evil.example".into());
        assert_eq!(
            status_of(admit(&h, &p, p.listen)),
            403,
            "a cross-site browser request"
        );
        h.origin = Some("http://localhost:8080".into());
        assert_eq!(status_of(admit(&h, &p, p.listen)), 200, "same origin");
    }

    fn on(addr: &str) -> SocketAddr {
        addr.parse().expect("addr")
    }

    #[test]
    fn a_wildcard_listener_without_names_admits_only_the_ip_literal_a_client_connected_to() {
        let p = policy("0.0.0.0:8080", Some("reader"));
        let mut h = head("POST", "/query", "127.0.0.1:8080", 3);
        h.bearer = Some("reader".into());
        assert_eq!(status_of(admit(&h, &p, on("127.0.0.1:8080"))), 200);
        h.host = Some("10.0.0.5:8080".into());
        assert_eq!(status_of(admit(&h, &p, on("10.0.0.5:8080"))), 200);
        // The address of another interface than the one it came in on, or another port: refused.
        assert_eq!(status_of(admit(&h, &p, on("127.0.0.1:8080"))), 403);
        h.host = Some("10.0.0.5:9090".into());
        assert_eq!(status_of(admit(&h, &p, on("10.0.0.5:8080"))), 403);
        // A name nobody configured, even the one the host really has, and even with the token.
        h.host = Some("node7.internal:8080".into());
        assert_eq!(status_of(admit(&h, &p, on("10.0.0.5:8080"))), 403);
        h.host = None;
        assert_eq!(status_of(admit(&h, &p, on("10.0.0.5:8080"))), 403);
    }

    #[test]
    fn a_rebound_host_is_refused_on_a_wildcard_listener_before_any_token_is_looked_at() {
        // The DNS-rebinding page: its own name, now pointing at 127.0.0.1, reaching 0.0.0.0.
        for open in [false, true] {
            let mut p = policy("0.0.0.0:8080", None);
            p.query_open = open;
            for path in ["/query", "/status", "/swap"] {
                let method = if path == "/status" { "GET" } else { "POST" };
                let mut h = head(method, path, "evil.example:8080", 0);
                assert_eq!(
                    status_of(admit(&h, &p, on("127.0.0.1:8080"))),
                    403,
                    "{path}, query open {open}"
                );
                h.bearer = Some("admin-secret".into());
                assert_eq!(
                    status_of(admit(&h, &p, on("127.0.0.1:8080"))),
                    403,
                    "{path} with the admin token, query open {open}"
                );
            }
        }
    }

    #[test]
    fn a_wildcard_listener_with_names_admits_them_and_still_refuses_others() {
        let mut p = policy("[::]:8080", Some("reader"));
        p.hosts = vec!["node7.internal".into(), "fold.example:443".into()];
        let mut h = head("POST", "/query", "node7.internal:8080", 3);
        h.bearer = Some("reader".into());
        for (host, want) in [
            ("node7.internal:8080", 200),
            ("node7.internal", 200),
            ("fold.example:443", 200),
            ("fold.example:8080", 403),
            ("10.0.0.5:8080", 200),
            ("evil.example:8080", 403),
            ("node7.internal.evil.example:8080", 403),
        ] {
            h.host = Some(host.into());
            assert_eq!(
                status_of(admit(&h, &p, on("[::ffff:10.0.0.5]:8080"))),
                want,
                "{host}"
            );
        }
        // A browser's Origin must still be the same origin as the name it used.
        h.host = Some("node7.internal:8080".into());
        h.origin = Some("http://evil.example".into());
        assert_eq!(status_of(admit(&h, &p, on("10.0.0.5:8080"))), 403);
        h.origin = Some("http://node7.internal:8080".into());
        assert_eq!(status_of(admit(&h, &p, on("10.0.0.5:8080"))), 200);
    }

    #[test]
    fn a_specific_address_beyond_loopback_admits_only_that_address_or_its_names() {
        let mut p = policy("10.0.0.5:8080", Some("reader"));
        let mut h = head("GET", "/status", "10.0.0.5:8080", 0);
        h.bearer = Some("reader".into());
        assert_eq!(status_of(admit(&h, &p, p.listen)), 200);
        for bad in ["127.0.0.1:8080", "localhost:8080", "node7.internal:8080"] {
            h.host = Some(bad.into());
            assert_eq!(status_of(admit(&h, &p, p.listen)), 403, "{bad}");
        }
        p.hosts = vec!["node7.internal:8080".into()];
        assert_eq!(status_of(admit(&h, &p, p.listen)), 200);
    }

    #[test]
    fn a_query_without_the_token_is_refused_beyond_loopback_unless_the_operator_opened_it() {
        for listen in ["0.0.0.0:8080", "10.0.0.5:8080", "[::]:8080"] {
            let arrived = if listen.starts_with("10.") {
                "10.0.0.5:8080"
            } else {
                "127.0.0.1:8080"
            };
            let host = arrived;
            // No token given, not opened: nobody but the admin (the host generates a token for
            // the listeners it starts; a policy built without one still refuses).
            let mut p = policy(listen, None);
            for (method, path) in [("POST", "/query"), ("GET", "/status")] {
                let mut h = head(method, path, host, 0);
                assert_eq!(
                    status_of(admit(&h, &p, on(arrived))),
                    401,
                    "{listen} {path}"
                );
                h.bearer = Some("admin-secret".into());
                assert_eq!(
                    status_of(admit(&h, &p, on(arrived))),
                    200,
                    "{listen} {path}"
                );
            }
            // With a query token: that token.
            let q = policy(listen, Some("reader"));
            let mut h = head("POST", "/query", host, 3);
            assert_eq!(status_of(admit(&h, &q, on(arrived))), 401, "{listen}");
            h.bearer = Some("reader".into());
            assert_eq!(status_of(admit(&h, &q, on(arrived))), 200, "{listen}");
            // --query-open: anyone who reaches it (with a Host that names it).
            p.query_open = true;
            let h = head("POST", "/query", host, 3);
            assert_eq!(status_of(admit(&h, &p, on(arrived))), 200, "{listen} open");
            // Admin routes still need the admin token.
            let h = head("POST", "/swap", host, 3);
            assert_eq!(
                status_of(admit(&h, &p, on(arrived))),
                401,
                "{listen} open swap"
            );
        }
        // Loopback keeps today's rule: open without a token unless one is given.
        let p = policy("127.0.0.1:8080", None);
        let h = head("POST", "/query", "127.0.0.1:8080", 3);
        assert_eq!(status_of(admit(&h, &p, p.listen)), 200);
    }

    #[test]
    fn with_every_slot_taken_the_oldest_connection_still_sending_its_head_is_evicted() {
        let mut h = HeadPhase::default();
        let (a, na) = h.enter();
        let (b, _nb) = h.enter();
        let (c, _nc) = h.enter();
        // `b` sent its head: it can no longer be evicted.
        h.leave(b);
        assert_eq!(h.evict_oldest(), Some(a));
        assert_eq!(h.evict_oldest(), Some(c));
        assert_eq!(h.evict_oldest(), None);
        assert!(h.is_empty());
        // The evicted one is told (the notification is kept until it waits for it).
        let woke = futures::FutureExt::now_or_never(na.notified());
        assert!(woke.is_some(), "the oldest was told to close");
    }

    #[test]
    fn only_a_generated_private_token_file_is_followed() -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir()?;
        let file = dir.path().join(ADMIN_TOKEN_FILE);
        let token = generate_token_file(&file)?;
        assert_eq!(
            std::fs::metadata(&file)?.permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(read_generated_token(&file)?, token);
        // Readable by others: refused.
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644))?;
        assert!(read_generated_token(&file).is_err());
        // Another name (a private key, say), or content that is not a generated token: refused.
        let key = dir.path().join("id_ed25519");
        std::fs::write(&key, "-----BEGIN OPENSSH PRIVATE KEY-----\n")?;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))?;
        assert!(read_generated_token(&key).is_err());
        let other = dir.path().join("sub");
        std::fs::create_dir(&other)?;
        let fake = other.join(ADMIN_TOKEN_FILE);
        std::fs::write(&fake, "-----BEGIN OPENSSH PRIVATE KEY-----\n")?;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o600))?;
        assert!(read_generated_token(&fake).is_err());
        Ok(())
    }

    #[test]
    fn tokens_match_only_exactly() {
        assert!(token_matches(Some("abc"), "abc"));
        assert!(!token_matches(Some("abd"), "abc"));
        assert!(!token_matches(Some("ab"), "abc"));
        assert!(!token_matches(Some(""), "abc"));
        assert!(!token_matches(None, "abc"));
    }
}
