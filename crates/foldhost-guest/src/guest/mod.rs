//! WebAssembly guests behind the [`Apply`] seam: one wasmtime [`Engine`], components compiled once
//! and cached by content hash, imports type-checked before anything runs (`InstancePre`), a fresh
//! `Store` per instance, an epoch deadline and a memory cap on every call.
//!
//! Invariants:
//! - Only `guest/bindings/` names generated types; everything else speaks the host's types.
//! - **No ambient authority.** A guest imports fold reads, logging and (0.3.0) its declared state
//!   buckets (the WIT world, docs/state.md) and the WASI
//!   interfaces Rust's std pulls in. Those are linked from `wasmtime-wasi` with an *empty* context:
//!   no preopened directories, no environment, no arguments, sockets and name lookup refused, stdin
//!   closed, stdout discarded, stderr kept (16 KiB) only to report a panic message, and a clock that
//!   never moves (time 0). Random numbers are deterministic streams fixed by the host's seed and
//!   the component's digest (`guest/random.rs`): every instance of a component draws the same numbers.
//!   Anything else a component imports is refused at load, naming the import.
//! - **Compiled once.** A component is compiled once per engine (kept in memory by its BLAKE3) and,
//!   with a cache directory, once per machine: [`cache`] loads a checked entry, or compiles and
//!   writes one. Nothing is loaded from disk that [`cache`] did not check.
//! - **Every call is bounded**: re-armed epoch deadline before each call (a ticker thread advances the
//!   epoch every [`TICK`]), memory capped by `StoreLimits`, batches passed whole, and the host
//!   memory a guest can make the host hold bounded too: its WASI resource table (each handle it
//!   holds is an entry) and its component-model handles, both at most
//!   [`GuestLimits::resource_entries`].
//! - **A failed call kills the instance.** After a trap, a deadline, a memory-cap hit or an `apply`
//!   error the instance is dropped; the next batch (or the fold loop's own [`Apply::rebuild`])
//!   builds a fresh one and rebuilds it from the committed fold (hydration) before retrying — so a
//!   retried batch never lands on half-applied domain state. A query never builds one: while no
//!   instance lives it is answered at once, "guest rebuilding" ([`ApplyError::rebuilding`]), so a
//!   hostile query cannot make the fold rehydrate on its account. Every instance built counts a
//!   generation ([`Apply::generation`]). The resource table lives in the instance's `Store`, so
//!   whatever handles the guest leaked go with it; handles a guest keeps across calls that succeed
//!   are its own (a guest may hold a stream), bounded by the same limit, and reaching it is a
//!   failed call like any other.

mod bindings;
pub mod cache;
mod candidate;
mod engine;
mod hydration;
mod instance;
mod random;
mod replay;
pub mod state;

use candidate::GuestCandidate;
pub use engine::{EngineOptions, GuestEngine, Prepared};
#[cfg(test)]
use hydration::Page;
use hydration::PageReader;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine, Store};

use bindings::{FolderInstance, FolderPre, HostState, MAX_MESSAGE_BYTES, clip_text};
use foldhost_core::kv::{KvEntry, KvUpdate, WatchCursor, WatchScope};
use foldhost_core::view::FoldRead;
use foldhost_fold::applied::{Apply, ApplyError, LaneLink, SwapCandidate, Verdict};
use state::StateAccess;

/// Compiled components kept by one engine (the running one, the one before, a swap candidate…).
pub(crate) const MAX_CACHED_COMPONENTS: usize = 8;

/// Longest guest name or version accepted from a manifest.
pub(crate) const MAX_MANIFEST_NAME: usize = 128;
/// Most scope prefixes a manifest may declare.
pub(crate) const MAX_SCOPE_PREFIXES: usize = 256;

/// The wasm stack of a guest call, in bytes (a deeper recursion traps).
pub(crate) const MAX_WASM_STACK: usize = 512 * 1024;

/// Largest answer a guest's `query` may give.
pub(crate) const MAX_QUERY_ANSWER_BYTES: usize = 16 * 1024 * 1024;

/// The default of [`GuestLimits::resource_entries`]. The guests in `guests/` (Rust, C, JavaScript,
/// Python) hold a handful at a time; a guest that leaks a handle per call reaches it and is rebuilt.
pub const DEFAULT_RESOURCE_ENTRIES: usize = 4096;

