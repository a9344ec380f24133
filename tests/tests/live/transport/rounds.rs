//! Export rounds gone wrong: a crash between the payload and the pointer, a slower exporter
//! superseded, a tampered download, and a node saying its newest artifact is missing, fresh or
//! stale.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_payload_and_the_pointer_leaves_the_old_artifact_and_an_orphan_kept_until_the_pointer_passes_it()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let moto = Moto::start().await?;
    let url = moto.url("crash");
    let tmp = tempfile::tempdir()?;
    let (mut host, addr) = folding_host(&h, "crash", 100, &tmp.path().join("a")).await?;
    let first = tmp.path().join("first");
    let c1 = export_live(&addr, &first)?;
    ok(&publish(&moto, &url, &first)?, "publish the first")?;
    h.bucket("crash")
        .await?
        .put("route.new", "v".into())
        .await?;
    wait_status(&addr, |s| s.applied_through == c1 + 1).await?;
    let second = tmp.path().join("second");
    let c2 = export_live(&addr, &second)?;
    terminate(&mut host)?;
    // The publisher dies after uploading the payload, before moving the pointer.
    let mut cmd = with_artifacts(&moto, "publish", &url);
    cmd.arg("--artifact").arg(&second);
    foldhost_tests::run_to_crash(cmd, foldhost_core::crashpoint::PUBLISH_BEFORE_POINTER, 1)?;
    // The old pointer still bootstraps a node.
    assert_eq!(published_cursor(&moto, &url, tmp.path())?, Some(c1));
    // The orphan payload is above the pointer: an exporter may still name it (as the next
    // publish does), so no prune takes it, even at zero grace; the target never.
    let prune = |grace: &str| -> anyhow::Result<u64> {
        let v = ok(
            &with_artifacts(&moto, "prune", &url)
                .args(["--grace-secs", grace])
                .output()?,
            "prune",
        )?;
        v["pruned"]
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("no count in {v}"))
    };
    assert_eq!(prune("3600")?, 0, "within the grace");
    assert_eq!(prune("0")?, 0, "above the pointer: kept even at zero grace");
    assert_eq!(published_cursor(&moto, &url, tmp.path())?, Some(c1));
    // Publishing the second again completes the round (its payload is the one already there);
    // the first's payload is now below the pointer and goes.
    ok(&publish(&moto, &url, &second)?, "publish again")?;
    assert_eq!(published_cursor(&moto, &url, tmp.path())?, Some(c2));
    assert_eq!(prune("0")?, 1, "the payload the pointer passed");
    assert_eq!(prune("0")?, 0, "the target stays");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slower_exporter_is_superseded_abandons_its_lease_and_never_regresses_the_pointer()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let moto = Moto::start().await?;
    let url = moto.url("slow");
    let tmp = tempfile::tempdir()?;
    let kv = h.bucket("slow").await?;
    publish_all(
        kv.jetstream(),
        (0..100u32).map(|i| (format!("$KV.slow.route.h{i:05}"), Bytes::from("v1"))),
    )
    .await?;
    // Node A exports in rounds under a long lease; its first round is held after the payload is
    // uploaded, before the pointer moves (a slow exporter, placed by the code's progress).
    let hold = tmp.path().join("hold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let log = tmp.path().join("a.log");
    let mut a = spawn_a_held_exporter(&h, &moto, &url, tmp.path(), &addr)?;
    let reached = hold.with_extension("reached");
    foldhost_tests::wait_until("node A's round to hold before its pointer", || {
        reached.exists()
    })
    .await?;
    node_a_holds_a_long_lease(&h).await?;

    let c2 =
        a_faster_exporter_publishes_a_newer_artifact(&kv, &moto, &url, tmp.path(), &addr).await?;
    a_is_superseded_and_the_pointer_stays(&moto, &url, tmp.path(), c2).await?;
    let c3 = rounds_with_nothing_new_take_no_lease(&kv, &addr, &log).await?;
    terminate(&mut a)?;
    assert_eq!(published_cursor(&moto, &url, tmp.path())?, Some(c3));
    Ok(())
}

/// Node A, exporting in rounds under a 600 s lease, its first round held (at `tmp`/hold) after
/// the payload is uploaded and before the pointer moves; it logs to `tmp`/a.log.
fn spawn_a_held_exporter(
    h: &Harness,
    moto: &Moto,
    url: &str,
    tmp: &Path,
    addr: &str,
) -> anyhow::Result<std::process::Child> {
    let hold = tmp.join("hold");
    let log = tmp.join("a.log");
    let mut cmd = run_command(h, "slow", &tmp.join("a"), Some(addr));
    cmd.args([
        "--artifacts",
        url,
        "--artifact-key",
        "routes",
        "--export-every",
        "1",
        "--export-lease-secs",
        "600",
        "--node-id",
        "a",
    ])
    .env(
        foldhost_core::crashpoint::HOLD_ENV,
        format!(
            "{}:{}",
            foldhost_core::crashpoint::PUBLISH_BEFORE_POINTER,
            hold.display()
        ),
    )
    .env("FOLDHOST_LOG", "info")
    .stderr(std::fs::File::create(&log)?);
    for (k, v) in moto.env() {
        cmd.env(k, v);
    }
    Ok(cmd.spawn()?)
}

