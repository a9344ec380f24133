//! Every decision the fold's correctness rests on, as a pure function. Production code calls these;
//! the tests and the simulated bucket (`testkit`) call the same functions rather than copies, so a
//! change to a rule is re-checked everywhere at once (seed 000, "Machine-checked protocol kernels").
//!
//! Invariants: nothing in this module does I/O, allocates on the hot path, or reads a clock; and it
//! imports nothing else of the crate (every other module may build on it).

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
pub const MAX_STORE_APPLY_FAILURES: u32 = 16;

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

/// The highest revision every update at or below which has been *applied* (`applied_through`):
/// the store's cursor, held below the oldest retained (deferred) record, which the cursor covers
/// but no guest has applied yet (seed 004).
pub fn applied_through(cursor: Option<u64>, oldest_retained: Option<u64>) -> Option<u64> {
    match (cursor, oldest_retained) {
        (c, None) => c,
        (None, Some(_)) => None,
        (Some(c), Some(r)) => Some(c.min(r.saturating_sub(1))),
    }
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
pub const MAX_QUERIES_BETWEEN_FLUSHES: u32 = 32;

/// Most query time the fold loop spends in a row while fold work waits: a query that starts within
/// it runs to its end (a guest call is never cut short but by its deadline), and none starts past
/// it. A query that spins to its deadline therefore ends its turn by itself.
pub const QUERY_TIME_BETWEEN_FLUSHES: std::time::Duration = std::time::Duration::from_millis(10);

/// Most flushes (or guest rebuilds) the fold loop runs in a row while a query waits: a waiting query
/// is postponed by at most this many.
pub const MAX_FLUSHES_BETWEEN_QUERIES: u32 = 16;

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

/// How an expired cursor may be repaired (`--repair`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RepairMode {
    /// Re-list where the listing is the truth, restore from an artifact otherwise.
    Auto,
    /// Only the key-listing diff (refused where the listing is not the truth).
    Relist,
    /// Only an artifact restore.
    Restore,
    /// No repair: an expired cursor stops the fold.
    None,
}

/// What to do about an expired cursor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RepairPlan {
    /// Nothing: the fold stops with `CursorExpired`.
    None,
    /// Diff the fold against the bucket's live key listing.
    Relist,
    /// Restore from a newer artifact.
    Restore,
    /// A re-list was asked for where a listing cannot tell a deleted key from an evicted one.
    RefuseRelist,
}

/// A bucket's retention as read live from its stream: whether it can evict a current value (an
/// age limit, a size/count limit with `discard: old`, per-message TTLs), and its first retained
/// revision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// Retention can remove a key's *current* value (not only superseded ones).
    pub evicts_current_values: bool,
    /// The stream's first retained sequence.
    pub first_revision: u64,
}

/// Whether "not listed" means "deleted": yes when retention never evicts current values, or when
/// it can but has evicted nothing yet (first retained revision ≤ 1) — and never once this fold has
/// seen it evict (`seen_evicting`, the cursor's memo).
pub fn listing_is_truth(
    evicts_current_values: bool,
    first_revision: u64,
    seen_evicting: bool,
) -> bool {
    !seen_evicting && (!evicts_current_values || first_revision <= 1)
}

/// Whether a read of retention shows it has evicted a current value (eviction is on and the log
/// is past its first revision): the moment a fold commits its eviction memo.
pub fn retention_has_evicted(r: Retention) -> bool {
    r.evicts_current_values && r.first_revision > 1
}

/// [`listing_is_truth`] for a retention that may be unknown (`None`: the backend cannot say),
/// which answers `None` unless the memo already settles it.
pub fn listing_truth(retention: Option<Retention>, seen_evicting: bool) -> Option<bool> {
    if seen_evicting {
        return Some(false);
    }
    retention.map(|r| listing_is_truth(r.evicts_current_values, r.first_revision, false))
}

/// The repair for an expired cursor under `mode`, given whether the listing is the truth.
pub fn plan_repair(mode: RepairMode, listing_truth: Option<bool>) -> RepairPlan {
    match (mode, listing_truth) {
        (RepairMode::None, _) => RepairPlan::None,
        (RepairMode::Relist, Some(true)) => RepairPlan::Relist,
        (RepairMode::Relist, _) => RepairPlan::RefuseRelist,
        (RepairMode::Restore, _) => RepairPlan::Restore,
        (RepairMode::Auto, Some(true)) => RepairPlan::Relist,
        (RepairMode::Auto, _) => RepairPlan::Restore,
    }
}

/// Whether a start without a cursor must repair first: when the fold holds data anyway (a re-list
/// never removes what it does not deliver), or, with a restore armed, when the listing is not the
/// truth (a re-list would miss evicted keys).
pub fn cursorless_start_needs_repair(
    mode: RepairMode,
    fold_has_data: bool,
    listing_truth: Option<bool>,
) -> bool {
    let restore_armed = matches!(mode, RepairMode::Restore | RepairMode::Auto);
    fold_has_data || (restore_armed && listing_truth != Some(true))
}

/// Whether an artifact at `artifact_revision` is strictly ahead of the local fold (a restore never
/// moves the fold, or a guest's structure, backward).
pub fn restore_ahead(artifact_revision: u64, local_revision: Option<u64>) -> bool {
    local_revision.is_none_or(|l| artifact_revision > l)
}

/// Whether an expired fold may be replaced by an artifact: strictly ahead of it, and with its
/// cursor still inside retention so the resume from it is gap-free.
pub fn restore_allowed(
    artifact_revision: u64,
    local_revision: Option<u64>,
    first_sequence: u64,
) -> bool {
    restore_ahead(artifact_revision, local_revision)
        && resume_window_ok(artifact_revision, first_sequence)
}

/// What a restore does to one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyRestore {
    /// Leave the local entry (or absence) as it is.
    Keep,
    /// Take the artifact's entry.
    Take,
    /// Delete the local entry.
    Delete,
}

/// The per-key restore decision. `local` and `artifact` are the entries' revisions (`None`:
/// absent; an unknown local version is passed as 0, older than any artifact entry); `identical`
/// says both entries are byte-equal; `listed_live` says the bucket's live listing has the key;
/// `fold_cursor` is the local fold's cursor. Take the artifact's entry unless the local one is
/// newer (never a move backward) or the fold's cursor already covers it (an entry at or below the
/// cursor is never news: an artifact exported mid catch-up can hold an older value of a key the
/// fold has since deleted, and taking it would bring the key back until the resume delivered its
/// later write — found by the repair model, issue 17); delete a key the artifact lacks unless the
/// bucket lists it live (never a phantom delete).
pub fn restore_key(
    local: Option<u64>,
    artifact: Option<u64>,
    identical: bool,
    listed_live: bool,
    fold_cursor: Option<u64>,
) -> KeyRestore {
    match (local, artifact) {
        (_, Some(_)) if identical => KeyRestore::Keep,
        (_, Some(a)) if fold_cursor.is_some_and(|c| a <= c) => KeyRestore::Keep,
        (Some(l), Some(a)) if l > a => KeyRestore::Keep,
        (_, Some(_)) => KeyRestore::Take,
        (Some(_), None) if listed_live => KeyRestore::Keep,
        (Some(_), None) => KeyRestore::Delete,
        (None, None) => KeyRestore::Keep,
    }
}

/// Whether a cursor that looks expired on an age-only bucket hides no eviction: when age is the
/// bucket's only way to evict a current value and the cursor's message is at most half of
/// `max_age` old, every later message is younger still, so none aged out and each missing one was
/// superseded by a later write the resume delivers (half is headroom for clock steps and leader
/// changes).
pub fn gap_holds_no_eviction(
    age_only: bool,
    max_age: std::time::Duration,
    cursor_message_age: std::time::Duration,
) -> bool {
    age_only && !max_age.is_zero() && cursor_message_age.saturating_mul(2) <= max_age
}

/// Whether a state-sync re-list that was started trusting the key listing (the fold had no
/// eviction memo) may still be trusted when its first event arrives: retention read *now*, after
/// the watch's snapshot exists, must still make the listing the truth. A bucket that began evicting
/// between the decision and the snapshot may have removed current values the snapshot silently
/// lacks, and a state-sync watch has no frontier for the floor guard to check until it is level
/// (found by the seeded simulation, issue 17). An unknown retention (`None`) changes nothing: the
/// decision was made without it too.
pub fn relist_still_vouched(retention_now: Option<Retention>) -> bool {
    retention_now.is_none_or(|r| listing_is_truth(r.evicts_current_values, r.first_revision, false))
}

/// Whether the live floor guard ends a watch: after a delivery gap (or a quiet period) following
/// `frontier`, the last sequence delivered, the stream's first retained sequence has passed
/// `frontier + 1` on a stream whose retention evicts current values — messages after the frontier
/// were evicted unseen (NATS skips them silently). Where retention never evicts a current value a
/// skipped message was superseded and its successor is delivered, so the guard stays quiet.
pub fn floor_guard_trips(evicts_current_values: bool, frontier: u64, first_sequence: u64) -> bool {
    evicts_current_values && !resume_window_ok(frontier, first_sequence)
}

/// Whether every watch prefix lies inside some prefix an artifact covers (`""` covers every key),
/// so a restore from it can speak for every key the watch folds.
pub fn scope_covers(artifact_prefixes: &[&str], watch_prefixes: &[&str]) -> bool {
    watch_prefixes
        .iter()
        .all(|w| artifact_prefixes.iter().any(|a| w.starts_with(a)))
}

/// What the identity check at a watch start found (see [`stream_identity_check`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdentityVerdict {
    /// The fold folds this stream: go on.
    Same,
    /// The fold records no identity yet (a first start, or a store written before identities
    /// were recorded, whose cursor the stream still covers): record the found one, then go on.
    Record,
    /// The stream is not the one the fold recorded (deleted and created again, or another
    /// bucket's): resuming would mix two streams' keys.
    Recreated,
    /// The fold's cursor is above the stream's last sequence: whatever the identity says, the fold
    /// has seen revisions this stream never wrote (a recreated stream before identities were
    /// recorded, or a server that lost its tail), and a resume would wait for — then fold — the
    /// new stream's writes on top of the old keys.
    CursorAhead,
}

/// The bucket identity check, made at every start and every watch (re)start, before a revision is
/// trusted (issue 12). `recorded_is_found` says whether the identity committed with the fold is the
/// stream's now (`None`: the fold records none yet), `cursor` is the fold's cursor and
/// `last_sequence` the stream's last sequence. Another stream (a change of name or creation time)
/// is [`IdentityVerdict::Recreated`]; a cursor past the stream's end is
/// [`IdentityVerdict::CursorAhead`]; a fold with no identity adopts the found one only when the
/// cursor passes that test. Never silently mixes two streams: every other answer ends the run or
/// repairs as a cursor-less start (`--on-recreated`).
pub fn stream_identity_check(
    recorded_is_found: Option<bool>,
    cursor: Option<u64>,
    last_sequence: u64,
) -> IdentityVerdict {
    match recorded_is_found {
        Some(false) => IdentityVerdict::Recreated,
        _ if cursor.is_some_and(|c| c > last_sequence) => IdentityVerdict::CursorAhead,
        Some(true) => IdentityVerdict::Same,
        None => IdentityVerdict::Record,
    }
}

/// How long a fold waits before resuming a watch that broke for the `streak`-th time in a row
/// (the count resets once a resumed watch commits): 100 ms doubling, capped at 5 s — bounded, so a
/// server that comes back is picked up within seconds, and never a tight loop.
pub fn watch_resume_backoff(streak: u32) -> std::time::Duration {
    std::time::Duration::from_millis(100u64.saturating_mul(1 << streak.min(10)).min(5_000))
}

/// What an artifact pointer in the object store holds, as read before a publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PointerState {
    /// No pointer yet.
    Absent,
    /// A pointer that does not parse (a partial write by a store without atomic puts, a foreign
    /// object): replaceable.
    Corrupt,
    /// A pointer to an artifact at this cursor.
    At(u64),
}

/// Whether an exporter may publish a pointer to its artifact at `cursor` over `current` (seed 000,
/// "the pointer"): never backward, and never sideways to an equal cursor (the pointer's artifact
/// already speaks for it); a corrupt pointer is replaceable. A `false` is `SupersededByNewer` for
/// the exporter, which abandons its round.
pub fn pointer_publish_allowed(current: PointerState, cursor: u64) -> bool {
    match current {
        PointerState::Absent | PointerState::Corrupt => true,
        PointerState::At(c) => cursor > c,
    }
}

