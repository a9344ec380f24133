//! WebAssembly guests behind the [`Apply`] seam: one wasmtime [`Engine`], components compiled once
//! and cached by content hash, imports type-checked before anything runs (`InstancePre`), a fresh
//! `Store` per instance, an epoch deadline and a memory cap on every call.
//!
//! Invariants:
//! - Only `guest/bindings.rs` names generated types; everything else speaks the host's types.
//! - **No ambient authority.** A guest imports fold reads and logging (the WIT world) and the WASI
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
mod random;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine, Store};

use crate::applied::{Apply, ApplyError, SwapCandidate, Verdict};
use crate::kv::{KvEntry, KvUpdate, WatchCursor, WatchScope};
use crate::view::FoldRead;
use bindings::{FolderInstance, FolderPre, HostState, MAX_MESSAGE_BYTES, clip_text};

/// Compiled components kept by one engine (the running one, the one before, a swap candidate…).
pub const MAX_CACHED_COMPONENTS: usize = 8;

/// Longest guest name or version accepted from a manifest.
pub const MAX_MANIFEST_NAME: usize = 128;
/// Most scope prefixes a manifest may declare.
pub const MAX_SCOPE_PREFIXES: usize = 256;

/// The wasm stack of a guest call, in bytes (a deeper recursion traps).
pub const MAX_WASM_STACK: usize = 512 * 1024;

/// Largest answer a guest's `query` may give.
pub const MAX_QUERY_ANSWER_BYTES: usize = 16 * 1024 * 1024;

/// The default of [`GuestLimits::resource_entries`]. The guests in `guests/` (Rust, C, JavaScript,
/// Python) hold a handful at a time; a guest that leaks a handle per call reaches it and is rebuilt.
pub const DEFAULT_RESOURCE_ENTRIES: usize = 4096;

/// How often the epoch advances: the granularity of call deadlines.
pub const TICK: Duration = Duration::from_millis(2);

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
    pub fn hydration_prefixes(&self) -> Vec<String> {
        self.watch_scope().disjoint_prefixes()
    }
}

/// How a host's engine is set up beyond its fixed configuration.
#[derive(Clone, Debug, Default)]
pub struct EngineOptions {
    /// The compiled-component cache directory ([`cache`]); `None`: compile in every process.
    pub cache_dir: Option<PathBuf>,
    /// The seed of every guest's random numbers (`guest/random.rs`); all zeros when not given.
    pub random_seed: [u8; 32],
}

/// How [`GuestEngine::prepare_traced`] came by a compiled component.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// Where the compilation came from.
    pub source: cache::Source,
    /// How long it took to have it (compile, or read, check and load).
    pub elapsed: Duration,
    /// Why a cache entry was not used, when one was there and refused.
    pub cache_refused: Option<String>,
    /// The component's BLAKE3.
    pub digest: [u8; 32],
    /// The contract version it was bound to (`0.1.0`, `0.2.0`): the newest whose `folder` it
    /// exports.
    pub contract: &'static str,
}

/// The engine, the linker and the compiled-component cache, shared by every guest of a host.
pub struct GuestEngine {
    engine: Engine,
    linker: Linker<HostState>,
    /// Compiled components by content hash, oldest first.
    cache: Mutex<Vec<([u8; 32], Component)>>,
    /// Compiled components on disk, across processes (when a cache directory is given and private).
    disk: Option<cache::DiskCache>,
    /// Read at each instantiation: a host sets the store's seed once the store is open.
    random_seed: std::sync::RwLock<[u8; 32]>,
    stop: Arc<AtomicBool>,
}

impl GuestEngine {
    /// Builds the engine with no disk cache and the all-zero random seed.
    pub fn new() -> Result<Arc<Self>, GuestError> {
        Self::with_options(EngineOptions::default())
    }

