//! The engine: one wasmtime engine per host (its limits, the epoch ticker, the compiled-component cache), and the preparation of a component against every released contract.

use super::*;

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
                    tracing::warn!(
                        event = "guest_cache_unavailable",
                        "compiled-component cache not used: {e}"
                    );
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

    pub(super) fn random_seed(&self) -> [u8; 32] {
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

    /// Compiles `bytes` now and writes the result to the disk cache (a failed write is logged, the
    /// compilation kept).
    fn compile(&self, what: &str, bytes: &[u8], hash: &[u8; 32]) -> Result<Component, GuestError> {
        let c = Component::new(&self.engine, bytes).map_err(|e| GuestError::Compile {
            what: what.to_string(),
            reason: format!("{e:#}"),
        })?;
        if let Some(d) = &self.disk
            && let Err(e) = d.store(hash, &c)
        {
            tracing::warn!(
                event = "guest_cache_store_failed",
                "{what}: compiled, but not cached: {e}"
            );
        }
        Ok(c)
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
                                event = "guest_cache_entry_ignored",
                                "{what}: compiled-cache entry ignored, compiling afresh: {e}"
                            );
                            cache_refused = Some(e.to_string());
                        })
                        .ok()
                        .flatten()
                });
                let (c, source) = match from_disk {
                    Some(c) => (c, cache::Source::Disk),
                    None => (self.compile(what, bytes, &hash)?, cache::Source::Compiled),
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
