//! State buckets across a kill and an artifact: each resumes from its own cursor, and a bucket
//! whose values age out is refused at start.

use super::*;

/// The main bucket `main` and the owner's state buckets as its declarations make them (one value
/// per key, the host's cap), each holding `n` keys (`m.`, `n.`, `t.` and a two-digit index).
async fn owner_buckets(
    h: &Harness,
    main: &str,
    n: usize,
) -> anyhow::Result<(
    std::sync::Arc<NatsKv>,
    std::sync::Arc<NatsKv>,
    std::sync::Arc<NatsKv>,
)> {
    let main = h.bucket(main).await?;
    let config = BucketConfig {
        max_bytes: Some(foldhost_core::protocol::DEFAULT_STATE_MAX_BUCKET as i64),
        ..BucketConfig::default()
    };
    let notes = h.conn.bucket(NOTES, &config).await?;
    let tally = h.conn.bucket(TALLY, &config).await?;
    for i in 0..n {
        main.put(&format!("m.{i:02}"), format!("{i}").into())
            .await?;
        notes
            .put(&format!("n.{i:02}"), format!("{i}").into())
            .await?;
        tally
            .put(&format!("t.{i:02}"), format!("{i}").into())
            .await?;
    }
    Ok((main, notes, tally))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_mid_fold_over_three_buckets_resumes_each_from_its_own_cursor()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let (main, notes, tally) = owner_buckets(&h, "kill_main", 50).await?;
    for i in (0..50).step_by(7) {
        notes.delete(&format!("n.{i:02}")).await?;
        tally.put(&format!("t.{i:02}"), "again".into()).await?;
    }
    let store = tempfile::tempdir()?;
    let run = |extra: &[&str]| {
        let mut c = run_command(&h, "kill_main", store.path(), None);
        c.arg("--guest")
            .arg(guest_wasm("state_owner"))
            .args(["--batch-max", "10"])
            .args(extra);
        c
    };
    // Killed at the 14th commit of any fold: the state buckets fold first (6 batches each, from
    // no cursor), so the main bucket is a batch or two in.
    run_to_crash(run(&[]), foldhost_core::crashpoint::FOLD_COMMITTED, 14)?;
    let addr = format!("127.0.0.1:{}", reserved_port()?);
    let mut c = run(&["--listen", &addr]);
    let node = Node {
        child: Some(c.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?),
        addr,
    };
    wait_status(&node.addr, level).await?;
    for (kv, bucket, dir) in [
        (&main, "", store.path().to_path_buf()),
        (&notes, "notes", store.path().join("state/notes")),
        (&tally, "tally", store.path().join("state/tally")),
    ] {
        let want = bucket_contents(kv).await?;
        let seen = wait_seen(&node, bucket, |s| {
            s["entries"]
                .as_object()
                .is_some_and(|e| e.len() == want.len())
        })
        .await?;
        for (k, (v, _)) in &want {
            anyhow::ensure!(
                seen["entries"][k].as_str() == Some(String::from_utf8_lossy(v).as_ref()),
                "{bucket:?} {k}: {seen}"
            );
        }
        anyhow::ensure!(seen["violations"] == json!([]), "{seen}");
        if !bucket.is_empty() {
            let dumped = dump_store(&dir)?;
            anyhow::ensure!(
                first_difference(&want, &dumped).is_none(),
                "{bucket}'s fold: {:?}",
                first_difference(&want, &dumped)
            );
        }
    }
    Ok(())
}

/// `foldhost CMD ARGS…` that must succeed, its standard output as JSON.
fn json_of(mut c: std::process::Command, what: &str) -> anyhow::Result<Value> {
    let out = c.output()?;
    anyhow::ensure!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_artifact_carries_every_state_bucket_and_a_node_started_from_it_resumes_each_from_its_cursor()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let (_main, notes, _tally) = owner_buckets(&h, "art_main", 60).await?;
    notes.delete("n.07").await?;
    let tmp = tempfile::tempdir()?;
    let (art, m) = export_the_exporter(&h, tmp.path()).await?;
    the_manifest_holds_each_buckets_cursor(&h, &m).await?;
    // Written after the export: what a node started from it folds from the server.
    notes.put("n.after", "late".into()).await?;
    // Two nodes from the artifact: one as imported, one with its state folds removed (what a
    // node started from an artifact without them does: folds each bucket from the start).
    let mut nodes = Vec::new();
    for name in ["resumed", "refolded"] {
        nodes.push(a_node_from_the_artifact(&h, &notes, tmp.path(), &art, &m, name).await?);
    }
    // Resumed: one batch of notes (the write after the export), none of tally; refolded: every
    // entry again, ten to a batch.
    let got: Vec<(&str, Option<u64>, Option<u64>)> =
        nodes.iter().map(|(n, a, b, _)| (*n, *a, *b)).collect();
    anyhow::ensure!(
        got[0] == ("resumed", Some(1), Some(0)),
        "the imported node resumes each state bucket from its cursor: {got:?}"
    );
    anyhow::ensure!(
        got[1].1 >= Some(6) && got[1].2 >= Some(6),
        "without the artifact's state folds each bucket is folded again: {got:?}"
    );
    Ok(())
}

