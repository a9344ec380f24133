//! Deferral (docs/design.md, "Deferral"): a record a guest version cannot decode is retained
//! durably in the fold, later updates of its key wait behind it, `applied_through` stays below it
//! while the cursor moves on, and a version that decodes it applies the retained records first, in
//! log order.
//!
//! The first test drives [`Fold`] directly with a native applier (deterministic, no server): it pins
//! the same-batch rule (an update after a deferred one of its key is held back even when the guest
//! would accept it). The others run the real binary against a real nats-server with the `kvstore`
//! guests: 0.1.0 defers `fmt2:` values, 0.2.0 decodes them and reports per key the revisions it
//! applied (`history:<key>`), and fails on any revision applied twice or out of order.

use std::process::{Child, Stdio};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use foldhost_core::kv::{KvEntry, KvUpdate, KvWriter, VersionToken, WatchCursor};
use foldhost_core::snapshot::{AppendLogOptions, AppendLogSnapshot, SnapshotStore};
use foldhost_core::status::FoldStatus;
use foldhost_core::view::{FoldRead, SharedStore};
use foldhost_fold::applied::{Apply, ApplyError, Fold, Verdict};
use foldhost_tests::{
    Harness, bucket_contents, dump_store, first_difference, foldhost, guest_wasm, run_command,
    status_store, terminate, wait_status,
};

/// A native applier that defers `fmt2:` values unless it is the "new version", and records what it
/// was offered and what it applied.
#[derive(Default)]
struct Recorder {
    decodes_fmt2: bool,
    offered: Vec<Vec<u64>>,
    applied: Vec<(String, u64)>,
}

#[async_trait]
impl Apply for Recorder {
    fn describe(&self) -> String {
        format!("native:recorder(fmt2={})", self.decodes_fmt2)
    }

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        self.offered
            .push(batch.iter().filter_map(KvUpdate::revision).collect());
        Ok(batch
            .iter()
            .map(|u| match u {
                KvUpdate::Put(e) if e.value.starts_with(b"fmt2:") && !self.decodes_fmt2 => {
                    Verdict::Defer
                }
                _ => Verdict::Accept,
            })
            .collect())
    }

    async fn apply(&mut self, batch: &[KvUpdate], verdicts: &[Verdict]) -> Result<(), ApplyError> {
        for (u, v) in batch.iter().zip(verdicts) {
            if *v == Verdict::Accept {
                self.applied
                    .push((u.key().to_string(), u.revision().unwrap_or(0)));
            }
        }
        Ok(())
    }

    async fn on_applied(&mut self, _cursor: WatchCursor) {}
}

fn put(key: &str, value: &str, rev: u64) -> KvUpdate {
    KvUpdate::Put(KvEntry {
        key: key.into(),
        value: Bytes::from(value.to_string()),
        version: VersionToken::from_u64(rev),
    })
}

