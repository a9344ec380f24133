//! Crash points: named places in the code where a test build can be made to die, so that crash
//! tests place their crash by the code's own progress instead of racing the clock.
//!
//! A test arms one point from outside the process with `FOLDHOST_CRASH_AT=NAME:N` (N ≥ 1): the
//! N-th time the process passes `NAME`, it writes one line to stderr
//! (`foldhost: crash point NAME reached (hit N): aborting`) and calls [`std::process::abort`].
//! Abort has the effect of SIGKILL on everything the tests check: no destructor runs, no buffer
//! is flushed, no lock file is removed, nothing is committed that was not already durable. The
//! exit is by `SIGABRT`, which tells a test the crash happened where it armed it (and not by a
//! stray panic, which exits with status 1, or by a kill).
//!
//! Invariants:
//! - **Absent from release builds.** Without the cargo feature `crashpoints`, [`hit`] is an empty
//!   inline function and the environment is never read; `make test` builds with the feature,
//!   `make demo`, `make bench` and release builds without.
//! - **Only the names in [`POINTS`]** can be armed; an unknown name in `FOLDHOST_CRASH_AT`, or
//!   the variable set on a build without the feature, is refused at start ([`check_env`], called
//!   by `main`) with one line and exit code 2, so a typo in a test never reads as "the crash did
//!   not happen".
//! - **A point never changes what the code does** until the armed hit: counting is one relaxed
//!   atomic increment on the armed point, nothing on the others.
//!
//! A point at an `async` site can also be **held** instead of crashed, to place a race by the
//! code's progress: `FOLDHOST_HOLD_AT=NAME:PATH` makes the first pass of `NAME` create
//! `PATH.reached` and wait until `PATH.release` exists (the test does its part in between, then
//! releases). Like crashing, holding exists only in `crashpoints` builds and is checked at start.
//!
//! Why not the `fail` crate, which arms named points from the environment too: its actions are
//! panic, return, sleep, pause, print and off, configured per point in process. What the crash
//! tests need is none of them — an abort that runs no destructor (a panic unwinds and drops, and
//! tokio catches it in a task), armed for the N-th pass from outside the process, a hold released
//! by another process through a file, and a closed list of names refused at start with exit 2 (`fail`
//! accepts any name, so a mistyped point is a test that waits for a crash that cannot come). Each
//! of those would be code around `fail`, so the few lines here stay ours.

/// The environment variable that plants a known bug in a `crashpoints` build: the write-history
/// checker's own proof that it catches what it claims to (one name of [`MUTATIONS`]).
pub const MUTATION_ENV: &str = "FOLDHOST_WRITE_MUTATION";

/// The bugs a test build can be made to have, with what each breaks.
pub const MUTATIONS: &[(&str, &str)] = &[
    (
        MUTATION_REPUBLISH_RETRY,
        "a retry of a given operation id skips the ledger and is published again",
    ),
    (
        MUTATION_EARLY_APPLIED,
        "a write is answered applied without waiting for the fold to hold it",
    ),
    (
        MUTATION_STALE_ROW,
        "ledger rows of a bucket's previous life still answer after a re-list",
    ),
];

/// A retry is published again.
pub const MUTATION_REPUBLISH_RETRY: &str = "republish_retry";
/// `applied` before the fold holds the write.
pub const MUTATION_EARLY_APPLIED: &str = "early_applied";
/// A previous life's rows answer.
pub const MUTATION_STALE_ROW: &str = "stale_row";

/// Whether the bug `name` is planted (only ever in a `crashpoints` build).
pub fn mutated(name: &'static str) -> bool {
    cfg!(feature = "crashpoints") && std::env::var(MUTATION_ENV).is_ok_and(|v| v == name)
}

