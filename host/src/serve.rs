//! The `--listen` endpoint: `GET /status` and `POST /query`, over a deliberately small HTTP/1.1.
//!
//! Parsing is a pure function over bytes ([`parse_request`]); the I/O loop around it is thin. One
//! request per connection (`Connection: close`), bounded head (16 KiB) and body (1 MiB), and a read
//! timeout, so a slow or hostile client costs one task and a little memory, never the fold.
//!
//! Queries are handed to the fold loop ([`crate::applied::Control::Query`]) and answered between
//! batches: a query never sees a half-applied batch.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use crate::applied::Control;

/// Largest request head accepted.
pub const MAX_HEAD: usize = 16 * 1024;
/// Largest request body accepted (a guest component for `/swap`).
pub const MAX_BODY: usize = 64 * 1024 * 1024;
/// Largest query body.
pub const MAX_QUERY: usize = 1024 * 1024;
/// How long a client may take to send its request, and a query to be answered.
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
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .ok_or(HttpError::Bad("header without a colon"))?;
        if name.trim().eq_ignore_ascii_case("content-length") {
            content_length = value
                .trim()
                .parse()
                .map_err(|_| HttpError::Bad("bad content-length"))?;
        } else if name.trim().eq_ignore_ascii_case("authorization") {
            bearer = value
                .trim()
                .strip_prefix("Bearer ")
                .map(|t| t.trim().to_string());
        } else if name.trim().eq_ignore_ascii_case("transfer-encoding") {
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

/// What the server needs from the host.
pub struct ServeState {
    /// Renders the status JSON.
    pub status: Box<dyn Fn() -> serde_json::Value + Send + Sync>,
    /// The fold's control channel (`None` once the fold stopped).
    pub control: mpsc::Sender<Control>,
    /// Compiles a swapped-in guest off the fold's path (`None`: no guest, no swap).
    pub engine: Option<Arc<crate::guest::GuestEngine>>,
    /// The token mutating routes (`/swap`, `/export`) require, when set.
    pub admin_token: Option<String>,
    /// The store's backend (for `/export`).
    pub backend: crate::storedir::Backend,
    /// The watch scope (recorded in exported artifacts).
    pub scope: String,
}

/// Most connections served at once; more wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 256;

/// Serves until the listener fails; each connection on its own task, at most
/// [`MAX_CONNECTIONS`] at once.
pub async fn serve(listener: TcpListener, state: Arc<ServeState>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let (sock, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "listen: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = handle(sock, &state).await {
                tracing::debug!(error = %e, "listen: connection ended");
            }
        });
    }
}

/// Reads what the client sent next into `buf`, under [`IO_TIMEOUT`]; `false` at end of stream.
async fn read_more(sock: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<bool> {
    let mut chunk = [0u8; 8192];
    let n = tokio::time::timeout(IO_TIMEOUT, sock.read(&mut chunk))
        .await
        .map_err(|_| std::io::Error::other("read timeout"))??;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n > 0)
}

async fn handle(mut sock: TcpStream, state: &ServeState) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let head = loop {
        match parse_request(&buf) {
            Ok(Some(h)) => break h,
            Ok(None) => {}
            Err(e) => {
                let r = response(400, "Bad Request", "text/plain", e.to_string().as_bytes());
                return sock.write_all(&r).await;
            }
        }
        if !read_more(&mut sock, &mut buf).await? {
            return Ok(());
        }
    };
    let want = head.head_len + head.content_length;
    while buf.len() < want {
        if !read_more(&mut sock, &mut buf).await? {
            return Ok(());
        }
    }
    let body = buf[head.head_len..want].to_vec();
    let resp = route(&head, body, state).await;
    sock.write_all(&resp).await?;
    sock.shutdown().await
}

