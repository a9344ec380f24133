//! Writes through hosts checked Jepsen-style (docs/writes.md): concurrent clients put, delete,
//! compare-and-set and read a few hot keys through two or three `foldhost run` nodes of one bucket,
//! every request and answer recorded in a history ([`foldhost_tests::history`]), while a seeded
//! nemesis kills and restarts the nats-server, cuts the nodes' connections at their proxy, kills
//! and restarts nodes (from their own store, from an empty one, and from an artifact a running
//! peer exported under the workload), shortens the stream's
//! duplicate window, sweeps a node's ledger and recreates the bucket. At the end the stream's own
//! records are read back and the checker proves every answer from the history and the log alone.
//!
//! Each run prints its seed (`history seed 0x…`); `FOLDHOST_HISTORY_SEED=0x…` replays one (the
//! schedule of operations and faults; what the scheduler does with it is its own), and
//! `FOLDHOST_HISTORY_LARGE=1` runs more operations over more seeds (minutes: run it under a
//! profile that allows them, `cargo nextest run --profile sim-deep …`). Besides the workloads: the
//! checker's own tests (hand-made histories that pass, and one that fails for each rule), and one
//! test per write mutation the host can be built to carry (`FOLDHOST_WRITE_MUTATION`), each
//! asserting the checker catches it.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use foldhost_tests::history::{
    self, Answer, FinalFold, Incarnation, Kind, Log, Op, Record, Recorder, RegisterOp, RegisterRet,
    Request, TimedRegisterOp,
};
use foldhost_tests::proxy::Proxy;
use foldhost_tests::{Contents, Harness, foldhost, terminate, wait_status, wait_until};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The write token every node takes.
const TOKEN: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
/// The hot keys.
const KEYS: &[&str] = &["k.a", "k.b", "k.c"];
/// Revisions a key keeps: the log is read between phases, before a key could drop one.
const HISTORY: i64 = 64;
/// The variable the host reads a write mutation from.
const MUTATION_ENV: &str = "FOLDHOST_WRITE_MUTATION";

// ---------------------------------------------------------------------------------------------
// The checker's own tests: no server.
// ---------------------------------------------------------------------------------------------

/// A fixed UUIDv7 text per small number.
fn id(n: u8) -> String {
    format!("01890000-0000-7000-8000-0000000000{n:02x}")
}

fn put(key: &str, value: &str, if_revision: Option<u64>) -> Request {
    Request::Put {
        key: key.into(),
        value: value.into(),
        if_revision,
    }
}

fn read(key: &str, min_revision: Option<u64>) -> Request {
    Request::Read {
        key: key.into(),
        min_revision,
    }
}

/// An operation of `client` on fold `node`, sent at `invoked` and answered at `completed`.
fn op(
    client: usize,
    node: usize,
    (invoked, completed): (u64, u64),
    request: Request,
    op_id: Option<u8>,
    answer: Answer,
) -> Op {
    Op {
        client,
        node,
        incarnation: 0,
        invoked,
        completed,
        request,
        op_id: op_id.map(id),
        retry: false,
        answer,
    }
}

fn record(seq: u64, key: &str, value: Option<&str>, op_id: u8) -> Record {
    Record {
        seq,
        key: key.into(),
        kind: if value.is_some() {
            Kind::Put
        } else {
            Kind::Delete
        },
        value: value.unwrap_or_default().as_bytes().to_vec(),
        op_id: Some(id(op_id)),
    }
}

fn log_of(records: Vec<Record>) -> Log {
    let last_sequence = records.iter().map(|r| r.seq).max().unwrap_or(0);
    Log {
        incarnations: vec![Incarnation {
            records: records.into_iter().map(|r| (r.seq, r)).collect(),
            last_sequence,
        }],
    }
}

fn applied(revision: u64) -> Answer {
    Answer::Applied { revision }
}

fn found(value: &str, revision: u64, applied_through: u64) -> Answer {
    Answer::Found {
        value: value.as_bytes().to_vec(),
        revision,
        applied_through,
    }
}

fn conflict(revision: u64) -> Answer {
    Answer::Refused {
        reason: "conflict".into(),
        revision: Some(revision),
        key: None,
    }
}

/// A history that keeps every promise: puts, a compare-and-set that wins and one that loses
/// naming the winner, a delete, an unknown write that landed and one that did not, a retry of an
/// answered write answered from the ledger, reads before and after, and folds equal to the log.
fn good() -> (Vec<Op>, Log, Vec<FinalFold>) {
    let history = vec![
        op(0, 0, (1, 2), put("k.a", "a1", None), Some(1), applied(1)),
        op(1, 1, (3, 6), put("k.a", "a2", Some(1)), Some(2), applied(2)),
        op(
            2,
            0,
            (4, 7),
            put("k.a", "a3", Some(1)),
            Some(3),
            conflict(2),
        ),
        op(0, 0, (8, 9), read("k.a", None), None, found("a2", 2, 2)),
        // Another fold, without a minimum revision, may still be behind.
        op(2, 1, (8, 10), read("k.a", None), None, found("a2", 2, 2)),
        op(
            1,
            1,
            (11, 12),
            Request::Delete {
                key: "k.a".into(),
                if_revision: None,
            },
            Some(4),
            Answer::Pending { revision: 3 },
        ),
        op(
            0,
            0,
            (13, 14),
            read("k.a", Some(3)),
            None,
            Answer::NotFound { applied_through: 3 },
        ),
        op(
            2,
            0,
            (15, 16),
            put("k.b", "b1", None),
            Some(5),
            Answer::Transport("connection reset".into()),
        ),
        op(
            2,
            1,
            (17, 18),
            put("k.b", "b2", None),
            Some(6),
            Answer::Unknown,
        ),
        Op {
            retry: true,
            ..op(0, 1, (19, 20), put("k.a", "a1", None), Some(1), applied(1))
        },
        op(
            1,
            0,
            (21, 22),
            read("k.b", Some(4)),
            None,
            found("b1", 4, 4),
        ),
    ];
    let log = log_of(vec![
        record(1, "k.a", Some("a1"), 1),
        record(2, "k.a", Some("a2"), 2),
        record(3, "k.a", None, 4),
        record(4, "k.b", Some("b1"), 5),
    ]);
    let folds = (0..2)
        .map(|node| FinalFold {
            node,
            contents: Contents::from([("k.b".to_string(), (b"b1".to_vec(), 4))]),
        })
        .collect();
    (history, log, folds)
}

