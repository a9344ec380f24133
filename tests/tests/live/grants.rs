//! The NATS permissions `foldhost grants` composes (docs/state.md, "Grants"), loaded as printed
//! into a real nats-server's `authorization` section: a node whose user holds exactly them does all
//! of its work with no violation in the server's log and leaves no consumer behind; one granted
//! no writes has a write refused by the server answered `refused: permission` naming the subject
//! (never a timeout); one lacking a grant its fold needs says which subject, once, and stops.

use std::path::Path;
use std::process::Stdio;

use foldhost::write::WriteAnswer;
use foldhost_core::bucket::{BucketConfig, ConnectOptions};
use foldhost_core::kv::KvWriter as _;
use foldhost_localnats::{LocalNats, reserved_port};
use foldhost_nats::NatsConnection;
use foldhost_tests::*;

use crate::users::{server, url_as, violations};

const BUCKET: &str = "granted";

/// `foldhost grants ARGS`' standard output.
fn grants(args: &[&str]) -> anyhow::Result<String> {
    let out = foldhost()
        .args(["grants", "--bucket", BUCKET])
        .args(args)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "grants failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// A `permissions` block built from `grants --json`'s lists, minus the subjects `drop` names.
fn block_from_json(json: &str, drop: &[&str]) -> anyhow::Result<String> {
    let v: serde_json::Value = serde_json::from_str(json)?;
    let list = |k: &str| -> anyhow::Result<String> {
        let items = v[k]
            .as_array()
            .ok_or_else(|| anyhow::anyhow!("no {k} list in {json}"))?;
        Ok(items
            .iter()
            .filter_map(|s| s.as_str())
            .filter(|s| !drop.contains(s))
            .map(|s| format!("{s:?}"))
            .collect::<Vec<_>>()
            .join(", "))
    };
    Ok(format!(
        "permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }} }}",
        list("publish")?,
        list("subscribe")?
    ))
}

/// A node process, killed if the test fails before it stops it.
struct Running(Option<std::process::Child>);

impl Running {
    fn stop(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        let mut child = self
            .0
            .take()
            .ok_or_else(|| anyhow::anyhow!("stopped twice"))?;
        terminate(&mut child)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The consumers on the bucket's stream, as the admin sees them.
async fn consumers(admin: &NatsConnection) -> anyhow::Result<usize> {
    let client = admin.client().await?;
    let js = async_nats::jetstream::new(client);
    let mut stream = js.get_stream(format!("KV_{BUCKET}")).await?;
    Ok(stream.info().await?.state.consumer_count)
}

/// Starts a node as `user` with `--listen`, a write token and `args`; waits until its fold holds
/// `last`.
async fn node_as(
    server: &LocalNats,
    user: &str,
    store: &Path,
    last: u64,
    args: &[&str],
) -> anyhow::Result<(Running, String, String)> {
    let addr = format!("127.0.0.1:{}", reserved_port()?);
    let token_file = store.with_extension("write-token");
    std::fs::write(&token_file, "0123456789abcdef0123456789abcdef")?;
    let child = foldhost()
        .args([
            "run",
            "--bucket",
            BUCKET,
            "--nats",
            &url_as(server, user),
            "--store",
        ])
        .arg(store)
        .args(["--listen", &addr, "--write-token-file"])
        .arg(&token_file)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let child = Running(Some(child));
    wait_status(&addr, |s| s.cursor == Some(last)).await?;
    Ok((child, addr, token_file.display().to_string()))
}

/// `foldhost put` through the node at `addr`: the exit code and the answer.
fn put(addr: &str, token_file: &str, key: &str) -> anyhow::Result<(i32, WriteAnswer)> {
    let out = foldhost()
        .args([
            "put",
            key,
            "v",
            "--listen",
            addr,
            "--write-token-file",
            token_file,
        ])
        .output()?;
    let answer = serde_json::from_slice(&out.stdout).map_err(|e| {
        anyhow::anyhow!(
            "{e}: {} / {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    Ok((out.status.code().unwrap_or(-1), answer))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_holding_exactly_its_composed_grants_folds_writes_and_leaves_no_consumer()
-> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let log = tmp.path().join("server.log");
    // The text block, pasted as printed; the read-only user from the JSON form.
    let writer = grants(&[])?;
    let reader = block_from_json(&grants(&["--read-only", "--json"])?, &[])?;
    let server = server(&log, &[("node", writer), ("reader", reader)])?;
    let admin = NatsConnection::open(ConnectOptions::new(url_as(&server, "admin"))).await?;
    let kv = admin.bucket(BUCKET, &BucketConfig::default()).await?;
    for i in 0..20 {
        kv.put(&format!("k.{i}"), format!("v{i}").into()).await?;
    }
    let last = kv.positions().await?.last_sequence;

    let (mut node, addr, token) =
        node_as(&server, "node", &tmp.path().join("node"), last, &[]).await?;
    let (code, answer) = put(&addr, &token, "written")?;
    anyhow::ensure!(
        code == 0 && answer.outcome == "applied",
        "a granted write: exit {code}, {answer:?}"
    );
    // A restart resumes under the same grants (a delta watch, a catch-up by stream gets).
    node.stop()?;
    kv.put("while-down", "x".into()).await?;
    let last = kv.positions().await?.last_sequence;
    let (mut node, _, _) = node_as(&server, "node", &tmp.path().join("node"), last, &[]).await?;
    let status = node.stop()?;
    anyhow::ensure!(status.success(), "the node's clean stop: {status}");
    anyhow::ensure!(
        consumers(&admin).await? == 0,
        "a consumer lingers after the node stopped"
    );

    // Granted no writes: the server refuses the publish, and the writer is told so.
    let (mut ro, addr, token) =
        node_as(&server, "reader", &tmp.path().join("ro"), last, &[]).await?;
    let (code, answer) = put(&addr, &token, "refused")?;
    anyhow::ensure!(
        code == 5
            && answer.outcome == "refused"
            && answer.reason.as_deref() == Some("permission")
            && answer
                .message
                .as_deref()
                .is_some_and(|m| m.contains(&format!("$KV.{BUCKET}.refused"))),
        "a write the server refuses: exit {code}, {answer:?}"
    );
    // The server logged it: the log this test reads is the one violations land in.
    let refused = format!("\"$KV.{BUCKET}.refused\"");
    wait_until("the server to log the refused write", || {
        violations(&log, "reader")
            .iter()
            .any(|l| l.contains(&refused))
    })
    .await?;
    // The log is live, and the fully granted node's work left nothing in it.
    anyhow::ensure!(
        violations(&log, "node").is_empty(),
        "the granted node hit violations: {:?}",
        violations(&log, "node")
    );
    // The refusal answered the writer; the node's fold goes on.
    kv.put("after", "y".into()).await?;
    let last = kv.positions().await?.last_sequence;
    wait_status(&addr, |s| s.cursor == Some(last)).await?;
    let status = ro.stop()?;
    anyhow::ensure!(
        status.success(),
        "the read-only node's clean stop: {status}"
    );
    anyhow::ensure!(
        consumers(&admin).await? == 0,
        "a consumer lingers after the read-only node stopped"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_lacking_a_grant_its_fold_needs_names_the_subject_once_and_stops()
-> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let log = tmp.path().join("server.log");
    // No consumer may be created on the bucket's stream, in either of the API's forms.
    let create = format!("$JS.API.CONSUMER.CREATE.KV_{BUCKET}");
    let named = format!("{create}.>");
    let short = block_from_json(&grants(&["--json"])?, &[&create, &named])?;
    let server = server(&log, &[("short", short)])?;
    let admin = NatsConnection::open(ConnectOptions::new(url_as(&server, "admin"))).await?;
    let kv = admin.bucket(BUCKET, &BucketConfig::default()).await?;
    kv.put("k", "v".into()).await?;
    let out = foldhost()
        .args([
            "run",
            "--bucket",
            BUCKET,
            "--nats",
            &url_as(&server, "short"),
            "--store",
        ])
        .arg(tmp.path().join("store"))
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(!out.status.success(), "the node ran on: {stderr}");
    let naming: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("lacks the grant"))
        .collect();
    anyhow::ensure!(
        naming.len() == 1
            && naming[0].contains(&format!("$JS.API.CONSUMER.CREATE.KV_{BUCKET}"))
            && stderr
                .matches(&format!("CONSUMER.CREATE.KV_{BUCKET}"))
                .count()
                == 1,
        "one line naming the subject: {stderr}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_granted_its_served_subjects_takes_them_in_its_queue_group_and_in_no_other()
-> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let log = tmp.path().join("server.log");
    let serves = [
        "--query-subject",
        "svc.granted.query",
        "--write-subject",
        "svc.granted.write",
        "--query-group",
        "routers",
    ];
    let block = grants(&serves)?;
    anyhow::ensure!(
        block.contains("\"svc.granted.query routers\"")
            && block.contains("\"svc.granted.write routers\""),
        "each served subject granted in its queue group: {block}"
    );
    let server = server(&log, &[("node", block)])?;
    let admin = NatsConnection::open(ConnectOptions::new(url_as(&server, "admin"))).await?;
    let kv = admin.bucket(BUCKET, &BucketConfig::default()).await?;
    kv.put("k", "v".into()).await?;
    let last = kv.positions().await?.last_sequence;
    let (mut node, _, _) =
        node_as(&server, "node", &tmp.path().join("node"), last, &serves).await?;
    // Both subjects are taken: a query is answered (the native applier's answer or its error),
    // a write applied.
    let client = admin.client().await?;
    client.request("svc.granted.query", "k".into()).await?;
    let reply = client
        .request(
            "svc.granted.write",
            serde_json::json!({"key": "w", "value": "x"})
                .to_string()
                .into(),
        )
        .await?;
    let answer: WriteAnswer = serde_json::from_slice(&reply.payload)?;
    anyhow::ensure!(answer.outcome == "applied", "{answer:?}");
    let status = node.stop()?;
    anyhow::ensure!(status.success(), "the node's clean stop: {status}");
    anyhow::ensure!(
        violations(&log, "node").is_empty(),
        "the granted node hit violations: {:?}",
        violations(&log, "node")
    );
    // The same user in another queue group: the server refuses the subscription, and the node
    // stops naming the subject.
    let mut other = serves.to_vec();
    other[5] = "others";
    let mut child = foldhost()
        .args([
            "run",
            "--bucket",
            BUCKET,
            "--nats",
            &url_as(&server, "node"),
        ])
        .arg("--store")
        .arg(tmp.path().join("other"))
        .args(&other)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read as _;
        // Read to its end: the node exits (a node that ran on would hold the test until the
        // harness's own limit, failing it).
        e.read_to_string(&mut stderr)?;
    }
    let status = child.wait()?;
    anyhow::ensure!(
        !status.success()
            && stderr.contains("svc.granted.query")
            && stderr.contains("lacks the grant"),
        "refused in another group, naming the subject: {status}: {stderr}"
    );
    Ok(())
}
