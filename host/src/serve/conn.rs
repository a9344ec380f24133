//! The hyper plumbing of the endpoint: the accept loop with its connection slots and eviction,
//! one connection per task, and each request's flow — admitted from its head ([`super::admit`]),
//! its body's budget taken, its body read within the route's limit and the request's deadline,
//! answered, the answer written within [`WRITE_DEADLINE`].
//!
//! A connection speaks HTTP/1.1 (keep-alive: its requests one after the other, pipelined ones
//! answered in order) or, when it opens with the HTTP/2 preface (prior knowledge, cleartext:
//! h2c), HTTP/2: each stream a request, admitted, budgeted and bounded in time exactly as an
//! HTTP/1.1 request is, at most [`H2_MAX_STREAMS`] of them at once. The first bytes are read to
//! tell the two apart within the head deadline. What a connection may hold is bounded either way
//! (see the module invariants of `super`): an HTTP/1.1 one a read buffer of [`MAX_HEAD`]; an
//! HTTP/2 one a header list of [`MAX_HEAD`] at a time, [`H2_WINDOW`] of body bytes not yet read
//! (its connection window: every stream's together), and per stream at most [`H2_CHUNK`] twice
//! of an answer beyond what its client's window lets through. The timing of both is the slot's
//! (`slot.rs`): a connection with no request in service for [`HEAD_DEADLINE`] is closed (the
//! first head, the wait between two, an HTTP/2 header block that never ends), each request's
//! body is read within [`REQUEST_DEADLINE`], and an answer not written by its deadline cuts the
//! connection. A refused HTTP/1.1 request closes its connection (its body unread); a refused
//! HTTP/2 stream is reset, its body unread, and the connection's other streams go on.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncReadExt as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::admission::{HeadPhase, HttpError, Refusal, RequestHead, Route, admit};
use super::slot::{Answer, BodyError, Flushes, InService, Slot, into_response, read_body};
use super::{
    ANSWER_BUDGET, HEAD_DEADLINE, MAX_CONNECTIONS, MAX_HEAD, QUERY_BODY_BUDGET, REQUEST_DEADLINE,
    RESERVED_CONNECTIONS, Reply, ServeState, WAITING_READS, WRITE_DEADLINE,
};

/// Most HTTP/2 streams one connection has open at once (`SETTINGS_MAX_CONCURRENT_STREAMS`).
pub(crate) const H2_MAX_STREAMS: u32 = 32;
/// An HTTP/2 connection's receive windows, the connection's and each stream's: the body bytes
/// the client may send before the host reads them (HTTP/2's own initial window).
pub(crate) const H2_WINDOW: u32 = 65_535;
/// The chunks an answer is handed to HTTP/2 in, and the most a stream buffers beyond its
/// client's window.
pub(crate) const H2_CHUNK: usize = 16 * 1024;
/// The HTTP/2 connection preface a client with prior knowledge opens with.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The byte budgets bodies are read under and answers written under (see the module invariants).
pub(crate) struct Budgets {
    /// Query bodies, in KiB.
    query_kib: Arc<Semaphore>,
    /// Query answers waiting to be written, in KiB.
    answer_kib: Arc<Semaphore>,
    /// One admin body at a time.
    admin: Arc<Semaphore>,
    /// Reads waiting for a revision ([`WAITING_READS`]).
    waiting: Arc<Semaphore>,
    /// Connections beyond [`MAX_CONNECTIONS`] for probes, writes and the operator's routes
    /// ([`RESERVED_CONNECTIONS`]).
    reserved: Arc<Semaphore>,
}

impl Budgets {
    fn new() -> Self {
        Budgets {
            query_kib: Arc::new(Semaphore::new(QUERY_BODY_BUDGET / 1024)),
            answer_kib: Arc::new(Semaphore::new(ANSWER_BUDGET / 1024)),
            admin: Arc::new(Semaphore::new(1)),
            waiting: Arc::new(Semaphore::new(WAITING_READS)),
            reserved: Arc::new(Semaphore::new(RESERVED_CONNECTIONS)),
        }
    }
}

/// Serves until the listener fails; each connection on its own task, at most
/// [`MAX_CONNECTIONS`] at once. With every slot taken, a new connection evicts the oldest one that
/// waits for a request or has not yet sent a whole unauthenticated one ([`HeadPhase`]), retrying
/// while it waits.
pub async fn serve(listener: TcpListener, state: Arc<ServeState>) {
    let heads = Arc::new(Mutex::new(HeadPhase::default()));
    serve_with(listener, state, heads, Arc::new(Budgets::new())).await;
}

