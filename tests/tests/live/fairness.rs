//! Queries and the fold take turns (`protocol::loop_gates`): a flood of queries over `--listen` —
//! queries that wait to their deadline, or cheap ones at full speed — beside a writer, and the fold
//! reaches the writer's last revision while the flood still runs.

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use foldhost_core::kv::KvWriter;
use foldhost_tests::{Harness, guest_wasm, run_command, terminate, wait_status};

/// The queries a flood sends, and what came back.
#[derive(Default)]
struct Tally {
    /// Answers of any kind (an HTTP status came back).
    answered: AtomicU64,
    /// Answers that were the guest's call cut at its deadline.
    deadline: AtomicU64,
}

/// `clients` tasks, each on its own connections, sending `request` to `/query` one after another
/// until `stop`.
fn flood(
    addr: &str,
    clients: usize,
    request: &'static [u8],
    stop: &Arc<AtomicBool>,
    tally: &Arc<Tally>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|_| {
            let (addr, stop, tally) = (addr.to_string(), stop.clone(), tally.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    if let Ok((_, body)) =
                        foldhost::serve::call(&addr, "POST", "/query", request).await
                    {
                        tally.answered.fetch_add(1, Ordering::SeqCst);
                        if String::from_utf8_lossy(&body).contains("deadline of") {
                            tally.deadline.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            })
        })
        .collect()
}

/// Starts a node running `guest` on a fresh bucket with `--listen`, floods it with `clients`
/// connections asking `request`, writes `writes` keys beside the flood, and waits — as a condition,
/// the flood still running — for the applied cursor to reach the writer's last revision. Returns
/// the flood's tally at that moment.
async fn fold_reaches_the_writer_under_a_query_flood(
    guest: &str,
    key_prefix: &str,
    clients: usize,
    request: &'static [u8],
    writes: u32,
) -> anyhow::Result<(u64, u64)> {
    let h = Harness::start().await?;
    let kv = h.bucket("flooded").await?;
    for i in 0..100u32 {
        kv.put(
            &format!("{key_prefix}{i}"),
            "{\"upstream\":\"10.0.0.1:80\"}".into(),
        )
        .await?;
    }
    let tmp = tempfile::tempdir()?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = run_command(&h, "flooded", &tmp.path().join("fold"), Some(&addr))
        .arg("--guest")
        .arg(guest_wasm(guest))
        .stderr(Stdio::null())
        .spawn()?;
    wait_status(&addr, |s| s.cursor == Some(100)).await?;

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let tasks = flood(&addr, clients, request, &stop, &tally);
    // The flood is under way (answered at least once) before the writer starts.
    let started = std::time::Instant::now();
    while tally.answered.load(Ordering::SeqCst) == 0 {
        anyhow::ensure!(
            started.elapsed() < std::time::Duration::from_secs(120),
            "the flood never got answers"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let mut last = 0;
    for i in 0..writes {
        last = kv
            .put(
                &format!("{key_prefix}w{i}"),
                format!("{{\"upstream\":\"10.1.{}.{}:80\"}}", i / 250, i % 250).into(),
            )
            .await?
            .as_u64()
            .unwrap_or(0);
    }
    let answered_before = tally.answered.load(Ordering::SeqCst);
    // The condition: the fold holds the writer's last revision while every flood task still runs.
    let reached = wait_status(&addr, |s| s.cursor == Some(last)).await;
    let flooding = tasks.iter().all(|t| !t.is_finished());
    let answered = tally.answered.load(Ordering::SeqCst);
    let deadline = tally.deadline.load(Ordering::SeqCst);
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await?;
    }
    let s = reached?;
    terminate(&mut host)?;
    assert!(flooding, "a flood task ended before the fold caught up");
    assert_eq!(s.state, "running", "{s:?}");
    assert!(
        answered > answered_before,
        "queries were still answered while the fold caught up ({answered_before} then {answered})"
    );
    Ok((answered, deadline))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_queries_waiting_to_their_deadline_on_8_connections_never_stops_the_fold()
-> anyhow::Result<()> {
    let (_, deadline) =
        fold_reaches_the_writer_under_a_query_flood("hostile_sleep", "k", 8, b"sleep", 3_000)
            .await?;
    assert!(deadline > 0, "the flood's queries ran to their deadline");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_queries_waiting_to_their_deadline_on_64_connections_never_stops_the_fold()
-> anyhow::Result<()> {
    let (_, deadline) =
        fold_reaches_the_writer_under_a_query_flood("hostile_sleep", "k", 64, b"sleep", 3_000)
            .await?;
    assert!(deadline > 0, "the flood's queries ran to their deadline");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cheap_queries_at_full_speed_on_64_connections_never_stop_the_fold() -> anyhow::Result<()> {
    // The router answers a host from memory: each query takes microseconds.
    let (answered, _) =
        fold_reaches_the_writer_under_a_query_flood("router", "route.h", 64, b"h1", 3_000).await?;
    assert!(answered > 64, "{answered}");
    Ok(())
}
