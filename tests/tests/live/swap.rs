//! Hot swap against a real nats-server and the real binary: v1 → v2 → v1 → v2 while a writer keeps
//! writing, with nothing lost or applied twice; and swaps the host must refuse while the old guest
//! keeps serving.

use std::process::{Child, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use foldhost_core::kv::KvWriter;
use foldhost_tests::{
    Harness, bucket_contents, dump_store, first_difference, foldhost, guest_wasm, hostile_wat,
    run_command, spawn_logged, terminate, wait_status, wait_until,
};
use rand::{Rng, SeedableRng};

fn start_host(
    h: &Harness,
    bucket: &str,
    store: &std::path::Path,
    addr: &str,
    token: Option<&str>,
) -> anyhow::Result<Child> {
    start_host_holding(h, bucket, store, addr, token, "kvstore", None)
}

/// The host running `guest`; with `hold`, its first swap's hydration is held after its first
/// chunk (the `swap.hydrating` hold point) until `hold.release` exists.
fn start_host_holding(
    h: &Harness,
    bucket: &str,
    store: &std::path::Path,
    addr: &str,
    token: Option<&str>,
    guest: &str,
    hold: Option<&std::path::Path>,
) -> anyhow::Result<Child> {
    let mut c = run_command(h, bucket, store, Some(addr));
    c.arg("--guest")
        .arg(guest_wasm(guest))
        .stderr(Stdio::null());
    if let Some(t) = token {
        c.env("FOLDHOST_ADMIN_TOKEN", t);
    }
    if let Some(hold) = hold {
        c.env(
            foldhost_core::crashpoint::HOLD_ENV,
            format!(
                "{}:{}",
                foldhost_core::crashpoint::SWAP_HYDRATING,
                hold.display()
            ),
        );
    }
    Ok(c.spawn()?)
}

/// Swaps to `guest` with the first swap's hydration held (see [`start_host_holding`]): waits until
/// it is held, then until the fold committed `batches` more batches beside it, then releases it.
async fn swap_overlapping(
    addr: &str,
    guest: &std::path::Path,
    hold: &std::path::Path,
    batches: u64,
) -> anyhow::Result<(bool, String, u64)> {
    let swapping = {
        let (addr, guest) = (addr.to_string(), guest.to_path_buf());
        tokio::task::spawn_blocking(move || swap(&addr, &guest, None))
    };
    let reached = hold.with_extension("reached");
    wait_until("the swap's hydration to be held", || reached.exists()).await?;
    let before = wait_status(addr, |_| true).await?;
    let during = wait_status(addr, |s| s.batches >= before.batches + batches).await?;
    assert_eq!(
        during.guest, before.guest,
        "the old version folds while the new one hydrates"
    );
    std::fs::write(hold.with_extension("release"), b"")?;
    let (ok, text) = swapping.await??;
    Ok((ok, text, during.batches - before.batches))
}

fn swap(
    addr: &str,
    guest: &std::path::Path,
    token: Option<&str>,
) -> anyhow::Result<(bool, String)> {
    let mut c = foldhost();
    c.args(["swap", "--listen", addr, "--guest"]).arg(guest);
    c.env_remove("FOLDHOST_ADMIN_TOKEN");
    if let Some(t) = token {
        c.env("FOLDHOST_ADMIN_TOKEN", t);
    }
    let out = c.output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.success(), text))
}

