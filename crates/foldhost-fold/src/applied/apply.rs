//! The domain-logic seam: [`Apply`] (a native Rust applier and a WebAssembly guest sit behind the
//! same trait), what `parse` answers ([`Verdict`]), what a failed call says ([`ApplyError`]), the
//! requests a running fold serves between batches ([`Control`]) and the native reference applier
//! ([`CountingApply`]).
//!
//! Invariant: calls cross the seam once per batch, and never inside a store commit.

use async_trait::async_trait;

use foldhost_core::kv::{KvUpdate, WatchCursor};
use foldhost_core::snapshot::SnapshotError;
use foldhost_core::view::FoldRead;

/// What `parse` says of one update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Apply it.
    Accept,
    /// Irrelevant or corrupt: nothing to apply, but the cursor covers it.
    Skip,
    /// This version cannot decode it: the host retains it (durably, in the fold) for a later
    /// version, and holds back every later update of its key ([`foldhost_core::retained`]).
    Defer,
}

/// A failed `parse` or `apply`, with the applier's own words.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
#[error("{applier}: {call} failed: {message}")]
pub struct ApplyError {
    /// Who failed (a guest's name and version, or a native applier's name).
    pub applier: String,
    /// Which call (`parse`, `apply`).
    pub call: &'static str,
    /// The applier's message.
    pub message: String,
}

/// The `call` of a swap's or shadow's refusal for a reason of the node's own — another swap or
/// shadow in progress, the fold's change capture overflowed or replaced, the fold unreadable —
/// which says nothing of the candidate ([`ApplyError::says_nothing_of_the_candidate`]): the caller
/// may try again later (a guest channel's follower does, docs/channels.md).
pub const NODE_CONDITION: &str = "node";

/// How an answer to a query that found no instance begins ([`ApplyError::rebuilding`]).
pub const GUEST_REBUILDING: &str = "guest rebuilding";

impl ApplyError {
    /// Whether this failure is the node's own condition, not the candidate's (a trap, a refusal
    /// at load): [`NODE_CONDITION`].
    pub fn says_nothing_of_the_candidate(&self) -> bool {
        self.call == NODE_CONDITION
    }

    /// The answer to a query that arrives while the applier's instance is lost (a failed call
    /// dropped it): given at once, never by rebuilding on the query's account. Retry: the fold
    /// loop rebuilds the instance as its own work ([`Apply::rebuild`]).
    pub fn rebuilding(applier: String, why: &str) -> Self {
        ApplyError {
            applier,
            call: "query",
            message: format!("{GUEST_REBUILDING} ({why}); retry"),
        }
    }

    /// Whether this is the answer [`ApplyError::rebuilding`] gives.
    pub fn is_rebuilding(&self) -> bool {
        self.call == "query" && self.message.starts_with(GUEST_REBUILDING)
    }
}

/// The domain-logic seam: what turns a batch of updates into live structures. A native Rust
/// implementation and a WebAssembly guest sit behind the same trait. Calls cross it once per batch.
#[async_trait]
pub trait Apply: Send {
    /// Name and version, for status and errors.
    fn describe(&self) -> String;

