//! The floor guard's backstop and the multi-prefix scope, with the real binary on a real
//! nats-server.
//!
//! - **The backstop** (docs/spec.md WATCH-4, docs/design.md "Cursor-expiry repair", the floor guard
//!   row; `FloorGuard::backstop` in crates/foldhost-nats/src/floor.rs): with no delivery at all,
//!   a watch whose frontier the stream's first sequence has passed (`first > frontier + 1`, on a
//!   bucket that evicts current values: `protocol::floor_guard_trips`) is ended as expired by the
//!   periodic probe — logged as `floor_overrun`, repaired (REPAIR-1) and, with no artifact to
//!   restore from, stopped with the fold and its cursor untouched. A node whose records merely aged
//!   out after it folded them is spared: an emptied stream's first sequence is its last + 1, which
//!   is the level node's frontier + 1, so nothing was lost and the guard stays quiet. Only a scoped
//!   node can see the floor pass its cursor with no traffic at all (the writes after its cursor are
//!   outside its scope and never delivered to it), so the tripped node here has a multi-prefix
//!   scope: the guard works with that scope too.
//! - **The multi-prefix scope** (`--scope prefixes:P1,P2`, `WatchScope::Prefixes`): the node folds
//!   exactly the keys under its prefixes — puts, overwrites and deletes under each, none of the
//!   keys outside every prefix (one under a subject filter the scope needs, others only textually
//!   close) — and a restart resumes from its cursor as a delta, delivering exactly the in-scope
//!   writes made while it was stopped: no key lost, none gained.
//!
//! Every wait is on a condition (a status, the stream's positions), bounded at 120 s.

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use bytes::Bytes;
use foldhost_core::kv::{KvWriter, VersionToken};
use foldhost_core::status::StatusReport;
use foldhost_nats::NatsKv;
use foldhost_tests::{
    Contents, Harness, bucket_contents, dump_store, first_difference, run_command, set_max_age,
    status_store, terminate, wait_status,
};

/// A node this test started: stopped cleanly by [`Node::stop`], killed (by its own handle) when a
/// failed test drops it still running.
struct Node(Child);

impl Node {
    fn spawn(mut cmd: Command) -> anyhow::Result<Self> {
        Ok(Node(cmd.spawn()?))
    }

