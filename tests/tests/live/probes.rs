//! `GET /healthz`, `GET /readyz` and `GET /metrics`: a probe needs no token; a fold held behind by
//! a deferred record is not ready (the body names the fold and why), its `seq` and
//! `applied_through` differ in the metrics, and both come back once a guest version releases it.

use std::process::Stdio;

use foldhost_core::kv::KvWriter as _;
use foldhost_tests::*;

async fn get(addr: &str, path: &str) -> anyhow::Result<(u16, String)> {
    let (code, body) = foldhost::serve::call(addr, "GET", path, b"").await?;
    Ok((code, String::from_utf8_lossy(&body).into_owned()))
}

/// `GET /metrics` (with the query token), parsed as Prometheus parses it: `name{fold="…"}` → value.
async fn scrape(
    addr: &str,
    token: &str,
) -> anyhow::Result<std::collections::BTreeMap<String, f64>> {
    let (code, body) =
        foldhost::serve::call_with_token(addr, "GET", "/metrics", b"", Some(token)).await?;
    let text = String::from_utf8(body)?;
    anyhow::ensure!(code == 200, "/metrics: {code} {text}");
    let parsed = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))?;
    let mut out = std::collections::BTreeMap::new();
    for s in parsed.samples {
        let value = match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => continue,
        };
        if s.labels.get("fold") == Some("probes") && s.labels.get("state_bucket").is_none() {
            out.insert(s.metric, value);
        }
    }
    Ok(out)
}

