use super::*;

fn v(n: u8) -> GuestVersion {
    GuestVersion {
        digest: format!("{:064x}", n),
        name: "g".into(),
        version: format!("{n}.0.0"),
        size: 1,
    }
}

fn entry(desired: u8, previous: Option<u8>, canaries: &[&str]) -> ChannelEntry {
    ChannelEntry {
        desired: v(desired),
        previous: previous.map(v),
        canaries: canaries.iter().map(|c| c.to_string()).collect(),
        canary_fraction: None,
        shadow_batches: 5,
        shadow_wait_s: 60,
        tolerance: 0,
        published_unix_ms: 0,
    }
}

fn report(node: &str, release: u64, outcome: Judgement) -> NodeReport {
    NodeReport {
        node: node.into(),
        release,
        outcome,
        detail: String::new(),
        running: None,
        unix_ms: 0,
    }
}

#[test]
fn a_release_waits_for_every_canary_to_judge_it_clean_before_it_rolls() {
    let e = entry(2, Some(1), &["a", "b"]);
    assert_eq!(rollout(7, &e, &[]), Rollout::Canary { clean: 0, of: 2 });
    let one = [
        report("a", 7, Judgement::Clean),
        report("b", 7, Judgement::Pending),
    ];
    assert_eq!(rollout(7, &e, &one), Rollout::Canary { clean: 1, of: 2 });
    // A clean report of another release counts for nothing.
    let stale = [
        report("a", 7, Judgement::Clean),
        report("b", 6, Judgement::Clean),
    ];
    assert_eq!(rollout(7, &e, &stale), Rollout::Canary { clean: 1, of: 2 });
    let both = [
        report("a", 7, Judgement::Clean),
        report("b", 7, Judgement::Clean),
    ];
    assert_eq!(rollout(7, &e, &both), Rollout::Rolling);
}

#[test]
fn any_differed_trapped_or_refused_report_halts_the_release_and_unfetchable_does_not() {
    let e = entry(2, Some(1), &["a"]);
    for bad in [Judgement::Differed, Judgement::Trapped, Judgement::Refused] {
        // Even from a node that is not a canary, even after the canaries were clean.
        let rs = [report("a", 3, Judgement::Clean), report("z", 3, bad)];
        assert!(matches!(rollout(3, &e, &rs), Rollout::Halted { by, .. } if by == "z"));
    }
    let rs = [
        report("a", 3, Judgement::Clean),
        report("z", 3, Judgement::Unfetchable),
    ];
    assert_eq!(rollout(3, &e, &rs), Rollout::Rolling);
    // A bad report of an older release halts nothing now.
    let rs = [
        report("a", 3, Judgement::Clean),
        report("z", 2, Judgement::Trapped),
    ];
    assert_eq!(rollout(3, &e, &rs), Rollout::Rolling);
}

#[test]
fn a_first_release_or_one_without_canaries_rolls_at_once() {
    assert_eq!(rollout(1, &entry(1, None, &["a"]), &[]), Rollout::Rolling);
    assert_eq!(rollout(1, &entry(2, Some(1), &[]), &[]), Rollout::Rolling);
}

#[test]
fn only_canaries_move_before_the_release_rolls_and_they_shadow_first() {
    let e = entry(2, Some(1), &["a"]);
    let s = Rollout::Canary { clean: 0, of: 1 };
    let one = v(1).digest;
    assert_eq!(next_step(&e, &s, "a", Some(&one), None), Step::Shadow(v(2)));
    assert_eq!(
        next_step(&e, &s, "a", Some(&one), Some(Judgement::Unfetchable)),
        Step::Shadow(v(2))
    );
    assert_eq!(next_step(&e, &s, "b", Some(&one), None), Step::Stay);
    // A node running something else returns to the last good version, never to the candidate.
    assert_eq!(
        next_step(&e, &s, "b", Some(&v(9).digest), None),
        Step::Swap(v(1))
    );
    // A canary that promoted stays.
    let two = v(2).digest;
    assert_eq!(
        next_step(&e, &s, "a", Some(&two), Some(Judgement::Clean)),
        Step::Stay
    );
}

#[test]
fn a_rolling_release_swaps_every_node_that_did_not_judge_it_bad() {
    let e = entry(2, Some(1), &["a"]);
    let one = v(1).digest;
    assert_eq!(
        next_step(&e, &Rollout::Rolling, "b", Some(&one), None),
        Step::Swap(v(2))
    );
    assert_eq!(
        next_step(&e, &Rollout::Rolling, "b", Some(&v(2).digest), None),
        Step::Stay
    );
    assert_eq!(
        next_step(
            &e,
            &Rollout::Rolling,
            "b",
            None,
            Some(Judgement::Unfetchable)
        ),
        Step::Swap(v(2))
    );
}

#[test]
fn a_halted_release_returns_every_node_to_the_last_good_version() {
    let e = entry(3, Some(2), &["a"]);
    let halted = Rollout::Halted {
        by: "a".into(),
        why: String::new(),
    };
    for me in ["a", "b"] {
        assert_eq!(
            next_step(&e, &halted, me, Some(&v(3).digest), Some(Judgement::Clean)),
            Step::Swap(v(2))
        );
        assert_eq!(
            next_step(&e, &halted, me, Some(&v(2).digest), None),
            Step::Stay
        );
    }
    // The only release halted: nothing good to return to, nothing moves.
    let first = entry(1, None, &[]);
    assert_eq!(
        next_step(&first, &halted, "a", Some(&v(1).digest), None),
        Step::Stay
    );
    assert_eq!(start_version(&first, &halted), None);
}

