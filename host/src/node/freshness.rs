//! Artifact freshness (docs/operations.md, "Artifact freshness"): on an evicting bucket the fold
//! is the replica of record, and once the newest published artifact's cursor falls behind the
//! stream's first sequence, the next expired cursor on any node is a stop with nothing to restore
//! from. A node with `--artifacts` checks the pointer against the stream and says how close that
//! is — in `/status` (`artifact`, a warning), `/readyz`'s answer, `/metrics` and the log — before
//! it bites.
//!
//! Invariants:
//! - The check only reads (the pointer, the stream's info, one stored record's time): it never
//!   moves the fold, the pointer or the node's readiness.
//! - Each change of state is logged once; a check that fails is said once per streak.
//! - Only a bucket whose retention can evict a current value is checked: elsewhere the stream
//!   itself can rebuild any fold, and nothing is reported.
//! - An artifact a restore here would refuse (another incarnation, a cursor past the stream, a
//!   scope not covering the node's) is `unusable`, never `fresh`; after [`FAILURES_UNKNOWN`]
//!   failed checks in a row the report says `unknown`, never the last good word.

use std::sync::Arc;
use std::time::Duration;

use foldhost_artifact::transport::ArtifactTransport;
use foldhost_core::protocol::{self, FreshnessState};
use foldhost_core::status::FoldStatus;
use foldhost_core::status::{ArtifactFreshnessReport, now_unix_ms};
use foldhost_nats::NatsKv;

/// The longest between two checks.
const MAX_PERIOD: Duration = Duration::from_secs(30);
/// The shortest between two checks (a fleet's nodes each read the pointer and the stream's info).
const MIN_PERIOD: Duration = Duration::from_secs(5);
/// Failed checks in a row after which the report says `unknown`.
const FAILURES_UNKNOWN: u32 = 3;

/// What the check needs of the node: its bucket, the store its artifacts are in, the key, the
/// stream its fold records and its scope.
pub(super) struct Checked {
    pub(super) kv: Arc<NatsKv>,
    pub(super) transport: Arc<ArtifactTransport>,
    pub(super) key: String,
    pub(super) stream: super::export::StreamSource,
    pub(super) scope: foldhost_core::kv::WatchScope,
}

/// What one check found: the report (`None` where the bucket never evicts a current value), its
/// state, and the stream's age limit in milliseconds.
type Found = (Option<ArtifactFreshnessReport>, Option<FreshnessState>, u64);

/// A period with up to a fifth more, different per node and check, so a fleet's checks spread.
fn jittered(period: Duration) -> Duration {
    let spread = (period.as_millis() as u64 / 5).max(1);
    let seed = now_unix_ms() ^ u64::from(std::process::id()).rotate_left(17);
    period + Duration::from_millis(seed % spread)
}

/// Checks the newest artifact under the key against the stream until the node stops (the task
/// is aborted): every eighth of the stream's age limit, between 5 s and 30 s, jittered.
pub(super) async fn watch(c: Checked, status: Arc<FoldStatus>) {
    let mut said: Option<FreshnessState> = None;
    let mut failures = 0u32;
    loop {
        let period = match check(&c).await {
            Ok((report, state, max_age_ms)) => {
                failures = 0;
                if said != state {
                    if let Some(r) = &report {
                        say(r);
                    }
                    said = state;
                }
                set(&status, report);
                Duration::from_millis(max_age_ms / 8).clamp(MIN_PERIOD, MAX_PERIOD)
            }
            Err(e) => {
                failures += 1;
                if failures == 1 {
                    tracing::warn!(event = "artifact_freshness_unknown", key = %c.key, error = %e, "the newest artifact's freshness could not be checked; tried again");
                }
                if failures >= FAILURES_UNKNOWN {
                    said = Some(FreshnessState::Unknown);
                    set(
                        &status,
                        Some(ArtifactFreshnessReport {
                            state: FreshnessState::Unknown.as_str().into(),
                            reason: Some(e),
                            key: c.key.clone(),
                            checked_unix_ms: now_unix_ms(),
                            ..ArtifactFreshnessReport::default()
                        }),
                    );
                }
                MAX_PERIOD
            }
        };
        tokio::time::sleep(jittered(period)).await;
    }
}

fn set(status: &FoldStatus, report: Option<ArtifactFreshnessReport>) {
    if let Ok(mut slot) = status.artifact_freshness.lock() {
        *slot = report;
    }
}

