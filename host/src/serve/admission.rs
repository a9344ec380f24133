//! Admission: every decision about a request taken from its head alone, before a byte of its
//! body is read — the route, the Host and Origin, the token, the declared body length against
//! the route's limit — and the queue of connections that may be evicted when every slot is taken.
//! Pure functions over `http::request::Parts` and plain values; the hyper plumbing
//! (`super::conn`) calls them.

use std::net::SocketAddr;
use std::sync::Arc;

use hyper::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, HOST, ORIGIN, TRANSFER_ENCODING};

use super::{MAX_BODY, MAX_EXPORT_BODY, MAX_GET_BODY, MAX_QUERY, MAX_SHADOW_HEADER};

/// What admission reads of a request head.
#[derive(Debug, PartialEq, Eq)]
pub struct RequestHead {
    /// `GET`, `POST`, …
    pub method: String,
    /// The path, without the query string.
    pub path: String,
    /// The declared body length (`Content-Length`); 0 for a chunked body, whose length is
    /// checked against the route's limit as it is read.
    pub content_length: usize,
    /// The body is chunked (`Transfer-Encoding`): its length is known only once read.
    pub chunked: bool,
    /// The bearer token of an `Authorization: Bearer …` header.
    pub bearer: Option<String>,
    /// The `Host` header.
    pub host: Option<String>,
    /// The `Origin` header (browsers send it on cross-site requests).
    pub origin: Option<String>,
    /// The revision a read must see (`Foldhost-Min-Revision`), when it names one.
    pub min_revision: Option<u64>,
    /// How long such a read may wait for it, ms (`Foldhost-Wait-Ms`; default 5 000).
    pub wait_ms: u64,
    /// The body is a batch of lookups (`Content-Type: application/x-foldhost-lookups`,
    /// [`super::lookups`]).
    pub lookups: bool,
}

/// Why a request head was refused before admission.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    /// Malformed.
    #[error("bad request: {0}")]
    Bad(&'static str),
    /// Over a limit.
    #[error("too large")]
    TooLarge,
}

impl RequestHead {
    /// Reads what admission needs from a parsed head (hyper has already refused a malformed
    /// request line, a head over its buffer, and conflicting `Content-Length`s). Pure. Refuses
    /// more than one `Host`, a header admission reads that is not UTF-8, an unreadable
    /// `Content-Length`, and a declared body over [`MAX_BODY`]. An HTTP/2 request names its host
    /// in `:authority` (the URI's authority), which must then equal a `Host` sent beside it; its
    /// body without a `Content-Length` is read as a chunked one (its length known once read).
    pub(crate) fn from_parts(
        parts: &hyper::http::request::Parts,
    ) -> Result<RequestHead, HttpError> {
        let text = |name, why| -> Result<Option<String>, HttpError> {
            let mut values = parts.headers.get_all(name).iter();
            let Some(v) = values.next() else {
                return Ok(None);
            };
            if values.next().is_some() {
                return Err(HttpError::Bad(why));
            }
            std::str::from_utf8(v.as_bytes())
                .map(|s| Some(s.trim().to_string()))
                .map_err(|_| HttpError::Bad("a header is not UTF-8"))
        };
        let mut host = text(HOST, "more than one Host header")?;
        if parts.version == hyper::Version::HTTP_2
            && let Some(authority) = parts.uri.authority().map(|a| a.as_str().to_string())
        {
            if host.as_ref().is_some_and(|h| *h != authority) {
                return Err(HttpError::Bad("Host differs from :authority"));
            }
            host = Some(authority);
        }
        let origin = text(ORIGIN, "more than one Origin header")?;
        let min_revision = foldhost_core::protocol::parse_min_revision(
            text(
                hyper::header::HeaderName::from_static("foldhost-min-revision"),
                "more than one Foldhost-Min-Revision header",
            )?
            .as_deref(),
        )
        .map_err(|_| HttpError::Bad("Foldhost-Min-Revision is not a revision"))?;
        let wait_ms = foldhost_core::protocol::parse_read_wait(
            text(
                hyper::header::HeaderName::from_static("foldhost-wait-ms"),
                "more than one Foldhost-Wait-Ms header",
            )?
            .as_deref(),
        )
        .map_err(|_| HttpError::Bad("Foldhost-Wait-Ms is not a wait of at most 60000 ms"))?;
        let bearer = text(AUTHORIZATION, "more than one Authorization header")?
            .and_then(|a| a.strip_prefix("Bearer ").map(|t| t.trim().to_string()));
        // A chunked body's length is checked as it is read; hyper ignores a `Content-Length`
        // beside a `Transfer-Encoding`.
        let chunked = parts.headers.contains_key(TRANSFER_ENCODING)
            || (parts.version == hyper::Version::HTTP_2
                && !parts.headers.contains_key(CONTENT_LENGTH));
        let content_length = match parts.headers.get(CONTENT_LENGTH) {
            Some(v) if !chunked => std::str::from_utf8(v.as_bytes())
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or(HttpError::Bad("bad content-length"))?,
            _ => 0,
        };
        let content_length = usize::try_from(content_length)
            .ok()
            .filter(|&n| n <= MAX_BODY)
            .ok_or(HttpError::TooLarge)?;
        Ok(RequestHead {
            method: parts.method.as_str().to_string(),
            path: parts.uri.path().to_string(),
            content_length,
            chunked,
            bearer,
            host,
            origin,
            min_revision,
            wait_ms,
            lookups: text(CONTENT_TYPE, "more than one Content-Type header")?
                .is_some_and(|t| super::lookups::is_lookups(&t)),
        })
    }
}