    /// SIGTERM (a clean stop), waited for.
    fn stop(&mut self) -> anyhow::Result<()> {
        terminate(&mut self.0)?;
        Ok(())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// A loopback address on a port reserved for this process, for `--listen`.
fn listen_addr() -> anyhow::Result<String> {
    Ok(format!(
        "127.0.0.1:{}",
        foldhost_localnats::reserved_port()?
    ))
}

/// Waits until every record has aged out and the stream's first sequence has passed
/// `cursor + 1` (the first revision a resume from `cursor` would need); returns that first
/// sequence. The deadline only bounds a test that would otherwise hang.
async fn wait_floor_past(kv: &NatsKv, cursor: u64) -> anyhow::Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let p = kv.positions().await?;
        if p.messages == 0 && p.first_sequence > cursor + 1 {
            return Ok(p.first_sequence);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "waited 120 s for the stream's first sequence to pass {cursor} + 1: {p:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The revision a put answered.
fn revision(v: VersionToken) -> anyhow::Result<u64> {
    v.as_u64()
        .ok_or_else(|| anyhow::anyhow!("a put answered no revision"))
}

/// The JSON log lines in `path` naming `event` (a line that is not JSON is skipped).
fn events(path: &Path, event: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    Ok(std::fs::read_to_string(path)?
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == event)
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_delivery_the_backstop_ends_a_watch_once_the_stream_floor_passes_its_cursor_and_spares_a_level_one()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    // Evicting from the start (an age limit), long enough that nothing ages out before both nodes
    // have folded it; shortened once they have.
    let kv = h.aging_bucket("quiet", Duration::from_secs(3600)).await?;
    let q = write_the_quiet_bucket(&kv).await?;
    let (scoped_last, last) = (q.scoped_last, q.last);

    let tmp = tempfile::tempdir()?;
    // The whole-bucket node, started first: its backstop probes come before the scoped node's.
    let whole = tmp.path().join("whole");
    let whole_log = tmp.path().join("whole.log");
    let wa = listen_addr()?;
    let mut whole_node = spawn_quiet_node(&h, &whole, &whole_log, &wa, &[])?;
    let whole_level =
        wait_status(&wa, |s| s.caught_up && s.cursor.is_some_and(|c| c >= last)).await?;
    assert_eq!(whole_level.cursor, Some(last));

    // The scoped node: two prefixes.
    let scoped = tmp.path().join("scoped");
    let scoped_log = tmp.path().join("scoped.log");
    let sa = listen_addr()?;
    let mut scoped_node = spawn_quiet_node(
        &h,
        &scoped,
        &scoped_log,
        &sa,
        &["--scope", "prefixes:a.,b."],
    )?;
    let scoped_level = wait_status(&sa, |s| {
        s.caught_up && s.cursor.is_some_and(|c| c >= scoped_last)
    })
    .await?;
    let cursor = scoped_level.cursor.unwrap_or_default();
    anyhow::ensure!(
        cursor == scoped_last,
        "the scoped node's cursor is its last in-scope revision {scoped_last}: {scoped_level:?}"
    );

    // No writes from here on: the operator shortens max_age and every record ages out.
    set_max_age(&kv, "quiet", Duration::from_secs(2)).await?;
    let first = wait_floor_past(&kv, cursor).await?;
    assert_eq!(
        first,
        last + 1,
        "an emptied stream's first sequence is its last + 1: past the scoped cursor + 1, and \
         exactly the whole-bucket node's cursor + 1"
    );

    the_scoped_node_fails_expired(&sa, cursor, first, &scoped_level).await?;
    the_whole_node_runs_on(&wa, last, &whole_level).await?;

    scoped_node.stop()?;
    whole_node.stop()?;

    only_the_scoped_node_tripped(&scoped_log, &whole_log, cursor, first)?;
    both_folds_keep_what_they_folded(&scoped, &whole, cursor, &q)
}

/// What the quiet bucket holds: ten keys in the scoped node's prefixes, then five outside them.
struct Quiet {
    /// The last in-scope revision.
    scoped_last: u64,
    /// The stream's last revision.
    last: u64,
    all: Contents,
    scoped_want: Contents,
}

/// Writes the quiet bucket: in scope of the scoped node first, then outside it.
async fn write_the_quiet_bucket(kv: &NatsKv) -> anyhow::Result<Quiet> {
    let mut scoped_last = 0;
    for i in 0..5 {
        for p in ["a", "b"] {
            scoped_last = revision(
                kv.put(&format!("{p}.{i}"), format!("{p}{i}").into())
                    .await?,
            )?;
        }
    }
    // After the scoped node's last in-scope revision: writes outside its scope, never delivered
    // to it, so its frontier stays at `scoped_last` while the stream goes on to `last`.
    for i in 0..5 {
        kv.put(&format!("other.{i}"), "out of scope".into()).await?;
    }
    let last = kv.positions().await?.last_sequence;
    anyhow::ensure!(
        last == scoped_last + 5,
        "last {last}, in scope {scoped_last}"
    );
    let all = bucket_contents(kv).await?;
    let scoped_want: Contents = all
        .clone()
        .into_iter()
        .filter(|(k, _)| k.starts_with("a.") || k.starts_with("b."))
        .collect();
    assert_eq!((all.len(), scoped_want.len()), (15, 10));
    Ok(Quiet {
        scoped_last,
        last,
        all,
        scoped_want,
    })
}

/// A node folding the quiet bucket into `store`, listening on `addr`, with `scope` flags and its
/// warnings logged as JSON to `log`.
fn spawn_quiet_node(
    h: &Harness,
    store: &Path,
    log: &Path,
    addr: &str,
    scope: &[&str],
) -> anyhow::Result<Node> {
    let mut cmd = run_command(h, "quiet", store, Some(addr));
    cmd.args(scope)
        .args(["--log-format", "json"])
        .env("FOLDHOST_LOG", "warn")
        .stderr(std::fs::File::create(log)?);
    Node::spawn(cmd)
}

/// The scoped node ends its watch as expired at its cursor and stops, nothing delivered.
async fn the_scoped_node_fails_expired(
    sa: &str,
    cursor: u64,
    first: u64,
    scoped_level: &StatusReport,
) -> anyhow::Result<()> {
    // The scoped node: nothing is delivered to it, so only the backstop can notice. It ends the
    // watch as expired; the repair has no artifact to restore from, and the node stops.
    let failed = wait_status(sa, |s| s.state == "failed").await?;
    let expired = format!(
        "cursor expired: resume needs revision {} but the stream's first retained revision is {first}",
        cursor + 1
    );
    assert!(
        failed
            .error
            .as_deref()
            .unwrap_or_default()
            .contains(&expired),
        "{failed:?}"
    );
    assert_eq!(
        failed.delivered, scoped_level.delivered,
        "nothing was delivered to the scoped node once it was level"
    );
    assert_eq!(
        failed.cursor,
        Some(cursor),
        "the cursor never moved past the loss"
    );
    Ok(())
}

/// The whole-bucket node runs on, unrepaired, at the cursor it had.
async fn the_whole_node_runs_on(
    wa: &str,
    last: u64,
    whole_level: &StatusReport,
) -> anyhow::Result<()> {
    // The whole-bucket node read the same eviction (its memo is committed) and its backstop probe,
    // due before the scoped node's, found the floor at its frontier + 1: it runs on, unrepaired.
    let whole_now = wait_status(wa, |s| s.eviction_seen).await?;
    assert_eq!(whole_now.state, "running", "{whole_now:?}");
    assert_eq!(whole_now.repairs, 0, "{whole_now:?}");
    assert_eq!(whole_now.cursor, Some(last));
    assert_eq!(whole_now.delivered, whole_level.delivered);
    Ok(())
}

/// The scoped node's log says its floor guard tripped and a repair started; the whole-bucket
/// node's says neither.
fn only_the_scoped_node_tripped(
    scoped_log: &Path,
    whole_log: &Path,
    cursor: u64,
    first: u64,
) -> anyhow::Result<()> {
    let overruns = events(scoped_log, "floor_overrun")?;
    let overrun = overruns.first().ok_or_else(|| {
        anyhow::anyhow!(
            "the scoped node logged no floor_overrun:\n{}",
            std::fs::read_to_string(scoped_log).unwrap_or_default()
        )
    })?;
    assert_eq!(overrun["frontier"].as_u64(), Some(cursor), "{overrun}");
    assert_eq!(overrun["first_sequence"].as_u64(), Some(first), "{overrun}");
    assert!(
        !events(scoped_log, "repair_started")?.is_empty(),
        "the trip started a repair"
    );
    assert!(
        events(whole_log, "floor_overrun")?.is_empty()
            && events(whole_log, "repair_started")?.is_empty(),
        "the whole-bucket node's guard tripped:\n{}",
        std::fs::read_to_string(whole_log)?
    );
    Ok(())
}

/// Both folds keep what they folded: nothing was deleted for having aged out.
fn both_folds_keep_what_they_folded(
    scoped: &Path,
    whole: &Path,
    cursor: u64,
    q: &Quiet,
) -> anyhow::Result<()> {
    let (last, all, scoped_want) = (q.last, &q.all, &q.scoped_want);
    assert_eq!(status_store(scoped)?.cursor, Some(cursor));
    assert_eq!(
        first_difference(scoped_want, &dump_store(scoped)?),
        None,
        "the scoped fold is untouched"
    );
    assert_eq!(status_store(whole)?.cursor, Some(last));
    assert_eq!(
        first_difference(all, &dump_store(whole)?),
        None,
        "the whole-bucket fold is untouched"
    );
    Ok(())
}

/// The multi-prefix scope of the second test, as its definition: a key starting with either
/// prefix (computed here, not by the code under test).
fn in_multi_scope(key: &str) -> bool {
    key.starts_with("a.") || key.starts_with("b.x")
}

/// `contents` restricted to the multi-prefix scope.
fn in_scope(contents: Contents) -> Contents {
    contents
        .into_iter()
        .filter(|(k, _)| in_multi_scope(k))
        .collect()
}

fn keys(c: &Contents) -> Vec<&str> {
    c.keys().map(String::as_str).collect()
}

/// Writes `ops` in order (a value: a put; `None`: a delete); returns how many are in scope.
async fn write_ops(kv: &NatsKv, ops: &[(&str, Option<&str>)]) -> anyhow::Result<u64> {
    let mut in_scope = 0;
    for &(key, value) in ops {
        match value {
            Some(v) => {
                kv.put(key, Bytes::copy_from_slice(v.as_bytes())).await?;
            }
            None => {
                kv.delete(key).await?;
            }
        }
        if in_multi_scope(key) {
            in_scope += 1;
        }
    }
    Ok(in_scope)
}

/// An in-scope put written last, so a node whose cursor reaches its revision has folded
/// everything before it.
async fn mark(kv: &NatsKv, round: u32) -> anyhow::Result<u64> {
    revision(kv.put("a.mark", format!("round {round}").into()).await?)
}

/// `foldhost run` of the `multi` bucket with the two prefixes `a.` and `b.x` (the second ends
/// inside a token: its subject filter `b.>` also delivers `b.y`, which the node must drop).
fn multi_node(h: &Harness, store: &Path, listen: &str) -> Command {
    let mut c = run_command(h, "multi", store, Some(listen));
    c.args(["--scope", "prefixes:a.,b.x"]);
    c
}

/// Before the node starts: puts under each prefix and outside both (`b.y` under the filter `b.>`,
/// `bx`, `aa.1` and `a` only textually close), then overwrites and deletes on both sides.
const BEFORE_THE_START: &[(&str, Option<&str>)] = &[
    ("a.1", Some("1")),
    ("a.2", Some("1")),
    ("a.3", Some("1")),
    ("b.x", Some("1")),
    ("b.xy", Some("1")),
    ("b.x.1", Some("1")),
    ("b.y", Some("out")),
    ("bx", Some("out")),
    ("c.1", Some("out")),
    ("aa.1", Some("out")),
    ("a", Some("out")),
    ("a.1", Some("2")),
    ("b.xy", Some("2")),
    ("a.3", None),
    ("c.1", None),
    ("b.y", Some("out 2")),
];

/// Live: the same mix while the node follows.
const WHILE_FOLLOWING: &[(&str, Option<&str>)] = &[
    ("a.4", Some("1")),
    ("b.x.1", Some("2")),
    ("a.2", None),
    ("b.xy", None),
    ("c.2", Some("out")),
    ("b.z", Some("out")),
    ("bx", Some("out 2")),
    ("a.1", Some("3")),
    ("aa.1", None),
];

/// Stopped: writes in and out of scope.
const WHILE_STOPPED: &[(&str, Option<&str>)] = &[
    ("a.5", Some("1")),
    ("a.4", None),
    ("b.x", Some("2")),
    ("b.x.1", None),
    ("c.3", Some("out")),
    ("b.y", None),
    ("aa.2", Some("out")),
    ("b.xz", Some("1")),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_prefix_node_folds_exactly_its_prefixes_and_resumes_from_its_cursor_without_losing_or_gaining_keys()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    // History kept: no message after a cursor is superseded away, so a restart is a plain resume.
    let kv = h.bucket_with_history("multi", 8).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("node");

    // Before the node starts: puts under each prefix and outside both (`b.y` under the filter
    // `b.>`, `bx`, `aa.1` and `a` only textually close), then overwrites and deletes on both sides.
    write_ops(&kv, BEFORE_THE_START).await?;
    let m1 = mark(&kv, 1).await?;
    let first_addr = listen_addr()?;
    let mut node = Node::spawn(multi_node(&h, &store, &first_addr))?;
    wait_status(&first_addr, |s| {
        s.caught_up && s.cursor.is_some_and(|c| c >= m1)
    })
    .await?;

    // Live: the same mix while the node follows.
    write_ops(&kv, WHILE_FOLLOWING).await?;
    let m2 = mark(&kv, 2).await?;
    wait_status(&first_addr, |s| s.cursor.is_some_and(|c| c >= m2)).await?;
    node.stop()?;
    let want = in_scope(bucket_contents(&kv).await?);
    assert_eq!(keys(&want), ["a.1", "a.4", "a.mark", "b.x", "b.x.1"]);
    assert_eq!(
        first_difference(&want, &dump_store(&store)?),
        None,
        "the fold is exactly the bucket under the two prefixes"
    );
    assert_eq!(status_store(&store)?.cursor, Some(m2));

    // Stopped: writes in and out of scope, then a restart from the cursor.
    let while_stopped = write_ops(&kv, WHILE_STOPPED).await?;
    assert_eq!(while_stopped, 5);
    let m3 = mark(&kv, 3).await?;
    let second_addr = listen_addr()?;
    let mut node = Node::spawn(multi_node(&h, &store, &second_addr))?;
    let resumed = wait_status(&second_addr, |s| {
        s.caught_up && s.cursor.is_some_and(|c| c >= m3)
    })
    .await?;
    assert_eq!(resumed.repairs, 0, "a plain resume: {resumed:?}");
    assert_eq!(
        resumed.delivered,
        while_stopped + 1,
        "the resume delivered exactly the in-scope writes after the cursor (the mark included): \
         {resumed:?}"
    );
    node.stop()?;

    let all = bucket_contents(&kv).await?;
    for outside in ["a", "aa.2", "b.z", "bx", "c.2", "c.3"] {
        assert!(all.contains_key(outside), "{outside} is live in the bucket");
    }
    let want = in_scope(all);
    assert_eq!(keys(&want), ["a.1", "a.5", "a.mark", "b.x", "b.xz"]);
    assert_eq!(
        first_difference(&want, &dump_store(&store)?),
        None,
        "after the restart the fold is still exactly the bucket under the two prefixes"
    );
    assert_eq!(status_store(&store)?.cursor, Some(m3));
    Ok(())
}
