//! The history checker's own tests, on hand-made histories: no server.

use super::*;

// ---------------------------------------------------------------------------------------------
// The checker's own tests: no server.
// ---------------------------------------------------------------------------------------------

/// A fixed UUIDv7 text per small number.
fn id(n: u8) -> String {
    format!("01890000-0000-7000-8000-0000000000{n:02x}")
}

fn read(key: &str, min_revision: Option<u64>) -> Request {
    Request::Read {
        key: key.into(),
        min_revision,
    }
}

/// An operation of `client` on fold `node`, sent at `invoked` and answered at `completed`.
fn op(
    client: usize,
    node: usize,
    (invoked, completed): (u64, u64),
    request: Request,
    op_id: Option<u8>,
    answer: Answer,
) -> Op {
    Op {
        client,
        node,
        incarnation: 0,
        invoked,
        completed,
        request,
        op_id: op_id.map(id),
        retry: false,
        answer,
    }
}

fn record(seq: u64, key: &str, value: Option<&str>, op_id: u8) -> Record {
    Record {
        seq,
        key: key.into(),
        kind: if value.is_some() {
            Kind::Put
        } else {
            Kind::Delete
        },
        value: value.unwrap_or_default().as_bytes().to_vec(),
        op_id: Some(id(op_id)),
    }
}

fn log_of(records: Vec<Record>) -> Log {
    let last_sequence = records.iter().map(|r| r.seq).max().unwrap_or(0);
    Log {
        incarnations: vec![Incarnation {
            records: records.into_iter().map(|r| (r.seq, r)).collect(),
            last_sequence,
        }],
    }
}

fn applied(revision: u64) -> Answer {
    Answer::Applied { revision }
}

fn found(value: &str, revision: u64, applied_through: u64) -> Answer {
    Answer::Found {
        value: value.as_bytes().to_vec(),
        revision,
        applied_through,
    }
}

fn conflict(revision: u64) -> Answer {
    Answer::Refused {
        reason: "conflict".into(),
        revision: Some(revision),
        key: None,
    }
}

/// A history that keeps every promise: puts, a compare-and-set that wins and one that loses
/// naming the winner, a delete, an unknown write that landed and one that did not, a retry of an
/// answered write answered from the ledger, reads before and after, and folds equal to the log.
fn good() -> (Vec<Op>, Log, Vec<FinalFold>) {
    let history = vec![
        op(0, 0, (1, 2), put("k.a", "a1", None), Some(1), applied(1)),
        op(1, 1, (3, 6), put("k.a", "a2", Some(1)), Some(2), applied(2)),
        op(
            2,
            0,
            (4, 7),
            put("k.a", "a3", Some(1)),
            Some(3),
            conflict(2),
        ),
        op(0, 0, (8, 9), read("k.a", None), None, found("a2", 2, 2)),
        // Another fold, without a minimum revision, may still be behind.
        op(2, 1, (8, 10), read("k.a", None), None, found("a2", 2, 2)),
        op(
            1,
            1,
            (11, 12),
            Request::Delete {
                key: "k.a".into(),
                if_revision: None,
            },
            Some(4),
            Answer::Pending { revision: 3 },
        ),
        op(
            0,
            0,
            (13, 14),
            read("k.a", Some(3)),
            None,
            Answer::NotFound { applied_through: 3 },
        ),
        op(
            2,
            0,
            (15, 16),
            put("k.b", "b1", None),
            Some(5),
            Answer::Transport("connection reset".into()),
        ),
        op(
            2,
            1,
            (17, 18),
            put("k.b", "b2", None),
            Some(6),
            Answer::Unknown,
        ),
        Op {
            retry: true,
            ..op(0, 1, (19, 20), put("k.a", "a1", None), Some(1), applied(1))
        },
        op(
            1,
            0,
            (21, 22),
            read("k.b", Some(4)),
            None,
            found("b1", 4, 4),
        ),
    ];
    let log = log_of(vec![
        record(1, "k.a", Some("a1"), 1),
        record(2, "k.a", Some("a2"), 2),
        record(3, "k.a", None, 4),
        record(4, "k.b", Some("b1"), 5),
    ]);
    let folds = (0..2)
        .map(|node| FinalFold {
            node,
            contents: Contents::from([("k.b".to_string(), (b"b1".to_vec(), 4))]),
        })
        .collect();
    (history, log, folds)
}

/// The rules `check` breaks on this history, once each.
fn rules(history: &[Op], log: &Log, folds: &[FinalFold]) -> Vec<char> {
    let mut r: Vec<char> = history::check(history, log, folds)
        .iter()
        .map(|a| a.rule)
        .collect();
    r.dedup();
    r
}

