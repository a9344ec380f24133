//! The operation ledger's rules (docs/writes.md, "The operation ledger" and "When a node cannot
//! vouch for an id"): what a row holds, which records may leave one, the ledger's life (which
//! bucket incarnation its rows belong to, and the horizon back to which they are complete), the
//! watermark a sweep leaves, and whether a retry with no row may be published.
//!
//! Invariants:
//! - **Only an id a host could have admitted leaves a row.** A record whose id claims a mint
//!   instant further past its own stored time than [`MAX_OP_ID_SKEW_MS`] (no write path admits
//!   one) leaves none ([`row_admitted`]), so no bucket writer can move the watermark ahead of
//!   time; and no sweep moves it past its own clock ([`watermark_after_sweep`]).
//! - **A row answers only for its life.** Rows carry the ledger's life ([`LedgerLife::epoch`]); a
//!   re-fold of a recreated or diverged bucket starts a new life, and a row of an earlier one
//!   answers nothing ([`row_of_life`]).
//! - **An id names one write.** A row carries the digest of the write it recorded (the operation
//!   and the value, [`write_digest`]); the same id with another body is refused, never answered as
//!   the first write.
//! - **No publish the ledger cannot vouch for.** A retry with no row is published only when every
//!   copy it may have left is either covered by the rows (stored after the horizon, at or below
//!   the cursor) or still inside the broker's duplicate window on a key none of whose records
//!   stored since can have been removed ([`vouch_retry`]): the broker rebuilds its window after a
//!   restart only from the records it stores.

use super::{KvOp, OpId};

/// How far in the future (by this host's clock) an operation id may have been minted: further,
/// and it is refused as invalid. It is also what bounds, from an id alone, how long before its
/// mint instant its record can have been stored: it must stay well inside the broker's duplicate
/// window (two minutes by default) for a fresh id to be vouched for right after a re-list.
pub const MAX_OP_ID_SKEW_MS: u64 = 30 * 1000;

/// The digest of a write's body: what, besides its key, an operation id names.
pub type WriteDigest = [u8; 16];

/// The digest of a write: its operation and, for a put, its value (BLAKE3, first 16 bytes).
pub fn write_digest(op: KvOp, value: &[u8]) -> WriteDigest {
    let mut h = blake3::Hasher::new();
    match op {
        KvOp::Put => {
            h.update(b"put\0");
            h.update(value);
        }
        KvOp::Delete => {
            h.update(b"del\0");
        }
        KvOp::Purge => {
            h.update(b"purge\0");
        }
    }
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    out
}

/// One row of the operation ledger: where an operation's record landed, what it wrote, in which
/// life of the ledger, and when this fold (or the donor whose fold it adopted) recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerRow {
    /// The record's revision.
    pub revision: u64,
    /// The key it was written to.
    pub key: String,
    /// When the fold recorded it, Unix milliseconds (the sweep counts the retention from here).
    pub recorded_unix_ms: u64,
    /// The ledger's life it was recorded in ([`LedgerLife::epoch`]; 0 for rows of the first
    /// format).
    pub epoch: u32,
    /// The digest of the write ([`write_digest`]; `None` for rows of the first format, which
    /// recorded none).
    pub digest: Option<WriteDigest>,
}

/// The first row format's version byte: `[1][revision][recorded][key]`.
const LEDGER_ROW_V1: u8 = 1;
/// The current one: `[2][revision][recorded][epoch u32][digest 16][key]`.
const LEDGER_ROW_V2: u8 = 2;

/// Why stored bytes are not a ledger row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LedgerRowError {
    /// Shorter than the fixed part, or of another format version.
    #[error("not a ledger row (format or length)")]
    Format,
    /// A key that is not UTF-8.
    #[error("a ledger row whose key is not UTF-8")]
    Key,
}

