//! The operation ledger's rules under a fleet's events (docs/writes.md, "The operation ledger" and
//! "When a node cannot vouch for an id"): writes and retries through one node, another writer's
//! records, a record carrying a forged far-future id, the node restarted from an empty store (a
//! state-sync start), the bucket recreated and re-listed, the sweep, time passing beyond the
//! broker's duplicate window, records removed (superseded past the bucket's history, or the key's
//! last one evicted by the stream's limits), and the broker restarted (it then remembers only the
//! ids of the records it still stores). Every decision is the host's: [`protocol::admit_write`],
//! [`protocol::same_write`], [`protocol::vouch_retry`], [`protocol::after_ack`],
//! [`protocol::row_admitted`], [`protocol::row_of_life`], [`protocol::watermark_after_sweep`] and
//! the life's moves.
//!
//! Properties:
//! - **never applied twice**: no operation id has two records on the log;
//! - **an answer names its record**: a write answered landed (or published) at a revision names a
//!   record on the log there carrying its id and its body;
//! - **the watermark never passes the clock**.
//!
//! Mutations (each must produce a counterexample):
//! - `NoHorizon` — a state-sync start passes records without rows and leaves the horizon;
//! - `StaleRow` — a row of the bucket's previous life still answers;
//! - `BodyIgnored` — a row answers a retry with another body;
//! - `AnyIdRow` — a record of any id leaves a row and the sweep trusts it past its clock;
//! - `WindowTrusted` — the broker's window vouches for a retry on a key whose records may have
//!   been removed since its first copy.

use std::collections::BTreeMap;

use stateright::{Checker, HasDiscoveries, Model, Property};

use crate::protocol::{self, Admission, LedgerLife, LedgerRow, OpId, Vouch};

/// One tick of the model's clock: longer than the broker's window, so a tick later a second
/// publish is no longer collapsed.
const TICK_MS: u64 = 200_000;
/// The broker's duplicate window.
const WINDOW_MS: u64 = 120_000;
/// How long a row is kept: one tick.
const RETENTION_MS: u64 = TICK_MS;
/// The clock's last tick.
const MAX_TICK: u64 = 2;
/// The longest log.
const MAX_LOG: usize = 3;
/// Writes through the node in one run.
const MAX_WRITES: u8 = 3;
/// The far-future instant a forged id claims.
const FORGED_MS: u64 = 1 << 46;

/// One decision forged, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mutation {
    None,
    NoHorizon,
    StaleRow,
    BodyIgnored,
    AnyIdRow,
    WindowTrusted,
}

/// A record on the log: its key (one key), the operation id it carries (0, 1: the clients'; 2:
/// the forged one), its body, when it was stored, whether the stream still stores it, and whether
/// the broker remembers its id (a restart forgets the ids of removed records).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Rec {
    op: Option<u8>,
    body: u8,
    stored_ms: u64,
    kept: bool,
    remembered: bool,
}

impl Rec {
    fn new(op: Option<u8>, body: u8, stored_ms: u64) -> Self {
        Self {
            op,
            body,
            stored_ms,
            kept: true,
            remembered: true,
        }
    }
}

/// A ledger row as the model keeps it (revision, recorded, epoch, body).
type Row = (u64, u64, u32, u8);

/// The last answer a write got: its operation, its body, and the revision it named (`None`:
/// unknown or refused).
type Answer = (u8, u8, Option<u64>);

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    now_ms: u64,
    log: Vec<Rec>,
    /// Records the node has passed (its cursor).
    cursor: u64,
    rows: BTreeMap<u8, Row>,
    watermark: u64,
    epoch: u32,
    horizon: u64,
    /// When each client operation was minted (its first attempt).
    minted: [Option<u64>; 2],
    writes: u8,
    restarted: bool,
    recreated: bool,
    forged: bool,
    raws: u8,
    broker_restarted: bool,
    /// The last write was collapsed by the broker onto its first copy.
    collapsed: bool,
    answer: Option<Answer>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Action {
    /// Client `op` writes (or retries) with `body`.
    Write(u8, u8),
    /// Another writer's record (no id).
    Raw,
    /// A record carrying a forged far-future id.
    Forge,
    /// The node folds its next record.
    Fold,
    /// The node restarts from an empty store: a state-sync delivers each key's newest record.
    RestartEmpty,
    /// The bucket is deleted and made again; the node re-folds it.
    Recreate,
    /// The ledger is swept.
    Sweep,
    /// The key's oldest stored record (one the node has folded) is removed: superseded past the
    /// bucket's history, or — the key's last — evicted by the stream's limits.
    Trim,
    /// The broker is killed and restarted.
    BrokerRestart,
    /// Time passes.
    Tick,
}

