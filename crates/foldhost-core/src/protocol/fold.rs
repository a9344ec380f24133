//! The fold's loop: the resume window, ACK subjects, commits and their cursor, retention's applied-through, the loop's turns between flushes and queries.

/// Whether a watch may resume after `revision` on a stream whose first retained sequence is
/// `first_sequence`.
///
/// Resume reads `revision + 1` onward; it is sound iff `first_sequence <= revision + 1`. NATS does not
/// refuse a start below its first retained sequence: it silently clamps to `first_sequence`, skipping
/// whatever was evicted (delete markers included). This check is ours to make; a `false` becomes
/// [`crate::kv::KvError::CursorExpired`]. Saturating, so `u64::MAX` never wraps to 0.
pub fn resume_window_ok(revision: u64, first_sequence: u64) -> bool {
    first_sequence <= revision.saturating_add(1)
}

/// What a JetStream ACK subject (a delivered message's reply subject) says about the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckMeta {
    /// The stream sequence: a KV entry's revision.
    pub stream_sequence: u64,
    /// The consumer's own delivery count: 1 for the first message a consumer delivers, so a 1
    /// after earlier deliveries says the consumer was re-created (0: unreadable).
    pub consumer_sequence: u64,
    /// Messages still pending for the consumer after this one.
    pub pending: u64,
    /// When the server stored the message, Unix nanoseconds (0: unreadable).
    pub timestamp_unix_ns: u64,
}

/// Parses a JetStream ACK subject without allocating.
///
/// Two layouts exist, by server version:
/// - legacy, 9 tokens: `$JS.ACK.<stream>.<consumer>.<delivered>.<stream_seq>.<consumer_seq>.<ts>.<pending>`
/// - modern, 11 or 12 tokens: `$JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>.<stream_seq>.<consumer_seq>.<ts>.<pending>[.<token>]`
///
/// The stream sequence sits at index 5 (legacy) or 7 (modern) and `pending` at index 8 or 10. The
/// last token of a 9- or 11-token subject is `pending`, which looks like a sequence but is not —
/// an earlier parser took the last token and minted a wrong revision for every entry. So we read
/// from the front and branch on the token count. Any other shape is `None` (the caller then uses
/// the unknown version, which never moves a cursor).
pub fn parse_ack_subject(subject: &str) -> Option<AckMeta> {
    // Every delivered message is parsed here (a profile of the router fold found the earlier
    // `split('.')` and `str::parse` at 9 % of the client's time): one pass over the bytes records
    // where each of up to 12 tokens ends, on the stack.
    let b = subject.as_bytes();
    let mut ends = [0usize; 12];
    let mut count = 0usize;
    for (i, &c) in b.iter().enumerate() {
        if c == b'.' {
            if count == ends.len() - 1 {
                return None; // more than 12 tokens: not a layout we know
            }
            ends[count] = i;
            count += 1;
        }
    }
    ends[count] = b.len();
    count += 1;
    let token = |i: usize| -> &[u8] {
        let start = if i == 0 { 0 } else { ends[i - 1] + 1 };
        &b[start..ends[i]]
    };
    // The count first: `token` reads only the `count` tokens recorded.
    let (seq_idx, ts_idx, pending_idx) = match count {
        9 => (5, 7, 8),
        11 | 12 => (7, 9, 10),
        _ => return None,
    };
    if token(0) != b"$JS" || token(1) != b"ACK" {
        return None;
    }
    let stream_sequence = decimal_u64(token(seq_idx))?;
    // Right after the stream sequence in both layouts; it only ever triggers an extra check.
    let consumer_sequence = decimal_u64(token(seq_idx + 1)).unwrap_or(0);
    let pending = decimal_u64(token(pending_idx))?;
    // The timestamp only ever makes a resume more conservative when missing, so it is optional.
    let timestamp_unix_ns = decimal_u64(token(ts_idx)).unwrap_or(0);
    Some(AckMeta {
        stream_sequence,
        consumer_sequence,
        pending,
        timestamp_unix_ns,
    })
}

/// A `u64` written in decimal, as `str::parse::<u64>` reads one (an optional `+`, then at least
/// one digit, no overflow): the ACK subject's numbers, without going through `str`.
fn decimal_u64(t: &[u8]) -> Option<u64> {
    let digits = t.strip_prefix(b"+").unwrap_or(t);
    if digits.is_empty() {
        return None;
    }
    let mut n: u64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
    }
    Some(n)
}

/// How many consecutive failed store applies a watch tolerates before it fail-stops. A failed batch
/// is re-queued, not dropped; this bounds the re-queued backlog under a store that keeps failing.
pub(crate) const MAX_STORE_APPLY_FAILURES: u32 = 16;

/// Whether the fold should fail-stop after `streak` consecutive failed store applies.
pub fn store_failures_fatal(streak: u32) -> bool {
    streak >= MAX_STORE_APPLY_FAILURES
}

