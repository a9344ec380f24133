//! The lean delivery connection: a watch's consumer delivered over a socket of its own, read by
//! the pure parser in `wire.rs`, instead of through the client library's subscription machinery.
//!
//! Why: measured on this project's two-core machine (`docs/performance.md` §4), the
//! async-nats client spends 0.74–0.94 µs of CPU per delivered message (its reader task, a
//! `Message` per message with its own allocations, a channel send and a task wake-up per message,
//! the ordered consumer's bookkeeping) while nats-server spends about 1.4 µs producing it; on a
//! machine where the two share the cores, the client's share is taken from the server that feeds
//! it. Parsing a whole read at once and slicing one frozen buffer costs 0.12–0.18 µs per message.
//!
//! Invariants:
//! - **The same consumer, delivered elsewhere**: the consumer is created with exactly the
//!   configuration of the client's ordered consumer (`OrderedConfig`: no acks, flow control,
//!   5 s idle heartbeats, in memory, one replica); only its deliver subject is subscribed on this
//!   socket, and the subscription is confirmed (`PING`/`PONG`) before the consumer exists, so no
//!   delivery precedes it.
//! - **Nothing is skipped silently**: every delivery's consumer sequence must follow the last
//!   (the first is 1), and a heartbeat's `Nats-Last-Consumer` must not be ahead of it. A gap, an
//!   error status, a protocol error, the socket's end, or three heartbeat periods of silence while
//!   waiting on the socket end the watch with an error; the fold resumes from its applied cursor
//!   (unlike the client's ordered consumer, this one is never re-created behind the fold's back).
//! - **What a writer stored is never a protocol error**: a delivery with a `$JS.ACK` reply is a
//!   stored message, handed over with [`protocol::decode_stored`]'s verdict over its header block
//!   as stored (an undecodable one is skipped by the fold, its revision passed); only the
//!   server's own notices are read by `wire::parse_headers`.
//! - **Backpressure, not buffering**: the socket is read only when the channel to the watch has
//!   room, so a slow fold leaves flow-control requests unread and the server stops sending; a read
//!   is bounded by [`READ_BUFFER`], a message by the larger of the server's `max_payload` and
//!   [`wire::MAX_MESSAGE`] (a stored message may predate a lowered `max_payload`; the client
//!   library takes it, so this connection does too).
//! - **Wherever the client connects, as the client does**: plain or TLS (a `tls://` URL, a
//!   server whose `INFO` requires it, or any TLS option, which requires it everywhere), trusting
//!   and presenting exactly what the client's connection does (`tls.rs`: the `--tls-ca` roots or
//!   the system's, the client certificate), the handshake before `INFO` when the options say
//!   `first`; authenticated as the client is: the URL's credentials, a user and password, an
//!   nkey user or a `.creds` user (either seed signs the server's nonce). Only a websocket URL
//!   (no lean dial is made; one log line says why), or a `CONNECT` the server refuses, keeps the
//!   client's ordered consumer (`Dial::Unsupported` turns this connection off for the handle); a
//!   socket that cannot be opened falls back for that one watch.
//! - **Listings too**: a listing's consumer (`LastPerSubject`, no acks) is delivered the same way,
//!   so no stored header block reaches the client library on a listing either.

use std::time::Duration;

use base64::Engine as _;
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::mpsc;

use super::wire::{self, ServerOp, WireAuth};
use foldhost_core::bucket::{ConnectOptions, CredentialSource, Secret, credential_source};
use foldhost_core::kv::KvError;
use foldhost_core::protocol;

/// Initial capacity of the read buffer; one read takes at most what it has free.
pub(crate) const READ_BUFFER: usize = 256 * 1024;
/// Messages per chunk handed to the watch.
pub(crate) const CHUNK: usize = 512;
/// Heartbeat periods of silence, while waiting on the socket, before the watch ends.
pub(crate) const MISSED_HEARTBEATS: u32 = 3;
/// Chunks in flight between the socket's reader and the watch.
const CHANNEL_CHUNKS: usize = 4;
/// The subscription id of the deliver subject on this socket.
const SID: &[u8] = b"1";

/// The environment variable that turns lean delivery off (`off`, `0` or `false`): every watch is
/// then delivered through the client's ordered consumer (an operator's escape hatch, and how tests
/// reach that path in a node).
pub const LEAN_DELIVERY_ENV: &str = "FOLDHOST_LEAN_DELIVERY";

/// Whether the value of [`LEAN_DELIVERY_ENV`] allows lean delivery (unset: yes).
pub fn lean_allowed(value: Option<&str>) -> bool {
    !matches!(
        value.map(|v| v.trim().to_ascii_lowercase()).as_deref(),
        Some("off" | "0" | "false" | "no")
    )
}

/// What one delivery of a watch's consumer is.
// Nearly every delivery is a message: boxing it would cost an allocation per message.
#[allow(clippy::large_enum_variant)]
pub(super) enum Delivered {
    /// A stored message, with what its ACK subject says when the delivery path already parsed
    /// it (the lean reader does, to check the consumer sequence; the watch then does not again),
    /// and what it means when the delivery path decoded its header block itself
    /// ([`protocol::decode_stored`]; the lean reader does, from the bytes as stored).
    Message(
        async_nats::Message,
        Option<protocol::AckMeta>,
        Option<Result<protocol::KvOp, protocol::Undecodable>>,
        Option<protocol::OpId>,
    ),
    /// The client's ordered consumer reported an error and is re-creating itself.
    Recreating(String),
}

