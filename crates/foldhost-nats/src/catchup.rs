//! The direct catch-up of a delta watch: a short gap after the cursor read by pipelined gets, so
//! the watch's consumer can start past the stream's last sequence, where nats-server creates it
//! without counting a partial block ([`protocol::direct_catch_up_range`] says when and why).
//!
//! Invariants:
//! - What the catch-up hands over is exactly what an unfiltered consumer started at the gap's
//!   first sequence would have delivered up to the gap's last: every message present, in sequence
//!   order, each once (the watch then keeps those in its scope, as a filtered consumer would).
//!   Every read is the stream leader's (`$JS.API.STREAM.MSG.GET`), so an absent answer is
//!   believed (a replica, or a mirror with `mirror_direct`, answers a direct get and may not
//!   hold the message yet).
//! - No stored byte reaches the client library's parser: the leader's answer carries the message
//!   as JSON (its header block base64), decoded here by [`protocol::decode_stored`]. A direct get
//!   answers with the stored header block itself, and a block the library refuses dropped its
//!   connection (or, a CR inside a value, panicked its connection task) on every resume over it.
//! - Anything unexpected (an error, an answer for another sequence, more absences than
//!   [`protocol::DIRECT_CATCH_UP_MAX_ABSENT`]) gives way: the caller starts its consumer at the
//!   gap's first sequence as if no catch-up had been tried. The catch-up never fails a watch.
//! - At most [`protocol::DIRECT_CATCH_UP_IN_FLIGHT`] requests are in flight, and the whole
//!   catch-up runs within [`protocol::DIRECT_CATCH_UP_BUDGET`] (or the operation timeout, if
//!   shorter).
//! - A prefetch ([`NatsKv::prefetch_resume_gap`], started while the store opens) is used only by
//!   a watch starting at the very sequence it was read from, on the stream (same identity) it was
//!   read from; anything else discards it. It only moves the reads earlier: what it found is
//!   immutable at its sequence and what it confirmed absent cannot come back.

use std::ops::RangeInclusive;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use base64::Engine as _;
use bytes::Bytes;
use futures::StreamExt;

use foldhost_core::kv::{KvError, KvUpdate, StreamIdentity, VersionToken};
use foldhost_core::protocol::{self, AckMeta};

use super::{NatsKv, backend, identity_of, timed};

/// A stored message as the stream leader's JSON answer carries it, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct StoredMessage {
    /// Its subject.
    pub(super) subject: String,
    /// Its stream sequence.
    pub(super) sequence: u64,
    /// What it means ([`protocol::decode_stored`] over its header block as stored).
    pub(super) verdict: Result<protocol::KvOp, protocol::Undecodable>,
    /// The operation id its header block carries ([`protocol::decode_stored_record`]).
    pub(super) op_id: Option<protocol::OpId>,
    /// Its payload.
    pub(super) payload: Bytes,
    /// When it was stored, Unix nanoseconds (0: not readable).
    pub(super) time_unix_ns: u64,
}

/// Reads a `$JS.API.STREAM.MSG.GET` answer: the message (`Ok(Some)`), no message at the sequence
/// asked (`Ok(None)`: the API's 404), or why the answer is not usable.
pub(super) fn parse_msg_get_reply(payload: &[u8]) -> Result<Option<StoredMessage>, String> {
    let v: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| format!("unreadable answer: {e}"))?;
    if let Some(err) = v.get("error") {
        return match err["code"].as_u64() {
            Some(404) => Ok(None),
            _ => Err(format!("the server said: {err}")),
        };
    }
    let m = &v["message"];
    let b64 = |field: &str| -> Result<Option<Vec<u8>>, String> {
        match m[field].as_str() {
            None => Ok(None),
            Some(s) => base64::engine::general_purpose::STANDARD
                .decode(s)
                .map(Some)
                .map_err(|e| format!("{field}: {e}")),
        }
    };
    let subject = m["subject"]
        .as_str()
        .ok_or("an answer without a subject")?
        .to_string();
    let sequence = m["seq"].as_u64().ok_or("an answer without a sequence")?;
    let hdrs = b64("hdrs")?;
    let payload = b64("data")?.unwrap_or_default();
    let time_unix_ns = m["time"]
        .as_str()
        .and_then(super::rfc3339_unix_ns)
        .unwrap_or(0);
    // An empty `hdrs` is a message stored without headers.
    let (verdict, op_id) =
        match protocol::decode_stored_record(hdrs.as_deref().filter(|h| !h.is_empty())) {
            Ok((op, id)) => (Ok(op), id),
            Err(e) => (Err(e), None),
        };
    Ok(Some(StoredMessage {
        subject,
        sequence,
        verdict,
        op_id,
        payload: payload.into(),
        time_unix_ns,
    }))
}

