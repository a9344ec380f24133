//! How updates are delivered: a watch's own delivery connection, the lean and the ordered delivery
//! folding alike, overlapping prefixes, a lean watch cut off from its consumer, and the stream info
//! requests opening a bucket costs.

use super::*;

/// Writes puts, an overwrite, a delete and a KV purge into `kv`'s keys `k.*`.
async fn mixed_writes(kv: &NatsKv, tag: &str) -> anyhow::Result<()> {
    for i in 0..300 {
        kv.put(&format!("k.{i:03}"), format!("{tag} {i}").into())
            .await?;
    }
    kv.put("k.007", format!("{tag} again").into()).await?;
    kv.delete("k.008").await?;
    let mut purge = async_nats::HeaderMap::new();
    purge.insert("KV-Operation", "PURGE");
    purge.insert("Nats-Rollup", "sub");
    kv.jetstream()
        .publish_with_headers(
            format!("$KV.{}.k.009", kv.bucket()),
            purge,
            bytes::Bytes::new(),
        )
        .await?
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_over_its_own_delivery_connection_hands_over_exactly_what_the_ordered_consumer_does()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("lean").await?;
    mixed_writes(&kv, "first").await?;
    let cursor = kv.positions().await?.last_sequence;
    mixed_writes(&kv, "second").await?;
    kv.set_direct_catch_up(false);
    let opts = foldhost_core::bucket::ConnectOptions::new(h.url());
    let mut runs = Vec::new();
    for lean in [false, true] {
        kv.set_lean_delivery(lean.then_some(&opts));
        let before = kv.lean_watches();
        let sync = collect_until_level(kv.clone(), WatchScope::All, WatchCursor::default()).await?;
        let delta =
            collect_until_level(kv.clone(), WatchScope::All, WatchCursor::at(cursor)).await?;
        let prefix = collect_until_level(
            kv.clone(),
            WatchScope::Prefix("k.00".into()),
            WatchCursor::at(cursor),
        )
        .await?;
        assert_eq!(kv.lean_watches() - before, if lean { 3 } else { 0 });
        let shapes = |us: &[KvUpdate]| us.iter().map(shape).collect::<Vec<_>>();
        runs.push((shapes(&sync), shapes(&delta), shapes(&prefix)));
    }
    let (ordered, lean) = (&runs[0], &runs[1]);
    assert_eq!(lean.0, ordered.0, "state-sync differs");
    assert_eq!(lean.1, ordered.1, "delta differs");
    assert_eq!(lean.2, ordered.2, "prefix delta differs");
    // What the writes imply (history 1: a key's older messages are gone): 300 keys listed, a
    // delta of every key's last write after the cursor (297 puts, the delete, the purge) and a
    // prefix delta of its ten keys' last writes.
    assert_eq!(lean.0.len(), 300);
    assert_eq!(lean.1.len(), 300);
    assert!(lean.1.iter().any(|u| u.0 == "k.008" && u.1 == "del"));
    assert!(lean.1.iter().any(|u| u.0 == "k.009" && u.1 == "purge"));
    assert!(lean.2.iter().all(|u| u.0.starts_with("k.00")));
    assert_eq!(lean.2.len(), 10);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_any_writer_can_store_folds_the_same_on_the_lean_and_the_ordered_delivery()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("odd").await?;
    kv.put("k.del", "to be deleted".into()).await?;
    let cursor = kv.positions().await?.last_sequence;
    kv.put("k.plain", "v".into()).await?;
    // A key whose delivery line is longer than the server's 4 KiB client line limit.
    let long = format!("k.{}", "l".repeat(4030));
    kv.put(&long, "long".into()).await?;
    // A delete whose header line ends in a bare LF, a continuation line, and a status line.
    raw_publish(
        &h.url(),
        "$KV.odd.k.del",
        b"NATS/1.0\r\nKV-Operation: DEL\nX-Note: y\r\nX-Long: a\r\n  b\r\n\r\n",
        b"",
    )
    .await?;
    raw_publish(
        &h.url(),
        "$KV.odd.k.status",
        b"NATS/1.0 100 FlowControl Request\r\nX-Note: y\r\n\r\n",
        b"s",
    )
    .await?;
    kv.put("k.last", "v".into()).await?;
    kv.set_direct_catch_up(false);
    let opts = foldhost_core::bucket::ConnectOptions::new(h.url());
    let mut runs = Vec::new();
    for lean in [false, true] {
        kv.set_lean_delivery(lean.then_some(&opts));
        let before = kv.lean_watches();
        let sync = collect_until_level(kv.clone(), WatchScope::All, WatchCursor::default()).await?;
        let delta =
            collect_until_level(kv.clone(), WatchScope::All, WatchCursor::at(cursor)).await?;
        assert_eq!(kv.lean_watches() - before, if lean { 2 } else { 0 });
        let shapes = |us: &[KvUpdate]| us.iter().map(shape).collect::<Vec<_>>();
        runs.push((shapes(&sync), shapes(&delta)));
    }
    let (ordered, lean) = (&runs[0], &runs[1]);
    assert_eq!(lean.0, ordered.0, "state-sync differs");
    assert_eq!(lean.1, ordered.1, "delta differs");
    let keys: BTreeSet<&str> = lean.1.iter().map(|u| u.0.as_str()).collect();
    assert!(
        keys.contains(long.as_str()),
        "the long key was not delivered"
    );
    assert!(
        keys.contains("k.status") && keys.contains("k.last"),
        "{keys:?}"
    );
    assert!(
        lean.1.iter().any(|u| u.0 == "k.del" && u.1 == "del"),
        "the bare-LF delete was not read as a delete: {:?}",
        lean.1.iter().find(|u| u.0 == "k.del")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scope_of_overlapping_prefixes_is_watched_and_delivers_each_key_once()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("overlap").await?;
    for k in ["a.b.c1", "a.b.c2", "a.x", "a.b.d.e", "z.q"] {
        kv.put(k, k.as_bytes().to_vec().into()).await?;
    }
    let cursor = kv.positions().await?.last_sequence;
    for k in ["a.b.c1", "a.x", "z.q"] {
        kv.put(k, "again".into()).await?;
    }
    // `a.b.c` and `a.x` filter on `a.b.>` and `a.>`: filters nats-server refuses together.
    let scope = WatchScope::Prefixes(vec!["a.b.c".into(), "a.x".into(), "a.b.".into()]);
    for cursor in [WatchCursor::default(), WatchCursor::at(cursor)] {
        let got = collect_until_level(kv.clone(), scope.clone(), cursor).await?;
        let mut keys: Vec<&str> = got.iter().map(|u| u.key()).collect();
        keys.sort_unstable();
        let expected: &[&str] = if cursor == WatchCursor::default() {
            &["a.b.c1", "a.b.c2", "a.b.d.e", "a.x"]
        } else {
            &["a.b.c1", "a.x"]
        };
        assert_eq!(keys, expected, "from {cursor:?}");
    }
    Ok(())
}

/// Starts a delta watch of `kv` from `cursor` and waits until it is level; returns the task, its
/// receiver and the deliver subject of the watch's one consumer.
async fn level_watch(
    kv: &std::sync::Arc<NatsKv>,
    cursor: u64,
) -> anyhow::Result<(
    tokio::task::JoinHandle<Result<(), KvError>>,
    mpsc::Receiver<WatchEvent>,
    String,
)> {
    use futures::TryStreamExt as _;
    let (tx, mut rx) = mpsc::channel(64);
    let k = kv.clone();
    let task = tokio::spawn(async move {
        k.watch_from(&WatchScope::All, WatchCursor::at(cursor), tx)
            .await
    });
    loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await? {
            Some(WatchEvent::CaughtUp { .. }) => break,
            Some(_) => {}
            None => anyhow::bail!("watch ended before it was level: {:?}", task.await?),
        }
    }
    let stream = kv
        .jetstream()
        .get_stream(format!("KV_{}", kv.bucket()))
        .await?;
    let names: Vec<String> = stream.consumer_names().try_collect().await?;
    anyhow::ensure!(names.len() == 1, "the watch's consumers: {names:?}");
    let info = stream.consumer_info(&names[0]).await?;
    let deliver = info
        .config
        .deliver_subject
        .ok_or_else(|| anyhow::anyhow!("not a push consumer"))?;
    Ok((task, rx, deliver))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lean_watch_cut_off_from_its_consumer_ends_instead_of_waiting_forever()
-> anyhow::Result<()> {
    use futures::TryStreamExt as _;
    let h = Harness::start().await?;
    // One-second heartbeats: the silence that ends the watch is three of them.
    let mut opts = foldhost_core::bucket::ConnectOptions::new(h.server.url());
    opts.watch_heartbeat = Duration::from_secs(1);
    let conn = foldhost_nats::NatsConnection::open(opts).await?;
    let kv = conn
        .bucket("silent", &foldhost_core::bucket::BucketConfig::default())
        .await?;
    kv.put("k.a", "a".into()).await?;
    let cursor = kv.positions().await?.last_sequence;
    let (task, mut rx, _) = level_watch(&kv, cursor).await?;
    let stream = kv.jetstream().get_stream("KV_silent").await?;
    let names: Vec<String> = stream.consumer_names().try_collect().await?;
    for n in &names {
        stream.delete_consumer(n).await?;
    }
    // Nothing is delivered and no heartbeat comes: the watch ends after three heartbeat periods
    // (the fold then resumes from its cursor).
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await? {
            Some(WatchEvent::Updates(us)) => anyhow::bail!("delivered after the cut: {us:?}"),
            Some(_) => {}
            None => break task.await?,
        }
    };
    match ended {
        Err(KvError::WatchError(m)) => assert!(m.contains("delivery connection"), "{m}"),
        other => anyhow::bail!("the watch should end: {other:?}"),
    }
    Ok(())
}

