//! Export rounds (docs/design.md, "Transport and export rounds"): every `--export-every`, a node
//! tries to win the export lease; the winner exports its fold live (between batches — the fold
//! pauses only for the copy), uploads the artifact, moves the pointer, completes the lease with the
//! cursor, prunes old payloads, and removes its local copy on every path, success or failure. A
//! node that loses the lease, or whose artifact is superseded, does nothing more that round.
//!
//! Nothing here is fatal to the node: the lease's bucket is opened by the first round that needs
//! it (a cluster still electing its leader when the node starts fails that round, not the node),
//! and every failure is the round's outcome, retried by the next round.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use foldhost_artifact::transport::{ArtifactTransport, TransportError, clock};
use foldhost_core::status::{ExportRoundReport, now_unix_ms};
use foldhost_core::storedir::Backend;
use foldhost_fold::applied::Control;
use foldhost_nats::lease::Lease;

/// What one round did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RoundOutcome {
    /// This node exported and published an artifact at `cursor`.
    Published {
        /// The artifact's cursor.
        cursor: u64,
    },
    /// Another node holds the lease this round.
    NotOurs,
    /// The published artifact already holds everything this node has folded: nothing to export
    /// (no lease taken, nothing uploaded).
    UpToDate {
        /// The published cursor.
        published: u64,
    },
    /// A newer artifact was already published; the lease was abandoned.
    Superseded {
        /// The published cursor.
        current: u64,
    },
    /// The round failed; the lease was abandoned (or runs out by itself).
    Failed(String),
}

/// The export rounds of one node.
pub struct ExportRounds {
    /// Where artifacts are published.
    pub transport: Arc<ArtifactTransport>,
    /// The artifact key.
    pub key: String,
    /// The lease of the key, opened by the first round that needs it.
    pub lease: LeaseSlot,
    /// The lease's time to live (also the prune grace's unit: payloads younger than 4× stay).
    pub lease_ttl: Duration,
    /// A scratch directory beside the store (same file system) for the round's artifact.
    pub scratch: PathBuf,
    /// The store's backend.
    pub backend: Backend,
    /// The fold's scope (recorded in the artifact).
    pub scope: String,
    /// The fold's control channel.
    pub control: mpsc::Sender<Control>,
    /// The last round's report, shown by `/status`.
    pub last: Arc<std::sync::Mutex<Option<ExportRoundReport>>>,
    /// The fold's live figures (its committed cursor decides whether a round has anything new).
    pub fold: Arc<foldhost_core::status::FoldStatus>,
    /// The stream the fold records now (read before and after each export: the artifact records
    /// it, and a pointer to another stream is never "up to date").
    pub stream: StreamSource,
    /// The guest's state buckets' folds, carried in each artifact at their own cursors (the
    /// pointer orders artifacts by the main fold's cursor: a round publishes when the main fold
    /// moved on, docs/state.md).
    pub state: Vec<foldhost_artifact::artifact::StateFoldSource>,
}

/// Reads the stream the fold records (its reserved identity key), if any.
pub(crate) type StreamSource =
    Arc<dyn Fn() -> Option<foldhost_artifact::artifact::ManifestStream> + Send + Sync>;

/// Opens a lease (its bucket) when first asked.
pub(crate) type LeaseOpener =
    Box<dyn Fn() -> futures::future::BoxFuture<'static, Result<Lease, String>> + Send + Sync>;

/// The export lease of a node's rounds: opened once, by the first round that needs it; a failed
/// open fails only that round.
pub struct LeaseSlot {
    lease: tokio::sync::OnceCell<Lease>,
    open: LeaseOpener,
}

impl LeaseSlot {
    /// A lease opened by `open` when a round first needs it.
    pub(crate) fn opening(open: LeaseOpener) -> Self {
        LeaseSlot {
            lease: tokio::sync::OnceCell::new(),
            open,
        }
    }

    async fn get(&self) -> Result<&Lease, String> {
        self.lease.get_or_try_init(|| (self.open)()).await
    }
}

impl ExportRounds {
    /// Runs a round every `every` until the fold stops taking controls.
    pub async fn run(self, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await; // the first round one period after start
        let mut last_published = None;
        loop {
            tick.tick().await;
            if self.control.is_closed() {
                return;
            }
            let started = std::time::Instant::now();
            let outcome = self.round().await;
            let (duration_ms, unix_ms) = (started.elapsed().as_millis() as u64, now_unix_ms());
            self.fold.count_export_round(match &outcome {
                RoundOutcome::Published { .. } => "published",
                RoundOutcome::NotOurs => "not-ours",
                RoundOutcome::UpToDate { .. } => "up-to-date",
                RoundOutcome::Superseded { .. } => "superseded",
                RoundOutcome::Failed(_) => "failed",
            });
            if let RoundOutcome::Published { cursor } = &outcome {
                self.fold
                    .last_published_unix_ms
                    .store(unix_ms, std::sync::atomic::Ordering::Relaxed);
                last_published = Some(foldhost_core::status::PublishedRound {
                    unix_ms,
                    cursor: *cursor,
                    duration_ms,
                });
            }
            let report = ExportRoundReport {
                duration_ms,
                unix_ms,
                last_published: last_published.clone(),
                cursor: match &outcome {
                    RoundOutcome::Published { cursor } => Some(*cursor),
                    RoundOutcome::UpToDate { published } => Some(*published),
                    _ => None,
                },
                outcome: match &outcome {
                    RoundOutcome::Published { .. } => "published".into(),
                    RoundOutcome::NotOurs => "not-ours".into(),
                    RoundOutcome::UpToDate { .. } => "up-to-date".into(),
                    RoundOutcome::Superseded { current } => format!("superseded by {current}"),
                    RoundOutcome::Failed(e) => format!("failed: {e}"),
                },
            };
            if let Ok(mut l) = self.last.lock() {
                *l = Some(report);
            }
        }
    }

