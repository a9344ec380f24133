//! Shared helpers for the cross-crate suites: a real nats-server per test, buckets, the `foldhost`
//! binary, and the two views every convergence test compares (the bucket, and the fold's `dump`).
//!
//! Every test starts its own nats-server on a free loopback port ([`foldhost_localnats`]), so tests
//! run in parallel without sharing state.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use base64::Engine as _;
use foldhost_core::bucket::{BucketConfig, ConnectOptions};
use foldhost_core::kv::KvError;
use foldhost_core::status::StatusReport;
use foldhost_localnats::LocalNats;
use foldhost_nats::{NatsConnection, NatsKv};

pub mod history;
pub mod proxy;

/// A bucket's contents: key → (value, revision).
pub type Contents = BTreeMap<String, (Vec<u8>, u64)>;

/// A started server plus a connection to it.
pub struct Harness {
    /// The server (killed on drop).
    pub server: LocalNats,
    /// A connection.
    pub conn: NatsConnection,
}

impl Harness {
    /// Starts a server and connects.
    pub async fn start() -> anyhow::Result<Self> {
        let server = LocalNats::start()?;
        let conn = NatsConnection::open(ConnectOptions::new(server.url())).await?;
        Ok(Harness { server, conn })
    }

    /// Creates (or opens) `name` with no size cap and history 1.
    pub async fn bucket(&self, name: &str) -> Result<Arc<NatsKv>, KvError> {
        self.conn
            .bucket(
                name,
                &BucketConfig {
                    max_bytes: None,
                    ..BucketConfig::default()
                },
            )
            .await
    }

    /// Creates (or opens) `name` with an age limit: a bucket whose retention evicts current
    /// values by age.
    pub async fn aging_bucket(
        &self,
        name: &str,
        max_age: std::time::Duration,
    ) -> Result<Arc<NatsKv>, KvError> {
        self.conn
            .bucket(
                name,
                &BucketConfig {
                    max_bytes: None,
                    max_age: Some(max_age),
                    ..BucketConfig::default()
                },
            )
            .await
    }

    /// Creates (or opens) `name` keeping `history` revisions per key: a history-1 bucket drops a
    /// key's older message as soon as it is overwritten, so a watcher that lags behind never sees
    /// it (tests that need every revision delivered use this).
    pub async fn bucket_with_history(
        &self,
        name: &str,
        history: i64,
    ) -> Result<Arc<NatsKv>, KvError> {
        self.conn
            .bucket(
                name,
                &BucketConfig {
                    max_bytes: None,
                    max_history: history,
                    ..BucketConfig::default()
                },
            )
            .await
    }

    /// The server URL.
    pub fn url(&self) -> String {
        self.server.url()
    }
}

/// The bucket's live contents, from a listing.
pub async fn bucket_contents(kv: &NatsKv) -> anyhow::Result<Contents> {
    use foldhost_core::kv::KvReader;
    let mut out = Contents::new();
    for e in kv.scan("").await? {
        let rev = e
            .version
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("{}: scan gave no revision", e.key))?;
        out.insert(e.key, (e.value.to_vec(), rev));
    }
    Ok(out)
}

/// Publishes `(subject, value)` pairs, awaiting acks in windows of 512 (the JetStream context
/// bounds the acks in flight: publishing more without awaiting them waits forever).
pub async fn publish_all(
    js: &async_nats::jetstream::Context,
    msgs: impl IntoIterator<Item = (String, bytes::Bytes)>,
) -> anyhow::Result<()> {
    let mut acks = Vec::new();
    for (subject, value) in msgs {
        acks.push(js.publish(subject, value).await?);
        if acks.len() >= 512 {
            for a in acks.drain(..) {
                a.await?;
            }
        }
    }
    for a in acks {
        a.await?;
    }
    Ok(())
}

/// The `foldhost` binary built beside this test (target/<profile>/foldhost), or `FOLDHOST_BIN`.
pub fn foldhost_bin() -> PathBuf {
    if let Ok(p) = std::env::var("FOLDHOST_BIN") {
        return PathBuf::from(p);
    }
    // The test executable lives in target/<profile>/deps/; the binary one level up.
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_default();
    dir.join("foldhost")
}

/// `foldhost run` of `bucket` on `h`'s server into `store`, serving `--listen ADDR` when given.
pub fn run_command(h: &Harness, bucket: &str, store: &Path, listen: Option<&str>) -> Command {
    let mut c = foldhost();
    c.args(["run", "--bucket", bucket, "--nats", &h.url(), "--store"])
        .arg(store);
    if let Some(addr) = listen {
        c.args(["--listen", addr]);
    }
    c
}

