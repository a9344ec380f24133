//! Rule (f): each key's writes, per incarnation, are linearizable against a [`Register`]. Every
//! record on the log enters, so that the rule judges only the order of the writes and reports
//! nothing the other rules report; [`landed_by`] closes the window of a write that landed at an
//! unknown instant, which keeps the tester's search small.

use std::collections::BTreeMap;

use super::super::{RegisterOp, RegisterRet, TimedRegisterOp, linearizable};
use super::{Answer, Evidence, Findings, Kind, Op, Record};

/// One key's writes in one incarnation, as the tester takes them.
type KeyHistories<'a> = BTreeMap<(usize, &'a str), Vec<TimedRegisterOp>>;

/// An op's entry in its key's history: when it returned, what, and where it landed.
type Outcome = (u64, RegisterRet, Option<u64>);

/// (f) Each key's writes are linearizable. Every record on the log enters too: a copy beyond the
/// one an answer names (rule (b)'s), a record of a refused op (rule (c)'s) or of an op the history
/// never sent, as a write that landed there at some instant — so that this rule judges only the
/// order, and reports nothing the other rules report.
///
/// A write that landed at an unknown instant took effect before any answer that shows the stream
/// past its record completed (stream sequences are given in time order): its window closes there
/// instead of staying open to the end, which keeps the tester's search small ([`landed_by`]).
pub(super) fn writes_are_linearizable(ev: &Evidence, out: &mut Findings) {
    let windows = Windows {
        landed_by: landed_by(ev.history),
    };
    let mut per_key = KeyHistories::new();
    for ((i, id), attempts) in &ev.writes {
        sent_op_enters(ev, &windows, (*i, id), attempts, &mut per_key);
    }
    unsent_records_enter(ev, &windows, &mut per_key);
    for ((i, key), ops) in &per_key {
        if let Err(why) = linearizable(ops) {
            out.flag(
                'f',
                format!(
                    "key {key} (incarnation {i}): its {} writes are not linearizable: {why}",
                    ops.len()
                ),
            );
        }
    }
}

/// The windows of writes that landed at an unknown instant.
struct Windows<F> {
    /// [`landed_by`] of the history.
    landed_by: F,
}

impl<F: Fn(usize, u64) -> Option<u64>> Windows<F> {
    /// When a write sent at `invoked` whose record is at `seq` of incarnation `i` took effect at
    /// the latest: once an answer showed the stream past it (`u64::MAX`: never known).
    fn close(&self, i: usize, seq: u64, invoked: u64) -> u64 {
        (self.landed_by)(i, seq).map_or(u64::MAX, |done| done.max(invoked))
    }

    /// Record `r` as a write that landed there at some instant after `invoked`.
    fn copy(&self, i: usize, r: &Record, name: String, invoked: u64) -> TimedRegisterOp {
        TimedRegisterOp {
            name,
            invoked,
            returned: self.close(i, r.seq, invoked),
            op: RegisterOp::Write {
                value: (r.kind == Kind::Put).then(|| r.value.clone()),
                if_revision: None,
                landed: Some(r.seq),
            },
            ret: RegisterRet::Wrote(r.seq),
        }
    }
}

/// (f) Op `id` of incarnation `i` enters its key's history with its window from its first send to
/// its first determinate answer (or, indeterminate, as landed where the log holds its record);
/// every other record of it enters as a copy on the key it is on.
fn sent_op_enters<'a, F: Fn(usize, u64) -> Option<u64>>(
    ev: &Evidence<'a>,
    windows: &Windows<F>,
    (i, id): (usize, &str),
    attempts: &[&'a Op],
    per_key: &mut KeyHistories<'a>,
) {
    let first = attempts[0];
    let invoked = attempts.iter().map(|o| o.invoked).min().unwrap_or(0);
    let recs = ev.records_of(i, id);
    let main = outcome(windows, i, attempts, &recs, invoked);
    let ops = per_key.entry((i, first.request.key())).or_default();
    let named = main.as_ref().and_then(|m| m.2);
    if let Some((returned, ret, landed)) = main {
        ops.push(TimedRegisterOp {
            name: format!("op {id}"),
            invoked,
            returned,
            op: RegisterOp::Write {
                value: first.request.written(),
                if_revision: first.request.if_revision(),
                landed,
            },
            ret,
        });
    }
    for r in recs.iter().filter(|r| Some(r.seq) != named) {
        per_key
            .entry((i, r.key.as_str()))
            .or_default()
            .push(windows.copy(i, r, format!("op {id}'s record at {}", r.seq), invoked));
    }
}

