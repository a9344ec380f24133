//! The one status model: [`StatusReport`] is what `GET /status` answers, what `status --json`
//! prints (from a running host or from a store at rest), what a host keeps in `status.json`, and
//! what the test harness reads — one type, serialised one way.
//!
//! Invariants: `lag` and the retained record's age are computed here only ([`lag`], [`age_s`],
//! [`behind_stream`]); `applied_through` is the fold's
//! ([`crate::retained::RetainedIndex::applied_through`], published by the fold with every commit),
//! never recomputed from other fields. What the status keeps of the past is bounded: at most
//! [`LAG_HISTORY_LEN`] lag samples, oldest first, and the last [`MAX_LAST_SWAPS`] swaps, oldest
//! first; a push past the bound drops the oldest.

use std::sync::atomic::Ordering;

mod channel;
mod freshness;
pub use channel::GuestChannelReport;
pub use freshness::ArtifactFreshnessReport;

use serde::{Deserialize, Serialize};

pub use crate::histogram::{HISTOGRAM_BOUNDS, Histogram};

use std::sync::atomic::AtomicU64;

/// A host's status. Fields a source cannot know are `None` (or zero), never made up. Unknown
/// fields are ignored and missing ones default when read, so a `status.json` written by an older
/// version still reads.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct StatusReport {
    /// `running`, `stopped`, `failed`, or `unknown` (a store at rest with no status file).
    pub state: String,
    /// Why the fold stopped, or the last transient error while it runs.
    pub error: Option<String>,
    /// The host's process id (0: not known).
    pub pid: u32,
    /// The bucket folded.
    pub bucket: String,
    /// The watch scope.
    pub scope: String,
    /// The store directory (set by `status --store`).
    pub store: Option<String>,
    /// The store's backend (`append-log`, `fjall`, `rocksdb`).
    pub backend: String,
    /// The applier (guest name and version, or `native:count`).
    pub guest: Option<String>,
    /// Where the guest's compiled code came from at the start: `compiled` (now), `disk-cache`
    /// (the compiled-component cache), or `memory`.
    pub guest_compiled: Option<String>,
    /// How long having the guest's compiled code took at the start (compile or cache load), ms.
    pub guest_compile_ms: Option<u64>,
    /// The guest contract version the guest was bound to at the start (`0.1.0`, `0.2.0`).
    pub guest_contract: Option<String>,
    /// The store's cursor: everything through it is applied or retained, and committed.
    pub cursor: Option<u64>,
    /// Highest revision delivered.
    pub seq: u64,
    /// Highest revision every update at or below which is applied and committed.
    pub applied_through: u64,
    /// `seq - applied_through` ([`lag`]).
    pub lag: u64,
    /// Whether the fold has been level with its stream (as of its watch's start) since the host
    /// started: a start folding a backlog is not.
    pub caught_up: bool,
    /// Updates delivered since the host started.
    pub delivered: u64,
    /// Batches committed since the host started.
    pub batches: u64,
    /// Last apply time, microseconds.
    pub last_apply_us: u64,
    /// Last store commit time, microseconds.
    pub last_commit_us: u64,
    /// Records retained (deferred by a guest) in the fold.
    pub retained: u64,
    /// Position of the oldest retained record.
    pub oldest_retained_revision: Option<u64>,
    /// When the oldest retained record was retained (Unix milliseconds).
    pub oldest_retained_unix_ms: Option<u64>,
    /// How long ago the oldest retained record was retained, seconds ([`age_s`]).
    pub oldest_retained_age_s: Option<u64>,
    /// Records retained longer than the grace, in words.
    pub warnings: Vec<String>,
    /// The fold has seen retention evict current values (its cursor carries the eviction memo).
    pub eviction_seen: bool,
    /// Cursor-expiry repairs (and recreated-bucket resets) run since the host started.
    pub repairs: u64,
    /// Stored messages skipped as undecodable since the host started: never folded, their
    /// revisions passed by the cursor (docs/design.md, "What a stored message means").
    pub skipped_messages: u64,
    /// The last message skipped as undecodable.
    pub last_skipped: Option<SkippedMessage>,
    /// The operation ledger's watermark (Unix milliseconds; 0: it never lost a row): an
    /// operation minted at or before it with no row is answered `unknown` (docs/writes.md).
    pub ledger_watermark_unix_ms: u64,
    /// Ledger sweeps completed since the host started.
    pub ledger_sweeps: u64,
    /// The operation ledger's horizon (Unix milliseconds; 0: its rows are complete back to the
    /// stream's start): records stored before it may have been passed without rows
    /// (docs/writes.md, "When a node cannot vouch for an id").
    #[serde(default)]
    pub ledger_horizon_unix_ms: u64,
    /// Requests on `--query-subject` this node answered since it started (a batch of lookups is
    /// one): nodes sharing the subject in a queue group split them.
    pub nats_queries_served: u64,
    /// The committed revision the query instance answers from (docs/design.md, "Queries off the
    /// fold's path"); `None` while none is level and the fold loop answers queries.
    pub query_instance_revision: Option<u64>,
    /// Lookups the query instance answered since the host started.
    pub queries_by_instance: u64,
    /// Lookups the fold loop answered (between batches) since the host started.
    pub queries_by_fold: u64,
    /// Asks that waited for the query instance to reach the fold's `applied_through` (an answer
    /// comes from a state at or past every write this node answered applied before it was asked).
    #[serde(default)]
    pub queries_waited_for_level: u64,
    /// When the server created the stream the fold folds (RFC 3339).
    pub stream_created_at: Option<String>,
    /// The revision of the fold's checkpoint (the newest its cursor covers whose stored time it
    /// recorded); checked against the log at every start.
    pub checkpoint_revision: Option<u64>,
    /// When the server stored the record at `checkpoint_revision` (RFC 3339).
    pub checkpoint_stored_at: Option<String>,
    /// The stream's first sequence, as last read (every 5 s).
    pub stream_first_sequence: Option<u64>,
    /// The stream's last sequence, as last read (every 5 s).
    pub stream_last_sequence: Option<u64>,
    /// The most updates one committed batch held since the host started.
    pub longest_batch: u64,
    /// The longest one `apply` took since the host started, microseconds.
    pub longest_apply_us: u64,
    /// Bucket keys in the fold (set by `status --store`).
    pub keys: Option<u64>,
    /// The address the host's `--listen` endpoint is bound to: with `--listen HOST:0`, the port
    /// the system chose is read here (or in `status.json`, written as soon as it is bound).
    pub listen: Option<String>,
    /// The file holding the admin token of the host's `--listen` endpoint (mode 0600), when the
    /// host generated it or was given it as a file.
    pub admin_token_file: Option<String>,
    /// The file holding the write token of the host's `--listen` endpoint (mode 0600), when the
    /// host generated it or was given it as a file.
    pub write_token_file: Option<String>,
    /// When this was taken (Unix milliseconds).
    pub updated_unix_ms: u64,
    /// The last export round of this host (`--export-every`), if any ran.
    pub last_export: Option<ExportRoundReport>,
    /// The guest's state buckets (docs/state.md): each declared bucket's fold, and every bucket
    /// folded here before whose declaration is gone (kept, never removed).
    pub state_buckets: Vec<StateBucketReport>,
    /// Records behind the stream ([`behind_stream`]), one sample every `lag_history_period_s`,
    /// oldest first: at most [`LAG_HISTORY_LEN`] (the last ten minutes). Empty until the status
    /// reporter's first sample; a store at rest shows its last run's, from `status.json`.
    pub lag_history: Vec<u64>,
    /// Seconds between two `lag_history` samples (0: no samples).
    pub lag_history_period_s: u64,
    /// The last guest swaps since the host started (a promoted shadow included), oldest first: at
    /// most [`MAX_LAST_SWAPS`].
    pub last_swaps: Vec<SwapRecord>,
    /// The guest channel this node follows (`run --guest-channel`; docs/channels.md), if any.
    pub guest_channel: Option<GuestChannelReport>,
    /// The newest published artifact's freshness, on a node with `--artifacts` whose bucket
    /// evicts current values (docs/operations.md, "Artifact freshness").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<ArtifactFreshnessReport>,
}

