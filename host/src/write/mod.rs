//! Writes through the host (docs/writes.md): one request — a key, a value or a delete, an
//! operation id, a compare-and-set revision, a wait — answered `applied`, `pending`, `unknown` or
//! `refused`, for `POST /write`, `foldhost put|delete` and the NATS write subject alike.
//!
//! Invariants:
//! - **Every decision is the protocol's** ([`foldhost_core::protocol::admit_write`], `same_write`,
//!   `vouch_retry`, `after_ack`, `resolve_lost_ack`, `outcome_at`): this module reads what they
//!   decide from (the ledger, the broker's answer, the log, the stream's duplicate window, the
//!   fold's positions) and renders the answer.
//! - **Nothing is published twice for one operation id by this host**: an id the ledger records
//!   is answered from its row; an id minted at or before the watermark without a row is unknown;
//!   a given id without a row is published only where the rows or the broker's window vouch for
//!   it, and otherwise answered unknown, said once in the log (`write_unvouched`).
//! - **An id names one write**: the same id with another key or body is refused `op_reused`.
//! - **Unknown only after the log was asked**: a lost acknowledgement reads the newest record on
//!   the key before it is answered unknown.
//! - **Bad input is refused before anything is published**, naming the field.

mod rate;

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use foldhost_core::kv::WatchScope;
use foldhost_core::protocol::{
    self, Admission, LedgerLife, LedgerRow, OpId, Outcome, UnknownWhy, WriteDigest, WriteRefusal,
};
use foldhost_core::status::FoldStatus;
use foldhost_nats::{NatsKv, Published, WriteKind};

pub(crate) use rate::ApplyRate;

/// The token file `POST /write` needs, generated beside the store when none is given.
pub(crate) const WRITE_TOKEN_FILE: &str = "write-token";

/// Largest `/write` body: a value of the broker's largest payload (8 MiB at most in NATS) as
/// base64, and the rest of the request.
pub(crate) const MAX_WRITE_BODY: usize = 12 * 1024 * 1024;

/// A write request (the body of `POST /write`, and of a request on the write subject).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WriteRequest {
    /// The key.
    pub key: String,
    /// `put` (the default), `delete` or `purge`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<String>,
    /// The value as UTF-8 text (a put; exclusive with `value_base64`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// The value as standard base64 (a put; exclusive with `value`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_base64: Option<String>,
    /// The operation id (a UUIDv7); the host mints one when absent. A retry sends the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op_id: Option<String>,
    /// Compare-and-set: the key's revision the write expects (0: the key has no record).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub if_revision: Option<u64>,
    /// How long to wait for this node's fold to apply the write before answering `pending`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
    /// The bucket, when the caller names it (it must be the one this node folds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket: Option<String>,
}

/// How far behind a pending write this fold is.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct LagAnswer {
    /// Records between `applied_through` and the write.
    pub records: u64,
    /// Estimated seconds to apply them, at the measured rate.
    pub seconds: u64,
}

