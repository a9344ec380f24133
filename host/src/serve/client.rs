//! A minimal client for the endpoint (the CLI, the demo and the tests use it): one request on a
//! connection of its own, through hyper's HTTP/1.1 client (no pool), its answer read whole.

use std::time::Duration;

use http_body_util::{BodyExt as _, Full};
use hyper::Request;
use hyper::body::Bytes;
use hyper::header::{AUTHORIZATION, CONNECTION, HOST};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::{IO_TIMEOUT, SWAP_TIMEOUT};

/// One request to `addr`, one response: its status and body.
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
/// after its wait for batches: the caller must outwait the host, which gives up first). The
/// connection is made within [`IO_TIMEOUT`].
pub async fn call_with_deadline(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
    token: Option<&str>,
    read: Duration,
) -> std::io::Result<(u16, Vec<u8>)> {
    call_with_headers(addr, method, path, body, token, &[], read).await
}

/// A `--listen` value as the CLI takes it: `HOST:PORT`, or `HOST:PORT/folds/NAME` for one fold of
/// a listener serving several — the address and the path prefix (empty for the first). Pure.
pub fn split_listen(listen: &str) -> (&str, &str) {
    match listen.find('/') {
        Some(i) => (&listen[..i], &listen[i..]),
        None => (listen, ""),
    }
}

/// [`call_with_deadline`] with more request headers (`Foldhost-Min-Revision`, say).
pub async fn call_with_headers(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
    token: Option<&str>,
    headers: &[(&str, String)],
    read: Duration,
) -> std::io::Result<(u16, Vec<u8>)> {
    let other = std::io::Error::other;
    // `ADDR/folds/NAME`: one fold of a listener serving several, its routes under that prefix.
    let (addr, prefix) = split_listen(addr);
    let path = format!("{prefix}{path}");
    let sock = tokio::time::timeout(IO_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| other("connect timeout"))??;
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header(HOST, addr)
        // One request per call: the server frees the connection once it has answered.
        .header(CONNECTION, "close");
    if let Some(t) = token {
        req = req.header(AUTHORIZATION, format!("Bearer {t}"));
    }
    for (name, value) in headers {
        req = req.header(*name, value.as_str());
    }
    let req = req
        .body(Full::new(Bytes::copy_from_slice(body)))
        .map_err(std::io::Error::other)?;
    let exchange = async {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(sock))
            .await
            .map_err(std::io::Error::other)?;
        // The connection's driver, ended with the exchange (on a timeout too).
        let _driver = AbortOnDrop(tokio::spawn(conn));
        let resp = sender
            .send_request(req)
            .await
            .map_err(std::io::Error::other)?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(std::io::Error::other)?;
        Ok::<_, std::io::Error>((status, body.to_bytes().to_vec()))
    };
    tokio::time::timeout(read, exchange)
        .await
        .map_err(|_| other("read timeout"))?
}

/// Aborts a task when dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
