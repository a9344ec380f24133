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

use foldhost_core::kv::KvWriter as _;
use foldhost_localnats::LocalNats;
use foldhost_nats::{NatsConnection, NatsKv};

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
    let conn =
        NatsConnection::open(foldhost_core::bucket::ConnectOptions::new(server.url())).await?;
    let kv = conn.bucket("wbench", &unlimited()).await?;
    let dir = tempfile::tempdir()?;
    let (mut host, addr) = start_host(&server.url(), dir.path())?;
    foldhost_tests::wait_status(&addr, |s| s.state == "running").await?;
    latency(&kv, &addr).await?;

    // Throughput with 16 writers each.
    let bare_rate = bare_throughput(&kv).await?;
    let (host_rate, host_cpu) = through_host(&addr, host.id(), "host16", None).await?;
    // The same writers answered `pending` at once (`wait_ms: 0`): what the host costs without
    // waiting for its fold, so the gap between the two is the wait for the fold's commit.
    let (pending_rate, pending_cpu) = through_host(&addr, host.id(), "pend16", Some(0)).await?;
    println!(
        "writes: 16 writers {host_rate:.0}/s through /write ({host_cpu:.2} cores), answered pending {pending_rate:.0}/s ({pending_cpu:.2} cores); bare puts {bare_rate:.0}/s"
    );
    table::row(
        "writes/s, 16 concurrent writers (/write, each answered)",
        table::rate(host_rate),
        format!("16 concurrent bare KV puts {}/s", table::rate(bare_rate)),
        host_rate / bare_rate,
        "",
    );
    table::row(
        format!(
            "writes/s, 16 writers answered `pending` (wait_ms 0; host {pending_cpu:.2} cores, applied {host_cpu:.2})"
        ),
        table::rate(pending_rate),
        format!("16 concurrent bare KV puts {}/s", table::rate(bare_rate)),
        pending_rate / bare_rate,
        "",
    );
    let _ = foldhost_tests::terminate(&mut host);
    Ok(())
}

/// Starts the release `foldhost` beside this binary on bucket `wbench` of the server at `url`,
/// its store and write token under `dir`; the process and the address it listens on.
fn start_host(url: &str, dir: &std::path::Path) -> anyhow::Result<(std::process::Child, String)> {
    let store = dir.join("fold");
    let token_file = dir.join("write-token");
    std::fs::write(&token_file, TOKEN)?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    // The release `foldhost` beside this binary (target/release/).
    let bin = std::env::current_exe()?.with_file_name("foldhost");
    anyhow::ensure!(
        bin.exists(),
        "{} not built: make bench builds it",
        bin.display()
    );
    let host = std::process::Command::new(bin)
        .env("FOLDHOST_LOG", "warn")
        .args(["run", "--bucket", "wbench", "--nats", url, "--store"])
        .arg(&store)
        .args(["--listen", &addr, "--write-token-file"])
        .arg(&token_file)
        .stderr(Stdio::null())
        .spawn()?;
    Ok((host, addr))
}

/// Latency, one writer at a time: bare puts, then applied writes through the host at `addr`, the
/// same keys and values; prints p50 and p99 of each and adds them to the table.
async fn latency(kv: &NatsKv, addr: &str) -> anyhow::Result<()> {
    let mut bare = Vec::with_capacity(SAMPLES);
    for i in 0..SAMPLES {
        let t = Instant::now();
        kv.put(&format!("bare.{i:05}"), "v".into()).await?;
        bare.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let mut through = Vec::with_capacity(SAMPLES);
    let mut writer = Writer::connect(addr).await?;
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
    Ok(())
}

/// [`WRITERS`] concurrent writers of [`PER_WRITER`] bare KV puts each; puts/s (and the machine's
/// busy cores, printed).
async fn bare_throughput(kv: &Arc<NatsKv>) -> anyhow::Result<f64> {
    let busy = machine_busy_seconds()?;
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
    println!(
        "writes: bare16: {bare_rate:.0}/s, machine {:.2} cores busy",
        (machine_busy_seconds()? - busy) / t.elapsed().as_secs_f64()
    );
    Ok(bare_rate)
}

/// The host process's CPU time so far (utime + stime from `/proc/PID/stat`), in seconds.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The fields after the command's closing parenthesis; utime and stime are the 12th and 13th.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or_else(|| anyhow::anyhow!("/proc/{pid}/stat: no command field"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| -> anyhow::Result<f64> {
        Ok(fields
            .get(i)
            .ok_or_else(|| anyhow::anyhow!("/proc/{pid}/stat: short"))?
            .parse::<f64>()?)
    };
    // Clock ticks are 100 per second on Linux.
    Ok((tick(11)? + tick(12)?) / 100.0)
}

/// The whole machine's busy CPU time so far (every core; `/proc/stat`'s first line less idle and
/// iowait), in seconds.
fn machine_busy_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat
        .lines()
        .next()
        .ok_or_else(|| anyhow::anyhow!("/proc/stat: empty"))?;
    let ticks: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .map(str::parse::<f64>)
        .collect::<Result<_, _>>()?;
    let idle = ticks.get(3).copied().unwrap_or(0.0) + ticks.get(4).copied().unwrap_or(0.0);
    Ok((ticks.iter().sum::<f64>() - idle) / 100.0)
}

/// [`WRITERS`] writers through the host's `/write`, [`PER_WRITER`] writes each under keys
/// `prefix.*` (with `wait_ms` when given); writes per second and the host's cores meanwhile.
async fn through_host(
    addr: &str,
    pid: u32,
    prefix: &'static str,
    wait_ms: Option<u64>,
) -> anyhow::Result<(f64, f64)> {
    let cpu = cpu_seconds(pid)?;
    let busy = machine_busy_seconds()?;
    let t = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let addr = addr.to_string();
        tasks.push(tokio::spawn(async move {
            let mut writer = Writer::connect(&addr).await?;
            for i in 0..PER_WRITER {
                let wait = wait_ms.map(|ms| format!(r#","wait_ms":{ms}"#));
                let body = format!(
                    r#"{{"key":"{prefix}.{w:02}.{i:04}","value":"v"{}}}"#,
                    wait.unwrap_or_default()
                );
                writer.write(body).await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let secs = t.elapsed().as_secs_f64();
    let cores = (cpu_seconds(pid)? - cpu) / secs;
    let machine = (machine_busy_seconds()? - busy) / secs;
    println!(
        "writes: {prefix}: {:.0}/s, host {cores:.2} cores, machine {machine:.2} cores busy",
        (WRITERS * PER_WRITER) as f64 / secs
    );
    Ok(((WRITERS * PER_WRITER) as f64 / secs, cores))
}
