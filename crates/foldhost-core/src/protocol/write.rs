//! What a write through the host answers (docs/writes.md): operation ids, the operation ledger's
//! rows and its watermark, the decision before a publish, the resolution of a lost
//! acknowledgement, and the outcome from the fold's positions.
//!
//! Invariants:
//! - **Never applied twice.** An operation the ledger records is answered from its row and never
//!   published again; one minted at or before the watermark with no row is answered unknown
//!   before anything is published ([`admit_write`]).
//! - **An operation id names one write.** A row, or a duplicate the broker collapsed, that landed
//!   on another key refuses the write `op_reused`, naming where it landed ([`admit_write`],
//!   [`after_ack`]).
//! - **Unknown only when nothing can be established.** A lost acknowledgement is resolved from
//!   the newest record on the key's subject first ([`resolve_lost_ack`]).
//! - **Applied means this fold holds it.** A durable revision is `applied` only once
//!   `applied_through` reaches it, `pending` before ([`outcome_at`]).

use super::{LedgerRow, WriteDigest};

/// The header every record written through the host carries its operation id in (beside
/// `Nats-Msg-Id`, which only the broker's duplicate window reads).
pub const OP_ID_HEADER: &str = "Foldhost-Op-Id";

/// How long a write waits for this fold to apply its record by default, before it answers
/// `pending`.
pub const DEFAULT_WRITE_WAIT_MS: u64 = 5_000;

/// The longest wait a write (or a read waiting for a revision) may ask for.
pub const MAX_WRITE_WAIT_MS: u64 = 60_000;

/// How long a ledger row is kept after its record was folded, by default (30 days).
pub const DEFAULT_LEDGER_RETENTION_MS: u64 = 30 * 24 * 3600 * 1000;

/// The header a read (`/query`, `/get`, a NATS query) names the revision it must see in: the
/// host answers once `applied_through` reaches it.
pub const MIN_REVISION_HEADER: &str = "Foldhost-Min-Revision";

/// How long a read waits for `applied_through` to reach its minimum revision before it is
/// answered `behind`, unless it names its own bound in [`WAIT_MS_HEADER`].
pub const READ_WAIT_MS: u64 = 5_000;

/// The header a read names its own bound on that wait in (milliseconds, at most
/// [`MAX_WRITE_WAIT_MS`]).
pub const WAIT_MS_HEADER: &str = "Foldhost-Wait-Ms";

/// The longest `retry_after_seconds` a caller is told.
pub const MAX_RETRY_AFTER_SECONDS: u64 = 60;

/// An operation id: a UUIDv7, whose leading 48 bits are its mint instant (Unix milliseconds).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId([u8; 16]);

/// Why a text is not an operation id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OpIdError {
    /// Not a UUID in its text form.
    #[error("not a UUID")]
    NotUuid,
    /// A UUID of another version: only a UUIDv7 carries its mint instant.
    #[error("a UUID of version {0}, not 7 (an operation id carries its mint instant)")]
    NotVersion7(usize),
}

impl OpId {
    /// Parses the text form (hyphenated, any case) of a UUIDv7.
    pub fn parse(text: &str) -> Result<OpId, OpIdError> {
        let u = uuid::Uuid::try_parse(text).map_err(|_| OpIdError::NotUuid)?;
        OpId::from_bytes(*u.as_bytes())
    }

    /// The id of these bytes, when they are a UUIDv7 (RFC variant).
    pub fn from_bytes(bytes: [u8; 16]) -> Result<OpId, OpIdError> {
        let u = uuid::Uuid::from_bytes(bytes);
        match (u.get_version_num(), u.get_variant()) {
            (7, uuid::Variant::RFC4122) => Ok(OpId(bytes)),
            (v, _) => Err(OpIdError::NotVersion7(v)),
        }
    }

