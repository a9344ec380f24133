//! Staged waves (docs/channels.md, "Waves"), four nodes following one channel on a real
//! nats-server: a release published with `--waves 1,10%,50%,100%` reaches its waves one at a time,
//! each only once every node of the earlier ones reported it baked; a version that traps in wave 2
//! halts the release before waves 3 and 4 ever run it.
//!
//! The order is proven from what the test observes, never from time: each round reads every
//! node's `/status` first and the bus's reports after, so a node seen running the new version in a
//! round swapped after every report it had read — which the bus read of that round (or an earlier
//! one) shows too.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use foldhost_core::kv::KvWriter;
use foldhost_core::protocol::{self, ChannelEntry};
use foldhost_core::status::StatusReport;
use foldhost_nats::channel::{ChannelBuckets, ChannelBus};
use foldhost_tests::{Harness, guest_wasm, wait_status};

use crate::channel::{CHANNEL, Node, STABLE, digest, guest_status_until, publish, renamed};

const WAVES: &str = "1,10%,50%,100%";
/// The four nodes' names.
const NODES: [&str; 4] = ["n0", "n1", "n2", "n3"];

/// A bucket of stable keys, v1 (`kvstore`) published, and four nodes following it, each of whose
/// reports is on the bus (the nodes a publish resolves its waves over); the channel's bus.
async fn four(
    h: &Harness,
    bucket: &str,
    tmp: &std::path::Path,
    env_of: impl Fn(&str) -> Vec<(&'static str, String)>,
) -> anyhow::Result<(String, Vec<Node>, ChannelBus)> {
    let kv = h.bucket(bucket).await?;
    for i in 0..STABLE {
        kv.put(&format!("k.{i:03}"), format!("seed{i}").into())
            .await?;
    }
    let v1 = digest(&std::fs::read(guest_wasm("kvstore"))?);
    publish(h, &guest_wasm("kvstore"), &[])?;
    let mut nodes = Vec::new();
    for name in NODES {
        nodes.push(Node::start_with(h, bucket, tmp, name, &env_of(name)).await?);
    }
    for n in &nodes {
        n.runs(&v1).await?;
    }
    guest_status_until(h, |v| v["nodes"].as_array().is_some_and(|a| a.len() == 4)).await?;
    let bus = ChannelBus::open(
        h.conn.client().await?,
        &ChannelBuckets::default(),
        false,
        std::time::Duration::from_secs(10),
    )
    .await?;
    Ok((v1, nodes, bus))
}

/// The release `release` as the bus holds it, with one node in each of its four waves.
async fn waved_release(bus: &ChannelBus, release: u64) -> anyhow::Result<ChannelEntry> {
    let (n, entry) = bus
        .release(CHANNEL)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no release"))?;
    anyhow::ensure!(n == release, "release {n}, published {release}");
    let sizes: Vec<usize> = entry.waves.iter().map(|w| w.nodes.len()).collect();
    // 10% of four nodes is one, which wave 1 already reached: the wave adds one node anyway.
    assert_eq!(sizes, [1, 1, 1, 1], "{:?}", entry.waves);
    Ok(entry)
}

/// What the observer saw: per node, the first round it ran the release's version (by its
/// `/status`) and the first round the bus showed it baked.
#[derive(Debug, Default)]
struct Seen {
    ran: BTreeMap<String, usize>,
    baked: BTreeMap<String, usize>,
    rounds: usize,
}

/// Reads every node's status, then each node's report on the bus, round after round until stopped (one more
/// round after the stop).
struct Observer {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<anyhow::Result<Seen>>,
}

impl Observer {
    /// Reads the reports by direct gets of each node's key (no consumer per round).
    async fn start(
        h: &Harness,
        nodes: &[Node],
        release: u64,
        entry: ChannelEntry,
    ) -> anyhow::Result<Self> {
        let js = async_nats::jetstream::new(h.conn.client().await?);
        let kv = js.get_key_value(ChannelBuckets::default().channels).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let addrs: Vec<(String, String)> = nodes
            .iter()
            .map(|n| (n.name.clone(), n.addr.clone()))
            .collect();
        let task = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut seen = Seen::default();
                loop {
                    let last = stop.load(Ordering::Relaxed);
                    for (name, addr) in &addrs {
                        let Ok((200, body)) =
                            foldhost::serve::call(addr, "GET", "/status", b"").await
                        else {
                            continue;
                        };
                        let s: StatusReport = serde_json::from_slice(&body)?;
                        let runs = s.guest_channel.and_then(|c| c.running_digest);
                        if runs.as_deref() == Some(entry.desired.digest.as_str()) {
                            seen.ran.entry(name.clone()).or_insert(seen.rounds);
                        }
                    }
                    for (name, _) in &addrs {
                        let Some(bytes) = kv.get(protocol::report_key(CHANNEL, name)).await? else {
                            continue;
                        };
                        let r =
                            protocol::decode_report(name, &bytes).map_err(anyhow::Error::msg)?;
                        if protocol::is_baked(release, &entry, &r) {
                            seen.baked.entry(r.node.clone()).or_insert(seen.rounds);
                        }
                    }
                    seen.rounds += 1;
                    if last {
                        return Ok(seen);
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
            })
        };
        Ok(Observer { stop, task })
    }

    async fn stop(self) -> anyhow::Result<Seen> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await?
    }
}