#[test]
fn the_history_checker_passes_a_history_that_keeps_every_promise() {
    let (history, log, folds) = good();
    let anomalies = history::check(&history, &log, &folds);
    assert!(anomalies.is_empty(), "{}", history::describe(&anomalies));
}

#[test]
fn the_history_checker_fails_an_applied_answer_whose_record_is_not_on_the_log() {
    let (mut history, log, folds) = good();
    // Answered at 3, where the log holds another op's record.
    history.push(op(
        3,
        0,
        (23, 24),
        put("k.c", "c1", None),
        Some(9),
        applied(3),
    ));
    assert_eq!(rules(&history, &log, &folds), vec!['a']);
    // Answered past the log's end.
    let (mut history, log, folds) = good();
    history.push(op(
        3,
        0,
        (23, 24),
        put("k.c", "c1", None),
        Some(9),
        applied(9),
    ));
    assert_eq!(rules(&history, &log, &folds), vec!['a']);
}

#[test]
fn the_history_checker_fails_an_op_id_with_two_records() {
    let (mut history, mut log, mut folds) = good();
    // The retry of op 1 landed a second copy, and the folds hold it.
    log.incarnations[0]
        .records
        .insert(5, record(5, "k.a", Some("a1"), 1));
    log.incarnations[0].last_sequence = 5;
    for f in &mut folds {
        f.contents.insert("k.a".into(), (b"a1".to_vec(), 5));
    }
    history[9].answer = applied(5);
    assert_eq!(rules(&history, &log, &folds), vec!['b']);
}

#[test]
fn the_history_checker_fails_a_refused_op_with_a_record() {
    let (history, mut log, mut folds) = good();
    // The compare-and-set refused as a conflict landed after all, as the newest on k.a.
    log.incarnations[0]
        .records
        .insert(5, record(5, "k.a", Some("a3"), 3));
    log.incarnations[0].last_sequence = 5;
    for f in &mut folds {
        f.contents.insert("k.a".into(), (b"a3".to_vec(), 5));
    }
    let r = rules(&history, &log, &folds);
    assert!(r.contains(&'c'), "{r:?}");
}

#[test]
fn the_history_checker_fails_an_unknown_op_with_two_records() {
    let (history, mut log, mut folds) = good();
    log.incarnations[0]
        .records
        .insert(5, record(5, "k.b", Some("b1"), 5));
    log.incarnations[0].last_sequence = 5;
    for f in &mut folds {
        f.contents.insert("k.b".into(), (b"b1".to_vec(), 5));
    }
    assert_eq!(rules(&history, &log, &folds), vec!['d']);
}

#[test]
fn the_history_checker_fails_a_read_older_than_a_write_its_fold_applied() {
    let (mut history, log, folds) = good();
    // Fold 1 answered op 2 applied at 2, then served 1 to a read sent after.
    history.push(op(
        3,
        1,
        (23, 24),
        read("k.a", None),
        None,
        found("a1", 1, 1),
    ));
    assert_eq!(rules(&history, &log, &folds), vec!['e']);
    // A read that asked for revision 3 and found the value of 2.
    let (mut history, log, folds) = good();
    history.push(op(
        3,
        1,
        (23, 24),
        read("k.a", Some(3)),
        None,
        found("a2", 2, 3),
    ));
    assert_eq!(rules(&history, &log, &folds), vec!['e']);
    // Nothing found after the fold applied a put: the only delete was sent after the read.
    let history = vec![
        op(0, 0, (1, 2), put("k.a", "a1", None), Some(1), applied(1)),
        op(
            1,
            0,
            (3, 4),
            read("k.a", None),
            None,
            Answer::NotFound { applied_through: 0 },
        ),
        op(
            0,
            0,
            (5, 6),
            Request::Delete {
                key: "k.a".into(),
                if_revision: None,
            },
            Some(2),
            applied(2),
        ),
    ];
    let log = log_of(vec![
        record(1, "k.a", Some("a1"), 1),
        record(2, "k.a", None, 2),
    ]);
    let folds = vec![FinalFold {
        node: 0,
        contents: Contents::new(),
    }];
    assert_eq!(rules(&history, &log, &folds), vec!['e']);
    // A read on another fold with no minimum may lag: no anomaly.
    let (mut history, log, folds) = good();
    history.push(op(
        3,
        7,
        (23, 24),
        read("k.a", None),
        None,
        found("a1", 1, 1),
    ));
    assert_eq!(rules(&history, &log, &folds), Vec::<char>::new());
}

