//! The artifact store as a hostile party and a moving target, with the real binary, a real
//! nats-server, a real S3-compatible server (moto) and `file://` stores: an object announcing
//! gigabytes (a pointer, a tar extension entry) is refused in one line from its size or header,
//! the process staying under 128 MiB; a payload pruned while a bootstrap was about to fetch it is
//! fetched again from the pointer read anew; prune counts its grace from when a payload stopped
//! being the target; export rounds after `--on-recreated relist` publish the new stream's
//! artifact, and the old incarnation's is refused naming both streams; the CLI sends a store's
//! admin token to no listener but the one its store names.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use bytes::Bytes;
use foldhost_core::kv::KvWriter;
use foldhost_tests::{
    Harness, Moto, foldhost, foldhost_bin, publish_all, run_command, terminate, wait_status,
    wait_until,
};
use object_store::ObjectStoreExt as _;

/// The peak resident memory allowed to a bootstrap refusing a hostile object.
const RSS_LIMIT_KIB: u64 = 128 * 1024;

/// Runs `foldhost ARGS` (with `env`) as the only child of a python3 that waits for it and writes
/// its peak resident set (`getrusage(RUSAGE_CHILDREN).ru_maxrss`, KiB) to a file: the kernel's
/// own account of the process's high-water mark, read after it exited. Returns the output and
/// the peak.
fn run_measured(
    args: &[&str],
    env: &[(&str, String)],
    scratch: &Path,
) -> anyhow::Result<(Output, u64)> {
    const SCRIPT: &str = "import resource, subprocess, sys\n\
        r = subprocess.run(sys.argv[2:])\n\
        open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n\
        sys.exit(r.returncode if r.returncode >= 0 else 128 - r.returncode)\n";
    let rss = scratch.join(format!("rss-{}", foldhost_localnats::reserved_port()?));
    let mut c = Command::new("python3");
    c.arg("-c")
        .arg(SCRIPT)
        .arg(&rss)
        .arg(foldhost_bin())
        .args(args)
        .env("FOLDHOST_LOG", "warn");
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output()?;
    let peak = std::fs::read_to_string(&rss)?.trim().parse()?;
    Ok((o, peak))
}

/// A manifest (valid, of an empty append-log fold at `cursor`) and the payload name it gives.
fn small_manifest(cursor: u64) -> anyhow::Result<(Vec<u8>, String)> {
    let m = serde_json::json!({
        "schema": 2, "backend": "append-log", "format": 1, "cursor": cursor,
        "scope": "all", "keys": 0, "created_unix_ms": 0, "files": []
    });
    let bytes = serde_json::to_vec(&m)?;
    let name = foldhost_artifact::transport::payload_name(&bytes, cursor);
    Ok((bytes, name))
}

/// A tar header announcing a GNU long-name (`L`) entry of `size` bytes.
fn long_name_header(size: u64) -> Vec<u8> {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::GNULongName);
    h.set_size(size);
    h.set_mode(0o644);
    let _ = h.set_path("././@LongLink");
    h.set_cksum();
    h.as_bytes().to_vec()
}

/// The refusal's one line (stderr, logged at `warn`).
fn refusal(o: &Output) -> String {
    let stderr = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    lines[0].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gigabyte_pointer_or_tar_extension_entry_is_refused_in_one_line_under_128_mib()
-> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let objects = tmp.path().join("objects");
    std::fs::create_dir_all(&objects)?;
    let url = format!("file://{}", objects.display());

    an_8_gib_pointer_is_refused_from_its_size(tmp.path(), &objects, &url)?;
    let (manifest, name) =
        a_1_gib_long_name_is_refused_from_its_header(tmp.path(), &objects, &url)?;
    the_same_over_s3_is_refused(tmp.path(), &manifest, &name).await
}

/// `foldhost bootstrap` of `key` from `url` into `store`.
fn bootstrap_args(url: &str, key: &str, store: &Path) -> Vec<String> {
    [
        "bootstrap",
        "--artifacts",
        url,
        "--artifact-key",
        key,
        "--store",
        &store.display().to_string(),
    ]
    .map(String::from)
    .to_vec()
}

