//! The limits of one instance's `Store`: memory counted across all of a guest's memories, table
//! elements, instance, table and memory counts, and what a hit on a host-resource limit is named.

use super::{MAX_INSTANCES, MAX_MEMORIES, MAX_TABLE_ELEMENTS, MAX_TABLES};

/// The memory cap was hit: the guest's memories together asked for more than the cap.
#[derive(Debug, thiserror::Error)]
#[error("memory cap of {cap_mib} MiB hit (all of the guest's memories together)")]
pub(crate) struct MemoryCapHit {
    /// The cap, in MiB.
    pub cap_mib: usize,
}

/// A table grew past [`MAX_TABLE_ELEMENTS`].
#[derive(Debug, thiserror::Error)]
#[error("table limit of {max} elements hit (all tables together would hold {desired})")]
pub(crate) struct TableCapHit {
    /// The limit.
    pub max: usize,
    /// What the tables together would have held.
    pub desired: usize,
}

/// The message naming the host-resource limit when `cause` (a link of a failed call's error
/// chain) is that limit refusing a resource: the WASI resource table full
/// ([`wasmtime::component::ResourceTable::set_max_capacity`], which a WASI import turns into a trap) or the store's
/// component-model handles all taken (`Store::set_max_component_handles`, whose error only its
/// text names).
pub(crate) fn resource_limit_hit(
    cause: &(dyn std::error::Error + 'static),
    limit: usize,
) -> Option<String> {
    if matches!(
        cause.downcast_ref::<wasmtime::component::ResourceTableError>(),
        Some(wasmtime::component::ResourceTableError::Full)
    ) {
        return Some(format!(
            "guest exceeded the host resource table limit ({limit} entries)"
        ));
    }
    cause
        .to_string()
        .contains("store handle limit exceeded")
        .then(|| format!("guest exceeded the component handle limit ({limit} handles)"))
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
