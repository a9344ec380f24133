//! Fast tests of the fold's loop over a [`SimBucket`]: the real [`watch_applied`], the real append
//! log in a temp directory, native appliers written here. Time is paused (tokio advances it when
//! every task waits), so backoffs and batch windows cost nothing and each test runs in
//! milliseconds.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use super::*;
use foldhost_core::retained::{RETAINED_PREFIX, is_reserved};
use foldhost_core::snapshot::{
    AppendLogOptions, AppendLogSnapshot, ProvenCopy, SnapshotError, SnapshotStore,
};
use foldhost_core::status::FoldStatus;
use foldhost_core::view::{FoldRead, SharedStore};
use foldhost_fold::applied::{
    AppliedError, Apply, ApplyError, BatchConfig, Control, CountingApply, MAX_APPLY_FAILURES,
    SwapCandidate, Verdict, WatchOptions, watch_applied,
};

/// Longest (virtual) time any wait in these tests may take: it only stops a hung test.
const DEADLINE: Duration = Duration::from_secs(600);

fn opts(max: usize, window: Duration, catch_up: bool) -> WatchOptions {
    WatchOptions {
        scope: WatchScope::All,
        batch: BatchConfig {
            window,
            max,
            ..BatchConfig::default()
        },
        catch_up,
        defer_grace: foldhost_fold::applied::DEFAULT_DEFER_GRACE,
        repair: foldhost_fold::repair::RepairConfig::default(),
        queries: None,
    }
}

fn open(dir: &Path) -> AppendLogSnapshot {
    AppendLogSnapshot::open(dir, AppendLogOptions::default())
        .expect("open store")
        .0
}

fn load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

/// Waits (in virtual time) until `cond` holds.
async fn until(what: &str, cond: impl Fn() -> bool) {
    let start = tokio::time::Instant::now();
    while !cond() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The next event of a watch.
async fn next_event(rx: &mut mpsc::Receiver<WatchEvent>) -> WatchEvent {
    tokio::time::timeout(DEADLINE, rx.recv())
        .await
        .expect("an event in time")
        .expect("the watch is open")
}

/// The (revision, key) pairs of an `Updates` event.
fn updates(ev: WatchEvent) -> Vec<(u64, String)> {
    match ev {
        WatchEvent::Updates(us) => us
            .iter()
            .map(|u| (u.revision().expect("a revision"), u.key().to_string()))
            .collect(),
        other => panic!("expected updates, got {other:?}"),
    }
}

/// Bucket keys of a store with their values and revisions (the host's own keys left out).
fn contents(store: &impl SnapshotStore) -> BTreeMap<String, (Bytes, u64)> {
    let mut out = BTreeMap::new();
    store
        .for_each_in_range("", &mut |e| {
            if !is_reserved(&e.key) {
                let rev = e.version.as_u64().unwrap_or(0);
                out.insert(e.key.clone(), (e.value.clone(), rev));
            }
            ControlFlow::Continue(())
        })
        .expect("scan store");
    out
}

/// The live keys of the bucket with their values and revisions.
async fn bucket(sim: &SimBucket) -> BTreeMap<String, (Bytes, u64)> {
    sim.scan("")
        .await
        .expect("scan bucket")
        .into_iter()
        .map(|e| {
            let rev = e.version.as_u64().unwrap_or(0);
            (e.key, (e.value, rev))
        })
        .collect()
}

/// Runs the fold until it ends by itself (catch-up, fail-stop, a watch error).
async fn fold_alone<S: SnapshotStore, A: Apply>(
    sim: &SimBucket,
    store: SharedStore<S>,
    apply: &mut A,
    opts: WatchOptions,
    status: Arc<FoldStatus>,
) -> Result<foldhost_fold::applied::Finished, AppliedError> {
    let watcher: Arc<dyn KvWatcher> = Arc::new(sim.clone());
    tokio::time::timeout(
        DEADLINE,
        watch_applied(
            watcher,
            store,
            apply,
            opts,
            status,
            None,
            std::future::pending(),
        ),
    )
    .await
    .expect("the fold ended in time")
}

// ---------------------------------------------------------------------------------------------
// The simulation itself.
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn sim_state_sync_delivers_the_last_message_per_key_then_the_level_then_live_writes() {
    let sim = SimBucket::new(); // history 1
    sim.put_now("a", "1"); // 1, superseded by 3
    sim.put_now("b", "1"); // 2, superseded by 4
    sim.put_now("a", "2"); // 3
    sim.delete_now("b"); // 4: a delete marker is the key's last message
    sim.put_now("x.c", "1"); // 5
    assert_eq!(sim.first_sequence(), 3, "superseded messages left the log");
    assert_eq!(sim.last_sequence(), 5);

    let (tx, mut rx) = mpsc::channel(8);
    let w = sim.clone();
    let task = tokio::spawn(async move { w.watch(&WatchScope::All, tx).await });
    assert!(matches!(next_event(&mut rx).await, WatchEvent::Pending(3)));
    assert_eq!(
        updates(next_event(&mut rx).await),
        [(3, "a".into()), (4, "b".into()), (5, "x.c".into())]
    );
    assert!(matches!(
        next_event(&mut rx).await,
        WatchEvent::CaughtUp { through: Some(5) }
    ));
    // Live: a write after the start is pushed to the open watch.
    sim.put_now("a", "3");
    assert_eq!(updates(next_event(&mut rx).await), [(6, "a".into())]);
    assert_eq!(sim.open_watches(), 1);
    drop(rx);
    assert_eq!(task.await.expect("the watch task"), Ok(()));
    assert_eq!(sim.open_watches(), 0);

    // A prefix watch sees only its keys; an empty scope is level at once.
    let (tx, mut rx) = mpsc::channel(8);
    let w = sim.clone();
    let task = tokio::spawn(async move { w.watch(&WatchScope::Prefix("x.".into()), tx).await });
    assert!(matches!(next_event(&mut rx).await, WatchEvent::Pending(1)));
    assert_eq!(updates(next_event(&mut rx).await), [(5, "x.c".into())]);
    assert!(matches!(
        next_event(&mut rx).await,
        WatchEvent::CaughtUp { through: Some(5) }
    ));
    drop(rx);
    assert_eq!(task.await.expect("the watch task"), Ok(()));
}

#[tokio::test(start_paused = true)]
async fn sim_delta_refuses_a_cursor_below_the_first_sequence_and_chunks_what_it_delivers() {
    let sim = SimBucket::new();
    for i in 1..=200 {
        sim.put_now(&format!("k{i:03}"), "v");
    }
    assert_eq!(sim.evict_through(10), 10);
    assert_eq!(sim.first_sequence(), 11);
    let (tx, _rx) = mpsc::channel(8);
    assert_eq!(
        sim.watch_from(&WatchScope::All, WatchCursor::at(9), tx)
            .await,
        Err(KvError::CursorExpired {
            resume_from: 10,
            first_sequence: 11
        })
    );
    let (tx, mut rx) = mpsc::channel(8);
    let w = sim.clone();
    let task = tokio::spawn(async move {
        w.watch_from(&WatchScope::All, WatchCursor::at(10), tx)
            .await
    });
    assert!(matches!(
        next_event(&mut rx).await,
        WatchEvent::Pending(190)
    ));
    let mut got = Vec::new();
    for want in [WATCH_CHUNK, WATCH_CHUNK, 190 - 2 * WATCH_CHUNK] {
        let chunk = updates(next_event(&mut rx).await);
        assert_eq!(chunk.len(), want);
        got.extend(chunk.into_iter().map(|(rev, _)| rev));
    }
    assert_eq!(got, (11..=200).collect::<Vec<_>>(), "in sequence order");
    assert!(matches!(
        next_event(&mut rx).await,
        WatchEvent::CaughtUp { through: Some(200) }
    ));
    sim.break_watches(KvError::WatchError("injected".into()));
    assert_eq!(
        task.await.expect("the watch task"),
        Err(KvError::WatchError("injected".into()))
    );
    assert_eq!(sim.watches_started(), 2);
}

#[tokio::test(start_paused = true)]
async fn sim_writes_follow_kv_semantics() {
    let sim = SimBucket::with_config(SimConfig {
        history: 5,
        ..SimConfig::default()
    });
    let v1 = sim.create("a", "1".into()).await.expect("create");
    assert_eq!(
        sim.create("a", "x".into()).await,
        Err(KvError::AlreadyExists("a".into()))
    );
    let stale = VersionToken::from_u64(99);
    assert!(matches!(
        sim.update("a", "x".into(), stale).await,
        Err(KvError::RevisionMismatch { .. })
    ));
    let v2 = sim.update("a", "2".into(), v1).await.expect("update");
    assert_eq!(
        sim.get("a").await.expect("get").map(|e| e.version),
        Some(v2)
    );
    assert!(sim.delete("a").await.expect("delete"));
    assert_eq!(sim.get("a").await.expect("get"), None);
    sim.create("a", "3".into())
        .await
        .expect("create after delete");
    sim.put_now("b", "1");
    sim.put_now("b", "2");
    let purge = sim.purge_now("b");
    assert_eq!(
        sim.messages()
            .iter()
            .filter(|m| m.key == "b")
            .map(|m| m.sequence)
            .collect::<Vec<_>>(),
        [purge],
        "a purge rolls the key's history up"
    );
    assert_eq!(sim.keys("").await.expect("keys"), ["a"]);
    let r = sim.retention().await.expect("retention").expect("known");
    assert!(!r.evicts_current_values);
    assert_eq!(r.first_revision, 1);
    let s = sim.stream_state().await.expect("state").expect("known");
    assert_eq!(s.identity.name, SIM_STREAM);
    assert_eq!(s.last_sequence, purge);
}

// ---------------------------------------------------------------------------------------------
// The fold over the simulation.
// ---------------------------------------------------------------------------------------------

/// Applies everything except one key, whose every `apply` fails (a poison update).
struct FailsOn {
    poison: String,
    applied: Vec<u64>,
    last_cursor: WatchCursor,
}

#[async_trait]
impl Apply for FailsOn {
    fn describe(&self) -> String {
        "native:fails-on".into()
    }

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        Ok(vec![Verdict::Accept; batch.len()])
    }

    async fn apply(&mut self, batch: &[KvUpdate], verdicts: &[Verdict]) -> Result<(), ApplyError> {
        // All or nothing: a failed call leaves the applier as it was.
        if let Some(u) = batch
            .iter()
            .zip(verdicts)
            .find(|(u, v)| **v == Verdict::Accept && u.key() == self.poison)
            .map(|(u, _)| u)
        {
            return Err(ApplyError {
                applier: self.describe(),
                call: "apply",
                message: format!("cannot apply {:?}", u.key()),
            });
        }
        self.applied
            .extend(batch.iter().filter_map(KvUpdate::revision));
        Ok(())
    }

    async fn on_applied(&mut self, cursor: WatchCursor) {
        self.last_cursor = cursor;
    }
}

