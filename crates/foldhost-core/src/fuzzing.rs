//! Not an API: the entry points the fuzz targets (`fuzz/fuzz_targets/`) and the corpus replay
//! share (docs/fuzzing.md). Compiled only for this crate's tests and with the `fuzzing` feature.
//!
//! Each entry point takes any bytes and panics only when an invariant below fails:
//! - [`stored_record`] — `protocol::decode_stored_record` (what a stored message's header block
//!   means) is total; its verdict is the one `decode_stored` gives; the refusals are the ones its
//!   documentation names for the first line; a decoded verdict re-encoded as a canonical block
//!   decodes the same, and so does the block with an unrelated header line added; the undecodable
//!   key round-trips through `parse_undecodable_key`.
//! - [`append_log`] — the append log's byte format (`snapshot/format.rs`) and its recovery: every
//!   record `decode_record` accepts is byte for byte what the encoder writes for it, and each of
//!   its proper prefixes is `Truncated`; a read-only open of the bytes as `fold.log` recovers
//!   exactly what the module documentation promises (every batch up to the last cursor record; a
//!   torn tail — cut short, zero-filled, a bad checksum with only zeros after — discarded and
//!   reported; anything else refused as corrupted), computed here independently record by record;
//!   `CompactLogCheck` accepts exactly the compacted logs, whatever chunks it is fed in; a
//!   writable open recovers the same fold and leaves a log that reopens to it with nothing
//!   discarded.
//! - [`channel_records`] — a release entry and a node report (`protocol::decode_entry`,
//!   `decode_report`): anything decoded keeps every bound the decoders promise, re-encodes
//!   (`serde_json`) to bytes that decode to the same value, and drives the rollout's deciders
//!   (`rollout`, `next_step`, `start_version`, …) without a panic.
//! - [`ledger_row`] — the host's reserved rows: `LedgerRow`, `LedgerLife`, `AppliedIntent`,
//!   retained records, `StreamIdentity` and `WatchCursor`: each decoder is total, accepts exactly
//!   the bytes its format admits, and what it decodes re-encodes to the same value (to the same
//!   bytes where the format has one encoding).

use std::collections::BTreeMap;
use std::path::Path;

use crate::kv::{KvEntry, KvUpdate, StreamIdentity, VersionToken, WatchCursor};
use crate::protocol::{self, KvOp, Undecodable};
use crate::snapshot::{
    AppendLogOptions, AppendLogSnapshot, CompactLogCheck, LOG_FILE, SnapshotError, SnapshotStore,
};

/// The fuzz corpus directory of `target` (`fuzz/corpus/<target>/`) and its kept regressions
/// (`fuzz/regressions/<target>/`), from this crate's manifest directory.
#[cfg(test)]
fn corpus_dirs(target: &str) -> [std::path::PathBuf; 2] {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    [
        root.join("corpus").join(target),
        root.join("regressions").join(target),
    ]
}

/// Runs `body` over every file of `target`'s corpus and regressions, in name order; the corpus
/// must hold at least one file (a missing corpus fails, never passes empty). Returns how many
/// inputs ran.
#[cfg(test)]
pub(crate) fn replay_corpus(target: &str, body: fn(&[u8])) -> usize {
    let [corpus, regressions] = corpus_dirs(target);
    let mut files = Vec::new();
    for dir in [&corpus, &regressions] {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_file()) {
                files.push(e.path());
            }
        }
    }
    files.sort();
    assert!(
        files.iter().any(|f| f.starts_with(&corpus)),
        "no corpus at {}",
        corpus.display()
    );
    for f in &files {
        let bytes = std::fs::read(f).expect("read a corpus file");
        eprintln!("replay {}", f.display());
        body(&bytes);
    }
    files.len()
}

/// Writes `bytes` as a seed of `target`'s corpus, named by its content (as cargo-fuzz names the
/// inputs it keeps, with BLAKE3 for SHA-1).
#[cfg(test)]
pub(crate) fn write_seed(target: &str, bytes: &[u8]) {
    let [dir, _] = corpus_dirs(target);
    std::fs::create_dir_all(&dir).expect("create the corpus directory");
    let name = blake3::hash(bytes).to_hex();
    std::fs::write(dir.join(&name[..40]), bytes).expect("write a seed");
}

/// A directory for one input's files: on the memory file system where there is one (the append
/// log's compaction and the artifact import fsync), removed when dropped.
pub fn scratch_dir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    tempfile::Builder::new()
        .prefix("foldhost-fuzz-")
        .tempdir_in(base)
        .expect("a scratch directory")
}

// ---------------------------------------------------------------------------------------------
// stored_record

/// The canonical header block of a verdict: the block a host's own publish writes for it.
fn canonical_block(op: KvOp, id: Option<protocol::OpId>) -> String {
    let mut b = String::from("NATS/1.0\r\n");
    match op {
        KvOp::Put => {}
        KvOp::Delete => b.push_str("KV-Operation: DEL\r\n"),
        KvOp::Purge => b.push_str("KV-Operation: PURGE\r\n"),
    }
    if let Some(id) = id {
        b.push_str(&format!("{}: {id}\r\n", protocol::OP_ID_HEADER));
    }
    b.push_str("\r\n");
    b
}

