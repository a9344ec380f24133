//! The load generator's requesters: the seeded host streams ([`Prng`]), the kinds of request a
//! row sends ([`Kind`]), and one requester per connection ([`Requester`]) that asks and checks
//! every answer (HTTP 200 with a body, a NATS reply without `Foldhost-Error`, a KV get that found
//! the key).

use bytes::Bytes;

use super::{KEYS, LOOKUPS_TYPE, SUBJECT};

/// One seeded stream of host indexes (splitmix64).
pub(super) struct Prng(pub(super) u64);

impl Prng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(super) fn host(&mut self) -> u64 {
        self.next() % KEYS
    }
}

pub(super) fn host_name(i: u64) -> String {
    format!("h{i:08}.example.com")
}

/// How queries are sent.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Kind {
    /// `POST /query`, one host per request.
    Http,
    /// `POST /query` with [`BATCH`](super::BATCH) hosts framed as lookups.
    Lookups,
    /// A request on the query subject.
    Nats,
    /// `Store::get` from the server.
    KvGet,
}

impl Kind {
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::Http => "HTTP /query",
            Kind::Lookups => "HTTP /query, 16 lookups per request",
            Kind::Nats => "NATS request/reply",
            Kind::KvGet => "KV get",
        }
    }
}

/// One requester's way to the answers.
pub(super) enum Requester {
    Http(Http),
    Nats(async_nats::Client),
    KvGet(Box<async_nats::jetstream::kv::Store>),
}

/// One keep-alive HTTP/1.1 connection to the node.
pub(super) struct Http {
    pub(super) send: hyper::client::conn::http1::SendRequest<http_body_util::Full<Bytes>>,
    pub(super) addr: String,
}

/// A connection's I/O, driven in the task that sends its requests (no wake-up of another task
/// per answer); it ends when its [`Http`] is dropped.
pub(super) type Driver = hyper::client::conn::http1::Connection<
    hyper_util::rt::TokioIo<tokio::net::TcpStream>,
    http_body_util::Full<Bytes>,
>;

impl Http {
    pub(super) async fn connect(addr: &str) -> anyhow::Result<(Http, Driver)> {
        let sock = tokio::net::TcpStream::connect(addr).await?;
        sock.set_nodelay(true)?;
        let (send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(sock)).await?;
        let http = Http {
            send,
            addr: addr.to_string(),
        };
        Ok((http, conn))
    }

    /// `POST /query` of `body`; its status, content type and body.
    pub(super) async fn post(
        &mut self,
        body: Bytes,
        content_type: Option<&str>,
    ) -> anyhow::Result<(u16, Option<String>, Bytes)> {
        use http_body_util::BodyExt as _;
        self.send.ready().await?;
        let mut req = hyper::Request::post("/query").header(hyper::header::HOST, &self.addr);
        if let Some(t) = content_type {
            req = req.header(hyper::header::CONTENT_TYPE, t);
        }
        let resp = self
            .send
            .send_request(req.body(http_body_util::Full::new(body))?)
            .await?;
        let code = resp.status().as_u16();
        let ctype = resp
            .headers()
            .get(hyper::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((code, ctype, body))
    }
}

/// `hosts` framed as lookups: each a 4-byte big-endian length, then its bytes.
pub(super) fn encode_lookups(hosts: &[String]) -> Bytes {
    let mut out = Vec::with_capacity(hosts.iter().map(|h| h.len() + 4).sum());
    for h in hosts {
        out.extend_from_slice(&(h.len() as u32).to_be_bytes());
        out.extend_from_slice(h.as_bytes());
    }
    out.into()
}

/// Checks a lookups answer: `n` results, each an answer (outcome 0) with a body.
pub(super) fn check_results(body: &[u8], n: usize) -> anyhow::Result<()> {
    let mut at = 0;
    let mut seen = 0;
    while at < body.len() {
        let head = body
            .get(at..at + 5)
            .ok_or_else(|| anyhow::anyhow!("result at byte {at} cut short"))?;
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        let text = body
            .get(at + 5..at + 5 + len)
            .ok_or_else(|| anyhow::anyhow!("result at byte {at} passes the end"))?;
        anyhow::ensure!(
            head[0] == 0 && !text.is_empty(),
            "lookup {seen} not answered (outcome {}): {}",
            head[0],
            String::from_utf8_lossy(text)
        );
        at += 5 + len;
        seen += 1;
    }
    anyhow::ensure!(seen == n, "{seen} results for {n} lookups");
    Ok(())
}

impl Requester {
    /// Asks for `hosts` (one, or [`BATCH`](super::BATCH) for lookups) and checks the answer.
    pub(super) async fn ask(&mut self, kind: Kind, hosts: &[String]) -> anyhow::Result<()> {
        match (self, kind) {
            (Requester::Http(h), Kind::Http) => {
                let (code, _, body) = h.post(Bytes::from(hosts[0].clone()), None).await?;
                anyhow::ensure!(
                    code == 200 && !body.is_empty(),
                    "query {} answered {code}: {}",
                    hosts[0],
                    String::from_utf8_lossy(&body)
                );
            }
            (Requester::Http(h), Kind::Lookups) => {
                let (code, ctype, body) = h.post(encode_lookups(hosts), Some(LOOKUPS_TYPE)).await?;
                anyhow::ensure!(
                    code == 200 && ctype.as_deref() == Some(LOOKUPS_TYPE),
                    "lookups answered {code} ({ctype:?}): {}",
                    String::from_utf8_lossy(&body)
                );
                check_results(&body, hosts.len())?;
            }
            (Requester::Nats(c), Kind::Nats) => {
                let m = c.request(SUBJECT, Bytes::from(hosts[0].clone())).await?;
                let failed = m.headers.as_ref().and_then(|h| h.get("Foldhost-Error"));
                anyhow::ensure!(
                    failed.is_none() && !m.payload.is_empty(),
                    "NATS query {} answered {failed:?}: {}",
                    hosts[0],
                    String::from_utf8_lossy(&m.payload)
                );
            }
            (Requester::KvGet(s), Kind::KvGet) => {
                let v = s.get(format!("route.{}", hosts[0])).await?;
                anyhow::ensure!(
                    v.is_some_and(|v| !v.is_empty()),
                    "KV get of route.{} found nothing",
                    hosts[0]
                );
            }
            (_, kind) => anyhow::bail!("no requester for {kind:?}"),
        }
        Ok(())
    }
}
