//! The generated bindings of the guest contract, every version the host links — `wit/guest.wit`
//! (`foldhost:guest@0.1.0`), `wit/v0.2.0/guest.wit` (`@0.2.0`: `parse` takes a packed batch) and
//! `wit/v0.3.0/guest.wit` (`@0.3.0`: state buckets, in `v3.rs`) — and the host side of their
//! imports. The only module in the crate that names generated types; `guest/mod.rs` sees one
//! [`FolderPre`] / [`FolderInstance`] whatever the version, with 0.1.0's types as the common ones,
//! and converts to the host's own types at the edge.
//!
//! Invariants: a component is bound to the newest version it exports ([`FolderPre::new`]); every
//! version's imports are served by the same [`HostState`] code (`fold_get`, `fold_scan`,
//! `log_line`), so no version reads or logs differently.

use std::sync::{Arc, OnceLock};

use wasmtime::component::ResourceTable;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use foldhost_core::kv::{KvEntry, KvUpdate};
use foldhost_core::protocol::{GuestCall, OwnedDecl};
use foldhost_core::view::FoldRead;

use super::state::StateAccess;

wasmtime::component::bindgen!({
    path: "../../wit",
    world: "foldhost:guest/guest@0.1.0",
    imports: { default: trappable },
    exports: { default: async },
    // A batch is lowered straight from the host's keys and values: `Update` borrows them, so no
    // update costs a host allocation on its way into the guest.
    ownership: Borrowing { duplicate_if_necessary: true },
});

pub use foldhost::guest::types::{Op, Update, Verdict};

/// The bindings of `foldhost:guest@0.2.0`.
mod v2 {
    wasmtime::component::bindgen!({
        path: "../../wit/v0.2.0",
        world: "foldhost:guest/guest@0.2.0",
        imports: { default: trappable },
        exports: { default: async },
        ownership: Borrowing { duplicate_if_necessary: true },
    });
}

/// Bytes of one packed update's header in a 0.2.0 batch: key length (u32), value length (u32),
/// revision (u64), op (u8).
pub(crate) const PACKED_HEADER_BYTES: usize = 17;

/// `batch` packed as `foldhost:guest@0.2.0`'s `parse` takes it (see `wit/v0.2.0/guest.wit`): per
/// update, little-endian key length, value length and revision, the op's index, then the key and
/// the value. `out` is cleared first. A key or value longer than a `u32` can say is refused, never
/// cut (a batch is capped far below that, `max-batch-bytes`, before it gets here).
pub(crate) fn pack_batch(batch: &[Update<'_>], out: &mut Vec<u8>) -> Result<(), String> {
    out.clear();
    let bytes: usize = batch
        .iter()
        .map(|u| PACKED_HEADER_BYTES + u.key.len() + u.value.len())
        .sum();
    out.reserve(bytes);
    for u in batch {
        let too_long = || {
            format!(
                "an update of a {}-byte key and a {}-byte value cannot be packed (over 4 GiB)",
                u.key.len(),
                u.value.len()
            )
        };
        let key_len = u32::try_from(u.key.len()).map_err(|_| too_long())?;
        let value_len = u32::try_from(u.value.len()).map_err(|_| too_long())?;
        out.extend_from_slice(&key_len.to_le_bytes());
        out.extend_from_slice(&value_len.to_le_bytes());
        out.extend_from_slice(&u.revision.to_le_bytes());
        out.push(match u.op {
            Op::Put => 0,
            Op::Delete => 1,
            Op::Purge => 2,
        });
        out.extend_from_slice(u.key.as_bytes());
        out.extend_from_slice(u.value);
    }
    Ok(())
}

/// The contract version a component was bound to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Contract {
    /// `foldhost:guest@0.1.0`: a `list<update>` per batch.
    V0_1,
    /// `foldhost:guest@0.2.0`: a packed batch.
    V0_2,
    /// `foldhost:guest@0.3.0`: state buckets.
    V0_3,
}

