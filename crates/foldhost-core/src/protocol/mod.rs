//! Every decision the fold's correctness rests on, as a pure function. Production code calls these;
//! the tests and the simulated bucket (`testkit`) call the same functions rather than copies, so a
//! change to a rule is re-checked everywhere at once (ARCHITECTURE.md, "Invariants").
//!
//! Invariants: nothing in this module does I/O, allocates on the hot path, or reads a clock; and it
//! imports nothing else of the crate (every other module may build on it).
//!
//! The rules are grouped by what they decide, one file each; all are items of this module.

mod artifacts;
mod backoff;
mod channel;
mod endpoint;
mod fold;
mod ledger;
mod repair;
mod state;
mod stored;
mod stream;
mod swap;
mod watch;
mod write;

pub use artifacts::*;
pub use backoff::Backoff;
pub use channel::*;
pub use endpoint::*;
pub use fold::*;
pub use ledger::*;
pub use repair::*;
pub use state::*;
pub use stored::*;
pub use stream::*;
pub use swap::*;
pub use watch::*;
pub use write::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fold_is_ready_only_running_level_and_within_its_lag() {
        let f = Readiness {
            state: "running",
            caught_up: true,
            applied_through: 100,
            seq: 100,
            stream_last: Some(100),
        };
        assert_eq!(fold_unready(f, 0), None);
        assert!(
            fold_unready(
                Readiness {
                    state: "failed",
                    ..f
                },
                10
            )
            .is_some()
        );
        let hydrating = fold_unready(
            Readiness {
                caught_up: false,
                ..f
            },
            10,
        );
        assert!(hydrating.is_some_and(|w| w.contains("catching up")));
        let behind = Readiness {
            stream_last: Some(150),
            ..f
        };
        assert_eq!(fold_unready(behind, 50), None);
        assert!(fold_unready(behind, 49).is_some_and(|w| w.contains("50 records behind")));
        // A deferred record holds applied_through below what was delivered.
        let held = Readiness {
            seq: 120,
            applied_through: 90,
            ..f
        };
        assert!(fold_unready(held, 10).is_some_and(|w| w.contains("30 records behind 120")));
        assert_eq!(
            fold_unready(
                Readiness {
                    stream_last: None,
                    ..f
                },
                0
            ),
            None
        );
    }

    #[test]
    fn a_shadow_is_promoted_only_on_complete_agreement_that_someone_hears_of() {
        assert_eq!(shadow_promotion(50, 50, 200, 200, 0, 0, true), Ok(()));
        assert_eq!(shadow_promotion(60, 50, 1, 1, 0, 0, true), Ok(()));
        // A declared tolerance admits that many differences, no more.
        assert_eq!(shadow_promotion(50, 50, 200, 200, 2, 2, true), Ok(()));
        for refused in [
            shadow_promotion(50, 50, 200, 200, 1, 0, true),
            shadow_promotion(50, 50, 0, 0, 0, 0, true),
            shadow_promotion(50, 50, 199, 200, 0, 0, true),
            shadow_promotion(49, 50, 200, 200, 0, 0, true),
            shadow_promotion(50, 50, 200, 200, 0, 0, false),
            shadow_promotion(50, 50, 200, 200, 3, 2, true),
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
        let unseen = |floor, level| Some(Unseen { floor, level });
        // (cursor, oldest retained, unseen, expected)
        let table = [
            (None, None, None, None),
            (Some(10), None, None, Some(10)),
            (Some(10), Some(7), None, Some(6)),
            (Some(10), Some(11), None, Some(10)),
            (Some(10), Some(1), None, Some(0)),
            (None, Some(3), None, None),
            // A state-sync start that never saw revision 1: nothing is covered while anything is
            // retained, or before the cursor reaches the level (or any level is known) ...
            (Some(30), Some(6), unseen(1, Some(30)), Some(0)),
            (Some(30), Some(6), unseen(4, Some(30)), Some(3)),
            (Some(30), Some(6), unseen(9, Some(30)), Some(5)),
            (Some(20), None, unseen(3, Some(30)), Some(2)),
            (Some(20), None, unseen(3, None), Some(2)),
            // ... and with nothing retained at the level, the floor says nothing.
            (Some(30), None, unseen(1, Some(30)), Some(30)),
            (Some(31), None, unseen(1, Some(30)), Some(31)),
        ];
        for (c, r, u, want) in table {
            assert_eq!(applied_through(c, r, u), want, "{c:?} {r:?} {u:?}");
        }
    }

    #[test]
    fn a_checkpoint_whose_revision_holds_another_record_has_diverged() {
        use CheckpointVerdict::*;
        assert_eq!(checkpoint_verdict(None, Some(5)), Unverified);
        assert_eq!(checkpoint_verdict(Some((9, 5)), None), Unverified);
        assert_eq!(checkpoint_verdict(Some((9, 5)), Some(5)), Same);
        assert_eq!(
            checkpoint_verdict(Some((9, 5)), Some(6)),
            Diverged {
                revision: 9,
                recorded_unix_ns: 5,
                found_unix_ns: 6
            }
        );
    }

    #[test]
    fn what_a_state_sync_left_unseen_is_kept_lowest_levelled_once_and_dropped_only_when_settled() {
        let u = |floor, level| Some(Unseen { floor, level });
        // A first skip; a lower one replaces it, a higher one does not.
        assert_eq!(
            unseen_after(None, Some(5), None, true, Some(9), true),
            u(5, None)
        );
        assert_eq!(
            unseen_after(u(5, None), Some(3), None, true, Some(9), true),
            u(3, None)
        );
        assert_eq!(
            unseen_after(u(3, None), Some(7), None, true, Some(9), true),
            u(3, None)
        );
        // The level is added once and never moved.
        assert_eq!(
            unseen_after(u(3, None), None, Some(20), true, Some(9), true),
            u(3, Some(20))
        );
        assert_eq!(
            unseen_after(u(3, Some(20)), None, Some(30), false, Some(9), true),
            u(3, Some(20))
        );
        // Settled (at the level, nothing retained) it goes — but never while a state-sync tracks.
        assert_eq!(
            unseen_after(u(3, Some(20)), None, None, false, Some(20), false),
            None
        );
        assert_eq!(
            unseen_after(u(3, Some(20)), None, None, true, Some(20), false),
            u(3, Some(20))
        );
        assert_eq!(
            unseen_after(u(3, Some(20)), None, None, false, Some(20), true),
            u(3, Some(20))
        );
        assert_eq!(
            unseen_after(u(3, Some(20)), None, None, false, Some(19), false),
            u(3, Some(20))
        );
        assert_eq!(
            unseen_after(None, None, Some(20), false, Some(20), false),
            None
        );
    }

    #[test]
    fn the_first_unseen_revision_is_the_first_a_state_sync_skipped() {
        assert_eq!(first_unseen(1, [1, 2, 3]), (None, 4));
        assert_eq!(first_unseen(1, [6, 7, 9]), (Some(1), 10));
        assert_eq!(first_unseen(1, [1, 2, 5, 9]), (Some(3), 10));
        assert_eq!(first_unseen(11, []), (None, 11));
        assert_eq!(first_unseen(11, [11, 13]), (Some(12), 14));
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
    fn bucket_keys_in_or_before_the_hosts_reserved_space_are_not_admitted() {
        assert!(bucket_key_admitted("route.a"));
        assert!(bucket_key_admitted(""));
        assert!(bucket_key_admitted("a\u{1}b"));
        assert!(!bucket_key_admitted(
            "\u{1}retained/00000000000000000001/k1"
        ));
        assert!(!bucket_key_admitted("\u{1}"));
        // Before the reserved space, where no scan of the whole fold looks.
        assert!(!bucket_key_admitted("\u{0}route.a"));
        assert!(bucket_key_admitted("a\u{0}b"));
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