/// How this exporter's (or this node's) stream relates to the stream an artifact was exported
/// from, as [`stream_relation`] reads the two identities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamRelation {
    /// The same stream (name and creation time).
    Same,
    /// One side records no stream (an artifact of an earlier version, or one exported without a
    /// running fold): nothing can be told, and the checks of before identities apply.
    Unknown,
    /// A later incarnation of the same stream (same name, created after the artifact's): the
    /// bucket was deleted and created again, and the artifact folds the old one.
    Later,
    /// Another stream: an earlier incarnation, or another name.
    Other,
}

/// Relates `ours` to `theirs`, each a stream's name and creation time (Unix nanoseconds), `None`
/// when it is not recorded.
pub fn stream_relation(ours: Option<(&str, u64)>, theirs: Option<(&str, u64)>) -> StreamRelation {
    match (ours, theirs) {
        (Some(a), Some(b)) if a == b => StreamRelation::Same,
        (Some((an, at)), Some((bn, bt))) if an == bn && at > bt => StreamRelation::Later,
        (Some(_), Some(_)) => StreamRelation::Other,
        _ => StreamRelation::Unknown,
    }
}

/// [`pointer_publish_allowed`] across incarnations: `relation` is the exporter's stream relative
/// to the pointer's artifact's. The cursor comparison holds within one stream (or when either
/// side records none); a later incarnation replaces the pointer whatever the cursors (a recreated
/// bucket's sequences start over, so its cursor is below the old artifact's and the pointer
/// would otherwise never move again); an exporter of an earlier incarnation or of another stream
/// never replaces it. A corrupt or absent pointer is replaceable as ever.
pub fn pointer_replace_allowed(
    current: PointerState,
    cursor: u64,
    relation: StreamRelation,
) -> bool {
    match (current, relation) {
        (PointerState::Absent | PointerState::Corrupt, _) => true,
        (PointerState::At(_), StreamRelation::Later) => true,
        (PointerState::At(_), StreamRelation::Other) => false,
        (PointerState::At(_), StreamRelation::Same | StreamRelation::Unknown) => {
            pointer_publish_allowed(current, cursor)
        }
    }
}

/// Whether a node may bootstrap from an artifact whose stream relates to the bucket's live stream
/// as `relation` (the live one relative to the artifact's): only the same stream; an artifact that
/// records none is taken, and the node's own identity check at its first start decides (as before
/// artifacts recorded their stream).
pub fn bootstrap_stream_allowed(relation: StreamRelation) -> bool {
    matches!(relation, StreamRelation::Same | StreamRelation::Unknown)
}

/// When a payload at `payload_cursor` stopped being the pointer's target, or could no longer
/// become it, from the targets the pointer knows: `targets` holds `(cursor, published_unix_ms)`
/// for its current target (published when the pointer object was last written) and its recent
/// previous targets (the pointer's `previous` list). A payload was replaced no later than the
/// publish of the first target above its cursor (the pointer never moves backward, so once a
/// higher cursor was published no lower one is named again): the earliest publish among the
/// targets above it. A name without a cursor (the earlier form) is older than every target.
/// `None`: no known target lies above it (it is the target, or an exporter may still name it).
pub fn payload_superseded_at(payload_cursor: Option<u64>, targets: &[(u64, i64)]) -> Option<i64> {
    targets
        .iter()
        .filter(|(c, _)| payload_cursor.is_none_or(|p| *c > p))
        .map(|(_, t)| *t)
        .min()
}

/// Whether a payload may be pruned: never the pointer's target (whatever its age, even at zero
/// grace); never one whose cursor is at or above the pointer's, nor any while there is no pointer
/// (an exporter may have uploaded it and be about to publish: the pointer would dangle — found by
/// the fleet model at zero grace); a payload below the pointer no publish can name
/// ([`pointer_publish_allowed`] refuses it), so it goes once the grace has passed **since it
/// stopped being the target** (`since_superseded`, from [`payload_superseded_at`]; `None`: not
/// known to be replaced, kept) — a node that read the pointer just before it moved has the grace
/// to download, however long ago the payload was uploaded — and since its upload (`age`). A
/// payload whose name carries no cursor (named before cursors were) is judged as below the pointer.
pub fn payload_prunable(
    is_pointer_target: bool,
    payload_cursor: Option<u64>,
    pointer_cursor: Option<u64>,
    age: std::time::Duration,
    since_superseded: Option<std::time::Duration>,
    grace: std::time::Duration,
) -> bool {
    let unreachable = match (payload_cursor, pointer_cursor) {
        (_, None) => false,
        (Some(p), Some(t)) => p < t,
        (None, Some(_)) => true,
    };
    !is_pointer_target && unreachable && age > grace && since_superseded.is_some_and(|s| s > grace)
}

/// What the export lease key holds, as read before a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseState {
    /// No lease key yet.
    Absent,
    /// A tombstone (an empty value): freed.
    Free,
    /// A value that does not decode: nobody can be holding it.
    Corrupt,
    /// A lease that runs out at this time (Unix milliseconds, the holder's clock).
    Held {
        /// Expiry.
        expires_unix_ms: u64,
    },
}

/// Whether a node may take the export lease (seed 000, "Fleet coordination"): when it is absent,
/// freed or corrupt, or when the holder's expiry has passed by the taker's clock. The take is
/// itself a CAS on the revision read, so of two nodes deciding "yes" at once only one wins.
pub fn lease_takeover_allowed(state: LeaseState, now_unix_ms: u64) -> bool {
    match state {
        LeaseState::Absent | LeaseState::Free | LeaseState::Corrupt => true,
        LeaseState::Held { expires_unix_ms } => now_unix_ms >= expires_unix_ms,
    }
}

/// The JetStream features a server of `version` (`"2.11.3"`, `"v2.10.0-beta"`) offers, as
/// `(message TTL with delete markers, conditional publish, direct get)`. An unreadable version
/// offers none (the host then assumes the least and says so).
pub fn server_features(version: &str) -> (bool, bool, bool) {
    let v = version.trim().trim_start_matches('v');
    let mut parts = v.split(|c: char| !c.is_ascii_digit());
    let major = parts.next().and_then(|p| p.parse::<u32>().ok());
    let minor = parts.next().and_then(|p| p.parse::<u32>().ok());
    match (major, minor) {
        (Some(major), Some(minor)) => {
            let at_least = |a: u32, b: u32| major > a || (major == a && minor >= b);
            (at_least(2, 11), at_least(2, 6), at_least(2, 9))
        }
        _ => (false, false, false),
    }
}

/// How a raw `$JS.API.STREAM.CREATE` reply is taken (seed 000, hosted NATS).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamCreateVerdict {
    /// The server created the stream (or found it already there with the same configuration).
    Created,
    /// JetStream error 10058: a stream of that name exists. Not fatal: the bucket is checked.
    AlreadyExists,
    /// The account's stream limit is reached. Not fatal when the bucket is already there (a
    /// provider answers this even for a bucket it holds): the bucket is checked.
    AtStreamLimit,
    /// Anything else: the create failed.
    Refused,
}

/// JetStream's error code for "stream name already in use".
pub const JS_STREAM_NAME_IN_USE: u64 = 10058;

/// Decides a raw stream-create reply from its error fields (`None` when the reply carries no
/// error). 10058 in either `code` or `err_code` (providers differ in which) is "already exists";
/// a 400 whose description says the maximum number of streams is reached is the at-limit answer;
/// any other error refuses. The two non-fatal verdicts are only half of the decision: the caller
/// must then find the bucket, or fail.
pub fn stream_create_verdict(
    error: Option<(Option<u64>, Option<u64>, &str)>,
) -> StreamCreateVerdict {
    let Some((code, err_code, description)) = error else {
        return StreamCreateVerdict::Created;
    };
    if code == Some(JS_STREAM_NAME_IN_USE) || err_code == Some(JS_STREAM_NAME_IN_USE) {
        return StreamCreateVerdict::AlreadyExists;
    }
    if code == Some(400)
        && description
            .to_ascii_lowercase()
            .contains("maximum number of streams")
    {
        return StreamCreateVerdict::AtStreamLimit;
    }
    StreamCreateVerdict::Refused
}

/// What a run does when the identity check finds the stream recreated (`--on-recreated`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnRecreated {
    /// Refuse with one line naming the bucket, both identities and what to do; the fold is
    /// untouched (the default: a recreated bucket is an operator's act worth a look).
    #[default]
    Refuse,
    /// Repair as a cursor-less start: the key-listing diff against the new stream, the cursor
    /// and the old stream's retained records and eviction memo dropped, the new identity
    /// recorded, then a state-sync re-list.
    Relist,
}

/// The parts of a stream's config that decide what its retention removes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamLimits {
    /// Age limit (zero: none).
    pub max_age: std::time::Duration,
    /// Size limit in bytes (≤ 0: none).
    pub max_bytes: i64,
    /// Message count limit (≤ 0: none).
    pub max_messages: i64,
    /// A full stream discards its oldest messages (`discard: old`) rather than refusing writes.
    pub discard_old: bool,
    /// Messages may carry their own TTL.
    pub message_ttl: bool,
}

impl StreamLimits {
    /// A size or count limit that discards the oldest messages.
    fn oldest_first(&self) -> bool {
        self.discard_old && (self.max_bytes > 0 || self.max_messages > 0)
    }

    /// Whether retention can remove a key's *current* value (not only superseded ones): an age
    /// limit or an oldest-first size/count limit. A per-key history limit only drops superseded
    /// revisions, and `discard: new` refuses writes rather than evicting, so neither counts.
    ///
    /// Per-message TTLs do not count either — a deliberate refinement of seed 000, which classes
    /// TTL buckets with `max_age` ones: a message expires by its TTL because its writer asked for
    /// it, so the expiry is the writer's own delete. A key absent from the listing was deleted or
    /// expired — both deletes — so the listing stays the truth and the re-list repair is allowed.
    /// (The Python client creates every KV stream with `allow_msg_ttl`; classing those as evicting
    /// made them impossible to re-list.)
    pub fn evicts_current_values(&self) -> bool {
        !self.max_age.is_zero() || self.oldest_first()
    }

    /// Whether age is the only way to evict a current value (the precondition of the
    /// supersession-only resume: only then does "every later message is younger" mean "none aged
    /// out").
    pub fn age_only(&self) -> bool {
        !self.max_age.is_zero() && !self.oldest_first() && !self.message_ttl
    }
}

/// What a delivered message does to its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvOp {
    /// The key now holds the message's payload.
    Put,
    /// The key is deleted.
    Delete,
    /// The key is purged (deleted, its history gone).
    Purge,
}

/// The fold's rule for a message's operation, from its `KV-Operation` header and the server's
/// `Nats-Marker-Reason` (NATS 2.11+: the marker the server writes when a subject's last message
/// goes by age, per-message TTL, or purge). A marker carries no `KV-Operation`; read as a put, it
/// would leave every expired key in the fold as an empty value. So: `KV-Operation` `DEL` → delete,
/// `PURGE` → purge; otherwise a marker is a removal — `MaxAge` and `Purge` purge, `Remove` and any
/// reason this host does not know delete (a marker never carries a value); otherwise a put.
pub fn kv_op(kv_operation: Option<&str>, marker_reason: Option<&str>) -> KvOp {
    match (kv_operation, marker_reason) {
        (Some("DEL"), _) => KvOp::Delete,
        (Some("PURGE"), _) => KvOp::Purge,
        (_, Some("MaxAge" | "Purge")) => KvOp::Purge,
        (_, Some(_)) => KvOp::Delete,
        _ => KvOp::Put,
    }
}

/// Why a stored message's header block is undecodable ([`decode_stored`]): each is a block the
/// client library (async-nats 0.51, `connection.rs`) refuses — an error that drops its connection,
/// or a panic in its connection task — or takes as a server notice rather than a stored message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Undecodable {
    /// An empty header block (no `NATS/1.0` line at all).
    Empty,
    /// Bytes that are not UTF-8.
    NotUtf8,
    /// A first line that does not start with `NATS/1.0`.
    NoVersionLine,
    /// A status line: a code the library cannot parse (an error), or one it can (the message is
    /// then a server notice to it: the ordered consumer drops it, a direct get reports it).
    StatusLine,
    /// A header line without a `:`.
    LineWithoutColon,
    /// A header name with a byte that is not ASCII graphic (a space, a control byte).
    BadName,
    /// A header value with a CR left inside (the library asserts on it: a panic).
    CrInValue,
}

