//! One seeded run: a scenario's lives, each the real `watch_applied` over the simulated bucket
//! with faults armed, a driver that writes, evicts, opens delivery gaps, publishes a peer's
//! artifacts, swaps the guest and exports mid-run, and the checks after every step.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use foldhost_artifact::artifact;
use foldhost_core::kv::{KvReader, KvWatcher, WatchScope};
use foldhost_core::protocol::RepairMode;
use foldhost_core::snapshot::SnapshotStore;
use foldhost_core::status::FoldStatus;
use foldhost_core::storedir::{AnyStore, Backend};
use foldhost_core::view::{FoldRead, SharedStore};
use foldhost_fold::applied::{
    AppliedError, Apply, ApplyError, BatchConfig, Control, Finished, Queries, WatchOptions,
    watch_applied,
};
use foldhost_fold::repair::{RepairConfig, RestoreSource};
use foldhost_fold::testkit::{SimBucket, SimConfig};
use foldhost_guest::guest::{GuestApply, GuestEngine, GuestLimits};
use tokio::sync::{mpsc, oneshot};

use crate::faults::{
    FaultStore, GuestFault, Harnessed, NativeMap, StoreFault, StoreWatch, Violations, contents,
};
use crate::world::{GuestKind, KEYS, Op, Rng, Scenario, Truth};

mod life;

/// Longest (virtual) time a wait for the fold may take before the run is declared stuck.
const STUCK: Duration = Duration::from_secs(300);

/// The components the Wasm scenarios run: `kvstore` and its next version.
struct Components {
    engine: Arc<GuestEngine>,
    v1: Vec<u8>,
    v2: Vec<u8>,
}

fn components() -> &'static Components {
    static C: OnceLock<Components> = OnceLock::new();
    C.get_or_init(|| {
        let read = |name: &str| {
            std::fs::read(foldhost_tests::guest_wasm(name)).expect("read a guest component")
        };
        Components {
            engine: GuestEngine::new().expect("a guest engine"),
            v1: read("kvstore"),
            v2: read("kvstore_v2"),
        }
    })
}

/// How a life ended.
#[derive(Debug, PartialEq, Eq)]
enum LifeEnd {
    /// Every round ran and the fold was stopped (cleanly, or killed).
    Done,
    /// A crash fault fired.
    Crashed,
}

/// What a run found wrong, with the trace that led there.
#[derive(Debug)]
pub struct Failure {
    pub seed: u64,
    pub what: String,
    pub trace: Vec<String>,
}

/// Marks a trace line whose presence or text depends on how many times a wait polled (the
/// queries sent while the driver waits for the fold): kept for reading a failure, left out of a
/// replay's comparison.
const POLLED: &str = "~ ";

/// The outcome of a passing run, for coverage and replay checks.
#[derive(Debug, Default)]
pub struct Outcome {
    pub trace: Vec<String>,
    pub repairs: u64,
    pub crashes: u32,
    pub torn: u32,
    pub swaps: u32,
    pub exports: u32,
    /// Guest calls interrupted by the guest host (real traps).
    pub guest_traps: u32,
    /// Queries sent while a batch waited re-queued after a failed commit (a trapping one among
    /// them): between the failure and its retry.
    pub queries_before_retry: u32,
    /// Times the query instance, level with the committed fold, was checked against a fresh
    /// instance hydrated from it.
    pub instance_checks: u32,
}

/// What a seed decides, and so what two runs of it must share: every line of the trace but the
/// polled ones, and the counts of repairs, crashes, torn commits, swaps and exports. Traps and
/// queries are not in it: how many queries a wait sends depends on how often it polled.
#[derive(Debug, PartialEq, Eq)]
pub struct Replay {
    pub trace: Vec<String>,
    pub counts: [u32; 4],
    pub repairs: u64,
}

impl Outcome {
    pub fn replay(&self) -> Replay {
        Replay {
            trace: self
                .trace
                .iter()
                .filter(|l| !l.starts_with(POLLED))
                .cloned()
                .collect(),
            counts: [self.crashes, self.torn, self.swaps, self.exports],
            repairs: self.repairs,
        }
    }
}

/// What the driver needs of the running life to send queries between its other steps.
struct Asker {
    ctl: mpsc::Sender<Control>,
    /// The fold's query route: the query instance once level, the fold loop before.
    queries: Queries,
    status: Arc<FoldStatus>,
    /// Sets the next query to trap ([`Harnessed::trap_next_query`]).
    trap: Arc<AtomicBool>,
    /// Whether queries may trap this life (its faults are armed).
    traps: bool,
}