/// Node A holds the export lease, for far longer than a minute.
async fn node_a_holds_a_long_lease(h: &Harness) -> anyhow::Result<()> {
    let leases = h.bucket(foldhost::node::DEFAULT_LEASE_BUCKET).await?;
    let lease = foldhost_nats::lease::Lease::new(
        leases,
        "export.routes",
        "reader",
        std::time::Duration::from_secs(1),
    );
    let now = foldhost_core::status::now_unix_ms();
    let held = lease.read().await?.expect("A holds the lease");
    assert_eq!(held.holder, "a");
    assert!(held.expires_unix_ms > now + 60_000, "{held:?}");
    Ok(())
}

/// Meanwhile a faster exporter publishes a newer artifact; returns its cursor.
async fn a_faster_exporter_publishes_a_newer_artifact(
    kv: &foldhost_nats::NatsKv,
    moto: &Moto,
    url: &str,
    tmp: &Path,
    addr: &str,
) -> anyhow::Result<u64> {
    // Meanwhile a faster exporter publishes a newer artifact.
    for i in 0..10 {
        kv.put(&format!("route.more{i}"), "v2".into()).await?;
    }
    let last = kv.positions().await?.last_sequence;
    wait_status(addr, |s| s.applied_through == last).await?;
    let newer = tmp.join("newer");
    let c2 = export_live(addr, &newer)?;
    ok(&publish(moto, url, &newer)?, "publish the newer")?;
    Ok(c2)
}

/// A goes on: its pointer swap is refused, the pointer stays at `c2`, and its lease is abandoned.
async fn a_is_superseded_and_the_pointer_stays(
    moto: &Moto,
    url: &str,
    tmp: &Path,
    c2: u64,
) -> anyhow::Result<()> {
    let hold = tmp.join("hold");
    let log = tmp.join("a.log");
    // A goes on: its pointer swap is refused, the pointer stays, and its lease is abandoned.
    std::fs::write(hold.with_extension("release"), b"")?;
    foldhost_tests::wait_until("A's round to be superseded", || {
        std::fs::read_to_string(&log)
            .is_ok_and(|l| l.contains("superseded by a newer artifact; lease abandoned"))
    })
    .await?;
    let text = std::fs::read_to_string(&log)?;
    let superseded = text
        .lines()
        .find(|l| l.contains("superseded by a newer artifact"))
        .unwrap_or_default();
    assert!(
        superseded.contains(&format!("current={c2}")),
        "superseded by the newer cursor {c2}: {superseded}"
    );
    assert_eq!(published_cursor(moto, url, tmp)?, Some(c2));
    Ok(())
}

/// While nothing is new, rounds end before the lease; the freed lease is won again and a later
/// round publishes the next revision, returned.
async fn rounds_with_nothing_new_take_no_lease(
    kv: &foldhost_nats::NatsKv,
    addr: &str,
    log: &Path,
) -> anyhow::Result<u64> {
    // While nothing is new, rounds end before the lease (the pointer holds A's cursor). Then the
    // freed lease is won again, long before the 600 s it was taken for run out: a later round
    // publishes the next revision.
    kv.put("route.last", "v3".into()).await?;
    let c3 = kv.positions().await?.last_sequence;
    wait_status(addr, |s| {
        s.last_export.as_ref().and_then(|e| e.cursor) == Some(c3)
    })
    .await?;
    // Nothing new since: the next rounds end before the lease, uploading nothing.
    let wins = |l: &str| l.matches("export round: lease won").count();
    let before = wins(&std::fs::read_to_string(log)?);
    let s = wait_status(addr, |s| {
        s.last_export
            .as_ref()
            .is_some_and(|e| e.outcome == "up-to-date" && e.cursor == Some(c3))
    })
    .await?;
    // The round that published c3 is still reported beside the up-to-date one.
    assert_eq!(
        s.last_export
            .as_ref()
            .and_then(|e| e.last_published.as_ref())
            .map(|p| p.cursor),
        Some(c3),
        "the last published round is kept: {:?}",
        s.last_export
    );
    let up_to_date_at = s.last_export.map(|e| e.unix_ms);
    wait_status(addr, |s| {
        s.last_export.as_ref().map(|e| e.unix_ms) != up_to_date_at
    })
    .await?;
    assert_eq!(
        wins(&std::fs::read_to_string(log)?),
        before,
        "a round with nothing new took the lease"
    );
    Ok(c3)
}

