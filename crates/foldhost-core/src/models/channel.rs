//! Guest channels (docs/channels.md): a release rolled out to a fleet, halted, replaced.
//!
//! Modelled: [`NODES`] nodes following one channel, each running a version, each with its own
//! view of the bus — a snapshot of the release and every report, taken when it reads (a watch
//! delivers in the stream's order, so a view is always the bus as it once was) — and its own
//! report, which it always knows. Up to [`MAX_RELEASES`] releases are published, each a new
//! version that behaves well or badly, with node 0 as its canary or none; `previous` comes from
//! [`protocol::previous_for_publish`] on the release's state then. A node takes the step
//! [`protocol::next_step`] gives it on [`protocol::rollout`] of its view: a canary's shadow of a
//! bad version judges it `differed`, of a good one promotes it; a swap to a release's version
//! judges it `clean`, and a bad version so swapped in may later trap (`trapped`).
//!
//! A node may restart (once in a run): it starts on [`protocol::start_version`] of the bus and
//! keeps the judgement its report on the bus holds (the follower takes it back from the bus).
//!
//! Abstractions: fetching, compiling and the fold are one step (a refusal is a `differed` here:
//! both halt); a node's report reaches the bus in its step.
//!
//! Properties (always): no node other than a canary runs a release's version before that release
//! rolled (every canary clean); every release's `previous` is a version whose release rolled; a
//! halted release never resumes; at
//! rest (no node would read or change anything, every release published), no node runs a version
//! a node judged bad and every node runs what the release's state says. Sometimes: a release
//! halts and every node returns to the last good version; a release rolls to every node.
//!
//! Mutations (each must produce a counterexample):
//! - `NonCanaryEarly` — `next_step`'s answer forged: a node that is no canary swaps to the
//!   candidate while canaries judge;
//! - `PreviousUnproven` — `previous_for_publish` forged: `previous` is always the current desired
//!   version, proven or not;
//! - `TrapIgnored` — `rollout`'s input forged: `trapped` reports left out;
//! - `RestartForgets` — a restarted node forgets its judgement and reports `pending` (what the
//!   follower did before it took its own report back from the bus): a halt is erased.

use stateright::{Checker, HasDiscoveries, Model, Property};

use crate::protocol::{self, ChannelEntry, GuestVersion, Judgement, NodeReport, Rollout, Step};

mod waves;

/// Nodes following the channel (node 0 is the canary of a release that has one).
const NODES: usize = 2;
/// Releases published, the first included.
const MAX_RELEASES: usize = 3;
const NAMES: [&str; NODES] = ["n0", "n1"];

const NO_EARLY: &str = "no node other than a canary runs a release's version before it rolled";
const PROVEN_PREVIOUS: &str = "every release's previous is a version whose release rolled";
const AT_REST: &str =
    "at rest no node runs a version judged bad and every node runs what the state says";
const HALT_STAYS: &str = "a halted release never resumes";
const HALTS_AND_RETURNS: &str = "a release halts and every node returns to the last good one";
const ROLLS: &str = "a release rolls to every node";

/// One decision forged, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mutation {
    None,
    NonCanaryEarly,
    PreviousUnproven,
    TrapIgnored,
    RestartForgets,
}

/// A release: its version, the last good one, whether node 0 is its canary.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Release {
    desired: u8,
    previous: Option<u8>,
    canary: bool,
}

/// A report: the release judged (1-based) and the judgement.
type Report = Option<(u8, Judgement)>;

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    releases: Vec<Release>,
    /// Per version (1-based, index `v - 1`): whether it behaves badly.
    bad: Vec<bool>,
    running: [u8; NODES],
    reports: [Report; NODES],
    /// Each node's view: the release it last read, and every report then.
    views: [(u8, [Report; NODES]); NODES],
    /// Ghosts: per release, whether it ever rolled; a property's violation seen.
    rolled: Vec<bool>,
    early: bool,
    unproven: bool,
    /// Whether a node restarted (at most once a run).
    restarted: bool,
    /// Ghosts: per release, whether it was ever halted; whether a halted one resumed.
    halted: Vec<bool>,
    resumed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Publish { bad: bool, canary: bool },
    Read(usize),
    Step(usize),
    Trap(usize),
    Restart(usize),
}