/// A run in progress.
pub struct Sim {
    sc: Scenario,
    /// Every decision of the run but the polled queries: drawn a fixed number of times per step,
    /// so a seed replays.
    rng: Rng,
    /// The queries sent while a wait polls: their own stream, since how many polls a wait takes
    /// depends on the machine (commits run on blocking threads while virtual time advances).
    poll_rng: Rng,
    bucket: SimBucket,
    truth: Arc<Mutex<Truth>>,
    _tmp: tempfile::TempDir,
    root: PathBuf,
    peer_dir: PathBuf,
    peer_cursor: u64,
    exports: Vec<(PathBuf, u64)>,
    /// Per store directory, the cursor of the last commit known durable: a reopened store holds
    /// at least this.
    durable: BTreeMap<PathBuf, u64>,
    violations: Violations,
    trace: Vec<String>,
    counter: u64,
    /// The component the Wasm guest runs now (`false`: v1, `true`: v2).
    on_v2: bool,
    out: Outcome,
    /// The running life's query path, while one runs.
    asker: Option<Asker>,
}

type Res<T> = Result<T, String>;

impl Sim {
    pub fn new(sc: Scenario) -> Self {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path().to_path_buf();
        let peer_dir = root.join("peer");
        std::fs::create_dir_all(&peer_dir).expect("peer dir");
        std::fs::create_dir_all(root.join("exports")).expect("exports dir");
        let bucket = SimBucket::with_config(SimConfig {
            history: 1,
            evicts_current_values: sc.evicting,
            ..SimConfig::default()
        });
        Sim {
            rng: Rng::new(sc.seed),
            poll_rng: Rng::new(sc.seed ^ 0x9011_ED00_0000_0000),
            sc,
            bucket,
            truth: Arc::new(Mutex::new(Truth::default())),
            _tmp: tmp,
            root,
            peer_dir,
            peer_cursor: 0,
            exports: Vec::new(),
            durable: BTreeMap::new(),
            violations: Arc::new(Mutex::new(Vec::new())),
            trace: Vec::new(),
            counter: 0,
            on_v2: false,
            out: Outcome::default(),
            asker: None,
        }
    }

    fn note(&mut self, s: String) {
        self.trace.push(s);
    }

    fn fail(&self, what: String) -> Failure {
        Failure {
            seed: self.sc.seed,
            what,
            trace: self.trace.clone(),
        }
    }

    /// Runs the whole scenario and its checks.
    pub async fn run(mut self) -> Result<Outcome, Failure> {
        self.note(format!("{:?}", self.sc));
        let store_dir = self.root.join("fold");
        for life in 0..self.sc.lives {
            // While the node is down the bucket goes on.
            self.offline_writes(life);
            let guest = self.sc.guest;
            if let Err(e) = self.life(&store_dir, guest, true, self.sc.rounds).await {
                return Err(self.fail(e));
            }
        }
        // A last life without faults: the fold must reach the truth and stop cleanly.
        self.offline_writes(self.sc.lives);
        let guest = self.sc.guest;
        if let Err(e) = self.life(&store_dir, guest, false, 1).await {
            return Err(self.fail(format!("final life: {e}")));
        }
        // Every mid-run export resumes to the truth.
        let exports = std::mem::take(&mut self.exports);
        for (i, (artifact_dir, cursor)) in exports.iter().enumerate() {
            let dest = self.root.join(format!("from-export-{i}"));
            if let Err(e) = artifact::import_artifact(
                artifact_dir,
                &dest,
                Some(self.sc.backend),
                &mut |_, _| {},
            ) {
                return Err(self.fail(format!("import of export {i} at {cursor}: {e}")));
            }
            self.note(format!("resume export {i} (cursor {cursor})"));
            if let Err(e) = self.life(&dest, GuestKind::Native, false, 0).await {
                return Err(self.fail(format!("export {i} at cursor {cursor}: {e}")));
            }
        }
        let v = self
            .violations
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default();
        if let Some(first) = v.first() {
            return Err(self.fail(first.clone()));
        }
        self.out.trace = std::mem::take(&mut self.trace);
        Ok(self.out)
    }

    // -----------------------------------------------------------------------------------------
    // The bucket side.
    // -----------------------------------------------------------------------------------------

