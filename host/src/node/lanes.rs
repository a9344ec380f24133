//! The state buckets of a guest (docs/state.md): asserted on the server, folded each into a store
//! of its own under `STORE/state/<name>/`, caught up before the guest hydrates, then folded live
//! beside the main bucket, every batch handed to the guest in the main fold loop
//! ([`foldhost_fold::applied::LaneApply`]).
//!
//! Invariants:
//! - **A bucket is asserted, never changed or deleted**: an owned bucket is created when absent
//!   and refused at start when the server holds it with other limits; a read bucket must exist.
//! - **The guest hydrates from level folds**: every lane is folded to the stream's last sequence
//!   (as of its start) with a passive applier before the guest's first instance is hydrated, so a
//!   first start hands the guest every current value — never a deletion — and a restart resumes
//!   each lane from its own cursor.
//! - **A lane whose declaration is gone is reported, never removed**: its directory stays, listed in
//!   status (`declared: false`) and by `foldhost state list`.
//! - **Lanes stop before the main fold**: the main loop serves their last batches, then stops.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use foldhost_core::bucket::BucketConfig;
use foldhost_core::kv::WatchScope;
use foldhost_core::protocol::{self, Access, StateBucket};
use foldhost_core::status::FoldStatus;
use foldhost_core::status::StateBucketReport;
use foldhost_core::storedir::AnyStore;
use foldhost_core::view::SharedStore;
use foldhost_fold::applied::{
    AppliedError, Control, CountingApply, LaneApply, LaneLink, WatchOptions, watch_applied,
};
use foldhost_guest::guest::GuestManifest;
use foldhost_guest::guest::state::{
    StateAccess, StateLane, StateWriteRequest, StateWriter, WriteFuture, WriteRefused, Written,
    WrittenOutcome,
};
use foldhost_nats::{NatsConnection, NatsKv};

use super::{NodeConfig, NodeError, signalled};

use foldhost_core::storedir::STATE_DIR;

/// One declared bucket, opened: its server handle, its fold's store and live figures.
pub(crate) struct Lane {
    pub decl: StateBucket,
    pub kv: Arc<NatsKv>,
    pub store: SharedStore<AnyStore>,
    pub status: Arc<FoldStatus>,
}

/// The store directory of the lane the guest names `local` (`<module>.<name>` kept as is: both
/// names exclude `/`).
pub(crate) fn lane_dir(store: &Path, local: &str) -> PathBuf {
    store.join(STATE_DIR).join(local)
}

/// The guest's declarations, checked against the host's caps and the naming rule.
pub(crate) fn declarations(
    cfg: &NodeConfig,
    m: &GuestManifest,
) -> Result<Vec<StateBucket>, NodeError> {
    protocol::check_declarations(&m.name, &m.state, &m.reads, cfg.state_caps, &cfg.bucket)
        .map_err(|e| NodeError::Config(format!("guest {}@{}: {e}", m.name, m.version)))
}

/// Asserts each declared bucket on the server and opens its store.
pub(crate) async fn open(
    cfg: &NodeConfig,
    conn: &NatsConnection,
    decls: Vec<StateBucket>,
) -> Result<Vec<Lane>, NodeError> {
    let mut lanes = Vec::with_capacity(decls.len());
    for decl in decls {
        let kv = assert_bucket(conn, &decl).await?;
        let dir = lane_dir(&cfg.store, &decl.local);
        std::fs::create_dir_all(&dir)
            .map_err(|e| NodeError::Config(format!("{}: {e}", dir.display())))?;
        let (backend, sync) = (cfg.backend, cfg.sync);
        let d = dir.clone();
        let (store, _) =
            tokio::task::spawn_blocking(move || AnyStore::open_with(&d, backend, sync))
                .await
                .map_err(|e| NodeError::Task("state store open", e.to_string()))?
                .map_err(|source| NodeError::Store { path: dir, source })?;
        lanes.push(Lane {
            decl,
            kv,
            store: SharedStore::new(store),
            status: Arc::new(FoldStatus::default()),
        });
    }
    Ok(lanes)
}

