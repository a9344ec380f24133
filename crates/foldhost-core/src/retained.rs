//! Retained records: updates a guest answered `defer` for (it cannot decode them), kept durably in
//! the fold until a guest version that can decode them is running (docs/design.md, "Deferral").
//!
//! Invariants:
//! - **In the store, atomically with the batch.** A retained record lives under a reserved key
//!   ([`RETAINED_PREFIX`] + revision + key) in the same store as the fold, written by the same
//!   `apply` that commits its batch and moves the cursor over it. A restart therefore finds every
//!   record the cursor covers either applied or retained, never neither. Reserved keys start with
//!   `\x01`; a bucket key starting so is skipped at the fold's edge
//!   ([`crate::protocol::bucket_key_admitted`]), so none of them comes from a bucket. They carry the
//!   unknown version, so they never mint or move the cursor.
//! - **A key's applied history is a prefix of its log.** Once a key has a retained record, every
//!   later update of that key is retained too (the host holds it back before `parse`), until the
//!   retained ones are released in log order.
//! - **The guest's view is what it applied.** The fold keeps each key's *latest* raw value (so
//!   `dump` always equals the bucket). For a blocked key the guest must see the value it last
//!   applied instead, so the first retained record of a key (its *head*) carries that *base*: the
//!   key's entry just before the record (or none). Guest reads and hydration show the base for
//!   blocked keys ([`crate::view::FoldRead`] on [`crate::view::SharedStore`]), and never a
//!   reserved key.
//! - **Bounded and checked.** A record is decoded with every length checked against what is left.
//!   A record that does not decode (or has no head) cannot have been written by a host: it is set
//!   aside as forged with a warning naming its key, never used, and deleted by the fold at start.

use std::collections::BTreeMap;
use std::ops::ControlFlow;

use bytes::Bytes;

use crate::kv::{KvEntry, KvUpdate, VersionToken};
use crate::snapshot::{SnapshotError, SnapshotStore};

pub use crate::snapshot::{RESERVED_PREFIX, is_reserved};

/// Where the fold records which stream it folds ([`crate::kv::StreamIdentity`]): one reserved
/// key, committed with the fold's first cursor and replaced only by a reset for a recreated
/// stream (`--on-recreated relist`).
pub const IDENTITY_KEY: &str = "\u{1}identity";

/// The fold's checkpoint: a revision at or below its cursor and when the server stored the record
/// there (Unix ns), 16 bytes big-endian, committed with the batch whose cursor covers it. At a
/// start the log's record at that revision must have the same time
/// ([`crate::protocol::checkpoint_verdict`]).
pub const CHECKPOINT_KEY: &str = "\u{1}checkpoint";

/// The store update that records the checkpoint.
pub fn checkpoint_put(revision: u64, stored_unix_ns: u64) -> KvUpdate {
    let mut value = revision.to_be_bytes().to_vec();
    value.extend_from_slice(&stored_unix_ns.to_be_bytes());
    KvUpdate::Put(KvEntry {
        key: CHECKPOINT_KEY.into(),
        value: Bytes::from(value),
        version: VersionToken::UNKNOWN,
    })
}

/// The checkpoint a store records (`None`: none, or bytes that are not one).
pub fn read_checkpoint<S: SnapshotStore + ?Sized>(
    store: &S,
) -> Result<Option<(u64, u64)>, SnapshotError> {
    Ok(store.get(CHECKPOINT_KEY)?.and_then(|e| {
        let v = e.value.as_ref();
        let rev = <[u8; 8]>::try_from(v.get(..8)?).ok()?;
        let ns = <[u8; 8]>::try_from(v.get(8..16)?).ok()?;
        (v.len() == 16).then(|| (u64::from_be_bytes(rev), u64::from_be_bytes(ns)))
    }))
}

/// The `on-applied` intent of the fold's last commit (docs/state.md, "Writes from `on-applied`"):
/// for an applier whose `on-applied` writes outside the fold (a guest that owns a state bucket),
/// every commit that ends in `on-applied` records the cursor it reports and the instant its writes'
/// operation ids are minted at, so a restart calls `on-applied` again with the same ids.
pub const ON_APPLIED_KEY: &str = "\u{1}on-applied";