/// One message of a catch-up, decoded: its update and the delivery metadata a consumer would have
/// given it (the same shape as a delivered message's, so the watch forwards both alike).
/// The third is the operation id the message carries, if any.
pub(super) type Decoded = (KvUpdate, Option<AckMeta>, Option<protocol::OpId>);

/// A gap read ahead of its watch: the sequence it starts at and the reading task, which answers
/// the stream it read, the gap's last sequence and the messages (`None`: nothing usable).
pub(super) struct Prefetch {
    start: u64,
    task: tokio::task::JoinHandle<Option<(StreamIdentity, u64, Vec<StoredMessage>)>>,
}

impl NatsKv {
    /// Reads `range` by direct gets and returns its present messages in sequence order. `None`:
    /// the catch-up gave way (see the module invariants); the caller starts its consumer at the
    /// range's start.
    pub(super) async fn direct_catch_up(
        &self,
        range: RangeInclusive<u64>,
        recovering: bool,
    ) -> Option<Vec<StoredMessage>> {
        let (first, last) = (*range.start(), *range.end());
        let budget = self.timeout.min(protocol::DIRECT_CATCH_UP_BUDGET);
        // A recovering watch reads past a message the client library cannot read whatever the
        // gap holds: its absences do not make it give way ([`protocol::catch_up_range`]).
        let max_absent = if recovering {
            usize::MAX
        } else {
            protocol::DIRECT_CATCH_UP_MAX_ABSENT
        };
        let read = timed("direct catch-up", budget, async {
            self.read_range(range, max_absent).await
        })
        .await;
        match read {
            Ok(Some(messages)) => {
                self.direct_reads
                    .fetch_add(messages.len() as u64, Ordering::Relaxed);
                tracing::debug!(bucket = %self.bucket, first, last, found = messages.len(), "resume gap read by direct gets");
                Some(messages)
            }
            Ok(None) => {
                tracing::debug!(bucket = %self.bucket, first, last, "resume gap mostly removed messages: a consumer reads it");
                None
            }
            Err(e @ KvError::Timeout { .. }) => {
                // The server drops a request the client may not publish: no answer, ever.
                tracing::warn!(event = "catchup_gave_way", bucket = %self.bucket, first, last, error = %e, "direct catch-up gave way to a consumer: is $JS.API.STREAM.MSG.GET.{} allowed for this client? Without it every start waits this long first", self.stream_name);
                None
            }
            Err(e) => {
                tracing::info!(event = "catchup_gave_way", bucket = %self.bucket, first, last, error = %e, "direct catch-up gave way to a consumer");
                None
            }
        }
    }

    /// Starts reading the gap after `cursor` (the revision a resume will start after) in the
    /// background, for the watch that follows to take (`take_prefetch`): a node calls
    /// this before it opens its store, so the reads and the open overlap. Replaces an earlier
    /// prefetch. Nothing is read when the stream is not one a direct catch-up may read whole (a
    /// mirror, sources, a subject transform, other subjects) or the gap is not short.
    pub fn prefetch_resume_gap(self: &Arc<Self>, cursor: u64) {
        let Some(start) = cursor.checked_add(1) else {
            return;
        };
        if !self.direct_catch_up.load(Ordering::Relaxed) {
            return;
        }
        let kv = Arc::clone(self);
        let task = tokio::spawn(tracing::Instrument::in_current_span(async move {
            // The stream info too is bounded by the catch-up's budget: the watch waits for this.
            let budget = kv.timeout.min(protocol::DIRECT_CATCH_UP_BUDGET);
            let info = tokio::time::timeout(budget, kv.stream_info())
                .await
                .ok()?
                .ok()?;
            let range = protocol::direct_catch_up_range(
                start,
                info.state.last_sequence,
                kv.plain_stream(&info.config),
                protocol::direct_reads_allowed(info.config.allow_direct, info.config.num_replicas),
            )?;
            let last = *range.end();
            let messages = kv.direct_catch_up(range, false).await?;
            Some((identity_of(&info), last, messages))
        }));
        if let Ok(mut p) = self.prefetch.lock()
            && let Some(old) = p.replace(Prefetch { start, task })
        {
            old.task.abort();
        }
    }

    /// The prefetched gap for a watch starting at `start` on the stream `here`: its last
    /// sequence and messages. `None` (and the prefetch dropped) when there is none, or it was
    /// read for another start or from another stream.
    pub(super) async fn take_prefetch(
        &self,
        start: u64,
        here: &StreamIdentity,
    ) -> Option<(u64, Vec<StoredMessage>)> {
        let p = self.prefetch.lock().ok()?.take()?;
        if p.start != start {
            p.task.abort();
            return None;
        }
        let (identity, last, messages) = p.task.await.ok()??;
        (identity == *here).then_some((last, messages))
    }