struct ChannelModel {
    mutation: Mutation,
}

fn version(v: u8) -> GuestVersion {
    GuestVersion {
        digest: format!("{v:064x}"),
        name: "g".into(),
        version: v.to_string(),
        size: 1,
    }
}

fn number(v: &GuestVersion) -> u8 {
    u8::from_str_radix(&v.digest, 16).unwrap_or(0)
}

fn entry(r: &Release) -> ChannelEntry {
    ChannelEntry {
        desired: version(r.desired),
        previous: r.previous.map(version),
        canaries: if r.canary {
            vec![NAMES[0].into()]
        } else {
            Vec::new()
        },
        canary_fraction: None,
        shadow_batches: 1,
        shadow_wait_s: 1,
        tolerance: 0,
        published_unix_ms: 0,
        waves: Vec::new(),
        bake_s: 0,
    }
}

impl ChannelModel {
    /// The state of `release` from `reports`, as `rollout` derives it (forged under a mutation).
    fn state(&self, release: u8, r: &Release, reports: &[Report; NODES]) -> Rollout {
        let reports: Vec<NodeReport> = reports
            .iter()
            .enumerate()
            .filter_map(|(i, rep)| {
                let (release, j) = (*rep)?;
                if self.mutation == Mutation::TrapIgnored && j == Judgement::Trapped {
                    return None;
                }
                Some(NodeReport {
                    node: NAMES[i].into(),
                    release: u64::from(release),
                    outcome: j,
                    detail: String::new(),
                    running: None,
                    unix_ms: 0,
                    baked: false,
                })
            })
            .collect();
        protocol::rollout(u64::from(release), &entry(r), &reports)
    }

    /// The state of the current release on the bus.
    fn truth(&self, s: &State) -> Rollout {
        let n = s.releases.len() as u8;
        self.state(n, &s.releases[usize::from(n) - 1], &s.reports)
    }

    /// Node `i`'s step on its view (its own report overlaid), and the release it is of.
    fn step_of(&self, s: &State, i: usize) -> (u8, Step) {
        let (release, mut reports) = s.views[i];
        reports[i] = s.reports[i];
        let r = &s.releases[usize::from(release) - 1];
        let state = self.state(release, r, &reports);
        let mine = s.reports[i]
            .filter(|(rel, _)| *rel == release)
            .map(|(_, j)| j);
        let step = protocol::next_step(
            &entry(r),
            &state,
            NAMES[i],
            Some(&version(s.running[i]).digest),
            mine,
        );
        let forged = self.mutation == Mutation::NonCanaryEarly
            && matches!(state, Rollout::Canary { .. })
            && !(r.canary && i == 0)
            && s.running[i] != r.desired;
        (
            release,
            if forged {
                Step::Swap(version(r.desired))
            } else {
                step
            },
        )
    }

    /// The state after node `i` took its step.
    fn stepped(&self, s: &State, i: usize) -> State {
        let mut n = s.clone();
        let (release, step) = self.step_of(s, i);
        let r = s.releases[usize::from(release) - 1];
        let judge = |n: &mut State, j: Judgement| n.reports[i] = Some((release, j));
        match step {
            Step::Stay => {}
            Step::Shadow(v) => {
                let v = number(&v);
                if s.bad[usize::from(v) - 1] {
                    judge(&mut n, Judgement::Differed);
                } else {
                    n.running[i] = v;
                    judge(&mut n, Judgement::Clean);
                }
            }
            Step::Swap(v) => {
                let v = number(&v);
                n.running[i] = v;
                if v == r.desired {
                    judge(&mut n, Judgement::Clean);
                    let canary = r.canary && i == 0;
                    if !canary && !s.rolled[usize::from(release) - 1] {
                        n.early = true;
                    }
                }
            }
        }
        // The report a node owes when it has not judged: clean once it runs the version.
        if n.reports[i].is_none_or(|(rel, _)| rel != release) && n.running[i] == r.desired {
            judge(&mut n, Judgement::Clean);
        }
        n
    }