    /// Builds the engine (epoch interruption on), opens the disk cache when one is named (a
    /// directory that is not private to this user is logged and not used), and starts the
    /// engine's epoch ticker.
    pub fn with_options(options: EngineOptions) -> Result<Arc<Self>, GuestError> {
        let mut config = Config::new();
        config.wasm_component_model(true);
        config.epoch_interruption(true);
        // Named rather than inherited: deep recursion in a guest traps at this depth.
        config.max_wasm_stack(MAX_WASM_STACK);
        // For profiles only: `FOLDHOST_WASM_PERFMAP=1` writes /tmp/perf-PID.map so `perf report`
        // names the guest's compiled functions.
        if std::env::var_os("FOLDHOST_WASM_PERFMAP").is_some() {
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        let engine = Engine::new(&config).map_err(|e| GuestError::Engine(format!("{e:#}")))?;
        let mut linker: Linker<HostState> = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)
            .map_err(|e| GuestError::Engine(format!("link WASI: {e:#}")))?;
        bindings::add_to_linker(&mut linker)
            .map_err(|e| GuestError::Engine(format!("link host imports: {e:#}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        {
            let engine = engine.clone();
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("foldhost-epoch".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(TICK);
                        engine.increment_epoch();
                    }
                })
                .map_err(|e| GuestError::Engine(format!("epoch ticker: {e}")))?;
        }
        let disk = options.cache_dir.as_deref().and_then(|dir| {
            cache::DiskCache::open(dir, &engine)
                .inspect_err(|e| {
                    tracing::warn!("compiled-component cache not used: {e}");
                })
                .ok()
        });
        Ok(Arc::new(GuestEngine {
            engine,
            linker,
            cache: Mutex::new(Vec::new()),
            disk,
            random_seed: std::sync::RwLock::new(options.random_seed),
            stop,
        }))
    }

    /// Sets the seed of the random streams of every instance made from now on (`guest/random.rs`).
    pub fn set_random_seed(&self, seed: [u8; 32]) {
        // A plain copy cannot be left half-done: a poisoned lock still holds a whole seed.
        *self
            .random_seed
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = seed;
    }

    fn random_seed(&self) -> [u8; 32] {
        *self
            .random_seed
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The compiled-component cache directory in use, if any.
    pub fn cache_dir(&self) -> Option<&std::path::Path> {
        self.disk.as_ref().map(cache::DiskCache::dir)
    }

    /// Compiles `bytes` (or takes the cached compilation of the same bytes) and checks its imports
    /// and exports against this host. `what` names it in errors.
    pub fn prepare(&self, what: &str, bytes: &[u8]) -> Result<FolderPre, GuestError> {
        self.prepare_traced(what, bytes).map(|(pre, _)| pre)
    }

    /// [`GuestEngine::prepare`], saying where the compilation came from: this engine's memory,
    /// the disk cache (checked before it is loaded: [`cache`]), or a compilation now, which is then
    /// written to the disk cache.
    pub fn prepare_traced(
        &self,
        what: &str,
        bytes: &[u8],
    ) -> Result<(FolderPre, Prepared), GuestError> {
        let started = Instant::now();
        let hash: [u8; 32] = *blake3::hash(bytes).as_bytes();
        let cached = self
            .cache
            .lock()
            .ok()
            .and_then(|c| c.iter().find(|(h, _)| *h == hash).map(|(_, c)| c.clone()));
        let mut cache_refused = None;
        let (component, source) = match cached {
            Some(c) => (c, cache::Source::Memory),
            None => {
                let from_disk = self.disk.as_ref().and_then(|d| {
                    d.load(&self.engine, &hash)
                        .inspect_err(|e| {
                            tracing::warn!(
                                "{what}: compiled-cache entry ignored, compiling afresh: {e}"
                            );
                            cache_refused = Some(e.to_string());
                        })
                        .ok()
                        .flatten()
                });
                let (c, source) = match from_disk {
                    Some(c) => (c, cache::Source::Disk),
                    None => {
                        let c = Component::new(&self.engine, bytes).map_err(|e| {
                            GuestError::Compile {
                                what: what.to_string(),
                                reason: format!("{e:#}"),
                            }
                        })?;
                        if let Some(d) = &self.disk
                            && let Err(e) = d.store(&hash, &c)
                        {
                            tracing::warn!("{what}: compiled, but not cached: {e}");
                        }
                        (c, cache::Source::Compiled)
                    }
                };
                if let Ok(mut cache) = self.cache.lock() {
                    // Bounded: a host swapped back and forth keeps its recent components, not
                    // every component it ever saw.
                    if cache.len() >= MAX_CACHED_COMPONENTS {
                        cache.remove(0);
                    }
                    cache.push((hash, c.clone()));
                }
                (c, source)
            }
        };
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| GuestError::Link {
                what: what.to_string(),
                reason: format!("{e:#}"),
            })?;
        let pre = FolderPre::new(pre).map_err(|e| GuestError::Link {
            what: what.to_string(),
            reason: format!("{e:#}"),
        })?;
        let contract = pre.contract().as_str();
        Ok((
            pre,
            Prepared {
                source,
                elapsed: started.elapsed(),
                cache_refused,
                digest: hash,
                contract,
            },
        ))
    }
}