/// Where a lean connection dials and how it authenticates; built from the node's options.
#[derive(Clone)]
pub(super) struct LeanDial {
    servers: Vec<wire::ServerAddress>,
    auth: DialAuth,
    /// The TLS client configuration (`tls::client_config`: the client's own), built when a URL
    /// or the options ask for TLS or at the first server whose `INFO` requires it.
    tls: std::sync::Arc<std::sync::OnceLock<Result<std::sync::Arc<rustls::ClientConfig>, String>>>,
    /// The TLS options it is built from.
    tls_options: foldhost_core::bucket::TlsOptions,
    name: Option<String>,
    timeout: Duration,
    /// The consumers' idle heartbeat ([`ConnectOptions::watch_heartbeat`]).
    pub(super) heartbeat: Duration,
}

impl std::fmt::Debug for LeanDial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeanDial")
            .field("servers", &self.servers)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// How a lean connection authenticates: what the `CONNECT` line carries as it is, a `.creds`
/// user whose nkey signs the server's nonce, or an nkey user whose seed does.
#[derive(Clone)]
enum DialAuth {
    Wire(WireAuth),
    Creds { jwt: String, seed: String },
    Nkey(Secret),
}

impl LeanDial {
    /// Why not, when the options need what this connection does not speak (a websocket URL), or
    /// name credentials it cannot read (the client library then fails on them too, naming them).
    pub(super) fn from_options(opts: &ConnectOptions) -> Result<LeanDial, String> {
        let creds = |text: &str| {
            wire::parse_creds(text)
                .map(|(jwt, seed)| DialAuth::Creds { jwt, seed })
                .ok_or_else(|| "the credentials are not a .creds text".to_string())
        };
        let auth = match credential_source(opts) {
            CredentialSource::Creds => creds(opts.creds.as_deref().unwrap_or_default())?,
            CredentialSource::CredsFile(p) => {
                let mut text = String::new();
                let unreadable = |e: std::io::Error| format!("{}: {e}", p.display());
                std::io::Read::read_to_string(
                    &mut std::io::Read::take(
                        std::fs::File::open(&p).map_err(unreadable)?,
                        wire::MAX_CREDS as u64,
                    ),
                    &mut text,
                )
                .map_err(unreadable)?;
                creds(&text)?
            }
            CredentialSource::Nkey => {
                DialAuth::Nkey(opts.nkey_seed.clone().unwrap_or_else(|| Secret::new("")))
            }
            CredentialSource::UserPassword => DialAuth::Wire(match &opts.user_password {
                Some((user, pass)) => WireAuth::UserPass(user.clone(), pass.expose().to_string()),
                None => WireAuth::None,
            }),
            CredentialSource::Url => {
                DialAuth::Wire(match foldhost_core::bucket::url_credentials(&opts.url) {
                    Some((user, Some(pass))) => WireAuth::UserPass(user, pass),
                    Some((token, None)) => WireAuth::Token(token),
                    None => WireAuth::None,
                })
            }
            CredentialSource::None => DialAuth::Wire(WireAuth::None),
        };
        let servers = foldhost_core::bucket::server_urls(&opts.url)
            .into_iter()
            .map(wire::server_address)
            .collect::<Option<Vec<_>>>()
            .ok_or("a URL that is not nats:// or tls:// (a websocket)")?;
        if servers.is_empty() {
            return Err("no server URL".into());
        }
        Ok(LeanDial {
            servers,
            auth,
            tls: std::sync::Arc::default(),
            tls_options: opts.tls.clone(),
            name: opts.name.clone(),
            timeout: opts.op_timeout.min(Duration::from_secs(10)),
            heartbeat: opts.watch_heartbeat,
        })
    }

    /// The TLS configuration, built once: the client connection's own (`tls::client_config`).
    fn tls_config(&self) -> Result<std::sync::Arc<rustls::ClientConfig>, String> {
        self.tls
            .get_or_init(|| crate::tls::client_config(&self.tls_options))
            .clone()
    }

    /// What the `CONNECT` line carries for a server whose `INFO` sent `nonce`.
    fn wire_auth(&self, nonce: Option<&str>) -> Result<WireAuth, DialError> {
        match &self.auth {
            DialAuth::Wire(w) => Ok(w.clone()),
            DialAuth::Creds { jwt, seed } => {
                let nonce = nonce.ok_or_else(|| {
                    DialError::Unsupported("the server sent no nonce for the credentials".into())
                })?;
                let key = nkeys::KeyPair::from_seed(seed)
                    .map_err(|e| DialError::Unsupported(format!("credentials: {e}")))?;
                let sig = key
                    .sign(nonce.as_bytes())
                    .map_err(|e| DialError::Unsupported(format!("credentials: {e}")))?;
                Ok(WireAuth::Jwt {
                    jwt: jwt.clone(),
                    sig: base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(sig),
                })
            }
            DialAuth::Nkey(seed) => {
                let nonce = nonce.ok_or_else(|| {
                    DialError::Unsupported("the server sent no nonce for the nkey".into())
                })?;
                let key = crate::connection::user_nkey(seed.expose())
                    .map_err(|e| DialError::Unsupported(e.into()))?;
                let sig = key
                    .sign(nonce.as_bytes())
                    .map_err(|e| DialError::Unsupported(format!("nkey: {e}")))?;
                Ok(WireAuth::Nkey {
                    public: key.public_key(),
                    sig: base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(sig),
                })
            }
        }
    }

