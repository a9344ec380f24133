//! Queries by every way in, with the real binary and a real nats-server: the answers over one
//! HTTP/1.1 keep-alive connection, over pipelined HTTP/1.1 requests and over concurrent HTTP/2
//! (h2c, prior knowledge) streams each equal the answer a request of its own gets; a batch of
//! lookups (`application/x-foldhost-lookups`) is answered as its lookups one by one, over HTTP and
//! over NATS, a guest's error included; and two nodes taking `--query-subject` in one queue group
//! share it: every request answered once, the nodes' served counts summing to the requests.

use std::process::Stdio;

use foldhost::serve::{Outcome, decode_results, encode_lookups};
use foldhost_core::kv::KvWriter as _;
use foldhost_tests::*;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const LOOKUPS: &str = "application/x-foldhost-lookups";

/// Keys the bucket holds (`k0` … `k{KEYS-1}`, each `v<i>`).
const KEYS: usize = 8;

/// The requests every test asks: each key, and one the guest does not hold (its error).
fn requests() -> Vec<String> {
    let mut r: Vec<String> = (0..KEYS).map(|i| format!("k{i}")).collect();
    r.push("nope".into());
    r
}

/// A node folding `bucket` with the kvstore guest, `--listen` on a reserved port and `args`;
/// waits until it has folded the `KEYS` keys.
struct Node {
    child: std::process::Child,
    addr: String,
    /// The store's directory, removed once the node has stopped.
    _store: tempfile::TempDir,
}

impl Node {
    async fn start(h: &Harness, bucket: &str, args: &[&str]) -> anyhow::Result<Node> {
        let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
        let tmp = tempfile::tempdir()?;
        let child = run_command(h, bucket, &tmp.path().join("fold"), Some(&addr))
            .arg("--guest")
            .arg(guest_wasm("kvstore"))
            .args(args)
            .stderr(Stdio::null())
            .spawn()?;
        let node = Node {
            child,
            addr,
            _store: tmp,
        };
        wait_status(&node.addr, |s| s.applied_through >= KEYS as u64).await?;
        Ok(node)
    }

    /// `nats_queries_served` in the node's `/status`.
    async fn served(&self) -> anyhow::Result<u64> {
        Ok(wait_status(&self.addr, |_| true).await?.nats_queries_served)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = terminate(&mut self.child);
    }
}

/// A bucket holding the `KEYS` keys.
async fn seeded(h: &Harness, bucket: &str) -> anyhow::Result<()> {
    let kv = h.bucket(bucket).await?;
    for i in 0..KEYS {
        kv.put(&format!("k{i}"), format!("v{i}").into()).await?;
    }
    Ok(())
}

/// What a request of its own gets: its status and body.
async fn single(addr: &str, request: &str) -> anyhow::Result<(u16, Vec<u8>)> {
    Ok(foldhost::serve::call(addr, "POST", "/query", request.as_bytes()).await?)
}

/// A request's answer as a batch's result says it: a 200's body is the answer, a 422's (less its
/// newline) the guest's error.
fn as_result(status: u16, body: &[u8]) -> anyhow::Result<(Outcome, Vec<u8>)> {
    match status {
        200 => Ok((Outcome::Answer, body.to_vec())),
        422 => Ok((Outcome::GuestError, body.trim_ascii_end().to_vec())),
        _ => anyhow::bail!("{status}: {}", String::from_utf8_lossy(body)),
    }
}