/// The stored-message decoder over `data` as a header block (module docs).
pub fn stored_record(data: &[u8]) {
    let verdict = protocol::decode_stored_record(Some(data));
    assert_eq!(
        protocol::decode_stored(Some(data)),
        verdict.map(|(op, _)| op),
        "decode_stored and decode_stored_record disagree"
    );
    // What the first line alone decides, as the documentation states it.
    match std::str::from_utf8(data) {
        Err(_) => assert_eq!(verdict, Err(Undecodable::NotUtf8)),
        Ok("") => assert_eq!(verdict, Err(Undecodable::Empty)),
        Ok(text) => {
            let first = text.lines().next().unwrap_or_default();
            match first.strip_prefix("NATS/1.0") {
                None => assert_eq!(verdict, Err(Undecodable::NoVersionLine)),
                Some(rest) if !rest.trim().is_empty() => {
                    assert_eq!(verdict, Err(Undecodable::StatusLine))
                }
                Some(_) => assert!(
                    !matches!(
                        verdict,
                        Err(Undecodable::NotUtf8
                            | Undecodable::Empty
                            | Undecodable::NoVersionLine
                            | Undecodable::StatusLine)
                    ),
                    "a version line alone refused: {verdict:?}"
                ),
            }
        }
    }
    if let Ok((op, id)) = verdict {
        let canonical = canonical_block(op, id);
        assert_eq!(
            protocol::decode_stored_record(Some(canonical.as_bytes())),
            Ok((op, id)),
            "the canonical block of a verdict decodes otherwise: {canonical:?}"
        );
        if data.ends_with(b"\n") {
            let mut more = data.to_vec();
            more.extend_from_slice(b"X-Fuzz-Unrelated: y\r\n\r\n");
            assert_eq!(
                protocol::decode_stored_record(Some(&more)),
                Ok((op, id)),
                "an unrelated header line changed the verdict"
            );
        }
    }
    // The key an undecodable message stands for names its subject and reason, and only such a
    // key parses as one.
    let text = String::from_utf8_lossy(data);
    for reason in [
        Undecodable::Empty,
        Undecodable::NotUtf8,
        Undecodable::NoVersionLine,
        Undecodable::StatusLine,
        Undecodable::LineWithoutColon,
        Undecodable::BadName,
        Undecodable::CrInValue,
    ] {
        let key = protocol::undecodable_key(&text, reason);
        assert_eq!(
            protocol::parse_undecodable_key(&key),
            Some((text.as_ref(), reason))
        );
        assert!(!protocol::bucket_key_admitted(&key));
    }
    if let Some((subject, reason)) = protocol::parse_undecodable_key(&text) {
        assert_eq!(protocol::undecodable_key(subject, reason), text);
    }
    if protocol::kv_key_valid(&text) {
        assert!(protocol::bucket_key_admitted(&text));
    }
}

// ---------------------------------------------------------------------------------------------
// append_log

/// The log's header as `snapshot/format.rs` documents it: the magic and version 1, little-endian.
const LOG_HEADER: &[u8; 6] = b"FHLG\x01\x00";

/// A record of the log, read here from the layout `snapshot/format.rs` documents (independently
/// of its decoder, which is private to the snapshot module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LogRecord<'a> {
    Put(&'a str, &'a [u8], VersionToken),
    Delete(&'a str, VersionToken),
    Cursor(WatchCursor),
}

/// The outcome of reading one record at a buffer's start, in the documented order: the framing
/// (an unknown type or a value length over the cap is invalid, lengths past the end are
/// truncated), then the checksum, then the meaning (a UTF-8 key, a version of at most 10 bytes, a
/// cursor encoding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LogRead<'a> {
    Record(LogRecord<'a>, usize),
    Truncated,
    BadCrc { len: usize, computed: u32 },
    Invalid,
}

/// A framed record's key, value, and version (or cursor) bytes.
type Fields<'a> = (&'a [u8], &'a [u8], &'a [u8]);

/// A bounds-checked reader over a record: `None` past the end.
struct At<'a>(&'a [u8], usize);

impl<'a> At<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let b = self.0.get(self.1..self.1.checked_add(n)?)?;
        self.1 += n;
        Some(b)
    }

    /// A little-endian integer of `N` bytes.
    fn int<const N: usize>(&mut self) -> Option<u64> {
        let b = self.take(N)?;
        Some(
            b.iter()
                .rev()
                .fold(0u64, |acc, x| (acc << 8) | u64::from(*x)),
        )
    }
}