    /// One round: lease → live export → upload → pointer → complete → prune; the local artifact
    /// removed on every path.
    pub(crate) async fn round(&self) -> RoundOutcome {
        // A quiet fold exports nothing: when the pointer already holds this node's committed
        // cursor, the round ends before the lease (an absent or corrupt pointer is exported over).
        let at = self.fold.cursor.load(std::sync::atomic::Ordering::Acquire);
        let stream = (self.stream)();
        if let Some(published) = self.published_up_to_date(at, &stream).await {
            return RoundOutcome::UpToDate { published };
        }
        let lease = match self.lease.get().await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(event = "export_lease_unavailable", error = %e, "export round: the lease bucket could not be opened");
                return RoundOutcome::Failed(e);
            }
        };
        let held = match lease.acquire(now_unix_ms()).await {
            Ok(Some(h)) => h,
            Ok(None) => return RoundOutcome::NotOurs,
            Err(e) => return RoundOutcome::Failed(e.to_string()),
        };
        let lease_revision = held.revision();
        tracing::info!(
            event = "export_lease_won",
            lease_revision,
            "export round: lease won"
        );
        let dir = self.scratch.join(format!("round-{}", now_unix_ms()));
        let published = self.export_and_upload(&dir, &stream).await;
        let _ = std::fs::remove_dir_all(&dir);
        match published {
            Ok(p) => {
                if let Err(e) = lease.complete(held, p.cursor, now_unix_ms()).await {
                    tracing::warn!(event = "export_lease_complete_failed", error = %e, "export round: the lease could not be completed");
                }
                self.prune().await;
                tracing::info!(event = "export_published", cursor = p.cursor, payload = %p.payload, lease_revision, "export round: artifact published");
                RoundOutcome::Published { cursor: p.cursor }
            }
            Err(e) => {
                if let Err(le) = lease.abandon(held, now_unix_ms()).await {
                    tracing::warn!(event = "export_lease_abandon_failed", error = %le, "export round: the lease could not be abandoned (it runs out by itself)");
                }
                match e {
                    Ok(current) => {
                        tracing::info!(
                            event = "export_superseded",
                            current,
                            lease_revision,
                            "export round: superseded by a newer artifact; lease abandoned"
                        );
                        RoundOutcome::Superseded { current }
                    }
                    Err(why) => {
                        tracing::warn!(event = "export_failed", error = %why, "export round failed");
                        RoundOutcome::Failed(why)
                    }
                }
            }
        }
    }

    /// The published artifact's cursor, when it already holds this node's committed cursor `at` of
    /// the same stream (or one not known): a quiet fold exports nothing. An absent or corrupt
    /// pointer is exported over.
    async fn published_up_to_date(
        &self,
        at: u64,
        stream: &Option<foldhost_artifact::artifact::ManifestStream>,
    ) -> Option<u64> {
        if at > 0
            && let Ok(Some(p)) = self.transport.pointer(&self.key).await
            && let Some(published) = p.manifest.cursor
            && published >= at
            && matches!(
                foldhost_core::protocol::stream_relation(
                    stream
                        .as_ref()
                        .map(foldhost_artifact::artifact::ManifestStream::key),
                    p.manifest
                        .stream
                        .as_ref()
                        .map(foldhost_artifact::artifact::ManifestStream::key),
                ),
                foldhost_core::protocol::StreamRelation::Same
                    | foldhost_core::protocol::StreamRelation::Unknown
            )
        {
            tracing::debug!(
                published,
                at,
                "export round: the published artifact is up to date"
            );
            return Some(published);
        }
        None
    }

    /// The fold exported live into `dir` and uploaded. `Err(Ok(current))`: superseded by the
    /// published cursor; `Err(Err(why))`: failed.
    async fn export_and_upload(
        &self,
        dir: &std::path::Path,
        stream: &Option<foldhost_artifact::artifact::ManifestStream>,
    ) -> Result<foldhost_artifact::transport::Published, Result<u64, String>> {
        std::fs::create_dir_all(&self.scratch)
            .map_err(|e| Err(format!("{}: {e}", self.scratch.display())))?;
        foldhost_fold::applied::export_live_of(
            &self.control,
            self.backend,
            dir.to_path_buf(),
            Some(self.scope.clone()),
            stream.clone(),
            self.state.clone(),
        )
        .await
        .map_err(|e| Err(e.to_string()))?;
        // The fold reset for another stream while it was copied: its artifact is not the
        // stream the manifest would name.
        if (self.stream)() != *stream {
            return Err(Err("the fold changed streams during the export".to_string()));
        }
        self.transport
            .upload(&self.key, dir, &self.scratch)
            .await
            .map_err(|e| match e {
                TransportError::SupersededByNewer { current, .. } => Ok(current),
                other => Err(other.to_string()),
            })
    }

    /// Prunes old payloads (four lease periods the horizon), saying what it did.
    async fn prune(&self) {
        match self
            .transport
            .prune(&self.key, self.lease_ttl * 4, clock::Now::system())
            .await
        {
            Ok(n) if n > 0 => {
                tracing::info!(
                    event = "export_pruned",
                    pruned = n,
                    "export round: old payloads pruned"
                )
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(event = "export_prune_failed", error = %e, "export round: prune failed")
            }
        }
    }
}
