//! What the two LSM backends ([`super::FjallSnapshot`], [`super::RocksDbSnapshot`]) share, pure:
//! the meta keys, the count and cursor encodings, and turning a batch into data writes plus the new
//! key count.
//!
//! Layout both keep (in two separate partitions / column families, so no data key — not even a
//! `\x01`-prefixed reserved key of the host — can ever be mistaken for a meta key):
//! - **data**: key = the KV key's UTF-8 bytes; value = a [`super::value_codec`] record.
//! - **meta**: [`CURSOR_KEY`] → [`WatchCursor::to_bytes`]; [`COUNT_KEY`] → live data keys,
//!   8 bytes big-endian. Both are written in the same atomic batch as the data they describe.

use std::collections::HashMap;
use std::path::Path;

use super::{SnapshotError, format, value_codec};
use crate::kv::{KvEntry, KvUpdate, WatchCursor};

/// The data partition / column family.
pub(crate) const DATA: &str = "data";
/// The meta partition / column family.
pub(crate) const META: &str = "meta";
/// Meta key of the cursor.
pub(crate) const CURSOR_KEY: &[u8] = b"cursor";
/// Meta key of the live-key count.
pub(crate) const COUNT_KEY: &[u8] = b"count";

/// One write to the data partition.
pub(crate) enum Op<'a> {
    /// Put `key` → encoded value record.
    Put(&'a str, Vec<u8>),
    /// Remove `key`.
    Delete(&'a str),
}

/// A batch resolved into data writes and the key count after it.
pub(crate) struct Plan<'a> {
    /// The writes, in batch order (a later write of a key supersedes an earlier one).
    pub ops: Vec<Op<'a>>,
    /// Live keys once the batch is applied.
    pub count: u64,
}

/// Resolves `batch` against a fold of `count` live keys. `exists` answers whether a key is live
/// *before* the batch; it is asked at most once per distinct key. Sizes are checked first, so a
/// refused batch writes nothing.
pub(crate) fn plan<'a>(
    batch: &'a [KvUpdate],
    count: u64,
    mut exists: impl FnMut(&str) -> Result<bool, SnapshotError>,
) -> Result<Plan<'a>, SnapshotError> {
    for update in batch {
        format::check_update(update)?;
    }
    let mut live: HashMap<&'a str, bool> = HashMap::with_capacity(batch.len());
    let mut count = count as i128;
    let mut ops = Vec::with_capacity(batch.len());
    for update in batch {
        let key = update.key();
        let was = match live.get(key) {
            Some(v) => *v,
            None => exists(key)?,
        };
        let now = matches!(update, KvUpdate::Put(_));
        count += i128::from(now) - i128::from(was);
        live.insert(key, now);
        ops.push(match update {
            KvUpdate::Put(e) => Op::Put(key, value_codec::encode(&e.version, &e.value)),
            KvUpdate::Delete { .. } | KvUpdate::Purge { .. } => Op::Delete(key),
        });
    }
    let count = u64::try_from(count).map_err(|_| {
        SnapshotError::Backend(format!(
            "key count would go negative ({count}): the stored count disagrees with the data"
        ))
    })?;
    Ok(Plan { ops, count })
}

/// Decodes a stored cursor (absent → [`WatchCursor::NONE`]).
pub(crate) fn decode_cursor(path: &Path, raw: Option<&[u8]>) -> Result<WatchCursor, SnapshotError> {
    match raw {
        None => Ok(WatchCursor::NONE),
        Some(raw) => WatchCursor::from_bytes(raw).ok_or_else(|| SnapshotError::Corrupted {
            path: path.to_owned(),
            offset: 0,
            reason: format!("meta cursor of {} byte(s) is not a cursor", raw.len()),
        }),
    }
}

/// Encodes the live-key count.
pub(crate) fn encode_count(count: u64) -> [u8; 8] {
    count.to_be_bytes()
}

/// Decodes a stored count (absent → 0, a new store).
pub(crate) fn decode_count(path: &Path, raw: Option<&[u8]>) -> Result<u64, SnapshotError> {
    match raw {
        None => Ok(0),
        Some(raw) => <[u8; 8]>::try_from(raw)
            .map(u64::from_be_bytes)
            .map_err(|_| SnapshotError::Corrupted {
                path: path.to_owned(),
                offset: 0,
                reason: format!("meta count of {} byte(s) is not 8 bytes", raw.len()),
            }),
    }
}

/// Decodes one data record into an entry, reusing `entry`'s key buffer.
pub(crate) fn decode_entry_into(
    path: &Path,
    key: &[u8],
    record: &[u8],
    entry: &mut KvEntry,
) -> Result<(), SnapshotError> {
    let key = std::str::from_utf8(key).map_err(|e| bad_record(path, key, e.to_string()))?;
    let (version, value) =
        value_codec::decode(record).map_err(|e| bad_record(path, key.as_bytes(), e.to_string()))?;
    entry.key.clear();
    entry.key.push_str(key);
    entry.value = bytes::Bytes::copy_from_slice(value);
    entry.version = version;
    Ok(())
}

/// A data record that does not decode.
pub(crate) fn bad_record(path: &Path, key: &[u8], reason: String) -> SnapshotError {
    SnapshotError::Corrupted {
        path: path.to_owned(),
        offset: 0,
        reason: format!(
            "record for key {:?}: {reason}",
            String::from_utf8_lossy(&key[..key.len().min(256)])
        ),
    }
}

/// An empty entry to decode into.
pub(crate) fn blank_entry() -> KvEntry {
    KvEntry {
        key: String::new(),
        value: bytes::Bytes::new(),
        version: crate::kv::VersionToken::UNKNOWN,
    }
}