/// The framing of a record of type `kind` at `buf`'s start: its fields and length, `Ok(None)`
/// when its lengths run past the end, `Err` for an unknown type or a value length over the cap.
fn frame_log_record(buf: &[u8], kind: u8) -> Result<Option<(Fields<'_>, usize)>, ()> {
    let mut r = At(buf, 5);
    let fields = match kind {
        1 | 2 => {
            let Some(key) = r.int::<2>().and_then(|n| r.take(n as usize)) else {
                return Ok(None);
            };
            let value: &[u8] = if kind == 1 {
                let Some(n) = r.int::<4>() else {
                    return Ok(None);
                };
                if n > crate::snapshot::MAX_VALUE_LEN as u64 {
                    return Err(());
                }
                let Some(v) = r.take(n as usize) else {
                    return Ok(None);
                };
                v
            } else {
                &[]
            };
            r.int::<1>()
                .and_then(|n| r.take(n as usize))
                .map(|ver| (key, value, ver))
        }
        3 => r
            .int::<1>()
            .and_then(|n| r.take(n as usize))
            .map(|c| (&[][..], &[][..], c)),
        _ => return Err(()),
    };
    Ok(fields.map(|f| (f, r.1)))
}

fn read_log_record(buf: &[u8]) -> LogRead<'_> {
    let Some(kind) = buf.get(4).copied() else {
        return LogRead::Truncated;
    };
    let ((key, value, tail), len) = match frame_log_record(buf, kind) {
        Err(()) => return LogRead::Invalid,
        Ok(None) => return LogRead::Truncated,
        Ok(Some(f)) => f,
    };
    let stored = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
    let computed = crc32fast::hash(&buf[4..len]);
    if stored != computed {
        return LogRead::BadCrc { len, computed };
    }
    let record = if kind == 3 {
        WatchCursor::from_bytes(tail).map(LogRecord::Cursor)
    } else {
        let key = std::str::from_utf8(key).ok();
        let version = (tail.len() <= 10)
            .then(|| VersionToken::from_bytes(tail))
            .flatten();
        match (key, version, kind) {
            (Some(k), Some(v), 1) => Some(LogRecord::Put(k, value, v)),
            (Some(k), Some(v), _) => Some(LogRecord::Delete(k, v)),
            _ => None,
        }
    };
    record.map_or(LogRead::Invalid, |rec| LogRead::Record(rec, len))
}

/// What a replay of a log recovers, by the module documentation's rules.
#[derive(Debug, PartialEq, Eq)]
enum Recovered {
    /// Refused: not this format, or corrupted.
    Refused,
    /// The fold up to the last cursor record.
    Fold {
        map: BTreeMap<String, (Vec<u8>, VersionToken)>,
        cursor: WatchCursor,
        /// Bytes after the end of the last cursor record (or of the header).
        discarded: u64,
        /// Whole records after the last cursor record.
        pending: u64,
    },
}

/// The fold `buf` recovers: every batch closed by a cursor record; a torn tail (a record cut
/// short at the end, nothing but NULs from a record's start, a bad checksum with nothing but
/// NULs after it) discarded; any other bad record refused.
fn model_recovery(buf: &[u8]) -> Recovered {
    let mut map = BTreeMap::new();
    let mut cursor = WatchCursor::NONE;
    if buf.is_empty() {
        return Recovered::Fold {
            map,
            cursor,
            discarded: 0,
            pending: 0,
        };
    }
    if !buf.starts_with(LOG_HEADER) {
        return Recovered::Refused;
    }
    let zeros_from = |at: usize| buf.get(at..).is_none_or(|t| t.iter().all(|b| *b == 0));
    let mut batch: Vec<LogRecord<'_>> = Vec::new();
    let mut committed_end = LOG_HEADER.len();
    let mut at = LOG_HEADER.len();
    while at < buf.len() && !zeros_from(at) {
        match read_log_record(&buf[at..]) {
            LogRead::Record(LogRecord::Cursor(c), len) => {
                at += len;
                for r in batch.drain(..) {
                    match r {
                        LogRecord::Put(key, value, version) => {
                            map.insert(key.to_string(), (value.to_vec(), version));
                        }
                        LogRecord::Delete(key, _) => {
                            map.remove(key);
                        }
                        LogRecord::Cursor(_) => {}
                    }
                }
                cursor = c;
                committed_end = at;
            }
            LogRead::Record(other, len) => {
                at += len;
                batch.push(other);
            }
            LogRead::Truncated => break,
            LogRead::BadCrc { len, .. } if zeros_from(at + len) => break,
            LogRead::BadCrc { .. } | LogRead::Invalid => return Recovered::Refused,
        }
    }
    Recovered::Fold {
        map,
        cursor,
        discarded: (buf.len() - committed_end) as u64,
        pending: batch.len() as u64,
    }
}

/// What `CompactLogCheck` must answer for `buf`: the cursor and key count of a compacted log (a
/// header, puts in strictly increasing key order, then one cursor record, last, and nothing
/// after it), `None` for anything else.
fn model_compact(buf: &[u8]) -> Option<(WatchCursor, u64)> {
    if !buf.starts_with(LOG_HEADER) {
        return None;
    }
    let mut at = LOG_HEADER.len();
    let mut last: Option<&str> = None;
    let mut keys = 0;
    while at < buf.len() {
        let LogRead::Record(record, len) = read_log_record(&buf[at..]) else {
            return None;
        };
        at += len;
        match record {
            LogRecord::Put(key, ..) if last.is_none_or(|l| l < key) => {
                last = Some(key);
                keys += 1;
            }
            LogRecord::Cursor(c) if at == buf.len() => return Some((c, keys)),
            _ => return None,
        }
    }
    None
}

