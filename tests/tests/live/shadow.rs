//! `foldhost swap --shadow N`: a candidate hydrated beside the running guest, fed the fold's next N
//! batches under a live writer, and compared with it on the same requests at the same cursor. A
//! candidate that answers differently is reported with those requests and never promoted; one that
//! traps leaves the running guest and the fold untouched; an agreeing one is promoted on
//! `--promote` with nothing lost or applied twice (the running and the new guest are `kvstore-v2`,
//! which fails the fold on any update applied twice).

use std::process::{Child, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use foldhost_core::kv::KvWriter;
use foldhost_nats::NatsKv;
use foldhost_tests::{
    Harness, bucket_contents, dump_store, first_difference, foldhost, guest_wasm, run_command,
    terminate, wait_status, wait_until,
};
use rand::{Rng, SeedableRng};

/// Stable keys `k.0000`… holding `seed<i>`: the writer never touches them.
const STABLE: u32 = 500;

/// A host folding `bucket` with `guest`, serving on `addr`.
fn start_host(
    h: &Harness,
    bucket: &str,
    store: &std::path::Path,
    addr: &str,
    guest: &str,
) -> anyhow::Result<Child> {
    let mut c = run_command(h, bucket, store, Some(addr));
    c.arg("--guest")
        .arg(guest_wasm(guest))
        .stderr(Stdio::null());
    Ok(c.spawn()?)
}

/// A writer putting and deleting `w.*` keys until stopped; counts acknowledged writes.
struct Writer {
    stop: Arc<AtomicBool>,
    acked: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<anyhow::Result<u64>>,
}

impl Writer {
    fn start(kv: &Arc<NatsKv>, bucket: &str, seed: u64) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(AtomicU64::new(0));
        let task = {
            let (kv, stop, acked, bucket) =
                (kv.clone(), stop.clone(), acked.clone(), bucket.to_string());
            tokio::spawn(async move {
                let js = kv.jetstream().clone();
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let mut acks = Vec::with_capacity(50);
                    for _ in 0..50 {
                        let k = rng.random_range(0..2000);
                        acks.push(
                            js.publish(format!("$KV.{bucket}.w.{k:04}"), format!("w{n}").into())
                                .await?,
                        );
                        n += 1;
                    }
                    for a in acks {
                        a.await?;
                    }
                    kv.delete(&format!("w.{:04}", rng.random_range(0..2000)))
                        .await?;
                    n += 1;
                    acked.store(n, Ordering::Relaxed);
                }
                anyhow::Ok(n)
            })
        };
        Writer { stop, acked, task }
    }

    async fn wait_for(&self, writes: u64) -> anyhow::Result<()> {
        let target = self.acked.load(Ordering::Relaxed) + writes;
        wait_until("more acknowledged writes", || {
            self.acked.load(Ordering::Relaxed) >= target
        })
        .await
    }

    async fn stop(self) -> anyhow::Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await?
    }
}

/// A bucket seeded with the stable keys, a host on it running `guest`, and a writer going.
async fn setup(
    h: &Harness,
    bucket: &str,
    guest: &str,
    tmp: &std::path::Path,
) -> anyhow::Result<(Arc<NatsKv>, Child, String, Writer)> {
    let kv = h.bucket(bucket).await?;
    for i in 0..STABLE {
        kv.put(&format!("k.{i:04}"), format!("seed{i}").into())
            .await?;
    }
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let host = start_host(h, bucket, &tmp.join("fold"), &addr, guest)?;
    wait_status(&addr, |s| s.applied_through >= u64::from(STABLE)).await?;
    let writer = Writer::start(&kv, bucket, 7);
    writer.wait_for(500).await?;
    Ok((kv, host, addr, writer))
}