    fn has_auth(&self) -> bool {
        !matches!(self.auth, DialAuth::Wire(WireAuth::None))
    }
}

/// Why no lean connection was made.
#[derive(Debug, thiserror::Error)]
pub(super) enum DialError {
    /// The server or the options need what this connection does not do: never try again.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// This attempt failed (no socket, a timeout): the next watch may try again.
    #[error("{0}")]
    Transient(String),
}

/// The socket's read side: a TCP half, or a TLS stream's.
type ReadSide = Box<dyn tokio::io::AsyncRead + Unpin + Send>;
/// The socket's write side.
type WriteSide = Box<dyn tokio::io::AsyncWrite + Unpin + Send>;

/// A connected, subscribed socket, not yet reading deliveries.
pub(super) struct Conn {
    rd: ReadSide,
    wr: WriteSide,
    buf: BytesMut,
    max_payload: usize,
    /// The consumer's idle heartbeat: three periods of silence end the delivery.
    heartbeat: Duration,
}

/// Opens a socket to the first server that answers, authenticates, subscribes `inbox` and waits
/// for the server to confirm it.
pub(super) async fn dial(d: &LeanDial, inbox: &str) -> Result<Conn, DialError> {
    match tokio::time::timeout(d.timeout, dial_inner(d, inbox)).await {
        Ok(r) => r,
        Err(_) => Err(DialError::Transient(format!(
            "no answer within {} ms",
            d.timeout.as_millis()
        ))),
    }
}

/// Reads the server's `INFO` (it speaks first: in the clear, or after the handshake when TLS
/// comes first), with what came after it.
async fn read_info(
    sock: &mut (impl tokio::io::AsyncRead + Unpin),
) -> Result<(serde_json::Value, BytesMut), DialError> {
    let transient = |e: std::io::Error| DialError::Transient(e.to_string());
    let mut buf = BytesMut::with_capacity(4096);
    loop {
        match wire::parse_op(&buf, usize::MAX).map_err(|e| DialError::Transient(e.to_string()))? {
            Some((ServerOp::Info(r), n)) => {
                let json: serde_json::Value = serde_json::from_slice(&buf[r])
                    .map_err(|e| DialError::Transient(format!("INFO: {e}")))?;
                let _ = buf.split_to(n);
                return Ok((json, buf));
            }
            Some((op, _)) => {
                return Err(DialError::Transient(format!("expected INFO, got {op:?}")));
            }
            None => {
                // `parse_op` refuses a line past the limit itself; this bound only keeps a
                // reader that never ends from growing the buffer, and it must admit the longest
                // line whose CRLF has not all arrived (the line, then its CR).
                if buf.len() > wire::MAX_CONTROL_LINE + 1 {
                    return Err(DialError::Transient("an INFO line without an end".into()));
                }
                if sock.read_buf(&mut buf).await.map_err(transient)? == 0 {
                    return Err(DialError::Transient("closed before INFO".into()));
                }
            }
        }
    }
}

/// The TLS handshake over `sock` (after the server's `INFO`, as the client library does, or
/// before it with `first`), the server's certificate checked against the client's roots
/// (`tls.rs`) for the host the URL names.
async fn upgrade(
    d: &LeanDial,
    server: &wire::ServerAddress,
    sock: tokio::net::TcpStream,
) -> Result<(ReadSide, WriteSide), DialError> {
    let config = d.tls_config().map_err(DialError::Unsupported)?;
    let name = rustls::pki_types::ServerName::try_from(server.host.clone())
        .map_err(|e| DialError::Unsupported(format!("TLS server name {}: {e}", server.host)))?;
    let stream = tokio_rustls::TlsConnector::from(config)
        .connect(name, sock)
        .await
        .map_err(|e| DialError::Transient(format!("TLS: {e}")))?;
    let (rd, wr) = tokio::io::split(stream);
    Ok((Box::new(rd), Box::new(wr)))
}

/// The socket to the first server that answers, TLS where the URL, the options or the server's
/// `INFO` ask (before the `INFO` with `first`): its two sides, the `INFO`, what came after it,
/// and whether it is TLS.
async fn open_socket(
    d: &LeanDial,
) -> Result<(ReadSide, WriteSide, serde_json::Value, BytesMut, bool), DialError> {
    let mut last = String::from("no server");
    let mut found = None;
    for server in &d.servers {
        match tokio::net::TcpStream::connect(&server.host_port).await {
            Ok(s) => {
                found = Some((s, server));
                break;
            }
            Err(e) => last = format!("{}: {e}", server.host_port),
        }
    }
    let (mut sock, server) = found.ok_or(DialError::Transient(last))?;
    let _ = sock.set_nodelay(true);
    if d.tls_options.first {
        let (mut rd, wr) = upgrade(d, server, sock).await?;
        let (info, buf) = read_info(&mut rd).await?;
        return Ok((rd, wr, info, buf, true));
    }
    let (info, buf) = read_info(&mut sock).await?;
    let tls = server.tls || d.tls_options.any() || info["tls_required"].as_bool() == Some(true);
    let (rd, wr) = if tls {
        if !buf.is_empty() {
            return Err(DialError::Transient("bytes after INFO before TLS".into()));
        }
        upgrade(d, server, sock).await?
    } else {
        let (rd, wr) = sock.into_split();
        (Box::new(rd) as ReadSide, Box::new(wr) as WriteSide)
    };
    Ok((rd, wr, info, buf, tls))
}