    fn can_trap(s: &State, i: usize) -> bool {
        let n = s.releases.len() as u8;
        let r = &s.releases[usize::from(n) - 1];
        s.running[i] == r.desired
            && s.bad[usize::from(r.desired) - 1]
            && s.reports[i] == Some((n, Judgement::Clean))
    }

    /// Nothing a node would read or change, every release published.
    fn at_rest(&self, s: &State) -> bool {
        s.releases.len() == MAX_RELEASES
            && (0..NODES).all(|i| {
                s.views[i] == (s.releases.len() as u8, s.reports)
                    && self.stepped(s, i) == *s
                    && !Self::can_trap(s, i)
            })
    }

    /// Every node runs what the current release's state says, and none a version judged bad.
    fn settled_well(&self, s: &State) -> bool {
        let r = s.releases[s.releases.len() - 1];
        let judged_bad = |v: u8| {
            s.reports
                .iter()
                .flatten()
                .any(|(rel, j)| j.halts() && s.releases[usize::from(*rel) - 1].desired == v)
        };
        let want = match self.truth(s) {
            Rollout::Rolling => Some(r.desired),
            Rollout::Halted { .. } => r.previous,
            Rollout::Canary { .. } | Rollout::Wave { .. } => return false,
        };
        s.running
            .iter()
            .all(|v| !judged_bad(*v) && want.is_none_or(|w| *v == w))
    }

    /// Marks the current release rolled or halted when it is, and a halted one that resumed.
    fn note_rolled(&self, n: &mut State) {
        let last = n.rolled.len() - 1;
        match self.truth(n) {
            Rollout::Rolling => n.rolled[last] = true,
            Rollout::Halted { .. } => n.halted[last] = true,
            Rollout::Canary { .. } | Rollout::Wave { .. } => {}
        }
        n.resumed |= n.halted[last] && !matches!(self.truth(n), Rollout::Halted { .. });
    }
}

