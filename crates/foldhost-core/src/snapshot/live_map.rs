//! [`LiveMap`]: the append log's in-RAM fold, kept close to the size of its data.
//!
//! Two layers:
//! - the **base**: a sorted array of offsets of Put records inside one immutable buffer (the log as
//!   it was read at open, or as the last compaction wrote it). 8 bytes per key beside the record
//!   itself, where an ordered map of owned entries costs about 80 bytes per key plus its nodes' slack;
//!   A hash index of the base (positions in the array, 4 bytes per slot) answers point lookups
//!   with one probe instead of a binary search whose every step is a cache miss into the buffer;
//! - the **overlay**: an ordered set of what changed since the base was built, each entry a record
//!   ([`Change`]): a Put record (the key's new value and version) or a Delete record's head, a
//!   tombstone hiding a base key. The store's records are slices of the batch buffers it wrote to
//!   the log, so the overlay holds one `Bytes` per key and no copy of it.
//!
//! Invariants (checked by the tests at the end of this file against an ordered-map model):
//! - every base offset is the start of a Put record of `buf` that a replay or a compaction checked
//!   whole, and the base's keys strictly increase;
//! - an overlay entry shadows the base entry with the same key; a tombstone exists only for a key
//!   the base holds (a key absent from the base is simply removed from the overlay); an overlay
//!   entry's bytes are a Put record or a Delete record's head, and its order is its key's;
//! - `len` is the number of live keys and `put_bytes` the encoded size of their Put records, both
//!   kept as entries change, so neither is ever counted by a walk.
//!
//! A compaction writes the merged map as a fresh file and [`LiveMap::rebase`]s on that file's bytes,
//! so the overlay empties and the old buffer, with its superseded records, is freed.

use std::cmp::Ordering;
use std::collections::{BTreeSet, btree_set};
use std::hash::{BuildHasher, RandomState};
use std::iter::Peekable;
use std::ops::{Bound, ControlFlow};
use std::sync::OnceLock;

use bytes::Bytes;
use hashbrown::HashTable;

use super::format::{self, HEADER_LEN};
use crate::kv::{KvEntry, KvUpdate, VersionToken, WatchCursor};

/// An overlay entry: what a key became since the base was built, as the record that says so — a
/// Put record (CRC to version: the key's new value and version, byte for byte what a compacted log
/// holds) or the head of a Delete record (enough to hold its key: a tombstone hiding a base key).
/// One `Bytes` per entry, ordered and looked up by the record's key: the set's nodes hold 32 bytes
/// per key, where a map of key, value and version held 80.
#[derive(Debug, Clone)]
struct Change(Bytes);

impl Change {
    /// The record's key (empty for bytes that are not a Put or Delete record: never built).
    fn key(&self) -> &[u8] {
        format::record_key(&self.0).unwrap_or_default()
    }

    /// The value and version, for a Put; `None` for a tombstone.
    fn put(&self) -> Option<(&[u8], VersionToken)> {
        format::put_fields(&self.0).map(|(_, value, version)| (value, version))
    }
}

impl PartialEq for Change {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Change {}

impl PartialOrd for Change {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Change {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key().cmp(other.key())
    }
}

/// Looked up by key bytes; consistent with `Ord`, which compares exactly these.
impl std::borrow::Borrow<[u8]> for Change {
    fn borrow(&self) -> &[u8] {
        self.key()
    }
}

/// The live fold (keys, values, versions, the cursor) of an append log.
#[derive(Debug, Default)]
pub(super) struct LiveMap {
    /// The buffer the base's offsets point into.
    buf: Bytes,
    /// Offsets in `buf` of Put records, in strictly increasing key order.
    base: Vec<u64>,
    /// Hash index of `base` (positions in it), built on the first lookup after a rebase and kept up
    /// to date by [`LiveMap::push_base`]. Keys come from untrusted bucket writers, so the hash is
    /// std's randomly keyed SipHash.
    index: OnceLock<HashTable<u32>>,
    hasher: RandomState,
    /// Changes since the base was built, ordered by the keys' UTF-8 bytes (byte order is key order).
    overlay: BTreeSet<Change>,
    /// Live keys.
    len: u64,
    /// The cursor the fold is at.
    pub(super) cursor: WatchCursor,
    /// Encoded size of the live keys' Put records, so the compaction trigger never walks the map.
    put_bytes: u64,
}

/// One live entry as a walk sees it: the value either in the base's buffer or owned by the overlay.
pub(super) struct Item<'a> {
    pub(super) key: &'a [u8],
    pub(super) value: &'a [u8],
    pub(super) version: VersionToken,
    /// The overlay's record, when the entry came from there (its value is sliced from it).
    owned: Option<&'a Bytes>,
    /// The entry's framed Put record: what a compacted log holds for it (an export copies it as it
    /// lies). A base record was checked whole when the base was built; an overlay record is one the
    /// store encoded.
    pub(super) record: Option<&'a [u8]>,
}