/// The cursor a batch may commit, given the cursor before it and the highest readable revision the
/// batch contained (`None` if every update carried the unknown version).
///
/// Cursor authority covers rejected entries (parse said skip), because NATS delivers in revision
/// order: having seen the max, every revision below it has been seen too. An unknown-version update
/// neither mints a position nor lowers one, so the cursor never moves backward.
pub fn commit_cursor(previous: Option<u64>, batch_high: Option<u64>) -> Option<u64> {
    match (previous, batch_high) {
        (Some(p), Some(h)) => Some(p.max(h)),
        (p, None) => p,
        (None, h) => h,
    }
}

/// Whether a `--catch-up` run is done: the applied cursor has reached the revision the watch reported
/// level at (`through`, `None` when nothing was in scope).
pub fn caught_up(applied: Option<u64>, through: Option<u64>) -> bool {
    match through {
        None => true,
        Some(t) => applied.is_some_and(|a| a >= t),
    }
}

/// What a state-sync start (each key's latest record only) left unseen: the first revision it
/// skipped, and the level — the revision the watch reported level at after it (`None` until one
/// did), past which every key's latest record as of the start has been folded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Unseen {
    /// The first revision the start never delivered.
    pub floor: u64,
    /// The level reported after it, once one was.
    pub level: Option<u64>,
}

impl Unseen {
    /// Whether it no longer holds `applied_through` down: the cursor is at the level and nothing
    /// is retained, so every key's latest record of the start is applied and every revision it
    /// skipped was superseded by one of them. The fold then removes it.
    pub fn settled(&self, cursor: Option<u64>, retained: bool) -> bool {
        !retained && matches!((self.level, cursor), (Some(l), Some(c)) if c >= l)
    }
}

/// The highest revision every update at or below which has been *applied* (`applied_through`):
/// the store's cursor, held below the oldest retained (deferred) record, which the cursor covers
/// but no guest has applied yet (docs/design.md, "Deferral"), and — until it is settled — below the
/// first revision a state-sync start never delivered ([`Unseen`]): the log no longer says which
/// key that revision touched, so it is assumed to be an older write of a key whose latest record
/// is not applied yet (not delivered, or retained), whose state in the fold is older than it.
pub fn applied_through(
    cursor: Option<u64>,
    oldest_retained: Option<u64>,
    unseen: Option<Unseen>,
) -> Option<u64> {
    let c = cursor?;
    let held = oldest_retained.map_or(c, |r| c.min(r.saturating_sub(1)));
    Some(match unseen {
        Some(u) if !u.settled(cursor, oldest_retained.is_some()) => {
            held.min(u.floor.saturating_sub(1))
        }
        _ => held,
    })
}

/// What a fold's recorded checkpoint — a revision at or below its cursor and when the server
/// stored the record there — says of the log it resumes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointVerdict {
    /// Nothing recorded, or the log no longer holds that revision (or keeps no times): nothing
    /// to compare.
    Unverified,
    /// The log holds the same record there.
    Same,
    /// The log holds another record at that revision: a log restored from an older copy and
    /// written past the fold (`log_diverged`).
    Diverged {
        /// The checkpoint's revision.
        revision: u64,
        /// When the record the fold folded there was stored, Unix ns.
        recorded_unix_ns: u64,
        /// When the record the log holds there now was stored, Unix ns.
        found_unix_ns: u64,
    },
}

/// Compares the recorded checkpoint `(revision, stored Unix ns)` with the time of the record the
/// log holds at that revision now (`None`: none there, or no times).
pub fn checkpoint_verdict(recorded: Option<(u64, u64)>, found: Option<u64>) -> CheckpointVerdict {
    match (recorded, found) {
        (Some((revision, recorded_unix_ns)), Some(found_unix_ns))
            if recorded_unix_ns != found_unix_ns =>
        {
            CheckpointVerdict::Diverged {
                revision,
                recorded_unix_ns,
                found_unix_ns,
            }
        }
        (Some(_), Some(_)) => CheckpointVerdict::Same,
        _ => CheckpointVerdict::Unverified,
    }
}

/// What a state-sync left unseen after a commit: `before`, with `first` — the first revision the
/// commit's batch skipped, while a state-sync is `tracking` — kept lowest, the `level` the watch
/// reported added where it has none, and removed once settled at `cursor` with `retained`
/// records, when no state-sync is tracking any more. The fold and the deferral model both decide
/// by it.
pub fn unseen_after(
    before: Option<Unseen>,
    first: Option<u64>,
    level: Option<u64>,
    tracking: bool,
    cursor: Option<u64>,
    retained: bool,
) -> Option<Unseen> {
    let mut after = match (before, first) {
        (None, Some(f)) => Some(Unseen {
            floor: f,
            level: None,
        }),
        (Some(u), Some(f)) => Some(Unseen {
            floor: u.floor.min(f),
            ..u
        }),
        (b, None) => b,
    };
    if let (Some(u), Some(l)) = (after.as_mut(), level)
        && u.level.is_none()
    {
        u.level = Some(l);
    }
    if !tracking && after.is_some_and(|u| u.settled(cursor, retained)) {
        after = None;
    }
    after
}

