//! A guest's state on the bus (docs/state.md), on a real nats-server whose users hold exactly what
//! `foldhost grants --guest` composes: an owner keeps state in buckets it declares and a reader
//! follows one of them; every host-side refusal fires before anything is published; a reader sees
//! the current values (never a deletion) then one end-of-current, then changes; a node killed
//! mid-fold over three buckets resumes each from its own cursor.

use std::path::Path;
use std::process::Stdio;

use foldhost_core::bucket::{BucketConfig, ConnectOptions};
use foldhost_core::kv::KvWriter as _;
use foldhost_localnats::{LocalNats, reserved_port};
use foldhost_nats::{NatsConnection, NatsKv};
use foldhost_tests::*;

use crate::users::{self, url_as, violations};
use serde_json::{Value, json};

mod on_applied;
mod owner;
mod resume;

/// The owner's and the reader's main buckets (each folds its own).
const OWNER_MAIN: &str = "owner_main";
const READER_MAIN: &str = "reader_main";
/// The server buckets the owner's declarations derive.
const NOTES: &str = "state_owner_notes";
const TALLY: &str = "state_owner_tally";
const MINE: &str = "state_reader_mine";

/// `foldhost grants --bucket MAIN --guest GUEST --json` as a `permissions` block.
fn grants_for(main: &str, guest: &str) -> anyhow::Result<String> {
    let out = foldhost()
        .args(["grants", "--bucket", main, "--json", "--guest"])
        .arg(guest_wasm(guest))
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "grants failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout)?;
    let list = |k: &str| -> String {
        v[k].as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(|s| format!("{s:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    Ok(format!(
        "permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }} }}",
        list("publish"),
        list("subscribe")
    ))
}

/// A server whose users are `admin` (everything), `owner` and `reader` (their composed grants).
fn server(log: &Path) -> anyhow::Result<LocalNats> {
    let owner = grants_for(OWNER_MAIN, "state_owner")?;
    let reader = grants_for(READER_MAIN, "state_reader")?;
    users::server(log, &[("owner", owner), ("reader", reader)])
}

/// The node runs, every fold (the main bucket and each declared one) level with its stream (a
/// node's state buckets are folded level before it answers at all).
fn level(s: &foldhost_core::status::StatusReport) -> bool {
    s.state == "running"
        && s.cursor.is_some()
        && s.lag == 0
        && s.state_buckets.iter().all(|b| !b.declared || b.lag == 0)
}

/// `foldhost state list --store STORE --json`, as `[local, declared]` pairs.
fn state_list(store: &Path) -> anyhow::Result<Value> {
    let out = foldhost()
        .args(["state", "list", "--json", "--store"])
        .arg(store)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "state list: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<foldhost_core::status::StateBucketReport> = serde_json::from_slice(&out.stdout)?;
    Ok(rows
        .into_iter()
        .map(|b| json!([b.local, b.declared]))
        .collect())
}

/// A node process, killed if the test fails before it stops it.
struct Node {
    child: Option<std::process::Child>,
    addr: String,
}

impl Node {
    fn stop(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| anyhow::anyhow!("stopped twice"))?;
        terminate(&mut child)
    }

    /// `POST /query` with a JSON request: the guest's JSON answer.
    async fn ask(&self, request: Value) -> anyhow::Result<Value> {
        let body = request.to_string();
        let (code, answer) =
            foldhost::serve::call(&self.addr, "POST", "/query", body.as_bytes()).await?;
        anyhow::ensure!(
            code == 200,
            "{request}: HTTP {code}: {}",
            String::from_utf8_lossy(&answer)
        );
        Ok(serde_json::from_slice(&answer)?)
    }

    /// The guest's view of `bucket`: what it was handed through `apply`.
    async fn seen(&self, bucket: &str) -> anyhow::Result<Value> {
        self.ask(json!({"op": "seen", "bucket": bucket})).await
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `guest` as `user` folding `main` into `store`, with `extra` flags; waits until it runs.
async fn start(
    server: &LocalNats,
    user: &str,
    main: &str,
    guest: &str,
    store: &Path,
    extra: &[&str],
) -> anyhow::Result<Node> {
    let addr = format!("127.0.0.1:{}", reserved_port()?);
    let log = store.with_extension("log");
    let child = foldhost()
        .args(["run", "--bucket", main, "--nats", &url_as(server, user)])
        .arg("--store")
        .arg(store)
        .arg("--guest")
        .arg(guest_wasm(guest))
        .args(["--listen", &addr])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let node = Node {
        child: Some(child),
        addr,
    };
    if let Err(e) = wait_status(&node.addr, level).await {
        let said = std::fs::read_to_string(&log).unwrap_or_default();
        anyhow::bail!("{user}'s node did not come level: {e}; it said: {said}");
    }
    Ok(node)
}

/// Waits until the guest's view of `bucket` satisfies `done`.
async fn wait_seen(
    node: &Node,
    bucket: &str,
    done: impl Fn(&Value) -> bool,
) -> anyhow::Result<Value> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        // An answer other than 200 ("guest rebuilding" after a trap) is waited out too.
        let seen = node.seen(bucket).await;
        if let Ok(seen) = &seen
            && done(seen)
        {
            return Ok(seen.clone());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the guest's view of {bucket} never got there: {seen:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The refusal's reason in a guest's answer, if it was refused.
fn refused(answer: &Value) -> Option<&str> {
    answer["refused"]["reason"].as_str()
}

/// The last sequence of the stream behind `bucket`, as the admin sees it.
async fn last_sequence(admin: &NatsConnection, bucket: &str) -> anyhow::Result<u64> {
    let kv = admin
        .bucket(
            bucket,
            &BucketConfig {
                create: false,
                ..BucketConfig::default()
            },
        )
        .await?;
    Ok(kv.positions().await?.last_sequence)
}

/// Consumers on the streams of `buckets`, as the admin sees them.
async fn consumers(admin: &NatsConnection, buckets: &[&str]) -> anyhow::Result<usize> {
    let js = async_nats::jetstream::new(admin.client().await?);
    let mut n = 0;
    for b in buckets {
        n += js
            .get_stream(format!("KV_{b}"))
            .await?
            .info()
            .await?
            .state
            .consumer_count;
    }
    Ok(n)
}

async fn main_bucket(admin: &NatsConnection, name: &str) -> anyhow::Result<std::sync::Arc<NatsKv>> {
    let kv = admin.bucket(name, &BucketConfig::default()).await?;
    kv.put("seed", "1".into()).await?;
    Ok(kv)
}