impl Undecodable {
    /// A short name without spaces (logs, `/status`).
    pub fn as_str(self) -> &'static str {
        match self {
            Undecodable::Empty => "empty-header-block",
            Undecodable::NotUtf8 => "header-block-not-utf8",
            Undecodable::NoVersionLine => "no-nats-version-line",
            Undecodable::StatusLine => "status-line",
            Undecodable::LineWithoutColon => "header-line-without-colon",
            Undecodable::BadName => "bad-header-name",
            Undecodable::CrInValue => "cr-inside-header-value",
        }
    }

    /// The reason named by [`Undecodable::as_str`].
    pub fn from_name(name: &str) -> Option<Undecodable> {
        [
            Undecodable::Empty,
            Undecodable::NotUtf8,
            Undecodable::NoVersionLine,
            Undecodable::StatusLine,
            Undecodable::LineWithoutColon,
            Undecodable::BadName,
            Undecodable::CrInValue,
        ]
        .into_iter()
        .find(|u| u.as_str() == name)
    }
}

impl std::fmt::Display for Undecodable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a stored message means, from its header block as nats-server stored it (`None`: a
/// message without headers) — the one rule every path folds by (docs/design.md, "What a stored
/// message means"): a put, a delete, a purge ([`kv_op`] over the first `KV-Operation` and the
/// first `Nats-Marker-Reason`, names compared exactly), or [`Undecodable`].
///
/// The block is read line for line as the client library reads a delivery (async-nats 0.51
/// `connection.rs`, `try_read_op`, `HMSG`): UTF-8; lines split by `str::lines` (a bare LF ends a
/// line, one CR before it goes with it); the first line `NATS/1.0` with nothing after it but
/// whitespace; then, skipping empty lines, `name:value` lines, a line starting with whitespace
/// continuing the value before it, values trimmed. The library's lookup is exact
/// (`HeaderMap::get` hashes the name as written), so `kv-operation: DEL` is a header named
/// otherwise: a put. Where the library accepts a block this verdict is the operation the fold
/// gets through it; where it refuses one (an error, a panic) or takes it for a server notice (a
/// status line), the verdict is undecodable: a skip on every path, never a different operation
/// (the proptest `the_decoder_agrees_with_the_client_library` checks this against the library's
/// own parser).
pub fn decode_stored(block: Option<&[u8]>) -> Result<KvOp, Undecodable> {
    let Some(block) = block else {
        return Ok(KvOp::Put);
    };
    let text = std::str::from_utf8(block).map_err(|_| Undecodable::NotUtf8)?;
    let mut lines = text.lines().peekable();
    let first = lines.next().ok_or(Undecodable::Empty)?;
    let status = first
        .strip_prefix("NATS/1.0")
        .ok_or(Undecodable::NoVersionLine)?
        .trim();
    if !status.is_empty() {
        return Err(Undecodable::StatusLine);
    }
    let (mut op, mut reason): (Option<String>, Option<String>) = (None, None);
    while let Some(line) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let (name, value) = line.split_once(':').ok_or(Undecodable::LineWithoutColon)?;
        if name.contains(|c: char| !c.is_ascii_graphic() || c == ':') {
            return Err(Undecodable::BadName);
        }
        let mut value = value.trim_start().to_string();
        while let Some(more) = lines.next_if(|l| l.starts_with(char::is_whitespace)) {
            value.push_str(more);
        }
        value.truncate(value.trim_end().len());
        if value.contains(['\r', '\n']) {
            return Err(Undecodable::CrInValue);
        }
        // The library keeps every value of a name; a lookup answers the first.
        let slot = match name {
            "KV-Operation" => &mut op,
            "Nats-Marker-Reason" => &mut reason,
            _ => continue,
        };
        slot.get_or_insert(value);
    }
    Ok(kv_op(op.as_deref(), reason.as_deref()))
}

/// The update standing for an undecodable stored message of `subject`: a key in the host's
/// reserved space (so the fold skips it as [`bucket_key_admitted`] says, its revision moving the
/// cursor), naming the reason and the subject. Nothing a writer stores can look like it: a
/// delivered subject never holds a space.
pub fn undecodable_key(subject: &str, reason: Undecodable) -> String {
    format!("{UNDECODABLE_KEY_PREFIX}{} {subject}", reason.as_str())
}

const UNDECODABLE_KEY_PREFIX: &str = "\u{1} undecodable ";

/// The subject and reason an [`undecodable_key`] names; `None` for any other key.
pub fn parse_undecodable_key(key: &str) -> Option<(&str, Undecodable)> {
    let rest = key.strip_prefix(UNDECODABLE_KEY_PREFIX)?;
    let (reason, subject) = rest.split_once(' ')?;
    Some((subject, Undecodable::from_name(reason)?))
}

/// The subject filters of a scope's key prefixes under `subject_prefix` (`$KV.<bucket>.`): a
/// prefix filters on its last whole token (`a.b.c` → `$KV.<bucket>.a.b.>`), the rest of it is
/// checked per message. `Err` names a prefix holding a wildcard or a space.
///
/// No filter returned overlaps another: a guest's manifest may name `a.` and `a.b.`, or `a.b.c`
/// and `a.x` (whose filters are `a.b.>` and `a.>`), and nats-server refuses a consumer whose
/// filters overlap — every watch of that scope failed at its consumer's creation, so the fold
/// never started. A filter another one covers is dropped, which changes no message delivered.
pub fn scope_filters<'a>(
    subject_prefix: &str,
    prefixes: impl IntoIterator<Item = &'a str>,
) -> Result<Vec<String>, String> {
    let mut stems: Vec<&str> = Vec::new();
    for p in prefixes {
        if p.contains(['*', '>', ' ']) {
            return Err(format!("prefix {p:?} contains a wildcard or space"));
        }
        stems.push(match p.rfind('.') {
            Some(i) => &p[..=i],
            None => "",
        });
    }
    // Sorted, a stem that covers others comes right before them.
    stems.sort_unstable();
    stems.dedup();
    let mut kept: Vec<&str> = Vec::with_capacity(stems.len());
    for stem in stems {
        if kept.last().is_some_and(|k| stem.starts_with(k)) {
            continue;
        }
        kept.push(stem);
    }
    Ok(kept
        .into_iter()
        .map(|stem| format!("{subject_prefix}{stem}>"))
        .collect())
}

/// The filters a watch consumer sends to the server for the watch's `filters`.
///
/// Empty (no filter) when the one filter is the catch-all of a stream that stores nothing else:
/// its subjects are exactly that filter and nothing reaches it by a mirror, a source or a subject
/// transform. Then "every message of the stream" and "every message matching the filter" are the
/// same messages, and the unfiltered consumer is the cheap one: nats-server 2.15 counts a new
/// filtered consumer's pending messages over the stream's subject tree, 30–47 ms on a stream of
/// 1 000 000 messages, against under 1 ms unfiltered — most of a resume's time. A
/// `LastPerSubject` consumer keeps its filter (the server refuses it without one), and so does
/// every narrower scope.
pub fn server_filters(
    filters: &[String],
    stream_subjects: &[String],
    stream_has_other_inputs: bool,
    last_per_subject: bool,
) -> Vec<String> {
    let whole_stream = !stream_has_other_inputs
        && !last_per_subject
        && filters.len() == 1
        && stream_subjects == filters;
    if whole_stream {
        Vec::new()
    } else {
        filters.to_vec()
    }
}

/// Whether a stream stores nothing but the bucket's subjects: no mirror, source or subject
/// transform brings anything in (`other_inputs`), and its subjects are exactly `catch_all`
/// (`$KV.<bucket>.>`).
pub fn plain_stream(stream_subjects: &[String], other_inputs: bool, catch_all: &str) -> bool {
    !other_inputs && stream_subjects.len() == 1 && stream_subjects[0] == catch_all
}

/// Whether a resume may read its gap by direct gets on a stream with `allow_direct` and
/// `replicas` replicas: only on a single-replica stream, for now. On a replicated one the
/// catch-up stays correct by construction (every absence is confirmed by the leader), but it has
/// not been measured through a leader's failover: the three-node cluster test, run under load,
/// took 13–66 s with it and 14–69 s without, too spread to tell. Replicated streams keep the
/// consumer path until that is measured.
pub fn direct_reads_allowed(allow_direct: bool, replicas: usize) -> bool {
    allow_direct && replicas <= 1
}

/// Most messages a delta watch reads by direct gets before its consumer starts
/// ([`direct_catch_up_range`]).
pub const DIRECT_CATCH_UP_MAX: u64 = 2048;

/// Longest a direct catch-up may take before the watch gives up on it and starts its consumer at
/// the cursor (or the operation timeout, when shorter). A gap of 2 048 reads in 10–20 ms; a
/// client not allowed `$JS.API.DIRECT.GET` gets no answer at all (the server drops the request),
/// and must not wait out the whole operation timeout at every start.
pub const DIRECT_CATCH_UP_BUDGET: std::time::Duration = std::time::Duration::from_secs(2);

/// Direct gets a catch-up keeps in flight at once.
pub const DIRECT_CATCH_UP_IN_FLIGHT: usize = 256;

/// Most sequences of a direct catch-up that may come back absent; past this the catch-up gives
/// way to a consumer from its start (each absence costs a read from the stream's leader, and a
/// gap of mostly removed messages is what a consumer steps over cheaply).
pub const DIRECT_CATCH_UP_MAX_ABSENT: usize = 64;

/// The sequences a delta watch starting at `start` reads by direct gets, on a stream whose last
/// sequence is `last`, before it starts its consumer at `last + 1` (`None`: the consumer starts
/// at `start`, as before).
///
/// Why: nats-server 2.15 answers a consumer's creation only after counting its pending messages,
/// and when the start lies inside a block of a stream with removed messages (any KV bucket whose
/// keys were overwritten) that count loads the block and its per-subject state — 21–25 ms on a
/// 1 000 000-key bucket, whatever the gap — while a consumer starting past the last sequence is
/// created in under 1 ms and 1 000 pipelined direct gets take 6–9 ms. So a short gap is read
/// directly. Only when the stream stores nothing but the bucket's subjects (`plain_stream`: no
/// mirror, source or subject transform, its subjects exactly the bucket's catch-all — a direct
/// get returns every message of the stream, and of those the watch keeps the ones in its scope,
/// as its consumer's filter would), the stream allows direct gets, and the gap is at most
/// [`DIRECT_CATCH_UP_MAX`] (2 048 direct gets cost about what the consumer's count does; a longer
/// gap is a consumer's job). A filtered consumer counts over the subject tree, 30–47 ms, so a
/// narrower scope gains as much.
///
/// Soundness rests on what the caller does with the answers: a message is immutable at its
/// sequence, so a found one is what a consumer would deliver; an absent one is confirmed by the
/// stream leader, because a replica or a mirror may answer a direct get before it holds the
/// message.
pub fn direct_catch_up_range(
    start: u64,
    last: u64,
    plain_stream: bool,
    allow_direct: bool,
) -> Option<std::ops::RangeInclusive<u64>> {
    let len = last.checked_sub(start)?.checked_add(1)?;
    (plain_stream && allow_direct && start > 0 && len <= DIRECT_CATCH_UP_MAX)
        .then_some(start..=last)
}

/// The sequences a watch reads through the stream API before its consumer starts, when the
/// watch before it on the client's ordered consumer ended because the client's connection
/// dropped (`recovering`), else what [`direct_catch_up_range`] says.
///
/// Why: the client library drops its connection on a stored header block it cannot read
/// (docs/design.md, "What a stored message means"), and its consumer, re-created at the cursor,
/// meets that message again, for good. The stream API carries a message as JSON, which any stored
/// bytes survive, so a recovering watch reads the first [`DIRECT_CATCH_UP_MAX`] sequences after
/// its cursor that way, whatever the gap's length, whether direct gets are allowed (the API is
/// the leader's, not a direct get) and however many of them are absent: the message the
/// connection dropped on is among them, because the fold commits what was delivered before it
/// ahead of the watch's end. Any stream is read so, plain or not (a mirror, sources, subject
/// transforms): the answers carry their subjects, and the watch keeps those in its scope as its
/// consumer's filter would, so a stream's other subjects cost reads, never a different fold.
pub fn catch_up_range(
    start: u64,
    last: u64,
    plain_stream: bool,
    allow_direct: bool,
    recovering: bool,
) -> Option<std::ops::RangeInclusive<u64>> {
    if !recovering {
        return direct_catch_up_range(start, last, plain_stream, allow_direct);
    }
    (start > 0 && last >= start)
        .then(|| start..=last.min(start.saturating_add(DIRECT_CATCH_UP_MAX - 1)))
}