/// The HTTP/1.1 responses in `raw`, in order: each one's status and body (by its
/// `Content-Length`).
fn responses(mut raw: &[u8]) -> anyhow::Result<Vec<(u16, Vec<u8>)>> {
    let mut out = Vec::new();
    while !raw.is_empty() {
        let end = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or_else(|| anyhow::anyhow!("a head that does not end"))?;
        let head = std::str::from_utf8(&raw[..end])?;
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("no status in {head:?}"))?;
        let length: usize = head
            .lines()
            .find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse().ok())?
            })
            .ok_or_else(|| anyhow::anyhow!("no length in {head:?}"))?;
        let body = raw
            .get(end + 4..end + 4 + length)
            .ok_or_else(|| anyhow::anyhow!("a body cut short"))?;
        out.push((status, body.to_vec()));
        raw = &raw[end + 4 + length..];
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_pipelined_and_h2c_requests_are_answered_as_requests_of_their_own_are()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    seeded(&h, "transports").await?;
    let node = Node::start(&h, "transports", &[]).await?;
    let addr = node.addr.as_str();
    let mut want = Vec::new();
    for r in requests() {
        want.push(single(addr, &r).await?);
    }
    assert_eq!(want[0], (200, b"v0".to_vec()));
    assert_eq!(want[KEYS].0, 422, "the unknown key is the guest's error");

    // One keep-alive connection, the requests one after the other.
    let sock = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(sock)).await?;
    let driver = tokio::spawn(conn);
    for (r, want) in requests().iter().zip(&want) {
        let req = hyper::Request::post("/query")
            .header(hyper::header::HOST, addr)
            .body(Full::new(Bytes::from(r.clone())))?;
        // The connection is ready for the next request once the last answer's end is read.
        sender.ready().await?;
        let resp = sender.send_request(req).await?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes().to_vec();
        // A 422 is an answer, not a refusal: the connection stays open for the next one.
        assert_eq!(&(status, body), want, "{r} on the kept-alive connection");
    }
    drop(sender);
    driver.await??;

    // Pipelined: every request written at once, the last one closing; the answers in order.
    let mut raw = Vec::new();
    let all = requests();
    for (i, r) in all.iter().enumerate() {
        let close = if i + 1 == all.len() {
            "Connection: close\r\n"
        } else {
            ""
        };
        raw.extend_from_slice(
            format!(
                "POST /query HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\n{close}\r\n{r}",
                r.len()
            )
            .as_bytes(),
        );
    }
    let mut sock = tokio::net::TcpStream::connect(addr).await?;
    sock.write_all(&raw).await?;
    let mut got = Vec::new();
    sock.read_to_end(&mut got).await?;
    assert_eq!(responses(&got)?, want, "pipelined answers, in order");

    // HTTP/2 with prior knowledge: every request on its own stream of one connection, at once.
    let sock = tokio::net::TcpStream::connect(addr).await?;
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(sock),
    )
    .await?;
    tokio::spawn(conn);
    let streams = requests().into_iter().map(|r| {
        let mut sender = sender.clone();
        async move {
            let req = hyper::Request::post(format!("http://{addr}/query"))
                .body(Full::new(Bytes::from(r)))?;
            let resp = sender.send_request(req).await?;
            anyhow::ensure!(resp.version() == hyper::Version::HTTP_2, "not HTTP/2");
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await?.to_bytes().to_vec();
            anyhow::Ok((status, body))
        }
    });
    let answers: Vec<(u16, Vec<u8>)> = futures::future::join_all(streams)
        .await
        .into_iter()
        .collect::<anyhow::Result<_>>()?;
    assert_eq!(answers, want, "h2c streams");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_lookups_is_answered_as_its_lookups_one_by_one_over_http_and_nats()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    seeded(&h, "batches").await?;
    let node = Node::start(&h, "batches", &["--query-subject", "svc.batches"]).await?;
    let addr = node.addr.as_str();
    let all = requests();
    let mut want = Vec::new();
    for r in &all {
        let (status, body) = single(addr, r).await?;
        want.push(as_result(status, &body)?);
    }
    let lookups: Vec<&[u8]> = all.iter().map(|r| r.as_bytes()).collect();
    let body = encode_lookups(&lookups);
    let ct = [("Content-Type", LOOKUPS.to_string())];
    let forever = std::time::Duration::from_secs(60);

    // Over HTTP.
    let (status, answer) =
        foldhost::serve::call_with_headers(addr, "POST", "/query", &body, None, &ct, forever)
            .await?;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    assert_eq!(decode_results(&answer)?, want);
    // No lookups: no results.
    let (status, answer) =
        foldhost::serve::call_with_headers(addr, "POST", "/query", b"", None, &ct, forever).await?;
    assert_eq!((status, answer), (200, Vec::new()));
    // A frame whose length passes the body's end: 400, naming where the frame starts.
    let mut bad = encode_lookups(&[b"k0"]);
    bad.extend_from_slice(&[0, 0, 0, 9, b'k']);
    let (status, answer) =
        foldhost::serve::call_with_headers(addr, "POST", "/query", &bad, None, &ct, forever)
            .await?;
    let line = String::from_utf8_lossy(&answer);
    assert_eq!(status, 400, "{line}");
    assert!(line.contains("frame at byte 6"), "{line}");
    assert_eq!(line.lines().count(), 1, "{line}");
    // One lookup past the limit: 400.
    let over = encode_lookups(&vec![b"k0"; foldhost::serve::MAX_LOOKUPS + 1]);
    let (status, _) =
        foldhost::serve::call_with_headers(addr, "POST", "/query", &over, None, &ct, forever)
            .await?;
    assert_eq!(status, 400);

    // Over NATS: the same batch, the same results, under the same content type.
    let client = h.conn.client().await?;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Content-Type", LOOKUPS);
    let reply = client
        .request_with_headers("svc.batches", headers.clone(), body.into())
        .await?;
    let header = |m: &async_nats::Message, name: &str| {
        m.headers
            .as_ref()
            .and_then(|h| h.get(name))
            .map(|v| v.as_str().to_string())
    };
    assert_eq!(header(&reply, "Content-Type").as_deref(), Some(LOOKUPS));
    assert_eq!(header(&reply, "Foldhost-Error"), None);
    assert_eq!(decode_results(&reply.payload)?, want);
    // Each lookup asked over NATS on its own answers the same.
    for (r, want) in all.iter().zip(&want) {
        let m = client.request("svc.batches", r.clone().into()).await?;
        let got = match header(&m, "Foldhost-Error").as_deref() {
            None => (Outcome::Answer, m.payload.to_vec()),
            Some("true") => (Outcome::GuestError, m.payload.to_vec()),
            Some(other) => anyhow::bail!("{r}: Foldhost-Error: {other}"),
        };
        assert_eq!(&got, want, "{r} over NATS");
    }
    // Bad framing over NATS: an error naming the offset.
    let m = client
        .request_with_headers("svc.batches", headers, bad.into())
        .await?;
    assert_eq!(header(&m, "Foldhost-Error").as_deref(), Some("true"));
    let why = String::from_utf8_lossy(&m.payload);
    assert!(why.contains("frame at byte 6"), "{why}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_in_one_queue_group_share_the_query_subject_each_request_answered_once()
-> anyhow::Result<()> {
    const N: usize = 200;
    let h = Harness::start().await?;
    seeded(&h, "shared").await?;
    let args = ["--query-subject", "svc.shared", "--query-group", "routers"];
    let a = Node::start(&h, "shared", &args).await?;
    let b = Node::start(&h, "shared", &args).await?;
    let client = h.conn.client().await?;
    // Every reply to this test's requests comes to one subscription, counted whatever it is.
    let mut replies = client.subscribe("_INBOX.shared.>").await?;
    client.flush().await?;
    let mut sent = 0usize;
    let mut received = 0usize;
    let ask = |i: usize| {
        let client = client.clone();
        async move {
            let key = format!("k{}", i % KEYS);
            client
                .publish_with_reply("svc.shared", format!("_INBOX.shared.{i}"), key.into())
                .await
        }
    };
    // Until each node has answered one (both subscriptions are in place at the server).
    use futures::StreamExt as _;
    while a.served().await? == 0 || b.served().await? == 0 {
        ask(sent).await?;
        sent += 1;
        let m = replies
            .next()
            .await
            .ok_or_else(|| anyhow::anyhow!("replies ended"))?;
        assert_eq!(m.payload, format!("v{}", (sent - 1) % KEYS).as_bytes());
        received += 1;
    }
    // Then N more, all at once.
    for _ in 0..N {
        ask(sent).await?;
        sent += 1;
    }
    let mut answered = std::collections::BTreeSet::new();
    while received < sent {
        let m = replies
            .next()
            .await
            .ok_or_else(|| anyhow::anyhow!("replies ended"))?;
        let i: usize = m
            .subject
            .rsplit('.')
            .next()
            .and_then(|i| i.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("a reply on {}", m.subject))?;
        assert_eq!(m.payload, format!("v{}", i % KEYS).as_bytes(), "reply {i}");
        answered.insert(i);
        received += 1;
    }
    // Each node counts a request before it replies: with every reply in, the counts are final.
    let (sa, sb) = (a.served().await?, b.served().await?);
    assert!(sa > 0 && sb > 0, "both nodes served: {sa} and {sb}");
    assert_eq!(
        (sa + sb) as usize,
        sent,
        "the nodes answered {sa} + {sb} requests of {sent}: each request once"
    );
    assert_eq!(answered.len(), N, "every one of the {N} got its reply");
    Ok(())
}

/// Once its query instance is level (`/status`: `query_instance_revision`), a node answers every
/// query from it — beside the fold, not between its batches — with the answers the fold loop gave
/// before, and keeps doing so while a writer moves the fold: the instance follows it in rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_the_query_instance_is_level_it_answers_every_query_and_follows_the_fold()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    seeded(&h, "instance").await?;
    let node = Node::start(&h, "instance", &[]).await?;
    let s = wait_status(&node.addr, |s| {
        s.query_instance_revision == Some(s.applied_through)
    })
    .await?;
    let asked = requests();
    for r in &asked {
        let (code, body) = single(&node.addr, r).await?;
        let want = match r.strip_prefix('k') {
            Some(i) => (200, format!("v{i}").into_bytes()),
            None => (422, Vec::new()),
        };
        assert_eq!(code, want.0, "{r}: {}", String::from_utf8_lossy(&body));
        if code == 200 {
            assert_eq!(body, want.1, "{r}");
        }
    }
    let after = wait_status(&node.addr, |_| true).await?;
    assert_eq!(
        after.queries_by_instance,
        s.queries_by_instance + asked.len() as u64,
        "every query answered by the query instance: {after:?}"
    );
    assert_eq!(
        after.queries_by_fold, s.queries_by_fold,
        "none by the fold loop"
    );
    // A change reaches the instance's answers once it is level with the fold again.
    let kv = h.bucket("instance").await?;
    let revision = kv
        .put("k0", "changed".into())
        .await?
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("a put without a revision"))?;
    wait_status(&node.addr, |s| s.query_instance_revision >= Some(revision)).await?;
    assert_eq!(single(&node.addr, "k0").await?, (200, b"changed".to_vec()));
    let metrics = foldhost::serve::call(&node.addr, "GET", "/metrics", b"").await?;
    let text = String::from_utf8_lossy(&metrics.1);
    assert!(
        text.contains("foldhost_query_instance_level{fold=\"instance\"} 1"),
        "{text}"
    );
    Ok(())
}
