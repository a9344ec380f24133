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
        waves: Vec::new(),
        bake_s: 0,
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
        baked: false,
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
    assert_eq!(start_version(&first, &halted, "a"), None);
}

#[test]
fn a_node_starting_runs_the_desired_version_only_once_it_rolls() {
    let e = entry(2, Some(1), &["a"]);
    assert_eq!(start_version(&e, &Rollout::Rolling, "b"), Some(&v(2)));
    assert_eq!(
        start_version(&e, &Rollout::Canary { clean: 0, of: 1 }, "b"),
        Some(&v(1))
    );
    let halted = Rollout::Halted {
        by: "a".into(),
        why: String::new(),
    };
    assert_eq!(start_version(&e, &halted, "b"), Some(&v(1)));
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

/// Release 2 over 1 with waves `[a] [b] [c, d] [rest]` and a bake of 60 s.
fn waved() -> ChannelEntry {
    let mut e = entry(2, Some(1), &[]);
    let w = |spec: &str, nodes: &[&str]| Wave {
        spec: spec.into(),
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
    };
    e.waves = vec![
        w("1", &["a"]),
        w("2", &["b"]),
        w("50%", &["c", "d"]),
        w("100%", &["e"]),
    ];
    e.bake_s = 60;
    e
}

/// A report of release 7 by `node`: `outcome`, running `running`, baked or not.
fn ran(node: &str, outcome: Judgement, running: u8, baked: bool) -> NodeReport {
    NodeReport {
        running: Some(v(running)),
        baked,
        ..report(node, 7, outcome)
    }
}

#[test]
fn waves_resolve_in_the_canary_ranking_each_adding_a_node_while_any_is_left_and_the_last_takes_the_rest()
 {
    let specs = |s: &str| s.split(',').map(str::to_string).collect::<Vec<_>>();
    let nodes: Vec<String> = (0..4).map(|i| format!("n{i}")).collect();
    let d = v(1).digest;
    let w = resolve_waves(&specs("1,10%,50%,100%"), &nodes, &[], &d).expect("resolves");
    let sizes: Vec<usize> = w.iter().map(|w| w.nodes.len()).collect();
    // 10% of 4 is one node, already reached: the wave adds one anyway.
    assert_eq!(sizes, [1, 1, 1, 1]);
    let order: Vec<String> = w.iter().flat_map(|w| w.nodes.clone()).collect();
    assert_eq!(
        order,
        pick_canaries(1.0, &nodes, &d),
        "the canaries' ranking"
    );
    // Canaries come before every wave and are in none; percentages count the others.
    let canaries = vec![order[0].clone()];
    let w = resolve_waves(&specs("50%,100%"), &nodes, &canaries, &d).expect("resolves");
    assert_eq!(w[0].nodes, order[1..3]);
    assert_eq!(w[1].nodes, order[3..]);
    // More waves than nodes: the ones past the fleet name none.
    let two = &nodes[..2];
    let w = resolve_waves(&specs("1,2,3,100%"), two, &[], &d).expect("resolves");
    let sizes: Vec<usize> = w.iter().map(|w| w.nodes.len()).collect();
    assert_eq!(sizes, [1, 1, 0, 0]);
    // No node known: every wave is empty, the last is whoever comes.
    let w = resolve_waves(&specs("1,100%"), &[], &[], &d).expect("resolves");
    assert!(w.iter().all(|w| w.nodes.is_empty()));
}

#[test]
fn malformed_waves_are_refused_in_one_line() {
    let specs = |s: &str| s.split(',').map(str::to_string).collect::<Vec<_>>();
    for (bad, says) in [
        ("1,50%", "must be 100%"),
        ("100%,100%", "only the last"),
        ("5,2,100%", "no larger"),
        ("50%,10%,100%", "no larger"),
        ("0,100%", "a number of nodes"),
        ("x,100%", "a number of nodes"),
        ("101%", "a number of nodes"),
        ("05%,100%", "a number of nodes"),
        ("+1,100%", "a number of nodes"),
        ("", "a number of nodes"),
    ] {
        let why = waves_refusal(&specs(bad)).unwrap_or_default();
        assert!(why.contains(says), "{bad:?}: {why:?}");
    }
    assert!(waves_refusal(&vec!["1".to_string(); MAX_WAVES + 1]).is_some());
    assert_eq!(waves_refusal(&specs("1,10%,50%,100%")), None);
    assert_eq!(waves_refusal(&specs("100%")), None);
}

#[test]
fn an_entry_with_waves_carries_the_fence_older_nodes_refuse_and_decodes_without_it() {
    let e = waved();
    let bytes = serde_json::to_vec(&e).expect("encodes");
    let wire: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
    assert_eq!(wire["canaries"], serde_json::json!([WAVES_FENCE]));
    // What an older node checks of every canary name: the fence fails it.
    assert!(name_refusal("canary", WAVES_FENCE).is_some());
    assert_eq!(decode_entry(&bytes), Ok(e));
    // An entry without waves is as it always was: no fence, no new field.
    let plain = serde_json::to_value(entry(2, Some(1), &["a"])).expect("encodes");
    assert!(plain.get("waves").is_none() && plain.get("bake_s").is_none());
    // The fence without waves, or waves without it, is refused.
    let mut forged = plain.clone();
    forged["canaries"] = serde_json::json!(["a", WAVES_FENCE]);
    assert!(
        decode_entry(forged.to_string().as_bytes()).is_err_and(|w| w.contains("without waves"))
    );
    let mut forged = wire.clone();
    forged["canaries"] = serde_json::json!([]);
    assert!(decode_entry(forged.to_string().as_bytes()).is_err_and(|w| w.contains("fence")));
}

#[test]
fn an_entry_whose_waves_are_malformed_overlap_or_name_a_canary_is_refused() {
    let refused = |f: &dyn Fn(&mut ChannelEntry), says: &str| {
        let mut e = waved();
        f(&mut e);
        let bytes = serde_json::to_vec(&e).expect("encodes");
        let why = decode_entry(&bytes).expect_err("refused");
        assert!(why.contains(says), "{says}: {why}");
    };
    refused(&|e| e.waves[1].nodes.push("a".into()), "two waves");
    refused(&|e| e.canaries.push("a".into()), "is a canary");
    refused(&|e| e.waves[0].nodes.push("a.b".into()), "wave node");
    refused(&|e| e.waves[3].spec = "90%".into(), "100%");
    refused(&|e| e.bake_s = MAX_BAKE_S + 1, "bake_s");
    refused(
        &|e| e.waves[0].nodes = (0..=MAX_WAVE_NODES).map(|i| format!("n{i}")).collect(),
        "most",
    );
}

#[test]
fn a_wave_opens_only_once_every_node_of_the_earlier_waves_baked_and_the_last_is_rolling() {
    let e = waved();
    let wave = |wave, baked, in_wave| Rollout::Wave {
        wave,
        of: 4,
        baked,
        in_wave,
    };
    assert_eq!(rollout(7, &e, &[]), wave(1, 0, 1));
    // Clean and running it is not enough: baked.
    assert_eq!(
        rollout(7, &e, &[ran("a", Judgement::Clean, 2, false)]),
        wave(1, 0, 1)
    );
    // Baked but running something else (or not clean, or of another release) counts nothing.
    assert_eq!(
        rollout(7, &e, &[ran("a", Judgement::Clean, 1, true)]),
        wave(1, 0, 1)
    );
    assert_eq!(
        rollout(7, &e, &[ran("a", Judgement::Pending, 2, true)]),
        wave(1, 0, 1)
    );
    let mut other = ran("a", Judgement::Clean, 2, true);
    other.release = 6;
    assert_eq!(rollout(7, &e, &[other]), wave(1, 0, 1));
    let a = ran("a", Judgement::Clean, 2, true);
    assert_eq!(rollout(7, &e, std::slice::from_ref(&a)), wave(2, 0, 1));
    let b = ran("b", Judgement::Clean, 2, true);
    let c = ran("c", Judgement::Clean, 2, true);
    let three = [a.clone(), b.clone(), c.clone()];
    assert_eq!(rollout(7, &e, &three), wave(3, 1, 2));
    assert_eq!(unbaked(7, &e, &wave(3, 1, 2), &three), ["d"]);
    let d = ran("d", Judgement::Clean, 2, true);
    assert_eq!(rollout(7, &e, &[a, b, c, d]), Rollout::Rolling);
    // A trap in any wave halts it.
    let trapped = [ran("b", Judgement::Trapped, 2, false)];
    assert!(matches!(rollout(7, &e, &trapped), Rollout::Halted { by, .. } if by == "b"));
    // Canaries first: no wave opens before they are clean.
    let mut e = waved();
    e.canaries = vec!["z".into()];
    assert_eq!(rollout(7, &e, &[]), Rollout::Canary { clean: 0, of: 1 });
    let z = ran("z", Judgement::Clean, 2, false);
    assert_eq!(rollout(7, &e, &[z]), wave(1, 0, 1));
    // A first release has no waves to wait for.
    let mut first = waved();
    first.previous = None;
    assert_eq!(rollout(7, &first, &[]), Rollout::Rolling);
}

#[test]
fn a_node_swaps_when_its_wave_opens_and_runs_the_last_good_version_before() {
    let e = waved();
    let (one, two) = (v(1).digest, v(2).digest);
    let open2 = Rollout::Wave {
        wave: 2,
        of: 4,
        baked: 0,
        in_wave: 1,
    };
    assert_eq!(wave_of(&e, "a"), 1);
    assert_eq!(wave_of(&e, "d"), 3);
    assert_eq!(wave_of(&e, "e"), 4);
    assert_eq!(
        wave_of(&e, "never-heard-of"),
        4,
        "the last wave is the rest"
    );
    for me in ["a", "b"] {
        assert_eq!(
            next_step(&e, &open2, me, Some(&one), None),
            Step::Swap(v(2))
        );
        assert_eq!(next_step(&e, &open2, me, Some(&two), None), Step::Stay);
        assert_eq!(start_version(&e, &open2, me), Some(&v(2)));
    }
    for me in ["c", "e", "new"] {
        assert_eq!(next_step(&e, &open2, me, Some(&one), None), Step::Stay);
        // One running the candidate too early is sent back.
        assert_eq!(
            next_step(&e, &open2, me, Some(&two), None),
            Step::Swap(v(1))
        );
        assert_eq!(start_version(&e, &open2, me), Some(&v(1)));
    }
    // A node of an open wave that judged it bad does not swap to it again.
    assert_eq!(
        next_step(&e, &open2, "b", Some(&one), Some(Judgement::Trapped)),
        Step::Stay
    );
    // A canary is before every wave: once the waves open it runs the version.
    let mut c = waved();
    c.canaries = vec!["z".into()];
    assert_eq!(wave_of(&c, "z"), 0);
    assert_eq!(next_step(&c, &open2, "z", Some(&two), None), Step::Stay);
    assert_eq!(start_version(&c, &open2, "z"), Some(&v(2)));
}

#[test]
fn a_release_in_its_waves_gives_no_previous_to_the_next_publish() {
    let e = waved();
    let open3 = Rollout::Wave {
        wave: 3,
        of: 4,
        baked: 0,
        in_wave: 2,
    };
    assert_eq!(previous_for_publish(Some((&e, &open3))), Some(v(1)));
    assert_eq!(
        previous_for_publish(Some((&e, &Rollout::Rolling))),
        Some(v(2))
    );
}

#[test]
fn a_report_without_baked_decodes_as_not_baked() {
    let r = report("n1", 1, Judgement::Clean);
    let mut json = serde_json::to_value(&r).expect("encodes");
    json.as_object_mut().expect("object").remove("baked");
    let back = decode_report("n1", json.to_string().as_bytes()).expect("decodes");
    assert!(!back.baked);
}

#[test]
fn a_report_under_a_key_that_is_no_node_name_is_refused() {
    for node in ["a.b", "=x", "", "n*"] {
        let report = format!(
            r#"{{"node":"{node}","release":1,"outcome":"clean","detail":"","running":null,"unix_ms":0}}"#
        );
        assert!(
            decode_report(node, report.as_bytes()).is_err(),
            "{node:?} is refused"
        );
    }
}