impl LedgerRow {
    /// `[2][revision u64 BE][recorded_unix_ms u64 BE][epoch u32 BE][digest 16][key UTF-8]`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(37 + self.key.len());
        out.push(LEDGER_ROW_V2);
        out.extend_from_slice(&self.revision.to_be_bytes());
        out.extend_from_slice(&self.recorded_unix_ms.to_be_bytes());
        out.extend_from_slice(&self.epoch.to_be_bytes());
        out.extend_from_slice(&self.digest.unwrap_or([0; 16]));
        out.extend_from_slice(self.key.as_bytes());
        out
    }

    /// The row these bytes encode ([`LedgerRow::encode`], or the first format).
    pub fn decode(bytes: &[u8]) -> Result<LedgerRow, LedgerRowError> {
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_be_bytes(b)
        };
        let (epoch, digest, key_at) = match bytes.first() {
            Some(&LEDGER_ROW_V1) if bytes.len() >= 17 => (0, None, 17),
            Some(&LEDGER_ROW_V2) if bytes.len() >= 37 => {
                let mut e = [0u8; 4];
                e.copy_from_slice(&bytes[17..21]);
                let mut d = [0u8; 16];
                d.copy_from_slice(&bytes[21..37]);
                (u32::from_be_bytes(e), Some(d), 37)
            }
            _ => return Err(LedgerRowError::Format),
        };
        let key = std::str::from_utf8(&bytes[key_at..]).map_err(|_| LedgerRowError::Key)?;
        Ok(LedgerRow {
            revision: u64_at(1),
            key: key.to_string(),
            recorded_unix_ms: u64_at(9),
            epoch,
            digest,
        })
    }
}

/// The ledger's life: which incarnation of the bucket its rows belong to, and how far back they
/// are complete.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerLife {
    /// Raised by each re-fold of a recreated or diverged bucket: rows of another epoch answer
    /// nothing.
    pub epoch: u32,
    /// Records stored at or before this instant (Unix ms, this host's clock) may have been passed
    /// without a row: a state-sync start or a re-list delivers only each key's newest record
    /// (0: the rows are complete back to the stream's start).
    pub horizon_unix_ms: u64,
}

impl LedgerLife {
    /// `[epoch u32 BE][horizon u64 BE]`.
    pub fn encode(&self) -> [u8; 12] {
        let mut out = [0u8; 12];
        out[..4].copy_from_slice(&self.epoch.to_be_bytes());
        out[4..].copy_from_slice(&self.horizon_unix_ms.to_be_bytes());
        out
    }

    /// The life these bytes encode; `None` when they are not 12 bytes.
    pub fn decode(bytes: &[u8]) -> Option<LedgerLife> {
        let b: [u8; 12] = bytes.try_into().ok()?;
        let mut e = [0u8; 4];
        e.copy_from_slice(&b[..4]);
        let mut h = [0u8; 8];
        h.copy_from_slice(&b[4..]);
        Some(LedgerLife {
            epoch: u32::from_be_bytes(e),
            horizon_unix_ms: u64::from_be_bytes(h),
        })
    }

    /// The life after a state-sync passed records without rows at `now_unix_ms`: the horizon
    /// moves up to now (never back).
    pub fn passed_without_rows(self, now_unix_ms: u64) -> LedgerLife {
        LedgerLife {
            horizon_unix_ms: self.horizon_unix_ms.max(now_unix_ms),
            ..self
        }
    }

    /// The life of a fold re-folded from a recreated or diverged bucket: a new epoch (every row
    /// so far answers nothing), the horizon at now.
    pub fn new_incarnation(self, now_unix_ms: u64) -> LedgerLife {
        LedgerLife {
            epoch: self.epoch.wrapping_add(1),
            horizon_unix_ms: self.horizon_unix_ms.max(now_unix_ms),
        }
    }
}

/// Whether a record carrying `op`, stored at `stored_unix_ms` (0: unknown, then `recorded_unix_ms`
/// stands in), may leave a ledger row: only when its id's mint instant is not further past the
/// record's time than a write path could have admitted ([`MAX_OP_ID_SKEW_MS`], with a margin for
/// the host's and the broker's clocks). A row of any other id would let
/// one raw record carry the watermark into the future.
pub fn row_admitted(op: &OpId, stored_unix_ms: u64, recorded_unix_ms: u64) -> bool {
    let at = if stored_unix_ms > 0 {
        stored_unix_ms
    } else {
        recorded_unix_ms
    };
    // Twice the admission's bound: a host whose clock runs ahead of the broker's may admit an id
    // a little further past the record's stored time than its own bound.
    op.minted_unix_ms() <= at.saturating_add(2 * MAX_OP_ID_SKEW_MS)
}

