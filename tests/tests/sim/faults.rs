//! The fault injectors and checkers the simulation puts around the real fold: [`FaultStore`] at
//! every store-apply call (transient failure, crash before, crash after, torn commit), and
//! [`Harnessed`] around every applier (an error at a chosen call, and the checks on what `apply`
//! is shown: no regression, no phantom delete).

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use foldhost_core::kv::{KvEntry, KvUpdate, WatchCursor, WatchScope};
use foldhost_core::retained::is_reserved;
use foldhost_core::snapshot::{ProvenCopy, SnapshotError, SnapshotStore};
use foldhost_core::storedir::AnyStore;
use foldhost_core::view::{FoldRead, SharedStore};
use foldhost_fold::applied::{Apply, ApplyError, SwapCandidate, Verdict};

use crate::world::Truth;

/// What a store-apply call does instead of succeeding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreFault {
    /// Fails, leaving the store as it was (a full disk for a moment).
    Fail,
    /// The process dies before the commit reaches the store.
    CrashBefore,
    /// The process dies after the commit is in the store, before the fold hears of it.
    CrashAfter,
    /// The process dies with the commit half written: the append log's tail is cut inside it.
    Torn,
}

/// What the run learns from its store (shared with the driver).
#[derive(Default)]
pub struct StoreWatch {
    /// The store is dead (a crash fault fired): every later call fails.
    pub crashed: AtomicBool,
    /// For a torn commit: the log's length before it, and after.
    pub torn: Mutex<Option<(u64, u64)>>,
    /// Store-apply calls so far this life.
    pub calls: AtomicU32,
    /// The revision of every committed cursor this life, in order.
    pub committed: Mutex<Vec<u64>>,
}

/// A store whose chosen apply calls fail or crash.
pub struct FaultStore {
    pub inner: AnyStore,
    pub dir: PathBuf,
    pub plan: BTreeMap<u32, StoreFault>,
    pub watch: Arc<StoreWatch>,
}

fn injected(what: &str) -> SnapshotError {
    SnapshotError::Io {
        path: "simulated fault".into(),
        op: "injected",
        source: std::io::Error::other(what.to_string()),
    }
}

/// The append log's file in a store directory, if the backend has one.
pub fn log_file(dir: &Path) -> PathBuf {
    dir.join("fold.log")
}