impl LiveMap {
    /// An empty fold whose base will be built from `buf` ([`LiveMap::push_base`]).
    pub(super) fn over(buf: Bytes) -> Self {
        LiveMap {
            buf,
            ..LiveMap::default()
        }
    }

    /// Keys held by the dense base and entries of the overlay (what the tests check the layout by).
    #[cfg(test)]
    pub(super) fn layers(&self) -> (usize, usize) {
        (self.base.len(), self.overlay.len())
    }

    /// Live keys.
    pub(super) fn len(&self) -> u64 {
        self.len
    }

    /// The size of the file a compaction would write.
    pub(super) fn compacted_len(&self) -> u64 {
        (HEADER_LEN + format::cursor_record_len(self.cursor)) as u64 + self.put_bytes
    }

    /// The replay's fast path: takes the Put record at `offset` of the buffer into the base when it
    /// extends it (nothing in the overlay yet, and its key after the base's last). Returns `false`
    /// when it does not, and the caller keeps the record for [`LiveMap::absorb`].
    pub(super) fn push_base(
        &mut self,
        offset: usize,
        key: &str,
        value_len: usize,
        version: VersionToken,
    ) -> bool {
        if !self.overlay.is_empty() {
            return false;
        }
        if let Some(&last) = self.base.last()
            && self.base_key(last) >= key.as_bytes()
        {
            return false;
        }
        debug_assert_eq!(
            format::put_fields(&self.buf[offset..]).map(|(k, _, _)| k),
            Some(key.as_bytes()),
            "a base offset names the record it was given for"
        );
        self.base.push(offset as u64);
        if let Some(index) = self.index.get_mut() {
            // Kept current rather than dropped: a log alternating deletes of absent keys with new
            // keys in order would otherwise rebuild it once per record.
            match u32::try_from(self.base.len() - 1) {
                Ok(pos) => {
                    let (base, buf, hasher) = (&self.base, &self.buf, &self.hasher);
                    let rehash = |&p: &u32| key_hash(hasher, base_key_in(buf, base[p as usize]));
                    index.insert_unique(key_hash(hasher, key.as_bytes()), pos, rehash);
                }
                Err(_) => {
                    self.index.take();
                }
            }
        }
        self.len += 1;
        self.put_bytes += format::put_record_len(key.len(), value_len, version) as u64;
        true
    }

    /// Builds the base anew on `buf`, a compacted log whose Put records start at `offsets` (in key
    /// order) and hold exactly the live map: the overlay empties and the old buffer is released.
    pub(super) fn rebase(&mut self, buf: Bytes, offsets: Vec<u64>) {
        debug_assert_eq!(
            offsets.len() as u64,
            self.len,
            "a rebase keeps every live key"
        );
        self.buf = buf;
        self.base = offsets;
        self.base.shrink_to_fit();
        self.index = OnceLock::new();
        self.overlay = BTreeSet::new();
    }