/// [`serve`], with the eviction queue and the budgets given (the tests watch them).
async fn serve_with(
    listener: TcpListener,
    state: Arc<ServeState>,
    heads: Arc<Mutex<HeadPhase>>,
    budgets: Arc<Budgets>,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (sock, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(event = "listen_accept_failed", error = %e, "listen: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let permit = loop {
            match slots.clone().try_acquire_owned() {
                Ok(p) => break Some((p, false)),
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
                break p.ok().map(|p| (p, false));
            }
            // Every slot is in service and none could be evicted: a reserved one, which serves
            // only probes, writes and the operator's routes.
            if let Ok(p) = budgets.reserved.clone().try_acquire_owned() {
                break Some((p, true));
            }
        };
        let Some((permit, reserved)) = permit else {
            return;
        };
        // Registered before its task runs, so an accept burst always finds someone to evict.
        let Ok((ticket, told)) = heads.lock().map(|mut h| h.enter()) else {
            return;
        };
        let slot = Arc::new(Slot::new(heads.clone(), ticket, told));
        let (state, budgets) = (state.clone(), budgets.clone());
        tokio::spawn(tracing::Instrument::in_current_span(async move {
            let _permit = permit;
            connection(sock, state, budgets, slot, reserved).await;
        }));
    }
}

/// Reads the first bytes of a connection until they are the HTTP/2 preface or cannot be: whether
/// they are, and the bytes read (replayed to the protocol). The end of the stream before either
/// is not the preface.
async fn sniff(sock: &mut TcpStream) -> std::io::Result<(bool, Bytes)> {
    let mut seen = Vec::with_capacity(H2_PREFACE.len());
    let mut chunk = [0u8; H2_PREFACE.len()];
    while seen.len() < H2_PREFACE.len() && H2_PREFACE.starts_with(&seen) {
        let n = sock
            .read(&mut chunk[..H2_PREFACE.len() - seen.len()])
            .await?;
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&chunk[..n]);
    }
    Ok((seen == H2_PREFACE, Bytes::from(seen)))
}

/// Runs an HTTP/2 connection's stream tasks, each on its own task in the connection's span, and
/// each ended with the connection ([`Slot::ended`]).
#[derive(Clone)]
struct StreamTasks {
    slot: Arc<Slot>,
    span: tracing::Span,
}

impl<F> hyper::rt::Executor<F> for StreamTasks
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        let slot = self.slot.clone();
        tokio::spawn(tracing::Instrument::instrument(
            async move {
                tokio::select! {
                    _ = fut => {}
                    () = slot.ended() => {}
                }
            },
            self.span.clone(),
        ));
    }
}

/// Serves one connection until the client closes it, its slot's watchdog cuts it (a deadline),
/// it is refused, or it is evicted.
async fn connection(
    sock: TcpStream,
    state: Arc<ServeState>,
    budgets: Arc<Budgets>,
    slot: Arc<Slot>,
    reserved: bool,
) {
    let arrived_on = match sock.local_addr() {
        Ok(a) => a,
        Err(e) => {
            tracing::debug!(error = %e, "listen: connection without a local address");
            slot.close();
            return;
        }
    };
    // Small frames (an HTTP/2 window update, a short answer) go out at once, not after the
    // client's delayed acknowledgement.
    if let Err(e) = sock.set_nodelay(true) {
        tracing::debug!(error = %e, "listen: TCP_NODELAY not set");
    }
    let ctx = Arc::new(ConnCtx {
        state,
        budgets,
        slot: slot.clone(),
        arrived_on,
        reserved,
    });
    let served = serve_http(sock, slot.clone(), ctx);
    let told = slot.told.clone();
    tokio::select! {
        r = served => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "listen: connection ended");
            }
        }
        () = told.notified() => {
            tracing::debug!("listen: connection evicted while waiting for a request or sending one: every slot was taken");
        }
        why = slot.watchdog() => {
            tracing::debug!(why, "listen: connection cut");
        }
    }
    slot.close();
}

/// Serves the connection's requests over HTTP/1.1 or HTTP/2, whichever its first bytes speak.
async fn serve_http(
    mut sock: TcpStream,
    slot: Arc<Slot>,
    ctx: Arc<ConnCtx>,
) -> std::io::Result<()> {
    let service = hyper::service::service_fn(move |req| {
        let ctx = ctx.clone();
        async move { ctx.handle(req).await }
    });
    let (h2, prefix) = sniff(&mut sock).await?;
    let io = TokioIo::new(Flushes {
        sock,
        prefix,
        slot: slot.clone(),
    });
    if h2 {
        let tasks = StreamTasks {
            slot,
            span: tracing::Span::current(),
        };
        hyper::server::conn::http2::Builder::new(tasks)
            .timer(TokioTimer::new())
            .max_concurrent_streams(H2_MAX_STREAMS)
            .max_header_list_size(MAX_HEAD as u32)
            .initial_stream_window_size(H2_WINDOW)
            .initial_connection_window_size(H2_WINDOW)
            .max_send_buf_size(H2_CHUNK)
            .serve_connection(io, service)
            .await
            .map_err(std::io::Error::other)
    } else {
        hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            // The wait for each head, the first and every one after an answer
            // (keep-alive idle); the slot's watchdog keeps the same clock.
            .header_read_timeout(HEAD_DEADLINE)
            // The read buffer, and so the largest head (hyper answers 431 past it).
            .max_buf_size(MAX_HEAD)
            .keep_alive(true)
            // A client that shuts its side after sending its request still gets the answer.
            .half_close(true)
            .serve_connection(io, service)
            .await
            .map_err(std::io::Error::other)
    }
}