#[tokio::test(start_paused = true)]
async fn a_failed_apply_is_retried_in_halves_so_the_fold_stops_exactly_before_the_poison() {
    let sim = SimBucket::new();
    for i in 1..=10 {
        sim.put_now(&format!("k{i:02}"), format!("v{i}"));
    }
    let poison_rev = 6;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let status = Arc::new(FoldStatus::default());
    let mut apply = FailsOn {
        poison: "k06".into(),
        applied: Vec::new(),
        last_cursor: WatchCursor::NONE,
    };
    let result = fold_alone(
        &sim,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), false),
        status.clone(),
    )
    .await;
    match result {
        Err(AppliedError::Apply { streak, last }) => {
            assert_eq!(streak, MAX_APPLY_FAILURES);
            assert!(last.message.contains("k06"), "{last}");
        }
        other => panic!("expected an apply fail-stop, got {other:?}"),
    }
    // Everything before the poison update committed, nothing from it on.
    let below = poison_rev - 1;
    assert_eq!(store.read().expect("read").cursor(), WatchCursor::at(below));
    assert_eq!(load(&status.cursor), below);
    assert_eq!(apply.applied, (1..=below).collect::<Vec<_>>());
    assert_eq!(apply.last_cursor, WatchCursor::at(below));
    let folded = contents(&*store.read().expect("read"));
    assert_eq!(
        folded.keys().cloned().collect::<Vec<_>>(),
        (1..=below).map(|i| format!("k{i:02}")).collect::<Vec<_>>()
    );
    assert!(status.last_error().is_some_and(|e| e.contains("k06")));
}

#[tokio::test(start_paused = true)]
async fn a_settle_before_a_swap_or_an_export_retries_in_halves_and_stops_exactly_before_the_poison()
{
    // `flush_all` is what a swap, an export and a shutdown settle the open batch with.
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let status = Arc::new(FoldStatus::default());
    let mut fold = foldhost_fold::applied::Fold::new(store.clone(), status).expect("fold");
    let mut apply = FailsOn {
        poison: "k06".into(),
        applied: Vec::new(),
        last_cursor: WatchCursor::NONE,
    };
    let mut batch: Vec<KvUpdate> = (1..=10u64)
        .map(|i| {
            KvUpdate::Put(KvEntry {
                key: format!("k{i:02}"),
                value: Bytes::from(format!("v{i}")),
                version: VersionToken::from_u64(i),
            })
        })
        .collect();
    match foldhost_fold::applied::flush_all(&mut fold, &mut batch, 100, &mut apply).await {
        Err(AppliedError::Apply { last, .. }) => assert!(last.message.contains("k06"), "{last}"),
        other => panic!("expected an apply fail-stop, got {other:?}"),
    }
    assert_eq!(store.read().expect("read").cursor(), WatchCursor::at(5));
    assert_eq!(apply.applied, (1..=5).collect::<Vec<_>>());
}

/// A store whose chosen `apply` calls (1-based) fail, and that checks on every commit that the
/// cursor covers no revision it never committed.
struct FaultyStore<S> {
    inner: S,
    calls: Arc<AtomicU32>,
    fail: Vec<u32>,
    committed: BTreeSet<u64>,
    holes: Arc<Mutex<Vec<String>>>,
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
        if self.fail.contains(&n) {
            return Err(SnapshotError::Io {
                path: "fault".into(),
                op: "injected apply failure",
                source: std::io::Error::other(format!("call {n}")),
            });
        }
        self.inner.apply(batch, cursor)?;
        self.committed.extend(
            batch
                .iter()
                .filter(|u| !is_reserved(u.key()))
                .filter_map(KvUpdate::revision),
        );
        if let Some(c) = cursor.revision()
            && let Some(missing) = (1..=c).find(|r| !self.committed.contains(r))
            && let Ok(mut holes) = self.holes.lock()
        {
            holes.push(format!("call {n}: cursor {c} without revision {missing}"));
        }
        Ok(())
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

    fn export_to(&self, dest: &Path) -> Result<Option<ProvenCopy>, SnapshotError> {
        self.inner.export_to(dest)
    }
}

