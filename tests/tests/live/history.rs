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

/// A put of `value` at `key`, compare-and-set on `if_revision` when given.
fn put(key: &str, value: &str, if_revision: Option<u64>) -> Request {
    Request::Put {
        key: key.into(),
        value: value.into(),
        if_revision,
    }
}

mod checker;
mod cluster;

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