fn applied(v: &[(&str, u64)]) -> Vec<(String, u64)> {
    v.iter().map(|(k, r)| (k.to_string(), *r)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_with_a_deferred_record_applies_nothing_later_until_a_new_version_releases_it_in_order()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let open = || AppendLogSnapshot::open(dir.path(), AppendLogOptions::default());
    let (store, _) = open()?;
    let shared = SharedStore::new(store);
    let status = Arc::new(FoldStatus::default());
    let mut fold = Fold::new(shared.clone(), status.clone())?;
    let mut v1 = Recorder::default();

    // r2 holds `a` at a value the guest applied; r3 is a format v1 cannot read; r5 would be
    // accepted by v1 but must wait behind r3.
    let first = vec![
        put("a", "a-old", 2),
        put("b", "b1", 3),
        put("a", "fmt2:a-new", 4),
        put("c", "c1", 5),
        put("a", "a-plain", 6),
    ];
    assert!(fold.flush(first, &mut v1).await?.is_none());
    assert_eq!(
        v1.offered,
        vec![vec![2, 3, 4, 5, 6], vec![2, 3, 5]],
        "re-parsed without the deferred record and the one behind it"
    );
    assert_eq!(applied(&[("a", 2), ("b", 3), ("c", 5)]), v1.applied);
    // A later batch: `a` is still blocked, so its update is held before the guest sees it.
    assert!(
        fold.flush(vec![put("a", "a-later", 7), put("d", "d1", 8)], &mut v1)
            .await?
            .is_none()
    );
    assert_eq!(v1.offered.last(), Some(&vec![8]));
    assert_eq!(
        fold.cursor(),
        WatchCursor::at(8),
        "the cursor covers retained records"
    );
    let load = |s: &FoldStatus, f: fn(&FoldStatus) -> &std::sync::atomic::AtomicU64| {
        f(s).load(std::sync::atomic::Ordering::Relaxed)
    };
    assert_eq!(load(&status, |s| &s.retained), 3);
    assert_eq!(load(&status, |s| &s.applied_through), 3, "held below r4");
    assert_eq!(load(&status, |s| &s.oldest_retained_revision), 4);
    // The guest's view of `a` is what it applied (r2); the fold itself holds the latest value.
    assert_eq!(
        FoldRead::get(&shared, "a")?.map(|e| e.value),
        Some(Bytes::from_static(b"a-old"))
    );
    assert_eq!(
        shared.read()?.get("a")?.map(|e| e.value),
        Some(Bytes::from_static(b"a-later"))
    );
    let keys: Vec<String> = FoldRead::scan(&shared, "", None, 100)?
        .into_iter()
        .map(|e| e.key)
        .collect();
    assert_eq!(
        keys,
        ["a", "b", "c", "d"],
        "no reserved key in the guest's view"
    );

    // Durable: a reopened store still retains them, with the same view.
    drop(fold);
    let store = shared
        .into_inner()
        .map_err(|_| anyhow::anyhow!("store still shared"))?;
    drop(store);
    let shared = SharedStore::new(open()?.0);
    let status = Arc::new(FoldStatus::default());
    let mut fold = Fold::new(shared.clone(), status.clone())?;
    assert_eq!(load(&status, |s| &s.retained), 3);
    assert_eq!(
        FoldRead::get(&shared, "a")?.map(|e| e.version),
        Some(VersionToken::from_u64(2))
    );

    // The same version again defers again: nothing released.
    let mut again = Recorder::default();
    assert_eq!(fold.release(&mut again).await?, (0, 3));
    assert!(again.applied.is_empty());

    // A version that decodes it: released in log order, once each.
    let mut v2 = Recorder {
        decodes_fmt2: true,
        ..Recorder::default()
    };
    assert_eq!(fold.release(&mut v2).await?, (3, 0));
    assert_eq!(applied(&[("a", 4), ("a", 6), ("a", 7)]), v2.applied);
    assert_eq!(load(&status, |s| &s.retained), 0);
    assert_eq!(load(&status, |s| &s.applied_through), 8);
    assert_eq!(
        FoldRead::get(&shared, "a")?.map(|e| e.value),
        Some(Bytes::from_static(b"a-later"))
    );
    assert!(
        fold.flush(vec![put("a", "a9", 9)], &mut v2)
            .await?
            .is_none()
    );
    assert_eq!(v2.applied.last(), Some(&("a".to_string(), 9)));
    Ok(())
}

fn start_host(
    h: &Harness,
    bucket: &str,
    store: &std::path::Path,
    addr: &str,
    extra: &[&str],
) -> anyhow::Result<Child> {
    Ok(run_command(h, bucket, store, Some(addr))
        .arg("--guest")
        .arg(guest_wasm("kvstore"))
        .args(extra)
        .env("FOLDHOST_LOG", "foldhost=debug")
        .stderr(Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(store.with_extension("log"))?,
        ))
        .spawn()?)
}

/// The host's log (kept beside the store), for assertion messages.
fn host_log(store: &std::path::Path) -> String {
    std::fs::read_to_string(store.with_extension("log")).unwrap_or_default()
}

async fn query(addr: &str, request: &str) -> anyhow::Result<(u16, String)> {
    let (code, body) = foldhost::serve::call(addr, "POST", "/query", request.as_bytes()).await?;
    Ok((code, String::from_utf8_lossy(&body).into_owned()))
}