/// A connection's view of the server.
struct ConnCtx {
    state: Arc<ServeState>,
    budgets: Arc<Budgets>,
    slot: Arc<Slot>,
    arrived_on: SocketAddr,
    /// A reserved slot ([`RESERVED_CONNECTIONS`]): only probes, writes and the operator's routes.
    reserved: bool,
}

/// A request admitted and read whole: its route, its body, and the budget its body holds.
struct Admitted {
    /// The fold a `/folds/NAME/…` path names (a listener serving several folds).
    fold: Option<String>,
    route: Route,
    body: Vec<u8>,
    budget: Option<OwnedSemaphorePermit>,
    /// The revision a read must see (`Foldhost-Min-Revision`), already waited for.
    min_revision: Option<u64>,
    /// The body is a batch of lookups ([`super::lookups`]).
    lookups: bool,
}

fn timed_out(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, what.to_string())
}

impl ConnCtx {
    /// One request (an HTTP/2 stream): an error cuts it without an answer (the request deadline,
    /// or the client gone mid-body) — the connection over HTTP/1.1, the stream over HTTP/2.
    async fn handle(&self, req: Request<Incoming>) -> std::io::Result<Response<Answer>> {
        let mut served = InService::begin(&self.slot);
        let h1 = req.version() != hyper::Version::HTTP_2;
        let (parts, body) = req.into_parts();
        let (reply, answer_budget) = match self.read_request(&parts, body, &mut served).await? {
            Ok(request) => {
                // Whole: no longer evictable until its answer is written.
                served.hold();
                self.route(request).await
            }
            Err(refused) => (refused, None),
        };
        let done = served.answering(Instant::now() + WRITE_DEADLINE, answer_budget, h1);
        let chunk = if h1 { usize::MAX } else { H2_CHUNK };
        Ok(into_response(reply, done, chunk, h1))
    }

    /// Admits the head, takes the body's budget and reads the body within the route's limit and
    /// what [`REQUEST_DEADLINE`] leaves after the head's deadline. `Ok(Err(reply))`: refused.
    async fn read_request(
        &self,
        parts: &hyper::http::request::Parts,
        body: Incoming,
        served: &mut InService,
    ) -> std::io::Result<Result<Admitted, Reply>> {
        use hyper::body::Body as _;
        let refuse =
            |status, message: &str| Ok(Err(Reply::refused(&Refusal::new(status, message))));
        let mut head = match RequestHead::from_parts(parts) {
            Ok(h) => h,
            Err(e @ HttpError::TooLarge) => return refuse(413, &e.to_string()),
            Err(e @ HttpError::Bad(_)) => return refuse(400, &e.to_string()),
        };
        // An HTTP/2 stream that ended with its head has no body to budget.
        head.chunked &= !body.is_end_stream();
        // `/folds/NAME/route`: admitted as `/route`, served by the fold NAME.
        let fold = match super::folds::split_fold(&head.path) {
            Ok((fold, route)) => {
                let fold = fold.map(str::to_string);
                head.path = route.to_string();
                fold
            }
            Err(why) => return refuse(404, why),
        };
        let (route, limit) = match admit(&head, &self.state.policy, self.arrived_on) {
            Ok(r) => r,
            Err(refusal) => return Ok(Err(Reply::refused(&refusal))),
        };
        if self.reserved && !route.keeps_a_reserved_slot() {
            return refuse(
                503,
                "every connection slot is taken: only probes, writes and the operator's routes are served now; retry",
            );
        }
        // A read that must wait for a revision waits before its body is budgeted or read, under a
        // bound of its own: waiting reads never hold the bodies' budget, and never more than
        // WAITING_READS connections.
        if let (Route::Query | Route::Get, Some(min)) = (route, head.min_revision)
            && let Err(refused) = self
                .wait_revision(fold.as_deref(), route, min, head.wait_ms)
                .await
        {
            return Ok(Err(refused));
        }
        let budget = match self.body_budget(route, &head, limit, served) {
            Ok(b) => b,
            Err(refused) => return Ok(Err(refused)),
        };
        let read = tokio::time::timeout(
            REQUEST_DEADLINE.saturating_sub(HEAD_DEADLINE),
            read_body(body, limit, head.content_length),
        )
        .await
        .map_err(|_| timed_out("request deadline"))?;
        match read {
            Ok(body) => Ok(Ok(Admitted {
                fold,
                route,
                body,
                budget,
                min_revision: head.min_revision,
                lookups: head.lookups,
            })),
            Err(BodyError::TooLarge) => refuse(
                413,
                &format!("{} takes at most {limit} body bytes", head.path),
            ),
            Err(BodyError::Read(e)) => Err(e),
        }
    }

    /// A read of `fold`'s `route` that must see revision `min` waits for it (unless the fold is
    /// level already), holding one of the waiting reads' places. `Err(reply)`: refused, or
    /// still behind when its wait ran out.
    async fn wait_revision(
        &self,
        fold: Option<&str>,
        route: Route,
        min: u64,
        wait_ms: u64,
    ) -> Result<(), Reply> {
        let target = self.target(fold, route)?;
        let level = target.positions.as_ref().is_some_and(|p| {
            p.status
                .applied_through
                .load(std::sync::atomic::Ordering::Acquire)
                >= min
        });
        if !level {
            let Ok(_waiting) = self.budgets.waiting.clone().try_acquire_owned() else {
                return Err(Reply::refused(&Refusal::new(
                    503,
                    "too many reads wait for a revision here; retry",
                )));
            };
            super::wait_revision(&target, min, wait_ms).await?;
        }
        Ok(())
    }

