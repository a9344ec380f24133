//! The generated bindings of `wit/guest.wit` and the host side of its imports. The only file in the
//! crate that names generated types; `guest/mod.rs` converts to and from the host's own types here
//! at the edge.

use std::sync::Arc;

use wasmtime::component::ResourceTable;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::kv::{KvEntry, KvUpdate};
use crate::view::FoldRead;

wasmtime::component::bindgen!({
    path: "../wit",
    world: "foldhost:guest/guest@0.1.0",
    imports: { default: trappable },
    exports: { default: async },
    // A batch is lowered straight from the host's keys and values: `Update` borrows them, so no
    // update costs a host allocation on its way into the guest.
    ownership: Borrowing { duplicate_if_necessary: true },
});

pub use foldhost::guest::types::{Entry, Op, Update, Verdict};

/// The most entries one `scan` import returns, whatever the guest asks.
pub const MAX_SCAN_LIMIT: u32 = 10_000;

/// Bytes of a guest's stderr kept for error reports (a panic message lands there).
const STDERR_CAPACITY: usize = 16 * 1024;

/// Longest guest log line or error message kept; the rest is cut with its length marked.
pub const MAX_MESSAGE_BYTES: usize = 4096;
/// Most log lines one guest call may write; the rest are dropped (counted in one last line).
pub const MAX_LOG_LINES_PER_CALL: u32 = 1000;
/// Most elements a guest's tables may have together (`table.grow` is one instruction no deadline
/// interrupts).
pub const MAX_TABLE_ELEMENTS: usize = 1_000_000;
/// Most core instances in one guest (language runtimes such as componentize-py use several).
pub const MAX_INSTANCES: usize = 64;
/// Most tables in one guest.
pub const MAX_TABLES: usize = 64;
/// Most linear memories in one guest (together under the memory cap).
pub const MAX_MEMORIES: usize = 16;

/// `text` cut to at most `max` bytes (at a character boundary), with what was cut marked.
pub fn clip_text(text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… [cut: {} bytes in all]", &text[..end], text.len())
}

/// The memory cap was hit: the guest's memories together asked for more than the cap.
#[derive(Debug, thiserror::Error)]
#[error("memory cap of {cap_mib} MiB hit (all of the guest's memories together)")]
pub struct MemoryCapHit {
    /// The cap, in MiB.
    pub cap_mib: usize,
}

/// A table grew past [`MAX_TABLE_ELEMENTS`].
#[derive(Debug, thiserror::Error)]
#[error("table limit of {max} elements hit (all tables together would hold {desired})")]
pub struct TableCapHit {
    /// The limit.
    pub max: usize,
    /// What the tables together would have held.
    pub desired: usize,
}

/// The limits of one instance's `Store`: memory counted across all of the guest's memories (not
/// per memory), table elements, and the counts of instances, tables and memories. A grow over a
/// limit traps the call with the limit named.
pub struct GuestLimiter {
    memory_cap: usize,
    memory_used: usize,
    /// The last memory grow allowed (taken back if the memory itself refuses it).
    memory_last: usize,
    table_used: usize,
    table_last: usize,
}

impl GuestLimiter {
    /// A limiter for a guest that may hold `memory_cap` bytes of linear memory in all.
    pub fn new(memory_cap: usize) -> Self {
        GuestLimiter {
            memory_cap,
            memory_used: 0,
            memory_last: 0,
            table_used: 0,
            table_last: 0,
        }
    }
}

impl wasmtime::ResourceLimiter for GuestLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let grow = desired.saturating_sub(current);
        let total = self.memory_used.saturating_add(grow);
        if total > self.memory_cap {
            return Err(wasmtime::Error::new(MemoryCapHit {
                cap_mib: self.memory_cap / (1024 * 1024),
            }));
        }
        self.memory_used = total;
        self.memory_last = grow;
        Ok(true)
    }

    fn memory_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        // Allowed here, refused by the memory (its own maximum): it holds nothing more.
        self.memory_used = self
            .memory_used
            .saturating_sub(std::mem::take(&mut self.memory_last));
        Ok(())
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let grow = desired.saturating_sub(current);
        let total = self.table_used.saturating_add(grow);
        if total > MAX_TABLE_ELEMENTS {
            return Err(wasmtime::Error::new(TableCapHit {
                max: MAX_TABLE_ELEMENTS,
                desired: total,
            }));
        }
        self.table_used = total;
        self.table_last = grow;
        Ok(true)
    }

    fn table_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        self.table_used = self
            .table_used
            .saturating_sub(std::mem::take(&mut self.table_last));
        Ok(())
    }

    fn instances(&self) -> usize {
        MAX_INSTANCES
    }

    fn tables(&self) -> usize {
        MAX_TABLES
    }

    fn memories(&self) -> usize {
        MAX_MEMORIES
    }
}

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
}

impl HostState {
    /// A fresh state: no filesystem, no environment, no arguments, no network, a fixed clock,
    /// random streams fixed by `seed` and the component's digest (`super::random`), a memory cap,
    /// and read access to the committed fold.
    pub fn new(
        fold: Arc<dyn FoldRead>,
        guest: String,
        memory_bytes: usize,
        seed: &[u8; 32],
        component: &[u8; 32],
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
        HostState {
            wasi,
            table: ResourceTable::new(),
            limits: GuestLimiter::new(memory_bytes),
            fold,
            guest,
            log_lines: 0,
            stderr,
        }
    }

    /// Names the guest in its log lines (`name@version`, once its manifest is known).
    pub fn set_guest(&mut self, guest: String) {
        self.guest = guest;
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
        self.log_lines = self.log_lines.saturating_add(1);
        let guest = self.guest.as_str();
        if self.log_lines > MAX_LOG_LINES_PER_CALL {
            if self.log_lines == MAX_LOG_LINES_PER_CALL + 1 {
                tracing::warn!(
                    guest,
                    "more than {MAX_LOG_LINES_PER_CALL} log lines in one call: the rest of this call's are dropped"
                );
            }
            return Ok(());
        }
        let message = clip_text(message, MAX_MESSAGE_BYTES);
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
pub fn to_wit_update(u: &KvUpdate) -> Update<'_> {
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
    fn long_text_is_cut_at_a_character_boundary_with_its_length_marked() {
        assert_eq!(clip_text("short".into(), 10), "short");
        let cut = clip_text("ééééé".into(), 3);
        assert_eq!(cut, "é… [cut: 10 bytes in all]");
        let big = clip_text("x".repeat(100 << 20), MAX_MESSAGE_BYTES);
        assert!(big.len() < MAX_MESSAGE_BYTES + 64);
        assert!(big.ends_with(&format!("[cut: {} bytes in all]", 100 << 20)));
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