/// Whether a commit moving the cursor from `before` to `through` over the delivered `revisions`
/// passes a revision it was never delivered: its record, and any operation id it carried, leaves
/// no ledger row.
pub fn passes_unseen(before: u64, revisions: impl IntoIterator<Item = u64>, through: u64) -> bool {
    let (skipped, next) = super::first_unseen(before.saturating_add(1), revisions);
    skipped.is_some() || next <= through
}

/// `row` as an answer in `life`: a row of another epoch (a previous incarnation of the bucket)
/// answers nothing.
pub fn row_of_life(row: Option<LedgerRow>, life: LedgerLife) -> Option<LedgerRow> {
    row.filter(|r| r.epoch == life.epoch)
}

/// The watermark after a sweep at `now_unix_ms` removed rows minted at most `swept_minted_max`
/// (`None`: it removed none): every operation minted at or before it may have lost its row. It
/// never moves back, and never past the sweep's own clock.
pub fn watermark_after_sweep(
    watermark_unix_ms: u64,
    swept_minted_max: Option<u64>,
    now_unix_ms: u64,
) -> u64 {
    watermark_unix_ms.max(swept_minted_max.unwrap_or(0).min(now_unix_ms))
}

/// The watermark an admission compares with: the stored one, but never past `now_unix_ms` (a
/// stored watermark in the future was left by a row no write path admits, and would answer every
/// write unknown).
pub fn effective_watermark(stored_unix_ms: u64, now_unix_ms: u64) -> u64 {
    stored_unix_ms.min(now_unix_ms)
}

/// What the fold's rows cover, as a retry is judged against them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coverage {
    /// The fold's committed cursor, read before the ledger was: every record at or below it that
    /// could leave a row has one (in the current life, after the horizon).
    pub cursor: u64,
    /// The ledger's life.
    pub life: LedgerLife,
}

/// Whether a retry with no row may be published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vouch {
    /// Every copy it may have left is covered by the rows or inside the broker's window.
    Publish,
    /// A copy may be among the records the fold passed without rows (at or before the horizon)
    /// and outside the broker's window: nothing can vouch for it here.
    Unvouched {
        /// Its mint instant.
        minted_unix_ms: u64,
        /// The ledger's horizon.
        horizon_unix_ms: u64,
    },
    /// A copy may be on the key past what the fold has passed, outside the broker's window:
    /// retry once the fold is level.
    FoldBehind,
}

/// What the broker's duplicate window can vouch for on one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowSeen {
    /// The stream's duplicate window, read from the stream.
    pub window_ms: u64,
    /// When the key's oldest stored record was stored, Unix milliseconds (`None`: the key has no
    /// record).
    pub oldest_on_key_unix_ms: Option<u64>,
    /// When the stream's oldest stored record was stored, Unix milliseconds (`u64::MAX`: the
    /// stream is empty, or its time cannot be read).
    pub stream_first_unix_ms: u64,
}

/// Judges a retry of `op` on a key whose newest record is at `key_newest` (`None`: the key has no
/// record) that the ledger has no row for. A copy of it, if any, was stored no earlier than its
/// mint instant less [`MAX_OP_ID_SKEW_MS`] (twice that on the broker's clock, whose distance from
/// the host's the same bound covers).
///
/// The broker collapses a second publish onto a copy stored within its duplicate window — but it
/// rebuilds what it remembers, after a restart, only from the records it still stores. So
/// `window` (`None`: no window at all, the rows alone judge) vouches for the retry only when it
/// was minted within half the window of now *and* no record of the key stored since its earliest
/// copy can have been removed: the key's oldest stored record predates that copy (a key's records
/// go oldest first, whether superseded past the bucket's history, aged out, evicted by the
/// stream's limits or purged under a marker). A key with no record at all may have lost its last
/// one to the stream's limits or to a rollup of the whole stream, both of which remove the
/// stream's oldest records first: there the stream's oldest record must predate the copy. A
/// record removed by hand (a message deleted, a subject purged with the stream's own API) leaves
/// no trace here, nor does one removed between this judgement and the publish.
///
/// The bounds assume the broker's clock within [`MAX_OP_ID_SKEW_MS`] of the host's.
pub fn vouch_retry(
    op: &OpId,
    now_unix_ms: u64,
    window: Option<WindowSeen>,
    key_newest: Option<u64>,
    covered: Coverage,
) -> Vouch {
    let earliest = op.minted_unix_ms().saturating_sub(MAX_OP_ID_SKEW_MS);
    if let Some(w) = window
        && earliest > now_unix_ms.saturating_sub(w.window_ms / 2)
        && w.oldest_on_key_unix_ms.unwrap_or(w.stream_first_unix_ms)
            < earliest.saturating_sub(MAX_OP_ID_SKEW_MS)
    {
        return Vouch::Publish;
    }
    if covered.life.horizon_unix_ms > 0 && earliest <= covered.life.horizon_unix_ms {
        return Vouch::Unvouched {
            minted_unix_ms: op.minted_unix_ms(),
            horizon_unix_ms: covered.life.horizon_unix_ms,
        };
    }
    if key_newest.is_some_and(|n| n > covered.cursor) {
        return Vouch::FoldBehind;
    }
    Vouch::Publish
}

