//! The live floor guard of a watch: the state it keeps ([`FloorGuard`]) and the stream probes it
//! makes. NATS never refuses a consumer start below the stream's first sequence — it clamps
//! silently — and an ordered consumer re-created after a disconnect starts at the first retained
//! message, past whatever aged out meanwhile. The guard makes that loss visible: before anything
//! after a delivery gap, after a consumer re-creation, or after a quiet period is passed on, it
//! reads the stream and ends the watch with `CursorExpired` when retention has passed the frontier
//! on a bucket that evicts current values ([`protocol::floor_guard_trips`]), or with
//! `StreamChanged` when the stream is not the one the watch started on.
//!
//! Invariants: the frontier only grows; nothing after unexamined evidence of loss is passed on (a
//! failed probe at a gap is retried, then ends the watch — never skipped); a prefix watch's
//! frontier moves over out-of-scope messages only by the quiet watermark's three-read argument.

use std::time::{Duration, Instant};

use async_nats::jetstream::stream;

use foldhost_core::kv::{KvError, StreamIdentity};
use foldhost_core::protocol::{self, AckMeta};

use super::{
    FLOOR_NON_EVICTING_TRUST, FLOOR_PROBE_RETRIES, NatsKv, StreamPositions, backend, identity_of,
    retention_of, timed,
};

/// What the guard knows of one watch.
pub(super) struct FloorGuard {
    /// The last stream sequence the watch is known to have passed (`None`: not guarded yet — a
    /// state-sync re-list before it is level).
    frontier: Option<u64>,
    /// The stream the watch started on.
    start: StreamIdentity,
    /// The watch's subject filters (for the quiet watermark's next-by-subject reads).
    filters: Vec<String>,
    /// A prefix watch: its deliveries are sparse, so its frontier also moves by the watermark.
    prefix_scope: bool,
    /// When a stream-info answer last said retention does not evict current values.
    non_evicting_at: Option<Instant>,
    /// No delivery since the last backstop tick.
    quiet: bool,
    /// A consumer error was seen (the ordered consumer re-creates itself after one): the next
    /// delivery is checked, gap or not.
    recreated: bool,
    /// Something was delivered (a later consumer sequence 1 is a re-created consumer).
    delivered_any: bool,
}

impl FloorGuard {
    /// A guard for a watch on `start` with `filters`, guarded from `frontier` (a delta watch's
    /// cursor) or from its level (a state-sync watch).
    pub(super) fn new(
        frontier: Option<u64>,
        start: StreamIdentity,
        filters: Vec<String>,
        prefix_scope: bool,
    ) -> Self {
        FloorGuard {
            frontier,
            start,
            filters,
            prefix_scope,
            non_evicting_at: None,
            quiet: true,
            recreated: false,
            delivered_any: false,
        }
    }

    /// Guards from `sequence` when not guarded yet (the level of a state-sync watch).
    pub(super) fn guard_from(&mut self, sequence: u64) {
        if self.frontier.is_none() {
            self.frontier = Some(sequence);
        }
    }

    /// Whether the watch is guarded yet.
    pub(super) fn is_guarded(&self) -> bool {
        self.frontier.is_some()
    }

    /// Live after the level: the frontier follows every delivered sequence.
    pub(super) fn follow(&mut self, sequence: u64) {
        self.frontier = Some(self.frontier.map_or(sequence, |f| f.max(sequence)));
    }

    /// A new consumer starts after deliveries that were not its own (a direct catch-up's): its
    /// first delivery, numbered 1, is not a re-created consumer's. A gap before it is still
    /// checked by the sequence rule.
    pub(super) fn consumer_started(&mut self) {
        self.delivered_any = false;
    }

    /// A consumer error: the ordered consumer is re-creating itself.
    pub(super) fn consumer_error(&mut self) {
        self.recreated = true;
    }