/// Creates an owned bucket when absent and checks it when present; a read bucket must exist.
async fn assert_bucket(
    conn: &NatsConnection,
    decl: &StateBucket,
) -> Result<Arc<NatsKv>, NodeError> {
    let Some(o) = decl.options.as_ref().filter(|_| decl.access == Access::Own) else {
        let config = BucketConfig {
            create: false,
            ..BucketConfig::default()
        };
        let kv = conn.bucket(&decl.bucket, &config).await.map_err(|e| match e {
            foldhost_core::kv::KvError::BucketNotFound(_) => NodeError::Config(format!(
                "read bucket {:?}: server bucket {} does not exist (its owner creates it when it first starts)",
                decl.local, decl.bucket
            )),
            e => NodeError::Nats(e),
        })?;
        if protocol::evicting_state_refusal(kv.limits()) {
            return Err(NodeError::Refused(format!(
                "read bucket {:?}: server bucket {} ages its values out ({} ms): {}",
                decl.local,
                decl.bucket,
                kv.limits().max_age_ms,
                protocol::EVICTING_STATE
            )));
        }
        return Ok(kv);
    };
    let config = BucketConfig {
        max_bytes: i64::try_from(o.max_bytes).ok(),
        max_history: i64::from(o.history),
        max_age: (o.max_age_ms > 0).then(|| Duration::from_millis(o.max_age_ms)),
        create: true,
        ..BucketConfig::default()
    };
    let kv = conn.bucket(&decl.bucket, &config).await?;
    if let Some(why) = protocol::state_config_mismatch(o, kv.limits()) {
        return Err(NodeError::Refused(format!(
            "state bucket {:?}: server bucket {} exists with {why}; the host never changes or deletes a bucket (change the declaration, or the bucket by hand)",
            decl.local, decl.bucket
        )));
    }
    Ok(kv)
}

/// A lane's fold options: the whole bucket, the node's batching and repairs.
fn options(cfg: &NodeConfig, lane: &Lane, catch_up: bool) -> WatchOptions {
    WatchOptions {
        scope: WatchScope::All,
        batch: cfg.batch,
        catch_up,
        defer_grace: cfg.defer_grace,
        repair: foldhost_fold::repair::RepairConfig {
            mode: cfg.repair,
            lister: Some(lane.kv.clone() as Arc<dyn foldhost_core::kv::KvReader>),
            on_recreated: cfg.on_recreated,
            on_diverged: cfg.on_diverged,
            ..Default::default()
        },
        queries: None,
    }
}

/// Folds every lane level with its stream (as of now) with a passive applier: what the guest's
/// first instance is hydrated from.
pub(crate) async fn catch_up(cfg: &NodeConfig, lanes: &[Lane]) -> Result<(), NodeError> {
    for lane in lanes {
        watch_applied(
            lane.kv.clone(),
            lane.store.clone(),
            &mut CountingApply::default(),
            options(cfg, lane, true),
            lane.status.clone(),
            None,
            std::future::pending::<()>(),
        )
        .await
        .map_err(|e| lane_failed(&lane.decl, e))?;
    }
    Ok(())
}

fn lane_failed(decl: &StateBucket, e: AppliedError) -> NodeError {
    NodeError::State(format!(
        "state bucket {:?} ({}): {e}",
        decl.local, decl.bucket
    ))
}

/// What the guest's state verbs reach: each lane's committed fold and the host's write path.
pub(crate) fn access(cfg: &NodeConfig, lanes: &[Lane]) -> StateAccess {
    let writer = LaneWriter {
        paths: lanes
            .iter()
            .map(|l| {
                (
                    l.decl.bucket.clone(),
                    crate::write::WritePath {
                        kv: l.kv.clone(),
                        bucket: l.decl.bucket.clone(),
                        scope: WatchScope::All,
                        status: l.status.clone(),
                        ledger: super::ledger_lookup(&l.store),
                        rate: Arc::new(crate::write::ApplyRate::default()),
                    },
                )
            })
            .collect(),
    };
    StateAccess {
        lanes: lanes
            .iter()
            .map(|l| StateLane {
                decl: l.decl.clone(),
                read: Arc::new(l.store.clone()),
                holds: holds(&l.store),
            })
            .collect(),
        writer: Some(Arc::new(writer)),
        caps: cfg.state_caps,
        unchecked: cfg.state_unchecked_writes,
    }
}