impl Contract {
    /// The WIT package version, as reports print it.
    pub fn as_str(self) -> &'static str {
        match self {
            Contract::V0_1 => "0.1.0",
            Contract::V0_2 => "0.2.0",
            Contract::V0_3 => "0.3.0",
        }
    }
}

/// A component checked against the host's imports and bound to the contract it exports.
#[derive(Clone)]
pub enum FolderPre {
    /// A 0.1.0 guest.
    V1(GuestPre<HostState>),
    /// A 0.2.0 guest.
    V2(v2::GuestPre<HostState>),
    /// A 0.3.0 guest.
    V3(v3::GuestPre<HostState>),
}

impl FolderPre {
    /// Binds `pre` to the newest contract whose `folder` it exports; the error names why it fits
    /// neither.
    pub fn new(pre: wasmtime::component::InstancePre<HostState>) -> wasmtime::Result<Self> {
        let newest = match v3::GuestPre::new(pre.clone()) {
            Ok(p) => return Ok(FolderPre::V3(p)),
            Err(e) => e,
        };
        let second = match v2::GuestPre::new(pre.clone()) {
            Ok(p) => return Ok(FolderPre::V2(p)),
            Err(e) => e,
        };
        GuestPre::new(pre).map(FolderPre::V1).map_err(|oldest| {
            wasmtime::Error::msg(format!(
                "it fits no guest contract this host links: as foldhost:guest@0.3.0, {newest:#}; as @0.2.0, {second:#}; as @0.1.0, {oldest:#}"
            ))
        })
    }

    /// The contract it was bound to.
    pub(crate) fn contract(&self) -> Contract {
        match self {
            FolderPre::V1(_) => Contract::V0_1,
            FolderPre::V2(_) => Contract::V0_2,
            FolderPre::V3(_) => Contract::V0_3,
        }
    }

    /// The engine it was compiled for.
    pub(crate) fn engine(&self) -> &wasmtime::Engine {
        match self {
            FolderPre::V1(p) => p.engine(),
            FolderPre::V2(p) => p.engine(),
            FolderPre::V3(p) => p.engine(),
        }
    }

    /// A new instance in `store`.
    pub(crate) async fn instantiate_async(
        &self,
        store: &mut wasmtime::Store<HostState>,
    ) -> wasmtime::Result<FolderInstance> {
        Ok(match self {
            FolderPre::V1(p) => FolderInstance::V1(p.instantiate_async(store).await?),
            FolderPre::V2(p) => FolderInstance::V2 {
                guest: p.instantiate_async(store).await?,
                packed: Vec::new(),
            },
            FolderPre::V3(p) => FolderInstance::V3 {
                guest: p.instantiate_async(store).await?,
                packed: Vec::new(),
            },
        })
    }
}

/// One instance's `folder` export, whatever its contract; results in 0.1.0's types.
pub(crate) enum FolderInstance {
    /// A 0.1.0 instance.
    V1(Guest),
    /// A 0.2.0 instance, with the buffer its batches are packed into (kept between calls).
    V2 {
        /// The instance.
        guest: v2::Guest,
        /// The packing buffer.
        packed: Vec<u8>,
    },
    /// A 0.3.0 instance, with its packing buffer.
    V3 {
        /// The instance.
        guest: v3::Guest,
        /// The packing buffer.
        packed: Vec<u8>,
    },
}

/// A manifest as a guest gave it, whatever its contract (0.1.0 and 0.2.0 declare no buckets).
pub(crate) struct RawManifest {
    pub name: String,
    pub version: String,
    pub scope: Vec<String>,
    pub state: Vec<OwnedDecl>,
    pub reads: Vec<String>,
}

fn v3_manifest(m: v3::foldhost::guest::types::GuestManifest) -> RawManifest {
    RawManifest {
        name: m.name,
        version: m.version,
        scope: m.scope,
        state: m
            .state
            .into_iter()
            .map(|b| OwnedDecl {
                name: b.name,
                history: b.history.max(1),
                max_age_ms: b.max_age_ms,
                max_bytes: b.max_bytes,
                per_key_ttl: b.per_key_ttl,
            })
            .collect(),
        reads: m.reads,
    }
}