    /// The backstop: no delivery for a whole period leaves no in-band evidence of an overrun (or
    /// of a recreated stream), so the stream is asked directly; a quiet, level prefix watch also
    /// tries to move its frontier by the watermark. A failed probe is logged and tried again next
    /// period (no evidence of loss waits on it).
    pub(super) async fn backstop(&mut self, kv: &NatsKv, level: bool) -> Result<(), KvError> {
        let was_quiet = std::mem::replace(&mut self.quiet, true);
        let Some(f) = self.frontier.filter(|_| was_quiet) else {
            return Ok(());
        };
        match kv
            .check_floor(f, &self.start, &mut self.non_evicting_at)
            .await
        {
            Ok(Some(p)) if self.prefix_scope && level && !self.recreated => {
                match kv
                    .quiet_watermark(&self.filters, f, p.last_sequence, &self.start)
                    .await
                {
                    Ok(Some(w)) => self.follow(w),
                    Ok(None) => {}
                    Err(e @ KvError::StreamChanged { .. }) => return Err(e),
                    Err(e) => {
                        tracing::warn!(event = "floor_probe_failed", bucket = %kv.bucket, error = %e, "floor guard: watermark probe failed; retrying next period")
                    }
                }
            }
            Ok(_) => {}
            Err(e @ (KvError::CursorExpired { .. } | KvError::StreamChanged { .. })) => {
                return Err(e);
            }
            Err(e) => {
                tracing::warn!(event = "floor_probe_failed", bucket = %kv.bucket, error = %e, "floor guard: backstop probe failed; retrying next period")
            }
        }
        Ok(())
    }

    /// A chunk of consumer errors only: the ordered consumer is re-creating itself (its stream may
    /// be gone, or another one by now). The stream is asked at once rather than at the next
    /// backstop; an unreachable stream is asked again at the next delivery or period.
    pub(super) async fn after_errors(&mut self, kv: &NatsKv) -> Result<(), KvError> {
        let Some(f) = self.frontier.filter(|_| self.recreated) else {
            return Ok(());
        };
        match kv.check_floor(f, &self.start, &mut None).await {
            Ok(_) => Ok(()),
            Err(e @ (KvError::CursorExpired { .. } | KvError::StreamChanged { .. })) => Err(e),
            Err(e) => {
                tracing::warn!(event = "floor_probe_failed", bucket = %kv.bucket, error = %e, "floor guard: probe after a consumer error failed; the next delivery is checked");
                Ok(())
            }
        }
    }

    /// In-band, before a chunk with these delivery metas is passed on: a gap after the frontier, or
    /// a delivery from a re-created consumer, is checked first, so the fold never advances past
    /// unexamined evidence of loss. One check per chunk, at its first such point: the first
    /// sequence only grows, so it covers the later ones too. A failed probe is retried (a leader
    /// change, an API hiccup) before the watch gives up, never skipped.
    pub(super) async fn before_chunk<'m>(
        &mut self,
        kv: &NatsKv,
        metas: impl Iterator<Item = &'m AckMeta>,
    ) -> Result<(), KvError> {
        self.quiet = false;
        let Some(mut f) = self.frontier else {
            self.delivered_any |= metas.count() > 0;
            return Ok(());
        };
        let mut check_after = None;
        for m in metas {
            let fresh_consumer = self.delivered_any && m.consumer_sequence == 1;
            if check_after.is_none()
                && (self.recreated || fresh_consumer || m.stream_sequence > f.saturating_add(1))
            {
                check_after = Some(f);
            }
            self.recreated = false;
            self.delivered_any = true;
            f = f.max(m.stream_sequence);
        }
        if let Some(g) = check_after {
            let mut attempt = 0u32;
            loop {
                match kv
                    .check_floor(g, &self.start, &mut self.non_evicting_at)
                    .await
                {
                    Ok(_) => break,
                    Err(e @ (KvError::CursorExpired { .. } | KvError::StreamChanged { .. })) => {
                        return Err(e);
                    }
                    Err(e) if attempt >= FLOOR_PROBE_RETRIES => return Err(e),
                    Err(e) => {
                        attempt += 1;
                        tracing::warn!(event = "floor_probe_failed", bucket = %kv.bucket, error = %e, attempt, "floor guard: probe failed; retrying");
                        tokio::time::sleep(Duration::from_millis(250u64 << attempt)).await;
                    }
                }
            }
        }
        self.frontier = Some(f);
        Ok(())
    }
}

