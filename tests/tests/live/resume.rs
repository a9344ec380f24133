//! Resume is a delta, and a failed store apply never leaves a gap — against a real nats-server, the
//! real `watch_applied` and the real append log on disk.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use foldhost_core::kv::{KvEntry, KvUpdate, KvWriter, WatchCursor, WatchScope};
use foldhost_core::snapshot::{AppendLogOptions, AppendLogSnapshot, SnapshotError, SnapshotStore};
use foldhost_core::status::FoldStatus;
use foldhost_core::view::SharedStore;
use foldhost_fold::applied::{
    AppliedError, Apply, ApplyError, BatchConfig, CountingApply, Verdict, WatchOptions,
    watch_applied,
};
use foldhost_nats::NatsKv;
use foldhost_tests::{Contents, Harness, bucket_contents, first_difference};

fn opts(max: usize) -> WatchOptions {
    WatchOptions {
        scope: WatchScope::All,
        batch: BatchConfig {
            max,
            ..BatchConfig::default()
        },
        catch_up: true,
        defer_grace: foldhost_fold::applied::DEFAULT_DEFER_GRACE,
        repair: Default::default(),
        queries: None,
    }
}

fn open(dir: &Path) -> AppendLogSnapshot {
    AppendLogSnapshot::open(dir, AppendLogOptions::default())
        .expect("open store")
        .0
}

fn contents_of(store: &impl SnapshotStore) -> Contents {
    let mut c = Contents::new();
    store
        .for_each_in_range("", &mut |e| {
            if foldhost_core::retained::is_reserved(&e.key) {
                return ControlFlow::Continue(()); // the host's own keys (the stream identity)
            }
            c.insert(
                e.key.clone(),
                (e.value.to_vec(), e.version.as_u64().unwrap_or(0)),
            );
            ControlFlow::Continue(())
        })
        .expect("scan store");
    c
}

