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
use crate::applied::{
    AppliedError, Apply, ApplyError, BatchConfig, Control, CountingApply, MAX_APPLY_FAILURES,
    SwapCandidate, Verdict, WatchOptions, watch_applied,
};
use foldhost_core::kv::WATCH_CHUNK;
use foldhost_core::retained::{RETAINED_PREFIX, is_reserved};
use foldhost_core::snapshot::{
    AppendLogOptions, AppendLogSnapshot, ProvenCopy, SnapshotError, SnapshotStore,
};
use foldhost_core::status::FoldStatus;
use foldhost_core::view::{FoldRead, SharedStore};

mod failures;
mod pinned;
mod repair;
mod swap;

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
        defer_grace: crate::applied::DEFAULT_DEFER_GRACE,
        repair: crate::repair::RepairConfig::default(),
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
) -> Result<crate::applied::Finished, AppliedError> {
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
