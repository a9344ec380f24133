//! Rule (e): a read answered from a fold sees neither an older state than it must (its minimum
//! revision, its `applied_through`, the same fold's earlier `applied` writes to the key) nor a
//! newer one than the log could have held when it was answered, and what it sees a record holds.

use std::collections::HashMap;

use super::{Answer, Evidence, Findings, Incarnation, Kind, Op, Record, Request};

/// The revision a read must see at least, and what set it (for the anomaly's line).
type Bound = (u64, String);

/// (e) Reads never see an older state than they must — nor a newer one than the log could have
/// held when they were answered: a record whose op was first sent after the read completed, and
/// every record after it, came later.
pub(super) fn reads_see_no_older_state(ev: &Evidence, out: &mut Findings) {
    let first_sent: HashMap<(usize, &str), u64> = ev
        .writes
        .iter()
        .map(|(k, attempts)| (*k, attempts.iter().map(|o| o.invoked).min().unwrap_or(0)))
        .collect();
    for read in ev.history.iter().filter(|o| !o.request.is_write()) {
        let Request::Read { key, min_revision } = &read.request else {
            continue;
        };
        let through = match &read.answer {
            Answer::Found {
                applied_through, ..
            }
            | Answer::NotFound { applied_through } => *applied_through,
            _ => continue,
        };
        let inc = ev.inc_of(read.incarnation);
        let bound = must_see(ev, read, key, *min_revision, through, out);
        let on_key: Vec<&Record> = inc.records.values().filter(|r| r.key == *key).collect();
        let seen = Seen {
            who: format!(
                "a read of {key} by client {} on fold {} (incarnation {})",
                read.client, read.node, read.incarnation
            ),
            inc,
            on_key,
            bound,
            later: sent_after(read, inc, &first_sent),
        };
        match &read.answer {
            Answer::Found {
                value, revision, ..
            } => seen.found(key, value, *revision, out),
            Answer::NotFound { .. } => seen.not_found(out),
            _ => {}
        }
    }
}

/// (e) The newest state `read` must see: its `applied_through`, its minimum revision (which the
/// answer's `applied_through` must reach), and every write to `key` the same fold answered
/// `applied` before the read was sent.
fn must_see(
    ev: &Evidence,
    read: &Op,
    key: &str,
    min_revision: Option<u64>,
    through: u64,
    out: &mut Findings,
) -> Bound {
    let mut bound = (
        through,
        format!("the applied_through {through} it reported"),
    );
    if let Some(min) = min_revision {
        if through < min {
            out.flag(
                'e',
                format!(
                    "a read of {key} by client {} on fold {} with min revision {min} was \
                     answered at applied_through {through}",
                    read.client, read.node
                ),
            );
        }
        if min > bound.0 {
            bound = (min, format!("its min revision {min}"));
        }
    }
    for w in ev.history.iter().filter(|w| {
        w.request.is_write()
            && w.node == read.node
            && w.incarnation == read.incarnation
            && w.request.key() == key
            && w.completed < read.invoked
    }) {
        if let Answer::Applied { revision } = w.answer
            && revision > bound.0
        {
            bound = (
                revision,
                format!(
                    "op {} applied at {revision} by the same fold before it",
                    w.op_id.as_deref().unwrap_or("?")
                ),
            );
        }
    }
    bound
}

/// The first sequence of `inc` whose record's op was first sent after `read` completed: the
/// log's position when the read was answered is below it (`u64::MAX`: no such record).
fn sent_after(read: &Op, inc: &Incarnation, first_sent: &HashMap<(usize, &str), u64>) -> u64 {
    inc.records
        .values()
        .find(|r| {
            r.op_id
                .as_deref()
                .and_then(|id| first_sent.get(&(read.incarnation, id)))
                .is_some_and(|sent| *sent > read.completed)
        })
        .map_or(u64::MAX, |r| r.seq)
}

/// What one read may see: the log of its incarnation, the key's records on it, the revision it
/// must see at least and the sequence from which on it cannot have seen anything.
struct Seen<'a> {
    /// The read, named for an anomaly's line.
    who: String,
    inc: &'a Incarnation,
    on_key: Vec<&'a Record>,
    bound: Bound,
    later: u64,
}

impl Seen<'_> {
    /// (e) A read that found `value` at `revision`: a record there holds it, it was not sent
    /// after the read was answered, and no newer record of the key is within the bound.
    fn found(&self, key: &str, value: &[u8], revision: u64, out: &mut Findings) {
        let who = &self.who;
        match self.inc.records.get(&revision) {
            Some(r) if r.key == *key && r.kind == Kind::Put && r.value == *value => {}
            other => out.flag(
                'e',
                format!(
                    "{who} saw {:?} at {revision}, which no record holds (the log there: \
                     {other:?})",
                    String::from_utf8_lossy(value)
                ),
            ),
        }
        if revision >= self.later {
            out.flag(
                'e',
                format!("{who} saw revision {revision}, a record sent after the read was answered"),
            );
        }
        if let Some(next) = self.on_key.iter().find(|r| r.seq > revision)
            && next.seq <= self.bound.0
        {
            out.flag(
                'e',
                format!(
                    "{who} saw revision {revision}, older than {} which it must see ({})",
                    next.seq, self.bound.1
                ),
            );
        }
    }

    /// (e) A read that found nothing: the key held no value at the bound, or a delete of it came
    /// between the bound and the first record sent after the read was answered.
    fn not_found(&self, out: &mut Findings) {
        let bound = self.bound.0;
        let newest_at_bound = self.on_key.iter().rev().find(|r| r.seq <= bound);
        let absent_at_bound = newest_at_bound.is_none_or(|r| r.kind != Kind::Put);
        let absent_later = self
            .on_key
            .iter()
            .any(|r| r.seq > bound && r.seq < self.later && r.kind != Kind::Put);
        if !absent_at_bound && !absent_later {
            out.flag(
                'e',
                format!(
                    "{} found nothing, but the key holds a value from {} on, which it must see \
                     ({})",
                    self.who,
                    newest_at_bound.map_or(0, |r| r.seq),
                    self.bound.1
                ),
            );
        }
    }
}