    /// The end of a replay: folds `tail`, the offsets of the Put and Delete records that came after
    /// the base stopped growing (in file order), into a new base. Sorted by key (stable, so a key's
    /// records keep their order), each key's last record wins over its earlier ones and over the
    /// base; a Delete drops the key. Returns whether any record was superseded or deleted.
    ///
    /// Memory: 8 bytes per tail record and a new base array, where folding the same records one by
    /// one into the overlay cost an ordered-map entry each.
    pub(super) fn absorb(&mut self, mut tail: Vec<u64>) -> bool {
        debug_assert!(
            self.overlay.is_empty(),
            "a replay folds into the base alone"
        );
        if tail.is_empty() {
            return false;
        }
        let buf = &self.buf;
        tail.sort_by(|&a, &b| base_key_in(buf, a).cmp(base_key_in(buf, b)));
        let old = std::mem::take(&mut self.base);
        let mut base = Vec::with_capacity(old.len() + tail.len());
        let mut superseded = false;
        let mut b = 0;
        let mut t = 0;
        while t < tail.len() {
            let key = base_key_in(buf, tail[t]);
            // The key's last record in the tail.
            while t + 1 < tail.len() && base_key_in(buf, tail[t + 1]) == key {
                superseded = true;
                t += 1;
            }
            while b < old.len() && base_key_in(buf, old[b]) < key {
                base.push(old[b]);
                b += 1;
            }
            if b < old.len() && base_key_in(buf, old[b]) == key {
                superseded = true;
                b += 1;
            }
            let at = usize::try_from(tail[t]).ok().and_then(|at| buf.get(at..));
            if at.is_some_and(format::is_put) {
                base.push(tail[t]);
            } else {
                superseded = true;
            }
            t += 1;
        }
        base.extend_from_slice(&old[b..]);
        drop(old);
        self.put_bytes = base
            .iter()
            .map(|&o| {
                let (key, value, version) = self.base_fields(o);
                format::put_record_len(key.len(), value.len(), version) as u64
            })
            .sum();
        self.len = base.len() as u64;
        self.base = base;
        self.index = OnceLock::new();
        superseded
    }

    /// Sets `key`; returns whether it replaced a live entry (a superseded record in the log). The
    /// overlay keeps a record of its own, encoded here (see [`LiveMap::apply_encoded`] for the
    /// store's path, which copies nothing).
    pub(super) fn put(&mut self, key: &str, value: Bytes, version: VersionToken) -> bool {
        let mut record =
            Vec::with_capacity(format::put_record_len(key.len(), value.len(), version));
        format::encode_put(&mut record, key, &value, version);
        self.put_record(Bytes::from(record))
    }

    /// Folds a Put record (its whole bytes); returns whether it replaced a live entry.
    fn put_record(&mut self, record: Bytes) -> bool {
        // A Put record's length is what the key adds to a compacted log.
        self.put_bytes += record.len() as u64;
        let change = Change(record);
        let key_len = change.key().len();
        // One descent of the overlay: the new record replaces an equal key's and hands it back.
        let lookup = change.clone();
        match self.overlay.replace(change) {
            Some(old) => match old.put() {
                Some(_) => {
                    self.put_bytes -= old.0.len() as u64;
                    true
                }
                None => {
                    self.len += 1;
                    false
                }
            },
            None => match self
                .base_find(lookup.key())
                .map(|(_, v, ver)| (v.len(), ver))
            {
                Some((old_len, old_version)) => {
                    self.put_bytes -= format::put_record_len(key_len, old_len, old_version) as u64;
                    true
                }
                None => {
                    self.len += 1;
                    false
                }
            },
        }
    }

    /// Deletes `key` if live.
    pub(super) fn remove(&mut self, key: &str) {
        self.remove_with(key, || {
            let mut record = Vec::new();
            format::encode_delete(&mut record, key, VersionToken::UNKNOWN);
            Bytes::from(record)
        });
    }

    /// [`LiveMap::remove`], `tombstone` making the Delete record (or its head) a tombstone keeps.
    fn remove_with(&mut self, key: &str, tombstone: impl FnOnce() -> Bytes) {
        let in_base = self
            .base_find(key.as_bytes())
            .map(|(_, v, ver)| (v.len(), ver));
        match self
            .overlay
            .get(key.as_bytes())
            .map(|c| c.0.len() as u64 * u64::from(c.put().is_some()))
        {
            // A tombstone already.
            Some(0) => {}
            Some(old_record_len) => {
                self.put_bytes -= old_record_len;
                self.len -= 1;
                if in_base.is_none() {
                    self.overlay.remove(key.as_bytes());
                } else {
                    self.overlay.replace(Change(tombstone()));
                }
            }
            None => {
                if let Some((old_len, old_version)) = in_base {
                    self.put_bytes -=
                        format::put_record_len(key.len(), old_len, old_version) as u64;
                    self.len -= 1;
                    self.overlay.insert(Change(tombstone()));
                }
            }
        }
    }

