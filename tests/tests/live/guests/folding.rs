//! How a guest folds: a bad parse output or an unprovided import is refused, a hydrated guest
//! answers like a watching one, a hash ring moves only a removed node's keys, batches split at the
//! byte limit, expiring keys leave, and a hydration yields to the fold beside it.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_parse_output_fails_the_batch_with_the_count_named() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("badparse").await?;
    kv.put("k.1", "v".into()).await?;
    let tmp = tempfile::tempdir()?;
    let out = foldhost()
        .args([
            "run",
            "--catch-up",
            "--bucket",
            "badparse",
            "--nats",
            &h.url(),
        ])
        .arg("--guest")
        .arg(guest_wasm("hostile_badparse"))
        .arg("--store")
        .arg(tmp.path().join("fold"))
        .output()?;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("hostile-badparse@0.1.0: parse failed: answered 0 verdicts for a batch of 1"),
        "{err}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_with_an_unprovided_import_is_refused_at_load_naming_it() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let out = foldhost()
        .args([
            "run",
            "--bucket",
            "b",
            "--nats",
            "nats://127.0.0.1:1",
            "--guest",
        ])
        .arg(hostile_wat("bad_import.wat"))
        .arg("--store")
        .arg(&store)
        .output()?;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("refused at load"), "{err}");
    assert!(
        err.contains("evil:net/exfil@1.0.0"),
        "the import is named: {err}"
    );
    assert!(!store.exists(), "nothing was written");
    // The same check through the library.
    let engine = GuestEngine::new()?;
    let bytes = std::fs::read(hostile_wat("bad_import.wat"))?;
    let e = engine
        .prepare("bad_import.wat", &bytes)
        .err()
        .ok_or_else(|| anyhow::anyhow!("must be refused"))?;
    assert!(e.to_string().contains("evil:net/exfil@1.0.0"), "{e}");
    // And garbage is not a component.
    let e = engine
        .prepare("garbage", b"\0asm\x01\0\0\0not really")
        .err()
        .ok_or_else(|| anyhow::anyhow!("must be refused"))?;
    assert!(e.to_string().contains("not a loadable component"), "{e}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hydrated_guest_answers_like_one_that_watched_from_the_start() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("hydrate").await?;
    const N: u32 = 50_000;
    let msgs = (0..N).map(|i| (format!("$KV.hydrate.route.h{i:05}"), upstream(i, 0).into()));
    foldhost_tests::publish_all(kv.jetstream(), msgs).await?;
    for i in (0..N).step_by(7) {
        kv.delete(&format!("route.h{i:05}")).await?;
    }
    let engine = GuestEngine::new()?;
    let bytes = std::fs::read(guest_wasm("router"))?;
    let tmp = tempfile::tempdir()?;
    let (store, _) = AppendLogSnapshot::open(tmp.path(), AppendLogOptions::default())?;
    let shared = SharedStore::new(store);

    // One instance watches from the start.
    let mut watched = load_default(&engine, "router", &bytes, Arc::new(shared.clone())).await?;
    watched.hydrate().await?;
    watch_applied(
        kv.clone(),
        shared.clone(),
        &mut watched,
        WatchOptions {
            scope: WatchScope::Prefix("route.".into()),
            batch: BatchConfig::default(),
            catch_up: true,
            defer_grace: foldhost_fold::applied::DEFAULT_DEFER_GRACE,
            repair: Default::default(),
            queries: None,
        },
        Arc::new(FoldStatus::default()),
        None,
        std::future::pending(),
    )
    .await?;

    // Another starts on the existing fold and is rebuilt from it.
    let mut hydrated = load_default(&engine, "router", &bytes, Arc::new(shared.clone())).await?;
    hydrated.hydrate().await?;
    let (entries, _) = hydrated
        .last_hydration
        .ok_or_else(|| anyhow::anyhow!("no hydration recorded"))?;
    assert_eq!(entries, u64::from(N - N.div_ceil(7)));
    for i in 0..N {
        let q = format!("h{i:05}");
        let a = watched.query(q.as_bytes()).await;
        let b = hydrated.query(q.as_bytes()).await;
        match (&a, &b) {
            (Ok(x), Ok(y)) => assert_eq!(x, y, "{q}"),
            (Err(x), Err(y)) => assert_eq!(x.message, y.message, "{q}"),
            _ => panic!("{q}: watched {a:?} vs hydrated {b:?}"),
        }
        assert_eq!(a.is_err(), i % 7 == 0, "{q}: deleted hosts are unknown");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hashring_removing_a_node_moves_only_the_keys_it_owned() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("ring").await?;
    for (id, w) in [("a", "1"), ("b", "2"), ("c", "1"), ("d", "3"), ("e", "1")] {
        kv.put(&format!("node.{id}"), w.into()).await?;
    }
    kv.put("node.bad", "not a weight".into()).await?; // not in the ring
    let engine = GuestEngine::new()?;
    let bytes = std::fs::read(guest_wasm("hashring"))?;
    let tmp = tempfile::tempdir()?;
    let (store, _) = AppendLogSnapshot::open(tmp.path(), AppendLogOptions::default())?;
    let shared = SharedStore::new(store);
    let mut ring = load_default(&engine, "hashring", &bytes, Arc::new(shared.clone())).await?;
    ring.hydrate().await?;
    let opts = WatchOptions {
        scope: ring.manifest().watch_scope(),
        batch: BatchConfig::default(),
        catch_up: true,
        defer_grace: foldhost_fold::applied::DEFAULT_DEFER_GRACE,
        repair: Default::default(),
        queries: None,
    };
    let fold = async |ring: &mut GuestApply| {
        watch_applied(
            kv.clone(),
            shared.clone(),
            ring,
            opts.clone(),
            Arc::new(FoldStatus::default()),
            None,
            std::future::pending(),
        )
        .await
    };
    fold(&mut ring).await?;
    async fn owners(ring: &mut GuestApply) -> anyhow::Result<Vec<String>> {
        let mut out = Vec::new();
        for i in 0..2000 {
            let answer = ring.query(format!("user-{i}").as_bytes()).await?;
            let v: serde_json::Value = serde_json::from_slice(&answer)?;
            out.push(v["node"].as_str().unwrap_or_default().to_string());
        }
        Ok(out)
    }
    let before = owners(&mut ring).await?;
    for id in ["a", "b", "c", "d", "e"] {
        assert!(before.iter().any(|n| n == id), "node {id} owns some keys");
    }
    assert!(
        !before.iter().any(|n| n == "bad"),
        "a node whose value is not a weight owns nothing"
    );
    kv.delete("node.c").await?;
    fold(&mut ring).await?;
    let after = owners(&mut ring).await?;
    for (i, (b, a)) in before.iter().zip(&after).enumerate() {
        if b == "c" {
            assert_ne!(a, "c", "user-{i} still maps to the removed node");
        } else {
            assert_eq!(
                a, b,
                "user-{i} moved from {b} to {a} though {b} is still there"
            );
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_over_the_guest_byte_limit_are_split_and_a_single_oversized_update_stops_the_fold()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("bytes").await?;
    for i in 0..20 {
        kv.put(&format!("k.{i:02}"), vec![b'x'; 1000].into())
            .await?;
    }
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let run = || {
        let mut c = foldhost();
        c.args(["run", "--catch-up", "--bucket", "bytes", "--nats", &h.url()])
            .args(["--guest-max-batch-bytes", "5000"])
            .arg("--guest")
            .arg(guest_wasm("kvstore"))
            .arg("--store")
            .arg(&store);
        c
    };
    let out = run().output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(dump_store(&store)?.len(), 20, "split batches all committed");

    // One update larger than the limit can never pass: the fold stops before it, naming the limit
    // (and the restart first rebuilds the guest from the fold in chunks under the limit).
    let big = kv.put("k.big", vec![b'y'; 6000].into()).await?;
    let out = run().output()?;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("kvstore@0.1.0: parse failed")
            && err.contains("max-batch-bytes limit of 5000"),
        "{err}"
    );
    assert_eq!(status_store(&store)?.cursor, big.as_u64().map(|r| r - 1));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_expiring_by_per_message_ttl_leave_the_fold_and_the_router_live_and_across_a_restart()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("ttl").await?;
    // Per-message TTLs, and the server's delete markers when a subject's last message expires.
    let js = kv.jetstream().clone();
    let mut config = js.get_stream("KV_ttl").await?.info().await?.config.clone();
    config.allow_message_ttl = true;
    config.subject_delete_marker_ttl = Some(Duration::from_secs(1));
    js.update_stream(config).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = run_command(&h, "ttl", &store, Some(&addr))
        .arg("--guest")
        .arg(guest_wasm("router"))
        .stderr(Stdio::null())
        .spawn()?;
    wait_status(&addr, |s| s.state == "running").await?;
    // Ten hosts that stay, ten that expire after 2 s.
    for i in 0..20u32 {
        let subject = format!("$KV.ttl.route.h{i:02}");
        let value = bytes::Bytes::from(upstream(i, 0));
        let ack = if i % 2 == 0 {
            js.publish(subject, value).await?
        } else {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-TTL", "2s");
            js.publish_with_headers(subject, headers, value).await?
        };
        ack.await?;
    }
    let expiring: Vec<String> = (0..20u32)
        .filter(|i| i % 2 == 1)
        .map(|i| format!("route.h{i:02}"))
        .collect();
    // Folded first (the router answers for every host), then gone once the server expires them.
    let s = wait_status(&addr, |s| s.applied_through >= 20).await?;
    assert_eq!(s.state, "running", "{s:?}");
    wait_until("the expired keys to leave the fold", || {
        dump_store(&store)
            .is_ok_and(|d| d.len() == 10 && expiring.iter().all(|k| !d.contains_key(k)))
    })
    .await?;
    for i in 0..20u32 {
        let (code, body) =
            foldhost::serve::call(&addr, "POST", "/query", format!("h{i:02}").as_bytes()).await?;
        let want = if i % 2 == 0 { 200 } else { 422 };
        assert_eq!(code, want, "h{i:02}: {}", String::from_utf8_lossy(&body));
    }
    terminate(&mut host)?;
    // A restart (a delta from the cursor) and a fresh node (a re-list) agree with the bucket.
    let fresh = tmp.path().join("fresh");
    for dir in [&store, &fresh] {
        let o = run_command(&h, "ttl", dir, None)
            .args(["--catch-up", "--guest"])
            .arg(guest_wasm("router"))
            .output()?;
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let d = dump_store(dir)?;
        assert_eq!(
            d.len(),
            10,
            "{}: {:?}",
            dir.display(),
            d.keys().collect::<Vec<_>>()
        );
        assert!(expiring.iter().all(|k| !d.contains_key(k)));
    }
    Ok(())
}

/// A guest call runs to its end without yielding, so a hydration of many chunks must yield between
/// them: a swap's candidate hydrates on the fold's own runtime, and on a runtime with one worker the
/// fold beside it would otherwise stop until the whole hydration ended.
#[tokio::test(flavor = "current_thread")]
async fn a_hydration_yields_between_chunks_so_the_fold_beside_it_keeps_running()
-> anyhow::Result<()> {
    use foldhost_core::kv::{KvEntry, KvUpdate, VersionToken, WatchCursor};
    use foldhost_core::snapshot::SnapshotStore as _;
    use std::sync::atomic::{AtomicU64, Ordering};
    let dir = tempfile::tempdir()?;
    let (mut store, _) = AppendLogSnapshot::open(dir.path(), AppendLogOptions::default())?;
    let routes: Vec<KvUpdate> = (0..5000u32)
        .map(|i| {
            KvUpdate::Put(KvEntry {
                key: format!("route.h{i:05}"),
                value: upstream(i, 1).into(),
                version: VersionToken::from_u64(u64::from(i) + 1),
            })
        })
        .collect();
    store.apply(&routes, WatchCursor::at(5000))?;
    let shared = SharedStore::new(store);
    let engine = GuestEngine::new()?;
    let bytes = std::fs::read(guest_wasm("router"))?;
    let limits = GuestLimits {
        hydrate_chunk: 250,
        ..GuestLimits::default()
    };
    let mut g =
        GuestApply::load(&engine, "router", &bytes, limits, vec![], Arc::new(shared)).await?;
    // Another task on the same (single) thread: it runs only when the hydration yields.
    let ticks = Arc::new(AtomicU64::new(0));
    let ticker = {
        let ticks = ticks.clone();
        tokio::spawn(async move {
            loop {
                ticks.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        })
    };
    tokio::task::yield_now().await; // the ticker starts
    let before = ticks.load(Ordering::Relaxed);
    g.hydrate().await?;
    let during = ticks.load(Ordering::Relaxed) - before;
    ticker.abort();
    assert_eq!(g.last_hydration.map(|(n, _)| n), Some(5000));
    assert!(
        during >= 19,
        "the task beside the hydration ran {during} times during its 20 chunks"
    );
    Ok(())
}