/// An `on-applied` intent ([`ON_APPLIED_KEY`]): the revision `on-applied` reports, the instant
/// (Unix milliseconds) the operation ids of its writes are minted at, and a random nonce those ids
/// are derived with (so no one outside the host can predict them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppliedIntent {
    /// The committed cursor's revision `on-applied` reports.
    pub revision: u64,
    /// When the ids of its writes are minted (the commit's clock), Unix milliseconds.
    pub minted_unix_ms: u64,
    /// Random, drawn at the commit.
    pub nonce: u64,
}

/// Format tag and version of an encoded intent.
const INTENT_TAG: [u8; 2] = [b'I', 1];

impl AppliedIntent {
    /// The store update that records it.
    pub fn to_put(self) -> KvUpdate {
        let mut value = INTENT_TAG.to_vec();
        value.extend_from_slice(&self.revision.to_be_bytes());
        value.extend_from_slice(&self.minted_unix_ms.to_be_bytes());
        value.extend_from_slice(&self.nonce.to_be_bytes());
        KvUpdate::Put(KvEntry {
            key: ON_APPLIED_KEY.into(),
            value: Bytes::from(value),
            version: VersionToken::UNKNOWN,
        })
    }

    /// Decodes a recorded intent (`None`: bytes that are not one).
    pub fn from_bytes(v: &[u8]) -> Option<Self> {
        if v.len() != 26 || v.get(..2)? != INTENT_TAG {
            return None;
        }
        let word = |at: usize| -> Option<u64> {
            Some(u64::from_be_bytes(
                <[u8; 8]>::try_from(v.get(at..at + 8)?).ok()?,
            ))
        };
        Some(AppliedIntent {
            revision: word(2)?,
            minted_unix_ms: word(10)?,
            nonce: word(18)?,
        })
    }
}

/// What a state-sync start left unseen ([`crate::protocol::Unseen`]): the first revision it never
/// delivered, 8 bytes big-endian, then the level reported after it (8 more) once one was. Until it
/// is settled `applied_through` stays below the floor. Committed with the batch that skipped it;
/// removed by the first commit after it is settled.
pub const UNSEEN_FLOOR_KEY: &str = "\u{1}unseen-floor";

/// The store update that records what a state-sync left unseen (`None`: removes it).
pub fn unseen_floor_update(unseen: Option<crate::protocol::Unseen>) -> KvUpdate {
    match unseen {
        Some(u) => {
            let mut value = u.floor.to_be_bytes().to_vec();
            if let Some(l) = u.level {
                value.extend_from_slice(&l.to_be_bytes());
            }
            KvUpdate::Put(KvEntry {
                key: UNSEEN_FLOOR_KEY.into(),
                value: Bytes::from(value),
                version: VersionToken::UNKNOWN,
            })
        }
        None => KvUpdate::Delete {
            key: UNSEEN_FLOOR_KEY.into(),
            version: VersionToken::UNKNOWN,
        },
    }
}

/// Where retained records live: `RETAINED_PREFIX` + 20-digit revision + `/` + key (log order).
/// A record of unknown revision (a synthetic delete of a re-list or restore) has no revision of
/// its own: it is stored at its *position* — the fold's revision when it was retained — as
/// `RETAINED_PREFIX` + 20-digit position + `~` + 20-digit sequence + `/` + key, which sorts after
/// every record of a known revision at or below that position (`~` > `/`) and before any later
/// one, so log order holds through every path and two records never share a store key.
pub const RETAINED_PREFIX: &str = "\u{1}retained/";

/// Format tag of an encoded retained record.
const RECORD_TAG: u8 = b'R';
/// Format version of an encoded retained record of a known revision (also what every host before
/// positions existed wrote).
const RECORD_VERSION: u8 = 1;
/// Format version of a record of unknown revision: version 1 followed by its position and
/// sequence.
const RECORD_VERSION_POSITIONED: u8 = 2;

/// What a blocked key's guest view holds: the entry as of its last applied update (`None`: absent).
pub type Base = Option<KvEntry>;

/// One retained update.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetainedRecord {
    /// The update as delivered.
    pub update: KvUpdate,
    /// When it was first retained (Unix milliseconds), for the grace warning.
    pub retained_unix_ms: u64,
    /// For the first retained record of its key: the key's entry before it. `None` for later ones.
    pub base: Option<Base>,
    /// For an update of unknown revision: its position (the fold's revision when it was retained,
    /// or the highest revision before it in its batch) and a sequence unique among retained
    /// records. `None` for an update with a revision.
    pub order: Option<(u64, u64)>,
}

