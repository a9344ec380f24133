//! The checker: [`check`] proves from a history, the log and the final folds what
//! docs/writes.md promises, one function per promise, each run in the order the rules are listed
//! (so the anomalies come out in that order: (L), the writes' op ids, (a), (b)/(d), (c), (e),
//! (f), (g)). Every rule reads one [`Evidence`] and adds to one [`Findings`]; none changes what
//! another sees.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::{Anomaly, Answer, FinalFold, Incarnation, Kind, Log, Op, Record, Request};

mod order;
mod reads;

/// The refusals that promise nothing was published (docs/writes.md, "A write has three outcomes").
const NOTHING_PUBLISHED: &[&str] = &[
    "conflict",
    "invalid",
    "too_large",
    "not_folded",
    "permission",
    "bucket_full",
];

/// An incarnation the log does not have: no record, nothing read.
static NO_INCARNATION: Incarnation = Incarnation {
    records: BTreeMap::new(),
    last_sequence: 0,
};

/// The anomalies found so far, in the order they were found.
#[derive(Default)]
struct Findings(Vec<Anomaly>);

impl Findings {
    /// Records that `line` breaks `rule`.
    fn flag(&mut self, rule: char, line: String) {
        self.0.push(Anomaly { rule, line });
    }
}

/// What every rule reads: the history and the log, with the log's records by op id and the
/// history's writes by operation.
struct Evidence<'a> {
    history: &'a [Op],
    log: &'a Log,
    /// Per incarnation: the records carrying each op id, by sequence.
    by_op: Vec<HashMap<&'a str, Vec<&'a Record>>>,
    /// The writes, grouped by (incarnation, op id): every attempt of one operation.
    writes: BTreeMap<(usize, &'a str), Vec<&'a Op>>,
}

impl<'a> Evidence<'a> {
    /// Incarnation `i`, or an empty one when the log has no such incarnation.
    fn inc_of(&self, i: usize) -> &'a Incarnation {
        self.log.incarnations.get(i).unwrap_or(&NO_INCARNATION)
    }

    /// The records of op `id` on incarnation `inc`'s log, by sequence.
    fn records_of(&self, inc: usize, id: &str) -> Vec<&'a Record> {
        self.by_op
            .get(inc)
            .and_then(|m| m.get(id))
            .cloned()
            .unwrap_or_default()
    }
}

/// Checks `history` against `log` and the folds' final contents, returning every anomaly:
///
/// - (a) every `applied`/`pending` answer names a record on the log, at that revision, carrying
///   the op id, on the key and with the value (or delete marker) the request asked for;
/// - (b) no op id has two records on one incarnation's log, and every record carries an op id the
///   history sent in that incarnation;
/// - (c) an op refused with a reason that publishes nothing has no record; one refused
///   `op_reused` has none on its own key, and the answer names where the id did land;
/// - (d) an op whose every answer was indeterminate (`unknown`, transport error) has at most one
///   record;
/// - (e) a read answered from a fold never sees an older state than the newest of: its
///   `Foldhost-Min-Revision`, the `applied_through` the answer reports, and every write to the
///   key answered `applied` by the same fold before the read was sent — and what it sees is a
///   value a record holds;
/// - (f) each key's writes (puts, deletes, compare-and-sets; per incarnation) are linearizable
///   against a register (stateright's [`LinearizabilityTester`]): an op with a known outcome
///   enters with its window from its first send to its first determinate answer; an
///   indeterminate op enters only if the log holds its record, as landed there at some instant
///   after it was sent; one the log does not hold did not happen. Reads do not enter: a fold
///   lags the log (docs/writes.md, "Three numbers that are not the same number"), so reads from
///   several folds are not linearizable by design; rule (e) states what they promise;
/// - (g) every final fold holds exactly the last incarnation's newest record of every key (a
///   delete: no entry), at its revision;
/// - (L) the log was read whole: no sequence of an incarnation went unseen.
///
/// [`LinearizabilityTester`]: stateright::semantics::LinearizabilityTester
pub fn check(history: &[Op], log: &Log, finals: &[FinalFold]) -> Vec<Anomaly> {
    let mut out = Findings::default();
    log_read_whole(history, log, &mut out);
    let ev = Evidence {
        history,
        log,
        by_op: records_by_op(log),
        writes: writes_by_op(history, &mut out),
    };
    answers_name_their_records(&ev, &mut out);
    one_record_per_op(&ev, &mut out);
    refusals_publish_nothing(&ev, &mut out);
    reads::reads_see_no_older_state(&ev, &mut out);
    order::writes_are_linearizable(&ev, &mut out);
    final_folds_equal_the_bucket(log, finals, &mut out);
    out.0
}