/// A write's answer: one JSON object.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct WriteAnswer {
    /// `applied`, `pending`, `unknown` or `refused`.
    pub outcome: String,
    /// The operation id (minted by the host when the request had none; absent only when the
    /// request could not be read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op_id: Option<String>,
    /// The record's revision (applied, pending); the key's current one for `conflict`; where
    /// the id landed for `op_reused`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u64>,
    /// How far behind this fold is (pending).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<LagAnswer>,
    /// Why it was refused: `conflict`, `op_reused`, `too_large`, `not_folded`, `invalid`,
    /// `permission` or `bucket_full`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The key the operation id landed on (`op_reused`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// What happened, for a person.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl WriteAnswer {
    fn outcome(o: Outcome, op: &OpId) -> Self {
        match o {
            Outcome::Applied { revision } => WriteAnswer {
                outcome: "applied".into(),
                op_id: Some(op.to_string()),
                revision: Some(revision),
                ..Default::default()
            },
            Outcome::Pending { revision, lag } => WriteAnswer {
                outcome: "pending".into(),
                op_id: Some(op.to_string()),
                revision: Some(revision),
                lag: Some(LagAnswer {
                    records: lag.records,
                    seconds: lag.seconds,
                }),
                message: Some("durable, not yet applied by this node: do not retry".into()),
                ..Default::default()
            },
        }
    }

    fn refused(r: WriteRefusal, op: Option<&OpId>) -> Self {
        let mut a = WriteAnswer {
            outcome: "refused".into(),
            op_id: op.map(OpId::to_string),
            reason: Some(r.reason().into()),
            ..Default::default()
        };
        a.message = Some(match r {
            WriteRefusal::Conflict { current } => {
                a.revision = current;
                match current {
                    Some(c) => format!("the key is at revision {c}"),
                    None => "the key has no record".into(),
                }
            }
            WriteRefusal::OpReused {
                key,
                revision,
                other_body,
            } => {
                a.revision = Some(revision);
                let m = if other_body {
                    format!(
                        "the operation id already named another write: it landed on {key:?} at revision {revision} with another operation or value; a different write takes a fresh op_id"
                    )
                } else {
                    format!("the operation id landed on {key:?} at revision {revision}")
                };
                a.key = Some(key);
                m
            }
            WriteRefusal::BucketFull { what } => format!(
                "the bucket is full and discards new records ({what}): nothing was published; free room or raise its limit, then write again"
            ),
            WriteRefusal::TooLarge { size, limit } => {
                format!("the value is {size} bytes; the bucket takes at most {limit}")
            }
            WriteRefusal::NotFolded { what } => format!("{what} is not folded by this node"),
            WriteRefusal::Invalid { what } => what,
            WriteRefusal::Permission { subject } => format!(
                "the server refused this node's publish to {subject}: its user lacks the grant (see `foldhost grants`)"
            ),
        });
        a
    }

    fn unknown(why: UnknownWhy, op: &OpId) -> Self {
        let message = match why {
            UnknownWhy::BeforeWatermark {
                minted_unix_ms,
                watermark_unix_ms,
            } => format!(
                "minted at {minted_unix_ms} ms, before this node's ledger watermark ({watermark_unix_ms} ms), and no row: it may have landed; its record, if any, is on the log"
            ),
            UnknownWhy::Unvouched {
                minted_unix_ms,
                horizon_unix_ms,
            } => format!(
                "minted at {minted_unix_ms} ms, before this node's ledger horizon ({horizon_unix_ms} ms: it folded from a listing there), beyond what the broker's duplicate window vouches for, and no row: it may have landed; its record, if any, is on the log"
            ),
            UnknownWhy::LogUnreadable(e) => {
                format!("no acknowledgement, and the log could not be read ({e}): retry with the same op_id")
            }
            UnknownWhy::NotNewest => "no acknowledgement, and the newest record on the key is not this operation's: retry with the same op_id".into(),
            UnknownWhy::FoldBehind => "this node has no row for the operation yet and is behind the log, where its first copy may be: retry with the same op_id once the node is level".into(),
        };
        WriteAnswer {
            outcome: "unknown".into(),
            op_id: Some(op.to_string()),
            message: Some(message),
            ..Default::default()
        }
    }

    /// The HTTP status the answer goes with: 200 applied, 202 pending, 503 unknown (retry with
    /// the same id), and per refusal 409 (conflict, op_reused), 413, 422 (not folded), 403
    /// (the server refused the node's publish), 507 (the bucket is full), 400.
    pub(crate) fn http_status(&self) -> u16 {
        match (self.outcome.as_str(), self.reason.as_deref()) {
            ("applied", _) => 200,
            ("pending", _) => 202,
            ("unknown", _) => 503,
            (_, Some("conflict" | "op_reused")) => 409,
            (_, Some("too_large")) => 413,
            (_, Some("not_folded")) => 422,
            (_, Some("permission")) => 403,
            (_, Some("bucket_full")) => 507,
            _ => 400,
        }
    }
}

/// The fold's positions and measured apply rate: what a read waiting for a revision waits on.
#[derive(Clone)]
pub(crate) struct Positions {
    pub(crate) status: Arc<FoldStatus>,
    pub(crate) rate: Arc<ApplyRate>,
}

/// Reads one key of the committed fold (`None`: the fold does not hold it).
pub(crate) type KeyReader =
    Arc<dyn Fn(&str) -> Result<Option<foldhost_core::kv::KvEntry>, String> + Send + Sync>;

