//! Guest channels (docs/channels.md), three nodes on one real nats-server: a version published
//! once reaches every node without a restart, a canary shadows it first, and a rollout stops
//! itself — a difference or a trap halts it and every node returns to the last good version; a
//! node started while it is halted runs that version; an object that was tampered with or
//! removed is refused by every node, which keeps its version and says why.

use std::process::{Child, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use foldhost_core::kv::KvWriter;
use foldhost_core::status::{GuestChannelReport, StatusReport};
use foldhost_nats::NatsKv;
use foldhost_tests::{
    Harness, bucket_contents, foldhost, guest_wasm, run_command, terminate, wait_status, wait_until,
};

mod names;
mod refusals;
mod rollout;

/// Stable keys `k.000`…, never written by the writer.
pub(crate) const STABLE: u32 = 200;
pub(crate) const CHANNEL: &str = "edge";

/// A component that behaves exactly as `wasm` but is other bytes (another digest): `wasm` with a
/// custom section appended, which no runtime reads.
pub(crate) fn renamed(wasm: &[u8], tag: &str) -> Vec<u8> {
    fn leb(mut n: usize, out: &mut Vec<u8>) {
        loop {
            let b = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }
    let name = b"foldhost-test";
    let mut payload = Vec::new();
    leb(name.len(), &mut payload);
    payload.extend_from_slice(name);
    payload.extend_from_slice(tag.as_bytes());
    let mut out = wasm.to_vec();
    out.push(0);
    leb(payload.len(), &mut out);
    out.extend_from_slice(&payload);
    out
}

pub(crate) fn digest(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

/// `foldhost guest publish FILE --channel edge ARGS…` on `h`'s server: the new release's number.
pub(crate) fn publish(h: &Harness, file: &std::path::Path, args: &[&str]) -> anyhow::Result<u64> {
    publish_to(&h.url(), file, args)
}

/// [`publish`] through `url`.
fn publish_to(url: &str, file: &std::path::Path, args: &[&str]) -> anyhow::Result<u64> {
    let out = foldhost()
        .args(["guest", "publish"])
        .arg(file)
        .args(["--nats", url, "--channel", CHANNEL])
        .args(args)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "publish failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    said["release"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no release in {said}"))
}

/// `foldhost guest status --channel edge --json`.
pub(crate) fn guest_status(h: &Harness) -> anyhow::Result<serde_json::Value> {
    let out = foldhost()
        .args([
            "guest",
            "status",
            "--json",
            "--nats",
            &h.url(),
            "--channel",
            CHANNEL,
        ])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "guest status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Reads `guest status --json` until `done` holds of it (a node shows a judgement in its own
/// status a moment before its report reaches the bus). The deadline (120 s) only bounds a test
/// that would otherwise hang.
pub(crate) async fn guest_status_until(
    h: &Harness,
    done: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let v = guest_status(h)?;
        if done(&v) {
            return Ok(v);
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "guest status never got there; last: {v}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The digests the nodes of a `guest status --json` run.
fn running_of(view: &serde_json::Value) -> Vec<String> {
    view["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["running"]["digest"].as_str().map(str::to_string))
        .collect()
}

/// The judgements of a `guest status --json`'s nodes of `release`.
fn judged_of(view: &serde_json::Value, release: u64) -> Vec<String> {
    view["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| n["release"].as_u64() == Some(release))
        .filter_map(|n| n["outcome"].as_str().map(str::to_string))
        .collect()
}

/// A node following the channel, named `name`, serving on a port of its own.
pub(crate) struct Node {
    pub(crate) name: String,
    pub(crate) child: Child,
    pub(crate) addr: String,
    pid: u32,
}

impl Node {
    pub(crate) async fn start(
        h: &Harness,
        bucket: &str,
        tmp: &std::path::Path,
        name: &str,
    ) -> anyhow::Result<Self> {
        Self::start_with(h, bucket, tmp, name, &[]).await
    }

    /// [`Node::start`] with `env` set for the node's process.
    pub(crate) async fn start_with(
        h: &Harness,
        bucket: &str,
        tmp: &std::path::Path,
        name: &str,
        env: &[(&str, String)],
    ) -> anyhow::Result<Self> {
        let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
        let child = run_command(h, bucket, &tmp.join(name), Some(&addr))
            .args(["--guest-channel", CHANNEL, "--node-id", name])
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stderr(Stdio::null())
            .spawn()?;
        let s = wait_status(&addr, |s| s.guest_channel.is_some()).await?;
        Ok(Node {
            name: name.to_string(),
            child,
            addr,
            pid: s.pid,
        })
    }

    /// Waits until the node's channel view satisfies `done`.
    pub(crate) async fn wait(
        &self,
        done: impl Fn(&GuestChannelReport) -> bool,
    ) -> anyhow::Result<StatusReport> {
        wait_status(&self.addr, |s| {
            s.state == "failed" || s.guest_channel.as_ref().is_some_and(&done)
        })
        .await
        .and_then(|s| {
            anyhow::ensure!(s.state != "failed", "{} failed: {:?}", self.name, s.error);
            Ok(s)
        })
    }

    pub(crate) async fn runs(&self, digest: &str) -> anyhow::Result<StatusReport> {
        self.wait(|c| c.running_digest.as_deref() == Some(digest))
            .await
    }

    pub(crate) async fn query(&self, request: &str) -> anyhow::Result<(u16, String)> {
        let (code, body) =
            foldhost::serve::call(&self.addr, "POST", "/query", request.as_bytes()).await?;
        Ok((code, String::from_utf8_lossy(&body).into_owned()))
    }

    /// The node still runs as the process it started as.
    pub(crate) async fn never_restarted(&mut self) -> anyhow::Result<()> {
        anyhow::ensure!(self.child.try_wait()?.is_none(), "{} exited", self.name);
        let s = wait_status(&self.addr, |_| true).await?;
        anyhow::ensure!(s.pid == self.pid, "{} restarted", self.name);
        Ok(())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = terminate(&mut self.child);
    }
}

/// A writer putting `w.*` keys until stopped.
struct Writer {
    stop: Arc<AtomicBool>,
    acked: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Writer {
    fn start(kv: &Arc<NatsKv>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(AtomicU64::new(0));
        let task = {
            let (kv, stop, acked) = (kv.clone(), stop.clone(), acked.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    kv.put(&format!("w.{:03}", n % 300), format!("w{n}").into())
                        .await?;
                    n += 1;
                    acked.store(n, Ordering::Relaxed);
                }
                Ok(())
            })
        };
        Writer { stop, acked, task }
    }

    async fn stop(self) -> anyhow::Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await??;
        Ok(self.acked.load(Ordering::Relaxed))
    }
}

/// A bucket of the stable keys, v1 (`kvstore`) published, and three nodes following it.
async fn fleet(
    h: &Harness,
    bucket: &str,
    tmp: &std::path::Path,
) -> anyhow::Result<(Arc<NatsKv>, String, Vec<Node>)> {
    let kv = h.bucket(bucket).await?;
    for i in 0..STABLE {
        kv.put(&format!("k.{i:03}"), format!("seed{i}").into())
            .await?;
    }
    let v1 = std::fs::read(guest_wasm("kvstore"))?;
    publish(h, &guest_wasm("kvstore"), &[])?;
    let mut nodes = Vec::new();
    for name in ["n0", "n1", "n2"] {
        nodes.push(Node::start(h, bucket, tmp, name).await?);
    }
    for n in &nodes {
        let s = n.runs(&digest(&v1)).await?;
        assert_eq!(
            s.guest_channel.as_ref().map(|c| c.state.as_str()),
            Some("rolling")
        );
        wait_status(&n.addr, |s| s.applied_through >= u64::from(STABLE)).await?;
    }
    Ok((kv, digest(&v1), nodes))
}

/// Every node answers every key of the bucket as `prefix` + its value once it applied all of it.
async fn answer_like_the_bucket(kv: &NatsKv, nodes: &[Node], prefix: &str) -> anyhow::Result<()> {
    let last = kv.positions().await?.last_sequence;
    let want = bucket_contents(kv).await?;
    for n in nodes {
        wait_status(&n.addr, |s| s.applied_through >= last).await?;
        for (key, (value, _)) in &want {
            let expect = format!("{prefix}{}", String::from_utf8_lossy(value));
            assert_eq!(n.query(key).await?, (200, expect), "{} {key}", n.name);
        }
    }
    Ok(())
}
