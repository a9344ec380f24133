//! A fleet on a real cluster: three `nats-server` processes joined by routes, an
//! R3 bucket under a continuous writer, three `foldhost run --artifacts …` nodes exporting in
//! rounds. The stream leader's server is killed mid-run and later restarted: nothing is lost and
//! every fold converges to the bucket. The bucket is then made to evict its oldest messages, and a
//! fourth node whose start the log no longer holds bootstraps from the published artifact and
//! converges to the same dump.

use std::process::{Child, Stdio};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use foldhost_core::bucket::{BucketConfig, ConnectOptions};
use foldhost_core::kv::KvWriter;
use foldhost_localnats::LocalCluster;
use foldhost_nats::{NatsConnection, NatsKv};
use foldhost_tests::{
    Moto, bucket_contents, dump_store, first_difference, foldhost, terminate, wait_status,
};

/// Retries `f` until it succeeds (the cluster electing a leader answers errors meanwhile).
async fn retrying<T, F: Future<Output = Result<T, E>>, E: std::fmt::Display>(
    what: &str,
    mut f: impl FnMut() -> F,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() < deadline => {
                tracing_free_sleep(&e).await;
            }
            Err(e) => anyhow::bail!("{what}: {e}"),
        }
    }
}

async fn tracing_free_sleep(_e: &dyn std::fmt::Display) {
    tokio::time::sleep(Duration::from_millis(250)).await;
}

/// A `foldhost run` of the cluster's bucket `fleet` into `store`, exporting in rounds.
fn node(
    cluster: &LocalCluster,
    moto: &Moto,
    store: &std::path::Path,
    name: &str,
    addr: &str,
    extra: &[&str],
) -> anyhow::Result<Child> {
    let mut c = foldhost();
    c.args([
        "run",
        "--bucket",
        "fleet",
        "--nats",
        &cluster.urls(),
        "--store",
    ])
    .arg(store)
    .args([
        "--listen",
        addr,
        "--artifacts",
        &moto.url("fleet"),
        "--artifact-key",
        "fleet",
        "--node-id",
        name,
    ])
    .args(extra)
    .env("FOLDHOST_LOG", "info,async_nats=info")
    .stderr(Stdio::from(std::fs::File::create(
        store.with_extension("log"),
    )?));
    for (k, v) in moto.env() {
        c.env(k, v);
    }
    Ok(c.spawn()?)
}

/// Prints the tail of every node's log when the test fails (an early `?` or a panic): a failure on a
/// machine nobody can log into still says what each node saw.
struct LogsOnFailure {
    dir: std::path::PathBuf,
    passed: bool,
}

impl Drop for LogsOnFailure {
    fn drop(&mut self) {
        if self.passed {
            return;
        }
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut logs: Vec<_> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        logs.sort();
        for log in logs {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(60)..];
            eprintln!(
                "--- {} (last {} lines)\n{}",
                log.display(),
                tail.len(),
                tail.join("\n")
            );
        }
    }
}

/// The node processes of the test with their `/status` addresses: killed and reaped when dropped,
/// so a test that fails early leaves none behind reconnecting to a stopped cluster.
struct Nodes(Vec<(Child, String)>);

