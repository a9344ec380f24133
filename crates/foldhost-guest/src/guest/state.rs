//! What a guest's state verbs reach (docs/state.md): the folds of its declared buckets (lanes), the
//! writer the host lends it, and the host's caps. The decisions are the protocol's
//! ([`foldhost_core::protocol::admit_state_write`]); this module holds what they decide from.
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

use foldhost_core::protocol::{StateBucket, StateCaps};
use foldhost_core::view::FoldRead;

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
    /// `op_id` is the host's own, derived for this write's first attempt (a first `on-applied`
    /// call's, docs/state.md): the writer publishes it as an id it minted, not as a retry.
    pub host_minted: bool,
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

/// Most bytes one side's captured writes may take in one comparison (each write's bucket, key and
/// value, and [`CAPTURED_WRITE_OVERHEAD`]): a trial that writes more is refused `invalid`,
/// saying so.
pub(crate) const MAX_CAPTURED_BYTES: usize = 16 << 20;
/// What one captured write is counted beyond its bytes (the overlay's entry and its strings).
pub(crate) const CAPTURED_WRITE_OVERHEAD: usize = 128;
/// Most writes captured between two [`WriteCapture::take`]s (one shadow request's): more are
/// refused `invalid`, saying so.
pub(crate) const MAX_CAPTURED_WRITES: usize = 1024;

/// The state writes of a guest while they are captured (a shadow's comparison, docs/guests.md,
/// "A trial touches nothing"): each admitted write is recorded and kept in an overlay its own
/// reads see; nothing reaches the writer.
#[derive(Default)]
pub(crate) struct WriteCapture {
    inner: std::sync::Mutex<Captured>,
}

#[derive(Default)]
struct Captured {
    /// Since the last take, in call order.
    taken: Vec<foldhost_fold::applied::CapturedWrite>,
    /// (bucket, key) → the value put, or `None` for a delete.
    overlay: std::collections::BTreeMap<(String, String), Option<Vec<u8>>>,
    bytes: usize,
    /// Operation ids minted since the last take (one request's).
    minted: u64,
}

impl WriteCapture {
    fn inner(&self) -> std::sync::MutexGuard<'_, Captured> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a put (`value`) or delete of `key` in `bucket` (as the guest names it) and returns
    /// the operation id to answer with: the guest's `op_id`, else one minted from the capture's
    /// count within the request — the same on both sides of a comparison, so a minted id never
    /// makes two answers differ. `Err` says why it is refused (a bound reached).
    pub(crate) fn record(
        &self,
        bucket: &str,
        key: &str,
        value: Option<Vec<u8>>,
        op_id: Option<String>,
    ) -> Result<String, String> {
        let mut c = self.inner();
        if c.taken.len() >= MAX_CAPTURED_WRITES {
            return Err(format!(
                "a trial's call captured {MAX_CAPTURED_WRITES} writes already"
            ));
        }
        let size =
            CAPTURED_WRITE_OVERHEAD + bucket.len() + key.len() + value.as_ref().map_or(0, Vec::len);
        if c.bytes.saturating_add(size) > MAX_CAPTURED_BYTES {
            return Err(format!(
                "a trial's captured writes hold {MAX_CAPTURED_BYTES} bytes already"
            ));
        }
        c.bytes += size;
        c.taken.push(foldhost_fold::applied::CapturedWrite {
            bucket: bucket.to_string(),
            key: key.to_string(),
            value: value.clone(),
        });
        c.overlay
            .insert((bucket.to_string(), key.to_string()), value);
        Ok(op_id.unwrap_or_else(|| {
            c.minted += 1;
            let mut counter = [0u8; 10];
            counter[2..].copy_from_slice(&c.minted.to_be_bytes());
            uuid::Builder::from_unix_timestamp_millis(0, &counter)
                .into_uuid()
                .to_string()
        }))
    }

    /// What the overlay says of `key` in `bucket`: `None` when the trial wrote nothing to it,
    /// `Some(None)` when it deleted it.
    pub(crate) fn get(&self, bucket: &str, key: &str) -> Option<Option<Vec<u8>>> {
        self.inner()
            .overlay
            .get(&(bucket.to_string(), key.to_string()))
            .cloned()
    }

    /// The overlay's keys of `bucket` under `prefix` and after `start_after`, with whether each
    /// is present (put) or gone (deleted).
    pub(crate) fn keys(
        &self,
        bucket: &str,
        prefix: &str,
        start_after: Option<&str>,
    ) -> Vec<(String, bool)> {
        self.inner()
            .overlay
            .iter()
            .filter(|((b, k), _)| {
                b == bucket && k.starts_with(prefix) && start_after.is_none_or(|a| k.as_str() > a)
            })
            .map(|((_, k), v)| (k.clone(), v.is_some()))
            .collect()
    }

    /// The writes since the last take, in call order.
    pub(crate) fn take(&self) -> Vec<foldhost_fold::applied::CapturedWrite> {
        let mut c = self.inner();
        c.minted = 0;
        std::mem::take(&mut c.taken)
    }
}

/// Where a guest's calls find the capture, while one runs: shared by every instance one [`Core`]
/// makes (a rebuilt instance keeps capturing), never by another core's (a query instance's).
///
/// [`Core`]: super::Core
pub(crate) type CaptureSlot = Arc<std::sync::Mutex<Option<Arc<WriteCapture>>>>;