    /// Folds one update whose record the store encoded into `chunk` at `at` (the batch's records,
    /// the very bytes it wrote to the log). The overlay keeps a slice of `chunk`, the record
    /// itself: a batch costs the one allocation it was encoded into, and a delivered value's read
    /// (the 256 KiB it arrived in) is never kept alive. A chunk stays in memory while any of its
    /// records is in the overlay: at most until the next compaction empties it, which bounds the
    /// chunks by the log's own growth.
    pub(super) fn apply_encoded(&mut self, update: &KvUpdate, chunk: &Bytes, at: usize) {
        let record = chunk.get(at..).unwrap_or_default();
        match update {
            KvUpdate::Put(e) => match format::put_record(record) {
                Some(p) if p.key == e.key.as_bytes() && p.value == &e.value[..] => {
                    self.put_record(chunk.slice_ref(p.bytes));
                }
                // Not the record of this update (a bug): fold the update itself, copied.
                _ => {
                    debug_assert!(false, "the record at {at} is not the put of {}", e.key);
                    self.put(&e.key, e.value.clone(), e.version);
                }
            },
            KvUpdate::Delete { key, .. } | KvUpdate::Purge { key, .. } => {
                match format::record_key(record) {
                    Some(k) if k == key.as_bytes() => {
                        // The record's head, up to the end of its key, is all a tombstone needs.
                        let head = (k.as_ptr() as usize - record.as_ptr() as usize) + k.len();
                        self.remove_with(key, || chunk.slice_ref(&record[..head]));
                    }
                    _ => {
                        debug_assert!(false, "the record at {at} is not the delete of {key}");
                        self.remove(key);
                    }
                }
            }
        }
    }

    /// Folds one update, copied (the model tests' path; the store folds its own records through
    /// [`LiveMap::apply_encoded`]).
    #[cfg(test)]
    pub(super) fn apply(&mut self, update: &KvUpdate) {
        match update {
            KvUpdate::Put(e) => {
                self.put(&e.key, e.value.clone(), e.version);
            }
            KvUpdate::Delete { key, .. } | KvUpdate::Purge { key, .. } => self.remove(key),
        }
    }

    /// The value and version of `key`, if live.
    pub(super) fn get(&self, key: &str) -> Option<(Bytes, VersionToken)> {
        match self.overlay.get(key.as_bytes()) {
            Some(change) => change
                .put()
                .map(|(value, version)| (change.0.slice_ref(value), version)),
            None => self
                .base_find(key.as_bytes())
                .map(|(_, value, version)| (self.buf.slice_ref(value), version)),
        }
    }

