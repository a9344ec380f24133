//! A guest's state on the bus (docs/state.md), on a real nats-server whose users hold exactly what
//! `foldhost grants --guest` composes: an owner keeps state in buckets it declares and a reader
//! follows one of them; every host-side refusal fires before anything is published; a reader sees
//! the current values (never a deletion) then one end-of-current, then changes; a node killed
//! mid-fold over three buckets resumes each from its own cursor.

use std::path::Path;
use std::process::Stdio;

use foldhost_core::bucket::{BucketConfig, ConnectOptions};
use foldhost_core::kv::KvWriter as _;
use foldhost_localnats::{LocalNats, reserved_port};
use foldhost_nats::{NatsConnection, NatsKv};
use foldhost_tests::*;

use crate::users::{self, url_as, violations};
use serde_json::{Value, json};

/// The owner's and the reader's main buckets (each folds its own).
const OWNER_MAIN: &str = "owner_main";
const READER_MAIN: &str = "reader_main";
/// The server buckets the owner's declarations derive.
const NOTES: &str = "state_owner_notes";
const TALLY: &str = "state_owner_tally";
const MINE: &str = "state_reader_mine";

/// `foldhost grants --bucket MAIN --guest GUEST --json` as a `permissions` block.
fn grants_for(main: &str, guest: &str) -> anyhow::Result<String> {
    let out = foldhost()
        .args(["grants", "--bucket", main, "--json", "--guest"])
        .arg(guest_wasm(guest))
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "grants failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout)?;
    let list = |k: &str| -> String {
        v[k].as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(|s| format!("{s:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    Ok(format!(
        "permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }} }}",
        list("publish"),
        list("subscribe")
    ))
}

/// A server whose users are `admin` (everything), `owner` and `reader` (their composed grants).
fn server(log: &Path) -> anyhow::Result<LocalNats> {
    let owner = grants_for(OWNER_MAIN, "state_owner")?;
    let reader = grants_for(READER_MAIN, "state_reader")?;
    users::server(log, &[("owner", owner), ("reader", reader)])
}

/// The node runs, every fold (the main bucket and each declared one) level with its stream (a
/// node's state buckets are folded level before it answers at all).
fn level(s: &foldhost_core::status::StatusReport) -> bool {
    s.state == "running"
        && s.cursor.is_some()
        && s.lag == 0
        && s.state_buckets.iter().all(|b| !b.declared || b.lag == 0)
}

/// `foldhost state list --store STORE --json`, as `[local, declared]` pairs.
fn state_list(store: &Path) -> anyhow::Result<Value> {
    let out = foldhost()
        .args(["state", "list", "--json", "--store"])
        .arg(store)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "state list: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<foldhost_core::status::StateBucketReport> = serde_json::from_slice(&out.stdout)?;
    Ok(rows
        .into_iter()
        .map(|b| json!([b.local, b.declared]))
        .collect())
}

/// A node process, killed if the test fails before it stops it.
struct Node {
    child: Option<std::process::Child>,
    addr: String,
}

impl Node {
    fn stop(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| anyhow::anyhow!("stopped twice"))?;
        terminate(&mut child)
    }

    /// `POST /query` with a JSON request: the guest's JSON answer.
    async fn ask(&self, request: Value) -> anyhow::Result<Value> {
        let body = request.to_string();
        let (code, answer) =
            foldhost::serve::call(&self.addr, "POST", "/query", body.as_bytes()).await?;
        anyhow::ensure!(
            code == 200,
            "{request}: HTTP {code}: {}",
            String::from_utf8_lossy(&answer)
        );
        Ok(serde_json::from_slice(&answer)?)
    }

    /// The guest's view of `bucket`: what it was handed through `apply`.
    async fn seen(&self, bucket: &str) -> anyhow::Result<Value> {
        self.ask(json!({"op": "seen", "bucket": bucket})).await
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `guest` as `user` folding `main` into `store`, with `extra` flags; waits until it runs.
async fn start(
    server: &LocalNats,
    user: &str,
    main: &str,
    guest: &str,
    store: &Path,
    extra: &[&str],
) -> anyhow::Result<Node> {
    let addr = format!("127.0.0.1:{}", reserved_port()?);
    let log = store.with_extension("log");
    let child = foldhost()
        .args(["run", "--bucket", main, "--nats", &url_as(server, user)])
        .arg("--store")
        .arg(store)
        .arg("--guest")
        .arg(guest_wasm(guest))
        .args(["--listen", &addr])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let node = Node {
        child: Some(child),
        addr,
    };
    if let Err(e) = wait_status(&node.addr, level).await {
        let said = std::fs::read_to_string(&log).unwrap_or_default();
        anyhow::bail!("{user}'s node did not come level: {e}; it said: {said}");
    }
    Ok(node)
}

/// Waits until the guest's view of `bucket` satisfies `done`.
async fn wait_seen(
    node: &Node,
    bucket: &str,
    done: impl Fn(&Value) -> bool,
) -> anyhow::Result<Value> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        // An answer other than 200 ("guest rebuilding" after a trap) is waited out too.
        let seen = node.seen(bucket).await;
        if let Ok(seen) = &seen
            && done(seen)
        {
            return Ok(seen.clone());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the guest's view of {bucket} never got there: {seen:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The refusal's reason in a guest's answer, if it was refused.
fn refused(answer: &Value) -> Option<&str> {
    answer["refused"]["reason"].as_str()
}

/// The last sequence of the stream behind `bucket`, as the admin sees it.
async fn last_sequence(admin: &NatsConnection, bucket: &str) -> anyhow::Result<u64> {
    let kv = admin
        .bucket(
            bucket,
            &BucketConfig {
                create: false,
                ..BucketConfig::default()
            },
        )
        .await?;
    Ok(kv.positions().await?.last_sequence)
}

/// Consumers on the streams of `buckets`, as the admin sees them.
async fn consumers(admin: &NatsConnection, buckets: &[&str]) -> anyhow::Result<usize> {
    let js = async_nats::jetstream::new(admin.client().await?);
    let mut n = 0;
    for b in buckets {
        n += js
            .get_stream(format!("KV_{b}"))
            .await?
            .info()
            .await?
            .state
            .consumer_count;
    }
    Ok(n)
}

async fn main_bucket(admin: &NatsConnection, name: &str) -> anyhow::Result<std::sync::Arc<NatsKv>> {
    let kv = admin.bucket(name, &BucketConfig::default()).await?;
    kv.put("seed", "1".into()).await?;
    Ok(kv)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_keeps_state_a_reader_follows_it_and_every_refusal_comes_before_a_publish()
-> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let log = tmp.path().join("server.log");
    let server = server(&log)?;
    let admin = NatsConnection::open(ConnectOptions::new(url_as(&server, "admin"))).await?;
    main_bucket(&admin, OWNER_MAIN).await?;
    main_bucket(&admin, READER_MAIN).await?;

    // The owner, with a small bucket cap and writes attempted from parse and apply.
    let owner_store = tmp.path().join("owner");
    let cap = "65536";
    let mut owner = start(
        &server,
        "owner",
        OWNER_MAIN,
        "state_owner",
        &owner_store,
        &[
            "--state-max-bucket",
            cap,
            "--guest-config",
            "write-in-parse=1",
            "--guest-config",
            "write-in-apply=1",
            // Room for a write from `query` to wait for the fold on a loaded machine.
            "--guest-deadline-ms",
            "30000",
        ],
    )
    .await?;
    // A write from `query` with `wait-ms`, once the query instance answers queries: the fold is
    // free to apply it while the query waits, so it answers `applied`. (Were the query answered
    // on the fold's path, the fold could not apply the write until the query returned: a wait
    // there would run out, and the answer would be `pending`.)
    wait_status(&owner.addr, |s| s.query_instance_revision.is_some()).await?;
    let waited = owner
        .ask(json!({"op": "put", "bucket": "notes", "key": "waited", "value": "w", "wait_ms": 25000}))
        .await?;
    anyhow::ensure!(
        waited["ok"]["outcome"] == "applied",
        "a query's write waiting for this node's fold: {waited}"
    );
    owner
        .ask(json!({"op": "delete", "bucket": "notes", "key": "waited", "wait_ms": 25000}))
        .await?;
    // Every verb, on its own bucket.
    let put = owner
        .ask(json!({"op": "put", "bucket": "notes", "key": "a", "value": "1"}))
        .await?;
    anyhow::ensure!(
        ["pending", "applied"].contains(&put["ok"]["outcome"].as_str().unwrap_or_default()),
        "the owner's put: {put}"
    );
    owner
        .ask(json!({"op": "put", "bucket": "notes", "key": "gone", "value": "x"}))
        .await?;
    let deleted = owner
        .ask(json!({"op": "delete", "bucket": "notes", "key": "gone"}))
        .await?;
    anyhow::ensure!(
        deleted["ok"]["op_id"].is_string(),
        "the owner's delete: {deleted}"
    );
    wait_seen(&owner, "notes", |s| {
        s["entries"]["a"] == "1"
            && s["entries"].get("gone").is_none()
            && s["events"]
                .as_array()
                .is_some_and(|e| e.iter().any(|x| x == "chg:del:gone"))
    })
    .await?;
    let got = owner
        .ask(json!({"op": "get", "bucket": "notes", "key": "a"}))
        .await?;
    anyhow::ensure!(got["ok"]["value"] == "1", "the owner's get: {got}");
    let keys = owner.ask(json!({"op": "keys", "bucket": "notes"})).await?;
    anyhow::ensure!(keys["ok"] == json!(["a"]), "the owner's keys: {keys}");

    // Each host-side refusal, with its reason, and nothing reaches the server.
    let before = last_sequence(&admin, NOTES).await?;
    let big = "x".repeat(300 * 1024);
    let half = "y".repeat(40 * 1024);
    for (request, reason) in [
        (
            json!({"op": "put", "bucket": "nope", "key": "k", "value": "v"}),
            "undeclared",
        ),
        (
            json!({"op": "put", "bucket": "notes", "key": "k", "value": big}),
            "too_large",
        ),
        (
            json!({"op": "put", "bucket": "notes", "key": "k", "value": "{\"db\": {\"Password\": \"hunter2\"}}"}),
            "credential",
        ),
        (
            json!({"op": "put", "bucket": "notes", "key": "k", "value": "v", "ttl_ms": 1000}),
            "no_ttl",
        ),
    ] {
        let answer = owner.ask(request.clone()).await?;
        anyhow::ensure!(refused(&answer) == Some(reason), "{request}: {answer}");
        anyhow::ensure!(
            answer["refused"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "a refusal says why: {answer}"
        );
    }
    // The bucket's cap: a first 40 KiB fits under 64 KiB, a second does not.
    let first = owner
        .ask(json!({"op": "put", "bucket": "notes", "key": "h1", "value": half}))
        .await?;
    anyhow::ensure!(first["ok"].is_object(), "{first}");
    wait_seen(&owner, "notes", |s| s["entries"].get("h1").is_some()).await?;
    let before_full = last_sequence(&admin, NOTES).await?;
    anyhow::ensure!(
        before_full == before + 1,
        "only the admitted write was published"
    );
    let second = owner
        .ask(json!({"op": "put", "bucket": "notes", "key": "h2", "value": half}))
        .await?;
    anyhow::ensure!(refused(&second) == Some("bucket_full"), "{second}");
    // Writes from parse and apply (asked by the guest's configuration on every main batch).
    let log_answer = owner.ask(json!({"op": "log"})).await?;
    let refusals: Vec<&str> = log_answer["refusals"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    anyhow::ensure!(
        refusals.contains(&"parse:wrong_call") && refusals.contains(&"apply:wrong_call"),
        "writes from parse and apply are refused: {log_answer}"
    );
    anyhow::ensure!(
        last_sequence(&admin, NOTES).await? == before_full,
        "no refused write reached the server"
    );

    // The reader starts after the owner wrote: it is handed the current values — not the key
    // deleted before it ever ran — then one end-of-current.
    let reader_store = tmp.path().join("reader");
    let mut reader = start(
        &server,
        "reader",
        READER_MAIN,
        "state_reader",
        &reader_store,
        &[],
    )
    .await?;
    let seen = reader.seen("owner.notes").await?;
    let events: Vec<&str> = seen["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    anyhow::ensure!(
        seen["eoc"] == true && seen["violations"] == json!([]),
        "current values then one end-of-current: {seen}"
    );
    let eoc_at = events.iter().position(|e| *e == "eoc");
    anyhow::ensure!(
        events.iter().filter(|e| **e == "eoc").count() == 1
            && eoc_at == Some(events.len() - 1)
            && events
                .iter()
                .all(|e| *e == "eoc" || e.starts_with("cur:put:"))
            && !events.iter().any(|e| e.ends_with(":gone")),
        "the reader's first view: {seen}"
    );
    anyhow::ensure!(seen["entries"]["a"] == "1", "{seen}");
    // A change afterwards reaches it, as a change.
    owner
        .ask(json!({"op": "put", "bucket": "notes", "key": "b", "value": "2"}))
        .await?;
    wait_seen(&reader, "owner.notes", |s| {
        s["entries"]["b"] == "2"
            && s["events"]
                .as_array()
                .is_some_and(|e| e.iter().any(|x| x == "chg:put:b"))
    })
    .await?;
    // The reader reads and lists the owner's bucket; its writes are refused by the host.
    let got = reader
        .ask(json!({"op": "get", "bucket": "owner.notes", "key": "b"}))
        .await?;
    anyhow::ensure!(got["ok"]["value"] == "2", "{got}");
    let keys = reader
        .ask(json!({"op": "keys", "bucket": "owner.notes"}))
        .await?;
    anyhow::ensure!(
        keys["ok"].as_array().is_some_and(|k| k.len() == 3),
        "{keys}"
    );
    let notes_before = last_sequence(&admin, NOTES).await?;
    for op in ["put", "delete"] {
        let answer = reader
            .ask(json!({"op": op, "bucket": "owner.notes", "key": "b", "value": "x"}))
            .await?;
        anyhow::ensure!(refused(&answer) == Some("read_only"), "{op}: {answer}");
    }
    // Its own bucket it writes.
    let mine = reader
        .ask(json!({"op": "put", "bucket": "mine", "key": "m", "value": "1"}))
        .await?;
    anyhow::ensure!(mine["ok"].is_object(), "{mine}");
    anyhow::ensure!(
        last_sequence(&admin, NOTES).await? == notes_before
            && violations(&log, "reader").is_empty(),
        "the host refused before any publish: no message, no violation"
    );
    reader.stop()?;

    // Forced past the host's check, the same write is refused by the server: `permission`,
    // naming the subject — not a timeout.
    let mut forced = start(
        &server,
        "reader",
        READER_MAIN,
        "state_reader",
        &reader_store,
        &["--state-unchecked-writes"],
    )
    .await?;
    let answer = forced
        .ask(json!({"op": "put", "bucket": "owner.notes", "key": "b", "value": "x"}))
        .await?;
    anyhow::ensure!(
        refused(&answer) == Some("permission")
            && answer["refused"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(NOTES)),
        "the server's refusal: {answer}"
    );
    anyhow::ensure!(
        !violations(&log, "reader").is_empty(),
        "the server logged it"
    );
    forced.stop()?;
    owner.stop()?;

    // Restarted, each resumes its folds; stopped, none leaves a consumer behind.
    let mut owner = start(
        &server,
        "owner",
        OWNER_MAIN,
        "state_owner",
        &owner_store,
        &["--state-max-bucket", cap],
    )
    .await?;
    let seen = owner.seen("notes").await?;
    anyhow::ensure!(
        seen["entries"]["b"] == "2" && seen["entries"].get("gone").is_none(),
        "{seen}"
    );
    let mut reader = start(
        &server,
        "reader",
        READER_MAIN,
        "state_reader",
        &reader_store,
        &[],
    )
    .await?;
    let seen = reader.seen("mine").await?;
    anyhow::ensure!(seen["entries"]["m"] == "1", "{seen}");
    // A trap drops the reader's instance; the next is hydrated from every bucket's fold.
    let trapped =
        foldhost::serve::call(&reader.addr, "POST", "/query", br#"{"op":"trap"}"#).await?;
    anyhow::ensure!(trapped.0 != 200, "the trap answered {trapped:?}");
    let hydrations = |s: &Value| s["eoc"] == true;
    let seen = wait_seen(&reader, "owner.notes", hydrations).await?;
    let events: Vec<&str> = seen["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    anyhow::ensure!(
        seen["entries"]["b"] == "2"
            && seen["entries"]["a"] == "1"
            && events
                .iter()
                .all(|e| *e == "eoc" || e.starts_with("cur:put:"))
            && seen["violations"] == json!([]),
        "a fresh instance, hydrated from the bucket's fold: {seen}"
    );
    let mine = reader.seen("mine").await?;
    anyhow::ensure!(mine["entries"]["m"] == "1" && mine["eoc"] == true, "{mine}");
    anyhow::ensure!(
        owner.stop()?.success() && reader.stop()?.success(),
        "clean stops"
    );
    anyhow::ensure!(
        consumers(&admin, &[OWNER_MAIN, READER_MAIN, NOTES, TALLY, MINE]).await? == 0,
        "no consumer lingers on any stream"
    );
    anyhow::ensure!(
        violations(&log, "owner").is_empty(),
        "{:?}",
        violations(&log, "owner")
    );

    // The owner's store under a guest that declares other buckets: the old ones are reported,
    // never removed.
    let listed = state_list(&owner_store)?;
    anyhow::ensure!(
        listed == json!([["notes", true], ["tally", true]]),
        "before: {listed}"
    );
    let mut other = start(
        &server,
        "admin",
        OWNER_MAIN,
        "state_reader",
        &owner_store,
        &[],
    )
    .await?;
    let status: foldhost_core::status::StatusReport = serde_json::from_slice(
        &foldhost::serve::call(&other.addr, "GET", "/status", b"")
            .await?
            .1,
    )?;
    let gone: Vec<&str> = status
        .state_buckets
        .iter()
        .filter(|b| !b.declared)
        .map(|b| b.local.as_str())
        .collect();
    anyhow::ensure!(gone == ["notes", "tally"], "{:?}", status.state_buckets);
    other.stop()?;
    let listed = state_list(&owner_store)?;
    anyhow::ensure!(
        listed
            == json!([
                ["mine", true],
                ["owner.notes", true],
                ["notes", false],
                ["tally", false]
            ]),
        "after: {listed}"
    );
    anyhow::ensure!(
        owner_store.join("state/notes").is_dir() && owner_store.join("state/tally").is_dir(),
        "kept"
    );
    Ok(())
}

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
    let start = |store: &Path| -> anyhow::Result<Node> {
        let addr = format!("127.0.0.1:{}", reserved_port()?);
        let mut c = run_command(&h, "art_main", store, Some(&addr));
        c.arg("--guest")
            .arg(guest_wasm("state_owner"))
            .args(["--batch-max", "10"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(store.with_extension("log"))?);
        Ok(Node {
            child: Some(c.spawn()?),
            addr,
        })
    };
    // The exporter: level with all three buckets, exported through its listener.
    let mut exporter = start(&tmp.path().join("exporter"))?;
    wait_status(&exporter.addr, level).await?;
    let art = tmp.path().join("art");
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
        .arg(tmp.path().join("exporter"))
        .arg("--out")
        .arg(tmp.path().join("at-rest.tar"));
    let rest = json_of(at_rest, "export --store")?;
    anyhow::ensure!(rest["state"] == m["state"], "{rest}\n{m}");
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
    // Written after the export: what a node started from it folds from the server.
    notes.put("n.after", "late".into()).await?;
    // Two nodes from the artifact: one as imported, one with its state folds removed (what a
    // node started from an artifact without them does: folds each bucket from the start).
    let mut nodes = Vec::new();
    for name in ["resumed", "refolded"] {
        let store = tmp.path().join(name);
        let mut import = foldhost();
        import
            .args(["import", "--artifact"])
            .arg(&art)
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
        let node = start(&store)?;
        let status = wait_status(&node.addr, level).await?;
        let want = bucket_contents(&notes).await?;
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
        nodes.push((name, batches("notes"), batches("tally"), node));
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

/// The mirror guest (`state_owner`, `mirror/K` of the main bucket → `K` in its `notes`) killed
/// between the commit of the batch that carries a mirror key and its `on-applied`: the
/// restart calls `on-applied` again for that commit, and each write lands once; a second restart
/// calls it again, and what it writes again (`extra` may make it write everything again) is
/// answered from the ledger by its derived operation id, never published twice.
async fn crash_before_on_applied_then_restart_twice(
    main: &str,
    extra: &[&str],
) -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.conn.bucket(main, &BucketConfig::default()).await?;
    kv.put("mirror/a", "1".into()).await?;
    let store = tempfile::tempdir()?;
    let run = |listen: Option<&str>| {
        let mut c = run_command(&h, main, store.path(), listen);
        c.arg("--guest")
            .arg(guest_wasm("state_owner"))
            .args(extra)
            .env("FOLDHOST_LOG", "info");
        c
    };
    // The state buckets are empty, so the first commit is the main bucket's, of its one record.
    run_to_crash(
        run(None),
        foldhost_core::crashpoint::FOLD_BEFORE_ON_APPLIED,
        1,
    )?;
    let cursor = status_store(store.path())?.cursor;
    assert_eq!(
        cursor,
        Some(1),
        "the main batch is committed before the crash"
    );
    assert_eq!(
        last_sequence(&h.conn, NOTES).await?,
        0,
        "on-applied never ran: nothing was mirrored before the crash"
    );
    for restart in 1..=2 {
        let addr = format!("127.0.0.1:{}", reserved_port()?);
        let (child, mut lines) = spawn_logged(run(Some(&addr)))?;
        let mut node = Node {
            child: Some(child),
            addr,
        };
        wait_status(&node.addr, level).await?;
        let seen = wait_seen(&node, "notes", |s| s["entries"]["a"] == "1").await?;
        anyhow::ensure!(seen["violations"] == json!([]), "{seen}");
        // Said once the call made again has returned: its writes are answered by then. The main
        // fold's commit comes first among them.
        let replayed = lines.wait_for("on_applied_replayed")?;
        anyhow::ensure!(replayed.contains("(main)"), "restart {restart}: {replayed}");
        assert_eq!(
            last_sequence(&h.conn, NOTES).await?,
            1,
            "restart {restart}: the mirror write is on the log once"
        );
        node.stop()?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_commit_and_on_applied_loses_no_write_the_call_would_have_made()
-> anyhow::Result<()> {
    crash_before_on_applied_then_restart_twice("replay_lacking", &[]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_an_on_applied_makes_again_after_a_restart_are_collapsed_by_their_derived_op_ids()
-> anyhow::Result<()> {
    crash_before_on_applied_then_restart_twice(
        "replay_all",
        &["--guest-config", "replay-writes-all=1"],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_on_applied_that_traps_part_way_is_called_again_and_each_of_its_writes_lands_once()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h
        .conn
        .bucket("replay_trap", &BucketConfig::default())
        .await?;
    kv.put("mirror/a", "1".into()).await?;
    kv.put("mirror/b", "2".into()).await?;
    let store = tempfile::tempdir()?;
    let addr = format!("127.0.0.1:{}", reserved_port()?);
    let mut c = run_command(&h, "replay_trap", store.path(), Some(&addr));
    // Each `on-applied` with mirror writes queued traps right after its first write.
    c.arg("--guest")
        .arg(guest_wasm("state_owner"))
        .args(["--guest-config", "trap-after-first-mirror=1"])
        .env("FOLDHOST_LOG", "info");
    let (child, mut lines) = spawn_logged(c)?;
    let mut node = Node {
        child: Some(child),
        addr,
    };
    let trapped = lines.wait_for("guest_trapped")?;
    anyhow::ensure!(trapped.contains("on-applied"), "{trapped}");
    wait_status(&node.addr, level).await?;
    let seen = wait_seen(&node, "notes", |s| {
        s["entries"]["a"] == "1" && s["entries"]["b"] == "2"
    })
    .await?;
    anyhow::ensure!(seen["violations"] == json!([]), "{seen}");
    // Said once the call made again returned: its writes are answered by then.
    lines.wait_for("on_applied_replayed")?;
    assert_eq!(
        last_sequence(&h.conn, NOTES).await?,
        2,
        "each mirror write is on the log once, the one made before the trap included"
    );
    node.stop()?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_on_applied_write_is_published_as_new_even_while_its_key_was_just_written()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let config = BucketConfig {
        max_history: 8,
        ..BucketConfig::default()
    };
    let kv = h.conn.bucket("first_writes", &config).await?;
    kv.put("seed", "1".into()).await?;
    let store = tempfile::tempdir()?;
    let addr = format!("127.0.0.1:{}", reserved_port()?);
    let mut c = run_command(&h, "first_writes", store.path(), Some(&addr));
    c.arg("--guest").arg(guest_wasm("state_owner"));
    let (child, _lines) = spawn_logged(c)?;
    let node = Node {
        child: Some(child),
        addr,
    };
    wait_status(&node.addr, level).await?;
    // Two values of one key, back to back: the second mirror write comes while this node's fold of
    // `notes` may not have passed the first (it waits for the main loop, which makes the writes).
    kv.put("mirror/a", "1".into()).await?;
    kv.put("mirror/a", "2".into()).await?;
    let seen = wait_seen(&node, "notes", |s| s["entries"]["a"] == "2").await?;
    anyhow::ensure!(seen["violations"] == json!([]), "{seen}");
    // Judged as a retry, the second would be answered `unknown` (the fold of `notes` behind its
    // key) and never published: `a` would stay `1`.
    assert_eq!(
        last_sequence(&h.conn, NOTES).await?,
        2,
        "each write is on the log once"
    );
    Ok(())
}