/// One check.
async fn check(c: &Checked) -> Result<Found, String> {
    let (positions, max_age_ms, evicts) =
        c.kv.positions_and_retention()
            .await
            .map_err(|e| e.to_string())?;
    if !evicts {
        return Ok((None, None, max_age_ms));
    }
    let pointer = c
        .transport
        .pointer(&c.key)
        .await
        .map_err(|e| e.to_string())?;
    let now = now_unix_ms();
    let mut report = ArtifactFreshnessReport {
        key: c.key.clone(),
        stream_first_sequence: positions.first_sequence,
        checked_unix_ms: now,
        ..ArtifactFreshnessReport::default()
    };
    if let Some(m) = pointer.as_ref().map(|p| &p.manifest) {
        report.cursor = m.cursor;
        if let Some(why) = unusable(c, m, positions.last_sequence) {
            report.state = FreshnessState::Unusable.as_str().into();
            report.reason = Some(why.into());
            return Ok((Some(report), Some(FreshnessState::Unusable), max_age_ms));
        }
    }
    let next = match report.cursor {
        Some(cur) if cur.saturating_add(1) >= positions.first_sequence => {
            record_after(&c.kv, cur, positions.last_sequence).await?
        }
        _ => None,
    };
    let f = protocol::artifact_freshness(
        report.cursor,
        positions.first_sequence,
        max_age_ms,
        next,
        now,
    );
    report.state = f.state.as_str().into();
    report.headroom_records = f.headroom_records;
    report.headroom_seconds = f.headroom_seconds;
    Ok((Some(report), Some(f.state), max_age_ms))
}

/// Why a restore on this node would refuse `m` before weighing its cursor (as the restore checks:
/// the stream's incarnation, the cursor against the stream, the scope), if it would.
fn unusable(
    c: &Checked,
    m: &foldhost_artifact::artifact::ExportManifest,
    last_sequence: u64,
) -> Option<&'static str> {
    let ours = (c.stream)();
    let relation = protocol::stream_relation(
        ours.as_ref()
            .map(foldhost_artifact::artifact::ManifestStream::key),
        m.stream
            .as_ref()
            .map(foldhost_artifact::artifact::ManifestStream::key),
    );
    let covers = m
        .scope
        .as_deref()
        .and_then(|s| foldhost_core::kv::WatchScope::parse(s).ok())
        .is_some_and(|s| {
            let theirs = s.disjoint_prefixes();
            let want = c.scope.disjoint_prefixes();
            let a: Vec<&str> = theirs.iter().map(String::as_str).collect();
            let w: Vec<&str> = want.iter().map(String::as_str).collect();
            protocol::scope_covers(&a, &w)
        });
    protocol::artifact_unusable(
        m.cursor,
        last_sequence,
        protocol::bootstrap_stream_allowed(relation),
        covers,
    )
}

/// When the stream stored the record after `cursor`, Unix milliseconds: the one at `cursor + 1`,
/// or — superseded or purged — the cursor's own (stored earlier: the estimate errs towards "at
/// risk"); `None` when neither is stored or the artifact is at the stream's head.
async fn record_after(kv: &NatsKv, cursor: u64, last: u64) -> Result<Option<u64>, String> {
    if cursor >= last {
        return Ok(None);
    }
    for seq in [cursor + 1, cursor] {
        if let Some(ns) = kv.record_time_at(seq).await.map_err(|e| e.to_string())? {
            return Ok(Some(ns / 1_000_000));
        }
    }
    Ok(None)
}

/// Logs a new state once.
fn say(r: &ArtifactFreshnessReport) {
    let (key, cursor, first) = (&r.key, r.cursor, r.stream_first_sequence);
    let (records, seconds) = (r.headroom_records, r.headroom_seconds);
    match r.state.as_str() {
        "fresh" => {
            tracing::info!(event = "artifact_fresh", key = %key, cursor, first_sequence = first, headroom_records = records, headroom_seconds = seconds, "the newest artifact can restore a node whose cursor expires")
        }
        "at_risk" => {
            tracing::warn!(event = "artifact_at_risk", key = %key, cursor, first_sequence = first, headroom_records = records, headroom_seconds = seconds, "the newest artifact is within a quarter of the stream's age of being stale: export one")
        }
        "stale" => {
            tracing::error!(event = "artifact_stale", key = %key, cursor, first_sequence = first, headroom_records = records, "the stream's first sequence passed the newest artifact's cursor: an expired cursor on any node has nothing to restore from; export one now")
        }
        "unusable" => {
            tracing::error!(event = "artifact_unusable", key = %key, cursor, reason = r.reason.as_deref().unwrap_or("?"), "a restore on this node would refuse the newest artifact: an expired cursor has nothing to restore from")
        }
        _ => {
            tracing::warn!(event = "artifact_missing", key = %key, first_sequence = first, "no artifact is published on an evicting bucket: an expired cursor on any node has nothing to restore from")
        }
    }
}