impl NatsKv {
    /// The live floor guard's check after a delivery gap, a consumer re-creation or a quiet
    /// backstop period following `frontier`, the last stream sequence the watch passed: ends the
    /// watch with `CursorExpired` when the stream's retention evicts current values and its first
    /// retained sequence has passed `frontier + 1` ([`protocol::floor_guard_trips`]), and with
    /// `StreamChanged` when the stream is not `start` (recreated under the watch) or ends below
    /// the frontier. A non-evicting answer is trusted for [`FLOOR_NON_EVICTING_TRUST`], so a
    /// keep-values bucket under overwrites costs at most one stream info per second, not one per
    /// gapped chunk. Returns the stream's state when it read one.
    pub(super) async fn check_floor(
        &self,
        frontier: u64,
        start: &StreamIdentity,
        non_evicting_at: &mut Option<Instant>,
    ) -> Result<Option<StreamPositions>, KvError> {
        if non_evicting_at.is_some_and(|t| t.elapsed() < FLOOR_NON_EVICTING_TRUST) {
            return Ok(None);
        }
        let info = self.stream_info().await?;
        self.check_same_stream(&info, start, frontier)?;
        let r = retention_of(&info);
        let positions = StreamPositions {
            first_sequence: info.state.first_sequence,
            last_sequence: info.state.last_sequence,
            messages: info.state.messages,
        };
        if !r.evicts_current_values {
            *non_evicting_at = Some(Instant::now());
            return Ok(Some(positions));
        }
        *non_evicting_at = None;
        if protocol::floor_guard_trips(r.evicts_current_values, frontier, r.first_revision) {
            tracing::warn!(event = "floor_overrun", bucket = %self.bucket, frontier, first_sequence = r.first_revision, "floor guard: retention overran the watch; ending it with CursorExpired");
            return Err(KvError::CursorExpired {
                resume_from: frontier.saturating_add(1),
                first_sequence: r.first_revision,
            });
        }
        Ok(Some(positions))
    }

    /// `StreamChanged` unless `info` is the stream `start` names and reaches `frontier`.
    fn check_same_stream(
        &self,
        info: &async_nats::jetstream::stream::Info,
        start: &StreamIdentity,
        frontier: u64,
    ) -> Result<(), KvError> {
        let found = identity_of(info);
        let detail = if found != *start {
            format!("the watch started on {start}, the bucket is now {found}")
        } else if info.state.last_sequence < frontier {
            format!(
                "its last sequence {} is below the {frontier} the watch already passed",
                info.state.last_sequence
            )
        } else {
            return Ok(());
        };
        tracing::warn!(event = "stream_changed", bucket = %self.bucket, %detail, "the stream changed under the watch");
        Err(KvError::StreamChanged {
            bucket: self.bucket.clone(),
            detail,
        })
    }

    /// For a prefix watch that is level and quiet: the position every in-scope message up to
    /// which has been delivered, when it can be shown to have moved past `frontier` (`None` when
    /// it cannot). A prefix watch's own deliveries say nothing about the out-of-scope messages
    /// the consumer passed, so without this a quiet prefix on a busy `max_age` bucket would look
    /// overrun by the next eviction. The argument, in three reads: `before` (the stream's last
    /// sequence, read first) is at or above every message written before the next read; the
    /// next-by-subject read finds no in-scope message after `frontier`; the last read finds the
    /// same stream with its first sequence still at most `frontier + 1`, so nothing after the
    /// frontier had been evicted when the middle read looked. Then no in-scope message lies in
    /// `(frontier, before]`: the watch has seen everything in scope through `before`.
    async fn quiet_watermark(
        &self,
        filters: &[String],
        frontier: u64,
        before: u64,
        start: &StreamIdentity,
    ) -> Result<Option<u64>, KvError> {
        if before <= frontier {
            return Ok(None);
        }
        for f in filters {
            let found = timed("next in scope", self.timeout, async {
                match self
                    .kv
                    .stream
                    .get_first_raw_message_by_subject(f, frontier.saturating_add(1))
                    .await
                {
                    Ok(m) => Ok(Some(m.sequence)),
                    Err(e) if e.kind() == stream::RawMessageErrorKind::NoMessageFound => Ok(None),
                    Err(e) => Err(backend("next in scope", e)),
                }
            })
            .await?;
            if found.is_some() {
                return Ok(None);
            }
        }
        let info = self.stream_info().await?;
        self.check_same_stream(&info, start, frontier)?;
        if !protocol::resume_window_ok(frontier, info.state.first_sequence) {
            return Ok(None);
        }
        Ok(Some(before))
    }
}
