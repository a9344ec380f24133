use super::*;

/// A UUIDv7 minted at `ms` with `rand` in its random bits.
fn op(ms: u64, rand: u8) -> OpId {
    let mut b = [rand; 16];
    b[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
    b[6] = 0x70 | (b[6] & 0x0f);
    b[8] = 0x80 | (b[8] & 0x3f);
    OpId::from_bytes(b).expect("a v7")
}

fn row(revision: u64, key: &str, epoch: u32) -> LedgerRow {
    LedgerRow {
        revision,
        key: key.into(),
        recorded_unix_ms: 7,
        epoch,
        digest: Some([9; 16]),
    }
}

#[test]
fn a_ledger_row_round_trips_a_first_format_row_reads_without_digest_and_foreign_bytes_are_refused()
{
    let r = LedgerRow {
        revision: u64::MAX - 1,
        key: "route.ü".into(),
        recorded_unix_ms: 99,
        epoch: 7,
        digest: Some([3; 16]),
    };
    assert_eq!(LedgerRow::decode(&r.encode()), Ok(r));
    // The first format: [1][revision][recorded][key].
    let mut v1 = vec![1u8];
    v1.extend_from_slice(&5u64.to_be_bytes());
    v1.extend_from_slice(&6u64.to_be_bytes());
    v1.extend_from_slice(b"k");
    assert_eq!(
        LedgerRow::decode(&v1),
        Ok(LedgerRow {
            revision: 5,
            key: "k".into(),
            recorded_unix_ms: 6,
            epoch: 0,
            digest: None,
        })
    );
    assert_eq!(LedgerRow::decode(b""), Err(LedgerRowError::Format));
    assert_eq!(LedgerRow::decode(&[2; 36]), Err(LedgerRowError::Format));
    let mut other = row(1, "a", 0).encode();
    other[0] = 3;
    assert_eq!(LedgerRow::decode(&other), Err(LedgerRowError::Format));
    let mut bad = row(1, "a", 0).encode();
    bad.push(0xff);
    assert_eq!(LedgerRow::decode(&bad), Err(LedgerRowError::Key));
}

#[test]
fn a_write_digest_tells_operations_and_values_apart() {
    let put_a = write_digest(KvOp::Put, b"a");
    assert_eq!(put_a, write_digest(KvOp::Put, b"a"));
    assert_ne!(put_a, write_digest(KvOp::Put, b"b"));
    assert_ne!(
        write_digest(KvOp::Put, b""),
        write_digest(KvOp::Delete, b"")
    );
    assert_ne!(
        write_digest(KvOp::Delete, b""),
        write_digest(KvOp::Purge, b"")
    );
    // A marker's payload is not part of it.
    assert_eq!(
        write_digest(KvOp::Delete, b"x"),
        write_digest(KvOp::Delete, b"")
    );
}

#[test]
fn only_an_id_minted_no_further_past_its_records_time_than_a_host_admits_leaves_a_row() {
    let stored = 1_000_000;
    // A host admits up to the skew; a row allows twice that, for the host's clock against the
    // broker's.
    let bound = 2 * MAX_OP_ID_SKEW_MS;
    assert!(row_admitted(&op(stored, 1), stored, 0));
    assert!(row_admitted(&op(stored + bound, 1), stored, 0));
    assert!(!row_admitted(&op(stored + bound + 1, 1), stored, 0));
    // Centuries ahead: never.
    assert!(!row_admitted(&op(1 << 47, 1), stored, 0));
    // Without the record's time, the recording instant stands in.
    assert!(row_admitted(&op(stored, 1), 0, stored));
    assert!(!row_admitted(&op(stored + bound + 1, 1), 0, stored));
}

#[test]
fn the_watermark_follows_the_newest_swept_mint_instant_never_moves_back_nor_past_the_sweeps_clock()
{
    assert_eq!(watermark_after_sweep(0, None, 100), 0);
    assert_eq!(watermark_after_sweep(0, Some(50), 100), 50);
    assert_eq!(watermark_after_sweep(80, Some(50), 100), 80);
    assert_eq!(watermark_after_sweep(0, Some(u64::MAX), 100), 100);
    assert_eq!(effective_watermark(500, 100), 100);
    assert_eq!(effective_watermark(50, 100), 50);
}

#[test]
fn a_row_of_an_earlier_life_answers_nothing() {
    let life = LedgerLife {
        epoch: 2,
        horizon_unix_ms: 0,
    };
    assert_eq!(
        row_of_life(Some(row(1, "a", 2)), life),
        Some(row(1, "a", 2))
    );
    assert_eq!(row_of_life(Some(row(1, "a", 1)), life), None);
    assert_eq!(row_of_life(None, life), None);
}

#[test]
fn a_life_round_trips_a_state_sync_raises_the_horizon_and_a_new_incarnation_the_epoch() {
    let l = LedgerLife {
        epoch: 3,
        horizon_unix_ms: 500,
    };
    assert_eq!(LedgerLife::decode(&l.encode()), Some(l));
    assert_eq!(LedgerLife::decode(b"short"), None);
    assert_eq!(
        l.passed_without_rows(400),
        l,
        "the horizon never moves back"
    );
    assert_eq!(l.passed_without_rows(900).horizon_unix_ms, 900);
    assert_eq!(l.passed_without_rows(900).epoch, 3);
    let n = l.new_incarnation(900);
    assert_eq!((n.epoch, n.horizon_unix_ms), (4, 900));
}

#[test]
fn a_retry_without_a_row_is_published_only_where_the_rows_or_the_brokers_window_cover_it() {
    let now = 10_000_000;
    // The broker's window, on a key whose oldest stored record is an hour old.
    let seen = WindowSeen {
        window_ms: 120_000,
        oldest_on_key_unix_ms: Some(now - 3_600_000),
        stream_first_unix_ms: now - 3_600_000,
    };
    let window = Some(seen);
    let complete = Coverage {
        cursor: 50,
        life: LedgerLife::default(),
    };
    // Fresh (every copy would be in the window): published whatever else holds.
    let fresh = op(now, 1);
    let behind_horizon = Coverage {
        cursor: 10,
        life: LedgerLife {
            epoch: 0,
            horizon_unix_ms: now,
        },
    };
    assert_eq!(
        vouch_retry(&fresh, now, window, Some(99), behind_horizon),
        Vouch::Publish
    );
    // Old, the key's newest record at or below the cursor, no horizon: the rows cover it.
    let old = op(now - 600_000, 1);
    assert_eq!(
        vouch_retry(&old, now, window, Some(50), complete),
        Vouch::Publish
    );
    assert_eq!(
        vouch_retry(&old, now, window, None, complete),
        Vouch::Publish
    );
    // Old, the key has records past the cursor: its copy may be there.
    assert_eq!(
        vouch_retry(&old, now, window, Some(51), complete),
        Vouch::FoldBehind
    );
    // Old, minted before the horizon was set: a copy may have been passed without a row.
    let horizon = Coverage {
        cursor: 50,
        life: LedgerLife {
            epoch: 1,
            horizon_unix_ms: now - 300_000,
        },
    };
    assert_eq!(
        vouch_retry(&old, now, window, Some(50), horizon),
        Vouch::Unvouched {
            minted_unix_ms: now - 600_000,
            horizon_unix_ms: now - 300_000,
        }
    );
    // Minted well after the horizon (past the skew allowance): the rows cover it.
    let after = op(now - 300_000 + MAX_OP_ID_SKEW_MS + 1, 1);
    assert_eq!(
        vouch_retry(&after, now, window, Some(50), horizon),
        Vouch::Publish
    );
}

const NOW: u64 = 10_000_000;

/// Rows complete through revision 50, no horizon.
fn complete() -> Coverage {
    Coverage {
        cursor: 50,
        life: LedgerLife::default(),
    }
}

/// Rows through revision 10 only, the horizon now.
fn behind_horizon() -> Coverage {
    Coverage {
        cursor: 10,
        life: LedgerLife {
            epoch: 0,
            horizon_unix_ms: NOW,
        },
    }
}

/// The verdict at [`NOW`] for `op` under a window of `window_ms` on a key whose oldest stored
/// record is `oldest` (`None` inside: the key has none; `None`: no window at all), in a stream
/// whose oldest record is `first`.
fn judge(
    first: u64,
    op: &OpId,
    window_ms: u64,
    oldest: Option<Option<u64>>,
    newest: Option<u64>,
    covered: Coverage,
) -> Vouch {
    let w = oldest.map(|oldest_on_key_unix_ms| WindowSeen {
        window_ms,
        oldest_on_key_unix_ms,
        stream_first_unix_ms: first,
    });
    vouch_retry(op, NOW, w, newest, covered)
}

fn unvouched(v: Vouch) -> bool {
    matches!(v, Vouch::Unvouched { .. })
}

#[test]
fn the_brokers_window_vouches_only_where_no_record_of_the_key_can_have_been_removed_since() {
    let hour_ago = NOW - 3_600_000;
    let hour_old = Some(Some(hour_ago));
    // A shorter window trusts less: the same age is no longer covered by the broker.
    let recent = op(NOW - 2_000, 1);
    let v = judge(
        hour_ago,
        &recent,
        120_000,
        hour_old,
        Some(50),
        behind_horizon(),
    );
    assert_eq!(v, Vouch::Publish);
    let v = judge(
        hour_ago,
        &recent,
        1_000,
        hour_old,
        Some(50),
        behind_horizon(),
    );
    assert!(unvouched(v));
    // No window at all: the rows alone judge.
    let v = judge(hour_ago, &recent, 0, None, Some(50), behind_horizon());
    assert!(unvouched(v));
    // In the window, but a record of the key stored since its earliest copy may have been removed
    // (the key's oldest stored record is newer than that): a restarted broker forgets a removed
    // copy's id, so the window vouches for nothing and the rows judge.
    let fresh = op(NOW, 1);
    let trimmed = |oldest: u64| Some(Some(oldest));
    let v = judge(
        hour_ago,
        &fresh,
        120_000,
        trimmed(NOW - 10),
        Some(99),
        behind_horizon(),
    );
    assert!(unvouched(v));
    let v = judge(
        hour_ago,
        &fresh,
        120_000,
        trimmed(NOW - 10),
        Some(10),
        complete(),
    );
    assert_eq!(v, Vouch::Publish, "complete rows still vouch");
    // The oldest record predates any copy (by the skew on both clocks): the window vouches.
    let before_any_copy = NOW - 2 * MAX_OP_ID_SKEW_MS;
    let at = |t| {
        judge(
            hour_ago,
            &fresh,
            120_000,
            trimmed(t),
            Some(99),
            behind_horizon(),
        )
    };
    assert_eq!(at(before_any_copy - 1), Vouch::Publish);
    assert!(unvouched(at(before_any_copy)));
}

#[test]
fn the_window_vouches_for_an_empty_key_only_where_the_streams_oldest_record_is_older() {
    let fresh = op(NOW, 1);
    let empty_key = |first| judge(first, &fresh, 120_000, Some(None), None, behind_horizon());
    // The stream's oldest record predates any copy: nothing of the key was removed (the stream's
    // limits and a rollup of it remove the stream's oldest first).
    assert_eq!(empty_key(NOW - 3_600_000), Vouch::Publish);
    // Its front moved past the first copy (evicted by the stream's limits, or the stream rolled
    // up), or the stream is empty: the key's last record may be gone.
    assert!(unvouched(empty_key(NOW - 10)));
    assert!(unvouched(empty_key(u64::MAX)));
}

#[test]
fn a_refused_compare_and_set_is_its_own_first_copy_when_that_is_the_record_after_its_revision() {
    use crate::protocol::{Landed, UnknownWhy, WriteRefusal};
    let id = op(1_000, 1);
    let d = write_digest(KvOp::Put, b"v");
    let found = |rev: u64, carried: Option<OpId>| {
        (
            Landed {
                revision: rev,
                key: "k".into(),
                digest: Some(d),
            },
            carried,
        )
    };
    let seen = |successor, known| ConflictSeen {
        current: Some(9),
        successor,
        successor_known: known,
    };
    let conflict = AfterConflict::Refused(WriteRefusal::Conflict { current: Some(9) });
    let mine = found(5, Some(id));
    let theirs = found(5, Some(op(1_000, 2)));
    // Its own record right after the revision it asked for: the write landed there.
    assert_eq!(
        after_conflict(&id, "k", &d, true, seen(Some(&mine), true), Vouch::Publish),
        AfterConflict::Landed(5)
    );
    // Another write's record there, the history intact: it never landed.
    assert_eq!(
        after_conflict(
            &id,
            "k",
            &d,
            true,
            seen(Some(&theirs), true),
            Vouch::FoldBehind
        ),
        conflict
    );
    // A first attempt (a host-minted id) cannot have landed before.
    assert_eq!(
        after_conflict(&id, "k", &d, false, seen(None, false), Vouch::FoldBehind),
        conflict
    );
    // The history before the successor may be gone: the rows decide.
    assert_eq!(
        after_conflict(&id, "k", &d, true, seen(None, false), Vouch::Publish),
        conflict
    );
    assert_eq!(
        after_conflict(&id, "k", &d, true, seen(None, false), Vouch::FoldBehind),
        AfterConflict::Unknown(UnknownWhy::FoldBehind)
    );
    // Its id on another body: refused, naming the first.
    let other = write_digest(KvOp::Put, b"w");
    assert!(matches!(
        after_conflict(
            &id,
            "k",
            &other,
            true,
            seen(Some(&mine), true),
            Vouch::Publish
        ),
        AfterConflict::Refused(WriteRefusal::OpReused {
            other_body: true,
            ..
        })
    ));
}

#[test]
fn a_commit_that_passes_a_revision_it_was_never_delivered_is_seen() {
    // Contiguous from the cursor to the new cursor: nothing passed unseen.
    assert!(!passes_unseen(10, [11, 12, 13], 13));
    assert!(!passes_unseen(10, [], 10));
    // A hole among the deliveries (a record superseded before the watch read it).
    assert!(passes_unseen(10, [11, 13], 13));
    // The first delivered is not the next revision.
    assert!(passes_unseen(10, [12], 12));
    // The cursor moves past the last delivery.
    assert!(passes_unseen(10, [11], 12));
    // Revisions the cursor already covers (a released retained record) change nothing.
    assert!(!passes_unseen(10, [5, 11], 11));
}

#[test]
fn a_compare_and_set_retry_needs_no_vouch_where_the_broker_refuses_its_second_copy() {
    assert!(!broker_refuses_a_second_copy(None));
    assert!(broker_refuses_a_second_copy(Some(3)));
    assert!(
        !broker_refuses_a_second_copy(Some(0)),
        "a create holds again once the key has no record"
    );
}