/// A completed swap of the running guest, as status reports it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct SwapRecord {
    /// The guest replaced (its name and version).
    pub from: String,
    /// The guest now running.
    pub to: String,
    /// When the swap completed (Unix milliseconds).
    pub unix_ms: u64,
    /// How long the fold paused for the cut-over, ms (the `guest_swapped` event's `paused_ms`).
    pub paused_ms: u64,
    /// `swap` (`POST /swap`, `--watch-guest`) or `shadow` (a shadow promoted).
    pub kind: String,
}

/// Most lag samples kept ([`StatusReport::lag_history`]): ten minutes at one every
/// [`LAG_SAMPLE_PERIOD`].
pub const LAG_HISTORY_LEN: usize = 120;

/// How often the status reporter samples the lag into [`FoldStatus::lag_history`].
pub const LAG_SAMPLE_PERIOD: std::time::Duration = std::time::Duration::from_secs(5);

/// Most swaps kept ([`StatusReport::last_swaps`]).
pub const MAX_LAST_SWAPS: usize = 5;

/// Pushes `item` at the back of `ring`, dropping from the front what passes `cap`.
fn push_bounded<T>(ring: &mut std::collections::VecDeque<T>, cap: usize, item: T) {
    ring.push_back(item);
    while ring.len() > cap {
        ring.pop_front();
    }
}

