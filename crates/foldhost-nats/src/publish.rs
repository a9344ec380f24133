//! Writes that carry an operation id (docs/writes.md): a publish on the key's subject with
//! `Nats-Msg-Id` (the broker's duplicate window) and [`protocol::OP_ID_HEADER`] (what the fold and
//! a lost acknowledgement's resolution read), optionally conditional on the subject's last
//! sequence; and the reads that settle a write the publish could not: the newest record on a
//! key, the record at a sequence, and the stream's duplicate window.
//!
//! Invariants: a publish answers what the broker said and nothing more — [`Published::Lost`]
//! whenever the acknowledgement did not arrive, however the wait ended, so the caller resolves
//! it from the log; the reads go to the stream leader as JSON and decode the stored header block
//! with [`protocol::decode_stored_record`], never through the client library's parser.

use super::*;

/// How long a publish waits for its acknowledgement before it is [`Published::Lost`] (at most the
/// operation timeout). A late acknowledgement costs a read of the log, never a wrong answer.
pub const ACK_WAIT: Duration = Duration::from_secs(5);

/// What a write publishes on its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteKind {
    /// A value.
    Put(Bytes),
    /// A delete marker (`KV-Operation: DEL`).
    Delete,
    /// A purge marker (`KV-Operation: PURGE`, rolling up the key's history).
    Purge,
}

/// What the broker answered a publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// Durable at `sequence`; `duplicate` when the broker's duplicate window collapsed it onto an
    /// earlier record with the same `Nats-Msg-Id` (at `sequence`, possibly on another key).
    Acked {
        /// The record's stream sequence (the key's revision).
        sequence: u64,
        /// Collapsed onto an earlier record.
        duplicate: bool,
    },
    /// The compare-and-set lost: the key's last sequence is not the one asked for.
    WrongLastSequence,
    /// No acknowledgement arrived (a timeout, a connection lost): the record may or may not be on
    /// the log.
    Lost(String),
    /// The broker (or the client, before sending) refused it: nothing landed.
    Refused(String),
    /// The server reported a permission violation for the publish (on the connection, where
    /// the client would have waited out its deadline): nothing landed. The subject.
    Denied(String),
    /// The stream is full and discards new records (its byte or message limit): nothing landed.
    /// What the broker said.
    Full(String),
}

/// Whether the broker's refusal of a publish says the stream is full (a stream that discards new
/// records past its byte or message limit answers so, and stores nothing).
fn says_full(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    [
        "maximum bytes exceeded",
        "maximum messages exceeded",
        "maximum messages per subject exceeded",
    ]
    .iter()
    .any(|m| t.contains(m))
}

/// Room left in a message for the headers a write adds (its id twice, the operation, the
/// conditions).
const HEADER_ROOM: u64 = 512;

impl NatsKv {
    /// The largest value a write may carry: the server's largest payload, less room for the
    /// headers a write adds, and within the bucket's own limit on a value when it sets one.
    pub fn max_value_len(&self) -> u64 {
        let payload = u64::try_from(self.client.server_info().max_payload).unwrap_or(0);
        let room = payload.saturating_sub(HEADER_ROOM);
        match u64::try_from(self.kv.stream.cached_info().config.max_message_size) {
            Ok(limit) if limit > 0 => room.min(limit.saturating_sub(HEADER_ROOM)),
            _ => room,
        }
    }

