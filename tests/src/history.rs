//! A Jepsen-style history of writes and reads through hosts, and the checker that proves from it
//! and the log alone what docs/writes.md promises.
//!
//! The module keeps three things:
//! - **the history** ([`Op`], recorded by a [`Recorder`]): every request a client made of a fold —
//!   a put, a delete, a compare-and-set (`if_revision`), a read with or without
//!   `Foldhost-Min-Revision` — with the client, the fold that answered (a node restarted from an
//!   empty store is a new fold), the bucket's incarnation, the instants it was invoked and
//!   completed on one shared monotonic clock, the operation id it sent (a UUIDv7), whether it was
//!   a retry of an id sent before, and its answer (a transport error is indeterminate, like
//!   `unknown`);
//! - **the log** ([`Log`], read by [`read_log`]): every record of the bucket's stream `KV_<bucket>`
//!   in sequence order, with its key, kind, value and `Foldhost-Op-Id` header, one
//!   [`Incarnation`] per life of the stream (a stream deleted and made again counts from 1: each
//!   life is read before it is deleted). Sequences the log no longer held when it was read (a
//!   key's history limit, a purge) are *unseen*: the checker reports them rather than prove
//!   anything blind;
//! - **the checker** ([`check`]): a list of [`Anomaly`]s, each one line naming op ids, keys and
//!   revisions, by the rules (a)–(g) of [`check`]. An empty list is the proof.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use stateright::semantics::{ConsistencyTester as _, LinearizabilityTester, SequentialSpec};

use crate::Contents;

/// What a client asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// `POST /write` of a value; with `if_revision`, a compare-and-set.
    Put {
        /// The key.
        key: String,
        /// The value (UTF-8).
        value: String,
        /// Compare-and-set against the key's last revision (0: no record at all).
        if_revision: Option<u64>,
    },
    /// `POST /write` of a delete marker; with `if_revision`, a compare-and-set.
    Delete {
        /// The key.
        key: String,
        /// Compare-and-set against the key's last revision.
        if_revision: Option<u64>,
    },
    /// `POST /get` of one key, with `Foldhost-Min-Revision` when `min_revision` is given.
    Read {
        /// The key.
        key: String,
        /// The revision the fold must have applied first.
        min_revision: Option<u64>,
    },
}

impl Request {
    /// The key asked about.
    pub fn key(&self) -> &str {
        match self {
            Request::Put { key, .. } | Request::Delete { key, .. } | Request::Read { key, .. } => {
                key
            }
        }
    }

    /// A write (put or delete), not a read.
    pub fn is_write(&self) -> bool {
        !matches!(self, Request::Read { .. })
    }

    /// The compare-and-set revision of a write.
    fn if_revision(&self) -> Option<u64> {
        match self {
            Request::Put { if_revision, .. } | Request::Delete { if_revision, .. } => *if_revision,
            Request::Read { .. } => None,
        }
    }

    /// The value the write's record holds: `Some` for a put, `None` for a delete.
    fn written(&self) -> Option<Vec<u8>> {
        match self {
            Request::Put { value, .. } => Some(value.as_bytes().to_vec()),
            _ => None,
        }
    }
}

/// What a client was answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// `applied`: durable at `revision` and applied by the answering fold.
    Applied {
        /// The record's revision.
        revision: u64,
    },
    /// `pending`: durable at `revision`, not yet applied by the answering fold.
    Pending {
        /// The record's revision.
        revision: u64,
    },
    /// `unknown`: the record may be on the log or not.
    Unknown,
    /// `refused` with its reason; `revision` (conflict: the key's; op_reused: where the id
    /// landed) and `key` (op_reused) when the answer names them.
    Refused {
        /// `conflict`, `op_reused`, `invalid`, …
        reason: String,
        /// The revision the refusal names.
        revision: Option<u64>,
        /// The key the refusal names (op_reused).
        key: Option<String>,
    },
    /// A read's answer: the fold holds the key.
    Found {
        /// The value.
        value: Vec<u8>,
        /// Its revision.
        revision: u64,
        /// The fold's `applied_through` when it read.
        applied_through: u64,
    },
    /// A read's answer: the fold does not hold the key.
    NotFound {
        /// The fold's `applied_through` when it read.
        applied_through: u64,
    },
    /// A read's answer: the fold had not reached the minimum revision within the wait.
    Behind,
    /// The host could not be asked, or its answer not read: indeterminate (a write is then
    /// treated like `unknown`, a read proves nothing).
    Transport(String),
}