/// Asks the host at `addr` (running `kvstore-v2`) for every key `k.0000`… below `keys`: each live
/// key answers `v2:` and its value in the bucket, each deleted one 422. Returns the bucket.
async fn v2_serves_the_bucket(
    addr: &str,
    kv: &foldhost_nats::NatsKv,
    keys: u32,
) -> anyhow::Result<foldhost_tests::Contents> {
    let want = bucket_contents(kv).await?;
    for (key, (value, _)) in &want {
        let (code, body) = foldhost::serve::call(addr, "POST", "/query", key.as_bytes()).await?;
        assert_eq!(code, 200, "{key}: {}", String::from_utf8_lossy(&body));
        let mut expect = b"v2:".to_vec();
        expect.extend_from_slice(value);
        assert_eq!(body, expect, "{key}: v2 answers from the whole fold");
    }
    for i in 0..keys {
        let key = format!("k.{i:04}");
        if !want.contains_key(&key) {
            let (code, _) = foldhost::serve::call(addr, "POST", "/query", key.as_bytes()).await?;
            assert_eq!(code, 422, "{key} was deleted");
        }
    }
    Ok(want)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swaps_under_load_lose_nothing_and_apply_nothing_twice() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("swap").await?;
    for i in 0..2000 {
        kv.put(&format!("k.{i:04}"), format!("seed{i}").into())
            .await?;
    }
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let hold = tmp.path().join("hold");
    let mut host = start_host_holding(&h, "swap", &store, &addr, None, "kvstore", Some(&hold))?;
    wait_status(&addr, |s| s.applied_through >= 2000).await?;

    // The writer: pipelined puts over 5 000 keys, with deletes, until stopped; it counts what
    // the server acknowledged, and the swaps are placed by that count, not by a clock.
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicU64::new(0));
    let writer = spawn_pipelined_writer(&kv, &stop, &acked);
    let reports = three_swaps_placed_by_acked_writes(&addr, &hold, &acked).await?;
    // More writes after the last swap, then the writer stops.
    let target = acked.load(Ordering::Relaxed) + 2000;
    wait_until("2 000 writes after the last swap", || {
        acked.load(Ordering::Relaxed) >= target
    })
    .await?;
    stop.store(true, Ordering::Relaxed);
    let rate = writer.await??;
    eprintln!("writer: {rate:.0} updates/s; swaps: {reports:?}");
    assert!(
        reports
            .iter()
            .all(|r| r["hydrated_entries"].as_u64() >= Some(1000)),
        "each new instance was rebuilt from the fold: {reports:?}"
    );

    let last = kv.positions().await?.last_sequence;
    let s = wait_status(&addr, |s| s.applied_through >= last || s.state == "failed").await?;
    assert_eq!(
        s.state, "running",
        "v2 refuses updates applied twice: {s:?}"
    );
    assert_eq!(s.guest.as_deref(), Some("kvstore@0.2.0"));
    let want = v2_serves_the_bucket(&addr, &kv, 5000).await?;
    terminate(&mut host)?;
    assert_eq!(first_difference(&want, &dump_store(&store)?), None);
    Ok(())
}

/// The writer: pipelined puts over 5 000 keys, with deletes, until `stop`; it counts what the
/// server acknowledged into `acked`, and returns its rate.
fn spawn_pipelined_writer(
    kv: &Arc<foldhost_nats::NatsKv>,
    stop: &Arc<AtomicBool>,
    acked: &Arc<AtomicU64>,
) -> tokio::task::JoinHandle<anyhow::Result<f64>> {
    let (kv, stop, acked) = (kv.clone(), stop.clone(), acked.clone());
    tokio::spawn(async move {
        let js = kv.jetstream().clone();
        let mut rng = rand::rngs::StdRng::seed_from_u64(42);
        let t = Instant::now();
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let mut acks = Vec::with_capacity(200);
            for _ in 0..200 {
                let k = rng.random_range(0..5000);
                acks.push(
                    js.publish(format!("$KV.swap.k.{k:04}"), format!("w{n}").into())
                        .await?,
                );
                n += 1;
            }
            for a in acks {
                a.await?;
            }
            let k = rng.random_range(0..5000);
            kv.delete(&format!("k.{k:04}")).await?;
            n += 1;
            acked.store(n, Ordering::Relaxed);
        }
        anyhow::Ok(n as f64 / t.elapsed().as_secs_f64())
    })
}