/// The rules `check` breaks on this history, once each.
fn rules(history: &[Op], log: &Log, folds: &[FinalFold]) -> Vec<char> {
    let mut r: Vec<char> = history::check(history, log, folds)
        .iter()
        .map(|a| a.rule)
        .collect();
    r.dedup();
    r
}

#[test]
fn the_history_checker_passes_a_history_that_keeps_every_promise() {
    let (history, log, folds) = good();
    let anomalies = history::check(&history, &log, &folds);
    assert!(anomalies.is_empty(), "{}", history::describe(&anomalies));
}

#[test]
fn the_history_checker_fails_an_applied_answer_whose_record_is_not_on_the_log() {
    let (mut history, log, folds) = good();
    // Answered at 3, where the log holds another op's record.
    history.push(op(
        3,
        0,
        (23, 24),
        put("k.c", "c1", None),
        Some(9),
        applied(3),
    ));
    assert_eq!(rules(&history, &log, &folds), vec!['a']);
    // Answered past the log's end.
    let (mut history, log, folds) = good();
    history.push(op(
        3,
        0,
        (23, 24),
        put("k.c", "c1", None),
        Some(9),
        applied(9),
    ));
    assert_eq!(rules(&history, &log, &folds), vec!['a']);
}

#[test]
fn the_history_checker_fails_an_op_id_with_two_records() {
    let (mut history, mut log, mut folds) = good();
    // The retry of op 1 landed a second copy, and the folds hold it.
    log.incarnations[0]
        .records
        .insert(5, record(5, "k.a", Some("a1"), 1));
    log.incarnations[0].last_sequence = 5;
    for f in &mut folds {
        f.contents.insert("k.a".into(), (b"a1".to_vec(), 5));
    }
    history[9].answer = applied(5);
    assert_eq!(rules(&history, &log, &folds), vec!['b']);
}

#[test]
fn the_history_checker_fails_a_refused_op_with_a_record() {
    let (history, mut log, mut folds) = good();
    // The compare-and-set refused as a conflict landed after all, as the newest on k.a.
    log.incarnations[0]
        .records
        .insert(5, record(5, "k.a", Some("a3"), 3));
    log.incarnations[0].last_sequence = 5;
    for f in &mut folds {
        f.contents.insert("k.a".into(), (b"a3".to_vec(), 5));
    }
    let r = rules(&history, &log, &folds);
    assert!(r.contains(&'c'), "{r:?}");
}

#[test]
fn the_history_checker_fails_an_unknown_op_with_two_records() {
    let (history, mut log, mut folds) = good();
    log.incarnations[0]
        .records
        .insert(5, record(5, "k.b", Some("b1"), 5));
    log.incarnations[0].last_sequence = 5;
    for f in &mut folds {
        f.contents.insert("k.b".into(), (b"b1".to_vec(), 5));
    }
    assert_eq!(rules(&history, &log, &folds), vec!['d']);
}

#[test]
fn the_history_checker_fails_a_read_older_than_a_write_its_fold_applied() {
    let (mut history, log, folds) = good();
    // Fold 1 answered op 2 applied at 2, then served 1 to a read sent after.
    history.push(op(
        3,
        1,
        (23, 24),
        read("k.a", None),
        None,
        found("a1", 1, 1),
    ));
    assert_eq!(rules(&history, &log, &folds), vec!['e']);
    // A read that asked for revision 3 and found the value of 2.
    let (mut history, log, folds) = good();
    history.push(op(
        3,
        1,
        (23, 24),
        read("k.a", Some(3)),
        None,
        found("a2", 2, 3),
    ));
    assert_eq!(rules(&history, &log, &folds), vec!['e']);
    // Nothing found after the fold applied a put: the only delete was sent after the read.
    let history = vec![
        op(0, 0, (1, 2), put("k.a", "a1", None), Some(1), applied(1)),
        op(
            1,
            0,
            (3, 4),
            read("k.a", None),
            None,
            Answer::NotFound { applied_through: 0 },
        ),
        op(
            0,
            0,
            (5, 6),
            Request::Delete {
                key: "k.a".into(),
                if_revision: None,
            },
            Some(2),
            applied(2),
        ),
    ];
    let log = log_of(vec![
        record(1, "k.a", Some("a1"), 1),
        record(2, "k.a", None, 2),
    ]);
    let folds = vec![FinalFold {
        node: 0,
        contents: Contents::new(),
    }];
    assert_eq!(rules(&history, &log, &folds), vec!['e']);
    // A read on another fold with no minimum may lag: no anomaly.
    let (mut history, log, folds) = good();
    history.push(op(
        3,
        7,
        (23, 24),
        read("k.a", None),
        None,
        found("a1", 1, 1),
    ));
    assert_eq!(rules(&history, &log, &folds), Vec::<char>::new());
}

