//! The byte format of `fold.log`: pure encode and decode functions, no I/O.
//!
//! Layout (all integers little-endian):
//! - Header: `b"FHLG"` ++ version `u16` (= [`VERSION`]), [`HEADER_LEN`] bytes.
//! - Record: `crc32: u32 ++ type: u8 ++ payload`; the CRC (IEEE, `crc32fast`) covers the type byte
//!   through the end of the record, so a flipped type or length byte is caught like a flipped value
//!   byte.
//!   - type 1 Put: `key_len: u16 ++ key ++ value_len: u32 ++ value ++ ver_len: u8 ++ version`
//!   - type 2 Delete: `key_len: u16 ++ key ++ ver_len: u8 ++ version` (purges are written as deletes:
//!     a fold treats them the same)
//!   - type 3 Cursor: `cur_len: u8 ++ cursor` ([`WatchCursor::to_bytes`])
//!
//! Guarantees:
//! - The encoder refuses (with [`SnapshotError::TooLarge`]) a key over [`MAX_KEY_LEN`] or a value
//!   over [`MAX_VALUE_LEN`] *before* touching the output buffer, so a refused batch writes nothing.
//! - The decoder never allocates or trusts a declared length: a value length over the cap is
//!   [`Invalid`], a length running past the buffer is [`Decoded::Truncated`], and the returned key and
//!   value borrow from the input, so the caller decides whether to copy or share them.
//! - The decoder is total: every byte string decodes to exactly one [`Decoded`] outcome; it never
//!   panics on hostile input.

use std::fmt;

use crate::kv::{KvUpdate, VersionToken, WatchCursor};
use crate::snapshot::SnapshotError;

/// The file's first four bytes.
pub(crate) const MAGIC: [u8; 4] = *b"FHLG";
/// The only format version this build reads and writes.
pub(crate) const VERSION: u16 = 1;
/// Length of the header (magic + version).
pub(crate) const HEADER_LEN: usize = 6;

/// The largest value the fold stores, on write and on read: 64 MiB, NATS's payload ceiling.
pub const MAX_VALUE_LEN: usize = 64 * 1024 * 1024;
/// The longest key the fold stores (the format spends a `u16` on the key length).
pub const MAX_KEY_LEN: usize = u16::MAX as usize;

const TYPE_PUT: u8 = 1;
const TYPE_DELETE: u8 = 2;
const TYPE_CURSOR: u8 = 3;
/// CRC + type byte, in front of every payload.
const RECORD_PREFIX_LEN: usize = 5;

/// A decoded record. Key and value borrow from the decoded buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Record<'a> {
    /// The key now holds `value`.
    Put {
        /// The key (validated UTF-8).
        key: &'a str,
        /// The value bytes.
        value: &'a [u8],
        /// The key's version.
        version: VersionToken,
    },
    /// The key was deleted or purged.
    Delete {
        /// The key (validated UTF-8).
        key: &'a str,
        /// The marker's version.
        version: VersionToken,
    },
    /// Every record before this one is one applied batch boundary: the fold is valid here.
    Cursor(WatchCursor),
}

/// Why a record that fits in the buffer and frames cleanly cannot be a record of this format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Invalid {
    /// The type byte names no record type (a run of NULs reads as type 0).
    UnknownType(u8),
    /// A put declares a value longer than [`MAX_VALUE_LEN`].
    ValueTooLarge(u32),
    /// The version length is over [`VersionToken::MAX_LEN`].
    VersionTooLong(u8),
    /// The key is not UTF-8.
    KeyNotUtf8,
    /// The cursor bytes are not a cursor encoding (0, 8, 12 or 20 bytes).
    BadCursorLength(u8),
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Invalid::UnknownType(0) => write!(f, "unknown record type 0 (NUL bytes)"),
            Invalid::UnknownType(t) => write!(f, "unknown record type {t}"),
            Invalid::ValueTooLarge(n) => {
                write!(
                    f,
                    "declared value length {n} exceeds the {MAX_VALUE_LEN}-byte cap"
                )
            }
            Invalid::VersionTooLong(n) => write!(
                f,
                "version length {n} exceeds {} bytes",
                VersionToken::MAX_LEN
            ),
            Invalid::KeyNotUtf8 => write!(f, "key is not UTF-8"),
            Invalid::BadCursorLength(n) => {
                write!(f, "cursor of {n} bytes is not a cursor (0, 8, 12 or 20)")
            }
        }
    }
}