    /// The body's share of a budget, taken before a byte of it is read: a chunked query takes
    /// the route's whole limit, the most it may read; an admin request takes the one admin
    /// place. A request admitted with a token is no longer a stranger to evict. `Err(reply)`:
    /// refused, the budget being spent.
    fn body_budget(
        &self,
        route: Route,
        head: &RequestHead,
        limit: usize,
        served: &mut InService,
    ) -> Result<Option<OwnedSemaphorePermit>, Reply> {
        let refuse = |message: &str| Err(Reply::refused(&Refusal::new(503, message)));
        Ok(match route {
            Route::Query | Route::Write if head.chunked || head.content_length > 0 => {
                if route == Route::Write {
                    // Admitted with the write token: no longer a stranger to evict.
                    served.hold();
                }
                let bytes = if head.chunked {
                    limit
                } else {
                    head.content_length
                };
                let share = u32::try_from(bytes.div_ceil(1024)).ok().and_then(|k| {
                    self.budgets
                        .query_kib
                        .clone()
                        .try_acquire_many_owned(k)
                        .ok()
                });
                match share {
                    Some(p) => Some(p),
                    None => return refuse("too many query bodies in flight; retry"),
                }
            }
            Route::Swap | Route::Shadow | Route::Export => {
                // Admitted with the admin token: no longer a stranger to evict.
                served.hold();
                match self.budgets.admin.clone().try_acquire_owned() {
                    Ok(p) => Some(p),
                    Err(_) => return refuse("another admin request is in flight; retry"),
                }
            }
            _ => None,
        })
    }

    /// The state serving a request for `fold`'s `route`: the fold's when the path names one (on a
    /// listener of several folds), the only fold's for a fold route on a listener of one, else the
    /// listener's own.
    fn target(&self, fold: Option<&str>, route: Route) -> Result<Arc<ServeState>, Reply> {
        let not_found = |m: String| Reply::new(404, "text/plain", format!("{m}\n"));
        match (fold, &self.state.registry) {
            (Some(name), Some(r)) => r
                .get(name)
                .ok_or_else(|| not_found(format!("no fold named {name:?} here"))),
            (Some(_), None) => Err(not_found(
                "this listener serves one fold: its routes have no /folds/ prefix".into(),
            )),
            (None, Some(r))
                if !matches!(
                    route,
                    Route::Health | Route::Ready | Route::Metrics | Route::Page | Route::Status
                ) =>
            {
                r.only().ok_or_else(|| {
                    not_found("this listener serves several folds: name one, /folds/NAME/…".into())
                })
            }
            _ => Ok(self.state.clone()),
        }
    }

