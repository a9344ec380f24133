//! Writes through a host (docs/writes.md): every answer applied, pending, unknown or refused, from
//! a real situation against a real nats-server, the CLI's exit code per outcome, and retries
//! answered from the operation ledger without publishing.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use foldhost::write::WriteAnswer;
use foldhost_core::kv::{KvReader as _, KvWriter as _};
use foldhost_tests::*;

/// The write token every test node is given.
const TOKEN: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// A node folding `bucket` with `--listen` on a reserved port, its write token in a file the test
/// chose; waits until it serves.
pub(crate) struct Node {
    child: std::process::Child,
    pub(crate) addr: String,
    token: String,
}

impl Node {
    pub(crate) async fn start(
        h: &Harness,
        bucket: &str,
        store: &Path,
        env: &[(&str, String)],
    ) -> anyhow::Result<Node> {
        Node::start_with(h, bucket, store, env, &[]).await
    }

    /// [`Node::start`] with more arguments.
    pub(crate) async fn start_with(
        h: &Harness,
        bucket: &str,
        store: &Path,
        env: &[(&str, String)],
        args: &[&str],
    ) -> anyhow::Result<Node> {
        Node::start_on(&h.url(), bucket, store, env, args).await
    }

    /// [`Node::start_with`] on the server at `nats` (a proxy in front of the test's, say).
    async fn start_on(
        nats: &str,
        bucket: &str,
        store: &Path,
        env: &[(&str, String)],
        args: &[&str],
    ) -> anyhow::Result<Node> {
        let (mut cmd, addr) = Node::command(nats, bucket, store, env, args)?;
        let child = cmd.stderr(Stdio::null()).spawn()?;
        Node::running(child, addr).await
    }

    /// [`Node::start_with`], its log (warnings and up) read line by line.
    pub(crate) async fn start_logged(
        h: &Harness,
        bucket: &str,
        store: &Path,
        args: &[&str],
    ) -> anyhow::Result<(Node, LogLines)> {
        let (cmd, addr) = Node::command(&h.url(), bucket, store, &[], args)?;
        let (child, logs) = spawn_logged(cmd)?;
        Ok((Node::running(child, addr).await?, logs))
    }

    /// The `foldhost run` of a node, and the address it will listen on.
    fn command(
        nats: &str,
        bucket: &str,
        store: &Path,
        env: &[(&str, String)],
        args: &[&str],
    ) -> anyhow::Result<(std::process::Command, String)> {
        let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
        std::fs::write(store.with_extension("write-token"), TOKEN)?;
        let mut cmd = foldhost();
        cmd.args(["run", "--bucket", bucket, "--nats", nats, "--store"])
            .arg(store)
            .args(["--listen", &addr])
            .arg("--write-token-file")
            .arg(store.with_extension("write-token"))
            .args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Ok((cmd, addr))
    }

    /// `child` once it serves on `addr`.
    async fn running(child: std::process::Child, addr: String) -> anyhow::Result<Node> {
        let node = Node {
            child,
            addr,
            token: TOKEN.into(),
        };
        // Dropped on a failed start: the child goes with it.
        wait_status(&node.addr, |s| s.state == "running").await?;
        Ok(node)
    }

    /// `POST /write` with `body` (JSON): the HTTP status and the answer.
    pub(crate) async fn write(
        &self,
        body: serde_json::Value,
    ) -> anyhow::Result<(u16, WriteAnswer)> {
        let (code, answer) = foldhost::serve::call_with_token(
            &self.addr,
            "POST",
            "/write",
            body.to_string().as_bytes(),
            Some(&self.token),
        )
        .await?;
        let parsed = serde_json::from_slice(&answer).map_err(|e| {
            anyhow::anyhow!("HTTP {code}: {e}: {}", String::from_utf8_lossy(&answer))
        })?;
        Ok((code, parsed))
    }
}