    /// The guest contract version (WIT package) this applier was bound to, for status; `None`
    /// for a native applier.
    fn contract(&self) -> Option<&'static str> {
        None
    }

    /// One verdict per update of `batch`, in order.
    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError>;

    /// Applies the updates of `batch` that `verdicts` accepted (the batch `parse` just saw).
    async fn apply(&mut self, batch: &[KvUpdate], verdicts: &[Verdict]) -> Result<(), ApplyError>;

    /// Called after the store committed through `cursor`.
    async fn on_applied(&mut self, cursor: WatchCursor);

    /// One verdict per update of `batch` of the state bucket the guest names `bucket` (a lane,
    /// [`crate::applied::lane`]); `apply` follows as for the main bucket. Appliers that fold no
    /// state bucket refuse it.
    async fn parse_lane(
        &mut self,
        bucket: &str,
        batch: &[KvUpdate],
    ) -> Result<Vec<Verdict>, ApplyError> {
        let _ = batch;
        Err(ApplyError {
            applier: self.describe(),
            call: "parse",
            message: format!("this applier folds no state bucket (asked for {bucket:?})"),
        })
    }

    /// The lane `bucket`'s store committed through `cursor`.
    async fn on_applied_lane(&mut self, bucket: &str, cursor: WatchCursor) {
        let _ = (bucket, cursor);
    }

    /// Whether this applier's `on-applied` may write outside the fold (a guest that owns a state
    /// bucket, docs/state.md): the fold then commits an intent ([`foldhost_core::retained::AppliedIntent`])
    /// with every commit that ends in `on-applied`, and hands it over with [`Apply::intend`] just
    /// before that call, so the writes' operation ids are the same when a restart calls it again.
    fn records_intents(&self) -> bool {
        false
    }

    /// The intent committed with the commit whose `on-applied` (of `bucket`; `""`: the main
    /// bucket) comes next.
    fn intend(&mut self, bucket: &str, intent: foldhost_core::retained::AppliedIntent) {
        let _ = (bucket, intent);
    }

    /// Drops whatever state the applier built that the committed fold does not back (after a
    /// failed release of retained records, or a re-queued batch's retry on another generation):
    /// the next call rebuilds it from the fold.
    fn discard(&mut self) {}

    /// Which build of the applier's state this is: a number that changes whenever the state is
    /// rebuilt from the fold (a guest's fresh instance). A batch re-queued after a failed commit
    /// remembers the generation it was applied to; its retry on another generation discards the
    /// state first ([`crate::applied::Fold`]), since that state was built from a fold without it.
    /// Appliers that never rebuild answer 0.
    fn generation(&self) -> u64 {
        0
    }

    /// True when the applier lost its state (a failed call) and answers queries with
    /// [`ApplyError::is_rebuilding`] until [`Apply::rebuild`] or its next batch rebuilds it. The
    /// fold loop rebuilds it as fold work, between flushes, once no batch waits re-queued.
    fn rebuild_due(&self) -> bool {
        false
    }

    /// Rebuilds lost state from the committed fold (a no-op when nothing is lost).
    async fn rebuild(&mut self) -> Result<(), ApplyError> {
        Ok(())
    }

    /// Test builds only (`testkit`): the applier's next call into a guest is interrupted as by
    /// its deadline (a real wasmtime trap through the real failure path). Appliers without a
    /// guest ignore it. How the seeded simulation places a guest trap at a chosen call.
    #[cfg(any(test, feature = "testkit"))]
    fn interrupt_next_call(&mut self) {}

    /// Starts a replacement of this applier from the component `bytes` (named `what`): checked now
    /// (compiled, its imports linked), then built and hydrated by the candidate itself from `view`
    /// (the fold at the swap's cursor C) beside the running applier, off the fold's path. Nothing of
    /// the running applier changes until [`Apply::adopt`].
    fn swap_candidate(
        &mut self,
        what: &str,
        _bytes: &[u8],
        _view: std::sync::Arc<dyn FoldRead>,
    ) -> Result<Box<dyn SwapCandidate>, ApplyError> {
        Err(ApplyError {
            applier: self.describe(),
            call: "swap",
            message: format!("this applier cannot be replaced by {what}"),
        })
    }

    /// Makes `candidate` — one this applier started, hydrated and caught up to the committed fold —
    /// the running applier. Called between batches with the fold settled. Returns what it
    /// replaced, for the caller to drop off the fold's path (a big instance takes a while to free).
    fn adopt(
        &mut self,
        candidate: Box<dyn SwapCandidate>,
    ) -> Result<Box<dyn std::any::Any + Send>, ApplyError> {
        Err(ApplyError {
            applier: self.describe(),
            call: "swap",
            message: format!("{} is not a replacement for it", candidate.describe()),
        })
    }

    /// A second instance of this applier for answering queries beside the fold (docs/design.md,
    /// "Queries off the fold's path"), reading the fold through `view`: hydrated by the caller
    /// ([`SwapCandidate::hydrate`]), then kept level by catch-up rounds
    /// ([`SwapCandidate::catch_up`]) and the state buckets' committed batches
    /// ([`SwapCandidate::apply_lane`]). `None` (the default): this applier has none, and its
    /// queries are answered by the fold loop between batches.
    fn query_instance(
        &mut self,
        view: std::sync::Arc<dyn FoldRead>,
    ) -> Option<Box<dyn SwapCandidate>> {
        let _ = view;
        None
    }

    /// Answers a query against the structure the applier built. Called between batches only, so it
    /// never sees a half-applied batch.
    async fn query(&mut self, _request: &[u8]) -> Result<Vec<u8>, ApplyError> {
        Err(ApplyError {
            applier: self.describe(),
            call: "query",
            message: "this applier answers no queries".into(),
        })
    }

    /// Captures this applier's state writes until [`Apply::end_capture`] (a shadow's comparison:
    /// docs/guests.md, "A trial touches nothing"): each admitted put or delete is recorded and
    /// answered from an overlay of its own, which its own reads see, and nothing is published.
    /// Queries answered beside the fold (its query instance) are not captured. Appliers without
    /// state buckets write nothing to capture.
    fn begin_capture(&mut self) {}

    /// The writes captured since the last call, in call order.
    fn take_captured(&mut self) -> Vec<CapturedWrite> {
        Vec::new()
    }

    /// Ends the capture: the overlay is dropped and writes are published again.
    fn end_capture(&mut self) {}
}