    /// One random write, recorded in the truth.
    fn write_one(&mut self) {
        let key = self.rng.pick(&KEYS);
        self.write_key(key);
    }

    /// A random put, delete or purge of `key`, recorded in the truth.
    fn write_key(&mut self, key: &str) {
        let roll = self.rng.below(100);
        self.counter += 1;
        let (seq, op) = if roll < 70 {
            let value = Bytes::from(format!("{key}={}", self.counter));
            (self.bucket.put_now(key, value.clone()), Op::Put(value))
        } else if roll < 85 {
            (self.bucket.delete_now(key), Op::Delete)
        } else if roll < 93 || !self.sc.evicting {
            (self.bucket.purge_now(key), Op::Purge)
        } else {
            // A message TTL ran out: the server's delete marker replaces the value.
            (self.bucket.expire_now(key), Op::Delete)
        };
        self.truth.lock().expect("truth").record(seq, key, op);
    }

    fn writes(&mut self, n: u64) {
        for _ in 0..n {
            self.write_one();
        }
        // On an evicting bucket with one message per key, overwrites alone can move the first
        // sequence past a fold's frontier; the simulated server keeps no message times, so the
        // guard cannot tell that from eviction and a restore must be possible: a peer in the fleet
        // always holds the head (the scenarios never lose a write no fold anywhere holds).
        if self.sc.evicting {
            self.publish_peer();
            // A few writes after the peer's artifact, each to a key not written again in this
            // tail: a fold restored from the artifact resumes through them, and none can be
            // superseded away before the fold sees it (the first sequence never passes the
            // artifact's cursor + 1, so a restore stays possible).
            let mut tail: Vec<&str> = Vec::new();
            for _ in 0..self.rng.below(3) {
                let key = self.rng.pick(&KEYS);
                if !tail.contains(&key) {
                    tail.push(key);
                    self.write_key(key);
                }
            }
        }
    }

    /// A correct peer publishes its artifact at the bucket's last sequence.
    fn publish_peer(&mut self) {
        let cursor = self.bucket.last_sequence();
        if cursor <= self.peer_cursor {
            return;
        }
        let store_dir = self.root.join(format!("peer-store-{cursor}"));
        let store =
            self.truth
                .lock()
                .expect("truth")
                .write_store(&store_dir, self.sc.backend, cursor);
        let out = self.peer_dir.join(format!("peer-{cursor:08}"));
        artifact::export_store(
            &store,
            self.sc.backend,
            &[],
            &out,
            Some(WatchScope::All.to_string()),
            &mut |_, _| {},
        )
        .expect("export the peer's artifact");
        drop(store);
        let _ = std::fs::remove_dir_all(&store_dir);
        self.peer_cursor = cursor;
        self.note(format!("peer artifact at {cursor}"));
    }

    /// On an evicting bucket, evicts up to the peer's artifact (so a restore is always possible:
    /// the scenarios never lose a write no fold anywhere holds).
    fn maybe_evict(&mut self) {
        if !self.sc.evicting || !self.rng.chance(60) {
            return;
        }
        let first = self.bucket.first_sequence();
        if self.peer_cursor < first {
            return;
        }
        let through = first + self.rng.below(self.peer_cursor - first + 1);
        let n = self.bucket.evict_through(through);
        self.note(format!("evict through {through} ({n} messages)"));
    }

    fn offline_writes(&mut self, life: u32) {
        // Sometimes a long outage: enough writes that every key is overwritten and the fold's
        // cursor falls out of the log (a repair at the next start).
        let n = if self.rng.chance(30) {
            20 + self.rng.below(30)
        } else {
            self.rng.below(12)
        };
        self.writes(n);
        if self.rng.chance(50) {
            self.publish_peer();
        }
        self.maybe_evict();
        self.maybe_purge_deletes();
        self.note(format!(
            "down before life {life}: {n} writes, log {}..={}",
            self.bucket.first_sequence(),
            self.bucket.last_sequence()
        ));
    }

    /// On a bucket that keeps current values, purges delete markers (NATS's `purge_deletes`) — only
    /// once every fold of this run has a cursor the log no longer reaches, which is the key-listing
    /// repair's axiom: a marker no fold still needs may go (a fold whose cursor is still inside
    /// the log would resume past the missing marker, and no repair could know).
    fn maybe_purge_deletes(&mut self) {
        if self.sc.evicting || !self.rng.chance(50) {
            return;
        }
        let newest = self.durable.values().copied().max().unwrap_or(0);
        if !foldhost_core::protocol::resume_window_ok(newest, self.bucket.first_sequence()) {
            let through = self.bucket.last_sequence();
            let n = self.bucket.purge_deletes_through(through);
            self.note(format!(
                "purge delete markers through {through} ({n} messages)"
            ));
        }
    }

