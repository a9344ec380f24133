//! The `--listen` endpoint against hostile callers, with the real binary and a real nats-server:
//! admin routes need a token even on loopback (one the host generates into a 0600 file that
//! `foldhost swap` finds), a wildcard listener answers queries only with the query token (or
//! `--query-open`), rebound Host names and cross-site Origins are refused, fast and slow
//! clients announcing large bodies on every route cannot pin the host's memory or stop the fold, and
//! a guest that fails in `init` leaves no store behind.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt as _;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use foldhost_core::kv::KvWriter;
use foldhost_core::status::StatusReport;
use foldhost_tests::{
    Harness, foldhost, guest_wasm, run_command, terminate, wait_status, wait_until,
};

fn addr() -> anyhow::Result<String> {
    Ok(format!(
        "127.0.0.1:{}",
        foldhost_localnats::reserved_port()?
    ))
}

/// Sends `raw` as a whole request and returns the status code of the answer.
fn raw_request(addr: &str, raw: &[u8]) -> anyhow::Result<u16> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))?;
    s.write_all(raw)?;
    // The status line is all this needs: read until it is whole (or the server closes), not
    // until a keep-alive connection's idle close.
    let mut resp = Vec::new();
    let mut chunk = [0u8; 4096];
    while !resp.windows(2).any(|w| w == b"\r\n") {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        resp.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&resp);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no status in {text:?}"))
}