/// Rewrites every framed record's checksum, so that the input reaches what a record means.
fn reseal(buf: &mut [u8]) {
    if !buf.starts_with(LOG_HEADER) {
        return;
    }
    let mut at = LOG_HEADER.len();
    while at < buf.len() {
        match read_log_record(&buf[at..]) {
            LogRead::Record(_, len) => at += len,
            LogRead::BadCrc { len, computed } => {
                buf[at..at + 4].copy_from_slice(&computed.to_le_bytes());
                at += len;
            }
            LogRead::Truncated | LogRead::Invalid => return,
        }
    }
}

/// Every entry of `store` in key order.
fn listing<S: SnapshotStore>(store: &S) -> BTreeMap<String, (Vec<u8>, VersionToken)> {
    let mut out = BTreeMap::new();
    let mut previous: Option<String> = None;
    store
        .for_each_in_range("", &mut |e: &KvEntry| {
            assert!(
                previous.as_deref().is_none_or(|p| p < e.key.as_str()),
                "a listing out of key order at {:?}",
                e.key
            );
            previous = Some(e.key.clone());
            out.insert(e.key.clone(), (e.value.to_vec(), e.version));
            std::ops::ControlFlow::Continue(())
        })
        .expect("list the store");
    out
}

/// The store holds exactly `map` at `cursor`, by its listing, its length and each key read.
fn assert_holds<S: SnapshotStore>(
    store: &S,
    map: &BTreeMap<String, (Vec<u8>, VersionToken)>,
    cursor: WatchCursor,
) {
    assert_eq!(store.cursor(), cursor, "recovered cursor");
    assert_eq!(
        store.len().expect("len"),
        map.len() as u64,
        "recovered key count"
    );
    assert_eq!(&listing(store), map, "recovered fold");
    for (k, (v, ver)) in map {
        let got = store.get(k).expect("get").expect("a recovered key reads");
        assert_eq!((got.value.as_ref(), got.version), (v.as_slice(), *ver));
    }
}

/// `CompactLogCheck` fed `buf` in chunks whose sizes `sizes` draws.
fn compact_check(buf: &[u8], mut sizes: impl FnMut() -> usize) -> Option<(WatchCursor, u64)> {
    let mut check = CompactLogCheck::new(Path::new(LOG_FILE));
    let mut rest = buf;
    while !rest.is_empty() {
        let n = sizes().clamp(1, rest.len());
        check.feed(&rest[..n]);
        rest = &rest[n..];
    }
    check.finish().ok()
}

/// A read-only open of `log` as `fold.log` recovers what [`model_recovery`] says.
fn assert_read_only_recovery(log: &[u8]) -> Recovered {
    let model = model_recovery(log);
    let dir = scratch_dir();
    std::fs::write(dir.path().join(LOG_FILE), log).expect("write fold.log");
    let opened = AppendLogSnapshot::open_read_only(dir.path());
    match (&model, &opened) {
        (Recovered::Refused, Err(SnapshotError::Corrupted { .. }))
        | (Recovered::Refused, Err(SnapshotError::InvalidFormat { .. })) => {}
        (
            Recovered::Fold {
                map,
                cursor,
                discarded,
                pending,
            },
            Ok((store, recovery)),
        ) => {
            assert_holds(store, map, *cursor);
            assert_eq!(recovery.discarded_tail_bytes, *discarded, "{recovery:?}");
            assert_eq!(recovery.discarded_records, *pending, "{recovery:?}");
            assert_eq!(recovery.reason.is_some(), *discarded > 0, "{recovery:?}");
        }
        (model, opened) => panic!(
            "the read-only open answered {:?}, the documented recovery is {model:?}",
            opened.as_ref().map(|(_, r)| r)
        ),
    }
    model
}

