//! A release's waves (docs/channels.md, "Waves"): three nodes, one a wave each (`n0` in wave 1,
//! `n1` in wave 2, `n2` the last: every node not named earlier), releases published with those
//! waves one over the other, each version good or bad.
//!
//! Modelled: each node runs a version, has its own view of the bus (the release and every report
//! when it last read; a watch delivers in order, so a view is the bus as it once was) and knows its
//! own report. A node's step is [`protocol::next_step`] on [`protocol::rollout`] of its view; its
//! report is then what the follower owes: its judgement, what it runs and `baked` — clean, running
//! the desired version, no failed call since its swap, and its bake time passed since its swap
//! (`Bake`, the passing of time on that node's own clock) or its own report said it baked before
//! a restart while it runs that version. A bad version may trap on a node that runs it (`Trap`):
//! the follower's trap check judges it `trapped`. A node may restart (once a run): it starts on
//! [`protocol::start_version`] of the bus, its clock starts again, and it keeps its report.
//!
//! Explored breadth-first to [`DEPTH`] actions from the start (the whole space, three nodes with
//! views of their own, is too large for a unit test): two releases with a restart, or three
//! without. The mutations are searched without a bound.
//!
//! Properties (always): no node runs a release's version before its wave opened on the bus
//! (`NO_EARLY`); no node of a later wave runs it before every node of the earlier waves ran it
//! for the bake time with no failed call (`BAKED_FIRST`); a version that trapped on a node of a
//! wave before that node baked is never run by a node of a later wave (`UNTOUCHED`); no node
//! leaves a release's version for the previous one while the release is current and not halted
//! (`NO_RETREAT`); every release's `previous` is a version whose release rolled to every wave
//! (`PROVEN_PREVIOUS`). Sometimes: a release rolls through every wave to every node; one that
//! traps in wave 2 halts with the last wave's node never having run it.
//!
//! Mutations (each must produce a counterexample):
//! - `WaveIgnored` — `next_step`'s input forged: waves are taken for a rolling release;
//! - `BakeSkipped` — a node reports `baked` as soon as it runs the version clean;
//! - `RestartUnbakes` — a restarted node does not keep the bake its report said: the open wave
//!   falls back and a later wave's node is sent back to the previous version;
//! - `TrapUnjudged` — the follower's trap check forged away: a trap neither judges the release nor
//!   stops the node's bake;
//! - `PreviousFromWave` — `previous_for_publish` forged: a release still in its waves gives its
//!   version as the next release's `previous`.

use stateright::{Checker, HasDiscoveries, Model, Property};

use super::{number, version};
use crate::protocol::{self, ChannelEntry, Judgement, NodeReport, Rollout, Step, Wave};

const NODES: usize = 3;
const NAMES: [&str; NODES] = ["n0", "n1", "n2"];

const NO_EARLY: &str = "no node runs a release's version before its wave opened";
const BAKED_FIRST: &str = "no later wave runs a version before the earlier waves baked it";
const UNTOUCHED: &str = "a version that trapped unbaked in a wave reaches no later wave";
const NO_RETREAT: &str = "no node leaves a current release's version while it is not halted";
const PROVEN_PREVIOUS: &str = "every release's previous is a version whose release rolled";
const ROLLS: &str = "a release rolls through every wave to every node";
const HALTS_IN_WAVE_2: &str = "a version trapping in wave 2 halts before the last wave runs it";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mutation {
    None,
    WaveIgnored,
    BakeSkipped,
    RestartUnbakes,
    TrapUnjudged,
    PreviousFromWave,
}

/// A report: the release (1-based), the judgement, baked, the version run.
type Report = (u8, Judgement, bool, u8);

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    /// Per release: its version (the release's number) and previous.
    previous: Vec<Option<u8>>,
    /// Per version: whether it traps.
    bad: Vec<bool>,
    running: [u8; NODES],
    reports: [Report; NODES],
    views: [(u8, [Report; NODES]); NODES],
    /// Per node: its bake time passed since its swap (its clock); a failed call of what it runs
    /// since its swap; the bake its report said before a restart, kept.
    elapsed: [bool; NODES],
    failed: [bool; NODES],
    kept: [bool; NODES],
    restarted: bool,
    /// Ghosts: per node, the releases whose version it ran for the bake time with no failed call
    /// (bit `v - 1`); per release, the highest wave the bus ever had open, whether it rolled, the
    /// lowest wave whose node trapped on it unbaked; each property's violation seen.
    proven: [u8; NODES],
    opened: Vec<usize>,
    rolled: Vec<bool>,
    trapped_in: Vec<Option<usize>>,
    early: bool,
    unbaked_first: bool,
    touched: bool,
    retreated: bool,
    unproven: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Publish { bad: bool },
    Read(usize),
    Step(usize),
    Bake(usize),
    Trap(usize),
    Restart(usize),
}

