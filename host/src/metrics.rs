//! `GET /metrics`: the fold's figures in the Prometheus text format (OpenMetrics 1.0), encoded by
//! `prometheus-client` from the live [`FoldStatus`] at each scrape (docs/operations.md, "Metrics").
//!
//! Invariants:
//! - **Read, never kept.** A scrape reads the fold's atomics and histograms; nothing here counts
//!   on its own, so the figures are the ones `/status` shows, and a scrape never waits for the fold.
//! - **Every series names its fold** (`fold="<bucket>"`); a state bucket's series add
//!   `state_bucket="<local>"`.
//! - **Prometheus names**: units in the name (`_seconds`, `_bytes`), counters end in `_total`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

use foldhost_core::status::FoldStatus;
use foldhost_core::status::Histogram;

/// The content type of [`render`]'s text.
pub(crate) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// One fold, as the scrape reads it.
#[derive(Debug, Clone)]
pub(crate) struct FoldSource {
    /// The fold's name (its bucket).
    pub name: String,
    /// Its live figures.
    pub status: Arc<FoldStatus>,
}

#[derive(Debug)]
struct Folds(Vec<FoldSource>);

type Labels<'a> = Vec<(&'static str, &'a str)>;

/// One metric's series: a value per label set.
type Series<'a> = Vec<(Labels<'a>, Value)>;

/// A counter, a gauge or a histogram of each series (the fold's labels with its value).
enum Value {
    Counter(u64),
    Gauge(i64),
    /// `(sum, count, buckets)` in the histogram's own unit, divided by the factor on encoding.
    Histogram(u64, u64, Vec<(Option<u64>, u64)>, f64),
}

fn histogram(h: &Histogram, per_unit: f64) -> Value {
    let (sum, count, buckets) = h.snapshot();
    Value::Histogram(sum, count, buckets, per_unit)
}

