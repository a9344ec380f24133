//! The `backends` benchmark: storage backends compared without NATS, one child process each.

use std::ops::ControlFlow;
use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use bytes::Bytes;
use foldhost_core::kv::{KvEntry, KvUpdate, VersionToken, WatchCursor};
use foldhost_core::snapshot::SnapshotStore;
use foldhost_core::storedir::{AnyStore, Backend};

/// The hidden subcommand a child runs: `__backend-child PHASE BACKEND KEYS DIR`.
pub const CHILD: &str = "__backend-child";
const CONFIGS: [(usize, usize); 4] = [(100, 128), (1000, 128), (100, 1024), (1000, 1024)];

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

/// A multiplier coprime with `keys`: `i * m % keys` visits 0..keys once each, scattered.
fn scatter(keys: u64) -> u64 {
    let mut m: u64 = 2_654_435_761 % keys.max(1);
    while gcd(m, keys) != 1 {
        m += 1;
    }
    m
}

/// Key `i` of a KEYS-key fold, in scattered (not sorted) order.
fn key(i: u64, keys: u64, m: u64) -> String {
    format!(
        "bench/{:010}",
        (i % keys.max(1)).wrapping_mul(m) % keys.max(1)
    )
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Folds `keys` keys into a new store in `dir`; returns updates/s.
fn ingest(
    backend: Backend,
    dir: &Path,
    keys: u64,
    batch: usize,
    value_len: usize,
) -> anyhow::Result<f64> {
    let (mut store, _) = AnyStore::open(dir, backend)?;
    let m = scatter(keys);
    let value = Bytes::from(vec![0x5a; value_len]);
    let mut buf = Vec::with_capacity(batch);
    let t = Instant::now();
    let mut i = 0;
    while i < keys {
        buf.clear();
        for j in i..(i + batch as u64).min(keys) {
            buf.push(KvUpdate::Put(KvEntry {
                key: key(j, keys, m),
                value: value.clone(),
                version: VersionToken::from_u64(j + 1),
            }));
        }
        i += buf.len() as u64;
        store.apply(&buf, WatchCursor::at(i))?;
    }
    let secs = t.elapsed().as_secs_f64();
    anyhow::ensure!(
        store.len()? == keys,
        "{}: len {} != {keys}",
        backend.as_str(),
        store.len()?
    );
    Ok(keys as f64 / secs)
}

/// Child: runs one phase for one backend and prints one JSON line.
/// `ingest BACKEND KEYS DIR BATCH VALUE_LEN` folds into DIR (kept); `open BACKEND KEYS DIR`
/// reopens DIR and scans it whole.
pub fn child(args: &[String]) -> anyhow::Result<()> {
    let (phase, backend, keys, dir) = match args {
        [p, b, k, d, ..] => (p, b, k, d),
        _ => anyhow::bail!("usage: {CHILD} ingest|open BACKEND KEYS DIR [BATCH VALUE_LEN]"),
    };
    let backend: Backend = backend.parse().map_err(anyhow::Error::msg)?;
    let keys: u64 = keys.parse()?;
    let dir = Path::new(dir);
    let out = match (phase.as_str(), &args[4..]) {
        ("ingest", [batch, value_len]) => {
            let rate = ingest(backend, dir, keys, batch.parse()?, value_len.parse()?)?;
            serde_json::json!({ "rate": rate, "rss_kib": peak_rss_kib() })
        }
        ("open", []) => {
            let t = Instant::now();
            let (store, _) = AnyStore::open(dir, backend)?;
            let open_s = t.elapsed().as_secs_f64();
            anyhow::ensure!(store.len()? == keys, "reopened len");
            let t = Instant::now();
            let mut n = 0u64;
            let mut live = 0u64;
            store.for_each_in_range("", &mut |e| {
                n += 1;
                live += (e.key.len() + e.value.len()) as u64;
                ControlFlow::Continue(())
            })?;
            let scan_s = t.elapsed().as_secs_f64();
            anyhow::ensure!(n == keys, "scanned {n} != {keys}");
            serde_json::json!({ "open_s": open_s, "scan_s": scan_s, "rss_kib": peak_rss_kib(), "live_bytes": live })
        }
        (other, _) => anyhow::bail!("unknown phase {other} or its arguments"),
    };
    println!("{out}");
    Ok(())
}

fn run_child(
    args: &[&str],
    backend: Backend,
    keys: u64,
    dir: &Path,
) -> anyhow::Result<serde_json::Value> {
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([CHILD, args[0], backend.as_str(), &keys.to_string()])
        .arg(dir)
        .args(&args[1..])
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("{} {} child", backend.as_str(), args[0]))?;
    anyhow::ensure!(
        out.status.success(),
        "{} {} child failed: {}",
        backend.as_str(),
        args[0],
        out.status
    );
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).with_context(|| format!("child output {line:?}"))
}