struct LedgerModel {
    mutation: Mutation,
}

/// The operation id of `op`, minted at `ms`.
fn op_id(op: u8, ms: u64) -> OpId {
    let mut b = [op.wrapping_add(1); 16];
    b[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
    b[6] = 0x70 | (b[6] & 0x0f);
    b[8] = 0x80 | (b[8] & 0x3f);
    OpId::from_bytes(b).unwrap_or_else(|_| unreachable!("a v7 by construction"))
}

fn digest(body: u8) -> protocol::WriteDigest {
    protocol::write_digest(protocol::KvOp::Put, &[body])
}

impl LedgerModel {
    fn life(s: &State) -> LedgerLife {
        LedgerLife {
            epoch: s.epoch,
            horizon_unix_ms: s.horizon,
        }
    }

    /// The id a record carries, as the fold reads it.
    fn id_of(s: &State, op: u8) -> OpId {
        match op {
            2 => op_id(2, FORGED_MS),
            o => op_id(o, s.minted[usize::from(o)].unwrap_or(0)),
        }
    }

    fn row_of(&self, s: &State, op: u8) -> Option<LedgerRow> {
        let (revision, recorded, epoch, body) = *s.rows.get(&op)?;
        let row = LedgerRow {
            revision,
            key: "k".into(),
            recorded_unix_ms: recorded,
            epoch,
            digest: Some(digest(body)),
        };
        if self.mutation == Mutation::StaleRow {
            return Some(row);
        }
        protocol::row_of_life(Some(row), Self::life(s))
    }

    fn landed(rev: u64, r: &Rec) -> protocol::Landed {
        protocol::Landed {
            revision: rev,
            key: "k".into(),
            digest: Some(digest(r.body)),
        }
    }

    /// The host's write path for `op` with `body`: the answer's revision (`None`: unknown or
    /// refused).
    fn write(&self, n: &mut State, op: u8, body: u8) -> Option<u64> {
        let minted = *n.minted[usize::from(op)].get_or_insert(n.now_ms);
        let id = op_id(op, minted);
        let asked = if self.mutation == Mutation::BodyIgnored {
            n.rows.get(&op).map_or(digest(body), |r| digest(r.3))
        } else {
            digest(body)
        };
        let row = self.row_of(n, op);
        match protocol::admit_write(&id, "k", &asked, row.as_ref(), n.watermark, n.now_ms) {
            Admission::Landed { revision } => return Some(revision),
            Admission::Refused(_) | Admission::Unknown(_) => return None,
            Admission::Publish => {}
        }
        // The key's newest record answers it when it carries the id.
        let newest = n.log.len() as u64;
        if let Some(r) = n.log.last()
            && r.op == Some(op)
        {
            return protocol::same_write("k", &asked, &Self::landed(newest, r)).ok();
        }
        let covered = protocol::Coverage {
            cursor: n.cursor,
            life: Self::life(n),
        };
        let key_newest = (newest > 0).then_some(newest);
        // One key: the stream's oldest record is the key's (none: the stream is empty).
        let oldest = n.log.iter().find(|r| r.kept).map(|r| r.stored_ms);
        let window = if self.mutation == Mutation::WindowTrusted {
            protocol::WindowSeen {
                window_ms: WINDOW_MS,
                oldest_on_key_unix_ms: None,
                stream_first_unix_ms: 0,
            }
        } else {
            protocol::WindowSeen {
                window_ms: WINDOW_MS,
                oldest_on_key_unix_ms: oldest,
                stream_first_unix_ms: oldest.unwrap_or(u64::MAX),
            }
        };
        if protocol::vouch_retry(&id, n.now_ms, Some(window), key_newest, covered) != Vouch::Publish
        {
            return None;
        }
        // The broker: a record of the same id stored within its window, whose id it remembers,
        // takes the publish; one the stream no longer stores answers unknown.
        let collapsed = n.log.iter().enumerate().find(|(_, r)| {
            r.op == Some(op) && r.remembered && n.now_ms.saturating_sub(r.stored_ms) < WINDOW_MS
        });
        if let Some((i, r)) = collapsed {
            let rev = i as u64 + 1;
            if !r.kept {
                return None;
            }
            n.collapsed = true;
            return protocol::after_ack("k", &asked, rev, Some(&Self::landed(rev, r))).ok();
        }
        n.log.push(Rec::new(Some(op), body, n.now_ms));
        Some(n.log.len() as u64)
    }

    /// The fold passes the record at revision `rev`, leaving its row where it may.
    fn fold_record(&self, n: &mut State, rev: u64) {
        let r = &n.log[(rev - 1) as usize];
        if let Some(op) = r.op {
            let id = Self::id_of(n, op);
            if self.mutation == Mutation::AnyIdRow
                || protocol::row_admitted(&id, r.stored_ms, n.now_ms)
            {
                let row = (rev, n.now_ms, n.epoch, r.body);
                n.rows.insert(op, row);
            }
        }
    }

    /// Client `op` writes (or retries) with `body`, and keeps the answer it got.
    fn client_write(&self, n: &mut State, op: u8, body: u8) {
        n.writes += 1;
        n.collapsed = false;
        let rev = self.write(n, op, body);
        n.answer = Some((op, body, rev));
    }

    /// Another writer's record (no id).
    fn raw(n: &mut State) {
        n.raws += 1;
        n.log.push(Rec::new(None, 9, n.now_ms));
    }

    /// A record carrying a forged far-future id.
    fn forge(n: &mut State) {
        n.forged = true;
        n.log.push(Rec::new(Some(2), 9, n.now_ms));
    }

    /// The node folds its next record.
    fn fold_next(&self, n: &mut State) {
        n.cursor += 1;
        let rev = n.cursor;
        self.fold_record(n, rev);
    }

    /// The node restarts from an empty store: the rows, the watermark and the life forgotten, a
    /// horizon over the records a state-sync passes without rows, and the newest record folded.
    fn restart_empty(&self, n: &mut State) {
        n.restarted = true;
        n.rows.clear();
        n.watermark = 0;
        n.epoch = 0;
        n.horizon = 0;
        // One key: the state-sync delivers its newest record only.
        let last = n.log.len() as u64;
        if last > 1 && self.mutation != Mutation::NoHorizon {
            n.horizon = Self::life(n).passed_without_rows(n.now_ms).horizon_unix_ms;
        }
        n.cursor = last;
        self.fold_record(n, last);
    }

    /// The bucket is deleted and made again: a new incarnation of the ledger's life.
    fn recreate(n: &mut State) {
        n.recreated = true;
        n.log.clear();
        // The last answer named a record of the log that is gone.
        n.answer = None;
        let life = Self::life(n).new_incarnation(n.now_ms);
        n.epoch = life.epoch;
        n.horizon = life.horizon_unix_ms;
        n.cursor = 0;
    }

    /// The sweep: rows past the cutoff removed, the watermark [`protocol::watermark_after_sweep`]
    /// gives.
    fn sweep(&self, n: &mut State) {
        let cutoff = protocol::ledger_cutoff(n.now_ms, RETENTION_MS);
        let due: Vec<u8> = n
            .rows
            .iter()
            .filter(|(_, r)| r.1 < cutoff)
            .map(|(op, _)| *op)
            .collect();
        let minted = due
            .iter()
            .map(|op| Self::id_of(n, *op).minted_unix_ms())
            .max();
        for op in &due {
            n.rows.remove(op);
        }
        let clock = if self.mutation == Mutation::AnyIdRow {
            u64::MAX
        } else {
            n.now_ms
        };
        n.watermark = protocol::watermark_after_sweep(n.watermark, minted, clock);
    }

    /// The key's oldest stored record is removed.
    fn trim(n: &mut State) {
        if let Some(r) = n.log.iter_mut().find(|r| r.kept) {
            r.kept = false;
        }
    }

    /// The broker restarts: it forgets the ids of the records it no longer stores.
    fn broker_restart(n: &mut State) {
        n.broker_restarted = true;
        for r in n.log.iter_mut().filter(|r| !r.kept) {
            r.remembered = false;
        }
    }
}

impl Model for LedgerModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            now_ms: 1,
            log: Vec::new(),
            cursor: 0,
            rows: BTreeMap::new(),
            watermark: 0,
            epoch: 0,
            horizon: 0,
            minted: [None; 2],
            writes: 0,
            restarted: false,
            recreated: false,
            forged: false,
            raws: 0,
            broker_restarted: false,
            collapsed: false,
            answer: None,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let room = s.log.len() < MAX_LOG;
        // A write may still go when the log is full: a retry the broker collapses adds nothing
        // (and one more record is the most a write adds).
        if s.log.len() <= MAX_LOG && s.writes < MAX_WRITES {
            // Operation 0 is sent with its own body or reused with another; operation 1 with its
            // own.
            actions.push(Action::Write(0, 0));
            actions.push(Action::Write(0, 1));
            actions.push(Action::Write(1, 0));
        }
        if room {
            if s.raws == 0 {
                actions.push(Action::Raw);
            }
            if !s.forged {
                actions.push(Action::Forge);
            }
        }
        if (s.cursor as usize) < s.log.len() {
            actions.push(Action::Fold);
        }
        if !s.restarted && !s.log.is_empty() {
            actions.push(Action::RestartEmpty);
        }
        if !s.recreated && !s.log.is_empty() {
            actions.push(Action::Recreate);
        }
        if !s.rows.is_empty() {
            actions.push(Action::Sweep);
        }
        let kept = s.log.iter().filter(|r| r.kept).count();
        let oldest_kept = s.log.iter().position(|r| r.kept);
        if kept > 0 && oldest_kept.is_some_and(|i| (i as u64) < s.cursor) {
            actions.push(Action::Trim);
        }
        if !s.broker_restarted && kept < s.log.len() {
            actions.push(Action::BrokerRestart);
        }
        if s.now_ms < MAX_TICK * TICK_MS {
            actions.push(Action::Tick);
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        match action {
            Action::Write(op, body) => self.client_write(&mut n, op, body),
            Action::Raw => Self::raw(&mut n),
            Action::Forge => Self::forge(&mut n),
            Action::Fold => self.fold_next(&mut n),
            Action::RestartEmpty => self.restart_empty(&mut n),
            Action::Recreate => Self::recreate(&mut n),
            Action::Sweep => self.sweep(&mut n),
            Action::Trim => Self::trim(&mut n),
            Action::BrokerRestart => Self::broker_restart(&mut n),
            Action::Tick => n.now_ms += TICK_MS,
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("never applied twice", |_, s: &State| {
                (0..2u8).all(|op| s.log.iter().filter(|r| r.op == Some(op)).count() <= 1)
            }),
            Property::always("an answer names its record", |_, s: &State| {
                match s.answer {
                    Some((op, body, Some(rev))) => s
                        .log
                        .get((rev as usize).wrapping_sub(1))
                        .is_some_and(|r| r.op == Some(op) && r.body == body),
                    _ => true,
                }
            }),
            Property::always("the watermark never passes the clock", |_, s: &State| {
                s.watermark <= s.now_ms
            }),
            Property::sometimes(
                "a retry collapsed by the broker's window",
                |_, s: &State| s.collapsed,
            ),
            Property::sometimes("a retry answered from its row", |_, s: &State| {
                s.answer.is_some_and(|(op, _, rev)| {
                    rev.is_some() && s.rows.get(&op).is_some_and(|r| Some(r.0) == rev)
                }) && s.writes >= 2
            }),
        ]
    }
}