    /// Publishes `kind` on `key` under `op`, conditional on the key's last revision being
    /// `if_revision` when given (0: the key has no record).
    pub async fn publish_op(
        &self,
        key: &str,
        kind: &WriteKind,
        op: &protocol::OpId,
        if_revision: Option<u64>,
    ) -> Published {
        if !protocol::kv_key_valid(key) {
            return Published::Refused(format!("{key:?} is not a valid key"));
        }
        let id = op.to_string();
        let mut msg = jetstream::message::PublishMessage::build()
            .message_id(&id)
            .header(protocol::OP_ID_HEADER, id.as_str());
        msg = match kind {
            WriteKind::Put(value) => msg.payload(value.clone()),
            WriteKind::Delete => msg.header("KV-Operation", "DEL"),
            WriteKind::Purge => msg
                .header("KV-Operation", "PURGE")
                .header("Nats-Rollup", "sub"),
        };
        if let Some(rev) = if_revision {
            msg = msg.expected_last_subject_sequence(rev);
        }
        let wait = self.timeout.min(ACK_WAIT);
        let subject = format!("{}{key}", self.subject_prefix);
        use async_nats::jetstream::context::PublishErrorKind as K;
        // Watched from before the publish: a violation the server reports for this subject
        // answers the write at once, not at the end of its deadline.
        let denied = self.denial_of(protocol::Denied::Publish, subject.clone());
        let subject_sent = subject.clone();
        let sent = match tokio::time::timeout(wait, self.js.send_publish(subject, msg)).await {
            Err(_) => return Published::Lost(format!("no room to send within {wait:?}")),
            Ok(Err(e)) => {
                return match e.kind() {
                    // Never sent: the request did not leave this process.
                    K::MaxPayloadExceeded | K::MaxAckPending => Published::Refused(e.to_string()),
                    _ => Published::Lost(e.to_string()),
                };
            }
            Ok(Ok(ack)) => ack,
        };
        let acked = tokio::select! {
            biased;
            acked = tokio::time::timeout(wait, sent) => acked,
            () = denied => return Published::Denied(subject_sent),
        };
        match acked {
            Err(_) => Published::Lost(format!("no acknowledgement within {wait:?}")),
            Ok(Ok(ack)) => Published::Acked {
                sequence: ack.sequence,
                duplicate: ack.duplicate,
            },
            Ok(Err(e)) => match e.kind() {
                K::WrongLastSequence => Published::WrongLastSequence,
                K::TimedOut | K::BrokenPipe => Published::Lost(e.to_string()),
                K::StreamNotFound | K::MaxPayloadExceeded => Published::Refused(e.to_string()),
                _ if says_full(&e.to_string()) => Published::Full(e.to_string()),
                // Another error answered by the broker names why it refused; anything else may
                // have landed.
                _ => Published::Lost(e.to_string()),
            },
        }
    }

    /// Resolves once the connection reports a violation of `denied` on `subject` numbered after
    /// now; never when it reports none (or the handle has no connection's report).
    fn denial_of(
        &self,
        denied: protocol::Denied,
        subject: String,
    ) -> impl std::future::Future<Output = ()> + use<> {
        let rx = lock(&self.denials).clone();
        let since = rx.as_ref().map(|r| r.borrow().count).unwrap_or(0);
        async move {
            let Some(mut rx) = rx else {
                return std::future::pending().await;
            };
            loop {
                if rx
                    .borrow_and_update()
                    .after(since, |d, s| d == denied && s == subject)
                    .is_some()
                {
                    return;
                }
                if rx.changed().await.is_err() {
                    return std::future::pending().await;
                }
            }
        }
    }

    /// The newest record on `key`: where it landed, what it wrote, and the operation id it
    /// carries (`Ok(None)`: the key has no record). An undecodable newest record carries no id.
    pub async fn newest_record(
        &self,
        key: &str,
    ) -> Result<Option<(protocol::Landed, Option<protocol::OpId>)>, KvError> {
        if !protocol::kv_key_valid(key) {
            return Err(KvError::Invalid(format!("{key:?} is not a valid key")));
        }
        let request =
            serde_json::json!({ "last_by_subj": format!("{}{key}", self.subject_prefix) });
        Ok(self
            .msg_get("newest record", request)
            .await?
            .map(|m| (landed(key, &m), m.op_id)))
    }

    /// The record at `sequence`: where it landed and what it wrote (`Ok(None)`: no record there,
    /// or one outside this bucket's subjects).
    pub async fn record_at(&self, sequence: u64) -> Result<Option<protocol::Landed>, KvError> {
        let request = serde_json::json!({ "seq": sequence });
        Ok(self
            .msg_get("record at sequence", request)
            .await?
            .and_then(|m| self.key_of(&m.subject).map(|k| landed(k, &m))))
    }