/// One backend's figures.
struct Figures {
    backend: Backend,
    /// Per [`CONFIGS`] entry: updates/s and the ingest's peak RSS in MiB.
    ingest: Vec<(f64, f64)>,
    /// Per value size (128 B, 1 KiB): open seconds, scan seconds, peak RSS MiB, live MiB.
    open: Vec<(f64, f64, f64, f64)>,
}

/// Runs every compiled-in backend in child processes (one per phase and configuration, so
/// each peak RSS is that phase's alone), prints the figures and adds them to the table.
pub fn run(keys: u64) -> anyhow::Result<()> {
    let backends: Vec<Backend> = [Backend::AppendLog, Backend::Fjall, Backend::RocksDb]
        .into_iter()
        .filter(Backend::is_compiled)
        .collect();
    println!("backends — {keys} keys, each phase in its own process (ratios: ÷ append-log)");
    let mut all = Vec::new();
    for b in backends {
        all.push(measure(b, keys)?);
    }
    let Some(base) = all.first().map(|f| (f.ingest.clone(), f.open.clone())) else {
        return Ok(());
    };
    for fig in &all {
        report(keys, fig, &base);
    }
    Ok(())
}

/// The figures of `b`: every [`CONFIGS`] ingest, and the batch-1 000 folds reopened and
/// scanned, each in a child process of its own.
fn measure(b: Backend, keys: u64) -> anyhow::Result<Figures> {
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let dir = tempfile::tempdir()?;
    let mut ingest = Vec::new();
    let mut open = Vec::new();
    for (i, (batch, value_len)) in CONFIGS.iter().enumerate() {
        let sub = dir.path().join(format!("c{i}"));
        let ing = run_child(
            &["ingest", &batch.to_string(), &value_len.to_string()],
            b,
            keys,
            &sub,
        )?;
        ingest.push((f(&ing, "rate"), f(&ing, "rss_kib") / 1024.0));
        // The batch-1 000 folds (128 B, then 1 KiB) are reopened and scanned.
        if *batch == 1000 {
            let o = run_child(&["open"], b, keys, &sub)?;
            open.push((
                f(&o, "open_s"),
                f(&o, "scan_s"),
                f(&o, "rss_kib") / 1024.0,
                f(&o, "live_bytes") / (1024.0 * 1024.0),
            ));
        }
        std::fs::remove_dir_all(&sub)?;
    }
    Ok(Figures {
        backend: b,
        ingest,
        open,
    })
}

/// `x ÷ b`, NaN when `b` is not positive.
fn ratio(x: f64, b: f64) -> f64 {
    if b > 0.0 { x / b } else { f64::NAN }
}

/// The append log's figures, which every backend's are divided by.
type Base = (Vec<(f64, f64)>, Vec<(f64, f64, f64, f64)>);

/// Prints `fig` beside `base` and adds its peak RSS and open time to the table.
fn report(keys: u64, fig: &Figures, base: &Base) {
    let name = fig.backend.as_str();
    println!("  {name}");
    for (i, (batch, value_len)) in CONFIGS.iter().enumerate() {
        let (r, rss) = fig.ingest.get(i).copied().unwrap_or((f64::NAN, f64::NAN));
        let b = base.0.get(i).map_or(f64::NAN, |x| x.0);
        println!(
            "    apply batch {batch:>4}, {value_len:>4} B values: {r:>10.0} updates/s  ({:.2}×); peak RSS {rss:.1} MiB",
            ratio(r, b)
        );
    }
    for (j, value_len) in [128, 1024].iter().enumerate() {
        let Some(&(open_s, scan_s, rss, live)) = fig.open.get(j) else {
            continue;
        };
        let base_open = base.1.get(j).map_or(f64::NAN, |x| x.0);
        println!(
            "    {value_len:>4} B fold: open {open_s:.3} s ({:.2}×), full scan {scan_s:.3} s, peak RSS open + scan {rss:.1} MiB for {live:.1} MiB of live keys and values ({:.2}×)",
            ratio(open_s, base_open),
            ratio(rss, live)
        );
        let (ingest_rss, ingest_rate) = {
            let i = if *value_len == 128 { 1 } else { 3 };
            let x = fig.ingest.get(i).copied().unwrap_or((f64::NAN, f64::NAN));
            (x.1, x.0)
        };
        let (target, rss_ratio) = if fig.backend == Backend::AppendLog {
            ("≤ 2", ratio(rss.max(ingest_rss), live))
        } else {
            ("≤ 256 MiB", ratio(rss.max(ingest_rss), live))
        };
        super::table::row(
            format!(
                "peak RSS, {name}, {keys} keys of {value_len} B (ingest at batch 1 000, {}/s; open + full scan)",
                super::table::rate(ingest_rate)
            ),
            format!(
                "{:.0} MiB (ingest {ingest_rss:.0}, open {rss:.0})",
                rss.max(ingest_rss)
            ),
            format!("live keys and values {live:.0} MiB"),
            rss_ratio,
            target,
        );
        super::table::row(
            format!("open the {keys}-key fold, {name}, {value_len} B values"),
            format!("{open_s:.3} s"),
            format!("append log {base_open:.3} s"),
            ratio(open_s, base_open),
            "",
        );
    }
}