    /// The instant it was minted, Unix milliseconds.
    pub fn minted_unix_ms(&self) -> u64 {
        let mut ms = [0u8; 8];
        ms[2..].copy_from_slice(&self.0[..6]);
        u64::from_be_bytes(ms)
    }

    /// Its 16 bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl std::fmt::Display for OpId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        uuid::Uuid::from_bytes(self.0).hyphenated().fmt(f)
    }
}

impl std::fmt::Debug for OpId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OpId({self})")
    }
}

/// Why a write is refused: nothing was published for it (or, for `op_reused` after a collapsed
/// duplicate, nothing new landed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteRefusal {
    /// The compare-and-set lost: the key is at `current` (`None`: absent or deleted).
    Conflict {
        /// The key's revision now.
        current: Option<u64>,
    },
    /// The operation id already landed on another key, or on this key with another body.
    OpReused {
        /// Where it landed.
        key: String,
        /// At which revision.
        revision: u64,
        /// It landed on this key, with another operation or value.
        other_body: bool,
    },
    /// The bucket is full (its byte or message limit, and it discards new records): nothing
    /// landed.
    BucketFull {
        /// What the broker said.
        what: String,
    },
    /// The value is larger than the bucket takes.
    TooLarge {
        /// Its size.
        size: u64,
        /// The largest the bucket takes.
        limit: u64,
    },
    /// The key (or bucket) is not one this node folds.
    NotFolded {
        /// What is not folded here.
        what: String,
    },
    /// The request itself is malformed (a bad key, operation id, value encoding or wait).
    Invalid {
        /// What is wrong, and where.
        what: String,
    },
    /// The server refused the publish for this node's permissions: nothing landed.
    Permission {
        /// The subject it refused.
        subject: String,
    },
}

impl WriteRefusal {
    /// The reason's name in an answer.
    pub fn reason(&self) -> &'static str {
        match self {
            WriteRefusal::Conflict { .. } => "conflict",
            WriteRefusal::OpReused { .. } => "op_reused",
            WriteRefusal::TooLarge { .. } => "too_large",
            WriteRefusal::NotFolded { .. } => "not_folded",
            WriteRefusal::Invalid { .. } => "invalid",
            WriteRefusal::Permission { .. } => "permission",
            WriteRefusal::BucketFull { .. } => "bucket_full",
        }
    }
}

/// Why a write is answered unknown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnknownWhy {
    /// Minted at or before the ledger's watermark, and no row: the row may have been swept.
    BeforeWatermark {
        /// The operation's mint instant.
        minted_unix_ms: u64,
        /// The watermark.
        watermark_unix_ms: u64,
    },
    /// No row, and a copy may be among the records this fold passed without rows (a state-sync
    /// start or a re-list), beyond what the broker's duplicate window vouches for
    /// ([`super::vouch_retry`]).
    Unvouched {
        /// The operation's mint instant.
        minted_unix_ms: u64,
        /// The ledger's horizon.
        horizon_unix_ms: u64,
    },
    /// The acknowledgement was lost and the log could not be read.
    LogUnreadable(String),
    /// The acknowledgement was lost and the newest record on the key is another operation's (or
    /// none): this one may still land, or may have been overwritten.
    NotNewest,
    /// A retry outside the broker's duplicate window, with no row yet, while the key has records
    /// past what this fold has passed: its first copy may be among them
    /// ([`super::vouch_retry`]).
    FoldBehind,
}

/// The decision before anything is published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Nothing is known of the operation: publish it.
    Publish,
    /// The ledger records it on this key: answered from there, nothing published.
    Landed {
        /// The revision the first copy landed at.
        revision: u64,
    },
    /// Refused before publishing.
    Refused(WriteRefusal),
    /// Answered unknown before publishing.
    Unknown(UnknownWhy),
}

