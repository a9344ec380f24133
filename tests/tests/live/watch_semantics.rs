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

mod delivery;
mod resume_gaps;

/// An update as comparable data: key, kind, revision, value.
fn shape(u: &KvUpdate) -> (String, &'static str, Option<u64>, Vec<u8>) {
    match u {
        KvUpdate::Put(e) => (e.key.clone(), "put", e.version.as_u64(), e.value.to_vec()),
        KvUpdate::Delete { key, version } => (key.clone(), "del", version.as_u64(), Vec::new()),
        KvUpdate::Purge { key, version } => (key.clone(), "purge", version.as_u64(), Vec::new()),
    }
}

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