/// The points a build can be crashed at, with what is durable when each fires.
pub(crate) const POINTS: &[(&str, &str)] = &[
    (
        FOLD_COMMITTED,
        "after a fold batch (data + cursor) committed and `on-applied` returned",
    ),
    (
        FOLD_BEFORE_ON_APPLIED,
        "between a fold batch's store commit and the applier's `on-applied`",
    ),
    (
        FOLD_LEDGER_COMMIT,
        "before the first fold commit that records an operation ledger row (hold only)",
    ),
    (
        RELIST_BATCH,
        "inside the key-listing diff, after a batch of its synthetic deletes committed",
    ),
    (
        RESTORE_BATCH,
        "inside an artifact restore, after a batch of its difference committed (old cursor)",
    ),
    (
        RESTORE_BEFORE_CURSOR,
        "inside an artifact restore, after the whole difference committed, before the final cursor commit",
    ),
    (
        EXPORT_STAGED,
        "mid-export: the fold copied into the hidden stage, before its verify and hashing pass",
    ),
    (
        EXPORT_FILE,
        "mid-export: after one more staged file was hashed, before the manifest is written",
    ),
    (
        QUERY_ROUND,
        "a batch committed, before the query instance is handed its round (hold only)",
    ),
    (
        SWAP_HYDRATING,
        "mid-swap: the new version hydrated its first chunk beside the running one (hold only)",
    ),
    (
        PUBLISH_BEFORE_POINTER,
        "mid-publish: the payload uploaded whole, before the pointer moves",
    ),
    (
        CHANNEL_BAKE,
        "a following node's bake: while held, it never reports a release baked (gate only)",
    ),
    (
        BOOTSTRAP_BEFORE_PAYLOAD,
        "mid-bootstrap: the pointer read (and its stream checked), before the payload is listed and fetched (hold only)",
    ),
];

/// After a fold batch committed and `on-applied` returned.
pub const FOLD_COMMITTED: &str = "fold.committed";
/// Between a fold batch's store commit and `on-applied`.
pub const FOLD_BEFORE_ON_APPLIED: &str = "fold.before-on-applied";
/// Before the first fold commit that records an operation ledger row (a write through the host
/// is then durable and not yet applied: `pending`).
pub const FOLD_LEDGER_COMMIT: &str = "fold.ledger-commit";
/// Inside the key-listing diff, after a committed batch of synthetic deletes.
pub const RELIST_BATCH: &str = "repair.relist.batch";
/// Inside an artifact restore, after a committed batch of its difference.
pub const RESTORE_BATCH: &str = "repair.restore.batch";
/// Inside an artifact restore, between the last difference batch and the final cursor commit.
pub const RESTORE_BEFORE_CURSOR: &str = "repair.restore.before-cursor";
/// Mid-export, after the fold was copied into the stage.
pub const EXPORT_STAGED: &str = "export.staged";
/// Mid-export, after each staged file was hashed.
pub const EXPORT_FILE: &str = "export.file";

/// A batch committed (`applied_through` moved), before the query instance's next round: it
/// answers from the state before the batch.
pub const QUERY_ROUND: &str = "query.round";

/// Mid-swap, after the new version's first hydration chunk (the old one still folding).
pub const SWAP_HYDRATING: &str = "swap.hydrating";

/// Mid-publish, after the payload was uploaded, before the pointer moves.
pub const PUBLISH_BEFORE_POINTER: &str = "publish.before-pointer";
/// Mid-bootstrap, the pointer read, before its payload is fetched.
pub const BOOTSTRAP_BEFORE_PAYLOAD: &str = "bootstrap.before-payload";

/// A following node's bake (docs/channels.md, "Waves"): a gate ([`gated`]), never a crash.
pub const CHANNEL_BAKE: &str = "channel.bake";

/// The environment variable that arms a point: `NAME:N`.
pub const ENV: &str = "FOLDHOST_CRASH_AT";

/// The environment variable that holds a point: `NAME:PATH`.
pub const HOLD_ENV: &str = "FOLDHOST_HOLD_AT";

/// Passes the point `name` at an async site; in a `crashpoints` build with `name` held
/// (`FOLDHOST_HOLD_AT=name:PATH`), the first pass creates `PATH.reached` and waits for
/// `PATH.release` to exist.
#[cfg(not(feature = "crashpoints"))]
#[inline(always)]
pub async fn hold(name: &'static str) {
    let _ = name;
}