struct WaveModel {
    mutation: Mutation,
    /// Releases, the first (rolled out before the run) included.
    releases: usize,
    /// Whether a node may restart (once a run).
    restarts: bool,
}

fn entry(release: u8, previous: Option<u8>) -> ChannelEntry {
    let wave = |spec: &str, nodes: &[&str]| Wave {
        spec: spec.into(),
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
    };
    ChannelEntry {
        desired: version(release),
        previous: previous.map(version),
        canaries: Vec::new(),
        canary_fraction: None,
        shadow_batches: 1,
        shadow_wait_s: 1,
        tolerance: 0,
        published_unix_ms: 0,
        waves: vec![
            wave("1", &["n0"]),
            wave("2", &["n1"]),
            wave("100%", &["n2"]),
        ],
        bake_s: 1,
    }
}

/// The wave of node `i` (1-based; the last is the rest).
fn wave(i: usize) -> usize {
    protocol::wave_of(&entry(1, None), NAMES[i])
}

/// The highest wave open in `state`.
fn open(state: &Rollout) -> usize {
    match state {
        Rollout::Wave { wave, .. } => *wave,
        Rollout::Rolling => NODES,
        Rollout::Canary { .. } | Rollout::Halted { .. } => 0,
    }
}

impl WaveModel {
    fn state(&self, s: &State, release: u8, reports: &[Report; NODES]) -> Rollout {
        let reports: Vec<NodeReport> = reports
            .iter()
            .enumerate()
            .map(|(i, &(rel, j, baked, runs))| NodeReport {
                node: NAMES[i].into(),
                release: u64::from(rel),
                outcome: j,
                detail: String::new(),
                running: Some(version(runs)),
                unix_ms: 0,
                baked,
            })
            .collect();
        let e = entry(release, s.previous[usize::from(release) - 1]);
        protocol::rollout(u64::from(release), &e, &reports)
    }

    fn current(s: &State) -> u8 {
        s.previous.len() as u8
    }

    fn truth(&self, s: &State) -> Rollout {
        self.state(s, Self::current(s), &s.reports)
    }

    /// The report node `i` owes of `release` as things are in `s`.
    fn report_due(&self, s: &State, i: usize, release: u8) -> Report {
        let (rel, j, _, _) = s.reports[i];
        let runs = s.running[i] == release;
        let judged = rel == release && (j == Judgement::Clean || j.halts());
        let j = match (judged, runs) {
            (true, _) => j,
            (false, true) => Judgement::Clean,
            (false, false) => Judgement::Pending,
        };
        let failed = s.failed[i] && self.mutation != Mutation::TrapUnjudged;
        let waited = s.elapsed[i] || s.kept[i] || self.mutation == Mutation::BakeSkipped;
        let baked = j == Judgement::Clean && runs && !failed && waited;
        (release, j, baked, s.running[i])
    }

    /// The state after node `i` took the step its view gives it, and wrote its report.
    fn stepped(&self, s: &State, i: usize) -> State {
        let mut n = s.clone();
        let (release, mut reports) = s.views[i];
        reports[i] = s.reports[i];
        let mut state = self.state(s, release, &reports);
        if self.mutation == Mutation::WaveIgnored && matches!(state, Rollout::Wave { .. }) {
            state = Rollout::Rolling;
        }
        let e = entry(release, s.previous[usize::from(release) - 1]);
        let (rel, j, _, _) = s.reports[i];
        let mine = (rel == release).then_some(j);
        let step = protocol::next_step(
            &e,
            &state,
            NAMES[i],
            Some(&version(s.running[i]).digest),
            mine,
        );
        if let Step::Swap(v) | Step::Shadow(v) = step {
            let v = number(&v);
            n.running[i] = v;
            n.elapsed[i] = false;
            n.failed[i] = false;
            n.kept[i] = false;
            if v == release {
                self.note_swap_in(&mut n, i, release);
            } else if s.running[i] == release && release == Self::current(s) {
                n.retreated |= !matches!(self.truth(s), Rollout::Halted { .. });
            }
        }
        n.reports[i] = self.report_due(&n, i, release);
        n
    }