async fn route(head: &RequestHead, body: Vec<u8>, state: &ServeState) -> Vec<u8> {
    match (head.method.as_str(), head.path.as_str()) {
        ("GET", "/status") => {
            let v = (state.status)();
            let mut b = serde_json::to_vec(&v).unwrap_or_default();
            b.push(b'\n');
            response(200, "OK", "application/json", &b)
        }
        ("POST", "/query") if body.len() > MAX_QUERY => response(
            413,
            "Payload Too Large",
            "text/plain",
            b"query body over 1 MiB\n",
        ),
        ("POST", "/query") => {
            let (tx, rx) = oneshot::channel();
            if state
                .control
                .send(Control::Query {
                    request: body,
                    reply: tx,
                })
                .await
                .is_err()
            {
                return response(
                    503,
                    "Service Unavailable",
                    "text/plain",
                    b"the fold is not running\n",
                );
            }
            match tokio::time::timeout(IO_TIMEOUT, rx).await {
                Ok(Ok(Ok(answer))) => response(200, "OK", "application/octet-stream", &answer),
                Ok(Ok(Err(e))) => response(
                    422,
                    "Unprocessable Entity",
                    "text/plain",
                    format!("{e}\n").as_bytes(),
                ),
                Ok(Err(_)) => response(
                    503,
                    "Service Unavailable",
                    "text/plain",
                    b"the fold stopped\n",
                ),
                Err(_) => response(504, "Gateway Timeout", "text/plain", b"no answer in time\n"),
            }
        }
        ("POST", "/swap") => swap(head, body, state).await,
        ("POST", "/export") => export(head, body, state).await,
        (_, "/status") | (_, "/query") | (_, "/swap") | (_, "/export") => response(
            405,
            "Method Not Allowed",
            "text/plain",
            b"method not allowed\n",
        ),
        _ => response(404, "Not Found", "text/plain", b"not found\n"),
    }
}

/// How long a swap (settle, compile, rebuild from the fold) may take before the caller gives up
/// waiting (the swap itself still completes or is refused).
pub const SWAP_TIMEOUT: Duration = Duration::from_secs(300);

/// `POST /export`: the body is the output path (a directory, or a file ending `.tar`) on the host's
/// machine; the answer is the artifact's manifest.
/// The 401 answer when `state` has an admin token and the request does not carry it.
fn refuse_without_token(head: &RequestHead, state: &ServeState, what: &str) -> Option<Vec<u8>> {
    let token = state.admin_token.as_deref()?;
    (head.bearer.as_deref() != Some(token)).then(|| {
        response(
            401,
            "Unauthorized",
            "text/plain",
            format!("{what} needs the admin bearer token\n").as_bytes(),
        )
    })
}

async fn export(head: &RequestHead, body: Vec<u8>, state: &ServeState) -> Vec<u8> {
    if let Some(refused) = refuse_without_token(head, state, "export") {
        return refused;
    }
    let Ok(out) = String::from_utf8(body) else {
        return response(400, "Bad Request", "text/plain", b"the path is not UTF-8\n");
    };
    let out = std::path::PathBuf::from(out.trim());
    match crate::artifact::export_live(
        &state.control,
        state.backend,
        out,
        Some(state.scope.clone()),
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

async fn swap(head: &RequestHead, body: Vec<u8>, state: &ServeState) -> Vec<u8> {
    if let Some(refused) = refuse_without_token(head, state, "swap") {
        return refused;
    }
    let Some(engine) = state.engine.clone() else {
        return response(
            409,
            "Conflict",
            "text/plain",
            b"this host runs no guest to swap\n",
        );
    };
    // Compile off the fold's path: the fold keeps applying while this runs; the cache hands the
    // compiled component to the fold's swap.
    let bytes = Arc::new(body);
    let compiled = {
        let bytes = bytes.clone();
        tokio::task::spawn_blocking(move || engine.prepare("the new guest", &bytes).map(|_| ()))
            .await
    };
    match compiled {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            return response(
                409,
                "Conflict",
                "text/plain",
                format!("swap refused: {e}\n").as_bytes(),
            );
        }
        Err(e) => {
            return response(
                500,
                "Internal Server Error",
                "text/plain",
                e.to_string().as_bytes(),
            );
        }
    }
    let (tx, rx) = oneshot::channel();
    let control = Control::Swap {
        bytes: Arc::try_unwrap(bytes).unwrap_or_else(|b| b.as_ref().clone()),
        what: "the new guest".into(),
        reply: tx,
    };
    if state.control.send(control).await.is_err() {
        return response(
            503,
            "Service Unavailable",
            "text/plain",
            b"the fold is not running\n",
        );
    }
    match tokio::time::timeout(SWAP_TIMEOUT, rx).await {
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
    tokio::time::timeout(SWAP_TIMEOUT, sock.read_to_end(&mut resp))
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
    }
}