fn swap_to_v2(addr: &str) -> anyhow::Result<serde_json::Value> {
    let out = foldhost()
        .args(["swap", "--listen", addr, "--guest"])
        .arg(guest_wasm("kvstore_v2"))
        .env_remove("FOLDHOST_ADMIN_TOKEN")
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "swap failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v2_record_and_a_later_v1_write_wait_for_v2_then_apply_in_order() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    // History 10: every revision stays in the stream until the host has it, even under load (with
    // history 1, a lagging watcher would never see `fmt2:a1` once `a2` replaced it).
    let kv = h.bucket_with_history("defer", 10).await?;
    let a0 = kv.put("k.a", "a0".into()).await?.as_u64().unwrap_or(0);
    for i in 0..50 {
        kv.put(&format!("k.{i:02}"), format!("v{i}").into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = start_host(&h, "defer", &store, &addr, &[])?;
    wait_status(&addr, |s| s.applied_through >= 51).await?;

    let rev = |v: VersionToken| v.as_u64().unwrap_or(0);
    let r1 = rev(kv.put("k.a", "fmt2:a1".into()).await?);
    let r2 = rev(kv.put("k.a", "a2".into()).await?);
    let r3 = rev(kv.put("k.b", "b1".into()).await?);
    let r4 = rev(kv.put("k.c", "fmt2:c1".into()).await?);
    kv.delete("k.c").await?;
    let r5 = kv.positions().await?.last_sequence;
    let s = wait_status(&addr, |s| s.cursor >= Some(r5)).await?;
    assert_eq!(s.state, "running", "{s:?}");
    assert_eq!(
        s.retained,
        4,
        "r1, r2 (behind r1), r4, r5 (behind r4): {s:?}\n{}",
        host_log(&store)
    );
    assert_eq!(s.oldest_retained_revision, Some(r1), "{s:?}");
    assert_eq!(s.seq, r5, "seq advances over retained records: {s:?}");
    assert_eq!(
        s.applied_through,
        r1 - 1,
        "applied_through stays below the oldest retained record: {s:?}"
    );
    // v1 serves what it applied: k.a as before the deferral; k.b (never deferred) moved on.
    assert_eq!(query(&addr, "k.a").await?, (200, "a0".into()));
    assert_eq!(query(&addr, "k.b").await?, (200, "b1".into()));
    assert_eq!(query(&addr, "k.c").await?.0, 422);

    let report = swap_to_v2(&addr)?;
    assert_eq!(report["to"], "kvstore@0.2.0");
    assert_eq!(report["released"], 4, "{report}");
    assert_eq!(report["still_retained"], 0, "{report}");
    let s = wait_status(&addr, |_| true).await?;
    assert_eq!(s.retained, 0, "{s:?}");
    assert_eq!(
        s.applied_through, s.seq,
        "applied_through caught up to seq: {s:?}"
    );
    assert_eq!(query(&addr, "k.a").await?, (200, "v2:a2".into()));
    assert_eq!(
        query(&addr, "history:k.a").await?,
        (200, format!("{a0},{r1},{r2}")),
        "the base, then both retained records, in log order, once each"
    );
    assert_eq!(
        query(&addr, "history:k.c").await?,
        (200, format!("{r4},{r5}"))
    );
    assert_eq!(query(&addr, "k.c").await?.0, 422, "the delete applied last");
    assert_eq!(query(&addr, "history:k.b").await?, (200, r3.to_string()));

    // v2 decodes new writes directly.
    let r6 = rev(kv.put("k.a", "fmt2:a3".into()).await?);
    wait_status(&addr, |s| s.applied_through >= r6).await?;
    assert_eq!(query(&addr, "k.a").await?, (200, "v2:a3".into()));
    terminate(&mut host)?;
    let want = bucket_contents(&kv).await?;
    assert_eq!(first_difference(&want, &dump_store(&store)?), None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_records_survive_a_restart_warn_past_the_grace_and_release_after_the_swap()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket_with_history("keep", 10).await?;
    let x0 = kv.put("k.x", "x0".into()).await?.as_u64().unwrap_or(0);
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = start_host(&h, "keep", &store, &addr, &[])?;
    wait_status(&addr, |s| s.applied_through >= x0).await?;
    let rev = |v: VersionToken| v.as_u64().unwrap_or(0);
    let r1 = rev(kv.put("k.x", "fmt2:x1".into()).await?);
    let r2 = rev(kv.put("k.x", "x2".into()).await?);
    wait_status(&addr, |s| s.cursor >= Some(r2)).await?;
    // A crash, not a clean stop.
    host.kill()?;
    host.wait()?;

    let s = status_store(&store)?;
    assert_eq!(
        s.retained,
        2,
        "retained on disk: {s:?}\n{}",
        host_log(&store)
    );
    assert_eq!(s.oldest_retained_revision, Some(r1), "{s:?}");
    assert_eq!(s.applied_through, r1 - 1, "{s:?}");
    assert_eq!(s.cursor, Some(r2), "{s:?}");

    // Restarted with the same version and a 1 s grace: still retained, and soon warned about.
    let mut host = start_host(&h, "keep", &store, &addr, &["--defer-grace-secs", "1"])?;
    let s = wait_status(&addr, |s| !s.warnings.is_empty()).await?;
    assert_eq!(s.retained, 2, "{s:?}");
    let warning = s.warnings.first().map(String::as_str).unwrap_or_default();
    assert!(
        warning.contains("k.x") && warning.contains(&r1.to_string()),
        "the warning names the key and the revision: {warning}"
    );
    assert_eq!(query(&addr, "k.x").await?, (200, "x0".into()));

    let report = swap_to_v2(&addr)?;
    assert_eq!(report["released"], 2, "{report}");
    let s = wait_status(&addr, |_| true).await?;
    assert_eq!(s.retained, 0, "{s:?}");
    assert_eq!(s.warnings.len(), 0, "{s:?}");
    assert_eq!(s.applied_through, r2, "{s:?}");
    assert_eq!(query(&addr, "k.x").await?, (200, "v2:x2".into()));
    assert_eq!(
        query(&addr, "history:k.x").await?,
        (200, format!("{x0},{r1},{r2}"))
    );
    terminate(&mut host)?;
    let s = status_store(&store)?;
    assert_eq!(s.retained, 0, "released on disk too: {s:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_publishes_of_reserved_looking_keys_are_skipped_and_never_touch_retained_records()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket_with_history("rsv", 10).await?;
    let a0 = kv.put("k.a", "a0".into()).await?.as_u64().unwrap_or(0);
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = start_host(&h, "rsv", &store, &addr, &[])?;
    wait_status(&addr, |s| s.applied_through >= a0).await?;
    // v1 defers r1: one retained record, stored under `\x01retained/<r1>/k.a`.
    let r1 = kv.put("k.a", "fmt2:a1".into()).await?.as_u64().unwrap_or(0);
    wait_status(&addr, |s| s.cursor >= Some(r1)).await?;
    // A bucket writer forges records in the host's space: one at the real record's own key (a
    // fake base for k.a), one fresh, and a delete of the real one.
    let js = kv.jetstream().clone();
    let real = format!("\u{1}retained/{r1:020}/k.a");
    for (key, value) in [
        (real.clone(), "forged"),
        ("\u{1}retained/00000000000000000001/k1".to_string(), "junk"),
    ] {
        js.publish(format!("$KV.rsv.{key}"), value.into())
            .await?
            .await?;
    }
    let mut del = async_nats::HeaderMap::new();
    del.insert("KV-Operation", "DEL");
    js.publish_with_headers(format!("$KV.rsv.{real}"), del, Bytes::new())
        .await?
        .await?;
    // A key starting with NUL would sort before the host's space, where every scan of the whole
    // fold starts past it (a guest's scan, `dump`, a state bucket's size): skipped the same way.
    js.publish("$KV.rsv.\u{0}k.c", "hidden".into())
        .await?
        .await?;
    // The node keeps folding past them.
    let r2 = kv.put("k.b", "b1".into()).await?.as_u64().unwrap_or(0);
    let s = wait_status(&addr, |s| s.cursor >= Some(r2)).await?;
    assert_eq!(s.state, "running", "{s:?}");
    assert_eq!(s.retained, 1, "the real record only: {s:?}");
    assert!(
        host_log(&store).contains("reserved space"),
        "each skip is warned about"
    );
    // A restart opens the store; status and dump read it; the record is intact.
    terminate(&mut host)?;
    let st = status_store(&store)?;
    assert_eq!(st.retained, 1, "{st:?}");
    assert_eq!(st.oldest_retained_revision, Some(r1), "{st:?}");
    let dump = dump_store(&store)?;
    assert!(dump.keys().all(|k| !k.starts_with('\u{1}')), "{dump:?}");
    {
        let (s, _) = foldhost_core::storedir::AnyStore::open_read_only(&store)?;
        assert_eq!(s.get("\u{0}k.c")?, None, "a NUL-led key is never folded");
    }
    let mut host = start_host(&h, "rsv", &store, &addr, &[])?;
    wait_status(&addr, |s| s.cursor >= Some(r2)).await?;
    // The real deferred update is released, in order, on top of the real base.
    let report = swap_to_v2(&addr)?;
    assert_eq!(report["released"], 1, "{report}");
    assert_eq!(query(&addr, "k.a").await?, (200, "v2:a1".into()));
    assert_eq!(
        query(&addr, "history:k.a").await?,
        (200, format!("{a0},{r1}"))
    );
    terminate(&mut host)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fold_holding_forged_retained_records_from_an_older_version_opens_and_drops_them()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("migrate").await?;
    let r1 = kv.put("k", "v".into()).await?.as_u64().unwrap_or(0);
    // The fold an older version left after a raw publish of `\x01retained/…/k1`: the bucket's key
    // at revision r1, and the forged "record" beside it.
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let forged = "\u{1}retained/00000000000000000001/k1".to_string();
    {
        let (mut s, _) = foldhost_core::storedir::AnyStore::open(
            &store,
            foldhost_core::storedir::Backend::AppendLog,
        )?;
        let batch = [
            KvUpdate::Put(KvEntry {
                key: "k".into(),
                value: Bytes::from_static(b"v"),
                version: VersionToken::from_u64(r1),
            }),
            KvUpdate::Put(KvEntry {
                key: forged.clone(),
                value: Bytes::from_static(b"junk"),
                version: VersionToken::UNKNOWN,
            }),
        ];
        s.apply(&batch, WatchCursor::at(r1))?;
    }
    // Read-only readers are not bricked by it.
    let st = status_store(&store)?;
    assert_eq!(st.retained, 0, "{st:?}");
    assert_eq!(st.cursor, Some(r1), "{st:?}");
    // A run opens the fold, deletes the forged record, and folds on.
    let r2 = kv.put("k2", "v2".into()).await?.as_u64().unwrap_or(0);
    let o = run_command(&h, "migrate", &store, None)
        .arg("--catch-up")
        .arg("--guest")
        .arg(guest_wasm("kvstore"))
        .output()?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (s, _) = foldhost_core::storedir::AnyStore::open_read_only(&store)?;
    assert_eq!(s.get(&forged)?, None, "the forged record is gone");
    assert_eq!(s.cursor().revision(), Some(r2));
    drop(s);
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&store)?),
        None
    );
    Ok(())
}

/// Fails `apply` whenever its batch holds the key `bad` (accepting everything in `parse`).
#[derive(Default)]
struct FailsOnBad;

#[async_trait]
impl Apply for FailsOnBad {
    fn describe(&self) -> String {
        "native:fails-on-bad".into()
    }

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        Ok(vec![Verdict::Accept; batch.len()])
    }

    async fn apply(&mut self, batch: &[KvUpdate], _verdicts: &[Verdict]) -> Result<(), ApplyError> {
        if batch.iter().any(|u| u.key() == "bad") {
            return Err(ApplyError {
                applier: self.describe(),
                call: "apply",
                message: "bad".into(),
            });
        }
        Ok(())
    }

    async fn on_applied(&mut self, _cursor: WatchCursor) {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipped_reserved_key_never_lets_a_retried_half_commit_a_cursor_over_unapplied_updates()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (store, _) = AppendLogSnapshot::open(dir.path(), AppendLogOptions::default())?;
    let mut fold = Fold::new(SharedStore::new(store), Arc::new(FoldStatus::default()))?;
    let mut apply = FailsOnBad;
    let batch = vec![
        put("a", "1", 1),
        put("\u{1}retained/00000000000000000009/x", "forged", 2),
        put("b", "3", 3),
        put("bad", "4", 4),
    ];
    // The apply fails: the batch comes back as delivered, the skipped key in it.
    let back = fold
        .flush(batch.clone(), &mut apply)
        .await?
        .ok_or_else(|| anyhow::anyhow!("the failed batch was not handed back"))?;
    assert_eq!(back, batch);
    // A retry of the first update alone commits a cursor at 1, not over the skipped key at 2
    // (b at 3 and bad at 4 are not applied).
    assert!(fold.flush(back[..1].to_vec(), &mut apply).await?.is_none());
    assert_eq!(fold.cursor(), WatchCursor::at(1));
    // The next half, with the skipped key and b, moves it to 3; bad (4) stays unapplied.
    assert!(fold.flush(back[1..3].to_vec(), &mut apply).await?.is_none());
    assert_eq!(fold.cursor(), WatchCursor::at(3));
    assert!(fold.flush(back[3..].to_vec(), &mut apply).await?.is_some());
    assert_eq!(fold.cursor(), WatchCursor::at(3));
    assert_eq!(
        fold.store()
            .read()?
            .get("\u{1}retained/00000000000000000009/x")?,
        None
    );

    // A batch of nothing but a skipped key (the stream's last message, say) still moves the
    // cursor, so a catch-up reaches its target.
    let dir = tempfile::tempdir()?;
    let (store, _) = AppendLogSnapshot::open(dir.path(), AppendLogOptions::default())?;
    let mut fold = Fold::new(SharedStore::new(store), Arc::new(FoldStatus::default()))?;
    assert!(
        fold.flush(vec![put("a", "1", 1)], &mut apply)
            .await?
            .is_none()
    );
    assert!(
        fold.flush(vec![put("\u{1}x", "y", 2)], &mut apply)
            .await?
            .is_none()
    );
    assert_eq!(fold.cursor(), WatchCursor::at(2));
    assert_eq!(fold.store().read()?.get("\u{1}x")?, None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_writes_the_same_applied_through_as_status_while_records_are_retained()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket_with_history("stopped", 10).await?;
    let x0 = kv.put("k.x", "x0".into()).await?.as_u64().unwrap_or(0);
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = start_host(&h, "stopped", &store, &addr, &[])?;
    wait_status(&addr, |s| s.applied_through >= x0).await?;
    let r1 = kv.put("k.x", "fmt2:x1".into()).await?.as_u64().unwrap_or(0);
    let r2 = kv.put("k.y", "y1".into()).await?.as_u64().unwrap_or(0);
    let live = wait_status(&addr, |s| s.cursor >= Some(r2)).await?;
    assert_eq!(live.applied_through, r1 - 1, "{live:?}");
    let exit = terminate(&mut host)?;
    assert!(exit.success(), "{exit}");
    let file = foldhost_core::storedir::read_status(&store)
        .ok_or_else(|| anyhow::anyhow!("no status.json after a clean stop"))?;
    assert_eq!(file.state, "stopped");
    assert_eq!(file.applied_through, r1 - 1, "status.json after the stop");
    let st = status_store(&store)?;
    assert_eq!(st.applied_through, r1 - 1, "status --store: {st:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relist_delete_of_a_key_with_a_retained_record_is_released_after_it_in_log_order()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket_with_history("resync", 10).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let rev = |v: VersionToken| v.as_u64().unwrap_or(0);
    // The host starts first: each revision is delivered (a state-sync start would deliver the
    // key's last revision only).
    let mut host = start_host(&h, "resync", &store, &addr, &[])?;
    wait_status(&addr, |s| s.state == "running").await?;
    let a0 = rev(kv.put("k.a", "a0".into()).await?);
    wait_status(&addr, |s| s.applied_through >= a0).await?;
    let r1 = rev(kv.put("k.a", "fmt2:a1".into()).await?);
    let s = wait_status(&addr, |s| s.cursor >= Some(r1)).await?;
    assert_eq!(s.retained, 1, "{s:?}");
    assert_eq!(s.applied_through, a0, "{s:?}");
    terminate(&mut host)?;

    // While the node is down the key is deleted and its every message purged: the cursor is
    // expired, and the delete survives only as the listing's silence.
    kv.delete("k.a").await?;
    let stream = kv.jetstream().get_stream("KV_resync").await?;
    stream.purge().filter("$KV.resync.k.a").await?;
    let b1 = rev(kv.put("k.b", "b1".into()).await?);
    assert!(kv.positions().await?.first_sequence > r1 + 1, "expired");

    // The re-list's synthetic delete of k.a waits behind k.a's retained record (k.a is blocked),
    // retained after it in log order: applied_through stays where it was, never 0.
    let mut host = start_host(&h, "resync", &store, &addr, &[])?;
    let s = wait_status(&addr, |s| s.cursor >= Some(b1)).await?;
    assert_eq!(s.repairs, 1, "{s:?}\n{}", host_log(&store));
    assert_eq!(s.retained, 2, "{s:?}\n{}", host_log(&store));
    assert_eq!(
        s.applied_through, a0,
        "applied_through never goes backwards: {s:?}"
    );
    assert_eq!(s.oldest_retained_revision, Some(r1), "{s:?}");
    assert_eq!(
        query(&addr, "k.a").await?,
        (200, "a0".into()),
        "v1 serves the base: {}",
        host_log(&store)
    );

    // The version that decodes it applies k.a's history as the log has it: the put, then the
    // delete — so the guest's answer is the fold's (no k.a).
    let report = swap_to_v2(&addr)?;
    assert_eq!(report["released"], 2, "{report}");
    assert_eq!(report["still_retained"], 0, "{report}");
    let s = wait_status(&addr, |_| true).await?;
    assert_eq!(s.applied_through, b1, "{s:?}");
    assert_eq!(
        query(&addr, "history:k.a").await?,
        (200, format!("{a0},{r1}")),
        "the base, then the retained put (the synthetic delete carries no revision)"
    );
    assert_eq!(
        query(&addr, "k.a").await?.0,
        422,
        "the delete applied last: {}",
        host_log(&store)
    );
    assert_eq!(query(&addr, "k.b").await?, (200, "v2:b1".into()));
    terminate(&mut host)?;
    let want = bucket_contents(&kv).await?;
    assert_eq!(first_difference(&want, &dump_store(&store)?), None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursorless_start_never_reports_applied_through_over_revisions_it_never_saw()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    // History 1: a rewritten key keeps only its newest record, so a cursor-less start (a
    // state-sync re-list) never sees what revisions 1–5 were.
    let kv = h.bucket("unseen").await?;
    let mut last = 0;
    for k in ["k.r0", "k.r1", "k.r2", "k.d0", "k.d1"] {
        last = kv.put(k, "fmt2:old".into()).await?.as_u64().unwrap_or(0);
    }
    assert_eq!(last, 5);
    for i in 6..=25 {
        kv.put(&format!("k.p{i:02}"), "fmt2:p".into()).await?;
    }
    for k in ["k.r0", "k.r1", "k.r2"] {
        kv.put(k, "fmt2:new".into()).await?;
    }
    for k in ["k.d0", "k.d1"] {
        kv.delete(k).await?;
    }
    let end = kv.positions().await?.last_sequence;
    assert_eq!(end, 30);
    // kvstore 0.1.0 defers every `fmt2:` value: nothing of the bucket is applied.
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = start_host(&h, "unseen", &store, &addr, &[])?;
    let s = wait_status(&addr, |s| s.cursor >= Some(end)).await?;
    assert!(s.retained > 0, "{s:?}");
    // Revision 3 wrote k.r2, rewritten at 28 and retained: the fold holds no k.r2, so
    // applied_through must not cover 3 — nor anything the start never saw, which begins at 1.
    assert_eq!(s.applied_through, 0, "{s:?}\n{}", host_log(&store));
    // A read that must see revision 3 is not let through.
    let out = foldhost()
        .args([
            "get",
            "k.r2",
            "--listen",
            &addr,
            "--min-revision",
            "3",
            "--wait-ms",
            "0",
        ])
        .output()?;
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // A version that decodes them applies everything: then the whole log is covered.
    swap_to_v2(&addr)?;
    let s = wait_status(&addr, |s| s.retained == 0).await?;
    assert_eq!(s.applied_through, end, "{s:?}");
    let out = foldhost()
        .args([
            "get",
            "k.r2",
            "--listen",
            &addr,
            "--min-revision",
            "3",
            "--wait-ms",
            "0",
        ])
        .output()?;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    terminate(&mut host)?;
    Ok(())
}
