//! `--log-format json` (docs/operations.md, "Log events"): every line a node writes parses as one JSON object
//! naming its `event` and the fold it belongs to; a deferral, a swap and a repair log the events
//! the table documents for them.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Stdio;

use foldhost_core::kv::KvWriter as _;
use foldhost_tests::*;
use serde_json::Value;

/// Every line of `text` as JSON, refusing one that does not parse, a host's line (target
/// `foldhost…`) that names no event, and a line that names no fold or another.
fn events(text: &str, fold: &str) -> anyhow::Result<Vec<Value>> {
    let mut out = Vec::new();
    for line in text.lines() {
        let v: Value = serde_json::from_str(line)
            .map_err(|e| anyhow::anyhow!("a log line that is not JSON ({e}): {line}"))?;
        let host = v["target"]
            .as_str()
            .is_some_and(|t| t.starts_with("foldhost"));
        anyhow::ensure!(
            v["event"].is_string() || !host,
            "a host's line naming no event: {line}"
        );
        anyhow::ensure!(
            v["level"].is_string() && v["timestamp"].is_string(),
            "{line}"
        );
        let folds: Vec<&Value> = v["spans"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|s| s["name"] == "fold")
            .map(|s| &s["fold"])
            .collect();
        // The fold's own lines name it in their span; its last one (`fold_stopped`) in a field.
        anyhow::ensure!(
            folds == [&Value::from(fold)] || v["fold"] == fold || !host,
            "a host's line naming no fold, or another: {line}"
        );
        out.push(v);
    }
    Ok(out)
}

fn names(lines: &[Value]) -> BTreeSet<String> {
    lines
        .iter()
        .filter_map(|v| v["event"].as_str().map(str::to_string))
        .collect()
}

/// `foldhost run --catch-up --log-format json` of `bucket` into `store`: its log.
fn catch_up_json(h: &Harness, bucket: &str, store: &Path) -> anyhow::Result<String> {
    let out = run_command(h, bucket, store, None)
        .args(["--catch-up", "--log-format", "json"])
        .env("FOLDHOST_LOG", "info,async_nats=warn")
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "catch-up failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stderr)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_json_log_line_parses_and_a_repair_logs_its_documented_events() -> anyhow::Result<()>
{
    let h = Harness::start().await?;
    let kv = h.bucket("jlog").await?;
    for k in ["a", "b", "c"] {
        kv.put(k, format!("{k}1").into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("node");
    let first = events(&catch_up_json(&h, "jlog", &store)?, "jlog")?;
    let seen = names(&first);
    for e in ["fold_started", "fold_caught_up"] {
        anyhow::ensure!(seen.contains(e), "{e} missing from {seen:?}");
    }
    // While the node is down its cursor falls out of the log (one value per key: the rewrites
    // drop b1 and c1, the purge a's put and its delete): the next start repairs.
    kv.delete("a").await?;
    kv.put("b", "b2".into()).await?;
    kv.put("c", "c2".into()).await?;
    let stream = kv.jetstream().get_stream("KV_jlog").await?;
    stream.purge().filter("$KV.jlog.a").await?;
    let first = kv.positions().await?.first_sequence;
    anyhow::ensure!(first > 4, "the cursor (3) is expired: first {first}");
    let second = events(&catch_up_json(&h, "jlog", &store)?, "jlog")?;
    let seen = names(&second);
    for e in ["repair_started", "repair_finished"] {
        anyhow::ensure!(seen.contains(e), "{e} missing from {seen:?}");
    }
    let finished = second
        .iter()
        .find(|v| v["event"] == "repair_finished")
        .ok_or_else(|| anyhow::anyhow!("no repair_finished"))?;
    anyhow::ensure!(
        finished["level"] == "WARN" && finished["kind"].is_string(),
        "{finished}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferral_and_a_swap_log_their_documented_events_as_json() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket_with_history("jdefer", 10).await?;
    kv.put("k.a", "a0".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let log = tmp.path().join("fold.log");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = run_command(&h, "jdefer", &store, Some(&addr))
        .arg("--guest")
        .arg(guest_wasm("kvstore"))
        .args(["--log-format", "json"])
        .env("FOLDHOST_LOG", "info,async_nats=warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    wait_status(&addr, |s| s.applied_through >= 1).await?;
    // kvstore 0.1.0 defers `fmt2:` values; 0.2.0 decodes them and releases what was retained.
    let deferred = kv.put("k.a", "fmt2:a1".into()).await?;
    let at = deferred.as_u64().unwrap_or(0);
    wait_status(&addr, |s| s.cursor >= Some(at) && s.retained == 1).await?;
    swap_to(&addr, "kvstore_v2", None)?;
    wait_status(&addr, |s| s.retained == 0 && s.applied_through >= at).await?;
    terminate(&mut host)?;
    let lines = events(&std::fs::read_to_string(&log)?, "jdefer")?;
    let seen = names(&lines);
    for e in [
        "fold_started",
        "record_deferred",
        "swap_started",
        "guest_swapped",
        "record_released",
    ] {
        anyhow::ensure!(seen.contains(e), "{e} missing from {seen:?}");
    }
    let d = lines
        .iter()
        .find(|v| v["event"] == "record_deferred")
        .ok_or_else(|| anyhow::anyhow!("no record_deferred"))?;
    anyhow::ensure!(
        d["records"] == 1 && d["first_key"] == "k.a",
        "the deferral names its record: {d}"
    );
    Ok(())
}
