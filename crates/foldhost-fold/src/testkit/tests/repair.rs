//! Expiry and its repairs: a state-sync start that eviction overtook, the re-list where the
//! listing is the truth and the restore where it is not, a re-list whose bucket began evicting.

use super::*;

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
    o.repair = crate::repair::RepairConfig {
        mode: protocol::RepairMode::Auto,
        restore_from: artifacts.map(crate::repair::RestoreSource::new),
        lister: Some(Arc::new(sim.clone()) as Arc<dyn KvReader>),
        scratch: Some(scratch.to_path_buf()),
        ..crate::repair::RepairConfig::default()
    };
    o
}

#[tokio::test(start_paused = true)]
async fn an_expired_cursor_is_relisted_where_the_listing_is_the_truth_and_restored_where_it_is_not()
{
    let scratch = tempfile::tempdir().expect("tempdir");
    relisted_where_the_listing_is_the_truth(scratch.path()).await;
    restored_where_the_listing_is_not(scratch.path()).await;
}

/// The first half of
/// [`an_expired_cursor_is_relisted_where_the_listing_is_the_truth_and_restored_where_it_is_not`]:
/// a bucket that keeps current values, re-listed.
async fn relisted_where_the_listing_is_the_truth(scratch: &Path) {
    // A bucket that keeps current values: the fold folds k1..k5, stops; while it is down every
    // key is overwritten (its cursor falls out of the log), k1 is deleted and the marker purged.
    let sim = SimBucket::new();
    for i in 1..=5 {
        sim.put_now(&format!("k{i}"), "v1");
    }
    let dir = tempfile::tempdir().expect("tempdir");
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
        repairing(&sim, None, scratch),
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
}

/// The second half: a bucket that evicts current values, restored from a peer's artifact.
async fn restored_where_the_listing_is_not(scratch: &Path) {
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
    let artifacts = tempfile::tempdir().expect("tempdir");
    peer_artifact_at_6(artifacts.path());
    sim.put_now("k5", "v1"); // 7
    sim.evict_through(6);
    let status = Arc::new(FoldStatus::default());
    let f = fold_alone(
        &sim,
        store.clone(),
        &mut apply,
        repairing(&sim, Some(artifacts.path()), scratch),
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

/// A peer's fold of k1@1, k2@4 and k4@6 exported as the artifact `peer-6` under `artifacts`.
fn peer_artifact_at_6(artifacts: &Path) {
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
    foldhost_artifact::artifact::export_store(
        &peer,
        foldhost_core::storedir::Backend::AppendLog,
        &[],
        &artifacts.join("peer-6"),
        Some(WatchScope::All.to_string()),
        &mut |_, _| {},
    )
    .expect("the peer's artifact");
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
        Err(AppliedError::Repair(crate::repair::RepairError::Refused(why))) => {
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
