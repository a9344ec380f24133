//! Swaps between batches: a new version hydrated beside the running fold and caught up (in rounds
//! under many writes), each changed key once, and one swap at a time.

use super::*;
use crate::applied::SwapReport;

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
    let driver = swap_between_batches(&sim, &status, &control_tx, stop_tx);
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
    let driver =
        swap_while_writes_arrive(&sim, &status, &control_tx, reached_rx, release_tx, stop_tx);
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
    let (distinct, n) = distinct_revisions(&apply.applied);
    assert_eq!(distinct, n, "an update applied twice: {:?}", apply.applied);
    // Nothing skipped: the new version's copy is the fold.
    assert_eq!(apply.state, contents(&*store.read().expect("read")));
    assert_eq!(apply.state, bucket(&sim).await);
    // The old version folded 21..=28 during the hydration; the new one took over at 29.
    let seen = seen.lock().expect("seen").clone();
    let at = seen
        .iter()
        .position(|s| matches!(s, Seen::Swapped { .. }))
        .expect("swapped");
    let by = applied_by;
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
    let gates = ((reached_rx, release_tx), (round_rx, round_release_tx));
    let driver = swap_in_rounds(&sim, &status, &control_tx, gates, stop_tx);
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

/// The driver of [`a_swap_runs_between_batches_after_everything_delivered_is_committed`]: live
/// updates left in the open batch, the swap asked for, updates after it committed.
async fn swap_between_batches(
    sim: &SimBucket,
    status: &FoldStatus,
    control_tx: &mpsc::Sender<Control>,
    stop_tx: oneshot::Sender<()>,
) -> SwapReport {
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
}

/// The driver of [`a_swap_hydrates_beside_the_running_fold_and_catches_up_each_changed_key_once`]:
/// the swap asked for, writes while its candidate is held on its first page, then released.
async fn swap_while_writes_arrive(
    sim: &SimBucket,
    status: &FoldStatus,
    control_tx: &mpsc::Sender<Control>,
    reached_rx: oneshot::Receiver<()>,
    release_tx: oneshot::Sender<()>,
    stop_tx: oneshot::Sender<()>,
) -> SwapReport {
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
}

/// The two gates of a swap in rounds: (hydration reached, its release), (round reached, its release).
type RoundGates = (
    (oneshot::Receiver<()>, oneshot::Sender<()>),
    (oneshot::Receiver<()>, oneshot::Sender<()>),
);

/// The driver of
/// [`a_swap_under_many_writes_catches_up_in_rounds_beside_the_fold_before_its_cut_over`]: 300 keys
/// changed during the hydration, 20 more during the catch-up round.
async fn swap_in_rounds(
    sim: &SimBucket,
    status: &FoldStatus,
    control_tx: &mpsc::Sender<Control>,
    gates: RoundGates,
    stop_tx: oneshot::Sender<()>,
) -> SwapReport {
    let ((reached_rx, release_tx), (round_rx, round_release_tx)) = gates;
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
}

/// The revisions version `v` applied in `part` of what the swapping applier saw.
fn applied_by(v: u32, part: &[Seen]) -> Vec<u64> {
    part.iter()
        .flat_map(|s| match s {
            Seen::Applied(w, revs) if *w == v => revs.clone(),
            _ => Vec::new(),
        })
        .collect()
}

/// How many distinct known revisions were applied, and how many applies of a known revision
/// there were (synthetic deletes carry none).
fn distinct_revisions(applied: &[(String, u64)]) -> (usize, usize) {
    let mut revs: Vec<&(String, u64)> = applied.iter().filter(|(_, r)| *r != 0).collect();
    let n = revs.len();
    revs.sort();
    revs.dedup();
    (revs.len(), n)
}
