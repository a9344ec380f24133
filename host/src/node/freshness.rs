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
//! - Each change of state is logged once; a check that fails keeps the last report and says so
//!   once per streak.
//! - Only a bucket whose retention can evict a current value is checked: elsewhere the stream
//!   itself can rebuild any fold, and nothing is reported.

use std::sync::Arc;
use std::time::Duration;

use crate::applied::FoldStatus;
use crate::nats::NatsKv;
use crate::protocol::{self, FreshnessState};
use crate::status::{ArtifactFreshnessReport, now_unix_ms};
use crate::transport::ArtifactTransport;

/// The longest between two checks.
const MAX_PERIOD: Duration = Duration::from_secs(30);
/// The shortest between two checks.
const MIN_PERIOD: Duration = Duration::from_secs(1);

/// Checks the newest artifact under `key` against `kv`'s stream until the node stops (the task
/// is aborted): every eighth of the stream's age limit, between 1 s and 30 s.
pub(super) async fn watch(
    kv: Arc<NatsKv>,
    transport: Arc<ArtifactTransport>,
    key: String,
    status: Arc<FoldStatus>,
) {
    let mut said: Option<FreshnessState> = None;
    let mut failing = false;
    loop {
        let period = match check(&kv, &transport, &key).await {
            Ok((report, state, max_age_ms)) => {
                failing = false;
                if said != state {
                    if let Some(r) = &report {
                        say(r);
                    }
                    said = state;
                }
                if let Ok(mut slot) = status.artifact_freshness.lock() {
                    *slot = report;
                }
                Duration::from_millis(max_age_ms / 8).clamp(MIN_PERIOD, MAX_PERIOD)
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(event = "artifact_freshness_unknown", key = %key, error = %e, "the newest artifact's freshness could not be checked; tried again");
                    failing = true;
                }
                MAX_PERIOD
            }
        };
        tokio::time::sleep(period).await;
    }
}

/// One check: the report (`None` where the bucket never evicts a current value), its state, and
/// the stream's age limit.
async fn check(
    kv: &NatsKv,
    transport: &ArtifactTransport,
    key: &str,
) -> Result<(Option<ArtifactFreshnessReport>, Option<FreshnessState>, u64), String> {
    let (positions, max_age_ms, evicts) = kv
        .positions_and_retention()
        .await
        .map_err(|e| e.to_string())?;
    if !evicts {
        return Ok((None, None, max_age_ms));
    }
    let cursor = transport
        .pointer(key)
        .await
        .map_err(|e| e.to_string())?
        .and_then(|p| p.manifest.cursor);
    let next = match cursor {
        Some(c)
            if c < positions.last_sequence && c.saturating_add(1) >= positions.first_sequence =>
        {
            kv.record_time_at(c + 1)
                .await
                .map_err(|e| e.to_string())?
                .map(|ns| ns / 1_000_000)
        }
        _ => None,
    };
    let now = now_unix_ms();
    let f = protocol::artifact_freshness(cursor, positions.first_sequence, max_age_ms, next, now);
    let report = ArtifactFreshnessReport {
        state: f.state.as_str().to_string(),
        key: key.to_string(),
        cursor,
        stream_first_sequence: positions.first_sequence,
        headroom_records: f.headroom_records,
        headroom_seconds: f.headroom_seconds,
        checked_unix_ms: now,
    };
    Ok((Some(report), Some(f.state), max_age_ms))
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
        _ => {
            tracing::warn!(event = "artifact_missing", key = %key, first_sequence = first, "no artifact is published on an evicting bucket: an expired cursor on any node has nothing to restore from")
        }
    }
}
