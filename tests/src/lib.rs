//! Shared helpers for the cross-crate suites: a real nats-server per test, buckets, the `foldhost`
//! binary, and the two views every convergence test compares (the bucket, and the fold's `dump`).
//!
//! Every test starts its own nats-server on a free loopback port ([`foldhost::localnats`]), so tests
//! run in parallel without sharing state.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use base64::Engine as _;
use foldhost::kv::KvError;
use foldhost::localnats::LocalNats;
use foldhost::nats::{NatsConnection, NatsKv};
use foldhost::stores::{ConnectOptions, StoreConfig};

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
                &StoreConfig {
                    max_bytes: None,
                    ..StoreConfig::default()
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
                &StoreConfig {
                    max_bytes: None,
                    max_history: history,
                    ..StoreConfig::default()
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
    use foldhost::kv::KvReader;
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

/// A `foldhost` command with logging quiet unless asked.
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
    c
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

/// `foldhost status --json` of a store, parsed.
pub fn status_store(store: &Path) -> anyhow::Result<serde_json::Value> {
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

/// Polls `GET /status` on `addr` until `done` holds for it (or 30 s pass).
pub async fn wait_status(
    addr: &str,
    mut done: impl FnMut(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut last = serde_json::Value::Null;
    while std::time::Instant::now() < deadline {
        if let Ok((200, body)) = foldhost::serve::call(addr, "GET", "/status", b"").await {
            last = serde_json::from_slice(&body)?;
            if done(&last) {
                return Ok(last);
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    anyhow::bail!("status never reached the expected state; last: {last}")
}

/// Sends SIGTERM to a child (a clean shutdown) and waits for it.
pub fn terminate(child: &mut std::process::Child) -> anyhow::Result<std::process::ExitStatus> {
    let pid = child.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status()?;
    Ok(child.wait()?)
}