/// One state bucket's fold, as status reports it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct StateBucketReport {
    /// The name the guest uses (`notes`, `<module>.<name>`).
    pub local: String,
    /// The server bucket.
    pub bucket: String,
    /// `own` or `read`; empty for a bucket no longer declared.
    pub access: String,
    /// Whether the running guest declares it.
    pub declared: bool,
    /// The fold's cursor.
    pub cursor: Option<u64>,
    /// Highest revision delivered.
    pub seq: u64,
    /// Highest revision every update at or below which is applied and committed.
    pub applied_through: u64,
    /// `seq - applied_through`.
    pub lag: u64,
    /// Batches committed since the host started.
    pub batches: u64,
}

impl StateBucketReport {
    /// `self` (the bucket's fixed facts) with its fold's live figures from `s`.
    pub fn with_live(&self, s: &FoldStatus) -> StateBucketReport {
        let cursor = s.cursor.load(Ordering::Relaxed);
        let applied_through = s.applied_through.load(Ordering::Relaxed);
        let seq = s.seq.load(Ordering::Relaxed).max(cursor);
        StateBucketReport {
            cursor: (cursor > 0).then_some(cursor),
            seq,
            applied_through,
            lag: lag(seq, applied_through),
            batches: s.batches.load(Ordering::Relaxed),
            ..self.clone()
        }
    }
}

/// A stored message skipped as undecodable.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct SkippedMessage {
    /// Its revision (stream sequence).
    pub revision: u64,
    /// Its subject.
    pub subject: String,
    /// Why it is undecodable (`protocol::Undecodable`'s name).
    pub reason: String,
}

/// What a host's last export round did.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct ExportRoundReport {
    /// When it ended (Unix milliseconds).
    pub unix_ms: u64,
    /// The published artifact's cursor, when this node published one.
    pub cursor: Option<u64>,
    /// `published`, `not-ours`, `superseded by N`, or `failed: why`.
    pub outcome: String,
    /// How long the round took, lease to prune (milliseconds).
    pub duration_ms: u64,
    /// This node's last round that published, kept while later rounds find nothing newer (so an
    /// operator, or a benchmark, sees when the bucket's artifact was last made here).
    pub last_published: Option<PublishedRound>,
}

/// A round that published an artifact.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct PublishedRound {
    /// When it ended (Unix milliseconds).
    pub unix_ms: u64,
    /// The published artifact's cursor.
    pub cursor: u64,
    /// How long the round took, lease to prune (milliseconds).
    pub duration_ms: u64,
}

/// How far the applied fold is behind what was delivered.
pub fn lag(seq: u64, applied_through: u64) -> u64 {
    seq.saturating_sub(applied_through)
}

/// Records the fold is behind its stream: the stream's last sequence as last read (or the highest
/// revision delivered, when that is ahead or the stream was not read yet) minus `applied_through`
/// — what `/readyz` and `foldhost_lag_records` measure, and what [`StatusReport::lag_history`]
/// samples.
pub fn behind_stream(stream_last: u64, seq: u64, applied_through: u64) -> u64 {
    stream_last.max(seq).saturating_sub(applied_through)
}

/// Seconds from `since_unix_ms` to `now_unix_ms` (`None` when `since` is unknown, 0).
pub fn age_s(since_unix_ms: u64, now_unix_ms: u64) -> Option<u64> {
    (since_unix_ms > 0).then(|| now_unix_ms.saturating_sub(since_unix_ms) / 1000)
}

/// Unix nanoseconds as RFC 3339 (`None` for 0, unknown).
pub fn rfc3339(unix_ns: u64) -> Option<String> {
    if unix_ns == 0 {
        return None;
    }
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(unix_ns))
        .ok()?
        .format(&time::format_description::well_known::Rfc3339)
        .ok()
}