/// The outcome of decoding the record at the start of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decoded<'a> {
    /// A whole record whose CRC matches, and its encoded length.
    Record {
        /// The record.
        record: Record<'a>,
        /// Bytes it occupies, CRC included.
        len: usize,
    },
    /// The declared lengths run past the end of the buffer.
    Truncated,
    /// The record frames (its declared length fits) but its CRC does not match.
    BadCrc {
        /// Bytes the record claims to occupy, so the caller can look at what follows it.
        len: usize,
        /// The CRC stored in the record.
        stored: u32,
        /// The CRC of the bytes as read.
        computed: u32,
    },
    /// The bytes cannot be a record of this format.
    Invalid(Invalid),
}

/// Appends the file header.
pub(crate) fn encode_header(out: &mut Vec<u8>) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
}

/// Why a header is not one this build reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeaderError {
    /// Fewer than [`HEADER_LEN`] bytes.
    TooShort(usize),
    /// The first four bytes are not [`MAGIC`].
    BadMagic([u8; 4]),
    /// A version this build does not know.
    UnknownVersion(u16),
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeaderError::TooShort(n) => {
                write!(
                    f,
                    "{n}-byte file is shorter than the {HEADER_LEN}-byte header"
                )
            }
            HeaderError::BadMagic(m) => write!(f, "bad magic {m:02x?} (expected {MAGIC:02x?})"),
            HeaderError::UnknownVersion(v) => {
                write!(f, "unknown format version {v} (this build reads {VERSION})")
            }
        }
    }
}

/// Checks the header at the start of `buf` (which must not be empty-by-design: the caller handles a
/// 0-byte file as a new fold).
pub(crate) fn decode_header(buf: &[u8]) -> Result<(), HeaderError> {
    let (Some(magic), Some(version)) = (array::<4>(buf, 0), array::<2>(buf, 4)) else {
        return Err(HeaderError::TooShort(buf.len()));
    };
    if magic != MAGIC {
        return Err(HeaderError::BadMagic(magic));
    }
    match u16::from_le_bytes(version) {
        VERSION => Ok(()),
        other => Err(HeaderError::UnknownVersion(other)),
    }
}

/// Refuses an update the format cannot hold. Called on a whole batch before encoding any of it.
pub(crate) fn check_update(update: &KvUpdate) -> Result<(), SnapshotError> {
    let key = update.key();
    if key.len() > MAX_KEY_LEN {
        return Err(SnapshotError::TooLarge(format!(
            "key of {} bytes (starting {:?}) exceeds the {MAX_KEY_LEN}-byte cap",
            key.len(),
            &key[..key.floor_char_boundary(32)]
        )));
    }
    if let KvUpdate::Put(e) = update
        && e.value.len() > MAX_VALUE_LEN
    {
        return Err(SnapshotError::TooLarge(format!(
            "value of {} bytes for key {:?} exceeds the {MAX_VALUE_LEN}-byte cap",
            e.value.len(),
            &key[..key.floor_char_boundary(256)]
        )));
    }
    Ok(())
}

/// Appends one Put or Delete record (a purge is written as a delete). Nothing is appended when the
/// update is refused.
pub(crate) fn encode_update(out: &mut Vec<u8>, update: &KvUpdate) -> Result<(), SnapshotError> {
    check_update(update)?;
    match update {
        KvUpdate::Put(e) => encode_put(out, &e.key, &e.value, e.version),
        KvUpdate::Delete { key, version } | KvUpdate::Purge { key, version } => {
            encode_delete(out, key, *version)
        }
    }
    Ok(())
}

