//! `foldhost demo`: everything local, end to end — a nats-server, a bucket of routes, the router
//! guest, a fold that catches up, then a live run that resumes from its cursor with a delta and
//! answers queries. It builds its [`NodeConfig`] from the defaults, as any embedder would.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};

use crate::node::{ListenConfig, Node, NodeConfig};
use foldhost_core::bucket::{BucketConfig, ConnectOptions};
use foldhost_core::kv::KvWriter;
use foldhost_core::status::StatusReport;
use foldhost_nats::NatsConnection;

use super::{DemoArgs, find_in_checkout};

/// How long the demo waits for its live run to apply the delta.
const DEMO_WAIT: Duration = Duration::from_secs(120);

/// Where the demo looks for the router guest when `--guest` is not given.
fn find_router_guest() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("FOLDHOST_GUESTS_DIR") {
        let p = Path::new(&dir).join("router.wasm");
        if p.is_file() {
            return Some(p);
        }
    }
    find_in_checkout(Path::new("guests/target/wasm32-wasip2/release/router.wasm"))
}

pub(super) async fn cmd_demo(a: DemoArgs) -> anyhow::Result<()> {
    use foldhost_core::bucket::Connection;
    use foldhost_localnats::LocalNats;
    println!(
        "== foldhost demo: a local nats-server, a bucket of routes, the router guest, a fold =="
    );
    let guest = demo_guest(&a)?;
    let server = LocalNats::start()?;
    println!("nats-server on {}", server.url());
    let work = tempfile::Builder::new()
        .prefix("foldhost-demo-")
        .tempdir()?;
    let store_dir = work.path().join("store");
    let conn = NatsConnection::open(ConnectOptions::new(server.url())).await?;
    let kv = conn
        .open_bucket(
            "routes",
            &BucketConfig {
                max_bytes: None,
                ..BucketConfig::default()
            },
        )
        .await?;
    let w = kv.writer();
    seed_routes(w.as_ref(), a.routes).await?;
    let port = foldhost_localnats::reserved_port()?;
    let listen = format!("127.0.0.1:{port}");
    let mut cfg = NodeConfig {
        guest: Some(guest.clone()),
        catch_up: true,
        ..NodeConfig::new(server.url(), "routes", store_dir.clone())
    };
    let (_keep, never) = tokio::sync::watch::channel(false);
    let first = Node::run(cfg.clone(), never.clone()).await?;
    println!(
        "first run ({}): folded to cursor {} ({} updates delivered: the state-sync re-list)",
        guest.display(),
        first.cursor,
        first.delivered
    );

    // Second run: live, serving queries, resuming from the cursor.
    cfg.catch_up = false;
    cfg.listen = Some(ListenConfig::new(listen.clone()));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let host = tokio::spawn(Node::run(cfg, stop_rx));
    write_delta(w.as_ref()).await?;
    let target = first.cursor.revision_or_zero() + 11;
    let status = match applied_status(&listen, target, &host).await {
        Some(status) => status,
        None => {
            let _ = stop_tx.send(true);
            bail!(
                "demo: the live run did not apply the delta through revision {target} within {DEMO_WAIT:?}"
            );
        }
    };
    println!("\n$ curl -s http://{listen}/status");
    println!("{status}");
    show_queries(&listen).await?;
    let _ = stop_tx.send(true);
    let second = host.await.context("host task")??;
    println!(
        "\nsecond run resumed from its cursor: {} updates delivered (a delta, not a replay), stopped at cursor {}",
        second.delivered, second.cursor
    );
    conn.shutdown().await;
    if second.delivered != 11 || second.cursor.revision_or_zero() != target {
        bail!(
            "demo: expected the resume to deliver exactly 11 updates through {target}, got {} through {}",
            second.delivered,
            second.cursor
        );
    }
    println!("\ndemo ok");
    Ok(())
}

/// The router guest: `--guest`, or the one built in the checkout.
fn demo_guest(a: &DemoArgs) -> anyhow::Result<PathBuf> {
    match a.guest.clone().or_else(find_router_guest) {
        Some(g) => Ok(g),
        None => bail!(
            "router.wasm not found: build the guests with `guests/build.sh` (`make demo` does), or pass --guest"
        ),
    }
}

/// `routes` routes, `route.hostNNNNN.example`, each to its upstream.
async fn seed_routes(w: &dyn KvWriter, routes: u32) -> anyhow::Result<()> {
    for i in 0..routes {
        w.put(
            &format!("route.host{i:05}.example"),
            format!("{{\"upstream\":\"10.0.{}.{}:8080\"}}", i / 250, i % 250).into(),
        )
        .await?;
    }
    println!("seeded {routes} routes into bucket 'routes'");
    Ok(())
}

/// The delta the live run applies: ten new routes and one deleted (eleven revisions).
async fn write_delta(w: &dyn KvWriter) -> anyhow::Result<()> {
    for i in 0..10u32 {
        w.put(
            &format!("route.new{i}.example"),
            "{\"upstream\":\"10.9.9.9:8080\"}".into(),
        )
        .await?;
    }
    w.delete("route.host00000.example").await?;
    Ok(())
}

/// `/status` once the live run has applied through `target` (a slow machine only takes longer);
/// `None` when the run ended or [`DEMO_WAIT`] passed first: a run that never gets there is a
/// failure, said as one.
async fn applied_status<T>(
    listen: &str,
    target: u64,
    host: &tokio::task::JoinHandle<T>,
) -> Option<String> {
    let deadline = tokio::time::Instant::now() + DEMO_WAIT;
    loop {
        if let Ok((200, body)) = crate::serve::call(listen, "GET", "/status", b"").await {
            let report: StatusReport = serde_json::from_slice(&body).unwrap_or_default();
            if report.applied_through >= target {
                return Some(String::from_utf8_lossy(&body).trim_end().to_string());
            }
        }
        if host.is_finished() || tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Three lookups, as `curl` would ask them: a seeded route, a new one, the deleted one.
async fn show_queries(listen: &str) -> anyhow::Result<()> {
    for host_name in ["host00042.example", "new7.example", "host00000.example"] {
        let (code, body) =
            crate::serve::call(listen, "POST", "/query", host_name.as_bytes()).await?;
        println!(
            "\n$ curl -s -d {host_name} http://{listen}/query\n{code} {}",
            String::from_utf8_lossy(&body).trim_end()
        );
    }
    Ok(())
}