#[tokio::test(start_paused = true)]
async fn a_failed_store_commit_requeues_the_batch_and_the_cursor_never_moves_over_a_hole() {
    let sim = SimBucket::new();
    for i in 1..=50 {
        sim.put_now(&format!("k{i:02}"), format!("v{i}"));
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let calls = Arc::new(AtomicU32::new(0));
    let holes = Arc::new(Mutex::new(Vec::new()));
    // The 2nd, 3rd and 5th commits fail; each is followed by good ones.
    let store = SharedStore::new(FaultyStore {
        inner: open(dir.path()),
        calls: calls.clone(),
        fail: vec![2, 3, 5],
        committed: BTreeSet::new(),
        holes: holes.clone(),
    });
    let status = Arc::new(FoldStatus::default());
    let mut apply = CountingApply::default();
    let finished = fold_alone(
        &sim,
        store.clone(),
        &mut apply,
        opts(10, Duration::from_millis(10), true),
        status.clone(),
    )
    .await
    .expect("the fold catches up through the failures");
    assert_eq!(finished.cursor, WatchCursor::at(50));
    assert!(
        calls.load(Ordering::SeqCst) >= 8,
        "the failures were exercised"
    );
    assert_eq!(
        *holes.lock().expect("holes"),
        Vec::<String>::new(),
        "a cursor moved over an uncommitted revision"
    );
    assert_eq!(apply.parsed, 50, "the applier saw each update once");
    assert_eq!(apply.last_cursor, WatchCursor::at(50));
    assert_eq!(load(&status.committed), 50);
    assert_eq!(load(&status.store_failure_streak), 0);
    // What survives a restart is what the disk holds: the whole bucket, at its last revision.
    drop(store);
    let reopened = open(dir.path());
    assert_eq!(reopened.cursor(), WatchCursor::at(50));
    assert_eq!(contents(&reopened), bucket(&sim).await);
}

/// Defers every put whose value starts with `new-format` (a version that cannot decode it); keeps
/// the view it applied.
#[derive(Default)]
struct Decoder {
    /// Every revision handed to `apply` (accepted or not).
    handed: Vec<u64>,
    applied: Vec<u64>,
    view: BTreeMap<String, Bytes>,
}

#[async_trait]
impl Apply for Decoder {
    fn describe(&self) -> String {
        "native:decoder".into()
    }

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        Ok(batch
            .iter()
            .map(|u| match u {
                KvUpdate::Put(e) if e.value.starts_with(b"new-format") => Verdict::Defer,
                _ => Verdict::Accept,
            })
            .collect())
    }

    async fn apply(&mut self, batch: &[KvUpdate], verdicts: &[Verdict]) -> Result<(), ApplyError> {
        self.handed
            .extend(batch.iter().filter_map(KvUpdate::revision));
        for (u, v) in batch.iter().zip(verdicts) {
            if *v != Verdict::Accept {
                continue;
            }
            self.applied.extend(u.revision());
            match u {
                KvUpdate::Put(e) => {
                    self.view.insert(e.key.clone(), e.value.clone());
                }
                KvUpdate::Delete { key, .. } | KvUpdate::Purge { key, .. } => {
                    self.view.remove(key);
                }
            }
        }
        Ok(())
    }

    async fn on_applied(&mut self, _cursor: WatchCursor) {}
}

#[tokio::test(start_paused = true)]
async fn a_deferred_update_holds_later_updates_of_its_key_and_applied_through_stays_below() {
    // History 10: a delta sees every message of a key, not only its last.
    let sim = SimBucket::with_config(SimConfig {
        history: 10,
        ..SimConfig::default()
    });
    sim.put_now("a", "1"); // 1
    sim.put_now("b", "1"); // 2
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let mut apply = Decoder::default();
    let first = fold_alone(
        &sim,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), true),
        Arc::new(FoldStatus::default()),
    )
    .await
    .expect("first run");
    assert_eq!(first.cursor, WatchCursor::at(2));

    sim.put_now("a", "new-format:1"); // 3: deferred
    sim.put_now("a", "2"); // 4: held behind 3, never applied
    sim.put_now("b", "2"); // 5
    sim.put_now("c", "1"); // 6
    let status = Arc::new(FoldStatus::default());
    let second = fold_alone(
        &sim,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), true),
        status.clone(),
    )
    .await
    .expect("second run (a delta)");

    // The cursor covers everything (retained records commit with their batch) ...
    assert_eq!(second.cursor, WatchCursor::at(6));
    assert_eq!(load(&status.cursor), 6);
    // ... but applied_through stays below the oldest retained record.
    assert_eq!(load(&status.applied_through), 2);
    assert_eq!(load(&status.retained), 2);
    assert_eq!(load(&status.oldest_retained_revision), 3);
    // The held update never reached `apply` (the batch was re-parsed without it), and only the
    // others were applied.
    assert!(!apply.handed.contains(&4), "handed {:?}", apply.handed);
    assert_eq!(apply.applied, [1, 2, 5, 6]);
    let view: Vec<(&str, &[u8])> = apply
        .view
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_ref()))
        .collect();
    assert_eq!(view, [("a", &b"1"[..]), ("b", &b"2"[..]), ("c", &b"1"[..])]);
    // The fold keeps the raw latest value (it equals the bucket); the guest's view of the blocked
    // key is what it last applied; both retained records are in the store.
    let raw = store.read().expect("read").get("a").expect("get");
    assert_eq!(raw.map(|e| e.version.as_u64()), Some(Some(4)));
    let guest_view = FoldRead::get(&store, "a").expect("get");
    assert_eq!(
        guest_view.map(|e| (e.value, e.version.as_u64())),
        Some((Bytes::from_static(b"1"), Some(1)))
    );
    // Read by reference (hydration's pages), the guest's view is the same: the blocked key's
    // base, no reserved key, page by page.
    foldhost_core::view::assert_scan_each_is_scan(&store, "", &[1, 2, 3, 100]);
    assert_eq!(
        store
            .read()
            .expect("read")
            .range(RETAINED_PREFIX)
            .expect("range")
            .len(),
        2
    );
    let folded = contents(&*store.read().expect("read"));
    assert_eq!(folded, bucket(&sim).await);
}

#[tokio::test(start_paused = true)]
async fn an_eviction_past_the_frontier_ends_the_watch_and_without_repair_the_fold_stops_at_its_cursor()
 {
    let sim = SimBucket::with_config(SimConfig {
        evicts_current_values: true, // max_age or discard-old: a current value can go
        ..SimConfig::default()
    });
    for i in 1..=5 {
        sim.put_now(&format!("k{i}"), "v");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let status = Arc::new(FoldStatus::default());
    let mut apply = CountingApply::default();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let watcher: Arc<dyn KvWatcher> = Arc::new(sim.clone());
    let fold = watch_applied(
        watcher,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), false),
        status.clone(),
        None,
        async {
            let _ = stop_rx.await;
        },
    );
    let driver = async {
        until("the first five committed", || load(&status.cursor) == 5).await;
        sim.hold_deliveries();
        sim.put_now("k6", "v"); // 6: evicted before the watch sees it
        sim.put_now("k7", "v"); // 7
        sim.evict_through(6);
        assert_eq!(sim.first_sequence(), 7);
        sim.release_deliveries();
        stop_tx // kept until the fold ends: dropping it would shut the fold down
    };
    let (result, _stop) = tokio::time::timeout(DEADLINE, async { tokio::join!(fold, driver) })
        .await
        .expect("the fold ended in time");
    match result {
        Err(AppliedError::Watch(KvError::CursorExpired {
            resume_from,
            first_sequence,
        })) => {
            assert_eq!((resume_from, first_sequence), (6, 7));
        }
        other => panic!("expected the floor guard's CursorExpired, got {other:?}"),
    }
    assert_eq!(store.read().expect("read").cursor(), WatchCursor::at(5));
    assert_eq!(load(&status.cursor), 5);
    assert_eq!(apply.parsed, 5, "nothing past the gap reached the applier");
    assert_eq!(sim.open_watches(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_superseded_gap_on_a_bucket_that_keeps_current_values_is_folded_past() {
    let sim = SimBucket::new(); // history 1, never evicts a current value
    for i in 1..=5 {
        sim.put_now(&format!("k{i}"), "v");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let status = Arc::new(FoldStatus::default());
    let mut apply = CountingApply::default();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let watcher: Arc<dyn KvWatcher> = Arc::new(sim.clone());
    let fold = watch_applied(
        watcher,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), false),
        status.clone(),
        None,
        async {
            let _ = stop_rx.await;
        },
    );
    let driver = async {
        until("the first five committed", || load(&status.cursor) == 5).await;
        sim.hold_deliveries();
        sim.put_now("x", "1"); // 6: superseded by 7 before the watch sees it
        sim.put_now("x", "2"); // 7
        assert_eq!(sim.first_sequence(), 1);
        sim.release_deliveries();
        until("the successor committed", || load(&status.cursor) == 7).await;
        drop(stop_tx); // shut down
    };
    let (result, ()) = tokio::time::timeout(DEADLINE, async { tokio::join!(fold, driver) })
        .await
        .expect("the fold ended in time");
    assert_eq!(result.expect("no expiry").cursor, WatchCursor::at(7));
    let folded = contents(&*store.read().expect("read"));
    assert_eq!(folded, bucket(&sim).await);
}

/// What the swapping applier saw, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    /// A batch applied by this version, with its revisions.
    Applied(u32, Vec<u64>),
    /// The swap, with the fold's figures at that moment.
    Swapped {
        delivered: u64,
        committed: u64,
        seq: u64,
        cursor: u64,
        store_cursor: WatchCursor,
    },
}