impl RetainedRecord {
    /// Where the record sits in the log: its revision, or for one of unknown revision its
    /// position (the revision the fold was at when it was retained).
    pub fn position(&self) -> u64 {
        match (self.update.revision(), self.order) {
            (Some(r), _) => r,
            (None, Some((p, _))) => p,
            (None, None) => 0,
        }
    }

    /// The first revision this record keeps from being applied: its own revision, or for one of
    /// unknown revision the one after its position (everything at its position was applied
    /// before it was retained). `applied_through` stays below it.
    pub(crate) fn first_unapplied(&self) -> u64 {
        match (self.update.revision(), self.order) {
            (Some(r), _) => r,
            (None, Some((p, _))) => p.saturating_add(1),
            (None, None) => 0,
        }
    }

    /// The reserved key this record is stored under.
    pub fn store_key(&self) -> String {
        match (self.update.revision(), self.order) {
            (None, Some((p, seq))) => {
                format!("{RETAINED_PREFIX}{p:020}~{seq:020}/{}", self.update.key())
            }
            _ => format!(
                "{RETAINED_PREFIX}{:020}/{}",
                self.position(),
                self.update.key()
            ),
        }
    }

    /// The store update that writes this record.
    pub fn to_put(&self) -> KvUpdate {
        KvUpdate::Put(KvEntry {
            key: self.store_key(),
            value: Bytes::from(encode(self)),
            version: VersionToken::UNKNOWN,
        })
    }

    /// The store update that releases this record.
    pub fn to_delete(&self) -> KvUpdate {
        KvUpdate::Delete {
            key: self.store_key(),
            version: VersionToken::UNKNOWN,
        }
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

fn put_version(out: &mut Vec<u8>, v: &VersionToken) {
    out.push(v.as_bytes().len() as u8);
    out.extend_from_slice(v.as_bytes());
}

/// Encodes a record: tag, version, op, retained-at, update version, key, value, base.
pub(crate) fn encode(r: &RetainedRecord) -> Vec<u8> {
    let (op, key, value): (u8, &str, &[u8]) = match &r.update {
        KvUpdate::Put(e) => (0, &e.key, &e.value),
        KvUpdate::Delete { key, .. } => (1, key, &[]),
        KvUpdate::Purge { key, .. } => (2, key, &[]),
    };
    let mut out = Vec::with_capacity(48 + key.len() + value.len());
    let version = if r.order.is_some() {
        RECORD_VERSION_POSITIONED
    } else {
        RECORD_VERSION
    };
    out.extend_from_slice(&[RECORD_TAG, version, op]);
    out.extend_from_slice(&r.retained_unix_ms.to_le_bytes());
    put_version(&mut out, &r.update.version());
    put_bytes(&mut out, key.as_bytes());
    put_bytes(&mut out, value);
    match &r.base {
        None => out.push(0),
        Some(None) => out.push(1),
        Some(Some(e)) => {
            out.push(2);
            put_version(&mut out, &e.version);
            put_bytes(&mut out, &e.value);
        }
    }
    if let Some((position, seq)) = r.order {
        out.extend_from_slice(&position.to_le_bytes());
        out.extend_from_slice(&seq.to_le_bytes());
    }
    out
}

/// A cursor over bytes whose every read is bounds-checked.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(format!(
                "cut short: wanted {n} bytes, {} left",
                self.0.len()
            ));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u64(&mut self) -> Result<u64, String> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }

    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        let n = u32::from_le_bytes(b) as usize;
        if n > crate::snapshot::MAX_VALUE_LEN {
            return Err(format!("length {n} over the value cap"));
        }
        self.take(n)
    }

    fn version(&mut self) -> Result<VersionToken, String> {
        let n = self.u8()? as usize;
        VersionToken::from_bytes(self.take(n)?).ok_or_else(|| format!("version of {n} bytes"))
    }
}