fn len_of(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

impl FaultStore {
    fn committed(&self, cursor: WatchCursor) {
        if let Ok(mut c) = self.watch.committed.lock() {
            c.push(cursor.revision_or_zero());
        }
    }
}

impl SnapshotStore for FaultStore {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn cursor(&self) -> WatchCursor {
        self.inner.cursor()
    }

    fn apply(&mut self, batch: &[KvUpdate], cursor: WatchCursor) -> Result<(), SnapshotError> {
        if self.watch.crashed.load(Ordering::SeqCst) {
            return Err(injected("the process is dead"));
        }
        let n = self.watch.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if std::env::var("FOLDHOST_SIM_DEBUG").is_ok() {
            eprintln!(
                "store call {n}: {batch:?} cursor {cursor:?} fault {:?}",
                self.plan.get(&n)
            );
        }
        match self.plan.get(&n).copied() {
            None => {
                self.inner.apply(batch, cursor)?;
                self.committed(cursor);
                Ok(())
            }
            Some(StoreFault::Fail) => Err(injected(&format!("transient failure at call {n}"))),
            Some(StoreFault::CrashBefore) => {
                self.watch.crashed.store(true, Ordering::SeqCst);
                Err(injected(&format!("crash before call {n}")))
            }
            Some(f @ (StoreFault::CrashAfter | StoreFault::Torn)) => {
                let before = len_of(&log_file(&self.dir));
                let r = self.inner.apply(batch, cursor);
                if r.is_ok() {
                    self.committed(cursor);
                    let after = len_of(&log_file(&self.dir));
                    if f == StoreFault::Torn
                        && after > before
                        && let Ok(mut t) = self.watch.torn.lock()
                    {
                        *t = Some((before, after));
                    }
                }
                self.watch.crashed.store(true, Ordering::SeqCst);
                Err(injected(&format!("crash after call {n}")))
            }
        }
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

    fn for_each_in_range_after(
        &self,
        prefix: &str,
        after: Option<&str>,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        self.inner.for_each_in_range_after(prefix, after, visit)
    }

    fn len(&self) -> Result<u64, SnapshotError> {
        self.inner.len()
    }

    fn export_to(&self, dest: &Path) -> Result<Option<ProvenCopy>, SnapshotError> {
        self.inner.export_to(dest)
    }
}

/// The bucket keys of a store in `scope`, with values and revisions.
pub fn contents(store: &impl SnapshotStore, scope: &WatchScope) -> BTreeMap<String, (Bytes, u64)> {
    let mut out = BTreeMap::new();
    store
        .for_each_in_range("", &mut |e| {
            if !is_reserved(&e.key) && scope.contains(&e.key) {
                out.insert(
                    e.key.clone(),
                    (e.value.clone(), e.version.as_u64().unwrap_or(0)),
                );
            }
            ControlFlow::Continue(())
        })
        .expect("scan the store");
    out
}

/// Violations seen by the checks inside the run, for the driver to report.
pub type Violations = Arc<Mutex<Vec<String>>>;

fn violation(v: &Violations, what: String) {
    if let Ok(mut v) = v.lock() {
        v.push(what);
    }
}

/// An applier with an error injected at chosen `apply` calls, and checks on everything `apply`
/// is shown against the committed fold and the truth.
pub struct Harnessed {
    pub inner: Box<dyn Apply>,
    pub bucket: foldhost_fold::testkit::SimBucket,
    pub store: SharedStore<FaultStore>,
    pub truth: Arc<Mutex<Truth>>,
    pub violations: Violations,
    /// `apply` calls (1-based, this life) that fail, and how.
    pub faults: Vec<(u32, GuestFault)>,
    pub calls: Arc<AtomicU32>,
    /// Guest calls that the injected interrupt really trapped.
    pub traps: Arc<AtomicU32>,
    /// Set by the driver: the next query fails as a trapped guest call does (the instance dropped).
    pub trap_next_query: Arc<AtomicBool>,
}

/// A fault at a guest call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestFault {
    /// The call fails as a guest's own error would (the instance is dropped).
    Error,
    /// The guest host arms the call with a passed deadline: wasmtime interrupts it (a real trap).
    Interrupt,
}

impl Harnessed {
    /// Checks one update against the committed fold: a revision never below the fold's for its
    /// key (no regression), and a delete without a revision only where the key was really
    /// deleted after the fold's value (no phantom delete).
    fn check(&self, u: &KvUpdate) {
        if is_reserved(u.key()) {
            return;
        }
        let Ok(store) = self.store.read() else {
            return;
        };
        let Ok(Some(have)) = store.get(u.key()) else {
            return;
        };
        let have_rev = have.version.as_u64().unwrap_or(0);
        match (u, u.revision()) {
            (_, Some(r)) if r < have_rev => violation(
                &self.violations,
                format!(
                    "regression: apply shown {} at revision {r} over the fold's {have_rev}",
                    u.key()
                ),
            ),
            (KvUpdate::Delete { .. } | KvUpdate::Purge { .. }, None) => {
                // Legitimate only for a key really deleted after the fold's value and not live in
                // the bucket now (a repair runs without yielding here, so nothing re-creates the
                // key between its listing and this call).
                let live = self
                    .bucket
                    .messages()
                    .iter()
                    .rev()
                    .find(|m| m.key == u.key())
                    .is_some_and(|m| matches!(m.op, foldhost_fold::testkit::SimOp::Put(_)));
                let truth = self.truth.lock().expect("truth");
                if live || !truth.deleted_after(u.key(), have_rev) {
                    violation(
                        &self.violations,
                        format!(
                            "phantom delete: apply shown a delete of {} (fold revision {have_rev}), which was never deleted after it or is live",
                            u.key()
                        ),
                    );
                }
            }
            _ => {}
        }
    }
}

#[async_trait]
impl Apply for Harnessed {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        self.inner.parse(batch).await
    }

    async fn apply(&mut self, batch: &[KvUpdate], verdicts: &[Verdict]) -> Result<(), ApplyError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let fault = self.faults.iter().find(|(c, _)| *c == n).map(|(_, f)| *f);
        if fault == Some(GuestFault::Error) {
            // A failed guest call kills its instance: the next call rebuilds it from the fold.
            self.inner.discard();
            return Err(ApplyError {
                applier: self.inner.describe(),
                call: "apply",
                message: format!("injected error at apply call {n}"),
            });
        }
        for (u, v) in batch.iter().zip(verdicts) {
            if *v != Verdict::Skip {
                self.check(u);
            }
        }
        if fault == Some(GuestFault::Interrupt) {
            self.inner.interrupt_next_call();
            let r = self.inner.apply(batch, verdicts).await;
            if r.is_err() {
                self.traps.fetch_add(1, Ordering::SeqCst);
            }
            return r;
        }
        self.inner.apply(batch, verdicts).await
    }

    async fn on_applied(&mut self, cursor: WatchCursor) {
        self.inner.on_applied(cursor).await;
    }

    fn discard(&mut self) {
        self.inner.discard();
    }

    fn generation(&self) -> u64 {
        self.inner.generation()
    }

    fn rebuild_due(&self) -> bool {
        self.inner.rebuild_due()
    }

    async fn rebuild(&mut self) -> Result<(), ApplyError> {
        self.inner.rebuild().await
    }

    fn swap_candidate(
        &mut self,
        what: &str,
        bytes: &[u8],
        view: Arc<dyn FoldRead>,
    ) -> Result<Box<dyn SwapCandidate>, ApplyError> {
        self.inner.swap_candidate(what, bytes, view)
    }

    fn adopt(
        &mut self,
        candidate: Box<dyn SwapCandidate>,
    ) -> Result<Box<dyn std::any::Any + Send>, ApplyError> {
        self.inner.adopt(candidate)
    }

    fn query_instance(&mut self, view: Arc<dyn FoldRead>) -> Option<Box<dyn SwapCandidate>> {
        self.inner.query_instance(view)
    }

    async fn query(&mut self, request: &[u8]) -> Result<Vec<u8>, ApplyError> {
        if self.trap_next_query.swap(false, Ordering::SeqCst) {
            // A guest is interrupted by the guest host (a real trap); a native applier fails as
            // a trapped call does: its state is dropped.
            self.inner.interrupt_next_call();
            let r = self.inner.query(request).await;
            let r = if self.inner.describe().starts_with("native:") {
                self.inner.discard();
                Err(ApplyError {
                    applier: self.inner.describe(),
                    call: "query",
                    message: "injected trap".into(),
                })
            } else {
                r
            };
            if r.is_err() {
                self.traps.fetch_add(1, Ordering::SeqCst);
            }
            return r;
        }
        self.inner.query(request).await
    }
}

