//! Deterministic simulation of the fold: the real `watch_applied`, the real repairs
//! (re-list and artifact restore), the real stores and the real guest host, over the simulated
//! bucket (`foldhost_fold::testkit::SimBucket`) with faults injected at every store-apply call and at
//! guest calls. No nats-server, no wall clock: each seed runs in its own single-threaded runtime
//! with paused time, so a seed is a complete, replayable description of a run.
//!
//! A seed picks a scenario ([`world::Scenario`]): backend, scope (whole bucket, a prefix, two
//! prefixes), batch size (1, 3, 16, 256), a bucket that keeps or evicts current values, a native
//! applier or the `kvstore` component (swapped to `kvstore-v2` mid-run), and the node's lives. In
//! each life the store fails transiently, crashes before or after a commit, or tears it (the
//! append log's tail cut inside the last record); the guest fails a chosen `apply` call; the
//! driver writes, deletes and purges, opens delivery gaps, evicts up to a peer's published
//! artifact, and exports mid-run.
//!
//! Invariants checked: the fold converges to every write minus every real delete (after every
//! round and at the end); the running guest answers as a fresh instance hydrated from the fold
//! and as the truth says; committed cursors never move backward and a reopened store holds at
//! least its last durable commit; `apply` is never shown a regression or a phantom delete; every
//! mid-run export resumes to the truth. Between its steps the driver sends queries — more often
//! while a batch waits re-queued after a failed commit, some of them trapping the guest — and after
//! every round the running guest must answer as a fresh one built from the fold, and so must the
//! query instance (docs/design.md, "Queries off the fold's path") once it is level with the
//! committed fold, asked every key in one ask; a pinned case
//! places a trapping query between a failed commit and its retry on every backend and guest.
//!
//! Tiers: the fast tier (these tests, in CI) runs [`FAST_SEEDS`] seeds per backend;
//! `FOLDHOST_SIM_DEEP=1` runs ten times as many (with `--profile sim-deep`, whose timeout allows
//! them); `FOLDHOST_SIM_SEED=<seed>` runs that one seed (the failure message prints the command).
//! `FOLDHOST_SIM_LOG=<filter>` prints the fold's own log; `FOLDHOST_SIM_DEBUG=1` prints every
//! store-apply call, and the store's contents when a wait gets stuck.

mod faults;
mod run;
mod world;

use foldhost_core::storedir::Backend;

use run::{Outcome, Sim};
use world::Scenario;

/// Seeds per backend in the fast tier.
const FAST_SEEDS: u64 = 24;

/// Runs one seed to its end in a fresh paused-time runtime.
fn run_seed(sc: Scenario) -> Result<Outcome, run::Failure> {
    if let Ok(filter) = std::env::var("FOLDHOST_SIM_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                foldhost::cli::log_filter(&filter),
            ))
            .with_test_writer()
            .try_init();
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime");
    rt.block_on(Sim::new(sc).run())
}

fn parse_seed(s: &str) -> u64 {
    let s = s.trim();
    let r = match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.unwrap_or_else(|_| panic!("FOLDHOST_SIM_SEED={s:?} is not a number"))
}

/// The seeds a tier runs for `backend` (or the one seed asked for).
fn seeds(backend: Backend) -> Vec<u64> {
    if let Ok(s) = std::env::var("FOLDHOST_SIM_SEED") {
        return vec![parse_seed(&s)];
    }
    let deep = std::env::var("FOLDHOST_SIM_DEEP").is_ok_and(|v| v == "1");
    let n = if deep { FAST_SEEDS * 10 } else { FAST_SEEDS };
    let base = match backend {
        Backend::AppendLog => 1,
        Backend::Fjall => 2,
        Backend::RocksDb => 3,
    } << 32;
    (0..n).map(|i| base | i).collect()
}

/// Runs every seed of the tier on `backend`; the first failure panics with its seed, its trace and
/// the command that replays it.
fn tier(backend: Backend, test: &str) -> Vec<(Scenario, Outcome)> {
    let mut out = Vec::new();
    for seed in seeds(backend) {
        let sc = Scenario::on_backend(seed, backend);
        match run_seed(sc.clone()) {
            Ok(o) => out.push((sc, o)),
            Err(f) => panic!(
                "seed {:#x}: {}\n--- trace ---\n{}\n--- replay ---\nFOLDHOST_SIM_SEED={:#x} cargo nextest run -p foldhost-tests --features fjall,rocksdb --test sim {test}",
                f.seed,
                f.what,
                f.trace.join("\n"),
                f.seed
            ),
        }
    }
    out
}