/// Shortens `bucket`'s duplicate window to a second, so a test can pass it.
pub(crate) async fn short_duplicate_window(
    kv: &foldhost_nats::NatsKv,
    bucket: &str,
) -> anyhow::Result<()> {
    let js = kv.jetstream();
    let mut config = js
        .get_stream(format!("KV_{bucket}"))
        .await?
        .cached_info()
        .config
        .clone();
    config.duplicate_window = Duration::from_secs(1);
    js.update_stream(config).await?;
    Ok(())
}

/// Waits past a one-second duplicate window (a precondition, not a synchronisation: waiting
/// longer changes nothing): the broker no longer collapses an id sent before.
pub(crate) async fn pass_duplicate_window() {
    tokio::time::sleep(Duration::from_millis(1500)).await;
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = terminate(&mut self.child);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_through_the_host_is_applied_at_its_revision_and_the_fold_holds_it()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("w").await?;
    kv.put("k.before", "x".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let node = Node::start(&h, "w", &store, &[]).await?;
    // Through the CLI: one JSON line, exit code 0 for applied.
    let out = foldhost()
        .args([
            "put",
            "k.a",
            "hello",
            "--listen",
            &node.addr,
            "--write-token-file",
        ])
        .arg(store.with_extension("write-token"))
        .output()?;
    let answer: WriteAnswer = serde_json::from_slice(&out.stdout)?;
    assert_eq!(out.status.code(), Some(0), "{answer:?}");
    assert_eq!(answer.outcome, "applied");
    let revision = answer
        .revision
        .expect("an applied write names its revision");
    assert!(answer.op_id.is_some(), "the host minted an operation id");
    // Durable at that revision on the bucket, and already in the fold: "a read right after sees
    // it" — the store is read while the node runs.
    let entry = kv.entry("k.a").await?.expect("on the bucket");
    assert_eq!(
        (entry.value.as_ref(), entry.version.as_u64()),
        (&b"hello"[..], Some(revision))
    );
    let dump = dump_store(&store)?;
    assert_eq!(dump.get("k.a"), Some(&(b"hello".to_vec(), revision)));
    // A delete answers the same way (exit 0), and the fold loses the key.
    let out = foldhost()
        .args([
            "delete",
            "k.a",
            "--listen",
            &node.addr,
            "--write-token-file",
        ])
        .arg(store.with_extension("write-token"))
        .output()?;
    let answer: WriteAnswer = serde_json::from_slice(&out.stdout)?;
    assert_eq!(
        (out.status.code(), answer.outcome.as_str()),
        (Some(0), "applied")
    );
    assert_eq!(dump_store(&store)?.get("k.a"), None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_the_fold_has_not_applied_is_pending_and_its_retry_is_answered_from_the_ledger()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("p").await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let hold = tmp.path().join("hold");
    let node = Node::start(
        &h,
        "p",
        &store,
        &[(
            foldhost_core::crashpoint::HOLD_ENV,
            format!(
                "{}:{}",
                foldhost_core::crashpoint::FOLD_LEDGER_COMMIT,
                hold.display()
            ),
        )],
    )
    .await?;
    let (code, first) = node
        .write(serde_json::json!({"key": "k.a", "value": "v1", "wait_ms": 200}))
        .await?;
    // Durable, held before the commit that applies it: pending, with its revision and the lag.
    assert_eq!(
        (code, first.outcome.as_str()),
        (202, "pending"),
        "{first:?}"
    );
    let revision = first.revision.expect("pending names the revision");
    let lag = first.lag.expect("pending names the lag");
    assert!(lag.records >= 1 && lag.seconds >= 1, "{lag:?}");
    assert!(hold.with_extension("reached").exists(), "the fold is held");
    let last = kv.positions().await?.last_sequence;
    // Released, the fold applies it; the same write asked again is answered applied at the
    // first revision, and nothing is published.
    std::fs::write(hold.with_extension("release"), "")?;
    wait_status(&node.addr, |s| s.applied_through >= revision).await?;
    let op_id = first.op_id.clone().expect("the id");
    let (code, again) = node
        .write(serde_json::json!({"key": "k.a", "value": "v1", "op_id": op_id}))
        .await?;
    assert_eq!(
        (code, again.outcome.as_str()),
        (200, "applied"),
        "{again:?}"
    );
    assert_eq!(again.revision, Some(revision));
    assert_eq!(
        kv.positions().await?.last_sequence,
        last,
        "published nothing"
    );
    assert_eq!(
        kv.entry("k.a").await?.map(|e| e.value),
        Some("v1".into()),
        "the first copy stands"
    );
    // The same id sent for another key: refused, naming where it landed.
    let (code, reused) = node
        .write(serde_json::json!({"key": "k.b", "value": "x", "op_id": op_id}))
        .await?;
    assert_eq!((code, reused.reason.as_deref()), (409, Some("op_reused")));
    assert_eq!(
        (reused.key.as_deref(), reused.revision),
        (Some("k.a"), Some(revision))
    );
    assert_eq!(
        kv.positions().await?.last_sequence,
        last,
        "published nothing"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_the_brokers_duplicate_window_is_answered_applied_and_publishes_nothing()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("d").await?;
    short_duplicate_window(&kv, "d").await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let node = Node::start(&h, "d", &store, &[]).await?;
    let (_, first) = node
        .write(serde_json::json!({"key": "k.a", "value": "v"}))
        .await?;
    assert_eq!(first.outcome, "applied", "{first:?}");
    let op_id = first.op_id.clone().expect("the id");
    // Past the window only the ledger stands between a retry and a second record.
    pass_duplicate_window().await;
    let last = kv.positions().await?.last_sequence;
    let (code, again) = node
        .write(serde_json::json!({"key": "k.a", "value": "v", "op_id": op_id}))
        .await?;
    assert_eq!((code, again.outcome.as_str()), (200, "applied"));
    assert_eq!(again.revision, first.revision);
    assert_eq!(
        kv.positions().await?.last_sequence,
        last,
        "published nothing"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_racing_a_compare_and_set_one_applies_and_the_other_conflicts_naming_it()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("c").await?;
    let start = kv
        .put("k.a", "v0".into())
        .await?
        .as_u64()
        .expect("a revision");
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let node = Node::start(&h, "c", &store, &[]).await?;
    let ask = |value: &'static str| {
        node.write(serde_json::json!({"key": "k.a", "value": value, "if_revision": start}))
    };
    let (a, b) = tokio::join!(ask("a"), ask("b"));
    let (a, b) = (a?, b?);
    let (won, lost) = match (a.1.outcome.as_str(), b.1.outcome.as_str()) {
        ("applied", "refused") => (a, b),
        ("refused", "applied") => (b, a),
        _ => anyhow::bail!("exactly one applies: {a:?} {b:?}"),
    };
    assert_eq!(lost.0, 409);
    assert_eq!(lost.1.reason.as_deref(), Some("conflict"));
    assert_eq!(
        lost.1.revision, won.1.revision,
        "the conflict names the winner's revision"
    );
    // A compare-and-set at a stale revision through the CLI: exit code 5, refused.
    let out = foldhost()
        .args(["put", "k.a", "late", "--if-revision", &start.to_string()])
        .args(["--listen", &node.addr, "--write-token-file"])
        .arg(store.with_extension("write-token"))
        .output()?;
    let answer: WriteAnswer = serde_json::from_slice(&out.stdout)?;
    assert_eq!(
        (out.status.code(), answer.reason.as_deref()),
        (Some(5), Some("conflict"))
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_writes_are_refused_naming_what_and_publish_nothing() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("b").await?;
    kv.put("k.a", "x".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let node = Node::start(&h, "b", &store, &[]).await?;
    let last = kv.positions().await?.last_sequence;
    let cases = [
        (serde_json::json!({"key": "bad key"}), 400, "invalid"),
        (
            serde_json::json!({"key": "k.a", "value": "x", "value_base64": "eA=="}),
            400,
            "invalid",
        ),
        (
            serde_json::json!({"key": "k.a", "value": "x", "op_id": "1b4e28ba-2fa1-41d2-883f-0016d3cca427"}),
            400,
            "invalid",
        ),
        (
            serde_json::json!({"key": "k.a", "value": "x", "bucket": "other"}),
            422,
            "not_folded",
        ),
        (
            serde_json::json!({"key": "k.a", "value": "x", "wait_ms": 3_600_000}),
            400,
            "invalid",
        ),
        (
            serde_json::json!({"key": "k.a", "op": "delete", "value": "x"}),
            400,
            "invalid",
        ),
        (
            serde_json::json!({"key": "k.a", "value": "x", "extra": 1}),
            400,
            "invalid",
        ),
    ];
    for (body, status, reason) in cases {
        let (code, answer) = node.write(body.clone()).await?;
        assert_eq!(
            (code, answer.outcome.as_str(), answer.reason.as_deref()),
            (status, "refused", Some(reason)),
            "{body}: {answer:?}"
        );
        assert!(answer.message.is_some(), "{body}: a refusal says why");
    }
    // Too large for the server's payload: refused before publishing.
    let big = "x".repeat(2 * 1024 * 1024);
    let (code, answer) = node
        .write(serde_json::json!({"key": "k.a", "value": big}))
        .await?;
    assert_eq!((code, answer.reason.as_deref()), (413, Some("too_large")));
    // Without the write token (or with the admin token): 401, nothing read.
    let (code, _) = foldhost::serve::call_with_token(
        &node.addr,
        "POST",
        "/write",
        br#"{"key":"k.a","value":"y"}"#,
        None,
    )
    .await?;
    assert_eq!(code, 401);
    assert_eq!(
        kv.positions().await?.last_sequence,
        last,
        "published nothing"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_op_id_older_than_the_swept_ledger_is_unknown_and_publishes_nothing()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("s").await?;
    short_duplicate_window(&kv, "s").await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let retention = ["--ledger-retention", "1s"];
    let node = Node::start_with(&h, "s", &store, &[], &retention).await?;
    let (_, first) = node
        .write(serde_json::json!({"key": "k.a", "value": "v"}))
        .await?;
    assert_eq!(first.outcome, "applied", "{first:?}");
    let op_id = first.op_id.clone().expect("the id");
    drop(node);
    // Past the retention (and the broker's window), a restart sweeps the row at once.
    pass_duplicate_window().await;
    let node = Node::start_with(&h, "s", &store, &[], &retention).await?;
    let swept = wait_status(&node.addr, |s| s.ledger_sweeps >= 1).await?;
    assert!(swept.ledger_watermark_unix_ms > 0, "{swept:?}");
    let last = kv.positions().await?.last_sequence;
    let (code, again) = node
        .write(serde_json::json!({"key": "k.a", "value": "v", "op_id": op_id}))
        .await?;
    assert_eq!(
        (code, again.outcome.as_str()),
        (503, "unknown"),
        "{again:?}"
    );
    assert_eq!(
        kv.positions().await?.last_sequence,
        last,
        "published nothing"
    );
    // A new operation is written as ever.
    let (_, new) = node
        .write(serde_json::json!({"key": "k.a", "value": "w"}))
        .await?;
    assert_eq!(new.outcome, "applied", "{new:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_bootstrapped_from_an_artifact_answers_a_retry_its_donor_applied()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("a").await?;
    short_duplicate_window(&kv, "a").await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let donor = Node::start(&h, "a", &store, &[]).await?;
    let (_, first) = donor
        .write(serde_json::json!({"key": "k.a", "value": "v"}))
        .await?;
    assert_eq!(first.outcome, "applied", "{first:?}");
    let art = tmp.path().join("art");
    let out = foldhost()
        .args(["export", "--listen", &donor.addr, "--out"])
        .arg(&art)
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(donor);
    let joined = tmp.path().join("joined");
    let out = foldhost()
        .args(["import", "--artifact"])
        .arg(&art)
        .arg("--store")
        .arg(&joined)
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    pass_duplicate_window().await;
    let node = Node::start(&h, "a", &joined, &[]).await?;
    let last = kv.positions().await?.last_sequence;
    let (code, again) = node
        .write(serde_json::json!({"key": "k.a", "value": "v", "op_id": first.op_id}))
        .await?;
    assert_eq!(
        (code, again.outcome.as_str()),
        (200, "applied"),
        "{again:?}"
    );
    assert_eq!(again.revision, first.revision);
    assert_eq!(
        kv.positions().await?.last_sequence,
        last,
        "published nothing"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_with_a_minimum_revision_waits_for_the_fold_and_past_its_bound_is_behind()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("r").await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let hold = tmp.path().join("hold");
    let node = Node::start(
        &h,
        "r",
        &store,
        &[(
            foldhost_core::crashpoint::HOLD_ENV,
            format!(
                "{}:{}",
                foldhost_core::crashpoint::FOLD_LEDGER_COMMIT,
                hold.display()
            ),
        )],
    )
    .await?;
    let (_, pending) = node
        .write(serde_json::json!({"key": "k.a", "value": "v", "wait_ms": 0}))
        .await?;
    let revision = pending.revision.expect("a revision");
    assert_eq!(pending.outcome, "pending", "{pending:?}");
    let get = |min: u64, wait_ms: u64| {
        foldhost()
            .args(["get", "k.a", "--listen", &node.addr, "--min-revision"])
            .arg(min.to_string())
            .arg("--wait-ms")
            .arg(wait_ms.to_string())
            .output()
    };
    // Held: past its bound (none) the read is behind (exit 3), with a positive
    // retry_after_seconds.
    let out = get(revision, 0)?;
    let behind: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(out.status.code(), Some(3), "{behind}");
    assert_eq!(behind["behind"], true);
    assert!(
        behind["retry_after_seconds"].as_u64() >= Some(1),
        "{behind}"
    );
    // A read that may wait (a minute) while the fold is released answers once the fold passes
    // the revision.
    let waiting = tokio::task::spawn_blocking({
        let addr = node.addr.clone();
        move || {
            foldhost()
                .args(["get", "k.a", "--listen", &addr, "--min-revision"])
                .arg(revision.to_string())
                .args(["--wait-ms", "60000"])
                .output()
        }
    });
    std::fs::write(hold.with_extension("release"), "")?;
    let out = waiting.await??;
    let read: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(out.status.code(), Some(0), "{read}");
    assert_eq!(
        (read["value"].as_str(), read["revision"].as_u64()),
        (Some("v"), Some(revision))
    );
    assert!(read["applied_through"].as_u64() >= Some(revision), "{read}");
    // A key the fold does not hold: exit 6.
    let out = foldhost()
        .args(["get", "k.none", "--listen", &node.addr])
        .output()?;
    assert_eq!(out.status.code(), Some(6));
    let _ = kv;
    Ok(())
}

/// A node folding `bucket` through `proxy` (its client, its watch and its writes), with a short
/// operation timeout so a read the proxy blocks fails soon.
async fn node_through(
    proxy: &foldhost_tests::proxy::Proxy,
    bucket: &str,
    store: &Path,
) -> anyhow::Result<Node> {
    Node::start_on(
        &proxy.url(),
        bucket,
        store,
        &[],
        &["--nats-op-timeout", "3"],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_acknowledgement_is_resolved_from_the_log_to_applied() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("l").await?;
    let proxy = foldhost_tests::proxy::Proxy::start(&h.server.url().replace("nats://", "")).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let node = node_through(&proxy, "l", &store).await?;
    // The publish reaches the server; its acknowledgement never reaches the node. The node
    // reconnects and reads the key's newest record: its own operation's.
    proxy.cut_after_publish_to("$KV.l.");
    let (code, answer) = node
        .write(serde_json::json!({"key": "k.a", "value": "v"}))
        .await?;
    assert_eq!(proxy.cuts(), 1, "the publish's connection was cut");
    assert_eq!(
        (code, answer.outcome.as_str()),
        (200, "applied"),
        "{answer:?}"
    );
    let entry = kv.entry("k.a").await?.expect("landed");
    assert_eq!(entry.version.as_u64(), answer.revision);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_acknowledgement_with_the_log_unreadable_is_unknown_and_the_retry_lands_once()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("u").await?;
    let proxy = foldhost_tests::proxy::Proxy::start(&h.server.url().replace("nats://", "")).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let node = node_through(&proxy, "u", &store).await?;
    // Cut after the publish, and let nobody reconnect: the log cannot be read.
    proxy.refuse_new(true);
    proxy.cut_after_publish_to("$KV.u.");
    let (code, answer) = node
        .write(serde_json::json!({"key": "k.a", "value": "v"}))
        .await?;
    assert_eq!(proxy.cuts(), 1);
    assert_eq!(
        (code, answer.outcome.as_str()),
        (503, "unknown"),
        "{answer:?}"
    );
    // It did land (the server had the publish). A retry under the same id once the node can
    // reach the server again is answered as that record: one record, never two.
    proxy.refuse_new(false);
    let landed = kv.entry("k.a").await?.expect("landed").version.as_u64();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let (code, again) = loop {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the retry never settled"
        );
        let (code, again) = node
            .write(serde_json::json!({"key": "k.a", "value": "v", "op_id": answer.op_id}))
            .await?;
        // The node's client may still be reconnecting: unknown again, and the retry is right.
        if again.outcome != "unknown" {
            break (code, again);
        }
    };
    assert_eq!(
        (code, again.outcome.as_str()),
        (200, "applied"),
        "{again:?}"
    );
    assert_eq!(again.revision, landed);
    assert_eq!(
        kv.positions().await?.last_sequence,
        landed.unwrap_or(0),
        "one record"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_over_the_nats_write_subject_is_answered_like_one_through_the_endpoint()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("n").await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let node = Node::start_with(&h, "n", &store, &[], &["--write-subject", "fold.n.write"]).await?;
    let client = h.conn.client().await?;
    let ask = |body: serde_json::Value| {
        let client = client.clone();
        async move {
            let reply = client
                .request("fold.n.write", body.to_string().into())
                .await?;
            let outcome = reply
                .headers
                .as_ref()
                .and_then(|h| h.get("Foldhost-Outcome"))
                .map(|v| v.as_str().to_string());
            let answer: WriteAnswer = serde_json::from_slice(&reply.payload)?;
            anyhow::Ok((outcome, answer))
        }
    };
    let (outcome, answer) = ask(serde_json::json!({"key": "k.a", "value": "v"})).await?;
    assert_eq!(answer.outcome, "applied", "{answer:?}");
    assert_eq!(outcome.as_deref(), Some("applied"));
    assert_eq!(
        kv.entry("k.a").await?.and_then(|e| e.version.as_u64()),
        answer.revision
    );
    // The same operation again, through the endpoint this time: answered as the first.
    let (_, again) = node
        .write(serde_json::json!({"key": "k.a", "value": "v", "op_id": answer.op_id}))
        .await?;
    assert_eq!(
        (again.outcome.as_str(), again.revision),
        ("applied", answer.revision)
    );
    let (_, bad) = ask(serde_json::json!({"key": "bad key", "value": "v"})).await?;
    assert_eq!(
        (bad.outcome.as_str(), bad.reason.as_deref()),
        ("refused", Some("invalid"))
    );
    Ok(())
}