/// A node of `art_main` with the state owner guest, folding into `store`, ten updates to a batch.
fn start_from(h: &Harness, store: &Path) -> anyhow::Result<Node> {
    let addr = format!("127.0.0.1:{}", reserved_port()?);
    let mut c = run_command(h, "art_main", store, Some(&addr));
    c.arg("--guest")
        .arg(guest_wasm("state_owner"))
        .args(["--batch-max", "10"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(store.with_extension("log"))?);
    Ok(Node {
        child: Some(c.spawn()?),
        addr,
    })
}

/// The exporter, level with all three buckets, exported through its listener to `tmp`/art, and the
/// same state at rest at the same cursors; returns the artifact and its manifest.
async fn export_the_exporter(
    h: &Harness,
    tmp: &Path,
) -> anyhow::Result<(std::path::PathBuf, Value)> {
    // The exporter: level with all three buckets, exported through its listener.
    let mut exporter = start_from(h, &tmp.join("exporter"))?;
    wait_status(&exporter.addr, level).await?;
    let art = tmp.join("art");
    let mut export = foldhost();
    export
        .args(["export", "--listen", &exporter.addr, "--out"])
        .arg(&art);
    let m = json_of(export, "export --listen")?;
    exporter.stop()?;
    // At rest, the same state folds at the same cursors.
    let mut at_rest = foldhost();
    at_rest
        .args(["export", "--store"])
        .arg(tmp.join("exporter"))
        .arg("--out")
        .arg(tmp.join("at-rest.tar"));
    let rest = json_of(at_rest, "export --store")?;
    anyhow::ensure!(rest["state"] == m["state"], "{rest}\n{m}");
    Ok((art, m))
}

/// The manifest `m` holds each state bucket at its fold's cursor, with its keys and stream.
async fn the_manifest_holds_each_buckets_cursor(h: &Harness, m: &Value) -> anyhow::Result<()> {
    let want = [
        ("notes", last_sequence(&h.conn, NOTES).await?, 59),
        ("tally", last_sequence(&h.conn, TALLY).await?, 60),
    ];
    for (local, cursor, keys) in want {
        let entry = m["state"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["local"] == local)
            .ok_or_else(|| anyhow::anyhow!("{local} is not in the manifest: {m}"))?;
        anyhow::ensure!(
            entry["cursor"] == json!(cursor) && entry["keys"].as_u64() >= Some(keys),
            "{local} at its fold's cursor {cursor} with {keys} keys: {entry}"
        );
        anyhow::ensure!(
            entry["stream"]["name"] == json!(format!("KV_state_owner_{local}")),
            "{entry}"
        );
    }
    Ok(())
}

/// A node from the artifact `art` (manifest `m`): `resumed` as imported, `refolded` with its state
/// folds removed; once it folded the late write, returns its name, its notes and tally batches and
/// the node.
async fn a_node_from_the_artifact(
    h: &Harness,
    notes: &NatsKv,
    tmp: &Path,
    art: &Path,
    m: &Value,
    name: &'static str,
) -> anyhow::Result<(&'static str, Option<u64>, Option<u64>, Node)> {
    let store = tmp.join(name);
    let mut import = foldhost();
    import
        .args(["import", "--artifact"])
        .arg(art)
        .arg("--store")
        .arg(&store);
    let imported = json_of(import, "import")?;
    anyhow::ensure!(imported["state"] == m["state"], "{imported}");
    if name == "refolded" {
        std::fs::remove_dir_all(store.join("state"))?;
    } else {
        for local in ["notes", "tally"] {
            anyhow::ensure!(store.join("state").join(local).is_dir(), "{local} imported");
        }
    }
    let node = start_from(h, &store)?;
    let status = wait_status(&node.addr, level).await?;
    let want = bucket_contents(notes).await?;
    let seen = wait_seen(&node, "notes", |s| {
        s["entries"]
            .as_object()
            .is_some_and(|e| e.len() == want.len())
    })
    .await?;
    anyhow::ensure!(seen["entries"]["n.after"] == "late", "{name}: {seen}");
    anyhow::ensure!(seen["entries"].get("n.07").is_none(), "{name}: {seen}");
    let batches = |local: &str| {
        status
            .state_buckets
            .iter()
            .find(|b| b.local == local)
            .map(|b| b.batches)
    };
    Ok((name, batches("notes"), batches("tally"), node))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_bucket_whose_values_age_out_is_refused_at_start_in_one_line_naming_it()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    h.bucket("agemain").await?;
    // The bucket the reader reads, made by hand with an age limit: a node down longer than the
    // age would find its fold's cursor expired with nothing to restore it from.
    h.conn
        .bucket(
            NOTES,
            &BucketConfig {
                max_bytes: None,
                max_age: Some(std::time::Duration::from_secs(60)),
                ..BucketConfig::default()
            },
        )
        .await?;
    let tmp = tempfile::tempdir()?;
    let mut child = foldhost()
        .args(["run", "--bucket", "agemain", "--nats", &h.url(), "--store"])
        .arg(tmp.path().join("reader"))
        .arg("--guest")
        .arg(guest_wasm("state_reader"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    wait_until("the reader's node to exit", || {
        child.try_wait().ok().flatten().is_some()
    })
    .await
    .inspect_err(|_| {
        let _ = child.kill();
    })?;
    let out = child.wait_with_output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(
        err.contains("read bucket \"owner.notes\"") && err.contains("ages its values out"),
        "{err}"
    );
    Ok(())
}
