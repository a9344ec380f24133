//! What a guest's state verbs reach (docs/state.md): the folds of its declared buckets (lanes), the
//! writer the host lends it, and the host's caps. The decisions are the protocol's
//! ([`crate::protocol::admit_state_write`]); this module holds what they decide from.
//!
//! Invariants:
//! - A read (`get`, `keys`) comes from the lane's committed fold, never from the server: what the
//!   guest was handed through `apply`, no round trip.
//! - A write reaches [`StateWriter`] only once the protocol admitted it, so every host-side refusal
//!   is answered before anything is published.
//! - A write never holds the guest call past its deadline: it is given what is left of it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::protocol::{StateBucket, StateCaps};
use crate::view::FoldRead;

/// One declared bucket as the guest reaches it.
#[derive(Clone)]
pub struct StateLane {
    /// The declaration: the guest's name for it, the server bucket, own or read.
    pub decl: StateBucket,
    /// The lane's committed fold.
    pub read: Arc<dyn FoldRead>,
    /// The bytes the bucket holds now (keys and values of its fold), for the size cap.
    pub holds: Arc<dyn Fn() -> u64 + Send + Sync>,
}

/// A write the protocol admitted, as the writer publishes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateWriteRequest {
    /// The key.
    pub key: String,
    /// The value of a put; `None` for a delete.
    pub value: Option<Vec<u8>>,
    /// The caller's operation id, if any (the writer mints one otherwise).
    pub op_id: Option<String>,
    /// Compare-and-set revision (0: absent).
    pub if_revision: Option<u64>,
    /// How long the writer may take, at most (within what is left of the guest call's deadline):
    /// past it the writer answers `unknown` with the operation id, never later.
    pub within: Duration,
    /// How long to wait for this node's fold of the bucket to apply the write before answering
    /// `pending` (never more than `within`): the guest's `wait-ms`, from `query` on the query
    /// instance only — elsewhere the fold that would apply it waits for the call, and it is 0.
    pub wait: Duration,
}

/// How an admitted write went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrittenOutcome {
    /// Durable and applied by this node's fold of the bucket.
    Applied,
    /// Durable, not yet applied here.
    Pending,
    /// Nothing can be established: retry with the same operation id.
    Unknown,
}

/// An admitted write's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    /// Applied, pending or unknown.
    pub outcome: WrittenOutcome,
    /// The operation id.
    pub op_id: String,
    /// The revision it is durable at, when known.
    pub revision: Option<u64>,
}

/// A write refused by the write path (or the server, through it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteRefused {
    /// One word (`conflict`, `op_reused`, `permission`, `invalid`, …).
    pub reason: String,
    /// For a person.
    pub message: String,
}

/// A boxed write in flight.
pub type WriteFuture<'a> = Pin<Box<dyn Future<Output = Result<Written, WriteRefused>> + Send + 'a>>;

/// Publishes admitted writes to a state bucket's server bucket (the host's write path), each
/// within its request's `within`.
pub trait StateWriter: Send + Sync {
    /// Writes `req` to `bucket` (its server name in `bucket.bucket`).
    fn write<'a>(&'a self, bucket: &'a StateBucket, req: StateWriteRequest) -> WriteFuture<'a>;
}

/// Everything a guest's state verbs reach: its lanes in declaration order, the writer and the caps.
#[derive(Clone)]
pub struct StateAccess {
    /// The declared buckets.
    pub lanes: Vec<StateLane>,
    /// The writer; `None` when the host lends none (a write is then refused `invalid`, saying so).
    pub writer: Option<Arc<dyn StateWriter>>,
    /// The host's caps.
    pub caps: StateCaps,
    /// Test builds only: writes skip the host's own checks and go straight to the writer, so a
    /// test can show what the server does with a write the host would have refused.
    pub unchecked: bool,
}

impl StateAccess {
    /// The lane the guest names `bucket`.
    pub(crate) fn lane(&self, bucket: &str) -> Option<&StateLane> {
        self.lanes.iter().find(|l| l.decl.local == bucket)
    }
}