/// A replacement applier being built beside the running one ([`Apply::swap_candidate`]).
///
/// Its life: [`SwapCandidate::hydrate`] off the fold's path, from the fold at the swap's cursor C
/// while the running applier keeps folding; then, at the cut-over (between batches, the fold
/// settled), [`SwapCandidate::catch_up`] with the keys whose view changed since C, each once with
/// its value now; then [`Apply::adopt`]. A failure at any step refuses the swap and the running
/// applier never noticed.
#[async_trait]
pub trait SwapCandidate: Send {
    /// Name and version (known once `hydrate` read its manifest).
    fn describe(&self) -> String;

    /// Builds the new instance and its domain state from its view: instantiate, check it may
    /// replace the running applier (its scope), initialise, then every entry in scope. Returns the
    /// entries hydrated.
    async fn hydrate(&mut self) -> Result<u64, ApplyError>;

    /// Brings the hydrated instance level with the committed fold: `updates` are the keys changed
    /// since C, each once (a put of its entry now, or a synthetic delete, revision unknown). They
    /// are part of the rebuild from the fold, so they are applied as hydration applies: what the new
    /// version skips or defers is not built.
    async fn catch_up(&mut self, updates: &[KvUpdate]) -> Result<(), ApplyError>;

    /// Hands the levelled candidate every state bucket's fold (a lane's current values, then its
    /// end of current), on the fold's path at the cut-over, when no lane's batch is between its
    /// `apply` and its commit. Appliers without lanes have nothing to do.
    async fn catch_up_lanes(&mut self) -> Result<(), ApplyError> {
        Ok(())
    }

    /// Applies a state bucket's committed batch (`bucket` as the guest names it) as hydration
    /// applies: what the query instance, level with the bucket's fold before it, needs to be
    /// level after it. Candidates without lanes refuse it.
    async fn apply_lane(&mut self, bucket: &str, updates: &[KvUpdate]) -> Result<(), ApplyError> {
        let _ = updates;
        Err(ApplyError {
            applier: self.describe(),
            call: "apply",
            message: format!("this candidate folds no state bucket (asked for {bucket:?})"),
        })
    }

    /// Answers a query (a shadow's comparison): `Ok` with the candidate's own answer — its
    /// response, or the error it chose to give — or `Err` when the call itself failed (a trap, a
    /// deadline), after which the candidate is dead.
    async fn query(&mut self, request: &[u8]) -> Result<Result<Vec<u8>, String>, ApplyError> {
        let _ = request;
        Err(ApplyError {
            applier: self.describe(),
            call: "query",
            message: "this candidate answers no queries".into(),
        })
    }