impl Answer {
    /// A write's answer that says where its record landed.
    fn landed(&self) -> Option<u64> {
        match self {
            Answer::Applied { revision } | Answer::Pending { revision } => Some(*revision),
            _ => None,
        }
    }

    /// A write's answer that leaves its outcome open.
    fn indeterminate(&self) -> bool {
        matches!(self, Answer::Unknown | Answer::Transport(_))
    }
}

/// One request and its answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Op {
    /// The client (one sequential caller).
    pub client: usize,
    /// The fold that answered: a node restarted from an empty store is a new fold.
    pub node: usize,
    /// The bucket's incarnation the request was made in (an index into [`Log::incarnations`]).
    pub incarnation: usize,
    /// When it was sent, on the recorder's clock.
    pub invoked: u64,
    /// When its answer (or its failure) came, on the recorder's clock.
    pub completed: u64,
    /// What was asked.
    pub request: Request,
    /// The operation id sent (a write's; a UUIDv7 in its text form).
    pub op_id: Option<String>,
    /// It was sent again under an id sent before.
    pub retry: bool,
    /// What was answered.
    pub answer: Answer,
}

/// The history as it is recorded: a monotonic clock every client reads before sending and after
/// its answer, and the operations in the order they completed.
#[derive(Default)]
pub struct Recorder {
    clock: AtomicU64,
    ops: Mutex<Vec<Op>>,
}

impl Recorder {
    /// The next instant: every call returns a larger one than every call that returned before it
    /// began, so `a.completed < b.invoked` means `a` completed before `b` was sent.
    pub fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Records a completed operation.
    pub fn record(&self, op: Op) {
        self.ops
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(op);
    }

    /// The history so far.
    pub fn ops(&self) -> Vec<Op> {
        self.ops
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// A record's kind (its `KV-Operation` header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A value.
    Put,
    /// A delete marker.
    Delete,
    /// A purge marker.
    Purge,
}

/// One record of the stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Its stream sequence: the key's revision.
    pub seq: u64,
    /// The key (the subject after `$KV.<bucket>.`).
    pub key: String,
    /// Put, delete or purge.
    pub kind: Kind,
    /// The payload.
    pub value: Vec<u8>,
    /// Its `Foldhost-Op-Id` header.
    pub op_id: Option<String>,
}

/// One life of the bucket's stream, as read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Incarnation {
    /// Every record read, by sequence.
    pub records: BTreeMap<u64, Record>,
    /// The stream's last sequence when it was last read: every sequence up to it not in
    /// `records` is unseen.
    pub last_sequence: u64,
}

impl Incarnation {
    /// Sequences up to `last_sequence` the log no longer held when they were read.
    pub fn unseen(&self) -> BTreeSet<u64> {
        (1..=self.last_sequence)
            .filter(|s| !self.records.contains_key(s))
            .collect()
    }
}

/// The stream's contents, one [`Incarnation`] per life.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Log {
    /// Oldest first.
    pub incarnations: Vec<Incarnation>,
}

