//! `slipfold fold --nats URL --bucket B --store DIR --until REVISION [--batch N]`: folds bucket B
//! with beyond-slipstream's own `watch_applied` (its append log, a native closure counting what it
//! applies) until its cursor reaches REVISION, then prints `applied=N secs=S rate=R` on one line.
//! `foldhost-bench` runs it beside foldhost on the same bucket (tests/src/bin/bench/matrix.rs).

use std::sync::Arc;
use std::time::Instant;

use slipstream::{
    AppendLogSnapshot, BatchConfig, Connection, ExpiryRepair, KvUpdate, NatsConnection,
    NatsConnectionConfig, SnapshotStore, WatchCursor, WatchScope, watch_applied,
};

/// The value after `--name` in `args`.
fn flag(args: &[String], name: &str) -> Result<String, String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .ok_or_else(|| format!("{name} is missing"))
}

/// The revision a cursor ends with (big-endian, its last eight bytes), if it has one.
fn revision(cursor: &WatchCursor) -> Option<u64> {
    let bytes = cursor.to_bytes();
    let tail: [u8; 8] = bytes.get(bytes.len().checked_sub(8)?..)?.try_into().ok()?;
    Some(u64::from_be_bytes(tail))
}

async fn fold(args: &[String]) -> Result<(), String> {
    let url = flag(args, "--nats")?;
    let bucket = flag(args, "--bucket")?;
    let dir = std::path::PathBuf::from(flag(args, "--store")?);
    let until: u64 = flag(args, "--until")?
        .parse()
        .map_err(|e| format!("--until: {e}"))?;
    let max: usize = match flag(args, "--batch") {
        Ok(n) => n.parse().map_err(|e| format!("--batch: {e}"))?,
        Err(_) => 100,
    };
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (cursor, snapshot) =
        AppendLogSnapshot::load(&dir.join("fold.log")).map_err(|e| format!("load: {e}"))?;
    let conn = NatsConnection::new(NatsConnectionConfig {
        url,
        creds: None,
        creds_file: None,
    });
    conn.connect().await.map_err(|e| format!("connect: {e}"))?;
    let kv = conn
        .store(&bucket)
        .await
        .map_err(|e| format!("{bucket}: {e}"))?;
    let watcher = kv
        .watcher()
        .ok_or_else(|| format!("{bucket}: no watcher"))?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    let mut applied = 0u64;
    let started = Instant::now();
    let resume = (!cursor.is_none()).then_some(cursor);
    watch_applied(
        watcher,
        WatchScope::All,
        resume,
        ExpiryRepair::<AppendLogSnapshot>::None,
        Some(snapshot),
        None,
        BatchConfig {
            max,
            ..BatchConfig::default()
        },
        |u: &KvUpdate| Some(u.clone()),
        |batch: Vec<KvUpdate>| applied += batch.len() as u64,
        move |c: WatchCursor| {
            if revision(&c).is_some_and(|r| r >= until) {
                let _ = stop_tx.send(true);
            }
        },
        stop_rx,
    )
    .await
    .map_err(|e| format!("fold: {e}"))?;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "applied={applied} secs={secs:.3} rate={:.0}",
        applied as f64 / secs
    );
    Ok(())
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let r = match args.get(1).map(String::as_str) {
        Some("fold") => fold(&args).await,
        _ => Err(
            "usage: slipfold fold --nats URL --bucket B --store DIR --until REVISION [--batch N]"
                .into(),
        ),
    };
    if let Err(e) = r {
        eprintln!("slipfold: {e}");
        std::process::exit(1);
    }
}