/// A state-sync start's first unseen revision: with `next` the revision expected next (the one
/// after the last delivered, or after the cursor the start began at), the first revision of
/// `delivered` (ascending) skips over, if any; and the revision expected after them.
pub fn first_unseen(next: u64, delivered: impl IntoIterator<Item = u64>) -> (Option<u64>, u64) {
    let mut next = next;
    let mut first = None;
    for r in delivered {
        if r > next && first.is_none() {
            first = Some(next);
        }
        next = next.max(r.saturating_add(1));
    }
    (first, next)
}

/// Which updates of a batch must be held back because an earlier update of the same key is
/// deferred: a key's applied history is always a prefix of its log. `deferred[i]` says update `i`
/// is deferred (by the guest, or held already); the answer lists the positions not yet deferred that
/// follow a deferred update of their key, in order.
pub fn held_after_defers(keys: &[&str], deferred: &[bool]) -> Vec<usize> {
    let mut blocked: Vec<&str> = Vec::new();
    let mut out = Vec::new();
    for (i, (key, d)) in keys.iter().zip(deferred).enumerate() {
        if *d {
            if !blocked.contains(key) {
                blocked.push(key);
            }
        } else if blocked.contains(key) {
            out.push(i);
        }
    }
    out
}

/// Most queries the fold loop serves in a row while fold work waits (deliveries in the watch
/// channel, or a lost guest instance to rebuild): a ready batch is postponed by at most this many
/// queries ([`loop_gates`]).
pub(crate) const MAX_QUERIES_BETWEEN_FLUSHES: u32 = 32;

/// Most query time the fold loop spends in a row while fold work waits: a query that starts within
/// it runs to its end (a guest call is never cut short but by its deadline), and none starts past
/// it. A query that spins to its deadline therefore ends its turn by itself.
pub(crate) const QUERY_TIME_BETWEEN_FLUSHES: std::time::Duration =
    std::time::Duration::from_millis(10);

/// Most flushes (or guest rebuilds) the fold loop runs in a row while a query waits: a waiting query
/// is postponed by at most this many.
pub(crate) const MAX_FLUSHES_BETWEEN_QUERIES: u32 = 16;

/// What the fold loop has done since it last switched between queries and its own work: the input
/// of [`loop_gates`]. Kept by the loop, changed only through [`LoopShare::served_query`] and
/// [`LoopShare::flushed`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoopShare {
    /// Queries served since the last flush.
    pub queries: u32,
    /// Their time.
    pub query_time: std::time::Duration,
    /// Flushes (and rebuilds) since the last query.
    pub flushes: u32,
}

impl LoopShare {
    /// One query served, taking `took`.
    pub fn served_query(&mut self, took: std::time::Duration) {
        self.queries = self.queries.saturating_add(1);
        self.query_time = self.query_time.saturating_add(took);
        self.flushes = 0;
    }

    /// One flush (or rebuild of the guest instance) done.
    pub fn flushed(&mut self) {
        self.queries = 0;
        self.query_time = std::time::Duration::ZERO;
        self.flushes = self.flushes.saturating_add(1);
    }
}

/// Which of its two kinds of work the fold loop may take next: `(queries, fold)` — whether the
/// control channel (queries, and the swaps, shadows and exports that travel with them) may be
/// served, and whether deliveries may be taken from the watch (and the guest rebuilt). The two
/// take turns while both wait: queries until [`MAX_QUERIES_BETWEEN_FLUSHES`] of them or
/// [`QUERY_TIME_BETWEEN_FLUSHES`] of their time, then the fold until [`MAX_FLUSHES_BETWEEN_QUERIES`]
/// flushes or nothing of it waits. Either side alone runs freely. Never both closed (an
/// inconsistent share opens the queries). The batch timer is not gated: a batch whose window has
/// run out is flushed before the next query starts.
pub fn loop_gates(share: LoopShare, fold_waiting: bool, query_waiting: bool) -> (bool, bool) {
    let query_turn_left = share.queries < MAX_QUERIES_BETWEEN_FLUSHES
        && share.query_time < QUERY_TIME_BETWEEN_FLUSHES
        // The fold's turn, once begun (a flush since the last query), runs to its end.
        && (share.flushes == 0 || share.flushes >= MAX_FLUSHES_BETWEEN_QUERIES);
    let queries = !fold_waiting || query_turn_left;
    let fold = !query_waiting || share.flushes < MAX_FLUSHES_BETWEEN_QUERIES;
    (queries || !fold, fold)
}