/// Decodes a record written by [`encode`].
pub(crate) fn decode(bytes: &[u8]) -> Result<RetainedRecord, String> {
    let mut r = Reader(bytes);
    let (tag, version) = (r.u8()?, r.u8()?);
    if tag != RECORD_TAG || !(version == RECORD_VERSION || version == RECORD_VERSION_POSITIONED) {
        return Err(format!("unknown record tag {tag:#04x} version {version}"));
    }
    let op = r.u8()?;
    let retained_unix_ms = r.u64()?;
    let uversion = r.version()?;
    let key = std::str::from_utf8(r.bytes()?)
        .map_err(|_| "key is not UTF-8".to_string())?
        .to_string();
    let value = Bytes::copy_from_slice(r.bytes()?);
    let update = match op {
        0 => KvUpdate::Put(KvEntry {
            key: key.clone(),
            value,
            version: uversion,
        }),
        1 => KvUpdate::Delete {
            key: key.clone(),
            version: uversion,
        },
        2 => KvUpdate::Purge {
            key: key.clone(),
            version: uversion,
        },
        other => return Err(format!("unknown op {other}")),
    };
    let base = match r.u8()? {
        0 => None,
        1 => Some(None),
        2 => {
            let version = r.version()?;
            let value = Bytes::copy_from_slice(r.bytes()?);
            Some(Some(KvEntry {
                key,
                value,
                version,
            }))
        }
        other => return Err(format!("unknown base tag {other}")),
    };
    let order = if version == RECORD_VERSION_POSITIONED {
        if !uversion.is_unknown() {
            return Err("a positioned record with a revision of its own".into());
        }
        Some((r.u64()?, r.u64()?))
    } else {
        None
    };
    if !r.0.is_empty() {
        return Err(format!("{} trailing bytes", r.0.len()));
    }
    Ok(RetainedRecord {
        update,
        retained_unix_ms,
        base,
        order,
    })
}

/// The retained records of a fold, in memory (loaded once, kept in step with every commit).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetainedIndex {
    /// By store key: log order.
    records: BTreeMap<String, RetainedRecord>,
    /// Blocked key → its base (the head record's).
    bases: BTreeMap<String, Base>,
    /// Store keys under [`RETAINED_PREFIX`] that no host wrote (see [`RetainedIndex::load`]).
    forged: Vec<String>,
    /// What a state-sync start left unseen ([`UNSEEN_FLOOR_KEY`]), while it matters
    /// ([`crate::protocol::applied_through`]).
    unseen: Option<crate::protocol::Unseen>,
}

impl RetainedIndex {
    /// Reads every retained record of `store`.
    ///
    /// A record that does not decode, or whose key has no head carrying its base, was not written
    /// by a host: every host-written record decodes (the stores checksum what they hold), and
    /// heads are written with the records behind them. Such records are what a bucket writer's raw
    /// publish of a `\x01retained/…` key left in a fold before the fold's edge skipped those keys
    /// ([`crate::protocol::bucket_key_admitted`]). They are set aside as *forged*, each named in a
    /// warning, never used; the fold deletes them at start ([`RetainedIndex::take_forged`]) — the
    /// migration of such stores.
    pub fn load<S: SnapshotStore + ?Sized>(store: &S) -> Result<Self, SnapshotError> {
        let mut index = RetainedIndex::default();
        store.for_each_in_range(RETAINED_PREFIX, &mut |e| {
            match decode(&e.value) {
                Ok(r) if r.store_key() == e.key => index.insert(r),
                Ok(_) => {
                    tracing::warn!(event = "retained_forged", key = ?e.key, "a retained record under another record's key: set aside as forged");
                    index.forged.push(e.key.clone());
                }
                Err(reason) => {
                    tracing::warn!(event = "retained_forged", key = ?e.key, %reason, "a retained record that does not decode: set aside as forged");
                    index.forged.push(e.key.clone());
                }
            }
            ControlFlow::Continue(())
        })?;
        let orphans: Vec<String> = index
            .records
            .iter()
            .filter(|(_, r)| !index.bases.contains_key(r.update.key()))
            .map(|(k, _)| k.clone())
            .collect();
        for k in orphans {
            tracing::warn!(event = "retained_forged", key = ?k, "a retained record with no head carrying its key's base: set aside as forged");
            index.records.remove(&k);
            index.forged.push(k);
        }
        // A record that does not decode cannot be trusted: the lowest floor and no level stand
        // in (nothing is covered until a level is reported and the record rewritten).
        index.unseen = store.get(UNSEEN_FLOOR_KEY)?.map(|e| {
            let v = e.value.as_ref();
            let at = |i: usize| v.get(i..i + 8).and_then(|b| <[u8; 8]>::try_from(b).ok());
            match (v.len(), at(0), at(8)) {
                (8, Some(f), _) => crate::protocol::Unseen {
                    floor: u64::from_be_bytes(f),
                    level: None,
                },
                (16, Some(f), Some(l)) => crate::protocol::Unseen {
                    floor: u64::from_be_bytes(f),
                    level: Some(u64::from_be_bytes(l)),
                },
                _ => crate::protocol::Unseen {
                    floor: 1,
                    level: None,
                },
            }
        });
        Ok(index)
    }