/// A native applier whose logic is "version N" and whose domain state is a copy of the fold; a
/// swap to `bytes` (a version number) builds the next version beside it from the swap's view.
struct Versioned {
    version: u32,
    seen: Arc<Mutex<Vec<Seen>>>,
    status: Arc<FoldStatus>,
    store: SharedStore<AppendLogSnapshot>,
    /// The copy this version built: key → (value, revision).
    state: BTreeMap<String, (Bytes, u64)>,
    /// Every (key, revision) this version applied, hydration and catch-up included.
    applied: Vec<(String, u64)>,
    /// The keys of the last swap's catch-up.
    caught_up: Vec<String>,
    /// Holds the next candidate's hydration after its first page: signals the first sender, waits
    /// for the second.
    gate: Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>,
    /// Holds the next candidate's first catch-up after it applied its updates, likewise.
    round_gate: Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>,
    /// What the last candidate's view read for `k295` after its held round.
    read_after_round: Option<Option<KvEntry>>,
}

impl Versioned {
    fn new(status: Arc<FoldStatus>, store: SharedStore<AppendLogSnapshot>) -> Self {
        Versioned {
            version: 1,
            seen: Arc::default(),
            status,
            store,
            state: BTreeMap::new(),
            applied: Vec::new(),
            caught_up: Vec::new(),
            gate: None,
            round_gate: None,
            read_after_round: None,
        }
    }

    fn note(&self, s: Seen) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.push(s);
        }
    }
}

/// Applies `u` to a copy of the fold, logging what was applied.
fn apply_to_copy(
    state: &mut BTreeMap<String, (Bytes, u64)>,
    applied: &mut Vec<(String, u64)>,
    u: &KvUpdate,
) {
    let rev = u.revision().unwrap_or(0);
    match u {
        KvUpdate::Put(e) => {
            state.insert(e.key.clone(), (e.value.clone(), rev));
        }
        KvUpdate::Delete { key, .. } | KvUpdate::Purge { key, .. } => {
            state.remove(key);
        }
    }
    applied.push((u.key().to_string(), rev));
}

#[async_trait]
impl Apply for Versioned {
    fn describe(&self) -> String {
        format!("native:v{}", self.version)
    }

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        Ok(vec![Verdict::Accept; batch.len()])
    }

    async fn apply(&mut self, batch: &[KvUpdate], _verdicts: &[Verdict]) -> Result<(), ApplyError> {
        let revs = batch.iter().filter_map(KvUpdate::revision).collect();
        self.note(Seen::Applied(self.version, revs));
        for u in batch {
            apply_to_copy(&mut self.state, &mut self.applied, u);
        }
        Ok(())
    }

    async fn on_applied(&mut self, _cursor: WatchCursor) {}

    fn swap_candidate(
        &mut self,
        what: &str,
        bytes: &[u8],
        view: Arc<dyn FoldRead>,
    ) -> Result<Box<dyn SwapCandidate>, ApplyError> {
        let to: u32 = std::str::from_utf8(bytes)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| ApplyError {
                applier: self.describe(),
                call: "swap",
                message: format!("{what}: not a version"),
            })?;
        Ok(Box::new(VersionedCandidate {
            to,
            view,
            state: BTreeMap::new(),
            applied: Vec::new(),
            caught_up: Vec::new(),
            gate: self.gate.take(),
            round_gate: self.round_gate.take(),
            read_after_round: None,
        }))
    }

    fn adopt(
        &mut self,
        candidate: Box<dyn SwapCandidate>,
    ) -> Result<Box<dyn std::any::Any + Send>, ApplyError> {
        let c = candidate
            .into_any()
            .downcast::<VersionedCandidate>()
            .map_err(|_| ApplyError {
                applier: self.describe(),
                call: "swap",
                message: "not a versioned candidate".into(),
            })?;
        let s = &self.status;
        let store_cursor = self.store.read().expect("read").cursor();
        self.note(Seen::Swapped {
            delivered: load(&s.delivered),
            committed: load(&s.committed),
            seq: load(&s.seq),
            cursor: load(&s.cursor),
            store_cursor,
        });
        self.version = c.to;
        self.state = c.state;
        self.applied = c.applied;
        self.caught_up = c.caught_up;
        self.read_after_round = c.read_after_round;
        Ok(Box::new(()))
    }
}

/// The next version of [`Versioned`], hydrating from the swap's view.
struct VersionedCandidate {
    to: u32,
    view: Arc<dyn FoldRead>,
    state: BTreeMap<String, (Bytes, u64)>,
    applied: Vec<(String, u64)>,
    caught_up: Vec<String>,
    gate: Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>,
    round_gate: Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>,
    read_after_round: Option<Option<KvEntry>>,
}

#[async_trait]
impl SwapCandidate for VersionedCandidate {
    fn describe(&self) -> String {
        format!("native:v{}", self.to)
    }

    async fn hydrate(&mut self) -> Result<u64, ApplyError> {
        // Small pages, so a held hydration reads most of the fold after the writes it overlaps.
        let mut after: Option<String> = None;
        let mut n = 0u64;
        loop {
            let page = self
                .view
                .scan("", after.as_deref(), 4)
                .expect("scan the view");
            for e in &page {
                apply_to_copy(
                    &mut self.state,
                    &mut self.applied,
                    &KvUpdate::Put(e.clone()),
                );
            }
            n += page.len() as u64;
            if let Some((reached, release)) = self.gate.take() {
                let _ = reached.send(());
                let _ = release.await;
            }
            match page.last() {
                Some(last) if page.len() == 4 => after = Some(last.key.clone()),
                _ => return Ok(n),
            }
        }
    }