/// Reads every record of `KV_<bucket>` after the last one `into` holds, up to the stream's last
/// sequence, with the JetStream API's message get (the stream leader's `STREAM.MSG.GET`). A
/// sequence the stream no longer holds stays unseen. Call it often enough that a key's history
/// limit drops nothing unread: between workload phases, and before the stream is deleted.
pub async fn read_log(
    js: &async_nats::jetstream::Context,
    bucket: &str,
    into: &mut Incarnation,
) -> anyhow::Result<()> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let stream = loop {
        match js.get_stream(format!("KV_{bucket}")).await {
            Ok(s) => break s,
            Err(e) => {
                anyhow::ensure!(
                    std::time::Instant::now() < deadline,
                    "stream KV_{bucket}: {e}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    };
    let last = stream.cached_info().state.last_sequence;
    let prefix = format!("$KV.{bucket}.");
    let mut seq = into.last_sequence + 1;
    while seq <= last {
        match stream.get_raw_message(seq).await {
            Ok(m) => {
                let key = m
                    .subject
                    .as_str()
                    .strip_prefix(&prefix)
                    .ok_or_else(|| anyhow::anyhow!("record {seq} on subject {}", m.subject))?
                    .to_string();
                let header = |name: &str| m.headers.get(name).map(|v| v.as_str().to_string());
                let kind = match header("KV-Operation").as_deref() {
                    Some("DEL") => Kind::Delete,
                    Some("PURGE") => Kind::Purge,
                    _ => Kind::Put,
                };
                into.records.insert(
                    seq,
                    Record {
                        seq,
                        key,
                        kind,
                        value: m.payload.to_vec(),
                        op_id: header(foldhost_core::protocol::OP_ID_HEADER),
                    },
                );
                seq += 1;
            }
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => seq += 1,
            // The server may be restarting: asked again until the deadline.
            Err(e) => {
                anyhow::ensure!(
                    std::time::Instant::now() < deadline,
                    "record {seq} of KV_{bucket}: {e}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
    into.last_sequence = into.last_sequence.max(last);
    Ok(())
}

/// A fold's contents at the end (its `POST /get` of every key, or its `dump`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FinalFold {
    /// The fold.
    pub node: usize,
    /// Key → (value, revision).
    pub contents: Contents,
}

/// One thing the history and the log disprove, by the rule it breaks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Anomaly {
    /// `a`…`g` (see [`check`]), or `L` for a log the checker cannot see whole.
    pub rule: char,
    /// One line naming op ids, keys and revisions.
    pub line: String,
}

impl std::fmt::Display for Anomaly {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "({}) {}", self.rule, self.line)
    }
}

/// One key's register, the sequential specification rule (f) checks a key's writes against: its
/// revision (the stream sequence of its newest record; 0 when it has none), its value (`None`
/// after a delete), and the key's records on the log in their order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Register {
    /// The newest record's revision.
    pub revision: u64,
    /// Its value; `None` for none or a delete marker.
    pub value: Option<Vec<u8>>,
    /// Every revision the key's records hold on the log, ascending (every record enters the
    /// history, so a write can take effect only as the next of them); empty: any rising order.
    pub order: std::sync::Arc<[u64]>,
}

impl Register {
    /// Whether a record at `r` may take effect next: above the register's revision and, when the
    /// log's order is known, the key's next record on it.
    fn next_is(&self, r: u64) -> bool {
        if r <= self.revision {
            return false;
        }
        if self.order.is_empty() {
            return true;
        }
        let at = self.order.partition_point(|x| *x <= self.revision);
        self.order.get(at) == Some(&r)
    }
}

/// An operation on a [`Register`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegisterOp {
    /// A write of `value` (`None`: a delete), compare-and-set when `if_revision` is given, whose
    /// record landed at `landed` (`None`: it was refused and landed nowhere). The revision is the
    /// log's, which the specification cannot choose: it only checks revisions rise.
    Write {
        /// The value written.
        value: Option<Vec<u8>>,
        /// The compare-and-set revision.
        if_revision: Option<u64>,
        /// Where its record landed.
        landed: Option<u64>,
    },
    /// A read of the current value.
    Read,
}

/// What a [`RegisterOp`] returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegisterRet {
    /// The write took effect at this revision.
    Wrote(u64),
    /// The compare-and-set lost: the key is at this revision.
    Conflict(u64),
    /// The value read, at its revision.
    Value(u64, Option<Vec<u8>>),
    /// A write the specification would have applied, but which landed nowhere.
    WouldHaveApplied,
    /// A write landed at a revision that is not the key's next record on the log: no order of
    /// the log allows it here.
    OutOfOrder,
}

impl SequentialSpec for Register {
    type Op = RegisterOp;
    type Ret = RegisterRet;

    fn invoke(&mut self, op: &RegisterOp) -> RegisterRet {
        match op {
            RegisterOp::Read => RegisterRet::Value(self.revision, self.value.clone()),
            RegisterOp::Write {
                value,
                if_revision,
                landed,
            } => {
                if let Some(want) = if_revision
                    && *want != self.revision
                {
                    return RegisterRet::Conflict(self.revision);
                }
                match landed {
                    None => RegisterRet::WouldHaveApplied,
                    Some(r) if !self.next_is(*r) => RegisterRet::OutOfOrder,
                    Some(r) => {
                        self.revision = *r;
                        self.value = value.clone();
                        RegisterRet::Wrote(*r)
                    }
                }
            }
        }
    }
}

