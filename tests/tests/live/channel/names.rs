//! A node's name: one node holds it, a second is refused, and a stopped or killed node's name is
//! taken again.

use super::*;

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
