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

mod rounds;
mod segments;

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

    // The slower exporter (the older artifact) publishes after the newer one: superseded.
    let target = the_slower_exporter_is_superseded(&moto, &url, tmp.path(), &older, &newer, c2)?;
    prune_keeps_the_target_and_the_grace(&moto, &url, tmp.path(), c2, &target).await?;
    corrupt_the_pointer(&moto).await?;
    kv.put("route.after", "v".into()).await?;
    wait_status(&addr, |s| s.applied_through == c2 + 1).await?;
    let newest = tmp.path().join("newest");
    let c3 = export_live(&addr, &newest)?;
    ok(
        &publish_segmented(&moto, &url, &newest)?,
        "publish over a corrupt pointer",
    )?;
    assert_eq!(published_cursor(&moto, &url, tmp.path())?, Some(c3));
    terminate(&mut host)?;
    Ok(())
}

/// Publishes `artifact` to `url` in several segments, so that prune must take a payload's every
/// segment.
fn publish_segmented(moto: &Moto, url: &str, artifact: &Path) -> anyhow::Result<Output> {
    Ok(with_artifacts(moto, "publish", url)
        .env("FOLDHOST_ARTIFACT_SEGMENT_BYTES", SMALL_SEGMENT)
        .arg("--artifact")
        .arg(artifact)
        .output()?)
}

/// After `newer` (at `c2`), the slower exporter's `older` is superseded and so is `newer` again;
/// returns what publishing `newer` printed.
fn the_slower_exporter_is_superseded(
    moto: &Moto,
    url: &str,
    tmp: &Path,
    older: &Path,
    newer: &Path,
    c2: u64,
) -> anyhow::Result<serde_json::Value> {
    // The slower exporter (the older artifact) publishes after the newer one: superseded, and
    // the pointer stays; an equal cursor does not move it either.
    let target = ok(&publish_segmented(moto, url, newer)?, "publish the newer")?;
    assert!(target["segments"].as_u64() >= Some(2), "{target}");
    for (artifact, what) in [(older, "older"), (newer, "the same")] {
        let o = publish_segmented(moto, url, artifact)?;
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && stderr.contains("superseded by a newer one"),
            "publishing {what} artifact: {stderr}"
        );
    }
    assert_eq!(published_cursor(moto, url, tmp)?, Some(c2));
    Ok(target)
}

/// `foldhost prune` of `url` with `grace` seconds: how many payloads it pruned.
fn prune_count(moto: &Moto, url: &str, grace: &str) -> anyhow::Result<u64> {
    let v = ok(
        &with_artifacts(moto, "prune", url)
            .args(["--grace-secs", grace])
            .output()?,
        "prune",
    )?;
    v["pruned"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no count in {v}"))
}

/// The objects under the race payloads' prefix.
async fn payload_objects(
    s3: &object_store::aws::AmazonS3,
) -> Result<Vec<String>, object_store::Error> {
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
}

/// Prune within the grace deletes nothing; at zero grace only the orphan (every segment of it),
/// never the pointer's `target` (at `c2`).
async fn prune_keeps_the_target_and_the_grace(
    moto: &Moto,
    url: &str,
    tmp: &Path,
    c2: u64,
    target: &serde_json::Value,
) -> anyhow::Result<()> {
    // A second payload exists (the older one, uploaded before its pointer swap was refused).
    // Prune within the grace deletes nothing; at zero grace only the orphan, never the target.
    let s3 = moto_s3(moto)?;
    let before = payload_objects(&s3).await?;
    assert_eq!(
        prune_count(moto, url, "3600")?,
        0,
        "nothing is older than the grace"
    );
    assert_eq!(prune_count(moto, url, "0")?, 1, "the orphan goes");
    assert_eq!(
        prune_count(moto, url, "0")?,
        0,
        "the pointer's target stays, even at zero grace"
    );
    assert_eq!(published_cursor(moto, url, tmp)?, Some(c2));
    // Every segment of the orphan went, every segment of the target stayed.
    let target_dir = target["payload"].as_str().unwrap_or_default().to_string();
    let after = payload_objects(&s3).await?;
    let (kept, gone): (Vec<_>, Vec<_>) = before
        .iter()
        .partition(|o| o.starts_with(&format!("{target_dir}/")));
    assert!(
        !gone.is_empty() && gone.iter().all(|o| !after.contains(o)),
        "{gone:?} / {after:?}"
    );
    assert_eq!(after.len(), kept.len(), "{after:?}");
    assert!(gone.len() >= 2, "the orphan had several segments: {gone:?}");
    Ok(())
}

/// A corrupt pointer (a foreign write).
async fn corrupt_the_pointer(moto: &Moto) -> anyhow::Result<()> {
    // A corrupt pointer (a foreign write) is replaced by the next publish.
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
