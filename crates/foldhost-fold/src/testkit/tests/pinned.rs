//! Cases found by the seeded simulation, pinned as fast tests: an export during an apply backoff,
//! floods of slow queries beside a writer, a failed write of the eviction memo.

use super::*;

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