impl Drop for GuestEngine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

struct Live {
    store: Store<HostState>,
    guest: FolderInstance,
}

/// One hydration page: its entries' keys in one string and their values in one buffer, both
/// reused from page to page, and where each entry's lie in them.
#[derive(Default)]
struct Page {
    keys: String,
    values: Vec<u8>,
    /// Per entry: its key's end in `keys`, its value's end in `values`, its revision (each starts
    /// where the entry before it ends).
    items: Vec<(usize, usize, u64)>,
}

impl Page {
    fn clear(&mut self) {
        self.keys.clear();
        self.values.clear();
        self.items.clear();
    }

    fn push(&mut self, e: &KvEntry) {
        self.keys.push_str(&e.key);
        self.values.extend_from_slice(&e.value);
        self.items.push((
            self.keys.len(),
            self.values.len(),
            e.version.as_u64().unwrap_or(0),
        ));
    }

    fn last_key(&self) -> Option<&str> {
        let n = self.items.len();
        let end = self.items.last()?.0;
        let start = n.checked_sub(2).map_or(0, |i| self.items[i].0);
        self.keys.get(start..end)
    }

    /// The page's entries as puts, borrowing the page.
    fn updates(&self) -> Vec<bindings::Update<'_>> {
        let (mut key_at, mut value_at) = (0, 0);
        self.items
            .iter()
            .map(|&(key_end, value_end, revision)| {
                let u = bindings::Update {
                    // Whole keys were pushed: every boundary is a character boundary.
                    key: self.keys.get(key_at..key_end).unwrap_or_default(),
                    value: &self.values[value_at..value_end],
                    revision,
                    op: bindings::Op::Put,
                };
                (key_at, value_at) = (key_end, value_end);
                u
            })
            .collect()
    }
}

/// Pages of the fold read ahead of a hydration on a blocking task of its own
/// ([`Core::stream_fold`]).
///
/// Two pages circulate: the reader fills one while the hydration feeds the other to the guest, and
/// the fed page comes back through [`PageReader::recycle`]. Dropped (the hydration ended, failed,
/// or its task was aborted), its channels close and the reader ends after the page it is reading.
/// A blocking task rather than a bare thread: while it runs, a runtime with paused time (the
/// simulator) does not jump its clock ahead as if everything were idle.
struct PageReader {
    full: tokio::sync::mpsc::Receiver<Result<Page, crate::snapshot::SnapshotError>>,
    empty: std::sync::mpsc::Sender<Page>,
}