#[test]
fn the_history_checker_fails_compare_and_set_histories_that_are_not_linearizable() {
    // Two compare-and-sets at revision 1, both applied: the second must have conflicted.
    let history = vec![
        op(0, 0, (1, 2), put("k.a", "a1", None), Some(1), applied(1)),
        op(1, 0, (3, 4), put("k.a", "a2", Some(1)), Some(2), applied(2)),
        op(2, 1, (5, 6), put("k.a", "a3", Some(1)), Some(3), applied(3)),
    ];
    let log = log_of(vec![
        record(1, "k.a", Some("a1"), 1),
        record(2, "k.a", Some("a2"), 2),
        record(3, "k.a", Some("a3"), 3),
    ]);
    let folds = vec![FinalFold {
        node: 0,
        contents: Contents::from([("k.a".to_string(), (b"a3".to_vec(), 3))]),
    }];
    assert_eq!(rules(&history, &log, &folds), vec!['f']);
    // A write that completed before another began landed after it.
    let history = vec![
        op(0, 0, (1, 2), put("k.a", "a2", None), Some(2), applied(2)),
        op(1, 0, (3, 4), put("k.a", "a1", None), Some(1), applied(1)),
    ];
    let log = log_of(vec![
        record(1, "k.a", Some("a1"), 1),
        record(2, "k.a", Some("a2"), 2),
    ]);
    let folds = vec![FinalFold {
        node: 0,
        contents: Contents::from([("k.a".to_string(), (b"a2".to_vec(), 2))]),
    }];
    assert_eq!(rules(&history, &log, &folds), vec!['f']);
    // A conflict naming a revision the key never held while the op was in flight.
    let history = vec![
        op(0, 0, (1, 2), put("k.a", "a1", None), Some(1), applied(1)),
        op(
            1,
            0,
            (3, 4),
            put("k.a", "a2", Some(0)),
            Some(2),
            conflict(7),
        ),
    ];
    let log = log_of(vec![record(1, "k.a", Some("a1"), 1)]);
    let folds = vec![FinalFold {
        node: 0,
        contents: Contents::from([("k.a".to_string(), (b"a1".to_vec(), 1))]),
    }];
    assert_eq!(rules(&history, &log, &folds), vec!['f']);
    // An unknown compare-and-set whose record the log holds took effect: a later compare-and-set
    // at the revision before it must have conflicted.
    let history = vec![
        op(0, 0, (1, 2), put("k.a", "a1", None), Some(1), applied(1)),
        op(
            1,
            0,
            (3, 4),
            put("k.a", "a2", Some(1)),
            Some(2),
            Answer::Unknown,
        ),
        op(2, 0, (5, 6), put("k.a", "a3", Some(1)), Some(3), applied(3)),
    ];
    let log = log_of(vec![
        record(1, "k.a", Some("a1"), 1),
        record(2, "k.a", Some("a2"), 2),
        record(3, "k.a", Some("a3"), 3),
    ]);
    let folds = vec![FinalFold {
        node: 0,
        contents: Contents::from([("k.a".to_string(), (b"a3".to_vec(), 3))]),
    }];
    assert_eq!(rules(&history, &log, &folds), vec!['f']);
}

#[test]
fn the_history_checker_fails_a_final_fold_that_is_not_the_bucket() {
    let (history, log, mut folds) = good();
    folds[1].contents.insert("k.a".into(), (b"a2".to_vec(), 2));
    assert_eq!(rules(&history, &log, &folds), vec!['g']);
}

#[test]
fn the_history_checker_says_when_the_log_lost_records_before_it_was_read() {
    let (history, mut log, folds) = good();
    log.incarnations[0].last_sequence = 6;
    let r = rules(&history, &log, &folds);
    assert!(r.contains(&'L'), "{r:?}");
}

#[test]
fn the_register_specification_orders_reads_in_real_time() {
    let write = |name: &str, (invoked, returned), landed: u64, if_revision| TimedRegisterOp {
        name: name.into(),
        invoked,
        returned,
        op: RegisterOp::Write {
            value: Some(name.as_bytes().to_vec()),
            if_revision,
            landed: Some(landed),
        },
        ret: RegisterRet::Wrote(landed),
    };
    let read_of = |(invoked, returned), revision: u64, value: Option<&str>| TimedRegisterOp {
        name: "read".into(),
        invoked,
        returned,
        op: RegisterOp::Read,
        ret: RegisterRet::Value(revision, value.map(|v| v.as_bytes().to_vec())),
    };
    // A read concurrent with a write may see either side of it.
    let ok = [
        write("x", (1, 2), 1, None),
        write("y", (3, 6), 2, Some(1)),
        read_of((4, 5), 1, Some("x")),
        read_of((4, 7), 2, Some("y")),
    ];
    assert_eq!(history::linearizable(&ok), Ok(()));
    // A read sent after the write returned must see it.
    let stale = [
        write("x", (1, 2), 1, None),
        write("y", (3, 4), 2, Some(1)),
        read_of((5, 6), 1, Some("x")),
    ];
    assert!(history::linearizable(&stale).is_err());
}

// ---------------------------------------------------------------------------------------------
// The workload against a real nats-server.
// ---------------------------------------------------------------------------------------------

/// How much one run does.
#[derive(Clone, Copy, Debug)]
struct Size {
    nodes: usize,
    clients: usize,
    ops_per_client: usize,
}

impl Size {
    fn get() -> Size {
        if large() {
            Size {
                nodes: 3,
                clients: 5,
                ops_per_client: 24,
            }
        } else {
            Size {
                nodes: 2,
                clients: 4,
                ops_per_client: 12,
            }
        }
    }
}

fn large() -> bool {
    std::env::var("FOLDHOST_HISTORY_LARGE").is_ok_and(|v| v == "1")
}

/// The seeds to run: the one `FOLDHOST_HISTORY_SEED` names, else `n` (four times as many in the
/// large tier) new ones.
fn seeds(n: usize) -> anyhow::Result<Vec<u64>> {
    if let Ok(s) = std::env::var("FOLDHOST_HISTORY_SEED") {
        let s = s.trim();
        let parsed = match s.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => s.parse(),
        };
        return Ok(vec![parsed.map_err(|e| {
            anyhow::anyhow!("FOLDHOST_HISTORY_SEED={s:?}: {e}")
        })?]);
    }
    let n = if large() { n * 4 } else { n };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64;
    let mut rng = StdRng::seed_from_u64(now ^ u64::from(std::process::id()));
    Ok((0..n).map(|_| rng.random()).collect())
}

/// A fault the nemesis injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// SIGKILL the nats-server and start it again on its port and store.
    KillServer,
    /// Cut connections at the proxy after a publish reached the server, once with the proxy
    /// refusing new connections for a while (the log unreadable).
    CutConnections,
    /// SIGKILL a node and start it again from where [`Restart`] says.
    KillNode(Restart),
    /// Shorten the stream's duplicate window to a second.
    ShortDuplicateWindow,
    /// Restart a node with `--ledger-retention 1s`, which sweeps its ledger at start.
    SweepLedger,
    /// Delete the bucket's stream and create it again; the nodes relist (`--on-recreated
    /// relist`). Only between phases: the old stream's log is read first.
    Recreate,
}

/// Where a killed node starts again from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Restart {
    /// Its own store.
    OwnStore,
    /// An empty store (a new fold: a state-sync start).
    Empty,
    /// A store imported from an artifact a running peer exported while the clients wrote (a
    /// new fold, which adopts the peer's ledger).
    PeerArtifact,
}

/// Where a client sends: a node's address and the fold behind it (`None`: the node is down).
#[derive(Clone, Debug)]
struct Target {
    addr: String,
    fold: usize,
}

type Targets = Arc<RwLock<Vec<Option<Target>>>>;

/// A node the test runs.
struct Node {
    child: Option<Child>,
    addr: String,
    store: PathBuf,
    fold: usize,
    extra: Vec<String>,
}

