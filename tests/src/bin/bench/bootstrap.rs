//! The `bootstrap` benchmark: on a KEYS-key bucket (default 1 000 000; 32 B keys,
//! 100 B values), for each of fjall and RocksDB, through the release `foldhost` binary as a user
//! runs it:
//!
//! - **replay** (the baseline): `foldhost run --catch-up` of an empty store from revision 1;
//! - **export + upload**: a node folding the same bucket with `--export-every`; one round's time
//!   (lease, live export, upload, pointer, prune — `/status`'s `duration_ms`) and the node's peak
//!   RSS during the round above its steady state (the peak is reset through
//!   `/proc/PID/clear_refs` once the node is caught up);
//! - **download + import**: `foldhost bootstrap` of an empty store from the published pointer,
//!   its time and peak RSS.
//!
//! - **resume**: 1 000 writes later, `foldhost run --catch-up` of the replayed store (whose last
//!   run, the exporting node, was stopped with SIGTERM), which must deliver exactly those 1 000
//!   (the figure: resume ÷ replay, target ≤ 0.01). With
//!   `FOLDHOST_BENCH_RESUME_LOG=<filter>` the resume runs at that log level and its log is printed.
//!   `FOLDHOST_BENCH_BACKENDS=fjall` (or `rocksdb`, or both comma-separated) measures only those.
//!
//! Each through S3 (moto on loopback) and through the local file system (`file://`), so the
//! object store's own cost shows. The figure that matters is replay ÷ (download + import).
//!
//! Every timed figure is the median of several runs, printed with its range: [`REPLAYS`] replays,
//! [`BOOTSTRAPS`] bootstraps per transport and [`RESUMES`] resumes (each after its own 1 000
//! writes). On this two-core machine one replay of the same bucket took anywhere from 1.9 to 3.9 s
//! in one hour and a resume 25 to 65 ms, so a single run of either moved a ratio by half of itself.
//!
//! Needs `target/release/foldhost` built with `--features fjall,rocksdb` (`make bench-bootstrap`
//! builds both), or `FOLDHOST_BIN`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use foldhost_core::bucket::ConnectOptions;
use foldhost_localnats::LocalNats;
use foldhost_nats::{NatsConnection, NatsKv};
use foldhost_tests::{Moto, wait_status};

fn foldhost_release() -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var("FOLDHOST_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let bin = exe
        .parent()
        .map(|d| d.join("foldhost"))
        .ok_or_else(|| anyhow::anyhow!("no directory for {}", exe.display()))?;
    anyhow::ensure!(
        bin.exists(),
        "{} is missing: cargo build --release -p foldhost --features fjall,rocksdb",
        bin.display()
    );
    Ok(bin)
}

