//! Reading the log back: the replay of a log at open (committed batches only, a torn tail told
//! from corruption), and [`CompactLogCheck`], the streaming check of a compacted log as it is
//! written.

use super::*;

/// What replaying a log produced.
#[derive(Debug)]
pub(super) struct Replayed {
    pub(super) fold: LiveMap,
    pub(super) recovery: Recovery,
    /// End of the last cursor record (or of the header): where appends continue.
    pub(super) valid_len: u64,
    /// Whether the file is already what a compaction would write (give or take key order).
    pub(super) compact: bool,
}

/// Where and why a replay stopped before the end of the file.
#[derive(Debug, Clone, Copy)]
pub(super) enum Tail {
    /// A record whose declared lengths run past the end of the file.
    CutShort(usize),
    /// Nothing but NUL bytes from here on.
    ZeroFilled(usize),
    /// A record with a bad checksum and nothing but NULs (or nothing) after it.
    BadCrcAtEnd(usize),
}

impl fmt::Display for Tail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tail::CutShort(at) => write!(f, "a record cut short at offset {at} (torn write)"),
            Tail::ZeroFilled(at) => write!(
                f,
                "a zero-filled tail from offset {at} (torn write after power loss)"
            ),
            Tail::BadCrcAtEnd(at) => write!(
                f,
                "a last record with a bad checksum at offset {at} (torn write)"
            ),
        }
    }
}