/// The system under test and its observers.
struct Cluster {
    h: Harness,
    proxy: Proxy,
    bucket: String,
    tmp: tempfile::TempDir,
    nodes: Vec<Node>,
    targets: Targets,
    next_fold: usize,
    recorder: Arc<Recorder>,
    log: Log,
    incarnation: Arc<AtomicUsize>,
    env: Vec<(String, String)>,
    clients: Vec<Client>,
}

impl Cluster {
    /// A server, a bucket keeping [`HISTORY`] revisions per key, a proxy in front of the server,
    /// and `nodes` nodes folding the bucket through it, with `env` in their environment.
    async fn start(
        seed: u64,
        nodes: usize,
        clients: usize,
        env: &[(&str, String)],
    ) -> anyhow::Result<Cluster> {
        let h = Harness::start().await?;
        let bucket = "hist".to_string();
        h.bucket_with_history(&bucket, HISTORY).await?;
        let proxy = Proxy::start(&h.url().replace("nats://", "")).await?;
        let mut c = Cluster {
            h,
            proxy,
            bucket,
            tmp: tempfile::tempdir()?,
            nodes: Vec::new(),
            targets: Arc::new(RwLock::new(Vec::new())),
            next_fold: 0,
            recorder: Arc::new(Recorder::default()),
            log: Log {
                incarnations: vec![Incarnation::default()],
            },
            incarnation: Arc::new(AtomicUsize::new(0)),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            clients: (0..clients)
                .map(|i| Client::new(i, seed.wrapping_add(i as u64 + 1)))
                .collect(),
        };
        for i in 0..nodes {
            let store = c.tmp.path().join(format!("fold-{i}"));
            let fold = c.next_fold;
            c.next_fold += 1;
            let (child, addr) = c.spawn_node(&store, &[]).await?;
            c.nodes.push(Node {
                child: Some(child),
                addr: addr.clone(),
                store,
                fold,
                extra: Vec::new(),
            });
            c.set_target(i, Some(Target { addr, fold }));
        }
        Ok(c)
    }

    fn set_target(&self, i: usize, t: Option<Target>) {
        let mut targets = self
            .targets
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if targets.len() <= i {
            targets.resize(i + 1, None);
        }
        targets[i] = t;
    }