async fn dial_inner(d: &LeanDial, inbox: &str) -> Result<Conn, DialError> {
    let transient = |e: std::io::Error| DialError::Transient(e.to_string());
    let (rd, wr, info, buf, tls) = open_socket(d).await?;
    if info["auth_required"].as_bool() == Some(true) && !d.has_auth() {
        return Err(DialError::Unsupported(
            "the server requires credentials the options do not name".into(),
        ));
    }
    let mut conn = Conn {
        rd,
        wr,
        buf,
        max_payload: wire::MAX_CONTROL_LINE,
        heartbeat: d.heartbeat,
    };
    if conn.buf.capacity() < READ_BUFFER {
        conn.buf.reserve(READ_BUFFER - conn.buf.len());
    }
    conn.max_payload = info["max_payload"]
        .as_u64()
        .and_then(|v| usize::try_from(v).ok())
        .unwrap_or(1 << 20)
        .max(wire::MAX_MESSAGE);
    let auth = d.wire_auth(info["nonce"].as_str())?;
    let hello = format!(
        "{}SUB {inbox} {}\r\nPING\r\n",
        wire::connect_line(&auth, d.name.as_deref(), tls),
        String::from_utf8_lossy(SID)
    );
    conn.wr
        .write_all(hello.as_bytes())
        .await
        .map_err(transient)?;
    conn.wr.flush().await.map_err(transient)?;
    loop {
        match wire::parse_op(&conn.buf, conn.max_payload)
            .map_err(|e| DialError::Transient(e.to_string()))?
        {
            Some((ServerOp::Pong, n)) => {
                let _ = conn.buf.split_to(n);
                return Ok(conn);
            }
            Some((ServerOp::Err(text), _)) => return Err(DialError::Unsupported(text)),
            Some((_, n)) => {
                let _ = conn.buf.split_to(n);
            }
            None => {
                if conn.rd.read_buf(&mut conn.buf).await.map_err(transient)? == 0 {
                    return Err(DialError::Transient("closed before PONG".into()));
                }
            }
        }
    }
}

/// The deliveries of one consumer over a lean connection; dropping it closes the socket.
pub(super) struct LeanDeliveries {
    rx: mpsc::Receiver<Result<Vec<Delivered>, KvError>>,
    task: tokio::task::JoinHandle<()>,
}

impl LeanDeliveries {
    /// Starts reading `conn` for `bucket`'s watch.
    pub(super) fn start(conn: Conn, bucket: String) -> Self {
        let (tx, rx) = mpsc::channel(CHANNEL_CHUNKS);
        let task = tokio::spawn(async move {
            let mut r = Reader {
                conn,
                bucket,
                last_consumer_sequence: 0,
            };
            if let Err(e) = r.run(&tx).await {
                let _ = tx.send(Err(e)).await;
            }
        });
        LeanDeliveries { rx, task }
    }

    /// The next chunk (cancel-safe); `None` once the reader has ended.
    pub(super) async fn next(&mut self) -> Option<Result<Vec<Delivered>, KvError>> {
        self.rx.recv().await
    }
}

impl Drop for LeanDeliveries {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Reader {
    conn: Conn,
    bucket: String,
    last_consumer_sequence: u64,
}

impl Reader {
    fn fail(&self, why: impl std::fmt::Display) -> KvError {
        KvError::WatchError(format!(
            "bucket {}: delivery connection: {why}",
            self.bucket
        ))
    }

    /// Reads, parses and forwards until the watch goes (`Ok`) or the delivery fails.
    async fn run(
        &mut self,
        tx: &mpsc::Sender<Result<Vec<Delivered>, KvError>>,
    ) -> Result<(), KvError> {
        let silence = self.conn.heartbeat * MISSED_HEARTBEATS;
        loop {
            // What came before a failure is handed over first (the fold commits it), then the
            // watch ends.
            let (chunk, replies, failed) = self.parse_ready();
            if !replies.is_empty() {
                self.conn
                    .wr
                    .write_all(&replies)
                    .await
                    .map_err(|e| self.fail(e))?;
                // A TLS stream holds what it was given until flushed.
                self.conn.wr.flush().await.map_err(|e| self.fail(e))?;
            }
            let chunk_was_empty = chunk.is_empty();
            if !chunk_was_empty {
                for part in chunk_up(chunk) {
                    // Waiting here (the fold is busy) leaves the socket unread: backpressure.
                    if tx.send(Ok(part)).await.is_err() {
                        return Ok(());
                    }
                }
            }
            if let Some(e) = failed {
                return Err(e);
            }
            if !chunk_was_empty {
                continue;
            }
            if self.conn.buf.capacity() - self.conn.buf.len() < READ_BUFFER / 4 {
                self.conn.buf.reserve(READ_BUFFER);
            }
            let read = tokio::time::timeout(silence, self.conn.rd.read_buf(&mut self.conn.buf));
            match read.await {
                Ok(Ok(0)) => return Err(self.fail("the server closed the socket")),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(self.fail(e)),
                Err(_) => {
                    return Err(self.fail(format!(
                        "no delivery or heartbeat for {} s",
                        silence.as_secs()
                    )));
                }
            }
        }
    }