/// A record on the log (or a ledger row) that carries an operation's id: where it landed and what
/// it wrote (`None`: unknown, a row of the first format or an undecodable record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Landed {
    /// Its revision.
    pub revision: u64,
    /// Its key.
    pub key: String,
    /// The digest of what it wrote ([`super::write_digest`]).
    pub digest: Option<WriteDigest>,
}

/// A write of `digest` on `key` whose operation id a record already carries: the same write
/// (`Ok(revision)`), or the id reused for another key or another body — refused `op_reused`,
/// naming where the first landed (an id names one write: never answered as the first).
pub fn same_write(key: &str, digest: &WriteDigest, found: &Landed) -> Result<u64, WriteRefusal> {
    let same_body = found.digest.is_none_or(|d| d == *digest);
    if found.key == key && same_body {
        Ok(found.revision)
    } else {
        Err(WriteRefusal::OpReused {
            key: found.key.clone(),
            revision: found.revision,
            other_body: found.key == key,
        })
    }
}

/// Decides a write of `digest` before publishing, from its ledger row in the current life (if
/// any, [`super::row_of_life`]) and the ledger's watermark (0: the ledger never lost a row).
/// `now_unix_ms` bounds the id's mint instant ([`super::MAX_OP_ID_SKEW_MS`]) and the watermark
/// ([`super::effective_watermark`]).
pub fn admit_write(
    op: &OpId,
    key: &str,
    digest: &WriteDigest,
    row: Option<&LedgerRow>,
    watermark_unix_ms: u64,
    now_unix_ms: u64,
) -> Admission {
    if let Some(row) = row {
        let found = Landed {
            revision: row.revision,
            key: row.key.clone(),
            digest: row.digest,
        };
        return match same_write(key, digest, &found) {
            Ok(revision) => Admission::Landed { revision },
            Err(r) => Admission::Refused(r),
        };
    }
    let minted = op.minted_unix_ms();
    if minted > now_unix_ms.saturating_add(super::MAX_OP_ID_SKEW_MS) {
        return Admission::Refused(WriteRefusal::Invalid {
            what: format!(
                "op_id {op} was minted {} ms in this host's future",
                minted - now_unix_ms
            ),
        });
    }
    let watermark = super::effective_watermark(watermark_unix_ms, now_unix_ms);
    if watermark > 0 && minted <= watermark {
        return Admission::Unknown(UnknownWhy::BeforeWatermark {
            minted_unix_ms: minted,
            watermark_unix_ms: watermark,
        });
    }
    Admission::Publish
}

/// An acknowledged publish of `digest` on `key` at `sequence`: when the broker collapsed it onto
/// an earlier record (its duplicate window), `landed` is that record, and it must be the same
/// write ([`same_write`]). Otherwise the record is durable at `sequence`.
pub fn after_ack(
    key: &str,
    digest: &WriteDigest,
    sequence: u64,
    landed: Option<&Landed>,
) -> Result<u64, WriteRefusal> {
    match landed {
        Some(found) => same_write(key, digest, found),
        None => Ok(sequence),
    }
}

/// A publish of `digest` on `key` whose acknowledgement was lost, resolved from the newest record
/// on the key's subject (`newest`: the record and the id it carries): its revision when it carries
/// this operation's id and is the same write, a refusal when it carries the id with another body,
/// unknown otherwise, or when the log could not be read (`newest` is `Err`).
pub fn resolve_lost_ack(
    op: &OpId,
    key: &str,
    digest: &WriteDigest,
    newest: Result<Option<(Landed, Option<OpId>)>, String>,
) -> Result<Result<u64, WriteRefusal>, UnknownWhy> {
    match newest {
        Ok(Some((found, Some(id)))) if id == *op => Ok(same_write(key, digest, &found)),
        Ok(_) => Err(UnknownWhy::NotNewest),
        Err(e) => Err(UnknownWhy::LogUnreadable(e)),
    }
}