/// A packed-batch contract's verdict as 0.1.0's (every version's enum has the same cases).
macro_rules! v1_verdict {
    ($v:expr, $V:ty) => {{
        type V = $V;
        match $v {
            V::Accept => Verdict::Accept,
            V::Skip => Verdict::Skip,
            V::Defer => Verdict::Defer,
        }
    }};
}

impl FolderInstance {
    /// `manifest`.
    pub(crate) async fn manifest(
        &self,
        store: &mut wasmtime::Store<HostState>,
    ) -> wasmtime::Result<RawManifest> {
        let plain = |name, version, scope| RawManifest {
            name,
            version,
            scope,
            state: Vec::new(),
            reads: Vec::new(),
        };
        match self {
            FolderInstance::V1(g) => {
                let m = g.foldhost_guest_folder().call_manifest(store).await?;
                Ok(plain(m.name, m.version, m.scope))
            }
            FolderInstance::V2 { guest, .. } => {
                let m = guest.foldhost_guest_folder().call_manifest(store).await?;
                Ok(plain(m.name, m.version, m.scope))
            }
            FolderInstance::V3 { guest, .. } => guest
                .foldhost_guest_folder()
                .call_manifest(store)
                .await
                .map(v3_manifest),
        }
    }

    /// `init`.
    pub(crate) async fn init(
        &self,
        store: &mut wasmtime::Store<HostState>,
        config: &[(&str, &str)],
    ) -> wasmtime::Result<Result<(), String>> {
        match self {
            FolderInstance::V1(g) => g.foldhost_guest_folder().call_init(store, config).await,
            FolderInstance::V2 { guest, .. } => {
                guest.foldhost_guest_folder().call_init(store, config).await
            }
            FolderInstance::V3 { guest, .. } => {
                guest.foldhost_guest_folder().call_init(store, config).await
            }
        }
    }