    /// As [`Apply::begin_capture`], for the candidate.
    fn begin_capture(&mut self) {}

    /// As [`Apply::take_captured`], for the candidate.
    fn take_captured(&mut self) -> Vec<CapturedWrite> {
        Vec::new()
    }

    /// As [`Apply::end_capture`], for the candidate.
    fn end_capture(&mut self) {}

    /// The candidate as `Any`, for the applier that started it to take it back.
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send>;
}

/// What a hot swap did.
#[derive(Clone, Debug, serde::Serialize, PartialEq, Eq)]
pub struct SwapReport {
    /// The applier before (name@version).
    pub from: String,
    /// The applier after.
    pub to: String,
    /// Entries the new instance was rebuilt from.
    pub hydrated_entries: u64,
    /// How long the rebuild took, milliseconds (beside the running applier: the fold kept going).
    pub hydrate_ms: u64,
    /// Keys changed while the new instance hydrated, applied to it in catch-up rounds beside the
    /// fold and at the cut-over (a key changed in several rounds counts once per round).
    pub caught_up: u64,
    /// Catch-up rounds, the cut-over's included.
    pub catch_up_rounds: u32,
    /// How long the fold was paused for the cut-over (settling, catch-up, switch, release),
    /// milliseconds.
    pub paused_ms: u64,
    /// Retained records the new version applied and released.
    pub released: u64,
    /// Retained records still retained after the swap (the new version deferred them too).
    pub still_retained: u64,
}

/// Most differences a shadow report lists (all are counted).
pub const MAX_SHADOW_DIFFERENCES_LISTED: usize = 100;
/// Most captured writes of the candidate a shadow report lists (all are counted).
pub const MAX_SHADOW_WRITES_LISTED: usize = 100;
/// Most requests one shadow comparison sends to each side.
pub const MAX_SHADOW_REQUESTS: usize = 10_000;
/// Longest answer a shadow report quotes (the rest is cut, marked).
pub const MAX_SHADOW_QUOTE: usize = 200;
/// Longest a shadow's comparison may hold the fold: the requests not asked by then are not asked
/// (the report counts those that were, and a promotion needs them all).
pub const MAX_SHADOW_COMPARE: std::time::Duration = std::time::Duration::from_secs(10);

/// What a shadow asks: how many batches to feed the candidate beside the running applier, what
/// to ask both, and whether to promote a candidate that answered exactly like the running one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShadowPlan {
    /// Batches the fold commits, after the shadow began, that the candidate must have been fed
    /// before the comparison.
    pub batches: u64,
    /// The requests sent to both.
    pub requests: ShadowRequests,
    /// Swap to the candidate when it answered every request exactly as the running applier did
    /// (and only then).
    pub promote: bool,
    /// Requests the candidate may answer differently and still be promoted (0: none; a guest
    /// channel's release declares its own, docs/channels.md).
    pub tolerated: u64,
    /// Longest the shadow waits for its batches: an idle bucket may never commit them, so after
    /// this it compares on what it was fed (the report says how many batches that was).
    pub max_wait: std::time::Duration,
}

/// The requests of a shadow comparison.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShadowRequests {
    /// Up to this many keys in scope — first those changed during the shadow, then the first
    /// keys of the fold — each sent as the key without the scope prefix it matched (the SDKs'
    /// convention: a router is asked for a host, not for `route.<host>`).
    Sample(usize),
    /// The operator's own requests, in order.
    List(Vec<Vec<u8>>),
}

/// One request the candidate answered differently: its answer differs, or both wrote state and
/// their writes differ.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct ShadowDifference {
    /// The request (as text, lossily).
    pub request: String,
    /// The running applier's answer: `ok: …` or `error: …` (cut at [`MAX_SHADOW_QUOTE`]).
    pub live: String,
    /// The candidate's answer, the same way.
    pub candidate: String,
    /// The running applier's captured writes for it ([`CapturedWrite::describe`], the first 10
    /// and a count of the rest), when they differ from the candidate's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub live_writes: Vec<String>,
    /// The candidate's, the same way.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub candidate_writes: Vec<String>,
}

