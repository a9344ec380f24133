//! `foldhost-bench writes`: the latency of an applied write through a host's `/write` against a
//! bare KV put from the same client in the same run (the broker's own round trip, which bounds
//! any write), and writes per second with 16 concurrent writers through `/write` against 16
//! concurrent bare puts. The host is the release `foldhost` binary beside this one, folding an idle
//! bucket with the native applier; every `/write` waits for `applied`. Each writer keeps one
//! HTTP/1.1 connection open across its writes, as a caller's HTTP library does (the NATS client
//! behind a bare put keeps its connection too).

use std::process::Stdio;
use std::sync::Arc;
use std::time::Instant;

use foldhost::kv::KvWriter as _;
use foldhost::nats::NatsConnection;
use foldhost_localnats::LocalNats;

use super::{percentile, table, unlimited};

/// Writes per latency sample set.
const SAMPLES: usize = 2_000;
/// Concurrent writers for the throughput figure, and writes each.
const WRITERS: usize = 16;
const PER_WRITER: usize = 500;

/// The write token the benchmark's host is given.
const TOKEN: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// One keep-alive HTTP/1.1 connection to the host, sending `/write` requests in turn.
struct Writer {
    send: hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>,
    addr: String,
}

impl Writer {
    async fn connect(addr: &str) -> anyhow::Result<Writer> {
        let sock = tokio::net::TcpStream::connect(addr).await?;
        sock.set_nodelay(true)?;
        let (send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(sock)).await?;
        tokio::spawn(conn);
        Ok(Writer {
            send,
            addr: addr.to_string(),
        })
    }

    /// Sends one write; its HTTP status.
    async fn write(&mut self, body: String) -> anyhow::Result<u16> {
        use http_body_util::BodyExt as _;
        self.send.ready().await?;
        let req = hyper::Request::post("/write")
            .header(hyper::header::HOST, &self.addr)
            .header(hyper::header::AUTHORIZATION, format!("Bearer {TOKEN}"))
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))?;
        let resp = self.send.send_request(req).await?;
        let code = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes();
        anyhow::ensure!(
            code == 200 || code == 202,
            "write answered {code}: {}",
            String::from_utf8_lossy(&body)
        );
        Ok(code)
    }
}

/// Runs both figures and adds them to the table.
pub async fn run() -> anyhow::Result<()> {
    let server = LocalNats::start()?;
    let conn = NatsConnection::open(foldhost::bucket::ConnectOptions::new(server.url())).await?;
    let kv = conn.bucket("wbench", &unlimited()).await?;
    let dir = tempfile::tempdir()?;
    let store = dir.path().join("fold");
    let token_file = dir.path().join("write-token");
    std::fs::write(&token_file, TOKEN)?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    // The release `foldhost` beside this binary (target/release/).
    let bin = std::env::current_exe()?.with_file_name("foldhost");
    anyhow::ensure!(
        bin.exists(),
        "{} not built: make bench builds it",
        bin.display()
    );
    let mut host = std::process::Command::new(bin)
        .env("FOLDHOST_LOG", "warn")
        .args([
            "run",
            "--bucket",
            "wbench",
            "--nats",
            &server.url(),
            "--store",
        ])
        .arg(&store)
        .args(["--listen", &addr, "--write-token-file"])
        .arg(&token_file)
        .stderr(Stdio::null())
        .spawn()?;
    foldhost_tests::wait_status(&addr, |s| s.state == "running").await?;

    // Latency, one writer at a time: bare puts, then applied writes, the same keys and values.
    let mut bare = Vec::with_capacity(SAMPLES);
    for i in 0..SAMPLES {
        let t = Instant::now();
        kv.put(&format!("bare.{i:05}"), "v".into()).await?;
        bare.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let mut through = Vec::with_capacity(SAMPLES);
    let mut writer = Writer::connect(&addr).await?;
    for i in 0..SAMPLES {
        let body = format!(r#"{{"key":"host.{i:05}","value":"v"}}"#);
        let t = Instant::now();
        let code = writer.write(body).await?;
        through.push(t.elapsed().as_secs_f64() * 1e6);
        anyhow::ensure!(code == 200, "not applied: {code}");
    }
    bare.sort_by(|a, b| a.total_cmp(b));
    through.sort_by(|a, b| a.total_cmp(b));
    let (b50, b99) = (percentile(&bare, 0.5), percentile(&bare, 0.99));
    let (w50, w99) = (percentile(&through, 0.5), percentile(&through, 0.99));
    println!(
        "writes: applied p50 {w50:.0} µs p99 {w99:.0} µs; bare put p50 {b50:.0} µs p99 {b99:.0} µs"
    );
    table::row(
        "applied write p50 (/write, idle fold)",
        format!("{w50:.0} µs"),
        format!("bare KV put p50 {b50:.0} µs"),
        w50 / b50,
        "",
    );
    table::row(
        "applied write p99 (/write, idle fold)",
        format!("{w99:.0} µs"),
        format!("bare KV put p99 {b99:.0} µs"),
        w99 / b99,
        "≤ 2×",
    );

    // Throughput with 16 writers each.
    let kv = Arc::new(kv);
    let t = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let kv = kv.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..PER_WRITER {
                kv.put(&format!("bare16.{w:02}.{i:04}"), "v".into()).await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let bare_rate = (WRITERS * PER_WRITER) as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let addr = addr.clone();
        tasks.push(tokio::spawn(async move {
            let mut writer = Writer::connect(&addr).await?;
            for i in 0..PER_WRITER {
                let body = format!(r#"{{"key":"host16.{w:02}.{i:04}","value":"v"}}"#);
                writer.write(body).await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let host_rate = (WRITERS * PER_WRITER) as f64 / t.elapsed().as_secs_f64();
    println!("writes: 16 writers {host_rate:.0}/s through /write; bare puts {bare_rate:.0}/s");
    table::row(
        "writes/s, 16 concurrent writers (/write, each answered)",
        table::rate(host_rate),
        format!("16 concurrent bare KV puts {}/s", table::rate(bare_rate)),
        host_rate / bare_rate,
        "",
    );
    let _ = foldhost_tests::terminate(&mut host);
    Ok(())
}