    /// Parses every whole operation in the buffer: the messages, and what to write back
    /// (flow-control answers, `PONG`s, a stalled consumer's nudge).
    #[allow(clippy::type_complexity)]
    fn parse_ready(&mut self) -> (Vec<Delivered>, Vec<u8>, Option<KvError>) {
        let mut ops = Vec::new();
        let mut at = 0;
        // A protocol error after whole operations does not discard them: they are handed over
        // (and committed) first, then the watch ends with the error.
        let mut unparsable = None;
        loop {
            match wire::parse_op(&self.conn.buf[at..], self.conn.max_payload) {
                Ok(Some((op, n))) => {
                    ops.push((op, at));
                    at += n;
                }
                Ok(None) => break,
                Err(e) => {
                    unparsable = Some(self.fail(e));
                    break;
                }
            }
        }
        let frozen: Bytes = self.conn.buf.split_to(at).freeze();
        let mut out = Vec::with_capacity(ops.len());
        let mut replies = Vec::new();
        let mut failed = None;
        for (op, base) in ops {
            if let Err(e) = self.take_op(&frozen, op, base, &mut out, &mut replies) {
                failed = Some(e);
                break;
            }
        }
        (out, replies, failed.or(unparsable))
    }

    /// One parsed operation: a message into `out`, an answer into `replies`.
    fn take_op(
        &mut self,
        frozen: &Bytes,
        op: ServerOp,
        base: usize,
        out: &mut Vec<Delivered>,
        replies: &mut Vec<u8>,
    ) -> Result<(), KvError> {
        match op {
            ServerOp::Msg {
                subject,
                sid,
                reply,
                headers,
                payload,
            } => {
                let shift = |r: std::ops::Range<usize>| r.start + base..r.end + base;
                if frozen[shift(sid)] != *SID {
                    return Ok(());
                }
                let reply = reply.map(|r| frozen.slice(shift(r)));
                let raw_block = headers.map(|h| &frozen[shift(h)]);
                // Only a stored message has a JetStream ACK reply. What a writer put in its
                // header block is the writer's: it never makes a server notice (the next delivery
                // would then be a gap, every time), and a block the fold cannot read is decoded
                // as undecodable — a skip — never a protocol error (which stalled the fold at it
                // for good).
                let stored = reply.as_ref().is_some_and(|r| r.starts_with(b"$JS.ACK."));
                if !stored {
                    // A server notice (flow control, heartbeat, error).
                    let block = raw_block
                        .map(wire::parse_headers)
                        .transpose()
                        .map_err(|e| self.fail(e))?;
                    if let Some(status) = block.as_ref().and_then(|b| b.status) {
                        return self.on_status(status, block.as_ref(), reply.as_ref(), replies);
                    }
                }
                let (verdict, op_id) = match protocol::decode_stored_record(raw_block) {
                    Ok((op, id)) => (Ok(op), id),
                    Err(e) => (Err(e), None),
                };
                let size = raw_block.and_then(wire::stored_msg_size);
                let (msg, meta) = self.message(
                    frozen,
                    shift(subject),
                    reply,
                    frozen.slice(shift(payload)),
                    size,
                )?;
                out.push(Delivered::Message(msg, Some(meta), Some(verdict), op_id));
            }
            ServerOp::Ping => replies.extend_from_slice(b"PONG\r\n"),
            ServerOp::Err(text) => return Err(self.fail(format!("the server said: {text}"))),
            ServerOp::Pong | ServerOp::Ok | ServerOp::Info(_) => {}
        }
        Ok(())
    }

    /// A status message: flow control (answered), a heartbeat (checked), anything else fails.
    fn on_status(
        &self,
        status: u16,
        block: Option<&wire::HeaderBlock<'_>>,
        reply: Option<&Bytes>,
        replies: &mut Vec<u8>,
    ) -> Result<(), KvError> {
        if status != 100 {
            let desc = block.and_then(|b| b.description).unwrap_or("");
            return Err(self.fail(format!("status {status} {desc}")));
        }
        if let Some(r) = reply {
            // A flow-control request: answer on its subject.
            publish_empty(replies, r);
            return Ok(());
        }
        // An idle heartbeat: it names the last consumer sequence the server sent.
        if let Some(last) = block
            .and_then(|b| b.get("Nats-Last-Consumer"))
            .and_then(|v| v.parse::<u64>().ok())
            && last > self.last_consumer_sequence
        {
            return Err(self.fail(format!(
                "a heartbeat names delivery {last}, the last received is {}",
                self.last_consumer_sequence
            )));
        }
        if let Some(stalled) = block.and_then(|b| b.get("Nats-Consumer-Stalled")) {
            publish_empty(replies, stalled.as_bytes());
        }
        Ok(())
    }