/// Passes the point `name` at an async site; in a `crashpoints` build with `name` held
/// (`FOLDHOST_HOLD_AT=name:PATH`), the first pass creates `PATH.reached` and waits for
/// `PATH.release` to exist.
#[cfg(feature = "crashpoints")]
pub async fn hold(name: &'static str) {
    use std::sync::atomic::{AtomicBool, Ordering};
    static HELD: AtomicBool = AtomicBool::new(false);
    let Ok(v) = std::env::var(HOLD_ENV) else {
        return;
    };
    let Ok((point, path)) = parse_hold(&v) else {
        return;
    };
    if point != name || HELD.swap(true, Ordering::Relaxed) {
        return;
    }
    let reached = format!("{path}.reached");
    let release = std::path::PathBuf::from(format!("{path}.release"));
    if let Err(e) = std::fs::write(&reached, name) {
        eprintln!("foldhost: hold point {name}: {reached}: {e}");
        return;
    }
    eprintln!(
        "foldhost: hold point {name} reached: waiting for {}",
        release.display()
    );
    while !release.exists() {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Whether the gate `name` is shut: in a `crashpoints` build with `name` held
/// (`FOLDHOST_HOLD_AT=name:PATH`), the first ask creates `PATH.reached`, and the gate stays shut
/// until `PATH.release` exists. Unlike [`hold`] it never waits: the caller goes on without what the
/// gate guards (a node that cannot bake still judges, reports and swaps).
#[cfg(not(feature = "crashpoints"))]
#[inline(always)]
pub fn gated(name: &'static str) -> bool {
    let _ = name;
    false
}

/// Whether the gate `name` is shut: in a `crashpoints` build with `name` held
/// (`FOLDHOST_HOLD_AT=name:PATH`), the first ask creates `PATH.reached`, and the gate stays shut
/// until `PATH.release` exists. Unlike [`hold`] it never waits: the caller goes on without what the
/// gate guards (a node that cannot bake still judges, reports and swaps).
#[cfg(feature = "crashpoints")]
pub fn gated(name: &'static str) -> bool {
    use std::sync::atomic::{AtomicBool, Ordering};
    static REACHED: AtomicBool = AtomicBool::new(false);
    let Ok(v) = std::env::var(HOLD_ENV) else {
        return false;
    };
    let Ok((point, path)) = parse_hold(&v) else {
        return false;
    };
    if point != name {
        return false;
    }
    if !REACHED.swap(true, Ordering::Relaxed) {
        let _ = std::fs::write(format!("{path}.reached"), name);
    }
    !std::path::Path::new(&format!("{path}.release")).exists()
}

/// Parses `NAME:PATH` (the value of [`HOLD_ENV`]): the point must be one of [`POINTS`].
pub(crate) fn parse_hold(s: &str) -> Result<(&'static str, &str), String> {
    let (name, path) = s
        .split_once(':')
        .ok_or_else(|| format!("{HOLD_ENV}={s:?}: expected NAME:PATH"))?;
    let point = POINTS
        .iter()
        .map(|(p, _)| *p)
        .find(|p| *p == name)
        .ok_or_else(|| format!("{HOLD_ENV}={s:?}: unknown point {name:?}"))?;
    if path.is_empty() {
        return Err(format!("{HOLD_ENV}={s:?}: empty path"));
    }
    Ok((point, path))
}

/// Passes the crash point `name`; in a `crashpoints` build armed at `name:N`, the N-th pass
/// aborts the process.
#[cfg(not(feature = "crashpoints"))]
#[inline(always)]
pub fn hit(name: &'static str) {
    let _ = name;
}

/// Passes the crash point `name`; in a `crashpoints` build armed at `name:N`, the N-th pass
/// aborts the process.
#[cfg(feature = "crashpoints")]
pub fn hit(name: &'static str) {
    armed::hit(name);
}

/// Checks `FOLDHOST_CRASH_AT` at process start: unset is fine; set, it must parse, and the
/// build must have crash points (a test arming a point on a build without them would otherwise
/// wait for a crash that cannot happen). Returns the one-line reason otherwise.
pub fn check_env() -> Result<(), String> {
    let crash = std::env::var(ENV).ok();
    let hold = std::env::var(HOLD_ENV).ok();
    let mutation = std::env::var(MUTATION_ENV).ok();
    if crash.is_none() && hold.is_none() && mutation.is_none() {
        return Ok(());
    }
    if let Some(m) = &mutation
        && !MUTATIONS.iter().any(|(n, _)| n == m)
    {
        return Err(format!("{MUTATION_ENV}={m:?}: unknown mutation"));
    }
    if let Some(v) = &crash {
        parse_arm(v)?;
    }
    if let Some(v) = &hold {
        parse_hold(v)?;
    }
    if cfg!(feature = "crashpoints") {
        Ok(())
    } else {
        Err(format!(
            "{ENV}, {HOLD_ENV} or {MUTATION_ENV} is set but this build has no crash points (cargo feature `crashpoints`)"
        ))
    }
}

/// Parses `NAME:N` (the value of [`ENV`]): the point must be one of [`POINTS`] and N ≥ 1.
pub(crate) fn parse_arm(s: &str) -> Result<(&'static str, u64), String> {
    let (name, n) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{ENV}={s:?}: expected NAME:N"))?;
    let point = POINTS
        .iter()
        .map(|(p, _)| *p)
        .find(|p| *p == name)
        .ok_or_else(|| {
            let known: Vec<&str> = POINTS.iter().map(|(p, _)| *p).collect();
            format!(
                "{ENV}={s:?}: unknown crash point {name:?} (known: {})",
                known.join(", ")
            )
        })?;
    match n.parse::<u64>() {
        Ok(n) if n >= 1 => Ok((point, n)),
        _ => Err(format!("{ENV}={s:?}: N must be a whole number ≥ 1")),
    }
}

#[cfg(feature = "crashpoints")]
mod armed {
    use std::io::Write as _;
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};

    static ARMED: OnceLock<Option<(&'static str, u64)>> = OnceLock::new();
    static HITS: AtomicU64 = AtomicU64::new(0);

    fn armed() -> Option<(&'static str, u64)> {
        *ARMED.get_or_init(|| {
            let v = std::env::var(super::ENV).ok()?;
            match super::parse_arm(&v) {
                Ok(a) => Some(a),
                Err(e) => {
                    eprintln!("foldhost: error: {e}");
                    std::process::exit(2);
                }
            }
        })
    }

    pub(super) fn hit(name: &'static str) {
        let Some((point, n)) = armed() else {
            return;
        };
        if point != name {
            return;
        }
        let k = HITS.fetch_add(1, Ordering::Relaxed) + 1;
        if k == n {
            // One write of the whole line, straight to fd 2 (stderr is unbuffered): it is the
            // last line the process writes.
            let line = format!("foldhost: crash point {name} reached (hit {k}): aborting\n");
            let _ = std::io::stderr().lock().write_all(line.as_bytes());
            std::process::abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_arm_names_a_known_point_and_a_positive_count() {
        assert_eq!(parse_arm("repair.relist.batch:7"), Ok((RELIST_BATCH, 7)));
        assert_eq!(parse_arm("fold.committed:1"), Ok((FOLD_COMMITTED, 1)));
        assert!(parse_arm("fold.comitted:1").is_err_and(|e| e.contains("unknown crash point")));
        assert!(parse_arm("fold.committed:0").is_err());
        assert!(parse_arm("fold.committed").is_err());
        assert!(parse_arm("fold.committed:x").is_err());
        assert_eq!(
            parse_hold("publish.before-pointer:/tmp/x:y"),
            Ok((PUBLISH_BEFORE_POINTER, "/tmp/x:y"))
        );
        assert!(parse_hold("publish.before-pointer:").is_err());
        assert!(parse_hold("nope:/tmp/x").is_err());
    }

    #[test]
    fn every_point_is_listed_once() {
        let mut names: Vec<&str> = POINTS.iter().map(|(p, _)| *p).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n);
    }
}
