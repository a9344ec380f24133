//! The operation ledger (docs/writes.md, "The operation ledger"): which operation's record landed
//! where, kept in the fold's reserved key space so it commits with the data and the cursor and
//! travels inside artifacts.
//!
//! Invariants:
//! - **A row commits with its record.** The fold writes a row ([`row_put`]) in the very commit
//!   that moves its cursor over the record's revision, so a fold that holds a record's revision
//!   holds its row, and a restart, a restore or a bootstrap carries both or neither.
//! - **Rows only go by the sweep, and the sweep leaves a watermark.** A row leaves only when
//!   [`sweep`] finds it recorded before the cutoff, in the same commit that raises the watermark
//!   ([`WATERMARK_KEY`]) to the newest mint instant it removed: an operation minted at or before
//!   the watermark with no row may have been swept ([`crate::protocol::admit_write`]).
//! - **Bounded and checked.** A row that does not decode is never an answer: it reads as an error
//!   naming its key.

use std::ops::ControlFlow;

use bytes::Bytes;

use crate::kv::{KvEntry, KvUpdate, VersionToken};
use crate::protocol::{LedgerRow, OpId};
use crate::snapshot::{SnapshotError, SnapshotStore};

/// Where rows live: `LEDGER_PREFIX` + the operation id's text (time-ordered).
pub const LEDGER_PREFIX: &str = "\u{1}op/";

/// The ledger's watermark: Unix milliseconds, 8 bytes big-endian (absent: 0, nothing swept).
pub const WATERMARK_KEY: &str = "\u{1}op-watermark";

/// The store key of `op`'s row.
pub fn row_key(op: &OpId) -> String {
    format!("{LEDGER_PREFIX}{op}")
}

/// The store update that writes `op`'s row (reserved key, unknown version: it never moves the
/// cursor).
pub fn row_put(op: &OpId, row: &LedgerRow) -> KvUpdate {
    KvUpdate::Put(KvEntry {
        key: row_key(op),
        value: Bytes::from(row.encode()),
        version: VersionToken::UNKNOWN,
    })
}

/// Why the ledger could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] SnapshotError),
    /// A stored row or watermark that does not decode.
    #[error("ledger entry {key:?}: {reason}")]
    Corrupt {
        /// Its store key.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

/// `op`'s row, if the ledger holds one.
pub fn read_row<S: SnapshotStore + ?Sized>(
    store: &S,
    op: &OpId,
) -> Result<Option<LedgerRow>, LedgerError> {
    let key = row_key(op);
    match store.get(&key)? {
        None => Ok(None),
        Some(e) => LedgerRow::decode(&e.value)
            .map(Some)
            .map_err(|err| LedgerError::Corrupt {
                key,
                reason: err.to_string(),
            }),
    }
}

/// The watermark (0 when nothing was ever swept).
pub fn read_watermark<S: SnapshotStore + ?Sized>(store: &S) -> Result<u64, LedgerError> {
    match store.get(WATERMARK_KEY)? {
        None => Ok(0),
        Some(e) => {
            let bytes: [u8; 8] = e
                .value
                .as_ref()
                .try_into()
                .map_err(|_| LedgerError::Corrupt {
                    key: WATERMARK_KEY.into(),
                    reason: format!("{} bytes, not 8", e.value.len()),
                })?;
            Ok(u64::from_be_bytes(bytes))
        }
    }
}

/// The store update that sets the watermark.
pub fn watermark_put(unix_ms: u64) -> KvUpdate {
    KvUpdate::Put(KvEntry {
        key: WATERMARK_KEY.into(),
        value: Bytes::copy_from_slice(&unix_ms.to_be_bytes()),
        version: VersionToken::UNKNOWN,
    })
}

/// The rows a sweep at `cutoff_unix_ms` removes, and the watermark's update, as store updates for
/// one commit (empty when nothing is due). Rows that do not decode are removed too (they answer
/// nothing), and count their id's instant.
pub fn sweep<S: SnapshotStore + ?Sized>(
    store: &S,
    cutoff_unix_ms: u64,
) -> Result<Vec<KvUpdate>, LedgerError> {
    let mut out = Vec::new();
    let mut minted_max: Option<u64> = None;
    store.for_each_in_range(LEDGER_PREFIX, &mut |e| {
        let due = LedgerRow::decode(&e.value).map_or(true, |r| r.recorded_unix_ms < cutoff_unix_ms);
        if due {
            let minted = e
                .key
                .strip_prefix(LEDGER_PREFIX)
                .and_then(|id| OpId::parse(id).ok())
                .map_or(u64::MAX, |op| op.minted_unix_ms());
            // A row whose key is not an id answers nothing either; it cannot say its instant, so
            // the watermark does not move for it.
            if minted != u64::MAX {
                minted_max = Some(minted_max.unwrap_or(0).max(minted));
            }
            out.push(KvUpdate::Delete {
                key: e.key.clone(),
                version: VersionToken::UNKNOWN,
            });
        }
        ControlFlow::Continue(())
    })?;
    if !out.is_empty() {
        let old = read_watermark(store)?;
        let new = crate::protocol::watermark_after_sweep(old, minted_max);
        if new != old {
            out.push(watermark_put(new));
        }
    }
    Ok(out)
}

/// How many rows the ledger holds.
pub fn rows<S: SnapshotStore + ?Sized>(store: &S) -> Result<u64, LedgerError> {
    let mut n = 0u64;
    store.for_each_in_range(LEDGER_PREFIX, &mut |_| {
        n += 1;
        ControlFlow::Continue(())
    })?;
    Ok(n)
}