/// What the ledger says of one operation, read from one view of the committed fold.
pub(crate) struct LedgerView {
    /// Its row in the ledger's current life.
    pub(crate) row: Option<LedgerRow>,
    /// The ledger's watermark.
    pub(crate) watermark: u64,
    /// The ledger's life (epoch, horizon).
    pub(crate) life: LedgerLife,
    /// The committed cursor the rows were read at: every record at or below it that could leave
    /// a row has one.
    pub(crate) cursor: u64,
}

/// Reads the ledger's view of an operation from the committed fold.
pub(crate) type LedgerLookup = Arc<dyn Fn(&OpId) -> Result<LedgerView, String> + Send + Sync>;

/// What a write needs of the running node.
pub(crate) struct WritePath {
    pub(crate) kv: Arc<NatsKv>,
    pub(crate) bucket: String,
    pub(crate) scope: WatchScope,
    pub(crate) status: Arc<FoldStatus>,
    pub(crate) ledger: LedgerLookup,
    pub(crate) rate: Arc<ApplyRate>,
}

/// A request checked and decoded: what to publish, under which id.
struct Checked {
    key: String,
    kind: WriteKind,
    /// What the write writes ([`protocol::write_digest`]): an id names one write.
    digest: WriteDigest,
    op: OpId,
    /// The caller sent the id (it may be a retry).
    given_id: bool,
    if_revision: Option<u64>,
    wait: Duration,
}

impl WritePath {
    /// Answers one request body (JSON).
    pub(crate) async fn write_json(&self, body: &[u8]) -> WriteAnswer {
        match serde_json::from_slice::<WriteRequest>(body) {
            Ok(req) => self.write(req).await,
            Err(e) => WriteAnswer::refused(
                WriteRefusal::Invalid {
                    what: format!("the request: {e}"),
                },
                None,
            ),
        }
    }

    /// Answers one request.
    pub(crate) async fn write(&self, req: WriteRequest) -> WriteAnswer {
        self.write_minted(req, None).await
    }

    /// [`WritePath::write`], with the id to use when the request names none minted by the caller
    /// (so a caller that gives up waiting still knows the id to retry with); the write is treated
    /// as a first attempt all the same.
    pub(crate) async fn write_minted(
        &self,
        req: WriteRequest,
        minted: Option<OpId>,
    ) -> WriteAnswer {
        let answer = self.answer(req, minted).await;
        self.status
            .count_write(&answer.outcome, answer.reason.as_deref().unwrap_or(""));
        answer
    }

    async fn answer(&self, req: WriteRequest, minted: Option<OpId>) -> WriteAnswer {
        let c = match self.check(req, minted) {
            Ok(c) => c,
            Err((r, op)) => return WriteAnswer::refused(r, op.as_ref()),
        };
        let view = match (self.ledger)(&c.op) {
            Ok(found) => found,
            // The ledger cannot say whether the id landed: nothing is published on a guess.
            Err(e) => {
                return WriteAnswer::unknown(
                    UnknownWhy::LogUnreadable(format!("the ledger: {e}")),
                    &c.op,
                );
            }
        };
        let republish =
            foldhost_core::crashpoint::mutated(foldhost_core::crashpoint::MUTATION_REPUBLISH_RETRY);
        let row = view.row.as_ref().filter(|_| !republish);
        match protocol::admit_write(&c.op, &c.key, &c.digest, row, view.watermark, now_unix_ms()) {
            Admission::Landed { revision } => self.settle(revision, &c).await,
            Admission::Refused(r) => WriteAnswer::refused(r, Some(&c.op)),
            Admission::Unknown(why) => self.unvouched(why, &c),
            Admission::Publish if republish => self.publish(&c, &view).await,
            Admission::Publish if c.given_id => self.publish_retry(&c, &view).await,
            Admission::Publish => self.publish(&c, &view).await,
        }
    }