#[test]
fn a_node_starting_runs_the_desired_version_only_once_it_rolls() {
    let e = entry(2, Some(1), &["a"]);
    assert_eq!(start_version(&e, &Rollout::Rolling), Some(&v(2)));
    assert_eq!(
        start_version(&e, &Rollout::Canary { clean: 0, of: 1 }),
        Some(&v(1))
    );
    let halted = Rollout::Halted {
        by: "a".into(),
        why: String::new(),
    };
    assert_eq!(start_version(&e, &halted), Some(&v(1)));
}

#[test]
fn a_publish_keeps_the_last_good_version_as_previous() {
    assert_eq!(previous_for_publish(None), None);
    let e = entry(2, Some(1), &["a"]);
    assert_eq!(
        previous_for_publish(Some((&e, &Rollout::Rolling))),
        Some(v(2))
    );
    // Over an unproven or halted release, the last good one stays.
    let canary = Rollout::Canary { clean: 0, of: 1 };
    assert_eq!(previous_for_publish(Some((&e, &canary))), Some(v(1)));
    let halted = Rollout::Halted {
        by: "a".into(),
        why: String::new(),
    };
    assert_eq!(previous_for_publish(Some((&e, &halted))), Some(v(1)));
}

#[test]
fn canaries_by_fraction_are_at_least_one_stable_per_component_and_within_the_fleet() {
    let nodes: Vec<String> = (0..10).map(|i| format!("n{i}")).collect();
    let a = pick_canaries(0.2, &nodes, &v(1).digest);
    assert_eq!(a.len(), 2);
    assert_eq!(a, pick_canaries(0.2, &nodes, &v(1).digest));
    assert_eq!(pick_canaries(0.01, &nodes, &v(1).digest).len(), 1);
    assert_eq!(pick_canaries(5.0, &nodes, &v(1).digest).len(), 10);
    assert!(pick_canaries(0.0, &nodes, &v(1).digest).is_empty());
    assert!(pick_canaries(f64::NAN, &nodes, &v(1).digest).is_empty());
    assert!(pick_canaries(0.5, &[], &v(1).digest).is_empty());
    // Another component picks (over enough tries) other nodes.
    assert!((2..20u8).any(|n| pick_canaries(0.2, &nodes, &v(n).digest) != a));
}

#[test]
fn names_are_one_key_token_and_digests_64_lowercase_hex() {
    assert_eq!(name_refusal("channel", "edge-routes_1"), None);
    for bad in ["", "a.b", "a b", "a*", "a>", &"x".repeat(65)] {
        assert!(name_refusal("channel", bad).is_some(), "{bad:?}");
    }
    assert!(is_digest(&v(1).digest));
    assert!(!is_digest(&v(1).digest.to_uppercase().replace('0', "A")));
    assert!(!is_digest("abc"));
    assert_eq!(report_node("c", &report_key("c", "n1")), Some("n1"));
    assert_eq!(report_node("c", &release_key("c")), None);
    assert_eq!(report_node("c", "cc.node.x"), None);
}

#[test]
fn a_record_that_is_too_large_malformed_or_under_another_name_is_refused_with_why() {
    let e = entry(2, Some(1), &["a"]);
    let bytes = serde_json::to_vec(&e).expect("encodes");
    assert_eq!(decode_entry(&bytes), Ok(e.clone()));
    assert!(decode_entry(b"{").is_err());
    assert!(decode_entry(&vec![b' '; MAX_CHANNEL_RECORD + 1]).is_err_and(|w| w.contains("bytes")));
    let mut bad = e.clone();
    bad.desired.digest = "zz".into();
    let bytes = serde_json::to_vec(&bad).expect("encodes");
    assert!(decode_entry(&bytes).is_err_and(|w| w.contains("digest")));
    let mut bad = e;
    bad.canaries = vec!["a.b".into()];
    let bytes = serde_json::to_vec(&bad).expect("encodes");
    assert!(decode_entry(&bytes).is_err_and(|w| w.contains("canary")));
    let r = report("n1", 1, Judgement::Clean);
    let bytes = serde_json::to_vec(&r).expect("encodes");
    assert_eq!(decode_report("n1", &bytes), Ok(r));
    assert!(decode_report("n2", &bytes).is_err_and(|w| w.contains("names")));
    let mut too_long = report("n1", 1, Judgement::Clean);
    too_long.detail = "x".repeat(MAX_REPORT_DETAIL + 1);
    let bytes = serde_json::to_vec(&too_long).expect("encodes");
    assert!(decode_report("n1", &bytes).is_err_and(|w| w.contains("detail")));
    let mut waits = entry(2, Some(1), &["a"]);
    waits.shadow_wait_s = u64::MAX;
    let bytes = serde_json::to_vec(&waits).expect("encodes");
    assert!(decode_entry(&bytes).is_err_and(|w| w.contains("shadow_wait_s")));
    let long = "é".repeat(MAX_REPORT_DETAIL);
    let cut = report_detail(&long);
    assert!(cut.len() <= MAX_REPORT_DETAIL && cut.ends_with("..."));
}