/// How often the epoch advances: the granularity of call deadlines.
pub(crate) const TICK: Duration = Duration::from_millis(2);

/// Per-guest limits. Defaults: 1 s per call, 256 MiB of memory, 16 MiB of keys and values per
/// call, hydration in chunks of 1 000, [`DEFAULT_RESOURCE_ENTRIES`] host resources.
#[derive(Clone, Copy, Debug)]
pub struct GuestLimits {
    /// Longest one call may run (a whole batch's `apply`, one hydration chunk).
    pub call_deadline: Duration,
    /// Most linear memory a guest may hold.
    pub memory_bytes: usize,
    /// Entries per call while hydrating a fresh instance from the fold.
    pub hydrate_chunk: usize,
    /// Most key and value bytes passed in one call. A larger batch is refused with this limit
    /// named; the fold then retries it in halves, so only a single update over the limit stops it.
    pub max_batch_bytes: usize,
    /// Most host resources an instance may hold at once: entries in the host's WASI resource
    /// table (a stream, a pollable, a network… each handle a guest is given, until it drops it)
    /// and, the same number, component-model handles. Both live in host memory, outside the
    /// memory cap; one more traps the call with this limit named.
    pub resource_entries: usize,
}

impl Default for GuestLimits {
    fn default() -> Self {
        GuestLimits {
            call_deadline: Duration::from_secs(1),
            memory_bytes: 256 * 1024 * 1024,
            hydrate_chunk: 1000,
            max_batch_bytes: 16 * 1024 * 1024,
            resource_entries: DEFAULT_RESOURCE_ENTRIES,
        }
    }
}

/// Errors loading or running a guest.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    /// The engine could not be built.
    #[error("wasm engine: {0}")]
    Engine(String),
    /// The file could not be read.
    #[error("{path}: {reason}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The bytes are not a component this host can compile.
    #[error("{what}: not a loadable component: {reason}")]
    Compile {
        /// The file or guest.
        what: String,
        /// The compiler's message.
        reason: String,
    },
    /// The component imports or exports something this host does not match.
    #[error("{what}: refused at load: {reason}")]
    Link {
        /// The file or guest.
        what: String,
        /// The linker's message (names the import).
        reason: String,
    },
    /// A call failed (trap, deadline, memory cap, or the guest's own error).
    #[error(transparent)]
    Call(#[from] ApplyError),
}

/// A guest's manifest, in host types.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestManifest {
    /// The guest's name.
    pub name: String,
    /// Its version.
    pub version: String,
    /// The key prefixes it wants; empty = all.
    pub scope: Vec<String>,
    /// The state buckets it owns (0.3.0; docs/state.md).
    pub state: Vec<foldhost_core::protocol::OwnedDecl>,
    /// Other modules' buckets it reads, each `<module>.<name>`.
    pub reads: Vec<String>,
}

impl GuestManifest {
    /// The watch scope the manifest asks for.
    pub fn watch_scope(&self) -> WatchScope {
        match self.scope.as_slice() {
            [] => WatchScope::All,
            [one] => WatchScope::Prefix(one.clone()),
            many => WatchScope::Prefixes(many.to_vec()),
        }
    }

    /// The prefixes a hydration scans, each key in scope under exactly one: a manifest may name
    /// overlapping prefixes (`a` and `ab`), and scanning both handed every key under `ab` to the
    /// guest twice — a counting guest then counted it twice.
    pub(crate) fn hydration_prefixes(&self) -> Vec<String> {
        self.watch_scope().disjoint_prefixes()
    }
}

struct Live {
    store: Store<HostState>,
    guest: FolderInstance,
}