/// Peak resident memory of a process, in bytes (`VmHWM`).
fn peak_rss(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmHWM for {pid}"))?;
    Ok(kb * 1024)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_need_the_generated_token_even_on_loopback_and_foldhost_swap_finds_it()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("admin").await?;
    kv.put("k", "v".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let a = addr()?;
    let mut host = run_command(&h, "admin", &store, Some(&a))
        .arg("--guest")
        .arg(guest_wasm("kvstore"))
        .stderr(Stdio::null())
        .spawn()?;
    let s = wait_status(&a, |s| s.applied_through >= 1).await?;

    // The generated token: in a file only this user can read, named by /status.
    let file = store.join("admin-token");
    assert_eq!(
        s.admin_token_file.as_deref(),
        Some(&*file.to_string_lossy()),
        "{s:?}"
    );
    let mode = std::fs::metadata(&file)?.permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the token file is private");
    let token = std::fs::read_to_string(&file)?.trim().to_string();
    assert!(token.len() >= 32, "a real token: {token:?}");

    // Without it, every admin route is refused on loopback, before any body is read.
    let guest = std::fs::read(guest_wasm("kvstore_v2"))?;
    for path in ["/swap", "/export"] {
        let (code, body) = foldhost::serve::call(&a, "POST", path, &guest).await?;
        assert_eq!(code, 401, "{path}: {}", String::from_utf8_lossy(&body));
        let (code, _) =
            foldhost::serve::call_with_token(&a, "POST", path, b"x", Some("not-it")).await?;
        assert_eq!(code, 401, "{path} with a wrong token");
    }
    // A rebound name or a cross-site browser request is refused even for open routes.
    let port = a.rsplit(':').next().unwrap_or_default();
    let rebound = format!("GET /status HTTP/1.1\r\nHost: evil.example:{port}\r\n\r\n");
    assert_eq!(raw_request(&a, rebound.as_bytes())?, 403);
    let cross = format!(
        "POST /query HTTP/1.1\r\nHost: {a}\r\nOrigin: http://evil.example\r\nContent-Length: 1\r\n\r\nk"
    );
    assert_eq!(raw_request(&a, cross.as_bytes())?, 403);
    let same = format!("POST /query HTTP/1.1\r\nHost: {a}\r\nContent-Length: 1\r\n\r\nk");
    assert_eq!(raw_request(&a, same.as_bytes())?, 200);

    // `foldhost swap` with no token argument finds the file through /status.
    let o = foldhost()
        .args(["swap", "--listen", &a, "--guest"])
        .arg(guest_wasm("kvstore_v2"))
        .output()?;
    assert!(
        o.status.success(),
        "foldhost swap: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    wait_status(&a, |s| s.guest.as_deref() == Some("kvstore@0.2.0")).await?;
    terminate(&mut host)?;
    Ok(())
}

/// `/status` of the host at `a`, asked with `token`, once it satisfies `done` (the deadline only
/// stops a hung test).
async fn status_with_token(
    a: &str,
    token: Option<&str>,
    mut done: impl FnMut(&StatusReport) -> bool,
) -> anyhow::Result<StatusReport> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        if let Ok((200, body)) =
            foldhost::serve::call_with_token(a, "GET", "/status", b"", token).await
        {
            let s: StatusReport = serde_json::from_slice(&body)?;
            if done(&s) {
                return Ok(s);
            }
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "{a} never answered /status as expected"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A raw query for key `k` to `a`, with `Host: host` and, when given, the bearer `token`.
fn query_as(a: &str, host: &str, token: Option<&str>) -> anyhow::Result<u16> {
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let raw = format!("POST /query HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Length: 1\r\n\r\nk");
    raw_request(a, raw.as_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wildcard_listener_answers_queries_only_with_the_query_token_and_never_to_a_rebound_host()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("wild").await?;
    kv.put("k", "v".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let port = foldhost_localnats::reserved_port()?;
    let wildcard = format!("0.0.0.0:{port}");
    // Clients reach it through loopback here, as a DNS-rebound page in a local browser would.
    let a = format!("127.0.0.1:{port}");
    let mut cmd = run_command(&h, "wild", &store, Some(&wildcard));
    cmd.arg("--guest")
        .arg(guest_wasm("kvstore"))
        .args(["--listen-host", "fold.test"]);
    let (mut host, mut log) = foldhost_tests::spawn_logged(cmd)?;

    // No token given: one generated into a private file in the store, named (never shown) in
    // the log.
    let line = log.wait_for("query token")?;
    let file = store.join("query-token");
    assert!(line.contains(&*file.to_string_lossy()), "{line}");
    let mode = std::fs::metadata(&file)?.permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the query token file is private");
    let token = std::fs::read_to_string(&file)?.trim().to_string();
    assert_eq!(token.len(), 64, "a generated token: {token:?}");
    assert!(!line.contains(&token), "the log shows the token: {line}");
    let s = status_with_token(&a, Some(&token), |s| s.applied_through >= 1).await?;
    assert_eq!(s.pid, host.id());
    let (_, body) =
        foldhost::serve::call_with_token(&a, "GET", "/status", b"", Some(&token)).await?;
    assert!(
        !String::from_utf8_lossy(&body).contains(&token),
        "/status shows the query token"
    );

    // Without the token: refused, /status too; with it: answered.
    assert_eq!(query_as(&a, &a, None)?, 401, "a query without the token");
    assert_eq!(query_as(&a, &a, Some("not-it"))?, 401, "a wrong token");
    let (code, _) = foldhost::serve::call(&a, "GET", "/status", b"").await?;
    assert_eq!(code, 401, "/status without the token");
    // The CLI's `status --listen` says which token it needs, and reads it from a file.
    let cli = |token_file: Option<&std::path::Path>| {
        let mut c = foldhost_tests::foldhost();
        c.args(["status", "--json", "--listen", &a]);
        if let Some(f) = token_file {
            c.arg("--token-file").arg(f);
        }
        c.output()
    };
    let o = cli(None)?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--token-file") && err.lines().count() == 1,
        "{err}"
    );
    let o = cli(Some(&file))?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    assert_eq!(s["pid"].as_u64(), Some(u64::from(host.id())), "{s}");
    assert_eq!(
        query_as(&a, &a, Some(&token))?,
        200,
        "a query with the token"
    );
    // The configured name is admitted; a rebound name is refused, token or not.
    assert_eq!(
        query_as(&a, &format!("fold.test:{port}"), Some(&token))?,
        200
    );
    for token in [None, Some(token.as_str())] {
        let rebound = format!("evil.example:{port}");
        assert_eq!(
            query_as(&a, &rebound, token)?,
            403,
            "rebound, token {token:?}"
        );
    }
    terminate(&mut host)?;

    // --query-open: the host says the risk, and answers without a token — still not to a
    // rebound name.
    let mut cmd = run_command(&h, "wild", &store, Some(&wildcard));
    cmd.arg("--guest")
        .arg(guest_wasm("kvstore"))
        .arg("--query-open");
    let (mut host, mut log) = foldhost_tests::spawn_logged(cmd)?;
    let line = log.wait_for("--query-open")?;
    assert!(line.contains("anyone") && line.contains("flood"), "{line}");
    let s = status_with_token(&a, None, |s| s.applied_through >= 1).await?;
    assert_eq!(s.pid, host.id());
    assert_eq!(query_as(&a, &a, None)?, 200, "an open query");
    assert_eq!(query_as(&a, &format!("evil.example:{port}"), None)?, 403);
    assert_eq!(
        query_as(&a, &format!("fold.test:{port}"), None)?,
        403,
        "a name not configured this time"
    );
    terminate(&mut host)?;

    // A literal token on the command line is refused, with the flag to use instead.
    let o = run_command(&h, "wild", &store, Some(&wildcard))
        .args(["--query-token", "literal"])
        .output()?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("--query-token-file"), "{err}");
    Ok(())
}

/// One client: announces `len` body bytes to `path` and sends them — as fast as the host takes
/// them, or, with `pace`, 1 KiB per `pace` (a trickle) — until it has sent them all, `stop` is set,
/// or the host closes the connection.
fn body_client(
    addr: String,
    path: &'static str,
    len: usize,
    pace: Option<std::time::Duration>,
    stop: Arc<AtomicBool>,
) {
    let Ok(mut s) = TcpStream::connect(&addr) else {
        return;
    };
    let method = if path == "/status" { "GET" } else { "POST" };
    let head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {len}\r\n\r\n");
    if s.write_all(head.as_bytes()).is_err() {
        return;
    }
    let chunk = vec![b'x'; if pace.is_some() { 1024 } else { 64 * 1024 }];
    let mut sent = 0;
    while sent < len && !stop.load(Ordering::Relaxed) {
        let n = chunk.len().min(len - sent);
        if s.write_all(&chunk[..n]).is_err() {
            return;
        }
        sent += n;
        if let Some(p) = pace {
            std::thread::sleep(p);
        }
    }
}

async fn slow_clients_round(query_token: Option<&str>) -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("slow").await?;
    let tmp = tempfile::tempdir()?;
    let a = addr()?;
    let mut cmd = run_command(&h, "slow", &tmp.path().join("fold"), Some(&a));
    cmd.arg("--guest").arg(guest_wasm("kvstore"));
    if let Some(t) = query_token {
        let file = tmp.path().join("query-token");
        std::fs::write(&file, t)?;
        cmd.arg("--query-token-file").arg(file);
    }
    let mut host = cmd.stderr(Stdio::null()).spawn()?;
    let status = |a: String| async move {
        foldhost::serve::call_with_token(&a, "GET", "/status", b"", query_token).await
    };
    wait_until("the host to listen", || {
        std::net::TcpStream::connect(&a).is_ok()
    })
    .await?;

    // 64 clients, 16 on each route, each announcing a large body (the query ones the most a query
    // may have, 1 MiB): half send it as fast as the host reads, half trickle it. Read whole, the
    // fast ones alone would be 1.5 GiB.
    let stop = Arc::new(AtomicBool::new(false));
    let (mut fast, mut slow) = (Vec::new(), Vec::new());
    for i in 0..64 {
        let (path, len) = match i % 4 {
            0 => ("/status", 64 << 20),
            1 => ("/query", 1 << 20),
            2 => ("/swap", 64 << 20),
            _ => ("/export", 64 << 20),
        };
        let pace = (i % 8 >= 4).then(|| std::time::Duration::from_millis(20));
        let (a, stop) = (a.clone(), stop.clone());
        let client = std::thread::spawn(move || body_client(a, path, len, pace, stop));
        if pace.is_some() {
            slow.push(client);
        } else {
            fast.push(client);
        }
    }
    // A writer the fold must keep up with while they trickle.
    let written = Arc::new(AtomicU64::new(0));
    for i in 0..2000u64 {
        kv.put(&format!("k.{i:04}"), format!("v{i}").into()).await?;
        written.store(i + 1, Ordering::Relaxed);
        if i % 500 == 0 {
            let (code, body) = status(a.clone()).await?;
            assert_eq!(
                code,
                200,
                "/status answers: {}",
                String::from_utf8_lossy(&body)
            );
        }
    }
    let last = kv.positions().await?.last_sequence;
    loop {
        let (code, body) = status(a.clone()).await?;
        assert_eq!(code, 200);
        let s: StatusReport = serde_json::from_slice(&body)?;
        assert_eq!(s.state, "running", "{s:?}");
        if s.applied_through >= last {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // Every fast client has sent all it could (or was cut off) before the peak is read.
    for c in fast {
        let _ = c.join();
    }
    let peak = peak_rss(host.id())?;
    stop.store(true, Ordering::Relaxed);
    for c in slow {
        let _ = c.join();
    }
    terminate(&mut host)?;
    eprintln!(
        "query token {query_token:?}: peak RSS {} MiB with 64 clients announcing large bodies",
        peak >> 20
    );
    assert!(
        peak < 256 << 20,
        "peak RSS {} MiB with 64 clients announcing large bodies",
        peak >> 20
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_with_large_bodies_on_every_route_cannot_pin_memory_or_stop_the_fold()
-> anyhow::Result<()> {
    slow_clients_round(None).await?;
    slow_clients_round(Some("reader-token")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_holding_every_slot_cannot_lock_out_a_caller() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("idle").await?;
    kv.put("k", "v".into()).await?;
    let tmp = tempfile::tempdir()?;
    let a = addr()?;
    let mut host = run_command(&h, "idle", &tmp.path().join("fold"), Some(&a))
        .stderr(Stdio::null())
        .spawn()?;
    wait_status(&a, |s| s.applied_through >= 1).await?;
    // More idle connections than there are slots, each with half a head, all held open.
    let idle: Vec<TcpStream> = (0..300)
        .map(|_| {
            let mut s = TcpStream::connect(&a)?;
            s.write_all(b"GET /status HTTP/1.1\r\n")?;
            Ok(s)
        })
        .collect::<anyhow::Result<_>>()?;
    for _ in 0..3 {
        let (code, body) = foldhost::serve::call(&a, "GET", "/status", b"").await?;
        assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    }
    drop(idle);
    terminate(&mut host)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_failing_in_init_leaves_no_store_behind() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("initfail").await?;
    kv.put("k", "v".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let o = run_command(&h, "initfail", &store, None)
        .arg("--catch-up")
        .arg("--guest")
        .arg(guest_wasm("hostile_trap"))
        .args(["--guest-config", "fail_init=1"])
        .output()?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("fail_init"),
        "the error names the guest's reason: {err}"
    );
    assert!(
        !store.exists(),
        "nothing written: {} exists",
        store.display()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_listening_on_port_0_names_the_port_it_got_in_its_status_file_and_serves_there()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("anyport").await?;
    kv.put("k", "v".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let mut host = run_command(&h, "anyport", &store, Some("127.0.0.1:0"))
        .stderr(Stdio::null())
        .spawn()?;
    let pid = host.id();
    // This run's status file (its pid), naming where it listens.
    let mut named = None;
    wait_until("status.json names this run's listen address", || {
        named = foldhost_core::storedir::read_status(&store)
            .filter(|s| s.pid == pid)
            .and_then(|s| s.listen);
        named.is_some()
    })
    .await?;
    let a = named.ok_or_else(|| anyhow::anyhow!("no listen address"))?;
    let port: u16 = a
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no port in {a:?}"))?;
    assert_ne!(port, 0, "the bound port, not the one asked for: {a}");
    // The host answers there, and says the same.
    let s = wait_status(&a, |s| s.applied_through >= 1).await?;
    assert_eq!(s.pid, pid);
    assert_eq!(s.listen.as_deref(), Some(a.as_str()));
    // `status --store` prints it.
    let o = foldhost()
        .args(["status", "--store"])
        .arg(&store)
        .output()?;
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.lines()
            .any(|l| l.starts_with("listen:") && l.ends_with(&a)),
        "{text}"
    );
    assert!(terminate(&mut host)?.success());
    Ok(())
}