async fn fold_once<S: SnapshotStore>(
    kv: &Arc<NatsKv>,
    store: S,
    max: usize,
) -> Result<(S, CountingApply), AppliedError> {
    let mut apply = CountingApply::default();
    let shared = SharedStore::new(store);
    watch_applied(
        kv.clone(),
        shared.clone(),
        &mut apply,
        opts(max),
        Arc::new(FoldStatus::default()),
        None,
        std::future::pending(),
    )
    .await?;
    let store = shared
        .into_inner()
        .map_err(|_| AppliedError::Task("store still shared".into()))?;
    Ok((store, apply))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_after_clean_restart_delivers_exactly_the_new_writes() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("resume").await?;
    for i in 0..500 {
        kv.put(&format!("k.{i}"), format!("v{i}").into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let (store, first) = fold_once(&kv, open(tmp.path()), 100).await?;
    assert_eq!(first.parsed, 500, "a cursor-less start re-lists every key");
    drop(store);

    // 37 new updates: new keys, overwrites and deletes.
    let mut n = 0;
    for i in 0..20 {
        kv.put(&format!("new.{i}"), "x".into()).await?;
        n += 1;
    }
    for i in 0..12 {
        kv.put(&format!("k.{i}"), "overwritten".into()).await?;
        n += 1;
    }
    for i in 100..105 {
        kv.delete(&format!("k.{i}")).await?;
        n += 1;
    }
    let (store, second) = fold_once(&kv, open(tmp.path()), 100).await?;
    assert_eq!(
        second.parsed, n,
        "a resume from the cursor delivers the delta only, not a replay"
    );
    assert_eq!(second.deletes, 5);
    let last = kv.positions().await?.last_sequence;
    assert_eq!(store.cursor(), WatchCursor::at(last));
    let want = bucket_contents(&kv).await?;
    assert_eq!(first_difference(&want, &contents_of(&store)), None);
    Ok(())
}

/// A store that fails the applies whose call numbers are listed (1-based), delegating the rest.
struct FaultyStore<S> {
    inner: S,
    calls: Arc<AtomicU32>,
    fail: Vec<u32>,
    fail_always: bool,
}

impl<S: SnapshotStore> SnapshotStore for FaultyStore<S> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn cursor(&self) -> WatchCursor {
        self.inner.cursor()
    }
    fn apply(&mut self, batch: &[KvUpdate], cursor: WatchCursor) -> Result<(), SnapshotError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if self.fail_always || self.fail.contains(&n) {
            return Err(SnapshotError::Io {
                path: "fault".into(),
                op: "injected apply failure",
                source: std::io::Error::other(format!("call {n}")),
            });
        }
        self.inner.apply(batch, cursor)
    }
    fn get(&self, key: &str) -> Result<Option<KvEntry>, SnapshotError> {
        self.inner.get(key)
    }
    fn for_each_in_range(
        &self,
        prefix: &str,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        self.inner.for_each_in_range(prefix, visit)
    }
    fn len(&self) -> Result<u64, SnapshotError> {
        self.inner.len()
    }
    fn export_to(
        &self,
        dest: &std::path::Path,
    ) -> Result<Option<foldhost_core::snapshot::ProvenCopy>, SnapshotError> {
        self.inner.export_to(dest)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_store_failure_never_leaves_a_cursor_gap() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("transient").await?;
    for i in 0..1000 {
        kv.put(&format!("k.{i:04}"), format!("v{i}").into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let calls = Arc::new(AtomicU32::new(0));
    // Fail the 2nd, 3rd and 5th store applies: each is followed by successful ones.
    let faulty = FaultyStore {
        inner: open(tmp.path()),
        calls: calls.clone(),
        fail: vec![2, 3, 5],
        fail_always: false,
    };
    let (store, apply) = fold_once(&kv, faulty, 50).await?;
    assert!(
        calls.load(Ordering::SeqCst) >= 6,
        "the failures were exercised"
    );
    assert_eq!(apply.parsed, 1000, "apply saw each update once");
    drop(store);

    // What survives a restart is what the disk holds: it must be the whole bucket.
    let reopened = open(tmp.path());
    let want = bucket_contents(&kv).await?;
    assert_eq!(
        first_difference(&want, &contents_of(&reopened)),
        None,
        "a failed batch was dropped and the cursor moved over it"
    );
    assert_eq!(
        reopened.cursor(),
        WatchCursor::at(kv.positions().await?.last_sequence)
    );

    // And a resume from it is a delta that converges.
    for i in 0..10 {
        kv.put(&format!("after.{i}"), "y".into()).await?;
    }
    let (store, again) = fold_once(&kv, reopened, 50).await?;
    assert_eq!(again.parsed, 10);
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &contents_of(&store)),
        None
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_failing_sixteen_times_in_a_row_fail_stops_without_moving_the_cursor()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("failstop").await?;
    for i in 0..30 {
        kv.put(&format!("k.{i}"), "v".into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let calls = Arc::new(AtomicU32::new(0));
    let faulty = FaultyStore {
        inner: open(tmp.path()),
        calls: calls.clone(),
        fail: vec![],
        fail_always: true,
    };
    match fold_once(&kv, faulty, 100).await {
        Err(AppliedError::Store { streak, .. }) => assert_eq!(streak, 16),
        Err(e) => panic!("expected a store fail-stop, got {e}"),
        Ok(_) => panic!("a store that always fails must fail-stop the fold"),
    }
    assert_eq!(calls.load(Ordering::SeqCst), 16);
    let reopened = open(tmp.path());
    assert_eq!(reopened.cursor(), WatchCursor::NONE);
    assert!(reopened.is_empty()?);
    Ok(())
}

/// An applier that rejects everything (every key is irrelevant to it).
struct SkipAll {
    applied: usize,
}

#[async_trait::async_trait]
impl Apply for SkipAll {
    fn describe(&self) -> String {
        "test:skip-all".into()
    }
    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        Ok(vec![Verdict::Skip; batch.len()])
    }
    async fn apply(&mut self, batch: &[KvUpdate], verdicts: &[Verdict]) -> Result<(), ApplyError> {
        self.applied += batch
            .iter()
            .zip(verdicts)
            .filter(|(_, v)| **v == Verdict::Accept)
            .count();
        Ok(())
    }
    async fn on_applied(&mut self, _cursor: WatchCursor) {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cursor_covers_rejected_updates_so_a_restart_does_not_replay_them() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("skipped").await?;
    for i in 0..250 {
        kv.put(&format!("noise.{i}"), "irrelevant".into()).await?;
    }
    let tmp = tempfile::tempdir()?;
    let mut apply = SkipAll { applied: 0 };
    let f = watch_applied(
        kv.clone(),
        SharedStore::new(open(tmp.path())),
        &mut apply,
        opts(100),
        Arc::new(FoldStatus::default()),
        None,
        std::future::pending(),
    )
    .await?;
    assert_eq!(apply.applied, 0, "nothing was accepted");
    assert_eq!(
        f.cursor,
        WatchCursor::at(kv.positions().await?.last_sequence),
        "a run of rejected updates still advances the cursor"
    );
    let (_, again) = fold_once(&kv, open(tmp.path()), 100).await?;
    assert_eq!(again.parsed, 0, "a restart re-delivers none of them");
    Ok(())
}

fn put_at(key: &str, value: &str, rev: u64) -> KvUpdate {
    KvUpdate::Put(KvEntry {
        key: key.into(),
        value: bytes::Bytes::from(value.to_string()),
        version: foldhost_core::kv::VersionToken::from_u64(rev),
    })
}

/// The interleaving of a store failure and a guest failure: a batch the guest applied
/// whose commit failed is re-queued; the guest then fails on the next batch and is dropped; the
/// instance built after it must not be hydrated from a fold that lacks the re-queued batch — the
/// fold commits the re-queued batch before the guest sees anything newer. Placed deterministically:
/// the store fails its 2nd apply, and the guest (`kvstore-v2`, which fails `apply` on a revision
/// it already applied) fails on a replayed revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_rebuilt_after_a_store_failure_sees_the_re_queued_batch() -> anyhow::Result<()> {
    use foldhost_fold::applied::Fold;
    use foldhost_guest::guest::{GuestApply, GuestEngine, GuestLimits};
    let tmp = tempfile::tempdir()?;
    let faulty = FaultyStore {
        inner: open(tmp.path()),
        calls: Arc::new(AtomicU32::new(0)),
        fail: vec![2],
        fail_always: false,
    };
    let shared = SharedStore::new(faulty);
    let engine = GuestEngine::new()?;
    let bytes = std::fs::read(foldhost_tests::guest_wasm("kvstore_v2"))?;
    let load = async || {
        GuestApply::load(
            &engine,
            "kvstore_v2",
            &bytes,
            GuestLimits::default(),
            vec![],
            Arc::new(shared.clone()),
        )
        .await
    };
    let mut guest = load().await?;
    guest.hydrate().await?;
    let mut fold = Fold::new(shared.clone(), Arc::new(FoldStatus::default()))?;

    let b1 = vec![put_at("k.a", "a1", 1), put_at("k.b", "b1", 2)];
    assert!(fold.flush(b1, &mut guest).await?.is_none());
    // Applied by the guest, then the store fails: re-queued, not committed.
    let b2 = vec![put_at("k.c", "c1", 3), put_at("k.a", "a2", 4)];
    assert!(fold.flush(b2, &mut guest).await?.is_none());
    assert!(
        !fold.is_settled(),
        "the 2nd store apply failed: the batch is re-queued"
    );
    // The guest fails on the next batch (a revision it already applied) and is dropped.
    let replay = vec![put_at("k.b", "b1", 2)];
    assert!(
        fold.flush(replay, &mut guest).await?.is_some(),
        "the guest refused the replay"
    );
    // The next batch goes to a fresh instance, rebuilt from the fold.
    assert!(
        fold.flush(vec![put_at("k.d", "d1", 5)], &mut guest)
            .await?
            .is_none()
    );
    assert!(fold.is_settled());
    assert_eq!(fold.cursor(), WatchCursor::at(5));

    // Its answers equal a fresh hydration's, and the fold's.
    let mut fresh = load().await?;
    fresh.hydrate().await?;
    for (key, want) in [("k.a", "a2"), ("k.b", "b1"), ("k.c", "c1"), ("k.d", "d1")] {
        let got = guest
            .query(key.as_bytes())
            .await
            .map_err(|e| anyhow::anyhow!("{key}: {e}"))?;
        let hydrated = fresh
            .query(key.as_bytes())
            .await
            .map_err(|e| anyhow::anyhow!("{key}: {e}"))?;
        assert_eq!(
            got, hydrated,
            "{key}: the rebuilt guest and a fresh hydration differ"
        );
        assert_eq!(got, format!("v2:{want}").into_bytes(), "{key}");
    }
    Ok(())
}