    /// `parse` of `bucket`'s batch (`""`: the main bucket): as 0.1.0 records, or packed for 0.2.0
    /// and 0.3.0. Only a 0.3.0 guest declares other buckets.
    pub(crate) async fn parse(
        &mut self,
        store: &mut wasmtime::Store<HostState>,
        bucket: &str,
        batch: &[Update<'_>],
    ) -> wasmtime::Result<Vec<Verdict>> {
        if !bucket.is_empty() && !matches!(self, FolderInstance::V3 { .. }) {
            return Err(wasmtime::Error::msg(format!(
                "a guest of contract 0.1.0 or 0.2.0 folds no state bucket (asked for {bucket:?})"
            )));
        }
        match self {
            FolderInstance::V1(g) => g.foldhost_guest_folder().call_parse(store, batch).await,
            FolderInstance::V2 { guest, packed } => {
                pack_batch(batch, packed).map_err(wasmtime::Error::msg)?;
                let verdicts = guest
                    .foldhost_guest_folder()
                    .call_parse(&mut *store, packed)
                    .await;
                if packed.capacity() > MAX_KEPT_PACK_BYTES {
                    *packed = Vec::new();
                }
                let verdicts = verdicts?.into_iter();
                Ok(verdicts
                    .map(|v| v1_verdict!(v, v2::foldhost::guest::types::Verdict))
                    .collect())
            }
            FolderInstance::V3 { guest, packed } => {
                pack_batch(batch, packed).map_err(wasmtime::Error::msg)?;
                let verdicts = guest
                    .foldhost_guest_folder()
                    .call_parse(&mut *store, bucket, packed)
                    .await;
                if packed.capacity() > MAX_KEPT_PACK_BYTES {
                    *packed = Vec::new();
                }
                let verdicts = verdicts?.into_iter();
                Ok(verdicts
                    .map(|v| v1_verdict!(v, v3::foldhost::guest::types::Verdict))
                    .collect())
            }
        }
    }

    /// `end-of-current` of `bucket` (0.3.0; older contracts have no such call).
    pub(crate) async fn end_of_current(
        &self,
        store: &mut wasmtime::Store<HostState>,
        bucket: &str,
    ) -> wasmtime::Result<()> {
        match self {
            FolderInstance::V3 { guest, .. } => {
                guest
                    .foldhost_guest_folder()
                    .call_end_of_current(store, bucket)
                    .await
            }
            FolderInstance::V1(_) | FolderInstance::V2 { .. } => Ok(()),
        }
    }

    /// `apply`.
    pub(crate) async fn apply(
        &self,
        store: &mut wasmtime::Store<HostState>,
    ) -> wasmtime::Result<Result<(), String>> {
        match self {
            FolderInstance::V1(g) => g.foldhost_guest_folder().call_apply(store).await,
            FolderInstance::V2 { guest, .. } => {
                guest.foldhost_guest_folder().call_apply(store).await
            }
            FolderInstance::V3 { guest, .. } => {
                guest.foldhost_guest_folder().call_apply(store).await
            }
        }
    }

    /// `on-applied` of `bucket` (`""`: the main bucket; older contracts hear only of it).
    pub(crate) async fn on_applied(
        &self,
        store: &mut wasmtime::Store<HostState>,
        bucket: &str,
        cursor: u64,
    ) -> wasmtime::Result<()> {
        if let FolderInstance::V3 { guest, .. } = self {
            return guest
                .foldhost_guest_folder()
                .call_on_applied(store, bucket, cursor)
                .await;
        }
        if !bucket.is_empty() {
            return Ok(());
        }
        match self {
            FolderInstance::V3 { .. } => Ok(()),
            FolderInstance::V1(g) => {
                g.foldhost_guest_folder()
                    .call_on_applied(store, cursor)
                    .await
            }
            FolderInstance::V2 { guest, .. } => {
                guest
                    .foldhost_guest_folder()
                    .call_on_applied(store, cursor)
                    .await
            }
        }
    }

    /// `query`.
    pub(crate) async fn query(
        &self,
        store: &mut wasmtime::Store<HostState>,
        request: &[u8],
    ) -> wasmtime::Result<Result<Vec<u8>, String>> {
        match self {
            FolderInstance::V1(g) => g.foldhost_guest_folder().call_query(store, request).await,
            FolderInstance::V2 { guest, .. } => {
                guest
                    .foldhost_guest_folder()
                    .call_query(store, request)
                    .await
            }
            FolderInstance::V3 { guest, .. } => {
                guest
                    .foldhost_guest_folder()
                    .call_query(store, request)
                    .await
            }
        }
    }
}

/// The largest packing buffer an instance keeps between batches.
const MAX_KEPT_PACK_BYTES: usize = 4 * 1024 * 1024;

/// The most entries one `scan` import returns, whatever the guest asks.
pub(crate) const MAX_SCAN_LIMIT: u32 = 10_000;

/// Bytes of a guest's stderr kept for error reports (a panic message lands there).
const STDERR_CAPACITY: usize = 16 * 1024;

/// Longest guest log line or error message kept; the rest is cut with its length marked.
pub(crate) const MAX_MESSAGE_BYTES: usize = 4096;
/// Most log lines one guest call may write; the rest are dropped (counted in one last line).
pub(crate) const MAX_LOG_LINES_PER_CALL: u32 = 1000;
/// Most elements a guest's tables may have together (`table.grow` is one instruction no deadline
/// interrupts).
pub(crate) const MAX_TABLE_ELEMENTS: usize = 1_000_000;
/// Most core instances in one guest (language runtimes such as componentize-py use several).
pub(crate) const MAX_INSTANCES: usize = 64;
/// Most tables in one guest.
pub(crate) const MAX_TABLES: usize = 64;
/// Most linear memories in one guest (together under the memory cap).
pub(crate) const MAX_MEMORIES: usize = 16;

/// `text` cut to at most `max` bytes (at a character boundary), with what was cut marked.
pub(crate) fn clip_text(text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… [cut: {} bytes in all]", &text[..end], text.len())
}

pub(crate) use limits::{GuestLimiter, MemoryCapHit, TableCapHit, resource_limit_hit};

/// What one instance's `Store` holds.
pub struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    /// The memory, table and instance limits.
    pub limits: GuestLimiter,
    fold: Arc<dyn FoldRead>,
    guest: String,
    /// Log lines written in the current call (reset when a call is armed).
    pub log_lines: u32,
    /// The guest's stderr (its panic messages), for error reports.
    pub stderr: MemoryOutputPipe,
    /// The call running now (a state write is allowed from some only).
    pub(crate) call: GuestCall,
    /// When the call running now must end.
    pub(crate) deadline: Option<tokio::time::Instant>,
    /// The state buckets, once the host attached them (shared by every instance of the guest).
    pub(crate) state: Arc<OnceLock<StateAccess>>,
    /// This instance answers queries beside the fold (docs/design.md, "Queries off the fold's
    /// path"): a write from its `query` may wait for the fold to apply it (`wait-ms`).
    pub(crate) may_wait: bool,
    /// Where a capture of the guest's state writes is found while one runs (a shadow's
    /// comparison): its core's, set after construction.
    pub(crate) capture: super::state::CaptureSlot,
    /// While `on-applied` runs with an intent: the ids of its writes (`super::replay`).
    pub(crate) derived: Option<super::replay::DerivedIds>,
}