/// The series of one metric: its name, help, unit and a value per label set.
fn family(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    series: &[(Labels<'_>, Value)],
) -> Result<(), std::fmt::Error> {
    let Some((_, first)) = series.first() else {
        return Ok(());
    };
    let kind = match first {
        Value::Counter(_) => MetricType::Counter,
        Value::Gauge(_) => MetricType::Gauge,
        Value::Histogram(..) => MetricType::Histogram,
    };
    let mut metric = encoder.encode_descriptor(name, help, unit.as_ref(), kind)?;
    for (labels, value) in series {
        let mut m = metric.encode_family(labels)?;
        match value {
            Value::Counter(v) => ConstCounter::new(*v).encode(m)?,
            Value::Gauge(v) => ConstGauge::new(*v).encode(m)?,
            Value::Histogram(sum, count, buckets, per_unit) => {
                let buckets: Vec<(f64, u64)> = buckets
                    .iter()
                    .map(|(upper, c)| (upper.map_or(f64::INFINITY, |u| u as f64 / per_unit), *c))
                    .collect();
                m.encode_histogram::<NoLabelSet>(*sum as f64 / per_unit, *count, &buckets, None)?;
            }
        }
    }
    Ok(())
}

fn gauge(v: u64) -> Value {
    Value::Gauge(i64::try_from(v).unwrap_or(i64::MAX))
}

/// Microseconds per second.
const US: f64 = 1e6;

/// A fold-wide metric: its name, help, unit, and how to read its value from a fold's figures.
type Metric = (
    &'static str,
    &'static str,
    Option<Unit>,
    fn(&FoldStatus) -> Value,
);

/// The batches: updates delivered and committed, and each batch's size and durations.
fn batch_metrics() -> [Metric; 7] {
    [
        (
            "foldhost_delivered_updates",
            "Updates delivered by the watch since the host started.",
            None,
            |s| Value::Counter(s.delivered.load(Ordering::Relaxed)),
        ),
        (
            "foldhost_applied_updates",
            "Updates committed to the fold since the host started.",
            None,
            |s| Value::Counter(s.committed.load(Ordering::Relaxed)),
        ),
        (
            "foldhost_batches",
            "Batches committed since the host started.",
            None,
            |s| Value::Counter(s.batches.load(Ordering::Relaxed)),
        ),
        (
            "foldhost_batch_updates",
            "Updates per committed batch.",
            None,
            |s| histogram(&s.batch_updates, 1.0),
        ),
        (
            "foldhost_apply_duration",
            "Each batch's parse and apply by the guest.",
            Some(Unit::Seconds),
            |s| histogram(&s.apply_us, US),
        ),
        (
            "foldhost_commit_duration",
            "Each batch's store commit.",
            Some(Unit::Seconds),
            |s| histogram(&s.commit_us, US),
        ),
        (
            "foldhost_batch_duration",
            "Each batch's flush, from its parse to its commit.",
            Some(Unit::Seconds),
            |s| histogram(&s.batch_us, US),
        ),
    ]
}

/// Where the fold stands on its stream: revisions, cursor, lag and whether it caught up.
fn position_metrics() -> [Metric; 7] {
    [
        ("foldhost_seq", "Highest revision delivered.", None, |s| {
            gauge(
                s.seq
                    .load(Ordering::Relaxed)
                    .max(s.cursor.load(Ordering::Relaxed)),
            )
        }),
        (
            "foldhost_applied_through",
            "Highest revision every update at or below which is applied and committed.",
            None,
            |s| gauge(s.applied_through.load(Ordering::Relaxed)),
        ),
        ("foldhost_cursor", "The store's cursor.", None, |s| {
            gauge(s.cursor.load(Ordering::Relaxed))
        }),
        (
            "foldhost_stream_last_sequence",
            "The stream's last sequence, as last read (0: not read yet).",
            None,
            |s| gauge(s.stream_last_sequence.load(Ordering::Relaxed)),
        ),
        (
            "foldhost_lag_records",
            "Records behind: the stream's last sequence (or the highest delivered) minus applied_through.",
            None,
            |s| {
                let head = s
                    .stream_last_sequence
                    .load(Ordering::Relaxed)
                    .max(s.seq.load(Ordering::Relaxed));
                gauge(head.saturating_sub(s.applied_through.load(Ordering::Relaxed)))
            },
        ),
        (
            "foldhost_lag",
            "How far behind its stream the fold is in time: since the server stored the newest record at or below applied_through (from delivery stamps, to within 0.1 s); 0 when level.",
            Some(Unit::Seconds),
            |s| {
                let head = s
                    .stream_last_sequence
                    .load(Ordering::Relaxed)
                    .max(s.seq.load(Ordering::Relaxed));
                let behind = head > s.applied_through.load(Ordering::Relaxed);
                let at = s.applied_server_time_unix_ns.load(Ordering::Relaxed) / 1_000_000;
                gauge(if behind && at > 0 {
                    foldhost_core::status::now_unix_ms().saturating_sub(at) / 1000
                } else {
                    0
                })
            },
        ),
        (
            "foldhost_caught_up",
            "1 once the fold has been level with its stream since the host started.",
            None,
            |s| gauge(s.caught_up.load(Ordering::Relaxed)),
        ),
    ]
}

/// What the fold holds back or skips: retained records and undecodable messages.
fn retention_metrics() -> [Metric; 3] {
    [
        (
            "foldhost_retained_records",
            "Records a guest deferred, retained in the fold.",
            None,
            |s| gauge(s.retained.load(Ordering::Relaxed)),
        ),
        (
            "foldhost_oldest_retained_age",
            "Age of the oldest retained record (0: none).",
            Some(Unit::Seconds),
            |s| {
                let at = s.oldest_retained_unix_ms.load(Ordering::Relaxed);
                gauge(if at == 0 {
                    0
                } else {
                    foldhost_core::status::now_unix_ms().saturating_sub(at) / 1000
                })
            },
        ),
        (
            "foldhost_skipped_messages",
            "Undecodable stored messages skipped.",
            None,
            |s| Value::Counter(s.skipped_messages.load(Ordering::Relaxed)),
        ),
    ]
}

/// Swaps, the queries this node answered, and the store's failure streak.
fn serving_metrics() -> [Metric; 7] {
    [
        (
            "foldhost_swaps",
            "Guest swaps completed (a promoted shadow included).",
            None,
            |s| Value::Counter(s.swaps.load(Ordering::Relaxed)),
        ),
        (
            "foldhost_swap_pause",
            "Each swap's pause of the fold.",
            Some(Unit::Seconds),
            |s| histogram(&s.swap_pause_us, US),
        ),
        (
            "foldhost_nats_queries_served",
            "Requests on --query-subject this node answered (a batch of lookups is one).",
            None,
            |s| Value::Counter(s.nats_queries_served.load(Ordering::Relaxed)),
        ),
        (
            "foldhost_queries_by_instance",
            "Lookups the query instance answered beside the fold.",
            None,
            |s| Value::Counter(s.queries_by_instance.load(Ordering::Relaxed)),
        ),
        (
            "foldhost_queries_by_fold",
            "Lookups the fold loop answered between batches (no query instance level).",
            None,
            |s| Value::Counter(s.queries_by_fold.load(Ordering::Relaxed)),
        ),
        (
            "foldhost_query_instance_level",
            "1 while a query instance answers queries beside the fold, 0 otherwise.",
            None,
            |s| {
                gauge(u64::from(
                    s.query_instance_level.load(Ordering::Relaxed) > 0,
                ))
            },
        ),
        (
            "foldhost_store_failure_streak",
            "Consecutive store failures now.",
            None,
            |s| gauge(s.store_failure_streak.load(Ordering::Relaxed)),
        ),
    ]
}

impl Collector for Folds {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let folds = self.series_labels();
        let metrics = batch_metrics()
            .into_iter()
            .chain(position_metrics())
            .chain(retention_metrics())
            .chain(serving_metrics());
        for (name, help, unit, pick) in metrics {
            let series: Vec<(Labels<'_>, Value)> = folds
                .iter()
                .map(|(labels, s)| (labels.clone(), pick(s)))
                .collect();
            family(&mut encoder, name, help, unit, &series)?;
        }
        self.encode_kinds(&mut encoder, &folds)?;
        self.encode_channels(&mut encoder)?;
        self.encode_artifact(&mut encoder)?;
        if let Some(rss) = resident_bytes() {
            let none: Labels<'_> = Vec::new();
            family(
                &mut encoder,
                "foldhost_process_resident_memory",
                "The process's resident set.",
                Some(Unit::Bytes),
                &[(none, gauge(rss))],
            )?;
        }
        Ok(())
    }
}

impl Folds {
    /// Every fold's main series, then each state bucket's with its extra label.
    fn series_labels(&self) -> Vec<(Labels<'_>, &FoldStatus)> {
        let mut folds: Vec<(Labels<'_>, &FoldStatus)> = Vec::new();
        for f in &self.0 {
            folds.push((vec![("fold", f.name.as_str())], &f.status));
            for (report, status) in f.status.lanes.get().into_iter().flatten() {
                folds.push((
                    vec![
                        ("fold", f.name.as_str()),
                        ("state_bucket", report.local.as_str()),
                    ],
                    status,
                ));
            }
        }
        folds
    }
}

impl Folds {
    /// The newest artifact's freshness on an evicting bucket (docs/operations.md, "Artifact
    /// freshness"): its cursor, its headroom in records and in seconds, and whether it is stale
    /// (or missing).
    fn encode_artifact(&self, encoder: &mut DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let reports: Vec<(&str, foldhost_core::status::ArtifactFreshnessReport)> = self
            .0
            .iter()
            .filter_map(|f| Some((f.name.as_str(), f.status.artifact_freshness()?)))
            .collect();
        let (mut cursor, mut records, mut seconds, mut stale) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (fold, r) in &reports {
            let labels = vec![("fold", *fold), ("key", r.key.as_str())];
            if let Some(c) = r.cursor {
                cursor.push((labels.clone(), gauge(c)));
            }
            if let Some(n) = r.headroom_records {
                records.push((labels.clone(), Value::Gauge(n)));
            }
            if let Some(n) = r.headroom_seconds {
                seconds.push((labels.clone(), Value::Gauge(n)));
            }
            let bad = matches!(r.state.as_str(), "stale" | "missing" | "unusable");
            stale.push((labels, gauge(u64::from(bad))));
        }
        family(
            encoder,
            "foldhost_artifact_cursor",
            "The newest published artifact's cursor, on an evicting bucket.",
            None,
            &cursor,
        )?;
        family(
            encoder,
            "foldhost_artifact_headroom_records",
            "Records the stream may still drop from its head before the newest artifact is stale (below 0: stale).",
            None,
            &records,
        )?;
        family(
            encoder,
            "foldhost_artifact_headroom",
            "How long until the record after the newest artifact's cursor ages out (below 0: stale).",
            Some(Unit::Seconds),
            &seconds,
        )?;
        family(
            encoder,
            "foldhost_artifact_stale",
            "1 while the newest artifact is stale, unusable here, or none is published on an evicting bucket: an expired cursor has nothing to restore from.",
            None,
            &stale,
        )
    }

    /// A followed guest channel's series (docs/channels.md): its release, whether it is halted,
    /// and one info series naming the running and desired digests, the rollout's state and this
    /// node's judgement.
    fn encode_channels(&self, encoder: &mut DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let channels: Vec<(&str, foldhost_core::status::GuestChannelReport)> = self
            .0
            .iter()
            .filter_map(|f| Some((f.name.as_str(), f.status.guest_channel()?)))
            .collect();
        let (mut info, mut release, mut halted) = (Vec::new(), Vec::new(), Vec::new());
        for (fold, c) in &channels {
            let base = vec![("fold", *fold), ("channel", c.channel.as_str())];
            let mut labels = base.clone();
            labels.extend([
                ("node", c.node.as_str()),
                ("running", c.running_digest.as_deref().unwrap_or("")),
                ("desired", c.desired_digest.as_deref().unwrap_or("")),
                ("state", c.state.as_str()),
                ("judgement", c.judgement.as_str()),
            ]);
            info.push((labels, gauge(1)));
            release.push((base.clone(), gauge(c.release)));
            halted.push((base, gauge(u64::from(c.state == "halted"))));
        }
        family(
            encoder,
            "foldhost_guest_channel_info",
            "The followed guest channel: running and desired digests, rollout state, this node's judgement (always 1).",
            None,
            &info,
        )?;
        family(
            encoder,
            "foldhost_guest_channel_release",
            "The followed guest channel's current release.",
            None,
            &release,
        )?;
        family(
            encoder,
            "foldhost_guest_channel_halted",
            "1 while the followed guest channel's release is halted.",
            None,
            &halted,
        )
    }

    /// The series with a label of their own beside the fold's: failed guest calls by kind, write
    /// outcomes, export rounds by outcome.
    fn encode_kinds(
        &self,
        encoder: &mut DescriptorEncoder<'_>,
        folds: &[(Labels<'_>, &FoldStatus)],
    ) -> Result<(), std::fmt::Error> {
        self.encode_guest_calls(encoder)?;
        encode_writes(encoder, folds)?;
        let (rounds, published) = self.export_series();
        let repairs = repair_series(folds);
        family(
            encoder,
            "foldhost_repairs",
            "Repairs by kind (a key-listing re-list, an artifact restore, a reset of the fold) and outcome.",
            None,
            &repairs,
        )?;
        family(
            encoder,
            "foldhost_export_rounds",
            "Export rounds run by this node, by outcome.",
            None,
            &rounds,
        )?;
        family(
            encoder,
            "foldhost_export_last_published_age",
            "Time since this node last published an artifact.",
            Some(Unit::Seconds),
            &published,
        )
    }

    /// Failed guest calls by kind, and rebuilds after them.
    fn encode_guest_calls(
        &self,
        encoder: &mut DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        // Guest calls: the main fold's only (the state buckets' batches go to the same guest).
        let mut calls = Vec::new();
        let mut rebuilds = Vec::new();
        for f in &self.0 {
            let g = &f.status.guest_counters;
            for (kind, n) in [
                ("trap", &g.traps),
                ("deadline", &g.deadline_hits),
                ("limit", &g.limit_hits),
            ] {
                calls.push((
                    vec![("fold", f.name.as_str()), ("kind", kind)],
                    Value::Counter(n.load(Ordering::Relaxed)),
                ));
            }
            rebuilds.push((
                vec![("fold", f.name.as_str())],
                Value::Counter(g.rebuilds.load(Ordering::Relaxed)),
            ));
        }
        family(
            encoder,
            "foldhost_guest_failed_calls",
            "Guest calls that failed, by kind: a trap, the call's deadline, a resource cap.",
            None,
            &calls,
        )?;
        family(
            encoder,
            "foldhost_guest_rebuilds",
            "Guest instances rebuilt from the fold after a failed call.",
            None,
            &rebuilds,
        )
    }

    /// Export rounds by outcome, and the age of this node's last published artifact.
    fn export_series(&self) -> (Series<'_>, Series<'_>) {
        let mut rounds = Vec::new();
        let mut published = Vec::new();
        for f in &self.0 {
            let counts = f
                .status
                .export_rounds
                .lock()
                .map(|m| m.clone())
                .unwrap_or_default();
            for outcome in [
                "published",
                "not-ours",
                "up-to-date",
                "superseded",
                "failed",
            ] {
                rounds.push((
                    vec![("fold", f.name.as_str()), ("outcome", outcome)],
                    Value::Counter(counts.get(outcome).copied().unwrap_or(0)),
                ));
            }
            let at = f.status.last_published_unix_ms.load(Ordering::Relaxed);
            if at > 0 {
                published.push((
                    vec![("fold", f.name.as_str())],
                    gauge(foldhost_core::status::now_unix_ms().saturating_sub(at) / 1000),
                ));
            }
        }
        (rounds, published)
    }
}

/// Write outcomes: every fold's write path, a state bucket's included.
fn encode_writes(
    encoder: &mut DescriptorEncoder<'_>,
    folds: &[(Labels<'_>, &FoldStatus)],
) -> Result<(), std::fmt::Error> {
    let writes: Vec<(Vec<(String, String)>, u64)> = folds
        .iter()
        .flat_map(|(labels, s)| {
            let base: Vec<(String, String)> = labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let counts = s
                .write_outcomes
                .lock()
                .map(|m| m.clone())
                .unwrap_or_default();
            counts.into_iter().map(move |((outcome, reason), n)| {
                let mut l = base.clone();
                l.push(("outcome".into(), outcome));
                l.push(("reason".into(), reason));
                (l, n)
            })
        })
        .collect();
    let writes: Vec<(Labels<'_>, Value)> = writes
        .iter()
        .map(|(l, n)| {
            (
                l.iter().map(|(k, v)| (label_key(k), v.as_str())).collect(),
                Value::Counter(*n),
            )
        })
        .collect();
    family(
        encoder,
        "foldhost_write_outcomes",
        "Writes answered through the host, by outcome (and a refusal's reason).",
        None,
        &writes,
    )
}

/// Repairs by kind and outcome, for every fold and state bucket.
fn repair_series<'a>(folds: &[(Labels<'a>, &FoldStatus)]) -> Series<'a> {
    let mut repairs = Vec::new();
    for (labels, s) in folds {
        let counts = s
            .repair_outcomes
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default();
        for kind in ["relist", "restore", "reset"] {
            for outcome in ["done", "refused", "failed"] {
                let mut l = labels.clone();
                l.extend([("kind", kind), ("outcome", outcome)]);
                let n = counts.get(&(kind, outcome)).copied().unwrap_or(0);
                repairs.push((l, Value::Counter(n)));
            }
        }
    }
    repairs
}

/// The label names [`encode_writes`] builds (static, as the encoder takes them).
fn label_key(k: &str) -> &'static str {
    match k {
        "fold" => "fold",
        "state_bucket" => "state_bucket",
        "outcome" => "outcome",
        _ => "reason",
    }
}

/// The process's resident set size, from `/proc/self/statm` (Linux), in bytes.
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// The scrape's text for `folds`.
pub(crate) fn render(folds: &[FoldSource]) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Folds(folds.to_vec())));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scrape_names_every_series_by_fold_with_units_and_totals_in_the_names() {
        let status = Arc::new(FoldStatus::default());
        status.delivered.store(7, Ordering::Relaxed);
        status.applied_through.store(5, Ordering::Relaxed);
        status.apply_us.observe(1_500);
        status.apply_us.observe(40);
        status
            .guest_counters
            .deadline_hits
            .fetch_add(2, Ordering::Relaxed);
        status.count_write("refused", "conflict");
        status.count_write("applied", "");
        status.count_export_round("up-to-date");
        status.count_repair("restore", "refused");
        let text = render(&[FoldSource {
            name: "routes".into(),
            status,
        }])
        .expect("render");
        for line in [
            "foldhost_delivered_updates_total{fold=\"routes\"} 7",
            "foldhost_applied_through{fold=\"routes\"} 5",
            "foldhost_apply_duration_seconds_count{fold=\"routes\"} 2",
            "foldhost_apply_duration_seconds_bucket{le=\"0.0025\",fold=\"routes\"} 2",
            "foldhost_apply_duration_seconds_bucket{le=\"0.001\",fold=\"routes\"} 1",
            "# TYPE foldhost_apply_duration_seconds histogram",
            "foldhost_guest_failed_calls_total{fold=\"routes\",kind=\"deadline\"} 2",
            "foldhost_guest_failed_calls_total{fold=\"routes\",kind=\"trap\"} 0",
            "foldhost_write_outcomes_total{fold=\"routes\",outcome=\"refused\",reason=\"conflict\"} 1",
            "foldhost_write_outcomes_total{fold=\"routes\",outcome=\"applied\",reason=\"\"} 1",
            "foldhost_export_rounds_total{fold=\"routes\",outcome=\"up-to-date\"} 1",
            "foldhost_repairs_total{fold=\"routes\",kind=\"restore\",outcome=\"refused\"} 1",
            "foldhost_swaps_total{fold=\"routes\"} 0",
            "foldhost_nats_queries_served_total{fold=\"routes\"} 0",
            "foldhost_queries_by_instance_total{fold=\"routes\"} 0",
            "foldhost_query_instance_level{fold=\"routes\"} 0",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