/// Whether the broker itself refuses a second copy of a compare-and-set conditioned on
/// `if_revision` on a key whose newest record is at `key_newest` (`None`: it has none), whatever
/// its duplicate window remembers: a first copy that landed moved the key's last revision past
/// `if_revision` for good (revisions only grow, and a key emptied by expiry answers 0, never a
/// revision it held). A condition of 0 (a create: no record) holds again once the key has no
/// record, which can happen between any read and the publish, so a create is vouched for like
/// any write. Such a retry is published without a vouch: the refusal is judged by
/// [`after_conflict`].
pub fn broker_refuses_a_second_copy(if_revision: Option<u64>) -> bool {
    if_revision.is_some_and(|r| r > 0)
}

/// What a compare-and-set the broker refused answers (the key's last revision was not the one it
/// asked for). The broker checks the revision before its duplicate window, so a retry of a
/// compare-and-set whose first copy landed is refused by it like any stale write: the first copy
/// is found where it must be if it landed — the key's first record after `if_revision` — or
/// judged by what the rows cover.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterConflict {
    /// The record after `if_revision` is this operation's, the same write: answered as it.
    Landed(u64),
    /// Refused: a conflict naming the key's revision, or the id reused.
    Refused(super::WriteRefusal),
    /// Nothing can establish whether its first copy landed.
    Unknown(super::UnknownWhy),
}

/// What the log shows a refused compare-and-set.
#[derive(Debug, Clone, Copy)]
pub struct ConflictSeen<'a> {
    /// The key's revision now (`None`: it has no record).
    pub current: Option<u64>,
    /// The key's first record after the revision it asked for, and the id it carries.
    pub successor: Option<&'a (super::Landed, Option<OpId>)>,
    /// Nothing before that record can have been removed (the record at the revision it asked for
    /// is still on the key).
    pub successor_known: bool,
}

/// Judges a compare-and-set of `op` (`digest` on `key`) the broker refused: `retry` when the
/// caller gave the id (a host-minted one is a first attempt); `seen` what the log shows;
/// `rows` the ledger's judgement with no duplicate window at all ([`vouch_retry`] with none).
pub fn after_conflict(
    op: &OpId,
    key: &str,
    digest: &WriteDigest,
    retry: bool,
    seen: ConflictSeen<'_>,
    rows: Vouch,
) -> AfterConflict {
    let ConflictSeen {
        current,
        successor,
        successor_known,
    } = seen;
    if let Some((found, Some(id))) = successor
        && id == op
    {
        return match super::same_write(key, digest, found) {
            Ok(revision) => AfterConflict::Landed(revision),
            Err(r) => AfterConflict::Refused(r),
        };
    }
    let conflict = AfterConflict::Refused(super::WriteRefusal::Conflict { current });
    if !retry || successor_known {
        return conflict;
    }
    match rows {
        Vouch::Publish => conflict,
        Vouch::FoldBehind => AfterConflict::Unknown(super::UnknownWhy::FoldBehind),
        Vouch::Unvouched {
            minted_unix_ms,
            horizon_unix_ms,
        } => AfterConflict::Unknown(super::UnknownWhy::Unvouched {
            minted_unix_ms,
            horizon_unix_ms,
        }),
    }
}

#[cfg(test)]
#[path = "ledger_tests.rs"]
mod tests;