/// The bytes a lane's fold holds (keys and values), kept by the lane's commits
/// ([`SharedStore::held_bytes`]): a guest write is admitted without reading the fold. A store
/// that cannot be read admits nothing (it holds, as far as the cap can tell, everything).
fn holds(store: &SharedStore<AnyStore>) -> Arc<dyn Fn() -> u64 + Send + Sync> {
    let store = store.clone();
    Arc::new(move || store.held_bytes().unwrap_or(u64::MAX))
}

/// The host's write path, one per state bucket.
struct LaneWriter {
    paths: Vec<(String, crate::write::WritePath)>,
}

impl StateWriter for LaneWriter {
    fn write<'a>(&'a self, bucket: &'a StateBucket, req: StateWriteRequest) -> WriteFuture<'a> {
        Box::pin(async move {
            let Some((_, path)) = self.paths.iter().find(|(b, _)| *b == bucket.bucket) else {
                return Err(WriteRefused {
                    reason: "undeclared".into(),
                    message: format!("no write path for bucket {:?}", bucket.local),
                });
            };
            use base64::Engine as _;
            // Minted here when the guest gave none, so a write that runs out of time still names
            // the id to retry with; an id the host derived for a first attempt is published as
            // one it minted (docs/state.md, "Writes from `on-applied`").
            let derived = req
                .op_id
                .as_deref()
                .filter(|_| req.host_minted)
                .and_then(|id| foldhost_core::protocol::OpId::parse(id).ok());
            let minted = match derived {
                Some(id) => Some(id),
                None => req.op_id.is_none().then(crate::write::mint),
            };
            let op_id = req
                .op_id
                .clone()
                .or_else(|| minted.as_ref().map(ToString::to_string))
                .unwrap_or_default();
            let given = if minted.is_some() { None } else { req.op_id };
            let request = crate::write::WriteRequest {
                key: req.key,
                op: req.value.is_none().then(|| "delete".to_string()),
                value_base64: req
                    .value
                    .map(|v| base64::engine::general_purpose::STANDARD.encode(v)),
                op_id: given,
                if_revision: req.if_revision,
                // Waits for this node's fold of the bucket only where the guest may
                // (`StateWriteRequest::wait`: from `query` on the query instance).
                wait_ms: Some(u64::try_from(req.wait.as_millis()).unwrap_or(u64::MAX)),
                ..Default::default()
            };
            let write = path.write_minted(request, minted);
            let Ok(answer) = tokio::time::timeout(req.within, write).await else {
                return Ok(Written {
                    outcome: WrittenOutcome::Unknown,
                    op_id,
                    revision: None,
                });
            };
            let outcome = match answer.outcome.as_str() {
                "applied" => WrittenOutcome::Applied,
                "pending" => WrittenOutcome::Pending,
                "unknown" => WrittenOutcome::Unknown,
                _ => {
                    return Err(WriteRefused {
                        reason: answer.reason.unwrap_or_else(|| "invalid".into()),
                        message: answer.message.unwrap_or_default(),
                    });
                }
            };
            Ok(Written {
                outcome,
                op_id: answer.op_id.unwrap_or_default(),
                revision: answer.revision,
            })
        })
    }
}

/// Each lane's fold as an export carries it beside the main fold (held weakly: an export never
/// keeps a stopped fold's store open).
pub(crate) fn export_sources(lanes: &[Lane]) -> Vec<foldhost_artifact::artifact::StateFoldSource> {
    lanes
        .iter()
        .map(|l| foldhost_artifact::artifact::StateFoldSource {
            local: l.decl.local.clone(),
            store: l.store.downgrade(),
        })
        .collect()
}