    /// The last sequence still in the log that is in scope (0: none).
    fn last_in_scope(&self) -> u64 {
        self.bucket
            .messages()
            .iter()
            .filter(|m| self.sc.scope.contains(&m.key))
            .map(|m| m.sequence)
            .max()
            .unwrap_or(0)
    }

    // -----------------------------------------------------------------------------------------
    // A life of the node.
    // -----------------------------------------------------------------------------------------

    fn plan_store_faults(&mut self) -> BTreeMap<u32, StoreFault> {
        let mut plan = BTreeMap::new();
        for call in 1..=40 {
            if self.rng.chance(6) {
                plan.insert(call, StoreFault::Fail);
            }
        }
        if self.rng.chance(70) {
            let call = 1 + self.rng.below(30) as u32;
            let mut kinds = vec![StoreFault::CrashBefore, StoreFault::CrashAfter];
            if self.sc.backend == Backend::AppendLog {
                kinds.push(StoreFault::Torn);
            }
            plan.insert(call, self.rng.pick(&kinds));
        }
        plan
    }

    /// Opens the store, checking it recovered at least the last durable cursor.
    fn open(&mut self, dir: &Path) -> Res<AnyStore> {
        let (store, _) =
            AnyStore::open(dir, self.sc.backend).map_err(|e| format!("reopen the store: {e}"))?;
        let at = store.cursor().revision_or_zero();
        let durable = self.durable.get(dir).copied().unwrap_or(0);
        if at < durable {
            return Err(format!(
                "the store reopened at cursor {at}, below its last durable commit {durable}"
            ));
        }
        Ok(store)
    }

    /// Sends one query for `key` (trapping when `trap`) through the running fold's control channel
    /// and says what came back. Mid-flight answers are not held to the truth (the fold moves);
    /// [`Self::check_guest`] holds the settled ones.
    async fn ask(&mut self, key: &str, trap: bool) -> Res<String> {
        let Some(a) = &self.asker else {
            return Ok("no fold".into());
        };
        let ctl = a.ctl.clone();
        let reply = if trap {
            // Through the fold loop, to the running applier (whose next query traps).
            a.trap.store(true, Ordering::SeqCst);
            let (tx, rx) = oneshot::channel();
            let q = Control::Query {
                request: key.as_bytes().to_vec(),
                reply: tx,
            };
            if ctl.send(q).await.is_err() {
                return Ok("the fold stopped".into());
            }
            rx.await.ok()
        } else {
            // Through the query route: the query instance when one is level.
            a.queries.ask(key.as_bytes().to_vec()).await.ok()
        };
        Ok(match reply.ok_or(()) {
            Ok(Ok(_)) => format!("{key}: a value"),
            Ok(Err(e)) if e.is_rebuilding() => format!("{key}: rebuilding"),
            Ok(Err(e)) if e.message.contains("missing") => format!("{key}: missing"),
            Ok(Err(e)) => format!("{key}: failed ({})", e.call),
            Err(()) => "no reply".into(),
        })
    }

    /// Between the driver's other steps: sometimes a query, more often while a batch waits
    /// re-queued after a failed commit, and then sometimes a trapping one followed by a plain one.
    async fn maybe_query(&mut self) -> Res<()> {
        let Some(a) = &self.asker else {
            return Ok(());
        };
        let unsettled = a.status.store_failure_streak.load(Ordering::SeqCst) > 0;
        let traps = a.traps;
        if !self.poll_rng.chance(if unsettled { 50 } else { 4 }) {
            return Ok(());
        }
        let key = self.poll_rng.pick(&KEYS);
        let trap = traps && self.poll_rng.chance(if unsettled { 60 } else { 20 });
        let first = self.ask(key, trap).await?;
        let then = if trap {
            Some(self.ask(key, false).await?)
        } else {
            None
        };
        if unsettled {
            self.out.queries_before_retry += 1;
        }
        let what = if unsettled {
            "a query before a retry"
        } else {
            "a query"
        };
        self.note(match then {
            Some(t) => format!("{POLLED}{what}, trapping: {first}, then {t}"),
            None => format!("{POLLED}{what}: {first}"),
        });
        Ok(())
    }