impl Model for ChannelModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        // A first release, good, already rolled out: every node runs it.
        let first = Release {
            desired: 1,
            previous: None,
            canary: false,
        };
        let reports = [Some((1, Judgement::Clean)); NODES];
        vec![State {
            releases: vec![first],
            bad: vec![false],
            running: [1; NODES],
            reports,
            views: [(1, reports); NODES],
            rolled: vec![true],
            early: false,
            unproven: false,
            restarted: false,
            halted: vec![false],
            resumed: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.releases.len() < MAX_RELEASES {
            for bad in [false, true] {
                for canary in [false, true] {
                    actions.push(Action::Publish { bad, canary });
                }
            }
        }
        for i in 0..NODES {
            if s.views[i] != (s.releases.len() as u8, s.reports) {
                actions.push(Action::Read(i));
            }
            if self.stepped(s, i) != *s {
                actions.push(Action::Step(i));
            }
            if Self::can_trap(s, i) {
                actions.push(Action::Trap(i));
            }
            if !s.restarted {
                actions.push(Action::Restart(i));
            }
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = match action {
            Action::Publish { bad, canary } => {
                let mut n = s.clone();
                let cur = s.releases[s.releases.len() - 1];
                let state = self.truth(s);
                let previous = if self.mutation == Mutation::PreviousUnproven {
                    Some(cur.desired)
                } else {
                    protocol::previous_for_publish(Some((&entry(&cur), &state))).map(|v| number(&v))
                };
                n.unproven |= previous.is_some_and(|p| {
                    !s.releases
                        .iter()
                        .zip(&s.rolled)
                        .any(|(r, rolled)| r.desired == p && *rolled)
                });
                let v = s.releases.len() as u8 + 1;
                n.bad.push(bad);
                n.releases.push(Release {
                    desired: v,
                    previous,
                    canary,
                });
                n.rolled.push(false);
                n.halted.push(false);
                n
            }
            Action::Read(i) => {
                let mut n = s.clone();
                n.views[i] = (s.releases.len() as u8, s.reports);
                n
            }
            Action::Step(i) => self.stepped(s, i),
            Action::Trap(i) => {
                let mut n = s.clone();
                n.reports[i] = Some((s.releases.len() as u8, Judgement::Trapped));
                n
            }
            Action::Restart(i) => {
                let mut n = s.clone();
                n.restarted = true;
                let release = s.releases.len() as u8;
                let r = s.releases[usize::from(release) - 1];
                let state = self.truth(s);
                // A node whose only release is halted does not start; it is not modelled.
                let v = protocol::start_version(&entry(&r), &state, NAMES[i]).map(number)?;
                n.running[i] = v;
                n.views[i] = (release, s.reports);
                if self.mutation == Mutation::RestartForgets
                    && s.reports[i].is_some_and(|(rel, j)| rel == release && j.halts())
                {
                    n.reports[i] = Some((release, Judgement::Pending));
                }
                n
            }
        };
        self.note_rolled(&mut n);
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(NO_EARLY, |_, s: &State| !s.early),
            Property::always(PROVEN_PREVIOUS, |_, s: &State| !s.unproven),
            Property::always(HALT_STAYS, |_, s: &State| !s.resumed),
            Property::always(AT_REST, |m: &ChannelModel, s: &State| {
                !m.at_rest(s) || m.settled_well(s)
            }),
            Property::sometimes(HALTS_AND_RETURNS, |m: &ChannelModel, s: &State| {
                let r = s.releases[s.releases.len() - 1];
                matches!(m.truth(s), Rollout::Halted { .. })
                    && r.previous.is_some()
                    && s.running.iter().all(|v| Some(*v) == r.previous)
                    && s.reports
                        .iter()
                        .flatten()
                        .any(|(_, j)| *j == Judgement::Trapped)
            }),
            Property::sometimes(ROLLS, |m: &ChannelModel, s: &State| {
                let r = s.releases[s.releases.len() - 1];
                s.releases.len() > 1
                    && r.canary
                    && m.truth(s) == Rollout::Rolling
                    && s.running.iter().all(|v| *v == r.desired)
            }),
        ]
    }
}

fn check(mutation: Mutation) -> impl Checker<ChannelModel> {
    ChannelModel { mutation }.checker().spawn_bfs().join()
}

/// The model under `mutation`, explored until `property` has a discovery (or everything was).
fn find(mutation: Mutation, property: &'static str) -> impl Checker<ChannelModel> {
    ChannelModel { mutation }
        .checker()
        .finish_when(HasDiscoveries::AnyOf(std::collections::BTreeSet::from([
            property,
        ])))
        .spawn_bfs()
        .join()
}

#[test]
fn a_rollout_never_runs_a_version_early_keeps_a_proven_previous_and_settles_on_what_its_state_says()
{
    let c = check(Mutation::None);
    for p in [NO_EARLY, PROVEN_PREVIOUS, HALT_STAYS, AT_REST] {
        c.assert_no_discovery(p);
    }
    for p in [HALTS_AND_RETURNS, ROLLS] {
        assert!(c.discovery(p).is_some(), "{p} is reachable");
    }
    assert!(
        c.unique_state_count() > 1000,
        "{} states",
        c.unique_state_count()
    );
}

#[test]
fn each_forged_rollout_decision_is_caught() {
    for (mutation, property) in [
        (Mutation::NonCanaryEarly, NO_EARLY),
        (Mutation::PreviousUnproven, PROVEN_PREVIOUS),
        (Mutation::TrapIgnored, AT_REST),
        (Mutation::RestartForgets, HALT_STAYS),
    ] {
        let c = find(mutation, property);
        assert!(
            c.discovery(property).is_some(),
            "{mutation:?} found no counterexample to {property:?}"
        );
    }
}
