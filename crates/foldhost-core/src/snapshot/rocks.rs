//! [`RocksDbSnapshot`] (cargo feature `rocksdb`): the durable fold in RocksDB, for folds too large
//! for RAM. Files live in `STORE/rocksdb/`.
//!
//! Invariants:
//! - **One atomic `WriteBatch` per apply.** A batch's data writes (column family `data`, values in
//!   the [`super::value_codec`] format) and the new cursor and key count (column family `meta`) go
//!   to RocksDB in one `WriteBatch`, with the WAL always on: after any crash, either all of it is
//!   recovered or none of it. Data keys and meta keys live in separate column families, so no data
//!   key (the host's `\x01…` reserved keys included) can collide with the cursor.
//! - **Durability.** With [`RocksDbOptions::sync`] `false` (the default) a committed apply is in
//!   the OS page cache: it survives a *process* crash, not a power loss; a power loss can take the
//!   fold back to an earlier cursor, never to a cursor without its data (WAL point-in-time
//!   recovery). With `sync` `true` every apply fsyncs the WAL before returning, and survives a
//!   power loss too.
//! - **`len` is kept, not scanned.** The live-key count is stored in `meta` beside the cursor and
//!   updated in the same batch; each apply probes whether its keys existed (one sorted multi-get
//!   of its distinct keys, mostly answered by the filters on a hydration of new keys; read in two
//!   halves on two threads when the last large batch's checks cost what cold block reads do).
//! - **Scans iterate.** `for_each_in_range*` walk a raw iterator from a seek; nothing materialises
//!   the fold.
//! - **Poisoned after a failed write.** When a commit fails, the store refuses every later write
//!   with [`SnapshotError::Poisoned`] until reopened; the WAL recovers a consistent fold.
//! - **Read-only opens never write into the store.** [`RocksDbSnapshot::open_read_only`] uses
//!   RocksDB's read-only mode (no lock, no flush, no compaction) with its info log redirected to a
//!   private temporary directory, so `status` and `dump` work beside a running host.
//! - **A clean stop is durable and writes a table only for a large log.**
//!   [`RocksDbSnapshot::close_durably`] fsyncs the write-ahead log when it holds at most
//!   [`CLEAN_STOP_LOG_BYTES`], and the next open replays it into the memtable without writing a
//!   table (`avoid_flush_during_recovery`); over that it flushes the memtables (one atomic flush).
//!   So a short run adds no level-0 table (each used to add two, and a node restarted often
//!   climbed towards RocksDB's write slowdown at 20), and an open never replays more than
//!   [`CLEAN_STOP_LOG_BYTES`] of log after a clean stop.
//! - **Export is a native checkpoint.** [`SnapshotStore::export_to`] creates a RocksDB checkpoint
//!   (memtables flushed atomically across both column families, SST files hard-linked) in
//!   `DEST/rocksdb`, then reopens it read-only and requires the same cursor.
//!
//! # Tuning
//! Tuned for large folds: ribbon filters (10 bits/key equivalent) partitioned together
//! with a two-level index, index and filter blocks held in the bounded block cache (top level
//! pinned), ZSTD at every level (see `data_cf_options`), dynamic level sizes. Filters are
//! kept on the last level too (not `optimize_filters_for_hits`): the count-keeping probe in `apply`
//! misses on every new key, and those misses are what a hydration is made of.
//! Memory is bounded by [`RocksDbOptions::block_cache_bytes`] plus the memtables
//! (`write_buffer_size` × 2 per column family).

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use rocksdb::{
    BlockBasedIndexType, BlockBasedOptions, Cache, ColumnFamily, ColumnFamilyDescriptor, DB,
    DBCompressionType, Options, WriteBatch, WriteOptions, checkpoint::Checkpoint,
};

use super::lsm::{self, COUNT_KEY, CURSOR_KEY, DATA, META, Op};
use super::{ProvenCopy, SnapshotError, SnapshotStore};
use crate::kv::{KvEntry, KvUpdate, WatchCursor};

/// The subdirectory of the store directory that holds RocksDB's files.
pub(crate) const DB_DIR: &str = "rocksdb";

/// Tuning for [`RocksDbSnapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RocksDbOptions {
    /// Fsync the WAL on every apply (survive a power loss), not only hand it to the OS (survive a
    /// process crash). Default `false`.
    pub sync: bool,
    /// Block cache capacity in bytes (data, index and filter blocks). Default 64 MiB.
    pub block_cache_bytes: usize,
    /// Memtable size per column family. Default 64 MiB.
    pub write_buffer_bytes: usize,
}

impl Default for RocksDbOptions {
    fn default() -> Self {
        RocksDbOptions {
            sync: false,
            block_cache_bytes: 64 << 20,
            write_buffer_bytes: 64 << 20,
        }
    }
}