    /// One stored message, its consumer sequence checked against the last.
    fn message(
        &mut self,
        frozen: &Bytes,
        subject: std::ops::Range<usize>,
        reply: Option<Bytes>,
        payload: Bytes,
        size: Option<u64>,
    ) -> Result<(async_nats::Message, protocol::AckMeta), KvError> {
        let reply = reply
            .map(async_nats::Subject::from_utf8)
            .transpose()
            .map_err(|_| self.fail("a reply subject that is not UTF-8"))?;
        let meta = reply
            .as_ref()
            .and_then(|r| protocol::parse_ack_subject(r.as_str()))
            .ok_or_else(|| self.fail("a delivery without a JetStream reply subject"))?;
        let cseq = meta.consumer_sequence;
        if cseq != self.last_consumer_sequence + 1 {
            return Err(self.fail(format!(
                "delivery {cseq} after {}: a gap",
                self.last_consumer_sequence
            )));
        }
        self.last_consumer_sequence = cseq;
        let subject = async_nats::Subject::from_utf8(frozen.slice(subject))
            .map_err(|_| self.fail("a subject that is not UTF-8"))?;
        // The header block is decoded from its bytes ([`protocol::decode_stored`]), not read
        // again from a header map; only a headers-only delivery's size is carried in one.
        let headers = size.map(|n| {
            let mut h = async_nats::HeaderMap::new();
            h.insert(wire::NATS_MSG_SIZE, n.to_string().as_str());
            h
        });
        let length = payload.len();
        Ok((
            async_nats::Message {
                subject,
                reply,
                payload,
                headers,
                status: None,
                description: None,
                length,
            },
            meta,
        ))
    }
}

fn publish_empty(out: &mut Vec<u8>, subject: &[u8]) {
    out.extend_from_slice(b"PUB ");
    out.extend_from_slice(subject);
    out.extend_from_slice(b" 0\r\n\r\n");
}

/// Splits a read's messages into chunks of at most [`CHUNK`].
fn chunk_up(mut all: Vec<Delivered>) -> Vec<Vec<Delivered>> {
    if all.len() <= CHUNK {
        return vec![all];
    }
    let mut parts = Vec::with_capacity(all.len() / CHUNK + 1);
    while all.len() > CHUNK {
        let rest = all.split_off(CHUNK);
        parts.push(std::mem::replace(&mut all, rest));
    }
    parts.push(all);
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lean_delivery_is_on_unless_the_environment_turns_it_off() {
        assert!(lean_allowed(None));
        assert!(lean_allowed(Some("on")));
        for off in ["off", "0", "false", " OFF ", "no"] {
            assert!(!lean_allowed(Some(off)), "{off}");
        }
    }

    #[test]
    fn every_url_but_a_websocket_and_every_credential_the_options_name_are_dialled_lean() {
        let o = ConnectOptions::new("nats://a:1,tls://b:2");
        let d = LeanDial::from_options(&o).expect("nats and tls URLs");
        assert_eq!(
            d.servers.iter().map(|s| s.tls).collect::<Vec<_>>(),
            [false, true]
        );
        assert!(LeanDial::from_options(&ConnectOptions::new("nats://a:1,ws://b:2")).is_err());
        let o = ConnectOptions::new("nats://u:p@a:1");
        let d = LeanDial::from_options(&o).expect("plain with a password");
        assert!(
            matches!(&d.auth, DialAuth::Wire(WireAuth::UserPass(u, p)) if u == "u" && p == "p")
        );
        // A `.creds` user signs the nonce with its seed; the server checks the signature against
        // the JWT's subject, so the signature must verify with the seed's public key.
        let user = nkeys::KeyPair::new_user();
        let seed = user.seed().expect("a seed");
        let mut o = ConnectOptions::new("nats://a:1");
        o.creds = Some(format!(
            "-----BEGIN NATS USER JWT-----\nj.w.t\n------END NATS USER JWT------\n\n\
             -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
        ));
        let d = LeanDial::from_options(&o).expect("inline creds");
        let WireAuth::Jwt { jwt, sig } = d.wire_auth(Some("nonce-1")).expect("signed") else {
            panic!("a JWT auth");
        };
        assert_eq!(jwt, "j.w.t");
        let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(sig)
            .expect("base64url");
        let public = nkeys::KeyPair::from_public_key(&user.public_key()).expect("public");
        assert!(public.verify(b"nonce-1", &sig).is_ok());
        assert!(d.wire_auth(None).is_err(), "no nonce, no signature");
        // A creds file that is not one names nothing the connection can send.
        o.creds = Some("not creds".into());
        assert!(LeanDial::from_options(&o).is_err());
        let mut o = ConnectOptions::new("nats://a:1");
        o.creds_file = Some("/nonexistent/x.creds".into());
        assert!(LeanDial::from_options(&o).is_err());
    }

    #[test]
    fn an_nkey_user_signs_the_nonce_and_a_user_sends_its_password_on_a_lean_connection() {
        let user = nkeys::KeyPair::new_user();
        let mut o = ConnectOptions::new("nats://a:1");
        o.nkey_seed = Some(Secret::new(user.seed().expect("a seed")));
        let d = LeanDial::from_options(&o).expect("an nkey user");
        let WireAuth::Nkey { public, sig } = d.wire_auth(Some("nonce-2")).expect("signed") else {
            panic!("an nkey auth");
        };
        assert_eq!(public, user.public_key());
        let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(sig)
            .expect("base64url");
        assert!(user.verify(b"nonce-2", &sig).is_ok());
        assert!(d.wire_auth(None).is_err(), "no nonce, no signature");
        // An account seed is not a user's: the server would refuse it; so does the dial.
        o.nkey_seed = Some(Secret::new(
            nkeys::KeyPair::new_account().seed().expect("a seed"),
        ));
        let d = LeanDial::from_options(&o).expect("options");
        assert!(d.wire_auth(Some("n")).is_err());
        let mut o = ConnectOptions::new("nats://u:url-pw@a:1");
        o.user_password = Some(("alice".into(), Secret::new("pw")));
        let d = LeanDial::from_options(&o).expect("a user");
        assert!(
            matches!(&d.auth, DialAuth::Wire(WireAuth::UserPass(u, p)) if u == "alice" && p == "pw"),
            "the user given apart wins over the URL's"
        );
        // Any TLS option requires TLS on a nats:// URL too; the handshake first when asked.
        o.tls.first = true;
        let d = LeanDial::from_options(&o).expect("tls first");
        assert!(d.tls_options.any() && d.tls_options.first);
    }

    /// A reader over a real local socket whose other end the test writes as the server.
    async fn reader_fed(frames: &[u8]) -> Vec<Result<Vec<Delivered>, KvError>> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (mut server, _) = listener.accept().await.expect("accept");
        let (rd, wr) = client.into_split();
        let conn = Conn {
            rd: Box::new(rd),
            wr: Box::new(wr),
            buf: BytesMut::with_capacity(READ_BUFFER),
            max_payload: 1 << 20,
            heartbeat: foldhost_core::bucket::DEFAULT_WATCH_HEARTBEAT,
        };
        let mut lean = LeanDeliveries::start(conn, "b".into());
        server.write_all(frames).await.expect("write");
        server.shutdown().await.expect("shutdown");
        let mut out = Vec::new();
        while let Some(r) = lean.next().await {
            let end = r.is_err();
            out.push(r);
            if end {
                break;
            }
        }
        out
    }