impl HostState {
    /// A fresh state: no filesystem, no environment, no arguments, no network, a fixed clock,
    /// random streams fixed by `seed` and the component's digest (`super::random`), a memory cap,
    /// a resource table of at most `resource_entries` entries, and read access to the committed
    /// fold.
    pub fn new(
        fold: Arc<dyn FoldRead>,
        guest: String,
        memory_bytes: usize,
        resource_entries: usize,
        seed: &[u8; 32],
        component: &[u8; 32],
        state: Arc<OnceLock<StateAccess>>,
    ) -> Self {
        use super::random::GuestRandom;
        let stderr = MemoryOutputPipe::new(STDERR_CAPACITY);
        let wasi = WasiCtxBuilder::new()
            .stderr(stderr.clone())
            .secure_random(GuestRandom::new(seed, component, "random"))
            .insecure_random(GuestRandom::new(seed, component, "insecure"))
            .insecure_random_seed(GuestRandom::new(seed, component, "insecure-seed").first_u128())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .wall_clock(FixedClock)
            .monotonic_clock(FixedClock)
            .build();
        // Every WASI handle a guest holds is an entry here, in host memory and outside the memory
        // cap: bounded, or a guest that never drops one grows the host until the call's deadline.
        let mut table = ResourceTable::new();
        table.set_max_capacity(resource_entries);
        HostState {
            wasi,
            table,
            limits: GuestLimiter::new(memory_bytes),
            fold,
            guest,
            log_lines: 0,
            stderr,
            call: GuestCall::Setup,
            deadline: None,
            state,
            may_wait: false,
            capture: Default::default(),
            derived: None,
        }
    }

