//! Ingest benchmark: on one bucket of 100 000 keys in a local nats-server, the raw async-nats drain
//! of the bucket's stream (ordered push consumer, same filter and deliver policy as the fold) against
//! the fold's ingest (`watch_applied`, native counting apply, append log on disk). Runs alternate,
//! each figure is the median of the runs, and the ratio is printed.
//!
//! `cargo run --release -p foldhost-tests --bin foldhost-bench -- [KEYS] [RUNS]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer;
use foldhost::applied::{BatchConfig, CountingApply, FoldStatus, WatchOptions, watch_applied};
use foldhost::kv::WatchScope;
use foldhost::localnats::LocalNats;
use foldhost::nats::NatsConnection;
use foldhost::snapshot::{AppendLogOptions, AppendLogSnapshot, SharedStore, SnapshotStore};
use foldhost::stores::{ConnectOptions, StoreConfig};
use futures::StreamExt;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let keys: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let runs: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5);
    let server = LocalNats::start()?;
    let conn = NatsConnection::open(ConnectOptions::new(server.url())).await?;
    let kv = conn
        .bucket(
            "bench",
            &StoreConfig {
                max_bytes: None,
                ..StoreConfig::default()
            },
        )
        .await?;
    let js = kv.jetstream().clone();
    let value = vec![b'v'; 100];
    let t = Instant::now();
    let mut acks = Vec::with_capacity(1000);
    for i in 0..keys {
        acks.push(
            js.publish(format!("$KV.bench.key.{i:026}"), value.clone().into())
                .await?,
        );
        if acks.len() == 1000 {
            for a in acks.drain(..) {
                a.await?;
            }
        }
    }
    for a in acks {
        a.await?;
    }
    println!(
        "seeded {keys} keys (32 B keys, 100 B values) in {:.2}s",
        t.elapsed().as_secs_f64()
    );

    let mut raw = Vec::new();
    let mut fold = Vec::new();
    for run in 0..runs {
        // Raw drain: the same ordered push consumer the fold's watch uses, counting to level.
        let stream = js.get_stream("KV_bench").await?;
        let t = Instant::now();
        let c = stream
            .create_consumer(consumer::push::OrderedConfig {
                deliver_subject: js_inbox(&conn).await?,
                filter_subjects: vec!["$KV.bench.>".into()],
                deliver_policy: consumer::DeliverPolicy::LastPerSubject,
                ..Default::default()
            })
            .await?;
        let mut msgs = c.messages().await?;
        let mut n = 0u64;
        while let Some(m) = msgs.next().await {
            let m = m?;
            n += 1;
            let pending = m
                .message
                .reply
                .as_ref()
                .and_then(|r| foldhost::protocol::parse_ack_subject(r.as_str()))
                .map(|a| a.pending);
            if pending == Some(0) {
                break;
            }
        }
        let raw_rate = n as f64 / t.elapsed().as_secs_f64();
        drop(msgs);

        // Fold ingest: state-sync re-list into an empty append log, to level.
        let dir = tempfile::tempdir()?;
        let (store, _) = AppendLogSnapshot::open(dir.path(), AppendLogOptions::default())?;
        let mut apply = CountingApply::default();
        let t = Instant::now();
        let store = SharedStore::new(store);
        watch_applied(
            kv.clone(),
            store.clone(),
            &mut apply,
            WatchOptions {
                scope: WatchScope::All,
                batch: BatchConfig::default(),
                catch_up: true,
            },
            Arc::new(FoldStatus::default()),
            None,
            std::future::pending(),
        )
        .await?;
        let fold_rate = apply.parsed as f64 / t.elapsed().as_secs_f64();
        anyhow::ensure!(store.read()?.len()? == keys, "fold incomplete");
        anyhow::ensure!(n == keys, "raw drain incomplete: {n}");
        println!(
            "run {run}: raw drain {raw_rate:>9.0} upd/s   fold ingest {fold_rate:>9.0} upd/s   ratio {:.2}",
            fold_rate / raw_rate
        );
        raw.push(raw_rate);
        fold.push(fold_rate);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let ratios: Vec<f64> = raw.iter().zip(&fold).map(|(r, f)| f / r).collect();
    let (r, f) = (median(raw), median(fold));
    println!(
        "median of {runs}: raw async-nats drain {r:.0} updates/s; fold ingest (native apply, append log) {f:.0} updates/s; ratio of medians {:.2}, median of per-run ratios {:.2} (target >= 0.80)",
        f / r,
        median(ratios)
    );
    Ok(())
}

async fn js_inbox(conn: &NatsConnection) -> anyhow::Result<String> {
    Ok(conn.client().await?.new_inbox())
}