    fn msg(key: &str, cseq: u64) -> String {
        format!(
            "MSG $KV.b.{key} 1 $JS.ACK.KV_b.c.1.{}.{cseq}.1700000000000000000.0 1\r\nv\r\n",
            cseq + 10
        )
    }

    fn keys(out: &[Result<Vec<Delivered>, KvError>]) -> Vec<String> {
        out.iter()
            .filter_map(|r| r.as_ref().ok())
            .flatten()
            .filter_map(|d| match d {
                Delivered::Message(m, _, _, _) => Some(m.subject.to_string()),
                Delivered::Recreating(_) => None,
            })
            .collect()
    }

    /// A reader handing out `parts` one after another, never two in one read (a part larger than
    /// the caller's buffer over several reads): where a socket read ends, placed by the test.
    struct Parts(std::collections::VecDeque<Vec<u8>>);

    impl tokio::io::AsyncRead for Parts {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            if let Some(part) = self.0.front_mut() {
                let n = part.len().min(buf.remaining());
                buf.put_slice(&part[..n]);
                part.drain(..n);
                if part.is_empty() {
                    self.0.pop_front();
                }
            }
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// An INFO line of the longest length the wire allows (`MAX_CONTROL_LINE` bytes before its
    /// CRLF) whose reads end on its CR: the line is whole once the LF comes, not refused before.
    #[tokio::test]
    async fn an_info_line_of_the_longest_length_read_in_two_parts_is_taken() {
        let head = "INFO {\"pad\":\"";
        let tail = "\"}";
        let pad = "x".repeat(wire::MAX_CONTROL_LINE - head.len() - tail.len());
        let line = format!("{head}{pad}{tail}");
        assert_eq!(line.len(), wire::MAX_CONTROL_LINE);
        let mut sock = Parts([format!("{line}\r").into_bytes(), b"\nPING\r\n".to_vec()].into());
        let (info, rest) = read_info(&mut sock).await.expect("the INFO line is taken");
        assert_eq!(info["pad"].as_str().map(str::len), Some(pad.len()));
        assert_eq!(&rest[..], b"PING\r\n");
    }

    #[tokio::test]
    async fn a_delivery_that_skips_a_consumer_sequence_ends_the_watch_and_is_not_handed_over() {
        let frames = format!("{}{}{}", msg("a", 1), msg("b", 2), msg("forged", 5));
        let out = reader_fed(frames.as_bytes()).await;
        assert_eq!(keys(&out), ["$KV.b.a", "$KV.b.b"]);
        match out.last() {
            Some(Err(KvError::WatchError(m))) => assert!(m.contains("delivery 5 after 2"), "{m}"),
            other => panic!(
                "the gap should end the watch: {other:?}",
                other = other.map(|r| r.is_ok())
            ),
        }
    }

    #[tokio::test]
    async fn a_heartbeat_naming_an_unreceived_delivery_ends_the_watch() {
        let hb =
            "NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 3\r\nNats-Last-Stream: 13\r\n\r\n";
        let frames = format!(
            "{}HMSG _INBOX.x 1 {} {}\r\n{hb}\r\n",
            msg("a", 1),
            hb.len(),
            hb.len()
        );
        let out = reader_fed(frames.as_bytes()).await;
        assert_eq!(keys(&out), ["$KV.b.a"]);
        match out.last() {
            Some(Err(KvError::WatchError(m))) => assert!(m.contains("names delivery 3"), "{m}"),
            other => panic!(
                "the heartbeat should end the watch: {other:?}",
                other = other.map(|r| r.is_ok())
            ),
        }
    }