/// Swaps to v2, v1 and v2 again, each after another 2 000 acknowledged writes (the first with its
/// hydration held at `hold` while the fold commits beside it); returns the swaps' reports.
async fn three_swaps_placed_by_acked_writes(
    addr: &str,
    hold: &std::path::Path,
    acked: &AtomicU64,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let v1 = guest_wasm("kvstore");
    let v2 = guest_wasm("kvstore_v2");
    let mut reports = Vec::new();
    for (i, (guest, to)) in [
        (&v2, "kvstore@0.2.0"),
        (&v1, "kvstore@0.1.0"),
        (&v2, "kvstore@0.2.0"),
    ]
    .into_iter()
    .enumerate()
    {
        // Each swap lands after another 2 000 acknowledged writes, with the writer still going.
        let target = 2000 * (i as u64 + 1);
        wait_until("2 000 more acknowledged writes", || {
            acked.load(Ordering::Relaxed) >= target
        })
        .await?;
        let (ok, text) = if i == 0 {
            // The first swap's hydration is held after its first chunk of 1 000 entries while the
            // fold commits at least 50 batches beside it; the rest of it reads the fold at the
            // swap's cursor all the same.
            let (ok, text, overlapped) = swap_overlapping(addr, guest, hold, 50).await?;
            assert!(overlapped >= 50);
            (ok, text)
        } else {
            swap(addr, guest, None)?
        };
        assert!(ok, "swap to {to} failed: {text}");
        let report: serde_json::Value = serde_json::from_str(text.trim())?;
        assert_eq!(report["to"], to, "{text}");
        if i == 0 {
            assert!(
                report["caught_up"].as_u64() > Some(0),
                "keys changed during the hydration were caught up at the cut-over: {text}"
            );
        }
        reports.push(report);
    }
    Ok(reports)
}