    /// An answer `unknown` before anything was published, said once in the log
    /// (`write_unvouched`) when it is the ledger that cannot vouch for the id.
    fn unvouched(&self, why: UnknownWhy, c: &Checked) -> WriteAnswer {
        match &why {
            UnknownWhy::BeforeWatermark {
                minted_unix_ms,
                watermark_unix_ms,
            } => {
                tracing::warn!(event = "write_unvouched", op_id = %c.op, key = %c.key, minted_unix_ms, watermark_unix_ms, "a write was answered unknown: its operation was minted before this node's ledger may have lost rows to the sweep, and no row says whether it landed");
            }
            UnknownWhy::Unvouched {
                minted_unix_ms,
                horizon_unix_ms,
            } => {
                tracing::warn!(event = "write_unvouched", op_id = %c.op, key = %c.key, minted_unix_ms, horizon_unix_ms, "a write was answered unknown: its operation may have landed among the records this node's fold passed without rows (a state-sync start or a re-list), and the broker's duplicate window cannot vouch for it (too old, or records of its key were removed since)");
            }
            _ => {}
        }
        WriteAnswer::unknown(why, &c.op)
    }

    /// An id the caller gave, with no ledger row: perhaps a retry of a write the fold has not
    /// passed yet, or passed without a row. Its record, when it is the newest on the key,
    /// answers it; otherwise it is published only where the broker refuses a second copy (a
    /// compare-and-set, [`protocol::broker_refuses_a_second_copy`]) or the rows or the broker's
    /// duplicate window vouch for it ([`protocol::vouch_retry`]).
    async fn publish_retry(&self, c: &Checked, view: &LedgerView) -> WriteAnswer {
        let newest = self.kv.newest_record(&c.key).await;
        let key_newest = match &newest {
            Ok(Some((found, Some(id)))) if *id == c.op => {
                return match protocol::same_write(&c.key, &c.digest, found) {
                    Ok(revision) => self.settle(revision, c).await,
                    Err(r) => WriteAnswer::refused(r, Some(&c.op)),
                };
            }
            Ok(found) => found.as_ref().map(|(f, _)| f.revision),
            Err(e) => {
                return WriteAnswer::unknown(UnknownWhy::LogUnreadable(e.to_string()), &c.op);
            }
        };
        if protocol::broker_refuses_a_second_copy(c.if_revision) {
            return self.publish(c, view).await;
        }
        let covered = protocol::Coverage {
            cursor: view.cursor,
            life: view.life,
        };
        let now = now_unix_ms();
        // The most cautious judgement first (no window at all); the window is read from the
        // stream, fresh, only when it is what decides.
        let mut vouch = protocol::vouch_retry(&c.op, now, None, key_newest, covered);
        if vouch != protocol::Vouch::Publish {
            let seen = tokio::try_join!(
                async {
                    self.kv.duplicate_window_and_first_ms().await.map_err(|e| {
                        UnknownWhy::LogUnreadable(format!("the duplicate window: {e}"))
                    })
                },
                async {
                    self.kv.oldest_record_ms(&c.key).await.map_err(|e| {
                        UnknownWhy::LogUnreadable(format!("the key's oldest record: {e}"))
                    })
                },
            )
            .map(
                |((window_ms, stream_first_unix_ms), oldest_on_key_unix_ms)| protocol::WindowSeen {
                    window_ms,
                    oldest_on_key_unix_ms,
                    stream_first_unix_ms,
                },
            );
            match seen {
                Ok(w) => vouch = protocol::vouch_retry(&c.op, now, Some(w), key_newest, covered),
                Err(why) => return WriteAnswer::unknown(why, &c.op),
            }
        }
        match vouch {
            protocol::Vouch::Publish => self.publish(c, view).await,
            protocol::Vouch::FoldBehind => WriteAnswer::unknown(UnknownWhy::FoldBehind, &c.op),
            protocol::Vouch::Unvouched {
                minted_unix_ms,
                horizon_unix_ms,
            } => self.unvouched(
                UnknownWhy::Unvouched {
                    minted_unix_ms,
                    horizon_unix_ms,
                },
                c,
            ),
        }
    }

