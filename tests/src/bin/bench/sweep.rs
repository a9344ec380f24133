//! `foldhost-bench sweep [ROWS]`: the operation ledger's sweep of ROWS due rows (default
//! 1 000 000) in an append-log store, in the bounded steps the fold takes it in — each step one
//! commit between two of the fold's batches, so the longest step is the longest the sweep holds
//! the fold — against the same sweep as one commit (every row read and deleted at once) on an
//! identical store, in the same run.

use std::time::Instant;

use foldhost::kv::{KvUpdate, WatchCursor};
use foldhost::protocol::{LedgerRow, OpId};
use foldhost::snapshot::SnapshotStore;
use foldhost::storedir::{AnyStore, Backend};

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

/// A store holding `rows` ledger rows recorded at 1 ms (all due).
fn store_with_rows(dir: &std::path::Path, rows: u64) -> anyhow::Result<AnyStore> {
    let (mut store, _) = AnyStore::open(dir, Backend::AppendLog)?;
    let mut batch = Vec::with_capacity(10_000);
    for i in 0..rows {
        let row = LedgerRow {
            revision: i + 1,
            key: format!("k.{i}"),
            recorded_unix_ms: 1,
            epoch: 0,
            digest: Some([7; 16]),
        };
        batch.push(foldhost::ledger::row_put(
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

pub async fn run(rows: u64) -> anyhow::Result<()> {
    let now = 1_800_000_000_000u64;
    let cutoff = now - 1;
    // Stepped, as the fold runs it.
    let dir = tempfile::tempdir()?;
    let mut store = store_with_rows(dir.path(), rows)?;
    let cursor = store.cursor();
    let (mut longest, mut steps, mut removed) = (0f64, 0u64, 0usize);
    let t = Instant::now();
    let mut after: Option<String> = None;
    loop {
        let s = Instant::now();
        let (updates, next) = foldhost::ledger::sweep_step(&store, cutoff, now, after.as_deref())?;
        removed += updates
            .iter()
            .filter(|u| matches!(u, KvUpdate::Delete { .. }))
            .count();
        if !updates.is_empty() {
            store.apply(&updates, cursor)?;
        }
        longest = longest.max(s.elapsed().as_secs_f64() * 1e3);
        steps += 1;
        match next {
            Some(k) => after = Some(k),
            None => break,
        }
    }
    let stepped_total = t.elapsed().as_secs_f64();
    anyhow::ensure!(removed as u64 == rows, "swept {removed} of {rows}");
    drop(store);
    // One commit, as a sweep ran before it was stepped.
    let dir = tempfile::tempdir()?;
    let mut store = store_with_rows(dir.path(), rows)?;
    let cursor = store.cursor();
    let t = Instant::now();
    let mut all = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let (updates, next) = foldhost::ledger::sweep_step(&store, cutoff, now, after.as_deref())?;
        all.extend(updates);
        match next {
            Some(k) => after = Some(k),
            None => break,
        }
    }
    store.apply(&all, cursor)?;
    let whole = t.elapsed().as_secs_f64() * 1e3;
    println!(
        "sweep: {rows} rows in {steps} steps, {stepped_total:.2} s; longest step {longest:.1} ms; as one commit {whole:.0} ms"
    );
    table::row(
        format!(
            "ledger sweep of {} rows: the fold's longest pause (one step)",
            table::rate(rows as f64)
        ),
        format!("{longest:.1} ms"),
        format!("the same sweep as one commit {whole:.0} ms"),
        longest / whole,
        "",
    );
    table::row(
        format!(
            "ledger sweep of {} rows: whole sweep in steps",
            table::rate(rows as f64)
        ),
        format!("{stepped_total:.2} s ({steps} steps)"),
        format!("as one commit {:.2} s", whole / 1e3),
        stepped_total * 1e3 / whole,
        "",
    );
    Ok(())
}