/// The append log's format and recovery over `data`: its first byte chooses (bit 0) whether every
/// framed record's checksum is made right first and (bit 1) whether a writable open runs too, and
/// where a second read-only open cuts the log (its upper bits); the rest is `fold.log` (module
/// docs).
pub fn append_log(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut log = rest.to_vec();
    if mode & 1 != 0 {
        reseal(&mut log);
    }
    let model = assert_read_only_recovery(&log);
    // The same log cut short (a torn write at any byte): recovered as documented too.
    let cut = usize::from(mode >> 2) + 1;
    if cut <= log.len() {
        assert_read_only_recovery(&log[..log.len() - cut]);
    }

    let compact = model_compact(&log);
    if let Some((cursor, keys)) = compact {
        match &model {
            Recovered::Fold {
                map,
                cursor: c,
                discarded: 0,
                pending: 0,
            } => assert_eq!((*c, map.len() as u64), (cursor, keys)),
            other => panic!("a compacted log does not recover whole: {other:?}"),
        }
    }
    // CompactLogCheck: the same answer whole, byte by byte, and in the chunks the mode draws.
    assert_eq!(compact_check(&log, || usize::MAX), compact, "fed whole");
    if log.len() <= 512 {
        assert_eq!(compact_check(&log, || 1), compact, "fed byte by byte");
    }
    let mut state = u32::from(mode) | 0x100;
    let draw = || {
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        ((state >> 16) % 67) as usize + 1
    };
    assert_eq!(compact_check(&log, draw), compact, "fed in chunks");

    if mode & 2 != 0 {
        let dir = scratch_dir();
        std::fs::write(dir.path().join(LOG_FILE), &log).expect("write fold.log");
        let writable = AppendLogSnapshot::open(dir.path(), AppendLogOptions::default());
        match (&model, writable) {
            (Recovered::Refused, Err(_)) => {}
            (Recovered::Fold { map, cursor, .. }, Ok((store, _))) => {
                assert_holds(&store, map, *cursor);
                drop(store);
                let (again, recovery) = AppendLogSnapshot::open_read_only(dir.path())
                    .expect("a log a writable open left reopens");
                assert_holds(&again, map, *cursor);
                assert_eq!(recovery, Default::default(), "a writable open left a tail");
            }
            (model, got) => panic!(
                "the writable open answered {:?}, the documented recovery is {model:?}",
                got.map(|(_, r)| r)
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// channel_records

/// The release entry and the report in `data`: `entry \0 node \0 report`, or the whole as both.
fn channel_parts(data: &[u8]) -> (&[u8], String, &[u8]) {
    let mut parts = data.splitn(3, |b| *b == 0);
    let entry = parts.next().unwrap_or_default();
    match (parts.next(), parts.next()) {
        (Some(node), Some(report)) => (entry, String::from_utf8_lossy(node).into_owned(), report),
        _ => (entry, "n".to_string(), entry),
    }
}

/// A release entry and a node report (module docs): `entry \0 node \0 report`.
pub fn channel_records(data: &[u8]) {
    let (entry_bytes, node, report_bytes) = channel_parts(data);
    let entry = protocol::decode_entry(entry_bytes);
    if let Ok(e) = &entry {
        check_entry(e);
    }
    let report = protocol::decode_report(&node, report_bytes);
    if let Ok(r) = &report {
        assert_eq!(r.node, node);
        assert_eq!(protocol::name_refusal("report of node", &node), None);
        assert!(r.detail.len() <= protocol::MAX_REPORT_DETAIL);
        assert_eq!(protocol::report_detail(&r.detail), r.detail);
        if let Some(v) = &r.running {
            assert!(protocol::is_digest(&v.digest));
        }
        let again = serde_json::to_vec(r).expect("a report encodes");
        assert_eq!(
            protocol::decode_report(&node, &again).as_ref(),
            Ok(r),
            "a report decoded does not decode the same once encoded"
        );
        let key = protocol::report_key("ch", &node);
        assert_eq!(protocol::report_node("ch", &key), Some(node.as_str()));
    }
    if let Ok(e) = &entry {
        drive_deciders(e, report.ok());
    }
}

/// A decoded release entry keeps every bound `decode_entry` promises and decodes the same once
/// encoded.
fn check_entry(e: &protocol::ChannelEntry) {
    for v in std::iter::once(&e.desired).chain(e.previous.as_ref()) {
        assert!(protocol::is_digest(&v.digest), "{:?}", v.digest);
        let _ = v.label();
    }
    assert!(e.canaries.len() <= protocol::MAX_CANARIES);
    assert!(e.shadow_wait_s <= protocol::MAX_SHADOW_WAIT_S);
    assert!(e.bake_s <= protocol::MAX_BAKE_S);
    assert!(e.waves.len() <= protocol::MAX_WAVES);
    assert!(!e.canaries.iter().any(|c| c == protocol::WAVES_FENCE));
    for c in &e.canaries {
        assert_eq!(protocol::name_refusal("canary", c), None);
    }
    if !e.waves.is_empty() {
        let specs: Vec<String> = e.waves.iter().map(|w| w.spec.clone()).collect();
        assert_eq!(protocol::waves_refusal(&specs), None);
    }
    let again = serde_json::to_vec(e).expect("an entry encodes");
    assert_eq!(
        protocol::decode_entry(&again).as_ref(),
        Ok(e),
        "an entry decoded does not decode the same once encoded: {}",
        String::from_utf8_lossy(&again)
    );
}

/// Whatever the decoders admit drives the rollout's deciders without a panic.
fn drive_deciders(e: &protocol::ChannelEntry, report: Option<protocol::NodeReport>) {
    let reports: Vec<_> = report.into_iter().collect();
    let release = reports.first().map_or(1, |r| r.release);
    let state = protocol::rollout(release, e, &reports);
    let _ = state.as_str();
    let me = reports.first().map_or("n", |r| r.node.as_str());
    let running = reports
        .first()
        .and_then(|r| r.running.as_ref())
        .map(|v| v.digest.as_str());
    let mine = reports.first().map(|r| r.outcome);
    let _ = protocol::next_step(e, &state, me, running, mine);
    let _ = protocol::start_version(e, &state, me);
    let _ = protocol::unbaked(release, e, &state, &reports);
    let _ = protocol::wave_of(e, me);
    for r in &reports {
        let _ = protocol::is_baked(release, e, r);
    }
    let _ = protocol::previous_for_publish(Some((e, &state)));
    let nodes: Vec<String> = e
        .canaries
        .iter()
        .chain(e.waves.iter().flat_map(|w| &w.nodes))
        .cloned()
        .collect();
    if let Some(f) = e.canary_fraction {
        let picked = protocol::pick_canaries(f, &nodes, &e.desired.digest);
        assert!(picked.len() <= nodes.len());
    }
    let specs: Vec<String> = e.waves.iter().map(|w| w.spec.clone()).collect();
    if !specs.is_empty() {
        let waves = protocol::resolve_waves(&specs, &nodes, &e.canaries, &e.desired.digest)
            .expect("the waves of a decoded entry resolve");
        assert_eq!(waves.len(), specs.len());
    }
}

// ---------------------------------------------------------------------------------------------
// ledger_row

/// The host's reserved rows (module docs): the first byte chooses the decoder, the rest is the
/// stored value.
pub fn ledger_row(data: &[u8]) {
    let Some((&which, v)) = data.split_first() else {
        return;
    };
    match which % 6 {
        0 => ledger_row_value(v),
        1 => {
            let life = protocol::LedgerLife::decode(v);
            assert_eq!(life.is_some(), v.len() == 12);
            if let Some(l) = life {
                assert_eq!(l.encode().as_slice(), v);
            }
        }
        2 => {
            let intent = crate::retained::AppliedIntent::from_bytes(v);
            assert_eq!(intent.is_some(), v.len() == 26 && v.starts_with(b"I\x01"));
            if let Some(i) = intent {
                let KvUpdate::Put(e) = i.to_put() else {
                    panic!("an intent is recorded by a put")
                };
                assert_eq!(e.value.as_ref(), v);
            }
        }
        3 => {
            if let Ok(r) = crate::retained::decode(v) {
                let again = crate::retained::encode(&r);
                assert_eq!(crate::retained::decode(&again).as_ref(), Ok(&r));
                if matches!(r.update, KvUpdate::Put(_)) {
                    assert_eq!(again, v, "a retained put is not its one encoding");
                }
                let _ = (r.position(), r.store_key(), r.to_put(), r.to_delete());
            }
        }
        4 => {
            if let Some(id) = StreamIdentity::from_bytes(v) {
                assert_eq!(id.to_bytes(), v);
            }
        }
        _ => {
            let cursor = WatchCursor::from_bytes(v);
            if cursor.is_some() {
                assert!(
                    matches!(v.len(), 0 | 8 | 12 | 20),
                    "a cursor of {} bytes",
                    v.len()
                );
            }
            if matches!(v.len(), 0 | 8) {
                assert!(cursor.is_some(), "no cursor of {} bytes", v.len());
            }
            if let Some(c) = cursor {
                assert_eq!(c.to_bytes(), v, "a cursor is not its one encoding");
            }
            if let Some(t) = VersionToken::from_bytes(v) {
                assert_eq!(t.as_bytes(), v);
            } else {
                assert!(v.len() > 10);
            }
        }
    }
}

/// `LedgerRow::decode`: accepts exactly a version 1 row of at least 17 bytes or a version 2 row
/// of at least 37 bytes whose key is UTF-8; a version 2 row is its one encoding, a version 1 row
/// re-encodes as version 2 with the same fields (and a zero digest).
fn ledger_row_value(v: &[u8]) {
    let row = protocol::LedgerRow::decode(v);
    let key_at = match v.first() {
        Some(1) if v.len() >= 17 => Some(17),
        Some(2) if v.len() >= 37 => Some(37),
        _ => None,
    };
    match (key_at, &row) {
        (None, Err(protocol::LedgerRowError::Format)) => {}
        (Some(at), Err(protocol::LedgerRowError::Key)) => {
            assert!(std::str::from_utf8(&v[at..]).is_err())
        }
        (Some(_), Ok(_)) => {}
        (at, got) => panic!("a ledger row of {} bytes (key at {at:?}): {got:?}", v.len()),
    }
    if let Ok(r) = row {
        let again = r.encode();
        if v.first() == Some(&2) {
            assert_eq!(again, v, "a version 2 row is not its one encoding");
        }
        let back = protocol::LedgerRow::decode(&again).expect("an encoded row decodes");
        assert_eq!(
            back,
            protocol::LedgerRow {
                digest: Some(r.digest.unwrap_or([0; 16])),
                ..r
            }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stored_record_in_the_fuzz_corpus_decodes_or_is_refused_without_panic() {
        assert!(replay_corpus("stored_record", stored_record) > 0);
    }

    #[test]
    fn every_append_log_in_the_fuzz_corpus_recovers_as_documented() {
        assert!(replay_corpus("append_log", append_log) > 0);
    }

    #[test]
    fn every_channel_record_in_the_fuzz_corpus_decodes_to_a_bounded_value_that_round_trips() {
        assert!(replay_corpus("channel_records", channel_records) > 0);
    }

    #[test]
    fn every_reserved_row_in_the_fuzz_corpus_decodes_exactly_its_format() {
        assert!(replay_corpus("ledger_row", ledger_row) > 0);
    }

    /// Writes the seed corpora of this crate's targets from the real encoders
    /// (docs/fuzzing.md, "Seeds"): `cargo test -p foldhost-core --features fuzzing
    /// write_the_seed_corpora -- --ignored`.
    #[test]
    #[ignore = "writes fuzz/corpus: run by hand to regenerate the seeds"]
    fn write_the_seed_corpora() {
        seeds::stored_records();
        seeds::append_logs();
        seeds::channel_records();
        seeds::ledger_rows();
    }

    mod seeds {
        use super::super::*;

        pub(super) fn stored_records() {
            let id = "0190b2f6-4e3c-7a1b-8c2d-3e4f5a6b7c8d";
            for block in [
                "NATS/1.0\r\n\r\n".to_string(),
                "NATS/1.0\r\nKV-Operation: DEL\r\n\r\n".to_string(),
                "NATS/1.0\r\nKV-Operation: PURGE\r\nNats-Rollup: sub\r\n\r\n".to_string(),
                "NATS/1.0\r\nNats-Marker-Reason: MaxAge\r\n\r\n".to_string(),
                "NATS/1.0\r\nNats-Marker-Reason: Remove\r\n\r\n".to_string(),
                format!("NATS/1.0\r\nNats-Msg-Id: {id}\r\nFoldhost-Op-Id: {id}\r\n\r\n"),
                "NATS/1.0\r\nKV-Operation: DEL\nX: y\r\n\r\n".to_string(),
                "NATS/1.0\r\nKV-Operation:\r\n DEL\r\n\r\n".to_string(),
                "NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 4\r\n\r\n".to_string(),
                "NATS/1.0\r\nbad line\r\n\r\n".to_string(),
                "NATS/1.0\r\nKV-Operation: DE\rL\r\n\r\n".to_string(),
            ] {
                write_seed("stored_record", block.as_bytes());
            }
        }

        fn put(key: &str, value: &[u8], rev: u64) -> KvUpdate {
            KvUpdate::Put(KvEntry {
                key: key.into(),
                value: bytes::Bytes::copy_from_slice(value),
                version: VersionToken::from_u64(rev),
            })
        }

        pub(super) fn append_logs() {
            // A log a store wrote: batches, a delete, a purge, overwrites; then its compaction.
            let dir = scratch_dir();
            {
                let (mut s, _) =
                    AppendLogSnapshot::open(dir.path(), AppendLogOptions::default()).expect("open");
                s.apply(
                    &[put("a", b"1", 1), put("b/c", b"two", 2)],
                    WatchCursor::at(2),
                )
                .expect("apply");
                s.apply(
                    &[
                        KvUpdate::Delete {
                            key: "a".into(),
                            version: VersionToken::from_u64(3),
                        },
                        put("d", b"", 4),
                    ],
                    WatchCursor::at(4),
                )
                .expect("apply");
                s.apply(
                    &[
                        KvUpdate::Purge {
                            key: "d".into(),
                            version: VersionToken::from_u64(5),
                        },
                        put("\u{1}retained/x", b"r", 0),
                    ],
                    WatchCursor::at(5).with_memo(Some(crate::kv::EvictionMemo {
                        server_time_unix_ns: 7,
                    })),
                )
                .expect("apply");
            }
            let written = std::fs::read(dir.path().join(LOG_FILE)).expect("read");
            let compact = {
                let d = scratch_dir();
                {
                    let (s, _) = AppendLogSnapshot::open(dir.path(), AppendLogOptions::default())
                        .expect("reopen");
                    s.export_to(d.path()).expect("export");
                }
                std::fs::read(d.path().join(LOG_FILE)).expect("read the export")
            };
            for (mode, log) in [
                (0u8, written.clone()),
                (2, written.clone()),
                (3, written[..written.len() - 5].to_vec()),
                (0, compact.clone()),
                (2, compact.clone()),
            ] {
                let mut seed = vec![mode];
                seed.extend_from_slice(&log);
                write_seed("append_log", &seed);
            }
            // A torn tail: zeros; the last record's checksum wrong (at the end: torn; with the
            // log again after it: corrupted); the header alone.
            let mut zeros = vec![0u8];
            zeros.extend_from_slice(&written);
            zeros.extend_from_slice(&[0; 9]);
            write_seed("append_log", &zeros);
            let mut bad = vec![0u8];
            bad.extend_from_slice(&compact);
            let last = bad.len() - 14;
            bad[last] ^= 1;
            write_seed("append_log", &bad);
            bad.extend_from_slice(&compact[LOG_HEADER.len()..]);
            write_seed("append_log", &bad);
            let mut header = vec![2u8];
            header.extend_from_slice(LOG_HEADER);
            write_seed("append_log", &header);
        }

        pub(super) fn channel_records() {
            let v = |d: char, n: &str| protocol::GuestVersion {
                digest: d.to_string().repeat(64),
                name: n.into(),
                version: "1.0.0".into(),
                size: 1234,
            };
            let plain = protocol::ChannelEntry {
                desired: v('a', "router"),
                previous: Some(v('b', "router")),
                canaries: vec!["node-1".into()],
                canary_fraction: Some(0.25),
                shadow_batches: 10,
                shadow_wait_s: 60,
                tolerance: 0,
                published_unix_ms: 1_700_000_000_000,
                waves: Vec::new(),
                bake_s: 0,
            };
            let waves = protocol::ChannelEntry {
                canaries: Vec::new(),
                canary_fraction: None,
                waves: vec![
                    protocol::Wave {
                        spec: "1".into(),
                        nodes: vec!["node-2".into()],
                    },
                    protocol::Wave {
                        spec: "100%".into(),
                        nodes: vec!["node-3".into(), "node-4".into()],
                    },
                ],
                bake_s: 300,
                ..plain.clone()
            };
            let first = protocol::ChannelEntry {
                previous: None,
                canaries: Vec::new(),
                ..plain.clone()
            };
            let report = |node: &str, outcome, baked| protocol::NodeReport {
                node: node.into(),
                release: 7,
                outcome,
                detail: "shadowed 10 batches".into(),
                running: Some(v('a', "router")),
                unix_ms: 1_700_000_000_500,
                baked,
            };
            for (e, r) in [
                (&plain, report("node-1", protocol::Judgement::Clean, false)),
                (&waves, report("node-2", protocol::Judgement::Clean, true)),
                (
                    &first,
                    report("node-9", protocol::Judgement::Trapped, false),
                ),
                (
                    &plain,
                    report("node-1", protocol::Judgement::Pending, false),
                ),
            ] {
                let mut seed = serde_json::to_vec(e).expect("entry");
                seed.push(0);
                seed.extend_from_slice(r.node.as_bytes());
                seed.push(0);
                seed.extend_from_slice(&serde_json::to_vec(&r).expect("report"));
                write_seed("channel_records", &seed);
            }
        }

        pub(super) fn ledger_rows() {
            let op = protocol::OpId::parse("0190b2f6-4e3c-7a1b-8c2d-3e4f5a6b7c8d").expect("id");
            let row = protocol::LedgerRow {
                revision: 42,
                key: "orders/7".into(),
                recorded_unix_ms: 1_700_000_000_000,
                epoch: 3,
                digest: Some(protocol::write_digest(KvOp::Put, b"v")),
            };
            let mut v1 = vec![1u8];
            v1.extend_from_slice(&42u64.to_be_bytes());
            v1.extend_from_slice(&1_700_000_000_000u64.to_be_bytes());
            v1.extend_from_slice(b"k");
            let crate::kv::KvUpdate::Put(ledger_put) = crate::ledger::row_put(&op, &row) else {
                panic!("a row is a put")
            };
            let life = protocol::LedgerLife {
                epoch: 2,
                horizon_unix_ms: 1_700_000_000_000,
            };
            let crate::kv::KvUpdate::Put(intent) = crate::retained::AppliedIntent {
                revision: 9,
                minted_unix_ms: 1_700_000_000_000,
                nonce: 0x1234_5678,
            }
            .to_put() else {
                panic!("an intent is a put")
            };
            let retained = [
                crate::retained::RetainedRecord {
                    update: put("k", b"value", 12),
                    retained_unix_ms: 1_700_000_000_000,
                    base: Some(Some(KvEntry {
                        key: "k".into(),
                        value: bytes::Bytes::from_static(b"old"),
                        version: VersionToken::from_u64(3),
                    })),
                    order: None,
                },
                crate::retained::RetainedRecord {
                    update: KvUpdate::Delete {
                        key: "k".into(),
                        version: VersionToken::UNKNOWN,
                    },
                    retained_unix_ms: 5,
                    base: Some(None),
                    order: Some((12, 1)),
                },
            ];
            let identity = StreamIdentity {
                name: "KV_orders".into(),
                created_unix_ns: 1_700_000_000_000_000_000,
            };
            let mut seeds: Vec<(u8, Vec<u8>)> = vec![
                (0, row.encode()),
                (0, ledger_put.value.to_vec()),
                (0, v1),
                (1, life.encode().to_vec()),
                (2, intent.value.to_vec()),
                (4, identity.to_bytes()),
                (5, WatchCursor::at(77).to_bytes()),
                (
                    5,
                    WatchCursor::at(77)
                        .with_memo(Some(crate::kv::EvictionMemo {
                            server_time_unix_ns: 99,
                        }))
                        .to_bytes(),
                ),
            ];
            for r in &retained {
                seeds.push((3, crate::retained::encode(r)));
            }
            for (which, v) in seeds {
                let mut seed = vec![which];
                seed.extend_from_slice(&v);
                write_seed("ledger_row", &seed);
            }
        }
    }
}
