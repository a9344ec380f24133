//! The hyper plumbing of the endpoint: the accept loop with its connection slots and eviction,
//! one HTTP/1.1 connection per task (keep-alive: its requests one after the other), and each
//! request's flow — admitted from its head ([`super::admit`]), its body's budget taken, its body
//! read within the route's limit and the request's deadline, answered, the answer written within
//! [`WRITE_DEADLINE`].

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::{BodyExt as _, Full};
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper::header::{CONNECTION, CONTENT_TYPE, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::admission::{HeadPhase, HttpError, Refusal, RequestHead, Route, admit, body_fits};
use super::{
    ANSWER_BUDGET, HEAD_DEADLINE, MAX_CONNECTIONS, MAX_HEAD, QUERY_BODY_BUDGET, REQUEST_DEADLINE,
    Reply, ServeState, WRITE_DEADLINE,
};

/// The byte budgets bodies are read under and answers written under (see the module invariants).
pub(crate) struct Budgets {
    /// Query bodies, in KiB.
    query_kib: Arc<Semaphore>,
    /// Query answers waiting to be written, in KiB.
    answer_kib: Arc<Semaphore>,
    /// One admin body at a time.
    admin: Arc<Semaphore>,
}

impl Budgets {
    fn new() -> Self {
        Budgets {
            query_kib: Arc::new(Semaphore::new(QUERY_BODY_BUDGET / 1024)),
            answer_kib: Arc::new(Semaphore::new(ANSWER_BUDGET / 1024)),
            admin: Arc::new(Semaphore::new(1)),
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
        let Ok((ticket, told)) = heads.lock().map(|mut h| h.enter()) else {
            return;
        };
        let slot = Arc::new(Slot {
            heads: heads.clone(),
            ticket,
            told,
            closed: AtomicBool::new(false),
            respond_by: Mutex::new(None),
            answer_budget: Mutex::new(None),
            answered: AtomicBool::new(false),
        });
        let (state, budgets) = (state.clone(), budgets.clone());
        tokio::spawn(tracing::Instrument::in_current_span(async move {
            let _permit = permit;
            connection(sock, state, budgets, slot).await;
        }));
    }
}

/// One connection's place in the eviction queue, and the deadline of the answer it writes.
struct Slot {
    heads: Arc<Mutex<HeadPhase>>,
    ticket: u64,
    /// Notified when the connection is evicted.
    told: Arc<Notify>,
    /// The connection ended: it never rejoins the queue.
    closed: AtomicBool,
    /// When the answer being written must be written by.
    respond_by: Mutex<Option<Instant>>,
    /// The share of [`ANSWER_BUDGET`] the answer being written holds until its last byte is
    /// written (hyper keeps the bytes in its write queue after it has taken the body).
    answer_budget: Mutex<Option<OwnedSemaphorePermit>>,
    /// The answer's body has been handed to hyper: the next completed flush ends the answer.
    answered: AtomicBool,
}

impl Slot {
    /// Out of the eviction queue: the request is whole, or admitted with the admin token.
    fn leave(&self) {
        if let Ok(mut h) = self.heads.lock() {
            h.leave(self.ticket);
        }
    }

    /// Back in the eviction queue: the answer is written and the connection waits for its next
    /// request.
    fn rejoin(&self) {
        if let Ok(mut h) = self.heads.lock()
            && !self.closed.load(Ordering::Acquire)
        {
            h.rejoin(self.ticket, self.told.clone());
        }
    }

    /// The connection ended (idempotent).
    fn close(&self) {
        if let Ok(mut h) = self.heads.lock() {
            self.closed.store(true, Ordering::Release);
            h.leave(self.ticket);
        }
    }

    fn set_respond_by(&self, by: Option<Instant>) {
        if let Ok(mut r) = self.respond_by.lock() {
            *r = by;
        }
    }

    fn respond_by(&self) -> Option<Instant> {
        self.respond_by.lock().ok().and_then(|r| *r)
    }

    /// Everything hyper buffered has been written: if that was an answer's last byte, the
    /// answer is done and the connection waits for its next request.
    fn flushed(&self) {
        if self.answered.swap(false, Ordering::AcqRel) {
            self.set_respond_by(None);
            if let Ok(mut b) = self.answer_budget.lock() {
                b.take();
            }
            self.rejoin();
        }
    }

    /// An answer starts: written by `by`, holding `budget` until then.
    fn answering(&self, by: Instant, budget: Option<OwnedSemaphorePermit>) {
        self.set_respond_by(Some(by));
        if let Ok(mut b) = self.answer_budget.lock() {
            *b = budget;
        }
    }
}

/// Serves one connection until the client closes it, a deadline cuts it, it is refused, or it is
/// evicted.
async fn connection(
    sock: TcpStream,
    state: Arc<ServeState>,
    budgets: Arc<Budgets>,
    slot: Arc<Slot>,
) {
    let arrived_on = match sock.local_addr() {
        Ok(a) => a,
        Err(e) => {
            tracing::debug!(error = %e, "listen: connection without a local address");
            slot.close();
            return;
        }
    };
    let ctx = Arc::new(ConnCtx {
        state,
        budgets,
        slot: slot.clone(),
        arrived_on,
    });
    let io = TokioIo::new(WriteDeadline {
        sock,
        slot: slot.clone(),
        sleep: None,
    });
    let service = hyper::service::service_fn(move |req| {
        let ctx = ctx.clone();
        async move { ctx.handle(req).await }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        // The wait for each head, the first and every one after an answer (keep-alive idle).
        .header_read_timeout(HEAD_DEADLINE)
        // The read buffer, and so the largest head (hyper answers 431 past it).
        .max_buf_size(MAX_HEAD)
        .keep_alive(true)
        // A client that shuts its side after sending its request still gets the answer.
        .half_close(true);
    let conn = builder.serve_connection(io, service);
    let told = slot.told.clone();
    tokio::select! {
        r = conn => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "listen: connection ended");
            }
        }
        () = told.notified() => {
            tracing::debug!("listen: connection evicted while waiting for a request or sending one: every slot was taken");
        }
    }
    slot.close();
}

/// A connection's view of the server.
struct ConnCtx {
    state: Arc<ServeState>,
    budgets: Arc<Budgets>,
    slot: Arc<Slot>,
    arrived_on: SocketAddr,
}

/// A request admitted and read whole: its route, its body, and the budget its body holds.
struct Admitted {
    /// The fold a `/folds/NAME/…` path names (a listener serving several folds).
    fold: Option<String>,
    route: Route,
    body: Vec<u8>,
    budget: Option<OwnedSemaphorePermit>,
    /// The revision a read must see first (`Foldhost-Min-Revision`), and how long it waits.
    min_revision: Option<u64>,
    wait_ms: u64,
}

fn timed_out(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, what.to_string())
}