    /// What a state-sync start left unseen, while it matters.
    pub fn unseen(&self) -> Option<crate::protocol::Unseen> {
        self.unseen
    }

    /// Records what a state-sync start left unseen (as committed with [`unseen_floor_update`]).
    pub fn set_unseen(&mut self, unseen: Option<crate::protocol::Unseen>) {
        self.unseen = unseen;
    }

    /// The store keys of forged records found at load (see [`RetainedIndex::load`]), handed over
    /// once to be deleted.
    pub fn take_forged(&mut self) -> Vec<String> {
        std::mem::take(&mut self.forged)
    }

    /// Adds a record (a head also blocks its key).
    pub fn insert(&mut self, r: RetainedRecord) {
        if let Some(base) = &r.base {
            self.bases.insert(r.update.key().to_string(), base.clone());
        }
        self.records.insert(r.store_key(), r);
    }

    /// True when `key` has retained records: its later updates are held back.
    pub fn is_blocked(&self, key: &str) -> bool {
        self.bases.contains_key(key)
    }

    /// The guest's view of a blocked key (`None` when the key is not blocked).
    pub fn base(&self, key: &str) -> Option<&Base> {
        self.bases.get(key)
    }

    /// Blocked keys with their bases whose key starts with `prefix`, in key order.
    pub(crate) fn bases_in(&self, prefix: &str) -> impl Iterator<Item = (&String, &Base)> {
        self.bases
            .range(prefix.to_string()..)
            .take_while(move |(k, _)| k.starts_with(prefix))
    }

    /// Records retained, in log order.
    pub fn records(&self) -> impl Iterator<Item = &RetainedRecord> {
        self.records.values()
    }

    /// Number of records retained.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// True when nothing is retained.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The oldest retained record (first in log order).
    pub fn oldest(&self) -> Option<&RetainedRecord> {
        self.records.values().next()
    }

    /// The sequence the next record of unknown revision gets: above every one retained.
    pub fn next_sequence(&self) -> u64 {
        self.records
            .values()
            .filter_map(|r| r.order.map(|(_, seq)| seq))
            .max()
            .map_or(1, |s| s.saturating_add(1))
    }