/// The sequence a direct catch-up's answer is for: its reply subject is `{inbox}.{seq}` (one
/// subscription `{inbox}.*` takes every answer, so the subject is the only thing that pairs an
/// answer with its question). `None` for any other subject, a sequence that is not a plain
/// decimal `u64` (no sign, no leading zero, no other token after it): such an answer is not
/// one the catch-up asked for, and it gives way rather than guess.
pub fn direct_reply_sequence(inbox: &str, subject: &str) -> Option<u64> {
    let token = subject.strip_prefix(inbox)?.strip_prefix('.')?;
    let canonical = !token.is_empty()
        && token.len() <= 20
        && token.bytes().all(|b| b.is_ascii_digit())
        && (token == "0" || !token.starts_with('0'));
    if !canonical {
        return None;
    }
    token.parse().ok()
}

/// Whether `key` is a key a NATS KV client may read or write: letters, digits and `-/_=.`, not
/// starting or ending with `.` (the rule the nats clients check, so no wildcard, space or empty
/// token reaches a subject).
pub fn kv_key_valid(key: &str) -> bool {
    !key.is_empty()
        && !key.starts_with('.')
        && !key.ends_with('.')
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-/_=.".contains(&b))
}

/// Whether a key delivered from the bucket may be folded. Keys starting with `\x01` are the
/// host's own record space (retained records live there); NATS accepts such a subject on a raw
/// publish, and folding one would put a forged host record — a fake base, a deleted deferred
/// update — where the host keeps its own, or make the store undecodable. The rule: such a key is
/// skipped with a warning, never stored and never shown to a guest; its revision still moves the
/// cursor, like a key a guest skips.
pub fn bucket_key_admitted(key: &str) -> bool {
    !key.starts_with('\u{1}')
}

/// Whether the host may publish a query's answer to `reply`: only to subjects under `prefix`
/// (an inbox, `_INBOX.` by default). Without this, a requester could name any subject — a
/// `$KV.<bucket>.<key>` or a `$JS.API` call — and have the host publish the answer there with its
/// own credentials.
pub fn reply_subject_allowed(reply: &str, prefix: &str) -> bool {
    !prefix.is_empty()
        && reply.len() > prefix.len()
        && reply.starts_with(prefix)
        && !reply.contains([' ', '\t', '\r', '\n', '*', '>'])
}

/// How a `--listen` endpoint opens `/status` and `/query` (the admin token opens them in every
/// case; [`query_access`] decides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueryAccess {
    /// With the query token the operator gave (a file, or an embedder's string).
    GivenToken,
    /// With a token the host generates into a private file: a listener reachable from beyond
    /// this machine, given no token and no `--query-open`.
    GeneratedToken,
    /// To whoever reaches the listener: a loopback listener given no token.
    Open,
    /// To whoever reaches a listener beyond loopback, because the operator said so
    /// (`--query-open`); the host says the risk when it starts.
    OpenByChoice,
}

/// How `/status` and `/query` of a listener bound to an address that is (`loopback`) or is not a
/// loopback one are opened, given whether a query token was given and `--query-open` asked. A
/// listener beyond loopback (a wildcard `0.0.0.0` / `::` one included: it answers through
/// 127.0.0.1 too, where a DNS-rebound web page reaches it) never answers a query from anyone who
/// can reach it unless the operator chose that: without a token it gets a generated one. A
/// loopback listener stays open without a token, as only this machine reaches it and its `Host`
/// check keeps rebound pages out. A token and `--query-open` together are a contradiction,
/// refused rather than one of them silently ignored.
pub fn query_access(
    loopback: bool,
    token_given: bool,
    query_open: bool,
) -> Result<QueryAccess, &'static str> {
    match (token_given, query_open, loopback) {
        (true, true, _) => Err("--query-open and a query token exclude each other: give one"),
        (true, false, _) => Ok(QueryAccess::GivenToken),
        (false, _, true) => Ok(QueryAccess::Open),
        (false, true, false) => Ok(QueryAccess::OpenByChoice),
        (false, false, false) => Ok(QueryAccess::GeneratedToken),
    }
}

/// A `Host` header value (or a `--listen-host` name) split into its host and its port, if it
/// has one: `name`, `name:port`, `1.2.3.4:port`, `[::1]:port`. `None` for anything else: empty,
/// a bare IPv6 address, a bad port, or characters no host name has (space, `/`, `@`, …).
pub fn split_host_port(value: &str) -> Option<(&str, Option<u16>)> {
    let bad = |c: char| c.is_whitespace() || c.is_control() || "/\\@?#,;\"'<>".contains(c);
    if value.is_empty() || value.contains(bad) {
        return None;
    }
    let (host, port) = if value.starts_with('[') {
        let close = value.find(']')?;
        let (host, rest) = value.split_at(close + 1);
        match rest {
            "" => (host, None),
            _ => (host, Some(rest.strip_prefix(':')?)),
        }
    } else {
        match value.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (value, None),
        }
    };
    if host.is_empty() || host == "[]" || (!host.starts_with('[') && host.contains([':', '[', ']']))
    {
        return None;
    }
    let port = match port {
        Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => Some(p.parse().ok()?),
        Some(_) => return None,
        None => None,
    };
    Some((host, port))
}

/// The IP address a `Host`'s host part spells literally (`10.0.0.5`, `[::1]`), if it is one.
fn host_ip_literal(host: &str) -> Option<std::net::IpAddr> {
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6
            .parse::<std::net::Ipv6Addr>()
            .ok()
            .map(std::net::IpAddr::V6),
        None => host
            .parse::<std::net::Ipv4Addr>()
            .ok()
            .map(std::net::IpAddr::V4),
    }
}

/// Whether a request's `Host` names this listener, so that it was addressed to the host and not
/// to a name a DNS-rebinding page made point here. `listen` is the bound address, `arrived_on`
/// the local address the connection came in on (on a wildcard listener, one of the machine's
/// concrete addresses), `names` the `--listen-host` names (with a port: that port exactly;
/// without: no port or the listener's). Besides those names:
/// - a loopback listener is named by `localhost`, `127.0.0.1`, `[::1]` or its own address, with
///   its port;
/// - a wildcard listener (`0.0.0.0`, `::`) by the IP literal of the address the connection
///   arrived on (and `localhost`, or the wildcard address itself, when that is loopback), with
///   its port: an IP literal cannot be rebound, and no other name is known to be the host's;
/// - any other listener by its own address.
///
/// A missing `Host`, a `Host` without a port (port 80) on another port, or any other name is
/// refused.
pub fn host_names_listener(
    host: Option<&str>,
    listen: std::net::SocketAddr,
    arrived_on: std::net::SocketAddr,
    names: &[String],
) -> bool {
    let Some((h, p)) = host.and_then(split_host_port) else {
        return false;
    };
    let port = p.unwrap_or(80);
    let named = names
        .iter()
        .filter_map(|n| split_host_port(n))
        .any(|(nh, np)| {
            nh.eq_ignore_ascii_case(h)
                && match np {
                    Some(np) => np == port,
                    None => p.is_none() || port == listen.port(),
                }
        });
    if named {
        return true;
    }
    if port != listen.port() {
        return false;
    }
    let ip = host_ip_literal(h).map(|ip| ip.to_canonical());
    let loopback_name = |on: std::net::IpAddr| {
        on.to_canonical().is_loopback()
            && (h.eq_ignore_ascii_case("localhost") || ip.is_some_and(|ip| ip.is_loopback()))
    };
    if listen.ip().is_unspecified() {
        ip == Some(arrived_on.ip().to_canonical())
            || loopback_name(arrived_on.ip())
            // `0.0.0.0:P` as the address, which this machine's clients reach through loopback.
            || (ip == Some(listen.ip().to_canonical()) && arrived_on.ip().to_canonical().is_loopback())
    } else {
        ip == Some(listen.ip().to_canonical()) || loopback_name(listen.ip())
    }
}

/// Most catch-up rounds a swap runs beside the fold before its cut-over.
pub const MAX_SWAP_CATCH_UP_ROUNDS: u32 = 4;

/// Keys changed since the candidate's capture began that the cut-over takes on itself; more, and
/// another catch-up round runs beside the fold first.
pub const SWAP_CUT_OVER_KEYS: usize = 256;

/// Whether a swap whose candidate is level with its capture's cursor, with `changed` keys changed
/// since and `rounds` catch-up rounds run, runs another round beside the fold before its
/// cut-over. Each round takes the keys changed during the one before, so under a steady writer
/// the cut-over's share shrinks round by round to what changes during one short round — the pause
/// is bounded by the write rate, not by the fold's size. Capped, so a writer faster than the
/// candidate's catch-up cannot hold a swap off for ever: the last round is the cut-over.
pub fn swap_needs_another_round(rounds: u32, changed: usize) -> bool {
    rounds < MAX_SWAP_CATCH_UP_ROUNDS && changed > SWAP_CUT_OVER_KEYS
}

/// What a shadow does next, its candidate level with its capture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShadowStep {
    /// Another catch-up round beside the fold (many keys changed since the capture began).
    CatchUp,
    /// Wait beside the fold for more batches (checked again after each commit).
    Wait,
    /// Settle and compare: the candidate has been fed the batches asked for.
    Compare,
}

/// A shadow's next step, with `seen` of the `wanted` batches committed since it began (`out_of_time`
/// when its wait for them ran out: it then compares on what it saw), `rounds` catch-up rounds run
/// since it stopped waiting, and `changed` keys changed since the capture began.
/// While waiting, a round runs whenever more keys changed than a cut-over takes on itself, so the
/// comparison's pause stays that of a swap's cut-over however many batches the shadow waits for;
/// once every batch was seen it ends as a swap does ([`swap_needs_another_round`]), with a
/// comparison instead of a switch.
pub fn shadow_step(
    seen: u64,
    wanted: u64,
    out_of_time: bool,
    rounds: u32,
    changed: usize,
) -> ShadowStep {
    if seen < wanted && !out_of_time {
        if changed > SWAP_CUT_OVER_KEYS {
            ShadowStep::CatchUp
        } else {
            ShadowStep::Wait
        }
    } else if swap_needs_another_round(rounds, changed) {
        ShadowStep::CatchUp
    } else {
        ShadowStep::Compare
    }
}

/// Whether a shadow's candidate has earned its promotion: `seen` of the `wanted` batches fed,
/// `asked` of the `planned` requests asked (the comparison's time budget can cut it), none of
/// them answered differently (`differing`), and the caller still `waiting` for the answer. `Err`
/// says what is missing. A comparison on nothing proves nothing: no request, or fewer batches than
/// asked (an idle bucket), is not a promotion.
pub fn shadow_promotion(
    seen: u64,
    wanted: u64,
    asked: usize,
    planned: usize,
    differing: u64,
    waiting: bool,
) -> Result<(), String> {
    if differing > 0 {
        return Err(format!(
            "{differing} of {asked} requests answered differently"
        ));
    }
    if asked == 0 {
        return Err("no request was compared (nothing in scope to sample?)".into());
    }
    if asked < planned {
        return Err(format!(
            "only {asked} of {planned} requests were compared within the comparison's time budget"
        ));
    }
    if seen < wanted {
        return Err(format!(
            "only {seen} of the {wanted} batches asked for came within the wait"
        ));
    }
    if !waiting {
        return Err("the caller went away before the answer".into());
    }
    Ok(())
}

impl std::str::FromStr for RepairMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(RepairMode::Auto),
            "relist" => Ok(RepairMode::Relist),
            "restore" => Ok(RepairMode::Restore),
            "none" => Ok(RepairMode::None),
            other => Err(format!(
                "{other:?} is not a repair mode (auto, relist, restore, none)"
            )),
        }
    }
}

impl std::fmt::Display for RepairMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RepairMode::Auto => "auto",
            RepairMode::Relist => "relist",
            RepairMode::Restore => "restore",
            RepairMode::None => "none",
        })
    }
}

impl std::fmt::Display for OnRecreated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OnRecreated::Refuse => "refuse",
            OnRecreated::Relist => "relist",
        })
    }
}

