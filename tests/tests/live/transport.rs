//! The artifact transport against a real S3-compatible server (moto, on loopback) and a
//! real nats-server: an artifact published to object storage bootstraps a node that resumes with a
//! delta only; the pointer never moves backward; prune never deletes the pointer's target and waits
//! for the grace; a corrupt pointer is replaced; the local file system refuses to publish a pointer
//! it cannot replace atomically unless told to; a payload cut into segments downloads in order and
//! refuses a listing with a gap, and the earlier one-object layout still bootstraps.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use bytes::Bytes;
use foldhost_core::kv::KvWriter;
use foldhost_tests::{
    Harness, Moto, bucket_contents, dump_store, first_difference, foldhost, publish_all,
    run_command, terminate, wait_status,
};

fn ok(o: &Output, what: &str) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(
        o.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(serde_json::from_slice(&o.stdout)?)
}

/// `foldhost <cmd> --artifacts URL --artifact-key routes` with moto's environment.
fn with_artifacts(moto: &Moto, cmd: &str, url: &str) -> Command {
    let mut c = foldhost();
    c.args([cmd, "--artifacts", url, "--artifact-key", "routes"]);
    for (k, v) in moto.env() {
        c.env(k, v);
    }
    c
}

/// Exports the running host at `addr` into `out`; returns the artifact's cursor.
fn export_live(addr: &str, out: &Path) -> anyhow::Result<u64> {
    let m = ok(
        &foldhost()
            .args(["export", "--listen", addr, "--out"])
            .arg(out)
            .output()?,
        "live export",
    )?;
    m["cursor"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no cursor in {m}"))
}

fn publish(moto: &Moto, url: &str, artifact: &Path) -> anyhow::Result<Output> {
    Ok(with_artifacts(moto, "publish", url)
        .arg("--artifact")
        .arg(artifact)
        .output()?)
}

/// The cursor of the published artifact, read by bootstrapping a throwaway store from it.
fn published_cursor(moto: &Moto, url: &str, scratch: &Path) -> anyhow::Result<Option<u64>> {
    let store = scratch.join(format!("probe-{}", foldhost_localnats::reserved_port()?));
    let m = ok(
        &with_artifacts(moto, "bootstrap", url)
            .arg("--store")
            .arg(&store)
            .output()?,
        "bootstrap",
    )?;
    Ok(m["cursor"].as_u64())
}

/// A bucket of `n` routes and a host folding it, serving `--listen`.
async fn folding_host(
    h: &Harness,
    bucket: &str,
    n: u32,
    store: &Path,
) -> anyhow::Result<(std::process::Child, String)> {
    let kv = h.bucket(bucket).await?;
    publish_all(
        kv.jetstream(),
        (0..n).map(|i| (format!("$KV.{bucket}.route.h{i:05}"), Bytes::from("v1"))),
    )
    .await?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let child = run_command(h, bucket, store, Some(&addr))
        .stderr(Stdio::null())
        .spawn()?;
    wait_status(&addr, |s| s.applied_through == u64::from(n)).await?;
    Ok((child, addr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_artifact_published_to_s3_bootstraps_a_node_that_resumes_with_a_delta_only()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let moto = Moto::start().await?;
    let url = moto.url("fleet");
    let tmp = tempfile::tempdir()?;
    let (mut a, addr) = folding_host(&h, "fleet", 2000, &tmp.path().join("a")).await?;
    let cursor = export_live(&addr, &tmp.path().join("art"))?;
    terminate(&mut a)?;
    let p = ok(&publish(&moto, &url, &tmp.path().join("art"))?, "publish")?;
    assert_eq!(p["cursor"].as_u64(), Some(cursor));
    assert!(
        p["payload"]
            .as_str()
            .unwrap_or_default()
            .contains("routes.segments/")
    );

    // The log moves on while B is not there yet.
    let kv = h.bucket("fleet").await?;
    for i in 0..50 {
        kv.put(&format!("route.late{i:02}"), "v2".into()).await?;
    }
    let b = tmp.path().join("b");
    let m = ok(
        &with_artifacts(&moto, "bootstrap", &url)
            .arg("--store")
            .arg(&b)
            .output()?,
        "bootstrap",
    )?;
    assert_eq!(m["cursor"].as_u64(), Some(cursor));
    let o = run_command(&h, "fleet", &b, None)
        .arg("--catch-up")
        .output()?;
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains("(50 updates delivered this run)"),
        "B resumed from the artifact's cursor with the delta only: {stderr}"
    );
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&b)?),
        None
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pointer_never_moves_backward_and_prune_keeps_its_target_and_the_grace()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let moto = Moto::start().await?;
    let url = moto.url("race");
    let tmp = tempfile::tempdir()?;
    let (mut host, addr) = folding_host(&h, "race", 6000, &tmp.path().join("a")).await?;
    let kv = h.bucket("race").await?;
    let older = tmp.path().join("older");
    let c1 = export_live(&addr, &older)?;
    kv.put("route.more", "v".into()).await?;
    wait_status(&addr, |s| s.applied_through == c1 + 1).await?;
    let newer = tmp.path().join("newer");
    let c2 = export_live(&addr, &newer)?;
    assert!(c2 > c1);

    // Both in several segments, so that prune must take a payload's every segment.
    let publish = |moto: &Moto, url: &str, artifact: &Path| -> anyhow::Result<Output> {
        Ok(with_artifacts(moto, "publish", url)
            .env("FOLDHOST_ARTIFACT_SEGMENT_BYTES", SMALL_SEGMENT)
            .arg("--artifact")
            .arg(artifact)
            .output()?)
    };
    // The slower exporter (the older artifact) publishes after the newer one: superseded, and
    // the pointer stays; an equal cursor does not move it either.
    let target = ok(&publish(&moto, &url, &newer)?, "publish the newer")?;
    assert!(target["segments"].as_u64() >= Some(2), "{target}");
    for (artifact, what) in [(&older, "older"), (&newer, "the same")] {
        let o = publish(&moto, &url, artifact)?;
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && stderr.contains("superseded by a newer one"),
            "publishing {what} artifact: {stderr}"
        );
    }
    assert_eq!(published_cursor(&moto, &url, tmp.path())?, Some(c2));

    // A second payload exists (the older one, uploaded before its pointer swap was refused).
    // Prune within the grace deletes nothing; at zero grace only the orphan, never the target.
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
    let s3 = moto_s3(&moto)?;
    let payload_objects = || async {
        use futures::StreamExt as _;
        use object_store::ObjectStore as _;
        s3.list(Some(&object_store::path::Path::from(
            "race/routes.segments",
        )))
        .map(|m| m.map(|m| m.location.to_string()))
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
    };
    let before = payload_objects().await?;
    assert_eq!(prune("3600")?, 0, "nothing is older than the grace");
    assert_eq!(prune("0")?, 1, "the orphan goes");
    assert_eq!(
        prune("0")?,
        0,
        "the pointer's target stays, even at zero grace"
    );
    assert_eq!(published_cursor(&moto, &url, tmp.path())?, Some(c2));
    // Every segment of the orphan went, every segment of the target stayed.
    let target_dir = target["payload"].as_str().unwrap_or_default().to_string();
    let after = payload_objects().await?;
    let (kept, gone): (Vec<_>, Vec<_>) = before
        .iter()
        .partition(|o| o.starts_with(&format!("{target_dir}/")));
    assert!(
        !gone.is_empty() && gone.iter().all(|o| !after.contains(o)),
        "{gone:?} / {after:?}"
    );
    assert_eq!(after.len(), kept.len(), "{after:?}");
    assert!(gone.len() >= 2, "the orphan had several segments: {gone:?}");

    // A corrupt pointer (a foreign write) is replaced by the next publish.
    {
        use object_store::ObjectStoreExt as _;
        let s3 = object_store::aws::AmazonS3Builder::new()
            .with_endpoint(format!("http://{}", moto.addr))
            .with_allow_http(true)
            .with_bucket_name(&moto.bucket)
            .with_access_key_id("test")
            .with_secret_access_key("test")
            .with_region("us-east-1")
            .build()?;
        s3.put(
            &object_store::path::Path::from("race/routes.manifest.json"),
            Bytes::from_static(b"not a manifest").into(),
        )
        .await?;
    }
    kv.put("route.after", "v".into()).await?;
    wait_status(&addr, |s| s.applied_through == c2 + 1).await?;
    let newest = tmp.path().join("newest");
    let c3 = export_live(&addr, &newest)?;
    ok(
        &publish(&moto, &url, &newest)?,
        "publish over a corrupt pointer",
    )?;
    assert_eq!(published_cursor(&moto, &url, tmp.path())?, Some(c3));
    terminate(&mut host)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_file_store_publishes_a_pointer_only_when_told_it_is_not_atomic()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let (mut host, addr) = folding_host(&h, "local", 6000, &tmp.path().join("a")).await?;
    let art = tmp.path().join("art");
    let cursor = export_live(&addr, &art)?;
    terminate(&mut host)?;
    let objects = tmp.path().join("objects");
    std::fs::create_dir_all(&objects)?;
    let url = format!("file://{}", objects.display());
    let publish = |extra: &[&str]| -> anyhow::Result<Output> {
        Ok(foldhost()
            .env("FOLDHOST_ARTIFACT_SEGMENT_BYTES", SMALL_SEGMENT)
            .args([
                "publish",
                "--artifacts",
                &url,
                "--artifact-key",
                "routes",
                "--artifact",
            ])
            .arg(&art)
            .args(extra)
            .output()?)
    };
    let o = publish(&[])?;
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("cannot replace the pointer atomically")
            && stderr.contains("--allow-non-atomic-pointer"),
        "{stderr}"
    );
    assert!(
        std::fs::read_dir(&objects)?.next().is_none(),
        "nothing was written"
    );
    let o = publish(&["--allow-non-atomic-pointer"])?;
    let p = ok(&o, "publish, non-atomic allowed")?;
    assert_eq!(p["cursor"].as_u64(), Some(cursor));
    let segments = p["segments"].as_u64().unwrap_or(0);
    assert!(segments >= 2, "the payload is cut into segments: {p}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("NON-ATOMIC pointer"),
        "the log says so"
    );
    let bootstrap = |store: &std::path::Path| -> anyhow::Result<Output> {
        Ok(foldhost()
            .args([
                "bootstrap",
                "--artifacts",
                &url,
                "--artifact-key",
                "routes",
                "--store",
            ])
            .arg(store)
            .output()?)
    };
    let b = tmp.path().join("b");
    let m = ok(&bootstrap(&b)?, "bootstrap from the file store")?;
    assert_eq!(m["cursor"].as_u64(), Some(cursor));

    // A local payload is read straight from its files, not through the store's stream: a flipped
    // byte in a segment past the first is still refused, and the store it was meant for is not
    // made.
    let payload = foldhost_tests::files_under(&objects)?
        .into_iter()
        .find(|p| {
            p.file_name().is_some_and(|n| n == "000001")
                && p.parent()
                    .is_some_and(|d| d.to_string_lossy().ends_with(".tar"))
        })
        .ok_or_else(|| anyhow::anyhow!("no second segment under {}", objects.display()))?;
    let mut bytes = std::fs::read(&payload)?;
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&payload, &bytes)?;
    let c = tmp.path().join("c");
    let o = bootstrap(&c)?;
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_ne!(
        o.status.code(),
        Some(0),
        "a tampered payload bootstrapped: {stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(
        !c.exists() || std::fs::read_dir(&c)?.next().is_none(),
        "{} was made",
        c.display()
    );
    Ok(())
}

