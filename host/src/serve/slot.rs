//! A connection's slot: its place in the eviction queue ([`HeadPhase`]), the requests it has in
//! service and the answers it is writing, each with its deadline and its share of the answer
//! budget; the watchdog that cuts the connection when one passes; the socket wrapper that tells
//! the slot when hyper's writes are flushed; the response body; and the body reader.
//!
//! One model serves both protocols. An HTTP/1.1 connection has at most one request in service at
//! a time, an HTTP/2 one up to its concurrent-stream limit; either way:
//! - a request is **in service** from its head to its answer written: its head has arrived, so
//!   the connection is not idle; with none in service for [`HEAD_DEADLINE`] the connection is
//!   closed (the wait for a first head, between two requests, and a header block that never
//!   ends);
//! - a request is **held** (out of the eviction queue) once it is whole or admitted with a
//!   token; the connection rejoins the queue when its last held request is answered;
//! - an answer is **written** once hyper has taken its last byte and, over HTTP/1.1, the next
//!   flush of the socket completed (over HTTP/2 the streams' writes interleave, so taking the
//!   last chunk ends it: h2 keeps at most [`super::conn::H2_CHUNK`] twice of it, for at most
//!   [`HEAD_DEADLINE`] once nothing else is in service); an answer not written by its deadline
//!   cuts the connection, and its budget comes back.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use http_body_util::BodyExt as _;
use hyper::body::{Body, Bytes, Frame, SizeHint};
use hyper::header::{CONNECTION, CONTENT_TYPE, HeaderValue};
use hyper::{Response, StatusCode};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, OwnedSemaphorePermit};
use tokio::time::Instant;

use super::admission::{HeadPhase, body_fits};
use super::{HEAD_DEADLINE, Reply};

/// One connection's place in the eviction queue, its requests in service and the answers it
/// writes.
pub(super) struct Slot {
    heads: Arc<Mutex<HeadPhase>>,
    ticket: u64,
    /// Notified when the connection is evicted.
    pub(super) told: Arc<Notify>,
    /// The connection ended: nothing rejoins the queue, no answer is kept.
    closed: AtomicBool,
    state: Mutex<SlotState>,
    /// Wakes the watchdog when the state changed.
    changed: Notify,
    /// Wakes everything waiting for the connection's end (an HTTP/2 connection's stream tasks).
    ended: Notify,
}

/// What a slot's watchdog reads.
struct SlotState {
    /// Requests held out of the eviction queue and not yet answered.
    held: usize,
    /// Requests in service.
    open: usize,
    /// Since when none is (`None` while some is).
    idle_since: Option<Instant>,
    /// Answers being written.
    writing: Vec<Writing>,
    next_id: u64,
}

/// An answer being written: its deadline, the budget it holds, and whether hyper has taken its
/// last byte (then the next completed flush ends it).
struct Writing {
    id: u64,
    by: Instant,
    _budget: Option<OwnedSemaphorePermit>,
    held: bool,
    taken: bool,
}

impl Slot {
    /// The slot of a connection entered into `heads` as `ticket` (told to close by `told`).
    pub(super) fn new(heads: Arc<Mutex<HeadPhase>>, ticket: u64, told: Arc<Notify>) -> Self {
        Slot {
            heads,
            ticket,
            told,
            closed: AtomicBool::new(false),
            state: Mutex::new(SlotState {
                held: 0,
                open: 0,
                idle_since: Some(Instant::now()),
                writing: Vec::new(),
                next_id: 0,
            }),
            changed: Notify::new(),
            ended: Notify::new(),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut SlotState) -> T) -> Option<T> {
        let out = self.state.lock().ok().map(|mut s| f(&mut s));
        self.changed.notify_one();
        out
    }

    /// A request is done with: out of service, and if it was held and the last one, the
    /// connection waits for its next request and is evictable again, at the back of the queue.
    fn finish(&self, s: &mut SlotState, held: bool) {
        s.open = s.open.saturating_sub(1);
        if s.open == 0 {
            s.idle_since = Some(Instant::now());
        }
        if held {
            s.held = s.held.saturating_sub(1);
            if s.held == 0
                && !self.closed.load(Ordering::Acquire)
                && let Ok(mut h) = self.heads.lock()
            {
                h.rejoin(self.ticket, self.told.clone());
            }
        }
    }

    /// The connection ended (idempotent): out of the queue for good, every answer's budget back,
    /// its stream tasks told.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        if let Ok(mut h) = self.heads.lock() {
            h.leave(self.ticket);
        }
        self.with(|s| s.writing.clear());
        self.ended.notify_waiters();
    }

    /// Resolves once the connection ended ([`Slot::close`]).
    pub(super) async fn ended(&self) {
        let ended = self.ended.notified();
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        ended.await;
    }

    /// Everything hyper buffered has been written: the answers whose last byte hyper had taken
    /// are written.
    fn flushed(&self) {
        if let Ok(mut s) = self.state.lock() {
            if !s.writing.iter().any(|w| w.taken) {
                return;
            }
            let done: Vec<bool> = s
                .writing
                .iter()
                .filter(|w| w.taken)
                .map(|w| w.held)
                .collect();
            s.writing.retain(|w| !w.taken);
            for held in done {
                self.finish(&mut s, held);
            }
        }
        self.changed.notify_one();
    }

    /// Resolves with why the connection must be cut: an answer not written by its deadline, or
    /// no request in service for [`HEAD_DEADLINE`].
    pub(super) async fn watchdog(&self) -> &'static str {
        loop {
            let next = self.state.lock().ok().and_then(|s| {
                let answer = s.writing.iter().map(|w| w.by).min();
                let idle = s.idle_since.map(|t| t + HEAD_DEADLINE);
                match (answer, idle) {
                    (Some(a), Some(i)) if i < a => Some((i, "no request within the head deadline")),
                    (Some(a), _) => Some((a, "an answer not written by its deadline")),
                    (None, Some(i)) => Some((i, "no request within the head deadline")),
                    (None, None) => None,
                }
            });
            match next {
                Some((at, why)) if at <= Instant::now() => return why,
                Some((at, _)) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(at) => {}
                        () = self.changed.notified() => {}
                    }
                }
                None => self.changed.notified().await,
            }
        }
    }
}

