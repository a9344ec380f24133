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

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::Contents;

mod check;
mod register;

pub use check::check;
pub use register::{Register, RegisterOp, RegisterRet, TimedRegisterOp, linearizable};

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