#[test]
fn the_history_checker_fails_compare_and_set_histories_that_are_not_linearizable() {
    // Two compare-and-sets at revision 1, both applied: the second must have conflicted.
    let history = vec![
        op(0, 0, (1, 2), put("k.a", "a1", None), Some(1), applied(1)),
        op(1, 0, (3, 4), put("k.a", "a2", Some(1)), Some(2), applied(2)),
        op(2, 1, (5, 6), put("k.a", "a3", Some(1)), Some(3), applied(3)),
    ];
    let log = log_of(vec![
        record(1, "k.a", Some("a1"), 1),
        record(2, "k.a", Some("a2"), 2),
        record(3, "k.a", Some("a3"), 3),
    ]);
    let folds = vec![FinalFold {
        node: 0,
        contents: Contents::from([("k.a".to_string(), (b"a3".to_vec(), 3))]),
    }];
    assert_eq!(rules(&history, &log, &folds), vec!['f']);
    // A write that completed before another began landed after it.
    let history = vec![
        op(0, 0, (1, 2), put("k.a", "a2", None), Some(2), applied(2)),
        op(1, 0, (3, 4), put("k.a", "a1", None), Some(1), applied(1)),
    ];
    let log = log_of(vec![
        record(1, "k.a", Some("a1"), 1),
        record(2, "k.a", Some("a2"), 2),
    ]);
    let folds = vec![FinalFold {
        node: 0,
        contents: Contents::from([("k.a".to_string(), (b"a2".to_vec(), 2))]),
    }];
    assert_eq!(rules(&history, &log, &folds), vec!['f']);
    // A conflict naming a revision the key never held while the op was in flight.
    let history = vec![
        op(0, 0, (1, 2), put("k.a", "a1", None), Some(1), applied(1)),
        op(
            1,
            0,
            (3, 4),
            put("k.a", "a2", Some(0)),
            Some(2),
            conflict(7),
        ),
    ];
    let log = log_of(vec![record(1, "k.a", Some("a1"), 1)]);
    let folds = vec![FinalFold {
        node: 0,
        contents: Contents::from([("k.a".to_string(), (b"a1".to_vec(), 1))]),
    }];
    assert_eq!(rules(&history, &log, &folds), vec!['f']);
    // An unknown compare-and-set whose record the log holds took effect: a later compare-and-set
    // at the revision before it must have conflicted.
    let history = vec![
        op(0, 0, (1, 2), put("k.a", "a1", None), Some(1), applied(1)),
        op(
            1,
            0,
            (3, 4),
            put("k.a", "a2", Some(1)),
            Some(2),
            Answer::Unknown,
        ),
        op(2, 0, (5, 6), put("k.a", "a3", Some(1)), Some(3), applied(3)),
    ];
    let log = log_of(vec![
        record(1, "k.a", Some("a1"), 1),
        record(2, "k.a", Some("a2"), 2),
        record(3, "k.a", Some("a3"), 3),
    ]);
    let folds = vec![FinalFold {
        node: 0,
        contents: Contents::from([("k.a".to_string(), (b"a3".to_vec(), 3))]),
    }];
    assert_eq!(rules(&history, &log, &folds), vec!['f']);
}

#[test]
fn the_history_checker_fails_a_final_fold_that_is_not_the_bucket() {
    let (history, log, mut folds) = good();
    folds[1].contents.insert("k.a".into(), (b"a2".to_vec(), 2));
    assert_eq!(rules(&history, &log, &folds), vec!['g']);
}

#[test]
fn the_history_checker_says_when_the_log_lost_records_before_it_was_read() {
    let (history, mut log, folds) = good();
    log.incarnations[0].last_sequence = 6;
    let r = rules(&history, &log, &folds);
    assert!(r.contains(&'L'), "{r:?}");
}

#[test]
fn the_register_specification_orders_reads_in_real_time() {
    let write = |name: &str, (invoked, returned), landed: u64, if_revision| TimedRegisterOp {
        name: name.into(),
        invoked,
        returned,
        op: RegisterOp::Write {
            value: Some(name.as_bytes().to_vec()),
            if_revision,
            landed: Some(landed),
        },
        ret: RegisterRet::Wrote(landed),
    };
    let read_of = |(invoked, returned), revision: u64, value: Option<&str>| TimedRegisterOp {
        name: "read".into(),
        invoked,
        returned,
        op: RegisterOp::Read,
        ret: RegisterRet::Value(revision, value.map(|v| v.as_bytes().to_vec())),
    };
    // A read concurrent with a write may see either side of it.
    let ok = [
        write("x", (1, 2), 1, None),
        write("y", (3, 6), 2, Some(1)),
        read_of((4, 5), 1, Some("x")),
        read_of((4, 7), 2, Some("y")),
    ];
    assert_eq!(history::linearizable(&ok), Ok(()));
    // A read sent after the write returned must see it.
    let stale = [
        write("x", (1, 2), 1, None),
        write("y", (3, 4), 2, Some(1)),
        read_of((5, 6), 1, Some("x")),
    ];
    assert!(history::linearizable(&stale).is_err());
}
