//! Write answers under what a fleet does to them (docs/writes.md, "The operation ledger" and "When
//! a node cannot vouch for an id"), each against a real nats-server: a raw record cannot poison the
//! ledger, a retry is never published a second time where the fold passed records without rows or
//! where a restarted server forgot its first copy, a bucket's previous life answers nothing, an
//! operation id names one write, a retained record does not hold retries unknown, and a full bucket
//! is a refusal.

use std::time::Duration;

use foldhost_core::kv::{KvReader as _, KvWriter as _};
use foldhost_tests::*;

use crate::writes::{Node, pass_duplicate_window, short_duplicate_window};

/// A UUIDv7 text minted at `unix_ms` (random bits from the test's own counter).
fn op_id_at(unix_ms: u64, n: u8) -> String {
    let mut b = [n; 16];
    b[..6].copy_from_slice(&unix_ms.to_be_bytes()[2..]);
    b[6] = 0x70 | (b[6] & 0x0f);
    b[8] = 0x80 | (b[8] & 0x3f);
    foldhost_core::protocol::OpId::from_bytes(b)
        .map(|op| op.to_string())
        .unwrap_or_default()
}

/// How many accepted connections on local `port` hold bytes their server has not read yet, from
/// the kernel's table (`/proc/net/tcp`); `None` when it cannot be read.
fn unread_on_port(port: u16) -> Option<usize> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let local = format!(":{port:04X}");
    Some(
        table
            .lines()
            .skip(1)
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                // local_address, rem_address, st, tx_queue:rx_queue
                let (local_addr, state, queues) = (f.get(1)?, f.get(3)?, f.get(4)?);
                let rx = queues.split(':').nth(1)?;
                (local_addr.ends_with(&local)
                    && *state == "01"
                    && !rx.trim_start_matches('0').is_empty())
                .then_some(())
            })
            .count(),
    )
}

/// Releases a hold point when dropped (a held fold does not stop).
struct Release(std::path::PathBuf);