    #[tokio::test]
    async fn a_consumer_error_status_or_the_sockets_end_ends_the_watch() {
        let st = "NATS/1.0 409 Consumer Deleted\r\n\r\n";
        let frames = format!("HMSG _INBOX.x 1 {} {}\r\n{st}\r\n", st.len(), st.len());
        let out = reader_fed(frames.as_bytes()).await;
        match out.last() {
            Some(Err(KvError::WatchError(m))) => assert!(m.contains("status 409"), "{m}"),
            other => panic!("{other:?}", other = other.map(|r| r.is_ok())),
        }
        let out = reader_fed(msg("a", 1).as_bytes()).await;
        assert_eq!(keys(&out), ["$KV.b.a"]);
        match out.last() {
            Some(Err(KvError::WatchError(m))) => assert!(m.contains("closed the socket"), "{m}"),
            other => panic!("{other:?}", other = other.map(|r| r.is_ok())),
        }
    }

    #[tokio::test]
    async fn a_stored_message_whose_header_block_has_a_status_line_is_a_delivery_not_a_notice() {
        let hdr = "NATS/1.0 100 FlowControl Request\r\nX: y\r\n\r\n";
        let stored = format!(
            "HMSG $KV.b.s 1 $JS.ACK.KV_b.c.1.12.2.1700000000000000000.0 {} {}\r\n{hdr}v\r\n",
            hdr.len(),
            hdr.len() + 1
        );
        let frames = format!("{}{stored}{}", msg("a", 1), msg("b", 3));
        let out = reader_fed(frames.as_bytes()).await;
        assert_eq!(keys(&out), ["$KV.b.a", "$KV.b.s", "$KV.b.b"]);
    }

    #[tokio::test]
    async fn a_stored_message_whose_header_block_is_undecodable_is_handed_over_as_such_not_an_error()
     {
        let mut bytes = msg("a", 1).into_bytes();
        for (cseq, hdr) in [
            (2, &b"NATS/1.0\r\nbad line\r\n\r\n"[..]),
            (3, b"NATS/1.0\r\nKV-Operation: DE\rL\r\n\r\n"),
            (4, b"NATS/1.0\r\nX: \xff\r\n\r\n"),
        ] {
            bytes.extend_from_slice(
                format!(
                    "HMSG $KV.b.odd{cseq} 1 $JS.ACK.KV_b.c.1.{}.{cseq}.1700000000000000000.0 {} {}\r\n",
                    cseq + 10,
                    hdr.len(),
                    hdr.len() + 1
                )
                .as_bytes(),
            );
            bytes.extend_from_slice(hdr);
            bytes.extend_from_slice(b"v\r\n");
        }
        bytes.extend_from_slice(msg("b", 5).as_bytes());
        let out = reader_fed(&bytes).await;
        let verdicts: Vec<(
            String,
            Option<Result<protocol::KvOp, protocol::Undecodable>>,
        )> = out
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .flatten()
            .filter_map(|d| match d {
                Delivered::Message(m, _, v, _) => Some((m.subject.to_string(), *v)),
                Delivered::Recreating(_) => None,
            })
            .collect();
        use protocol::Undecodable::*;
        assert_eq!(
            verdicts,
            [
                ("$KV.b.a".to_string(), Some(Ok(protocol::KvOp::Put))),
                ("$KV.b.odd2".to_string(), Some(Err(LineWithoutColon))),
                ("$KV.b.odd3".to_string(), Some(Err(CrInValue))),
                ("$KV.b.odd4".to_string(), Some(Err(NotUtf8))),
                ("$KV.b.b".to_string(), Some(Ok(protocol::KvOp::Put))),
            ]
        );
        // The watch ends only at the socket's end.
        match out.last() {
            Some(Err(KvError::WatchError(m))) => assert!(m.contains("closed the socket"), "{m}"),
            other => panic!("{other:?}", other = other.map(|r| r.is_ok())),
        }
    }

    #[tokio::test]
    async fn whole_messages_before_a_protocol_error_are_handed_over_before_the_watch_ends() {
        let frames = format!("{}{}WHAT\r\n", msg("a", 1), msg("b", 2));
        let out = reader_fed(frames.as_bytes()).await;
        assert_eq!(keys(&out), ["$KV.b.a", "$KV.b.b"]);
        match out.last() {
            Some(Err(KvError::WatchError(m))) => assert!(m.contains("malformed"), "{m}"),
            other => panic!("{other:?}", other = other.map(|r| r.is_ok())),
        }
    }

    #[test]
    fn a_read_is_handed_over_in_chunks_of_at_most_chunk() {
        let all: Vec<Delivered> = (0..CHUNK * 2 + 3)
            .map(|i| Delivered::Recreating(i.to_string()))
            .collect();
        let parts = chunk_up(all);
        assert_eq!(
            parts.iter().map(Vec::len).collect::<Vec<_>>(),
            [CHUNK, CHUNK, 3]
        );
    }
}