impl ConnCtx {
    /// One request: an error cuts the connection without an answer (the request deadline, or the
    /// client gone mid-body).
    async fn handle(&self, req: Request<Incoming>) -> std::io::Result<Response<Answer>> {
        let (parts, body) = req.into_parts();
        let (reply, answer_budget) = match self.read_request(&parts, body).await? {
            Ok(request) => {
                // Whole: no longer evictable until its answer is written.
                self.slot.leave();
                self.route(request).await
            }
            Err(refused) => (refused, None),
        };
        self.slot
            .answering(Instant::now() + WRITE_DEADLINE, answer_budget);
        Ok(into_response(reply, self.slot.clone()))
    }

    /// Admits the head, takes the body's budget and reads the body within the route's limit and
    /// what [`REQUEST_DEADLINE`] leaves after the head's deadline. `Ok(Err(reply))`: refused.
    async fn read_request(
        &self,
        parts: &hyper::http::request::Parts,
        body: Incoming,
    ) -> std::io::Result<Result<Admitted, Reply>> {
        let refuse =
            |status, message: &str| Ok(Err(Reply::refused(&Refusal::new(status, message))));
        let mut head = match RequestHead::from_parts(parts) {
            Ok(h) => h,
            Err(e @ HttpError::TooLarge) => return refuse(413, &e.to_string()),
            Err(e @ HttpError::Bad(_)) => return refuse(400, &e.to_string()),
        };
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
        // The body's share of a budget, taken before a byte of it is read: a chunked query
        // takes the route's whole limit, the most it may read.
        let budget = match route {
            Route::Query | Route::Write if head.chunked || head.content_length > 0 => {
                if route == Route::Write {
                    // Admitted with the write token: no longer a stranger to evict.
                    self.slot.leave();
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
                    None => return refuse(503, "too many query bodies in flight; retry"),
                }
            }
            Route::Swap | Route::Shadow | Route::Export => {
                // Admitted with the admin token: no longer a stranger to evict.
                self.slot.leave();
                match self.budgets.admin.clone().try_acquire_owned() {
                    Ok(p) => Some(p),
                    Err(_) => return refuse(503, "another admin request is in flight; retry"),
                }
            }
            _ => None,
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
                wait_ms: head.wait_ms,
            })),
            Err(BodyError::TooLarge) => refuse(
                413,
                &format!("{} takes at most {limit} body bytes", head.path),
            ),
            Err(BodyError::Read(e)) => Err(e),
        }
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
            wait_ms,
        } = request;
        let target = match self.target(fold.as_deref(), route) {
            Ok(t) => t,
            Err(refused) => return (refused, None),
        };
        let state = &*target;
        if let (Route::Query | Route::Get, Some(min)) = (route, min_revision)
            && let Err(behind) = super::wait_revision(state, min, wait_ms).await
        {
            return (behind, None);
        }
        let answered = match route {
            Route::Status => (super::status(state), None),
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

/// Why a body was not read whole.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BodyError {
    /// Its bytes would pass the route's limit: refused, the chunk that would pass it unkept.
    #[error("the body passes the route's limit")]
    TooLarge,
    /// The client went away or sent a malformed body.
    #[error("reading the body: {0}")]
    Read(std::io::Error),
}