/// Appends a Put record. The caller has checked the sizes ([`check_update`]).
pub(crate) fn encode_put(out: &mut Vec<u8>, key: &str, value: &[u8], version: VersionToken) {
    let start = begin_record(out, TYPE_PUT);
    put_key(out, key);
    // Sizes were checked against MAX_VALUE_LEN, which fits in a u32.
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(value);
    put_version(out, version);
    finish_record(out, start);
}

/// Appends a Delete record.
pub(crate) fn encode_delete(out: &mut Vec<u8>, key: &str, version: VersionToken) {
    let start = begin_record(out, TYPE_DELETE);
    put_key(out, key);
    put_version(out, version);
    finish_record(out, start);
}

/// Appends a Cursor record: the batch boundary recovery rolls back to.
pub(crate) fn encode_cursor(out: &mut Vec<u8>, cursor: WatchCursor) {
    let start = begin_record(out, TYPE_CURSOR);
    let bytes = cursor.to_bytes();
    // to_bytes is 0, 8, 12 or 20 bytes long.
    out.push(bytes.len() as u8);
    out.extend_from_slice(&bytes);
    finish_record(out, start);
}

/// Encoded size of the record [`encode_update`] writes for `update`, so a batch's buffer is allocated
/// once.
pub(crate) fn update_record_len(update: &KvUpdate) -> usize {
    match update {
        KvUpdate::Put(e) => put_record_len(e.key.len(), e.value.len(), e.version),
        KvUpdate::Delete { key, version } | KvUpdate::Purge { key, version } => {
            RECORD_PREFIX_LEN + 2 + key.len() + 1 + version.as_bytes().len()
        }
    }
}

/// Encoded size of a Put record, for the compaction trigger's estimate of the live fold.
pub(crate) fn put_record_len(key_len: usize, value_len: usize, version: VersionToken) -> usize {
    RECORD_PREFIX_LEN + 2 + key_len + 4 + value_len + 1 + version.as_bytes().len()
}

/// Encoded size of a Cursor record.
pub(crate) fn cursor_record_len(cursor: WatchCursor) -> usize {
    RECORD_PREFIX_LEN + 1 + cursor.to_bytes().len()
}

/// Reserves the CRC, writes the type byte; returns where the record starts.
fn begin_record(out: &mut Vec<u8>, kind: u8) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.push(kind);
    start
}

/// Fills in the CRC over the type byte through the end of the record.
fn finish_record(out: &mut [u8], start: usize) {
    let crc = crc32fast::hash(&out[start + 4..]);
    out[start..start + 4].copy_from_slice(&crc.to_le_bytes());
}

fn put_key(out: &mut Vec<u8>, key: &str) {
    // Checked against MAX_KEY_LEN = u16::MAX.
    out.extend_from_slice(&(key.len() as u16).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
}

fn put_version(out: &mut Vec<u8>, version: VersionToken) {
    let bytes = version.as_bytes();
    // A VersionToken is at most 10 bytes by construction.
    out.push(bytes.len() as u8);
    out.extend_from_slice(bytes);
}

/// Decodes the record at the start of `buf`.
///
/// Order of checks, chosen so each failure gets the most useful name: first the framing (type byte
/// and length fields: unknown type and over-cap value lengths are [`Invalid`], lengths past the end
/// are [`Decoded::Truncated`]), then the CRC over the framed bytes ([`Decoded::BadCrc`], so a flipped
/// bit anywhere reads as a checksum failure), and only then the meaning of CRC-valid bytes (UTF-8
/// key, version and cursor lengths).
pub(crate) fn decode_record(buf: &[u8]) -> Decoded<'_> {
    let (Some(stored), Some(kind)) = (array::<4>(buf, 0), buf.get(4).copied()) else {
        return Decoded::Truncated;
    };
    let framed = match kind {
        TYPE_PUT => frame_put(buf),
        TYPE_DELETE => frame_delete(buf),
        TYPE_CURSOR => frame_cursor(buf),
        other => Err(Frame::Invalid(Invalid::UnknownType(other))),
    };
    let fields = match framed {
        Ok(fields) => fields,
        Err(Frame::Truncated) => return Decoded::Truncated,
        Err(Frame::Invalid(why)) => return Decoded::Invalid(why),
    };
    let stored = u32::from_le_bytes(stored);
    let computed = crc32fast::hash(&buf[4..fields.len]);
    if stored != computed {
        return Decoded::BadCrc {
            len: fields.len,
            stored,
            computed,
        };
    }
    match interpret(kind, &fields) {
        Ok(record) => Decoded::Record {
            record,
            len: fields.len,
        },
        Err(why) => Decoded::Invalid(why),
    }
}

