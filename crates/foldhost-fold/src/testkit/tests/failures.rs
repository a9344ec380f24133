//! The fold over a failing world: a poison update retried in halves, a failed store commit
//! re-queued, a deferred key, an eviction past the frontier, a superseded gap, a broken watch
//! resumed.

use super::*;

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
    let mut fold = crate::applied::Fold::new(store.clone(), status).expect("fold");
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
    match crate::applied::flush_all(&mut fold, &mut batch, 100, &mut apply).await {
        Err(AppliedError::Apply { last, .. }) => assert!(last.message.contains("k06"), "{last}"),
        other => panic!("expected an apply fail-stop, got {other:?}"),
    }
    assert_eq!(store.read().expect("read").cursor(), WatchCursor::at(5));
    assert_eq!(apply.applied, (1..=5).collect::<Vec<_>>());
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