    /// The live entries from `from` on, in key order.
    pub(super) fn iter_from(&self, from: Bound<&[u8]>) -> Iter<'_> {
        let start = match from {
            Bound::Included(k) => self.base.partition_point(|&o| self.base_key(o) < k),
            Bound::Excluded(k) => self.base.partition_point(|&o| self.base_key(o) <= k),
            Bound::Unbounded => 0,
        };
        Iter {
            map: self,
            base: start,
            overlay: self
                .overlay
                .range::<[u8], _>((from, Bound::Unbounded))
                .peekable(),
        }
    }

    /// Visits the entries from `from` on whose keys start with `prefix`, in key order.
    pub(super) fn walk(
        &self,
        prefix: &str,
        from: Bound<&str>,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) {
        // One entry reused across visits: the key's buffer is allocated once, not per key.
        let mut entry = KvEntry {
            key: String::new(),
            value: Bytes::new(),
            version: VersionToken::UNKNOWN,
        };
        let from: Bound<&[u8]> = match from {
            Bound::Included(k) => Bound::Included(k.as_bytes()),
            Bound::Excluded(k) => Bound::Excluded(k.as_bytes()),
            Bound::Unbounded => Bound::Unbounded,
        };
        for item in self.iter_from(from) {
            // Keys sharing the prefix are contiguous in order: the first one without it ends the range.
            if !item.key.starts_with(prefix.as_bytes()) {
                break;
            }
            entry.key.clear();
            entry.key.push_str(&String::from_utf8_lossy(item.key));
            entry.value = self.value_bytes(&item);
            entry.version = item.version;
            if visit(&entry).is_break() {
                break;
            }
        }
    }

    /// An item's value as shared bytes (a slice of the buffer or of the overlay's record), never a
    /// copy.
    pub(super) fn value_bytes(&self, item: &Item<'_>) -> Bytes {
        match item.owned {
            Some(owned) => owned.slice_ref(item.value),
            None => self.buf.slice_ref(item.value),
        }
    }

    /// The key of the base record at `offset`.
    fn base_key(&self, offset: u64) -> &[u8] {
        base_key_in(&self.buf, offset)
    }

    /// Key, value and version of the base record at `offset`. The record was checked whole when
    /// the offset was taken, so reading it again cannot fail; if it ever did (a bug), the entry
    /// reads as an empty key, which sorts first and matches no lookup of a real key.
    fn base_fields(&self, offset: u64) -> (&[u8], &[u8], VersionToken) {
        let p = self.base_record(offset);
        (p.key, p.value, p.version)
    }

    /// [`Self::base_fields`] and the whole framed record (empty in the bug case above).
    fn base_record(&self, offset: u64) -> format::PutRecord<'_> {
        let fields = usize::try_from(offset)
            .ok()
            .and_then(|at| self.buf.get(at..))
            .and_then(format::put_record);
        debug_assert!(fields.is_some(), "base offset {offset} is not a Put record");
        fields.unwrap_or(format::PutRecord {
            key: &[],
            value: &[],
            version: VersionToken::UNKNOWN,
            bytes: &[],
        })
    }

    /// The base's entry for `key`: (position, value, version).
    fn base_find(&self, key: &[u8]) -> Option<(usize, &[u8], VersionToken)> {
        if self.base.is_empty() {
            return None;
        }
        let i = match self.index() {
            Some(index) => *index.find(key_hash(&self.hasher, key), |&p| {
                self.base_key(self.base[p as usize]) == key
            })? as usize,
            // More keys than a u32 counts: no index, a binary search.
            None => self
                .base
                .binary_search_by(|&o| self.base_key(o).cmp(key))
                .ok()?,
        };
        let (_, value, version) = self.base_fields(self.base[i]);
        Some((i, value, version))
    }

    /// The base's hash index, built now if this is the first lookup since the base was made.
    fn index(&self) -> Option<&HashTable<u32>> {
        if u32::try_from(self.base.len()).is_err() {
            return None;
        }
        Some(self.index.get_or_init(|| {
            let (base, buf, hasher) = (&self.base, &self.buf, &self.hasher);
            let rehash = |&p: &u32| key_hash(hasher, base_key_in(buf, base[p as usize]));
            // Sized once: the keys are read in buffer order, and nothing is rehashed.
            let mut index = HashTable::with_capacity(base.len());
            for (pos, &offset) in base.iter().enumerate() {
                let hash = key_hash(hasher, base_key_in(buf, offset));
                // pos < base.len() <= u32::MAX, checked above.
                index.insert_unique(hash, pos as u32, rehash);
            }
            index
        }))
    }
}

fn key_hash(hasher: &RandomState, key: &[u8]) -> u64 {
    hasher.hash_one(key)
}

/// The key of the Put (or, in a replay's tail, Delete) record at `offset` of `buf` (checked whole
/// when the offset was taken; a bug reads as the empty key, see [`LiveMap::base_fields`]).
fn base_key_in(buf: &Bytes, offset: u64) -> &[u8] {
    let key = usize::try_from(offset)
        .ok()
        .and_then(|at| buf.get(at..))
        .and_then(format::record_key);
    debug_assert!(key.is_some(), "base offset {offset} is not a Put record");
    key.unwrap_or(&[])
}

/// The merge of the base and the overlay, in key order; the overlay wins on equal keys.
pub(super) struct Iter<'a> {
    map: &'a LiveMap,
    base: usize,
    overlay: Peekable<btree_set::Range<'a, Change>>,
}

impl<'a> Iterator for Iter<'a> {
    type Item = Item<'a>;