/// Key, value and version of the Put record at the start of `buf`, read by its framing alone: no
/// CRC and no UTF-8 check. Only for records a [`decode_record`] (or the encoder) already checked
/// whole, such as the append log's in-RAM base; `None` when `buf` does not start with a framed Put.
pub(crate) fn put_fields(buf: &[u8]) -> Option<(&[u8], &[u8], VersionToken)> {
    put_record(buf).map(|p| (p.key, p.value, p.version))
}

/// A framed Put record's fields and its whole bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PutRecord<'a> {
    pub(crate) key: &'a [u8],
    pub(crate) value: &'a [u8],
    pub(crate) version: VersionToken,
    /// The record, CRC to version: what a compacted log holds for this entry, byte for byte.
    pub(crate) bytes: &'a [u8],
}

/// [`put_fields`], with the whole record (same conditions: framing only, no CRC).
pub(crate) fn put_record(buf: &[u8]) -> Option<PutRecord<'_>> {
    if buf.get(4) != Some(&TYPE_PUT) {
        return None;
    }
    let fields = frame_put(buf).ok()?;
    Some(PutRecord {
        key: fields.key,
        value: fields.value,
        version: VersionToken::from_bytes(fields.tail)?,
        bytes: buf.get(..fields.len)?,
    })
}

/// The key of the Put or Delete record at the start of `buf`, read by its framing alone (see
/// [`put_fields`]).
pub(crate) fn record_key(buf: &[u8]) -> Option<&[u8]> {
    if !matches!(buf.get(4), Some(&TYPE_PUT | &TYPE_DELETE)) {
        return None;
    }
    let len = usize::from(u16::from_le_bytes(array::<2>(buf, RECORD_PREFIX_LEN)?));
    buf.get(RECORD_PREFIX_LEN + 2..RECORD_PREFIX_LEN + 2 + len)
}

/// Whether `buf` starts with a Put record (by its type byte alone).
pub(crate) fn is_put(buf: &[u8]) -> bool {
    buf.get(4) == Some(&TYPE_PUT)
}

/// The raw fields of a framed record: slices of the buffer, not yet checked for meaning.
struct Fields<'a> {
    key: &'a [u8],
    value: &'a [u8],
    /// The version bytes for Put/Delete, the cursor bytes for Cursor.
    tail: &'a [u8],
    /// Total record length, CRC included.
    len: usize,
}

/// Why a record could not be framed.
enum Frame {
    Truncated,
    Invalid(Invalid),
}

fn frame_put(buf: &[u8]) -> Result<Fields<'_>, Frame> {
    let mut r = Reader::at(buf, RECORD_PREFIX_LEN);
    let key_len = usize::from(u16::from_le_bytes(r.array()?));
    let key = r.take(key_len)?;
    let value_len = u32::from_le_bytes(r.array()?);
    // Checked before taking the bytes: an absurd length is corruption, not a torn tail to wait for.
    if value_len as usize > MAX_VALUE_LEN {
        return Err(Frame::Invalid(Invalid::ValueTooLarge(value_len)));
    }
    let value = r.take(value_len as usize)?;
    let [ver_len] = r.array()?;
    let tail = r.take(usize::from(ver_len))?;
    Ok(Fields {
        key,
        value,
        tail,
        len: r.pos,
    })
}