/// What a guest's calls need besides the instance: `Sync`, so it can be borrowed across awaits
/// while the (non-`Sync`) instance is borrowed mutably beside it.
struct Core {
    /// Keeps the engine — and its epoch ticker, without which no deadline fires — alive, and
    /// compiles replacements.
    engine: Arc<GuestEngine>,
    pre: FolderPre,
    /// The component's BLAKE3: with the engine's seed, it fixes the instance's random streams.
    digest: [u8; 32],
    manifest: GuestManifest,
    limits: GuestLimits,
    config: Vec<(String, String)>,
    fold: Arc<dyn FoldRead>,
    /// The state buckets every instance of this guest reaches, once attached.
    state: Arc<OnceLock<StateAccess>>,
    /// Shared with the lanes: the generation and their discard requests.
    link: Arc<LaneLink>,
    /// Failed calls and rebuilds, counted for the fold's status (kept across swaps).
    counters: Arc<foldhost_core::status::GuestCounters>,
    /// A trial: a swap or shadow candidate not adopted yet (or a query instance of one). Its
    /// failed calls are never the running version's
    /// ([`foldhost_core::status::GuestCounters::running_failures`]).
    trial: bool,
    /// Its instances answer queries beside the fold (the query instance): a state write from
    /// their `query` may wait for the fold to apply it.
    answers_beside_fold: bool,
    /// The capture of this core's state writes while one runs ([`Apply::begin_capture`]): every
    /// instance it makes shares it; no other core does.
    capture: state::CaptureSlot,
    /// Test builds only: the next call is armed with a deadline already passed, so wasmtime
    /// interrupts it at its first epoch check — a real deadline trap at a chosen call.
    #[cfg(any(test, feature = "testkit"))]
    interrupt_next: AtomicBool,
}

/// A guest as an [`Apply`]: parse/apply/on-applied/query cross into the component, once per batch.
pub struct GuestApply {
    core: Core,
    live: Option<Live>,
    /// Hydrations run (fresh instances rebuilt from the fold), for status and tests.
    pub hydrations: u64,
    /// Entries streamed into the last hydration, and how long it took.
    pub last_hydration: Option<(u64, Duration)>,
    /// Why the instance was lost, while it is (for the "guest rebuilding" answer).
    lost: Option<String>,
    /// The `on-applied` intents handed over and the calls owed again ([`replay`]).
    replays: replay::Replays,
}

impl Core {
    /// A core for the component at `bytes`, compiled (or found in the engine's caches), with a
    /// placeholder manifest until its first instance names itself.
    fn prepared(
        engine: &Arc<GuestEngine>,
        what: &str,
        bytes: &[u8],
        limits: GuestLimits,
        config: Vec<(String, String)>,
        fold: Arc<dyn FoldRead>,
    ) -> Result<Self, GuestError> {
        let (pre, prepared) = engine.prepare_traced(what, bytes)?;
        Ok(Core {
            engine: engine.clone(),
            pre,
            digest: prepared.digest,
            manifest: GuestManifest {
                name: what.to_string(),
                version: "?".into(),
                scope: Vec::new(),
                state: Vec::new(),
                reads: Vec::new(),
            },
            limits,
            config,
            fold,
            state: Arc::new(OnceLock::new()),
            link: Arc::new(LaneLink::default()),
            counters: Arc::default(),
            trial: false,
            answers_beside_fold: false,
            capture: Default::default(),
            #[cfg(any(test, feature = "testkit"))]
            interrupt_next: AtomicBool::new(false),
        })
    }