/// The JetStream API requests the server has answered for the account so far (this query
/// included).
async fn api_requests(h: &Harness) -> anyhow::Result<u64> {
    let js = async_nats::jetstream::new(h.conn.client().await?);
    Ok(js.query_account().await?.requests.total)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opening_a_bucket_and_the_identity_refusal_before_the_store_opens_cost_one_stream_info_request()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    drop(h.bucket("once").await?);
    for i in 0..5 {
        h.bucket("once")
            .await?
            .put(&format!("k.{i}"), "v".into())
            .await?;
    }
    // A node's start: open the bucket, check the identity before the store opens. Counted by the
    // server: each count is one request itself.
    let before = api_requests(&h).await?;
    let kv = h.bucket("once").await?;
    let state = kv.start_state().await?;
    let after = api_requests(&h).await?;
    assert_eq!(
        after - before,
        2,
        "the open and the refusal check are one request (the second count is the other)"
    );
    assert_eq!(kv.stream_info_reads(), 1);
    let live = kv.stream_state().await?.expect("NATS knows its identity");
    assert_eq!(state, live, "the open's answer is the stream as it is");
    assert_eq!(state.last_sequence, 5);
    // The fold's own start check: identity and retention, afresh, in one request.
    let before = api_requests(&h).await?;
    let (found, retention) = kv.state_and_retention().await?;
    assert_eq!(api_requests(&h).await? - before, 2, "one request for both");
    assert_eq!(found, Some(live));
    assert_eq!(retention, Some(kv.read_retention().await?));
    // A bucket that is not there is named, not created, when creation is off.
    let missing = h
        .conn
        .bucket(
            "absent",
            &foldhost_core::bucket::BucketConfig {
                create: false,
                ..Default::default()
            },
        )
        .await;
    assert!(
        matches!(missing, Err(KvError::BucketNotFound(ref b)) if b == "absent"),
        "{:?}",
        missing.map(|_| ())
    );
    Ok(())
}