/// Whether `read` body bytes and a next chunk of `next` stay within `limit`: the body reader
/// stops, the chunk unkept, at the first chunk that would pass it. Pure.
pub(crate) fn body_fits(read: usize, next: usize, limit: usize) -> bool {
    read.checked_add(next).is_some_and(|n| n <= limit)
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
    /// `POST /write` (the write token).
    Write,
    /// `POST /get`: one key of the fold (the query token's rules).
    Get,
    /// `GET /healthz`: the process answers (no token: a probe's).
    Health,
    /// `GET /metrics`: the Prometheus text (the query token's rules, as `/status`).
    Metrics,
    /// `GET /readyz`: every fold runs, level and within its lag (no token: a probe's).
    Ready,
    /// `GET /`: the status page (`serve/page.html`). It carries no data — the figures come from
    /// `/status`, which the page fetches with the token its address's fragment holds — so it
    /// needs no token (a browser's navigation carries none, and the fragment never reaches the
    /// server); the Host and Origin checks and the empty body are `/status`'s.
    Page,
}

impl Route {
    /// True for the routes that change the host (they need the admin token).
    pub(crate) fn is_admin(self) -> bool {
        matches!(self, Route::Swap | Route::Shadow | Route::Export)
    }

    /// True for the routes a reserved connection slot serves (every other slot in service):
    /// probes, writes and the operator's routes.
    pub(crate) fn keeps_a_reserved_slot(self) -> bool {
        self.is_admin()
            || matches!(
                self,
                Route::Health | Route::Ready | Route::Write | Route::Status | Route::Metrics
            )
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
    /// The token `/write` requires (always set: given, or generated by the host). Only it opens
    /// `/write`: the admin token does not.
    pub write_token: String,
    /// The token `/status` and `/query` require, when set (the admin token also opens them).
    /// Always set on a listener beyond loopback unless the operator chose `--query-open`
    /// ([`foldhost_core::protocol::query_access`]).
    pub query_token: Option<String>,
    /// The listener's bound address (`Host` is checked against it, or against the address a
    /// connection arrived on when it is a wildcard: [`foldhost_core::protocol::host_names_listener`]).
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

/// A refused request: the status and a one-line message. Its response closes the connection
/// (the body, if any, is left unread).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// HTTP status.
    pub status: u16,
    /// What was wrong.
    pub message: String,
}

impl Refusal {
    /// A refusal with its HTTP status and message.
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        Refusal {
            status,
            message: message.into(),
        }
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
/// cross-site browser request; [`foldhost_core::protocol::host_names_listener`]), the token (401), the
/// declared body length against the route's limit (413).
pub fn admit(
    head: &RequestHead,
    policy: &AccessPolicy,
    arrived_on: SocketAddr,
) -> Result<(Route, usize), Refusal> {
    let route = route_of(head)?;
    check_host_and_origin(head, policy, arrived_on)?;
    check_token(head, policy, route)?;
    let limit = body_limit(route, policy);
    if head.content_length > limit {
        return Err(Refusal::new(
            413,
            format!(
                "{} takes at most {limit} body bytes, {} announced",
                head.path, head.content_length
            ),
        ));
    }
    Ok((route, limit))
}

/// The route the head's path names, taken with its method (404, 405).
fn route_of(head: &RequestHead) -> Result<Route, Refusal> {
    let route = match head.path.as_str() {
        "/status" => Route::Status,
        "/query" => Route::Query,
        "/swap" => Route::Swap,
        "/shadow" => Route::Shadow,
        "/export" => Route::Export,
        "/write" => Route::Write,
        "/get" => Route::Get,
        "/healthz" => Route::Health,
        "/metrics" => Route::Metrics,
        "/readyz" => Route::Ready,
        "/" => Route::Page,
        _ => return Err(Refusal::new(404, "not found")),
    };
    let method = if matches!(
        route,
        Route::Status | Route::Health | Route::Ready | Route::Metrics | Route::Page
    ) {
        "GET"
    } else {
        "POST"
    };
    if head.method != method {
        return Err(Refusal::new(405, format!("{} takes {method}", head.path)));
    }
    Ok(route)
}

/// The Host names this listener and the Origin, if any, is the Host's (403: a rebound name or a
/// cross-site browser request).
fn check_host_and_origin(
    head: &RequestHead,
    policy: &AccessPolicy,
    arrived_on: SocketAddr,
) -> Result<(), Refusal> {
    if !foldhost_core::protocol::host_names_listener(
        head.host.as_deref(),
        policy.listen,
        arrived_on,
        &policy.hosts,
    ) {
        return Err(Refusal::new(
            403,
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
                format!("cross-origin request from {origin:?} refused"),
            ));
        }
    }
    Ok(())
}

/// The bearer token the route needs (401): the write token for `/write`, the admin token for the
/// admin routes, the query token (as the listener's query access asks) for the rest but the
/// probes and the page.
fn check_token(head: &RequestHead, policy: &AccessPolicy, route: Route) -> Result<(), Refusal> {
    let bearer = head.bearer.as_deref();
    if route == Route::Write && !token_matches(bearer, &policy.write_token) {
        return Err(Refusal::new(401, "/write needs the write bearer token"));
    }
    let admin = token_matches(bearer, &policy.admin_token);
    if route.is_admin() && !admin {
        return Err(Refusal::new(
            401,
            format!("{} needs the admin bearer token", head.path),
        ));
    }
    let query_allowed = || {
        use foldhost_core::protocol::QueryAccess;
        let loopback = policy.listen.ip().to_canonical().is_loopback();
        match foldhost_core::protocol::query_access(
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
    // A probe carries no token: the probes say only whether the process answers and which fold
    // is not ready and why. Nor does a browser opening the page, which holds no data.
    let probe = matches!(route, Route::Health | Route::Ready | Route::Page);
    if !route.is_admin() && route != Route::Write && !probe && !admin && !query_allowed() {
        return Err(Refusal::new(
            401,
            format!("{} needs the query bearer token", head.path),
        ));
    }
    Ok(())
}

/// The largest body `route` may read.
fn body_limit(route: Route, policy: &AccessPolicy) -> usize {
    match route {
        Route::Status | Route::Health | Route::Ready | Route::Metrics | Route::Page => 0,
        Route::Query => policy.limits.query_body,
        Route::Swap => policy.limits.swap_body,
        Route::Shadow => policy.limits.swap_body.saturating_add(MAX_SHADOW_HEADER),
        Route::Export => MAX_EXPORT_BODY,
        Route::Write => crate::write::MAX_WRITE_BODY,
        Route::Get => MAX_GET_BODY,
    }
}

/// The connections still sending their request, oldest first: when every slot is taken, a new
/// connection takes the slot of the oldest of these (it is told to close), so clients that open
/// connections and send nothing — or a head and never the body — cannot lock out one that sends
/// its request at once. A connection leaves the queue once its request is whole, or once it is
/// admitted with the admin token; from then on only its deadlines end it. Once its answer is
/// written it waits for its next request (keep-alive) and rejoins the queue, at the back.
#[derive(Debug, Default)]
pub struct HeadPhase {
    next: u64,
    queue: std::collections::VecDeque<(u64, Arc<tokio::sync::Notify>)>,
}

impl HeadPhase {
    /// Enters a connection; returns its ticket and what tells it to close.
    pub(crate) fn enter(&mut self) -> (u64, Arc<tokio::sync::Notify>) {
        let id = self.next;
        self.next += 1;
        let n = Arc::new(tokio::sync::Notify::new());
        self.queue.push_back((id, n.clone()));
        (id, n)
    }

    /// The connection `id` has sent its whole request, was authenticated, or ended: it can no
    /// longer be evicted.
    pub(crate) fn leave(&mut self, id: u64) {
        self.queue.retain(|(i, _)| *i != id);
    }

    /// The connection `id` waits for its next request again: evictable, after every connection
    /// already waiting. A connection already in the queue keeps its place.
    pub(crate) fn rejoin(&mut self, id: u64, told: Arc<tokio::sync::Notify>) {
        if !self.queue.iter().any(|(i, _)| *i == id) {
            self.queue.push_back((id, told));
        }
    }

    /// Tells the oldest connection still in its head phase to close; its ticket, if there was one.
    pub(crate) fn evict_oldest(&mut self) -> Option<u64> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(raw: &[(&str, &str)], target: &str) -> hyper::http::request::Parts {
        let mut b = hyper::Request::builder().method("POST").uri(target);
        for (k, v) in raw {
            b = b.header(*k, *v);
        }
        b.body(()).expect("request").into_parts().0
    }

    #[test]
    fn a_head_yields_its_path_without_the_query_its_length_token_host_and_origin() {
        let h = RequestHead::from_parts(&parts(
            &[
                ("Host", "a:1"),
                ("Content-Length", "5"),
                ("Authorization", "Bearer  tok "),
                ("Origin", "http://a:1"),
                ("Foldhost-Min-Revision", "17"),
            ],
            "/query?x=1",
        ))
        .expect("valid");
        assert_eq!(
            h,
            RequestHead {
                method: "POST".into(),
                path: "/query".into(),
                content_length: 5,
                chunked: false,
                bearer: Some("tok".into()),
                host: Some("a:1".into()),
                origin: Some("http://a:1".into()),
                min_revision: Some(17),
                wait_ms: foldhost_core::protocol::READ_WAIT_MS,
                lookups: false,
            }
        );
        // A minimum revision that is not one is refused before admission.
        assert!(
            RequestHead::from_parts(&parts(&[("Foldhost-Min-Revision", "soon")], "/q")).is_err()
        );
        // Another scheme than Bearer is no token.
        let h = RequestHead::from_parts(&parts(&[("Authorization", "Basic eA==")], "/q"))
            .expect("valid");
        assert_eq!(h.bearer, None);
        // A chunked body: no declared length (it is checked as it is read).
        let h = RequestHead::from_parts(&parts(
            &[("Transfer-Encoding", "chunked"), ("Content-Length", "9")],
            "/query",
        ))
        .expect("valid");
        assert_eq!((h.chunked, h.content_length), (true, 0));
    }

    #[test]
    fn an_http2_head_names_its_host_in_authority_and_a_body_without_length_is_read_as_chunked() {
        let h2 = |headers: &[(&str, &str)]| {
            let mut b = hyper::Request::builder()
                .method("POST")
                .version(hyper::Version::HTTP_2)
                .uri("http://127.0.0.1:7/query");
            for (k, v) in headers {
                b = b.header(*k, *v);
            }
            RequestHead::from_parts(&b.body(()).expect("request").into_parts().0)
        };
        let h = h2(&[("Content-Type", "application/x-foldhost-lookups")]).expect("valid");
        assert_eq!(h.host.as_deref(), Some("127.0.0.1:7"));
        assert_eq!((h.chunked, h.content_length, h.lookups), (true, 0, true));
        let h = h2(&[("Content-Length", "3"), ("Host", "127.0.0.1:7")]).expect("valid");
        assert_eq!((h.chunked, h.content_length, h.lookups), (false, 3, false));
        assert_eq!(
            h2(&[("Host", "evil.example")]),
            Err(HttpError::Bad("Host differs from :authority"))
        );
        // HTTP/1.1: the Host header, whatever the request target says.
        let h =
            RequestHead::from_parts(&parts(&[("Host", "a:1")], "http://b:2/query")).expect("valid");
        assert_eq!(h.host.as_deref(), Some("a:1"));
    }

    #[test]
    fn a_head_with_two_hosts_a_bad_length_or_a_body_over_the_largest_is_refused() {
        for (headers, want) in [
            (
                vec![("Host", "a"), ("Host", "b")],
                HttpError::Bad("more than one Host header"),
            ),
            (
                vec![("Content-Length", "x")],
                HttpError::Bad("bad content-length"),
            ),
            (
                vec![("Content-Length", "-1")],
                HttpError::Bad("bad content-length"),
            ),
        ] {
            assert_eq!(
                RequestHead::from_parts(&parts(&headers, "/query")),
                Err(want),
                "{headers:?}"
            );
        }
        let over = (MAX_BODY + 1).to_string();
        assert_eq!(
            RequestHead::from_parts(&parts(&[("Content-Length", &over)], "/swap")),
            Err(HttpError::TooLarge)
        );
        let mut p = parts(&[], "/query");
        p.headers.insert(
            HOST,
            hyper::header::HeaderValue::from_bytes(b"caf\xff").expect("opaque value"),
        );
        assert!(
            RequestHead::from_parts(&p).is_err(),
            "a Host that is not UTF-8"
        );
    }

    #[test]
    fn a_body_fits_only_while_its_bytes_stay_within_the_limit() {
        for (read, next, limit, fits) in [
            (0, 0, 0, true),
            (0, 1, 0, false),
            (10, 6, 16, true),
            (10, 7, 16, false),
            (usize::MAX, 1, usize::MAX, false),
        ] {
            assert_eq!(
                body_fits(read, next, limit),
                fits,
                "{read}+{next} in {limit}"
            );
        }
    }

    #[test]
    fn a_connection_waiting_for_its_next_request_rejoins_the_queue_at_the_back() {
        let mut h = HeadPhase::default();
        let (a, na) = h.enter();
        let (b, _nb) = h.enter();
        // `a` sent a whole request, was answered, and now waits for the next one.
        h.leave(a);
        h.rejoin(a, na.clone());
        h.rejoin(a, na);
        assert_eq!(h.len(), 2, "rejoined once");
        assert_eq!(h.evict_oldest(), Some(b));
        assert_eq!(h.evict_oldest(), Some(a));
        assert!(h.is_empty());
    }

    fn head(method: &str, path: &str, host: &str, len: usize) -> RequestHead {
        RequestHead {
            method: method.into(),
            path: path.into(),
            content_length: len,
            bearer: None,
            host: Some(host.into()),
            origin: None,
            chunked: false,
            min_revision: None,
            wait_ms: 0,
            lookups: false,
        }
    }

    fn policy(listen: &str, query_token: Option<&str>) -> AccessPolicy {
        AccessPolicy {
            admin_token: "admin-secret".into(),
            write_token: "write-secret".into(),
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
    fn the_probes_answer_without_a_token_take_get_and_no_body_and_keep_the_host_check() {
        let p = policy("10.0.0.5:8080", Some("reader"));
        let arrived = on("10.0.0.5:8080");
        for path in ["/healthz", "/readyz"] {
            let h = head("GET", path, "10.0.0.5:8080", 0);
            assert_eq!(status_of(admit(&h, &p, arrived)), 200, "{path}");
            assert_eq!(
                status_of(admit(&head("POST", path, "10.0.0.5:8080", 0), &p, arrived)),
                405,
                "{path}"
            );
            assert_eq!(
                status_of(admit(&head("GET", path, "10.0.0.5:8080", 1), &p, arrived)),
                413,
                "{path}"
            );
            assert_eq!(
                status_of(admit(
                    &head("GET", path, "evil.example:8080", 0),
                    &p,
                    arrived
                )),
                403,
                "{path}"
            );
        }
        let status = head("GET", "/status", "10.0.0.5:8080", 0);
        assert_eq!(
            status_of(admit(&status, &p, arrived)),
            401,
            "/status keeps its token"
        );
    }

    #[test]
    fn the_page_takes_get_and_no_body_keeps_the_host_and_origin_checks_and_leaves_the_token_to_status()
     {
        for (listen, arrived) in [
            ("10.0.0.5:8080", "10.0.0.5:8080"),
            ("0.0.0.0:8080", "10.0.0.5:8080"),
            ("127.0.0.1:8080", "127.0.0.1:8080"),
        ] {
            let p = policy(listen, Some("reader"));
            let arrived = on(arrived);
            let host = arrived.to_string();
            let page = head("GET", "/", &host, 0);
            assert_eq!(admit(&page, &p, arrived), Ok((Route::Page, 0)), "{listen}");
            // The data it shows is `/status`'s, behind the token the page sends from its
            // address's fragment.
            let mut status = head("GET", "/status", &host, 0);
            assert_eq!(status_of(admit(&status, &p, arrived)), 401, "{listen}");
            status.bearer = Some("reader".into());
            assert_eq!(status_of(admit(&status, &p, arrived)), 200, "{listen}");
            for (method, len, want) in [("POST", 0, 405), ("PUT", 0, 405), ("GET", 1, 413)] {
                assert_eq!(
                    status_of(admit(&head(method, "/", &host, len), &p, arrived)),
                    want,
                    "{listen} {method} / with {len} body bytes"
                );
            }
            // What keeps `/status` from a rebound name or a cross-site page keeps the page too.
            assert_eq!(
                status_of(admit(
                    &head("GET", "/", "evil.example:8080", 0),
                    &p,
                    arrived
                )),
                403,
                "{listen}"
            );
            let mut h = head("GET", "/", &host, 0);
            h.origin = Some("http://evil.example".into());
            assert_eq!(status_of(admit(&h, &p, arrived)), 403, "{listen}");
            h.origin = Some(format!("http://{host}"));
            assert_eq!(status_of(admit(&h, &p, arrived)), 200, "{listen}");
            // Only `/` itself: another path is no page.
            assert_eq!(
                status_of(admit(&head("GET", "/index.html", &host, 0), &p, arrived)),
                404
            );
        }
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
    fn tokens_match_only_exactly() {
        assert!(token_matches(Some("abc"), "abc"));
        assert!(!token_matches(Some("abd"), "abc"));
        assert!(!token_matches(Some("ab"), "abc"));
        assert!(!token_matches(Some(""), "abc"));
        assert!(!token_matches(None, "abc"));
    }
}