/// (L) The log was read whole: no sequence of an incarnation went unseen, and every op was made
/// in an incarnation the log has.
fn log_read_whole(history: &[Op], log: &Log, out: &mut Findings) {
    for (i, inc) in log.incarnations.iter().enumerate() {
        let unseen = inc.unseen();
        if let (Some(first), Some(last)) = (unseen.first(), unseen.last()) {
            out.flag(
                'L',
                format!(
                    "incarnation {i}: {} sequences between {first} and {last} were gone before \
                     the log was read; the checker is blind there",
                    unseen.len()
                ),
            );
        }
    }
    if let Some(op) = history
        .iter()
        .find(|o| o.incarnation >= log.incarnations.len())
    {
        out.flag(
            'L',
            format!(
                "op {:?} was made in incarnation {} but the log has {}",
                op.op_id,
                op.incarnation,
                log.incarnations.len()
            ),
        );
    }
}

/// Each incarnation's records by the op id they carry.
fn records_by_op(log: &Log) -> Vec<HashMap<&str, Vec<&Record>>> {
    log.incarnations
        .iter()
        .map(|inc| {
            let mut m: HashMap<&str, Vec<&Record>> = HashMap::new();
            for r in inc.records.values() {
                if let Some(id) = &r.op_id {
                    m.entry(id.as_str()).or_default().push(r);
                }
            }
            m
        })
        .collect()
}