/// No node of a wave ran the version in a round before the one in which every node of the
/// earlier waves was seen baked.
fn assert_wave_by_wave(entry: &ChannelEntry, seen: &Seen) {
    for (node, ran) in &seen.ran {
        let wave = protocol::wave_of(entry, node);
        for earlier in entry.waves[..wave - 1].iter().flat_map(|w| &w.nodes) {
            let baked = seen.baked.get(earlier);
            assert!(
                baked.is_some_and(|b| b <= ran),
                "{node} (wave {wave}) ran the version in round {ran}, but {earlier} of an \
                 earlier wave was baked {baked:?}: {seen:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_version_reaches_each_wave_only_after_every_node_of_the_earlier_waves_baked_it()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let (_v1, mut nodes, bus) = four(&h, "waveclean", tmp.path(), |_| Vec::new()).await?;
    // kvstore again as other bytes: a version that behaves well.
    let file = tmp.path().join("v2.wasm");
    std::fs::write(
        &file,
        renamed(&std::fs::read(guest_wasm("kvstore"))?, "waves"),
    )?;
    let v2 = digest(&std::fs::read(&file)?);
    let release = publish(&h, &file, &["--waves", WAVES, "--bake", "3s"])?;
    let entry = waved_release(&bus, release).await?;
    assert_eq!(entry.bake_s, 3);
    let observer = Observer::start(&h, &nodes, release, entry.clone()).await?;
    // Every node gets there, and the release rolls, every node baked.
    for n in &nodes {
        n.runs(&v2).await?;
    }
    let view = guest_status_until(&h, |v| {
        v["state"] == "rolling"
            && v["nodes"].as_array().is_some_and(|a| {
                a.iter()
                    .filter(|n| n["release"].as_u64() == Some(release) && n["baked"] == true)
                    .count()
                    == 4
            })
    })
    .await?;
    assert!(view["wave"].is_null(), "{view}");
    let seen = observer.stop().await?;
    assert_eq!(seen.ran.len(), 4, "{seen:?}");
    assert_wave_by_wave(&entry, &seen);
    // The waves came in their order: each later wave's node ran it in a later round.
    let rounds: Vec<usize> = entry.waves.iter().map(|w| seen.ran[&w.nodes[0]]).collect();
    assert!(rounds.windows(2).all(|p| p[0] < p[1]), "{rounds:?}");
    for n in &mut nodes {
        n.never_restarted().await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_that_traps_in_wave_two_halts_the_release_and_waves_three_and_four_never_run_it()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    // hostile-trap answers like kvstore, but traps on a query for `trap.me`. The node its waves
    // put second (the same ranking the publish resolves them by) starts with its bake gated shut
    // (`channel.bake`): it swaps, runs and reports, but never bakes, so the trap comes before its
    // bake whatever the machine's pace.
    let trap = digest(&std::fs::read(guest_wasm("hostile_trap"))?);
    let names: Vec<String> = NODES.iter().map(|n| n.to_string()).collect();
    let specs: Vec<String> = WAVES.split(',').map(String::from).collect();
    let planned =
        protocol::resolve_waves(&specs, &names, &[], &trap).map_err(|e| anyhow::anyhow!("{e}"))?;
    let gated = planned[1].nodes[0].clone();
    let gate = tmp.path().join("bake-gate");
    let (v1, mut nodes, bus) = four(&h, "wavetrap", tmp.path(), |name| {
        if name == gated {
            let held = format!(
                "{}:{}",
                foldhost_core::crashpoint::CHANNEL_BAKE,
                gate.display()
            );
            vec![(foldhost_core::crashpoint::HOLD_ENV, held)]
        } else {
            Vec::new()
        }
    })
    .await?;
    let release = publish(
        &h,
        &guest_wasm("hostile_trap"),
        &["--waves", WAVES, "--bake", "1s"],
    )?;
    let entry = waved_release(&bus, release).await?;
    assert_eq!(
        entry.waves[1].nodes,
        std::slice::from_ref(&gated),
        "{:?}",
        entry.waves
    );
    let observer = Observer::start(&h, &nodes, release, entry.clone()).await?;
    let node = |name: &str| {
        nodes
            .iter()
            .position(|n| n.name == name)
            .ok_or_else(|| anyhow::anyhow!("no node {name}"))
    };
    let second = node(&entry.waves[1].nodes[0])?;
    nodes[second].runs(&trap).await?;
    let (code, body) = nodes[second].query("trap.me").await?;
    assert!(
        code != 200 && body.contains("trapping on a query"),
        "a trapping query answers an error: {code} {body}"
    );
    let halted_by = format!("{}: trapped", nodes[second].name);
    every_node_returns_to_v1_halted_by(&nodes, release, &v1, &halted_by).await?;
    let view = guest_status_until(&h, |v| v["state"] == "halted").await?;
    assert_eq!(view["halted"]["by"], nodes[second].name.as_str(), "{view}");
    let seen = observer.stop().await?;
    assert_wave_by_wave(&entry, &seen);
    waves_three_and_four_never_ran_it(&entry, &nodes, &seen, &view, &v1).await?;
    for n in &mut nodes {
        n.never_restarted().await?;
    }
    let reached = std::path::PathBuf::from(format!("{}.reached", gate.display()));
    assert!(reached.exists(), "{gated} asked its bake gate");
    a_deleted_halt_report_is_written_again(&h, &nodes, second, release, &v1).await
}

/// Every node returns to `v1` (wave 1's and 2's) or never left it, the release halted by wave 2's
/// node (`halted_by`).
async fn every_node_returns_to_v1_halted_by(
    nodes: &[Node],
    release: u64,
    v1: &str,
    halted_by: &str,
) -> anyhow::Result<()> {
    // Every node returns to v1 (wave 1's and 2's) or never left it, the release halted by
    // wave 2's node.
    for n in nodes {
        n.wait(|c| {
            c.release == release
                && c.state == "halted"
                && c.running_digest.as_deref() == Some(v1)
                && c.halted_by
                    .as_deref()
                    .is_some_and(|b| b.starts_with(halted_by))
        })
        .await?;
    }
    Ok(())
}

/// Waves 3 and 4 never ran it: never seen running it, never swapped at all (they started on
/// `v1`), and their reports of the release in `view` say they run `v1`.
async fn waves_three_and_four_never_ran_it(
    entry: &ChannelEntry,
    nodes: &[Node],
    seen: &Seen,
    view: &serde_json::Value,
    v1: &str,
) -> anyhow::Result<()> {
    let node = |name: &str| {
        nodes
            .iter()
            .position(|n| n.name == name)
            .ok_or_else(|| anyhow::anyhow!("no node {name}"))
    };
    // Waves 3 and 4 never ran it: never seen running it, never swapped at all (they started on
    // v1), and their reports of the release say they run v1.
    for wave in &entry.waves[2..] {
        let n = &nodes[node(&wave.nodes[0])?];
        assert!(!seen.ran.contains_key(&n.name), "{}: {seen:?}", n.name);
        let s = wait_status(&n.addr, |_| true).await?;
        assert!(
            !s.last_swaps.iter().any(|w| w.to.contains("hostile-trap")),
            "{}: {:?}",
            n.name,
            s.last_swaps
        );
        let theirs = view["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|r| r["node"] == n.name.as_str())
            .cloned()
            .unwrap_or_default();
        assert_eq!(theirs["running"]["digest"], v1, "{theirs}");
    }
    Ok(())
}

/// A halt stands when its report is deleted from the bus: the halting node (`nodes[second]`)
/// writes it again, and no node leaves the last good version `v1` meanwhile.
async fn a_deleted_halt_report_is_written_again(
    h: &Harness,
    nodes: &[Node],
    second: usize,
    release: u64,
    v1: &str,
) -> anyhow::Result<()> {
    // A halt stands when its report is deleted from the bus: the halting node writes it again,
    // and no node leaves the last good version meanwhile.
    let js = async_nats::jetstream::new(h.conn.client().await?);
    let channels = js.get_key_value(ChannelBuckets::default().channels).await?;
    let key = protocol::report_key(CHANNEL, &nodes[second].name);
    channels.delete(&key).await?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let back = channels.get(&key).await?.is_some_and(|bytes| {
            serde_json::from_slice::<protocol::NodeReport>(&bytes)
                .is_ok_and(|r| r.release == release && r.outcome == protocol::Judgement::Trapped)
        });
        if back {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "{key} was never written again"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    for n in nodes {
        let s = wait_status(&n.addr, |_| true).await?;
        let c = s.guest_channel.as_ref();
        assert_eq!(c.map(|c| c.state.as_str()), Some("halted"), "{}", n.name);
        assert_eq!(c.and_then(|c| c.running_digest.as_deref()), Some(v1));
    }
    Ok(())
}