/// Replays a whole log (pure: no I/O). `path` only names the file in errors.
pub(super) fn replay(file: &Bytes, path: &Path) -> Result<Replayed, SnapshotError> {
    if file.is_empty() {
        // A crash right after creating the file: an empty new fold, but not a compact file (no
        // header), so a writable open rewrites it.
        return Ok(Replayed {
            fold: LiveMap::default(),
            recovery: Recovery::default(),
            valid_len: 0,
            compact: false,
        });
    }
    format::decode_header(file).map_err(|e| SnapshotError::InvalidFormat {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let mut scan = Scan {
        file,
        fold: LiveMap::over(file.clone()),
        pending: 0,
        committed_end: HEADER_LEN,
        cursor_records: 0,
        superseded: false,
    };
    let tail = scan.run(path)?;
    scan.replay_committed(path)?;
    let recovery = scan.recovery(tail);
    let compact =
        recovery.discarded_tail_bytes == 0 && !scan.superseded && scan.cursor_records <= 1;
    Ok(Replayed {
        valid_len: scan.committed_end as u64,
        fold: scan.fold,
        recovery,
        compact,
    })
}

/// Replay state, in two passes over the file: [`Scan::run`] checks every record and finds the end
/// of the last cursor record; [`Scan::replay_committed`] then folds the records before it. So
/// records of an unfinished apply never reach the fold, and nothing is held per record in between
/// (a compacted log is one batch of a million puts: holding them until its cursor record cost
/// more memory than the map).
struct Scan<'a> {
    file: &'a Bytes,
    fold: LiveMap,
    /// Whole records after the last cursor record (an apply that did not finish).
    pending: u64,
    /// End of the last cursor record.
    committed_end: usize,
    cursor_records: u64,
    /// Whether some record was overwritten or deleted (the file is not compact).
    superseded: bool,
}

impl<'a> Scan<'a> {
    /// Reads records from after the header to the end or to a torn tail.
    fn run(&mut self, path: &Path) -> Result<Option<Tail>, SnapshotError> {
        let buf: &'a [u8] = self.file;
        // Computed once, so "is everything from here on zero?" is O(1) per record.
        let last_nonzero = buf.iter().rposition(|b| *b != 0);
        let zeros_from = |at: usize| last_nonzero.is_none_or(|p| p < at);
        let mut at = HEADER_LEN;
        while at < buf.len() {
            if zeros_from(at) {
                return Ok(Some(Tail::ZeroFilled(at)));
            }
            match format::decode_record(&buf[at..]) {
                Decoded::Record { record, len } => {
                    at += len;
                    self.take(record, at);
                }
                Decoded::Truncated => return Ok(Some(Tail::CutShort(at))),
                Decoded::BadCrc { len, .. } if zeros_from(at + len) => {
                    return Ok(Some(Tail::BadCrcAtEnd(at)));
                }
                Decoded::BadCrc {
                    stored, computed, ..
                } => {
                    let reason = format!(
                        "checksum mismatch (stored {stored:#010x}, computed {computed:#010x}) with more data after the record"
                    );
                    return Err(corrupted(path, at, reason));
                }
                Decoded::Invalid(why) => return Err(corrupted(path, at, why.to_string())),
            }
        }
        Ok(None)
    }

    /// Notes one whole record ending at `end` (the first pass).
    fn take(&mut self, record: Record<'a>, end: usize) {
        if let Record::Cursor(_) = record {
            self.cursor_records += 1;
            self.committed_end = end;
            self.pending = 0;
        } else {
            self.pending += 1;
        }
    }

    /// The second pass: folds every record before the end of the last cursor record (all of them
    /// checked whole by the first pass).
    fn replay_committed(&mut self, path: &Path) -> Result<(), SnapshotError> {
        let buf: &'a [u8] = self.file;
        // Offsets of the records after the base stopped growing, folded in by one sort at the end.
        let mut tail = Vec::new();
        let mut at = HEADER_LEN;
        while at < self.committed_end {
            let start = at;
            let Decoded::Record { record, len } = format::decode_record(&buf[at..]) else {
                // The first pass read this record whole: only a bug gets here.
                return Err(corrupted(
                    path,
                    at,
                    "a record read whole once did not read the second time".into(),
                ));
            };
            at += len;
            match record {
                Record::Put {
                    key,
                    value,
                    version,
                } => {
                    // A compacted log's records, in key order, become the base: 8 bytes per key.
                    // From the first record out of order on, every record goes to the tail.
                    if !(tail.is_empty() && self.fold.push_base(start, key, value.len(), version)) {
                        tail.push(start as u64);
                    }
                }
                Record::Delete { .. } => tail.push(start as u64),
                Record::Cursor(cursor) => self.fold.cursor = cursor,
            }
        }
        self.superseded |= self.fold.absorb(tail);
        Ok(())
    }

    /// Reports what lies after the last cursor record.
    fn recovery(&self, tail: Option<Tail>) -> Recovery {
        let discarded = self.file.len() - self.committed_end;
        if discarded == 0 {
            return Recovery::default();
        }
        let mut why = Vec::new();
        if self.pending > 0 {
            why.push(format!(
                "{} whole record(s) after the last cursor record (an apply that did not finish)",
                self.pending
            ));
        }
        if let Some(tail) = tail {
            why.push(tail.to_string());
        }
        Recovery {
            discarded_tail_bytes: discarded as u64,
            discarded_records: self.pending,
            reason: Some(format!(
                "discarded {discarded} byte(s) from offset {}: {}",
                self.committed_end,
                why.join("; ")
            )),
        }
    }
}

/// Checks a **compacted** log (what [`SnapshotStore::export_to`] writes) as its bytes stream by,
/// without building the map: the header, every record whole with its CRC, puts only and in
/// strictly increasing key order (so every key once), then exactly one cursor record, last. What
/// it proves is what a reopen would: the file recovers to that cursor with that many keys, with
/// nothing torn and nothing superseded. Memory: the carried-over part of one record.
pub struct CompactLogCheck {
    path: PathBuf,
    /// The start of a record (or of the header) cut by the end of the last chunk.
    carry: Vec<u8>,
    /// File offset of the first byte not yet checked (the start of `carry`).
    offset: usize,
    header_done: bool,
    /// The last key seen (reused: no allocation per key), valid when `keys > 0`.
    last_key: String,
    keys: u64,
    cursor: Option<WatchCursor>,
    failed: Option<SnapshotError>,
}

impl CompactLogCheck {
    /// A check of the compacted log at `path` (named in errors).
    pub fn new(path: &Path) -> Self {
        CompactLogCheck {
            path: path.to_owned(),
            carry: Vec::new(),
            offset: 0,
            header_done: false,
            last_key: String::new(),
            keys: 0,
            cursor: None,
            failed: None,
        }
    }

    /// Feeds the next bytes of the file. The first problem found is kept for [`Self::finish`]
    /// (the caller's digest check of the same bytes comes first: a flipped byte is reported as
    /// the digest mismatch it is).
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.failed.is_none()
            && let Err(e) = self.step(chunk)
        {
            self.failed = Some(e);
            self.carry = Vec::new();
        }
    }

    /// Checks what `chunk` completes. Records wholly inside the chunk are checked where they lie;
    /// only a record cut by a chunk's end is copied, and completed by taking from the next chunk
    /// just enough bytes (in doubling steps) to decode it.
    fn step(&mut self, mut chunk: &[u8]) -> Result<(), SnapshotError> {
        let mut take = 4096;
        while !self.carry.is_empty() && !chunk.is_empty() {
            let before = self.carry.len();
            let n = take.min(chunk.len());
            self.carry.extend_from_slice(&chunk[..n]);
            let carry = std::mem::take(&mut self.carry);
            let used = self.scan(&carry);
            self.carry = carry;
            let used = used?;
            if used == 0 {
                // Still cut short: those bytes stay carried.
                chunk = &chunk[n..];
                take = take.saturating_mul(2);
                continue;
            }
            // The scan got past the carried bytes (they were cut short before); whatever it did
            // not use of the appended ones is scanned from `chunk` itself below.
            debug_assert!(
                used > before,
                "a carried record completed without new bytes"
            );
            chunk = &chunk[used.saturating_sub(before)..];
            self.carry.clear();
        }
        if self.carry.is_empty() {
            let used = self.scan(chunk)?;
            self.carry.extend_from_slice(&chunk[used..]);
        }
        Ok(())
    }

    /// Checks the header (if not done yet) and every whole record at the start of `buf`, which
    /// starts at `self.offset` in the file; returns the bytes used and moves `offset` past them.
    fn scan(&mut self, buf: &[u8]) -> Result<usize, SnapshotError> {
        let mut at = 0;
        if !self.header_done {
            if buf.len() < HEADER_LEN {
                return Ok(0);
            }
            format::decode_header(buf).map_err(|e| SnapshotError::InvalidFormat {
                path: self.path.clone(),
                reason: e.to_string(),
            })?;
            self.header_done = true;
            at = HEADER_LEN;
        }
        loop {
            let here = self.offset + at;
            match format::decode_record(&buf[at..]) {
                Decoded::Truncated => break,
                Decoded::Record { record, len } => {
                    if self.cursor.is_some() {
                        return Err(corrupted(
                            &self.path,
                            here,
                            "a record after the cursor".into(),
                        ));
                    }
                    match record {
                        Record::Put { key, .. } => {
                            if self.keys > 0 && self.last_key.as_str() >= key {
                                return Err(corrupted(
                                    &self.path,
                                    here,
                                    format!("key {key:?} out of order: not a compacted log"),
                                ));
                            }
                            self.last_key.clear();
                            self.last_key.push_str(key);
                            self.keys += 1;
                        }
                        Record::Delete { .. } => {
                            return Err(corrupted(
                                &self.path,
                                here,
                                "a delete record: not a compacted log".into(),
                            ));
                        }
                        Record::Cursor(c) => self.cursor = Some(c),
                    }
                    at += len;
                }
                Decoded::BadCrc {
                    stored, computed, ..
                } => {
                    return Err(corrupted(
                        &self.path,
                        here,
                        format!(
                            "checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
                        ),
                    ));
                }
                Decoded::Invalid(why) => return Err(corrupted(&self.path, here, why.to_string())),
            }
        }
        self.offset += at;
        Ok(at)
    }

    /// Ends the check: the cursor the file recovers and its number of keys.
    pub fn finish(self) -> Result<(WatchCursor, u64), SnapshotError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        if !self.header_done || !self.carry.is_empty() {
            return Err(corrupted(
                &self.path,
                self.offset,
                format!("{} bytes of a torn record at the end", self.carry.len()),
            ));
        }
        let cursor = self
            .cursor
            .ok_or_else(|| corrupted(&self.path, self.offset, "no cursor record".into()))?;
        Ok((cursor, self.keys))
    }
}
