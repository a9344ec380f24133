//! A release rolling out: a canary shadows it, every node swaps under load, and a difference, a
//! trap, a halt or a tampered object stops it with every node keeping a version it can run.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_shadows_a_new_version_clean_then_every_node_swaps_to_it_under_load_without_a_restart()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let (kv, _v1, mut nodes) = fleet(&h, "chclean", tmp.path()).await?;
    let writer = Writer::start(&kv);
    // Throughout the rollout every node answers every stable key with its value.
    let checking = Arc::new(AtomicBool::new(true));
    let checker = spawn_stable_key_checker(&nodes, &checking);
    let (v2, release) = publish_v2_with_a_canary(&h, tmp.path())?;
    for n in &nodes {
        n.runs(&v2).await?;
    }
    checking.store(false, Ordering::Relaxed);
    let checked = checker.await??;
    assert!(checked > 0);
    writer.stop().await?;
    the_canary_was_promoted_clean_before_the_others_swapped(&nodes, release).await?;
    answer_like_the_bucket(&kv, &nodes, "").await?;
    every_nodes_metrics_name_what_it_runs(&nodes, tmp.path(), &v2).await?;
    let fleet_view = guest_status_until(&h, |v| running_of(v) == vec![v2.clone(); 3]).await?;
    assert_eq!(fleet_view["state"], "rolling", "{fleet_view}");
    for n in &mut nodes {
        n.never_restarted().await?;
    }
    Ok(())
}

/// Until `checking` is cleared, asks every node for each stable key in turn and fails on an answer
/// other than its value; returns how many it checked.
fn spawn_stable_key_checker(
    nodes: &[Node],
    checking: &Arc<AtomicBool>,
) -> tokio::task::JoinHandle<anyhow::Result<u64>> {
    let (checking, addrs) = (
        checking.clone(),
        nodes.iter().map(|n| n.addr.clone()).collect::<Vec<_>>(),
    );
    tokio::spawn(async move {
        let mut checked = 0u64;
        while checking.load(Ordering::Relaxed) {
            for addr in &addrs {
                let i = checked % u64::from(STABLE);
                let (code, body) =
                    foldhost::serve::call(addr, "POST", "/query", format!("k.{i:03}").as_bytes())
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
}

/// Publishes a renamed kvstore (written under `tmp`) with n0 as its canary shadowing 5 batches;
/// returns its digest and its release.
fn publish_v2_with_a_canary(h: &Harness, tmp: &std::path::Path) -> anyhow::Result<(String, u64)> {
    let v2_file = tmp.join("kvstore-renamed.wasm");
    std::fs::write(
        &v2_file,
        renamed(&std::fs::read(guest_wasm("kvstore"))?, "v2"),
    )?;
    let v2 = digest(&std::fs::read(&v2_file)?);
    let release = publish(
        h,
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
    Ok((v2, release))
}

/// The canary came by a promoted shadow, judged clean with what it compared; the others by a
/// swap made after it.
async fn the_canary_was_promoted_clean_before_the_others_swapped(
    nodes: &[Node],
    release: u64,
) -> anyhow::Result<()> {
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
    Ok(())
}

/// Each node's /metrics names what it runs (`v2`) and what the channel wants.
async fn every_nodes_metrics_name_what_it_runs(
    nodes: &[Node],
    tmp: &std::path::Path,
    v2: &str,
) -> anyhow::Result<()> {
    // Each node's /metrics names what it runs and what the channel wants.
    for n in nodes {
        let token = std::fs::read_to_string(tmp.join(&n.name).join("admin-token"))?;
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