    /// Starts a fresh capture of this core's state writes ([`Apply::begin_capture`]).
    fn begin_capture(&self) {
        *self
            .capture
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::default());
    }

    /// The writes captured since the last take.
    fn take_captured(&self) -> Vec<foldhost_fold::applied::CapturedWrite> {
        self.capture
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|c| c.take())
            .unwrap_or_default()
    }

    /// Whether a capture runs.
    fn capturing(&self) -> bool {
        self.capture
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some()
    }

    /// Ends the capture: writes are published again.
    fn end_capture(&self) {
        *self
            .capture
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

impl GuestApply {
    /// Loads the component at `bytes` (named `what` in errors), reads its manifest from a first
    /// instance, and keeps that instance (initialised, not yet hydrated).
    pub async fn load(
        engine: &Arc<GuestEngine>,
        what: &str,
        bytes: &[u8],
        limits: GuestLimits,
        config: Vec<(String, String)>,
        fold: Arc<dyn FoldRead>,
    ) -> Result<Self, GuestError> {
        let mut core = Core::prepared(engine, what, bytes, limits, config, fold)?;
        let mut live = core.instantiate().await?;
        core.manifest = core.call_manifest(&mut live).await?;
        // From here on its log lines carry its name@version, not the file it came from.
        live.store.data_mut().set_guest(core.describe());
        core.call_init(&mut live).await?;
        Ok(GuestApply {
            core,
            live: Some(live),
            hydrations: 0,
            last_hydration: None,
            lost: None,
            replays: Default::default(),
        })
    }

    /// The manifest the component at `bytes` declares, read from an instance that is never
    /// initialised and then dropped: it compiles, links and names itself (a publisher's check,
    /// docs/channels.md).
    pub async fn read_manifest(
        engine: &Arc<GuestEngine>,
        what: &str,
        bytes: &[u8],
    ) -> Result<GuestManifest, GuestError> {
        let core = Core::prepared(
            engine,
            what,
            bytes,
            GuestLimits::default(),
            Vec::new(),
            Arc::new(foldhost_core::view::EmptyFold),
        )?;
        let mut live = core.instantiate().await?;
        Ok(core.call_manifest(&mut live).await?)
    }

    /// Counts this guest's failed calls and rebuilds into `counters` (the fold's status), from now
    /// on and across swaps.
    pub fn count_into(&mut self, counters: Arc<foldhost_core::status::GuestCounters>) {
        self.core.counters = counters;
    }

    /// The guest's manifest.
    pub fn manifest(&self) -> &GuestManifest {
        &self.core.manifest
    }

    /// Attaches the folds of the buckets the manifest declares (docs/state.md), before the first
    /// hydration: every instance from now on is hydrated from them and reaches them through the
    /// `state` import. Once per guest; a second attach is refused.
    pub fn attach_state(&mut self, access: StateAccess) -> Result<(), ApplyError> {
        // Its `on-applied` may write: every commit of its folds records an intent (`replay`).
        let writes = access.writer.is_some()
            && access
                .lanes
                .iter()
                .any(|l| l.decl.access == foldhost_core::protocol::Access::Own);
        self.core
            .state
            .set(access)
            .map_err(|_| self.core.err("init", "state buckets attached twice".into()))?;
        self.core.link.set_records_intents(writes);
        Ok(())
    }

    /// What the lanes share with this guest (its generation, their discard requests).
    pub fn lane_link(&self) -> Arc<LaneLink> {
        self.core.link.clone()
    }

    /// `parse` of `bucket`'s batch (`""`: the main bucket), over the byte limit refused.
    async fn parse_in(
        &mut self,
        bucket: &str,
        batch: &[KvUpdate],
    ) -> Result<Vec<Verdict>, ApplyError> {
        let bytes: usize = batch.iter().map(KvUpdate::byte_len).sum();
        if bytes > self.core.limits.max_batch_bytes {
            return Err(self.core.err(
                "parse",
                format!(
                    "a batch of {} updates carries {bytes} bytes, over the guest's max-batch-bytes limit of {}",
                    batch.len(),
                    self.core.limits.max_batch_bytes
                ),
            ));
        }
        let mut live = self.live().await?;
        let updates: Vec<bindings::Update<'_>> =
            batch.iter().map(bindings::to_wit_update).collect();
        let r = self.core.call_parse(&mut live, bucket, &updates).await;
        if r.is_ok() {
            self.live = Some(live);
        }
        r
    }

    /// `on-applied` of `bucket` (`""`: the main bucket). On a failure the batch is committed but
    /// the instance is not trustworthy any more: the next batch rebuilds a fresh one from the
    /// folds, which makes the call again first when the guest records intents (`replay`).
    async fn on_applied_in(&mut self, bucket: &str, cursor: WatchCursor) {
        self.take_lane_discard();
        let intent = self.replays.next.remove(bucket);
        let Some(mut live) = self.live.take() else {
            // No instance to call (a lane dropped it): the next fresh one makes the call.
            if let Some(i) = intent {
                self.replays.failed(bucket, i);
            }
            return;
        };
        let revision = cursor.revision_or_zero();
        match self
            .call_on_applied(&mut live, bucket, revision, intent.map(|i| (i, false)))
            .await
        {
            Ok(()) => self.live = Some(live),
            Err(err) => {
                tracing::warn!(event = "guest_trapped", error = %err, "guest failed after a commit; rebuilding it");
                if let Some(i) = intent {
                    self.replays.failed(bucket, i);
                }
            }
        }
    }

    /// A lane asked for the live instance to go: it goes now, before any call.
    fn take_lane_discard(&mut self) {
        if self.core.link.take_discard() {
            self.live = None;
        }
    }

    /// Builds the first instance's domain state from the committed fold (a no-op when the live
    /// instance is already hydrated). Call before the first batch.
    pub async fn hydrate(&mut self) -> Result<(), ApplyError> {
        let live = self.live().await?;
        self.live = Some(live);
        Ok(())
    }

    /// The live instance, building and hydrating a fresh one if the last call killed it.
    async fn live(&mut self) -> Result<Live, ApplyError> {
        self.take_lane_discard();
        let l = match self.live.take() {
            Some(l) if self.hydrations > 0 => return Ok(l),
            Some(l) => l,
            None => self.core.fresh().await?,
        };
        let mut l = self.hydrated(l).await?;
        // A call made again that fails takes its instance along and is not made again: a fresh
        // one makes the rest. Each turn makes one fewer, so this ends.
        loop {
            match self.replay_due(l).await? {
                Some(l) => return Ok(l),
                None => l = self.hydrated(self.core.fresh().await?).await?,
            }
        }
    }

    /// `l` hydrated from the folds, counted as a rebuild after the first.
    async fn hydrated(&mut self, mut l: Live) -> Result<Live, ApplyError> {
        let stats = self.core.stream_fold(&mut l, false).await?;
        if self.hydrations > 0 {
            self.core
                .counters
                .rebuilds
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.hydrations += 1;
        self.core.link.set_generation(self.hydrations);
        self.last_hydration = Some(stats);
        self.lost = None;
        Ok(l)
    }
}

#[async_trait]
impl Apply for GuestApply {
    fn describe(&self) -> String {
        self.core.describe()
    }

    fn contract(&self) -> Option<&'static str> {
        Some(self.core.pre.contract().as_str())
    }

    fn records_intents(&self) -> bool {
        self.core.link.records_intents()
    }

    fn intend(&mut self, bucket: &str, intent: foldhost_core::retained::AppliedIntent) {
        self.replays.next.insert(bucket.to_string(), intent);
    }

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        self.parse_in("", batch).await
    }

    async fn parse_lane(
        &mut self,
        bucket: &str,
        batch: &[KvUpdate],
    ) -> Result<Vec<Verdict>, ApplyError> {
        if bucket.is_empty() || self.core.lane(bucket).is_none() {
            return Err(self.core.err(
                "parse",
                format!("{bucket:?} is not a bucket this guest declares"),
            ));
        }
        self.parse_in(bucket, batch).await
    }

    async fn on_applied_lane(&mut self, bucket: &str, cursor: WatchCursor) {
        self.on_applied_in(bucket, cursor).await;
    }

    async fn apply(
        &mut self,
        _batch: &[KvUpdate],
        _verdicts: &[Verdict],
    ) -> Result<(), ApplyError> {
        let Some(mut live) = self.live.take() else {
            return Err(self
                .core
                .err("apply", "no live instance (parse failed)".into()));
        };
        let r = self.core.call_apply(&mut live).await;
        if r.is_ok() {
            self.live = Some(live);
        }
        r
    }

    fn discard(&mut self) {
        // The next call builds a fresh instance and hydrates it from the fold.
        self.live = None;
    }

    #[cfg(any(test, feature = "testkit"))]
    fn interrupt_next_call(&mut self) {
        self.core.interrupt_next.store(true, Ordering::Relaxed);
    }

    async fn on_applied(&mut self, cursor: WatchCursor) {
        self.on_applied_in("", cursor).await;
    }

    fn query_instance(&mut self, view: Arc<dyn FoldRead>) -> Option<Box<dyn SwapCandidate>> {
        // The same compiled component, limits, configuration and state buckets; its own store and
        // instance, reading the fold through `view`.
        Some(Box::new(GuestCandidate {
            core: Core {
                engine: self.core.engine.clone(),
                pre: self.core.pre.clone(),
                digest: self.core.digest,
                manifest: self.core.manifest.clone(),
                limits: self.core.limits,
                config: self.core.config.clone(),
                fold: view,
                state: self.core.state.clone(),
                // Its own: a lane's discard request is the running instance's, not this one's.
                link: Arc::new(LaneLink::default()),
                counters: self.core.counters.clone(),
                trial: self.core.trial,
                answers_beside_fold: true,
                capture: Default::default(),
                #[cfg(any(test, feature = "testkit"))]
                interrupt_next: AtomicBool::new(false),
            },
            live: None,
            running: self.core.manifest.clone(),
            hydrated: None,
        }))
    }

    fn swap_candidate(
        &mut self,
        what: &str,
        bytes: &[u8],
        view: Arc<dyn FoldRead>,
    ) -> Result<Box<dyn SwapCandidate>, ApplyError> {
        let from = self.describe();
        // Compiled already by the caller off the fold's path (the cache makes this a lookup); the
        // import check runs again here all the same.
        let (pre, prepared) =
            self.core
                .engine
                .prepare_traced(what, bytes)
                .map_err(|e| ApplyError {
                    applier: from.clone(),
                    call: "swap",
                    message: e.to_string(),
                })?;
        Ok(Box::new(GuestCandidate {
            core: Core {
                engine: self.core.engine.clone(),
                pre,
                digest: prepared.digest,
                manifest: GuestManifest {
                    name: what.to_string(),
                    version: "?".into(),
                    scope: Vec::new(),
                    state: Vec::new(),
                    reads: Vec::new(),
                },
                limits: self.core.limits,
                config: self.core.config.clone(),
                fold: view,
                // The same buckets and the same lanes: a swap keeps the declarations.
                state: self.core.state.clone(),
                link: self.core.link.clone(),
                counters: self.core.counters.clone(),
                trial: true,
                answers_beside_fold: false,
                capture: Default::default(),
                #[cfg(any(test, feature = "testkit"))]
                interrupt_next: AtomicBool::new(false),
            },
            live: None,
            running: self.core.manifest.clone(),
            hydrated: None,
        }))
    }

    fn adopt(
        &mut self,
        candidate: Box<dyn SwapCandidate>,
    ) -> Result<Box<dyn std::any::Any + Send>, ApplyError> {
        let described = candidate.describe();
        let c = candidate
            .into_any()
            .downcast::<GuestCandidate>()
            .map_err(|_| self.core.err("swap", format!("{described} is not a guest")))?;
        let GuestCandidate {
            mut core,
            live,
            hydrated,
            ..
        } = *c;
        // Adopted, it is the running version: its failures judge it from the cut-over on.
        core.trial = false;
        let (Some(live), Some(stats)) = (live, hydrated) else {
            return Err(self
                .core
                .err("swap", format!("{described} was not hydrated")));
        };
        let retired = (
            std::mem::replace(&mut self.core, core),
            self.live.replace(live),
        );
        self.hydrations += 1;
        self.core.link.set_generation(self.hydrations);
        self.last_hydration = Some(stats);
        self.drop_owed();
        Ok(Box::new(retired))
    }

    fn generation(&self) -> u64 {
        self.hydrations
    }

    fn rebuild_due(&self) -> bool {
        self.live.is_none() || self.core.link.discard_requested()
    }

    async fn rebuild(&mut self) -> Result<(), ApplyError> {
        self.take_lane_discard();
        if self.live.is_some() {
            return Ok(());
        }
        match self.live().await {
            Ok(l) => {
                self.live = Some(l);
                Ok(())
            }
            Err(e) => {
                self.lost = Some(format!("the last rebuild failed: {}", e.message));
                Err(e)
            }
        }
    }

    async fn query(&mut self, request: &[u8]) -> Result<Vec<u8>, ApplyError> {
        // No instance: answered at once. Building one here would put a hydration on the fold's
        // path on a query's account, ahead of the deliveries waiting (a query that spins to its
        // deadline, asked in a loop, rebuilt the guest after every answer and stopped the fold).
        self.take_lane_discard();
        let mut live = match self.live.take() {
            Some(l) if self.hydrations > 0 => l,
            Some(l) => {
                // The first instance, not hydrated yet (before the fold's first batch).
                self.live = Some(l);
                self.live().await?
            }
            None => {
                let why = self
                    .lost
                    .clone()
                    .unwrap_or_else(|| "a failed call dropped the instance".into());
                return Err(ApplyError::rebuilding(self.core.describe(), &why));
            }
        };
        let answer = match self.core.query(&mut live, request).await {
            Ok(a) => a,
            Err(e) => {
                // The call failed: the instance is dead (dropped with `live`).
                self.lost = Some(format!("a query failed: {}", e.message));
                return Err(e);
            }
        };
        // Answered (either way): the instance lives on.
        self.live = Some(live);
        answer.map_err(|m| self.core.err("query", m))
    }

    fn begin_capture(&mut self) {
        self.core.begin_capture();
    }

    fn take_captured(&mut self) -> Vec<foldhost_fold::applied::CapturedWrite> {
        self.core.take_captured()
    }

    fn end_capture(&mut self) {
        self.core.end_capture();
    }
}