    /// Starts `foldhost run` on `store` through the proxy, on a new reserved port; waits until
    /// it serves.
    async fn spawn_node(&self, store: &Path, extra: &[String]) -> anyhow::Result<(Child, String)> {
        let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
        let token_file = store.with_extension("write-token");
        std::fs::write(&token_file, TOKEN)?;
        let mut cmd = foldhost();
        cmd.args(["run", "--bucket", &self.bucket, "--nats"])
            .arg(self.proxy.url())
            .arg("--store")
            .arg(store)
            .args(["--listen", &addr])
            .arg("--write-token-file")
            .arg(&token_file)
            // A read the proxy blocks fails soon; a watch over a cut connection, and one whose
            // stream was recreated, is noticed within seconds.
            .args(["--nats-op-timeout", "3", "--watch-heartbeat", "1"])
            .args(["--on-recreated", "relist"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(if std::env::var_os("FOLDHOST_HISTORY_NODE_LOG").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            });
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let child = cmd.spawn()?;
        wait_status(&addr, |s| s.state == "running").await?;
        Ok((child, addr))
    }

    /// SIGKILLs node `i`; its clients see it gone.
    fn kill_node(&mut self, i: usize) -> anyhow::Result<()> {
        self.set_target(i, None);
        if let Some(mut child) = self.nodes[i].child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Starts node `i` again (a new fold and store when `empty`), with `extra` arguments.
    async fn restart_node(&mut self, i: usize, empty: bool, extra: &[&str]) -> anyhow::Result<()> {
        if empty {
            self.new_fold(i);
        }
        self.start_node(i, extra).await
    }

    /// Gives node `i` a new fold whose store does not exist yet.
    fn new_fold(&mut self, i: usize) {
        self.nodes[i].store = self.tmp.path().join(format!("fold-{i}-{}", self.next_fold));
        self.nodes[i].fold = self.next_fold;
        self.next_fold += 1;
    }

    /// Node `i`'s store becomes a new fold imported from an artifact node `peer` exports while it
    /// runs (exactly at its cursor, between two of its batches).
    fn import_from_peer(&mut self, i: usize, peer: usize) -> anyhow::Result<()> {
        let artifact = self.tmp.path().join(format!("artifact-{}", self.next_fold));
        let out = foldhost()
            .args(["export", "--listen", &self.nodes[peer].addr, "--out"])
            .arg(&artifact)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "export from node {peer}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.new_fold(i);
        let out = foldhost()
            .args(["import", "--artifact"])
            .arg(&artifact)
            .arg("--store")
            .arg(&self.nodes[i].store)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "import into node {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// Starts node `i` on its store with `extra` arguments; its clients see it once it serves.
    async fn start_node(&mut self, i: usize, extra: &[&str]) -> anyhow::Result<()> {
        self.nodes[i].extra = extra.iter().map(|s| s.to_string()).collect();
        let (child, addr) = self
            .spawn_node(&self.nodes[i].store.clone(), &self.nodes[i].extra.clone())
            .await?;
        self.nodes[i].child = Some(child);
        self.nodes[i].addr = addr.clone();
        self.set_target(
            i,
            Some(Target {
                addr,
                fold: self.nodes[i].fold,
            }),
        );
        Ok(())
    }

    /// The bucket's stream's last sequence, asked until the server answers.
    async fn last_sequence(&self) -> anyhow::Result<u64> {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let kv = self.h.bucket_with_history(&self.bucket, HISTORY).await;
            match kv {
                Ok(kv) => match kv.positions().await {
                    Ok(p) => return Ok(p.last_sequence),
                    Err(e) => {
                        anyhow::ensure!(std::time::Instant::now() < deadline, "positions: {e}")
                    }
                },
                Err(e) => anyhow::ensure!(std::time::Instant::now() < deadline, "bucket: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Every node up, every fold level with the log, and the log read.
    async fn settle(&mut self) -> anyhow::Result<()> {
        self.proxy.refuse_new(false);
        for i in 0..self.nodes.len() {
            if self.nodes[i].child.is_none() {
                self.restart_node(i, false, &[]).await?;
            }
        }
        let last = self.last_sequence().await?;
        for n in &self.nodes {
            wait_status(&n.addr, |s| {
                s.state == "running" && s.applied_through >= last
            })
            .await?;
        }
        self.read_log().await
    }

    async fn read_log(&mut self) -> anyhow::Result<()> {
        let kv = self.h.bucket_with_history(&self.bucket, HISTORY).await?;
        let inc = self
            .log
            .incarnations
            .last_mut()
            .ok_or_else(|| anyhow::anyhow!("no incarnation"))?;
        history::read_log(kv.jetstream(), &self.bucket, inc).await
    }

    /// One phase: every client runs `ops` operations (`Mode`), and `fault`, when given, strikes
    /// once a third of them completed. Then everything settles and the log is read.
    async fn phase(
        &mut self,
        rng: &mut StdRng,
        ops: usize,
        mode: Mode,
        fault: Option<Fault>,
    ) -> anyhow::Result<()> {
        if fault == Some(Fault::Recreate) {
            self.recreate().await?;
        }
        let progress = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for mut client in std::mem::take(&mut self.clients) {
            let env = Env {
                recorder: self.recorder.clone(),
                targets: self.targets.clone(),
                incarnation: self.incarnation.clone(),
                progress: progress.clone(),
            };
            tasks.push(tokio::spawn(async move {
                let r = client.run(&env, ops, mode).await;
                (client, r)
            }));
        }
        if let Some(fault) = fault.filter(|f| *f != Fault::Recreate) {
            let total = ops * tasks.len();
            let at = total / 3;
            wait_until("a third of the phase", || {
                progress.load(Ordering::SeqCst) >= at || tasks.iter().all(|t| t.is_finished())
            })
            .await?;
            self.strike(rng, fault, &progress, &tasks).await?;
        }
        for t in tasks {
            let (client, r) = t.await?;
            self.clients.push(client);
            r?;
        }
        self.settle().await
    }

    /// Injects `fault` while the clients run.
    async fn strike(
        &mut self,
        rng: &mut StdRng,
        fault: Fault,
        progress: &AtomicUsize,
        tasks: &[tokio::task::JoinHandle<(Client, anyhow::Result<()>)>],
    ) -> anyhow::Result<()> {
        // Waits until `n` more operations completed (or the clients are done).
        let more = |n: usize| {
            let from = progress.load(Ordering::SeqCst);
            wait_until("operations under the fault", move || {
                progress.load(Ordering::SeqCst) >= from + n || tasks.iter().all(|t| t.is_finished())
            })
        };
        eprintln!("history: {fault:?}");
        match fault {
            Fault::KillServer => self.h.server.restart()?,
            Fault::CutConnections => {
                let prefix = format!("$KV.{}.", self.bucket);
                for round in 0..3 {
                    let cuts = self.proxy.cuts();
                    // Once, nobody may reconnect until a few more operations were answered.
                    let refuse = round == 1;
                    self.proxy.refuse_new(refuse);
                    self.proxy.cut_after_publish_to(&prefix);
                    wait_until("a cut", || {
                        self.proxy.cuts() > cuts || tasks.iter().all(|t| t.is_finished())
                    })
                    .await?;
                    if refuse {
                        more(tasks.len()).await?;
                        self.proxy.refuse_new(false);
                    }
                }
                // An armed cut nobody reached is disarmed: the next phase starts clean.
                self.proxy.cut_after_publish_to("$nothing.");
            }
            Fault::KillNode(from) => {
                let i = rng.random_range(0..self.nodes.len());
                self.kill_node(i)?;
                more(tasks.len()).await?;
                match from {
                    Restart::OwnStore => self.restart_node(i, false, &[]).await?,
                    Restart::Empty => self.restart_node(i, true, &[]).await?,
                    Restart::PeerArtifact => {
                        // Every other node is up: the nemesis strikes one node at a time.
                        let peer =
                            (i + 1 + rng.random_range(0..self.nodes.len() - 1)) % self.nodes.len();
                        tokio::task::block_in_place(|| self.import_from_peer(i, peer))?;
                        self.start_node(i, &[]).await?;
                    }
                }
            }
            Fault::ShortDuplicateWindow => self.short_duplicate_window().await?,
            Fault::SweepLedger => {
                let i = rng.random_range(0..self.nodes.len());
                self.kill_node(i)?;
                // Rows older than the retention are swept at start: let a second pass (a
                // precondition, not a synchronisation).
                tokio::time::sleep(Duration::from_millis(1500)).await;
                self.restart_node(i, false, &["--ledger-retention", "1s"])
                    .await?;
                wait_status(&self.nodes[i].addr, |s| s.ledger_sweeps >= 1).await?;
            }
            Fault::Recreate => self.recreate().await?,
        }
        Ok(())
    }

    /// Shortens the stream's duplicate window to a second (as `short_duplicate_window` in
    /// writes.rs).
    async fn short_duplicate_window(&self) -> anyhow::Result<()> {
        let kv = self.h.bucket_with_history(&self.bucket, HISTORY).await?;
        let js = kv.jetstream();
        let mut config = js
            .get_stream(format!("KV_{}", self.bucket))
            .await?
            .cached_info()
            .config
            .clone();
        config.duplicate_window = Duration::from_secs(1);
        js.update_stream(config).await?;
        Ok(())
    }

    /// Reads the stream's log whole, deletes the stream, creates the bucket again, and waits
    /// until every node relisted it. Requests from here on are the new incarnation's.
    async fn recreate(&mut self) -> anyhow::Result<()> {
        eprintln!("history: Recreate");
        self.settle().await?;
        let mut repairs = Vec::new();
        for n in &self.nodes {
            repairs.push(wait_status(&n.addr, |_| true).await?.repairs);
        }
        let kv = self.h.bucket_with_history(&self.bucket, HISTORY).await?;
        kv.jetstream()
            .delete_stream(format!("KV_{}", self.bucket))
            .await?;
        self.h.bucket_with_history(&self.bucket, HISTORY).await?;
        self.log.incarnations.push(Incarnation::default());
        self.incarnation
            .store(self.log.incarnations.len() - 1, Ordering::SeqCst);
        for (n, before) in self.nodes.iter().zip(repairs) {
            wait_status(&n.addr, |s| s.state == "running" && s.repairs > before).await?;
        }
        Ok(())
    }

    /// Every fold's contents, read with `POST /get` once it applied the log's end.
    async fn finals(&mut self) -> anyhow::Result<Vec<FinalFold>> {
        self.settle().await?;
        let last = self.last_sequence().await?;
        let mut out = Vec::new();
        for n in &self.nodes {
            let mut contents = Contents::new();
            for key in KEYS {
                match get(&n.addr, key, Some(last), 60_000).await {
                    Answer::Found {
                        value, revision, ..
                    } => {
                        contents.insert(key.to_string(), (value, revision));
                    }
                    Answer::NotFound { .. } => {}
                    other => anyhow::bail!("final read of {key} on {}: {other:?}", n.addr),
                }
            }
            out.push(FinalFold {
                node: n.fold,
                contents,
            });
        }
        Ok(out)
    }

    /// The checker's verdict on everything recorded.
    async fn check(&mut self) -> anyhow::Result<Vec<history::Anomaly>> {
        let finals = self.finals().await?;
        let ops = self.recorder.ops();
        let anomalies = history::check(&ops, &self.log, &finals);
        let writes = ops.iter().filter(|o| o.request.is_write()).count();
        let count = |f: &dyn Fn(&Answer) -> bool| ops.iter().filter(|o| f(&o.answer)).count();
        eprintln!(
            "history: {} ops ({writes} writes: {} applied, {} pending, {} unknown, {} transport, \
             {} refused; {} retries), {} records over {} incarnation(s), {} anomalies",
            ops.len(),
            count(&|a| matches!(a, Answer::Applied { .. })),
            count(&|a| matches!(a, Answer::Pending { .. })),
            count(&|a| matches!(a, Answer::Unknown)),
            count(&|a| matches!(a, Answer::Transport(_))),
            count(&|a| matches!(a, Answer::Refused { .. })),
            ops.iter().filter(|o| o.retry).count(),
            self.log
                .incarnations
                .iter()
                .map(|i| i.records.len())
                .sum::<usize>(),
            self.log.incarnations.len(),
            anomalies.len()
        );
        Ok(anomalies)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = terminate(&mut c);
            }
        }
    }
}

/// What the clients share.
struct Env {
    recorder: Arc<Recorder>,
    targets: Targets,
    incarnation: Arc<AtomicUsize>,
    progress: Arc<AtomicUsize>,
}

/// What a phase's clients do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Puts, deletes, compare-and-sets, reads, and re-sends of answered writes.
    Mixed,
    /// Puts and compare-and-sets only (every one a new operation).
    Writes,
    /// Each client re-sends every write it had answered `applied` or `pending` (the same body
    /// under the same op id), once.
    ResendAll,
}

/// A write as sent: its op id, body and request.
#[derive(Clone)]
struct Sent {
    op_id: String,
    body: serde_json::Value,
    request: Request,
}

/// One sequential client.
struct Client {
    id: usize,
    rng: StdRng,
    n: usize,
    /// Writes answered applied or pending, per incarnation.
    answered: Vec<(usize, Sent)>,
    /// The newest revision this client was answered in an incarnation (a read asks for it).
    newest: (usize, u64),
}

impl Client {
    fn new(id: usize, seed: u64) -> Client {
        Client {
            id,
            rng: StdRng::seed_from_u64(seed),
            n: 0,
            answered: Vec::new(),
            newest: (0, 0),
        }
    }

    /// A UUIDv7 minted now.
    fn mint(&mut self) -> anyhow::Result<String> {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis() as u64;
        let mut b = [0u8; 16];
        self.rng.fill(&mut b);
        b[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
        b[6] = 0x70 | (b[6] & 0x0f);
        b[8] = 0x80 | (b[8] & 0x3f);
        foldhost_core::protocol::OpId::from_bytes(b)
            .map(|o| o.to_string())
            .map_err(|e| anyhow::anyhow!("minted id: {e}"))
    }

    async fn run(&mut self, env: &Env, ops: usize, mode: Mode) -> anyhow::Result<()> {
        if mode == Mode::ResendAll {
            let inc = env.incarnation.load(Ordering::SeqCst);
            let sent: Vec<Sent> = self.answered.iter().map(|(_, s)| s.clone()).collect();
            for s in sent {
                self.write(env, s, true, inc).await?;
                env.progress.fetch_add(1, Ordering::SeqCst);
            }
            return Ok(());
        }
        for _ in 0..ops {
            self.step(env, mode).await?;
            env.progress.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }

    /// One operation, chosen by the client's seed.
    async fn step(&mut self, env: &Env, mode: Mode) -> anyhow::Result<()> {
        let inc = env.incarnation.load(Ordering::SeqCst);
        let key = KEYS[self.rng.random_range(0..KEYS.len())].to_string();
        let roll = match mode {
            Mode::Writes => self.rng.random_range(0..60),
            _ => self.rng.random_range(0..100),
        };
        self.n += 1;
        let value = format!("c{}-{}", self.id, self.n);
        match roll {
            0..25 => {
                self.new_write(env, inc, &key, Some(value), None).await?;
            }
            25..35 => {
                self.new_write(env, inc, &key, None, None).await?;
            }
            35..60 => {
                // A compare-and-set at the revision a read saw (0 when it found nothing).
                let seen = self.read(env, inc, &key, None).await;
                let if_revision = match seen {
                    Answer::Found { revision, .. } => revision,
                    Answer::NotFound { .. } => 0,
                    _ => return Ok(()),
                };
                let v = (self.rng.random_range(0..5) > 0).then_some(value);
                self.new_write(env, inc, &key, v, Some(if_revision)).await?;
            }
            60..85 => {
                let min = (self.newest.0 == inc && self.newest.1 > 0 && self.rng.random())
                    .then_some(self.newest.1);
                self.read(env, inc, &key, min).await;
            }
            _ => {
                // A later re-send of an answered write: answered from the ledger, never a second
                // record.
                let mine: Vec<&Sent> = self
                    .answered
                    .iter()
                    .filter(|(i, _)| *i == inc)
                    .map(|(_, s)| s)
                    .collect();
                if !mine.is_empty() {
                    let s = mine[self.rng.random_range(0..mine.len())].clone();
                    self.write(env, s, true, inc).await?;
                }
            }
        }
        Ok(())
    }

    async fn new_write(
        &mut self,
        env: &Env,
        inc: usize,
        key: &str,
        value: Option<String>,
        if_revision: Option<u64>,
    ) -> anyhow::Result<()> {
        let op_id = self.mint()?;
        let wait_ms = if self.rng.random_range(0..6) == 0 {
            0
        } else {
            2000
        };
        let mut body = serde_json::json!({"key": key, "op_id": op_id, "wait_ms": wait_ms});
        let request = match value {
            Some(v) => {
                body["value"] = v.clone().into();
                Request::Put {
                    key: key.into(),
                    value: v,
                    if_revision,
                }
            }
            None => {
                body["op"] = "delete".into();
                Request::Delete {
                    key: key.into(),
                    if_revision,
                }
            }
        };
        if let Some(r) = if_revision {
            body["if_revision"] = r.into();
        }
        let sent = Sent {
            op_id,
            body,
            request,
        };
        self.write(env, sent, false, inc).await
    }

    /// Sends a write, and again under the same op id after every answer that leaves it open
    /// (`unknown`, a transport error), up to five times.
    async fn write(
        &mut self,
        env: &Env,
        sent: Sent,
        mut retry: bool,
        inc: usize,
    ) -> anyhow::Result<()> {
        for _ in 0..5 {
            let target = self.pick(env).await?;
            let invoked = env.recorder.tick();
            let answer = send_write(&target.addr, &sent.body).await;
            let completed = env.recorder.tick();
            env.recorder.record(Op {
                client: self.id,
                node: target.fold,
                incarnation: inc,
                invoked,
                completed,
                request: sent.request.clone(),
                op_id: Some(sent.op_id.clone()),
                retry,
                answer: answer.clone(),
            });
            retry = true;
            match answer {
                Answer::Unknown | Answer::Transport(_) => {
                    // Paced, not synchronised: a retry too soon finds the same fault.
                    let ms = self.rng.random_range(50..300);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                Answer::Applied { revision } | Answer::Pending { revision } => {
                    if !self.answered.iter().any(|(_, s)| s.op_id == sent.op_id) {
                        self.answered.push((inc, sent.clone()));
                    }
                    if self.newest.0 != inc || self.newest.1 < revision {
                        self.newest = (inc, revision);
                    }
                    return Ok(());
                }
                _ => return Ok(()),
            }
        }
        Ok(())
    }

    /// A `POST /get`, recorded.
    async fn read(&mut self, env: &Env, inc: usize, key: &str, min: Option<u64>) -> Answer {
        let Ok(target) = self.pick(env).await else {
            return Answer::Transport("no node".into());
        };
        let invoked = env.recorder.tick();
        let answer = get(&target.addr, key, min, 3000).await;
        let completed = env.recorder.tick();
        env.recorder.record(Op {
            client: self.id,
            node: target.fold,
            incarnation: inc,
            invoked,
            completed,
            request: Request::Read {
                key: key.into(),
                min_revision: min,
            },
            op_id: None,
            retry: false,
            answer: answer.clone(),
        });
        answer
    }

    /// A node that is up, at random.
    async fn pick(&mut self, env: &Env) -> anyhow::Result<Target> {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let up: Vec<Target> = env
                .targets
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
                .flatten()
                .cloned()
                .collect();
            if !up.is_empty() {
                return Ok(up[self.rng.random_range(0..up.len())].clone());
            }
            anyhow::ensure!(std::time::Instant::now() < deadline, "no node came up");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// `POST /write` of `body`, its answer read as the history records it.
async fn send_write(addr: &str, body: &serde_json::Value) -> Answer {
    let sent = foldhost::serve::call_with_deadline(
        addr,
        "POST",
        "/write",
        body.to_string().as_bytes(),
        Some(TOKEN),
        Duration::from_secs(90),
    )
    .await;
    let (code, bytes) = match sent {
        Ok(r) => r,
        Err(e) => return Answer::Transport(e.to_string()),
    };
    let unreadable = || {
        Answer::Transport(format!(
            "HTTP {code}: {}",
            String::from_utf8_lossy(&bytes).trim_end()
        ))
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return unreadable();
    };
    let revision = v["revision"].as_u64();
    match (v["outcome"].as_str(), revision) {
        (Some("applied"), Some(revision)) => Answer::Applied { revision },
        (Some("pending"), Some(revision)) => Answer::Pending { revision },
        (Some("unknown"), _) => Answer::Unknown,
        (Some("refused"), _) => Answer::Refused {
            reason: v["reason"].as_str().unwrap_or_default().to_string(),
            revision,
            key: v["key"].as_str().map(str::to_string),
        },
        _ => unreadable(),
    }
}

/// `POST /get` of `key` (with `Foldhost-Min-Revision` when `min` is given), read as the history
/// records it.
async fn get(addr: &str, key: &str, min: Option<u64>, wait_ms: u64) -> Answer {
    let mut headers = vec![(foldhost_core::protocol::WAIT_MS_HEADER, wait_ms.to_string())];
    if let Some(m) = min {
        headers.push((foldhost_core::protocol::MIN_REVISION_HEADER, m.to_string()));
    }
    let asked = foldhost::serve::call_with_headers(
        addr,
        "POST",
        "/get",
        key.as_bytes(),
        None,
        &headers,
        Duration::from_secs(90),
    )
    .await;
    let (code, bytes) = match asked {
        Ok(r) => r,
        Err(e) => return Answer::Transport(e.to_string()),
    };
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    let through = v["applied_through"].as_u64().unwrap_or(0);
    match code {
        200 => {
            use base64::Engine as _;
            let value = match (v["value"].as_str(), v["value_base64"].as_str()) {
                (Some(t), _) => Some(t.as_bytes().to_vec()),
                (None, Some(b)) => base64::engine::general_purpose::STANDARD.decode(b).ok(),
                _ => None,
            };
            match (value, v["revision"].as_u64()) {
                (Some(value), Some(revision)) => Answer::Found {
                    value,
                    revision,
                    applied_through: through,
                },
                _ => Answer::Transport(format!("HTTP 200: {v}")),
            }
        }
        404 if v["found"] == false => Answer::NotFound {
            applied_through: through,
        },
        503 if v["behind"] == true => Answer::Behind,
        _ => Answer::Transport(format!(
            "HTTP {code}: {}",
            String::from_utf8_lossy(&bytes).trim_end()
        )),
    }
}

/// Runs one seed: `faults` in the seed's order, one per phase, after a quiet first phase; then
/// the checker. Returns the anomalies.
async fn run_seed(seed: u64, faults: &[Fault]) -> anyhow::Result<Vec<history::Anomaly>> {
    eprintln!("history seed {seed:#x}");
    let size = Size::get();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut faults = faults.to_vec();
    // A seeded shuffle, a recreation kept last (it ends the old stream's log).
    for i in (1..faults.len()).rev() {
        let j = rng.random_range(0..=i);
        faults.swap(i, j);
    }
    faults.sort_by_key(|f| *f == Fault::Recreate);
    let mut c = Cluster::start(seed, size.nodes, size.clients, &[]).await?;
    c.phase(&mut rng, size.ops_per_client, Mode::Mixed, None)
        .await?;
    for f in faults {
        c.phase(&mut rng, size.ops_per_client, Mode::Mixed, Some(f))
            .await?;
    }
    let anomalies = c.check().await?;
    if !anomalies.is_empty() {
        eprintln!(
            "{}",
            history::explain(&anomalies, &c.recorder.ops(), &c.log)
        );
    }
    Ok(anomalies)
}

/// Runs the seeds of `faults`, and fails naming every anomaly of every seed that has any.
async fn every_answer_holds(faults: &[Fault]) -> anyhow::Result<()> {
    let mut failed = Vec::new();
    for seed in seeds(2)? {
        let anomalies = run_seed(seed, faults).await?;
        if !anomalies.is_empty() {
            failed.push(format!(
                "history seed {seed:#x} (replay with FOLDHOST_HISTORY_SEED={seed:#x}): {} \
                 anomalies:\n{}",
                anomalies.len(),
                history::describe(&anomalies)
            ));
        }
    }
    anyhow::ensure!(failed.is_empty(), "{}", failed.join("\n"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_write_answer_holds_under_server_kills_connection_cuts_and_node_restarts_by_the_history_checker()
-> anyhow::Result<()> {
    every_answer_holds(&[
        Fault::KillServer,
        Fault::CutConnections,
        Fault::KillNode(Restart::OwnStore),
        Fault::KillNode(Restart::Empty),
        Fault::KillNode(Restart::PeerArtifact),
    ])
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_write_answer_holds_past_a_short_duplicate_window_a_swept_ledger_and_a_recreated_bucket_by_the_history_checker()
-> anyhow::Result<()> {
    every_answer_holds(&[
        Fault::ShortDuplicateWindow,
        Fault::SweepLedger,
        Fault::CutConnections,
        Fault::Recreate,
    ])
    .await
}

// ---------------------------------------------------------------------------------------------
// The mutations: a host built to break one promise, and the checker catching it.
// ---------------------------------------------------------------------------------------------

/// Fails unless the checker reports an anomaly by `rule` for a host carrying `mutation` (the
/// rule the mutation breaks: an anomaly of another rule would not show the checker sees this
/// one).
fn caught(
    mutation: &str,
    rule: char,
    seed: u64,
    anomalies: &[history::Anomaly],
) -> anyhow::Result<()> {
    anyhow::ensure!(
        anomalies.iter().any(|a| a.rule == rule),
        "history seed {seed:#x}: the host ran with {MUTATION_ENV}={mutation} and the checker \
         found no anomaly of rule ({rule}) (a host without the mutation answers correctly; is \
         it built in?); it found:\n{}",
        history::describe(anomalies)
    );
    eprintln!(
        "{mutation} caught:\n{}",
        history::describe(&anomalies[..anomalies.len().min(5)])
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_history_checker_catches_a_retry_republished() -> anyhow::Result<()> {
    let seed = seeds(1)?[0];
    eprintln!("history seed {seed:#x}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mutation = "republish_retry";
    let mut c = Cluster::start(seed, 2, 3, &[(MUTATION_ENV, mutation.into())]).await?;
    c.short_duplicate_window().await?;
    c.phase(&mut rng, 8, Mode::Writes, None).await?;
    // Past the broker's window only the ledger stands between a retry and a second record (a
    // precondition, not a synchronisation).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    c.phase(&mut rng, 0, Mode::ResendAll, None).await?;
    let anomalies = c.check().await?;
    caught(mutation, 'b', seed, &anomalies)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_history_checker_catches_an_applied_answer_before_the_fold_holds_it()
-> anyhow::Result<()> {
    let seed = seeds(1)?[0];
    eprintln!("history seed {seed:#x}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mutation = "early_applied";
    let tmp = tempfile::tempdir()?;
    let hold = tmp.path().join("hold");
    // The fold holds before the first commit that records a ledger row: a write through it is
    // durable and not applied, and a read right after cannot see it.
    let mut c = Cluster::start(
        seed,
        1,
        2,
        &[
            (MUTATION_ENV, mutation.into()),
            (
                foldhost_core::crashpoint::HOLD_ENV,
                format!(
                    "{}:{}",
                    foldhost_core::crashpoint::FOLD_LEDGER_COMMIT,
                    hold.display()
                ),
            ),
        ],
    )
    .await?;
    let env = Env {
        recorder: c.recorder.clone(),
        targets: c.targets.clone(),
        incarnation: c.incarnation.clone(),
        progress: Arc::new(AtomicUsize::new(0)),
    };
    let mut client = std::mem::take(&mut c.clients)
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no client"))?;
    let op_id = client.mint()?;
    let sent = Sent {
        op_id: op_id.clone(),
        body: serde_json::json!({"key": "k.a", "value": "held", "op_id": op_id, "wait_ms": 300}),
        request: put("k.a", "held", None),
    };
    client.write(&env, sent, false, 0).await?;
    client.read(&env, 0, "k.a", None).await;
    std::fs::write(hold.with_extension("release"), "")?;
    c.clients.push(client);
    c.clients.push(Client::new(1, seed ^ 1));
    c.settle().await?;
    c.phase(&mut rng, 10, Mode::Mixed, None).await?;
    let anomalies = c.check().await?;
    caught(mutation, 'e', seed, &anomalies)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_history_checker_catches_a_ledger_row_of_the_buckets_previous_life()
-> anyhow::Result<()> {
    let seed = seeds(1)?[0];
    eprintln!("history seed {seed:#x}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mutation = "stale_row";
    let mut c = Cluster::start(seed, 2, 3, &[(MUTATION_ENV, mutation.into())]).await?;
    c.phase(&mut rng, 8, Mode::Writes, None).await?;
    c.recreate().await?;
    // Every write of the old life sent again: its row is gone with the old stream.
    c.phase(&mut rng, 0, Mode::ResendAll, None).await?;
    let anomalies = c.check().await?;
    caught(mutation, 'a', seed, &anomalies)
}