    /// The first record on `key` after revision `after`: where it landed, what it wrote, and the
    /// operation id it carries (`Ok(None)`: none). A compare-and-set conditioned on `after` that
    /// landed is exactly this record.
    pub async fn successor(
        &self,
        key: &str,
        after: u64,
    ) -> Result<Option<(protocol::Landed, Option<protocol::OpId>)>, KvError> {
        if !protocol::kv_key_valid(key) {
            return Err(KvError::Invalid(format!("{key:?} is not a valid key")));
        }
        let request = serde_json::json!({
            "seq": after.saturating_add(1),
            "next_by_subj": format!("{}{key}", self.subject_prefix),
        });
        Ok(self
            .msg_get("record after a revision", request)
            .await?
            .map(|m| (landed(key, &m), m.op_id)))
    }

    /// When the oldest record the stream still stores on `key` was stored, Unix milliseconds
    /// (`Ok(None)`: the key has no record; `u64::MAX` when its time cannot be read — as new as
    /// can be, so it vouches for nothing).
    pub async fn oldest_record_ms(&self, key: &str) -> Result<Option<u64>, KvError> {
        if !protocol::kv_key_valid(key) {
            return Err(KvError::Invalid(format!("{key:?} is not a valid key")));
        }
        let request = serde_json::json!({
            "seq": 1,
            "next_by_subj": format!("{}{key}", self.subject_prefix),
        });
        Ok(self
            .msg_get("oldest record", request)
            .await?
            .map(|m| match m.time_unix_ns {
                0 => u64::MAX,
                t => t / 1_000_000,
            }))
    }

    /// The stream's duplicate window in milliseconds, read fresh from the server (its
    /// configuration can change under a running node), and when its oldest stored record was
    /// stored, Unix milliseconds (`u64::MAX` when it stores none, or its time cannot be read —
    /// as new as can be).
    pub async fn duplicate_window_and_first_ms(&self) -> Result<(u64, u64), KvError> {
        let info = self.stream_info().await?;
        let window = u64::try_from(info.config.duplicate_window.as_millis()).unwrap_or(u64::MAX);
        let first = if info.state.messages == 0 {
            u64::MAX
        } else {
            u64::try_from(info.state.first_timestamp.unix_timestamp_nanos() / 1_000_000)
                .ok()
                .filter(|t| *t > 0)
                .unwrap_or(u64::MAX)
        };
        Ok((window, first))
    }

    /// When the record at `sequence` was stored, Unix nanoseconds (`Ok(None)`: no record there).
    pub async fn record_time_at(&self, sequence: u64) -> Result<Option<u64>, KvError> {
        let request = serde_json::json!({ "seq": sequence });
        Ok(self
            .msg_get("record at the checkpoint", request)
            .await?
            .map(|m| m.time_unix_ns)
            .filter(|t| *t > 0))
    }

    /// One `$JS.API.STREAM.MSG.GET` from the stream leader, decoded.
    async fn msg_get(
        &self,
        what: &'static str,
        request: serde_json::Value,
    ) -> Result<Option<catchup::StoredMessage>, KvError> {
        let answer = timed(what, self.timeout, async {
            self.client
                .request(
                    format!("$JS.API.STREAM.MSG.GET.{}", self.stream_name),
                    request.to_string().into(),
                )
                .await
                .map_err(|e| backend(what, e))
        })
        .await?;
        catchup::parse_msg_get_reply(&answer.payload).map_err(|e| backend(what, e))
    }
}

/// A stored record as a write's resolution reads it: its revision, key and what it wrote (an
/// undecodable record: `None`).
fn landed(key: &str, m: &catchup::StoredMessage) -> protocol::Landed {
    protocol::Landed {
        revision: m.sequence,
        key: key.to_string(),
        digest: m
            .verdict
            .as_ref()
            .ok()
            .map(|op| protocol::write_digest(*op, &m.payload)),
    }
}
