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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_shadows_a_new_version_clean_then_every_node_swaps_to_it_under_load_without_a_restart()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let (kv, _v1, mut nodes) = fleet(&h, "chclean", tmp.path()).await?;
    let writer = Writer::start(&kv);
    // Throughout the rollout every node answers every stable key with its value.
    let checking = Arc::new(AtomicBool::new(true));
    let checker = {
        let (checking, addrs) = (
            checking.clone(),
            nodes.iter().map(|n| n.addr.clone()).collect::<Vec<_>>(),
        );
        tokio::spawn(async move {
            let mut checked = 0u64;
            while checking.load(Ordering::Relaxed) {
                for addr in &addrs {
                    let i = checked % u64::from(STABLE);
                    let (code, body) = foldhost::serve::call(
                        addr,
                        "POST",
                        "/query",
                        format!("k.{i:03}").as_bytes(),
                    )
                    .await?;
                    anyhow::ensure!(
                        (code, body.as_slice()) == (200, format!("seed{i}").as_bytes()),
                        "{addr} answered k.{i:03} with {code} {}",
                        String::from_utf8_lossy(&body)
                    );
                    checked += 1;
                }
            }
            anyhow::Ok(checked)
        })
    };
    let v2_file = tmp.path().join("kvstore-renamed.wasm");
    std::fs::write(
        &v2_file,
        renamed(&std::fs::read(guest_wasm("kvstore"))?, "v2"),
    )?;
    let v2 = digest(&std::fs::read(&v2_file)?);
    let release = publish(
        &h,
        &v2_file,
        &[
            "--canary",
            "n0",
            "--shadow-batches",
            "5",
            "--shadow-wait",
            "120s",
        ],
    )?;
    for n in &nodes {
        n.runs(&v2).await?;
    }
    checking.store(false, Ordering::Relaxed);
    let checked = checker.await??;
    assert!(checked > 0);
    writer.stop().await?;
    // The canary came by a promoted shadow, judged clean with what it compared; the others by a
    // swap made after it.
    let canary = nodes[0].wait(|c| c.judgement == "clean").await?;
    let c = canary.guest_channel.clone().unwrap_or_default();
    // "shadowed N batches, …": at least the 5 asked for (more may come before it compares).
    let shadowed: u64 = c
        .detail
        .strip_prefix("shadowed ")
        .and_then(|d| d.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(c.canary && shadowed >= 5, "{c:?}");
    assert_eq!(c.release, release);
    let promoted = canary
        .last_swaps
        .iter()
        .find(|s| s.kind == "shadow")
        .map(|s| s.unix_ms)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "the canary's swap was no promoted shadow: {:?}",
                canary.last_swaps
            )
        })?;
    for n in &nodes[1..] {
        let s = n.wait(|c| c.judgement == "clean").await?;
        assert_eq!(s.last_swaps.len(), 1, "{}: {:?}", n.name, s.last_swaps);
        assert_eq!(s.last_swaps[0].kind, "swap");
        assert!(
            s.last_swaps[0].unix_ms >= promoted,
            "{} swapped before the canary was clean",
            n.name
        );
        assert!(!s.guest_channel.is_some_and(|c| c.canary));
    }
    answer_like_the_bucket(&kv, &nodes, "").await?;
    // Each node's /metrics names what it runs and what the channel wants.
    for n in &nodes {
        let token = std::fs::read_to_string(tmp.path().join(&n.name).join("admin-token"))?;
        let (code, body) =
            foldhost::serve::call_with_token(&n.addr, "GET", "/metrics", b"", Some(token.trim()))
                .await?;
        let text = String::from_utf8(body)?;
        assert_eq!(code, 200, "{text}");
        let info = text
            .lines()
            .find(|l| l.starts_with("foldhost_guest_channel_info{"))
            .ok_or_else(|| anyhow::anyhow!("no channel info in {text}"))?;
        for part in [
            format!("running=\"{v2}\""),
            format!("desired=\"{v2}\""),
            "state=\"rolling\"".to_string(),
            "judgement=\"clean\"".to_string(),
        ] {
            assert!(info.contains(&part), "{part} not in {info}");
        }
        assert!(
            text.lines()
                .any(|l| l.starts_with("foldhost_guest_channel_halted{") && l.ends_with(" 0")),
            "{text}"
        );
    }
    let fleet_view = guest_status_until(&h, |v| running_of(v) == vec![v2.clone(); 3]).await?;
    assert_eq!(fleet_view["state"], "rolling", "{fleet_view}");
    for n in &mut nodes {
        n.never_restarted().await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_that_answers_differently_halts_the_rollout_no_other_node_swaps_and_a_node_started_then_runs_the_last_good_version()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let (kv, v1, mut nodes) = fleet(&h, "chdiffer", tmp.path()).await?;
    let writer = Writer::start(&kv);
    // kvstore-v2 answers `v2:` + the value: every sampled key differs.
    let release = publish(
        &h,
        &guest_wasm("kvstore_v2"),
        &[
            "--canary",
            "n0",
            "--shadow-batches",
            "3",
            "--shadow-wait",
            "120s",
        ],
    )?;
    let canary = nodes[0]
        .wait(|c| c.release == release && c.judgement == "differed")
        .await?;
    let c = canary.guest_channel.clone().unwrap_or_default();
    assert!(
        c.detail.contains("answered differently") && c.detail.contains("v2:"),
        "{c:?}"
    );
    for n in &nodes {
        let s = n
            .wait(|c| c.release == release && c.state == "halted")
            .await?;
        let c = s.guest_channel.clone().unwrap_or_default();
        assert_eq!(c.running_digest.as_deref(), Some(v1.as_str()), "{}", n.name);
        assert!(c.halted_by.is_some_and(|b| b.starts_with("n0: differed")));
        assert!(
            s.last_swaps.is_empty(),
            "{} swapped: {:?}",
            n.name,
            s.last_swaps
        );
    }
    writer.stop().await?;
    // A node started now runs the last good version, not the halted one.
    nodes.push(Node::start(&h, "chdiffer", tmp.path(), "n3").await?);
    let s = nodes[3].runs(&v1).await?;
    assert_eq!(s.guest.as_deref(), Some("kvstore@0.1.0"));
    answer_like_the_bucket(&kv, &nodes, "").await?;
    let fleet_view = guest_status_until(&h, |v| v["state"] == "halted").await?;
    assert_eq!(fleet_view["halted"]["by"], "n0", "{fleet_view}");
    for n in &mut nodes {
        n.never_restarted().await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_that_traps_after_it_rolled_out_halts_the_release_and_every_node_returns_to_the_last_good_one()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let (kv, v1, mut nodes) = fleet(&h, "chtrap", tmp.path()).await?;
    // hostile-trap answers like kvstore, but traps on a query for `trap.me`. No canary: every
    // node swaps to it at once.
    let trap = digest(&std::fs::read(guest_wasm("hostile_trap"))?);
    let release = publish(&h, &guest_wasm("hostile_trap"), &[])?;
    for n in &nodes {
        n.runs(&trap).await?;
    }
    let (code, body) = nodes[1].query("trap.me").await?;
    assert!(
        code != 200 && body.contains("trapping on a query"),
        "a trapping query answers an error: {code} {body}"
    );
    nodes[1]
        .wait(|c| c.release == release && c.judgement == "trapped")
        .await?;
    for n in &nodes {
        let s = n.runs(&v1).await?;
        let c = s.guest_channel.clone().unwrap_or_default();
        assert_eq!(c.state, "halted", "{}: {c:?}", n.name);
        assert!(c.halted_by.is_some_and(|b| b.starts_with("n1: trapped")));
        assert_eq!(s.guest.as_deref(), Some("kvstore@0.1.0"), "{}", n.name);
    }
    // The node that halted it restarts: it takes its own `trapped` from the bus as its judgement
    // and writes it again — a restart never erases a halt (were it to report `pending`, the
    // release would roll again).
    terminate(&mut nodes[1].child)?;
    let restarted_at = foldhost_core::status::now_unix_ms();
    nodes[1] = Node::start(&h, "chtrap", tmp.path(), "n1").await?;
    let s = nodes[1].runs(&v1).await?;
    assert_eq!(s.guest.as_deref(), Some("kvstore@0.1.0"));
    let fleet_view =
        guest_status_until(&h, |v| {
            v["nodes"].as_array().into_iter().flatten().any(|n| {
                n["node"] == "n1" && n["unix_ms"].as_u64().is_some_and(|t| t >= restarted_at)
            })
        })
        .await?;
    assert_eq!(fleet_view["state"], "halted", "{fleet_view}");
    assert_eq!(
        judged_of(&fleet_view, release)
            .iter()
            .filter(|j| *j == "trapped")
            .count(),
        1
    );
    nodes[1]
        .wait(|c| c.judgement == "trapped" && c.state == "halted")
        .await?;
    answer_like_the_bucket(&kv, &nodes, "").await?;
    for n in &mut nodes {
        n.never_restarted().await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_or_removed_object_is_refused_by_every_node_which_keeps_its_version_and_says_why()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let (kv, v1, mut nodes) = fleet(&h, "chtamper", tmp.path()).await?;
    let client = h.conn.client().await?;
    let js = async_nats::jetstream::new(client.clone());
    let objects = js.get_object_store("foldhost-guests").await?;
    let bus = foldhost_nats::channel::ChannelBus::open(
        client,
        &foldhost_nats::channel::ChannelBuckets::default(),
        false,
        std::time::Duration::from_secs(10),
    )
    .await?;
    // A release whose object holds other bytes than its name says: kvstore-v2 stored under the
    // digest of a renamed kvstore (someone with write access to the object store replaced it).
    let good = renamed(&std::fs::read(guest_wasm("kvstore"))?, "tampered");
    let other = std::fs::read(guest_wasm("kvstore_v2"))?;
    let version = foldhost_core::protocol::GuestVersion {
        digest: digest(&good),
        name: "kvstore".into(),
        version: "0.1.0".into(),
        size: good.len() as u64,
    };
    objects
        .put(version.digest.as_str(), &mut other.as_slice())
        .await?;
    let (current, entry) = bus
        .release(CHANNEL)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no release"))?;
    let next = foldhost_core::protocol::ChannelEntry {
        desired: version.clone(),
        previous: Some(entry.desired.clone()),
        canaries: Vec::new(),
        ..entry.clone()
    };
    let release = bus.publish_release(CHANNEL, &next, Some(current)).await?;
    for n in &nodes {
        let s = n
            .wait(|c| c.release == release && c.judgement == "unfetchable")
            .await?;
        let c = s.guest_channel.clone().unwrap_or_default();
        assert!(
            c.detail.contains("tampered or replaced"),
            "{}: {c:?}",
            n.name
        );
        assert_eq!(c.running_digest.as_deref(), Some(v1.as_str()));
    }
    // The same release with its object removed: every node says it is missing.
    objects.delete(version.digest.as_str()).await?;
    let (current, _) = bus
        .release(CHANNEL)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no release"))?;
    let release = bus.publish_release(CHANNEL, &next, Some(current)).await?;
    for n in &nodes {
        let s = n
            .wait(|c| c.release == release && c.judgement == "unfetchable")
            .await?;
        let c = s.guest_channel.clone().unwrap_or_default();
        assert!(c.detail.contains("does not exist"), "{}: {c:?}", n.name);
        assert_eq!(c.running_digest.as_deref(), Some(v1.as_str()));
    }
    guest_status_until(&h, |v| judged_of(v, release) == vec!["unfetchable"; 3]).await?;
    answer_like_the_bucket(&kv, &nodes, "").await?;
    for n in &mut nodes {
        n.never_restarted().await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_following_a_channel_under_exactly_its_grants_swaps_with_no_violation_and_cannot_write_another_nodes_report()
-> anyhow::Result<()> {
    use crate::users::{server, url_as, violations};
    let tmp = tempfile::tempdir()?;
    let log = tmp.path().join("server.log");
    let out = foldhost()
        .args([
            "grants",
            "--bucket",
            "chgrant",
            "--guest-channel",
            CHANNEL,
            "--node-id",
            "n0",
        ])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let server = server(&log, &[("node", String::from_utf8(out.stdout)?)])?;
    let admin = foldhost_nats::NatsConnection::open(foldhost_core::bucket::ConnectOptions::new(
        url_as(&server, "admin"),
    ))
    .await?;
    let kv = admin
        .bucket("chgrant", &foldhost_core::bucket::BucketConfig::default())
        .await?;
    for i in 0..20 {
        kv.put(&format!("k.{i}"), format!("v{i}").into()).await?;
    }
    let v1 = digest(&std::fs::read(guest_wasm("kvstore"))?);
    publish_to(&url_as(&server, "admin"), &guest_wasm("kvstore"), &[])?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let child = foldhost()
        .args([
            "run",
            "--bucket",
            "chgrant",
            "--nats",
            &url_as(&server, "node"),
            "--store",
        ])
        .arg(tmp.path().join("n0"))
        .args([
            "--listen",
            &addr,
            "--guest-channel",
            CHANNEL,
            "--node-id",
            "n0",
        ])
        .stderr(Stdio::null())
        .spawn()?;
    let mut node = Node {
        name: "n0".into(),
        pid: child.id(),
        child,
        addr,
    };
    node.runs(&v1).await?;
    let v2_file = tmp.path().join("kvstore-renamed.wasm");
    std::fs::write(
        &v2_file,
        renamed(&std::fs::read(guest_wasm("kvstore"))?, "granted"),
    )?;
    publish_to(&url_as(&server, "admin"), &v2_file, &[])?;
    let s = node.runs(&digest(&std::fs::read(&v2_file)?)).await?;
    assert_eq!(s.guest_channel.map(|c| c.judgement), Some("clean".into()));
    // The node's user may write its own report only.
    let as_node = foldhost_nats::NatsConnection::open(foldhost_core::bucket::ConnectOptions::new(
        url_as(&server, "node"),
    ))
    .await?
    .client()
    .await?;
    let other = format!("$KV.foldhost-channels.{CHANNEL}.node.n9");
    as_node.publish(other.clone(), "forged".into()).await?;
    as_node.flush().await?;
    wait_until("the server to log the forged report", || {
        violations(&log, "node").iter().any(|l| l.contains(&other))
    })
    .await?;
    let by_the_node: Vec<String> = violations(&log, "node")
        .into_iter()
        .filter(|l| !l.contains(&other))
        .collect();
    assert!(
        by_the_node.is_empty(),
        "the node's own work hit violations: {by_the_node:?}"
    );
    node.never_restarted().await?;
    Ok(())
}

/// `foldhost ARGS…` on `h`'s server: exit code and standard error.
fn fails(h: &Harness, args: &[&str]) -> anyhow::Result<(Option<i32>, String)> {
    let out = foldhost().args(args).args(["--nats", &h.url()]).output()?;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_to_publish_or_to_a_following_node_is_refused_in_one_line_and_publishes_nothing()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let not_wasm = tmp.path().join("notes.wasm");
    std::fs::write(&not_wasm, "not a component")?;
    let not_wasm = not_wasm.display().to_string();
    let kvstore = guest_wasm("kvstore").display().to_string();
    for (args, says) in [
        (
            vec!["guest", "publish", not_wasm.as_str(), "--channel", CHANNEL],
            "notes.wasm",
        ),
        (
            vec!["guest", "publish", kvstore.as_str(), "--channel", "a.b"],
            "--channel \"a.b\"",
        ),
        (
            vec![
                "guest",
                "publish",
                kvstore.as_str(),
                "--channel",
                CHANNEL,
                "--canary-fraction",
                "1.5",
            ],
            "--canary-fraction",
        ),
        (
            vec![
                "guest",
                "publish",
                kvstore.as_str(),
                "--channel",
                CHANNEL,
                "--canary",
                "x y",
            ],
            "--canary",
        ),
    ] {
        let (code, err) = fails(&h, &args)?;
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // Nothing was published: no channel to read.
    let (code, err) = fails(&h, &["guest", "status", "--channel", CHANNEL])?;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("no channel was published"), "{err}");
    // A node on a channel with nothing published does not start, and says why.
    h.bucket("chbad").await?;
    let out = run_command(&h, "chbad", &tmp.path().join("n0"), None)
        .args(["--guest-channel", CHANNEL, "--node-id", "n0", "--catch-up"])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no channel was published") && err.contains("--guest-channel edge"),
        "{err}"
    );
    assert!(
        !tmp.path().join("n0").exists(),
        "a refused node made its store"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_moves_only_from_the_revision_it_was_read_at_and_a_repeated_publish_changes_nothing()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let bus = foldhost_nats::channel::ChannelBus::open(
        h.conn.client().await?,
        &foldhost_nats::channel::ChannelBuckets::default(),
        true,
        std::time::Duration::from_secs(10),
    )
    .await?;
    let first = publish(&h, &guest_wasm("kvstore"), &[])?;
    let (read_at, entry) = bus
        .release(CHANNEL)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no release"))?;
    assert_eq!(read_at, first);
    // The same version again: nothing published.
    let out = foldhost()
        .args(["guest", "publish"])
        .arg(guest_wasm("kvstore"))
        .args(["--nats", &h.url(), "--channel", CHANNEL])
        .output()?;
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("nothing published"));
    assert_eq!(bus.release(CHANNEL).await?.map(|r| r.0), Some(first));
    // Another publish moves it; a write from the old revision is refused, the entry untouched.
    let v2 = tmp.path().join("v2.wasm");
    std::fs::write(&v2, renamed(&std::fs::read(guest_wasm("kvstore"))?, "v2"))?;
    let second = publish(&h, &v2, &[])?;
    let stale = bus.publish_release(CHANNEL, &entry, Some(read_at)).await;
    assert!(
        matches!(
            stale,
            Err(foldhost_nats::channel::ChannelError::Conflict(_))
        ),
        "{stale:?}"
    );
    let (now, current) = bus
        .release(CHANNEL)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no release"))?;
    assert_eq!(now, second);
    assert_eq!(current.desired.digest, digest(&std::fs::read(&v2)?));
    assert_eq!(
        current.previous.map(|p| p.digest),
        Some(entry.desired.digest)
    );
    // History lists both, oldest first.
    let out = foldhost()
        .args([
            "guest",
            "history",
            "--json",
            "--nats",
            &h.url(),
            "--channel",
            CHANNEL,
        ])
        .output()?;
    let releases: Vec<u64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["release"].as_u64())
        .collect();
    assert_eq!(releases, vec![first, second]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_that_fails_to_load_is_refused_the_release_halts_and_every_node_keeps_serving_its_version()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let (kv, v1, mut nodes) = fleet(&h, "chrefused", tmp.path()).await?;
    // A component importing what the host does not offer: `guest publish` would refuse it (it
    // reads its manifest first), so it is put on the bus as a publisher that skipped that would.
    let bad = std::fs::read(foldhost_tests::hostile_wat("bad_import.wat"))?;
    let bus = foldhost_nats::channel::ChannelBus::open(
        h.conn.client().await?,
        &foldhost_nats::channel::ChannelBuckets::default(),
        false,
        std::time::Duration::from_secs(10),
    )
    .await?;
    let version = foldhost_core::protocol::GuestVersion {
        digest: digest(&bad),
        name: "bad-import".into(),
        version: "0.1.0".into(),
        size: bad.len() as u64,
    };
    bus.put_component(&version, &bad).await?;
    let (current, entry) = bus
        .release(CHANNEL)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no release"))?;
    let next = foldhost_core::protocol::ChannelEntry {
        desired: version,
        previous: Some(entry.desired.clone()),
        ..entry
    };
    let release = bus.publish_release(CHANNEL, &next, Some(current)).await?;
    for n in &nodes {
        let s = n
            .wait(|c| c.release == release && c.state == "halted")
            .await?;
        let c = s.guest_channel.clone().unwrap_or_default();
        assert_eq!(c.running_digest.as_deref(), Some(v1.as_str()), "{}", n.name);
        assert!(
            c.halted_by.is_some_and(|b| b.contains("refused")),
            "{}",
            n.name
        );
        assert!(s.last_swaps.is_empty(), "{}: {:?}", n.name, s.last_swaps);
        assert_eq!(s.state, "running");
    }
    guest_status_until(&h, |v| {
        v["state"] == "halted" && judged_of(v, release).iter().any(|j| j == "refused")
    })
    .await?;
    answer_like_the_bucket(&kv, &nodes, "").await?;
    for n in &mut nodes {
        n.never_restarted().await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_trial_that_fails_on_one_node_never_judges_the_release_the_fleet_runs()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let (_kv, _v1, mut nodes) = fleet(&h, "chtrial", tmp.path()).await?;
    // Release 2 rolls out to every node (no canary).
    let v2_file = tmp.path().join("kvstore-renamed.wasm");
    std::fs::write(
        &v2_file,
        renamed(&std::fs::read(guest_wasm("kvstore"))?, "v2"),
    )?;
    let v2 = digest(&std::fs::read(&v2_file)?);
    let release = publish(&h, &v2_file, &[])?;
    for n in &nodes {
        n.wait(|c| c.release == release && c.running_digest.as_deref() == Some(v2.as_str()))
            .await?;
    }
    // On n0 an operator tries a component that hits its memory cap while hydrating, in shadow.
    let out = foldhost()
        .args(["swap", "--listen", &nodes[0].addr, "--guest"])
        .arg(guest_wasm("hostile_membomb"))
        .args(["--shadow", "1", "--shadow-wait", "5"])
        .env_remove("FOLDHOST_ADMIN_TOKEN")
        .output()?;
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() != Some(0) && said.contains("memory"),
        "the trial fails at its memory cap: {said}"
    );
    // A swap (or a shadow that would promote) is refused on a node the channel moves.
    for extra in [&[][..], &["--shadow", "1", "--promote"][..]] {
        let out = foldhost()
            .args(["swap", "--listen", &nodes[0].addr, "--guest"])
            .arg(guest_wasm("kvstore_v2"))
            .args(extra)
            .env_remove("FOLDHOST_ADMIN_TOKEN")
            .output()?;
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.code() != Some(0) && said.contains("follows guest channel \"edge\""),
            "{extra:?}: {said}"
        );
    }
    // Two checks of n0's running version after the trial failed (the first may have begun before
    // it): each judged what it found.
    let before = wait_status(&nodes[0].addr, |s| s.guest_channel.is_some())
        .await?
        .guest_channel
        .map_or(0, |c| c.checks);
    let s = nodes[0].wait(|c| c.checks >= before + 2).await?;
    let c = s.guest_channel.unwrap_or_default();
    assert_eq!(
        (c.failed_calls, c.judgement.as_str(), c.state.as_str()),
        (0, "clean", "rolling"),
        "a trial's failure judged the running release: {c:?}"
    );
    // Every node still runs release 2, and the bus holds no `trapped` report of it.
    for n in &nodes {
        let s = n.runs(&v2).await?;
        let c = s.guest_channel.unwrap_or_default();
        assert_eq!(c.state, "rolling", "{}: {c:?}", n.name);
    }
    let view = guest_status(&h)?;
    assert!(
        !judged_of(&view, release).iter().any(|j| j == "trapped"),
        "{view}"
    );
    for n in &mut nodes {
        n.never_restarted().await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_halt_reaches_a_canary_mid_shadow_which_abandons_it_keeps_its_version_and_says_so()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let (_kv, v1, mut nodes) = fleet(&h, "chabandon", tmp.path()).await?;
    let bus = foldhost_nats::channel::ChannelBus::open(
        h.conn.client().await?,
        &foldhost_nats::channel::ChannelBuckets::default(),
        false,
        std::time::Duration::from_secs(10),
    )
    .await?;
    // Release 2, n0 its canary, with a shadow that waits a day for batches no writer brings.
    let v2_file = tmp.path().join("kvstore-renamed.wasm");
    std::fs::write(
        &v2_file,
        renamed(&std::fs::read(guest_wasm("kvstore"))?, "v2"),
    )?;
    let v2 = digest(&std::fs::read(&v2_file)?);
    let release = publish(
        &h,
        &v2_file,
        &[
            "--canary",
            "n0",
            "--shadow-batches",
            "1000000",
            "--shadow-wait",
            "24h",
        ],
    )?;
    let s = nodes[0]
        .wait(|c| c.release == release && c.shadowing.is_some())
        .await?;
    assert_eq!(s.guest_channel.map(|c| c.state), Some("canary".into()));
    // Another node halts the release (as a canary that judged it differed would).
    bus.put_report(
        CHANNEL,
        &foldhost_core::protocol::NodeReport {
            node: "n9".into(),
            release,
            outcome: foldhost_core::protocol::Judgement::Differed,
            detail: "halted by the test".into(),
            running: None,
            unix_ms: foldhost_core::status::now_unix_ms(),
            baked: false,
        },
    )
    .await?;
    // The canary abandons its shadow (a day before it would end), shows the halt, and keeps v1.
    let s = nodes[0]
        .wait(|c| c.release == release && c.state == "halted" && c.shadowing.is_none())
        .await?;
    let c = s.guest_channel.clone().unwrap_or_default();
    assert!(
        c.halted_by
            .as_deref()
            .is_some_and(|b| b.starts_with("n9: differed")),
        "{c:?}"
    );
    assert_eq!(c.running_digest.as_deref(), Some(v1.as_str()), "{c:?}");
    assert_ne!(
        c.judgement, "trapped",
        "an abandoned shadow judges nothing: {c:?}"
    );
    for n in &nodes {
        n.runs(&v1).await?;
    }
    // The fold holds no shadow any more: an operator's own shadow is taken, not refused as busy.
    let out = foldhost()
        .args(["swap", "--listen", &nodes[0].addr, "--guest"])
        .arg(&v2_file)
        .args(["--shadow", "1", "--shadow-wait", "1"])
        .env_remove("FOLDHOST_ADMIN_TOKEN")
        .output()?;
    let said = String::from_utf8_lossy(&out.stderr);
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        !said.contains("still running") && report.contains("\"batches\""),
        "the shadow ran to its report: {report} {said}"
    );
    assert_ne!(v2, v1);
    for n in &mut nodes {
        n.never_restarted().await?;
    }
    Ok(())
}

/// Waits for `child` to exit and returns its exit code and standard error. The deadline (120 s)
/// only bounds a test that would otherwise hang.
async fn exit_of(mut child: Child) -> anyhow::Result<(Option<i32>, String)> {
    use std::io::Read as _;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if std::time::Instant::now() >= deadline {
            let _ = terminate(&mut child);
            anyhow::bail!("the process still ran after 120 s");
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        e.read_to_string(&mut err)?;
    }
    Ok((status.code(), err))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_name_is_one_node_a_second_is_refused_a_node_whose_name_was_taken_stops_and_a_stopped_or_killed_nodes_name_is_taken_again()
-> anyhow::Result<()> {
    use foldhost_core::kv::KvReader;
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let kv = h.bucket("names").await?;
    kv.put("k.000", "v".into()).await?;
    let v1 = std::fs::read(guest_wasm("kvstore"))?;
    publish(&h, &guest_wasm("kvstore"), &[])?;
    let mut first = Node::start(&h, "names", tmp.path(), "n0").await?;
    first.runs(&digest(&v1)).await?;
    // Another process, its own store and port, the same node name: refused in one line naming
    // the running holder, before it made its store.
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let second = run_command(&h, "names", &tmp.path().join("second"), Some(&addr))
        .args(["--guest-channel", CHANNEL, "--node-id", "n0"])
        .stderr(Stdio::piped())
        .spawn()?;
    let (code, err) = exit_of(second).await?;
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(
        err.contains("node name \"n0\"")
            && err.contains("another node runs under this name")
            && err.contains(&format!("pid {}", first.pid)),
        "{err}"
    );
    assert!(
        !tmp.path().join("second").exists(),
        "a refused node made its store"
    );
    first.never_restarted().await?;

    // Another process takes the name over (as one would after this node could not renew for
    // longer than the claim holds): the node stops following and writes no report.
    let channels = h.bucket("foldhost-channels").await?;
    let claim = foldhost_core::protocol::claim_key(CHANNEL, "n0");
    let report = foldhost_core::protocol::report_key(CHANNEL, "n0");
    let intruder = format!(
        r#"{{"holder":"intruder","expires_unix_ms":{}}}"#,
        foldhost_core::status::now_unix_ms() + 3_600_000
    );
    channels.put(&claim, intruder.into()).await?;
    first
        .wait(|c| {
            c.error
                .as_deref()
                .is_some_and(|e| e.contains("taken over by \"intruder\""))
        })
        .await?;
    let report_at = channels.entry(&report).await?.map(|e| e.version);
    // A release the fleet rolls: another node takes it; the node whose name was taken does not.
    let v2_file = tmp.path().join("v2.wasm");
    let v2 = renamed(&v1, "v2");
    std::fs::write(&v2_file, &v2)?;
    publish(&h, &v2_file, &[])?;
    let other = Node::start(&h, "names", tmp.path(), "n1").await?;
    other.runs(&digest(&v2)).await?;
    let s = wait_status(&first.addr, |_| true).await?;
    assert_eq!(
        s.guest_channel.and_then(|c| c.running_digest),
        Some(digest(&v1)),
        "a node whose name was taken kept its version"
    );
    assert_eq!(
        channels.entry(&report).await?.map(|e| e.version),
        report_at,
        "a node whose name was taken wrote its report"
    );
    // The operator frees the name (docs/channels.md: `nats kv del`), and stops the node.
    channels.delete(&claim).await?;
    drop(first);
    // A clean stop (SIGTERM, by the drop) frees the name: the next start under it follows.
    let mut restarted = Node::start(&h, "names", tmp.path(), "n0").await?;
    restarted.runs(&digest(&v2)).await?;
    // A killed holder cannot free its name: a start under it takes the claim over once it saw it
    // unrenewed for the claim's time and a renewal, by its own clock.
    restarted.child.kill()?;
    restarted.child.wait()?;
    // Reaped: nothing is left for the drop to stop.
    std::mem::forget(restarted);
    let killed_at = std::time::Instant::now();
    let after_kill = Node::start(&h, "names", tmp.path(), "n0").await?;
    assert!(
        killed_at.elapsed() >= foldhost_core::protocol::NAME_CLAIM_TTL,
        "a killed holder's claim was taken before it could have run out"
    );
    after_kill.runs(&digest(&v2)).await?;
    Ok(())
}
