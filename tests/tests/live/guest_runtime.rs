//! What a guest's runtime promises beyond its calls: compiled code kept on disk and loaded only
//! after it is checked (a second start loads from the cache; a truncated, foreign or loosely kept
//! entry is compiled afresh, never loaded), and what a guest can observe fixed (random numbers from
//! the host's seed, the same in every instance; a clock that never moves).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use foldhost_core::kv::KvWriter;
use foldhost_fold::applied::Apply;
use foldhost_guest::guest::{EngineOptions, GuestApply, GuestEngine, GuestLimits};
use foldhost_tests::{Harness, guest_wasm, run_command};

/// The one `.cwasm` entry in `dir`.
fn only_entry(dir: &Path) -> anyhow::Result<PathBuf> {
    let entries: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
        .collect();
    anyhow::ensure!(entries.len() == 1, "cache entries: {entries:?}");
    Ok(entries[0].clone())
}

/// Folds `bucket` to its end with the router and `cache`, returning where the guest's compiled
/// code came from (status) and the run's log.
fn catch_up(h: &Harness, store: &Path, cache: &Path) -> anyhow::Result<(String, String)> {
    let o = run_command(h, "routes", store, None)
        .arg("--catch-up")
        .arg("--guest")
        .arg(guest_wasm("router"))
        .arg("--guest-cache")
        .arg(cache)
        .env("FOLDHOST_LOG", "foldhost=info")
        .output()?;
    let log = String::from_utf8_lossy(&o.stderr).into_owned();
    anyhow::ensure!(o.status.success(), "run failed: {log}");
    let status = foldhost_core::storedir::read_status(store)
        .ok_or_else(|| anyhow::anyhow!("no status.json after the run"))?;
    let from = status
        .guest_compiled
        .ok_or_else(|| anyhow::anyhow!("status names no guest_compiled: {log}"))?;
    Ok((from, log))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_start_loads_the_compiled_guest_from_the_cache_and_a_bad_entry_is_rebuilt_not_loaded()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("routes").await?;
    for i in 0..50 {
        kv.put(
            &format!("route.h{i}"),
            format!("{{\"upstream\":\"10.0.0.{i}:80\"}}").into(),
        )
        .await?;
    }
    let tmp = tempfile::tempdir()?;
    let cache = tmp.path().join("cache");
    let store = tmp.path().join("fold");

    let (from, log) = catch_up(&h, &store, &cache)?;
    assert_eq!(from, "compiled", "{log}");
    let entry = only_entry(&cache)?;
    let mode = |p: &Path| -> anyhow::Result<u32> {
        Ok(std::fs::metadata(p)?.permissions().mode() & 0o777)
    };
    assert_eq!(mode(&cache)?, 0o700, "the cache directory is private");
    assert_eq!(mode(&entry)?, 0o600, "an entry is private");
    let whole = std::fs::read(&entry)?;

    let (from, log) = catch_up(&h, &store, &cache)?;
    assert_eq!(
        from, "disk-cache",
        "the second start loads the compiled guest: {log}"
    );

    // A torn write: the entry cut short. Ignored, compiled afresh, and written whole again.
    std::fs::write(&entry, &whole[..whole.len() / 2])?;
    let (from, log) = catch_up(&h, &store, &cache)?;
    assert_eq!(from, "compiled", "a truncated entry is never loaded: {log}");
    assert!(log.contains("compiled-cache entry ignored"), "{log}");
    assert_eq!(std::fs::read(&entry)?, whole, "rebuilt whole");
    assert_eq!(catch_up(&h, &store, &cache)?.0, "disk-cache");

    // A foreign entry under the right name (same length, other bytes): refused by its digest.
    let mut foreign = whole.clone();
    let mid = foreign.len() / 2;
    foreign[mid] ^= 0xff;
    std::fs::write(&entry, &foreign)?;
    let (from, log) = catch_up(&h, &store, &cache)?;
    assert_eq!(from, "compiled", "a corrupt entry is never loaded: {log}");
    assert_eq!(std::fs::read(&entry)?, whole);

    // An entry others may write is not trusted, whatever it holds.
    std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o666))?;
    let (from, log) = catch_up(&h, &store, &cache)?;
    assert_eq!(
        from, "compiled",
        "a world-writable entry is never loaded: {log}"
    );
    assert_eq!(mode(&entry)?, 0o600);

    // Nor a directory others may write: the run compiles and says why it does not cache.
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o777))?;
    let (from, log) = catch_up(&h, &store, &cache)?;
    assert_eq!(from, "compiled", "{log}");
    assert!(
        log.contains("cache not used") && log.contains("lets others write"),
        "{log}"
    );

    // Through all of it the fold is the bucket's.
    let dumped = foldhost_tests::dump_store(&store)?;
    assert_eq!(dumped.len(), 50);
    Ok(())
}