/// The compiled-component cache every `foldhost` the tests start shares (beside the binary, in
/// `target/`, never the user's own cache): a large guest (JavaScript, Python) compiles once per
/// checkout, not once per start. Entries are checked before use, so sharing it across tests and
/// runs is safe; a test about the cache itself passes its own `--guest-cache`.
pub fn test_guest_cache() -> PathBuf {
    foldhost_bin().with_file_name("foldhost-test-guest-cache")
}

/// A `foldhost` command with logging quiet unless asked, and the tests' compiled-component cache
/// ([`test_guest_cache`]).
pub fn foldhost() -> Command {
    let bin = foldhost_bin();
    assert!(
        bin.exists(),
        "{} not built: run `cargo build -p foldhost` first (the test command does)",
        bin.display()
    );
    let mut c = Command::new(bin);
    c.env(
        "FOLDHOST_LOG",
        std::env::var("FOLDHOST_LOG").unwrap_or_else(|_| "warn".into()),
    );
    c.env("FOLDHOST_GUEST_CACHE", test_guest_cache());
    c
}

/// The last line a process writes when it dies at an armed crash point.
pub fn crash_line(point: &str, n: u64) -> String {
    format!("foldhost: crash point {point} reached (hit {n}): aborting")
}

/// Runs `cmd` armed at the crash point `point:n` (`FOLDHOST_CRASH_AT`) to its end, and checks that
/// it died there: killed by SIGABRT (not a panic's exit 1, not a clean exit) with the crash line
/// as the last line of its stderr. Returns its output. The binary must be a `crashpoints` build
/// (the test command's); any other refuses the variable with exit code 2, which fails here.
pub fn run_to_crash(mut cmd: Command, point: &str, n: u64) -> anyhow::Result<std::process::Output> {
    use std::os::unix::process::ExitStatusExt as _;
    let out = cmd
        .env(foldhost_core::crashpoint::ENV, format!("{point}:{n}"))
        .stdin(std::process::Stdio::null())
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
    anyhow::ensure!(
        out.status.signal() == Some(6) && last == Some(crash_line(point, n).as_str()),
        "armed at {point}:{n}, the process did not crash there: {} — last stderr line {last:?}\n{stderr}",
        out.status
    );
    Ok(out)
}

/// `foldhost dump --json` of a store, parsed.
pub fn dump_store(store: &Path) -> anyhow::Result<Contents> {
    let out = foldhost()
        .args(["dump", "--json", "--store"])
        .arg(store)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "dump failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut c = Contents::new();
    for line in String::from_utf8(out.stdout)?.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let key = v["key"]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("no key in {line}"))?
            .to_string();
        let value = base64::engine::general_purpose::STANDARD.decode(
            v["value_b64"]
                .as_str()
                .ok_or_else(|| anyhow::anyhow!("no value_b64 in {line}"))?,
        )?;
        let rev = v["revision"]
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("no revision in {line}"))?;
        c.insert(key, (value, rev));
    }
    Ok(c)
}

