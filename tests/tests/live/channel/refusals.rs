//! What a channel refuses: a node's writes beyond its grants, bad input to publish or to a
//! following node, a release read at a stale revision, a version that fails to load, and a release
//! judged by one node's failed local trial.

use super::*;

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
