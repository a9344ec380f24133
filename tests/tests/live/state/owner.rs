//! An owner node keeps state, a reader follows it, and every refusal comes before a publish.

use super::*;

/// What the scenario's phases share: the server and its log, an admin connection, and the
/// owner's and the reader's stores (fields drop in the order the test's locals did).
struct Scene {
    reader_store: std::path::PathBuf,
    owner_store: std::path::PathBuf,
    admin: NatsConnection,
    server: LocalNats,
    log: std::path::PathBuf,
    _tmp: tempfile::TempDir,
}

impl Scene {
    /// A server with both main buckets.
    async fn open() -> anyhow::Result<Self> {
        let tmp = tempfile::tempdir()?;
        let log = tmp.path().join("server.log");
        let server = server(&log)?;
        let admin = NatsConnection::open(ConnectOptions::new(url_as(&server, "admin"))).await?;
        main_bucket(&admin, OWNER_MAIN).await?;
        main_bucket(&admin, READER_MAIN).await?;
        let owner_store = tmp.path().join("owner");
        let reader_store = tmp.path().join("reader");
        Ok(Self {
            reader_store,
            owner_store,
            admin,
            server,
            log,
            _tmp: tmp,
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_keeps_state_a_reader_follows_it_and_every_refusal_comes_before_a_publish()
-> anyhow::Result<()> {
    let s = Scene::open().await?;
    // The owner, with a small bucket cap and writes attempted from parse and apply.
    let cap = "65536";
    let mut owner = start_owner(&s, cap).await?;
    owner_answers_every_verb(&owner).await?;
    owner_refusals_come_before_a_publish(&s, &owner).await?;
    let reader = start_a_reader_following_the_owner(&s, &owner).await?;
    reader_reads_the_owners_bucket_and_is_refused_its_writes(&s, reader).await?;
    forced_past_the_check_the_server_refuses(&s).await?;
    owner.stop()?;
    restarted_nodes_resume_and_leave_no_consumer(&s, cap).await?;
    other_buckets_are_reported_never_removed(&s).await
}

/// Starts the owner with the bucket cap `cap`, writing from parse and apply.
async fn start_owner(s: &Scene, cap: &str) -> anyhow::Result<Node> {
    let owner_store = &s.owner_store;
    let server = &s.server;
    start(
        server,
        "owner",
        OWNER_MAIN,
        "state_owner",
        owner_store,
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
    .await
}

/// A write from `query` waiting for the fold, then every verb on the owner's own bucket.
async fn owner_answers_every_verb(owner: &Node) -> anyhow::Result<()> {
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
    wait_seen(owner, "notes", |s| {
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
    Ok(())
}

/// Each host-side refusal says why and publishes nothing; the bucket's cap admits one write of
/// two; writes from parse and apply are refused.
async fn owner_refusals_come_before_a_publish(s: &Scene, owner: &Node) -> anyhow::Result<()> {
    let admin = &s.admin;
    // Each host-side refusal, with its reason, and nothing reaches the server.
    let before = last_sequence(admin, NOTES).await?;
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
    wait_seen(owner, "notes", |s| s["entries"].get("h1").is_some()).await?;
    let before_full = last_sequence(admin, NOTES).await?;
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
        last_sequence(admin, NOTES).await? == before_full,
        "no refused write reached the server"
    );
    Ok(())
}

/// A reader started after the owner wrote is handed the current values, then follows a change.
async fn start_a_reader_following_the_owner(s: &Scene, owner: &Node) -> anyhow::Result<Node> {
    let Scene {
        server,
        reader_store,
        ..
    } = s;
    // The reader starts after the owner wrote: it is handed the current values — not the key
    // deleted before it ever ran — then one end-of-current.
    let reader = start(
        server,
        "reader",
        READER_MAIN,
        "state_reader",
        reader_store,
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
    Ok(reader)
}

/// The reader reads and lists the owner's bucket, and is refused its writes by the host before any
/// publish; its own bucket it writes.
async fn reader_reads_the_owners_bucket_and_is_refused_its_writes(
    s: &Scene,
    mut reader: Node,
) -> anyhow::Result<()> {
    let Scene { log, admin, .. } = s;
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
    let notes_before = last_sequence(admin, NOTES).await?;
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
        last_sequence(admin, NOTES).await? == notes_before && violations(log, "reader").is_empty(),
        "the host refused before any publish: no message, no violation"
    );
    reader.stop()?;
    Ok(())
}

/// Forced past the host's check, a reader's write is refused by the server.
async fn forced_past_the_check_the_server_refuses(s: &Scene) -> anyhow::Result<()> {
    let Scene {
        log,
        server,
        reader_store,
        ..
    } = s;
    // Forced past the host's check, the same write is refused by the server: `permission`,
    // naming the subject — not a timeout.
    let mut forced = start(
        server,
        "reader",
        READER_MAIN,
        "state_reader",
        reader_store,
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
        !violations(log, "reader").is_empty(),
        "the server logged it"
    );
    forced.stop()?;
    Ok(())
}

/// Restarted, each node resumes its folds (a trapped instance is hydrated again); stopped, none
/// leaves a consumer behind.
async fn restarted_nodes_resume_and_leave_no_consumer(s: &Scene, cap: &str) -> anyhow::Result<()> {
    let Scene {
        log,
        server,
        admin,
        owner_store,
        reader_store,
        ..
    } = s;
    // Restarted, each resumes its folds; stopped, none leaves a consumer behind.
    let mut owner = start(
        server,
        "owner",
        OWNER_MAIN,
        "state_owner",
        owner_store,
        &["--state-max-bucket", cap],
    )
    .await?;
    let seen = owner.seen("notes").await?;
    anyhow::ensure!(
        seen["entries"]["b"] == "2" && seen["entries"].get("gone").is_none(),
        "{seen}"
    );
    let mut reader = start(
        server,
        "reader",
        READER_MAIN,
        "state_reader",
        reader_store,
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
        consumers(admin, &[OWNER_MAIN, READER_MAIN, NOTES, TALLY, MINE]).await? == 0,
        "no consumer lingers on any stream"
    );
    anyhow::ensure!(
        violations(log, "owner").is_empty(),
        "{:?}",
        violations(log, "owner")
    );
    Ok(())
}

/// The owner's store under a guest that declares other buckets: the old ones are reported, never
/// removed.
async fn other_buckets_are_reported_never_removed(s: &Scene) -> anyhow::Result<()> {
    let Scene {
        server,
        owner_store,
        ..
    } = s;
    // The owner's store under a guest that declares other buckets: the old ones are reported,
    // never removed.
    let listed = state_list(owner_store)?;
    anyhow::ensure!(
        listed == json!([["notes", true], ["tally", true]]),
        "before: {listed}"
    );
    let mut other = start(
        server,
        "admin",
        OWNER_MAIN,
        "state_reader",
        owner_store,
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
    let listed = state_list(owner_store)?;
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
