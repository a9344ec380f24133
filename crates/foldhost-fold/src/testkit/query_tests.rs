//! The query instance over a [`SimBucket`] (docs/design.md, "Queries off the fold's path"): the
//! real [`watch_applied`] with a query route, a native applier whose query instance answers from
//! its own map. Time is paused, so backoffs cost nothing.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use super::*;
use crate::applied::{
    Apply, ApplyError, BatchConfig, Control, Queries, SwapCandidate, Verdict, WatchOptions,
    watch_applied,
};
use foldhost_core::snapshot::{AppendLogOptions, AppendLogSnapshot};
use foldhost_core::status::FoldStatus;
use foldhost_core::view::{FoldRead, SharedStore};

/// Longest (virtual) time any wait here may take: it only stops a hung test.
const DEADLINE: Duration = Duration::from_secs(600);

/// Holds the next `apply` until released: (reached, release).
type Gate = Arc<Mutex<Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>>>;

/// Key → value, answering `v{version}:{value}` (or the error `missing`); its query instance
/// answers the same from a map of its own, and fails the call (a trap) when asked `trap`.
struct Mapped {
    version: u32,
    map: BTreeMap<String, Bytes>,
    gate: Gate,
}

fn apply_to(map: &mut BTreeMap<String, Bytes>, updates: &[KvUpdate]) {
    for u in updates {
        match u {
            KvUpdate::Put(e) => {
                map.insert(e.key.clone(), e.value.clone());
            }
            KvUpdate::Delete { key, .. } | KvUpdate::Purge { key, .. } => {
                map.remove(key);
            }
        }
    }
}

/// This version cannot decode the value `later`: it defers it (the host retains it, and holds
/// back the key's later updates).
fn verdict(u: &KvUpdate) -> Verdict {
    match u {
        KvUpdate::Put(e) if &e.value[..] == b"later" => Verdict::Defer,
        _ => Verdict::Accept,
    }
}

fn answer(version: u32, map: &BTreeMap<String, Bytes>, request: &[u8]) -> Result<Vec<u8>, String> {
    let key = String::from_utf8_lossy(request);
    map.get(key.as_ref())
        .map(|v| {
            let mut a = format!("v{version}:").into_bytes();
            a.extend_from_slice(v);
            a
        })
        .ok_or_else(|| "missing".to_string())
}

#[async_trait]
impl Apply for Mapped {
    fn describe(&self) -> String {
        format!("native:mapped-v{}", self.version)
    }

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        Ok(batch.iter().map(verdict).collect())
    }

    async fn apply(&mut self, batch: &[KvUpdate], verdicts: &[Verdict]) -> Result<(), ApplyError> {
        let accepted: Vec<KvUpdate> = batch
            .iter()
            .zip(verdicts)
            .filter(|(_, v)| **v == Verdict::Accept)
            .map(|(u, _)| u.clone())
            .collect();
        // Half of the batch now, the rest after the gate: a query answered meanwhile from this
        // instance would see a half-applied batch.
        let half = accepted.len() / 2;
        apply_to(&mut self.map, &accepted[..half]);
        let gate = self.gate.lock().expect("gate").take();
        if let Some((reached, release)) = gate {
            let _ = reached.send(());
            let _ = release.await;
        }
        apply_to(&mut self.map, &accepted[half..]);
        Ok(())
    }

    async fn on_applied(&mut self, _cursor: WatchCursor) {}

    fn swap_candidate(
        &mut self,
        _what: &str,
        bytes: &[u8],
        view: Arc<dyn FoldRead>,
    ) -> Result<Box<dyn SwapCandidate>, ApplyError> {
        let version = std::str::from_utf8(bytes)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        Ok(Box::new(MappedCandidate {
            version,
            view,
            map: BTreeMap::new(),
        }))
    }

    fn adopt(
        &mut self,
        candidate: Box<dyn SwapCandidate>,
    ) -> Result<Box<dyn std::any::Any + Send>, ApplyError> {
        let c = candidate
            .into_any()
            .downcast::<MappedCandidate>()
            .map_err(|_| ApplyError {
                applier: self.describe(),
                call: "swap",
                message: "not a mapped candidate".into(),
            })?;
        self.version = c.version;
        self.map = c.map;
        Ok(Box::new(()))
    }

    fn query_instance(&mut self, view: Arc<dyn FoldRead>) -> Option<Box<dyn SwapCandidate>> {
        Some(Box::new(MappedCandidate {
            version: self.version,
            view,
            map: BTreeMap::new(),
        }))
    }

    async fn query(&mut self, request: &[u8]) -> Result<Vec<u8>, ApplyError> {
        answer(self.version, &self.map, request).map_err(|message| ApplyError {
            applier: self.describe(),
            call: "query",
            message,
        })
    }
}