/// How far a fold is behind a revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lag {
    /// Records between what the fold has applied and the revision.
    pub records: u64,
    /// An estimate of the seconds the fold needs to apply them, from its measured rate (at least
    /// 1, at most [`MAX_RETRY_AFTER_SECONDS`]).
    pub seconds: u64,
}

/// A durable write's outcome on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Applied by this fold: a read here sees it.
    Applied {
        /// Its revision.
        revision: u64,
    },
    /// Durable, not yet applied here: do not retry.
    Pending {
        /// Its revision.
        revision: u64,
        /// How far behind it this fold is.
        lag: Lag,
    },
}

/// The outcome of a record durable at `revision`, with the fold applied through
/// `applied_through` and applying `rate_per_s` records a second.
pub fn outcome_at(revision: u64, applied_through: u64, rate_per_s: f64) -> Outcome {
    if applied_through >= revision {
        Outcome::Applied { revision }
    } else {
        Outcome::Pending {
            revision,
            lag: lag_to(revision, applied_through, rate_per_s),
        }
    }
}

/// The lag from `applied_through` to `revision` (records, and seconds at `rate_per_s`).
pub fn lag_to(revision: u64, applied_through: u64, rate_per_s: f64) -> Lag {
    let records = revision.saturating_sub(applied_through);
    Lag {
        records,
        seconds: retry_after_seconds(records, rate_per_s),
    }
}

/// The seconds to wait before asking again with `records` to apply at `rate_per_s`: at least 1,
/// at most [`MAX_RETRY_AFTER_SECONDS`] (a fold applying nothing is asked again at the longest).
pub fn retry_after_seconds(records: u64, rate_per_s: f64) -> u64 {
    if !(rate_per_s.is_finite() && rate_per_s > 0.0) {
        return MAX_RETRY_AFTER_SECONDS;
    }
    let secs = (records as f64 / rate_per_s).ceil();
    if secs >= MAX_RETRY_AFTER_SECONDS as f64 {
        MAX_RETRY_AFTER_SECONDS
    } else {
        (secs as u64).max(1)
    }
}

/// How long a write (or a read) waits: the asked `wait_ms`, or [`DEFAULT_WRITE_WAIT_MS`]; more
/// than [`MAX_WRITE_WAIT_MS`] is refused.
pub fn write_wait_ms(asked: Option<u64>) -> Result<u64, WriteRefusal> {
    match asked {
        None => Ok(DEFAULT_WRITE_WAIT_MS),
        Some(ms) if ms <= MAX_WRITE_WAIT_MS => Ok(ms),
        Some(ms) => Err(WriteRefusal::Invalid {
            what: format!("wait_ms {ms} is over the limit of {MAX_WRITE_WAIT_MS}"),
        }),
    }
}

/// The minimum revision a read asks for, from its [`MIN_REVISION_HEADER`] (absent: none). A value
/// that is not a decimal revision is refused, naming it.
pub fn parse_min_revision(header: Option<&str>) -> Result<Option<u64>, String> {
    match header.map(str::trim) {
        None => Ok(None),
        Some(v) => v
            .parse::<u64>()
            .map(Some)
            .map_err(|_| format!("{MIN_REVISION_HEADER}: {v:?} is not a revision")),
    }
}

/// A read's bound on its wait, from its [`WAIT_MS_HEADER`]: [`READ_WAIT_MS`] when absent; one
/// that is not a number of milliseconds, or is over [`MAX_WRITE_WAIT_MS`], is refused.
pub fn parse_read_wait(header: Option<&str>) -> Result<u64, String> {
    match header.map(str::trim) {
        None => Ok(READ_WAIT_MS),
        Some(v) => match v.parse::<u64>() {
            Ok(ms) if ms <= MAX_WRITE_WAIT_MS => Ok(ms),
            _ => Err(format!(
                "{WAIT_MS_HEADER}: {v:?} is not a wait of at most {MAX_WRITE_WAIT_MS} ms"
            )),
        },
    }
}