impl Drop for Nodes {
    fn drop(&mut self) {
        for (child, _) in &mut self.0 {
            // A child already stopped and reaped by `terminate` is left alone by `kill`.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The stream's leader, as the cluster reports it.
async fn leader(kv: &NatsKv) -> anyhow::Result<String> {
    retrying("stream leader", || async {
        let mut s = kv.jetstream().get_stream("KV_fleet").await?;
        let info = s.info().await?;
        info.cluster
            .as_ref()
            .and_then(|c| c.leader.clone())
            .ok_or_else(|| async_nats::Error::from("no leader yet"))
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_node_cluster_loses_its_leader_without_losing_a_key_and_a_late_node_bootstraps()
-> anyhow::Result<()> {
    let mut cluster = LocalCluster::start(3)?;
    let moto = Moto::start().await?;
    let conn = NatsConnection::open(ConnectOptions::new(cluster.urls())).await?;
    let r3 = BucketConfig {
        max_bytes: None,
        num_replicas: 3,
        ..BucketConfig::default()
    };
    let kv: Arc<NatsKv> = retrying("create the R3 bucket", || conn.bucket("fleet", &r3)).await?;
    let tmp = tempfile::tempdir()?;
    let mut logs = LogsOnFailure {
        dir: tmp.path().to_path_buf(),
        passed: false,
    };
    // A continuous writer: keys w.000000…, retried through the leader change.
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let writer = spawn_writer(&kv, &stop, &written);
    let mut nodes = start_nodes(&cluster, &moto, tmp.path()).await?;
    kill_and_restart_the_leader(&mut cluster, &kv, &written).await?;
    stop.store(true, Ordering::Relaxed);
    writer.await?;
    every_fold_converges_to_the_bucket(&kv, &mut nodes, tmp.path()).await?;
    exactly_one_node_exports_per_round(tmp.path())?;
    let exporter = export_from_an_evicting_bucket(&cluster, &moto, &kv, tmp.path()).await?;
    a_late_node_bootstraps_from_the_artifact(&cluster, &moto, tmp.path())?;
    drop(exporter);
    logs.passed = true;
    Ok(())
}

/// A continuous writer: keys w.000000…, retried through the leader change; counts into `written`
/// until `stop`.
fn spawn_writer(
    kv: &Arc<NatsKv>,
    stop: &Arc<AtomicBool>,
    written: &Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    let (kv, stop, written) = (kv.clone(), stop.clone(), written.clone());
    tokio::spawn(async move {
        let mut i = 0u64;
        while !stop.load(Ordering::Relaxed) {
            if kv
                .put(&format!("w.{:06}", i % 5000), format!("v{i}").into())
                .await
                .is_ok()
            {
                i += 1;
                written.store(i, Ordering::Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
}

/// Starts nodes a, b and c exporting in rounds, each once it applied past 100 and exported.
async fn start_nodes(
    cluster: &LocalCluster,
    moto: &Moto,
    tmp: &std::path::Path,
) -> anyhow::Result<Nodes> {
    let mut nodes = Nodes(Vec::new());
    for name in ["a", "b", "c"] {
        let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
        let child = node(
            cluster,
            moto,
            &tmp.join(name),
            name,
            &addr,
            &["--export-every", "1", "--export-lease-secs", "3"],
        )?;
        nodes.0.push((child, addr));
    }
    for (i, (_, addr)) in nodes.0.iter().enumerate() {
        let log = tmp.join(["a", "b", "c"][i]).with_extension("log");
        wait_status(addr, |s| s.applied_through > 100 && s.last_export.is_some())
            .await
            .map_err(|e| {
                anyhow::anyhow!("{e}\n{}", std::fs::read_to_string(&log).unwrap_or_default())
            })?;
    }
    Ok(nodes)
}

/// Kills the stream leader's server mid-run; writes go on once a new leader is elected, and after
/// it is restarted.
async fn kill_and_restart_the_leader(
    cluster: &mut LocalCluster,
    kv: &NatsKv,
    written: &AtomicU64,
) -> anyhow::Result<()> {
    // Kill the stream leader's server mid-run; writes go on once a new leader is elected.
    let old = leader(kv).await?;
    let before = written.load(Ordering::Relaxed);
    cluster
        .member_mut(&old)
        .ok_or_else(|| anyhow::anyhow!("no member {old}"))?
        .stop();
    foldhost_tests::wait_until("writes after the leader died", || {
        written.load(Ordering::Relaxed) > before + 300
    })
    .await?;
    assert_ne!(leader(kv).await?, old, "a new leader took over");
    cluster
        .member_mut(&old)
        .ok_or_else(|| anyhow::anyhow!("no member {old}"))?
        .restart()?;
    let after_restart = written.load(Ordering::Relaxed);
    foldhost_tests::wait_until("writes after the restart", || {
        written.load(Ordering::Relaxed) > after_restart + 300
    })
    .await?;
    Ok(())
}

/// Every fold converges to the bucket.
async fn every_fold_converges_to_the_bucket(
    kv: &NatsKv,
    nodes: &mut Nodes,
    tmp: &std::path::Path,
) -> anyhow::Result<()> {
    // Every fold converges to the bucket.
    let last = retrying("last sequence", || kv.positions())
        .await?
        .last_sequence;
    for (_, addr) in nodes.0.iter() {
        let s = wait_status(addr, |s| s.applied_through == last).await?;
        assert_eq!(s.state, "running", "{s:?}");
    }
    let want = retrying("bucket contents", || bucket_contents(kv)).await?;
    for (child, _) in nodes.0.iter_mut() {
        terminate(child)?;
    }
    for name in ["a", "b", "c"] {
        assert_eq!(
            first_difference(&want, &dump_store(&tmp.join(name))?),
            None,
            "node {name}"
        );
    }
    Ok(())
}

/// Exactly one node exports per round, as the nodes' logs say.
fn exactly_one_node_exports_per_round(tmp: &std::path::Path) -> anyhow::Result<()> {
    // Exactly one node exports per round: every lease win is a CAS on the revision before it, so
    // no lease revision is won by two nodes, and every published artifact was exported under a
    // lease its node won.
    let mut winners: std::collections::BTreeMap<u64, &str> = Default::default();
    let mut published = 0;
    for name in ["a", "b", "c"] {
        let log = std::fs::read_to_string(tmp.join(name).with_extension("log"))?;
        let mut won_here = std::collections::BTreeSet::new();
        for line in log.lines() {
            let revision = || -> anyhow::Result<u64> {
                let v = line
                    .split("lease_revision=")
                    .nth(1)
                    .and_then(|r| r.split_whitespace().next())
                    .ok_or_else(|| anyhow::anyhow!("no lease revision in {line}"))?;
                Ok(v.parse()?)
            };
            if line.contains("export round: lease won") {
                let r = revision()?;
                if let Some(other) = winners.insert(r, name) {
                    anyhow::bail!("lease revision {r} won by both {other} and {name}");
                }
                won_here.insert(r);
            } else if line.contains("export round: artifact published") {
                let r = revision()?;
                anyhow::ensure!(
                    won_here.contains(&r),
                    "{name} published under a lease it did not win: {line}"
                );
                published += 1;
            }
        }
    }
    assert!(
        published > 0 && winners.len() >= published,
        "{published} published, {} rounds won",
        winners.len()
    );
    Ok(())
}

/// Makes the bucket evict under node a exporting, until a round published past the log's start;
/// returns the (stopped) exporter.
async fn export_from_an_evicting_bucket(
    cluster: &LocalCluster,
    moto: &Moto,
    kv: &NatsKv,
    tmp: &std::path::Path,
) -> anyhow::Result<Nodes> {
    // Now the bucket evicts its oldest messages; a node whose start the log no longer holds
    // bootstraps from the artifact a round publishes. (A node stopped mid-round leaves its lease
    // to run out: 3 s here.)
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut exporter = Nodes(vec![(
        node(
            cluster,
            moto,
            &tmp.join("a"),
            "a",
            &addr,
            &["--export-every", "1", "--export-lease-secs", "3"],
        )?,
        addr.clone(),
    )]);
    retrying("make the stream evict", || async {
        let mut s = kv.jetstream().get_stream("KV_fleet").await?;
        let mut config = s.info().await?.config.clone();
        config.max_messages = 2000;
        config.discard = async_nats::jetstream::stream::DiscardPolicy::Old;
        kv.jetstream()
            .update_stream(config)
            .await
            .map(|_| ())
            .map_err(async_nats::Error::from)
    })
    .await?;
    for i in 0..3000u32 {
        let key = format!("late.{i:05}");
        retrying("write", || kv.put(&key, "v".into())).await?;
    }
    let p = retrying("positions", || kv.positions()).await?;
    assert!(
        p.first_sequence > 1,
        "the log no longer holds its start: {p:?}"
    );
    wait_status(&addr, |s| {
        s.last_export
            .as_ref()
            .and_then(|e| e.cursor)
            .is_some_and(|c| c >= p.last_sequence)
    })
    .await?;
    for (child, _) in &mut exporter.0 {
        terminate(child)?;
    }
    Ok(exporter)
}

/// A node whose start the log no longer holds bootstraps from the artifact and converges to the
/// exporter's fold.
fn a_late_node_bootstraps_from_the_artifact(
    cluster: &LocalCluster,
    moto: &Moto,
    tmp: &std::path::Path,
) -> anyhow::Result<()> {
    let late = tmp.join("late");
    let o = foldhost()
        .args([
            "run",
            "--bucket",
            "fleet",
            "--nats",
            &cluster.urls(),
            "--store",
        ])
        .arg(&late)
        .args([
            "--catch-up",
            "--artifacts",
            &moto.url("fleet"),
            "--artifact-key",
            "fleet",
        ])
        .envs(moto.env())
        .env("FOLDHOST_LOG", "warn")
        .output()?;
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains("kind=\"restore\""),
        "the late node seeded itself from the artifact: {stderr}"
    );
    // On an evicting bucket the listing is not the truth (a current value can age out unseen):
    // the late node converges to the exporter's fold, the one its artifact came from.
    assert_eq!(
        first_difference(&dump_store(&tmp.join("a"))?, &dump_store(&late)?),
        None
    );
    Ok(())
}