/// A swap whose new version traps halfway through its hydration — after the fold committed 50
/// batches beside it — is refused; the running version (kvstore v2, which fails on any update
/// applied twice) never noticed: it keeps serving every key, and applied nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swap_refused_mid_hydration_leaves_the_old_version_serving_and_applies_nothing_twice()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("midway").await?;
    for i in 0..1500 {
        kv.put(&format!("k.{i:04}"), format!("seed{i}").into())
            .await?;
    }
    // Sorted after every k.*: the trap guest reaches it in its second hydration chunk.
    kv.put("trap.me", "the trap guest dies hydrating this".into())
        .await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let hold = tmp.path().join("hold");
    let mut host =
        start_host_holding(&h, "midway", &store, &addr, None, "kvstore_v2", Some(&hold))?;
    wait_status(&addr, |s| s.applied_through >= 1501).await?;

    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (kv, stop) = (kv.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                kv.put(&format!("k.{:04}", n % 2000), format!("w{n}").into())
                    .await?;
                if n.is_multiple_of(7) {
                    kv.delete(&format!("k.{:04}", (n * 13) % 2000)).await?;
                }
                n += 1;
            }
            anyhow::Ok(n)
        })
    };
    let (ok, text, overlapped) =
        swap_overlapping(&addr, &guest_wasm("hostile_trap"), &hold, 50).await?;
    assert!(!ok, "the trapping version must be refused: {text}");
    assert!(text.contains("hydration failed"), "{text}");
    assert!(overlapped >= 50);
    stop.store(true, Ordering::Relaxed);
    let writes = writer.await??;
    assert!(writes > 0);

    let last = kv.positions().await?.last_sequence;
    let s = wait_status(&addr, |s| s.applied_through >= last || s.state == "failed").await?;
    assert_eq!(
        s.state, "running",
        "v2 refuses updates applied twice: {s:?}"
    );
    assert_eq!(s.guest.as_deref(), Some("kvstore@0.2.0"));
    let want = v2_serves_the_bucket(&addr, &kv, 2000).await?;
    terminate(&mut host)?;
    assert_eq!(first_difference(&want, &dump_store(&store)?), None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_swaps_leave_the_old_guest_serving() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("refuse").await?;
    kv.put("route.a", "{\"upstream\":\"1\"}".into()).await?;
    kv.put("trap.me", "the trap guest dies hydrating this".into())
        .await?;
    let tmp = tempfile::tempdir()?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let token = "s3cret";
    let mut host = start_host(&h, "refuse", &tmp.path().join("fold"), &addr, Some(token))?;
    wait_status(&addr, |s| s.applied_through >= 2).await?;

    let cases = [
        (guest_wasm("kvstore_v2"), None, "admin bearer token"),
        (guest_wasm("hostile_trap"), Some(token), "hydration failed"),
        (
            hostile_wat("bad_import.wat"),
            Some(token),
            "evil:net/exfil@1.0.0",
        ),
        (guest_wasm("router"), Some(token), "scope"),
    ];
    for (guest, tok, why) in cases {
        let (ok, text) = swap(&addr, &guest, tok)?;
        assert!(!ok, "{} must be refused", guest.display());
        assert!(
            text.contains(why),
            "{}: the reason names {why:?}: {text}",
            guest.display()
        );
        let (code, body) = foldhost::serve::call(&addr, "POST", "/query", b"route.a").await?;
        assert_eq!(
            (code, body),
            (200, b"{\"upstream\":\"1\"}".to_vec()),
            "v1 still serves"
        );
        let s = wait_status(&addr, |_| true).await?;
        assert_eq!(s.guest.as_deref(), Some("kvstore@0.1.0"));
        assert_eq!(s.state, "running");
    }
    // The fold kept going after the refusals.
    kv.put("route.b", "{\"upstream\":\"2\"}".into()).await?;
    let last = kv.positions().await?.last_sequence;
    wait_status(&addr, |s| s.applied_through >= last).await?;
    let (code, _) = foldhost::serve::call(&addr, "POST", "/query", b"route.b").await?;
    assert_eq!(code, 200);
    terminate(&mut host)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_guest_file_is_swapped_in_with_watch_guest() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("watchfile").await?;
    kv.put("k", "v".into()).await?;
    let tmp = tempfile::tempdir()?;
    let guest = tmp.path().join("guest.wasm");
    std::fs::copy(guest_wasm("kvstore"), &guest)?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut cmd = foldhost();
    cmd.args([
        "run",
        "--bucket",
        "watchfile",
        "--nats",
        &h.url(),
        "--listen",
        &addr,
    ])
    .arg("--watch-guest")
    .arg("--guest")
    .arg(&guest)
    .arg("--store")
    .arg(tmp.path().join("fold"));
    // The refusal of a bad file is waited for in the host's log (warn level), not by a clock.
    let (mut host, mut log) = spawn_logged(cmd)?;
    wait_status(&addr, |s| s.applied_through >= 1).await?;
    // A file that is not a component is refused; the running guest stays.
    let staged = tmp.path().join("staged.wasm");
    std::fs::write(&staged, b"not a component")?;
    std::fs::rename(&staged, &guest)?;
    log.wait_for("swap refused; the running guest stays")?;
    let (code, body) = foldhost::serve::call(&addr, "POST", "/query", b"k").await?;
    assert_eq!((code, body), (200, b"v".to_vec()), "v1 still serves");
    // Replace the file atomically with v2: the host swaps it in.
    std::fs::copy(guest_wasm("kvstore_v2"), &staged)?;
    std::fs::rename(&staged, &guest)?;
    wait_status(&addr, |s| s.guest.as_deref() == Some("kvstore@0.2.0")).await?;
    let (code, body) = foldhost::serve::call(&addr, "POST", "/query", b"k").await?;
    assert_eq!((code, body), (200, b"v2:v".to_vec()));
    terminate(&mut host)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queries_are_served_over_nats_request_reply() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("nq").await?;
    kv.put("route.a", "{\"upstream\":\"1\"}".into()).await?;
    let tmp = tempfile::tempdir()?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = foldhost()
        .args([
            "run",
            "--bucket",
            "nq",
            "--nats",
            &h.url(),
            "--listen",
            &addr,
        ])
        .args(["--query-subject", "svc.kv.query"])
        .arg("--guest")
        .arg(guest_wasm("kvstore"))
        .arg("--store")
        .arg(tmp.path().join("fold"))
        .stderr(Stdio::null())
        .spawn()?;
    wait_status(&addr, |s| s.applied_through >= 1).await?;
    let client = h.conn.client().await?;
    let answer = client.request("svc.kv.query", "route.a".into()).await?;
    assert_eq!(&answer.payload[..], b"{\"upstream\":\"1\"}");
    assert!(
        answer
            .headers
            .is_none_or(|h| h.get("Foldhost-Error").is_none())
    );
    let missing = client.request("svc.kv.query", "route.zzz".into()).await?;
    let is_error = missing
        .headers
        .as_ref()
        .and_then(|h| h.get("Foldhost-Error"))
        .map(|v| v.as_str() == "true");
    assert_eq!(is_error, Some(true));
    assert!(String::from_utf8_lossy(&missing.payload).contains("missing"));
    // A requester naming a bucket subject as its reply gets nothing published there: only inbox
    // replies are answered. Requests are served in order, so once the next one is answered the
    // forged one has been handled.
    let before = kv.positions().await?.last_sequence;
    client
        .publish_with_reply("svc.kv.query", "$KV.nq.route.a", "route.a".into())
        .await?;
    let after = client.request("svc.kv.query", "route.a".into()).await?;
    assert_eq!(&after.payload[..], b"{\"upstream\":\"1\"}");
    assert_eq!(
        kv.positions().await?.last_sequence,
        before,
        "nothing was published into the bucket"
    );
    terminate(&mut host)?;
    Ok(())
}

