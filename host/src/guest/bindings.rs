//! The generated bindings of `wit/guest.wit` and the host side of its imports. The only file in the
//! crate that names generated types; `guest/mod.rs` converts to and from the host's own types here
//! at the edge.

use std::sync::Arc;

use wasmtime::component::ResourceTable;
use wasmtime::{StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::kv::{KvEntry, KvUpdate};
use crate::snapshot::FoldRead;

wasmtime::component::bindgen!({
    path: "../wit",
    world: "foldhost:guest/guest@0.1.0",
    imports: { default: trappable },
    exports: { default: async },
});

pub use foldhost::guest::types::{Entry, Op, Update, Verdict};

/// The most entries one `scan` import returns, whatever the guest asks.
pub const MAX_SCAN_LIMIT: u32 = 10_000;

/// Bytes of a guest's stderr kept for error reports (a panic message lands there).
const STDERR_CAPACITY: usize = 16 * 1024;

/// What one instance's `Store` holds.
pub struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    /// The memory cap.
    pub limits: StoreLimits,
    fold: Arc<dyn FoldRead>,
    guest: String,
    /// The guest's stderr (its panic messages), for error reports.
    pub stderr: MemoryOutputPipe,
}

impl HostState {
    /// A fresh state: no filesystem, no environment, no arguments, no network, a fixed clock, a
    /// memory cap, and read access to the committed fold.
    pub fn new(fold: Arc<dyn FoldRead>, guest: String, memory_bytes: usize) -> Self {
        let stderr = MemoryOutputPipe::new(STDERR_CAPACITY);
        let wasi = WasiCtxBuilder::new()
            .stderr(stderr.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .wall_clock(FixedClock)
            .monotonic_clock(FixedClock)
            .build();
        HostState {
            wasi,
            table: ResourceTable::new(),
            limits: StoreLimitsBuilder::new()
                .memory_size(memory_bytes)
                .trap_on_grow_failure(true)
                .instances(4)
                .tables(16)
                .memories(4)
                .build(),
            fold,
            guest,
            stderr,
        }
    }

    /// What the guest said before it trapped: a Rust panic's message (the line after
    /// `panicked at …:`, with that location), else the last line it wrote to stderr.
    pub fn panic_message(&self) -> Option<String> {
        let bytes = self.stderr.contents();
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        if let Some(i) = lines.iter().rposition(|l| l.contains("panicked at")) {
            let at = lines[i]
                .split_once("panicked at")
                .map(|(_, loc)| loc.trim().trim_end_matches(':'))
                .unwrap_or_default();
            let msg = lines.get(i + 1).copied().unwrap_or_default();
            return Some(format!("panicked at {at}: {msg}"));
        }
        lines
            .iter()
            .rev()
            .find(|l| !l.is_empty() && !l.starts_with("note:"))
            .map(|l| l.to_string())
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

fn to_entry(e: KvEntry) -> Entry {
    Entry {
        revision: e.version.as_u64().unwrap_or(0),
        key: e.key,
        value: e.value.to_vec(),
    }
}

impl foldhost::guest::types::Host for HostState {}

impl foldhost::guest::fold::Host for HostState {
    fn get(&mut self, key: String) -> wasmtime::Result<Option<Entry>> {
        // A read error traps the call: a guest must never mistake "could not read" for "absent".
        let e = self
            .fold
            .get(&key)
            .map_err(|e| wasmtime::Error::msg(format!("fold get {key:?}: {e}")))?;
        Ok(e.map(to_entry))
    }

    fn scan(
        &mut self,
        prefix: String,
        start_after: Option<String>,
        limit: u32,
    ) -> wasmtime::Result<Vec<Entry>> {
        let limit = limit.min(MAX_SCAN_LIMIT) as usize;
        let v = self
            .fold
            .scan(&prefix, start_after.as_deref(), limit)
            .map_err(|e| wasmtime::Error::msg(format!("fold scan {prefix:?}: {e}")))?;
        Ok(v.into_iter().map(to_entry).collect())
    }
}

impl foldhost::guest::log::Host for HostState {
    fn log(&mut self, level: foldhost::guest::log::Level, message: String) -> wasmtime::Result<()> {
        use foldhost::guest::log::Level;
        let guest = self.guest.as_str();
        match level {
            Level::Trace => tracing::trace!(guest, "{message}"),
            Level::Debug => tracing::debug!(guest, "{message}"),
            Level::Info => tracing::info!(guest, "{message}"),
            Level::Warn => tracing::warn!(guest, "{message}"),
            Level::Error => tracing::error!(guest, "{message}"),
        }
        Ok(())
    }
}

/// The host's update as the guest sees it.
pub fn to_wit_update(u: &KvUpdate) -> Update {
    let (op, value) = match u {
        KvUpdate::Put(e) => (Op::Put, e.value.to_vec()),
        KvUpdate::Delete { .. } => (Op::Delete, Vec::new()),
        KvUpdate::Purge { .. } => (Op::Purge, Vec::new()),
    };
    Update {
        key: u.key().to_string(),
        value,
        revision: u.revision().unwrap_or(0),
        op,
    }
}