impl PageReader {
    /// Starts reading `prefixes` (each in key order, `chunk` entries a page) through `fold`.
    fn start(fold: Arc<dyn FoldRead>, prefixes: Vec<String>, chunk: usize) -> Self {
        let (full_tx, full) = tokio::sync::mpsc::channel(1);
        let (empty, empty_rx) = std::sync::mpsc::channel::<Page>();
        for _ in 0..2 {
            // Cannot fail: the receiver is alive, owned below.
            let _ = empty.send(Page::default());
        }
        // Detached: it ends by itself once the pages or the hydration run out.
        drop(tokio::task::spawn_blocking(move || {
            for prefix in prefixes {
                let mut after: Option<String> = None;
                loop {
                    // No page back: the hydration is gone.
                    let Ok(mut page) = empty_rx.recv() else {
                        return;
                    };
                    page.clear();
                    let n = match fold
                        .scan_each(&prefix, after.as_deref(), chunk, &mut |e| page.push(e))
                    {
                        Ok(n) => n,
                        Err(e) => {
                            let _ = full_tx.blocking_send(Err(e));
                            return;
                        }
                    };
                    let Some(last) = page.last_key() else { break };
                    after = Some(last.to_string());
                    if full_tx.blocking_send(Ok(page)).is_err() {
                        return;
                    }
                    if n < chunk {
                        break;
                    }
                }
            }
        }));
        PageReader { full, empty }
    }

    /// The next page, an error reading it, or `None` when the fold is read to its end.
    async fn next(&mut self) -> Option<Result<Page, crate::snapshot::SnapshotError>> {
        self.full.recv().await
    }

    /// Hands a fed page back to be filled again.
    fn recycle(&self, page: Page) {
        // The reader may be done already: nothing to hand back to then.
        let _ = self.empty.send(page);
    }
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
        let (pre, prepared) = engine.prepare_traced(what, bytes)?;
        let mut core = Core {
            engine: engine.clone(),
            pre,
            digest: prepared.digest,
            manifest: GuestManifest {
                name: what.to_string(),
                version: "?".into(),
                scope: Vec::new(),
            },
            limits,
            config,
            fold,
            #[cfg(any(test, feature = "testkit"))]
            interrupt_next: AtomicBool::new(false),
        };
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
        })
    }

    /// The guest's manifest.
    pub fn manifest(&self) -> &GuestManifest {
        &self.core.manifest
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
        let mut l = match self.live.take() {
            Some(l) if self.hydrations > 0 => return Ok(l),
            Some(l) => l,
            None => self.core.fresh().await?,
        };
        let stats = self.core.stream_fold(&mut l, false).await?;
        self.hydrations += 1;
        self.last_hydration = Some(stats);
        self.lost = None;
        Ok(l)
    }
}

impl Core {
    fn describe(&self) -> String {
        format!("{}@{}", self.manifest.name, self.manifest.version)
    }

    fn err(&self, call: &'static str, message: String) -> ApplyError {
        ApplyError {
            applier: self.describe(),
            call,
            message,
        }
    }

    /// Explains a failed call: deadline, memory cap, the guest's panic message, or the trap.
    fn call_error(&self, live: &Live, call: &'static str, e: wasmtime::Error) -> ApplyError {
        let limit_hit = e.chain().find_map(|c| {
            c.downcast_ref::<bindings::MemoryCapHit>()
                .map(ToString::to_string)
                .or_else(|| {
                    c.downcast_ref::<bindings::TableCapHit>()
                        .map(ToString::to_string)
                })
                .or_else(|| bindings::resource_limit_hit(c, self.limits.resource_entries))
        });
        let message = if matches!(
            e.downcast_ref::<wasmtime::Trap>(),
            Some(wasmtime::Trap::Interrupt)
        ) {
            format!(
                "deadline of {} ms exceeded (interrupted)",
                self.limits.call_deadline.as_millis()
            )
        } else if let Some(hit) = limit_hit {
            hit
        } else {
            let text = format!("{e:#}");
            if text.contains("forcing trap when growing memory") {
                format!(
                    "memory cap of {} MiB hit ({})",
                    self.limits.memory_bytes / (1024 * 1024),
                    text.lines().next().unwrap_or_default()
                )
            } else {
                let cause = match e.downcast_ref::<wasmtime::Trap>() {
                    Some(trap) => trap.to_string(),
                    None => e.root_cause().to_string(),
                };
                match live.store.data().panic_message() {
                    Some(panic) => format!("trapped ({cause}): {panic}"),
                    None => format!("trapped ({cause})"),
                }
            }
        };
        self.err(call, message)
    }

