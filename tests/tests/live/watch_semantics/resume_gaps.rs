//! Resuming a watch across a gap: a short gap read by direct gets, a gap of removed messages, a
//! prefetched gap, a recreated stream, a prefix watch's gap, a mirror without the gap, and a
//! consumer cut off before its first delivery.

use super::*;

/// A delta watch from `cursor` until level, then one more write (`after`) that must arrive
/// through the consumer that follows: returns the updates before the level and the one after.
async fn delta_then_live(
    kv: std::sync::Arc<NatsKv>,
    cursor: u64,
    after: &str,
) -> anyhow::Result<(Vec<KvUpdate>, KvUpdate)> {
    delta_then_live_in(kv, WatchScope::All, cursor, after).await
}

/// [`delta_then_live`] of `scope`.
async fn delta_then_live_in(
    kv: std::sync::Arc<NatsKv>,
    scope: WatchScope,
    cursor: u64,
    after: &str,
) -> anyhow::Result<(Vec<KvUpdate>, KvUpdate)> {
    let (tx, mut rx) = mpsc::channel(64);
    let k = kv.clone();
    let task = tokio::spawn(async move { k.watch_from(&scope, WatchCursor::at(cursor), tx).await });
    let mut got = Vec::new();
    let mut level = false;
    loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await? {
            Some(WatchEvent::Updates(us)) if level => {
                let live = us
                    .into_iter()
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("an empty chunk"))?;
                task.abort();
                return Ok((got, live));
            }
            Some(WatchEvent::Updates(us)) => got.extend(us),
            Some(WatchEvent::CaughtUp { .. }) => {
                level = true;
                kv.put(after, "live".into()).await?;
            }
            Some(WatchEvent::Pending(_) | WatchEvent::Stamp { .. } | WatchEvent::Ops(_)) => {}
            None => {
                let r = task.await?;
                anyhow::bail!("watch ended: {r:?}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_resume_gap_read_by_direct_gets_hands_over_exactly_what_a_consumer_delivers()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("direct").await?;
    for i in 0..40 {
        kv.put(&format!("k.{i:02}"), format!("before {i}").into())
            .await?;
    }
    let cursor = kv.positions().await?.last_sequence;
    // The gap: new keys, overwrites of older keys, keys overwritten inside the gap (their first
    // message is removed: an absence the leader must confirm), a delete and a purge.
    for i in 0..30 {
        kv.put(&format!("k.{:02}", i * 3 % 50), format!("gap {i}").into())
            .await?;
    }
    kv.put("k.hot", "1".into()).await?;
    kv.put("k.hot", "2".into()).await?;
    kv.put("k.hot", "3".into()).await?;
    kv.delete("k.05").await?;
    // A KV purge: a rollup of the subject, marked as such.
    let mut purge = async_nats::HeaderMap::new();
    purge.insert("KV-Operation", "PURGE");
    purge.insert("Nats-Rollup", "sub");
    kv.jetstream()
        .publish_with_headers("$KV.direct.k.06", purge, bytes::Bytes::new())
        .await?
        .await?;
    let last = kv.positions().await?.last_sequence;

    // Reference: the consumer reads the gap.
    kv.set_direct_catch_up(false);
    let (reference, live_ref) = delta_then_live(kv.clone(), cursor, "k.live1").await?;
    assert_eq!(kv.direct_catch_up_reads(), 0);
    kv.set_direct_catch_up(true);
    let (direct, live) = delta_then_live(kv.clone(), cursor, "k.live2").await?;

    // The second watch's gap also holds the first one's live write.
    let want: Vec<_> = reference.iter().chain([&live_ref]).map(shape).collect();
    let got: Vec<_> = direct.iter().map(shape).collect();
    assert_eq!(got, want, "the direct catch-up differs from the consumer");
    assert_eq!(
        kv.direct_catch_up_reads(),
        direct.len() as u64,
        "the gap was not read by direct gets"
    );
    // Every update is after the cursor, in revision order, and the removed ones are absent.
    let revs: Vec<u64> = got.iter().filter_map(|u| u.2).collect();
    assert_eq!(revs.len(), got.len());
    assert!(revs.windows(2).all(|w| w[0] < w[1]));
    assert!(revs.iter().all(|r| *r > cursor));
    assert!(revs[..revs.len() - 1].iter().all(|r| *r <= last));
    assert_eq!(
        got.iter().filter(|u| u.0 == "k.hot").count(),
        1,
        "the overwritten messages of k.hot are delivered"
    );
    assert!(got.iter().any(|u| u.0 == "k.05" && u.1 == "del"));
    assert!(got.iter().any(|u| u.0 == "k.06" && u.1 == "purge"));
    // The consumer after the catch-up delivers the next write, and only it.
    assert_eq!(shape(&live_ref).0, "k.live1");
    assert_eq!(shape(&live).0, "k.live2");
    assert!(shape(&live).2 > Some(last));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_gap_of_mostly_removed_messages_is_read_by_the_consumer_and_loses_nothing()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("removed").await?;
    kv.put("k.a", "a".into()).await?;
    let cursor = kv.positions().await?.last_sequence;
    let max_absent = foldhost_core::protocol::DIRECT_CATCH_UP_MAX_ABSENT as u64;
    for i in 0..=max_absent + 1 {
        kv.put("k.hot", format!("{i}").into()).await?;
    }
    kv.put("k.b", "b".into()).await?;
    let (got, _) = delta_then_live(kv.clone(), cursor, "k.live").await?;
    assert_eq!(
        kv.direct_catch_up_reads(),
        0,
        "a gap of more than {max_absent} removed messages should give way to the consumer"
    );
    let got: Vec<_> = got.iter().map(shape).collect();
    let keys: Vec<&str> = got.iter().map(|u| u.0.as_str()).collect();
    assert_eq!(keys, ["k.hot", "k.b"]);
    assert_eq!(got[0].3, format!("{}", max_absent + 1).into_bytes());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetched_resume_gap_serves_only_the_watch_from_the_cursor_it_was_read_after()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("prefetch").await?;
    for i in 0..20 {
        kv.put(&format!("k.{i:02}"), format!("before {i}").into())
            .await?;
    }
    let cursor = kv.positions().await?.last_sequence;
    for i in 0..30 {
        kv.put(&format!("k.{:02}", i * 7 % 40), format!("gap {i}").into())
            .await?;
    }
    kv.set_direct_catch_up(false);
    let (reference, live_ref) = delta_then_live(kv.clone(), cursor, "k.live1").await?;
    kv.set_direct_catch_up(true);
    let want: Vec<_> = reference.iter().chain([&live_ref]).map(shape).collect();

    // Read ahead from the cursor, then the watch from it: the gap is read once, by the prefetch.
    kv.prefetch_resume_gap(cursor);
    let (got, _) = delta_then_live(kv.clone(), cursor, "k.live2").await?;
    let got_shape: Vec<_> = got.iter().map(shape).collect();
    assert_eq!(got_shape, want);
    assert_eq!(
        kv.direct_catch_up_reads(),
        got.len() as u64,
        "the watch read the gap again instead of taking the prefetch"
    );

    // A prefetch read from an earlier cursor would hand over five updates the watch must not see.
    kv.prefetch_resume_gap(cursor - 5);
    let (got, _) = delta_then_live(kv.clone(), cursor, "k.live3").await?;
    assert!(
        got.iter().all(|u| u.revision().is_some_and(|r| r > cursor)),
        "a prefetch from another cursor was used"
    );
    assert_eq!(got.len(), want.len() + 1, "the gap plus k.live2");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetch_read_from_a_stream_since_recreated_is_never_handed_over() -> anyhow::Result<()>
{
    let h = Harness::start().await?;
    let kv = h.bucket("recreated").await?;
    for i in 0..10 {
        kv.put(&format!("k.{i}"), "old".into()).await?;
    }
    kv.prefetch_resume_gap(5);
    // The prefetch reads the old stream to the end before the stream goes (a wait on the count
    // of messages it read, bounded).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while kv.direct_catch_up_reads() < 5 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the prefetch did not read the gap"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    kv.jetstream().delete_stream("KV_recreated").await?;
    // Recreated under the same name; `kv`, which holds the prefetch, names the stream by name.
    drop(h.bucket("recreated").await?);
    for i in 0..10 {
        kv.put(&format!("k.{i}"), "new".into()).await?;
    }
    let (got, _) = delta_then_live(kv.clone(), 5, "k.live").await?;
    let values: Vec<_> = got.iter().map(|u| shape(u).3).collect();
    assert_eq!(
        got.len(),
        5,
        "{:?}",
        got.iter().map(shape).collect::<Vec<_>>()
    );
    assert!(
        values.iter().all(|v| v == b"new"),
        "the old stream's prefetched messages were handed over"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_watch_reads_its_short_gap_directly_and_keeps_only_its_scope() -> anyhow::Result<()>
{
    let h = Harness::start().await?;
    let kv = h.bucket("narrow").await?;
    for i in 0..10 {
        kv.put(&format!("a.{i}"), "before".into()).await?;
        kv.put(&format!("b.{i}"), "before".into()).await?;
    }
    let cursor = kv.positions().await?.last_sequence;
    for i in 0..25 {
        kv.put(&format!("a.{}", i % 12), format!("gap {i}").into())
            .await?;
        kv.put(&format!("b.{}", i % 7), format!("gap {i}").into())
            .await?;
    }
    kv.delete("a.3").await?;
    let scope = WatchScope::Prefix("a.".into());
    kv.set_direct_catch_up(false);
    let (reference, live_ref) =
        delta_then_live_in(kv.clone(), scope.clone(), cursor, "a.live1").await?;
    kv.set_direct_catch_up(true);
    let (direct, _) = delta_then_live_in(kv.clone(), scope, cursor, "a.live2").await?;
    let want: Vec<_> = reference.iter().chain([&live_ref]).map(shape).collect();
    let got: Vec<_> = direct.iter().map(shape).collect();
    assert_eq!(
        got, want,
        "the direct catch-up of a prefix watch differs from its consumer"
    );
    assert!(got.iter().all(|u| u.0.starts_with("a.")));
    assert!(
        kv.direct_catch_up_reads() > direct.len() as u64,
        "the gap (both prefixes) was not read by direct gets"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_answering_direct_gets_without_the_gap_never_makes_the_catch_up_skip_it()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("mx").await?;
    kv.put("m.0", "mirrored".into()).await?;
    // A mirror of the bucket's `m.` keys only, answering the bucket's direct gets (the server puts
    // it in the same queue group as the bucket itself): for every other key it answers "not
    // found", as a replica or mirror that is behind would.
    let js = kv.jetstream().clone();
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "MX_MIRROR".into(),
        mirror: Some(async_nats::jetstream::stream::Source {
            name: "KV_mx".into(),
            filter_subject: Some("$KV.mx.m.>".into()),
            ..Default::default()
        }),
        mirror_direct: true,
        allow_direct: true,
        ..Default::default()
    })
    .await?;
    // The mirror answers once it has caught up (it holds m.0): a wait on that, bounded.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut m = js.get_stream("MX_MIRROR").await?;
        if m.info().await?.state.messages >= 1 {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the mirror never caught up"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let cursor = kv.positions().await?.last_sequence;
    for i in 0..40 {
        kv.put(&format!("k.{i:02}"), format!("gap {i}").into())
            .await?;
    }
    kv.set_direct_catch_up(false);
    let (reference, live_ref) = delta_then_live(kv.clone(), cursor, "k.live1").await?;
    kv.set_direct_catch_up(true);
    let (direct, _) = delta_then_live(kv.clone(), cursor, "k.live2").await?;
    let want: Vec<_> = reference.iter().chain([&live_ref]).map(shape).collect();
    let got: Vec<_> = direct.iter().map(shape).collect();
    assert_eq!(
        got, want,
        "the catch-up skipped what the mirror did not hold"
    );
    assert_eq!(
        kv.direct_catch_up_reads(),
        41,
        "the gap was not read directly"
    );
    // The catch-up reads the stream's leader (`STREAM.MSG.GET`), which the mirror never answers
    // for: what it does not hold cannot be taken for an absence.
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_cut_off_before_its_first_delivery_ends_the_watch_instead_of_replaying_the_stream()
-> anyhow::Result<()> {
    use futures::TryStreamExt as _;
    let h = Harness::start().await?;
    let kv = h.bucket("cutoff").await?;
    // The client's ordered consumer (the lean connection's own consumer is never re-created: see
    // `a_lean_watch_cut_off_from_its_consumer_ends_instead_of_waiting_forever`).
    kv.set_lean_delivery(None);
    for i in 0..30 {
        kv.put(&format!("k.{i:02}"), "before".into()).await?;
    }
    let cursor = kv.positions().await?.last_sequence;
    kv.put("k.gap", "gap".into()).await?;
    // The gap is read directly; the watch's consumer starts past it and has nothing to deliver.
    let (tx, mut rx) = mpsc::channel(64);
    let k = kv.clone();
    let task = tokio::spawn(async move {
        k.watch_from(&WatchScope::All, WatchCursor::at(cursor), tx)
            .await
    });
    let mut got: Vec<KvUpdate> = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await? {
            Some(WatchEvent::Updates(us)) => got.extend(us),
            Some(WatchEvent::CaughtUp { .. }) => break,
            Some(_) => {}
            None => anyhow::bail!("watch ended before it was level: {:?}", task.await?),
        }
    }
    assert_eq!(
        kv.direct_catch_up_reads(),
        1,
        "the gap was not read directly"
    );
    // Cut the consumer off before it delivered anything: the client re-creates it, and an ordered
    // consumer that delivered nothing is re-created at the stream's first message.
    let stream = kv.jetstream().get_stream("KV_cutoff").await?;
    let names: Vec<String> = stream.consumer_names().try_collect().await?;
    anyhow::ensure!(!names.is_empty(), "the watch has no consumer");
    for n in &names {
        stream.delete_consumer(n).await?;
    }
    // The watch must end (the fold restarts it from its cursor) without handing over anything at
    // or below the cursor.
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await? {
            Some(WatchEvent::Updates(us)) => got.extend(us),
            Some(_) => {}
            None => break task.await?,
        }
    };
    assert!(
        got.iter().all(|u| u.revision().is_some_and(|r| r > cursor)),
        "the re-created consumer replayed the stream: {:?}",
        got.iter().map(shape).collect::<Vec<_>>()
    );
    match ended {
        Err(KvError::WatchError(m)) => assert!(m.contains("re-created behind"), "{m}"),
        other => anyhow::bail!("the watch should end with a re-created consumer: {other:?}"),
    }
    Ok(())
}