    /// Publishes, and turns the broker's answer (or its absence) into a revision or an answer.
    /// `view`: what the ledger said of the operation before.
    async fn publish(&self, c: &Checked, view: &LedgerView) -> WriteAnswer {
        let _expecting = self.status.expect_applied();
        let published = self
            .kv
            .publish_op(&c.key, &c.kind, &c.op, c.if_revision)
            .await;
        let revision = match published {
            Published::Acked {
                sequence,
                duplicate,
            } => {
                let landed = if duplicate {
                    match self.kv.record_at(sequence).await {
                        Ok(Some(found)) => Some(found),
                        // The record the broker collapsed it onto is gone (superseded, purged):
                        // which write it was cannot be told.
                        Ok(None) => {
                            return WriteAnswer::unknown(
                                UnknownWhy::LogUnreadable(format!(
                                    "the broker collapsed it onto the record at {sequence}, which is gone"
                                )),
                                &c.op,
                            );
                        }
                        Err(e) => {
                            return WriteAnswer::unknown(
                                UnknownWhy::LogUnreadable(e.to_string()),
                                &c.op,
                            );
                        }
                    }
                } else {
                    None
                };
                match protocol::after_ack(&c.key, &c.digest, sequence, landed.as_ref()) {
                    Ok(rev) => rev,
                    Err(r) => return WriteAnswer::refused(r, Some(&c.op)),
                }
            }
            Published::WrongLastSequence => return self.conflicted(c, view).await,
            Published::Lost(why) => {
                tracing::warn!(event = "write_ack_lost", op_id = %c.op, key = %c.key, error = %why, "a write's acknowledgement was lost: resolving it from the log");
                let newest = self
                    .kv
                    .newest_record(&c.key)
                    .await
                    .map_err(|e| e.to_string());
                match protocol::resolve_lost_ack(&c.op, &c.key, &c.digest, newest) {
                    Ok(Ok(rev)) => rev,
                    Ok(Err(r)) => return WriteAnswer::refused(r, Some(&c.op)),
                    Err(why) => {
                        tracing::warn!(event = "write_outcome_unknown", op_id = %c.op, key = %c.key, ?why, "a write could not tell whether its record landed: retry under the same op_id");
                        return WriteAnswer::unknown(why, &c.op);
                    }
                }
            }
            Published::Denied(subject) => {
                return WriteAnswer::refused(WriteRefusal::Permission { subject }, Some(&c.op));
            }
            Published::Full(what) => {
                return WriteAnswer::refused(WriteRefusal::BucketFull { what }, Some(&c.op));
            }
            Published::Refused(why) => {
                return WriteAnswer::refused(
                    WriteRefusal::Invalid {
                        what: format!("the broker refused it: {why}"),
                    },
                    Some(&c.op),
                );
            }
        };
        self.settle(revision, c).await
    }

    /// A compare-and-set the broker refused: a conflict naming the key's revision — unless the
    /// operation's own first copy is the key's record right after the revision it asked for (a
    /// retry of a write that landed: the broker checks the revision before its duplicate window),
    /// or nothing can establish whether it landed ([`protocol::after_conflict`]).
    async fn conflicted(&self, c: &Checked, view: &LedgerView) -> WriteAnswer {
        let unreadable = |e: foldhost_core::kv::KvError| {
            WriteAnswer::unknown(UnknownWhy::LogUnreadable(e.to_string()), &c.op)
        };
        let current = match self.kv.newest_record(&c.key).await {
            Ok(found) => found.map(|(f, _)| f.revision),
            // The key's revision cannot be told, nor, for a retry, whether its first copy landed.
            Err(e) => return unreadable(e),
        };
        let asked = c.if_revision.unwrap_or(0);
        let (successor, known) = if c.given_id {
            let successor = match self.kv.successor(&c.key, asked).await {
                Ok(s) => s,
                Err(e) => return unreadable(e),
            };
            let known = asked > 0
                && match self.kv.record_at(asked).await {
                    Ok(at) => at.is_some_and(|r| r.key == c.key),
                    Err(e) => return unreadable(e),
                };
            (successor, known)
        } else {
            (None, false)
        };
        let covered = protocol::Coverage {
            cursor: view.cursor,
            life: view.life,
        };
        let rows = protocol::vouch_retry(&c.op, now_unix_ms(), None, current, covered);
        let seen = protocol::ConflictSeen {
            current,
            successor: successor.as_ref(),
            successor_known: known,
        };
        match protocol::after_conflict(&c.op, &c.key, &c.digest, c.given_id, seen, rows) {
            protocol::AfterConflict::Landed(revision) => self.settle(revision, c).await,
            protocol::AfterConflict::Refused(r) => WriteAnswer::refused(r, Some(&c.op)),
            protocol::AfterConflict::Unknown(why) => self.unvouched(why, c),
        }
    }

