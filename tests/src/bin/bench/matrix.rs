//! The ingest matrix: one bucket of KEYS routes folded by every applier (native, the router guest,
//! the kvstore guest) into every compiled-in backend (append log, fjall, RocksDB), each against the
//! raw async-nats drain of the same stream and against `beyond-slipstream` 0.8.6 folding the same
//! bucket with a native closure (the `slipfold` tool, `bench/slipfold/`, built into
//! `target/slipfold` by `make slipfold`; never a dependency of the project). Runs alternate between
//! the sides; every figure is the median of RUNS.

use std::path::PathBuf;
use std::sync::Arc;

use foldhost_core::kv::WatchScope;
use foldhost_core::storedir::{AnyStore, Backend};
use foldhost_core::view::SharedStore;
use foldhost_fold::applied::{Apply, CountingApply};
use foldhost_guest::guest::GuestEngine;
use foldhost_nats::{NatsConnection, NatsKv};

use super::table::{rate, row};
use super::{fold_rate, load_guest, median, raw_drain, read_guest, seed_routes, unlimited};

/// The `slipfold` binary: `FOLDHOST_SLIPFOLD`, else `target/slipfold/release/slipfold`.
fn slipfold() -> PathBuf {
    std::env::var("FOLDHOST_SLIPFOLD").map_or_else(
        |_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/slipfold/release/slipfold"),
        PathBuf::from,
    )
}

/// Folds `bucket` through `last` with slipstream's `watch_applied` (batch 100) in a child process;
/// returns its rate.
fn slipstream_fold(url: &str, bucket: &str, last: u64) -> anyhow::Result<f64> {
    let bin = slipfold();
    anyhow::ensure!(
        bin.exists(),
        "{}: not built (run `make slipfold`)",
        bin.display()
    );
    let dir = tempfile::tempdir()?;
    let out = std::process::Command::new(&bin)
        .args(["fold", "--nats", url, "--bucket", bucket, "--store"])
        .arg(dir.path())
        .args(["--until", &last.to_string(), "--batch", "100"])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "slipfold failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let applied: u64 = field(&text, "applied=").unwrap_or(0.0) as u64;
    anyhow::ensure!(applied == last, "slipfold applied {applied} of {last}");
    field(&text, "rate=").ok_or_else(|| anyhow::anyhow!("slipfold printed no rate: {text}"))
}

/// The number after `name` on the last line of `text`.
fn field(text: &str, name: &str) -> Option<f64> {
    let line = text.lines().last()?;
    let at = line.find(name)? + name.len();
    line[at..].split_whitespace().next()?.parse().ok()
}

fn empty(backend: Backend) -> anyhow::Result<(tempfile::TempDir, SharedStore<AnyStore>)> {
    let dir = tempfile::tempdir()?;
    let (store, _) = AnyStore::open(&dir.path().join("fold"), backend)?;
    Ok((dir, SharedStore::new(store)))
}

/// Runs the matrix and adds its rows to the table.
pub async fn run(conn: &NatsConnection, url: &str, keys: u64, runs: usize) -> anyhow::Result<()> {
    let kv = conn.bucket("matrix", &unlimited()).await?;
    seed_routes(&kv, keys).await?;
    let engine = GuestEngine::new()?;
    let router = read_guest("router")?;
    let kvstore = read_guest("kvstore")?;
    let backends: Vec<Backend> = [Backend::AppendLog, Backend::Fjall, Backend::RocksDb]
        .into_iter()
        .filter(Backend::is_compiled)
        .collect();
    let appliers = ["native", "router", "kvstore"];
    let mut drain = Vec::new();
    let mut slip = Vec::new();
    let mut folds: Vec<Vec<f64>> = vec![Vec::new(); backends.len() * appliers.len()];
    // `FOLDHOST_BENCH_ONLY=BACKEND/APPLIER` (e.g. `append-log/router`): that fold alone, beside
    // the drain, for a profile; the table then has only its rows (slipstream not run).
    let only = std::env::var("FOLDHOST_BENCH_ONLY").ok();
    let wanted = |b: Backend, a: &str| {
        only.as_deref()
            .is_none_or(|o| o == format!("{}/{a}", b.as_str()))
    };
    for run in 0..runs {
        drain.push(raw_drain(conn, &kv, keys).await?);
        slip.push(if only.is_some() {
            f64::NAN
        } else {
            slipstream_fold(url, "matrix", keys)?
        });
        for (b, backend) in backends.iter().enumerate() {
            for (a, applier) in appliers.iter().enumerate() {
                if !wanted(*backend, applier) {
                    continue;
                }
                let r =
                    one_fold(&kv, &engine, (&router, &kvstore), *backend, applier, keys).await?;
                folds[b * appliers.len() + a].push(r);
            }
        }
        println!(
            "matrix run {run}: drain {:.0}/s, slipstream {:.0}/s",
            drain[run], slip[run]
        );
    }
    let (d, s) = (median(drain), median(slip));
    for (b, backend) in backends.iter().enumerate() {
        for (a, applier) in appliers.iter().enumerate() {
            if !wanted(*backend, applier) {
                continue;
            }
            let f = median(folds[b * appliers.len() + a].clone());
            let targeted = *applier == "router" && *backend == Backend::AppendLog;
            let what = format!(
                "ingest {keys} routes, {applier} apply, {}, batch 100",
                backend.as_str()
            );
            println!(
                "{what}: {f:.0}/s; ÷ raw drain {:.2}; ÷ slipstream {:.2}",
                f / d,
                f / s
            );
            row(
                format!("{what} ÷ raw drain"),
                format!("{}/s", rate(f)),
                format!("raw async-nats drain {}/s", rate(d)),
                f / d,
                if targeted { "≥ 0.8" } else { "" },
            );
            row(
                format!("{what} ÷ slipstream"),
                format!("{}/s", rate(f)),
                format!("beyond-slipstream 0.8.6 native fold {}/s", rate(s)),
                f / s,
                if targeted { "≥ 2.5" } else { "" },
            );
        }
    }
    Ok(())
}

/// One fold of the bucket's `keys` routes into an empty store of `backend`, through `applier`
/// (`native`: a counting apply; `router` or `kvstore`: that guest, from `guests`); updates/s.
async fn one_fold(
    kv: &Arc<NatsKv>,
    engine: &Arc<GuestEngine>,
    (router, kvstore): (&[u8], &[u8]),
    backend: Backend,
    applier: &str,
    keys: u64,
) -> anyhow::Result<f64> {
    let (_dir, store) = empty(backend)?;
    let mut apply: Box<dyn Apply> = match applier {
        "native" => Box::new(CountingApply::default()),
        name => {
            let bytes = if name == "router" { router } else { kvstore };
            let mut g = load_guest(engine, name, bytes, Arc::new(store.clone())).await?;
            g.hydrate().await?;
            Box::new(g)
        }
    };
    let r = fold_rate(kv, apply.as_mut(), 100, WatchScope::All, store.clone()).await?;
    anyhow::ensure!(
        foldhost_core::snapshot::bucket_len(&*store.read()?)? == keys,
        "{applier} fold into {} incomplete",
        backend.as_str()
    );
    Ok(r)
}