/// A native applier with `kvstore`'s semantics: key → value, a query answers the value or
/// `missing`. Built from the fold on start and after a failed call, as a guest instance is — by
/// its next call of any kind, a query included (the guest host never rebuilds on a query's account;
/// this applier does, so the fold's generation rule is what keeps it whole).
pub struct NativeMap {
    pub map: BTreeMap<String, Bytes>,
    pub fold: Arc<dyn FoldRead>,
    pub stale: bool,
    /// Rebuilds so far ([`Apply::generation`]).
    pub rebuilds: u64,
}

impl NativeMap {
    pub fn new(fold: Arc<dyn FoldRead>) -> Self {
        NativeMap {
            map: BTreeMap::new(),
            fold,
            stale: true,
            rebuilds: 0,
        }
    }

    fn rebuild_from_fold(&mut self) -> Result<(), ApplyError> {
        self.map.clear();
        let mut after: Option<String> = None;
        loop {
            let page = self
                .fold
                .scan("", after.as_deref(), 64)
                .map_err(|e| ApplyError {
                    applier: "native:map".into(),
                    call: "hydrate",
                    message: e.to_string(),
                })?;
            let Some(last) = page.last().map(|e| e.key.clone()) else {
                break;
            };
            for e in page {
                self.map.insert(e.key, e.value);
            }
            after = Some(last);
        }
        self.stale = false;
        self.rebuilds += 1;
        Ok(())
    }
}

#[async_trait]
impl Apply for NativeMap {
    fn describe(&self) -> String {
        "native:map".into()
    }

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        Ok(vec![Verdict::Accept; batch.len()])
    }

    async fn apply(&mut self, batch: &[KvUpdate], _verdicts: &[Verdict]) -> Result<(), ApplyError> {
        if self.stale {
            self.rebuild_from_fold()?;
        }
        for u in batch {
            match u {
                KvUpdate::Put(e) => {
                    self.map.insert(e.key.clone(), e.value.clone());
                }
                KvUpdate::Delete { key, .. } | KvUpdate::Purge { key, .. } => {
                    self.map.remove(key);
                }
            }
        }
        Ok(())
    }

    async fn on_applied(&mut self, _cursor: WatchCursor) {}

    fn discard(&mut self) {
        self.stale = true;
    }

    fn generation(&self) -> u64 {
        self.rebuilds
    }

    fn rebuild_due(&self) -> bool {
        self.stale
    }

    async fn rebuild(&mut self) -> Result<(), ApplyError> {
        if self.stale {
            self.rebuild_from_fold()?;
        }
        Ok(())
    }

    fn query_instance(&mut self, view: Arc<dyn FoldRead>) -> Option<Box<dyn SwapCandidate>> {
        Some(Box::new(NativeMapCandidate {
            map: NativeMap::new(view),
        }))
    }

    async fn query(&mut self, request: &[u8]) -> Result<Vec<u8>, ApplyError> {
        if self.stale {
            self.rebuild_from_fold()?;
        }
        let key = String::from_utf8_lossy(request);
        self.map
            .get(key.as_ref())
            .map(|v| v.to_vec())
            .ok_or_else(|| ApplyError {
                applier: "native:map".into(),
                call: "query",
                message: "missing".into(),
            })
    }
}

/// [`NativeMap`]'s query instance: the same map, built from its own view of the fold and kept
/// level by the fold loop's rounds.
struct NativeMapCandidate {
    map: NativeMap,
}

#[async_trait]
impl SwapCandidate for NativeMapCandidate {
    fn describe(&self) -> String {
        "native:map".into()
    }

    async fn hydrate(&mut self) -> Result<u64, ApplyError> {
        self.map.rebuild_from_fold()?;
        Ok(self.map.map.len() as u64)
    }

    async fn catch_up(&mut self, updates: &[KvUpdate]) -> Result<(), ApplyError> {
        self.map
            .apply(updates, &vec![Verdict::Accept; updates.len()])
            .await
    }

    async fn query(&mut self, request: &[u8]) -> Result<Result<Vec<u8>, String>, ApplyError> {
        Ok(self.map.query(request).await.map_err(|e| e.message))
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}