    /// The call deadline in epoch ticks (at least one).
    fn deadline_ticks(&self) -> u64 {
        let ticks = self.limits.call_deadline.as_micros() / TICK.as_micros();
        u64::try_from(ticks).unwrap_or(u64::MAX).max(1)
    }

    /// Re-arms the deadline before a call: a deadline is relative to the epoch when it is set.
    /// Also resets the call's log-line count.
    fn arm(&self, live: &mut Live) {
        live.store.set_epoch_deadline(self.deadline_ticks());
        #[cfg(any(test, feature = "testkit"))]
        if self.interrupt_next.swap(false, Ordering::Relaxed) {
            live.store.set_epoch_deadline(0);
        }
        live.store.data_mut().log_lines = 0;
    }

    /// Runs one guest call under the call deadline in wall-clock time. The epoch deadline stops a
    /// guest that computes; this stops one that waits in a host call (a WASI sleep or poll),
    /// where no wasm runs and the epoch cannot interrupt it. The call's future is dropped at the
    /// deadline, and with it the instance's state: the caller drops the instance.
    async fn within<F: std::future::Future>(
        &self,
        call: &'static str,
        fut: F,
    ) -> Result<F::Output, ApplyError> {
        tokio::time::timeout(self.limits.call_deadline, fut)
            .await
            .map_err(|_| {
                self.err(
                    call,
                    format!(
                        "deadline of {} ms exceeded (wall clock: the guest was waiting in a host call)",
                        self.limits.call_deadline.as_millis()
                    ),
                )
            })
    }

    async fn instantiate(&self) -> Result<Live, ApplyError> {
        let state = HostState::new(
            self.fold.clone(),
            self.describe(),
            self.limits.memory_bytes,
            self.limits.resource_entries,
            &self.engine.random_seed(),
            &self.digest,
        );
        let mut store = Store::new(self.pre.engine(), state);
        store.limiter(|s| &mut s.limits);
        // The handles the guest's own tables hold (wasmtime's default is 100 000): as bounded as
        // the host resources behind them.
        store.set_max_component_handles(self.limits.resource_entries);
        // Instantiation runs guest start-up code too: it gets a deadline like every call.
        store.set_epoch_deadline(self.deadline_ticks());
        let guest = self
            .within("instantiate", self.pre.instantiate_async(&mut store))
            .await?
            .map_err(|e| self.err("instantiate", format!("{e:#}")))?;
        Ok(Live { store, guest })
    }

    async fn call_manifest(&self, live: &mut Live) -> Result<GuestManifest, ApplyError> {
        self.arm(live);
        let m = self
            .within("manifest", live.guest.manifest(&mut live.store))
            .await?
            .map_err(|e| self.call_error(live, "manifest", e))?;
        // The name and version go into every log line, error and status: short, printable.
        let printable = |s: &str| {
            !s.is_empty() && s.len() <= MAX_MANIFEST_NAME && !s.chars().any(char::is_control)
        };
        if !printable(&m.name) || !printable(&m.version) {
            return Err(self.err(
                "manifest",
                format!(
                    "name and version must be 1 to {MAX_MANIFEST_NAME} printable bytes (got {} and {} bytes)",
                    m.name.len(),
                    m.version.len()
                ),
            ));
        }
        if m.scope.len() > MAX_SCOPE_PREFIXES || m.scope.iter().any(|p| p.len() > MAX_MESSAGE_BYTES)
        {
            return Err(self.err(
                "manifest",
                format!(
                    "scope must be at most {MAX_SCOPE_PREFIXES} prefixes of at most {MAX_MESSAGE_BYTES} bytes"
                ),
            ));
        }
        Ok(GuestManifest {
            name: m.name,
            version: m.version,
            scope: m.scope,
        })
    }