/// A swap across contract versions: a host running the C router (`foldhost:guest@0.1.0`) swaps to
/// the Rust router (`@0.2.0`: packed batches) while a writer keeps writing; the new version then
/// serves every route exactly as the bucket holds it, and status names each version's contract.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swap_from_a_0_1_guest_to_a_0_2_guest_serves_every_route_like_the_bucket()
-> anyhow::Result<()> {
    let route = |i: u32, generation: u32| {
        format!(
            "{{\"upstream\":\"10.{generation}.{}.{}:80\"}}",
            i / 250,
            i % 250
        )
    };
    let h = Harness::start().await?;
    let kv = h.bucket("contracts").await?;
    for i in 0..2000u32 {
        kv.put(&format!("route.h{i:05}"), route(i, 0).into())
            .await?;
    }
    let tmp = tempfile::tempdir()?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = start_host_holding(
        &h,
        "contracts",
        &tmp.path().join("fold"),
        &addr,
        None,
        "router_c",
        None,
    )?;
    let last = kv.positions().await?.last_sequence;
    let before = wait_status(&addr, |s| s.applied_through >= last).await?;
    assert_eq!(before.guest_contract.as_deref(), Some("0.1.0"));
    let writer = {
        let kv = kv.clone();
        tokio::spawn(async move {
            for i in 0..2000u32 {
                if i % 3 == 0 {
                    kv.put(&format!("route.h{i:05}"), route(i, 1).into())
                        .await?;
                }
                if i % 7 == 0 {
                    kv.delete(&format!("route.h{i:05}")).await?;
                }
            }
            anyhow::Ok(())
        })
    };
    let (ok, text) = {
        let (addr, guest) = (addr.clone(), guest_wasm("router"));
        tokio::task::spawn_blocking(move || swap(&addr, &guest, None)).await??
    };
    assert!(ok, "the swap to the 0.2.0 router: {text}");
    writer.await??;
    let last = kv.positions().await?.last_sequence;
    let after = wait_status(&addr, |s| s.applied_through >= last).await?;
    assert_eq!(after.guest_contract.as_deref(), Some("0.2.0"));
    let want = bucket_contents(&kv).await?;
    let checked = foldhost_tests::check_routes_served(&addr, &want).await?;
    assert_eq!(checked, want.len());
    for i in (0..2000u32).filter(|i| i % 7 == 0) {
        let host_name = format!("h{i:05}");
        let (code, _) =
            foldhost::serve::call(&addr, "POST", "/query", host_name.as_bytes()).await?;
        assert_ne!(code, 200, "{host_name} was deleted");
    }
    terminate(&mut host)?;
    Ok(())
}