    /// Serves an admitted request; a query's answer holds its share of [`ANSWER_BUDGET`] until it
    /// is written (the second value).
    async fn route(&self, request: Admitted) -> (Reply, Option<OwnedSemaphorePermit>) {
        let Admitted {
            fold,
            route,
            body,
            budget,
            min_revision,
            lookups,
        } = request;
        let target = match self.target(fold.as_deref(), route) {
            Ok(t) => t,
            Err(refused) => return (refused, None),
        };
        let state = &*target;
        // A minimum revision was waited for before the body was read; the gate stands (the
        // fold's applied_through never moves back), checked again without waiting.
        if let (Route::Query | Route::Get, Some(min)) = (route, min_revision)
            && let Err(behind) = super::wait_revision(state, min, 0).await
        {
            return (behind, None);
        }
        let answered = match route {
            Route::Status => (super::status(state), None),
            Route::Query if lookups => {
                super::query_lookups(&body, state, &self.budgets.answer_kib).await
            }
            Route::Query => super::query(body, state, &self.budgets.answer_kib).await,
            Route::Swap => (super::swap(body, state).await, None),
            Route::Shadow => (super::shadow(body, state).await, None),
            Route::Export => (super::export(body, state).await, None),
            Route::Write => (super::write(body, state).await, None),
            Route::Get => (super::get(&body, state), None),
            Route::Health => (super::health(), None),
            Route::Metrics => (super::metrics(state), None),
            Route::Ready => (super::ready(state), None),
            Route::Page => (super::page(), None),
        };
        // The body's budget is held until the request is served.
        drop(budget);
        answered
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::{BodyExt as _, Full};
    use hyper::body::Frame;
    use hyper::header::HOST;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::sync::Notify;

    use super::*;
    use crate::serve::{AccessPolicy, Limits};
    use foldhost_fold::applied::Control;

    /// Every test is stopped by this if it hangs (never reached by a passing one).
    const HUNG: Duration = Duration::from_secs(60);

    /// A server on loopback whose fold answers each query with its own request bytes; returns
    /// its address and the count of queries the fold received.
    async fn server(limits: Limits) -> std::io::Result<(SocketAddr, Arc<AtomicUsize>)> {
        let s = server_with(limits, None).await?;
        Ok((s.addr, s.queries))
    }

    /// A test server: its address, the count of queries its fold received, its eviction queue
    /// and its budgets.
    struct Served {
        addr: SocketAddr,
        queries: Arc<AtomicUsize>,
        heads: Arc<Mutex<HeadPhase>>,
        budgets: Arc<Budgets>,
    }

    /// [`server`], its fold answering each query only once `gate` is notified, and its eviction
    /// queue.
    async fn server_with(limits: Limits, gate: Option<Arc<Notify>>) -> std::io::Result<Served> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let listen = listener.local_addr()?;
        let (control, mut rx) = tokio::sync::mpsc::channel(64);
        let queries = Arc::new(AtomicUsize::new(0));
        let seen = queries.clone();
        tokio::spawn(async move {
            while let Some(c) = rx.recv().await {
                // Every ask of the endpoint reaches a fold without a query instance as one
                // `Control::Queries`: each lookup is answered with itself.
                match c {
                    Control::Queries { lookups, reply } => {
                        seen.fetch_add(1, Ordering::SeqCst);
                        if let Some(g) = &gate {
                            g.notified().await;
                        }
                        let _ = reply.send(lookups.into_iter().map(Ok).collect());
                    }
                    Control::Query { request, reply } => {
                        seen.fetch_add(1, Ordering::SeqCst);
                        if let Some(g) = &gate {
                            g.notified().await;
                        }
                        let _ = reply.send(Ok(request));
                    }
                    _ => {}
                }
            }
        });
        let state = Arc::new(ServeState {
            status: Box::new(foldhost_core::status::StatusReport::default),
            queries: foldhost_fold::applied::Queries::new(control.clone()),
            control,
            engine: None,
            policy: AccessPolicy {
                admin_token: "admin-secret".into(),
                write_token: "write-secret".into(),
                query_token: None,
                listen,
                hosts: Vec::new(),
                query_open: false,
                limits,
            },
            backend: foldhost_core::storedir::Backend::AppendLog,
            scope: ">".into(),
            stream: Arc::new(|| None),
            state_folds: Vec::new(),
            ready_max_lag: 0,
            folds: Vec::new(),
            registry: None,
            channel: None,
            write: None,
            positions: None,
            read_key: None,
        });
        let heads = Arc::new(Mutex::new(HeadPhase::default()));
        let budgets = Arc::new(Budgets::new());
        tokio::spawn(serve_with(listener, state, heads.clone(), budgets.clone()));
        Ok(Served {
            addr: listen,
            queries,
            heads,
            budgets,
        })
    }