struct MappedCandidate {
    version: u32,
    view: Arc<dyn FoldRead>,
    map: BTreeMap<String, Bytes>,
}

#[async_trait]
impl SwapCandidate for MappedCandidate {
    fn describe(&self) -> String {
        format!("native:mapped-v{}", self.version)
    }

    async fn hydrate(&mut self) -> Result<u64, ApplyError> {
        let entries = self.view.scan("", None, 10_000).expect("scan the view");
        for e in &entries {
            self.map.insert(e.key.clone(), e.value.clone());
        }
        Ok(entries.len() as u64)
    }

    async fn catch_up(&mut self, updates: &[KvUpdate]) -> Result<(), ApplyError> {
        // As hydration applies: what this version defers is not built.
        let accepted: Vec<KvUpdate> = updates
            .iter()
            .filter(|u| verdict(u) == Verdict::Accept)
            .cloned()
            .collect();
        apply_to(&mut self.map, &accepted);
        Ok(())
    }

    async fn query(&mut self, request: &[u8]) -> Result<Result<Vec<u8>, String>, ApplyError> {
        if request == b"trap" {
            return Err(ApplyError {
                applier: self.describe(),
                call: "query",
                message: "trapped".into(),
            });
        }
        Ok(answer(self.version, &self.map, request))
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

/// Waits (in virtual time) until `cond` holds.
async fn until(what: &str, cond: impl Fn() -> bool) {
    let start = tokio::time::Instant::now();
    while !cond() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A fold of `keys` keys (`k01`… = `a`) with a query route, run until `driver` ends.
async fn with_fold<F, Fut>(keys: u64, driver: F)
where
    F: FnOnce(SimBucket, Queries, mpsc::Sender<Control>, Gate, Arc<FoldStatus>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let sim = SimBucket::new();
    for i in 1..=keys {
        sim.put_now(&format!("k{i:02}"), "a");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) =
        AppendLogSnapshot::open(dir.path(), AppendLogOptions::default()).expect("open");
    let store = SharedStore::new(store);
    let status = Arc::new(FoldStatus::default());
    let gate: Gate = Arc::default();
    let mut apply = Mapped {
        version: 1,
        map: BTreeMap::new(),
        gate: gate.clone(),
    };
    let (control_tx, control_rx) = mpsc::channel(4);
    let queries = Queries::new(control_tx.clone());
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let opts = WatchOptions {
        scope: WatchScope::All,
        batch: BatchConfig {
            window: Duration::from_millis(5),
            max: 100,
            ..BatchConfig::default()
        },
        catch_up: false,
        defer_grace: crate::applied::DEFAULT_DEFER_GRACE,
        repair: crate::repair::RepairConfig::default(),
        queries: Some(queries.clone()),
    };
    let fold = watch_applied(
        Arc::new(sim.clone()),
        store,
        &mut apply,
        opts,
        status.clone(),
        Some(control_rx),
        async {
            let _ = stop_rx.await;
        },
    );
    let driver = async {
        driver(sim, queries, control_tx, gate, status).await;
        let _ = stop_tx.send(());
    };
    let (folded, ()) = tokio::join!(fold, driver);
    folded.expect("the fold ends cleanly");
}

async fn ask(queries: &Queries, key: &str) -> Result<String, String> {
    match queries.ask(key.as_bytes().to_vec()).await {
        Ok(Ok(a)) => Ok(String::from_utf8_lossy(&a).into_owned()),
        Ok(Err(e)) => Err(e.message),
        Err(e) => Err(e.to_string()),
    }
}

#[tokio::test(start_paused = true)]
async fn a_query_is_answered_from_the_committed_fold_while_a_batch_is_held_inside_apply() {
    with_fold(4, |sim, queries, _control, gate, status| async move {
        until("the query instance level at 4", || {
            queries.level() == Some(4)
        })
        .await;
        assert_eq!(ask(&queries, "k01").await.as_deref(), Ok("v1:a"));
        let (reached_tx, reached) = oneshot::channel();
        let (release, release_rx) = oneshot::channel();
        *gate.lock().expect("gate") = Some((reached_tx, release_rx));
        sim.put_now("k01", "b");
        sim.put_now("k02", "b");
        reached.await.expect("the batch reached apply");
        // The running applier holds k01 = b and k02 = a (half of the batch); the fold is in
        // apply. The query instance answers without waiting for it, from the committed fold.
        let (by_instance, _) = queries.answered();
        assert_eq!(ask(&queries, "k01").await.as_deref(), Ok("v1:a"));
        assert_eq!(ask(&queries, "k02").await.as_deref(), Ok("v1:a"));
        assert_eq!(
            queries.answered().0,
            by_instance + 2,
            "answered by the query instance"
        );
        assert_eq!(status.cursor.load(std::sync::atomic::Ordering::Relaxed), 4);
        let _ = release.send(());
        until("the query instance level at 6", || {
            queries.level() == Some(6)
        })
        .await;
        assert_eq!(ask(&queries, "k01").await.as_deref(), Ok("v1:b"));
        assert_eq!(ask(&queries, "k02").await.as_deref(), Ok("v1:b"));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn lookups_asked_together_are_answered_in_order_alike_by_the_query_instance_and_the_fold_loop()
 {
    with_fold(3, |_sim, queries, control, _gate, _status| async move {
        let lookups = || vec![b"k02".to_vec(), b"nope".to_vec(), b"k01".to_vec()];
        let text = |answers: Vec<Result<Vec<u8>, ApplyError>>| -> Vec<Result<String, String>> {
            answers
                .into_iter()
                .map(|a| {
                    a.map(|v| String::from_utf8_lossy(&v).into_owned())
                        .map_err(|e| e.to_string())
                })
                .collect()
        };
        until("the query instance level", || queries.level() == Some(3)).await;
        // The fold loop, asked directly (as while no query instance is level).
        let (reply, answers) = oneshot::channel();
        control
            .send(Control::Queries {
                lookups: lookups(),
                reply,
            })
            .await
            .expect("the fold runs");
        let by_fold = text(answers.await.expect("answered"));
        let by_instance = text(queries.ask_many(lookups()).await.expect("answered"));
        assert_eq!(
            by_fold,
            vec![
                Ok("v1:a".to_string()),
                Err("native:mapped-v1: query failed: missing".to_string()),
                Ok("v1:a".to_string()),
            ]
        );
        assert_eq!(by_instance, by_fold);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_query_instance_that_fails_is_replaced_and_the_fold_loop_answers_until_then() {
    with_fold(2, |sim, queries, _control, _gate, _status| async move {
        until("the query instance level", || queries.level() == Some(2)).await;
        let answers = queries
            .ask_many(vec![b"trap".to_vec(), b"k01".to_vec()])
            .await
            .expect("answered");
        assert_eq!(
            answers[0].as_ref().map_err(|e| e.message.as_str()),
            Err("trapped")
        );
        assert!(
            answers[1].as_ref().is_err_and(ApplyError::is_rebuilding),
            "a lookup after the failed one is answered rebuilding: {:?}",
            answers[1]
        );
        until("the failed instance withdrawn", || {
            queries.level().is_none()
        })
        .await;
        // Meanwhile the fold loop answers, and the fold goes on.
        let (_, by_fold) = queries.answered();
        assert_eq!(ask(&queries, "k01").await.as_deref(), Ok("v1:a"));
        assert_eq!(
            queries.answered().1,
            by_fold + 1,
            "answered by the fold loop"
        );
        sim.put_now("k01", "c");
        until("a new query instance level at 3", || {
            queries.level() == Some(3)
        })
        .await;
        let (by_instance, _) = queries.answered();
        assert_eq!(ask(&queries, "k01").await.as_deref(), Ok("v1:c"));
        assert_eq!(queries.answered().0, by_instance + 1);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn once_a_swap_is_answered_no_query_is_answered_by_the_version_before() {
    with_fold(2, |_sim, queries, control, _gate, _status| async move {
        until("the query instance level", || queries.level() == Some(2)).await;
        assert_eq!(ask(&queries, "k01").await.as_deref(), Ok("v1:a"));
        let (reply, swapped) = oneshot::channel();
        control
            .send(Control::Swap {
                bytes: b"2".to_vec(),
                what: "v2".into(),
                reply,
            })
            .await
            .expect("the fold runs");
        swapped.await.expect("answered").expect("swapped");
        assert_eq!(ask(&queries, "k01").await.as_deref(), Ok("v2:a"));
        until("a query instance of v2 level", || {
            queries.level() == Some(2)
        })
        .await;
        let (by_instance, _) = queries.answered();
        assert_eq!(ask(&queries, "k02").await.as_deref(), Ok("v2:a"));
        assert_eq!(queries.answered().0, by_instance + 1);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_query_instance_beside_a_deferral_answers_as_a_fresh_instance_hydrated_from_the_fold() {
    let sim = SimBucket::new();
    for i in 1..=4 {
        sim.put_now(&format!("k{i:02}"), "a");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) =
        AppendLogSnapshot::open(dir.path(), AppendLogOptions::default()).expect("open");
    let store = SharedStore::new(store);
    let status = Arc::new(FoldStatus::default());
    let mut apply = Mapped {
        version: 1,
        map: BTreeMap::new(),
        gate: Arc::default(),
    };
    let (control_tx, control_rx) = mpsc::channel(4);
    let queries = Queries::new(control_tx.clone());
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let opts = with_queries(&queries);
    let view = store.clone();
    let fold = watch_applied(
        Arc::new(sim.clone()),
        store,
        &mut apply,
        opts,
        status.clone(),
        Some(control_rx),
        async {
            let _ = stop_rx.await;
        },
    );
    let driver = async {
        until("the query instance level at 4", || {
            queries.level() == Some(4)
        })
        .await;
        // k02's record this version cannot decode is retained, and k02's next update held back
        // behind it; k03 moves on.
        sim.put_now("k02", "later");
        // Delivered before the next put supersedes it (the bucket keeps one value per key).
        until("the deferred record committed", || {
            status.cursor.load(std::sync::atomic::Ordering::Relaxed) == 5
        })
        .await;
        sim.put_now("k02", "b");
        sim.put_now("k03", "c");
        until("the query instance level at 7", || {
            queries.level() == Some(7)
        })
        .await;
        assert!(
            status.retained.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "the deferral happened: k02's records are retained"
        );
        let keys: Vec<Vec<u8>> = (1..=4).map(|i| format!("k{i:02}").into_bytes()).collect();
        let (by_instance, _) = queries.answered();
        let answers = queries.ask_many(keys.clone()).await.expect("answered");
        assert_eq!(
            queries.answered().0,
            by_instance + 4,
            "answered by the query instance"
        );
        let expected = fresh_answers(Arc::new(view), &keys).await;
        let answers: Vec<Result<Vec<u8>, String>> = answers
            .into_iter()
            .map(|a| a.map_err(|e| e.message))
            .collect();
        assert_eq!(answers, expected);
        assert_eq!(
            answers[1],
            Ok(b"v1:a".to_vec()),
            "k02 shows what was applied, not the deferred record"
        );
        assert_eq!(answers[2], Ok(b"v1:c".to_vec()));
        let _ = stop_tx.send(());
    };
    let (folded, ()) = tokio::join!(fold, driver);
    folded.expect("the fold ends cleanly");
}

/// Default batches, a query route through `queries`, no catch-up, no repair.
fn with_queries(queries: &Queries) -> WatchOptions {
    WatchOptions {
        scope: WatchScope::All,
        batch: BatchConfig::default(),
        catch_up: false,
        defer_grace: crate::applied::DEFAULT_DEFER_GRACE,
        repair: crate::repair::RepairConfig::default(),
        queries: Some(queries.clone()),
    }
}

/// What a fresh version-1 instance hydrated from `view` answers to each of `keys`, in order.
async fn fresh_answers(view: Arc<dyn FoldRead>, keys: &[Vec<u8>]) -> Vec<Result<Vec<u8>, String>> {
    let mut fresh = MappedCandidate {
        version: 1,
        view,
        map: BTreeMap::new(),
    };
    fresh.hydrate().await.expect("hydrated");
    let mut expected = Vec::new();
    for k in keys {
        expected.push(fresh.query(k).await.expect("answered"));
    }
    expected
}