/// The durable fold in RocksDB. See the module docs for what it guarantees.
pub struct RocksDbSnapshot {
    path: PathBuf,
    db: DB,
    cursor: WatchCursor,
    count: u64,
    sync: bool,
    read_only: bool,
    poisoned: Option<String>,
    fail_next_write: bool,
    /// Whether this process may run on two cores or more (read once, at the open).
    multi_core: bool,
    /// Whether the next large existence probe is split across two threads: the last large probe
    /// cost as much as cold reads do (see [`split_next_probe`]).
    split_probe: bool,
    /// Makes the next split probe find its thread refused (tests only: the one-thread fallback).
    refuse_probe_thread: bool,
    /// Where a read-only open's info log goes (removed on drop).
    _log_dir: Option<tempfile::TempDir>,
}

impl std::fmt::Debug for RocksDbSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocksDbSnapshot")
            .field("path", &self.path)
            .field("keys", &self.count)
            .field("cursor", &self.cursor)
            .field("read_only", &self.read_only)
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

/// The most write-ahead log a clean stop leaves for the next open to replay rather than flush
/// into a level-0 table (see [`RocksDbSnapshot::close_durably`]). 1 MiB is about 7 000 updates of
/// a 100-byte value. Measured on a 300 000-key store (`docs/performance.md` §7, `00ffbe8`), a
/// replay at the open costs about 5 ms per MiB of log and the fsync at the stop about 3, where
/// the flush they replace costs 4.4 ms at 0.14 MB of log and 11.7 ms at 0.86 MB: under the bound
/// the stop and the next open together cost no more than a flush and its open, and leave no
/// level-0 table behind.
pub(crate) const CLEAN_STOP_LOG_BYTES: u64 = 1 << 20;

/// The fewest distinct keys whose existence probe (see [`RocksDbSnapshot::probe_live`]) is split
/// across two threads: under it, a thread's start (tens of µs) costs about what it saves, even
/// on cold blocks.
const SPLIT_PROBE_KEYS: usize = 64;

/// The cost per key, on one thread, from which a probe is worth splitting. A check the filter
/// answers (a new key) costs well under 1 µs, one answered from the block cache 1–2 µs, one that
/// reads and decompresses a cold 4 KiB block about 10 µs with ZSTD (6.5 with LZ4): a resume's, on
/// a fold whose blocks are not cached (`docs/performance.md` §7, `d873fd7`).
const SPLIT_PROBE_COST: std::time::Duration = std::time::Duration::from_micros(4);

/// Whether the next large probe should be split, from the last large one: `keys` checked in
/// `elapsed`, on two threads when `split`. Its cost per key on one thread is taken as twice the
/// wall time of a split probe (the halves run side by side). Pure; only the speed depends on it,
/// never what a probe answers.
fn split_next_probe(keys: usize, elapsed: std::time::Duration, split: bool) -> bool {
    let one_thread = if split {
        elapsed.saturating_mul(2)
    } else {
        elapsed
    };
    keys >= SPLIT_PROBE_KEYS
        && one_thread >= SPLIT_PROBE_COST.saturating_mul(u32::try_from(keys).unwrap_or(u32::MAX))
}

/// The bytes of write-ahead log (`*.log`; the info log is `LOG`) in the RocksDB directory `db`,
/// or `None` when it cannot be listed.
fn log_bytes(db: &Path) -> Option<u64> {
    let mut total = 0u64;
    for entry in std::fs::read_dir(db).ok()? {
        let entry = entry.ok()?;
        if entry.file_name().to_string_lossy().ends_with(".log") {
            total = total.saturating_add(entry.metadata().ok()?.len());
        }
    }
    Some(total)
}

fn rerr(path: &Path, op: &'static str) -> impl FnOnce(rocksdb::Error) -> SnapshotError {
    let path = path.to_owned();
    move |e| SnapshotError::Backend(format!("{}: rocksdb {op}: {e}", path.display()))
}