/// Whether a read that must see `min_revision` may be answered with the fold applied through
/// `applied_through`: `Ok` when it may, else the lag to tell the caller (its `seconds` is the
/// `retry_after_seconds`).
pub fn read_gate(min_revision: u64, applied_through: u64, rate_per_s: f64) -> Result<(), Lag> {
    if applied_through >= min_revision {
        Ok(())
    } else {
        Err(lag_to(min_revision, applied_through, rate_per_s))
    }
}

/// The sweep's cutoff: rows recorded before it go.
pub fn ledger_cutoff(now_unix_ms: u64, retention_ms: u64) -> u64 {
    now_unix_ms.saturating_sub(retention_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::MAX_OP_ID_SKEW_MS;

    /// A UUIDv7 minted at `ms` with `rand` in its random bits.
    fn op(ms: u64, rand: u8) -> OpId {
        let mut b = [rand; 16];
        b[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
        b[6] = 0x70 | (b[6] & 0x0f);
        b[8] = 0x80 | (b[8] & 0x3f);
        OpId::from_bytes(b).expect("a v7")
    }

    fn row(revision: u64, key: &str) -> LedgerRow {
        LedgerRow {
            revision,
            key: key.into(),
            recorded_unix_ms: 7,
            epoch: 0,
            digest: Some(D),
        }
    }

    #[test]
    fn an_op_id_is_a_uuidv7_whose_mint_instant_reads_back() {
        let id = op(1_733_000_000_123, 0xab);
        assert_eq!(id.minted_unix_ms(), 1_733_000_000_123);
        let text = id.to_string();
        assert_eq!(OpId::parse(&text), Ok(id));
        assert_eq!(OpId::parse(&text.to_uppercase()), Ok(id));
        assert_eq!(OpId::parse("not-a-uuid"), Err(OpIdError::NotUuid));
        // A v4 carries no instant.
        assert_eq!(
            OpId::parse("1b4e28ba-2fa1-41d2-883f-0016d3cca427"),
            Err(OpIdError::NotVersion7(4))
        );
    }

    #[test]
    fn a_stored_records_op_id_is_read_from_its_header_and_a_foreign_value_is_none() {
        let id = op(1_733_000_000_000, 3);
        let block = format!("NATS/1.0\r\nKV-Operation: DEL\r\n{OP_ID_HEADER}: {id}\r\n\r\n");
        assert_eq!(
            super::super::decode_stored_record(Some(block.as_bytes())),
            Ok((super::super::KvOp::Delete, Some(id)))
        );
        let foreign =
            format!("NATS/1.0\r\n{OP_ID_HEADER}: 1b4e28ba-2fa1-41d2-883f-0016d3cca427\r\n\r\n");
        assert_eq!(
            super::super::decode_stored_record(Some(foreign.as_bytes())),
            Ok((super::super::KvOp::Put, None))
        );
        assert_eq!(
            super::super::decode_stored_record(None),
            Ok((super::super::KvOp::Put, None))
        );
    }

    const D: WriteDigest = [1; 16];
    const OTHER: WriteDigest = [2; 16];

    fn landed(revision: u64, key: &str, digest: Option<WriteDigest>) -> Landed {
        Landed {
            revision,
            key: key.into(),
            digest,
        }
    }

    #[test]
    fn a_recorded_op_is_answered_from_its_row_and_never_published_again() {
        let id = op(1_000, 1);
        assert_eq!(
            admit_write(&id, "a", &D, Some(&row(5, "a")), 0, 2_000),
            Admission::Landed { revision: 5 }
        );
        // However old it is, and whatever the watermark: the row answers.
        assert_eq!(
            admit_write(&id, "a", &D, Some(&row(5, "a")), 9_999_999, 99_999_999),
            Admission::Landed { revision: 5 }
        );
        // A row of the first format recorded no digest: it answers any body.
        let old = LedgerRow {
            digest: None,
            ..row(5, "a")
        };
        assert_eq!(
            admit_write(&id, "a", &OTHER, Some(&old), 0, 2_000),
            Admission::Landed { revision: 5 }
        );
    }

    #[test]
    fn an_op_id_that_landed_on_another_key_or_with_another_body_is_refused_naming_where() {
        let id = op(1_000, 1);
        assert_eq!(
            admit_write(&id, "b", &D, Some(&row(5, "a")), 0, 2_000),
            Admission::Refused(WriteRefusal::OpReused {
                key: "a".into(),
                revision: 5,
                other_body: false,
            })
        );
        assert_eq!(
            admit_write(&id, "a", &OTHER, Some(&row(5, "a")), 0, 2_000),
            Admission::Refused(WriteRefusal::OpReused {
                key: "a".into(),
                revision: 5,
                other_body: true,
            })
        );
        assert_eq!(
            after_ack("b", &D, 9, Some(&landed(9, "a", Some(D)))),
            Err(WriteRefusal::OpReused {
                key: "a".into(),
                revision: 9,
                other_body: false,
            })
        );
        assert_eq!(
            after_ack("a", &OTHER, 9, Some(&landed(9, "a", Some(D)))),
            Err(WriteRefusal::OpReused {
                key: "a".into(),
                revision: 9,
                other_body: true,
            })
        );
        assert_eq!(after_ack("a", &D, 9, Some(&landed(9, "a", Some(D)))), Ok(9));
        assert_eq!(after_ack("a", &D, 9, None), Ok(9));
    }

    #[test]
    fn an_op_minted_at_or_before_the_watermark_without_a_row_is_unknown_before_publishing() {
        let at = |ms| admit_write(&op(ms, 1), "a", &D, None, 5_000, 10_000);
        assert!(matches!(at(4_999), Admission::Unknown(_)));
        assert!(matches!(at(5_000), Admission::Unknown(_)));
        assert_eq!(at(5_001), Admission::Publish);
        // A ledger that never lost a row (watermark 0) publishes anything new.
        assert_eq!(
            admit_write(&op(1, 1), "a", &D, None, 0, 10_000),
            Admission::Publish
        );
    }

    #[test]
    fn a_watermark_in_the_hosts_future_holds_back_no_fresh_write() {
        // A stored watermark past now (left by a row no write path admits) counts as now.
        let now = 10_000;
        assert_eq!(
            admit_write(&op(now + 1, 1), "a", &D, None, u64::MAX / 2, now),
            Admission::Publish
        );
        assert!(matches!(
            admit_write(&op(now, 1), "a", &D, None, u64::MAX / 2, now),
            Admission::Unknown(UnknownWhy::BeforeWatermark {
                watermark_unix_ms: 10_000,
                ..
            })
        ));
    }

    #[test]
    fn an_op_id_minted_in_the_hosts_future_is_refused() {
        let now = 1_000_000;
        assert_eq!(
            admit_write(&op(now + MAX_OP_ID_SKEW_MS, 1), "a", &D, None, 0, now),
            Admission::Publish
        );
        assert!(matches!(
            admit_write(&op(now + MAX_OP_ID_SKEW_MS + 1, 1), "a", &D, None, 0, now),
            Admission::Refused(WriteRefusal::Invalid { .. })
        ));
    }

    #[test]
    fn a_lost_ack_is_resolved_only_by_a_newest_record_carrying_its_id_and_body() {
        let id = op(1_000, 1);
        let newest = |found: Landed, carried: Option<OpId>| Ok(Some((found, carried)));
        assert_eq!(
            resolve_lost_ack(&id, "a", &D, newest(landed(12, "a", Some(D)), Some(id))),
            Ok(Ok(12))
        );
        assert!(matches!(
            resolve_lost_ack(&id, "a", &OTHER, newest(landed(12, "a", Some(D)), Some(id))),
            Ok(Err(WriteRefusal::OpReused {
                other_body: true,
                ..
            }))
        ));
        assert_eq!(
            resolve_lost_ack(
                &id,
                "a",
                &D,
                newest(landed(12, "a", Some(D)), Some(op(1_000, 2)))
            ),
            Err(UnknownWhy::NotNewest)
        );
        assert_eq!(
            resolve_lost_ack(&id, "a", &D, newest(landed(12, "a", Some(D)), None)),
            Err(UnknownWhy::NotNewest)
        );
        assert_eq!(
            resolve_lost_ack(&id, "a", &D, Ok(None)),
            Err(UnknownWhy::NotNewest)
        );
        assert!(matches!(
            resolve_lost_ack(&id, "a", &D, Err("gone".into())),
            Err(UnknownWhy::LogUnreadable(_))
        ));
    }

    #[test]
    fn a_durable_write_is_applied_only_once_applied_through_reaches_it() {
        assert_eq!(outcome_at(10, 10, 0.0), Outcome::Applied { revision: 10 });
        assert_eq!(outcome_at(10, 11, 0.0), Outcome::Applied { revision: 10 });
        assert_eq!(
            outcome_at(10, 4, 2.0),
            Outcome::Pending {
                revision: 10,
                lag: Lag {
                    records: 6,
                    seconds: 3
                }
            }
        );
    }

    #[test]
    fn retry_after_is_at_least_a_second_and_at_most_the_cap() {
        assert_eq!(retry_after_seconds(1, 1000.0), 1);
        assert_eq!(retry_after_seconds(0, 1000.0), 1);
        assert_eq!(retry_after_seconds(3000, 1000.0), 3);
        assert_eq!(retry_after_seconds(3001, 1000.0), 4);
        assert_eq!(retry_after_seconds(10, 0.0), MAX_RETRY_AFTER_SECONDS);
        assert_eq!(retry_after_seconds(10, f64::NAN), MAX_RETRY_AFTER_SECONDS);
        assert_eq!(retry_after_seconds(u64::MAX, 1.0), MAX_RETRY_AFTER_SECONDS);
    }

    #[test]
    fn a_wait_over_the_limit_is_refused_and_none_is_the_default() {
        assert_eq!(write_wait_ms(None), Ok(DEFAULT_WRITE_WAIT_MS));
        assert_eq!(write_wait_ms(Some(0)), Ok(0));
        assert_eq!(
            write_wait_ms(Some(MAX_WRITE_WAIT_MS)),
            Ok(MAX_WRITE_WAIT_MS)
        );
        assert!(write_wait_ms(Some(MAX_WRITE_WAIT_MS + 1)).is_err());
    }

    #[test]
    fn the_sweeps_cutoff_is_the_retention_before_now() {
        assert_eq!(ledger_cutoff(100, 30), 70);
        assert_eq!(ledger_cutoff(10, 30), 0);
    }

    #[test]
    fn a_read_passes_once_applied_through_reaches_its_minimum_and_is_told_the_lag_before() {
        assert_eq!(read_gate(10, 10, 0.0), Ok(()));
        assert_eq!(read_gate(10, 12, 0.0), Ok(()));
        assert_eq!(
            read_gate(10, 4, 3.0),
            Err(Lag {
                records: 6,
                seconds: 2
            })
        );
        assert_eq!(parse_min_revision(None), Ok(None));
        assert_eq!(parse_min_revision(Some(" 42 ")), Ok(Some(42)));
        assert!(parse_min_revision(Some("-1")).is_err());
        assert!(parse_min_revision(Some("4x")).is_err());
        assert_eq!(parse_read_wait(None), Ok(READ_WAIT_MS));
        assert_eq!(parse_read_wait(Some("0")), Ok(0));
        assert!(parse_read_wait(Some("60001")).is_err());
        assert!(parse_read_wait(Some("soon")).is_err());
    }
}