    /// Ghosts: node `i` starts running release `release`'s version.
    fn note_swap_in(&self, n: &mut State, i: usize, release: u8) {
        let w = wave(i);
        let r = usize::from(release) - 1;
        n.early |= w > n.opened[r];
        n.unbaked_first |= (0..NODES).any(|p| wave(p) < w && n.proven[p] & (1 << r) == 0);
        n.touched |= n.trapped_in[usize::from(release) - 1].is_some_and(|t| w > t);
    }

    fn note(&self, n: &mut State) {
        let last = n.rolled.len() - 1;
        let truth = self.truth(n);
        n.opened[last] = n.opened[last].max(open(&truth));
        if truth == Rollout::Rolling {
            n.rolled[last] = true;
        }
    }
}

impl Model for WaveModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let report = (1, Judgement::Clean, true, 1);
        let reports = [report; NODES];
        vec![State {
            previous: vec![None],
            bad: vec![false],
            running: [1; NODES],
            reports,
            views: [(1, reports); NODES],
            elapsed: [true; NODES],
            failed: [false; NODES],
            kept: [false; NODES],
            restarted: false,
            proven: [1; NODES],
            opened: vec![NODES],
            rolled: vec![true],
            trapped_in: vec![None],
            early: false,
            unbaked_first: false,
            touched: false,
            retreated: false,
            unproven: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.previous.len() < self.releases {
            actions.push(Action::Publish { bad: false });
            actions.push(Action::Publish { bad: true });
        }
        let current = Self::current(s);
        for i in 0..NODES {
            if s.views[i] != (current, s.reports) {
                actions.push(Action::Read(i));
            }
            if self.stepped(s, i) != *s {
                actions.push(Action::Step(i));
            }
            if !s.elapsed[i] && s.running[i] == current {
                actions.push(Action::Bake(i));
            }
            let runs_bad = s.bad[usize::from(s.running[i]) - 1];
            if s.running[i] == current && runs_bad && !s.failed[i] {
                actions.push(Action::Trap(i));
            }
            if self.restarts && !s.restarted {
                actions.push(Action::Restart(i));
            }
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        let current = Self::current(s);
        match action {
            Action::Publish { bad } => {
                let cur = entry(current, s.previous[usize::from(current) - 1]);
                let state = self.truth(s);
                let previous = if self.mutation == Mutation::PreviousFromWave
                    && matches!(state, Rollout::Wave { .. })
                {
                    Some(current)
                } else {
                    protocol::previous_for_publish(Some((&cur, &state))).map(|v| number(&v))
                };
                n.unproven |= previous.is_some_and(|p| !s.rolled[usize::from(p) - 1]);
                n.previous.push(previous);
                n.bad.push(bad);
                n.rolled.push(false);
                n.opened.push(0);
                n.trapped_in.push(None);
            }
            Action::Read(i) => n.views[i] = (current, s.reports),
            Action::Step(i) => n = self.stepped(s, i),
            Action::Bake(i) => {
                n.elapsed[i] = true;
                if !s.failed[i] {
                    n.proven[i] |= 1 << (s.running[i] - 1);
                }
                let release = s.views[i].0;
                n.reports[i] = self.report_due(&n, i, release);
            }
            Action::Trap(i) => {
                n.failed[i] = true;
                let (_, _, baked, _) = s.reports[i];
                if !baked {
                    let t = &mut n.trapped_in[usize::from(current) - 1];
                    *t = Some(t.map_or(wave(i), |t| t.min(wave(i))));
                    n.touched |= (0..NODES).any(|j| wave(j) > wave(i) && s.running[j] == current);
                }
                if self.mutation != Mutation::TrapUnjudged {
                    n.reports[i] = (current, Judgement::Trapped, false, current);
                }
            }
            Action::Restart(i) => {
                n.restarted = true;
                let e = entry(current, s.previous[usize::from(current) - 1]);
                let v = protocol::start_version(&e, &self.truth(s), NAMES[i]).map(number)?;
                let (rel, j, baked, runs) = s.reports[i];
                if s.running[i] == current && v != current {
                    n.retreated |= !matches!(self.truth(s), Rollout::Halted { .. });
                }
                n.running[i] = v;
                n.views[i] = (current, s.reports);
                n.elapsed[i] = false;
                n.failed[i] = false;
                n.kept[i] = self.mutation != Mutation::RestartUnbakes
                    && baked
                    && j == Judgement::Clean
                    && runs == v;
                if v == current && s.running[i] != current {
                    self.note_swap_in(&mut n, i, current);
                }
                n.reports[i] = self.report_due(&n, i, rel.max(current));
            }
        }
        self.note(&mut n);
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(NO_EARLY, |_, s: &State| !s.early),
            Property::always(BAKED_FIRST, |_, s: &State| !s.unbaked_first),
            Property::always(UNTOUCHED, |_, s: &State| !s.touched),
            Property::always(NO_RETREAT, |_, s: &State| !s.retreated),
            Property::always(PROVEN_PREVIOUS, |_, s: &State| !s.unproven),
            Property::sometimes(ROLLS, |m: &WaveModel, s: &State| {
                let current = WaveModel::current(s);
                current > 1
                    && m.truth(s) == Rollout::Rolling
                    && s.running.iter().all(|v| *v == current)
            }),
            Property::sometimes(HALTS_IN_WAVE_2, |m: &WaveModel, s: &State| {
                let current = WaveModel::current(s);
                matches!(m.truth(s), Rollout::Halted { by, .. } if by == NAMES[1])
                    && s.trapped_in[usize::from(current) - 1] == Some(2)
                    && s.running.iter().all(|v| *v != current)
            }),
        ]
    }
}