fn check(mutation: Mutation) -> impl Checker<LedgerModel> {
    LedgerModel { mutation }.checker().spawn_bfs().join()
}

/// Explores a mutation until `property` has a discovery (breadth first: the shortest
/// counterexample, found long before the whole space is walked).
fn find(mutation: Mutation, property: &'static str) -> impl Checker<LedgerModel> {
    LedgerModel { mutation }
        .checker()
        .finish_when(HasDiscoveries::AnyOf(std::collections::BTreeSet::from([
            property,
        ])))
        .spawn_bfs()
        .join()
}

#[test]
fn the_ledger_never_applies_a_write_twice_names_only_its_own_records_and_keeps_its_watermark() {
    let c = check(Mutation::None);
    c.assert_no_discovery("never applied twice");
    c.assert_no_discovery("an answer names its record");
    c.assert_no_discovery("the watermark never passes the clock");
    assert!(
        c.discovery("a retry answered from its row").is_some(),
        "the model answers retries from the ledger"
    );
    assert!(
        c.discovery("a retry collapsed by the broker's window")
            .is_some(),
        "the window vouches for some retries"
    );
    assert!(
        c.unique_state_count() > 1000,
        "{} states",
        c.unique_state_count()
    );
}

#[test]
fn each_mutation_of_the_ledgers_rules_has_a_counterexample() {
    for (mutation, property) in [
        (Mutation::NoHorizon, "never applied twice"),
        (Mutation::StaleRow, "an answer names its record"),
        (Mutation::BodyIgnored, "an answer names its record"),
        (Mutation::AnyIdRow, "the watermark never passes the clock"),
        (Mutation::WindowTrusted, "never applied twice"),
    ] {
        let c = find(mutation, property);
        assert!(
            c.discovery(property).is_some(),
            "{mutation:?} found no counterexample to {property:?}"
        );
    }
}