/// The wall clock in Unix milliseconds (0 if the clock is before 1970).
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl StatusReport {
    /// `self` (the host's fixed facts: state, bucket, scope, backend, pid, token file) with the
    /// running fold's live figures from `s`.
    pub fn with_live(&self, s: &FoldStatus) -> StatusReport {
        let guest = s.guest();
        let cursor = s.cursor.load(Ordering::Relaxed);
        let applied_through = s.applied_through.load(Ordering::Relaxed);
        let seq = s.seq.load(Ordering::Relaxed).max(cursor);
        let oldest_ms = s.oldest_retained_unix_ms.load(Ordering::Relaxed);
        let now = now_unix_ms();
        let (guest_contract, guest) = match guest.is_empty() {
            true => (self.guest_contract.clone(), self.guest.clone()),
            false => (s.guest_contract().map(str::to_string), Some(guest)),
        };
        StatusReport {
            guest_contract,
            guest,
            error: self.error.clone().or_else(|| s.last_error()),
            cursor: (cursor > 0).then_some(cursor),
            seq,
            applied_through,
            lag: lag(seq, applied_through),
            caught_up: s.caught_up.load(Ordering::Relaxed) == 1,
            delivered: s.delivered.load(Ordering::Relaxed),
            batches: s.batches.load(Ordering::Relaxed),
            last_apply_us: s.last_apply_us.load(Ordering::Relaxed),
            last_commit_us: s.last_commit_us.load(Ordering::Relaxed),
            retained: s.retained.load(Ordering::Relaxed),
            oldest_retained_revision: (oldest_ms > 0)
                .then(|| s.oldest_retained_revision.load(Ordering::Relaxed)),
            oldest_retained_unix_ms: (oldest_ms > 0).then_some(oldest_ms),
            oldest_retained_age_s: age_s(oldest_ms, now),
            warnings: s.all_warnings(),
            eviction_seen: s.eviction_seen.load(Ordering::Relaxed) == 1,
            repairs: s.repairs.load(Ordering::Relaxed),
            skipped_messages: s.skipped_messages.load(Ordering::Relaxed),
            ledger_watermark_unix_ms: s.ledger_watermark_unix_ms.load(Ordering::Relaxed),
            ledger_sweeps: s.ledger_sweeps.load(Ordering::Relaxed),
            ledger_horizon_unix_ms: s.ledger_horizon_unix_ms.load(Ordering::Relaxed),
            nats_queries_served: s.nats_queries_served.load(Ordering::Relaxed),
            query_instance_revision: s.query_instance_revision(),
            queries_by_instance: s.queries_by_instance.load(Ordering::Relaxed),
            queries_by_fold: s.queries_by_fold.load(Ordering::Relaxed),
            queries_waited_for_level: s.queries_waited_for_level.load(Ordering::Relaxed),
            stream_created_at: rfc3339(s.stream_created_unix_ns.load(Ordering::Relaxed)),
            checkpoint_revision: Some(s.checkpoint_revision.load(Ordering::Relaxed))
                .filter(|r| *r > 0),
            checkpoint_stored_at: rfc3339(s.checkpoint_stored_unix_ns.load(Ordering::Relaxed)),
            stream_first_sequence: Some(s.stream_first_sequence.load(Ordering::Relaxed))
                .filter(|r| *r > 0),
            stream_last_sequence: Some(s.stream_last_sequence.load(Ordering::Relaxed))
                .filter(|r| *r > 0),
            longest_batch: s.longest_batch.load(Ordering::Relaxed),
            longest_apply_us: s.longest_apply_us.load(Ordering::Relaxed),
            last_skipped: s
                .last_skipped()
                .map(|(revision, subject, reason)| SkippedMessage {
                    revision,
                    subject,
                    reason: reason.to_string(),
                }),
            updated_unix_ms: now,
            lag_history: s.lag_history(),
            lag_history_period_s: LAG_SAMPLE_PERIOD.as_secs(),
            last_swaps: s.last_swaps(),
            guest_channel: s.guest_channel().or_else(|| self.guest_channel.clone()),
            artifact: s.artifact_freshness(),
            state_buckets: self
                .state_buckets
                .iter()
                .cloned()
                .chain(
                    s.lanes
                        .get()
                        .into_iter()
                        .flatten()
                        .map(|(fixed, live)| fixed.with_live(live)),
                )
                .collect(),
            ..self.clone()
        }
    }
}

