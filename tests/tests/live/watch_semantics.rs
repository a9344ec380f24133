//! The kv layer's contract against a real nats-server: state-sync re-list, complete listings of large
//! buckets, CAS conflicts, the resume window, and multi-prefix deltas.

use anyhow::Context as _;
use std::collections::BTreeSet;
use std::time::Duration;

use foldhost_core::kv::{
    KvError, KvReader, KvUpdate, KvWatcher, KvWriter, VersionToken, WatchCursor, WatchEvent,
    WatchScope,
};
use foldhost_nats::NatsKv;
use foldhost_tests::Harness;
use tokio::sync::mpsc;

/// Collects a watch's updates until it reports it is level (or `extra` more updates after that).
async fn collect_until_level(
    kv: std::sync::Arc<NatsKv>,
    scope: WatchScope,
    cursor: WatchCursor,
) -> anyhow::Result<Vec<KvUpdate>> {
    let (tx, mut rx) = mpsc::channel(64);
    let task = tokio::spawn(async move { kv.watch_from(&scope, cursor, tx).await });
    let mut got = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await? {
            Some(WatchEvent::Updates(us)) => got.extend(us),
            Some(WatchEvent::CaughtUp { .. }) => break,
            Some(WatchEvent::Pending(_) | WatchEvent::Stamp { .. } | WatchEvent::Ops(_)) => {}
            None => {
                let r = task.await?;
                anyhow::bail!("watch ended before it was level: {r:?}");
            }
        }
    }
    drop(rx);
    task.abort();
    Ok(got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_prefix_relist_covers_seed_then_watch_gap() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("relist").await?;
    for i in 0..100 {
        kv.put(&format!("svc.{i:03}"), "v".into()).await?;
    }
    kv.put("other.x", "not in scope".into()).await?;
    // A consumer that seeds from a scan and then watches new updates misses a write in between.
    let seed = kv.scan("svc.").await?;
    assert_eq!(seed.len(), 100);
    kv.put("svc.gap", "written between seed and watch".into())
        .await?;
    let got = collect_until_level(
        kv.clone(),
        WatchScope::Prefix("svc.".into()),
        WatchCursor::NONE,
    )
    .await?;
    let keys: BTreeSet<&str> = got.iter().map(KvUpdate::key).collect();
    assert!(
        keys.contains("svc.gap"),
        "the state-sync re-list covers the gap write"
    );
    assert_eq!(keys.len(), 101);
    assert!(!keys.contains("other.x"), "out-of-scope keys are filtered");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_a_bucket_of_5000_keys_is_complete() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("big").await?;
    let mut acks = Vec::new();
    let js = kv.jetstream().clone();
    for i in 0..5000 {
        // Pipelined publishes: fast, and each is still acknowledged by the stream.
        acks.push(
            js.publish(format!("$KV.big.k.{i:05}"), format!("v{i}").into())
                .await?,
        );
    }
    for a in acks {
        a.await?;
    }
    kv.delete("k.00007").await?;
    kv.put("k.00008", bytes::Bytes::new()).await?; // an empty value reads as a tombstone
    let keys = kv.keys("").await?;
    assert_eq!(
        keys.len(),
        4998,
        "listing stops early or keeps deleted keys"
    );
    assert!(keys.windows(2).all(|w| w[0] < w[1]), "keys come in order");
    let scan = kv.scan("k.").await?;
    assert_eq!(scan.len(), 4998);
    assert!(scan.iter().all(|e| e.version.as_u64().is_some()));
    let e = scan
        .iter()
        .find(|e| e.key == "k.04999")
        .ok_or_else(|| anyhow::anyhow!("k.04999 missing"))?;
    assert_eq!(&e.value[..], b"v4999");
    // The watch's re-list of the same bucket is complete too.
    let got = collect_until_level(kv.clone(), WatchScope::All, WatchCursor::NONE).await?;
    let puts = got.iter().filter(|u| matches!(u, KvUpdate::Put(_))).count();
    assert_eq!(puts, 4999);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cas_create_update_and_delete_with_version_conflict_as_specified() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("cas").await?;
    let v1 = kv.create("lock", "a".into()).await?;
    assert!(matches!(
        kv.create("lock", "b".into()).await,
        Err(KvError::AlreadyExists(k)) if k == "lock"
    ));
    let v2 = kv.update("lock", "b".into(), v1).await?;
    assert!(v2.as_u64() > v1.as_u64());
    assert!(matches!(
        kv.update("lock", "c".into(), v1).await,
        Err(KvError::RevisionMismatch { .. })
    ));
    assert!(matches!(
        kv.delete_with_version("lock", v1).await,
        Err(KvError::RevisionMismatch { .. })
    ));
    assert!(kv.delete_with_version("lock", v2).await?);
    assert_eq!(kv.get("lock").await?, None, "get filters the CAS tombstone");
    let raw = kv
        .entry("lock")
        .await?
        .ok_or_else(|| anyhow::anyhow!("entry must expose the tombstone"))?;
    assert!(raw.value.is_empty());
    assert!(raw.version.as_u64() > v2.as_u64());
    // A version that is not a NATS revision is refused before the server sees it.
    let fdb = VersionToken::from_bytes(&[1; 10]).ok_or_else(|| anyhow::anyhow!("token"))?;
    assert!(matches!(
        kv.update("lock", "d".into(), fdb).await,
        Err(KvError::Invalid(_))
    ));
    // A plain delete then create succeeds (the key is absent again).
    kv.put("k", "v".into()).await?;
    assert!(kv.delete("k").await?);
    assert_eq!(kv.get("k").await?, None);
    kv.create("k", "again".into()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_below_the_first_retained_revision_is_cursor_expired_not_a_silent_clamp()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("expiry").await?;
    // History 1: rewriting one key evicts its older messages, moving the stream's head.
    for i in 0..10 {
        kv.put("only", format!("v{i}").into()).await?;
    }
    let pos = kv.positions().await?;
    assert_eq!(pos.first_sequence, 10);
    let (tx, _rx) = mpsc::channel(8);
    let r = kv
        .watch_from(&WatchScope::All, WatchCursor::at(3), tx)
        .await;
    assert_eq!(
        r,
        Err(KvError::CursorExpired {
            resume_from: 4,
            first_sequence: 10
        })
    );
    // At the edge of the window the resume is sound and delivers the tail only.
    let got = collect_until_level(kv.clone(), WatchScope::All, WatchCursor::at(9)).await?;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].revision(), Some(10));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_prefix_delta_delivers_only_in_scope_updates_after_the_cursor() -> anyhow::Result<()>
{
    let h = Harness::start().await?;
    let kv = h.bucket("multi").await?;
    kv.put("a.1", "old".into()).await?;
    kv.put("b.1", "old".into()).await?;
    let cursor = WatchCursor::at(kv.positions().await?.last_sequence);
    kv.put("a.2", "new".into()).await?;
    kv.put("c.1", "out of scope".into()).await?;
    kv.put("b.1", "new".into()).await?;
    kv.delete("a.1").await?;
    let scope = WatchScope::Prefixes(vec!["a.".into(), "b.".into()]);
    let got = collect_until_level(kv.clone(), scope, cursor).await?;
    let seen: Vec<(String, bool)> = got
        .iter()
        .map(|u| (u.key().to_string(), matches!(u, KvUpdate::Put(_))))
        .collect();
    assert_eq!(
        seen,
        vec![
            ("a.2".to_string(), true),
            ("b.1".to_string(), true),
            ("a.1".to_string(), false)
        ]
    );
    let revs: Vec<u64> = got.iter().filter_map(KvUpdate::revision).collect();
    assert!(revs.windows(2).all(|w| w[0] < w[1]), "revision order");
    assert!(revs.iter().all(|r| *r > cursor.revision_or_zero()));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_is_read_live_from_the_stream_and_follows_an_edited_config() -> anyhow::Result<()>
{
    let h = Harness::start().await?;
    let keep = h.bucket("keepvalues").await?;
    for i in 0..5 {
        keep.put(&format!("k{i}"), "v".into()).await?;
    }
    let r = keep
        .retention()
        .await?
        .ok_or_else(|| anyhow::anyhow!("NATS can say"))?;
    assert!(!r.evicts_current_values, "no limits, history only: {r:?}");
    assert_eq!(r.first_revision, 1);
    assert!(foldhost_core::protocol::listing_is_truth(
        r.evicts_current_values,
        r.first_revision,
        false
    ));

    let aging = h
        .conn
        .bucket(
            "aging",
            &foldhost_core::bucket::BucketConfig {
                max_bytes: None,
                max_age: Some(Duration::from_secs(3600)),
                ..foldhost_core::bucket::BucketConfig::default()
            },
        )
        .await?;
    let r = aging
        .retention()
        .await?
        .ok_or_else(|| anyhow::anyhow!("no retention"))?;
    assert!(
        r.evicts_current_values,
        "max_age evicts current values: {r:?}"
    );

    // Edit the first bucket's stream: a message limit that discards the oldest. Read live, the
    // retention changes at once; and once the limit has evicted, the listing is not the truth.
    let js = keep.jetstream().clone();
    let mut stream = js.get_stream("KV_keepvalues").await?;
    let mut config = stream.info().await?.config.clone();
    config.max_messages = 3;
    config.discard = async_nats::jetstream::stream::DiscardPolicy::Old;
    js.update_stream(config).await?;
    let r = keep
        .retention()
        .await?
        .ok_or_else(|| anyhow::anyhow!("no retention"))?;
    assert!(
        r.evicts_current_values,
        "the edited config is what counts: {r:?}"
    );
    assert!(r.first_revision > 1, "the limit evicted k0 and k1: {r:?}");
    assert!(!foldhost_core::protocol::listing_is_truth(
        r.evicts_current_values,
        r.first_revision,
        false
    ));
    Ok(())
}

/// An update as comparable data: key, kind, revision, value.
fn shape(u: &KvUpdate) -> (String, &'static str, Option<u64>, Vec<u8>) {
    match u {
        KvUpdate::Put(e) => (e.key.clone(), "put", e.version.as_u64(), e.value.to_vec()),
        KvUpdate::Delete { key, version } => (key.clone(), "del", version.as_u64(), Vec::new()),
        KvUpdate::Purge { key, version } => (key.clone(), "purge", version.as_u64(), Vec::new()),
    }
}

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

/// Publishes `header` + `payload` to `subject` over a raw socket, as any writer may (the client
/// library refuses such header blocks), and waits for JetStream's acknowledgement.
pub(crate) async fn raw_publish(
    url: &str,
    subject: &str,
    header: &[u8],
    payload: &[u8],
) -> anyhow::Result<()> {
    use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};
    let addr = foldhost_nats::wire::server_address(url)
        .filter(|a| !a.tls)
        .context("a plain URL")?
        .host_port;
    let mut sock = tokio::io::BufReader::new(tokio::net::TcpStream::connect(addr).await?);
    let mut line = String::new();
    sock.read_line(&mut line).await?;
    anyhow::ensure!(line.starts_with("INFO"), "{line}");
    let mut out =
        b"CONNECT {\"verbose\":false,\"headers\":true,\"protocol\":1}\r\nSUB _RAW.ack 1\r\n"
            .to_vec();
    out.extend_from_slice(
        format!(
            "HPUB {subject} _RAW.ack {} {}\r\n",
            header.len(),
            header.len() + payload.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(header);
    out.extend_from_slice(payload);
    out.extend_from_slice(b"\r\n");
    sock.get_mut().write_all(&out).await?;
    loop {
        line.clear();
        anyhow::ensure!(
            sock.read_line(&mut line).await? > 0,
            "closed before the ack"
        );
        if line.starts_with("PING") {
            sock.get_mut().write_all(b"PONG\r\n").await?;
        } else if line.starts_with("MSG _RAW.ack") {
            let size: usize = line.split_whitespace().last().context("size")?.parse()?;
            let mut body = vec![0; size + 2];
            sock.read_exact(&mut body).await?;
            let body = String::from_utf8_lossy(&body);
            anyhow::ensure!(body.contains("\"seq\""), "not stored: {body}");
            return Ok(());
        } else if line.starts_with("-ERR") {
            anyhow::bail!("{line}");
        }
    }
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