fn proc_kib(pid: u32, field: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Replays timed per backend (the store of the last one is the one exported and resumed).
const REPLAYS: usize = 3;
/// Bootstraps timed per backend and transport.
const BOOTSTRAPS: usize = 3;
/// Resumes timed per backend, each after its own 1 000 writes.
const RESUMES: usize = 5;

/// The median of `v` (not empty) and its range.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// [`timed_child`], also requiring `check` of its stderr to hold.
fn timed_child_stderr(
    mut cmd: Command,
    check: impl Fn(&str) -> bool,
) -> anyhow::Result<(f64, f64, String)> {
    let log = tempfile::NamedTempFile::new()?;
    cmd.stderr(log.reopen()?);
    let t = Instant::now();
    let status = cmd.stdout(Stdio::null()).status()?;
    let secs = t.elapsed().as_secs_f64();
    let err = std::fs::read_to_string(log.path())?;
    anyhow::ensure!(status.success() && check(&err), "{cmd:?}: {err}");
    Ok((secs, 0.0, err))
}

/// Runs `cmd` to completion, sampling its peak RSS (`VmHWM`, monotone: the last sample is the
/// closest to the true peak); returns (seconds, peak MiB, stdout).
fn timed_child(mut cmd: Command) -> anyhow::Result<(f64, f64, String)> {
    let t = Instant::now();
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let pid = child.id();
    let mut peak = 0u64;
    let status = loop {
        if let Some(kib) = proc_kib(pid, "VmHWM:") {
            peak = peak.max(kib);
        }
        if let Some(s) = child.try_wait()? {
            break s;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let secs = t.elapsed().as_secs_f64();
    let mut out = String::new();
    let mut err = String::new();
    use std::io::Read as _;
    if let Some(mut o) = child.stdout.take() {
        o.read_to_string(&mut out)?;
    }
    if let Some(mut e) = child.stderr.take() {
        e.read_to_string(&mut err)?;
    }
    anyhow::ensure!(status.success(), "{cmd:?} failed: {err}");
    Ok((secs, peak as f64 / 1024.0, out))
}

struct Node(Child);
impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One transport: its URL and the environment the client needs.
struct Target {
    name: &'static str,
    url: String,
    env: Vec<(&'static str, String)>,
    flags: Vec<&'static str>,
}

#[allow(clippy::too_many_arguments)]
async fn one(
    bin: &Path,
    nats: &str,
    backend: &str,
    keys: u64,
    last: u64,
    target: &Target,
    tmp: &Path,
    replay_s: f64,
) -> anyhow::Result<()> {
    // A key (and so a lease) per backend and store: a round cut short when the previous node was
    // stopped holds its lease until it runs out.
    let key = format!("boot-{backend}-{}", target.name);
    let store = tmp.join(format!("{backend}-replayed"));
    let (export_s, steady, round_peak) =
        export_round(bin, nats, backend, &key, target, &store, last).await?;
    let (boots, boot_peak, bytes) = bootstraps(bin, &key, target, (tmp, backend), last)?;
    let (boot_s, boot_min, boot_max) = spread(boots);
    let mb = bytes as f64 / 1e6;
    println!(
        "  {backend:>7} via {:<4}: artifact {mb:.1} MB; export+upload {export_s:.2} s ({:.0} keys/s, {:.0} MB/s); download+import {boot_s:.2} s (median of {BOOTSTRAPS}, {boot_min:.2}–{boot_max:.2}; {:.0} keys/s, {:.0} MB/s); replay ÷ bootstrap = {:.1}×",
        target.name,
        keys as f64 / export_s,
        mb / export_s,
        keys as f64 / boot_s,
        mb / boot_s,
        replay_s / boot_s,
    );
    super::table::row(
        format!(
            "bootstrap from an artifact ({}), {backend}, {keys} keys: download + import (median of {BOOTSTRAPS}, {boot_min:.2}–{boot_max:.2} s)",
            target.name
        ),
        format!("{boot_s:.2} s ({mb:.0} MB)"),
        format!("full replay from revision 1 {replay_s:.2} s (median of {REPLAYS})"),
        replay_s / boot_s,
        "≥ 20 (replay ÷ bootstrap)",
    );
    super::table::row(
        format!(
            "export + upload round ({}), {backend}, {keys} keys",
            target.name
        ),
        format!("{export_s:.2} s"),
        format!("full replay {replay_s:.2} s"),
        export_s / replay_s,
        "",
    );
    println!(
        "  {backend:>7} via {:<4}: RSS node steady {steady:.0} MiB, round peak {round_peak:.0} MiB (+{:.0}); bootstrap process peak {boot_peak:.0} MiB ({:+.0} vs the node's steady state)",
        target.name,
        round_peak - steady,
        boot_peak - steady,
    );
    Ok(())
}

/// A 100-byte value that compresses about as well as real configuration (hex digits: 2:1), not
/// the 50:1 of a repeated byte.
fn value(i: u64) -> Vec<u8> {
    let h = blake3::hash(&i.to_le_bytes()).to_hex();
    let mut v = h.as_bytes().to_vec();
    v.extend_from_slice(&h.as_bytes()[..36]);
    v
}

/// Runs the benchmark for `keys` keys.
pub async fn run(keys: u64) -> anyhow::Result<()> {
    let bin = foldhost_release()?;
    let server = LocalNats::start()?;
    let moto = Moto::start().await?;
    let conn = NatsConnection::open(ConnectOptions::new(server.url())).await?;
    let kv = conn
        .bucket(
            "boot",
            &foldhost_core::bucket::BucketConfig {
                max_bytes: None,
                ..Default::default()
            },
        )
        .await?;
    let t = Instant::now();
    foldhost_tests::publish_all(
        kv.jetstream(),
        (0..keys).map(|i| (format!("$KV.boot.key.{i:026}"), value(i).into())),
    )
    .await?;
    println!(
        "bootstrap — {keys} keys (32 B keys, 100 B hex values) seeded in {:.1} s; replay = `foldhost run --catch-up` from revision 1",
        t.elapsed().as_secs_f64()
    );
    let tmp = tempfile::tempdir()?;
    let files = tmp.path().join("objects");
    std::fs::create_dir_all(&files)?;
    let targets = [
        Target {
            name: "s3",
            url: moto.url("bench"),
            env: moto.env(),
            flags: vec![],
        },
        Target {
            name: "file",
            url: format!("file://{}", files.display()),
            env: vec![],
            flags: vec!["--allow-non-atomic-pointer"],
        },
    ];
    let only = std::env::var("FOLDHOST_BENCH_BACKENDS").unwrap_or_default();
    for backend in ["fjall", "rocksdb"] {
        if !only.is_empty() && !only.split(',').any(|b| b.trim() == backend) {
            continue;
        }
        let last = kv.positions().await?.last_sequence;
        let store = tmp.path().join(format!("{backend}-replayed"));
        let fold = Fold {
            bin: &bin,
            nats: &server.url(),
            backend,
            keys,
            store: &store,
        };
        let replay = fold.replays(tmp.path())?;
        for target in &targets {
            one(
                &bin,
                &server.url(),
                backend,
                keys,
                last,
                target,
                tmp.path(),
                replay.median,
            )
            .await?;
        }
        fold.resumes(&kv, &replay).await?;
    }
    Ok(())
}

/// One backend's fold of the bucket through the release binary: its replays and resumes.
struct Fold<'a> {
    bin: &'a Path,
    nats: &'a str,
    backend: &'a str,
    keys: u64,
    /// The store the last replay leaves, which the resumes run on.
    store: &'a Path,
}

/// The replays' figures: median, fastest and slowest seconds, peak RSS in MiB.
struct Replay {
    median: f64,
    min: f64,
    max: f64,
    peak: f64,
}

impl Fold<'_> {
    /// [`REPLAYS`] full replays from revision 1, each into an empty store (the last one's kept
    /// as [`Fold::store`]); prints their figures.
    fn replays(&self, tmp: &Path) -> anyhow::Result<Replay> {
        let (backend, keys) = (self.backend, self.keys);
        let mut replays = Vec::with_capacity(REPLAYS);
        let mut replay_peak = 0f64;
        for i in 0..REPLAYS {
            let into = if i + 1 == REPLAYS {
                self.store.to_path_buf()
            } else {
                tmp.join(format!("{backend}-replay-{i}"))
            };
            let mut cmd = Command::new(self.bin);
            cmd.args(["run", "--bucket", "boot", "--nats", self.nats, "--store"])
                .arg(&into)
                .args(["--backend", backend, "--catch-up"])
                .env("FOLDHOST_LOG", "warn");
            let (secs, peak, _) = timed_child(cmd)?;
            replays.push(secs);
            replay_peak = replay_peak.max(peak);
            if into != self.store {
                std::fs::remove_dir_all(&into)?;
            }
        }
        let (replay_s, replay_min, replay_max) = spread(replays);
        println!(
            "  {backend:>7} replay: {replay_s:.2} s (median of {REPLAYS}, {replay_min:.2}–{replay_max:.2}; {:.0} keys/s), peak RSS {replay_peak:.0} MiB",
            keys as f64 / replay_s
        );
        Ok(Replay {
            median: replay_s,
            min: replay_min,
            max: replay_max,
            peak: replay_peak,
        })
    }

    /// Resume: 1 000 writes after the fold's cursor, then a run that must deliver exactly those;
    /// [`RESUMES`] times. Prints the figures beside `replay`'s and adds the row.
    async fn resumes(&self, kv: &NatsKv, replay: &Replay) -> anyhow::Result<()> {
        let (backend, keys) = (self.backend, self.keys);
        let mut resumes = Vec::with_capacity(RESUMES);
        for round in 0..RESUMES as u64 {
            foldhost_tests::publish_all(
                kv.jetstream(),
                (0..1000u64).map(|i| {
                    (
                        format!(
                            "$KV.boot.key.{:026}",
                            (i + round * 1000) * 997 % keys.max(1)
                        ),
                        value(i + round * 1000 + keys).into(),
                    )
                }),
            )
            .await?;
            resumes.push(self.resume()?);
        }
        let (resume_s, resume_min, resume_max) = spread(resumes);
        let (replay_s, replay_min, replay_max, replay_peak) =
            (replay.median, replay.min, replay.max, replay.peak);
        println!(
            "  {backend:>7} resume after 1 000 writes: {resume_s:.3} s (median of {RESUMES}, {resume_min:.3}–{resume_max:.3}), exactly 1 000 delivered each time; resume ÷ replay = {:.4} ({:.4}–{:.4})",
            resume_s / replay_s,
            resume_min / replay_s,
            resume_max / replay_s,
        );
        super::table::row(
            format!(
                "resume after 1 000 writes, {backend}, {keys}-key fold (exactly 1 000 delivered; median of {RESUMES}, {resume_min:.3}–{resume_max:.3} s)"
            ),
            format!("{resume_s:.3} s"),
            format!(
                "full replay {replay_s:.2} s (median of {REPLAYS}, {replay_min:.2}–{replay_max:.2}; peak RSS {replay_peak:.0} MiB)"
            ),
            resume_s / replay_s,
            "≤ 0.01",
        );
        Ok(())
    }

    /// One resume on [`Fold::store`]: a `--catch-up` run that must deliver exactly 1 000
    /// updates; its seconds.
    fn resume(&self) -> anyhow::Result<f64> {
        let mut cmd = Command::new(self.bin);
        cmd.args(["run", "--bucket", "boot", "--nats", self.nats, "--store"])
            .arg(self.store)
            .args(["--backend", self.backend, "--catch-up"])
            .env(
                "FOLDHOST_LOG",
                std::env::var("FOLDHOST_BENCH_RESUME_LOG").unwrap_or_else(|_| "warn".into()),
            );
        let (secs, _, log) = timed_child_stderr(cmd, |stderr| {
            stderr.contains("(1000 updates delivered this run)")
        })?;
        if std::env::var_os("FOLDHOST_BENCH_RESUME_LOG").is_some() {
            eprintln!("{log}");
        }
        Ok(secs)
    }
}

/// Export + upload: a node on the replayed `store`, one round published under `key` to
/// `target`; the round's seconds, the node's steady RSS and the round's peak RSS (MiB).
async fn export_round(
    bin: &Path,
    nats: &str,
    backend: &str,
    key: &str,
    target: &Target,
    store: &Path,
    last: u64,
) -> anyhow::Result<(f64, f64, f64)> {
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut cmd = Command::new(bin);
    cmd.args(["run", "--bucket", "boot", "--nats", nats, "--store"])
        .arg(store)
        .args(["--backend", backend, "--listen", &addr])
        .args(["--artifacts", &target.url, "--artifact-key", key])
        .args(&target.flags)
        .args(["--export-every", "5", "--node-id", "bench"])
        .envs(target.env.iter().map(|(k, v)| (*k, v.as_str())))
        .env("FOLDHOST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut node = Node(cmd.spawn()?);
    let pid = node.0.id();
    let s = wait_status(&addr, |s| s.applied_through == last).await?;
    anyhow::ensure!(
        s.last_export.is_none(),
        "a round started before the steady state was read"
    );
    let steady = proc_kib(pid, "VmRSS:").unwrap_or(0) as f64 / 1024.0;
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")?;
    // The round that published: kept in the report while later rounds are up to date (a round
    // longer than the period is followed at once by one that finds nothing newer).
    let s = wait_status(&addr, |s| {
        s.last_export
            .as_ref()
            .and_then(|e| e.last_published.as_ref())
            .is_some_and(|p| p.cursor == last)
    })
    .await?;
    let round_peak = proc_kib(pid, "VmHWM:").unwrap_or(0) as f64 / 1024.0;
    // Stopped as an operator stops a node (SIGTERM): the resume below follows a clean stop.
    foldhost_tests::terminate(&mut node.0)?;
    drop(node);
    let round = s
        .last_export
        .and_then(|e| e.last_published)
        .ok_or_else(|| anyhow::anyhow!("no published round"))?;
    Ok((round.duration_ms as f64 / 1000.0, steady, round_peak))
}

/// Download + import: a new node's bootstrap from `key` on `target`, [`BOOTSTRAPS`] times into an
/// empty store under `tmp` named after `backend`; each one's seconds, the peak RSS (MiB) and the artifact's
/// bytes.
fn bootstraps(
    bin: &Path,
    key: &str,
    target: &Target,
    (tmp, backend): (&Path, &str),
    last: u64,
) -> anyhow::Result<(Vec<f64>, f64, u64)> {
    let mut boots = Vec::with_capacity(BOOTSTRAPS);
    let mut boot_peak = 0f64;
    let mut bytes = 0u64;
    for i in 0..BOOTSTRAPS {
        let fresh = tmp.join(format!("{backend}-{}-boot-{i}", target.name));
        let mut cmd = Command::new(bin);
        cmd.args([
            "bootstrap",
            "--artifacts",
            &target.url,
            "--artifact-key",
            key,
        ])
        .args(&target.flags)
        .arg("--store")
        .arg(&fresh)
        .envs(target.env.iter().map(|(k, v)| (*k, v.as_str())));
        let (secs, peak, out) = timed_child(cmd)?;
        let m: serde_json::Value = serde_json::from_str(out.trim())?;
        anyhow::ensure!(m["cursor"].as_u64() == Some(last), "bootstrapped {m}");
        bytes = m["files"]
            .as_array()
            .map(|fs| fs.iter().filter_map(|f| f["size"].as_u64()).sum())
            .unwrap_or(0);
        boots.push(secs);
        boot_peak = boot_peak.max(peak);
        std::fs::remove_dir_all(&fresh)?;
    }
    Ok((boots, boot_peak, bytes))
}