/// Live figures of a running fold, shared with status, metrics and progress displays.
#[derive(Debug, Default)]
pub struct FoldStatus {
    /// The folds of the guest's state buckets beside this one, once they run (docs/state.md).
    pub lanes: std::sync::OnceLock<Vec<(StateBucketReport, std::sync::Arc<FoldStatus>)>>,
    /// Highest revision delivered by the watch (`seq`); 0 before any.
    pub seq: AtomicU64,
    /// Highest revision every update at or below which is applied and committed
    /// (`applied_through`: the cursor, held below the oldest retained record); 0 before any.
    pub applied_through: AtomicU64,
    /// The store's cursor: everything through it is applied or retained, and committed; 0 before
    /// any.
    pub cursor: AtomicU64,
    /// Updates delivered since start.
    pub delivered: AtomicU64,
    /// Updates committed since start.
    pub committed: AtomicU64,
    /// Batches committed since start.
    pub batches: AtomicU64,
    /// Updates the server still had pending at the last progress report (hydration).
    pub pending: AtomicU64,
    /// Duration of the last `apply` call, microseconds.
    pub last_apply_us: AtomicU64,
    /// Duration of the last store commit, microseconds.
    pub last_commit_us: AtomicU64,
    /// Every batch's parse and apply, microseconds (`/metrics`).
    pub apply_us: Histogram,
    /// Every batch's store commit, microseconds.
    pub commit_us: Histogram,
    /// Every batch's flush, from its parse to its commit, microseconds.
    pub batch_us: Histogram,
    /// Every committed batch's updates.
    pub batch_updates: Histogram,
    /// The guest's failed calls and rebuilds (shared with the guest's applier: `/metrics`).
    pub guest_counters: std::sync::Arc<GuestCounters>,
    /// Writes answered through this fold's write path, by outcome and refusal reason (at most
    /// [`MAX_WRITE_OUTCOME_KINDS`] kinds: both come from the host's own fixed sets).
    pub write_outcomes: std::sync::Mutex<std::collections::BTreeMap<(String, String), u64>>,
    /// Export rounds by outcome (`published`, `not-ours`, `up-to-date`, `superseded`, `failed`).
    pub export_rounds: std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>>,
    /// When this node last published an artifact, Unix milliseconds (0: never).
    pub last_published_unix_ms: AtomicU64,
    /// Repairs by kind (`relist`, `restore`, `reset`) and outcome (`done`, `refused`, `failed`).
    pub repair_outcomes:
        std::sync::Mutex<std::collections::BTreeMap<(&'static str, &'static str), u64>>,
    /// Swaps completed since the host started (a promoted shadow included).
    pub swaps: AtomicU64,
    /// When the server stored the newest record known at or below `applied_through` (Unix
    /// nanoseconds, from the watch's delivery stamps; 0: none yet): what `/metrics`' lag in
    /// seconds is measured from.
    pub applied_server_time_unix_ns: AtomicU64,
    /// Every completed swap's pause of the fold, microseconds.
    pub swap_pause_us: Histogram,
    /// Consecutive store failures right now.
    pub store_failure_streak: AtomicU64,
    /// 1 once the watch reported it is level with the stream as of its start.
    pub caught_up: AtomicU64,
    /// The last apply or store failure (cleared by the next successful commit).
    pub last_error: std::sync::Mutex<Option<String>>,
    /// The applier now running (name@version).
    pub guest: std::sync::Mutex<String>,
    /// The running applier's guest contract version (`None`: native, or not yet known).
    pub guest_contract: std::sync::Mutex<Option<&'static str>>,
    /// Records retained (deferred by a guest), waiting for a version that can decode them.
    pub retained: AtomicU64,
    /// Revision of the oldest retained record (0: none).
    pub oldest_retained_revision: AtomicU64,
    /// When the oldest retained record was retained, Unix milliseconds (0: none).
    pub oldest_retained_unix_ms: AtomicU64,
    /// Records retained longer than the grace, named (key and revision), at most
    /// [`MAX_WARNINGS`] of them.
    pub warnings: std::sync::Mutex<Vec<String>>,
    /// 1 once the fold's cursor carries the eviction memo (it has seen retention evict a current
    /// value, and never trusts the bucket's listing again).
    pub eviction_seen: AtomicU64,
    /// Cursor-expiry repairs completed since start.
    pub repairs: AtomicU64,
    /// Stored messages skipped as undecodable since start ([`crate::protocol::decode_stored`]):
    /// never folded, their revisions passed by the cursor.
    pub skipped_messages: AtomicU64,
    /// The last of them: revision, subject and reason.
    pub last_skipped: std::sync::Mutex<Option<(u64, String, &'static str)>>,
    /// The operation ledger's watermark, Unix milliseconds (0: it never lost a row).
    pub ledger_watermark_unix_ms: AtomicU64,
    /// The fold's checkpoint: a revision its cursor covers (0: none recorded) ...
    pub checkpoint_revision: AtomicU64,
    /// ... and when the server stored the record there, Unix nanoseconds.
    pub checkpoint_stored_unix_ns: AtomicU64,
    /// When the server created the stream the fold folds, Unix nanoseconds (0: not known yet).
    pub stream_created_unix_ns: AtomicU64,
    /// The stream's first and last sequence as last read (0: not read yet).
    pub stream_first_sequence: AtomicU64,
    /// See `stream_first_sequence`.
    pub stream_last_sequence: AtomicU64,
    /// The most updates one committed batch held since start.
    pub longest_batch: AtomicU64,
    /// The longest one `apply` took since start, microseconds.
    pub longest_apply_us: AtomicU64,
    /// Ledger sweeps completed since start.
    pub ledger_sweeps: AtomicU64,
    /// The operation ledger's horizon, Unix milliseconds (0: complete).
    pub ledger_horizon_unix_ms: AtomicU64,
    /// Requests on `--query-subject` answered since start (a batch of lookups is one).
    pub nats_queries_served: AtomicU64,
    /// The revision the query instance is level with, plus one (0: none is level).
    pub query_instance_level: AtomicU64,
    /// Lookups answered by the query instance since start.
    pub queries_by_instance: AtomicU64,
    /// Lookups answered by the fold loop since start.
    pub queries_by_fold: AtomicU64,
    /// Asks that waited for the query instance's level since start.
    pub queries_waited_for_level: AtomicU64,
    /// Told whenever `applied_through` or `cursor` is published: what a write or a read waiting
    /// for a revision waits on ([`FoldStatus::wait_applied`]).
    pub applied_moved: tokio::sync::Notify,
    /// How many wait on `applied_moved` now: while any does, the fold flushes a batch as soon as
    /// its deliveries are taken instead of lingering for the batch window.
    pub applied_waiters: AtomicU64,
    /// Told when a wait on `applied_moved` begins: a batch already lingering for its window is
    /// flushed at once (its deliveries may have come before the writer's acknowledgement did).
    pub waiter_arrived: tokio::sync::Notify,
    /// Records behind the stream, sampled by the status reporter ([`FoldStatus::sample_lag`]),
    /// oldest first, at most [`LAG_HISTORY_LEN`].
    pub lag_history: std::sync::Mutex<std::collections::VecDeque<u64>>,
    /// The last swaps ([`FoldStatus::note_swap`]), oldest first, at most [`MAX_LAST_SWAPS`].
    pub last_swaps: std::sync::Mutex<std::collections::VecDeque<SwapRecord>>,
    /// What the guest channel's follower shows (`run --guest-channel`), once it ran.
    pub guest_channel: std::sync::Mutex<Option<GuestChannelReport>>,
    /// The newest artifact's freshness, once checked (docs/operations.md, "Artifact freshness").
    pub artifact_freshness: std::sync::Mutex<Option<ArtifactFreshnessReport>>,
}

/// A waiter on `applied_through` for as long as it lives ([`FoldStatus::expect_applied`]).
pub struct ExpectApplied<'a>(&'a FoldStatus);