/// A state write made while writes were captured ([`Apply::begin_capture`]): never published.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapturedWrite {
    /// The bucket, as the guest names it.
    pub bucket: String,
    /// The key.
    pub key: String,
    /// The value put; `None`: a delete.
    pub value: Option<Vec<u8>>,
}

impl CapturedWrite {
    /// `put BUCKET KEY "VALUE"` or `delete BUCKET KEY`, the key and the value each cut at
    /// [`MAX_SHADOW_QUOTE`] characters.
    pub fn describe(&self) -> String {
        let cut = |s: &str| s.chars().take(MAX_SHADOW_QUOTE).collect::<String>();
        let key = cut(&self.key);
        match &self.value {
            Some(v) => {
                let value = cut(&String::from_utf8_lossy(v));
                format!("put {} {key} {value:?}", self.bucket)
            }
            None => format!("delete {} {key}", self.bucket),
        }
    }
}

/// A write the candidate made during a shadow's comparison, captured ([`ShadowReport`]).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct ShadowWrite {
    /// The request it answered (as text, lossily).
    pub request: String,
    /// The write ([`CapturedWrite::describe`]).
    pub write: String,
}

/// What a shadow did: the candidate fed beside the fold, compared, and promoted or dropped.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct ShadowReport {
    /// The running applier (name@version).
    pub live: String,
    /// The candidate.
    pub candidate: String,
    /// Entries the candidate was hydrated from, and how long that took (beside the fold).
    pub hydrated_entries: u64,
    /// Milliseconds of the hydration.
    pub hydrate_ms: u64,
    /// Batches the fold committed, and the candidate was fed, between the shadow's start and the
    /// comparison (fewer than asked when the wait ran out first).
    pub batches: u64,
    /// Keys those batches changed that reached the candidate (each once per catch-up round).
    pub caught_up: u64,
    /// Requests sent to both.
    pub requests: u64,
    /// Requests answered differently.
    pub differing: u64,
    /// The first of them ([`MAX_SHADOW_DIFFERENCES_LISTED`]).
    pub differences: Vec<ShadowDifference>,
    /// State writes the candidate made while compared: captured, answered from an overlay of its
    /// own, never published (the first [`MAX_SHADOW_WRITES_LISTED`]).
    #[serde(default)]
    pub candidate_writes: Vec<ShadowWrite>,
    /// How many state writes the candidate made while compared (all captured).
    #[serde(default)]
    pub candidate_writes_total: u64,
    /// How many the running applier made answering the same requests (all captured too).
    #[serde(default)]
    pub live_writes_total: u64,
    /// Whether the candidate replaced the running applier.
    pub promoted: bool,
    /// Why it was not promoted, when `promote` was asked.
    pub not_promoted: Option<String>,
    /// How long the fold paused for the comparison (and the switch), milliseconds.
    pub paused_ms: u64,
}

