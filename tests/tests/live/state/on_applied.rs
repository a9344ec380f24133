//! An on_applied hook across crashes and traps: no write is lost, repeated writes collapse by their
//! derived op ids, and a first write is published as new.

use super::*;

/// The mirror guest (`state_owner`, `mirror/K` of the main bucket → `K` in its `notes`) killed
/// between the commit of the batch that carries a mirror key and its `on-applied`: the
/// restart calls `on-applied` again for that commit, and each write lands once; a second restart
/// calls it again, and what it writes again (`extra` may make it write everything again) is
/// answered from the ledger by its derived operation id, never published twice.
async fn crash_before_on_applied_then_restart_twice(
    main: &str,
    extra: &[&str],
) -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.conn.bucket(main, &BucketConfig::default()).await?;
    kv.put("mirror/a", "1".into()).await?;
    let store = tempfile::tempdir()?;
    let run = |listen: Option<&str>| {
        let mut c = run_command(&h, main, store.path(), listen);
        c.arg("--guest")
            .arg(guest_wasm("state_owner"))
            .args(extra)
            .env("FOLDHOST_LOG", "info");
        c
    };
    // The state buckets are empty, so the first commit is the main bucket's, of its one record.
    run_to_crash(
        run(None),
        foldhost_core::crashpoint::FOLD_BEFORE_ON_APPLIED,
        1,
    )?;
    let cursor = status_store(store.path())?.cursor;
    assert_eq!(
        cursor,
        Some(1),
        "the main batch is committed before the crash"
    );
    assert_eq!(
        last_sequence(&h.conn, NOTES).await?,
        0,
        "on-applied never ran: nothing was mirrored before the crash"
    );
    for restart in 1..=2 {
        let addr = format!("127.0.0.1:{}", reserved_port()?);
        let (child, mut lines) = spawn_logged(run(Some(&addr)))?;
        let mut node = Node {
            child: Some(child),
            addr,
        };
        wait_status(&node.addr, level).await?;
        let seen = wait_seen(&node, "notes", |s| s["entries"]["a"] == "1").await?;
        anyhow::ensure!(seen["violations"] == json!([]), "{seen}");
        // Said once the call made again has returned: its writes are answered by then. The main
        // fold's commit comes first among them.
        let replayed = lines.wait_for("on_applied_replayed")?;
        anyhow::ensure!(replayed.contains("(main)"), "restart {restart}: {replayed}");
        assert_eq!(
            last_sequence(&h.conn, NOTES).await?,
            1,
            "restart {restart}: the mirror write is on the log once"
        );
        node.stop()?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_commit_and_on_applied_loses_no_write_the_call_would_have_made()
-> anyhow::Result<()> {
    crash_before_on_applied_then_restart_twice("replay_lacking", &[]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_an_on_applied_makes_again_after_a_restart_are_collapsed_by_their_derived_op_ids()
-> anyhow::Result<()> {
    crash_before_on_applied_then_restart_twice(
        "replay_all",
        &["--guest-config", "replay-writes-all=1"],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_on_applied_that_traps_part_way_is_called_again_and_each_of_its_writes_lands_once()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h
        .conn
        .bucket("replay_trap", &BucketConfig::default())
        .await?;
    kv.put("mirror/a", "1".into()).await?;
    kv.put("mirror/b", "2".into()).await?;
    let store = tempfile::tempdir()?;
    let addr = format!("127.0.0.1:{}", reserved_port()?);
    let mut c = run_command(&h, "replay_trap", store.path(), Some(&addr));
    // Each `on-applied` with mirror writes queued traps right after its first write.
    c.arg("--guest")
        .arg(guest_wasm("state_owner"))
        .args(["--guest-config", "trap-after-first-mirror=1"])
        .env("FOLDHOST_LOG", "info");
    let (child, mut lines) = spawn_logged(c)?;
    let mut node = Node {
        child: Some(child),
        addr,
    };
    let trapped = lines.wait_for("guest_trapped")?;
    anyhow::ensure!(trapped.contains("on-applied"), "{trapped}");
    wait_status(&node.addr, level).await?;
    let seen = wait_seen(&node, "notes", |s| {
        s["entries"]["a"] == "1" && s["entries"]["b"] == "2"
    })
    .await?;
    anyhow::ensure!(seen["violations"] == json!([]), "{seen}");
    // Said once the call made again returned: its writes are answered by then.
    lines.wait_for("on_applied_replayed")?;
    assert_eq!(
        last_sequence(&h.conn, NOTES).await?,
        2,
        "each mirror write is on the log once, the one made before the trap included"
    );
    node.stop()?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_on_applied_write_is_published_as_new_even_while_its_key_was_just_written()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let config = BucketConfig {
        max_history: 8,
        ..BucketConfig::default()
    };
    let kv = h.conn.bucket("first_writes", &config).await?;
    kv.put("seed", "1".into()).await?;
    let store = tempfile::tempdir()?;
    let addr = format!("127.0.0.1:{}", reserved_port()?);
    let mut c = run_command(&h, "first_writes", store.path(), Some(&addr));
    c.arg("--guest").arg(guest_wasm("state_owner"));
    let (child, _lines) = spawn_logged(c)?;
    let node = Node {
        child: Some(child),
        addr,
    };
    wait_status(&node.addr, level).await?;
    // Two values of one key, back to back: the second mirror write comes while this node's fold of
    // `notes` may not have passed the first (it waits for the main loop, which makes the writes).
    kv.put("mirror/a", "1".into()).await?;
    kv.put("mirror/a", "2".into()).await?;
    let seen = wait_seen(&node, "notes", |s| s["entries"]["a"] == "2").await?;
    anyhow::ensure!(seen["violations"] == json!([]), "{seen}");
    // Judged as a retry, the second would be answered `unknown` (the fold of `notes` behind its
    // key) and never published: `a` would stay `1`.
    assert_eq!(
        last_sequence(&h.conn, NOTES).await?,
        2,
        "each write is on the log once"
    );
    Ok(())
}