/// What an op's attempts prove it did: its first determinate answer (landed, or a conflict);
/// indeterminate throughout, it happened if the log holds its record (`recs`), else it did not;
/// refused for a reason that publishes nothing, it did not happen (`None`).
fn outcome<F: Fn(usize, u64) -> Option<u64>>(
    windows: &Windows<F>,
    i: usize,
    attempts: &[&Op],
    recs: &[&Record],
    invoked: u64,
) -> Option<Outcome> {
    let determinate = attempts
        .iter()
        .filter(|o| {
            o.answer.landed().is_some()
                || matches!(&o.answer, Answer::Refused { reason, .. } if reason == "conflict")
        })
        .min_by_key(|o| o.completed);
    match determinate {
        Some(o) => match &o.answer {
            Answer::Refused { revision, .. } => Some((
                o.completed,
                RegisterRet::Conflict(revision.unwrap_or(0)),
                None,
            )),
            a => {
                let r = a.landed().unwrap_or(0);
                Some((o.completed, RegisterRet::Wrote(r), Some(r)))
            }
        },
        None if attempts.iter().all(|o| o.answer.indeterminate()) => recs.first().map(|r| {
            (
                windows.close(i, r.seq, invoked),
                RegisterRet::Wrote(r.seq),
                Some(r.seq),
            )
        }),
        None => None,
    }
}

/// (f) Every record carrying an op id the history never sent in its incarnation enters its key's
/// history as a write that landed there at some instant.
fn unsent_records_enter<'a, F: Fn(usize, u64) -> Option<u64>>(
    ev: &Evidence<'a>,
    windows: &Windows<F>,
    per_key: &mut KeyHistories<'a>,
) {
    for (i, inc) in ev.log.incarnations.iter().enumerate() {
        for r in inc.records.values() {
            let sent = r
                .op_id
                .as_deref()
                .is_some_and(|id| ev.writes.contains_key(&(i, id)));
            if !sent {
                per_key
                    .entry((i, r.key.as_str()))
                    .or_default()
                    .push(windows.copy(i, r, format!("the unsent record at {}", r.seq), 0));
            }
        }
    }
}

/// For each incarnation, the earliest instant an answer showed its stream at or past a sequence:
/// `landed_by(i, seq)` is the first completion of an op of incarnation `i` answered `applied` or
/// `pending` at a revision of at least `seq`, or a read that found a record of at least `seq`
/// (both proved by rules (a) and (e)); `None` when no answer did. A record at `seq` was on the
/// stream before any such answer completed: sequences are given in the order records are stored.
fn landed_by(history: &[Op]) -> impl Fn(usize, u64) -> Option<u64> {
    // Per incarnation: (revision, completed) sorted by revision, with the earliest completion
    // of every revision at or above each entry.
    let mut shown: BTreeMap<usize, Vec<(u64, u64)>> = BTreeMap::new();
    for o in history {
        let revision = match &o.answer {
            Answer::Applied { revision }
            | Answer::Pending { revision }
            | Answer::Found { revision, .. } => *revision,
            _ => continue,
        };
        shown
            .entry(o.incarnation)
            .or_default()
            .push((revision, o.completed));
    }
    for v in shown.values_mut() {
        v.sort_unstable();
        let mut earliest = u64::MAX;
        for e in v.iter_mut().rev() {
            earliest = earliest.min(e.1);
            e.1 = earliest;
        }
    }
    move |i, seq| {
        let v = shown.get(&i)?;
        let at = v.partition_point(|(r, _)| *r < seq);
        v.get(at).map(|(_, done)| *done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::Request;

    fn answered(incarnation: usize, completed: u64, answer: Answer) -> Op {
        Op {
            client: 0,
            node: 0,
            incarnation,
            invoked: completed.saturating_sub(1),
            completed,
            request: Request::Read {
                key: "k".into(),
                min_revision: None,
            },
            op_id: None,
            retry: false,
            answer,
        }
    }

    /// A record is known stored by the first completed answer that shows its incarnation's
    /// stream at or past it (an applied, a pending or a read's revision; another key's counts),
    /// never by an answer of another incarnation or one that names no revision.
    #[test]
    fn a_record_is_known_landed_by_the_first_answer_showing_its_stream_at_or_past_it() {
        let found = |revision| Answer::Found {
            value: b"v".to_vec(),
            revision,
            applied_through: revision,
        };
        let history = vec![
            answered(0, 10, Answer::Applied { revision: 5 }),
            answered(0, 7, Answer::Pending { revision: 3 }),
            answered(0, 20, found(9)),
            answered(0, 4, Answer::Unknown),
            answered(
                0,
                2,
                Answer::Refused {
                    reason: "conflict".into(),
                    revision: Some(50),
                    key: None,
                },
            ),
            answered(1, 1, Answer::Applied { revision: 8 }),
        ];
        let by = landed_by(&history);
        assert_eq!(by(0, 1), Some(7));
        assert_eq!(by(0, 3), Some(7));
        assert_eq!(by(0, 4), Some(10));
        assert_eq!(by(0, 5), Some(10));
        assert_eq!(by(0, 6), Some(20));
        assert_eq!(by(0, 10), None, "a conflict's revision is not evidence");
        assert_eq!(by(1, 8), Some(1));
        assert_eq!(by(1, 9), None);
        assert_eq!(by(2, 1), None);
    }
}