/// The segment size the segment tests publish with (the smallest allowed), so that a small
/// artifact makes several.
const SMALL_SEGMENT: &str = "65536";

/// An S3 client of `moto`'s bucket.
fn moto_s3(moto: &Moto) -> anyhow::Result<object_store::aws::AmazonS3> {
    Ok(object_store::aws::AmazonS3Builder::new()
        .with_endpoint(format!("http://{}", moto.addr))
        .with_allow_http(true)
        .with_bucket_name(&moto.bucket)
        .with_access_key_id("test")
        .with_secret_access_key("test")
        .with_region("us-east-1")
        .build()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_cut_into_segments_bootstraps_in_order_refuses_a_listing_with_a_gap_and_the_one_object_layout_still_reads()
-> anyhow::Result<()> {
    use futures::StreamExt as _;
    use object_store::ObjectStore as _;
    use object_store::ObjectStoreExt as _;
    let h = Harness::start().await?;
    let moto = Moto::start().await?;
    let url = moto.url("seg");
    let tmp = tempfile::tempdir()?;
    let (mut a, addr) = folding_host(&h, "seg", 6000, &tmp.path().join("a")).await?;
    let cursor = export_live(&addr, &tmp.path().join("art"))?;
    terminate(&mut a)?;
    let p = ok(
        &with_artifacts(&moto, "publish", &url)
            .env("FOLDHOST_ARTIFACT_SEGMENT_BYTES", SMALL_SEGMENT)
            .arg("--artifact")
            .arg(tmp.path().join("art"))
            .output()?,
        "publish in small segments",
    )?;
    let segments = p["segments"].as_u64().unwrap_or(0);
    assert!(segments >= 3, "several segments: {p}");
    let kv = h.bucket("seg").await?;
    let bootstrap = |dest: &Path| -> anyhow::Result<Output> {
        Ok(with_artifacts(&moto, "bootstrap", &url)
            .arg("--store")
            .arg(dest)
            .output()?)
    };
    // Fetched several at once, fed in order: the store equals the bucket.
    let b = tmp.path().join("b");
    let m = ok(&bootstrap(&b)?, "bootstrap from segments")?;
    assert_eq!(m["cursor"].as_u64(), Some(cursor));
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&b)?),
        None
    );

    // Nothing of it lies under routes.payloads/, which an earlier version's prune scans and
    // judges object by object (a segment's name carries no cursor: it would be deleted).
    let s3 = moto_s3(&moto)?;
    let under_payloads: Vec<_> = s3
        .list(Some(&object_store::path::Path::from("seg/routes.payloads")))
        .collect::<Vec<_>>()
        .await;
    assert!(under_payloads.is_empty(), "{under_payloads:?}");

    // A listing with a gap is refused before anything is imported, in one line naming it.
    let dir = object_store::path::Path::from(
        p["payload"]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("no payload in {p}"))?,
    );
    let second = dir.clone().join("000001");
    let kept = s3.get(&second).await?.bytes().await?;
    s3.delete(&second).await?;
    let c = tmp.path().join("c");
    let o = bootstrap(&c)?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("segment 000001 is missing"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(!c.exists(), "a store was left behind");
    s3.put(&second, kept.into()).await?;

    // A segment shorter than its neighbours said: the tar it makes is refused, nothing is made.
    let shortened = dir.clone().join(format!("{:06}", segments - 2));
    let whole_last = s3.get(&shortened).await?.bytes().await?;
    s3.put(&shortened, whole_last.slice(..whole_last.len() / 2).into())
        .await?;
    let o = bootstrap(&c)?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(!c.exists(), "a store was left behind: {err}");
    s3.put(&shortened, whole_last.into()).await?;

    // The earlier layout: the same bytes as one object in the payloads directory, no segment
    // listed. It bootstraps the same store.
    let mut listed: Vec<_> = s3
        .list(Some(&dir))
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    listed.sort_by(|x, y| x.location.cmp(&y.location));
    let mut whole = Vec::new();
    for meta in &listed {
        whole.extend_from_slice(&s3.get(&meta.location).await?.bytes().await?);
        s3.delete(&meta.location).await?;
    }
    let one_object = object_store::path::Path::from(dir.as_ref().replacen(
        "routes.segments/",
        "routes.payloads/",
        1,
    ));
    assert_ne!(one_object, dir, "{dir} is not under routes.segments/");
    s3.put(&one_object, Bytes::from(whole).into()).await?;
    let d = tmp.path().join("d");
    let m = ok(&bootstrap(&d)?, "bootstrap from one object")?;
    assert_eq!(m["cursor"].as_u64(), Some(cursor));
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&d)?),
        None
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_exporting_in_rounds_publish_a_pointer_a_third_node_bootstraps_from()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let moto = Moto::start().await?;
    let url = moto.url("rounds");
    let tmp = tempfile::tempdir()?;
    let kv = h.bucket("rounds").await?;
    publish_all(
        kv.jetstream(),
        (0..500u32).map(|i| (format!("$KV.rounds.route.h{i:05}"), Bytes::from("v1"))),
    )
    .await?;
    // Two exporters on the same key, a round a second each.
    let mut nodes = Vec::new();
    for name in ["a", "b"] {
        let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
        let mut cmd = run_command(&h, "rounds", &tmp.path().join(name), Some(&addr));
        cmd.args([
            "--artifacts",
            &url,
            "--artifact-key",
            "routes",
            "--export-every",
            "1",
            "--node-id",
            name,
        ])
        .stderr(Stdio::null());
        for (k, v) in moto.env() {
            cmd.env(k, v);
        }
        nodes.push((cmd.spawn()?, addr));
    }
    for i in 0..100 {
        kv.put(&format!("route.more{i:03}"), "v2".into()).await?;
    }
    let last = kv.positions().await?.last_sequence;
    // Rounds run until one of them publishes the bucket's last revision; both nodes take part.
    for (_, addr) in &nodes {
        wait_status(addr, |s| {
            s.applied_through == last && s.last_export.is_some()
        })
        .await?;
    }
    let published = |s: &foldhost_core::status::StatusReport| {
        s.last_export.as_ref().and_then(|e| e.cursor) == Some(last)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let mut done = false;
        for (_, addr) in &nodes {
            done |= wait_status(addr, |_| true)
                .await
                .is_ok_and(|s| published(&s));
        }
        if done {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "no round published {last}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    // The status file a running host keeps says what its last round did, like `/status`.
    foldhost_tests::wait_until("status.json shows the last export round", || {
        ["a", "b"].iter().all(|n| {
            foldhost_tests::status_store(&tmp.path().join(n))
                .is_ok_and(|s| s.state == "running" && s.last_export.is_some())
        })
    })
    .await?;
    for (child, _) in &mut nodes {
        terminate(child)?;
    }
    assert_eq!(published_cursor(&moto, &url, tmp.path())?, Some(last));
    // No local artifact is left behind by a round.
    for name in [".a.export", ".b.export"] {
        let scratch = tmp.path().join(name);
        let left: Vec<_> = std::fs::read_dir(&scratch)
            .map(|d| d.filter_map(Result::ok).map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{name}: {left:?}");
    }
    // A third node bootstraps from the pointer and folds to the bucket.
    let c = tmp.path().join("c");
    ok(
        &with_artifacts(&moto, "bootstrap", &url)
            .arg("--store")
            .arg(&c)
            .output()?,
        "bootstrap",
    )?;
    let o = run_command(&h, "rounds", &c, None)
        .arg("--catch-up")
        .output()?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&c)?),
        None
    );
    Ok(())
}

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
    let mut cmd = run_command(&h, "slow", &tmp.path().join("a"), Some(&addr));
    cmd.args([
        "--artifacts",
        &url,
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
    let mut a = cmd.spawn()?;
    let reached = hold.with_extension("reached");
    foldhost_tests::wait_until("node A's round to hold before its pointer", || {
        reached.exists()
    })
    .await?;
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

    // Meanwhile a faster exporter publishes a newer artifact.
    for i in 0..10 {
        kv.put(&format!("route.more{i}"), "v2".into()).await?;
    }
    let last = kv.positions().await?.last_sequence;
    wait_status(&addr, |s| s.applied_through == last).await?;
    let newer = tmp.path().join("newer");
    let c2 = export_live(&addr, &newer)?;
    ok(&publish(&moto, &url, &newer)?, "publish the newer")?;

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
    assert_eq!(published_cursor(&moto, &url, tmp.path())?, Some(c2));

    // While nothing is new, rounds end before the lease (the pointer holds A's cursor). Then the
    // freed lease is won again, long before the 600 s it was taken for run out: a later round
    // publishes the next revision.
    kv.put("route.last", "v3".into()).await?;
    let c3 = kv.positions().await?.last_sequence;
    wait_status(&addr, |s| {
        s.last_export.as_ref().and_then(|e| e.cursor) == Some(c3)
    })
    .await?;
    // Nothing new since: the next rounds end before the lease, uploading nothing.
    let wins = |l: &str| l.matches("export round: lease won").count();
    let before = wins(&std::fs::read_to_string(&log)?);
    let s = wait_status(&addr, |s| {
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
    wait_status(&addr, |s| {
        s.last_export.as_ref().map(|e| e.unix_ms) != up_to_date_at
    })
    .await?;
    assert_eq!(
        wins(&std::fs::read_to_string(&log)?),
        before,
        "a round with nothing new took the lease"
    );
    terminate(&mut a)?;
    assert_eq!(published_cursor(&moto, &url, tmp.path())?, Some(c3));
    Ok(())
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

    type Edit = Box<dyn Fn(&str, Vec<u8>) -> Option<Vec<u8>>>;
    type Extra<'a> = Option<(&'a str, &'a [u8])>;
    let cases: Vec<(&str, Edit, Extra, &str)> = vec![
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
    ];
    for (what, edit, extra, words) in cases {
        rewrite_payload(&s3, &payload, edit, extra).await?;
        let dest = tmp.path().join("b");
        let o = with_artifacts(&moto, "bootstrap", &url)
            .arg("--store")
            .arg(&dest)
            .output()?;
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{what}: {err}");
        assert!(err.contains(words), "{what}: names {words:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{what}: one line: {err}");
        assert!(!dest.exists(), "{what}: a store was left behind");
        let left: Vec<_> = std::fs::read_dir(tmp.path())?
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".b."))
            .collect();
        assert!(left.is_empty(), "{what}: a stage was left behind: {left:?}");
        // Put the good payload back for the next case.
        use object_store::ObjectStoreExt as _;
        s3.put(&payload, original.clone().into()).await?;
    }
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