fn data_cf_options(opts: &RocksDbOptions, cache: &Cache) -> Options {
    let mut table = BlockBasedOptions::default();
    table.set_block_cache(cache);
    // 4 KiB blocks: a point read (the existence check of every put, see `apply`) decompresses
    // one block into the cache; at 16 KiB the 1 000 updates of a resume on a 1 000 000-key fold
    // spent 11 ms reading, at 4 KiB 5 ms. The values compress no worse, and scans do not slow.
    table.set_block_size(4 << 10);
    table.set_ribbon_filter(10.0);
    table.set_partition_filters(true);
    table.set_index_type(BlockBasedIndexType::TwoLevelIndexSearch);
    table.set_metadata_block_size(4 << 10);
    table.set_cache_index_and_filter_blocks(true);
    table.set_cache_index_and_filter_blocks_with_high_priority(true);
    table.set_pin_top_level_index_and_filter(true);
    table.set_pin_l0_filter_and_index_blocks_in_cache(true);
    let mut o = Options::default();
    o.set_block_based_table_factory(&table);
    // ZSTD at every level, not LZ4 above the bottommost: a replayed fold sits in level-0 tables
    // (a 1 000 000-key replay leaves three), where LZ4, which has no entropy coding, left the
    // bench's hex values whole: the store and its artifact were 80 MB with LZ4, 49 MB with ZSTD,
    // and a bootstrap through S3 (moto) took 0.08 s instead of 0.12 (`docs/performance.md` §7,
    // `d873fd7`). The replay did not slow (the flushes run beside the fold); a cold point read
    // pays the slower decompression, about 4 ms over a resume's 1 000 existence checks.
    o.set_compression_type(DBCompressionType::Zstd);
    o.set_level_compaction_dynamic_level_bytes(true);
    o.set_write_buffer_size(opts.write_buffer_bytes);
    o
}

fn meta_cf_options() -> Options {
    let mut o = Options::default();
    // Two keys, rewritten on every apply: a small memtable is plenty.
    o.set_write_buffer_size(1 << 20);
    o
}

fn db_options(read_only: bool) -> Options {
    let mut o = Options::default();
    o.create_if_missing(!read_only);
    o.create_missing_column_families(!read_only);
    // Flush both column families together, so a checkpoint never pairs new data with an old cursor.
    o.set_atomic_flush(true);
    o.set_keep_log_file_num(3);
    o.set_max_log_file_size(8 << 20);
    o.set_bytes_per_sync(1 << 20);
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    o.increase_parallelism(cores.clamp(2, 8) as i32);
    // Open the tables on the opening thread: a resume's open spent 1.4 ms of its 5.5 starting
    // RocksDB's default 16 table-opening threads for the few tables a fold has.
    o.set_max_file_opening_threads(1);
    o
}

/// [`db_options`] for the writable open: the log a clean stop left (at most
/// [`CLEAN_STOP_LOG_BYTES`]) is replayed into the memtable, not flushed into a level-0 table at
/// the open; RocksDB keeps those log files until their memtable is flushed. The Rust binding has
/// no setter for this one, so it goes through RocksDB's options-string parser.
fn writable_db_options() -> Result<Options, rocksdb::Error> {
    db_options(false).get_options_from_string("avoid_flush_during_recovery=true")
}

fn descriptors(opts: &RocksDbOptions, cache: &Cache) -> Vec<ColumnFamilyDescriptor> {
    vec![
        ColumnFamilyDescriptor::new(DATA, data_cf_options(opts, cache)),
        ColumnFamilyDescriptor::new(META, meta_cf_options()),
    ]
}

impl RocksDbSnapshot {
    /// Opens (creating when absent) the store in `STORE/rocksdb` for writing. RocksDB's own lock
    /// refuses a second writer.
    pub fn open(store_dir: &Path, opts: RocksDbOptions) -> Result<Self, SnapshotError> {
        let path = store_dir.join(DB_DIR);
        std::fs::create_dir_all(&path).map_err(|source| SnapshotError::Io {
            path: path.clone(),
            op: "create rocksdb directory",
            source,
        })?;
        let cache = Cache::new_lru_cache(opts.block_cache_bytes);
        let db_opts = writable_db_options().map_err(rerr(&path, "options"))?;
        let db =
            DB::open_cf_descriptors(&db_opts, &path, descriptors(&opts, &cache)).map_err(|e| {
                if e.to_string().contains("lock") {
                    SnapshotError::Locked {
                        path: path.join("LOCK"),
                    }
                } else {
                    rerr(&path, "open")(e)
                }
            })?;
        Self::load(path, db, opts.sync, false, None)
    }

    /// A clean stop, after which everything applied survives a power loss. When the write-ahead
    /// log holds at most [`CLEAN_STOP_LOG_BYTES`] (a short run, or a resume), it is fsynced and
    /// left for the next open to replay into the memtable: no table is written, at the stop or at
    /// the open. Over that, both column families' memtables are flushed into tables (one atomic
    /// flush, `atomic_flush`; RocksDB fsyncs the tables and the manifest), so the next open
    /// replays no more than that bound. Either way the log stays until RocksDB drops it as
    /// obsolete, so a failure here loses nothing: the next open replays it. A read-only instance
    /// has nothing to make durable.
    pub(crate) fn close_durably(self) -> Result<(), SnapshotError> {
        self.close_keeping_log(CLEAN_STOP_LOG_BYTES)
    }