    async fn catch_up(&mut self, updates: &[KvUpdate]) -> Result<(), ApplyError> {
        for u in updates {
            apply_to_copy(&mut self.state, &mut self.applied, u);
            self.caught_up.push(u.key().to_string());
        }
        if let Some((reached, release)) = self.round_gate.take() {
            let _ = reached.send(());
            let _ = release.await;
            // The fold moved on during the round; the view still reads the round's cursor.
            self.read_after_round = Some(self.view.get("k295").expect("get"));
        }
        Ok(())
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

#[tokio::test(start_paused = true)]
async fn a_swap_runs_between_batches_after_everything_delivered_is_committed() {
    let sim = SimBucket::new();
    for i in 1..=10 {
        sim.put_now(&format!("k{i:02}"), "v");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let status = Arc::new(FoldStatus::default());
    let mut apply = Versioned::new(status.clone(), store.clone());
    let seen = apply.seen.clone();
    let (control_tx, control_rx) = mpsc::channel(4);
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let watcher: Arc<dyn KvWatcher> = Arc::new(sim.clone());
    // A long window: live updates sit in the open batch until something flushes it.
    let fold = watch_applied(
        watcher,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_secs(1), false),
        status.clone(),
        Some(control_rx),
        async {
            let _ = stop_rx.await;
        },
    );
    let driver = async {
        // The re-list flushes at the level.
        until("the re-list committed", || load(&status.cursor) == 10).await;
        for i in 11..=15 {
            sim.put_now(&format!("k{i:02}"), "v");
        }
        until("the live updates delivered", || {
            load(&status.delivered) == 15
        })
        .await;
        assert_eq!(load(&status.cursor), 10, "the batch is still open");
        let (reply, answer) = oneshot::channel();
        control_tx
            .send(Control::Swap {
                bytes: b"2".to_vec(),
                what: "v2".into(),
                reply,
            })
            .await
            .expect("the fold takes controls");
        let report = answer
            .await
            .expect("the fold answers")
            .expect("the swap succeeds");
        for i in 16..=20 {
            sim.put_now(&format!("k{i:02}"), "v");
        }
        until("the updates after the swap committed", || {
            load(&status.cursor) == 20
        })
        .await;
        drop(stop_tx);
        report
    };
    let (result, report) = tokio::time::timeout(DEADLINE, async { tokio::join!(fold, driver) })
        .await
        .expect("the fold ended in time");
    assert_eq!(
        result.expect("a clean shutdown").cursor,
        WatchCursor::at(20)
    );
    assert_eq!(report.from, "native:v1");
    assert_eq!(report.to, "native:v2");
    assert_eq!(report.hydrated_entries, 15);
    assert_eq!(status.guest(), "native:v2");

    let seen = seen.lock().expect("seen").clone();
    let at = seen
        .iter()
        .position(|s| matches!(s, Seen::Swapped { .. }))
        .expect("the swap was seen");
    // Everything delivered before the swap was committed before it ran.
    assert_eq!(
        seen[at],
        Seen::Swapped {
            delivered: 15,
            committed: 15,
            seq: 15,
            cursor: 15,
            store_cursor: WatchCursor::at(15),
        }
    );
    // The old version applied exactly 1..=15, the new one exactly 16..=20: the swap fell between
    // two batches.
    let applied_by = |version: u32, part: &[Seen]| -> Vec<u64> {
        part.iter()
            .flat_map(|s| match s {
                Seen::Applied(v, revs) => {
                    assert_eq!(*v, version, "{s:?}");
                    revs.clone()
                }
                Seen::Swapped { .. } => Vec::new(),
            })
            .collect()
    };
    assert_eq!(applied_by(1, &seen[..at]), (1..=15).collect::<Vec<_>>());
    assert_eq!(
        applied_by(2, &seen[at + 1..]),
        (16..=20).collect::<Vec<_>>()
    );
}

/// A swap hydrates the new version beside the running one, from the fold as it was when
/// the swap began (cursor C), while the old version keeps folding; the cut-over hands the new one
/// each key changed since C exactly once, with its value now. Nothing applied twice, nothing
/// skipped, and the new version's copy equals the fold.
#[tokio::test(start_paused = true)]
async fn a_swap_hydrates_beside_the_running_fold_and_catches_up_each_changed_key_once() {
    let sim = SimBucket::new();
    for i in 1..=20 {
        sim.put_now(&format!("k{i:02}"), format!("v{i}"));
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let status = Arc::new(FoldStatus::default());
    let mut apply = Versioned::new(status.clone(), store.clone());
    let seen = apply.seen.clone();
    let (reached_tx, reached_rx) = oneshot::channel();
    let (release_tx, release_rx) = oneshot::channel();
    apply.gate = Some((reached_tx, release_rx));
    let (control_tx, control_rx) = mpsc::channel(4);
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let watcher: Arc<dyn KvWatcher> = Arc::new(sim.clone());
    let fold = watch_applied(
        watcher,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), false),
        status.clone(),
        Some(control_rx),
        async {
            let _ = stop_rx.await;
        },
    );
    let driver = async {
        until("the first 20 committed", || load(&status.cursor) == 20).await;
        let (reply, answer) = oneshot::channel();
        control_tx
            .send(Control::Swap {
                bytes: b"2".to_vec(),
                what: "v2".into(),
                reply,
            })
            .await
            .expect("the fold takes controls");
        // The candidate read its first page (k01..k04) and is held there.
        reached_rx.await.expect("the candidate started hydrating");
        sim.put_now("k02", "changed after its page was read"); // 21
        sim.put_now("k10", "changed before its page is read"); // 22
        sim.delete_now("k15"); // 23
        sim.put_now("k21", "new"); // 24
        sim.delete_now("k07"); // 25
        sim.put_now("k07", "back"); // 26
        sim.put_now("k30", "short-lived"); // 27
        sim.delete_now("k30"); // 28
        until("the old version committed the writes", || {
            load(&status.cursor) == 28
        })
        .await;
        assert_eq!(
            status.guest(),
            "native:v1",
            "the old version is still folding"
        );
        release_tx.send(()).expect("release the hydration");
        let report = answer
            .await
            .expect("the fold answers")
            .expect("the swap succeeds");
        sim.put_now("k31", "after"); // 29
        until("the update after the swap committed", || {
            load(&status.cursor) == 29
        })
        .await;
        drop(stop_tx);
        report
    };
    let (result, report) = tokio::time::timeout(DEADLINE, async { tokio::join!(fold, driver) })
        .await
        .expect("the fold ended in time");
    assert_eq!(
        result.expect("a clean shutdown").cursor,
        WatchCursor::at(29)
    );
    assert_eq!(report.to, "native:v2");
    assert_eq!(
        report.hydrated_entries, 20,
        "the candidate hydrated the fold at C, not the fold it was reading"
    );
    assert_eq!(report.caught_up, 5);
    assert_eq!(apply.caught_up, ["k02", "k07", "k10", "k15", "k21"]);
    // k10 was read after it changed, yet hydrated at its value at C; the catch-up brought it up.
    let k10: Vec<u64> = apply
        .applied
        .iter()
        .filter(|(k, _)| k == "k10")
        .map(|(_, r)| *r)
        .collect();
    assert_eq!(k10, [10, 22]);
    // Nothing applied twice: every known revision once (synthetic deletes carry none).
    let mut revs: Vec<&(String, u64)> = apply.applied.iter().filter(|(_, r)| *r != 0).collect();
    let n = revs.len();
    revs.sort();
    revs.dedup();
    assert_eq!(
        revs.len(),
        n,
        "an update applied twice: {:?}",
        apply.applied
    );
    // Nothing skipped: the new version's copy is the fold.
    assert_eq!(apply.state, contents(&*store.read().expect("read")));
    assert_eq!(apply.state, bucket(&sim).await);
    // The old version folded 21..=28 during the hydration; the new one took over at 29.
    let seen = seen.lock().expect("seen").clone();
    let at = seen
        .iter()
        .position(|s| matches!(s, Seen::Swapped { .. }))
        .expect("swapped");
    let by = |v: u32, part: &[Seen]| -> Vec<u64> {
        part.iter()
            .flat_map(|s| match s {
                Seen::Applied(w, revs) if *w == v => revs.clone(),
                _ => Vec::new(),
            })
            .collect()
    };
    // (The watch may coalesce a key's updates delivered together: 25 and 27 are superseded.)
    let old = by(1, &seen[..at]);
    assert_eq!(old[..20], (1..=20).collect::<Vec<_>>());
    assert_eq!(
        old.last(),
        Some(&28),
        "the old version folded through 28: {old:?}"
    );
    assert_eq!(by(2, &seen[at + 1..]), [29]);
}

/// With more than [`protocol::SWAP_CUT_OVER_KEYS`] keys changed during the hydration,
/// a catch-up round runs beside the fold first (the fold keeps committing during it too); the
/// cut-over then takes only the keys changed during that round. Each key once per round, its
/// value at the round's cursor; nothing applied twice; the copy equals the fold.
#[tokio::test(start_paused = true)]
async fn a_swap_under_many_writes_catches_up_in_rounds_beside_the_fold_before_its_cut_over() {
    let sim = SimBucket::new();
    for i in 0..400 {
        sim.put_now(&format!("k{i:03}"), "seed");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let status = Arc::new(FoldStatus::default());
    let mut apply = Versioned::new(status.clone(), store.clone());
    let (reached_tx, reached_rx) = oneshot::channel();
    let (release_tx, release_rx) = oneshot::channel();
    apply.gate = Some((reached_tx, release_rx));
    let (round_tx, round_rx) = oneshot::channel();
    let (round_release_tx, round_release_rx) = oneshot::channel();
    apply.round_gate = Some((round_tx, round_release_rx));
    let (control_tx, control_rx) = mpsc::channel(4);
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let watcher: Arc<dyn KvWatcher> = Arc::new(sim.clone());
    let fold = watch_applied(
        watcher,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), false),
        status.clone(),
        Some(control_rx),
        async {
            let _ = stop_rx.await;
        },
    );
    let driver = async {
        until("the seed committed", || load(&status.cursor) == 400).await;
        let (reply, answer) = oneshot::channel();
        control_tx
            .send(Control::Swap {
                bytes: b"2".to_vec(),
                what: "v2".into(),
                reply,
            })
            .await
            .expect("the fold takes controls");
        reached_rx.await.expect("hydrating");
        // 300 keys change during the hydration: more than the cut-over takes on itself.
        for i in 0..300 {
            sim.put_now(&format!("k{i:03}"), "during the hydration");
        }
        until("committed", || load(&status.cursor) == 700).await;
        release_tx.send(()).expect("release the hydration");
        round_rx.await.expect("a catch-up round ran");
        // During the round: some of its keys change again, and new ones.
        for i in 290..310 {
            sim.put_now(&format!("k{i:03}"), "during the round");
        }
        until("committed", || load(&status.cursor) == 720).await;
        assert_eq!(status.guest(), "native:v1");
        round_release_tx.send(()).expect("release the round");
        let report = answer.await.expect("answered").expect("swapped");
        drop(stop_tx);
        report
    };
    let (result, report) = tokio::time::timeout(DEADLINE, async { tokio::join!(fold, driver) })
        .await
        .expect("the fold ended in time");
    assert_eq!(
        result.expect("a clean shutdown").cursor,
        WatchCursor::at(720)
    );
    assert_eq!(report.hydrated_entries, 400);
    assert_eq!(report.catch_up_rounds, 2, "{report:?}");
    assert_eq!(report.caught_up, 300 + 20, "{report:?}");
    let want: Vec<String> = (0..300)
        .chain(290..310)
        .map(|i| format!("k{i:03}"))
        .collect();
    assert_eq!(apply.caught_up, want);
    let k295 = apply.read_after_round.clone().flatten().expect("k295 read");
    assert_eq!(
        k295.value,
        Bytes::from_static(b"during the hydration"),
        "during a round the candidate's view reads the fold at the round's cursor"
    );
    let mut revs: Vec<&(String, u64)> = apply.applied.iter().filter(|(_, r)| *r != 0).collect();
    let n = revs.len();
    revs.sort();
    revs.dedup();
    assert_eq!(revs.len(), n, "an update applied twice");
    assert_eq!(apply.state, contents(&*store.read().expect("read")));
    assert_eq!(apply.state, bucket(&sim).await);
}

