//! The fold rides out a nats-server restart: the watch resumes by itself and the fold converges.

use std::process::Stdio;
use std::time::Duration;

use foldhost_core::kv::KvWriter;
use foldhost_tests::{
    Harness, bucket_contents, dump_store, first_difference, run_command, terminate, wait_status,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fold_resumes_by_itself_after_the_server_restarts() -> anyhow::Result<()> {
    let mut h = Harness::start().await?;
    let kv = h.bucket("restart").await?;
    for i in 0..1000 {
        kv.put(&format!("k.{i:04}"), "before".into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = run_command(&h, "restart", &store, Some(&addr))
        .stderr(Stdio::null())
        .spawn()?;
    wait_status(&addr, |s| s.applied_through >= 1000).await?;

    h.server.restart()?;
    // Writes resume once the client has reconnected.
    let mut written = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while written < 500 {
        anyhow::ensure!(std::time::Instant::now() < deadline, "writes never resumed");
        match kv.put(&format!("k.{written:04}"), "after".into()).await {
            Ok(_) => written += 1,
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let last = kv.positions().await?.last_sequence;
    let s = wait_status(&addr, |s| s.applied_through >= last).await?;
    assert_eq!(s.state, "running");
    terminate(&mut host)?;
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&store)?),
        None
    );
    Ok(())
}

/// The watch's consumer deleted from the server side, again and again, and the
/// server restarted twice, under a writer: the host (one process, never restarted) resumes from
/// its applied cursor every time, stays `running`, and its fold converges to the bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_whose_consumer_is_deleted_or_whose_server_restarts_resumes_without_a_restart()
-> anyhow::Result<()> {
    use futures::TryStreamExt as _;
    let mut h = Harness::start().await?;
    let kv = h.bucket("resume").await?;
    for i in 0..200 {
        kv.put(&format!("k.{i:04}"), "before".into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    // One-second heartbeats: a watch whose consumer was deleted ends after three of them.
    let mut host = run_command(&h, "resume", &store, Some(&addr))
        .args(["--watch-heartbeat", "1"])
        .stderr(Stdio::null())
        .spawn()?;
    let started = wait_status(&addr, |s| s.applied_through >= 200).await?;
    let mut n = 200u32;
    // Writes that retry while the server is away.
    async fn put_retrying(kv: &foldhost_nats::NatsKv, key: &str) -> anyhow::Result<()> {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while kv.put(key, "after".into()).await.is_err() {
            anyhow::ensure!(std::time::Instant::now() < deadline, "writes never resumed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }
    for round in 0..6 {
        if round % 3 == 2 {
            h.server.restart()?;
        } else {
            let stream = kv.jetstream().get_stream("KV_resume").await?;
            let names: Vec<String> = stream.consumer_names().try_collect().await?;
            for name in names {
                let _ = stream.delete_consumer(&name).await;
            }
        }
        for _ in 0..50 {
            put_retrying(&kv, &format!("k.{n:04}")).await?;
            n += 1;
        }
        let last = kv.positions().await?.last_sequence;
        let s = wait_status(&addr, |s| s.applied_through >= last).await?;
        assert_eq!(s.state, "running", "round {round}: {s:?}");
        assert_eq!(s.pid, started.pid, "the same host process");
    }
    terminate(&mut host)?;
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&store)?),
        None
    );
    Ok(())
}

/// A node whose server has gone still stops on SIGTERM, and keeps what it folded: its stop does not
/// wait on a server that will never answer. Found by a cluster test whose nodes, left behind after
/// their cluster was stopped, sat out SIGTERM: the shutdown's flush waited the whole operation
/// timeout (30 s by default). The node here runs with an operation timeout of an hour, so a stop
/// that still waited on the server would outlast the test's deadline, which only bounds a hang:
/// nothing asserts how fast the stop is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_server_has_gone_still_stops_on_sigterm_and_keeps_its_fold()
-> anyhow::Result<()> {
    let mut h = Harness::start().await?;
    let kv = h.bucket("gone").await?;
    for i in 0..200 {
        kv.put(&format!("k.{i:04}"), "v".into()).await?;
    }
    let want = bucket_contents(&kv).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = run_command(&h, "gone", &store, Some(&addr))
        .args(["--nats-op-timeout", "3600"])
        .stderr(Stdio::null())
        .spawn()?;
    wait_status(&addr, |s| s.applied_through >= 200).await?;
    h.server.stop();
    let pid = host.id().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()?;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = host.try_wait()? {
            break status;
        }
        if std::time::Instant::now() >= deadline {
            host.kill()?;
            host.wait()?;
            anyhow::bail!("the node did not stop on SIGTERM with its server gone");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.code().is_some(), "it exited, not killed: {status}");
    assert_eq!(first_difference(&want, &dump_store(&store)?), None);
    Ok(())
}