    async fn call_init(&self, live: &mut Live) -> Result<(), ApplyError> {
        self.arm(live);
        let config: Vec<(&str, &str)> = self
            .config
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        self.within("init", live.guest.init(&mut live.store, &config))
            .await?
            .map_err(|e| self.call_error(live, "init", e))?
            .map_err(|m| self.err("init", clip_text(m, MAX_MESSAGE_BYTES)))
    }

    /// A fresh instance: instantiated, checked to be the same guest, initialised (not hydrated).
    async fn fresh(&self) -> Result<Live, ApplyError> {
        let mut live = self.instantiate().await?;
        let m = self.call_manifest(&mut live).await?;
        if m.name != self.manifest.name || m.version != self.manifest.version {
            return Err(self.err(
                "manifest",
                format!("a fresh instance says it is {}@{}", m.name, m.version),
            ));
        }
        self.call_init(&mut live).await?;
        Ok(live)
    }

    async fn call_parse(
        &self,
        live: &mut Live,
        batch: &[bindings::Update<'_>],
    ) -> Result<Vec<Verdict>, ApplyError> {
        self.arm(live);
        let verdicts = self
            .within("parse", live.guest.parse(&mut live.store, batch))
            .await?
            .map_err(|e| self.call_error(live, "parse", e))?;
        if verdicts.len() != batch.len() {
            return Err(self.err(
                "parse",
                format!(
                    "answered {} verdicts for a batch of {}",
                    verdicts.len(),
                    batch.len()
                ),
            ));
        }
        verdicts
            .into_iter()
            .map(|v| match v {
                bindings::Verdict::Accept => Ok(Verdict::Accept),
                bindings::Verdict::Skip => Ok(Verdict::Skip),
                bindings::Verdict::Defer => Ok(Verdict::Defer),
            })
            .collect()
    }

    /// One `query` call: `Ok` with the guest's own answer — its response (at most
    /// [`MAX_QUERY_ANSWER_BYTES`]) or the error it chose to give — or `Err` when the call itself
    /// failed (a trap, a deadline): the caller then drops `live`, which is dead.
    async fn query(
        &self,
        live: &mut Live,
        request: &[u8],
    ) -> Result<Result<Vec<u8>, String>, ApplyError> {
        self.arm(live);
        let answer = self
            .within("query", live.guest.query(&mut live.store, request))
            .await?
            .map_err(|e| self.call_error(live, "query", e))?;
        Ok(match answer {
            Ok(a) if a.len() > MAX_QUERY_ANSWER_BYTES => Err(format!(
                "answer of {} bytes is over the limit of {MAX_QUERY_ANSWER_BYTES}",
                a.len()
            )),
            Ok(a) => Ok(a),
            Err(m) => Err(clip_text(m, MAX_MESSAGE_BYTES)),
        })
    }

    async fn call_apply(&self, live: &mut Live) -> Result<(), ApplyError> {
        self.arm(live);
        self.within("apply", live.guest.apply(&mut live.store))
            .await?
            .map_err(|e| self.call_error(live, "apply", e))?
            .map_err(|m| self.err("apply", clip_text(m, MAX_MESSAGE_BYTES)))
    }

    /// Parses and applies `updates` in calls of at most `hydrate_chunk` entries and
    /// `max_batch_bytes` bytes (a single update over the byte limit is refused, named). Verdicts
    /// are the guest's own business here: what it skips or defers it does not build.
    async fn feed(
        &self,
        live: &mut Live,
        updates: Vec<bindings::Update<'_>>,
    ) -> Result<(), ApplyError> {
        let chunk = self.limits.hydrate_chunk.max(1);
        let mut rest = updates.into_iter().peekable();
        while rest.peek().is_some() {
            let mut call = Vec::with_capacity(chunk);
            let mut bytes = 0usize;
            while let Some(u) = rest.peek() {
                let size = u.key.len() + u.value.len();
                if call.len() == chunk
                    || (!call.is_empty() && bytes + size > self.limits.max_batch_bytes)
                {
                    break;
                }
                if size > self.limits.max_batch_bytes {
                    return Err(self.err(
                        "hydrate",
                        format!(
                            "entry {:?} carries {size} bytes, over the guest's max-batch-bytes limit of {}",
                            u.key, self.limits.max_batch_bytes
                        ),
                    ));
                }
                bytes += size;
                call.extend(rest.next());
            }
            self.call_parse(live, &call).await?;
            self.call_apply(live).await?;
            // A guest call runs to its end without yielding (its deadline traps, it does not
            // yield), so a hydration of many chunks would hold its worker thread throughout: on a
            // runtime with one worker, the fold beside a swap's hydration would stop. Yield
            // between chunks.
            tokio::task::yield_now().await;
        }
        Ok(())
    }

    /// Streams the fold (in scope, through this guest's view of it) through parse/apply in chunks.
    /// `swapping`: this is a swap candidate's hydration (the fold keeps going beside it), where the
    /// [`crate::crashpoint::SWAP_HYDRATING`] hold point sits after the first chunk.
    async fn stream_fold(
        &self,
        live: &mut Live,
        swapping: bool,
    ) -> Result<(u64, Duration), ApplyError> {
        let t = Instant::now();
        let prefixes = self.manifest.hydration_prefixes();
        let chunk = self.limits.hydrate_chunk.max(1);
        let mut total = 0u64;
        // Pages are read on a thread of their own, one page ahead of the guest: reading the next
        // page (the store's scan and the copy into the page) overlaps the guest's parse and apply
        // of this one. Every read goes through the same view, so when a page is read does not
        // change what it holds (a swap candidate's view stands at C whatever the fold does).
        let mut pages = PageReader::start(self.fold.clone(), prefixes, chunk);
        while let Some(read) = pages.next().await {
            let page = read.map_err(|e| self.err("hydrate", format!("read the fold: {e}")))?;
            total += page.items.len() as u64;
            self.feed(live, page.updates()).await?;
            pages.recycle(page);
            if swapping {
                crate::crashpoint::hold(crate::crashpoint::SWAP_HYDRATING).await;
            }
        }
        tracing::info!(
            guest = %self.describe(),
            entries = total,
            ms = t.elapsed().as_millis() as u64,
            "guest hydrated from the fold"
        );
        Ok((total, t.elapsed()))
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

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
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
        let r = self.core.call_parse(&mut live, &updates).await;
        if r.is_ok() {
            self.live = Some(live);
        }
        r
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
        let Some(mut live) = self.live.take() else {
            return;
        };
        self.core.arm(&mut live);
        let called = self
            .core
            .within(
                "on-applied",
                live.guest
                    .on_applied(&mut live.store, cursor.revision_or_zero()),
            )
            .await;
        // On a failure the batch is committed but the instance is not trustworthy any more: the
        // next batch rebuilds a fresh one from the fold.
        match called {
            Ok(Ok(())) => self.live = Some(live),
            Ok(Err(e)) => {
                let err = self.core.call_error(&live, "on-applied", e);
                tracing::warn!(error = %err, "guest failed after a commit; rebuilding it");
            }
            Err(err) => {
                tracing::warn!(error = %err, "guest failed after a commit; rebuilding it");
            }
        }
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
                },
                limits: self.core.limits,
                config: self.core.config.clone(),
                fold: view,
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
            core,
            live,
            hydrated,
            ..
        } = *c;
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
        self.last_hydration = Some(stats);
        Ok(Box::new(retired))
    }

    fn generation(&self) -> u64 {
        self.hydrations
    }

    fn rebuild_due(&self) -> bool {
        self.live.is_none()
    }

    async fn rebuild(&mut self) -> Result<(), ApplyError> {
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
}