/// One swap at a time. A second swap asked for while the first one's candidate hydrates
/// is refused in one line naming the swap in flight; the first still completes, and the fold keeps
/// committing throughout.
#[tokio::test(start_paused = true)]
async fn a_second_swap_while_one_hydrates_is_refused_and_the_first_completes() {
    let sim = SimBucket::new();
    for i in 1..=10 {
        sim.put_now(&format!("k{i:02}"), "v");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let status = Arc::new(FoldStatus::default());
    let mut apply = Versioned::new(status.clone(), store.clone());
    let (reached_tx, reached_rx) = oneshot::channel();
    let (release_tx, release_rx) = oneshot::channel();
    apply.gate = Some((reached_tx, release_rx));
    let (control_tx, control_rx) = mpsc::channel(4);
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let watcher: Arc<dyn KvWatcher> = Arc::new(sim.clone());
    let fold = watch_applied(
        watcher,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), false),
        status.clone(),
        Some(control_rx),
        async {
            let _ = stop_rx.await;
        },
    );
    let swap = |to: &'static [u8]| {
        let (reply, answer) = oneshot::channel();
        let control = Control::Swap {
            bytes: to.to_vec(),
            what: format!("v{}", String::from_utf8_lossy(to)),
            reply,
        };
        (control, answer)
    };
    let driver = async {
        until("the first 10 committed", || load(&status.cursor) == 10).await;
        let (control, first) = swap(b"2");
        control_tx
            .send(control)
            .await
            .expect("the fold takes controls");
        reached_rx.await.expect("the first swap hydrates");
        let (control, second) = swap(b"3");
        control_tx
            .send(control)
            .await
            .expect("the fold takes controls");
        let second = second
            .await
            .expect("answered")
            .expect_err("refused while the first hydrates");
        sim.put_now("k11", "during");
        until("the fold kept committing", || load(&status.cursor) == 11).await;
        release_tx.send(()).expect("release");
        let report = first
            .await
            .expect("answered")
            .expect("the first swap completes");
        drop(stop_tx);
        (second, report)
    };
    let (result, (second, report)) =
        tokio::time::timeout(DEADLINE, async { tokio::join!(fold, driver) })
            .await
            .expect("the fold ended in time");
    result.expect("a clean shutdown");
    assert!(
        second.message.contains("v3 refused") && second.message.contains("still hydrating"),
        "{second}"
    );
    assert_eq!(report.to, "native:v2");
    assert_eq!(apply.version, 2);
    assert_eq!(apply.state, contents(&*store.read().expect("read")));
}

/// A watch that breaks (the connection, the server or the consumer failed) is resumed
/// from the applied cursor after a bounded backoff — the fold does not stop, and nothing is lost
/// or applied twice. Repeated breaks only lengthen the backoff up to its cap.
#[tokio::test(start_paused = true)]
async fn a_broken_watch_is_resumed_from_the_applied_cursor_without_a_restart() {
    let sim = SimBucket::new();
    for i in 1..=10 {
        sim.put_now(&format!("k{i:02}"), "v");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let status = Arc::new(FoldStatus::default());
    let mut apply = CountingApply::default();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let watcher: Arc<dyn KvWatcher> = Arc::new(sim.clone());
    let fold = watch_applied(
        watcher,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), false),
        status.clone(),
        None,
        async {
            let _ = stop_rx.await;
        },
    );
    let driver = async {
        until("the re-list committed", || load(&status.cursor) == 10).await;
        for round in 0..5u64 {
            sim.break_watches(KvError::WatchError(format!("injected break {round}")));
            let next = 10 + (round + 1) * 4;
            for i in next - 3..=next {
                sim.put_now(&format!("k{i:02}"), "v");
            }
            until("the writes after the break committed", || {
                load(&status.cursor) == next
            })
            .await;
        }
        let _ = stop_tx.send(());
    };
    let (finished, ()) = tokio::time::timeout(DEADLINE, async { tokio::join!(fold, driver) })
        .await
        .expect("in time");
    let finished = finished.expect("the fold never stopped on a broken watch");
    assert_eq!(finished.cursor, WatchCursor::at(30));
    assert_eq!(sim.watches_started(), 6, "one watch, then one per break");
    assert_eq!(
        apply.parsed, 30,
        "every update applied once: resumed, not replayed"
    );
    let committed = contents(&*store.read().expect("read"));
    assert_eq!(committed, bucket(&sim).await);
}

// ---------------------------------------------------------------------------------------------
// Found by the seeded simulation (tests/tests/sim), pinned here as fast tests.
// ---------------------------------------------------------------------------------------------

/// Fails its first `apply`, then applies everything.
#[derive(Default)]
struct FailsFirstApply {
    failed: bool,
    inner: CountingApply,
}

#[async_trait]
impl Apply for FailsFirstApply {
    fn describe(&self) -> String {
        "native:fails-first".into()
    }

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        self.inner.parse(batch).await
    }

    async fn apply(&mut self, batch: &[KvUpdate], verdicts: &[Verdict]) -> Result<(), ApplyError> {
        if !std::mem::replace(&mut self.failed, true) {
            return Err(ApplyError {
                applier: self.describe(),
                call: "apply",
                message: "the first call fails".into(),
            });
        }
        self.inner.apply(batch, verdicts).await
    }

    async fn on_applied(&mut self, cursor: WatchCursor) {
        self.inner.on_applied(cursor).await;
    }
}

#[tokio::test(start_paused = true)]
async fn an_export_during_an_apply_backoff_does_not_stop_the_fold_taking_deliveries() {
    let sim = SimBucket::new();
    for i in 1..=5 {
        sim.put_now(&format!("k{i}"), "v");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let export_dir = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let status = Arc::new(FoldStatus::default());
    let mut apply = FailsFirstApply::default();
    let (ctl_tx, ctl_rx) = mpsc::channel(4);
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let watcher: Arc<dyn KvWatcher> = Arc::new(sim.clone());
    let fold = watch_applied(
        watcher,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), false),
        status.clone(),
        Some(ctl_rx),
        async {
            let _ = stop_rx.await;
        },
    );
    let driver = async {
        until("the first apply failed", || status.last_error().is_some()).await;
        // The export arrives while the fold backs off: it settles the fold (the retry commits).
        let (tx, rx) = oneshot::channel();
        let export = Control::Export {
            dir: export_dir.path().to_path_buf(),
            reply: tx,
        };
        assert!(ctl_tx.send(export).await.is_ok(), "the fold takes controls");
        let (cursor, _) = rx.await.expect("a reply").expect("the export");
        assert_eq!(cursor, WatchCursor::at(5));
        // Before the fix the settle left the fold backing off with its timer disarmed: the
        // watch was never read again.
        sim.put_now("k6", "v");
        until("the write after the export committed", || {
            load(&status.cursor) == 6
        })
        .await;
        drop(stop_tx);
    };
    let (result, ()) = tokio::time::timeout(DEADLINE, async { tokio::join!(fold, driver) })
        .await
        .expect("the fold ended in time");
    assert_eq!(result.expect("a clean stop").cursor, WatchCursor::at(6));
}

/// A native applier whose every query takes 1 s; with `loses`, it then fails and loses its state
/// (as a guest's query interrupted at its deadline drops the instance), and while lost it answers
/// "guest rebuilding" and is rebuilt only by [`Apply::rebuild`] (or its next batch).
#[derive(Default)]
struct SpinningQueries {
    inner: CountingApply,
    loses: bool,
    lost: bool,
    rebuilds: u64,
}