impl Drop for ExpectApplied<'_> {
    fn drop(&mut self) {
        self.0.applied_waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Most warnings kept in [`FoldStatus::warnings`].
pub const MAX_WARNINGS: usize = 16;

impl FoldStatus {
    /// The revision the query instance answers from, while one is level.
    pub fn query_instance_revision(&self) -> Option<u64> {
        self.query_instance_level
            .load(Ordering::Relaxed)
            .checked_sub(1)
    }

    /// Counts as a waiter on `applied_through` until dropped: a write holds it from before its
    /// publish, so the fold flushes its record as soon as it is delivered, beside the
    /// acknowledgement's way back to the writer, rather than lingering for the batch window.
    pub fn expect_applied(&self) -> ExpectApplied<'_> {
        self.applied_waiters.fetch_add(1, Ordering::AcqRel);
        self.waiter_arrived.notify_one();
        ExpectApplied(self)
    }

    /// Waits until `applied_through` reaches `revision`, at most until `deadline`: the
    /// `applied_through` seen last (at or past `revision` when the wait succeeded).
    pub async fn wait_applied(&self, revision: u64, deadline: tokio::time::Instant) -> u64 {
        // While anyone waits, the fold commits what it holds without lingering for more.
        self.applied_waiters.fetch_add(1, Ordering::AcqRel);
        if self.applied_through.load(Ordering::Acquire) < revision {
            self.waiter_arrived.notify_one();
        }
        let through = self.wait_applied_inner(revision, deadline).await;
        self.applied_waiters.fetch_sub(1, Ordering::AcqRel);
        through
    }

    async fn wait_applied_inner(&self, revision: u64, deadline: tokio::time::Instant) -> u64 {
        loop {
            let moved = self.applied_moved.notified();
            tokio::pin!(moved);
            // Registered before the check, so a publish in between is not missed.
            moved.as_mut().enable();
            let through = self.applied_through.load(Ordering::Acquire);
            if through >= revision {
                return through;
            }
            if tokio::time::timeout_at(deadline, moved).await.is_err() {
                return self.applied_through.load(Ordering::Acquire);
            }
        }
    }

    /// Records the applier now running.
    pub(crate) fn set_guest(&self, name: &str) {
        if let Ok(mut g) = self.guest.lock() {
            *g = name.to_string();
        }
    }

    /// Records the applier now running (its description), with the guest contract it was bound
    /// to.
    pub fn set_applier(&self, describe: &str, contract: Option<&'static str>) {
        self.set_guest(describe);
        if let Ok(mut c) = self.guest_contract.lock() {
            *c = contract;
        }
    }

    /// The running applier's guest contract version.
    pub(crate) fn guest_contract(&self) -> Option<&'static str> {
        self.guest_contract.lock().ok().and_then(|c| *c)
    }

    /// The applier now running.
    pub fn guest(&self) -> String {
        self.guest.lock().map(|g| g.clone()).unwrap_or_default()
    }

    /// Records the last failure (`None`: the fold committed since).
    pub fn set_error(&self, e: Option<String>) {
        if let Ok(mut g) = self.last_error.lock() {
            *g = e;
        }
    }

    /// The last failure, if the fold has not committed since.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().ok().and_then(|g| g.clone())
    }

    /// The current warnings.
    pub(crate) fn warnings(&self) -> Vec<String> {
        self.warnings.lock().map(|g| g.clone()).unwrap_or_default()
    }

    /// Counts an undecodable message skipped at `revision`, once: a batch flushed again (an apply
    /// retried, a watch resumed before its commit) meets the same revisions, which are not
    /// counted again. True when it was counted now.
    pub fn note_skipped(
        &self,
        revision: u64,
        subject: &str,
        reason: crate::protocol::Undecodable,
    ) -> bool {
        let Ok(mut last) = self.last_skipped.lock() else {
            return false;
        };
        if last.as_ref().is_some_and(|(r, _, _)| *r >= revision) {
            return false;
        }
        *last = Some((revision, subject.to_string(), reason.as_str()));
        self.skipped_messages
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        true
    }

    /// The last undecodable message skipped: revision, subject, reason.
    pub fn last_skipped(&self) -> Option<(u64, String, &'static str)> {
        self.last_skipped.lock().ok().and_then(|g| g.clone())
    }

    /// Takes one lag sample: the records the fold is behind its stream now ([`behind_stream`]),
    /// the oldest sample dropped past [`LAG_HISTORY_LEN`]. The status reporter calls it every
    /// [`LAG_SAMPLE_PERIOD`].
    pub fn sample_lag(&self) {
        let behind = behind_stream(
            self.stream_last_sequence.load(Ordering::Relaxed),
            self.seq.load(Ordering::Relaxed),
            self.applied_through.load(Ordering::Relaxed),
        );
        if let Ok(mut h) = self.lag_history.lock() {
            push_bounded(&mut h, LAG_HISTORY_LEN, behind);
        }
    }

    /// The lag samples, oldest first.
    pub fn lag_history(&self) -> Vec<u64> {
        self.lag_history
            .lock()
            .map(|h| h.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Counts one repair's outcome.
    pub fn count_repair(&self, kind: &'static str, outcome: &'static str) {
        if let Ok(mut m) = self.repair_outcomes.lock() {
            *m.entry((kind, outcome)).or_insert(0) += 1;
        }
    }

    /// Records a completed swap (counted, its pause observed), the oldest dropped past
    /// [`MAX_LAST_SWAPS`].
    pub fn note_swap(&self, swap: SwapRecord) {
        self.swaps.fetch_add(1, Ordering::Relaxed);
        self.swap_pause_us
            .observe(swap.paused_ms.saturating_mul(1000));
        if let Ok(mut s) = self.last_swaps.lock() {
            push_bounded(&mut s, MAX_LAST_SWAPS, swap);
        }
    }

    /// The last swaps, oldest first.
    pub fn last_swaps(&self) -> Vec<SwapRecord> {
        self.last_swaps
            .lock()
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// What the guest channel's follower shows, once it ran.
    pub fn guest_channel(&self) -> Option<GuestChannelReport> {
        self.guest_channel.lock().ok().and_then(|c| c.clone())
    }

    /// The warnings `/status` shows: the fold's, then the newest artifact's.
    fn all_warnings(&self) -> Vec<String> {
        self.warnings()
            .into_iter()
            .chain(self.artifact_freshness().and_then(|a| a.warning()))
            .collect()
    }

    /// The newest artifact's freshness, once checked.
    pub fn artifact_freshness(&self) -> Option<ArtifactFreshnessReport> {
        self.artifact_freshness.lock().ok().and_then(|c| c.clone())
    }
}

/// Most distinct `(outcome, reason)` pairs [`FoldStatus::write_outcomes`] keeps.
pub const MAX_WRITE_OUTCOME_KINDS: usize = 64;

impl FoldStatus {
    /// Counts one write's answer.
    pub fn count_write(&self, outcome: &str, reason: &str) {
        let Ok(mut m) = self.write_outcomes.lock() else {
            return;
        };
        let key = (outcome.to_string(), reason.to_string());
        if m.len() < MAX_WRITE_OUTCOME_KINDS || m.contains_key(&key) {
            *m.entry(key).or_insert(0) += 1;
        }
    }

    /// Counts one export round's outcome.
    pub fn count_export_round(&self, outcome: &'static str) {
        if let Ok(mut m) = self.export_rounds.lock() {
            *m.entry(outcome).or_insert(0) += 1;
        }
    }
}

/// A guest's failed calls by kind, and the instances rebuilt after them. The applier counts; the
/// status and `/metrics` read.
#[derive(Debug, Default)]
pub struct GuestCounters {
    /// Calls that trapped (a panic, an `unreachable`, a host refusal turned trap).
    pub traps: AtomicU64,
    /// Calls interrupted at their deadline.
    pub deadline_hits: AtomicU64,
    /// Calls stopped at a resource cap (memory, tables, instances).
    pub limit_hits: AtomicU64,
    /// Instances rebuilt from the fold after a failed call.
    pub rebuilds: AtomicU64,
    /// Failed calls (traps, deadline hits, resource caps) of the instances running the fold — the
    /// applier, its rebuilds and its query instance — and never of a trial's (a swap or shadow
    /// candidate's before it is adopted): what a channel follower judges the version it runs by.
    /// The three counters above count every instance.
    pub running_failures: AtomicU64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_file_from_an_older_version_still_reads() {
        let old = br#"{"state":"stopped","pid":7,"seq":9,"applied_through":9,"guest":null,
            "bucket":"b","scope":"all","delivered":9,"batches":1,"last_apply_us":1,
            "last_commit_us":2,"error":null,"updated_unix_ms":1}"#;
        let r: StatusReport = serde_json::from_slice(old).expect("reads");
        assert_eq!(
            (r.state.as_str(), r.seq, r.applied_through),
            ("stopped", 9, 9)
        );
        assert_eq!(r.retained, 0);
    }

    #[test]
    fn the_lag_history_keeps_the_newest_samples_in_order_and_no_more_than_its_bound() {
        let s = FoldStatus::default();
        assert!(s.lag_history().is_empty());
        let total = LAG_HISTORY_LEN as u64 + 7;
        for n in 0..total {
            // Behind the stream: its last sequence (read every 5 s) past what is applied.
            s.stream_last_sequence.store(n * 3, Ordering::Relaxed);
            s.seq.store(n, Ordering::Relaxed);
            s.applied_through.store(n, Ordering::Relaxed);
            s.sample_lag();
        }
        let h = s.lag_history();
        assert_eq!(h.len(), LAG_HISTORY_LEN, "bounded");
        let want: Vec<u64> = (total - LAG_HISTORY_LEN as u64..total)
            .map(|n| n * 2)
            .collect();
        assert_eq!(h, want, "the newest, oldest first");
        let r = StatusReport::default().with_live(&s);
        assert_eq!(r.lag_history, want);
        assert_eq!(r.lag_history_period_s, LAG_SAMPLE_PERIOD.as_secs());
        // The stream not read yet: what was delivered counts.
        let fresh = FoldStatus::default();
        fresh.seq.store(9, Ordering::Relaxed);
        fresh.applied_through.store(4, Ordering::Relaxed);
        fresh.sample_lag();
        assert_eq!(fresh.lag_history(), vec![5]);
    }

    #[test]
    fn the_last_swaps_are_kept_oldest_first_and_bounded() {
        let s = FoldStatus::default();
        for n in 0..MAX_LAST_SWAPS as u64 + 3 {
            s.note_swap(SwapRecord {
                from: format!("g@{n}"),
                to: format!("g@{}", n + 1),
                unix_ms: 1000 + n,
                paused_ms: n,
                kind: "swap".into(),
            });
        }
        let kept = StatusReport::default().with_live(&s).last_swaps;
        assert_eq!(kept.len(), MAX_LAST_SWAPS);
        let froms: Vec<&str> = kept.iter().map(|r| r.from.as_str()).collect();
        assert_eq!(froms, ["g@3", "g@4", "g@5", "g@6", "g@7"]);
    }

    #[test]
    fn a_status_without_the_history_fields_reads_them_empty() {
        let r: StatusReport =
            serde_json::from_slice(br#"{"state":"running","lag":3}"#).expect("reads");
        assert!(r.lag_history.is_empty() && r.last_swaps.is_empty());
        assert_eq!(r.lag_history_period_s, 0);
        let round: StatusReport = serde_json::from_slice(
            &serde_json::to_vec(&StatusReport {
                lag_history: vec![4, 0],
                lag_history_period_s: 5,
                last_swaps: vec![SwapRecord::default()],
                ..StatusReport::default()
            })
            .expect("writes"),
        )
        .expect("reads");
        assert_eq!((round.lag_history, round.last_swaps.len()), (vec![4, 0], 1));
    }

    #[test]
    fn lag_and_age_never_underflow() {
        assert_eq!(behind_stream(0, 9, 4), 5);
        assert_eq!(behind_stream(12, 9, 4), 8);
        assert_eq!(behind_stream(3, 2, 4), 0);
        assert_eq!(lag(5, 9), 0);
        assert_eq!(lag(9, 5), 4);
        assert_eq!(age_s(0, 10_000), None);
        assert_eq!(age_s(2_000, 10_000), Some(8));
        assert_eq!(age_s(20_000, 10_000), Some(0));
    }
}
