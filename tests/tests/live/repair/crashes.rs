//! A crash at every point of a restore or a listing diff reruns it on restart to the same result.

use super::*;

/// The log lines that open and close a repair, and the one every committed batch writes.
const REPAIR_START: &str = "cursor expired: repairing";
const REPAIR_DONE: &str = "cursor-expiry repair done";
const BATCH: &str = "batch parsed and applied";

/// How many batches the repair of `cmd` commits: the committed-batch lines between its start and
/// done lines, counted in the finished run's log (the count depends on the data, not on timing).
fn repair_batches(mut cmd: std::process::Command) -> anyhow::Result<usize> {
    let o = cmd
        .env("FOLDHOST_LOG", "warn,foldhost_fold::applied=debug")
        .output()?;
    ok(&o, "measuring run")?;
    let log = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = log.lines().collect();
    let start = lines.iter().position(|l| l.contains(REPAIR_START));
    let done = lines.iter().position(|l| l.contains(REPAIR_DONE));
    match (start, done) {
        (Some(a), Some(b)) => Ok(lines[a..b].iter().filter(|l| l.contains(BATCH)).count()),
        _ => anyhow::bail!("the measuring run logged no repair:\n{log}"),
    }
}

/// Crashes a repair of a copy of `node` at the crash point `point` (a repair-batch point) after
/// each fraction of the batches one whole repair commits, and after the last of them; and once
/// at [`crashpoint::RESTORE_BEFORE_CURSOR`] when `restore` is set. After every crash the fold's
/// cursor is where it was before the repair (no repair moves the cursor early), and a re-run ends
/// at `want`.
async fn crashes_inside_the_repair_converge(
    cmd: &dyn Fn(&Path) -> std::process::Command,
    node: &Path,
    scratch: &Path,
    want: &Contents,
    point: &'static str,
    fractions: &[f64],
) -> anyhow::Result<()> {
    let measured = scratch.join("measured");
    copy_dir(node, &measured)?;
    let batches = repair_batches(cmd(&measured))?;
    assert!(
        batches >= 20,
        "a repair of {batches} batches is too short to crash inside"
    );
    assert_eq!(first_difference(want, &dump_store(&measured)?), None);
    let before = status_store(node)?.cursor;
    let mut arms: Vec<(&'static str, usize)> = fractions
        .iter()
        .map(|f| (point, ((batches as f64 * f) as usize).clamp(1, batches)))
        .collect();
    arms.push((point, batches));
    if point == crashpoint::RESTORE_BATCH {
        arms.push((crashpoint::RESTORE_BEFORE_CURSOR, 1));
    }
    for (i, (at, n)) in arms.into_iter().enumerate() {
        let dir = scratch.join(format!("crashed{i}"));
        copy_dir(node, &dir)?;
        run_to_crash(cmd(&dir), at, n as u64)?;
        assert_eq!(
            status_store(&dir)?.cursor,
            before,
            "the cursor moved before the repair finished (crashed at {at}:{n} of {batches} batches)"
        );
        let o = cmd(&dir).output()?;
        ok(
            &o,
            &format!("re-run after a crash at {at}:{n} ({batches} batches)"),
        )?;
        assert_eq!(
            first_difference(want, &dump_store(&dir)?),
            None,
            "crashed at {at}:{n} of {batches} batches"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_every_point_of_a_restore_reruns_it_on_restart_to_the_same_result()
-> anyhow::Result<()> {
    let mut e = evicted("crashrestore", 20_000, 15_000, 2_000).await?;
    let arts = e.artifacts.display().to_string();
    let want = dump_store(&e.exporter)?;
    terminate(&mut e.host)?;
    let url = e.h.url();
    let cmd = |dir: &Path| {
        let mut c = foldhost();
        c.args([
            "run",
            "--bucket",
            "crashrestore",
            "--nats",
            &url,
            "--catch-up",
        ])
        .args(["--restore-from", &arts, "--store"])
        .arg(dir);
        c
    };
    crashes_inside_the_repair_converge(
        &cmd,
        &e.node,
        e.tmp.path(),
        &want,
        crashpoint::RESTORE_BATCH,
        &[0.0, 0.35, 0.7],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_inside_a_listing_diff_reruns_it_on_restart_to_the_same_result()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("crashrelist").await?;
    let js = kv.jetstream().clone();
    publish_all(
        &js,
        (0..20_000u32).map(|i| {
            let k = if i % 4 == 0 { "del" } else { "keep" };
            (format!("$KV.crashrelist.{k}.{i:06}"), "v1".into())
        }),
    )
    .await?;
    let tmp = tempfile::tempdir()?;
    let node = tmp.path().join("node");
    ok(&catch_up(&h, "crashrelist", &node, &[])?, "first catch-up")?;
    // Delete every del.* key, rewrite every keep.* key, purge the delete markers: expired.
    for i in (0..20_000u32).step_by(4) {
        kv.delete(&format!("del.{i:06}")).await?;
    }
    publish_all(
        &js,
        (0..20_000u32)
            .filter(|i| i % 4 != 0)
            .map(|i| (format!("$KV.crashrelist.keep.{i:06}"), "v2".into())),
    )
    .await?;
    let stream = kv.jetstream().get_stream("KV_crashrelist").await?;
    stream.purge().filter("$KV.crashrelist.del.>").await?;
    let want = bucket_contents(&kv).await?;
    assert_eq!(want.len(), 15_000);
    let url = h.url();
    let cmd = |dir: &Path| {
        let mut c = foldhost();
        c.args([
            "run",
            "--bucket",
            "crashrelist",
            "--nats",
            &url,
            "--catch-up",
            "--store",
        ])
        .arg(dir);
        c
    };
    crashes_inside_the_repair_converge(
        &cmd,
        &node,
        tmp.path(),
        &want,
        crashpoint::RELIST_BATCH,
        &[0.0, 0.5],
    )
    .await
}