impl std::str::FromStr for OnRecreated {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "refuse" => Ok(OnRecreated::Refuse),
            "relist" => Ok(OnRecreated::Relist),
            other => Err(format!(
                "{other:?} is not what to do with a recreated bucket (refuse, relist)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shadow_is_promoted_only_on_complete_agreement_that_someone_hears_of() {
        assert_eq!(shadow_promotion(50, 50, 200, 200, 0, true), Ok(()));
        assert_eq!(shadow_promotion(60, 50, 1, 1, 0, true), Ok(()));
        for refused in [
            shadow_promotion(50, 50, 200, 200, 1, true),
            shadow_promotion(50, 50, 0, 0, 0, true),
            shadow_promotion(50, 50, 199, 200, 0, true),
            shadow_promotion(49, 50, 200, 200, 0, true),
            shadow_promotion(50, 50, 200, 200, 0, false),
        ] {
            assert!(refused.is_err());
        }
    }

    #[test]
    fn a_shadow_waits_for_its_batches_catching_up_beside_the_fold_then_compares() {
        use ShadowStep::*;
        assert_eq!(shadow_step(0, 50, false, 0, 0), Wait);
        assert_eq!(shadow_step(49, 50, false, 0, SWAP_CUT_OVER_KEYS), Wait);
        assert_eq!(
            shadow_step(49, 50, false, 9, SWAP_CUT_OVER_KEYS + 1),
            CatchUp,
            "rounds while waiting are not capped"
        );
        assert_eq!(shadow_step(50, 50, false, 0, 0), Compare);
        assert_eq!(
            shadow_step(50, 50, false, 0, SWAP_CUT_OVER_KEYS + 1),
            CatchUp
        );
        assert_eq!(
            shadow_step(50, 50, false, MAX_SWAP_CATCH_UP_ROUNDS, usize::MAX),
            Compare,
            "a writer faster than the candidate cannot hold the comparison off"
        );
        assert_eq!(
            shadow_step(0, 0, false, 0, 0),
            Compare,
            "zero batches: compare at once"
        );
        assert_eq!(
            shadow_step(3, 50, true, 0, 0),
            Compare,
            "an idle bucket: compare on what came"
        );
        assert_eq!(shadow_step(3, 50, true, 0, SWAP_CUT_OVER_KEYS + 1), CatchUp);
    }

    fn limits(
        max_age: std::time::Duration,
        max_bytes: i64,
        max_messages: i64,
        discard_old: bool,
        message_ttl: bool,
    ) -> StreamLimits {
        StreamLimits {
            max_age,
            max_bytes,
            max_messages,
            discard_old,
            message_ttl,
        }
    }

    #[test]
    fn only_age_and_oldest_first_limits_evict_current_values_and_only_age_is_age_only() {
        use std::time::Duration as D;
        let hour = D::from_secs(3600);
        // (max_age, max_bytes, max_messages, discard old, ttl, evicts, age only)
        let table = [
            (D::ZERO, -1, -1, false, false, false, false),
            (D::ZERO, -1, -1, true, false, false, false),
            (hour, -1, -1, false, false, true, true),
            (hour, 1 << 20, -1, false, false, true, true), // discard new refuses, never evicts
            (hour, 1 << 20, -1, true, false, true, false),
            (hour, -1, 10, true, false, true, false),
            (hour, -1, -1, false, true, true, false), // TTLs: no supersession-only resume
            (D::ZERO, -1, -1, false, true, false, false), // TTL only: the writer's deletes
            (D::ZERO, 1 << 20, -1, true, false, true, false),
            (D::ZERO, 1 << 20, -1, false, false, false, false),
            (D::ZERO, -1, 1000, true, false, true, false),
            (D::ZERO, 1 << 20, -1, true, true, true, false),
        ];
        for (age, bytes, msgs, old, ttl, evicts, only) in table {
            let l = limits(age, bytes, msgs, old, ttl);
            assert_eq!(l.evicts_current_values(), evicts, "{l:?}");
            assert_eq!(l.age_only(), only, "{l:?}");
        }
    }

    #[test]
    fn the_listing_is_the_truth_only_where_nothing_current_was_ever_evicted() {
        // (evicts current values, first revision, seen evicting, expected)
        let table = [
            (false, 1, false, true),
            (false, 5000, false, true),
            (true, 0, false, true),
            (true, 1, false, true),
            (true, 2, false, false),
            (false, 1, true, false),
            (true, 1, true, false),
        ];
        for (e, f, seen, want) in table {
            assert_eq!(listing_is_truth(e, f, seen), want, "{e} {f} {seen}");
        }
        assert_eq!(listing_truth(None, false), None);
        assert_eq!(listing_truth(None, true), Some(false));
        let keep = Retention {
            evicts_current_values: false,
            first_revision: 900,
        };
        assert_eq!(listing_truth(Some(keep), false), Some(true));
        assert_eq!(
            listing_truth(Some(keep), true),
            Some(false),
            "the memo wins"
        );
    }

    #[test]
    fn repair_plans_follow_the_mode_and_the_listing() {
        use RepairMode as M;
        use RepairPlan as P;
        let table = [
            (M::None, Some(true), P::None),
            (M::None, None, P::None),
            (M::Relist, Some(true), P::Relist),
            (M::Relist, Some(false), P::RefuseRelist),
            (M::Relist, None, P::RefuseRelist),
            (M::Restore, Some(true), P::Restore),
            (M::Restore, None, P::Restore),
            (M::Auto, Some(true), P::Relist),
            (M::Auto, Some(false), P::Restore),
            (M::Auto, None, P::Restore),
        ];
        for (m, t, want) in table {
            assert_eq!(plan_repair(m, t), want, "{m:?} {t:?}");
        }
    }

    #[test]
    fn a_cursorless_start_repairs_when_the_fold_has_data_or_a_restore_is_armed_on_an_untrue_listing()
     {
        use RepairMode as M;
        assert!(cursorless_start_needs_repair(M::Relist, true, Some(true)));
        assert!(cursorless_start_needs_repair(M::None, true, Some(true)));
        assert!(!cursorless_start_needs_repair(
            M::Relist,
            false,
            Some(false)
        ));
        assert!(!cursorless_start_needs_repair(M::Auto, false, Some(true)));
        assert!(cursorless_start_needs_repair(M::Auto, false, Some(false)));
        assert!(cursorless_start_needs_repair(M::Restore, false, None));
        assert!(!cursorless_start_needs_repair(M::None, false, None));
    }

    #[test]
    fn a_restore_is_allowed_only_strictly_ahead_and_inside_retention() {
        // (artifact, local, first sequence, expected)
        let table = [
            (100, Some(50), 90, true),
            (100, Some(100), 90, false), // not strictly ahead
            (100, Some(150), 90, false), // behind
            (100, None, 90, true),       // an empty fold
            (100, Some(50), 101, true),  // resume at 101 is the head
            (100, Some(50), 102, false), // its cursor aged out too
        ];
        for (a, l, f, want) in table {
            assert_eq!(restore_allowed(a, l, f), want, "{a} {l:?} {f}");
        }
    }

    #[test]
    fn a_restore_never_moves_a_key_backward_nor_deletes_a_live_one() {
        use KeyRestore as K;
        // (local, artifact, identical, listed live, expected)
        let table = [
            (Some(5), Some(5), true, true, K::Keep),
            (Some(5), Some(9), false, true, K::Take),
            (Some(9), Some(5), false, true, K::Keep),
            (None, Some(5), false, false, K::Take),
            (Some(5), None, false, true, K::Keep),
            (Some(5), None, false, false, K::Delete),
            (None, None, false, false, K::Keep),
            (Some(0), Some(5), false, true, K::Take), // an unknown local version is older
        ];
        for (l, a, same, live, want) in table {
            assert_eq!(
                restore_key(l, a, same, live, None),
                want,
                "{l:?} {a:?} {same} {live}"
            );
        }
        // The fold's cursor covers the artifact's entry: never taken (a key the fold deleted
        // stays deleted), whatever the local entry.
        assert_eq!(restore_key(None, Some(5), false, false, Some(7)), K::Keep);
        assert_eq!(
            restore_key(Some(3), Some(5), false, false, Some(5)),
            K::Keep
        );
        assert_eq!(restore_key(None, Some(8), false, false, Some(7)), K::Take);
        assert_eq!(restore_key(Some(5), None, false, false, Some(7)), K::Delete);
    }

    #[test]
    fn the_floor_guard_trips_only_on_head_eviction_of_an_evicting_stream() {
        // (evicts, frontier, first sequence, expected)
        let table = [
            (true, 10, 11, false), // the next message is still there
            (true, 10, 5, false),
            (true, 10, 12, true),    // 11 was evicted unseen
            (false, 10, 500, false), // superseded, not evicted: the successor is delivered
            (true, 0, 1, false),
            (true, 0, 2, true),
        ];
        for (e, f, first, want) in table {
            assert_eq!(floor_guard_trips(e, f, first), want, "{e} {f} {first}");
        }
    }

    #[test]
    fn an_artifact_covers_a_watch_only_if_every_watch_prefix_is_inside_one_of_its_own() {
        assert!(scope_covers(&[""], &[""]));
        assert!(scope_covers(&[""], &["a/", "b/"]));
        assert!(scope_covers(&["a/"], &["a/x/"]));
        assert!(scope_covers(&["a/", "b/"], &["b/"]));
        assert!(!scope_covers(&["a/"], &[""]));
        assert!(!scope_covers(&["a/x/"], &["a/"]));
        assert!(!scope_covers(&["a/"], &["a/", "c/"]));
        assert!(!scope_covers(&[], &["a/"]));
    }

    #[test]
    fn an_age_only_gap_is_trusted_only_within_half_of_max_age() {
        use std::time::Duration as D;
        let hour = D::from_secs(3600);
        assert!(gap_holds_no_eviction(true, hour, D::from_secs(1800)));
        assert!(!gap_holds_no_eviction(true, hour, D::from_secs(1801)));
        assert!(!gap_holds_no_eviction(false, hour, D::from_secs(1)));
        assert!(!gap_holds_no_eviction(true, D::ZERO, D::ZERO));
    }

    #[test]
    fn applied_through_stays_below_the_oldest_retained_record() {
        // (cursor, oldest retained, expected)
        let table = [
            (None, None, None),
            (Some(10), None, Some(10)),
            (Some(10), Some(7), Some(6)),
            (Some(10), Some(11), Some(10)),
            (Some(10), Some(1), Some(0)),
            (None, Some(3), None),
        ];
        for (c, r, want) in table {
            assert_eq!(applied_through(c, r), want, "{c:?} {r:?}");
        }
    }

    #[test]
    fn updates_after_a_deferred_one_of_the_same_key_are_held() {
        let keys = ["a", "b", "a", "c", "a", "b"];
        assert_eq!(held_after_defers(&keys, &[false; 6]), Vec::<usize>::new());
        assert_eq!(
            held_after_defers(&keys, &[true, false, false, false, false, false]),
            vec![2, 4]
        );
        // A later defer does not hold what came before it.
        assert_eq!(
            held_after_defers(&keys, &[false, false, true, false, false, false]),
            vec![4]
        );
        assert_eq!(
            held_after_defers(&keys, &[false, true, false, true, true, false]),
            vec![5]
        );
    }

    #[test]
    fn queries_and_the_fold_take_bounded_turns_while_both_wait() {
        use std::time::Duration;
        let ms = Duration::from_millis;
        let share = |queries, query_time, flushes| LoopShare {
            queries,
            query_time,
            flushes,
        };
        let n = MAX_QUERIES_BETWEEN_FLUSHES;
        let m = MAX_FLUSHES_BETWEEN_QUERIES;
        // (share, fold work waiting, a query waiting) -> (queries may run, the fold may run)
        let table = [
            // Either side alone runs freely, whatever it did before.
            (share(0, ms(0), 0), false, false, (true, true)),
            (share(n + 5, ms(900), 0), false, true, (true, true)),
            (share(0, ms(0), m + 5), true, false, (true, true)),
            // Both wait: queries first, within their count and time...
            (share(0, ms(0), 0), true, true, (true, true)),
            (share(n - 1, ms(9), 0), true, true, (true, true)),
            // ...then the fold: the count, or the time (one query spinning to its deadline).
            (share(n, ms(0), 0), true, true, (false, true)),
            (
                share(1, QUERY_TIME_BETWEEN_FLUSHES, 0),
                true,
                true,
                (false, true),
            ),
            (share(1, ms(1000), 0), true, true, (false, true)),
            // The fold's turn, once begun, runs to its end while its work waits...
            (share(0, ms(0), 1), true, true, (false, true)),
            (share(0, ms(0), m - 1), true, true, (false, true)),
            // ...and a query goes next.
            (share(0, ms(0), m), true, true, (true, false)),
            (share(0, ms(0), m + 3), true, true, (true, false)),
            // The fold ran out of work mid-turn: queries go.
            (share(0, ms(0), 3), false, true, (true, true)),
            // An inconsistent share (no loop reaches it) never closes both.
            (share(n, ms(0), m), true, true, (true, false)),
        ];
        for (s, fold_waiting, query_waiting, want) in table {
            assert_eq!(
                loop_gates(s, fold_waiting, query_waiting),
                want,
                "{s:?} fold waiting {fold_waiting}, query waiting {query_waiting}"
            );
        }
    }

    #[test]
    fn neither_a_query_flood_nor_a_delivery_flood_starves_the_other() {
        use std::time::Duration;
        // Both always waiting; queries of each cost (cheap, spinning to a 1 s deadline). The loop
        // serves queries first when both gates are open, as its biased select does.
        for cost in [Duration::from_micros(20), Duration::from_secs(1)] {
            let mut s = LoopShare::default();
            let (mut queries_in_row, mut flushes_in_row) = (0u32, 0u32);
            let (mut max_q, mut max_f) = (0u32, 0u32);
            let mut flushes = 0u32;
            for _ in 0..10_000 {
                match loop_gates(s, true, true) {
                    (true, _) => {
                        s.served_query(cost);
                        queries_in_row += 1;
                        flushes_in_row = 0;
                    }
                    (false, true) => {
                        s.flushed();
                        flushes += 1;
                        flushes_in_row += 1;
                        queries_in_row = 0;
                    }
                    (false, false) => panic!("both gates closed at {s:?}"),
                }
                max_q = max_q.max(queries_in_row);
                max_f = max_f.max(flushes_in_row);
            }
            assert!(
                max_q <= MAX_QUERIES_BETWEEN_FLUSHES,
                "{cost:?}: {max_q} queries in a row"
            );
            assert!(
                max_f <= MAX_FLUSHES_BETWEEN_QUERIES,
                "{cost:?}: {max_f} flushes in a row"
            );
            assert!(flushes > 0 && max_q > 0, "{cost:?}: both sides ran");
            if cost >= QUERY_TIME_BETWEEN_FLUSHES {
                // A spinning query ends the queries' turn by itself: one per fold turn.
                assert_eq!(max_q, 1, "{cost:?}");
                assert_eq!(max_f, MAX_FLUSHES_BETWEEN_QUERIES, "{cost:?}");
            }
        }
    }

    #[test]
    fn resume_window_table_matches_the_seed() {
        // (revision, first_sequence, expected)
        let table = [
            (0, 0, true),
            (0, 1, true), // a fresh stream: resume at 1 is the head
            (0, 2, false),
            (10, 11, true), // exactly the next one
            (10, 12, false),
            (10, 5, true), // well inside retention
            (u64::MAX, u64::MAX, true),
            (u64::MAX, 1, true), // saturates, never wraps to 0
            (u64::MAX - 1, u64::MAX, true),
            (u64::MAX - 2, u64::MAX, false),
        ];
        for (rev, first, want) in table {
            assert_eq!(
                resume_window_ok(rev, first),
                want,
                "resume_window_ok({rev}, {first})"
            );
        }
    }

    #[test]
    fn ack_parser_reads_legacy_and_modern_layouts_from_the_front() {
        let legacy = "$JS.ACK.KV_b.cons.1.42.7.1700000000000000000.3";
        assert_eq!(
            parse_ack_subject(legacy),
            Some(AckMeta {
                stream_sequence: 42,
                consumer_sequence: 7,
                pending: 3,
                timestamp_unix_ns: 1_700_000_000_000_000_000
            })
        );
        let modern11 = "$JS.ACK._.ACCT.KV_b.cons.1.43.8.1700000000000000000.0";
        assert_eq!(
            parse_ack_subject(modern11),
            Some(AckMeta {
                stream_sequence: 43,
                consumer_sequence: 8,
                pending: 0,
                timestamp_unix_ns: 1_700_000_000_000_000_000
            })
        );
        let modern12 = "$JS.ACK.hub.ACCT.KV_b.cons.2.44.9.1700000000000000000.5.rAnd0m";
        assert_eq!(
            parse_ack_subject(modern12),
            Some(AckMeta {
                stream_sequence: 44,
                consumer_sequence: 9,
                pending: 5,
                timestamp_unix_ns: 1_700_000_000_000_000_000
            })
        );
    }

    #[test]
    fn ack_parser_never_takes_the_last_token_as_the_sequence() {
        // The last token is num_pending (0 here); the sequence is 777.
        let s = "$JS.ACK.KV_b.c.1.777.1.1700000000000000000.0";
        assert_eq!(parse_ack_subject(s).map(|m| m.stream_sequence), Some(777));
    }

    #[test]
    fn ack_parser_accepts_u64_max_and_rejects_overflow_and_bad_shapes() {
        let max = format!("$JS.ACK.KV_b.c.1.{}.1.1.0", u64::MAX);
        assert_eq!(
            parse_ack_subject(&max).map(|m| m.stream_sequence),
            Some(u64::MAX)
        );
        let over = "$JS.ACK.KV_b.c.1.18446744073709551616.1.1.0";
        assert_eq!(parse_ack_subject(over), None);
        for bad in [
            "",
            "$JS.ACK",
            "$JS.ACK.KV_b.c.1.5.1.1",               // 8 tokens
            "$JS.ACK.a.b.KV_b.c.1.5.1.1",           // 10 tokens
            "$JS.ACK.a.b.KV_b.c.1.5.1.1.0.t.extra", // 13 tokens
            "$JS.NAK.KV_b.c.1.5.1.1.0",             // not an ACK subject
            "_INBOX.KV_b.c.1.5.1.1.0.0",            // wrong prefix
            "$JS.ACK.KV_b.c.1.-5.1.1.0",            // negative
            "$JS.ACK.KV_b.c.1.5.1.1.x",             // pending not a number
        ] {
            assert_eq!(parse_ack_subject(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn commit_cursor_covers_rejected_and_ignores_unknown_versions() {
        assert_eq!(commit_cursor(None, None), None);
        assert_eq!(commit_cursor(Some(5), None), Some(5)); // only unknown versions: no move
        assert_eq!(commit_cursor(None, Some(3)), Some(3));
        assert_eq!(commit_cursor(Some(9), Some(3)), Some(9)); // never backward
        assert_eq!(commit_cursor(Some(9), Some(12)), Some(12));
    }

    #[test]
    fn store_failure_streak_is_fatal_at_sixteen() {
        assert!(!store_failures_fatal(15));
        assert!(store_failures_fatal(16));
    }

    #[test]
    fn caught_up_needs_the_level_revision_applied() {
        assert!(caught_up(None, None));
        assert!(!caught_up(None, Some(1)));
        assert!(!caught_up(Some(4), Some(5)));
        assert!(caught_up(Some(5), Some(5)));
    }

    #[test]
    fn query_answers_go_only_to_inbox_subjects() {
        assert!(reply_subject_allowed("_INBOX.abc.1", "_INBOX."));
        assert!(!reply_subject_allowed("$KV.routes.route.a", "_INBOX."));
        assert!(!reply_subject_allowed(
            "$JS.API.STREAM.DELETE.KV_routes",
            "_INBOX."
        ));
        assert!(!reply_subject_allowed("_INBOX.", "_INBOX."));
        assert!(!reply_subject_allowed("_INBOX.>", "_INBOX."));
        assert!(!reply_subject_allowed("_INBOX.a", ""));
        assert!(reply_subject_allowed("svc.replies.7", "svc.replies."));
    }

    #[test]
    fn a_listener_beyond_loopback_answers_queries_only_with_a_token_or_by_the_operators_choice() {
        use QueryAccess::*;
        // (loopback, token given, --query-open) → access
        let table = [
            (true, false, false, Ok(Open)),
            (true, true, false, Ok(GivenToken)),
            (true, false, true, Ok(Open)),
            (false, false, false, Ok(GeneratedToken)),
            (false, true, false, Ok(GivenToken)),
            (false, false, true, Ok(OpenByChoice)),
        ];
        for (loopback, token, open, want) in table {
            assert_eq!(
                query_access(loopback, token, open),
                want,
                "loopback {loopback}, token {token}, open {open}"
            );
        }
        for loopback in [true, false] {
            assert!(query_access(loopback, true, true).is_err());
        }
    }

    #[test]
    fn host_values_split_into_a_host_and_a_port_or_are_refused() {
        type Split<'a> = Option<(&'a str, Option<u16>)>;
        let table: [(&str, Split); 14] = [
            ("node7.internal", Some(("node7.internal", None))),
            ("node7.internal:8080", Some(("node7.internal", Some(8080)))),
            ("10.0.0.5:80", Some(("10.0.0.5", Some(80)))),
            ("[::1]:8080", Some(("[::1]", Some(8080)))),
            ("[::1]", Some(("[::1]", None))),
            ("::1", None),
            ("", None),
            ("a:", None),
            (":80", None),
            ("a:99999", None),
            ("a:8x", None),
            ("a b:80", None),
            ("user@evil.example", None),
            ("[::1]x", None),
        ];
        for (value, want) in table {
            assert_eq!(split_host_port(value), want, "{value:?}");
        }
    }

    #[test]
    fn a_host_header_names_the_listener_only_by_a_configured_name_or_an_address_it_listens_on() {
        const LO: &str = "127.0.0.1:8080";
        const ANY: &str = "0.0.0.0:8080";
        const ANY6: &str = "[::]:8080";
        const LAN: &str = "10.0.0.5:8080";
        let sa = |s: &str| s.parse::<std::net::SocketAddr>().expect("addr");
        let names = [
            "node7.internal".to_string(),
            "proxy.example:443".to_string(),
        ];
        // (Host ("" for none), listen, arrived on, with the names, admitted)
        let table = [
            // Loopback: its own names, with its port.
            ("127.0.0.1:8080", LO, LO, false, true),
            ("LOCALHOST:8080", LO, LO, false, true),
            ("[::1]:8080", LO, LO, false, true),
            ("localhost", LO, LO, false, false),
            ("127.0.0.1:9090", LO, LO, false, false),
            ("evil.example:8080", LO, LO, false, false),
            ("", LO, LO, false, false),
            // Wildcard, no names: only the IP literal of the address the connection came in on.
            ("127.0.0.1:8080", ANY, LO, false, true),
            ("localhost:8080", ANY, LO, false, true),
            ("10.0.0.5:8080", ANY, LAN, false, true),
            ("localhost:8080", ANY, LAN, false, false),
            ("10.0.0.6:8080", ANY, LAN, false, false),
            ("10.0.0.5:8081", ANY, LAN, false, false),
            // The DNS-rebinding page: its own name, through 127.0.0.1.
            ("evil.example:8080", ANY, LO, false, false),
            ("node7.internal:8080", ANY, LAN, false, false),
            ("", ANY, LO, false, false),
            // The wildcard address itself, as a local client given `--listen 0.0.0.0:P` sends it.
            ("0.0.0.0:8080", ANY, LO, false, true),
            ("0.0.0.0:8080", ANY, LAN, false, false),
            // IPv6 wildcard; a v4 client on a dual-stack socket.
            ("10.0.0.5:8080", ANY6, "[::ffff:10.0.0.5]:8080", false, true),
            ("[fd00::5]:8080", ANY6, "[fd00::5]:8080", false, true),
            ("[FD00:0::5]:8080", ANY6, "[fd00::5]:8080", false, true),
            // Names: with the listener's port or none; a name given with a port: that port only.
            ("node7.internal:8080", ANY, LAN, true, true),
            ("NODE7.internal", ANY, LAN, true, true),
            ("node7.internal:9", ANY, LAN, true, false),
            ("proxy.example:443", ANY, LAN, true, true),
            ("proxy.example", ANY, LAN, true, false),
            ("evil.example:8080", ANY, LO, true, false),
            ("10.0.0.5:8080", ANY, LAN, true, true),
            // A specific address beyond loopback: that address (and the names).
            ("10.0.0.5:8080", LAN, LAN, false, true),
            ("127.0.0.1:8080", LAN, LAN, false, false),
            ("evil.example:8080", LAN, LAN, false, false),
            ("node7.internal", LAN, LAN, true, true),
        ];
        for (host, listen, on, with_names, want) in table {
            let names: &[String] = if with_names { &names } else { &[] };
            let host = (!host.is_empty()).then_some(host);
            assert_eq!(
                host_names_listener(host, sa(listen), sa(on), names),
                want,
                "Host {host:?} on {listen} (arrived on {on}), names {names:?}"
            );
        }
    }

    #[test]
    fn bucket_keys_in_the_hosts_reserved_space_are_not_admitted() {
        assert!(bucket_key_admitted("route.a"));
        assert!(bucket_key_admitted(""));
        assert!(bucket_key_admitted("a\u{1}b"));
        assert!(!bucket_key_admitted(
            "\u{1}retained/00000000000000000001/k1"
        ));
        assert!(!bucket_key_admitted("\u{1}"));
    }

    #[test]
    fn delete_markers_and_kv_operations_are_removals_and_nothing_else_is() {
        let cases = [
            (None, None, KvOp::Put),
            (Some("PUT"), None, KvOp::Put),
            (Some("DEL"), None, KvOp::Delete),
            (Some("PURGE"), None, KvOp::Purge),
            (None, Some("MaxAge"), KvOp::Purge),
            (None, Some("Purge"), KvOp::Purge),
            (None, Some("Remove"), KvOp::Delete),
            (None, Some("SomethingNew"), KvOp::Delete),
            (Some("DEL"), Some("MaxAge"), KvOp::Delete),
        ];
        for (op, reason, want) in cases {
            assert_eq!(kv_op(op, reason), want, "{op:?} {reason:?}");
        }
    }

    #[test]
    fn every_stored_header_block_is_a_put_a_delete_a_purge_or_undecodable() {
        use Undecodable::*;
        let put = Ok(KvOp::Put);
        let del = Ok(KvOp::Delete);
        let cases: [(&[u8], Result<KvOp, Undecodable>); 24] = [
            (b"NATS/1.0\r\n\r\n", put),
            (b"NATS/1.0\r\nKV-Operation: DEL\r\n\r\n", del),
            (b"NATS/1.0\r\nKV-Operation: PURGE\r\n\r\n", Ok(KvOp::Purge)),
            (
                b"NATS/1.0\r\nNats-Marker-Reason: MaxAge\r\n\r\n",
                Ok(KvOp::Purge),
            ),
            // A bare LF ends a line; whitespace continues one; the first value of a name counts.
            (b"NATS/1.0\nKV-Operation: DEL\nX: y\r\n\r\n", del),
            (b"NATS/1.0\r\nKV-Operation: DE\r\n L\r\n\r\n", put),
            // A continuation keeps its own leading whitespace: " DEL" is no operation.
            (b"NATS/1.0\r\nKV-Operation:\r\n DEL\r\n\r\n", put),
            (
                b"NATS/1.0\r\nKV-Operation: DEL\r\nKV-Operation: PURGE\r\n\r\n",
                del,
            ),
            (b"NATS/1.0   \r\nKV-Operation:DEL  \r\n\r\n", del),
            // Names are compared as written: another case is another header.
            (b"NATS/1.0\r\nkv-operation: DEL\r\n\r\n", put),
            (b"NATS/1.0\r\nnats-marker-reason: Remove\r\n\r\n", put),
            // A CR at a value's end is trimmed, inside it is the library's panic.
            (b"NATS/1.0\r\nX: a\r\r\n\r\n", put),
            // The six blocks a raw publish stored that stalled the fold.
            (b"NATS/1.0\r\nbad line\r\n\r\n", Err(LineWithoutColon)),
            (
                b"NATS/1.0\r\nNats-Marker-Reason: a\rb\r\n\r\n",
                Err(CrInValue),
            ),
            (b"NATS/1.0\r\nKV-Operation: DE\rL\r\n\r\n", Err(CrInValue)),
            (b"NATS/1.0\r\nX: \xff\r\n\r\n", Err(NotUtf8)),
            (b"NATS/1.0\r\nKV-Operation : DEL\r\n\r\n", Err(BadName)),
            (b"NATS/1.0 0100\r\n\r\n", Err(StatusLine)),
            (b"NATS/1.0 100 Idle Heartbeat\r\n\r\n", Err(StatusLine)),
            (b"NATS/1.0x\r\n\r\n", Err(StatusLine)),
            (b"HTTP/1.1\r\n\r\n", Err(NoVersionLine)),
            (b"", Err(Empty)),
            (b"NATS/1.0\r\nN\x01: v\r\n\r\n", Err(BadName)),
            (b"NATS/1.0\r\n: v\r\n\r\n", put),
        ];
        for (block, want) in cases {
            assert_eq!(
                decode_stored(Some(block)),
                want,
                "{:?}",
                String::from_utf8_lossy(block)
            );
        }
        assert_eq!(decode_stored(None), put);
    }

    #[test]
    fn an_undecodable_key_names_its_subject_and_reason_and_no_delivered_key_looks_like_one() {
        let k = undecodable_key("$KV.b.a.b", Undecodable::BadName);
        assert!(!bucket_key_admitted(&k));
        assert_eq!(
            parse_undecodable_key(&k),
            Some(("$KV.b.a.b", Undecodable::BadName))
        );
        assert_eq!(parse_undecodable_key("\u{1}retained/1/k"), None);
        assert_eq!(parse_undecodable_key("\u{1}undecodable x y"), None);
        assert_eq!(parse_undecodable_key("a b"), None);
    }

    #[test]
    fn a_fold_resumes_only_on_the_stream_it_recorded_and_never_past_its_end() {
        use IdentityVerdict::*;
        // (recorded is the found stream?, cursor, last sequence, verdict)
        let table = [
            (None, None, 0, Record),
            (None, Some(3000), 3000, Record),
            // A store from before identities: its cursor above the stream's end is the only tell.
            (None, Some(3000), 500, CursorAhead),
            (Some(true), Some(3000), 3000, Same),
            (Some(true), None, 0, Same),
            // Recreated (a new creation time, or another bucket's stream), whatever the
            // sequences say.
            (Some(false), Some(3000), 500, Recreated),
            (Some(false), Some(400), 500, Recreated),
            (Some(false), None, 5, Recreated),
            // The same stream, but behind the fold: it lost its tail.
            (Some(true), Some(3000), 2999, CursorAhead),
        ];
        for (same, cursor, last, want) in table {
            assert_eq!(
                stream_identity_check(same, cursor, last),
                want,
                "{same:?} {cursor:?} {last}"
            );
        }
    }

    #[test]
    fn a_broken_watch_is_resumed_after_a_bounded_growing_backoff() {
        use std::time::Duration as D;
        assert_eq!(watch_resume_backoff(0), D::from_millis(100));
        assert_eq!(watch_resume_backoff(1), D::from_millis(200));
        assert_eq!(watch_resume_backoff(5), D::from_millis(3_200));
        for streak in [6, 10, 31, u32::MAX] {
            assert_eq!(watch_resume_backoff(streak), D::from_secs(5), "{streak}");
        }
    }

    #[test]
    fn a_pointer_never_moves_backward_and_a_corrupt_one_is_replaceable() {
        use PointerState::*;
        let table = [
            (Absent, 1, true),
            (Corrupt, 1, true),
            (At(10), 11, true),
            (At(10), 10, false),
            (At(10), 9, false),
            (At(u64::MAX), u64::MAX, false),
        ];
        for (current, cursor, want) in table {
            assert_eq!(
                pointer_publish_allowed(current, cursor),
                want,
                "{current:?} {cursor}"
            );
        }
    }

    #[test]
    fn a_payload_is_pruned_only_past_the_grace_since_it_was_replaced_and_never_the_pointers_target()
    {
        use std::time::Duration as D;
        let (below, at) = (Some(4), Some(5));
        let (g, long) = (D::from_secs(60), D::from_secs(1_000_000));
        // (target?, payload cursor, pointer cursor, age, since superseded, grace, prunable)
        let table = [
            // The target: never, whatever the ages, even at zero grace.
            (true, at, at, long, Some(long), D::ZERO, false),
            (true, at, at, D::ZERO, None, D::ZERO, false),
            // Below the pointer: past the grace since upload and since replaced.
            (
                false,
                below,
                at,
                D::from_secs(61),
                Some(D::from_secs(61)),
                g,
                true,
            ),
            (
                false,
                below,
                at,
                D::from_secs(60),
                Some(D::from_secs(61)),
                g,
                false,
            ),
            (
                false,
                below,
                at,
                D::from_millis(1),
                Some(D::from_millis(1)),
                D::ZERO,
                true,
            ),
            // Uploaded long ago, replaced a moment ago: a bootstrap that read the pointer before
            // it moved is still downloading it.
            (false, below, at, long, Some(D::from_secs(1)), g, false),
            (false, below, at, long, Some(g), g, false),
            // Not known to be replaced: kept.
            (false, below, at, long, None, g, false),
            (false, below, at, long, None, D::ZERO, false),
            // At or above the pointer, or with no pointer: an exporter may be about to name it.
            (false, at, at, long, Some(long), D::ZERO, false),
            (false, Some(9), at, long, Some(long), D::ZERO, false),
            (false, below, None, long, Some(long), D::ZERO, false),
            // A name without a cursor (the earlier form): judged as below the pointer.
            (
                false,
                None,
                at,
                D::from_secs(61),
                Some(D::from_secs(61)),
                g,
                true,
            ),
            (false, None, at, long, Some(D::from_secs(1)), g, false),
        ];
        for (target, cursor, pointer, age, since, grace, want) in table {
            assert_eq!(
                payload_prunable(target, cursor, pointer, age, since, grace),
                want,
                "{target} {cursor:?} {pointer:?} {age:?} {since:?} {grace:?}"
            );
        }
    }

    #[test]
    fn a_payload_was_replaced_when_the_first_target_above_it_was_published() {
        // (cursor, published) of the current target (90 at t=900) and previous targets.
        let targets = [(90, 900), (70, 700), (50, 500)];
        // (payload cursor, replaced at)
        let table = [
            (Some(90), None),
            (Some(95), None),
            (Some(70), Some(900)),
            (Some(80), Some(900)),
            (Some(50), Some(700)),
            (Some(60), Some(700)),
            // Below every known target: no later than the oldest known publish.
            (Some(10), Some(500)),
            (None, Some(500)),
        ];
        for (cursor, want) in table {
            assert_eq!(payload_superseded_at(cursor, &targets), want, "{cursor:?}");
        }
        assert_eq!(payload_superseded_at(Some(1), &[]), None);
        // Publish times out of cursor order (a clock step): the earliest above counts.
        assert_eq!(
            payload_superseded_at(Some(1), &[(5, 900), (3, 950)]),
            Some(900)
        );
    }

    #[test]
    fn a_later_incarnation_replaces_the_pointer_whatever_its_cursor_and_nothing_else_crosses() {
        use PointerState::*;
        use StreamRelation::*;
        let (a1, a2, b) = (Some(("KV_a", 1)), Some(("KV_a", 2)), Some(("KV_b", 3)));
        assert_eq!(stream_relation(a1, a1), Same);
        assert_eq!(stream_relation(a2, a1), Later);
        assert_eq!(stream_relation(a1, a2), Other);
        assert_eq!(stream_relation(b, a1), Other);
        assert_eq!(stream_relation(None, a1), Unknown);
        assert_eq!(stream_relation(a1, None), Unknown);
        let table = [
            (Absent, 1, Other, true),
            (Corrupt, 1, Other, true),
            (At(1000), 5, Later, true),
            (At(1000), 1000, Later, true),
            (At(10), 5000, Other, false),
            (At(10), 11, Same, true),
            (At(10), 10, Same, false),
            (At(10), 9, Same, false),
            (At(10), 11, Unknown, true),
            (At(10), 9, Unknown, false),
        ];
        for (current, cursor, relation, want) in table {
            assert_eq!(
                pointer_replace_allowed(current, cursor, relation),
                want,
                "{current:?} {cursor} {relation:?}"
            );
        }
        for (relation, want) in [
            (Same, true),
            (Unknown, true),
            (Later, false),
            (Other, false),
        ] {
            assert_eq!(bootstrap_stream_allowed(relation), want, "{relation:?}");
        }
    }

    #[test]
    fn a_lease_is_taken_only_when_free_corrupt_or_expired() {
        use LeaseState::*;
        let table = [
            (Absent, 0, true),
            (Free, 0, true),
            (Corrupt, 0, true),
            (
                Held {
                    expires_unix_ms: 1_000,
                },
                999,
                false,
            ),
            (
                Held {
                    expires_unix_ms: 1_000,
                },
                1_000,
                true,
            ),
            (
                Held {
                    expires_unix_ms: 1_000,
                },
                5_000,
                true,
            ),
            (
                Held {
                    expires_unix_ms: u64::MAX,
                },
                u64::MAX - 1,
                false,
            ),
        ];
        for (state, now, want) in table {
            assert_eq!(
                lease_takeover_allowed(state, now),
                want,
                "{state:?} at {now}"
            );
        }
    }

    #[test]
    fn server_features_follow_the_version_and_an_unreadable_one_offers_none() {
        assert_eq!(server_features("2.15.1"), (true, true, true));
        assert_eq!(server_features("v2.11.0"), (true, true, true));
        assert_eq!(server_features("2.10.22"), (false, true, true));
        assert_eq!(server_features("2.9.0-beta.1"), (false, true, true));
        assert_eq!(server_features("2.6.0"), (false, true, false));
        assert_eq!(server_features("3.0.0"), (true, true, true));
        assert_eq!(server_features("nonsense"), (false, false, false));
        assert_eq!(server_features(""), (false, false, false));
    }

    #[test]
    fn a_stream_create_reply_is_fatal_only_when_it_is_neither_exists_nor_at_limit() {
        use StreamCreateVerdict::*;
        assert_eq!(stream_create_verdict(None), Created);
        // nats-server's shape: the JetStream code in err_code.
        let in_use = "stream name already in use with a different configuration";
        assert_eq!(
            stream_create_verdict(Some((Some(400), Some(10058), in_use))),
            AlreadyExists
        );
        // A provider that puts it in code.
        assert_eq!(
            stream_create_verdict(Some((Some(10058), None, ""))),
            AlreadyExists
        );
        assert_eq!(
            stream_create_verdict(Some((
                Some(400),
                Some(10027),
                "Maximum number of streams reached"
            ))),
            AtStreamLimit
        );
        // The limit wording without the 400 is not the provider's at-limit answer.
        assert_eq!(
            stream_create_verdict(Some((Some(500), None, "maximum number of streams reached"))),
            Refused
        );
        assert_eq!(
            stream_create_verdict(Some((Some(400), Some(10052), "replicas > 1 not supported"))),
            Refused
        );
        assert_eq!(stream_create_verdict(Some((None, None, ""))), Refused);
    }

    #[test]
    fn a_swap_runs_catch_up_rounds_while_many_keys_changed_and_at_most_the_cap() {
        assert!(swap_needs_another_round(0, SWAP_CUT_OVER_KEYS + 1));
        assert!(!swap_needs_another_round(0, SWAP_CUT_OVER_KEYS));
        assert!(!swap_needs_another_round(0, 0));
        assert!(swap_needs_another_round(
            MAX_SWAP_CATCH_UP_ROUNDS - 1,
            usize::MAX
        ));
        assert!(!swap_needs_another_round(
            MAX_SWAP_CATCH_UP_ROUNDS,
            usize::MAX
        ));
    }

    fn filters_of(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| (*s).to_string()).collect()
    }

    #[test]
    fn a_watch_of_a_whole_plain_stream_sends_no_filter() {
        let all = filters_of(&["$KV.b.>"]);
        assert!(server_filters(&all, &all, false, false).is_empty());
    }

    #[test]
    fn a_watch_keeps_its_filter_unless_the_filter_is_exactly_the_streams_only_input() {
        let all = filters_of(&["$KV.b.>"]);
        // LastPerSubject: the server refuses it unfiltered.
        assert_eq!(server_filters(&all, &all, false, true), all);
        // A mirror, a source or a subject transform can store subjects the filter would not pass.
        assert_eq!(server_filters(&all, &all, true, false), all);
        // A narrower scope.
        let narrow = filters_of(&["$KV.b.a.>"]);
        assert_eq!(server_filters(&narrow, &all, false, false), narrow);
        let two = filters_of(&["$KV.b.a.>", "$KV.b.c.>"]);
        assert_eq!(server_filters(&two, &all, false, false), two);
        // A stream that takes more subjects than the bucket's.
        let wider = filters_of(&["$KV.b.>", "other.>"]);
        assert_eq!(server_filters(&all, &wider, false, false), all);
        // A stream whose subjects differ (a mirror's are empty).
        assert_eq!(server_filters(&all, &[], false, false), all);
    }

    #[test]
    fn direct_reads_are_for_single_replica_streams_that_allow_them() {
        assert!(direct_reads_allowed(true, 1));
        assert!(direct_reads_allowed(true, 0));
        assert!(!direct_reads_allowed(true, 3));
        assert!(!direct_reads_allowed(false, 1));
    }

    #[test]
    fn a_plain_stream_is_the_buckets_subjects_and_nothing_else() {
        let all = filters_of(&["$KV.b.>"]);
        assert!(plain_stream(&all, false, "$KV.b.>"));
        assert!(!plain_stream(&all, true, "$KV.b.>"));
        assert!(!plain_stream(
            &filters_of(&["$KV.b.>", "x.>"]),
            false,
            "$KV.b.>"
        ));
        assert!(!plain_stream(&[], false, "$KV.b.>"));
        assert!(!plain_stream(&filters_of(&["$KV.c.>"]), false, "$KV.b.>"));
    }

    /// The split-based parser `parse_ack_subject` replaced: the reference it must agree with.
    fn parse_ack_subject_reference(subject: &str) -> Option<AckMeta> {
        let tokens: Vec<&str> = subject.split('.').collect();
        if tokens.len() > 12 || tokens[0] != "$JS" || tokens.get(1) != Some(&"ACK") {
            return None;
        }
        let (seq_idx, ts_idx, pending_idx) = match tokens.len() {
            9 => (5, 7, 8),
            11 | 12 => (7, 9, 10),
            _ => return None,
        };
        Some(AckMeta {
            stream_sequence: tokens[seq_idx].parse().ok()?,
            consumer_sequence: tokens[seq_idx + 1].parse().unwrap_or(0),
            pending: tokens[pending_idx].parse().ok()?,
            timestamp_unix_ns: tokens[ts_idx].parse().unwrap_or(0),
        })
    }

    #[test]
    fn the_ack_subject_parser_agrees_with_the_split_based_reference_on_every_shape() {
        let pieces = [
            "$JS",
            "ACK",
            "KV_b",
            "c1",
            "1",
            "0",
            "+7",
            "+",
            "",
            "18446744073709551615",
            "18446744073709551616",
            "007",
            "12a",
            "-3",
            "dom",
            "acc",
            "tok",
            "1764000000000000000",
        ];
        // A deterministic walk over subjects of 1..14 tokens drawn from `pieces`, with the two
        // real layouts' prefixes favoured so the numeric branches are reached.
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        for _ in 0..200_000 {
            let len = 1 + next(14);
            let mut tokens: Vec<&str> = (0..len).map(|_| pieces[next(pieces.len())]).collect();
            if next(4) != 0 {
                tokens[0] = "$JS";
                if len > 1 {
                    tokens[1] = "ACK";
                }
            }
            let subject = tokens.join(".");
            assert_eq!(
                parse_ack_subject(&subject),
                parse_ack_subject_reference(&subject),
                "{subject}"
            );
        }
        for s in [
            "",
            ".",
            "$JS",
            "$JS.ACK",
            "$JS.ACK.........",
            "$JS.ACK.s.c.1.2.3.4.5",
        ] {
            assert_eq!(parse_ack_subject(s), parse_ack_subject_reference(s), "{s}");
        }
    }

    #[test]
    fn a_direct_answer_is_paired_with_its_question_only_by_its_exact_reply_subject() {
        let inbox = "_INBOX.abc";
        assert_eq!(direct_reply_sequence(inbox, "_INBOX.abc.17"), Some(17));
        assert_eq!(direct_reply_sequence(inbox, "_INBOX.abc.0"), Some(0));
        assert_eq!(
            direct_reply_sequence(inbox, "_INBOX.abc.18446744073709551615"),
            Some(u64::MAX)
        );
        for other in [
            "_INBOX.abc",
            "_INBOX.abc.",
            "_INBOX.abcd.17",
            "_INBOX.ab.17",
            "_INBOX.abc.017",
            "_INBOX.abc.+17",
            "_INBOX.abc.-1",
            "_INBOX.abc.17.1",
            "_INBOX.abc.1 7",
            "_INBOX.abc.18446744073709551616",
            "_INBOX.abc.184467440737095516150",
            "_INBOX.other.17",
        ] {
            assert_eq!(direct_reply_sequence(inbox, other), None, "{other}");
        }
    }

    #[test]
    fn a_short_gap_of_a_plain_direct_stream_is_read_directly_and_nothing_else_is() {
        assert_eq!(direct_catch_up_range(11, 20, true, true), Some(11..=20));
        assert_eq!(direct_catch_up_range(20, 20, true, true), Some(20..=20));
        let longest = DIRECT_CATCH_UP_MAX;
        assert_eq!(
            direct_catch_up_range(1, longest, true, true),
            Some(1..=longest)
        );
        // One more than the limit: a consumer's job.
        assert_eq!(direct_catch_up_range(1, longest + 1, true, true), None);
        // Nothing to read: the consumer starts where it would.
        assert_eq!(direct_catch_up_range(21, 20, true, true), None);
        // A stream with other inputs, a stream without direct gets, a start of 0.
        assert_eq!(direct_catch_up_range(11, 20, false, true), None);
        assert_eq!(direct_catch_up_range(11, 20, true, false), None);
        assert_eq!(direct_catch_up_range(0, 20, true, true), None);
        // Never wraps.
        assert_eq!(
            direct_catch_up_range(u64::MAX, u64::MAX, true, true),
            Some(u64::MAX..=u64::MAX)
        );
        assert_eq!(direct_catch_up_range(1, u64::MAX, true, true), None);
    }

    #[test]
    fn a_readable_key_has_no_wildcard_space_or_empty_edge_token() {
        for ok in ["a", "a.b", "route/x=1", "A-b_c"] {
            assert!(kv_key_valid(ok), "{ok}");
        }
        for bad in ["", ".a", "a.", "a.*", "a.>", "a b", "a\r", "é"] {
            assert!(!kv_key_valid(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_watch_recovering_from_a_dropped_connection_reads_the_first_sequences_of_any_gap() {
        let longest = DIRECT_CATCH_UP_MAX;
        // Not recovering: the short-gap rule, unchanged.
        assert_eq!(catch_up_range(11, 20, true, true, false), Some(11..=20));
        assert_eq!(catch_up_range(1, longest + 1, true, true, false), None);
        assert_eq!(catch_up_range(11, 20, true, false, false), None);
        // Recovering: a prefix of any gap, direct gets allowed or not.
        assert_eq!(catch_up_range(11, 20, true, false, true), Some(11..=20));
        assert_eq!(
            catch_up_range(1, longest * 10, true, true, true),
            Some(1..=longest)
        );
        assert_eq!(
            catch_up_range(u64::MAX - 1, u64::MAX, true, true, true),
            Some(u64::MAX - 1..=u64::MAX)
        );
        // On a stream that is not plain too; never from 0 or past the stream's end.
        assert_eq!(catch_up_range(11, 20, false, false, true), Some(11..=20));
        assert_eq!(catch_up_range(0, 20, true, true, true), None);
        assert_eq!(catch_up_range(21, 20, true, true, true), None);
    }

    #[test]
    fn scope_filters_never_overlap_so_the_server_accepts_every_scope() {
        let f = |ps: &[&str]| scope_filters("$KV.b.", ps.iter().copied()).unwrap();
        assert_eq!(f(&["a.", "a.b."]), ["$KV.b.a.>"]);
        assert_eq!(f(&["a.b.c", "a.x"]), ["$KV.b.a.>"]);
        assert_eq!(f(&["a.b.c", "a.bc.d", "x"]), ["$KV.b.>"]);
        assert_eq!(f(&["r.", "s.t", "r."]), ["$KV.b.r.>", "$KV.b.s.>"]);
        assert_eq!(f(&["ab.c", "a.c"]), ["$KV.b.a.>", "$KV.b.ab.>"]);
        assert!(scope_filters("$KV.b.", ["a.*"]).is_err());
    }
}
