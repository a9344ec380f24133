//! The operation ledger (docs/writes.md, "The operation ledger"): which operation's record landed
//! where, kept in the fold's reserved key space so it commits with the data and the cursor and
//! travels inside artifacts.
//!
//! Invariants:
//! - **A row commits with its record.** The fold writes a row ([`row_put`]) in the very commit
//!   that moves its cursor over the record's revision, so a fold that holds a record's revision
//!   holds its row, and a restart, a restore or a bootstrap carries both or neither.
//! - **Rows only go by the sweep, and the sweep leaves a watermark.** A row leaves only when
//!   [`sweep_step`] finds it recorded before the cutoff, in the same commit that raises the watermark
//!   ([`WATERMARK_KEY`]) to the newest mint instant it removed: an operation minted at or before
//!   the watermark with no row may have been swept ([`crate::protocol::admit_write`]).
//! - **A row answers only in its life.** [`lookup`] reads the row with the ledger's life
//!   ([`LIFE_KEY`]) from one view of the store, and a row of an earlier life is no answer.
//! - **Bounded and checked.** A row that does not decode is never an answer: it reads as an error
//!   naming its key.

use std::ops::ControlFlow;

use bytes::Bytes;

use crate::kv::{KvEntry, KvUpdate, VersionToken};
use crate::protocol::{LedgerLife, LedgerRow, OpId};
use crate::snapshot::{SnapshotError, SnapshotStore};

/// Where rows live: `LEDGER_PREFIX` + the operation id's text (time-ordered).
pub const LEDGER_PREFIX: &str = "\u{1}op/";

/// The ledger's watermark: Unix milliseconds, 8 bytes big-endian (absent: 0, nothing swept).
pub const WATERMARK_KEY: &str = "\u{1}op-watermark";

/// The ledger's life ([`LedgerLife`]: its epoch and horizon; absent: epoch 0, complete).
pub const LIFE_KEY: &str = "\u{1}op-life";

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

/// The ledger's life (epoch 0 and no horizon when none was ever recorded).
pub fn read_life<S: SnapshotStore + ?Sized>(store: &S) -> Result<LedgerLife, LedgerError> {
    match store.get(LIFE_KEY)? {
        None => Ok(LedgerLife::default()),
        Some(e) => LedgerLife::decode(&e.value).ok_or_else(|| LedgerError::Corrupt {
            key: LIFE_KEY.into(),
            reason: format!("{} bytes, not 12", e.value.len()),
        }),
    }
}

/// The store update that records the ledger's life.
pub fn life_put(life: &LedgerLife) -> KvUpdate {
    KvUpdate::Put(KvEntry {
        key: LIFE_KEY.into(),
        value: Bytes::copy_from_slice(&life.encode()),
        version: VersionToken::UNKNOWN,
    })
}

/// What the write path reads of the ledger for one operation, from one view of the store: its row
/// in the current life (a row of an earlier life answers nothing), the watermark and the life.
pub fn lookup<S: SnapshotStore + ?Sized>(
    store: &S,
    op: &OpId,
) -> Result<(Option<LedgerRow>, u64, LedgerLife), LedgerError> {
    let life = read_life(store)?;
    let row = read_row(store, op)?;
    let row = if crate::crashpoint::mutated(crate::crashpoint::MUTATION_STALE_ROW) {
        row
    } else {
        crate::protocol::row_of_life(row, life)
    };
    Ok((row, read_watermark(store)?, life))
}

/// The store update that sets the watermark.
pub fn watermark_put(unix_ms: u64) -> KvUpdate {
    KvUpdate::Put(KvEntry {
        key: WATERMARK_KEY.into(),
        value: Bytes::copy_from_slice(&unix_ms.to_be_bytes()),
        version: VersionToken::UNKNOWN,
    })
}

/// Most rows one sweep step reads: a sweep runs in steps of at most this many, each one commit
/// between two batches of the fold, so a ledger of millions of rows never holds the fold for
/// longer than one step.
pub const SWEEP_STEP: usize = 4096;

/// One step of a sweep at `now_unix_ms`: of at most [`SWEEP_STEP`] rows after `after` (`None`:
/// from the first), the ones recorded before `cutoff_unix_ms`, and the watermark's update, as
/// store updates for one commit; and the key to resume after (`None`: the sweep is done). Rows
/// that do not decode are removed too (they answer nothing), and count their id's instant; the
/// watermark never passes `now_unix_ms` ([`crate::protocol::watermark_after_sweep`]).
pub fn sweep_step<S: SnapshotStore + ?Sized>(
    store: &S,
    cutoff_unix_ms: u64,
    now_unix_ms: u64,
    after: Option<&str>,
) -> Result<(Vec<KvUpdate>, Option<String>), LedgerError> {
    let mut out = Vec::new();
    let mut minted_max: Option<u64> = None;
    let mut read = 0usize;
    let mut last: Option<String> = None;
    store.for_each_in_range_after(LEDGER_PREFIX, after, &mut |e| {
        read += 1;
        last = Some(e.key.clone());
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
        if read >= SWEEP_STEP {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })?;
    if !out.is_empty() {
        let old = read_watermark(store)?;
        let new = crate::protocol::watermark_after_sweep(old, minted_max, now_unix_ms);
        if new != old {
            out.push(watermark_put(new));
        }
    }
    let next = if read >= SWEEP_STEP { last } else { None };
    Ok((out, next))
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