/// The lanes' status entries: each declared lane live, and every lane directory under the store
/// whose declaration is gone.
pub(crate) fn reports(
    cfg: &NodeConfig,
    lanes: &[Lane],
) -> (
    Vec<(StateBucketReport, Arc<FoldStatus>)>,
    Vec<StateBucketReport>,
) {
    let live = lanes
        .iter()
        .map(|l| {
            (
                StateBucketReport {
                    local: l.decl.local.clone(),
                    bucket: l.decl.bucket.clone(),
                    access: match l.decl.access {
                        Access::Own => "own",
                        Access::Read => "read",
                    }
                    .into(),
                    declared: true,
                    ..StateBucketReport::default()
                },
                l.status.clone(),
            )
        })
        .collect();
    let gone = undeclared(&cfg.store, lanes.iter().map(|l| l.decl.local.as_str()))
        .into_iter()
        .map(|local| StateBucketReport {
            local,
            declared: false,
            ..StateBucketReport::default()
        })
        .collect();
    (live, gone)
}

/// The lane directories under `store` not among `declared`, sorted.
pub(crate) fn undeclared<'a>(store: &Path, declared: impl Iterator<Item = &'a str>) -> Vec<String> {
    let declared: Vec<&str> = declared.collect();
    let Ok(entries) = std::fs::read_dir(store.join(STATE_DIR)) else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| !declared.contains(&n.as_str()))
        .collect();
    out.sort();
    out
}

/// The lanes folding live, each in a task of its own, every batch handed to the guest through
/// the main loop's `control` channel.
pub(crate) struct Running {
    tasks: tokio::task::JoinSet<(
        String,
        Result<foldhost_fold::applied::Finished, AppliedError>,
    )>,
    /// Each lane's ledger sweeper (aborted with the lanes).
    _sweepers: tokio::task::JoinSet<()>,
    shutdown: tokio::sync::watch::Receiver<bool>,
}

impl Running {
    /// Starts every lane live; each stops when `shutdown` turns true.
    pub(crate) fn start(
        cfg: &NodeConfig,
        lanes: Vec<Lane>,
        guest: String,
        control: &tokio::sync::mpsc::Sender<Control>,
        link: &Arc<LaneLink>,
        shutdown: &tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        let mut tasks = tokio::task::JoinSet::new();
        let mut sweepers = tokio::task::JoinSet::new();
        for lane in lanes {
            let opts = options(cfg, &lane, false);
            let mut apply = LaneApply::new(
                lane.decl.local.clone(),
                guest.clone(),
                control.clone(),
                link.clone(),
            );
            let stop = signalled(shutdown.clone());
            // Each state bucket's lines carry its name beside the fold's.
            let span = tracing::info_span!("state", bucket = %lane.decl.local);
            // A state bucket's ledger is swept as the fold's is: its own control channel takes
            // the sweep's steps between its batches.
            let (sweeps, control_rx) = tokio::sync::mpsc::channel(1);
            sweepers.spawn(tracing::Instrument::instrument(
                super::side::sweep_ledger(cfg.ledger_retention, sweeps),
                span.clone(),
            ));
            tasks.spawn(tracing::Instrument::instrument(
                async move {
                    let r = watch_applied(
                        lane.kv,
                        lane.store,
                        &mut apply,
                        opts,
                        lane.status,
                        Some(control_rx),
                        stop,
                    )
                    .await;
                    (lane.decl.local, r)
                },
                span,
            ));
        }
        Running {
            tasks,
            _sweepers: sweepers,
            shutdown: shutdown.clone(),
        }
    }

    /// Resolves when a lane fails (with why), or when every lane has stopped cleanly (`None`,
    /// only after a shutdown).
    pub(crate) async fn failed(&mut self) -> Option<String> {
        while let Some(done) = self.tasks.join_next().await {
            match done {
                // A fold ends by itself only at a shutdown; any other end leaves the guest's
                // view of the bucket behind, so the node stops.
                Ok((local, Ok(_))) if !*self.shutdown.borrow() => {
                    return Some(format!("state bucket {local:?}: its fold ended"));
                }
                Ok((_, Ok(_))) => {}
                Ok((local, Err(e))) => return Some(format!("state bucket {local:?}: {e}")),
                Err(e) => return Some(format!("a state bucket's fold task: {e}")),
            }
        }
        None
    }
}