    async fn swap(&mut self, ctl: &mpsc::Sender<Control>) -> Res<()> {
        let (tx, rx) = oneshot::channel();
        let swap = Control::Swap {
            bytes: components().v2.clone(),
            what: "kvstore_v2.wasm".into(),
            reply: tx,
        };
        if ctl.send(swap).await.is_err() {
            return Ok(());
        }
        match rx.await {
            Ok(Ok(r)) => {
                self.on_v2 = true;
                self.out.swaps += 1;
                self.note(format!("swapped {} -> {}", r.from, r.to));
            }
            Ok(Err(e)) => self.note(format!("swap refused: {e}")),
            Err(_) => self.note("swap: the fold stopped".into()),
        }
        Ok(())
    }

    async fn export(&mut self, ctl: &mpsc::Sender<Control>) {
        let out = self
            .root
            .join("exports")
            .join(format!("e{}", self.exports.len()));
        match foldhost_fold::applied::export_live(
            ctl,
            self.sc.backend,
            out.clone(),
            Some(self.sc.scope.to_string()),
        )
        .await
        {
            Ok(m) => {
                let c = m.cursor.unwrap_or(0);
                self.note(format!("exported at {c}"));
                // The fold's own artifacts serve restores too, as a fleet's would: complete
                // together with the log after their cursor, not the truth at it.
                let shared = self
                    .peer_dir
                    .join(format!("node-{c:08}-{}", self.exports.len()));
                copy_dir(&out, &shared);
                self.exports.push((out, c));
                self.out.exports += 1;
            }
            Err(e) => self.note(format!("export failed: {e}")),
        }
    }