    /// `applied_through` for a fold at `cursor` with these records: the one rule
    /// ([`crate::protocol::applied_through`]) held below the oldest record's first unapplied
    /// revision. `/status`, `status.json` and `status --store` all come here.
    pub fn applied_through(&self, cursor: Option<u64>) -> Option<u64> {
        crate::protocol::applied_through(
            cursor,
            self.oldest().map(RetainedRecord::first_unapplied),
            self.unseen,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(key: &str, value: &str, rev: u64) -> KvUpdate {
        KvUpdate::Put(KvEntry {
            key: key.into(),
            value: Bytes::from(value.to_string()),
            version: VersionToken::from_u64(rev),
        })
    }

    #[test]
    fn an_on_applied_intent_round_trips_and_other_bytes_are_none() {
        let i = AppliedIntent {
            revision: 41,
            minted_unix_ms: 1_700_000_000_123,
            nonce: 0x0123_4567_89ab_cdef,
        };
        let KvUpdate::Put(e) = i.to_put() else {
            panic!("an intent is a put");
        };
        assert_eq!(e.key, ON_APPLIED_KEY);
        assert!(is_reserved(&e.key));
        assert_eq!(AppliedIntent::from_bytes(&e.value), Some(i));
        assert_eq!(AppliedIntent::from_bytes(&e.value[..25]), None);
        let mut other = e.value.to_vec();
        other[1] = 2;
        assert_eq!(AppliedIntent::from_bytes(&other), None);
        assert_eq!(AppliedIntent::from_bytes(b""), None);
    }

    #[test]
    fn records_round_trip_with_every_base_shape() {
        let base_entry = KvEntry {
            key: "k".into(),
            value: Bytes::from_static(b"old"),
            version: VersionToken::from_u64(3),
        };
        for update in [
            put("k", "fmt2:x", 7),
            KvUpdate::Delete {
                key: "k".into(),
                version: VersionToken::from_u64(8),
            },
            KvUpdate::Purge {
                key: "k".into(),
                version: VersionToken::UNKNOWN,
            },
        ] {
            for base in [None, Some(None), Some(Some(base_entry.clone()))] {
                let order = update.revision().is_none().then_some((41, 3));
                let r = RetainedRecord {
                    update: update.clone(),
                    retained_unix_ms: 1_700_000_000_000,
                    base,
                    order,
                };
                assert_eq!(decode(&encode(&r)), Ok(r));
            }
        }
    }

    #[test]
    fn every_truncation_and_a_trailing_byte_are_refused() {
        let r = RetainedRecord {
            update: put("key", "value", 9),
            retained_unix_ms: 1,
            base: Some(None),
            order: None,
        };
        let positioned = RetainedRecord {
            update: KvUpdate::Delete {
                key: "key".into(),
                version: VersionToken::UNKNOWN,
            },
            retained_unix_ms: 1,
            base: None,
            order: Some((9, 1)),
        };
        for r in [r, positioned] {
            let bytes = encode(&r);
            for cut in 0..bytes.len() {
                assert!(decode(&bytes[..cut]).is_err(), "cut at {cut} decoded");
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert!(decode(&longer).is_err());
        }
    }

    #[test]
    fn store_keys_sort_in_log_order_and_are_reserved() {
        let a = RetainedRecord {
            update: put("zz", "", 9),
            retained_unix_ms: 0,
            base: None,
            order: None,
        };
        let b = RetainedRecord {
            update: put("aa", "", 10),
            retained_unix_ms: 0,
            base: None,
            order: None,
        };
        assert!(a.store_key() < b.store_key());
        // A synthetic delete of `zz` retained when the fold was at 9: after `zz`'s record at 9
        // (never under its key), before anything later; two of them at one position stay apart.
        let synthetic = |seq| RetainedRecord {
            update: KvUpdate::Delete {
                key: "zz".into(),
                version: VersionToken::UNKNOWN,
            },
            retained_unix_ms: 0,
            base: None,
            order: Some((9, seq)),
        };
        let (s1, s2) = (synthetic(1), synthetic(2));
        assert!(a.store_key() < s1.store_key() && s1.store_key() < s2.store_key());
        assert!(s2.store_key() < b.store_key());
        assert_eq!((s1.position(), s1.first_unapplied()), (9, 10));
        assert_eq!((a.position(), a.first_unapplied()), (9, 9));
        assert!(is_reserved(&a.store_key()));
        assert!(!is_reserved("route.a"));
        // Reserved keys sort before every key a NATS bucket can hold.
        assert!(a.store_key().as_str() < "-");
        assert!(a.to_put().revision().is_none(), "never moves the cursor");
    }

    #[test]
    fn applied_through_never_drops_for_a_record_retained_at_the_cursor() {
        let mut index = RetainedIndex::default();
        assert_eq!(index.applied_through(Some(20)), Some(20));
        // A synthetic delete retained with the fold at 20: everything through 20 was applied.
        index.insert(RetainedRecord {
            update: KvUpdate::Delete {
                key: "k".into(),
                version: VersionToken::UNKNOWN,
            },
            retained_unix_ms: 0,
            base: Some(None),
            order: Some((20, index.next_sequence())),
        });
        assert_eq!(index.applied_through(Some(20)), Some(20));
        assert_eq!(index.next_sequence(), 2);
        // A record of a known revision 15 is older in the log: it holds applied_through at 14.
        index.insert(RetainedRecord {
            update: put("j", "v", 15),
            retained_unix_ms: 0,
            base: Some(None),
            order: None,
        });
        assert_eq!(index.applied_through(Some(20)), Some(14));
    }
}
