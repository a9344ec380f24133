//! A TCP proxy in front of a nats-server that a test controls: it forwards every connection both
//! ways until told to cut the connection that publishes to a subject — after the publish reached
//! the server, before its acknowledgement reaches the client — and it can refuse new connections
//! (a server nobody can reach any more).
//!
//! The cut is placed by the bytes, not by time: the proxy reads the client's protocol lines, and
//! once a `PUB`/`HPUB` whose subject starts with the armed prefix has been forwarded whole, that
//! connection's server-to-client direction forwards nothing more and both sockets close.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// What the test tells the proxy.
#[derive(Default)]
struct Control {
    /// Cut the next connection that publishes to a subject with this prefix (once).
    cut_prefix: std::sync::Mutex<Option<String>>,
    /// Connections cut so far.
    cuts: AtomicU64,
    /// Close every new connection at once.
    refuse: AtomicBool,
}

/// The proxy; it stops when dropped.
pub struct Proxy {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    control: Arc<Control>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a reserved loopback port and forwards to `upstream` (`HOST:PORT`).
    pub async fn start(upstream: &str) -> anyhow::Result<Proxy> {
        let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
        let listener = TcpListener::bind(&addr).await?;
        let control = Arc::new(Control::default());
        let upstream = upstream.to_string();
        let c = control.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if c.refuse.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let (c, upstream) = (c.clone(), upstream.clone());
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        forward(client, server, c).await;
                    }
                });
            }
        });
        Ok(Proxy {
            addr,
            control,
            task,
        })
    }

    /// `nats://` URL of the proxy.
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// Arms the cut: the next connection that publishes to a subject starting with `prefix` is
    /// cut once that publish has been forwarded whole.
    pub fn cut_after_publish_to(&self, prefix: &str) {
        if let Ok(mut p) = self.control.cut_prefix.lock() {
            *p = Some(prefix.to_string());
        }
    }

    /// How many connections were cut so far.
    pub fn cuts(&self) -> u64 {
        self.control.cuts.load(Ordering::SeqCst)
    }

    /// Refuses (closes at once) every new connection while `refuse` holds.
    pub fn refuse_new(&self, refuse: bool) {
        self.control.refuse.store(refuse, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Forwards one connection both ways, watching the client's bytes for the armed publish.
async fn forward(client: TcpStream, server: TcpStream, control: Arc<Control>) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let cut = Arc::new(tokio::sync::Notify::new());
    let cut_seen = cut.clone();
    let down = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            tokio::select! {
                _ = cut_seen.notified() => return,
                n = sr.read(&mut buf) => match n {
                    Ok(0) | Err(_) => return,
                    Ok(n) => if cw.write_all(&buf[..n]).await.is_err() { return },
                },
            }
        }
    });
    let mut scan = Scanner::default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match cr.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let prefix = control.cut_prefix.lock().ok().and_then(|p| p.clone());
        // Forward up to the end of an armed publish, then cut.
        match scan.feed(&buf[..n], prefix.as_deref()) {
            Some(end) => {
                let _ = sw.write_all(&buf[..end]).await;
                let _ = sw.flush().await;
                if let Ok(mut p) = control.cut_prefix.lock() {
                    *p = None;
                }
                control.cuts.fetch_add(1, Ordering::SeqCst);
                cut.notify_one();
                break;
            }
            None => {
                if sw.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    }
    // The server side stays open until the publish is surely in: its socket closes with the
    // task; the client's write half closes with `down`.
    down.abort();
}

/// Reads the client's protocol stream just enough to find where an armed publish ends.
#[derive(Default)]
struct Scanner {
    /// Bytes of an incomplete control line.
    line: Vec<u8>,
    /// Payload bytes (and their CRLF) still to pass, and whether they end an armed publish.
    skip: usize,
    armed: bool,
}

impl Scanner {
    /// Feeds `bytes`; `Some(n)`: the armed publish ends after the first `n` of them.
    fn feed(&mut self, bytes: &[u8], prefix: Option<&str>) -> Option<usize> {
        let mut i = 0;
        while i < bytes.len() {
            if self.skip > 0 {
                let take = self.skip.min(bytes.len() - i);
                self.skip -= take;
                i += take;
                if self.skip == 0 && self.armed {
                    return Some(i);
                }
                continue;
            }
            self.line.push(bytes[i]);
            i += 1;
            if self.line.ends_with(b"\r\n") {
                let line = String::from_utf8_lossy(&self.line[..self.line.len() - 2]).to_string();
                self.line.clear();
                let parts: Vec<&str> = line.split_whitespace().collect();
                let (subject, total) = match parts.first().map(|p| p.to_ascii_uppercase()) {
                    Some(op) if op == "PUB" => {
                        (parts.get(1), parts.last().and_then(|n| n.parse().ok()))
                    }
                    Some(op) if op == "HPUB" => {
                        (parts.get(1), parts.last().and_then(|n| n.parse().ok()))
                    }
                    _ => (None, None),
                };
                if let (Some(subject), Some(total)) = (subject, total) {
                    let total: usize = total;
                    self.skip = total + 2;
                    self.armed = prefix.is_some_and(|p| subject.starts_with(p));
                }
            }
        }
        None
    }
}