/// Two releases with restarts (every property but `PROVEN_PREVIOUS`, which needs a publish over
/// a release in its waves), or three without (every property).
const CONFIGS: [(usize, bool); 2] = [(2, true), (3, false)];

/// Steps explored from the start (every path of at most this many actions): enough for a release
/// to roll through its three waves (9 steps), or to trap in wave 2, halt and return (10).
const DEPTH: usize = 12;

fn find(mutation: Mutation, property: &'static str) -> impl Checker<WaveModel> {
    let (releases, restarts) = if property == PROVEN_PREVIOUS {
        CONFIGS[1]
    } else {
        CONFIGS[0]
    };
    WaveModel {
        mutation,
        releases,
        restarts,
    }
    .checker()
    .finish_when(HasDiscoveries::AnyOf(std::collections::BTreeSet::from([
        property,
    ])))
    .spawn_bfs()
    .join()
}

#[test]
fn waves_open_in_order_each_after_the_earlier_ones_baked_and_a_trap_stops_the_later_ones() {
    for (releases, restarts) in CONFIGS {
        let c = WaveModel {
            mutation: Mutation::None,
            releases,
            restarts,
        }
        .checker()
        .target_max_depth(DEPTH)
        .spawn_bfs()
        .join();
        for p in [
            NO_EARLY,
            BAKED_FIRST,
            UNTOUCHED,
            NO_RETREAT,
            PROVEN_PREVIOUS,
        ] {
            c.assert_no_discovery(p);
        }
        for p in [ROLLS, HALTS_IN_WAVE_2] {
            assert!(c.discovery(p).is_some(), "{p} is reachable");
        }
        assert!(
            c.unique_state_count() > 1000,
            "{} states",
            c.unique_state_count()
        );
    }
}

#[test]
fn each_forged_wave_decision_is_caught() {
    for (mutation, property) in [
        (Mutation::WaveIgnored, NO_EARLY),
        (Mutation::BakeSkipped, BAKED_FIRST),
        (Mutation::RestartUnbakes, NO_RETREAT),
        (Mutation::TrapUnjudged, UNTOUCHED),
        (Mutation::PreviousFromWave, PROVEN_PREVIOUS),
    ] {
        let c = find(mutation, property);
        assert!(
            c.discovery(property).is_some(),
            "{mutation:?} found no counterexample to {property:?}"
        );
    }
}