/// One operation of a key's history for the linearizability tester: invoked at `invoked`,
/// returned at `returned` (`None`: never, it may or may not have taken effect) with `ret`.
#[derive(Clone, Debug)]
pub struct TimedRegisterOp {
    /// What names it in an anomaly (its op id).
    pub name: String,
    /// When it was invoked.
    pub invoked: u64,
    /// When it returned; `u64::MAX` for an operation that took effect at an unknown instant after
    /// its invocation (an indeterminate write the log shows landed).
    pub returned: u64,
    /// The operation.
    pub op: RegisterOp,
    /// What it returned.
    pub ret: RegisterRet,
}

/// Whether `ops` (one key's history) are linearizable against a [`Register`] starting empty;
/// `Err` names the first return after which no linearization exists. Each operation runs on a
/// thread of its own in stateright's tester (an operation's window may overlap its own client's
/// next one: a retry answered later than the client moved on), so real-time order between any
/// two is what the tester records.
pub fn linearizable(ops: &[TimedRegisterOp]) -> Result<(), String> {
    // Events in real-time order: (instant, 0 = invoke / 1 = return, op index).
    let mut events: Vec<(u64, u8, usize)> = Vec::new();
    for (i, o) in ops.iter().enumerate() {
        events.push((o.invoked, 0, i));
        events.push((o.returned, 1, i));
    }
    events.sort();
    // The log fixes the order of the key's writes: the tester is told it, so its search never
    // tries an order the log refutes (without it, a history with many open windows took the
    // search beyond any time limit).
    let mut order: Vec<u64> = ops
        .iter()
        .filter_map(|o| match &o.op {
            RegisterOp::Write {
                landed: Some(r), ..
            } => Some(*r),
            _ => None,
        })
        .collect();
    order.sort_unstable();
    order.dedup();
    let mut tester = LinearizabilityTester::new(Register {
        order: order.into(),
        ..Register::default()
    });
    for (_, what, i) in events {
        let o = &ops[i];
        if what == 0 {
            tester
                .on_invoke(i, o.op.clone())
                .map_err(|e| format!("the tester refused the history: {e}"))?;
        } else {
            tester
                .on_return(i, o.ret.clone())
                .map_err(|e| format!("the tester refused the history: {e}"))?;
            if tester.serialized_history().is_none() {
                return Err(format!(
                    "no linearization once {} returned {:?} ({:?})",
                    o.name, o.ret, o.op
                ));
            }
        }
    }
    Ok(())
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

/// The refusals that promise nothing was published (docs/writes.md, "A write has three outcomes").
const NOTHING_PUBLISHED: &[&str] = &[
    "conflict",
    "invalid",
    "too_large",
    "not_folded",
    "permission",
    "bucket_full",
];

/// Checks `history` against `log` and the folds' final contents, returning every anomaly:
///
/// - (a) every `applied`/`pending` answer names a record on the log, at that revision, carrying
///   the op id, on the key and with the value (or delete marker) the request asked for;
/// - (b) no op id has two records on one incarnation's log, and every record carries an op id the
///   history sent in that incarnation;
/// - (c) an op refused with a reason that publishes nothing has no record; one refused
///   `op_reused` has none on its own key, and the answer names where the id did land;
/// - (d) an op whose every answer was indeterminate (`unknown`, transport error) has at most one
///   record;
/// - (e) a read answered from a fold never sees an older state than the newest of: its
///   `Foldhost-Min-Revision`, the `applied_through` the answer reports, and every write to the
///   key answered `applied` by the same fold before the read was sent — and what it sees is a
///   value a record holds;
/// - (f) each key's writes (puts, deletes, compare-and-sets; per incarnation) are linearizable
///   against a register (stateright's [`LinearizabilityTester`]): an op with a known outcome
///   enters with its window from its first send to its first determinate answer; an
///   indeterminate op enters only if the log holds its record, as landed there at some instant
///   after it was sent; one the log does not hold did not happen. Reads do not enter: a fold
///   lags the log (docs/writes.md, "Three numbers that are not the same number"), so reads from
///   several folds are not linearizable by design; rule (e) states what they promise;
/// - (g) every final fold holds exactly the last incarnation's newest record of every key (a
///   delete: no entry), at its revision;
/// - (L) the log was read whole: no sequence of an incarnation went unseen.
pub fn check(history: &[Op], log: &Log, finals: &[FinalFold]) -> Vec<Anomaly> {
    let mut out = Vec::new();
    let mut flag = |rule: char, line: String| out.push(Anomaly { rule, line });
    let empty = Incarnation::default();
    let inc_of = |i: usize| log.incarnations.get(i).unwrap_or(&empty);
    for (i, inc) in log.incarnations.iter().enumerate() {
        let unseen = inc.unseen();
        if let (Some(first), Some(last)) = (unseen.first(), unseen.last()) {
            flag(
                'L',
                format!(
                    "incarnation {i}: {} sequences between {first} and {last} were gone before \
                     the log was read; the checker is blind there",
                    unseen.len()
                ),
            );
        }
    }
    if let Some(op) = history
        .iter()
        .find(|o| o.incarnation >= log.incarnations.len())
    {
        flag(
            'L',
            format!(
                "op {:?} was made in incarnation {} but the log has {}",
                op.op_id,
                op.incarnation,
                log.incarnations.len()
            ),
        );
    }

    // Records by op id, per incarnation.
    let by_op: Vec<HashMap<&str, Vec<&Record>>> = log
        .incarnations
        .iter()
        .map(|inc| {
            let mut m: HashMap<&str, Vec<&Record>> = HashMap::new();
            for r in inc.records.values() {
                if let Some(id) = &r.op_id {
                    m.entry(id.as_str()).or_default().push(r);
                }
            }
            m
        })
        .collect();
    let records_of = |inc: usize, id: &str| -> Vec<&Record> {
        by_op
            .get(inc)
            .and_then(|m| m.get(id))
            .cloned()
            .unwrap_or_default()
    };

    // The writes, grouped by (incarnation, op id): every attempt of one operation.
    let mut writes: BTreeMap<(usize, &str), Vec<&Op>> = BTreeMap::new();
    for op in history.iter().filter(|o| o.request.is_write()) {
        match &op.op_id {
            Some(id) => writes
                .entry((op.incarnation, id.as_str()))
                .or_default()
                .push(op),
            None => flag(
                'a',
                format!(
                    "a write to {} by client {} carries no op id",
                    op.request.key(),
                    op.client
                ),
            ),
        }
    }

    // (a) applied and pending answers name their record; every record of an op holds what it
    // asked for.
    for ((i, id), attempts) in &writes {
        let inc = inc_of(*i);
        let first = attempts[0];
        for op in attempts {
            if op.request != first.request {
                flag(
                    'a',
                    format!(
                        "op {id} was sent with two different requests: {:?} and {:?}",
                        first.request, op.request
                    ),
                );
            }
            let Some(rev) = op.answer.landed() else {
                continue;
            };
            match inc.records.get(&rev) {
                Some(r) if r.op_id.as_deref() == Some(*id) => {}
                Some(r) => flag(
                    'a',
                    format!(
                        "op {id} on {} answered {:?} by fold {}: the record at {rev} is on {} \
                         and carries {:?}",
                        op.request.key(),
                        op.answer,
                        op.node,
                        r.key,
                        r.op_id
                    ),
                ),
                None if rev <= inc.last_sequence => flag(
                    'a',
                    format!(
                        "op {id} on {} answered {:?} by fold {}: revision {rev} was gone before \
                         the log was read (cannot be proved)",
                        op.request.key(),
                        op.answer,
                        op.node
                    ),
                ),
                None => flag(
                    'a',
                    format!(
                        "op {id} on {} answered {:?} by fold {} in incarnation {i}: the log ends \
                         at {}, no record at {rev}",
                        op.request.key(),
                        op.answer,
                        op.node,
                        inc.last_sequence
                    ),
                ),
            }
        }
        for r in records_of(*i, id) {
            let want_kind = if first.request.written().is_some() {
                Kind::Put
            } else {
                Kind::Delete
            };
            let holds = r.key == first.request.key()
                && r.kind == want_kind
                && (want_kind != Kind::Put || Some(&r.value) == first.request.written().as_ref());
            // op_reused refusals are rule (c)'s: a record elsewhere is where the id landed.
            if !holds && r.key == first.request.key() {
                flag(
                    'a',
                    format!(
                        "the record at {} carries op {id} but holds {:?} {:?} on {}, not {:?}",
                        r.seq,
                        r.kind,
                        String::from_utf8_lossy(&r.value),
                        r.key,
                        first.request
                    ),
                );
            }
        }
    }

    // (b) and (d): one record per op id; no record nobody sent.
    for (i, inc) in log.incarnations.iter().enumerate() {
        let mut sent: BTreeSet<&str> = BTreeSet::new();
        for (inc_i, id) in writes.keys() {
            if *inc_i == i {
                sent.insert(id);
            }
        }
        for r in inc.records.values() {
            match r.op_id.as_deref() {
                Some(id) if sent.contains(id) => {}
                other => flag(
                    'b',
                    format!(
                        "incarnation {i}: the record at {} on {} carries {other:?}, an op id \
                         the history never sent there",
                        r.seq, r.key
                    ),
                ),
            }
        }
        if let Some(m) = by_op.get(i) {
            for (id, recs) in m {
                if recs.len() < 2 {
                    continue;
                }
                let seqs: Vec<u64> = recs.iter().map(|r| r.seq).collect();
                let indeterminate = writes
                    .get(&(i, *id))
                    .is_some_and(|a| a.iter().all(|o| o.answer.indeterminate()));
                let (rule, what) = if indeterminate {
                    ('d', "whose every answer was indeterminate")
                } else {
                    ('b', "answered")
                };
                flag(
                    rule,
                    format!(
                        "incarnation {i}: op {id} {what} has {} records, at {seqs:?}",
                        recs.len()
                    ),
                );
            }
        }
    }

    // (c) refusals publish nothing.
    for ((i, id), attempts) in &writes {
        let recs = records_of(*i, id);
        for op in attempts {
            let Answer::Refused {
                reason,
                revision,
                key,
            } = &op.answer
            else {
                continue;
            };
            if reason == "op_reused" {
                let own: Vec<u64> = recs
                    .iter()
                    .filter(|r| r.key == op.request.key())
                    .map(|r| r.seq)
                    .collect();
                if !own.is_empty() {
                    flag(
                        'c',
                        format!(
                            "op {id} on {} was refused op_reused by fold {} but has records on \
                             that key at {own:?}",
                            op.request.key(),
                            op.node
                        ),
                    );
                }
                let named = recs
                    .iter()
                    .any(|r| Some(r.seq) == *revision && Some(&r.key) == key.as_ref());
                if !named {
                    flag(
                        'c',
                        format!(
                            "op {id} was refused op_reused naming {key:?} at {revision:?}, where \
                             the log holds no record of it",
                        ),
                    );
                }
            } else if NOTHING_PUBLISHED.contains(&reason.as_str()) && !recs.is_empty() {
                let seqs: Vec<u64> = recs.iter().map(|r| r.seq).collect();
                flag(
                    'c',
                    format!(
                        "op {id} on {} was refused {reason} by fold {} but its record is on the \
                         log at {seqs:?}",
                        op.request.key(),
                        op.node
                    ),
                );
            }
        }
    }

    // (e) reads never see an older state than they must — nor a newer one than the log could
    // have held when they were answered: a record whose op was first sent after the read
    // completed, and every record after it, came later.
    let first_sent: HashMap<(usize, &str), u64> = writes
        .iter()
        .map(|(k, attempts)| (*k, attempts.iter().map(|o| o.invoked).min().unwrap_or(0)))
        .collect();
    for read in history.iter().filter(|o| !o.request.is_write()) {
        let Request::Read { key, min_revision } = &read.request else {
            continue;
        };
        let through = match &read.answer {
            Answer::Found {
                applied_through, ..
            }
            | Answer::NotFound { applied_through } => *applied_through,
            _ => continue,
        };
        let inc = inc_of(read.incarnation);
        // The bound and what set it.
        let mut bound = (
            through,
            format!("the applied_through {through} it reported"),
        );
        if let Some(min) = min_revision {
            if through < *min {
                flag(
                    'e',
                    format!(
                        "a read of {key} by client {} on fold {} with min revision {min} was \
                         answered at applied_through {through}",
                        read.client, read.node
                    ),
                );
            }
            if *min > bound.0 {
                bound = (*min, format!("its min revision {min}"));
            }
        }
        for w in history.iter().filter(|w| {
            w.request.is_write()
                && w.node == read.node
                && w.incarnation == read.incarnation
                && w.request.key() == key
                && w.completed < read.invoked
        }) {
            if let Answer::Applied { revision } = w.answer
                && revision > bound.0
            {
                bound = (
                    revision,
                    format!(
                        "op {} applied at {revision} by the same fold before it",
                        w.op_id.as_deref().unwrap_or("?")
                    ),
                );
            }
        }
        let on_key: Vec<&Record> = inc.records.values().filter(|r| r.key == *key).collect();
        // The log's position when the read was answered is below this.
        let later = inc
            .records
            .values()
            .find(|r| {
                r.op_id
                    .as_deref()
                    .and_then(|id| first_sent.get(&(read.incarnation, id)))
                    .is_some_and(|sent| *sent > read.completed)
            })
            .map_or(u64::MAX, |r| r.seq);
        let who = format!(
            "a read of {key} by client {} on fold {} (incarnation {})",
            read.client, read.node, read.incarnation
        );
        match &read.answer {
            Answer::Found {
                value, revision, ..
            } => {
                match inc.records.get(revision) {
                    Some(r) if r.key == *key && r.kind == Kind::Put && r.value == *value => {}
                    other => flag(
                        'e',
                        format!(
                            "{who} saw {:?} at {revision}, which no record holds (the log there: \
                             {other:?})",
                            String::from_utf8_lossy(value)
                        ),
                    ),
                }
                if *revision >= later {
                    flag(
                        'e',
                        format!(
                            "{who} saw revision {revision}, a record sent after the read was \
                             answered"
                        ),
                    );
                }
                if let Some(next) = on_key.iter().find(|r| r.seq > *revision)
                    && next.seq <= bound.0
                {
                    flag(
                        'e',
                        format!(
                            "{who} saw revision {revision}, older than {} which it must see \
                             ({})",
                            next.seq, bound.1
                        ),
                    );
                }
            }
            Answer::NotFound { .. } => {
                let newest_at_bound = on_key.iter().rev().find(|r| r.seq <= bound.0);
                let absent_at_bound = newest_at_bound.is_none_or(|r| r.kind != Kind::Put);
                let absent_later = on_key
                    .iter()
                    .any(|r| r.seq > bound.0 && r.seq < later && r.kind != Kind::Put);
                if !absent_at_bound && !absent_later {
                    flag(
                        'e',
                        format!(
                            "{who} found nothing, but the key holds a value from {} on, which it \
                             must see ({})",
                            newest_at_bound.map_or(0, |r| r.seq),
                            bound.1
                        ),
                    );
                }
            }
            _ => {}
        }
    }

    // (f) each key's writes are linearizable. Every record on the log enters too: a copy beyond
    // the one an answer names (rule (b)'s), a record of a refused op (rule (c)'s) or of an op the
    // history never sent, as a write that landed there at some instant — so that this rule
    // judges only the order, and reports nothing the other rules report.
    //
    // A write that landed at an unknown instant took effect before any answer that shows the
    // stream past its record completed (stream sequences are given in time order): its window
    // closes there instead of staying open to the end, which keeps the tester's search small
    // ([`landed_by`]).
    let landed_by = landed_by(history);
    let bound = |i: usize, seq: u64, invoked: u64| {
        landed_by(i, seq).map_or(u64::MAX, |done| done.max(invoked))
    };
    let mut per_key: BTreeMap<(usize, &str), Vec<TimedRegisterOp>> = BTreeMap::new();
    let copy = |i: usize, r: &Record, name: String, invoked: u64| TimedRegisterOp {
        name,
        invoked,
        returned: bound(i, r.seq, invoked),
        op: RegisterOp::Write {
            value: (r.kind == Kind::Put).then(|| r.value.clone()),
            if_revision: None,
            landed: Some(r.seq),
        },
        ret: RegisterRet::Wrote(r.seq),
    };
    for ((i, id), attempts) in &writes {
        let first = attempts[0];
        let invoked = attempts.iter().map(|o| o.invoked).min().unwrap_or(0);
        let recs = records_of(*i, id);
        let determinate = attempts
            .iter()
            .filter(|o| {
                o.answer.landed().is_some()
                    || matches!(&o.answer, Answer::Refused { reason, .. } if reason == "conflict")
            })
            .min_by_key(|o| o.completed);
        let main = match determinate {
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
            // Indeterminate: it happened if the log holds its record, else it did not.
            None if attempts.iter().all(|o| o.answer.indeterminate()) => recs.first().map(|r| {
                (
                    bound(*i, r.seq, invoked),
                    RegisterRet::Wrote(r.seq),
                    Some(r.seq),
                )
            }),
            // Refused for a reason that publishes nothing: it did not happen.
            None => None,
        };
        let ops = per_key.entry((*i, first.request.key())).or_default();
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
            per_key.entry((*i, r.key.as_str())).or_default().push(copy(
                *i,
                r,
                format!("op {id}'s record at {}", r.seq),
                invoked,
            ));
        }
    }
    for (i, inc) in log.incarnations.iter().enumerate() {
        for r in inc.records.values() {
            let sent = r
                .op_id
                .as_deref()
                .is_some_and(|id| writes.contains_key(&(i, id)));
            if !sent {
                per_key.entry((i, r.key.as_str())).or_default().push(copy(
                    i,
                    r,
                    format!("the unsent record at {}", r.seq),
                    0,
                ));
            }
        }
    }
    for ((i, key), ops) in &per_key {
        if let Err(why) = linearizable(ops) {
            flag(
                'f',
                format!(
                    "key {key} (incarnation {i}): its {} writes are not linearizable: {why}",
                    ops.len()
                ),
            );
        }
    }

    // (g) the final folds equal the bucket.
    if let Some(last) = log.incarnations.last() {
        let mut want: BTreeMap<&str, Option<(Vec<u8>, u64)>> = BTreeMap::new();
        for r in last.records.values() {
            want.insert(
                &r.key,
                (r.kind == Kind::Put).then(|| (r.value.clone(), r.seq)),
            );
        }
        for f in finals {
            let keys: BTreeSet<&str> = want
                .keys()
                .copied()
                .chain(f.contents.keys().map(String::as_str))
                .collect();
            for key in keys {
                let w = want.get(key).cloned().flatten();
                let got = f.contents.get(key).cloned();
                if w != got {
                    let show = |e: &Option<(Vec<u8>, u64)>| {
                        e.as_ref().map_or("nothing".to_string(), |(v, r)| {
                            format!("{:?} at {r}", String::from_utf8_lossy(v))
                        })
                    };
                    flag(
                        'g',
                        format!(
                            "fold {} holds {} for {key}, the bucket {}",
                            f.node,
                            show(&got),
                            show(&w)
                        ),
                    );
                }
            }
        }
    }
    out
}