/// `foldhost status --json` of a store, read as the one status model.
pub fn status_store(store: &Path) -> anyhow::Result<StatusReport> {
    let out = foldhost()
        .args(["status", "--json", "--store"])
        .arg(store)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Describes the first difference between two contents, for assertion messages.
pub fn first_difference(want: &Contents, got: &Contents) -> Option<String> {
    for (k, v) in want {
        match got.get(k) {
            None => return Some(format!("missing key {k:?} (rev {})", v.1)),
            Some(g) if g != v => {
                return Some(format!(
                    "key {k:?}: want rev {} ({} bytes), got rev {} ({} bytes)",
                    v.1,
                    v.0.len(),
                    g.1,
                    g.0.len()
                ));
            }
            _ => {}
        }
    }
    for k in got.keys() {
        if !want.contains_key(k) {
            return Some(format!("extra key {k:?} (deleted or never written)"));
        }
    }
    None
}

/// A guest component built by `guests/build.sh` (`FOLDHOST_GUESTS_DIR` overrides the directory).
pub fn guest_wasm(name: &str) -> PathBuf {
    let dir = std::env::var("FOLDHOST_GUESTS_DIR").map_or_else(
        |_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../guests/target/wasm32-wasip2/release"),
        PathBuf::from,
    );
    let p = dir.join(format!("{name}.wasm"));
    assert!(
        p.is_file(),
        "{} not built: run guests/build.sh (the test command does)",
        p.display()
    );
    p
}

/// A hostile component that lives beside the guests as text (compiled by the host's WAT support).
pub fn hostile_wat(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../guests/hostile-imports")
        .join(name)
}

/// Polls `GET /status` on `addr`, read as the one status model, until `done` holds for it. The
/// deadline (120 s) only bounds a test that would otherwise hang; nothing asserts how fast the
/// state is reached. A status from a node this process did not start is an error at once (see
/// [`started_here`]), never a state reached.
pub async fn wait_status(
    addr: &str,
    mut done: impl FnMut(&StatusReport) -> bool,
) -> anyhow::Result<StatusReport> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let mut last = None;
    while std::time::Instant::now() < deadline {
        if let Ok((200, body)) = foldhost::serve::call(addr, "GET", "/status", b"").await {
            let s: StatusReport = serde_json::from_slice(&body)?;
            anyhow::ensure!(
                started_here(s.pid),
                "the node answering on {addr} is pid {}, which this process did not start: \
                 another test's node took the port",
                s.pid
            );
            if done(&s) {
                return Ok(s);
            }
            last = Some(s);
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    anyhow::bail!("status never reached the expected state; last: {last:?}")
}

/// Whether `pid` is this process or a descendant of it (a child, or the child of a wrapper such
/// as `strace` or `perf` that `FOLDHOST_BIN` names; at most [`WRAPPER_DEPTH`] levels). A node's
/// listen port is reserved for this process ([`foldhost_localnats::reserved_port`]), so no node of
/// another test should answer on it; should something else still hold it (a process that reserves
/// ports another way), its status must never pass for ours.
fn started_here(pid: u32) -> bool {
    let me = std::process::id();
    let mut p = pid;
    for _ in 0..=WRAPPER_DEPTH {
        if p == me {
            return true;
        }
        match parent_of(p) {
            Some(parent) if parent > 1 => p = parent,
            _ => return false,
        }
    }
    false
}

/// How many processes may stand between the test and the node it started.
const WRAPPER_DEPTH: usize = 4;

/// The parent of `pid`, from `/proc/PID/stat` (the fields after the command name's closing
/// parenthesis: state, then the parent's pid).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Polls `cond` every 20 ms until it holds. The deadline (120 s) only bounds a test that would
/// otherwise hang; nothing asserts how fast `what` happens.
pub async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !cond() {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "waited 120 s for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    Ok(())
}

/// The stderr lines of a spawned child, read by a thread as they come ([`spawn_logged`]).
pub struct LogLines {
    rx: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl LogLines {
    /// Waits for a line containing `needle` and returns it. The deadline (120 s) only bounds a
    /// test that would otherwise hang. Fails at once if the child closed its stderr first.
    pub fn wait_for(&mut self, needle: &str) -> anyhow::Result<String> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => {
                    let hit = line.contains(needle);
                    self.seen.push(line.clone());
                    if hit {
                        return Ok(line);
                    }
                }
                Err(e) => anyhow::bail!(
                    "no log line containing {needle:?} ({e}); the log so far:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }
}

/// Spawns `cmd` with its stderr read line by line into a [`LogLines`] (stdout is discarded).
pub fn spawn_logged(mut cmd: Command) -> anyhow::Result<(std::process::Child, LogLines)> {
    use std::io::BufRead as _;
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let stderr = child
        .stderr
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stderr pipe"))?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    Ok((
        child,
        LogLines {
            rx,
            seen: Vec::new(),
        },
    ))
}

/// Asks the router guest serving `addr` for every `route.<host>` in `routes` and checks each
/// answer's upstream is the one in the route's value. Returns how many it checked.
pub async fn check_routes_served(addr: &str, routes: &Contents) -> anyhow::Result<usize> {
    let mut checked = 0;
    for (key, (value, _)) in routes {
        let Some(host_name) = key.strip_prefix("route.") else {
            continue;
        };
        let (code, body) =
            foldhost::serve::call(addr, "POST", "/query", host_name.as_bytes()).await?;
        anyhow::ensure!(
            code == 200,
            "{host_name}: {code} {}",
            String::from_utf8_lossy(&body)
        );
        let got: serde_json::Value = serde_json::from_slice(&body)?;
        let want: serde_json::Value = serde_json::from_slice(value)?;
        anyhow::ensure!(
            got["upstream"] == want["upstream"],
            "{host_name}: answered {got}, the bucket says {want}"
        );
        checked += 1;
    }
    Ok(checked)
}

/// Sends SIGTERM to a child (a clean shutdown) and waits for it.
pub fn terminate(child: &mut std::process::Child) -> anyhow::Result<std::process::ExitStatus> {
    let pid = child.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status()?;
    Ok(child.wait()?)
}

/// A throwaway S3-compatible server (moto, server mode) on loopback with one bucket, killed on
/// drop. `scripts/setup.sh` installs it; `MOTO_SERVER_BIN` overrides where it is found.
pub struct Moto {
    child: std::process::Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// The bucket created at start.
    pub bucket: String,
}

impl Moto {
    /// Starts moto and creates the bucket `artifacts`. Waits (on a condition: the bucket is
    /// created) at most 60 s. The port is chosen by binding and releasing it, so another process
    /// can take it before moto binds it: moto then exits, and the start tries again on another
    /// port (at most four times); an answer is only believed while moto is still running.
    pub async fn start() -> anyhow::Result<Self> {
        const ATTEMPTS: usize = 4;
        let mut attempt = 1;
        loop {
            match Self::start_once().await? {
                Some(moto) => return Ok(moto),
                None if attempt < ATTEMPTS => attempt += 1,
                None => anyhow::bail!("moto exited at start {ATTEMPTS} times (ports taken?)"),
            }
        }
    }

    /// One try; `None` when moto exited before it created the bucket.
    async fn start_once() -> anyhow::Result<Option<Self>> {
        let bin = std::env::var("MOTO_SERVER_BIN").unwrap_or_else(|_| "moto_server".into());
        let port = foldhost_localnats::reserved_port()?;
        let addr = format!("127.0.0.1:{port}");
        let child = Command::new(&bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| anyhow::anyhow!("{bin}: {e} (run scripts/setup.sh)"))?;
        let mut moto = Moto {
            child,
            addr,
            bucket: "artifacts".into(),
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            if moto.child.try_wait()?.is_some() {
                return Ok(None);
            }
            // S3 CreateBucket: `PUT /bucket` (moto accepts it unsigned).
            let answer =
                foldhost::serve::call(&moto.addr, "PUT", &format!("/{}", moto.bucket), b"").await;
            // Whatever answered, it was not moto if moto has gone.
            if moto.child.try_wait()?.is_some() {
                return Ok(None);
            }
            // Another answer may come from a process that holds the port while moto is still
            // starting (it exits once it fails to bind): asked again until the deadline.
            let last = match answer {
                Ok((200, _)) => return Ok(Some(moto)),
                Ok((code, body)) => format!(
                    "create bucket answered {code}: {}",
                    String::from_utf8_lossy(&body)
                ),
                Err(e) => e.to_string(),
            };
            if std::time::Instant::now() >= deadline {
                anyhow::bail!("moto on {}: {last}", moto.addr);
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// The `--artifacts` URL of `prefix` in the bucket.
    pub fn url(&self, prefix: &str) -> String {
        format!("s3://{}/{prefix}", self.bucket)
    }

    /// The environment the object-store client needs to talk to this server (conditional puts on).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT", format!("http://{}", self.addr)),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_ACCESS_KEY_ID", "test".into()),
            ("AWS_SECRET_ACCESS_KEY", "test".into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_CONDITIONAL_PUT", "etag".into()),
            ("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "false".into()),
        ]
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every file under `dir`, recursively (an object store's files on `file://`, a store's files).
pub fn files_under(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p);
            }
        }
    }
    Ok(out)
}

/// `foldhost swap --listen LISTEN --guest GUEST.wasm` (with `--admin-token-file` when given, else
/// the token the host's `/status` names): the swap's report.
pub fn swap_to(
    listen: &str,
    guest: &str,
    admin_token_file: Option<&Path>,
) -> anyhow::Result<serde_json::Value> {
    let mut c = foldhost();
    c.args(["swap", "--listen", listen, "--guest"])
        .arg(guest_wasm(guest))
        .env_remove("FOLDHOST_ADMIN_TOKEN");
    if let Some(f) = admin_token_file {
        c.arg("--admin-token-file").arg(f);
    }
    let out = c.output()?;
    anyhow::ensure!(
        out.status.success(),
        "swap to {guest}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Edits `bucket`'s stream to `max_age` (zero: no age limit), as an operator would (no message is
/// written); the duplicate window is cut to the age, which the server requires.
pub async fn set_max_age(
    kv: &NatsKv,
    bucket: &str,
    max_age: std::time::Duration,
) -> anyhow::Result<()> {
    let mut stream = kv.jetstream().get_stream(format!("KV_{bucket}")).await?;
    let mut config = stream.info().await?.config.clone();
    config.max_age = max_age;
    if !max_age.is_zero() && config.duplicate_window > max_age {
        config.duplicate_window = max_age;
    }
    kv.jetstream().update_stream(config).await?;
    Ok(())
}