#[async_trait]
impl Apply for SpinningQueries {
    fn describe(&self) -> String {
        "native:spinning-queries".into()
    }

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        if std::mem::take(&mut self.lost) {
            self.rebuilds += 1;
        }
        self.inner.parse(batch).await
    }

    async fn apply(&mut self, batch: &[KvUpdate], verdicts: &[Verdict]) -> Result<(), ApplyError> {
        self.inner.apply(batch, verdicts).await
    }

    async fn on_applied(&mut self, cursor: WatchCursor) {
        self.inner.on_applied(cursor).await;
    }

    fn generation(&self) -> u64 {
        self.rebuilds
    }

    fn rebuild_due(&self) -> bool {
        self.lost
    }

    async fn rebuild(&mut self) -> Result<(), ApplyError> {
        if std::mem::take(&mut self.lost) {
            self.rebuilds += 1;
        }
        Ok(())
    }

    async fn query(&mut self, _request: &[u8]) -> Result<Vec<u8>, ApplyError> {
        if self.lost {
            return Err(ApplyError::rebuilding(self.describe(), "lost"));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        if !self.loses {
            return Ok(b"slow".to_vec());
        }
        self.lost = true;
        Err(ApplyError {
            applier: self.describe(),
            call: "query",
            message: "deadline of 1000 ms exceeded".into(),
        })
    }
}

#[tokio::test(start_paused = true)]
async fn a_flood_of_slow_queries_never_stops_the_fold() {
    query_flood_beside_a_writer(false).await;
}

#[tokio::test(start_paused = true)]
async fn a_flood_of_queries_running_to_their_deadline_never_stops_the_fold_nor_rebuilds_for_them() {
    let apply = query_flood_beside_a_writer(true).await;
    // Every spinning query lost the state; the fold rebuilt it as its own work, never on a
    // query's account (a query finding it lost was answered at once).
    assert!(apply.rebuilds > 0, "the state was rebuilt");
}

/// 8 clients query in a loop (each query taking 1 s, losing the state when `loses`) while 2 000
/// writes arrive: the fold reaches the last while the flood runs.
async fn query_flood_beside_a_writer(loses: bool) -> SpinningQueries {
    let sim = SimBucket::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let status = Arc::new(FoldStatus::default());
    let mut apply = SpinningQueries {
        loses,
        ..SpinningQueries::default()
    };
    let (ctl_tx, ctl_rx) = mpsc::channel(8);
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let watcher: Arc<dyn KvWatcher> = Arc::new(sim.clone());
    let fold = watch_applied(
        watcher,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), false),
        status.clone(),
        Some(ctl_rx),
        async {
            let _ = stop_rx.await;
        },
    );
    let flooding = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let answered = Arc::new(AtomicU64::new(0));
    let rebuilding = Arc::new(AtomicU64::new(0));
    let client = |ctl: mpsc::Sender<Control>| {
        let (flooding, answered, rebuilding) =
            (flooding.clone(), answered.clone(), rebuilding.clone());
        async move {
            while flooding.load(Ordering::SeqCst) {
                let (tx, rx) = oneshot::channel();
                let q = Control::Query {
                    request: b"spin".to_vec(),
                    reply: tx,
                };
                if ctl.send(q).await.is_err() {
                    return;
                }
                match rx.await {
                    Ok(Err(e)) if e.is_rebuilding() => {
                        answered.fetch_add(1, Ordering::SeqCst);
                        rebuilding.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(_) => {
                        answered.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(_) => {}
                }
            }
        }
    };
    let clients = futures::future::join_all((0..8).map(|_| client(ctl_tx.clone())));
    let driver = async {
        until("the flood is answered", || load(&answered) >= 8).await;
        let mut last = 0;
        for i in 0..2_000 {
            last = sim.put_now(&format!("k{i}"), "v");
        }
        let before = load(&answered);
        // The condition: the fold holds the last write while the flood still runs (before, the
        // loop served the control channel first and never took a delivery while it ran).
        until("the fold reaches the last write under the flood", || {
            load(&status.cursor) == last
        })
        .await;
        assert!(load(&answered) > before, "queries were answered meanwhile");
        flooding.store(false, Ordering::SeqCst);
        drop(stop_tx);
    };
    let (result, (), _) =
        tokio::time::timeout(DEADLINE, async { tokio::join!(fold, driver, clients) })
            .await
            .expect("the fold ended in time");
    assert!(result.is_ok(), "{result:?}");
    apply
}

#[tokio::test(start_paused = true)]
async fn one_failed_write_of_the_eviction_memo_is_retried_not_fatal() {
    let sim = SimBucket::with_config(SimConfig {
        evicts_current_values: true,
        ..SimConfig::default()
    });
    for i in 1..=6 {
        sim.put_now(&format!("k{i}"), "v");
    }
    sim.evict_through(2); // the fold starts on a bucket that has evicted: it commits the memo
    let dir = tempfile::tempdir().expect("tempdir");
    let holes = Arc::new(Mutex::new(Vec::new()));
    let store = SharedStore::new(FaultyStore {
        inner: open(dir.path()),
        calls: Arc::new(AtomicU32::new(0)),
        fail: vec![1], // the memo's commit
        committed: BTreeSet::new(),
        holes: holes.clone(),
    });
    let status = Arc::new(FoldStatus::default());
    let mut apply = CountingApply::default();
    let finished = fold_alone(
        &sim,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), true),
        status.clone(),
    )
    .await
    .expect("one failed write is retried, not fatal");
    assert_eq!(finished.cursor.revision(), Some(6));
    assert!(
        finished.cursor.memo().is_some(),
        "the memo committed on the retry"
    );
    assert_eq!(apply.parsed, 4, "the four retained keys");
}

/// A watcher that evicts through `evict_through` just before it opens a state-sync watch: the
/// moment between the fold's start-up decision and the watch's snapshot.
struct EvictsBeforeSnapshot {
    sim: SimBucket,
    evict_through: u64,
}

#[async_trait]
impl KvWatcher for EvictsBeforeSnapshot {
    async fn watch(&self, scope: &WatchScope, tx: mpsc::Sender<WatchEvent>) -> Result<(), KvError> {
        self.sim.evict_through(self.evict_through);
        self.sim.watch(scope, tx).await
    }

    async fn watch_from(
        &self,
        scope: &WatchScope,
        cursor: WatchCursor,
        tx: mpsc::Sender<WatchEvent>,
    ) -> Result<(), KvError> {
        if cursor.revision().is_none() {
            self.sim.evict_through(self.evict_through);
        }
        self.sim.watch_from(scope, cursor, tx).await
    }

    async fn retention(&self) -> Result<Option<protocol::Retention>, KvError> {
        self.sim.retention().await
    }

    async fn stream_state(&self) -> Result<Option<StreamState>, KvError> {
        self.sim.stream_state().await
    }

    fn bucket_name(&self) -> String {
        self.sim.bucket_name()
    }

    fn pin_identity(&self, identity: StreamIdentity) {
        self.sim.pin_identity(identity);
    }
}