/// Scrapes until `done` holds of the figures; returns them.
async fn scrape_until(
    addr: &str,
    token: &str,
    done: impl Fn(&std::collections::BTreeMap<String, f64>) -> bool,
) -> anyhow::Result<std::collections::BTreeMap<String, f64>> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let m = scrape(addr, token).await?;
        if done(&m) {
            return Ok(m);
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "never got there: {m:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Polls `path` until its status is `code`; returns the body.
async fn wait_for(addr: &str, path: &str, code: u16) -> anyhow::Result<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        // Refused connections are waited out too: the listener comes up after the store opens.
        let answer = get(addr, path).await;
        if let Ok((got, body)) = &answer
            && *got == code
        {
            return Ok(body.clone());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "{path} never answered {code}: {answer:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fold_held_behind_by_a_deferred_record_is_unready_and_says_so_in_metrics_and_status_watch_until_released()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket_with_history("probes", 10).await?;
    kv.put("k.a", "a0".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    // A query token: the probes answer without it, `/status` does not.
    let token = tmp.path().join("query-token");
    std::fs::write(&token, "p".repeat(64))?;
    let mut host = run_command(&h, "probes", &store, Some(&addr))
        .arg("--guest")
        .arg(guest_wasm("kvstore"))
        .args(["--ready-max-lag", "0", "--query-token-file"])
        .arg(&token)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let secret = "p".repeat(64);
    let before = the_probes_answer_without_the_token(&addr, &secret).await?;
    status_watch_prints_a_line_per_refresh(&addr, &token)?;
    a_deferred_record_holds_the_fold_behind(&kv, &addr, &secret, &before).await?;
    swap_to(&addr, "kvstore_v2", Some(&store.join("admin-token")))?;
    assert_eq!(
        wait_for(&addr, "/readyz", 200).await?,
        "ready: fold probes\n"
    );
    let released = scrape_until(&addr, &secret, |m| {
        m.get("foldhost_retained_records") == Some(&0.0)
    })
    .await?;
    anyhow::ensure!(
        released["foldhost_seq"] == released["foldhost_applied_through"]
            && released["foldhost_lag_seconds"] == 0.0,
        "{released:?}"
    );
    terminate(&mut host)?;
    Ok(())
}

/// The fold's metrics as scraped: name → value.
type Metrics = std::collections::BTreeMap<String, f64>;

/// The probes answer without the query token, `/status` and `/metrics` only with it (`secret`);
/// returns the first scrape, which names every fold metric.
async fn the_probes_answer_without_the_token(addr: &str, secret: &str) -> anyhow::Result<Metrics> {
    assert_eq!(wait_for(addr, "/healthz", 200).await?, "ok\n");
    let ready = wait_for(addr, "/readyz", 200).await?;
    assert_eq!(ready, "ready: fold probes\n");
    assert_eq!(
        get(addr, "/status").await?.0,
        401,
        "/status still needs its token"
    );
    assert_eq!(get(addr, "/metrics").await?.0, 401, "/metrics too");
    let before = scrape(addr, secret).await?;
    for name in [
        "foldhost_delivered_updates_total",
        "foldhost_applied_updates_total",
        "foldhost_batches_total",
        "foldhost_seq",
        "foldhost_applied_through",
        "foldhost_lag_records",
        "foldhost_lag_seconds",
    ] {
        anyhow::ensure!(before.contains_key(name), "{name} missing: {before:?}");
    }
    anyhow::ensure!(
        before["foldhost_seq"] == before["foldhost_applied_through"],
        "{before:?}"
    );
    Ok(before)
}

/// `status --watch`: a line per refresh, the fold's name, state and positions, the rate from the
/// second refresh on.
fn status_watch_prints_a_line_per_refresh(
    addr: &str,
    token: &std::path::Path,
) -> anyhow::Result<()> {
    // `status --watch`: a line per refresh, the fold's name, state and positions, the rate from
    // the second refresh on.
    let watch = foldhost()
        .args([
            "status",
            "--listen",
            addr,
            "--watch",
            "0.2",
            "--count",
            "2",
            "--token-file",
        ])
        .arg(token)
        .output()?;
    let text = String::from_utf8(watch.stdout)?;
    let lines: Vec<&str> = text.lines().collect();
    anyhow::ensure!(
        watch.status.success() && lines.len() == 2,
        "status --watch: {text}{}",
        String::from_utf8_lossy(&watch.stderr)
    );
    for (i, line) in lines.iter().enumerate() {
        let words: Vec<&str> = line.split_whitespace().collect();
        anyhow::ensure!(
            words.first() == Some(&"probes") && words.get(1) == Some(&"running"),
            "{line}"
        );
        anyhow::ensure!(
            line.contains("applied 1 ") && line.contains("lag 0 "),
            "{line}"
        );
        anyhow::ensure!(line.contains("kvstore@0.1.0"), "{line}");
        anyhow::ensure!(
            (i == 0) == line.contains(" - "),
            "the rate from the second on: {line}"
        );
    }
    Ok(())
}

/// kvstore 0.1.0 defers `fmt2:` values: the fold is held behind the record once it is committed
/// as retained, unready while the process answers, its metrics saying so against `before`.
async fn a_deferred_record_holds_the_fold_behind(
    kv: &foldhost_nats::NatsKv,
    addr: &str,
    secret: &str,
    before: &Metrics,
) -> anyhow::Result<()> {
    // kvstore 0.1.0 defers `fmt2:` values: the fold is held behind the record once it is
    // committed as retained.
    kv.put("k.a", "fmt2:a1".into()).await?;
    let held = scrape_until(addr, secret, |m| {
        m.get("foldhost_retained_records") == Some(&1.0)
    })
    .await?;
    let not_ready = wait_for(addr, "/readyz", 503).await?;
    assert!(
        not_ready.starts_with("not ready: fold probes: ") && not_ready.contains("records behind"),
        "{not_ready}"
    );
    assert_eq!(
        get(addr, "/healthz").await?.0,
        200,
        "the process still answers"
    );
    anyhow::ensure!(
        held["foldhost_seq"] > held["foldhost_applied_through"],
        "seq moves on over the deferred record, applied_through stays below it: {held:?}"
    );
    anyhow::ensure!(
        held["foldhost_delivered_updates_total"] > before["foldhost_delivered_updates_total"],
        "{before:?}\n{held:?}"
    );
    Ok(())
}