/// Reads a body whole, keeping at most `limit` bytes: stops at the first chunk that would pass
/// it ([`body_fits`]), whatever the body declared. `declared` (at most the limit once admitted)
/// sizes the buffer.
pub(crate) async fn read_body<B>(
    mut body: B,
    limit: usize,
    declared: usize,
) -> Result<Vec<u8>, BodyError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut buf = Vec::with_capacity(declared.min(limit));
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| BodyError::Read(std::io::Error::other(e)))?;
        let Ok(data) = frame.into_data() else {
            // Trailers: not kept.
            continue;
        };
        if !body_fits(buf.len(), data.len(), limit) {
            return Err(BodyError::TooLarge);
        }
        buf.extend_from_slice(&data);
    }
    Ok(buf)
}

/// The hyper response for `reply`; once hyper has taken its body, the next completed flush ends
/// the answer ([`Slot::flushed`]).
fn into_response(reply: Reply, slot: Arc<Slot>) -> Response<Answer> {
    let mut resp = Response::new(Answer {
        body: Full::new(Bytes::from(reply.body)),
        _done: Answered(slot),
    });
    *resp.status_mut() =
        StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(reply.content_type));
    for (name, value) in reply.headers {
        resp.headers_mut().insert(name.clone(), value.clone());
    }
    if reply.close {
        resp.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// A response body: the bytes, and what marks the answer handed over.
pub(crate) struct Answer {
    body: Full<Bytes>,
    _done: Answered,
}

/// Dropped when hyper has taken the whole body: the next completed flush ends the answer.
struct Answered(Arc<Slot>);

impl Drop for Answered {
    fn drop(&mut self) {
        self.0.answered.store(true, Ordering::Release);
    }
}

impl Body for Answer {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The socket, with each answer's write deadline: a write or flush still blocked at the
/// deadline fails, and hyper closes the connection.
struct WriteDeadline {
    sock: TcpStream,
    slot: Arc<Slot>,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl WriteDeadline {
    /// The inner write is blocked: fails it once the answer's deadline has passed, else waits
    /// (woken at the deadline).
    fn blocked<T>(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<T>> {
        let Some(by) = self.slot.respond_by() else {
            return Poll::Pending;
        };
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(by)));
        if sleep.deadline() != by {
            sleep.as_mut().reset(by);
        }
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(timed_out("response write deadline"))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for WriteDeadline {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().sock).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteDeadline {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.sock).poll_write(cx, buf) {
            Poll::Pending => this.blocked(cx),
            r => r,
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.sock).poll_write_vectored(cx, bufs) {
            Poll::Pending => this.blocked(cx),
            r => r,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.sock.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.sock).poll_flush(cx) {
            Poll::Ready(Ok(())) => {
                this.slot.flushed();
                Poll::Ready(Ok(()))
            }
            Poll::Pending => this.blocked(cx),
            r => r,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().sock).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use hyper::header::HOST;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;
    use crate::applied::Control;
    use crate::serve::{AccessPolicy, Limits};

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
                if let Control::Query { request, reply } = c {
                    seen.fetch_add(1, Ordering::SeqCst);
                    if let Some(g) = &gate {
                        g.notified().await;
                    }
                    let _ = reply.send(Ok(request));
                }
            }
        });
        let state = Arc::new(ServeState {
            status: Box::new(crate::status::StatusReport::default),
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
            backend: crate::storedir::Backend::AppendLog,
            scope: ">".into(),
            stream: Arc::new(|| None),
            state_folds: Vec::new(),
            ready_max_lag: 0,
            folds: Vec::new(),
            registry: None,
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
            let resp = tokio::time::timeout(HUNG, sender.send_request(status)).await??;
            assert_eq!(resp.status(), 200, "status {i}");
            resp.into_body().collect().await?;
            let query = Request::post("/query")
                .header(HOST, addr.to_string())
                .body(Full::new(Bytes::from(format!("k{i}"))))?;
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
        let resp = tokio::time::timeout(HUNG, sender.send_request(rebound)).await??;
        assert_eq!(resp.status(), 403);
        resp.into_body().collect().await?;
        tokio::time::timeout(HUNG, driver).await???;
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