fn frame_delete(buf: &[u8]) -> Result<Fields<'_>, Frame> {
    let mut r = Reader::at(buf, RECORD_PREFIX_LEN);
    let key_len = usize::from(u16::from_le_bytes(r.array()?));
    let key = r.take(key_len)?;
    let [ver_len] = r.array()?;
    let tail = r.take(usize::from(ver_len))?;
    Ok(Fields {
        key,
        value: &[],
        tail,
        len: r.pos,
    })
}

fn frame_cursor(buf: &[u8]) -> Result<Fields<'_>, Frame> {
    let mut r = Reader::at(buf, RECORD_PREFIX_LEN);
    let [cur_len] = r.array()?;
    let tail = r.take(usize::from(cur_len))?;
    Ok(Fields {
        key: &[],
        value: &[],
        tail,
        len: r.pos,
    })
}

/// Gives CRC-valid fields their meaning.
fn interpret<'a>(kind: u8, f: &Fields<'a>) -> Result<Record<'a>, Invalid> {
    if kind == TYPE_CURSOR {
        return WatchCursor::from_bytes(f.tail)
            .map(Record::Cursor)
            .ok_or(Invalid::BadCursorLength(f.tail.len() as u8));
    }
    let version =
        VersionToken::from_bytes(f.tail).ok_or(Invalid::VersionTooLong(f.tail.len() as u8))?;
    let key = std::str::from_utf8(f.key).map_err(|_| Invalid::KeyNotUtf8)?;
    Ok(if kind == TYPE_PUT {
        Record::Put {
            key,
            value: f.value,
            version,
        }
    } else {
        Record::Delete { key, version }
    })
}