/// The anomalies' lines, one per line, for an assertion message.
pub fn describe(anomalies: &[Anomaly]) -> String {
    anomalies
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

/// For every op id an anomaly names: its attempts (who sent it where, when, and what came back)
/// and its records on the log, one per line — what a reader of a failure needs to judge it.
pub fn explain(anomalies: &[Anomaly], history: &[Op], log: &Log) -> String {
    let mut ids: Vec<&str> = Vec::new();
    for op in history {
        if let Some(id) = op.op_id.as_deref()
            && !ids.contains(&id)
            && anomalies.iter().any(|a| a.line.contains(id))
        {
            ids.push(id);
        }
    }
    let mut out = String::new();
    for id in ids {
        out.push_str(&format!("op {id}:\n"));
        for op in history.iter().filter(|o| o.op_id.as_deref() == Some(id)) {
            out.push_str(&format!(
                "  client {} fold {} incarnation {} [{}, {}]{} {:?} -> {:?}\n",
                op.client,
                op.node,
                op.incarnation,
                op.invoked,
                op.completed,
                if op.retry { " retry" } else { "" },
                op.request,
                op.answer
            ));
        }
        for (i, inc) in log.incarnations.iter().enumerate() {
            for r in inc
                .records
                .values()
                .filter(|r| r.op_id.as_deref() == Some(id))
            {
                out.push_str(&format!(
                    "  incarnation {i} record {} on {} {:?} {:?}\n",
                    r.seq,
                    r.key,
                    r.kind,
                    String::from_utf8_lossy(&r.value)
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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
