//! The fleet (docs/design.md, "Transport and export rounds"): exporters publishing their folds
//! through the artifact transport, a pruner, a bootstrapping node, and the export lease.
//!
//! Modelled, [`FleetModel`]: a bucket that evicts current values (where artifacts are what a fleet
//! rebuilds from) whose log takes up to [`MAX_OPS`] puts and deletes of [`KEYS`] keys, its first
//! retained revision advancing over anything; [`EXPORTERS`] exporters, each folding the log with
//! its own cursor — a delivery past a gap is the floor guard's ([`protocol::floor_guard_trips`]),
//! a cursor-less start repairs first when [`protocol::cursorless_start_needs_repair`] says so, and
//! an expired exporter restores from the published artifact ([`protocol::restore_allowed`],
//! [`protocol::restore_key`] per key with the live listing) — and each exporting its fold at its
//! cursor in an export round: the payload uploaded (a new content-addressed object), then the
//! pointer read, then published by a conditional put on the version read
//! ([`protocol::pointer_publish_allowed`] on what was read: a `false` abandons the round; a changed
//! version reads again); a prune pass (`ArtifactTransport::prune`) that reads the pointer, lists
//! the payloads and judges each with [`protocol::payload_prunable`], then deletes the doomed ones
//! one by one while the fleet moves on; a node that bootstraps: it reads the pointer, then fetches
//! that payload. Export rounds are not gated by the lease here (it is work-dedup, not a
//! correctness gate, and without it every interleaving of rounds is explored).
//!
//! Modelled, [`LeaseModel`]: [`NODES`] nodes and one lease key holding a value (absent, or a
//! lease's expiry) and a revision, under one clock that advances; a node reads the key, then takes
//! it when [`protocol::lease_takeover_allowed`] says so, by a write conditional on the revision
//! read; a holder releases it (`complete` or `abandon`: expiry set to now) by a write conditional
//! on the revision it wrote, and learns it lost the lease when that fails.
//!
//! Abstractions: a restore is one step (the repair model has it as steps); a cursor-less start on
//! a bucket nothing was evicted from yet is a floor-guarded watch from revision 0 (the state-sync
//! re-list's own window is the repair model's); the exporters are interchangeable, so the full
//! check explores one state for each order of them.
//!
//! Axioms:
//! - Payload age is abstracted as "older than the grace" or not, taken when a prune pass starts (a
//!   payload uploaded since is younger than any grace). Under [`Grace::OutlastsEveryRound`] (the
//!   shipped 4 × lease TTL) a payload is older than the grace only if no export round holds it
//!   unpublished: the grace outlasts an upload-to-publish. Under [`Grace::Zero`] every listed
//!   payload is older than the grace.
//! - The time since a payload was replaced as the pointer's target is abstracted the same way:
//!   under [`Grace::OutlastsEveryRound`] it is past the grace only if no bootstrap has read the
//!   pointer naming it and not yet fetched it (the grace outlasts a bootstrap's download).
//! - An export round exports a settled fold (its cursor exactly); exporters fold in revision order.
//! - One clock for the lease: every node reads the same time (NTP-sane clocks), and a lease's
//!   value is never corrupted while held (a corrupt lease is taken over by design).
//!
//! Properties (always): the published cursor never regresses; the pointer's target is always
//! fetchable; every published artifact is the truth at its cursor — exactly so for every key not
//! written after its cursor (a restored exporter keeps a key the artifact lacks while the bucket
//! lists it live, so a key written after the cursor may hold an older value, or none: the resume
//! delivers it); a bootstrapped node holds the truth at its artifact's cursor in the same sense; a
//! bootstrap finds the payload the pointer it read named (under the shipped grace); at most one
//! node holds an unexpired lease. Sometimes: an exporter that restored from the fleet's
//! artifact publishes; a node bootstraps; a lease changes hands.
//!
//! Mutations (each must produce a counterexample):
//! - `PublishEqualOrBackward` — the pointer read is forged `Absent`, so a lower cursor is allowed;
//! - `PruneIgnoresPointer` — the prune judges without the pointer: `is_pointer_target` forged
//!   `false` and the pointer's cursor forged past every payload;
//! - `PruneAtOrAbovePointer` — only the pointer's cursor is forged past every payload (the rule
//!   before payload names carried cursors): at zero grace a pass deletes the payload an exporter is
//!   about to name;
//! - `PointerBeforeUpload` — the pointer is published before the payload is uploaded;
//! - `PruneAgesFromUpload` — the time since a payload was replaced is forged as its age since its
//!   upload (the rule before the pointer recorded its previous targets): a pass deletes the payload
//!   a bootstrap read the pointer for just before it moved;
//! - `ExporterPublishesUnrepairedFold` — an expired exporter skips the repair and carries on from
//!   the first retained revision (what NATS does to a consumer started below it), then publishes;
//! - `LeaseWithoutCas` — a take is written on a stale read without the revision check.
//!
//! Zero grace is checked too (`at_zero_grace_the_pointers_target_stays_fetchable`): a prune takes
//! only payloads below the pointer's cursor. Before `payload_prunable` took the cursors, this
//! model found a pass deleting the payload an exporter was about to name.