/// `foldhost swap --shadow …`: the exit code, stdout, stderr.
fn shadow(addr: &str, guest: &str, args: &[&str]) -> anyhow::Result<(Option<i32>, String, String)> {
    let out = foldhost()
        .args(["swap", "--listen", addr, "--guest"])
        .arg(guest_wasm(guest))
        .args(args)
        .env_remove("FOLDHOST_ADMIN_TOKEN")
        .output()?;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

async fn query(addr: &str, request: &str) -> anyhow::Result<(u16, String)> {
    let (code, body) = foldhost::serve::call(addr, "POST", "/query", request.as_bytes()).await?;
    Ok((code, String::from_utf8_lossy(&body).into_owned()))
}

/// Stops the writer, waits for the host to apply everything, checks the host still runs `guest`,
/// that it answers every key of the bucket as `answer_prefix` + its value (kvstore's answer is the
/// value, kvstore-v2's `v2:` and the value), and that the fold is the bucket.
async fn settle_and_check(
    kv: &NatsKv,
    mut host: Child,
    addr: &str,
    store: &std::path::Path,
    writer: Writer,
    guest: &str,
    answer_prefix: &str,
) -> anyhow::Result<()> {
    writer.stop().await?;
    let last = kv.positions().await?.last_sequence;
    let s = wait_status(addr, |s| s.applied_through >= last || s.state == "failed").await?;
    assert_eq!(s.state, "running", "{s:?}");
    assert_eq!(s.guest.as_deref(), Some(guest));
    let want = bucket_contents(kv).await?;
    for (key, (value, _)) in &want {
        let expect = format!("{answer_prefix}{}", String::from_utf8_lossy(value));
        assert_eq!(query(addr, key).await?, (200, expect), "{key}");
    }
    for i in 0..2000 {
        let key = format!("w.{i:04}");
        if !want.contains_key(&key) {
            assert_eq!(
                query(addr, &key).await?.0,
                422,
                "{key} is deleted in the bucket"
            );
        }
    }
    terminate(&mut host)?;
    assert_eq!(first_difference(&want, &dump_store(store)?), None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_that_answers_differently_is_reported_with_those_requests_and_never_promoted()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let (kv, host, addr, writer) = setup(&h, "shd", "kvstore", tmp.path()).await?;
    // kvstore-v2 answers `v2:` + the value: it differs on every key that exists, and agrees on a
    // missing one (both answer the error `missing`).
    let requests = tmp.path().join("requests");
    std::fs::write(&requests, "k.0001\nk.0002\nno.such.key\n")?;
    let before = wait_status(&addr, |_| true).await?;
    let (ok, out, err) = shadow(
        &addr,
        "kvstore_v2",
        &[
            "--shadow",
            "20",
            "--requests",
            &requests.display().to_string(),
            "--promote",
        ],
    )?;
    assert_eq!(ok, Some(3), "a differing candidate exits 3: {out}{err}");
    assert!(
        err.contains("answered 2 of 3 requests differently") && err.contains("not promoted"),
        "{err}"
    );
    let report: serde_json::Value = serde_json::from_str(out.trim())?;
    assert_eq!(report["promoted"], false, "{out}");
    assert_eq!(report["differing"], 2, "{out}");
    assert_eq!(report["requests"], 3, "{out}");
    assert!(
        report["batches"].as_u64() >= Some(20),
        "fed the fold's next 20 batches: {out}"
    );
    let listed: Vec<(String, String, String)> = report["differences"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            (
                d["request"].as_str().unwrap_or_default().to_string(),
                d["live"].as_str().unwrap_or_default().to_string(),
                d["candidate"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        vec![
            ("k.0001".into(), "ok: seed1".into(), "ok: v2:seed1".into()),
            ("k.0002".into(), "ok: seed2".into(), "ok: v2:seed2".into()),
        ]
    );
    // The running guest was never replaced, and kept folding.
    let s = wait_status(&addr, |s| s.batches >= before.batches + 20).await?;
    assert_eq!(s.guest.as_deref(), Some("kvstore@0.1.0"));
    assert_eq!(query(&addr, "k.0001").await?, (200, "seed1".into()));

    // A sample: keys in scope, asked as they are (a whole-bucket scope strips nothing); without
    // --promote the command still says what differed.
    let (ok, out, _) = shadow(&addr, "kvstore_v2", &["--shadow", "5", "--sample", "8"])?;
    assert_eq!(ok, Some(3), "{out}");
    let report: serde_json::Value = serde_json::from_str(out.trim())?;
    assert_eq!(report["requests"], 8, "{out}");
    // A sampled key the batches changed may since have been deleted (both answer `missing`); every
    // one that exists differs, as `v2:` and the same value.
    let differences = report["differences"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(!differences.is_empty(), "{out}");
    assert_eq!(report["differing"], differences.len(), "{out}");
    for d in &differences {
        let live = d["live"].as_str().unwrap_or_default();
        let value = live.strip_prefix("ok: ").unwrap_or_else(|| panic!("{out}"));
        assert_eq!(
            d["candidate"].as_str(),
            Some(format!("ok: v2:{value}").as_str()),
            "{out}"
        );
    }
    assert_eq!(report["promoted"], false);

    settle_and_check(
        &kv,
        host,
        &addr,
        &tmp.path().join("fold"),
        writer,
        "kvstore@0.1.0",
        "",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_that_traps_in_shadow_leaves_the_live_guest_and_the_fold_untouched()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    // The running guest is kvstore-v2: it fails the fold on any update applied twice.
    let (kv, host, addr, writer) = setup(&h, "sht", "kvstore_v2", tmp.path()).await?;
    // hostile-trap traps in `apply` on a batch holding `trap.me`: in its hydration, if the key is
    // there at the shadow's cursor, else in a catch-up of the batches that wrote it (a round while
    // it waits, or the comparison's). It asks for more batches than can come, so it compares only
    // when its 5 s wait runs out, after `trap.me` was written whatever the machine's speed: every
    // path reaches the trap.
    let shadowing = {
        let addr = addr.clone();
        tokio::task::spawn_blocking(move || {
            shadow(
                &addr,
                "hostile_trap",
                &[
                    "--shadow",
                    "1000000",
                    "--shadow-wait",
                    "5",
                    "--sample",
                    "10",
                    "--promote",
                ],
            )
        })
    };
    writer.wait_for(200).await?;
    kv.put("trap.me", "boom".into()).await?;
    let (ok, out, err) = shadowing.await??;
    assert_eq!(ok, Some(1), "a failed shadow is an error: {out}{err}");
    assert!(
        err.contains("the shadow of the candidate failed")
            && err.contains("keeps running untouched")
            && err.contains("trapped"),
        "{err}"
    );
    let s = wait_status(&addr, |_| true).await?;
    assert_eq!(s.state, "running");
    assert_eq!(s.guest.as_deref(), Some("kvstore@0.2.0"));
    assert_eq!(
        query(&addr, "trap.me").await?,
        (200, "v2:boom".into()),
        "the live guest applied it"
    );
    // Its capture is over: a swap right after goes through at once.
    let (ok, out, err) = shadow(&addr, "kvstore_v2", &[])?;
    assert_eq!(ok, Some(0), "a swap after the failed shadow: {out}{err}");
    settle_and_check(
        &kv,
        host,
        &addr,
        &tmp.path().join("fold"),
        writer,
        "kvstore@0.2.0",
        "v2:",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agreeing_shadow_is_promoted_with_nothing_lost_or_applied_twice() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let (kv, host, addr, writer) = setup(&h, "shp", "kvstore_v2", tmp.path()).await?;
    let (ok, out, err) = shadow(
        &addr,
        "kvstore_v2",
        &["--shadow", "30", "--sample", "200", "--promote"],
    )?;
    assert_eq!(ok, Some(0), "{out}{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim())?;
    assert_eq!(report["promoted"], true, "{out}");
    assert_eq!(report["differing"], 0, "{out}");
    assert_eq!(report["requests"], 200, "{out}");
    assert!(report["batches"].as_u64() >= Some(30), "{out}");
    assert!(
        report["caught_up"].as_u64() > Some(0),
        "fed what the writer changed: {out}"
    );
    // The writer stops at once, so what the promoted instance answers is what the shadow built
    // (plus the writes still in flight): a key changed during the shadow and not handed to it would
    // answer stale. kvstore-v2 fails the fold on any update applied twice.
    settle_and_check(
        &kv,
        host,
        &addr,
        &tmp.path().join("fold"),
        writer,
        "kvstore@0.2.0",
        "v2:",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_on_a_quiet_bucket_compares_on_what_came_and_promotes_nothing()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("shq").await?;
    for i in 0..STABLE {
        kv.put(&format!("k.{i:04}"), format!("seed{i}").into())
            .await?;
    }
    let tmp = tempfile::tempdir()?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = start_host(&h, "shq", &tmp.path().join("fold"), &addr, "kvstore_v2")?;
    wait_status(&addr, |s| s.applied_through >= u64::from(STABLE)).await?;
    // No writer: the 5 batches never come. The wait runs out (checked on the loop's tick), the
    // candidate — identical, so it agrees on every key — is compared on what came, and a
    // comparison that saw none of the batches asked for promotes nothing.
    let (ok, out, err) = shadow(
        &addr,
        "kvstore_v2",
        &[
            "--shadow",
            "5",
            "--shadow-wait",
            "2",
            "--sample",
            "10",
            "--promote",
        ],
    )?;
    assert_eq!(
        ok,
        Some(4),
        "nothing differed, promotion refused: {out}{err}"
    );
    let report: serde_json::Value = serde_json::from_str(out.trim())?;
    assert_eq!(report["batches"], 0, "{out}");
    assert_eq!(report["requests"], 10, "{out}");
    assert_eq!(report["differing"], 0, "{out}");
    assert_eq!(report["promoted"], false, "{out}");
    assert!(
        report["not_promoted"]
            .as_str()
            .is_some_and(|w| w.contains("only 0 of the 5 batches")),
        "{out}"
    );
    assert!(err.contains("not promoted"), "{err}");
    terminate(&mut host)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadowed_candidate_whose_query_writes_state_publishes_nothing_and_the_report_lists_its_writes()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("shst").await?;
    for i in 0..20 {
        kv.put(&format!("k.{i:04}"), format!("seed{i}").into())
            .await?;
    }
    let tmp = tempfile::tempdir()?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = start_host(&h, "shst", &tmp.path().join("fold"), &addr, "state_owner")?;
    wait_status(&addr, |s| s.applied_through >= 20).await?;
    let notes = h.bucket("state_owner_notes").await?;
    let before = notes.positions().await?.last_sequence;
    // A put, a read of it, a delete, and a read again: each side answers from its own overlay,
    // so both read their own put and agree.
    let requests = tmp.path().join("requests");
    std::fs::write(
        &requests,
        [
            r#"{"op":"put","bucket":"notes","key":"trial","value":"t1"}"#,
            r#"{"op":"get","bucket":"notes","key":"trial"}"#,
            r#"{"op":"keys","bucket":"notes","prefix":"tr"}"#,
            r#"{"op":"delete","bucket":"notes","key":"trial"}"#,
            r#"{"op":"get","bucket":"notes","key":"trial"}"#,
        ]
        .join("\n"),
    )?;
    // The same component as the candidate: whatever differs is the host's doing. No writer: the
    // wait runs out and the comparison runs on what came.
    let (code, out, err) = shadow(
        &addr,
        "state_owner",
        &[
            "--shadow",
            "1",
            "--shadow-wait",
            "1",
            "--requests",
            &requests.display().to_string(),
        ],
    )?;
    assert_eq!(code, Some(0), "nothing differed: {out}{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim())?;
    assert_eq!(report["requests"], 5, "{out}");
    assert_eq!(report["differing"], 0, "{out}");
    assert_eq!(report["candidate_writes_total"], 2, "{out}");
    assert_eq!(report["live_writes_total"], 2, "{out}");
    let listed: Vec<&str> = report["candidate_writes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| w["write"].as_str())
        .collect();
    assert_eq!(
        listed,
        ["put notes trial \"t1\"", "delete notes trial"],
        "{out}"
    );
    // Nothing reached the bucket: its stream gained no record, and the node reads no value.
    assert_eq!(
        notes.positions().await?.last_sequence,
        before,
        "a shadow published a state write"
    );
    let (code, answer) = query(&addr, r#"{"op":"get","bucket":"notes","key":"trial"}"#).await?;
    assert_eq!((code, answer.as_str()), (200, r#"{"ok":null}"#));
    // The capture ended with the comparison: the fold-path instance's own writes (`on-applied`
    // mirrors `mirror/K` of the main bucket into `notes`) are published again.
    kv.put("mirror/after", "m".into()).await?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while notes.positions().await?.last_sequence == before {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the fold's own write after the shadow was never published"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let before = notes.positions().await?.last_sequence;
    // Outside a shadow, the same put is published.
    let (code, answer) = query(
        &addr,
        r#"{"op":"put","bucket":"notes","key":"real","value":"r"}"#,
    )
    .await?;
    assert_eq!(code, 200, "{answer}");
    assert!(
        notes.positions().await?.last_sequence > before,
        "a query's write outside a shadow is published: {answer}"
    );
    terminate(&mut host)?;
    Ok(())
}