/// A probe guest's answer to `request` from a fresh engine with `seed`.
async fn probe(seed: [u8; 32], request: &[u8]) -> anyhow::Result<(String, GuestApply)> {
    let engine = GuestEngine::with_options(EngineOptions {
        cache_dir: None,
        random_seed: seed,
    })?;
    let bytes = std::fs::read(guest_wasm("probe"))?;
    let mut g = GuestApply::load(
        &engine,
        "probe",
        &bytes,
        GuestLimits::default(),
        vec![],
        Arc::new(foldhost_core::view::EmptyFold),
    )
    .await?;
    g.hydrate().await?;
    let answer = String::from_utf8(g.query(request).await?)?;
    Ok((answer, g))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_draws_the_same_random_numbers_in_every_instance_and_only_the_seed_changes_them()
-> anyhow::Result<()> {
    let (first, mut g) = probe([1; 32], b"random").await?;
    assert_eq!(
        first.len(),
        48,
        "16 random bytes and a 64-bit hash, in hex: {first}"
    );
    // A fresh instance rebuilt from the fold (as after a trap) draws the same numbers. A query
    // never rebuilds it (it is answered "guest rebuilding"); the fold loop does.
    g.discard();
    let waiting = g.query(b"random").await;
    assert!(
        waiting.as_ref().is_err_and(|e| e.is_rebuilding()),
        "{waiting:?}"
    );
    g.rebuild().await?;
    let again = String::from_utf8(g.query(b"random").await?)?;
    assert_eq!(again, first, "a rebuilt instance draws what the first drew");
    assert_eq!(g.hydrations, 2, "the query ran on a rebuilt instance");
    // Another engine (another host, another process) with the same seed: the same numbers.
    assert_eq!(probe([1; 32], b"random").await?.0, first);
    // Another seed: other numbers.
    assert_ne!(probe([2; 32], b"random").await?.0, first);
    // The clock never moves.
    assert_eq!(probe([1; 32], b"clock").await?.0, "wall=0 monotonic=0");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_keeps_its_guest_seed_with_the_store_and_the_operator_can_pin_it()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("routes").await?;
    kv.put("probe.a", "1".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("fold");
    let run = |extra: &[&str]| -> anyhow::Result<()> {
        let o = run_command(&h, "routes", &store, None)
            .arg("--catch-up")
            .arg("--guest")
            .arg(guest_wasm("probe"))
            .args(extra)
            .output()?;
        anyhow::ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        Ok(())
    };
    run(&[])?;
    let seed_file = store.join("guest-seed");
    let seed = std::fs::read(&seed_file)?;
    assert_eq!(seed.len(), 32);
    assert_eq!(
        std::fs::metadata(&seed_file)?.permissions().mode() & 0o777,
        0o600
    );
    run(&[])?;
    assert_eq!(
        std::fs::read(&seed_file)?,
        seed,
        "a restart keeps the store's seed"
    );
    // A pinned seed is used and leaves the store's alone; a malformed one is refused up front.
    run(&["--guest-seed", &"ab".repeat(32)])?;
    assert_eq!(std::fs::read(&seed_file)?, seed);
    let o = run_command(&h, "routes", &store, None)
        .args(["--catch-up", "--guest-seed", "xyz", "--guest"])
        .arg(guest_wasm("probe"))
        .output()?;
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("64 hex digits"));
    // A damaged seed stops the run with the file named, and is kept for the operator.
    std::fs::write(&seed_file, &seed[..10])?;
    let o = run_command(&h, "routes", &store, None)
        .args(["--catch-up", "--guest"])
        .arg(guest_wasm("probe"))
        .output()?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("guest-seed") && err.contains("10 bytes"),
        "{err}"
    );
    assert_eq!(std::fs::read(&seed_file)?.len(), 10);
    Ok(())
}