/// A bounds-checked cursor over a record: every read that would run past the end is
/// [`Frame::Truncated`].
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn at(buf: &'a [u8], pos: usize) -> Self {
        Reader { buf, pos }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Frame> {
        let end = self.pos.checked_add(n).ok_or(Frame::Truncated)?;
        let bytes = self.buf.get(self.pos..end).ok_or(Frame::Truncated)?;
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Frame> {
        let a = array::<N>(self.buf, self.pos).ok_or(Frame::Truncated)?;
        self.pos += N;
        Ok(a)
    }
}

/// `N` bytes of `buf` at `at`, or `None` past the end.
fn array<const N: usize>(buf: &[u8], at: usize) -> Option<[u8; N]> {
    buf.get(at..at.checked_add(N)?)?.try_into().ok()
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::kv::KvEntry;

    fn put(key: &str, value: &[u8], version: VersionToken) -> KvUpdate {
        KvUpdate::Put(KvEntry {
            key: key.into(),
            value: Bytes::copy_from_slice(value),
            version,
        })
    }

    fn ten_byte_version() -> VersionToken {
        VersionToken::from_bytes(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).expect("10 bytes fit")
    }

    fn decode_one(buf: &[u8]) -> (Record<'_>, usize) {
        match decode_record(buf) {
            Decoded::Record { record, len } => (record, len),
            other => panic!("expected a record, got {other:?}"),
        }
    }

    /// Recomputes the CRC of a hand-edited record so only the edit under test is wrong.
    fn reseal(record: &mut [u8]) {
        let crc = crc32fast::hash(&record[4..]);
        record[..4].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn header_round_trips_and_names_what_is_wrong() {
        let mut h = Vec::new();
        encode_header(&mut h);
        assert_eq!(h, b"FHLG\x01\x00");
        assert_eq!(decode_header(&h), Ok(()));
        assert_eq!(decode_header(&h[..3]), Err(HeaderError::TooShort(3)));
        assert_eq!(
            decode_header(b"FHLX\x01\x00"),
            Err(HeaderError::BadMagic(*b"FHLX"))
        );
        let err = decode_header(b"FHLG\x07\x00").expect_err("version 7 is unknown");
        assert_eq!(err, HeaderError::UnknownVersion(7));
        assert!(err.to_string().contains('7'), "{err}");
    }

    #[test]
    fn put_delete_and_cursor_records_round_trip() {
        let mut buf = Vec::new();
        let updates = [
            put("a/b", b"value", VersionToken::from_u64(42)),
            put("ten", b"", ten_byte_version()),
            put("unknown-version", b"x", VersionToken::UNKNOWN),
            KvUpdate::Delete {
                key: "gone".into(),
                version: VersionToken::from_u64(7),
            },
        ];
        for u in &updates {
            encode_update(&mut buf, u).expect("fits");
        }
        encode_cursor(&mut buf, WatchCursor::at(u64::MAX));
        encode_cursor(&mut buf, WatchCursor::NONE);

        let mut at = 0;
        let mut decoded = Vec::new();
        while at < buf.len() {
            let (record, len) = decode_one(&buf[at..]);
            decoded.push(record);
            at += len;
        }
        let expected = vec![
            Record::Put {
                key: "a/b",
                value: b"value",
                version: VersionToken::from_u64(42),
            },
            Record::Put {
                key: "ten",
                value: b"",
                version: ten_byte_version(),
            },
            Record::Put {
                key: "unknown-version",
                value: b"x",
                version: VersionToken::UNKNOWN,
            },
            Record::Delete {
                key: "gone",
                version: VersionToken::from_u64(7),
            },
            Record::Cursor(WatchCursor::at(u64::MAX)),
            Record::Cursor(WatchCursor::NONE),
        ];
        assert_eq!(decoded, expected);
    }

    #[test]
    fn purge_is_encoded_as_delete() {
        let version = VersionToken::from_u64(9);
        let (mut purge, mut delete) = (Vec::new(), Vec::new());
        let key = "k".to_string();
        encode_update(
            &mut purge,
            &KvUpdate::Purge {
                key: key.clone(),
                version,
            },
        )
        .expect("fits");
        encode_update(&mut delete, &KvUpdate::Delete { key, version }).expect("fits");
        assert_eq!(purge, delete);
    }

    #[test]
    fn cursor_record_lengths_match_the_encoder() {
        let mut buf = Vec::new();
        let memo = Some(crate::kv::EvictionMemo {
            server_time_unix_ns: 5,
        });
        for cursor in [
            WatchCursor::NONE,
            WatchCursor::at(3),
            WatchCursor::at(3).with_memo(memo),
        ] {
            buf.clear();
            encode_cursor(&mut buf, cursor);
            assert_eq!(buf.len(), cursor_record_len(cursor));
        }
    }

    #[test]
    fn predicted_record_lengths_match_the_encoder() {
        let updates = [
            put("key", b"12345", ten_byte_version()),
            KvUpdate::Purge {
                key: "purged".into(),
                version: VersionToken::UNKNOWN,
            },
        ];
        for u in &updates {
            let mut buf = Vec::new();
            encode_update(&mut buf, u).expect("fits");
            assert_eq!(buf.len(), update_record_len(u), "{u:?}");
        }
    }

    #[test]
    fn every_proper_prefix_of_a_record_is_truncated() {
        let mut buf = Vec::new();
        encode_put(&mut buf, "key", b"value", ten_byte_version());
        for cut in 0..buf.len() {
            assert_eq!(
                decode_record(&buf[..cut]),
                Decoded::Truncated,
                "cut at {cut}"
            );
        }
        assert!(matches!(decode_record(&buf), Decoded::Record { .. }));
    }

    #[test]
    fn any_flipped_byte_is_never_decoded_as_a_record() {
        let mut buf = Vec::new();
        encode_put(&mut buf, "key", b"value", VersionToken::from_u64(1));
        for i in 0..buf.len() {
            let mut bad = buf.clone();
            bad[i] ^= 0x10;
            let got = decode_record(&bad);
            assert!(
                !matches!(got, Decoded::Record { .. }),
                "flip at {i}: {got:?}"
            );
        }
        // A flip inside the value frames cleanly, so it is named as a checksum failure.
        let mut bad = buf.clone();
        bad[14] ^= 1; // crc 4 + type 1 + key_len 2 + "key" 3 + value_len 4
        assert_eq!(&bad[14..19], b"walue");
        assert!(matches!(decode_record(&bad), Decoded::BadCrc { len, .. } if len == buf.len()));
    }

    #[test]
    fn declared_value_over_the_cap_is_invalid_not_truncated() {
        let mut rec = vec![0, 0, 0, 0, TYPE_PUT, 1, 0, b'k'];
        rec.extend_from_slice(&(MAX_VALUE_LEN as u32 + 1).to_le_bytes());
        rec.extend_from_slice(b"only a few bytes follow");
        reseal(&mut rec);
        assert_eq!(
            decode_record(&rec),
            Decoded::Invalid(Invalid::ValueTooLarge(MAX_VALUE_LEN as u32 + 1))
        );
    }

    #[test]
    fn version_longer_than_ten_bytes_is_invalid() {
        let mut rec = vec![0, 0, 0, 0, TYPE_DELETE, 1, 0, b'k', 11];
        rec.extend_from_slice(&[7; 11]);
        reseal(&mut rec);
        assert_eq!(
            decode_record(&rec),
            Decoded::Invalid(Invalid::VersionTooLong(11))
        );
    }

    #[test]
    fn non_utf8_key_is_invalid() {
        let mut rec = vec![0, 0, 0, 0, TYPE_DELETE, 2, 0, 0xff, 0xfe, 0];
        reseal(&mut rec);
        assert_eq!(decode_record(&rec), Decoded::Invalid(Invalid::KeyNotUtf8));
    }

    #[test]
    fn unknown_type_and_bad_cursor_length_are_invalid() {
        assert_eq!(
            decode_record(&[0; 16]),
            Decoded::Invalid(Invalid::UnknownType(0))
        );
        assert_eq!(
            decode_record(&[0, 0, 0, 0, 9, 0]),
            Decoded::Invalid(Invalid::UnknownType(9))
        );
        let mut rec = vec![0, 0, 0, 0, TYPE_CURSOR, 3, 1, 2, 3];
        reseal(&mut rec);
        assert_eq!(
            decode_record(&rec),
            Decoded::Invalid(Invalid::BadCursorLength(3))
        );
    }

    #[test]
    fn encoder_refuses_oversized_value_and_key_without_writing() {
        let mut buf = vec![1, 2, 3];
        let big_value = KvUpdate::Put(KvEntry {
            key: "k".into(),
            value: Bytes::from(vec![0u8; MAX_VALUE_LEN + 1]),
            version: VersionToken::from_u64(1),
        });
        let err = encode_update(&mut buf, &big_value).expect_err("value over the cap");
        assert!(matches!(err, SnapshotError::TooLarge(_)), "{err}");
        let big_key = KvUpdate::Delete {
            key: "k".repeat(MAX_KEY_LEN + 1),
            version: VersionToken::from_u64(1),
        };
        let err = encode_update(&mut buf, &big_key).expect_err("key over the cap");
        assert!(matches!(err, SnapshotError::TooLarge(_)), "{err}");
        assert_eq!(buf, [1, 2, 3]);
    }

    #[test]
    fn value_exactly_at_the_cap_round_trips() {
        let mut buf = Vec::new();
        let value = vec![0xabu8; MAX_VALUE_LEN];
        encode_update(&mut buf, &put("k", &value, VersionToken::from_u64(1))).expect("at the cap");
        let (record, _) = decode_one(&buf);
        assert!(matches!(record, Record::Put { value: v, .. } if v.len() == MAX_VALUE_LEN));
    }
}