/// Where a range walk starts: strictly after `after` when it lies inside (or beyond) the range,
/// else at the prefix. Returns the seek key and whether the key equal to it must be skipped.
pub(crate) fn seek_start<'a>(prefix: &'a str, after: Option<&'a str>) -> (&'a str, bool) {
    match after.filter(|a| *a >= prefix) {
        Some(a) => (a, true),
        None => (prefix, false),
    }
}

/// Copies the directory tree `src` into `dest` (which must not exist yet): files for which
/// `immutable` holds are hard-linked (falling back to a byte copy when the link fails, e.g. across
/// filesystems); the rest are byte-copied. Fails with the I/O error when a file vanishes
/// mid-copy (the caller retries).
pub(crate) fn copy_tree(
    src: &Path,
    dest: &Path,
    immutable: &dyn Fn(&Path) -> bool,
    skip: &dyn Fn(&Path) -> bool,
) -> Result<(), SnapshotError> {
    let io = |path: &Path, op: &'static str| {
        let path = path.to_owned();
        move |source| SnapshotError::Io { path, op, source }
    };
    std::fs::create_dir(dest).map_err(io(dest, "create copy directory"))?;
    for item in std::fs::read_dir(src).map_err(io(src, "list directory"))? {
        let item = item.map_err(io(src, "list directory"))?;
        let from = item.path();
        let rel = from.strip_prefix(src).unwrap_or(&from);
        if skip(rel) {
            continue;
        }
        let to = dest.join(item.file_name());
        let kind = item.file_type().map_err(io(&from, "stat"))?;
        if kind.is_dir() {
            copy_tree(&from, &to, &|p| immutable(&rel.join(p)), &|p| {
                skip(&rel.join(p))
            })?;
        } else if immutable(rel) {
            if std::fs::hard_link(&from, &to).is_err() {
                std::fs::copy(&from, &to).map_err(io(&from, "copy file"))?;
            }
        } else {
            std::fs::copy(&from, &to).map_err(io(&from, "copy file"))?;
        }
    }
    Ok(())
}

/// What the LSM backends' compression tests share: a fold of values like the benchmark's.
#[cfg(test)]
pub(crate) mod testing {
    use crate::kv::{KvEntry, KvUpdate, VersionToken, WatchCursor};
    use crate::snapshot::SnapshotStore;

    /// A value like the benchmark's: 64 hex digits of a BLAKE3 hash and 36 of them again. LZ4,
    /// which has no entropy coding, leaves hex digits almost whole; ZSTD codes them in about half a
    /// byte each.
    pub(crate) fn hex_value(i: u64) -> bytes::Bytes {
        let h = blake3::hash(&i.to_le_bytes()).to_hex();
        bytes::Bytes::from(format!("{h}{}", &h[..36]))
    }

    /// The key of entry `i`: `key.` and eight digits.
    pub fn key(i: u64) -> String {
        format!("key.{i:08}")
    }

    /// Puts `n` entries ([`key`], [`hex_value`]) in batches of 1 000 (`n` a multiple of 1 000);
    /// answers the bytes of their keys and values.
    pub(crate) fn fill_with_hex_values(store: &mut dyn SnapshotStore, n: u64) -> u64 {
        assert_eq!(n % 1_000, 0, "whole batches");
        for b in 0..(n / 1_000) {
            let batch: Vec<KvUpdate> = (b * 1_000..(b + 1) * 1_000)
                .map(|i| {
                    KvUpdate::Put(KvEntry {
                        key: key(i),
                        value: hex_value(i),
                        version: VersionToken::from_u64(i + 1),
                    })
                })
                .collect();
            store
                .apply(&batch, WatchCursor::at((b + 1) * 1_000))
                .expect("apply");
        }
        (0..n)
            .map(|i| (key(i).len() + hex_value(i).len()) as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::VersionToken;

    fn put(k: &str) -> KvUpdate {
        KvUpdate::Put(KvEntry {
            key: k.into(),
            value: bytes::Bytes::from_static(b"v"),
            version: VersionToken::from_u64(1),
        })
    }

    fn del(k: &str) -> KvUpdate {
        KvUpdate::Delete {
            key: k.into(),
            version: VersionToken::from_u64(2),
        }
    }

    #[test]
    fn plan_counts_new_keys_overwrites_and_deletes_once_per_key() {
        let batch = [put("a"), put("a"), put("b"), del("c"), del("x"), put("c")];
        let mut asked = Vec::new();
        let p = plan(&batch, 5, |k| {
            asked.push(k.to_owned());
            Ok(k == "c" || k == "b")
        })
        .expect("plan");
        // a: new (+1); b: existed; c: existed, deleted, put again; x: absent, delete is a no-op.
        assert_eq!(p.count, 6);
        assert_eq!(asked, ["a", "b", "c", "x"]);
        assert_eq!(p.ops.len(), batch.len());
    }

    #[test]
    fn plan_refuses_a_negative_count() {
        let err = plan(&[del("a")], 0, |_| Ok(true)).err().expect("negative");
        assert!(matches!(err, SnapshotError::Backend(_)));
    }

    #[test]
    fn counts_and_cursors_decode_or_error() {
        let p = Path::new("x");
        assert_eq!(decode_count(p, None).expect("absent"), 0);
        assert_eq!(decode_count(p, Some(&encode_count(42))).expect("ok"), 42);
        assert!(decode_count(p, Some(b"short")).is_err());
        assert_eq!(decode_cursor(p, None).expect("absent"), WatchCursor::NONE);
        assert_eq!(
            decode_cursor(p, Some(&WatchCursor::at(9).to_bytes())).expect("ok"),
            WatchCursor::at(9)
        );
        assert!(decode_cursor(p, Some(b"abc")).is_err());
    }
}