    /// A record durable at `revision`: applied once this fold reaches it within the wait,
    /// pending otherwise.
    async fn settle(&self, revision: u64, c: &Checked) -> WriteAnswer {
        if foldhost_core::crashpoint::mutated(foldhost_core::crashpoint::MUTATION_EARLY_APPLIED) {
            return WriteAnswer::outcome(Outcome::Applied { revision }, &c.op);
        }
        let deadline = tokio::time::Instant::now() + c.wait;
        let through = self.status.wait_applied(revision, deadline).await;
        WriteAnswer::outcome(
            protocol::outcome_at(revision, through, self.rate.per_second()),
            &c.op,
        )
    }

    /// The request checked field by field; a refusal names the field (and carries the id when
    /// one was given or minted).
    fn check(
        &self,
        req: WriteRequest,
        minted: Option<OpId>,
    ) -> Result<Checked, (WriteRefusal, Option<OpId>)> {
        let invalid = |what: String| WriteRefusal::Invalid { what };
        let op = match req.op_id.as_deref() {
            Some(text) => {
                OpId::parse(text).map_err(|e| (invalid(format!("op_id {text:?}: {e}")), None))?
            }
            None => minted.unwrap_or_else(mint),
        };
        let refuse = |r: WriteRefusal| (r, Some(op));
        if let Some(b) = &req.bucket
            && *b != self.bucket
        {
            return Err(refuse(WriteRefusal::NotFolded {
                what: format!("bucket {b:?}"),
            }));
        }
        if !protocol::kv_key_valid(&req.key) {
            return Err(refuse(invalid(format!(
                "key {:?} is not a valid key",
                req.key
            ))));
        }
        if !self.scope.contains(&req.key) {
            return Err(refuse(WriteRefusal::NotFolded {
                what: format!("key {:?} (outside the scope {})", req.key, self.scope),
            }));
        }
        let wait = protocol::write_wait_ms(req.wait_ms).map_err(refuse)?;
        let op_name = req.op.as_deref().unwrap_or("put");
        let kind = write_kind(op_name, req.value, req.value_base64).map_err(refuse)?;
        if let WriteKind::Put(v) = &kind {
            let limit = self.kv.max_value_len();
            if v.len() as u64 > limit {
                return Err(refuse(WriteRefusal::TooLarge {
                    size: v.len() as u64,
                    limit,
                }));
            }
        }
        let digest = match &kind {
            WriteKind::Put(v) => protocol::write_digest(protocol::KvOp::Put, v),
            WriteKind::Delete => protocol::write_digest(protocol::KvOp::Delete, &[]),
            WriteKind::Purge => protocol::write_digest(protocol::KvOp::Purge, &[]),
        };
        Ok(Checked {
            key: req.key,
            kind,
            digest,
            op,
            given_id: req.op_id.is_some(),
            if_revision: req.if_revision,
            wait: Duration::from_millis(wait),
        })
    }
}

/// What a write of `op` does: a put of exactly one of `value` and `value_base64`, a delete or a
/// purge of none.
fn write_kind(
    op: &str,
    value: Option<String>,
    value_base64: Option<String>,
) -> Result<WriteKind, WriteRefusal> {
    let invalid = |what: String| WriteRefusal::Invalid { what };
    Ok(match op {
        "put" => match (value, value_base64) {
            (Some(v), None) => WriteKind::Put(Bytes::from(v)),
            (None, Some(b)) => WriteKind::Put(Bytes::from(
                base64::engine::general_purpose::STANDARD
                    .decode(b.as_bytes())
                    .map_err(|e| invalid(format!("value_base64: {e}")))?,
            )),
            _ => {
                return Err(invalid(
                    "a put takes exactly one of value and value_base64".into(),
                ));
            }
        },
        op @ ("delete" | "purge") => {
            if value.is_some() || value_base64.is_some() {
                return Err(invalid(format!("a {op} takes no value")));
            }
            if op == "delete" {
                WriteKind::Delete
            } else {
                WriteKind::Purge
            }
        }
        other => {
            return Err(invalid(format!("op {other:?}: put, delete or purge")));
        }
    })
}

/// A new operation id: a UUIDv7 minted now.
pub(crate) fn mint() -> OpId {
    let u = uuid::Uuid::now_v7();
    // `now_v7` always makes a version-7 id.
    OpId::from_bytes(*u.as_bytes()).unwrap_or_else(|_| unreachable!("now_v7 mints a UUIDv7"))
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
