//! `foldhost-bench sweep [ROWS]`: the operation ledger's sweep of ROWS due rows (default
//! 1 000 000) in a store of each backend, in the bounded steps the fold takes it in — each step
//! one commit between two of the fold's batches, so the longest step is the longest the sweep
//! holds the fold — against the same sweep as one commit (every row read and deleted at once) on
//! an identical store, in the same run. A step's commit includes whatever the store does in its
//! apply (the append log compacts there once its garbage passes the live fold).

use std::time::Instant;

use foldhost_core::kv::{KvUpdate, WatchCursor};
use foldhost_core::protocol::{LedgerRow, OpId};
use foldhost_core::snapshot::SnapshotStore;
use foldhost_core::storedir::{AnyStore, Backend};

use super::table;

/// A UUIDv7 minted at `ms`, `n` in its random bits.
fn op(ms: u64, n: u64) -> anyhow::Result<OpId> {
    let mut b = [0u8; 16];
    b[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
    b[8..].copy_from_slice(&n.to_be_bytes());
    b[6] = 0x70;
    b[8] = 0x80 | (b[8] & 0x3f);
    Ok(OpId::from_bytes(b)?)
}

/// A store of `backend` holding `rows` ledger rows recorded at 1 ms (all due).
fn store_with_rows(dir: &std::path::Path, backend: Backend, rows: u64) -> anyhow::Result<AnyStore> {
    let (mut store, _) = AnyStore::open(dir, backend)?;
    let mut batch = Vec::with_capacity(10_000);
    for i in 0..rows {
        let row = LedgerRow {
            revision: i + 1,
            key: format!("k.{i}"),
            recorded_unix_ms: 1,
            epoch: 0,
            digest: Some([7; 16]),
        };
        batch.push(foldhost_core::ledger::row_put(
            &op(1_700_000_000_000 + i, i)?,
            &row,
        ));
        if batch.len() == 10_000 {
            store.apply(&batch, WatchCursor::at(i + 1))?;
            batch.clear();
        }
    }
    if !batch.is_empty() {
        store.apply(&batch, WatchCursor::at(rows))?;
    }
    Ok(store)
}

const NOW: u64 = 1_800_000_000_000;

/// Sweeps `store` in the fold's steps; each step's time (read and commit) in ms.
fn stepped(store: &mut AnyStore, rows: u64) -> anyhow::Result<Vec<f64>> {
    let cursor = store.cursor();
    let mut steps = Vec::new();
    let mut removed = 0usize;
    let mut after: Option<String> = None;
    loop {
        let s = Instant::now();
        let (updates, next) =
            foldhost_core::ledger::sweep_step(&*store, NOW - 1, NOW, after.as_deref())?;
        removed += updates
            .iter()
            .filter(|u| matches!(u, KvUpdate::Delete { .. }))
            .count();
        if !updates.is_empty() {
            store.apply(&updates, cursor)?;
        }
        steps.push(s.elapsed().as_secs_f64() * 1e3);
        match next {
            Some(k) => after = Some(k),
            None => break,
        }
    }
    anyhow::ensure!(removed as u64 == rows, "swept {removed} of {rows}");
    Ok(steps)
}

/// Sweeps `store` as one commit (every due row read, then deleted at once); its time in ms.
fn whole(store: &mut AnyStore) -> anyhow::Result<f64> {
    let cursor = store.cursor();
    let t = Instant::now();
    let mut all = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let (updates, next) =
            foldhost_core::ledger::sweep_step(&*store, NOW - 1, NOW, after.as_deref())?;
        all.extend(updates);
        match next {
            Some(k) => after = Some(k),
            None => break,
        }
    }
    store.apply(&all, cursor)?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

pub async fn run(rows: u64) -> anyhow::Result<()> {
    for backend in [Backend::AppendLog, Backend::Fjall, Backend::RocksDb] {
        let dir = tempfile::tempdir()?;
        let mut store = store_with_rows(dir.path(), backend, rows)?;
        let t = Instant::now();
        let mut steps = stepped(&mut store, rows)?;
        let total = t.elapsed().as_secs_f64();
        drop(store);
        let dir = tempfile::tempdir()?;
        let mut store = store_with_rows(dir.path(), backend, rows)?;
        let one = whole(&mut store)?;
        drop(store);
        let n = steps.len();
        let longest = steps.iter().copied().fold(0f64, f64::max);
        steps.sort_by(|a, b| a.total_cmp(b));
        let median = steps[n / 2];
        let over = steps.iter().filter(|&&ms| ms > 10.0 * median).count();
        let name = backend.as_str();
        println!(
            "sweep {name}: {rows} rows in {n} steps, {total:.2} s; step median {median:.1} ms, longest {longest:.1} ms ({over} over 10× the median); as one commit {one:.0} ms"
        );
        table::row(
            format!(
                "ledger sweep of {} rows, {name}: the fold's longest pause (one step; median {median:.1} ms, {over} of {n} over 10×)",
                table::rate(rows as f64)
            ),
            format!("{longest:.1} ms"),
            format!("the same sweep as one commit {one:.0} ms"),
            longest / one,
            "",
        );
    }
    Ok(())
}