    /// [`Self::close_durably`] with another bound on the log left to replay (tests and probes).
    #[doc(hidden)]
    pub(crate) fn close_keeping_log(self, max_log_bytes: u64) -> Result<(), SnapshotError> {
        if self.read_only {
            return Ok(());
        }
        // A log that cannot be listed is treated as large: flushing is never wrong.
        if log_bytes(&self.path).is_some_and(|n| n <= max_log_bytes) {
            return self
                .db
                .flush_wal(true)
                .map_err(rerr(&self.path, "fsync the log at a clean stop"));
        }
        let data = cf(&self.db, &self.path, DATA)?;
        let meta = cf(&self.db, &self.path, META)?;
        let mut fo = rocksdb::FlushOptions::default();
        fo.set_wait(true);
        self.db
            .flush_cfs_opt(&[data, meta], &fo)
            .map_err(rerr(&self.path, "flush at a clean stop"))
    }

    /// Opens `STORE/rocksdb` read-only: no lock, no writes into the store, works beside a running
    /// writer (it sees the writer's state as of the open). [`SnapshotStore::apply`] is refused.
    pub(crate) fn open_read_only(store_dir: &Path) -> Result<Self, SnapshotError> {
        let path = store_dir.join(DB_DIR);
        if !path.join("CURRENT").exists() {
            return Err(SnapshotError::Io {
                path: path.clone(),
                op: "open read-only",
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no RocksDB store here"),
            });
        }
        let (db, log_dir) = open_read_only_db(&path)?;
        Self::load(path, db, false, true, Some(log_dir))
    }

    fn load(
        path: PathBuf,
        db: DB,
        sync: bool,
        read_only: bool,
        log_dir: Option<tempfile::TempDir>,
    ) -> Result<Self, SnapshotError> {
        let (cursor, count) = {
            let meta = cf(&db, &path, META)?;
            let c = db
                .get_pinned_cf(meta, CURSOR_KEY)
                .map_err(rerr(&path, "read cursor"))?;
            let n = db
                .get_pinned_cf(meta, COUNT_KEY)
                .map_err(rerr(&path, "read count"))?;
            (
                lsm::decode_cursor(&path, c.as_deref())?,
                lsm::decode_count(&path, n.as_deref())?,
            )
        };
        Ok(RocksDbSnapshot {
            path,
            db,
            cursor,
            count,
            sync,
            read_only,
            poisoned: None,
            fail_next_write: false,
            multi_core: std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2),
            // The first large probe after an open is split: its blocks are cold.
            split_probe: true,
            refuse_probe_thread: false,
            _log_dir: log_dir,
        })
    }

    /// Which of `keys` (sorted, distinct) are live, in their order. One sorted multi-get, its two
    /// halves read on two threads when `split`. A live key's check reads and decompresses a data
    /// block, cold on a resume (about 10 µs with ZSTD), and a resume's batches leave the second
    /// core idle; `apply` asks for a split when the last large probe cost that much per key
    /// ([`split_next_probe`]), so a hydration of new keys, whose checks the filters answer, or a
    /// stream of updates to cached keys, is not split after its first large batch.
    fn probe_live(
        &self,
        data: &ColumnFamily,
        keys: &[&str],
        split: bool,
    ) -> Result<Vec<bool>, SnapshotError> {
        let read = |part: &[&str]| -> Result<Vec<bool>, SnapshotError> {
            self.db
                .batched_multi_get_cf(data, part, true)
                .into_iter()
                .map(|r| r.map(|v| v.is_some()).map_err(rerr(&self.path, "read")))
                .collect()
        };
        if !split || keys.len() < SPLIT_PROBE_KEYS {
            return read(keys);
        }
        let (first, second) = keys.split_at(keys.len() / 2);
        std::thread::scope(|scope| {
            // A thread the system refuses (a thread limit reached) is no error: one thread reads
            // it all, as it would for a small batch.
            let spawned = if self.refuse_probe_thread {
                Err(std::io::Error::other("refused (test)"))
            } else {
                std::thread::Builder::new()
                    .name("foldhost-rocksdb-probe".into())
                    .spawn_scoped(scope, || read(second))
            };
            let Ok(other) = spawned else {
                return read(keys);
            };
            // Joined before either answer is looked at: an error on this thread never leaves
            // the other to the scope.
            let live = read(first);
            let rest = other.join().map_err(|_| {
                SnapshotError::Backend(format!(
                    "{}: rocksdb read: the existence probe's second thread panicked",
                    self.path.display()
                ))
            })?;
            let mut live = live?;
            live.extend(rest?);
            Ok(live)
        })
    }

    /// Makes the next apply's commit fail as an I/O error would (tests only).
    #[cfg(test)]
    pub(crate) fn inject_write_fault(&mut self) {
        self.fail_next_write = true;
    }

    fn writable(&self) -> Result<(), SnapshotError> {
        if self.read_only {
            return Err(SnapshotError::Io {
                path: self.path.clone(),
                op: "write",
                source: std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    "the store was opened read-only",
                ),
            });
        }
        if let Some(cause) = &self.poisoned {
            return Err(SnapshotError::Poisoned {
                path: self.path.clone(),
                cause: cause.clone(),
            });
        }
        Ok(())
    }

    fn poison(&mut self, err: &SnapshotError) {
        tracing::warn!(event = "store_poisoned", cause = %err, "rocksdb store poisoned; reopen it to recover");
        self.poisoned.get_or_insert_with(|| err.to_string());
    }

    fn walk(
        &self,
        prefix: &str,
        after: Option<&str>,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        let data = cf(&self.db, &self.path, DATA)?;
        let (start, skip_equal) = lsm::seek_start(prefix, after);
        let mut it = self.db.raw_iterator_cf(data);
        it.seek(start.as_bytes());
        if skip_equal && it.key() == Some(start.as_bytes()) {
            it.next();
        }
        let mut entry = lsm::blank_entry();
        while let (Some(key), Some(record)) = (it.key(), it.value()) {
            if !key.starts_with(prefix.as_bytes()) {
                break;
            }
            lsm::decode_entry_into(&self.path, key, record, &mut entry)?;
            if visit(&entry).is_break() {
                return Ok(());
            }
            it.next();
        }
        it.status().map_err(rerr(&self.path, "iterate"))
    }
}