    /// The leader's reads of every sequence of `range` over one subscription of the client's:
    /// each request's reply subject ends in its sequence, so an answer is matched to its question
    /// without a request/response pair per message. At most
    /// [`protocol::DIRECT_CATCH_UP_IN_FLIGHT`] are in flight; the answers come back in the order
    /// asked, `None` where the stream holds no message.
    async fn leader_gets(
        &self,
        range: RangeInclusive<u64>,
    ) -> Result<Vec<(u64, Option<StoredMessage>)>, KvError> {
        let (first, last) = (*range.start(), *range.end());
        let len = usize::try_from(last.saturating_sub(first).saturating_add(1))
            .map_err(|e| backend("direct catch-up", e))?;
        let inbox = self.client.new_inbox();
        let mut answers = self
            .client
            .subscribe(format!("{inbox}.*"))
            .await
            .map_err(|e| backend("direct catch-up subscribe", e))?;
        let subject = format!("$JS.API.STREAM.MSG.GET.{}", self.stream_name);
        let mut slots: Vec<Option<Option<StoredMessage>>> = vec![None; len];
        let mut asked = range.clone();
        let mut in_flight = 0usize;
        let mut answered = 0usize;
        while answered < len {
            while in_flight < protocol::DIRECT_CATCH_UP_IN_FLIGHT {
                let Some(seq) = asked.next() else { break };
                self.client
                    .publish_with_reply(
                        subject.clone(),
                        format!("{inbox}.{seq}"),
                        format!("{{\"seq\":{seq}}}").into(),
                    )
                    .await
                    .map_err(|e| backend("direct catch-up request", e))?;
                in_flight += 1;
            }
            let Some(m) = answers.next().await else {
                return Err(backend(
                    "direct catch-up",
                    "the answers' subscription ended",
                ));
            };
            let seq = protocol::direct_reply_sequence(&inbox, m.subject.as_str())
                .filter(|s| range.contains(s))
                .ok_or_else(|| backend("direct catch-up", format!("an answer on {}", m.subject)))?;
            // In range, so the index fits: `len` slots from `first`.
            let slot = &mut slots[(seq - first) as usize];
            if slot.is_some() {
                return Err(backend(
                    "direct catch-up",
                    format!("two answers for sequence {seq}"),
                ));
            }
            if let Some(code) = m.status {
                return Err(backend(
                    "direct catch-up",
                    format!("sequence {seq}: status {code}"),
                ));
            }
            let found = parse_msg_get_reply(&m.payload)
                .map_err(|e| backend("direct catch-up", format!("sequence {seq}: {e}")))?;
            if let Some(msg) = &found
                && msg.sequence != seq
            {
                return Err(backend(
                    "direct catch-up",
                    format!("asked for sequence {seq}, answered {}", msg.sequence),
                ));
            }
            *slot = Some(found);
            in_flight -= 1;
            answered += 1;
        }
        Ok(range
            .zip(slots)
            .map(|(seq, a)| (seq, a.flatten()))
            .collect())
    }

    async fn read_range(
        &self,
        range: RangeInclusive<u64>,
        max_absent: usize,
    ) -> Result<Option<Vec<StoredMessage>>, KvError> {
        let answers = self.leader_gets(range).await?;
        let mut out = Vec::with_capacity(answers.len());
        let mut absent = 0usize;
        for (_, answer) in answers {
            match answer {
                Some(m) => out.push(m),
                None => {
                    absent += 1;
                    if absent > max_absent {
                        return Ok(None);
                    }
                }
            }
        }
        Ok(Some(out))
    }

    /// `messages` (a catch-up's, in sequence order) decoded as a consumer would deliver them, the
    /// last with `pending_after` still pending. A message outside the bucket (none on a plain
    /// stream) is left out and not counted as pending, so the last one handed over always says
    /// what follows it: a watch with nothing after the gap is level at its end.
    pub(super) fn decode_caught_up(
        &self,
        messages: &[StoredMessage],
        pending_after: u64,
    ) -> Vec<Decoded> {
        let kept: Vec<(KvUpdate, &StoredMessage)> = messages
            .iter()
            .filter_map(|m| {
                let update = self.update_of(
                    m.subject.as_str(),
                    m.verdict,
                    &m.payload,
                    VersionToken::from_u64(m.sequence),
                )?;
                Some((update, m))
            })
            .collect();
        let n = kept.len() as u64;
        kept.into_iter()
            .zip(1u64..)
            .map(|((update, m), i)| {
                let meta = AckMeta {
                    stream_sequence: m.sequence,
                    // Not a consumer's delivery: never taken for a re-created consumer's first.
                    consumer_sequence: 0,
                    pending: (n - i).saturating_add(pending_after),
                    timestamp_unix_ns: m.time_unix_ns,
                };
                (update, Some(meta), m.op_id)
            })
            .collect()
    }
}