/// The tier exercised what it claims: repairs on both kinds of bucket, crashes, swaps, exports.
fn assert_coverage(runs: &[(Scenario, Outcome)], torn: bool) {
    if runs.len() < FAST_SEEDS as usize {
        return; // one seed replayed: nothing to cover
    }
    let sum = |f: &dyn Fn(&(Scenario, Outcome)) -> u64| runs.iter().map(f).sum::<u64>();
    let relists = sum(&|(s, o)| if s.evicting { 0 } else { o.repairs });
    let restores = sum(&|(s, o)| if s.evicting { o.repairs } else { 0 });
    let crashes = sum(&|(_, o)| u64::from(o.crashes));
    let torn_n = sum(&|(_, o)| u64::from(o.torn));
    let swaps = sum(&|(_, o)| u64::from(o.swaps));
    let exports = sum(&|(_, o)| u64::from(o.exports));
    let traps = sum(&|(_, o)| u64::from(o.guest_traps));
    let before_retry = sum(&|(_, o)| u64::from(o.queries_before_retry));
    let instance_checks = sum(&|(_, o)| u64::from(o.instance_checks));
    eprintln!(
        "{} seeds: {relists} re-list repairs, {restores} restores, {crashes} crashes ({torn_n} torn), {swaps} swaps, {traps} guest traps, {before_retry} queries between a failed commit and its retry, {exports} exports resumed, {instance_checks} query-instance checks",
        runs.len()
    );
    assert!(relists > 0, "no re-list repair ran");
    assert!(restores > 0, "no restore ran");
    assert!(crashes > 0, "no crash was injected");
    assert!(!torn || torn_n > 0, "no commit was torn");
    assert!(swaps > 0, "no guest was swapped");
    assert!(exports > 0, "no mid-run export was resumed");
    assert!(traps > 0, "no guest call was interrupted");
    assert!(
        before_retry > 0,
        "no query ran between a failed commit and its retry"
    );
    assert!(
        instance_checks >= runs.len() as u64,
        "the query instance was checked against a fresh one {instance_checks} times in {} seeds",
        runs.len()
    );
}

#[test]
fn seeded_faults_on_the_append_log_never_lose_resurrect_or_regress_a_key() {
    let runs = tier(
        Backend::AppendLog,
        "seeded_faults_on_the_append_log_never_lose_resurrect_or_regress_a_key",
    );
    assert_coverage(&runs, true);
}

#[test]
fn seeded_faults_on_fjall_never_lose_resurrect_or_regress_a_key() {
    assert!(Backend::Fjall.is_compiled(), "build with --features fjall");
    let runs = tier(
        Backend::Fjall,
        "seeded_faults_on_fjall_never_lose_resurrect_or_regress_a_key",
    );
    assert_coverage(&runs, false);
}

#[test]
fn seeded_faults_on_rocksdb_never_lose_resurrect_or_regress_a_key() {
    assert!(
        Backend::RocksDb.is_compiled(),
        "build with --features rocksdb"
    );
    let runs = tier(
        Backend::RocksDb,
        "seeded_faults_on_rocksdb_never_lose_resurrect_or_regress_a_key",
    );
    assert_coverage(&runs, false);
}

#[test]
fn a_query_trap_between_a_failed_commit_and_its_retry_never_leaves_the_guest_without_the_batch() {
    for backend in world::backends() {
        for guest in [world::GuestKind::Native, world::GuestKind::Wasm] {
            let sc = Scenario::query_trap_before_a_retry(0x7EA9, backend, guest);
            match run_seed(sc) {
                Ok(o) => assert!(
                    o.queries_before_retry >= 2,
                    "{backend:?} {guest:?}: the case was not placed: {:?}",
                    o.trace
                ),
                Err(f) => panic!(
                    "{backend:?} {guest:?}: {}\n--- trace ---\n{}",
                    f.what,
                    f.trace.join("\n")
                ),
            }
        }
    }
}

#[test]
fn a_seed_replays_to_the_same_run() {
    // Seeds covering both guests on both kinds of bucket: each run twice must give the same trace
    // (every write, fault, repair-visible step and committed cursor), whatever the machine's
    // speed did to how often the driver's waits polled.
    let mut kinds = std::collections::BTreeSet::new();
    for seed in 0..16u64 {
        let sc = Scenario::on_backend(0x5EED_0000 + seed, Backend::AppendLog);
        if !kinds.insert((sc.guest == world::GuestKind::Wasm, sc.evicting)) {
            continue;
        }
        let a = run_seed(sc.clone()).expect("the seed passes");
        let b = run_seed(sc.clone()).expect("the seed passes");
        assert_eq!(
            a.replay(),
            b.replay(),
            "two runs of seed {:#x} differ",
            sc.seed
        );
        assert!(a.trace.len() > 5, "{:?}", a.trace);
    }
    assert_eq!(kinds.len(), 4, "both guests on both kinds of bucket");
}