    fn next(&mut self) -> Option<Item<'a>> {
        loop {
            let base = self
                .map
                .base
                .get(self.base)
                .map(|&o| self.map.base_record(o));
            let from_overlay = match (&base, self.overlay.peek()) {
                (None, None) => return None,
                (None, Some(_)) => true,
                (Some(_), None) => false,
                (Some(b), Some(change)) => match change.key().cmp(b.key) {
                    Ordering::Less => true,
                    Ordering::Equal => {
                        // The overlay's entry shadows the base's.
                        self.base += 1;
                        true
                    }
                    Ordering::Greater => false,
                },
            };
            if !from_overlay {
                self.base += 1;
                let b = base?;
                return Some(Item {
                    key: b.key,
                    value: b.value,
                    version: b.version,
                    owned: None,
                    record: (!b.bytes.is_empty()).then_some(b.bytes),
                });
            }
            let change = self.overlay.next()?;
            // A tombstone hides the base's record and yields nothing.
            let Some((value, version)) = change.put() else {
                continue;
            };
            return Some(Item {
                key: change.key(),
                value,
                version,
                owned: Some(&change.0),
                // A Put record is what a compacted log holds for it, byte for byte.
                record: Some(&change.0),
            });
        }
    }
}

/// A compacted log of `fold` encoded in memory: the file's bytes, and the offsets of its Put
/// records (what [`LiveMap::rebase`] takes). Allocated once at its final size.
pub(super) fn encode_compacted(fold: &LiveMap) -> (Vec<u8>, Vec<u64>) {
    let mut out = Vec::with_capacity(usize::try_from(fold.compacted_len()).unwrap_or(0));
    let mut offsets = Vec::with_capacity(usize::try_from(fold.len()).unwrap_or(0));
    format::encode_header(&mut out);
    for item in fold.iter_from(Bound::Unbounded) {
        offsets.push(out.len() as u64);
        format::encode_put(
            &mut out,
            &String::from_utf8_lossy(item.key),
            item.value,
            item.version,
        );
    }
    format::encode_cursor(&mut out, fold.cursor);
    debug_assert_eq!(
        out.len() as u64,
        fold.compacted_len(),
        "the live size is kept exact"
    );
    (out, offsets)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::kv::KvEntry;

    /// A seeded xorshift: the model test's failures replay from their seed.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    fn check_against(map: &LiveMap, model: &BTreeMap<String, (Vec<u8>, VersionToken)>, seed: u64) {
        assert_eq!(map.len(), model.len() as u64, "len, seed {seed}");
        let walked: Vec<(String, Vec<u8>, VersionToken)> = map
            .iter_from(Bound::Unbounded)
            .map(|i| {
                (
                    String::from_utf8_lossy(i.key).into_owned(),
                    i.value.to_vec(),
                    i.version,
                )
            })
            .collect();
        let expected: Vec<(String, Vec<u8>, VersionToken)> = model
            .iter()
            .map(|(k, (v, ver))| (k.clone(), v.clone(), *ver))
            .collect();
        assert_eq!(walked, expected, "walk, seed {seed}");
        for k in 0..40 {
            let key = format!("k{k:02}");
            assert_eq!(
                map.get(&key).map(|(v, ver)| (v.to_vec(), ver)),
                model.get(&key).cloned(),
                "get {key}, seed {seed}"
            );
        }
        let live: u64 = model
            .iter()
            .map(|(k, (v, ver))| format::put_record_len(k.len(), v.len(), *ver) as u64)
            .sum();
        assert_eq!(
            map.compacted_len(),
            (HEADER_LEN + format::cursor_record_len(map.cursor)) as u64 + live,
            "put bytes, seed {seed}"
        );
    }

    /// Random puts and deletes over 40 keys, with rebases between rounds, agree with an ordered
    /// map after every step: gets, the merged walk, `len` and the compacted size.
    #[test]
    fn base_and_overlay_agree_with_an_ordered_map_through_puts_deletes_and_rebases() {
        for seed in 1..=40u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let mut map = LiveMap::default();
            let mut model = BTreeMap::new();
            for round in 0..6 {
                for step in 0..60u64 {
                    let key = format!("k{:02}", rng.next() % 40);
                    if rng.next().is_multiple_of(3) {
                        map.apply(&KvUpdate::Delete {
                            key: key.clone(),
                            version: VersionToken::from_u64(step),
                        });
                        model.remove(&key);
                    } else {
                        let value = vec![round as u8; (rng.next() % 9) as usize];
                        let version = VersionToken::from_u64(round * 100 + step);
                        map.apply(&KvUpdate::Put(KvEntry {
                            key: key.clone(),
                            value: Bytes::from(value.clone()),
                            version,
                        }));
                        model.insert(key, (value, version));
                    }
                    check_against(&map, &model, seed);
                }
                let (file, offsets) = encode_compacted(&map);
                map.rebase(Bytes::from(file), offsets);
                assert!(map.overlay.is_empty());
                check_against(&map, &model, seed);
            }
        }
    }

    /// A replay of a compacted log builds the base alone; a key out of order goes to the overlay.
    #[test]
    fn an_overlay_value_owns_its_bytes_and_keeps_no_delivered_read_alive() {
        let read = Bytes::from(vec![7u8; 64 * 1024]);
        let span = read.as_ptr() as usize..read.as_ptr() as usize + read.len();
        let mut map = LiveMap::default();
        map.put("k", read.slice(100..140), VersionToken::from_u64(1));
        let Some((value, _)) = map.get("k") else {
            panic!("the key is live");
        };
        assert_eq!(value, vec![7u8; 40]);
        assert!(
            !span.contains(&(value.as_ptr() as usize)),
            "the overlay holds a slice of the read it was delivered in"
        );
        // The read is the last owner of its buffer once the overlay copied: it converts back
        // into its vector without a copy only when nothing else shares it.
        assert!(
            read.try_into_mut().is_ok(),
            "the read's buffer is still shared"
        );
    }

    #[test]
    fn records_in_key_order_go_to_the_base_and_the_first_out_of_order_one_to_the_overlay() {
        let mut source = LiveMap::default();
        for k in ["a", "b", "c"] {
            source.put(k, Bytes::from_static(b"v"), VersionToken::from_u64(1));
        }
        let (file, offsets) = encode_compacted(&source);
        let mut map = LiveMap::over(Bytes::from(file));
        for (o, k) in offsets.iter().zip(["a", "b", "c"]) {
            assert!(map.push_base(*o as usize, k, 1, VersionToken::from_u64(1)));
        }
        assert!(!map.push_base(offsets[0] as usize, "a", 1, VersionToken::from_u64(1)));
        assert_eq!(map.base.len(), 3);
        assert!(map.put("b", Bytes::from_static(b"w"), VersionToken::from_u64(2)));
        assert!(!map.push_base(offsets[2] as usize, "c", 1, VersionToken::from_u64(1)));
        assert_eq!(
            map.get("b"),
            Some((Bytes::from_static(b"w"), VersionToken::from_u64(2)))
        );
        assert_eq!(map.len(), 3);
    }

    /// A delete of an absent key during a replay builds the hash index without ending the base;
    /// keys pushed after it must still be found by their lookups.
    #[test]
    fn a_key_pushed_after_the_hash_index_was_built_is_found_by_it() {
        let mut source = LiveMap::default();
        for k in ["a", "b", "c"] {
            source.put(k, Bytes::from_static(b"v"), VersionToken::from_u64(1));
        }
        let (file, offsets) = encode_compacted(&source);
        let mut map = LiveMap::over(Bytes::from(file));
        let version = VersionToken::from_u64(1);
        assert!(map.push_base(offsets[0] as usize, "a", 1, version));
        map.remove("absent");
        assert!(map.index.get().is_some(), "the lookup built the index");
        assert!(map.push_base(offsets[1] as usize, "b", 1, version));
        map.remove("absent-too");
        assert!(map.push_base(offsets[2] as usize, "c", 1, version));
        for k in ["a", "b", "c"] {
            assert_eq!(map.get(k), Some((Bytes::from_static(b"v"), version)), "{k}");
        }
        map.remove("b");
        assert_eq!(map.get("b"), None);
        assert_eq!((map.len(), map.layers()), (2, (3, 1)));
    }
}