use std::collections::BTreeSet;
use std::time::Duration;

use super::log::{self, Op};
use stateright::{Checker, HasDiscoveries, Model, Property};

use crate::protocol::{self, LeaseState, PointerState, RepairMode, Retention};

mod steps;

/// Keys in the bucket.
const KEYS: u8 = 2;
/// Puts and deletes the log takes.
const MAX_OPS: usize = 3;
/// Exporters in the fleet.
const EXPORTERS: usize = 2;
/// Export rounds per exporter.
const ROUNDS: u8 = 1;
/// Payloads ever uploaded (one per round).
const PAYLOADS: usize = EXPORTERS * ROUNDS as usize;
/// `--repair auto`, with the fleet's artifact as the restore source.
const MODE: RepairMode = RepairMode::Auto;

/// Nodes contending for the lease.
const NODES: usize = 2;
/// The lease's time to live, in clock ticks.
const TTL: u64 = 2;
/// The clock's last tick.
const LAST_TICK: u64 = 4;
/// Writes the lease key takes.
const MAX_LEASE_WRITES: u8 = 4;

const NO_REGRESSION: &str = "the published cursor never regresses";
const FETCHABLE: &str = "the pointer's target is always fetchable";
const ARTIFACT_TRUE: &str = "every published artifact is the truth at its cursor";
const BOOTSTRAP_TRUE: &str = "a bootstrapped node holds the truth at its artifact's cursor";
const RESTORED_PUBLISHES: &str = "an exporter that restored publishes";
const BOOTSTRAPS: &str = "a node bootstraps";
const BOOT_FETCHES: &str = "a bootstrap finds the payload the pointer it read named";
const ONE_HOLDER: &str = "at most one node holds an unexpired lease";
const LEASE_TAKEN: &str = "the lease changes hands";

/// One decision forged, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mutation {
    None,
    PublishEqualOrBackward,
    PruneIgnoresPointer,
    PruneAtOrAbovePointer,
    PointerBeforeUpload,
    PruneAgesFromUpload,
    ExporterPublishesUnrepairedFold,
    LeaseWithoutCas,
}

/// How long a payload is kept after it is replaced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Grace {
    /// `--grace-secs 0`.
    Zero,
    /// Longer than any upload-to-publish and any prune pass.
    OutlastsEveryRound,
}

impl Grace {
    fn duration(self) -> Duration {
        match self {
            Grace::Zero => Duration::ZERO,
            Grace::OutlastsEveryRound => Duration::from_secs(4 * 60),
        }
    }

    /// A payload's age, as the abstraction has it: past the grace or not.
    fn age(self, older: bool) -> Duration {
        if older {
            self.duration() + Duration::from_millis(1)
        } else {
            Duration::ZERO
        }
    }
}

/// The bucket's log.
type Log = log::Log<MAX_OPS>;

impl Log {
    /// The truth after the first `upto` messages: the key's latest put, unless deleted since.
    fn truth_at(&self, upto: u8, key: u8) -> Option<u8> {
        self[..upto as usize]
            .iter()
            .enumerate()
            .rev()
            .find(|(_, o)| o.key == key)
            .and_then(|(i, o)| o.put.then_some(i as u8 + 1))
    }