/// Reads a guest file, naming it in the error.
pub fn read_guest_file(path: &std::path::Path) -> Result<Vec<u8>, GuestError> {
    std::fs::read(path).map_err(|e| GuestError::Read {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::{GuestEngine, Page};

    #[test]
    fn a_component_exporting_no_folder_is_refused_naming_every_contract() {
        let engine = GuestEngine::new().expect("engine");
        let err = engine
            .prepare("empty", b"(component)")
            .err()
            .expect("an empty component is refused")
            .to_string();
        assert!(
            err.contains("fits no guest contract")
                && err.contains("foldhost:guest@0.3.0")
                && err.contains("@0.2.0")
                && err.contains("@0.1.0"),
            "{err}"
        );
    }
    #[test]
    fn a_manifest_with_overlapping_prefixes_hydrates_each_key_under_one_prefix() {
        let m = |scope: &[&str]| super::GuestManifest {
            name: "g".into(),
            version: "1".into(),
            scope: scope.iter().map(|s| s.to_string()).collect(),
            state: Vec::new(),
            reads: Vec::new(),
        };
        assert_eq!(m(&[]).hydration_prefixes(), [""]);
        assert_eq!(
            m(&["b/", "a", "ab", "b/x"]).hydration_prefixes(),
            ["a", "b/"]
        );
        assert_eq!(m(&["r/", "", "x"]).hydration_prefixes(), [""]);
    }

    use foldhost_core::kv::{KvEntry, VersionToken};

    fn entry(key: &str, value: &[u8], revision: u64) -> KvEntry {
        KvEntry {
            key: key.to_string(),
            value: bytes::Bytes::copy_from_slice(value),
            version: VersionToken::from_u64(revision),
        }
    }

    #[test]
    fn a_hydration_page_hands_back_every_entry_as_pushed_and_is_reused_empty() {
        let mut page = Page::default();
        assert_eq!(page.last_key(), None);
        assert!(page.updates().is_empty());
        let entries = [
            entry("route.é", b"{\"upstream\":\"1\"}", 3),
            entry("route.b", b"", 7),
            entry("", b"x", 9),
            entry("route.ü.last", b"\xff\x00", u64::MAX),
        ];
        for e in &entries {
            page.push(e);
        }
        let got: Vec<(String, Vec<u8>, u64)> = page
            .updates()
            .iter()
            .map(|u| {
                assert!(matches!(u.op, super::bindings::Op::Put));
                (u.key.to_string(), u.value.to_vec(), u.revision)
            })
            .collect();
        let want: Vec<(String, Vec<u8>, u64)> = entries
            .iter()
            .map(|e| {
                (
                    e.key.clone(),
                    e.value.to_vec(),
                    e.version.as_u64().unwrap_or(0),
                )
            })
            .collect();
        assert_eq!(got, want);
        assert_eq!(page.last_key(), Some("route.ü.last"));
        page.clear();
        assert_eq!(page.last_key(), None);
        page.push(&entries[1]);
        assert_eq!(page.last_key(), Some("route.b"));
        assert_eq!(page.updates().len(), 1);
    }

    /// A fold of sorted entries as a [`FoldRead`]; `fail_after` pages, every scan fails.
    struct Sorted {
        entries: Vec<KvEntry>,
        fail_after: Option<usize>,
        scans: std::sync::atomic::AtomicUsize,
    }

    impl foldhost_core::view::FoldRead for Sorted {
        fn get(
            &self,
            key: &str,
        ) -> Result<Option<KvEntry>, foldhost_core::snapshot::SnapshotError> {
            Ok(self.entries.iter().find(|e| e.key == key).cloned())
        }

        fn scan(
            &self,
            prefix: &str,
            start_after: Option<&str>,
            limit: usize,
        ) -> Result<Vec<KvEntry>, foldhost_core::snapshot::SnapshotError> {
            let n = self.scans.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if self.fail_after.is_some_and(|f| n >= f) {
                return Err(foldhost_core::snapshot::SnapshotError::Backend(
                    "disk gone".into(),
                ));
            }
            Ok(self
                .entries
                .iter()
                .filter(|e| e.key.starts_with(prefix))
                .filter(|e| start_after.is_none_or(|a| e.key.as_str() > a))
                .take(limit)
                .cloned()
                .collect())
        }

        fn visit(
            &self,
            prefix: &str,
            visit: &mut dyn FnMut(&KvEntry) -> std::ops::ControlFlow<()>,
        ) -> Result<(), foldhost_core::snapshot::SnapshotError> {
            for e in self.entries.iter().filter(|e| e.key.starts_with(prefix)) {
                if visit(e).is_break() {
                    break;
                }
            }
            Ok(())
        }
    }

    fn sorted(n: usize, fail_after: Option<usize>) -> std::sync::Arc<Sorted> {
        let mut entries: Vec<KvEntry> = (0..n)
            .map(|i| entry(&format!("{}.{i:05}", ["a", "b"][i % 2]), b"v", i as u64 + 1))
            .collect();
        entries.sort_by(|x, y| x.key.cmp(&y.key));
        std::sync::Arc::new(Sorted {
            entries,
            fail_after,
            scans: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// Every key the reader hands over, page by page, recycling each page.
    async fn read_all(
        reader: &mut super::PageReader,
    ) -> Result<Vec<String>, foldhost_core::snapshot::SnapshotError> {
        let mut keys = Vec::new();
        while let Some(page) = reader.next().await {
            let page = page?;
            keys.extend(page.updates().iter().map(|u| u.key.to_string()));
            reader.recycle(page);
        }
        Ok(keys)
    }

    #[tokio::test]
    async fn the_page_reader_hands_over_every_entry_in_scope_once_in_order_whatever_the_page_size()
    {
        let fold = sorted(1_003, None);
        for chunk in [1, 7, 500, 501, 1_003, 5_000] {
            for prefixes in [
                vec![String::new()],
                vec!["b.".to_string(), "a.".to_string()],
            ] {
                let want: Vec<String> = prefixes
                    .iter()
                    .flat_map(|p| {
                        fold.entries
                            .iter()
                            .filter(move |e| e.key.starts_with(p.as_str()))
                            .map(|e| e.key.clone())
                    })
                    .collect();
                let mut reader = super::PageReader::start(fold.clone(), prefixes.clone(), chunk);
                let got = read_all(&mut reader).await.expect("read");
                assert_eq!(got, want, "chunk {chunk}, prefixes {prefixes:?}");
            }
        }
    }

    #[tokio::test]
    async fn a_failed_read_is_handed_over_as_the_error_it_is() {
        let fold = sorted(100, Some(3));
        let mut reader = super::PageReader::start(fold, vec![String::new()], 10);
        let err = read_all(&mut reader)
            .await
            .expect_err("the fourth page fails");
        assert!(err.to_string().contains("disk gone"), "{err}");
    }

    #[tokio::test]
    async fn a_reader_dropped_mid_hydration_stops_reading_and_lets_go_of_the_fold() {
        let fold = sorted(10_000, None);
        let mut reader = super::PageReader::start(fold.clone(), vec![String::new()], 10);
        let first = reader.next().await.expect("a page").expect("read");
        assert_eq!(first.items.len(), 10);
        drop(first);
        drop(reader);
        // The reader holds the fold until its task ends; it must end without being fed.
        for _ in 0..10_000 {
            if std::sync::Arc::strong_count(&fold) == 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        assert_eq!(std::sync::Arc::strong_count(&fold), 1, "the reader let go");
        let scans = fold.scans.load(std::sync::atomic::Ordering::SeqCst);
        assert!(scans <= 3, "it stopped reading ahead ({scans} pages read)");
    }
}