    /// Waits until the fold holds the truth for its scope with its cursor past every message in
    /// scope, or a crash fired.
    async fn wait_level(
        &mut self,
        shared: &SharedStore<FaultStore>,
        watch: &StoreWatch,
        started: u64,
    ) -> Res<LifeEnd> {
        let start = tokio::time::Instant::now();
        loop {
            if watch.crashed.load(Ordering::SeqCst) {
                return Ok(LifeEnd::Crashed);
            }
            let (cursor, have) = {
                let s = shared.read().map_err(|e| e.to_string())?;
                (s.cursor().revision_or_zero(), contents(&*s, &self.sc.scope))
            };
            let want = self.truth.lock().expect("truth").now(&self.sc.scope);
            // Level: this life's fold has a watch open (so it has started, and repaired what
            // it had to) and holds the truth for everything the log has in scope.
            let watching =
                self.bucket.watches_started() > started && self.bucket.open_watches() > 0;
            if watching && have == want && cursor >= self.last_in_scope() {
                return Ok(LifeEnd::Done);
            }
            self.maybe_query().await?;
            if start.elapsed() > STUCK {
                if std::env::var("FOLDHOST_SIM_DEBUG").is_ok() {
                    let s = shared.read().map_err(|e| e.to_string())?;
                    eprintln!("the fold holds {:?}", s.range(""));
                }
                return Err(format!(
                    "the fold never reached the truth: cursor {cursor}, log {}..={}, {} watches open ({} started), {}",
                    self.bucket.first_sequence(),
                    self.bucket.last_sequence(),
                    self.bucket.open_watches(),
                    self.bucket.watches_started(),
                    diff(&have, &want)
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The running guest answers every key as a fresh instance of the same component hydrated
    /// from the fold does, and as the truth says.
    async fn check_guest(
        &mut self,
        shared: &SharedStore<FaultStore>,
        ctl: &mpsc::Sender<Control>,
        kind: GuestKind,
    ) -> Res<()> {
        let view: Arc<dyn FoldRead> = Arc::new(shared.clone());
        let mut fresh = self.applier(kind, view).await?;
        let want = self.truth.lock().expect("truth").now(&self.sc.scope);
        for key in KEYS.iter().filter(|k| self.sc.scope.contains(k)) {
            let (tx, rx) = oneshot::channel();
            let q = Control::Query {
                request: key.as_bytes().to_vec(),
                reply: tx,
            };
            if ctl.send(q).await.is_err() {
                return Err("query: the fold stopped".into());
            }
            let mut reply = rx.await.map_err(|_| "query: no reply".to_string())?;
            // A query that trapped dropped the instance: the fold rebuilds it as its own work.
            let start = tokio::time::Instant::now();
            while reply.as_ref().is_err_and(ApplyError::is_rebuilding) {
                if start.elapsed() > STUCK {
                    return Err(format!("the guest is still rebuilding: {reply:?}"));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
                let (tx, rx) = oneshot::channel();
                let q = Control::Query {
                    request: key.as_bytes().to_vec(),
                    reply: tx,
                };
                if ctl.send(q).await.is_err() {
                    return Err("query: the fold stopped".into());
                }
                reply = rx.await.map_err(|_| "query: no reply".to_string())?;
            }
            let running = answer(reply)?;
            let hydrated = answer(fresh.query(key.as_bytes()).await)?;
            if running != hydrated {
                return Err(format!(
                    "the running guest answers {key} with {running:?}, a fresh one from the fold with {hydrated:?}"
                ));
            }
            let expect = want.get(*key).map(|(v, _)| {
                let mut e = if self.on_v2 && kind == GuestKind::Wasm {
                    b"v2:".to_vec()
                } else {
                    Vec::new()
                };
                e.extend_from_slice(v);
                e
            });
            if running != expect {
                return Err(format!(
                    "the guest answers {key} with {running:?}, the truth is {expect:?}"
                ));
            }
        }
        self.check_query_instance(shared, fresh.as_mut()).await
    }

    /// The query instance, once level with the committed fold, answers every key (asked together)
    /// as `fresh` — an instance hydrated from the fold at that cursor — does.
    async fn check_query_instance(
        &mut self,
        shared: &SharedStore<FaultStore>,
        fresh: &mut dyn Apply,
    ) -> Res<()> {
        let Some(queries) = self.asker.as_ref().map(|a| a.queries.clone()) else {
            return Ok(());
        };
        let start = tokio::time::Instant::now();
        loop {
            let committed = shared
                .read()
                .map_err(|e| format!("read the store: {e}"))?
                .cursor()
                .revision_or_zero();
            if queries.level() == Some(committed) {
                break;
            }
            if start.elapsed() > STUCK {
                return Err(format!(
                    "the query instance is not level with the fold at {committed} (it is at {:?})",
                    queries.level()
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let keys: Vec<&str> = KEYS
            .iter()
            .copied()
            .filter(|k| self.sc.scope.contains(k))
            .collect();
        let (by_instance, _) = queries.answered();
        let answers = queries
            .ask_many(keys.iter().map(|k| k.as_bytes().to_vec()).collect())
            .await
            .map_err(|e| format!("ask the query instance: {e}"))?;
        if queries.answered().0 != by_instance + keys.len() as u64 {
            return Err("the fold loop answered the check, not the query instance".into());
        }
        self.out.instance_checks += 1;
        for (key, reply) in keys.iter().zip(answers) {
            let instance = answer(reply)?;
            let hydrated = answer(fresh.query(key.as_bytes()).await)?;
            if instance != hydrated {
                return Err(format!(
                    "the query instance answers {key} with {instance:?}, a fresh instance from the fold with {hydrated:?}"
                ));
            }
        }
        Ok(())
    }
}

/// A guest's answer to a key: its value, or `None` for `missing`.
fn answer(r: Result<Vec<u8>, ApplyError>) -> Res<Option<Vec<u8>>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.message.contains("missing") => Ok(None),
        Err(e) => Err(format!("query: {e}")),
    }
}

/// The first differences between what the fold holds and the truth.
fn diff(have: &BTreeMap<String, (Bytes, u64)>, want: &BTreeMap<String, (Bytes, u64)>) -> String {
    let mut out = Vec::new();
    for (k, w) in want {
        match have.get(k) {
            None => out.push(format!("{k} missing (truth {w:?})")),
            Some(h) if h != w => out.push(format!("{k} is {h:?}, truth {w:?}")),
            _ => {}
        }
    }
    for k in have.keys().filter(|k| !want.contains_key(*k)) {
        out.push(format!("{k} present, deleted in truth"));
    }
    out.truncate(6);
    out.join("; ")
}

/// Copies the artifact directory `from` to `to` (files and subdirectories).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create the copy");
    for e in std::fs::read_dir(from).expect("read the artifact") {
        let e = e.expect("an entry");
        let dest = to.join(e.file_name());
        if e.file_type().expect("a file type").is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), &dest).expect("copy a file");
        }
    }
}
