//! The router guest in each language the project supports (Rust, C, JavaScript, Python): the
//! component's size, its first compile, a load from the compiled-component cache (a second engine,
//! the same cache directory), and the fold of one bucket of KEYS routes with it against the native
//! applier folding the same bucket in the same run (append log, batch 100, median of RUNS, the two
//! sides alternating).

use std::sync::Arc;

use foldhost_core::kv::WatchScope;
use foldhost_core::snapshot::{AppendLogOptions, AppendLogSnapshot};
use foldhost_core::view::SharedStore;
use foldhost_fold::applied::{Apply, CountingApply};
use foldhost_guest::guest::cache::Source;
use foldhost_guest::guest::{EngineOptions, GuestEngine};
use foldhost_nats::NatsConnection;

use super::table::{rate, row};
use super::{fold_rate, load_guest, median, read_guest, seed_routes, unlimited};

/// The routers, by the file name `guests/build.sh` gives them.
const ROUTERS: [&str; 4] = ["router", "router_c", "router_js", "router_py"];

/// Runs it and adds its rows to the table.
pub async fn run(conn: &NatsConnection, keys: u64, runs: usize) -> anyhow::Result<()> {
    let kv = conn.bucket("languages", &unlimited()).await?;
    seed_routes(&kv, keys).await?;
    for name in ROUTERS {
        let bytes = read_guest(name)?;
        let cache = tempfile::tempdir()?;
        let options = || EngineOptions {
            cache_dir: Some(cache.path().to_path_buf()),
            random_seed: [0; 32],
        };
        let first = GuestEngine::with_options(options())?;
        let (_, compiled) = first.prepare_traced(name, &bytes)?;
        anyhow::ensure!(compiled.source == Source::Compiled, "{name}: {compiled:?}");
        let engine = GuestEngine::with_options(options())?;
        let (_, loaded) = engine.prepare_traced(name, &bytes)?;
        anyhow::ensure!(loaded.source == Source::Disk, "{name}: {loaded:?}");
        let (mut native, mut guest) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            for side in ["native", "guest"] {
                let dir = tempfile::tempdir()?;
                let (store, _) = AppendLogSnapshot::open(dir.path(), AppendLogOptions::default())?;
                let store = SharedStore::new(store);
                let mut apply: Box<dyn Apply> = if side == "native" {
                    Box::new(CountingApply::default())
                } else {
                    let mut g = load_guest(&engine, name, &bytes, Arc::new(store.clone())).await?;
                    g.hydrate().await?;
                    Box::new(g)
                };
                let r = fold_rate(&kv, apply.as_mut(), 100, WatchScope::All, store).await?;
                if side == "native" {
                    native.push(r)
                } else {
                    guest.push(r)
                }
            }
        }
        let (n, g) = (median(native), median(guest));
        let mb = bytes.len() as f64 / 1e6;
        let (compile_ms, load_ms) = (
            compiled.elapsed.as_secs_f64() * 1e3,
            loaded.elapsed.as_secs_f64() * 1e3,
        );
        println!(
            "{name}: {mb:.2} MB; first compile {compile_ms:.0} ms; cached load {load_ms:.1} ms; ingest {g:.0}/s vs native {n:.0}/s ({:.2})",
            g / n
        );
        row(
            format!("{name}: load from the compiled cache ÷ first compile ({mb:.2} MB component)"),
            format!("{load_ms:.1} ms"),
            format!("first compile {compile_ms:.0} ms"),
            load_ms / compile_ms,
            "",
        );
        row(
            format!("{name}: ingest {keys} routes, append log, batch 100 ÷ native apply"),
            format!("{}/s", rate(g)),
            format!("native apply {}/s", rate(n)),
            g / n,
            "",
        );
    }
    Ok(())
}