/// One request of a connection, in service from its head until its answer is written (or, when
/// it ends without one, until dropped).
pub(super) struct InService {
    slot: Arc<Slot>,
    held: bool,
    /// Handed on to the answer ([`InService::answering`]): dropping this no longer finishes it.
    handed: bool,
}

impl InService {
    /// A request's head arrived on `slot`'s connection.
    pub(super) fn begin(slot: &Arc<Slot>) -> Self {
        slot.with(|s| {
            s.open += 1;
            s.idle_since = None;
        });
        InService {
            slot: slot.clone(),
            held: false,
            handed: false,
        }
    }

    /// The request is whole, or admitted with a token: the connection is no longer evictable
    /// until its answer is written (idempotent).
    pub(super) fn hold(&mut self) {
        if self.held {
            return;
        }
        self.held = true;
        let slot = &self.slot;
        slot.with(|s| {
            s.held += 1;
            if s.held == 1
                && let Ok(mut h) = slot.heads.lock()
            {
                h.leave(slot.ticket);
            }
        });
    }

    /// The answer starts: written by `by`, holding `budget` until then. Over HTTP/1.1
    /// (`flush_ends`) it is written at the flush after hyper took its last byte, over HTTP/2
    /// once hyper took it.
    pub(super) fn answering(
        mut self,
        by: Instant,
        budget: Option<OwnedSemaphorePermit>,
        flush_ends: bool,
    ) -> Answered {
        self.handed = true;
        let held = self.held;
        let slot = self.slot.clone();
        let id = slot
            .with(|s| {
                let id = s.next_id;
                s.next_id += 1;
                if !slot.closed.load(Ordering::Acquire) {
                    s.writing.push(Writing {
                        id,
                        by,
                        _budget: budget,
                        held,
                        taken: false,
                    });
                }
                id
            })
            .unwrap_or(u64::MAX);
        Answered {
            slot,
            id,
            flush_ends,
        }
    }
}

impl Drop for InService {
    fn drop(&mut self) {
        if !self.handed {
            let held = self.held;
            let slot = &self.slot;
            slot.with(|s| slot.finish(s, held));
        }
    }
}

/// Dropped when hyper has taken an answer's whole body.
pub(super) struct Answered {
    slot: Arc<Slot>,
    id: u64,
    flush_ends: bool,
}

impl Drop for Answered {
    fn drop(&mut self) {
        let (slot, id) = (&self.slot, self.id);
        slot.with(|s| {
            let Some(i) = s.writing.iter().position(|w| w.id == id) else {
                return;
            };
            if self.flush_ends {
                s.writing[i].taken = true;
            } else {
                let w = s.writing.swap_remove(i);
                slot.finish(s, w.held);
            }
        });
    }
}

/// The hyper response for `reply`, its answer ended by `done` once hyper has taken its body,
/// handed to hyper in chunks of at most `chunk` bytes. `Connection: close` goes with a refusal
/// over HTTP/1.1 only (`close_header`): an HTTP/2 stream ends on its own.
pub(super) fn into_response(
    reply: Reply,
    done: Answered,
    chunk: usize,
    close_header: bool,
) -> Response<Answer> {
    let mut resp = Response::new(Answer {
        rest: Bytes::from(reply.body),
        chunk: chunk.max(1),
        _done: done,
    });
    *resp.status_mut() =
        StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(reply.content_type));
    for (name, value) in reply.headers {
        resp.headers_mut().insert(name.clone(), value.clone());
    }
    if reply.close && close_header {
        resp.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// A response body: the bytes not yet taken, in chunks, and what marks the answer handed over.
pub(crate) struct Answer {
    rest: Bytes,
    chunk: usize,
    _done: Answered,
}

impl Body for Answer {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if this.rest.is_empty() {
            return Poll::Ready(None);
        }
        let n = this.chunk.min(this.rest.len());
        Poll::Ready(Some(Ok(Frame::data(this.rest.split_to(n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.rest.len() as u64)
    }
}

/// The socket as hyper sees it: the bytes read while the protocol was told first (replayed
/// before the socket's own), and every completed flush reported to the slot.
pub(super) struct Flushes {
    pub(super) sock: TcpStream,
    pub(super) prefix: Bytes,
    pub(super) slot: Arc<Slot>,
}

impl AsyncRead for Flushes {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if !this.prefix.is_empty() {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.sock).poll_read(cx, buf)
    }
}

impl AsyncWrite for Flushes {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().sock).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().sock).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.sock.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.sock).poll_flush(cx);
        if let Poll::Ready(Ok(())) = r {
            this.slot.flushed();
        }
        r
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().sock).poll_shutdown(cx)
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