#[tokio::test(start_paused = true)]
async fn a_state_sync_start_that_eviction_overtook_expires_instead_of_folding_a_short_snapshot() {
    let sim = SimBucket::with_config(SimConfig {
        evicts_current_values: true,
        ..SimConfig::default()
    });
    for i in 1..=4 {
        sim.put_now(&format!("k{i}"), "v");
    }
    // Nothing evicted yet: the fold trusts the listing and starts a state-sync watch; k1 and k2
    // go before its snapshot is taken.
    let watcher: Arc<dyn KvWatcher> = Arc::new(EvictsBeforeSnapshot {
        sim: sim.clone(),
        evict_through: 2,
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let status = Arc::new(FoldStatus::default());
    let mut apply = CountingApply::default();
    let result = tokio::time::timeout(
        DEADLINE,
        watch_applied(
            watcher,
            store.clone(),
            &mut apply,
            opts(100, Duration::from_millis(10), true),
            status,
            None,
            std::future::pending(),
        ),
    )
    .await
    .expect("the fold ended in time");
    match result {
        Err(AppliedError::Watch(KvError::CursorExpired { first_sequence, .. })) => {
            assert_eq!(first_sequence, 3);
        }
        other => panic!("expected CursorExpired (no repair configured), got {other:?}"),
    }
    assert_eq!(apply.parsed, 0, "nothing of the short snapshot was folded");
    let s = store.read().expect("read");
    assert_eq!(s.cursor().revision(), None);
    assert!(s.cursor().memo().is_some(), "the eviction is remembered");
}

/// Options with an automatic repair: a key listing from `sim`, and artifacts from `artifacts`.
fn repairing(sim: &SimBucket, artifacts: Option<&Path>, scratch: &Path) -> WatchOptions {
    let mut o = opts(100, Duration::from_millis(10), true);
    o.repair = foldhost_fold::repair::RepairConfig {
        mode: protocol::RepairMode::Auto,
        restore_from: artifacts.map(foldhost_fold::repair::RestoreSource::new),
        lister: Some(Arc::new(sim.clone()) as Arc<dyn KvReader>),
        scratch: Some(scratch.to_path_buf()),
        ..foldhost_fold::repair::RepairConfig::default()
    };
    o
}

#[tokio::test(start_paused = true)]
async fn an_expired_cursor_is_relisted_where_the_listing_is_the_truth_and_restored_where_it_is_not()
{
    // A bucket that keeps current values: the fold folds k1..k5, stops; while it is down every
    // key is overwritten (its cursor falls out of the log), k1 is deleted and the marker purged.
    let sim = SimBucket::new();
    for i in 1..=5 {
        sim.put_now(&format!("k{i}"), "v1");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let scratch = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let mut apply = CountingApply::default();
    let status = Arc::new(FoldStatus::default());
    let f = fold_alone(
        &sim,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), true),
        status,
    )
    .await
    .expect("the first run");
    assert_eq!(f.cursor.revision(), Some(5));
    for i in 1..=5 {
        sim.put_now(&format!("k{i}"), "v2");
    }
    sim.delete_now("k1");
    assert_eq!(
        sim.purge_deletes_through(u64::MAX),
        1,
        "k1's marker is gone"
    );
    assert!(sim.first_sequence() > 6, "the cursor fell out of the log");
    let status = Arc::new(FoldStatus::default());
    let f = fold_alone(
        &sim,
        store.clone(),
        &mut apply,
        repairing(&sim, None, scratch.path()),
        status.clone(),
    )
    .await
    .expect("the re-list repair");
    assert_eq!(load(&status.repairs), 1);
    assert_eq!(
        f.cursor.revision(),
        Some(sim.last_sequence() - 1),
        "through k5's last write"
    );
    let folded = contents(&*store.read().expect("read"));
    assert_eq!(
        folded,
        bucket(&sim).await,
        "k1 deleted by the diff, the rest re-listed"
    );
    assert!(!folded.contains_key("k1"));

    // A bucket that evicts current values: the fold folds k1..k3; while it is down k1..k3 are
    // evicted unseen-over (k2's new value and k3's delete with them) and only a peer's artifact
    // at 6 still holds what they were.
    let sim = SimBucket::with_config(SimConfig {
        evicts_current_values: true,
        ..SimConfig::default()
    });
    for i in 1..=3 {
        sim.put_now(&format!("k{i}"), "v1");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let mut apply = CountingApply::default();
    fold_alone(
        &sim,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), true),
        Arc::new(FoldStatus::default()),
    )
    .await
    .expect("the first run");
    sim.put_now("k2", "v2"); // 4
    sim.delete_now("k3"); // 5
    sim.put_now("k4", "v1"); // 6
    let peer_dir = tempfile::tempdir().expect("tempdir");
    let mut peer = open(peer_dir.path());
    let entry = |key: &str, value: &'static str, rev: u64| {
        KvUpdate::Put(KvEntry {
            key: key.into(),
            value: Bytes::from_static(value.as_bytes()),
            version: VersionToken::from_u64(rev),
        })
    };
    peer.apply(
        &[
            entry("k1", "v1", 1),
            entry("k2", "v2", 4),
            entry("k4", "v1", 6),
        ],
        WatchCursor::at(6),
    )
    .expect("the peer's fold");
    let artifacts = tempfile::tempdir().expect("tempdir");
    foldhost_artifact::artifact::export_store(
        &peer,
        foldhost_core::storedir::Backend::AppendLog,
        &[],
        &artifacts.path().join("peer-6"),
        Some(WatchScope::All.to_string()),
        &mut |_, _| {},
    )
    .expect("the peer's artifact");
    sim.put_now("k5", "v1"); // 7
    sim.evict_through(6);
    let status = Arc::new(FoldStatus::default());
    let f = fold_alone(
        &sim,
        store.clone(),
        &mut apply,
        repairing(&sim, Some(artifacts.path()), scratch.path()),
        status.clone(),
    )
    .await
    .expect("the restore");
    assert_eq!(load(&status.repairs), 1);
    assert_eq!(f.cursor.revision(), Some(7));
    let folded = contents(&*store.read().expect("read"));
    let want: Vec<(&str, &str, u64)> = vec![
        ("k1", "v1", 1),
        ("k2", "v2", 4),
        ("k4", "v1", 6),
        ("k5", "v1", 7),
    ];
    assert_eq!(
        folded
            .iter()
            .map(|(k, (v, r))| (k.as_str(), std::str::from_utf8(v).expect("utf-8"), *r))
            .collect::<Vec<_>>(),
        want,
        "the evicted values restored, k3's delete taken from the artifact's absence"
    );
}

/// A key listing during which the bucket's retention starts evicting current values (an operator
/// sets `max_age` mid-repair) and evicts through `evict_through`.
struct EvictsDuringListing {
    sim: SimBucket,
    evict_through: u64,
}

#[async_trait]
impl KvReader for EvictsDuringListing {
    async fn get(&self, key: &str) -> Result<Option<KvEntry>, KvError> {
        self.sim.get(key).await
    }

    async fn entry(&self, key: &str) -> Result<Option<KvEntry>, KvError> {
        self.sim.entry(key).await
    }

    async fn keys(&self, prefix: &str) -> Result<Vec<String>, KvError> {
        self.sim.set_evicts_current_values(true);
        self.sim.evict_through(self.evict_through);
        self.sim.keys(prefix).await
    }

    async fn scan(&self, prefix: &str) -> Result<Vec<KvEntry>, KvError> {
        self.sim.scan(prefix).await
    }
}

#[tokio::test(start_paused = true)]
async fn a_relist_whose_bucket_began_evicting_during_its_listing_deletes_nothing() {
    let sim = SimBucket::new(); // keeps current values
    for i in 1..=3 {
        sim.put_now(&format!("k{i}"), "v1");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let scratch = tempfile::tempdir().expect("tempdir");
    let store = SharedStore::new(open(dir.path()));
    let mut apply = CountingApply::default();
    fold_alone(
        &sim,
        store.clone(),
        &mut apply,
        opts(100, Duration::from_millis(10), true),
        Arc::new(FoldStatus::default()),
    )
    .await
    .expect("the first run");
    // While the fold is down every key is overwritten, so its cursor 3 falls out of the log…
    sim.put_now("k2", "v2"); // 4
    sim.put_now("k3", "v2"); // 5
    sim.put_now("k1", "v2"); // 6
    sim.put_now("k4", "v1"); // 7
    sim.put_now("k2", "v3"); // 8
    assert_eq!(sim.first_sequence(), 5, "the cursor fell out of the log");
    // …and during the listing retention starts evicting and takes k3's and k1's current values
    // (5, 6): the listing lacks two keys that were never deleted.
    let mut o = repairing(&sim, None, scratch.path());
    o.repair.lister = Some(Arc::new(EvictsDuringListing {
        sim: sim.clone(),
        evict_through: 6,
    }) as Arc<dyn KvReader>);
    let result = fold_alone(
        &sim,
        store.clone(),
        &mut apply,
        o,
        Arc::new(FoldStatus::default()),
    )
    .await;
    match result {
        Err(AppliedError::Repair(foldhost_fold::repair::RepairError::Refused(why))) => {
            assert!(why.contains("began evicting"), "{why}");
        }
        other => panic!("expected the re-list refused, got {other:?}"),
    }
    let folded = contents(&*store.read().expect("read"));
    assert!(
        folded.contains_key("k1"),
        "k1 only aged out: it is not deleted"
    );
}