/// An 8 GiB pointer in `objects` (at `url`) is refused from its size, under the RSS limit.
fn an_8_gib_pointer_is_refused_from_its_size(
    tmp: &Path,
    objects: &Path,
    url: &str,
) -> anyhow::Result<()> {
    // An 8 GiB pointer (a sparse file): refused from its size, naming the object and the limit.
    let pointer = objects.join("huge.manifest.json");
    std::fs::File::create(&pointer)?.set_len(8 << 30)?;
    let args = bootstrap_args(url, "huge", &tmp.join("a"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (o, peak) = run_measured(&args, &[], tmp)?;
    assert_ne!(o.status.code(), Some(0));
    let line = refusal(&o);
    assert!(
        line.contains("huge.manifest.json")
            && line.contains("8589934592 bytes")
            && line.contains(&format!(
                "limit of {}",
                foldhost_artifact::artifact::MAX_MANIFEST_BYTES
            )),
        "{line}"
    );
    assert!(
        peak < RSS_LIMIT_KIB,
        "peak RSS {peak} KiB refusing an 8 GiB pointer"
    );
    Ok(())
}

/// A payload in `objects` (at `url`) whose first segment announces a 1 GiB GNU long name is
/// refused from the header; returns its manifest and payload name, for the same over S3.
fn a_1_gib_long_name_is_refused_from_its_header(
    tmp: &Path,
    objects: &Path,
    url: &str,
) -> anyhow::Result<(Vec<u8>, String)> {
    // A payload whose first segment starts with a GNU long-name entry announcing 1 GiB, its body
    // there in full (17 sparse segments of 64 MiB): refused from the header.
    let (manifest, name) = small_manifest(7)?;
    std::fs::write(objects.join("longname.manifest.json"), &manifest)?;
    let dir = objects.join("longname.segments").join(&name);
    std::fs::create_dir_all(&dir)?;
    for i in 0..17 {
        let f = std::fs::File::create(dir.join(foldhost_artifact::transport::segment_name(i)))?;
        if i == 0 {
            use std::os::unix::fs::FileExt as _;
            f.write_all_at(&long_name_header(1 << 30), 0)?;
        }
        f.set_len(foldhost_artifact::transport::MAX_SEGMENT_BYTES)?;
    }
    let args = bootstrap_args(url, "longname", &tmp.join("b"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (o, peak) = run_measured(&args, &[], tmp)?;
    assert_ne!(o.status.code(), Some(0));
    let line = refusal(&o);
    assert!(
        line.contains("GNU long-name (L)")
            && line.contains("1073741824 bytes")
            && line.contains(&format!(
                "limit of {}",
                foldhost_artifact::artifact::MAX_TAR_EXTENSION_BYTES
            )),
        "{line}"
    );
    assert!(
        peak < RSS_LIMIT_KIB,
        "peak RSS {peak} KiB refusing a 1 GiB long name"
    );
    assert!(!tmp.join("b").exists());
    Ok((manifest, name))
}

/// The same over S3: a pointer over the limit is refused from its size, a long name from its
/// header (`manifest` and `name` as the long-name case wrote them).
async fn the_same_over_s3_is_refused(
    tmp: &Path,
    manifest: &[u8],
    name: &str,
) -> anyhow::Result<()> {
    // The same over S3: a pointer over the limit is refused from its size, a 1 GiB long name from
    // its header.
    let moto = Moto::start().await?;
    let s3 = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(format!("http://{}", moto.addr))
        .with_allow_http(true)
        .with_bucket_name(&moto.bucket)
        .with_access_key_id("test")
        .with_secret_access_key("test")
        .with_region("us-east-1")
        .build()?;
    let over = foldhost_artifact::artifact::MAX_MANIFEST_BYTES + 1;
    s3.put(
        &object_store::path::Path::from("hostile/huge.manifest.json"),
        vec![b' '; over as usize].into(),
    )
    .await?;
    s3.put(
        &object_store::path::Path::from("hostile/longname.manifest.json"),
        manifest.to_vec().into(),
    )
    .await?;
    let mut segment = long_name_header(1 << 30);
    segment.resize(1 << 20, 0);
    s3.put(
        &object_store::path::Path::from(format!("hostile/longname.segments/{name}/000000")),
        segment.into(),
    )
    .await?;
    let env: Vec<(&str, String)> = moto.env();
    let s3_url = moto.url("hostile");
    for (key, store, words) in [
        ("huge", "c", format!("{over} bytes, over the limit")),
        ("longname", "d", "GNU long-name (L)".to_string()),
    ] {
        let store = tmp.join(store).display().to_string();
        let args = [
            "bootstrap",
            "--artifacts",
            &s3_url,
            "--artifact-key",
            key,
            "--store",
            &store,
        ];
        let (o, peak) = run_measured(&args, &env, tmp)?;
        assert_ne!(o.status.code(), Some(0), "{key}");
        let line = refusal(&o);
        assert!(line.contains(&words), "{key}: {line}");
        assert!(peak < RSS_LIMIT_KIB, "{key}: peak RSS {peak} KiB");
    }
    Ok(())
}

/// A bucket of `n` routes and a host folding it, serving `--listen`.
async fn folding_host(
    h: &Harness,
    bucket: &str,
    n: u32,
    store: &Path,
    extra: &[&str],
    env: &[(&str, String)],
) -> anyhow::Result<(std::process::Child, String)> {
    let kv = h.bucket(bucket).await?;
    publish_all(
        kv.jetstream(),
        (0..n).map(|i| (format!("$KV.{bucket}.route.h{i:05}"), Bytes::from("v1"))),
    )
    .await?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut cmd = run_command(h, bucket, store, Some(&addr));
    cmd.args(extra).stderr(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn()?;
    wait_status(&addr, |s| s.applied_through == u64::from(n)).await?;
    Ok((child, addr))
}

fn ok(o: &Output, what: &str) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(
        o.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(serde_json::from_slice(&o.stdout)?)
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
    // Exported through the listener as by export rounds: the artifact names the fold's stream,
    // so a bootstrap of another incarnation refuses it.
    anyhow::ensure!(
        m["stream"]["name"].is_string(),
        "a live export records the fold's stream: {m}"
    );
    m["cursor"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no cursor in {m}"))
}

/// `foldhost CMD --artifacts URL --artifact-key KEY` with `env`.
fn at_store(cmd: &str, url: &str, key: &str, env: &[(&str, String)]) -> Command {
    let mut c = foldhost();
    c.args([cmd, "--artifacts", url, "--artifact-key", key]);
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bootstrap_whose_payload_is_pruned_after_it_read_the_pointer_retries_once_and_completes()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let moto = Moto::start().await?;
    let env = moto.env();
    let url = moto.url("moving");
    let tmp = tempfile::tempdir()?;
    let (mut host, addr) = folding_host(&h, "moving", 500, &tmp.path().join("a"), &[], &[]).await?;
    let first = export_live(&addr, &tmp.path().join("art1"))?;
    ok(
        &at_store("publish", &url, "routes", &env)
            .arg("--artifact")
            .arg(tmp.path().join("art1"))
            .output()?,
        "publish the first",
    )?;

    // A bootstrap parked after it read the pointer (naming the first), before its payload.
    let hold = tmp.path().join("boot-hold");
    let mut boot = at_store("bootstrap", &url, "routes", &env);
    boot.arg("--store")
        .arg(tmp.path().join("b"))
        .env(
            "FOLDHOST_HOLD_AT",
            format!(
                "{}:{}",
                foldhost_core::crashpoint::BOOTSTRAP_BEFORE_PAYLOAD,
                hold.display()
            ),
        )
        .env("FOLDHOST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let boot = boot.spawn()?;
    let reached = PathBuf::from(format!("{}.reached", hold.display()));
    wait_until("the bootstrap read the pointer", || reached.exists()).await?;

    // Meanwhile a newer artifact is published and the first pruned at zero grace.
    let kv = h.bucket("moving").await?;
    for i in 0..50 {
        kv.put(&format!("route.more{i:03}"), "v2".into()).await?;
    }
    wait_status(&addr, |s| s.applied_through == 550).await?;
    let second = export_live(&addr, &tmp.path().join("art2"))?;
    assert!(second > first);
    ok(
        &at_store("publish", &url, "routes", &env)
            .arg("--artifact")
            .arg(tmp.path().join("art2"))
            .output()?,
        "publish the second",
    )?;
    terminate(&mut host)?;
    // Zero grace: gone as soon as the store's clock says it was replaced (its times are seconds).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let p = ok(
            &at_store("prune", &url, "routes", &env)
                .args(["--grace-secs", "0"])
                .output()?,
            "prune",
        )?;
        if p["pruned"].as_u64() == Some(1) {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the first was never pruned"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }

    std::fs::write(format!("{}.release", hold.display()), b"")?;
    let o = boot.wait_with_output()?;
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "the bootstrap failed: {stderr}");
    assert!(
        stderr.contains("the payload vanished mid-download") && stderr.contains("retrying once"),
        "the retry is in the log: {stderr}"
    );
    let m: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    assert_eq!(m["cursor"].as_u64(), Some(second), "{m}");
    Ok(())
}

fn age(path: &Path, by: std::time::Duration) -> anyhow::Result<()> {
    let f = std::fs::File::options().write(true).open(path)?;
    f.set_modified(std::time::SystemTime::now() - by)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_keeps_a_payload_uploaded_long_ago_until_the_grace_has_passed_since_it_was_replaced()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    let objects = tmp.path().join("objects");
    std::fs::create_dir_all(&objects)?;
    let url = format!("file://{}", objects.display());
    let (mut host, addr) = folding_host(&h, "graced", 300, &tmp.path().join("a"), &[], &[]).await?;
    let publish = |art: &Path| -> anyhow::Result<serde_json::Value> {
        ok(
            &at_store("publish", &url, "routes", &[])
                .arg("--artifact")
                .arg(art)
                .arg("--allow-non-atomic-pointer")
                .output()?,
            "publish",
        )
    };
    export_live(&addr, &tmp.path().join("art1"))?;
    let p1 = publish(&tmp.path().join("art1"))?;
    // The first payload was uploaded an hour ago.
    let hour = std::time::Duration::from_secs(3600);
    let first_dir = p1["payload"].as_str().unwrap_or_default().to_string();
    let first: Vec<PathBuf> = foldhost_tests::files_under(&objects)?
        .into_iter()
        .filter(|p| p.display().to_string().contains(&first_dir))
        .collect();
    anyhow::ensure!(!first.is_empty(), "no segment of {first_dir}");
    for p in &first {
        age(p, hour)?;
    }
    h.bucket("graced")
        .await?
        .put("route.more", "v2".into())
        .await?;
    wait_status(&addr, |s| s.applied_through == 301).await?;
    export_live(&addr, &tmp.path().join("art2"))?;
    publish(&tmp.path().join("art2"))?;
    terminate(&mut host)?;
    let prune = || -> anyhow::Result<Option<u64>> {
        Ok(ok(
            &at_store("prune", &url, "routes", &[])
                .args(["--grace-secs", "600"])
                .output()?,
            "prune",
        )?["pruned"]
            .as_u64())
    };
    // Replaced just now: kept, however old its upload (counted from the upload, it went).
    assert_eq!(prune()?, Some(0));
    assert!(
        first.iter().all(|p| p.exists()),
        "the replaced payload stays for the grace"
    );
    // Replaced an hour ago (the pointer, written when the second was published, aged with it).
    age(&objects.join("routes.manifest.json"), hour)?;
    assert_eq!(prune()?, Some(1));
    assert!(first.iter().all(|p| !p.exists()), "past the grace it goes");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_rounds_after_a_relist_publish_the_new_streams_artifact_and_the_old_one_is_refused_naming_both()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let moto = Moto::start().await?;
    let env = moto.env();
    let url = moto.url("incarnations");
    let tmp = tempfile::tempdir()?;
    let bucket = "incarn";
    let (mut host, addr) = folding_host(
        &h,
        bucket,
        800,
        &tmp.path().join("a"),
        &[
            "--artifacts",
            &url,
            "--artifact-key",
            "routes",
            "--export-every",
            "1",
            "--on-recreated",
            "relist",
            // The recreation ends the watch by its silence: three heartbeats of one second.
            "--watch-heartbeat",
            "1",
        ],
        &env,
    )
    .await?;
    wait_status(&addr, published(800)).await?;
    keep_the_old_incarnations_artifact(&url, &env, tmp.path())?;
    let old_stream = stream_identity(
        h.bucket(bucket)
            .await?
            .jetstream()
            .get_stream(format!("KV_{bucket}"))
            .await?
            .cached_info(),
    );

    let new_stream = recreate_the_bucket_with_30_writes(&h, bucket).await?;
    assert_ne!(old_stream, new_stream);
    // The node re-lists the new bucket and its rounds publish it (cursor 30, below the old 800).
    wait_status(&addr, |s| s.applied_through == 30 && s.repairs >= 1).await?;
    wait_status(&addr, published(30)).await?;
    terminate(&mut host)?;

    the_old_incarnations_artifact_is_refused_naming_both(
        &h,
        bucket,
        &url,
        &env,
        tmp.path(),
        &old_stream,
        &new_stream,
    )
}

/// Whether a status says the last published round is at cursor `c`.
fn published(c: u64) -> impl Fn(&foldhost_core::status::StatusReport) -> bool {
    move |s: &foldhost_core::status::StatusReport| {
        s.last_export
            .as_ref()
            .and_then(|e| e.last_published.as_ref())
            .is_some_and(|p| p.cursor == c)
    }
}

/// The old incarnation's artifact as the rounds published it (its manifest names its stream),
/// kept under a key of its own: bootstrapped, exported offline, published again.
fn keep_the_old_incarnations_artifact(
    url: &str,
    env: &[(&str, String)],
    tmp: &Path,
) -> anyhow::Result<()> {
    // The old incarnation's artifact as the rounds published it (its manifest names its stream),
    // kept under a key of its own: bootstrapped, exported offline, published again.
    let copy = tmp.join("old-copy");
    ok(
        &at_store("bootstrap", url, "routes", env)
            .arg("--store")
            .arg(&copy)
            .output()?,
        "bootstrap the old incarnation's",
    )?;
    ok(
        &foldhost()
            .args(["export", "--store"])
            .arg(&copy)
            .arg("--out")
            .arg(tmp.join("old"))
            .output()?,
        "export the old incarnation's fold",
    )?;
    ok(
        &at_store("publish", url, "routes-old", env)
            .arg("--artifact")
            .arg(tmp.join("old"))
            .output()?,
        "publish the old incarnation's",
    )?;
    Ok(())
}

/// A stream's identity: its name and creation time.
fn stream_identity(
    info: &async_nats::jetstream::stream::Info,
) -> foldhost_core::kv::StreamIdentity {
    foldhost_core::kv::StreamIdentity {
        name: info.config.name.clone(),
        created_unix_ns: u64::try_from(info.created.unix_timestamp_nanos()).unwrap_or(0),
    }
}

/// The bucket is deleted and created again, with fewer writes than the old cursor; returns the
/// new stream's identity.
async fn recreate_the_bucket_with_30_writes(
    h: &Harness,
    bucket: &str,
) -> anyhow::Result<foldhost_core::kv::StreamIdentity> {
    // The bucket is deleted and created again, with fewer writes than the old cursor.
    let kv = h.bucket(bucket).await?;
    kv.jetstream().delete_stream(format!("KV_{bucket}")).await?;
    let kv = h.bucket(bucket).await?;
    for i in 0..30u32 {
        kv.put(&format!("new.{i:04}"), Bytes::from(format!("new-{i}")))
            .await?;
    }
    let new_stream = stream_identity(
        kv.jetstream()
            .get_stream(format!("KV_{bucket}"))
            .await?
            .cached_info(),
    );
    Ok(new_stream)
}

/// A node bootstraps from the new incarnation's artifact, and is refused the old one's in one line
/// naming both streams.
fn the_old_incarnations_artifact_is_refused_naming_both(
    h: &Harness,
    bucket: &str,
    url: &str,
    env: &[(&str, String)],
    tmp: &Path,
    old_stream: &foldhost_core::kv::StreamIdentity,
    new_stream: &foldhost_core::kv::StreamIdentity,
) -> anyhow::Result<()> {
    let nats = h.url();
    let bootstrap = |key: &str, store: &str| -> anyhow::Result<Output> {
        Ok(at_store("bootstrap", url, key, env)
            .arg("--store")
            .arg(tmp.join(store))
            .args(["--nats", &nats, "--bucket", bucket])
            .output()?)
    };
    let m = ok(
        &bootstrap("routes", "new")?,
        "bootstrap the new incarnation's",
    )?;
    assert_eq!(m["cursor"].as_u64(), Some(30), "{m}");
    assert_eq!(m["stream"]["name"].as_str(), Some("KV_incarn"), "{m}");
    let o = bootstrap("routes-old", "old-node")?;
    assert_ne!(o.status.code(), Some(0));
    let line = refusal(&o);
    assert!(
        line.contains("refusing to bootstrap from another incarnation")
            && line.contains(&format!("it folds {old_stream}"))
            && line.contains(&format!("the bucket is {new_stream}")),
        "{line}"
    );
    assert!(!tmp.join("old-node").exists());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_naming_another_stores_token_file_is_sent_no_token() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let h = Harness::start().await?;
    let tmp = tempfile::tempdir()?;
    // A real host: its store holds a generated token and a status.json naming its address.
    let victim = tmp.path().join("victim");
    let (mut host, real) = folding_host(&h, "tokens", 10, &victim, &[], &[]).await?;
    let token_file = std::path::absolute(victim.join("admin-token"))?;
    let token = std::fs::read_to_string(&token_file)?.trim().to_string();
    anyhow::ensure!(token.len() == 64, "a generated token: {token:?}");

    // A listener on another loopback port claiming that store's token file in its `/status`; it
    // keeps every request head it is sent.
    let squat = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let listener = tokio::net::TcpListener::bind(&squat).await?;
    let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let kept = heads.clone();
    let body = serde_json::json!({"state": "running", "admin_token_file": token_file}).to_string();
    let server = tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match sock.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            if let Ok(mut h) = kept.lock() {
                h.push(String::from_utf8_lossy(&head).into_owned());
            }
            let reply = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(reply.as_bytes()).await;
            let _ = sock.shutdown().await;
        }
    });
    let o = foldhost()
        .args(["export", "--listen", &squat, "--out"])
        .arg(tmp.path().join("stolen"))
        .output()?;
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains("not sending the admin token")
            && stderr.contains(&format!("listens at {real}"))
            && stderr.contains("--admin-token"),
        "{stderr}"
    );
    let seen = heads.lock().map(|h| h.clone()).unwrap_or_default();
    assert!(!seen.is_empty(), "the CLI asked the listener's /status");
    assert!(
        seen.iter()
            .all(|h| !h.contains(&token) && h.starts_with("GET /status")),
        "the token was sent: {seen:?}"
    );
    server.abort();

    // The host the store names is still found without an argument.
    ok(
        &foldhost()
            .args(["export", "--listen", &real, "--out"])
            .arg(tmp.path().join("art"))
            .output()?,
        "export through the store's own listener",
    )?;
    terminate(&mut host)?;
    Ok(())
}