    /// The capture of this guest's state writes, while one runs.
    pub(crate) fn capturing(&self) -> Option<Arc<super::state::WriteCapture>> {
        self.capture
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// What is left of the running call's deadline.
    pub(crate) fn time_left(&self) -> std::time::Duration {
        self.deadline.map_or(std::time::Duration::ZERO, |d| {
            d.saturating_duration_since(tokio::time::Instant::now())
        })
    }

    /// Names the guest in its log lines (`name@version`, once its manifest is known).
    pub(crate) fn set_guest(&mut self, guest: String) {
        self.guest = guest;
    }

    /// What the guest said before it trapped: a Rust panic's message (the line after
    /// `panicked at …:`, with that location), else the last line it wrote to stderr.
    pub(crate) fn panic_message(&self) -> Option<String> {
        let bytes = self.stderr.contents();
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        if let Some(i) = lines.iter().rposition(|l| l.contains("panicked at")) {
            let at = lines[i]
                .split_once("panicked at")
                .map(|(_, loc)| loc.trim().trim_end_matches(':'))
                .unwrap_or_default();
            let msg = lines.get(i + 1).copied().unwrap_or_default();
            return Some(clip_text(
                format!("panicked at {at}: {msg}"),
                MAX_MESSAGE_BYTES,
            ));
        }
        lines
            .iter()
            .rev()
            .find(|l| !l.is_empty() && !l.starts_with("note:"))
            .map(|l| clip_text(l.to_string(), MAX_MESSAGE_BYTES))
    }
}

/// A clock that never moves: guests get no time source unless the host grants one.
struct FixedClock;

impl wasmtime_wasi::HostWallClock for FixedClock {
    fn resolution(&self) -> std::time::Duration {
        std::time::Duration::from_secs(1)
    }
    fn now(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
}

impl wasmtime_wasi::HostMonotonicClock for FixedClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl HostState {
    /// `fold.get`, every version. A read error traps the call: a guest must never mistake "could
    /// not read" for "absent".
    fn fold_get(&mut self, key: &str) -> wasmtime::Result<Option<KvEntry>> {
        self.fold
            .get(key)
            .map_err(|e| wasmtime::Error::msg(format!("fold get {key:?}: {e}")))
    }

    /// `fold.scan`, every version: at most [`MAX_SCAN_LIMIT`] entries whatever the guest asks.
    fn fold_scan(
        &mut self,
        prefix: &str,
        start_after: Option<&str>,
        limit: u32,
    ) -> wasmtime::Result<Vec<KvEntry>> {
        let limit = limit.min(MAX_SCAN_LIMIT) as usize;
        self.fold
            .scan(prefix, start_after, limit)
            .map_err(|e| wasmtime::Error::msg(format!("fold scan {prefix:?}: {e}")))
    }