/// A guest built beside the running one ([`Apply::swap_candidate`]): its own engine store and
/// instance, reading the fold through the swap's view (the fold at C until the cut-over).
struct GuestCandidate {
    core: Core,
    live: Option<Live>,
    /// The running guest's manifest (a scope change is refused).
    running: GuestManifest,
    /// Entries hydrated and how long it took, once hydrated.
    hydrated: Option<(u64, Duration)>,
}

#[async_trait]
impl SwapCandidate for GuestCandidate {
    fn describe(&self) -> String {
        self.core.describe()
    }

    async fn hydrate(&mut self) -> Result<u64, ApplyError> {
        let mut live = self.core.instantiate().await?;
        self.core.manifest = self.core.call_manifest(&mut live).await?;
        live.store.data_mut().set_guest(self.core.describe());
        if self.core.manifest.scope != self.running.scope {
            return Err(self.core.err(
                "swap",
                format!(
                    "its scope {} differs from the running {} (a scope change needs a restart)",
                    self.core.manifest.watch_scope(),
                    self.running.watch_scope()
                ),
            ));
        }
        self.core.call_init(&mut live).await?;
        let stats = self
            .core
            .stream_fold(&mut live, true)
            .await
            .map_err(|e| self.core.err("swap", format!("hydration failed: {e}")))?;
        self.live = Some(live);
        self.hydrated = Some(stats);
        Ok(stats.0)
    }