/// The history's writes grouped by (incarnation, op id); (a) every write carries an op id.
fn writes_by_op<'a>(
    history: &'a [Op],
    out: &mut Findings,
) -> BTreeMap<(usize, &'a str), Vec<&'a Op>> {
    let mut writes: BTreeMap<(usize, &str), Vec<&Op>> = BTreeMap::new();
    for op in history.iter().filter(|o| o.request.is_write()) {
        match &op.op_id {
            Some(id) => writes
                .entry((op.incarnation, id.as_str()))
                .or_default()
                .push(op),
            None => out.flag(
                'a',
                format!(
                    "a write to {} by client {} carries no op id",
                    op.request.key(),
                    op.client
                ),
            ),
        }
    }
    writes
}

/// (a) Every `applied`/`pending` answer names a record on the log, at that revision, carrying the
/// op id; every attempt of an op sent the same request; and every record of an op on its key
/// holds what the op asked for.
fn answers_name_their_records(ev: &Evidence, out: &mut Findings) {
    for ((i, id), attempts) in &ev.writes {
        let inc = ev.inc_of(*i);
        let first = attempts[0];
        for op in attempts {
            if op.request != first.request {
                out.flag(
                    'a',
                    format!(
                        "op {id} was sent with two different requests: {:?} and {:?}",
                        first.request, op.request
                    ),
                );
            }
            answer_names_its_record(*i, id, op, inc, out);
        }
        for r in ev.records_of(*i, id) {
            record_holds_the_request(id, first, r, out);
        }
    }
}

/// (a) An `applied`/`pending` answer of op `id` in incarnation `i` names a record of `inc` at its
/// revision carrying the op id.
fn answer_names_its_record(i: usize, id: &str, op: &Op, inc: &Incarnation, out: &mut Findings) {
    let Some(rev) = op.answer.landed() else {
        return;
    };
    match inc.records.get(&rev) {
        Some(r) if r.op_id.as_deref() == Some(id) => {}
        Some(r) => out.flag(
            'a',
            format!(
                "op {id} on {} answered {:?} by fold {}: the record at {rev} is on {} and \
                 carries {:?}",
                op.request.key(),
                op.answer,
                op.node,
                r.key,
                r.op_id
            ),
        ),
        None if rev <= inc.last_sequence => out.flag(
            'a',
            format!(
                "op {id} on {} answered {:?} by fold {}: revision {rev} was gone before the log \
                 was read (cannot be proved)",
                op.request.key(),
                op.answer,
                op.node
            ),
        ),
        None => out.flag(
            'a',
            format!(
                "op {id} on {} answered {:?} by fold {} in incarnation {i}: the log ends at {}, \
                 no record at {rev}",
                op.request.key(),
                op.answer,
                op.node,
                inc.last_sequence
            ),
        ),
    }
}

/// (a) A record of op `id` on the op's own key holds the value (or delete marker) its first
/// request asked for. A record on another key is rule (c)'s: where an `op_reused` id landed.
fn record_holds_the_request(id: &str, first: &Op, r: &Record, out: &mut Findings) {
    let want_kind = if first.request.written().is_some() {
        Kind::Put
    } else {
        Kind::Delete
    };
    let holds = r.key == first.request.key()
        && r.kind == want_kind
        && (want_kind != Kind::Put || Some(&r.value) == first.request.written().as_ref());
    if !holds && r.key == first.request.key() {
        out.flag(
            'a',
            format!(
                "the record at {} carries op {id} but holds {:?} {:?} on {}, not {:?}",
                r.seq,
                r.kind,
                String::from_utf8_lossy(&r.value),
                r.key,
                first.request
            ),
        );
    }
}

/// (b) and (d), per incarnation: every record carries an op id the history sent there, then no
/// op id has two records.
fn one_record_per_op(ev: &Evidence, out: &mut Findings) {
    for (i, inc) in ev.log.incarnations.iter().enumerate() {
        every_record_was_sent(ev, i, inc, out);
        no_op_has_two_records(ev, i, out);
    }
}

/// (b) Every record of incarnation `i` carries an op id the history sent in that incarnation.
fn every_record_was_sent(ev: &Evidence, i: usize, inc: &Incarnation, out: &mut Findings) {
    let mut sent: BTreeSet<&str> = BTreeSet::new();
    for (inc_i, id) in ev.writes.keys() {
        if *inc_i == i {
            sent.insert(id);
        }
    }
    for r in inc.records.values() {
        match r.op_id.as_deref() {
            Some(id) if sent.contains(id) => {}
            other => out.flag(
                'b',
                format!(
                    "incarnation {i}: the record at {} on {} carries {other:?}, an op id the \
                     history never sent there",
                    r.seq, r.key
                ),
            ),
        }
    }
}

/// (b) No op id has two records on incarnation `i`'s log; (d) when every answer of the op was
/// indeterminate, the breach is rule (d)'s.
fn no_op_has_two_records(ev: &Evidence, i: usize, out: &mut Findings) {
    let Some(m) = ev.by_op.get(i) else {
        return;
    };
    for (id, recs) in m {
        if recs.len() < 2 {
            continue;
        }
        let seqs: Vec<u64> = recs.iter().map(|r| r.seq).collect();
        let indeterminate = ev
            .writes
            .get(&(i, *id))
            .is_some_and(|a| a.iter().all(|o| o.answer.indeterminate()));
        let (rule, what) = if indeterminate {
            ('d', "whose every answer was indeterminate")
        } else {
            ('b', "answered")
        };
        out.flag(
            rule,
            format!(
                "incarnation {i}: op {id} {what} has {} records, at {seqs:?}",
                recs.len()
            ),
        );
    }
}

/// (c) An op refused with a reason that publishes nothing has no record; one refused `op_reused`
/// has none on its own key, and the answer names where the id did land.
fn refusals_publish_nothing(ev: &Evidence, out: &mut Findings) {
    for ((i, id), attempts) in &ev.writes {
        let recs = ev.records_of(*i, id);
        for op in attempts {
            let Answer::Refused { reason, .. } = &op.answer else {
                continue;
            };
            if reason == "op_reused" {
                op_reused_names_where_it_landed(id, op, &recs, out);
            } else if NOTHING_PUBLISHED.contains(&reason.as_str()) && !recs.is_empty() {
                let seqs: Vec<u64> = recs.iter().map(|r| r.seq).collect();
                out.flag(
                    'c',
                    format!(
                        "op {id} on {} was refused {reason} by fold {} but its record is on the \
                         log at {seqs:?}",
                        op.request.key(),
                        op.node
                    ),
                );
            }
        }
    }
}

/// (c) Op `id`, refused `op_reused` by `op`'s answer, has no record on its own key, and the
/// answer names a record of it (key and revision) that the log holds.
fn op_reused_names_where_it_landed(id: &str, op: &Op, recs: &[&Record], out: &mut Findings) {
    let Answer::Refused { revision, key, .. } = &op.answer else {
        return;
    };
    let own: Vec<u64> = recs
        .iter()
        .filter(|r| r.key == op.request.key())
        .map(|r| r.seq)
        .collect();
    if !own.is_empty() {
        out.flag(
            'c',
            format!(
                "op {id} on {} was refused op_reused by fold {} but has records on that key at \
                 {own:?}",
                op.request.key(),
                op.node
            ),
        );
    }
    let named = recs
        .iter()
        .any(|r| Some(r.seq) == *revision && Some(&r.key) == key.as_ref());
    if !named {
        out.flag(
            'c',
            format!(
                "op {id} was refused op_reused naming {key:?} at {revision:?}, where the log \
                 holds no record of it",
            ),
        );
    }
}

/// A key's entry: its value and revision, `None` for none.
type Entry = Option<(Vec<u8>, u64)>;

/// (g) Every final fold holds exactly the last incarnation's newest record of every key (a
/// delete: no entry), at its revision.
fn final_folds_equal_the_bucket(log: &Log, finals: &[FinalFold], out: &mut Findings) {
    let Some(last) = log.incarnations.last() else {
        return;
    };
    let mut want: BTreeMap<&str, Entry> = BTreeMap::new();
    for r in last.records.values() {
        want.insert(
            &r.key,
            (r.kind == Kind::Put).then(|| (r.value.clone(), r.seq)),
        );
    }
    let show = |e: &Entry| {
        e.as_ref().map_or("nothing".to_string(), |(v, r)| {
            format!("{:?} at {r}", String::from_utf8_lossy(v))
        })
    };
    for f in finals {
        let keys: BTreeSet<&str> = want
            .keys()
            .copied()
            .chain(f.contents.keys().map(String::as_str))
            .collect();
        for key in keys {
            let w = want.get(key).cloned().flatten();
            let got = f.contents.get(key).cloned();
            if w != got {
                out.flag(
                    'g',
                    format!(
                        "fold {} holds {} for {key}, the bucket {}",
                        f.node,
                        show(&got),
                        show(&w)
                    ),
                );
            }
        }
    }
}