fn cf<'a>(db: &'a DB, path: &Path, name: &str) -> Result<&'a ColumnFamily, SnapshotError> {
    db.cf_handle(name)
        .ok_or_else(|| SnapshotError::InvalidFormat {
            path: path.to_owned(),
            reason: format!("no column family {name:?}: not a foldhost RocksDB store"),
        })
}

fn open_read_only_db(path: &Path) -> Result<(DB, tempfile::TempDir), SnapshotError> {
    // RocksDB writes an info log even when read-only; keep it out of the store directory.
    let log_dir = tempfile::Builder::new()
        .prefix("foldhost-rocksdb-ro-")
        .tempdir()
        .map_err(|source| SnapshotError::Io {
            path: std::env::temp_dir(),
            op: "create temporary log directory",
            source,
        })?;
    let mut o = db_options(true);
    o.set_db_log_dir(log_dir.path());
    let cache = Cache::new_lru_cache(16 << 20);
    let db = DB::open_cf_descriptors_read_only(
        &o,
        path,
        descriptors(&RocksDbOptions::default(), &cache),
        false,
    )
    .map_err(rerr(path, "open read-only"))?;
    Ok((db, log_dir))
}

impl SnapshotStore for RocksDbSnapshot {
    fn backend(&self) -> &'static str {
        "rocksdb"
    }

    fn cursor(&self) -> WatchCursor {
        self.cursor
    }

    /// One `WriteBatch`: the data writes, the cursor and the new count (see the module docs).
    fn apply(&mut self, batch: &[KvUpdate], cursor: WatchCursor) -> Result<(), SnapshotError> {
        self.writable()?;
        let data = cf(&self.db, &self.path, DATA)?;
        let meta = cf(&self.db, &self.path, META)?;
        // Which of the batch's keys are live before it, in one sorted multi-get: RocksDB then
        // looks each table's index up once per run of keys and reads their blocks together.
        let mut keys: Vec<&str> = batch.iter().map(KvUpdate::key).collect();
        keys.sort_unstable();
        keys.dedup();
        let split = self.multi_core && self.split_probe && keys.len() >= SPLIT_PROBE_KEYS;
        let started = std::time::Instant::now();
        let found = self.probe_live(data, &keys, split)?;
        if keys.len() >= SPLIT_PROBE_KEYS {
            self.split_probe = split_next_probe(keys.len(), started.elapsed(), split);
        }
        if found.len() != keys.len() {
            return Err(SnapshotError::Backend(format!(
                "{}: rocksdb read: the existence probe answered {} of {} keys",
                self.path.display(),
                found.len(),
                keys.len()
            )));
        }
        let live: std::collections::HashSet<&str> = keys
            .iter()
            .zip(&found)
            .filter_map(|(key, f)| f.then_some(*key))
            .collect();
        let plan = lsm::plan(batch, self.count, |key| Ok(live.contains(key)))?;
        let mut wb = WriteBatch::default();
        for op in &plan.ops {
            match op {
                Op::Put(key, record) => wb.put_cf(data, key, record),
                Op::Delete(key) => wb.delete_cf(data, key),
            }
        }
        wb.put_cf(meta, CURSOR_KEY, cursor.to_bytes());
        wb.put_cf(meta, COUNT_KEY, lsm::encode_count(plan.count));
        let mut wo = WriteOptions::default();
        wo.set_sync(self.sync);
        let res = if std::mem::take(&mut self.fail_next_write) {
            Err(SnapshotError::Io {
                path: self.path.clone(),
                op: "commit batch",
                source: std::io::Error::other("injected write fault"),
            })
        } else {
            self.db
                .write_opt(wb, &wo)
                .map_err(rerr(&self.path, "commit batch"))
        };
        if let Err(e) = res {
            self.poison(&e);
            return Err(e);
        }
        self.cursor = cursor;
        self.count = plan.count;
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<KvEntry>, SnapshotError> {
        let data = cf(&self.db, &self.path, DATA)?;
        let Some(record) = self
            .db
            .get_pinned_cf(data, key)
            .map_err(rerr(&self.path, "get"))?
        else {
            return Ok(None);
        };
        let mut entry = lsm::blank_entry();
        lsm::decode_entry_into(&self.path, key.as_bytes(), &record, &mut entry)?;
        Ok(Some(entry))
    }

    fn for_each_in_range(
        &self,
        prefix: &str,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        self.walk(prefix, None, visit)
    }

    fn for_each_in_range_after(
        &self,
        prefix: &str,
        after: Option<&str>,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        self.walk(prefix, after, visit)
    }

    fn len(&self) -> Result<u64, SnapshotError> {
        Ok(self.count)
    }

    /// A native checkpoint into `DEST/rocksdb`, verified by reopening it read-only. Refused on a
    /// read-only instance: its checkpoint would leave out what is still only in the write-ahead
    /// log (the verify would catch it; this says why, before any copy).
    fn export_to(&self, dest: &Path) -> Result<Option<ProvenCopy>, SnapshotError> {
        let target = dest.join(DB_DIR);
        if self.read_only {
            return Err(SnapshotError::Backend(format!(
                "{}: a read-only RocksDB instance cannot export (its checkpoint would miss what is only in the write-ahead log); export from a writable open",
                self.path.display()
            )));
        }
        Checkpoint::new(&self.db)
            .and_then(|c| c.create_checkpoint(&target))
            .map_err(rerr(&target, "checkpoint"))?;
        let copy = RocksDbSnapshot::open_read_only(dest)?;
        if copy.cursor != self.cursor || copy.count != self.count {
            return Err(SnapshotError::Backend(format!(
                "{}: exported checkpoint recovers {} with {} keys, the store is at {} with {} keys",
                target.display(),
                copy.cursor,
                copy.count,
                self.cursor,
                self.count
            )));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::VersionToken;

    #[test]
    fn sync_mode_commits_and_reopens() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = RocksDbOptions {
            sync: true,
            ..RocksDbOptions::default()
        };
        let mut s = RocksDbSnapshot::open(dir.path(), opts).expect("open");
        s.apply(
            &[KvUpdate::Put(KvEntry {
                key: "a".into(),
                value: bytes::Bytes::from_static(b"v"),
                version: VersionToken::from_u64(1),
            })],
            WatchCursor::at(1),
        )
        .expect("apply");
        drop(s);
        let s = RocksDbSnapshot::open(dir.path(), opts).expect("reopen");
        assert_eq!((s.cursor(), s.len().expect("len")), (WatchCursor::at(1), 1));
    }

    /// Bytes in the store's write-ahead log files (`NNNNNN.log`; `LOG` is the info log).
    fn wal_bytes(store: &Path) -> u64 {
        std::fs::read_dir(store.join(DB_DIR))
            .expect("list")
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().ends_with(".log"))
            .map(|e| e.metadata().expect("stat").len())
            .sum()
    }

    fn table_count(store: &Path) -> usize {
        std::fs::read_dir(store.join(DB_DIR))
            .expect("list")
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().ends_with(".sst"))
            .count()
    }

    fn put(key: &str, value: &[u8], rev: u64) -> KvUpdate {
        KvUpdate::Put(KvEntry {
            key: key.into(),
            value: bytes::Bytes::copy_from_slice(value),
            version: VersionToken::from_u64(rev),
        })
    }

    #[test]
    fn a_clean_close_of_a_small_log_writes_no_table_and_the_reopen_replays_it_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = RocksDbSnapshot::open(dir.path(), RocksDbOptions::default()).expect("open");
        s.apply(&[put("a", b"1", 1), put("b", b"2", 2)], WatchCursor::at(2))
            .expect("apply");
        s.apply(
            &[KvUpdate::Delete {
                key: "a".into(),
                version: VersionToken::from_u64(3),
            }],
            WatchCursor::at(3),
        )
        .expect("apply");
        let logged = wal_bytes(dir.path());
        assert!(logged > 0, "the applies are in the log");
        s.close_durably().expect("close");
        assert_eq!(table_count(dir.path()), 0, "no table written at the stop");
        assert!(
            wal_bytes(dir.path()) >= logged,
            "the log is kept for the reopen"
        );
        let mut s = RocksDbSnapshot::open(dir.path(), RocksDbOptions::default()).expect("reopen");
        assert_eq!(
            table_count(dir.path()),
            0,
            "the open replays without a flush"
        );
        assert_eq!((s.cursor(), s.len().expect("len")), (WatchCursor::at(3), 1));
        assert!(s.get("a").expect("get").is_none(), "the delete holds");
        assert_eq!(
            s.get("b").expect("get").map(|e| e.value),
            Some(bytes::Bytes::from_static(b"2"))
        );
        // Writes after the reopen number above the replayed log and win over it.
        s.apply(&[put("b", b"3", 4)], WatchCursor::at(4))
            .expect("apply");
        s.close_durably().expect("close");
        let s = RocksDbSnapshot::open(dir.path(), RocksDbOptions::default()).expect("reopen");
        assert_eq!((s.cursor(), s.len().expect("len")), (WatchCursor::at(4), 1));
        assert_eq!(
            s.get("b").expect("get").map(|e| e.value),
            Some(bytes::Bytes::from_static(b"3"))
        );
    }

    #[test]
    fn many_short_runs_add_no_table_and_leave_at_most_the_bound_of_log_to_replay() {
        let dir = tempfile::tempdir().expect("tempdir");
        let value = [7u8; 200];
        let mut rev = 0u64;
        let mut flushed = false;
        // Each run: open, 1 000 updates of 200 bytes (about 0.25 MiB of log), a clean stop. The
        // log grows past the bound on the fifth run; that stop flushes, the others write nothing.
        for run in 0..8 {
            let mut s = RocksDbSnapshot::open(dir.path(), RocksDbOptions::default()).expect("open");
            if run > 0 {
                assert_eq!(
                    s.cursor(),
                    WatchCursor::at(rev),
                    "run {run} resumes where the last stopped"
                );
            }
            for chunk in 0..10 {
                let batch: Vec<_> = (0..100)
                    .map(|i| {
                        rev += 1;
                        put(&format!("k{}", (chunk * 100 + i) % 700), &value, rev)
                    })
                    .collect();
                s.apply(&batch, WatchCursor::at(rev)).expect("apply");
            }
            let before = wal_bytes(dir.path());
            s.close_durably().expect("close");
            if before > CLEAN_STOP_LOG_BYTES {
                flushed = true;
                assert!(
                    table_count(dir.path()) > 0,
                    "run {run}: a large log is flushed"
                );
            } else if !flushed {
                assert_eq!(
                    table_count(dir.path()),
                    0,
                    "run {run}: a small log writes no table"
                );
            }
            assert!(
                wal_bytes(dir.path()) <= CLEAN_STOP_LOG_BYTES,
                "run {run}: at most the bound is left to replay"
            );
        }
        assert!(flushed, "the log passed the bound at least once");
        let s = RocksDbSnapshot::open(dir.path(), RocksDbOptions::default()).expect("reopen");
        assert_eq!(
            (s.cursor(), s.len().expect("len")),
            (WatchCursor::at(rev), 700)
        );
    }

    #[test]
    fn a_read_only_instance_refuses_to_export_rather_than_miss_its_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let mut s = RocksDbSnapshot::open(dir.path(), RocksDbOptions::default()).expect("open");
            s.apply(
                &[KvUpdate::Put(KvEntry {
                    key: "a".into(),
                    value: bytes::Bytes::from_static(b"v"),
                    version: VersionToken::from_u64(1),
                })],
                WatchCursor::at(1),
            )
            .expect("apply");
        }
        let ro = RocksDbSnapshot::open_read_only(dir.path()).expect("read-only");
        let out = tempfile::tempdir().expect("tempdir");
        let err = ro.export_to(out.path()).expect_err("refused");
        assert!(err.to_string().contains("read-only"), "{err}");
        assert!(!out.path().join(DB_DIR).exists(), "nothing copied");
    }

    #[test]
    fn read_only_open_of_a_missing_store_is_not_found_and_creates_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = RocksDbSnapshot::open_read_only(dir.path()).expect_err("missing");
        assert!(
            matches!(&err, SnapshotError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
            "{err}"
        );
        assert!(!dir.path().join(DB_DIR).exists());
    }

    #[test]
    fn a_flushed_table_is_entropy_coded_and_reads_back_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = RocksDbSnapshot::open(dir.path(), RocksDbOptions::default()).expect("open");
        let n = 20_000u64;
        let raw = lsm::testing::fill_with_hex_values(&mut s, n);
        // One flush: one level-0 table, where a replayed fold sits.
        let data = cf(&s.db, &s.path, DATA).expect("cf");
        s.db.flush_cf(data).expect("flush");
        let tables: Vec<u64> = std::fs::read_dir(dir.path().join(DB_DIR))
            .expect("ls")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".sst"))
            .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
            .collect();
        let largest = tables.iter().copied().max().unwrap_or(0);
        assert!(largest > 0, "the flush wrote a table: {tables:?}");
        assert!(
            largest * 10 < raw * 7,
            "a table of {largest} bytes for {raw} bytes of keys and values: not entropy-coded"
        );
        for i in [0, 1, n / 2, n - 1] {
            let got = s.get(&lsm::testing::key(i)).expect("get").expect("present");
            assert_eq!(got.value, lsm::testing::hex_value(i), "key {i}");
        }
    }

    #[test]
    fn an_existence_probe_split_across_two_threads_counts_like_one() {
        // The same batches on three stores: one probing on one thread, one always split, one
        // always asked to split and refused its thread (the fallback); the counts follow a model,
        // and every store reads back the same.
        const { assert!(SPLIT_PROBE_KEYS <= 120, "the batches below must be split") };
        let dirs = [
            tempfile::tempdir().expect("tempdir"),
            tempfile::tempdir().expect("tempdir"),
            tempfile::tempdir().expect("tempdir"),
        ];
        let mut stores: Vec<RocksDbSnapshot> = dirs
            .iter()
            .map(|d| RocksDbSnapshot::open(d.path(), RocksDbOptions::default()).expect("open"))
            .collect();
        let mut model = std::collections::BTreeMap::new();
        let mut rev = 0u64;
        for round in 0..6u64 {
            // New keys, updates of live ones, deletes of live and absent ones, and duplicates.
            let mut batch = Vec::new();
            for i in 0..150u64 {
                // 150 updates of 120 distinct keys: a key twice in one batch is deduplicated
                // before the probe and applied in order.
                let k = ((i % 120) * 7 + round * 53) % 400;
                rev += 1;
                let key = format!("k.{k:04}");
                if (i + round) % 5 == 0 {
                    batch.push(KvUpdate::Delete {
                        key: key.clone(),
                        version: VersionToken::from_u64(rev),
                    });
                    model.remove(&key);
                } else {
                    let value = bytes::Bytes::from(format!("v{rev}"));
                    batch.push(KvUpdate::Put(KvEntry {
                        key: key.clone(),
                        value: value.clone(),
                        version: VersionToken::from_u64(rev),
                    }));
                    model.insert(key, value);
                }
            }
            for (n, s) in stores.iter_mut().enumerate() {
                s.multi_core = true;
                s.split_probe = n >= 1;
                s.refuse_probe_thread = n == 2;
                s.apply(&batch, WatchCursor::at(rev)).expect("apply");
                assert_eq!(
                    s.len().expect("len"),
                    model.len() as u64,
                    "round {round}, store {n} (0: one thread, 1: split, 2: split refused)"
                );
            }
        }
        for s in &stores {
            for (key, value) in &model {
                assert_eq!(
                    &s.get(key).expect("get").expect("live").value,
                    value,
                    "{key}"
                );
            }
        }
    }

    #[test]
    fn a_probe_is_split_after_one_that_cost_what_cold_reads_do_and_never_for_a_small_batch() {
        use std::time::Duration;
        let us = Duration::from_micros;
        // Cold blocks (about 10 µs a key on one thread): split.
        assert!(split_next_probe(100, us(1_000), false));
        // The same probe split: its wall time is half, its cost on one thread the same.
        assert!(split_next_probe(100, us(500), true));
        // Checks the filters or the block cache answer: not split.
        assert!(!split_next_probe(100, us(100), false));
        assert!(!split_next_probe(100, us(150), true));
        // At the bound: split.
        assert!(split_next_probe(100, us(400), false));
        assert!(!split_next_probe(100, us(399), false));
        // Under the batch size that pays for a thread: never.
        assert!(!split_next_probe(SPLIT_PROBE_KEYS - 1, us(100_000), false));
        // No overflow on absurd inputs.
        assert!(split_next_probe(usize::MAX, Duration::MAX, true));
    }

    #[test]
    fn read_only_open_leaves_no_info_log_in_the_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        drop(RocksDbSnapshot::open(dir.path(), RocksDbOptions::default()).expect("open"));
        let list = || {
            let mut v: Vec<_> = std::fs::read_dir(dir.path().join(DB_DIR))
                .expect("ls")
                .map(|e| e.expect("entry").file_name())
                .collect();
            v.sort();
            v
        };
        let before = list();
        drop(RocksDbSnapshot::open_read_only(dir.path()).expect("read-only"));
        assert_eq!(list(), before);
    }
}