/// Rewrites the tar object at `path` in `s3`: every entry through `edit` (name, bytes → new bytes,
/// or `None` to drop it), then `extra` appended.
async fn rewrite_payload(
    s3: &dyn object_store::ObjectStore,
    path: &object_store::path::Path,
    edit: impl Fn(&str, Vec<u8>) -> Option<Vec<u8>>,
    extra: Option<(&str, &[u8])>,
) -> anyhow::Result<()> {
    use object_store::ObjectStoreExt as _;
    use std::io::Read as _;
    let bytes = s3.get(path).await?.bytes().await?;
    let mut out = tar::Builder::new(Vec::new());
    let mut archive = tar::Archive::new(&bytes[..]);
    for entry in archive.entries()? {
        let mut entry = entry?;
        let name = String::from_utf8(entry.path_bytes().into_owned())?;
        let mut body = Vec::new();
        entry.read_to_end(&mut body)?;
        if let Some(body) = edit(&name, body) {
            let mut header = entry.header().clone();
            header.set_size(body.len() as u64);
            header.set_cksum();
            out.append(&header, &body[..])?;
        }
    }
    if let Some((name, body)) = extra {
        let mut header = tar::Header::new_gnu();
        header.set_size(body.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        out.append_data(&mut header, name, body)?;
    }
    s3.put(path, Bytes::from(out.into_inner()?).into()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_download_is_refused_in_one_line_and_leaves_no_store_behind()
-> anyhow::Result<()> {
    use futures::StreamExt as _;
    use object_store::ObjectStore as _;
    let h = Harness::start().await?;
    let moto = Moto::start().await?;
    let url = moto.url("tamper");
    let tmp = tempfile::tempdir()?;
    let (mut a, addr) = folding_host(&h, "tamper", 500, &tmp.path().join("a")).await?;
    export_live(&addr, &tmp.path().join("art"))?;
    terminate(&mut a)?;
    ok(&publish(&moto, &url, &tmp.path().join("art"))?, "publish")?;
    let s3 = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(format!("http://{}", moto.addr))
        .with_allow_http(true)
        .with_bucket_name(&moto.bucket)
        .with_access_key_id("test")
        .with_secret_access_key("test")
        .with_region("us-east-1")
        .build()?;
    let listed: Vec<_> = s3
        .list(Some(&object_store::path::Path::from(
            "tamper/routes.segments",
        )))
        .collect()
        .await;
    let [Ok(payload)] = &listed[..] else {
        anyhow::bail!("one payload expected: {listed:?}");
    };
    let payload = payload.location.clone();
    let original = {
        use object_store::ObjectStoreExt as _;
        s3.get(&payload).await?.bytes().await?
    };

    each_tampered_download_is_refused(&moto, &url, tmp.path(), &s3, &payload, &original).await?;
    // The untouched payload still bootstraps.
    ok(
        &with_artifacts(&moto, "bootstrap", &url)
            .arg("--store")
            .arg(tmp.path().join("b"))
            .output()?,
        "bootstrap the good payload",
    )?;
    Ok(())
}

/// How a case rewrites each entry of the payload's tar: its new bytes, or none to drop it.
type Edit = Box<dyn Fn(&str, Vec<u8>) -> Option<Vec<u8>>>;
/// An entry a case adds: its name and bytes.
type Extra<'a> = Option<(&'a str, &'a [u8])>;

/// Each way to tamper with a download: what it is, the edit, an entry added, and the words its
/// refusal names.
fn tamper_cases() -> Vec<(&'static str, Edit, Extra<'static>, &'static str)> {
    vec![
        (
            "a flipped byte in a data file",
            Box::new(|name, mut b| {
                if name.starts_with("data/") && !b.is_empty() {
                    let mid = b.len() / 2;
                    b[mid] ^= 1;
                }
                Some(b)
            }),
            None,
            "BLAKE3",
        ),
        (
            "an embedded manifest that is not the pointer",
            Box::new(|name, mut b| {
                if name == "MANIFEST.json" {
                    b.push(b' ');
                }
                Some(b)
            }),
            None,
            "embedded manifest is not the pointer's",
        ),
        (
            "a data file dropped",
            Box::new(|name, b| (!name.starts_with("data/")).then_some(b)),
            None,
            "missing from the artifact",
        ),
        (
            "an unlisted file added",
            Box::new(|_, b| Some(b)),
            Some(("data/extra.bin", b"x")),
            "not listed in the manifest",
        ),
    ]
}

/// Each case, on the one `payload` in `s3`: bootstrapping is refused in one line naming its words,
/// leaving no store and no stage under `tmp`; the `original` is put back after each.
async fn each_tampered_download_is_refused(
    moto: &Moto,
    url: &str,
    tmp: &Path,
    s3: &object_store::aws::AmazonS3,
    payload: &object_store::path::Path,
    original: &Bytes,
) -> anyhow::Result<()> {
    for (what, edit, extra, words) in tamper_cases() {
        rewrite_payload(s3, payload, edit, extra).await?;
        let dest = tmp.join("b");
        let o = with_artifacts(moto, "bootstrap", url)
            .arg("--store")
            .arg(&dest)
            .output()?;
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{what}: {err}");
        assert!(err.contains(words), "{what}: names {words:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{what}: one line: {err}");
        assert!(!dest.exists(), "{what}: a store was left behind");
        let left: Vec<_> = std::fs::read_dir(tmp)?
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".b."))
            .collect();
        assert!(left.is_empty(), "{what}: a stage was left behind: {left:?}");
        // Put the good payload back for the next case.
        use object_store::ObjectStoreExt as _;
        s3.put(payload, original.clone().into()).await?;
    }
    Ok(())
}

/// The node's freshness report once it satisfies `done` (a status without one never does).
async fn artifact_until(
    addr: &str,
    done: impl Fn(&foldhost_core::status::ArtifactFreshnessReport) -> bool,
) -> anyhow::Result<foldhost_core::status::StatusReport> {
    wait_status(addr, |s| s.artifact.as_ref().is_some_and(&done)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_says_the_newest_artifact_is_missing_fresh_then_stale_once_the_stream_passes_its_cursor()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let moto = Moto::start().await?;
    let url = moto.url("fresh");
    let tmp = tempfile::tempdir()?;
    // An evicting bucket: an age limit long enough that nothing ages out until the test says.
    let kv = h
        .aging_bucket("fresh", std::time::Duration::from_secs(3600))
        .await?;
    for i in 0..20 {
        kv.put(&format!("route.h{i:02}"), "v1".into()).await?;
    }
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut cmd = run_command(&h, "fresh", &tmp.path().join("node"), Some(&addr));
    cmd.args(["--artifacts", &url, "--artifact-key", "routes"])
        .stderr(Stdio::null());
    for (k, v) in moto.env() {
        cmd.env(k, v);
    }
    let mut node = cmd.spawn()?;
    wait_status(&addr, |s| s.applied_through >= 20).await?;
    // Nothing published: said at once.
    let s = artifact_until(&addr, |a| a.state == "missing").await?;
    assert!(
        s.warnings.iter().any(|w| w.contains("none published")),
        "{:?}",
        s.warnings
    );
    // One artifact at the head of the stream: fresh.
    let cursor = export_live(&addr, &tmp.path().join("art"))?;
    ok(&publish(&moto, &url, &tmp.path().join("art"))?, "publish")?;
    let s = artifact_until(&addr, |a| a.state == "fresh" && a.cursor == Some(cursor)).await?;
    assert!(
        !s.warnings.iter().any(|w| w.contains("artifact")),
        "{:?}",
        s.warnings
    );
    // The stream moves on and its records age out past the artifact's cursor: stale, said in
    // the status, the readiness answer and the metrics, while the fold itself runs on.
    for i in 0..5 {
        kv.put(&format!("route.n{i:02}"), "v2".into()).await?;
    }
    // The fold level first: its own cursor never expires under the shortened age.
    let last = kv.positions().await?.last_sequence;
    wait_status(&addr, |s| s.applied_through >= last).await?;
    foldhost_tests::set_max_age(&kv, "fresh", std::time::Duration::from_secs(1)).await?;
    let s = artifact_until(&addr, |a| a.state == "stale").await?;
    let a = s.artifact.as_ref().map(|a| (a.cursor, a.headroom_records));
    assert!(
        matches!(a, Some((Some(c), Some(n))) if c == cursor && n < 0),
        "{a:?}"
    );
    assert!(
        s.warnings.iter().any(|w| w.contains("stale")),
        "{:?}",
        s.warnings
    );
    let (code, body) = foldhost::serve::call(&addr, "GET", "/readyz", b"").await?;
    let body = String::from_utf8_lossy(&body);
    assert!(code == 200 && body.contains("stale"), "{code} {body}");
    let (_, metrics) = foldhost::serve::call(&addr, "GET", "/metrics", b"").await?;
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("foldhost_artifact_stale{") && l.ends_with(" 1")),
        "{metrics}"
    );
    assert_eq!(s.state, "running");
    terminate(&mut node)?;
    Ok(())
}