impl Drop for Release {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.0, "");
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Every record of the bucket's stream that carries `op_id`, by revision.
async fn records_of(
    kv: &foldhost_nats::NatsKv,
    bucket: &str,
    op_id: &str,
) -> anyhow::Result<Vec<u64>> {
    let last = kv.positions().await?.last_sequence;
    let stream = kv.jetstream().get_stream(format!("KV_{bucket}")).await?;
    let mut out = Vec::new();
    for seq in 1..=last {
        let Ok(m) = stream.direct_get(seq).await else {
            continue;
        };
        let carries = m
            .headers
            .get(foldhost_core::protocol::OP_ID_HEADER)
            .is_some_and(|v| v.as_str() == op_id);
        if carries {
            out.push(seq);
        }
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_record_whose_id_claims_a_far_future_instant_leaves_no_row_and_never_holds_writes_unknown()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("poison").await?;
    // Any bucket writer: one record whose id claims to be minted in the 25th century.
    let forged = op_id_at(16_000_000_000_000, 7);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(foldhost_core::protocol::OP_ID_HEADER, forged.as_str());
    let ack = kv
        .jetstream()
        .publish_with_headers("$KV.poison.k.raw", headers, "x".into())
        .await?
        .await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let retention = ["--ledger-retention", "1s"];
    let node = Node::start_with(&h, "poison", &store, &[], &retention).await?;
    wait_status(&node.addr, |s| s.applied_through >= ack.sequence).await?;
    drop(node);
    // Past the retention, a restart sweeps at once: a row of the forged id would carry the
    // watermark to its instant.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let node = Node::start_with(&h, "poison", &store, &[], &retention).await?;
    let swept = wait_status(&node.addr, |s| s.ledger_sweeps >= 1).await?;
    assert!(
        swept.ledger_watermark_unix_ms <= now_ms(),
        "the watermark never passes the sweep's clock: {}",
        swept.ledger_watermark_unix_ms
    );
    // Every write through the node is still answered: a fresh one, and one with its own id.
    let (code, fresh) = node
        .write(serde_json::json!({"key": "k.a", "value": "v"}))
        .await?;
    assert_eq!(
        (code, fresh.outcome.as_str()),
        (200, "applied"),
        "{fresh:?}"
    );
    let mine = op_id_at(now_ms(), 1);
    let (code, given) = node
        .write(serde_json::json!({"key": "k.b", "value": "v", "op_id": mine}))
        .await?;
    assert_eq!(
        (code, given.outcome.as_str()),
        (200, "applied"),
        "{given:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_op_id_with_another_value_or_a_delete_is_refused_naming_the_first_write()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("body").await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let node = Node::start(&h, "body", &store, &[]).await?;
    let op_id = op_id_at(now_ms(), 2);
    let (_, first) = node
        .write(serde_json::json!({"key": "k.a", "value": "v1", "op_id": op_id}))
        .await?;
    assert_eq!(first.outcome, "applied", "{first:?}");
    let last = kv.positions().await?.last_sequence;
    for other in [
        serde_json::json!({"key": "k.a", "value": "v2", "op_id": op_id}),
        serde_json::json!({"key": "k.a", "op": "delete", "op_id": op_id}),
    ] {
        let (code, again) = node.write(other.clone()).await?;
        assert_eq!(
            (code, again.outcome.as_str(), again.reason.as_deref()),
            (409, "refused", Some("op_reused")),
            "{other}: {again:?}"
        );
        assert_eq!(
            (again.key.as_deref(), again.revision),
            (Some("k.a"), first.revision),
            "it names the first write"
        );
    }
    // The same write again is the same write: answered, not refused.
    let (code, same) = node
        .write(serde_json::json!({"key": "k.a", "value": "v1", "op_id": op_id}))
        .await?;
    assert_eq!((code, same.revision), (200, first.revision), "{same:?}");
    assert_eq!(
        kv.positions().await?.last_sequence,
        last,
        "published nothing"
    );
    assert_eq!(
        kv.entry("k.a").await?.map(|e| e.value),
        Some("v1".into()),
        "the first write stands"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_a_write_that_landed_before_a_nodes_state_sync_start_is_unknown_and_never_published_again()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket_with_history("sync", 8).await?;
    short_duplicate_window(&kv, "sync").await?;
    let tmp = tempfile::tempdir()?;
    let a = Node::start(&h, "sync", &tmp.path().join("a"), &[]).await?;
    let op_id = op_id_at(now_ms(), 3);
    let (_, first) = a
        .write(serde_json::json!({"key": "k.a", "value": "v1", "op_id": op_id}))
        .await?;
    assert_eq!(first.outcome, "applied", "{first:?}");
    // Another write over it: a state-sync start delivers only the key's newest record.
    kv.put("k.a", "v2".into()).await?;
    drop(a);
    pass_duplicate_window().await;
    // A node started from an empty store passes the first record without its row.
    let (b, mut logs) = Node::start_logged(&h, "sync", &tmp.path().join("b"), &[]).await?;
    let last = kv.positions().await?.last_sequence;
    wait_status(&b.addr, |s| s.applied_through >= last).await?;
    let (code, again) = b
        .write(serde_json::json!({"key": "k.a", "value": "v1", "op_id": op_id}))
        .await?;
    assert_eq!(
        (code, again.outcome.as_str()),
        (503, "unknown"),
        "{again:?}"
    );
    assert!(
        again
            .message
            .as_deref()
            .is_some_and(|m| m.contains("horizon")),
        "{again:?}"
    );
    assert_eq!(
        kv.positions().await?.last_sequence,
        last,
        "published nothing"
    );
    assert_eq!(
        records_of(&kv, "sync", &op_id).await?.len(),
        1,
        "one record of the id"
    );
    // The log says why: the id, its mint instant and the horizon.
    let line = logs.wait_for("write_unvouched")?;
    assert!(
        line.contains(&op_id)
            && line.contains("minted_unix_ms")
            && line.contains("horizon_unix_ms"),
        "{line}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_a_recreated_buckets_previous_life_never_answer_for_the_new_one()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("life").await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let relist = ["--on-recreated", "relist"];
    let node = Node::start_with(&h, "life", &store, &[], &relist).await?;
    let op_id = op_id_at(now_ms(), 4);
    let (_, first) = node
        .write(serde_json::json!({"key": "k.a", "value": "v", "op_id": op_id}))
        .await?;
    assert_eq!(first.outcome, "applied", "{first:?}");
    drop(node);
    // The bucket deleted and made again: its stream counts from 1, and holds other records.
    kv.jetstream().delete_stream("KV_life").await?;
    let kv = h.bucket("life").await?;
    for i in 0..3 {
        kv.put(&format!("k.other{i}"), "x".into()).await?;
    }
    let node = Node::start_with(&h, "life", &store, &[], &relist).await?;
    let (code, again) = node
        .write(serde_json::json!({"key": "k.a", "value": "v", "op_id": op_id}))
        .await?;
    // The old row names a revision this stream never held for the key: it is no answer. The
    // write is decided afresh, and whatever it answers is true of this stream.
    match again.outcome.as_str() {
        "applied" | "pending" => {
            let revision = again.revision.unwrap_or(0);
            assert_eq!(
                records_of(&kv, "life", &op_id).await?,
                vec![revision],
                "its answer names this stream's record of the id: {again:?}"
            );
            assert_eq!(kv.entry("k.a").await?.map(|e| e.value), Some("v".into()));
        }
        "unknown" => assert!(
            records_of(&kv, "life", &op_id).await?.is_empty(),
            "{again:?}"
        ),
        _ => anyhow::bail!("HTTP {code}: {again:?}"),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_record_pinning_applied_through_does_not_hold_an_old_ids_write_unknown()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("pin").await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let guest = guest_wasm("kvstore");
    let guest_arg = guest.to_string_lossy().to_string();
    let node = Node::start_with(&h, "pin", &store, &[], &["--guest", &guest_arg]).await?;
    // A record this guest defers: retained, applied_through stays below it for good.
    let pinned = kv.put("k.deferred", "fmt2:x".into()).await?;
    let pinned = pinned.as_u64().unwrap_or(0);
    let s = wait_status(&node.addr, |s| s.retained >= 1).await?;
    assert!(s.applied_through < pinned, "{s:?}");
    // A write under an id minted ten minutes ago (a caller's first attempt, or a retry of
    // nothing): nothing of it is on the log, the fold's rows cover the key.
    let old = op_id_at(now_ms() - 600_000, 5);
    let (code, answer) = node
        .write(serde_json::json!({"key": "k.b", "value": "v", "op_id": old, "wait_ms": 100}))
        .await?;
    assert_ne!(answer.outcome, "unknown", "HTTP {code}: {answer:?}");
    assert_eq!(
        records_of(&kv, "pin", &old).await?,
        vec![answer.revision.unwrap_or(0)],
        "{answer:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_to_a_full_bucket_is_refused_bucket_full_and_publishes_nothing()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h
        .conn
        .bucket(
            "full",
            &foldhost_core::bucket::BucketConfig {
                max_bytes: Some(4096),
                ..foldhost_core::bucket::BucketConfig::default()
            },
        )
        .await?;
    let value = "x".repeat(200);
    let mut filled = false;
    for i in 0..100 {
        if kv
            .put(&format!("k.fill{i}"), value.clone().into())
            .await
            .is_err()
        {
            filled = true;
            break;
        }
    }
    assert!(filled, "the bucket never filled");
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let node = Node::start(&h, "full", &store, &[]).await?;
    let last = kv.positions().await?.last_sequence;
    let (code, answer) = node
        .write(serde_json::json!({"key": "k.new", "value": value}))
        .await?;
    assert_eq!(
        (code, answer.outcome.as_str(), answer.reason.as_deref()),
        (507, "refused", Some("bucket_full")),
        "{answer:?}"
    );
    assert_eq!(
        kv.positions().await?.last_sequence,
        last,
        "published nothing"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_right_after_an_applied_write_sees_it_while_the_query_instance_is_a_round_behind()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    // An empty bucket: the write below is the fold's first batch once the query instance is
    // level, so the hold below is passed first right after it.
    h.bucket("race").await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let hold = tmp.path().join("round");
    let guest = guest_wasm("kvstore").to_string_lossy().to_string();
    // The fold commits the write and answers it applied, then is held before it hands the query
    // instance its round: the instance still holds the state before the write.
    let env = [(
        foldhost_core::crashpoint::HOLD_ENV,
        format!(
            "{}:{}",
            foldhost_core::crashpoint::QUERY_ROUND,
            hold.display()
        ),
    )];
    let node = Node::start_with(&h, "race", &store, &env, &["--guest", &guest]).await?;
    // Whatever happens below, the fold is released before the node is stopped (dropped first).
    let _release = Release(hold.with_extension("release"));
    wait_status(&node.addr, |s| {
        s.query_instance_revision.is_some() && s.query_instance_revision == Some(s.applied_through)
    })
    .await?;
    let (code, written) = node
        .write(serde_json::json!({"key": "k0", "value": "new"}))
        .await?;
    assert_eq!(
        (code, written.outcome.as_str()),
        (200, "applied"),
        "{written:?}"
    );
    let reached = hold.with_extension("reached");
    wait_until("the hold before the round", || reached.exists()).await?;
    let addr = node.addr.clone();
    let read =
        tokio::spawn(async move { foldhost::serve::call(&addr, "POST", "/query", b"k0").await });
    // The read is either answered already (from the instance's old state: the defect) or waits
    // for the instance to reach the write; either way the round may go now.
    let status_addr = node.addr.clone();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the read neither finished nor waited"
        );
        if read.is_finished() {
            break;
        }
        let s = wait_status(&status_addr, |_| true).await?;
        if s.queries_waited_for_level >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    std::fs::write(hold.with_extension("release"), "")?;
    let (code, body) = read.await??;
    assert_eq!(
        (code, String::from_utf8_lossy(&body).to_string()),
        (200, "new".to_string()),
        "a read after an applied write answered from a state before it"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_reads_held_waiting_for_a_revision_never_lock_out_probes_writes_or_status()
-> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let h = Harness::start().await?;
    h.bucket("held").await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let node = Node::start(&h, "held", &store, &[]).await?;
    // Any local user: reads that wait a minute for a revision the bucket will not reach, more
    // than the listener has connection slots.
    let mut held = Vec::new();
    for _ in 0..300 {
        let mut sock = tokio::net::TcpStream::connect(&node.addr).await?;
        let request = format!(
            "POST /get HTTP/1.1\r\nHost: {}\r\nFoldhost-Min-Revision: 1000000\r\nFoldhost-Wait-Ms: 60000\r\nContent-Length: 3\r\n\r\nk.a",
            node.addr
        );
        // A connection the node closed for a newer one (every slot taken) is one held read less.
        let _ = sock.write_all(request.as_bytes()).await;
        held.push(tokio::spawn(async move {
            let mut buf = Vec::new();
            let _ = sock.read_to_end(&mut buf).await;
        }));
    }
    // Once the node has read every request sent to it (no accepted connection of its port holds
    // unread bytes: the kernel's own count), every slot it will hold is held.
    let port = node
        .addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse::<u16>().ok())
        .ok_or_else(|| anyhow::anyhow!("no port in {}", node.addr))?;
    // A node that stops taking connections never gets there: the bound only tells "taken" from
    // "locked out", as the probes' below.
    let bound = std::time::Instant::now() + Duration::from_secs(20);
    while unread_on_port(port).is_none_or(|n| n != 0) {
        anyhow::ensure!(
            std::time::Instant::now() < bound,
            "locked out: {:?} connections' requests are never read",
            unread_on_port(port)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Probes, a write and the operator's status are still answered, long before the reads' wait
    // is over (the bound here only tells "answered" from "locked out").
    let deadline = Duration::from_secs(20);
    for (method, path) in [("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/status")] {
        let (code, body) =
            foldhost::serve::call_with_deadline(&node.addr, method, path, b"", None, deadline)
                .await
                .map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
        assert!(
            code == 200 || (path == "/readyz" && code == 503),
            "{path}: HTTP {code}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    let (code, written) = tokio::time::timeout(
        deadline,
        node.write(serde_json::json!({"key": "k.a", "value": "v"})),
    )
    .await
    .map_err(|_| anyhow::anyhow!("the write was locked out"))??;
    assert_eq!(
        (code, written.outcome.as_str()),
        (200, "applied"),
        "{written:?}"
    );
    for t in held {
        t.abort();
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_compare_and_set_whose_first_copy_landed_is_answered_as_it_not_refused()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket_with_history("cas", 8).await?;
    let start = kv.put("k.a", "v0".into()).await?.as_u64().unwrap_or(0);
    let tmp = tempfile::tempdir()?;
    let a = Node::start(&h, "cas", &tmp.path().join("a"), &[]).await?;
    let op_id = op_id_at(now_ms(), 6);
    let cas =
        serde_json::json!({"key": "k.a", "value": "v1", "op_id": op_id, "if_revision": start});
    let (_, first) = a.write(cas.clone()).await?;
    assert_eq!(first.outcome, "applied", "{first:?}");
    // The key moves on; a node started from an empty store holds no row of the first write.
    kv.put("k.a", "v2".into()).await?;
    drop(a);
    let b = Node::start(&h, "cas", &tmp.path().join("b"), &[]).await?;
    let last = kv.positions().await?.last_sequence;
    wait_status(&b.addr, |s| s.applied_through >= last).await?;
    // The broker refuses the retry's revision before its duplicate window could collapse it:
    // the retry is still the write that won.
    let (code, again) = b.write(cas).await?;
    assert_eq!(
        (code, again.outcome.as_str(), again.revision),
        (200, "applied", first.revision),
        "{again:?}"
    );
    assert_eq!(
        kv.positions().await?.last_sequence,
        last,
        "published nothing"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_whose_first_copy_was_superseded_before_a_lagging_node_read_it_is_never_published_again()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    // One revision a key: a record superseded before a watch reads it is gone from the stream.
    let kv = h.bucket("gone").await?;
    short_duplicate_window(&kv, "gone").await?;
    kv.put("k.z", "first".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store_b = tmp.path().join("b");
    // Node B folds, then stops: it lags from here.
    let b = Node::start(&h, "gone", &store_b, &[]).await?;
    let folded = kv.positions().await?.last_sequence;
    wait_status(&b.addr, |s| s.applied_through >= folded).await?;
    drop(b);
    // Through node A, a write lands; another writer supersedes it before B reads it.
    let a = Node::start(&h, "gone", &tmp.path().join("a"), &[]).await?;
    let op_id = op_id_at(now_ms(), 8);
    let (_, first) = a
        .write(serde_json::json!({"key": "k.a", "value": "v1", "op_id": op_id}))
        .await?;
    assert_eq!(first.outcome, "applied", "{first:?}");
    kv.put("k.a", "v2".into()).await?;
    drop(a);
    pass_duplicate_window().await;
    // B resumes from its cursor: its watch never sees the first copy, so no row says it landed.
    let b = Node::start(&h, "gone", &store_b, &[]).await?;
    let last = kv.positions().await?.last_sequence;
    wait_status(&b.addr, |s| s.applied_through >= last).await?;
    // Past the broker's window (and 30 s past its mint instant), a retry through B.
    let (code, again) = b
        .write(serde_json::json!({"key": "k.a", "value": "v1", "op_id": op_id, "wait_ms": 100}))
        .await?;
    assert_eq!(
        kv.positions().await?.last_sequence,
        last,
        "published again: HTTP {code} {again:?}"
    );
    assert_eq!(again.outcome, "unknown", "HTTP {code}: {again:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_whose_first_copy_a_restarted_server_forgot_is_unknown_and_never_published_again()
-> anyhow::Result<()> {
    let mut h = Harness::start().await?;
    // Two revisions a key, and a duplicate window far longer than the test: the retry below is
    // well inside it, where the window alone would have vouched for it.
    let kv = h.bucket_with_history("forgot", 2).await?;
    let js = kv.jetstream();
    let mut config = js
        .get_stream("KV_forgot")
        .await?
        .cached_info()
        .config
        .clone();
    config.duplicate_window = std::time::Duration::from_secs(3600);
    js.update_stream(config).await?;
    let tmp = tempfile::tempdir()?;
    let a = Node::start(&h, "forgot", &tmp.path().join("a"), &[]).await?;
    let op_id = op_id_at(now_ms(), 9);
    let (_, first) = a
        .write(serde_json::json!({"key": "k.a", "value": "v1", "op_id": op_id}))
        .await?;
    assert_eq!(first.outcome, "applied", "{first:?}");
    drop(a);
    // The first copy is superseded past the key's history: the stream no longer stores it.
    kv.put("k.a", "v2".into()).await?;
    kv.put("k.a", "v3".into()).await?;
    assert_eq!(records_of(&kv, "forgot", &op_id).await?, Vec::<u64>::new());
    // Killed and restarted, the server rebuilds its duplicate window from what it stores.
    h.server.restart()?;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let last = loop {
        match kv.positions().await {
            Ok(p) => break p.last_sequence,
            Err(e) => {
                anyhow::ensure!(
                    std::time::Instant::now() < deadline,
                    "the server never came back: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    // A node started from an empty store has no row of the id.
    let b = Node::start(&h, "forgot", &tmp.path().join("b"), &[]).await?;
    wait_status(&b.addr, |s| s.applied_through >= last).await?;
    let (code, again) = b
        .write(serde_json::json!({"key": "k.a", "value": "v1", "op_id": op_id}))
        .await?;
    assert_eq!(
        kv.positions().await?.last_sequence,
        last,
        "published again: HTTP {code} {again:?}"
    );
    assert_eq!(
        (code, again.outcome.as_str()),
        (503, "unknown"),
        "{again:?}"
    );
    Ok(())
}