    async fn catch_up(&mut self, updates: &[KvUpdate]) -> Result<(), ApplyError> {
        let Some(mut live) = self.live.take() else {
            return Err(self
                .core
                .err("swap", "caught up before it was hydrated".into()));
        };
        let scope = self.core.manifest.watch_scope();
        let updates: Vec<bindings::Update<'_>> = updates
            .iter()
            .filter(|u| scope.contains(u.key()))
            .map(bindings::to_wit_update)
            .collect();
        self.core
            .feed(&mut live, updates)
            .await
            .map_err(|e| self.core.err("swap", format!("catch-up failed: {e}")))?;
        self.live = Some(live);
        Ok(())
    }

    async fn query(&mut self, request: &[u8]) -> Result<Result<Vec<u8>, String>, ApplyError> {
        let Some(mut live) = self.live.take() else {
            return Err(self
                .core
                .err("query", "queried before it was hydrated".into()));
        };
        let answer = self.core.query(&mut live, request).await?;
        self.live = Some(live);
        Ok(answer)
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
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
    fn a_component_exporting_no_folder_is_refused_naming_both_contracts() {
        let engine = GuestEngine::new().expect("engine");
        let err = engine
            .prepare("empty", b"(component)")
            .err()
            .expect("an empty component is refused")
            .to_string();
        assert!(
            err.contains("fits no guest contract")
                && err.contains("foldhost:guest@0.2.0")
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
        };
        assert_eq!(m(&[]).hydration_prefixes(), [""]);
        assert_eq!(
            m(&["b/", "a", "ab", "b/x"]).hydration_prefixes(),
            ["a", "b/"]
        );
        assert_eq!(m(&["r/", "", "x"]).hydration_prefixes(), [""]);
    }

    use crate::kv::{KvEntry, VersionToken};

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

    impl crate::view::FoldRead for Sorted {
        fn get(&self, key: &str) -> Result<Option<KvEntry>, crate::snapshot::SnapshotError> {
            Ok(self.entries.iter().find(|e| e.key == key).cloned())
        }

        fn scan(
            &self,
            prefix: &str,
            start_after: Option<&str>,
            limit: usize,
        ) -> Result<Vec<KvEntry>, crate::snapshot::SnapshotError> {
            let n = self.scans.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if self.fail_after.is_some_and(|f| n >= f) {
                return Err(crate::snapshot::SnapshotError::Backend("disk gone".into()));
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
        ) -> Result<(), crate::snapshot::SnapshotError> {
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
    ) -> Result<Vec<String>, crate::snapshot::SnapshotError> {
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