/// A request to the running fold, handled between batches.
pub enum Control {
    /// Replace the applier (a hot swap).
    Swap {
        /// The new component.
        bytes: Vec<u8>,
        /// What to call it in errors (a file name).
        what: String,
        /// Where the outcome goes.
        reply: tokio::sync::oneshot::Sender<Result<SwapReport, ApplyError>>,
    },
    /// Hydrate a candidate beside the applier, feed it the fold's next batches, compare the two
    /// on requests, then drop it or (asked, and only when they agreed) swap to it.
    Shadow {
        /// The candidate component.
        bytes: Vec<u8>,
        /// What to call it in errors (a file name).
        what: String,
        /// Batches, requests, promotion.
        plan: ShadowPlan,
        /// Where the outcome goes: the report, or why the shadow failed (the running applier and
        /// the fold untouched).
        reply: tokio::sync::oneshot::Sender<Result<ShadowReport, ApplyError>>,
    },
    /// End the shadow of `what` now, if one is pending: its requester no longer wants it (a
    /// channel's release moved on). The shadow's reply is an error that says nothing of the
    /// candidate; a shadow already concluded (its reply sent) is untouched.
    AbandonShadow {
        /// The candidate's name, as its `Shadow` gave it.
        what: String,
    },
    /// Copy the committed fold into `dir` (an existing empty directory) with
    /// [`foldhost_core::snapshot::SnapshotStore::export_to`], after flushing everything pending: the copy's cursor is the
    /// applied cursor, exactly. The rest of an export (verify, hash, manifest) runs off the fold's
    /// path ([`foldhost_artifact::artifact::seal`]).
    Export {
        /// Where the backend's files go.
        dir: std::path::PathBuf,
        /// The cursor the copy holds and what the store proved of it while writing it
        /// ([`foldhost_core::snapshot::ProvenCopy`]), or why it failed.
        reply: tokio::sync::oneshot::Sender<
            Result<(WatchCursor, Option<foldhost_core::snapshot::ProvenCopy>), SnapshotError>,
        >,
    },
    /// One step of a sweep of the operation ledger: remove the rows recorded before
    /// `cutoff_unix_ms` among at most [`foldhost_core::ledger::SWEEP_STEP`] and raise the watermark over
    /// them, in one commit under the current cursor ([`foldhost_core::ledger::sweep_step`]).
    SweepLedger {
        /// Rows recorded before this instant go.
        cutoff_unix_ms: u64,
        /// Where this step starts: after this row's key (`None`: the first step).
        after: Option<String>,
        /// How many rows went and where the next step starts (`None`: done), or why the step
        /// failed (the ledger is then untouched).
        reply: tokio::sync::oneshot::Sender<Result<(u64, Option<String>), String>>,
    },
    /// A state bucket's turn at the applier: its steps are served inline, nothing else between
    /// them ([`crate::applied::lane`]).
    Lane(crate::applied::LaneSession),
    /// Several lookups against the applier, answered in a row between two batches
    /// ([`crate::applied::Queries`] when no query instance is level).
    Queries {
        /// The requests, in order.
        lookups: Vec<Vec<u8>>,
        /// Where the answers go, one per lookup, in order.
        reply: tokio::sync::oneshot::Sender<Vec<Result<Vec<u8>, ApplyError>>>,
    },
    /// Run a query against the applier.
    Query {
        /// The request bytes.
        request: Vec<u8>,
        /// Where the answer goes.
        reply: tokio::sync::oneshot::Sender<Result<Vec<u8>, ApplyError>>,
    },
}

/// A native applier that counts what it sees: the built-in `apply` of `foldhost run` until a guest
/// is loaded, and the reference applier of the tests.
#[derive(Debug, Default, Clone)]
pub struct CountingApply {
    /// Updates parsed (deliveries that reached the applier).
    pub parsed: u64,
    /// Puts applied.
    pub puts: u64,
    /// Deletes and purges applied.
    pub deletes: u64,
    /// The last committed cursor seen by `on_applied`.
    pub last_cursor: WatchCursor,
}

#[async_trait]
impl Apply for CountingApply {
    fn describe(&self) -> String {
        "native:count".into()
    }

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        self.parsed += batch.len() as u64;
        Ok(vec![Verdict::Accept; batch.len()])
    }

    async fn apply(&mut self, batch: &[KvUpdate], verdicts: &[Verdict]) -> Result<(), ApplyError> {
        for (u, v) in batch.iter().zip(verdicts) {
            if *v == Verdict::Accept {
                match u {
                    KvUpdate::Put(_) => self.puts += 1,
                    KvUpdate::Delete { .. } | KvUpdate::Purge { .. } => self.deletes += 1,
                }
            }
        }
        Ok(())
    }

    async fn on_applied(&mut self, cursor: WatchCursor) {
        self.last_cursor = cursor;
    }
}