    /// Whether `key` is written after revision `rev`.
    fn written_after(&self, rev: u8, key: u8) -> bool {
        self[rev as usize..].iter().any(|o| o.key == key)
    }

    /// Whether a fold at `cursor` holding `entries` is the truth at `cursor` for every key not
    /// written after it (the resume delivers the others).
    fn agrees(&self, cursor: u8, entries: [Option<u8>; KEYS as usize]) -> bool {
        (0..KEYS).all(|k| {
            entries[k as usize] == self.truth_at(cursor, k) || self.written_after(cursor, k)
        })
    }
}

/// An uploaded (or, under a mutation, named) payload: an exporter's fold at its cursor.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Payload {
    cursor: u8,
    entries: [Option<u8>; KEYS as usize],
    /// In the object store.
    present: bool,
}

/// Where an exporter's fold stands.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
enum Status {
    /// Not started (no cursor, no data).
    Fresh,
    /// Watching.
    Running,
    /// Its cursor expired: a restore must come first.
    Expired,
}

/// An export round under way.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
struct Round {
    payload: u8,
    uploaded: bool,
    /// The pointer version read (the conditional put's precondition).
    read: Option<u8>,
    published: bool,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
struct Exporter {
    status: Status,
    cursor: Option<u8>,
    fold: [Option<u8>; KEYS as usize],
    rounds: u8,
    round: Option<Round>,
    restored: bool,
}

/// The bootstrapping node.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Boot {
    Idle,
    /// Read the pointer: its target.
    Read(u8),
    /// Fetched and imported this payload.
    Done(u8),
    /// The payload was gone (a visible failure: it tries again later).
    Failed,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct FleetState {
    log: Log,
    first: u8,
    exporters: [Exporter; EXPORTERS],
    payloads: [Option<Payload>; PAYLOADS],
    pointer: Option<u8>,
    /// The pointer object's version (its ETag).
    version: u8,
    /// A prune pass's doomed payloads, decided when it read the pointer and listed the payloads,
    /// not yet deleted.
    doomed: [bool; PAYLOADS],
    boot: Boot,
    /// What the properties look at.
    regressed: bool,
    restored_published: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum FleetAction {
    Write { key: u8, put: bool },
    Evict,
    Start(usize),
    Deliver(usize),
    Restore(usize),
    Export(usize),
    Upload(usize),
    ReadPointer(usize),
    Publish(usize),
    PruneList,
    PruneDelete(u8),
    BootRead,
    BootFetch,
}

struct FleetModel {
    mutation: Mutation,
    grace: Grace,
}

impl FleetState {
    fn retention(&self) -> Retention {
        Retention {
            evicts_current_values: true,
            first_revision: u64::from(self.first),
        }
    }

    /// The bucket's live listing has `key`: its latest message is a retained put.
    fn listed(&self, key: u8) -> bool {
        let len = self.log.len() as u8;
        self.log
            .truth_at(len, key)
            .is_some_and(|rev| rev >= self.first)
    }

    /// The pointer's state as a publisher reads it.
    fn pointer_state(&self) -> PointerState {
        match self.pointer.and_then(|t| self.payloads[t as usize]) {
            Some(p) => PointerState::At(p.cursor.into()),
            None => PointerState::Absent,
        }
    }

    /// Whether an export round holds payload `j` and has not published it yet.
    fn held(&self, j: u8) -> bool {
        self.exporters
            .iter()
            .any(|e| e.round.is_some_and(|r| r.payload == j && !r.published))
    }
}

impl Model for FleetModel {
    type State = FleetState;
    type Action = FleetAction;

    fn init_states(&self) -> Vec<FleetState> {
        let exporter = Exporter {
            status: Status::Fresh,
            cursor: None,
            fold: [None; KEYS as usize],
            rounds: 0,
            round: None,
            restored: false,
        };
        vec![FleetState {
            log: Log::default(),
            first: 1,
            exporters: [exporter; EXPORTERS],
            payloads: [None; PAYLOADS],
            pointer: None,
            version: 0,
            doomed: [false; PAYLOADS],
            boot: Boot::Idle,
            regressed: false,
            restored_published: false,
        }]
    }

    fn actions(&self, s: &FleetState, actions: &mut Vec<FleetAction>) {
        let len = s.log.len() as u8;
        if s.log.len() < MAX_OPS {
            for key in 0..KEYS {
                actions.push(FleetAction::Write { key, put: true });
                if s.log.truth_at(len, key).is_some() {
                    actions.push(FleetAction::Write { key, put: false });
                }
            }
        }
        if s.first <= len {
            actions.push(FleetAction::Evict);
        }
        if s.doomed.contains(&true) {
            for (j, doomed) in s.doomed.iter().enumerate() {
                if *doomed {
                    actions.push(FleetAction::PruneDelete(j as u8));
                }
            }
        } else {
            actions.push(FleetAction::PruneList);
        }
        for (i, e) in s.exporters.iter().enumerate() {
            let unrepaired = self.mutation == Mutation::ExporterPublishesUnrepairedFold;
            match e.status {
                Status::Fresh => actions.push(FleetAction::Start(i)),
                Status::Running if e.cursor.unwrap_or(0) < len => {
                    actions.push(FleetAction::Deliver(i))
                }
                Status::Expired => {
                    actions.push(FleetAction::Restore(i));
                    if unrepaired {
                        actions.push(FleetAction::Deliver(i));
                    }
                }
                Status::Running => {}
            }
            match e.round {
                None if e.status == Status::Running && e.cursor.is_some() && e.rounds < ROUNDS => {
                    actions.push(FleetAction::Export(i))
                }
                None => {}
                Some(r) => {
                    let upload_first = self.mutation != Mutation::PointerBeforeUpload;
                    if !r.uploaded && (upload_first || r.published) {
                        actions.push(FleetAction::Upload(i));
                    }
                    if !r.published && r.read.is_none() && (r.uploaded || !upload_first) {
                        actions.push(FleetAction::ReadPointer(i));
                    }
                    if r.read.is_some() {
                        actions.push(FleetAction::Publish(i));
                    }
                }
            }
        }
        match s.boot {
            Boot::Idle | Boot::Failed if s.pointer.is_some() => actions.push(FleetAction::BootRead),
            Boot::Read(_) => actions.push(FleetAction::BootFetch),
            _ => {}
        }
    }

    fn next_state(&self, s: &FleetState, action: FleetAction) -> Option<FleetState> {
        let mut n = s.clone();
        match action {
            FleetAction::Write { key, put } => n.log.push(Op { key, put }),
            FleetAction::Evict => n.first += 1,
            FleetAction::Start(i) => Self::start(&mut n, i),
            FleetAction::Deliver(i) => self.deliver(&mut n, i)?,
            FleetAction::Restore(i) => Self::restore(&mut n, i).then_some(())?,
            FleetAction::Export(i) => Self::export(&mut n, i)?,
            FleetAction::Upload(i) => Self::upload(&mut n, i)?,
            FleetAction::ReadPointer(i) => self.read_pointer(&mut n, i)?,
            FleetAction::Publish(i) => Self::publish(&mut n, i)?,
            FleetAction::PruneList => self.prune_list(&mut n)?,
            FleetAction::PruneDelete(j) => Self::prune_delete(&mut n, j),
            FleetAction::BootRead => n.boot = Boot::Read(n.pointer?),
            FleetAction::BootFetch => Self::boot_fetch(&mut n)?,
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(NO_REGRESSION, |_, s: &FleetState| !s.regressed),
            Property::always(FETCHABLE, |_, s: &FleetState| {
                s.pointer
                    .is_none_or(|t| s.payloads[t as usize].is_some_and(|p| p.present))
            }),
            Property::always(ARTIFACT_TRUE, |_, s: &FleetState| {
                s.pointer
                    .and_then(|t| s.payloads[t as usize])
                    .is_none_or(|p| s.log.agrees(p.cursor, p.entries))
            }),
            Property::always(BOOTSTRAP_TRUE, |_, s: &FleetState| match s.boot {
                Boot::Done(t) => {
                    s.payloads[t as usize].is_none_or(|p| s.log.agrees(p.cursor, p.entries))
                }
                _ => true,
            }),
            Property::always(BOOT_FETCHES, |_, s: &FleetState| s.boot != Boot::Failed),
            Property::sometimes(RESTORED_PUBLISHES, |_, s: &FleetState| s.restored_published),
            Property::sometimes(BOOTSTRAPS, |_, s: &FleetState| {
                matches!(s.boot, Boot::Done(..))
            }),
        ]
    }
}

/// The lease key's value: `None` absent, else the expiry of the lease it holds (a released lease
/// holds the time of its release).
type LeaseValue = Option<u64>;

/// The lease key's value as [`protocol::lease_takeover_allowed`] reads it.
fn lease_state(value: LeaseValue) -> LeaseState {
    match value {
        None => LeaseState::Absent,
        Some(expires_unix_ms) => LeaseState::Held { expires_unix_ms },
    }
}

/// A node of the lease model.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Node {
    Idle,
    /// Read the key: its value and revision.
    Read(LeaseValue, u8),
    /// Holds the lease it wrote at this revision, until this tick.
    Holding {
        revision: u8,
        expires: u64,
    },
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct LeaseKeyState {
    now: u64,
    key: LeaseValue,
    revision: u8,
    nodes: [Node; NODES],
    /// A take succeeded over a held lease (an expired one).
    taken_over: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum LeaseAction {
    Tick,
    Read(usize),
    Take(usize),
    Release(usize),
}

struct LeaseModel {
    mutation: Mutation,
}

impl Model for LeaseModel {
    type State = LeaseKeyState;
    type Action = LeaseAction;

    fn init_states(&self) -> Vec<LeaseKeyState> {
        vec![LeaseKeyState {
            now: 0,
            key: None,
            revision: 0,
            nodes: [Node::Idle; NODES],
            taken_over: false,
        }]
    }

    fn actions(&self, s: &LeaseKeyState, actions: &mut Vec<LeaseAction>) {
        if s.now < LAST_TICK {
            actions.push(LeaseAction::Tick);
        }
        for (i, node) in s.nodes.iter().enumerate() {
            match node {
                Node::Idle => actions.push(LeaseAction::Read(i)),
                Node::Read(..) if s.revision < MAX_LEASE_WRITES => {
                    actions.push(LeaseAction::Take(i))
                }
                Node::Read(..) => {}
                Node::Holding { .. } if s.revision < MAX_LEASE_WRITES => {
                    actions.push(LeaseAction::Release(i))
                }
                Node::Holding { .. } => {}
            }
        }
    }

    fn next_state(&self, s: &LeaseKeyState, action: LeaseAction) -> Option<LeaseKeyState> {
        let mut n = s.clone();
        match action {
            LeaseAction::Tick => n.now += 1,
            LeaseAction::Read(i) => n.nodes[i] = Node::Read(n.key, n.revision),
            LeaseAction::Take(i) => {
                let Node::Read(value, revision) = n.nodes[i] else {
                    return None;
                };
                n.nodes[i] = Node::Idle;
                if !protocol::lease_takeover_allowed(lease_state(value), n.now) {
                    return Some(n);
                }
                let cas = self.mutation != Mutation::LeaseWithoutCas;
                if cas && revision != n.revision {
                    // Another node wrote first: its round.
                    return Some(n);
                }
                if n.key.is_some() {
                    n.taken_over = true;
                }
                let expires = n.now + TTL;
                n.key = Some(expires);
                n.revision += 1;
                n.nodes[i] = Node::Holding {
                    revision: n.revision,
                    expires,
                };
            }
            LeaseAction::Release(i) => {
                let Node::Holding { revision, .. } = n.nodes[i] else {
                    return None;
                };
                n.nodes[i] = Node::Idle;
                if revision == n.revision {
                    n.key = Some(n.now);
                    n.revision += 1;
                }
                // Otherwise `Lost`: taken over after it expired; the key is not ours to write.
            }
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONE_HOLDER, |_, s: &LeaseKeyState| {
                s.nodes
                    .iter()
                    .filter(|n| matches!(n, Node::Holding { expires, .. } if s.now < *expires))
                    .count()
                    <= 1
            }),
            Property::sometimes(LEASE_TAKEN, |_, s: &LeaseKeyState| s.taken_over),
        ]
    }
}

/// The exporters are interchangeable (a payload's slot is not its exporter's): a state stands
/// for every state that differs from it only in the exporters' order.
fn representative(s: &FleetState) -> FleetState {
    let mut r = s.clone();
    r.exporters.sort();
    r
}

/// Explores every state of the fleet (depth first: symmetry reduction needs it).
fn check_fleet(mutation: Mutation, grace: Grace) -> impl Checker<FleetModel> {
    FleetModel { mutation, grace }
        .checker()
        .symmetry_fn(representative)
        .spawn_dfs()
        .join()
}

/// Explores the fleet until `property` has a discovery. Depth first, which finds one in a fraction
/// of the states; `spawn_bfs` instead gives a shortest counterexample, to read one.
fn find_fleet(
    mutation: Mutation,
    grace: Grace,
    property: &'static str,
) -> impl Checker<FleetModel> {
    FleetModel { mutation, grace }
        .checker()
        .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
        .spawn_dfs()
        .join()
}

fn check_lease(mutation: Mutation) -> impl Checker<LeaseModel> {
    LeaseModel { mutation }.checker().spawn_bfs().join()
}

#[test]
fn the_published_cursor_never_regresses_its_target_stays_fetchable_and_every_artifact_is_true() {
    let c = check_fleet(Mutation::None, Grace::OutlastsEveryRound);
    for property in [
        NO_REGRESSION,
        FETCHABLE,
        ARTIFACT_TRUE,
        BOOTSTRAP_TRUE,
        BOOT_FETCHES,
    ] {
        c.assert_no_discovery(property);
    }
    for property in [RESTORED_PUBLISHES, BOOTSTRAPS] {
        assert!(c.discovery(property).is_some(), "{property}");
    }
    assert!(
        c.unique_state_count() > 10_000,
        "{} states",
        c.unique_state_count()
    );
}

#[test]
fn at_most_one_node_holds_an_unexpired_lease() {
    let c = check_lease(Mutation::None);
    c.assert_no_discovery(ONE_HOLDER);
    assert!(c.discovery(LEASE_TAKEN).is_some(), "a lease is taken over");
    assert!(
        c.unique_state_count() > 100,
        "{} states",
        c.unique_state_count()
    );
}

/// Zero grace is safe: a payload at or above the pointer's cursor is never pruned, so no prune
/// pass deletes what an exporter is about to name (the fleet model found it did, before
/// `payload_prunable` took the cursors).
#[test]
fn at_zero_grace_the_pointers_target_stays_fetchable() {
    let c = check_fleet(Mutation::None, Grace::Zero);
    c.assert_no_discovery(FETCHABLE);
    c.assert_no_discovery(NO_REGRESSION);
    let c = find_fleet(Mutation::PruneAtOrAbovePointer, Grace::Zero, FETCHABLE);
    let path = c
        .discovery(FETCHABLE)
        .unwrap_or_else(|| panic!("PruneAtOrAbovePointer found no counterexample at zero grace"));
    assert!(!path.into_actions().is_empty());
}

#[test]
fn each_mutation_of_the_fleet_has_a_counterexample() {
    let fleet = [
        (Mutation::PublishEqualOrBackward, NO_REGRESSION),
        (Mutation::PruneIgnoresPointer, FETCHABLE),
        (Mutation::PointerBeforeUpload, FETCHABLE),
        (Mutation::PruneAgesFromUpload, BOOT_FETCHES),
        (Mutation::ExporterPublishesUnrepairedFold, ARTIFACT_TRUE),
    ];
    std::thread::scope(|scope| {
        for (mutation, property) in fleet {
            scope.spawn(move || {
                let c = find_fleet(mutation, Grace::OutlastsEveryRound, property);
                let path = c.discovery(property).unwrap_or_else(|| {
                    panic!("{mutation:?} found no counterexample to {property:?}")
                });
                let steps: Vec<FleetAction> = path.into_actions();
                assert!(!steps.is_empty(), "{mutation:?}");
            });
        }
    });
    let c = check_lease(Mutation::LeaseWithoutCas);
    let path = c
        .discovery(ONE_HOLDER)
        .unwrap_or_else(|| panic!("LeaseWithoutCas found no counterexample to {ONE_HOLDER:?}"));
    let steps: Vec<LeaseAction> = path.into_actions();
    assert!(!steps.is_empty(), "LeaseWithoutCas");
}
