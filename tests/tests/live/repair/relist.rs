//! Repairs without an artifact or past one: supersession-only restarts, a fold with no cursor, TTL-
//! only buckets re-listed, a prefix watch cut off while messages age out, and a restore skipping an
//! artifact that fails verification.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn supersession_only_restart_resumes_on_a_max_age_bucket_without_an_artifact()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.aging_bucket("supersede", Duration::from_secs(1)).await?;
    kv.put("x", "aged out".into()).await?;
    wait_aged_out(&kv).await?;
    // Age-only eviction with room: the node sees it has evicted (memo, with its message's time).
    set_max_age(&kv, "supersede", Duration::from_secs(3600)).await?;
    kv.put("a", "a0".into()).await?;
    kv.put("b", "b0".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("node");
    ok(&catch_up(&h, "supersede", &store, &[])?, "catch-up")?;
    assert!(status_store(&store)?.eviction_seen);
    {
        let (s, _) = AnyStore::open_read_only(&store)?;
        let memo = s
            .cursor()
            .memo()
            .ok_or_else(|| anyhow::anyhow!("no memo"))?;
        assert!(
            memo.server_time_unix_ns > 0,
            "the memo keeps its message's server time"
        );
    }
    // While the node is down every key is rewritten: the messages after its cursor are all gone,
    // superseded, none aged out. The cursor looks expired.
    for i in 1..4 {
        kv.put("a", format!("a{i}").into()).await?;
        kv.put("b", format!("b{i}").into()).await?;
    }
    let cursor = status_store(&store)?.cursor.unwrap_or(0);
    let first = kv.positions().await?.first_sequence;
    assert!(
        first > cursor + 1,
        "expired-looking: cursor {cursor}, first {first}"
    );
    // No artifact anywhere: only the supersession-only resume can bring it back.
    let o = catch_up(&h, "supersede", &store, &[])?;
    ok(&o, "supersession-only resume")?;
    let log = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!log.contains("cursor expired: repairing"), "{log}");
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&store)?),
        None
    );

    // The same gap under an oldest-first limit is not age-only: it reads as expired, and with no
    // artifact it is refused, the fold untouched.
    let mut stream = kv.jetstream().get_stream("KV_supersede").await?;
    let mut config = stream.info().await?.config.clone();
    config.max_messages = 1000;
    config.discard = async_nats::jetstream::stream::DiscardPolicy::Old;
    kv.jetstream().update_stream(config).await?;
    for i in 4..7 {
        kv.put("a", format!("a{i}").into()).await?;
        kv.put("b", format!("b{i}").into()).await?;
    }
    let before = dump_store(&store)?;
    let o = catch_up(&h, "supersede", &store, &[])?;
    assert!(!o.status.success());
    assert!(
        error_line(&o).contains("--restore-from"),
        "{}",
        error_line(&o)
    );
    assert_eq!(dump_store(&store)?, before);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fold_with_data_but_no_cursor_is_repaired_like_an_expiry_at_revision_zero()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("nocursor").await?;
    kv.put("live", "in the bucket".into()).await?;
    // A fold that holds a key the bucket no longer has, and no cursor (say, a first batch whose
    // cursor record was torn off): a plain re-list would never remove `gone`.
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("node");
    {
        let (mut s, _) = AnyStore::open(&store, Backend::AppendLog)?;
        s.apply(
            &[KvUpdate::Put(KvEntry {
                key: "gone".into(),
                value: Bytes::from_static(b"stale"),
                version: VersionToken::UNKNOWN,
            })],
            WatchCursor::NONE,
        )?;
    }
    let o = catch_up(&h, "nocursor", &store, &[])?;
    ok(&o, "cursor-less catch-up")?;
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("cursor-expiry repair done"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&store)?),
        None
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_only_buckets_are_re_listed_to_exactly_the_bucket_without_an_artifact()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("ttlonly").await?;
    // As nats-py creates every KV stream: per-message TTLs allowed, no age or size limit.
    let js = kv.jetstream().clone();
    let mut config = js
        .get_stream("KV_ttlonly")
        .await?
        .info()
        .await?
        .config
        .clone();
    config.allow_message_ttl = true;
    js.update_stream(config).await?;
    publish_all(
        &js,
        (0..400u32).map(|i| {
            let k = if i % 4 == 0 { "del" } else { "keep" };
            (format!("$KV.ttlonly.{k}.{i:04}"), "v1".into())
        }),
    )
    .await?;
    let tmp = tempfile::tempdir()?;
    let node = tmp.path().join("node");
    ok(&catch_up(&h, "ttlonly", &node, &[])?, "first catch-up")?;
    // The gap: deletes (their markers purged), rewrites, and one key written with a 1 s TTL that
    // expires before the node returns.
    for i in (0..400u32).step_by(4) {
        kv.delete(&format!("del.{i:04}")).await?;
    }
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-TTL", "1s");
    js.publish_with_headers("$KV.ttlonly.gone.soon", headers, "brief".into())
        .await?
        .await?;
    publish_all(
        &js,
        (0..400u32)
            .filter(|i| i % 4 != 0)
            .map(|i| (format!("$KV.ttlonly.keep.{i:04}"), "v2".into())),
    )
    .await?;
    let stream = js.get_stream("KV_ttlonly").await?;
    stream.purge().filter("$KV.ttlonly.del.>").await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while foldhost_core::kv::KvReader::get(&*kv, "gone.soon")
        .await?
        .is_some()
    {
        anyhow::ensure!(Instant::now() < deadline, "the TTL'd key never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let want = bucket_contents(&kv).await?;
    assert_eq!(want.len(), 300);
    assert!(!want.contains_key("gone.soon"));
    // The cursor is expired; the default repair re-lists (no artifact anywhere) to the bucket.
    let o = catch_up(&h, "ttlonly", &node, &[])?;
    ok(&o, "catch-up over the expired cursor")?;
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("relist"),
        "repaired by re-list: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(first_difference(&want, &dump_store(&node)?), None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_watch_cut_off_while_in_scope_messages_age_out_trips_the_floor_guard_never_skips()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.aging_bucket("cutoff", Duration::from_secs(3600)).await?;
    for i in 0..20 {
        kv.put(
            &format!("route.h{i}"),
            format!("{{\"upstream\":\"10.0.0.{i}:80\"}}").into(),
        )
        .await?;
        kv.put(&format!("other.{i}"), "noise".into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let node = tmp.path().join("node");
    let na = addr()?;
    let log_path = tmp.path().join("node.log");
    let mut nd = run_command(&h, "cutoff", &node, Some(&na))
        .arg("--guest")
        .arg(foldhost_tests::guest_wasm("router"))
        .env("FOLDHOST_LOG", "warn")
        // The client's ordered consumer, which re-creates itself at the first retained message
        // (a lean connection's watch ends instead, and the resume window refuses the cursor).
        .env(foldhost_nats::LEAN_DELIVERY_ENV, "off")
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()?;
    let last = kv.positions().await?.last_sequence;
    let before = wait_status(&na, |s| s.applied_through >= last - 1).await?;
    let cursor = before.cursor.unwrap_or(0);
    let (code, _) = foldhost::serve::call(&na, "POST", "/query", b"h1").await?;
    assert_eq!(code, 200);

    // Cut off: the node is stopped and its consumer deleted on the server, so nothing more is
    // pushed to it. Meanwhile in-scope writes (a delete, a change) and out-of-scope noise happen
    // and every message ages out (the operator shortens max_age), then a new in-scope write.
    signal(&nd, "-STOP")?;
    let stream = kv.jetstream().get_stream("KV_cutoff").await?;
    let names: Vec<String> = stream.consumer_names().try_collect().await?;
    assert!(!names.is_empty(), "the node's watch consumer exists");
    for n in &names {
        stream.delete_consumer(n).await?;
    }
    kv.delete("route.h1").await?;
    kv.put("route.h2", "{\"upstream\":\"10.9.9.9:80\"}".into())
        .await?;
    kv.put("other.x", "noise".into()).await?;
    set_max_age(&kv, "cutoff", Duration::from_secs(2)).await?;
    let first = wait_aged_out(&kv).await?;
    assert!(first > cursor + 1, "the in-scope writes aged out unseen");
    kv.put("route.h99", "{\"upstream\":\"10.0.0.99:80\"}".into())
        .await?;
    signal(&nd, "-CONT")?;

    // The re-created consumer starts at the first retained message: the guard trips before
    // anything after the gap is applied. With no artifact armed the node stops.
    let st = wait_status(&na, |s| s.state == "failed").await?;
    terminate(&mut nd)?;
    let log = std::fs::read_to_string(&log_path)?;
    assert!(
        log.contains("floor guard: retention overran the watch"),
        "{st:?}\n{log}"
    );
    assert!(
        st.error
            .as_deref()
            .unwrap_or_default()
            .contains("cursor expired"),
        "{st:?}"
    );
    let fold = dump_store(&node)?;
    assert!(!fold.contains_key("route.h99"), "the fold skipped the gap");
    assert!(
        fold.contains_key("route.h1"),
        "the fold moved past the lost delete"
    );
    assert_eq!(status_store(&node)?.cursor, Some(cursor));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_skips_an_artifact_that_fails_verification_for_the_next_newest()
-> anyhow::Result<()> {
    let mut e = evicted("fallback", 50, 10, 5).await?;
    // A copy of the artifact, tried first (same cursor, earlier name), with one payload byte
    // flipped: its import fails the digest check.
    let bad = e.artifacts.join("art0");
    copy_dir(&e.artifacts.join("art1"), &bad)?;
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bad.join("MANIFEST.json"))?)?;
    let file = manifest["files"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["size"].as_u64().unwrap_or(0) > 0))
        .and_then(|f| f["path"].as_str())
        .ok_or_else(|| anyhow::anyhow!("no non-empty payload file in {manifest}"))?;
    let path = bad.join("data").join(file);
    let mut bytes = std::fs::read(&path)?;
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&path, bytes)?;

    let arts = e.artifacts.display().to_string();
    let o = catch_up(&e.h, "fallback", &e.node, &["--restore-from", &arts])?;
    ok(&o, "restoring catch-up")?;
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(
        log.contains("failed verification; trying the next newest"),
        "{log}"
    );
    assert_eq!(
        first_difference(&dump_store(&e.exporter)?, &dump_store(&e.node)?),
        None,
        "restored from the good artifact, identical to the exporter"
    );
    terminate(&mut e.host)?;
    Ok(())
}
