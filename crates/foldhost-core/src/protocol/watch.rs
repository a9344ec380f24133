//! A watch's scope and start: server-side filters, plain streams, direct reads, the catch-up range.

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