    /// Waits until the eviction queue holds `n` connections (the deadline only stops a hung test).
    async fn queued(heads: &Mutex<HeadPhase>, n: usize, what: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + HUNG;
        loop {
            let len = heads.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.len();
            if len == n {
                return Ok(());
            }
            anyhow::ensure!(Instant::now() < deadline, "{what}: {len} queued, not {n}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn a_connection_is_evictable_while_it_waits_for_a_request_and_never_while_one_is_served()
    -> anyhow::Result<()> {
        let gate = Arc::new(Notify::new());
        let Served {
            addr,
            queries,
            heads,
            ..
        } = server_with(Limits::default(), Some(gate.clone())).await?;
        let sock = TcpStream::connect(addr).await?;
        queued(&heads, 1, "accepted, no request yet").await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(sock)).await?;
        let _driver = tokio::spawn(conn);
        for i in 0..2 {
            let query = Request::post("/query")
                .header(HOST, addr.to_string())
                .body(Full::new(Bytes::from(format!("k{i}"))))?;
            let answer = tokio::spawn(sender.send_request(query));
            // Whole and in the fold: out of the queue until its answer is written.
            let deadline = Instant::now() + HUNG;
            while queries.load(Ordering::SeqCst) <= i {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "the query never reached the fold"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            queued(&heads, 0, "a whole request being served").await?;
            gate.notify_one();
            let resp = tokio::time::timeout(HUNG, answer).await???;
            assert_eq!(resp.status(), 200);
            resp.into_body().collect().await?;
            // Answered: waiting for its next request, evictable again.
            queued(&heads, 1, "answered, waiting for the next request").await?;
        }
        Ok(())
    }

    /// Sends `raw` and reads until the server closes the connection; the client never closes
    /// its side, so an answer that needs more of the request never comes.
    async fn exchange(addr: SocketAddr, raw: &[u8]) -> anyhow::Result<String> {
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(raw).await?;
        let mut resp = Vec::new();
        tokio::time::timeout(HUNG, s.read_to_end(&mut resp)).await??;
        Ok(String::from_utf8_lossy(&resp).into_owned())
    }

    fn chunked(body: &[u8], chunk: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for c in body.chunks(chunk) {
            out.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
            out.extend_from_slice(c);
            out.extend_from_slice(b"\r\n");
        }
        out
    }

    #[tokio::test]
    async fn several_requests_are_answered_on_one_keep_alive_connection() -> anyhow::Result<()> {
        let (addr, queries) = server(Limits::default()).await?;
        let sock = TcpStream::connect(addr).await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(sock)).await?;
        let driver = tokio::spawn(conn);
        for i in 0..3 {
            // Each request is admitted on its own: a status, then a query, on the same connection.
            let status = Request::get("/status")
                .header(HOST, addr.to_string())
                .body(Full::new(Bytes::new()))?;
            // The connection takes the next request once it finished the last (keep-alive, not
            // pipelining): wait for that, or the send is refused as "not ready".
            tokio::time::timeout(HUNG, sender.ready()).await??;
            let resp = tokio::time::timeout(HUNG, sender.send_request(status)).await??;
            assert_eq!(resp.status(), 200, "status {i}");
            resp.into_body().collect().await?;
            let query = Request::post("/query")
                .header(HOST, addr.to_string())
                .body(Full::new(Bytes::from(format!("k{i}"))))?;
            tokio::time::timeout(HUNG, sender.ready()).await??;
            let resp = tokio::time::timeout(HUNG, sender.send_request(query)).await??;
            assert_eq!(resp.status(), 200, "query {i}");
            let answer = resp.into_body().collect().await?.to_bytes();
            assert_eq!(&answer[..], format!("k{i}").as_bytes());
        }
        assert_eq!(queries.load(Ordering::SeqCst), 3);
        // A request refused on the same connection is refused on its own head (a foreign Host),
        // and closes the connection.
        let rebound = Request::get("/status")
            .header(HOST, "evil.example")
            .body(Full::new(Bytes::new()))?;
        tokio::time::timeout(HUNG, sender.ready()).await??;
        let resp = tokio::time::timeout(HUNG, sender.send_request(rebound)).await??;
        assert_eq!(resp.status(), 403);
        resp.into_body().collect().await?;
        tokio::time::timeout(HUNG, driver).await???;
        Ok(())
    }

    #[tokio::test]
    async fn pipelined_requests_written_at_once_are_answered_in_order_on_one_connection()
    -> anyhow::Result<()> {
        let (addr, queries) = server(Limits::default()).await?;
        let mut raw = Vec::new();
        for i in 0..3 {
            raw.extend_from_slice(
                format!("POST /query HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 2\r\n\r\nk{i}")
                    .as_bytes(),
            );
        }
        raw.extend_from_slice(
            format!("GET /status HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        );
        let resp = exchange(addr, &raw).await?;
        let answers: Vec<&str> = resp.split("HTTP/1.1 ").skip(1).collect();
        assert_eq!(answers.len(), 4, "{resp}");
        for (i, a) in answers.iter().take(3).enumerate() {
            assert!(a.starts_with("200"), "{a}");
            assert!(a.ends_with(&format!("k{i}")), "answer {i} in order: {a}");
        }
        assert_eq!(queries.load(Ordering::SeqCst), 3);
        Ok(())
    }

    /// An HTTP/2 prior-knowledge client on a new connection to `addr`.
    async fn h2_client(
        addr: SocketAddr,
    ) -> anyhow::Result<hyper::client::conn::http2::SendRequest<Full<Bytes>>> {
        let sock = TcpStream::connect(addr).await?;
        let (sender, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            TokioIo::new(sock),
        )
        .await?;
        tokio::spawn(conn);
        Ok(sender)
    }

    fn h2_query(addr: SocketAddr, body: &str) -> anyhow::Result<Request<Full<Bytes>>> {
        Ok(Request::post(format!("http://{addr}/query"))
            .body(Full::new(Bytes::from(body.to_string())))?)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_http2_streams_are_each_admitted_and_answered_and_a_refused_one_ends_alone()
    -> anyhow::Result<()> {
        let (addr, queries) = server(Limits::default()).await?;
        let sender = h2_client(addr).await?;
        let asked = (0..8).map(|i| {
            let mut sender = sender.clone();
            async move {
                let resp = sender
                    .send_request(h2_query(addr, &format!("k{i}"))?)
                    .await?;
                anyhow::ensure!(resp.version() == hyper::Version::HTTP_2);
                let status = resp.status();
                let body = resp.into_body().collect().await?.to_bytes();
                anyhow::Ok((status, body))
            }
        });
        let answers = tokio::time::timeout(HUNG, futures::future::join_all(asked)).await?;
        for (i, a) in answers.into_iter().enumerate() {
            let (status, body) = a?;
            assert_eq!(status, 200);
            assert_eq!(&body[..], format!("k{i}").as_bytes());
        }
        assert_eq!(queries.load(Ordering::SeqCst), 8);
        // A stream naming another host is refused on its own head; the connection serves on.
        let mut s = sender.clone();
        let rebound = Request::get("http://evil.example/status").body(Full::new(Bytes::new()))?;
        let resp = tokio::time::timeout(HUNG, s.send_request(rebound)).await??;
        assert_eq!(resp.status(), 403);
        let resp = tokio::time::timeout(HUNG, s.send_request(h2_query(addr, "again")?)).await??;
        assert_eq!(resp.status(), 200);
        assert_eq!(&resp.into_body().collect().await?.to_bytes()[..], b"again");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_http2_connection_is_evictable_while_no_stream_is_whole_and_never_while_one_is_served()
    -> anyhow::Result<()> {
        let gate = Arc::new(Notify::new());
        let Served {
            addr,
            queries,
            heads,
            ..
        } = server_with(Limits::default(), Some(gate.clone())).await?;
        let mut sender = h2_client(addr).await?;
        queued(&heads, 1, "an HTTP/2 connection, no stream yet").await?;
        let answer = tokio::spawn(sender.send_request(h2_query(addr, "k")?));
        until("the query reaches the fold", || {
            queries.load(Ordering::SeqCst) == 1
        })
        .await?;
        queued(&heads, 0, "a whole stream being served").await?;
        gate.notify_one();
        let resp = tokio::time::timeout(HUNG, answer).await???;
        assert_eq!(resp.status(), 200);
        resp.into_body().collect().await?;
        queued(&heads, 1, "answered, waiting for the next stream").await?;
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_http2_connection_without_a_request_is_closed_at_the_head_deadline()
    -> anyhow::Result<()> {
        let (addr, _) = server(Limits::default()).await?;
        // The preface and nothing more: no settings, no stream.
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(H2_PREFACE).await?;
        let mut got = Vec::new();
        // Closed by the server (its own settings frame, then the end of the stream).
        tokio::time::timeout(HUNG, s.read_to_end(&mut got)).await??;
        // Half a preface is not left waiting either.
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(&H2_PREFACE[..10]).await?;
        let mut got = Vec::new();
        tokio::time::timeout(HUNG, s.read_to_end(&mut got)).await??;
        assert!(got.is_empty(), "no answer to half a preface");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_http2_answer_its_client_does_not_read_holds_its_budget_until_the_write_deadline_cuts_it()
    -> anyhow::Result<()> {
        const ANSWER: usize = 8 << 20;
        let s = server_with(
            Limits {
                query_body: ANSWER,
                ..Limits::default()
            },
            None,
        )
        .await?;
        let full = ANSWER_BUDGET / 1024;
        let answers = s.budgets.answer_kib.clone();
        let mut sender = h2_client(s.addr).await?;
        let body = "x".repeat(ANSWER);
        // The client never reads the body: its stream window closes after 64 KiB.
        let resp =
            tokio::time::timeout(HUNG, sender.send_request(h2_query(s.addr, &body)?)).await??;
        assert_eq!(resp.status(), 200);
        until("the answer holds its budget", || {
            answers.available_permits() == full - ANSWER / 1024
        })
        .await?;
        until("the budget comes back", || {
            answers.available_permits() == full
        })
        .await?;
        // The connection was cut: the body ends in an error, not whole.
        let read = tokio::time::timeout(HUNG, resp.into_body().collect()).await?;
        assert!(read.is_err(), "cut before the whole answer arrived");
        Ok(())
    }

    #[tokio::test]
    async fn the_page_goes_out_with_its_policy_and_no_other_answer_does() -> anyhow::Result<()> {
        let (addr, _) = server(Limits::default()).await?;
        let page = exchange(
            addr,
            format!("GET / HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
        let (head, body) = page.split_once("\r\n\r\n").unwrap_or((&page, ""));
        let head = head.to_ascii_lowercase();
        assert!(head.starts_with("http/1.1 200"), "{head}");
        for line in [
            "content-type: text/html; charset=utf-8",
            "content-security-policy: default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:",
            "x-content-type-options: nosniff",
        ] {
            assert!(
                head.contains(&format!("\r\n{line}\r\n")),
                "{line} missing: {head}"
            );
        }
        assert_eq!(body, super::super::PAGE, "the page, whole");
        let status = exchange(
            addr,
            format!("GET /status HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?
        .to_ascii_lowercase();
        assert!(status.starts_with("http/1.1 200"), "{status}");
        assert!(!status.contains("content-security-policy"), "{status}");
        Ok(())
    }

    #[test]
    fn the_page_sets_every_figure_as_text_and_loads_nothing_from_elsewhere() {
        let page = super::super::PAGE;
        for banned in [
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
        ] {
            assert!(!page.contains(banned), "the page uses {banned}");
        }
        for banned in ["src=\"http", "href=\"http", "//cdn", "@import", "url("] {
            assert!(!page.contains(banned), "the page loads {banned}");
        }
        for field in [
            "cursor",
            "lag",
            "applied_through",
            "lag_history",
            "last_swaps",
        ] {
            assert!(
                page.contains(&format!("data-field=\"{field}\"")),
                "no {field} on the page"
            );
        }
    }

    #[tokio::test]
    async fn a_chunked_body_within_the_routes_limit_is_accepted() -> anyhow::Result<()> {
        let limits = Limits {
            query_body: 4096,
            ..Limits::default()
        };
        let (addr, queries) = server(limits).await?;
        // Exactly the limit, in chunks of 1000 bytes and a last one of 96.
        let body: Vec<u8> = (0..4096u32).map(|i| b'a' + (i % 26) as u8).collect();
        let mut raw = format!(
            "POST /query HTTP/1.1\r\nHost: {addr}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        .into_bytes();
        raw.extend_from_slice(&chunked(&body, 1000));
        raw.extend_from_slice(b"0\r\n\r\n");
        let resp = exchange(addr, &raw).await?;
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(
            resp.ends_with(&*String::from_utf8_lossy(&body)),
            "the fold got the whole body: {resp}"
        );
        assert_eq!(queries.load(Ordering::SeqCst), 1);
        Ok(())
    }

    #[tokio::test]
    async fn a_chunked_body_over_the_routes_limit_is_refused_before_it_is_read_whole()
    -> anyhow::Result<()> {
        let limits = Limits {
            query_body: 4096,
            ..Limits::default()
        };
        let (addr, queries) = server(limits).await?;
        // One byte over the limit, and the body never ends (no last chunk, the connection kept
        // open): the refusal comes from the bytes past the limit, not from the body's end.
        let body = vec![b'x'; 4097];
        let mut raw =
            format!("POST /query HTTP/1.1\r\nHost: {addr}\r\nTransfer-Encoding: chunked\r\n\r\n")
                .into_bytes();
        raw.extend_from_slice(&chunked(&body, 1024));
        let resp = exchange(addr, &raw).await?;
        assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
        assert_eq!(
            queries.load(Ordering::SeqCst),
            0,
            "the fold never saw the body"
        );
        // The same on /status, which takes no body at all.
        let mut raw =
            format!("GET /status HTTP/1.1\r\nHost: {addr}\r\nTransfer-Encoding: chunked\r\n\r\n")
                .into_bytes();
        raw.extend_from_slice(&chunked(b"x", 1));
        let resp = exchange(addr, &raw).await?;
        assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
        Ok(())
    }

    #[tokio::test]
    async fn a_head_over_the_largest_is_refused_before_it_ends() -> anyhow::Result<()> {
        let (addr, queries) = server(Limits::default()).await?;
        // A head that never ends: one header line longer than the largest head.
        let mut raw = format!("POST /query HTTP/1.1\r\nHost: {addr}\r\nX-Pad: ").into_bytes();
        raw.resize(raw.len() + MAX_HEAD + 1, b'a');
        let resp = exchange(addr, &raw).await?;
        assert!(resp.starts_with("HTTP/1.1 431"), "{resp:.80}");
        assert_eq!(queries.load(Ordering::SeqCst), 0);
        Ok(())
    }

    /// Waits until `what` holds (the deadline only stops a hung test).
    async fn until(what: &str, mut done: impl FnMut() -> bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + HUNG;
        while !done() {
            anyhow::ensure!(Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_answer_the_client_does_not_read_holds_its_budget_until_the_write_deadline_cuts_it()
    -> anyhow::Result<()> {
        const ANSWER: usize = 8 << 20;
        let s = server_with(
            Limits {
                query_body: ANSWER,
                ..Limits::default()
            },
            None,
        )
        .await?;
        let full = ANSWER_BUDGET / 1024;
        let answers = s.budgets.answer_kib.clone();
        // A client that reads nothing, with a small receive buffer: an 8 MiB answer cannot be
        // written whole into the kernel's buffers.
        let sock = tokio::net::TcpSocket::new_v4()?;
        sock.set_recv_buffer_size(4096)?;
        let mut c = sock.connect(s.addr).await?;
        let mut raw = format!(
            "POST /query HTTP/1.1\r\nHost: {}\r\nContent-Length: {ANSWER}\r\n\r\n",
            s.addr
        )
        .into_bytes();
        raw.resize(raw.len() + ANSWER, b'x');
        c.write_all(&raw).await?;
        // The answer holds its share while hyper writes it, not only until hyper took the body.
        until("the answer holds its budget", || {
            answers.available_permits() == full - ANSWER / 1024
        })
        .await?;
        // Unread, it is cut at the write deadline, and its share comes back.
        until("the budget comes back", || {
            answers.available_permits() == full
        })
        .await?;
        let mut got = Vec::new();
        // Closed by the server: the end of the stream, or a reset (either ends the read).
        let _ = tokio::time::timeout(HUNG, c.read_to_end(&mut got)).await?;
        assert!(got.len() < ANSWER, "cut: {} bytes arrived", got.len());
        Ok(())
    }

    #[tokio::test]
    async fn a_body_reader_keeps_no_chunk_that_would_pass_the_limit() -> anyhow::Result<()> {
        let frames = |sizes: &[usize]| {
            let chunks: Vec<Result<Frame<Bytes>, Infallible>> = sizes
                .iter()
                .map(|&n| Ok(Frame::data(Bytes::from(vec![b'x'; n]))))
                .collect();
            http_body_util::StreamBody::new(futures::stream::iter(chunks))
        };
        assert_eq!(read_body(frames(&[10, 6]), 16, 0).await?.len(), 16);
        assert!(matches!(
            read_body(frames(&[10, 7]), 16, 0).await,
            Err(BodyError::TooLarge)
        ));
        assert!(matches!(
            read_body(frames(&[1]), 0, 0).await,
            Err(BodyError::TooLarge)
        ));
        Ok(())
    }
}