    /// `log.log`, every version: clipped, and at most [`MAX_LOG_LINES_PER_CALL`] lines a call.
    fn log_line(&mut self, level: tracing::Level, message: String) {
        self.log_lines = self.log_lines.saturating_add(1);
        let guest = self.guest.as_str();
        if self.log_lines > MAX_LOG_LINES_PER_CALL {
            if self.log_lines == MAX_LOG_LINES_PER_CALL + 1 {
                tracing::warn!(
                    event = "guest_log_dropped",
                    guest,
                    "more than {MAX_LOG_LINES_PER_CALL} log lines in one call: the rest of this call's are dropped"
                );
            }
            return;
        }
        let message = clip_text(message, MAX_MESSAGE_BYTES);
        match level {
            tracing::Level::TRACE => tracing::trace!(guest, "{message}"),
            tracing::Level::DEBUG => tracing::debug!(guest, "{message}"),
            tracing::Level::INFO => tracing::info!(event = "guest_log", guest, "{message}"),
            tracing::Level::WARN => tracing::warn!(event = "guest_log", guest, "{message}"),
            tracing::Level::ERROR => tracing::error!(event = "guest_log", guest, "{message}"),
        }
    }
}

/// The `tracing` level of a WIT `log.level` (every version's enum has the same cases).
macro_rules! tracing_level {
    ($level:expr, $Level:ident) => {
        match $level {
            $Level::Trace => tracing::Level::TRACE,
            $Level::Debug => tracing::Level::DEBUG,
            $Level::Info => tracing::Level::INFO,
            $Level::Warn => tracing::Level::WARN,
            $Level::Error => tracing::Level::ERROR,
        }
    };
}

mod limits;
mod v3;

/// The imports every contract version shares — `types`, `fold` (`get`, `scan`) and `log` — for
/// the bindings at `$v` (`foldhost::guest`, `v2::foldhost::guest`, …): one body for every version,
/// each only converting to its own generated types, so no version reads or logs differently.
macro_rules! fold_and_log_imports {
    ($($v:ident)::+) => {
        impl $($v)::+::types::Host for HostState {}

        impl $($v)::+::fold::Host for HostState {
            fn get(
                &mut self,
                key: String,
            ) -> wasmtime::Result<Option<$($v)::+::types::Entry>> {
                Ok(self.fold_get(&key)?.map(|e| $($v)::+::types::Entry {
                    revision: e.version.as_u64().unwrap_or(0),
                    key: e.key,
                    value: e.value.to_vec(),
                }))
            }

            fn scan(
                &mut self,
                prefix: String,
                start_after: Option<String>,
                limit: u32,
            ) -> wasmtime::Result<Vec<$($v)::+::types::Entry>> {
                let v = self.fold_scan(&prefix, start_after.as_deref(), limit)?;
                Ok(v
                    .into_iter()
                    .map(|e| $($v)::+::types::Entry {
                        revision: e.version.as_u64().unwrap_or(0),
                        key: e.key,
                        value: e.value.to_vec(),
                    })
                    .collect())
            }
        }

        impl $($v)::+::log::Host for HostState {
            fn log(
                &mut self,
                level: $($v)::+::log::Level,
                message: String,
            ) -> wasmtime::Result<()> {
                use $($v)::+::log::Level;
                self.log_line(tracing_level!(level, Level), message);
                Ok(())
            }
        }
    };
}

fold_and_log_imports!(foldhost::guest);
fold_and_log_imports!(v2::foldhost::guest);
fold_and_log_imports!(v3::foldhost::guest);

/// Adds every linked contract version's imports (`fold`, `log`, and 0.3.0's `state`) to `linker`.
pub(crate) fn add_to_linker(
    linker: &mut wasmtime::component::Linker<HostState>,
) -> wasmtime::Result<()> {
    use wasmtime::component::HasSelf;
    Guest::add_to_linker::<HostState, HasSelf<HostState>>(linker, |s| s)?;
    v2::Guest::add_to_linker::<HostState, HasSelf<HostState>>(linker, |s| s)?;
    v3::Guest::add_to_linker::<HostState, HasSelf<HostState>>(linker, |s| s)
}

/// The host's update as the guest sees it.
pub(crate) fn to_wit_update(u: &KvUpdate) -> Update<'_> {
    let (op, value): (Op, &[u8]) = match u {
        KvUpdate::Put(e) => (Op::Put, &e.value),
        KvUpdate::Delete { .. } => (Op::Delete, &[]),
        KvUpdate::Purge { .. } => (Op::Purge, &[]),
    };
    Update {
        key: u.key(),
        value,
        revision: u.revision().unwrap_or(0),
        op,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmtime::ResourceLimiter as _;

    #[test]
    fn a_packed_batch_is_each_update_header_key_and_value_back_to_back() {
        let batch = [
            Update {
                key: "route.a",
                value: b"{}",
                revision: 7,
                op: Op::Put,
            },
            Update {
                key: "é",
                value: &[],
                revision: u64::MAX,
                op: Op::Purge,
            },
            Update {
                key: "d",
                value: &[],
                revision: 0,
                op: Op::Delete,
            },
        ];
        let mut out = vec![0xAA; 3]; // cleared first
        pack_batch(&batch, &mut out).expect("packs");
        let mut want = Vec::new();
        want.extend_from_slice(&7u32.to_le_bytes());
        want.extend_from_slice(&2u32.to_le_bytes());
        want.extend_from_slice(&7u64.to_le_bytes());
        want.push(0);
        want.extend_from_slice(b"route.a{}");
        want.extend_from_slice(&2u32.to_le_bytes());
        want.extend_from_slice(&0u32.to_le_bytes());
        want.extend_from_slice(&u64::MAX.to_le_bytes());
        want.push(2);
        want.extend_from_slice("é".as_bytes());
        want.extend_from_slice(&1u32.to_le_bytes());
        want.extend_from_slice(&0u32.to_le_bytes());
        want.extend_from_slice(&0u64.to_le_bytes());
        want.push(1);
        want.push(b'd');
        assert_eq!(out, want);
        assert_eq!(out.len(), 3 * PACKED_HEADER_BYTES + 7 + 2 + 2 + 1);
        pack_batch(&[], &mut out).expect("packs");
        assert!(out.is_empty());
    }

    #[test]
    fn long_text_is_cut_at_a_character_boundary_with_its_length_marked() {
        assert_eq!(clip_text("short".into(), 10), "short");
        let cut = clip_text("ééééé".into(), 3);
        assert_eq!(cut, "é… [cut: 10 bytes in all]");
        let big = clip_text("x".repeat(100 << 20), MAX_MESSAGE_BYTES);
        assert!(big.len() < MAX_MESSAGE_BYTES + 64);
        assert!(big.ends_with(&format!("[cut: {} bytes in all]", 100 << 20)));
    }

    #[test]
    fn a_full_resource_table_or_handle_count_is_named_as_the_limit_and_nothing_else_is() {
        let mut table = ResourceTable::new();
        table.set_max_capacity(2);
        assert!(table.push(1u32).is_ok() && table.push(2u32).is_ok());
        let full = table.push(3u32).expect_err("a third entry is refused");
        // As a WASI import returns it: `?` into the call's error, with context on top.
        let e = wasmtime::Error::from(full).context("call of get-stderr");
        let hit = e.chain().find_map(|c| resource_limit_hit(c, 2));
        assert_eq!(
            hit.as_deref(),
            Some("guest exceeded the host resource table limit (2 entries)")
        );
        let e = wasmtime::Error::msg("cannot allocate another handle: store handle limit exceeded");
        let hit = e.chain().find_map(|c| resource_limit_hit(c, 7));
        assert_eq!(
            hit.as_deref(),
            Some("guest exceeded the component handle limit (7 handles)")
        );
        for other in [
            wasmtime::Error::from(wasmtime::component::ResourceTableError::NotPresent),
            wasmtime::Error::msg("wasm trap: unreachable"),
        ] {
            assert!(other.chain().all(|c| resource_limit_hit(c, 2).is_none()));
        }
    }

    #[test]
    fn memory_is_capped_across_all_memories_and_tables_by_elements() {
        let mut l = GuestLimiter::new(64 << 20);
        // Four memories of 16 MiB fit; a fifth byte over the cap in any of them does not.
        for _ in 0..4 {
            assert!(l.memory_growing(0, 16 << 20, None).is_ok_and(|ok| ok));
        }
        let e = l.memory_growing(16 << 20, (16 << 20) + 65536, None);
        assert!(e.is_err_and(|e| e.to_string().contains("memory cap of 64 MiB")));
        // A grow the memory itself refuses is taken back.
        let mut l = GuestLimiter::new(64 << 20);
        assert!(l.memory_growing(0, 60 << 20, None).is_ok_and(|ok| ok));
        assert!(
            l.memory_grow_failed(wasmtime::Error::msg("over its maximum"))
                .is_ok()
        );
        assert!(l.memory_growing(0, 60 << 20, None).is_ok_and(|ok| ok));
        // Tables are counted together too.
        let half = MAX_TABLE_ELEMENTS / 2;
        assert!(l.table_growing(0, half, None).is_ok_and(|ok| ok));
        assert!(l.table_growing(0, half, None).is_ok_and(|ok| ok));
        let e = l.table_growing(0, 1, None);
        assert!(e.is_err_and(|e| e.to_string().contains("table limit")));
        assert!(
            l.instances() >= 32,
            "language runtimes need more than a few core instances"
        );
    }
}
