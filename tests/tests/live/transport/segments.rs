//! A payload cut into segments, and two nodes exporting in rounds to one pointer a third node
//! bootstraps from.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_cut_into_segments_bootstraps_in_order_refuses_a_listing_with_a_gap_and_the_one_object_layout_still_reads()
-> anyhow::Result<()> {
    use futures::StreamExt as _;
    use object_store::ObjectStore as _;
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
    // Fetched several at once, fed in order: the store equals the bucket.
    let b = tmp.path().join("b");
    let m = ok(&bootstrap_to(&moto, &url, &b)?, "bootstrap from segments")?;
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
    a_listing_with_a_gap_is_refused(&moto, &url, tmp.path(), &s3, &dir).await?;
    a_shortened_segment_is_refused(&moto, &url, tmp.path(), &s3, &dir, segments).await?;
    rewrite_as_one_object(&s3, &dir).await?;
    let d = tmp.path().join("d");
    let m = ok(&bootstrap_to(&moto, &url, &d)?, "bootstrap from one object")?;
    assert_eq!(m["cursor"].as_u64(), Some(cursor));
    assert_eq!(
        first_difference(&bucket_contents(&kv).await?, &dump_store(&d)?),
        None
    );
    Ok(())
}

/// `foldhost bootstrap` from `url` into `dest`.
fn bootstrap_to(moto: &Moto, url: &str, dest: &Path) -> anyhow::Result<Output> {
    Ok(with_artifacts(moto, "bootstrap", url)
        .arg("--store")
        .arg(dest)
        .output()?)
}

/// A listing of the payload `dir` with a gap is refused before anything is imported, in one line
/// naming it; the segment is put back.
async fn a_listing_with_a_gap_is_refused(
    moto: &Moto,
    url: &str,
    tmp: &Path,
    s3: &object_store::aws::AmazonS3,
    dir: &object_store::path::Path,
) -> anyhow::Result<()> {
    use object_store::ObjectStoreExt as _;
    let second = dir.clone().join("000001");
    let kept = s3.get(&second).await?.bytes().await?;
    s3.delete(&second).await?;
    let c = tmp.join("c");
    let o = bootstrap_to(moto, url, &c)?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("segment 000001 is missing"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(!c.exists(), "a store was left behind");
    s3.put(&second, kept.into()).await?;
    Ok(())
}

/// A segment of `dir` shorter than its neighbours said: the tar it makes is refused, nothing is
/// made; the segment is put back.
async fn a_shortened_segment_is_refused(
    moto: &Moto,
    url: &str,
    tmp: &Path,
    s3: &object_store::aws::AmazonS3,
    dir: &object_store::path::Path,
    segments: u64,
) -> anyhow::Result<()> {
    use object_store::ObjectStoreExt as _;
    let c = tmp.join("c");
    // A segment shorter than its neighbours said: the tar it makes is refused, nothing is made.
    let shortened = dir.clone().join(format!("{:06}", segments - 2));
    let whole_last = s3.get(&shortened).await?.bytes().await?;
    s3.put(&shortened, whole_last.slice(..whole_last.len() / 2).into())
        .await?;
    let o = bootstrap_to(moto, url, &c)?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(!c.exists(), "a store was left behind: {err}");
    s3.put(&shortened, whole_last.into()).await?;
    Ok(())
}

/// Rewrites the segments of `dir` as the earlier layout: the same bytes as one object in the
/// payloads directory, no segment listed.
async fn rewrite_as_one_object(
    s3: &object_store::aws::AmazonS3,
    dir: &object_store::path::Path,
) -> anyhow::Result<()> {
    use futures::StreamExt as _;
    use object_store::ObjectStore as _;
    use object_store::ObjectStoreExt as _;
    // The earlier layout: the same bytes as one object in the payloads directory, no segment
    // listed. It bootstraps the same store.
    let mut listed: Vec<_> = s3
        .list(Some(dir))
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
    assert_ne!(&one_object, dir, "{dir} is not under routes.segments/");
    s3.put(&one_object, Bytes::from(whole).into()).await?;
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
    let mut nodes = start_two_exporters(&h, &moto, &url, tmp.path())?;
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
    wait_for_a_round_to_publish(&nodes, last).await?;
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

/// Two exporters, a and b, on the same key (`url`), a round a second each; their children and
/// addresses.
fn start_two_exporters(
    h: &Harness,
    moto: &Moto,
    url: &str,
    tmp: &Path,
) -> anyhow::Result<Vec<(std::process::Child, String)>> {
    let mut nodes = Vec::new();
    for name in ["a", "b"] {
        let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
        let mut cmd = run_command(h, "rounds", &tmp.join(name), Some(&addr));
        cmd.args([
            "--artifacts",
            url,
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
    Ok(nodes)
}

/// Waits until one of the `nodes`' rounds published the bucket's `last` revision.
async fn wait_for_a_round_to_publish(
    nodes: &[(std::process::Child, String)],
    last: u64,
) -> anyhow::Result<()> {
    let published = |s: &foldhost_core::status::StatusReport| {
        s.last_export.as_ref().and_then(|e| e.cursor) == Some(last)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let mut done = false;
        for (_, addr) in nodes {
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
    Ok(())
}
