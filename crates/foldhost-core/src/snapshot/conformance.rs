//! One conformance suite for every [`SnapshotStore`] backend: the contract of `snapshot/mod.rs`, checked
//! the same way for each. A backend gets the whole suite with one line:
//!
//! ```ignore
//! conformance_suite!(my_backend, super::MyOpener);
//! ```
//!
//! where `MyOpener` implements [`Opener`]. Each generated test is named after the property it
//! checks. The crash test re-runs the test binary as a child process that applies and then aborts
//! (no destructor, no clean close), and reopens what it left.
//!
//! The cursor memo (the eviction memo, 12 or 20 bytes) round-trips through every backend, through
//! a reopen and through an export, beside bare cursors.

use std::ops::ControlFlow;
use std::path::Path;

use bytes::Bytes;

use super::{SnapshotError, SnapshotStore};
use crate::kv::{KvEntry, KvUpdate, VersionToken, WatchCursor};

/// How the suite opens one backend.
pub(crate) trait Opener {
    /// The store type.
    type Store: SnapshotStore;
    /// Opens (creating) the store in `dir` for writing.
    fn open(dir: &Path) -> Self::Store {
        Self::try_open(dir).expect("open")
    }
    /// Like [`Self::open`], returning the error.
    fn try_open(dir: &Path) -> Result<Self::Store, SnapshotError>;
    /// Opens the store in `dir` read-only (never writes into it).
    fn open_read_only(dir: &Path) -> Self::Store;
    /// Makes the store's next durable write fail in a way that leaves its state unknown.
    fn fail_next_write(store: &mut Self::Store);
}

type Row = (String, Vec<u8>, Vec<u8>);

fn put(key: &str, value: &[u8], rev: u64) -> KvUpdate {
    put_v(key, value, VersionToken::from_u64(rev))
}

fn put_v(key: &str, value: &[u8], version: VersionToken) -> KvUpdate {
    KvUpdate::Put(KvEntry {
        key: key.into(),
        value: Bytes::copy_from_slice(value),
        version,
    })
}

fn del(key: &str, rev: u64) -> KvUpdate {
    KvUpdate::Delete {
        key: key.into(),
        version: VersionToken::from_u64(rev),
    }
}

fn purge(key: &str, rev: u64) -> KvUpdate {
    KvUpdate::Purge {
        key: key.into(),
        version: VersionToken::from_u64(rev),
    }
}

fn ten() -> VersionToken {
    VersionToken::from_bytes(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).expect("10 bytes fit")
}

fn row(key: &str, value: &[u8], version: VersionToken) -> Row {
    (key.into(), value.to_vec(), version.as_bytes().to_vec())
}

/// The whole fold, in scan order, versions as raw bytes (so a length change shows).
fn contents(s: &impl SnapshotStore) -> Vec<Row> {
    let mut out = Vec::new();
    s.for_each_in_range("", &mut |e| {
        out.push(row(&e.key, &e.value, e.version));
        ControlFlow::Continue(())
    })
    .expect("scan");
    out
}

fn keys_after(s: &impl SnapshotStore, prefix: &str, after: Option<&str>, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    s.for_each_in_range_after(prefix, after, &mut |e| {
        out.push(e.key.clone());
        if out.len() >= n {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })
    .expect("scan");
    out
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

pub(crate) fn apply_then_reopen_round_trips_puts_deletes_and_purges<O: Opener>() {
    let dir = tempdir();
    let mut s = O::open(dir.path());
    s.apply(
        &[
            put("a", b"1", 1),
            put("doomed", b"x", 2),
            put("purged", b"y", 3),
        ],
        WatchCursor::at(3),
    )
    .expect("apply");
    s.apply(
        &[del("doomed", 4), purge("purged", 5), put("a", b"2", 6)],
        WatchCursor::at(6),
    )
    .expect("apply");
    let expected = vec![row("a", b"2", VersionToken::from_u64(6))];
    assert_eq!(contents(&s), expected);
    assert_eq!(s.get("doomed").expect("get"), None);
    assert_eq!(s.get("purged").expect("get"), None);
    drop(s);
    let s = O::open(dir.path());
    assert_eq!(contents(&s), expected);
    assert_eq!(s.cursor(), WatchCursor::at(6));
    let a = s.get("a").expect("get").expect("present");
    assert_eq!((a.value.as_ref(), a.version.as_u64()), (&b"2"[..], Some(6)));
}

pub(crate) fn data_and_cursor_are_recovered_together_after_reopen<O: Opener>() {
    let dir = tempdir();
    let mut s = O::open(dir.path());
    assert_eq!(s.cursor(), WatchCursor::NONE);
    for rev in 1..=20u64 {
        s.apply(
            &[put(&format!("k{rev:02}"), &rev.to_be_bytes(), rev)],
            WatchCursor::at(rev),
        )
        .expect("apply");
    }
    // A cursor-only apply (no data) moves the cursor alone.
    s.apply(&[], WatchCursor::at(25)).expect("apply");
    drop(s);
    let s = O::open(dir.path());
    assert_eq!(s.cursor(), WatchCursor::at(25));
    let rows = contents(&s);
    assert_eq!(rows.len(), 20);
    for (i, (k, v, _)) in rows.iter().enumerate() {
        let rev = i as u64 + 1;
        assert_eq!(k, &format!("k{rev:02}"));
        assert_eq!(v, &rev.to_be_bytes());
    }
}

pub(crate) fn cursor_memo_bytes_round_trip_through_reopen_and_export<O: Opener>() {
    let memo = Some(crate::kv::EvictionMemo {
        server_time_unix_ns: 1_700_000_000_123_456_789,
    });
    let dir = tempdir();
    let mut s = O::open(dir.path());
    s.apply(&[put("a", b"1", 3)], WatchCursor::at(3))
        .expect("apply");
    let with = WatchCursor::at(3).with_memo(memo);
    s.apply(&[], with).expect("apply");
    assert_eq!(s.cursor(), with);
    s.apply(&[put("b", b"2", 4)], with.moved_to(Some(4)))
        .expect("apply");
    let exported = tempdir();
    s.export_to(exported.path()).expect("export");
    drop(s);
    for d in [dir.path(), exported.path()] {
        let s = O::open(d);
        assert_eq!(s.cursor().revision(), Some(4));
        assert_eq!(
            s.cursor().memo(),
            memo,
            "the memo survives reopen and export"
        );
        assert_eq!(s.cursor().to_bytes().len(), 20);
    }
    // The 12-byte form (time unknown), and a cursor-less memo.
    let dir = tempdir();
    let mut s = O::open(dir.path());
    let untimed = WatchCursor::NONE.with_memo(Some(crate::kv::EvictionMemo::default()));
    s.apply(&[], untimed).expect("apply");
    drop(s);
    assert_eq!(O::open(dir.path()).cursor(), untimed);
}

/// Child half of the crash test: applies, then aborts the process without closing the store.
pub(crate) fn crash_child<O: Opener>(dir: &Path) -> ! {
    let mut s = O::open(dir);
    s.apply(&[put("a", b"1", 1), put("b", b"2", 2)], WatchCursor::at(2))
        .expect("apply");
    s.apply(&[put("c", b"3", 3), del("a", 4)], WatchCursor::at(4))
        .expect("apply");
    std::process::abort();
}

/// The env var that turns a crash test into its child half.
pub(crate) const CRASH_DIR_ENV: &str = "FOLDHOST_CONFORMANCE_CRASH_DIR";

pub(crate) fn a_process_crash_after_apply_returns_keeps_data_and_cursor<O: Opener>(test: &str) {
    if let Some(dir) = std::env::var_os(CRASH_DIR_ENV) {
        crash_child::<O>(Path::new(&dir));
    }
    let dir = tempdir();
    let status = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CRASH_DIR_ENV, dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("spawn child");
    assert!(!status.success(), "the child must die by abort: {status}");
    let s = O::open(dir.path());
    assert_eq!(s.cursor(), WatchCursor::at(4));
    assert_eq!(
        contents(&s),
        vec![
            row("b", b"2", VersionToken::from_u64(2)),
            row("c", b"3", VersionToken::from_u64(3)),
        ]
    );
    assert_eq!(s.len().expect("len"), 2);
}

pub(crate) fn delete_and_purge_remove_the_key_and_its_count<O: Opener>() {
    let dir = tempdir();
    let mut s = O::open(dir.path());
    s.apply(
        &[put("a", b"1", 1), put("b", b"2", 2), put("c", b"3", 3)],
        WatchCursor::at(3),
    )
    .expect("apply");
    assert_eq!(s.len().expect("len"), 3);
    s.apply(
        &[del("a", 4), purge("b", 5), del("never", 6)],
        WatchCursor::at(6),
    )
    .expect("apply");
    assert_eq!(s.len().expect("len"), 1);
    assert_eq!(s.get("a").expect("get"), None);
    assert_eq!(s.get("b").expect("get"), None);
    assert_eq!(
        contents(&s),
        vec![row("c", b"3", VersionToken::from_u64(3))]
    );
}

pub(crate) fn ten_byte_versions_round_trip_through_reopen<O: Opener>() {
    let dir = tempdir();
    let mut s = O::open(dir.path());
    s.apply(&[put_v("fdb", b"stamped", ten())], WatchCursor::at(1))
        .expect("apply");
    drop(s);
    let s = O::open(dir.path());
    let e = s.get("fdb").expect("get").expect("present");
    assert_eq!(e.version.as_bytes(), ten().as_bytes());
    assert_eq!(e.version, ten());
}

pub(crate) fn unknown_versions_and_empty_values_round_trip<O: Opener>() {
    let dir = tempdir();
    let mut s = O::open(dir.path());
    s.apply(
        &[
            put_v("unversioned", b"v", VersionToken::UNKNOWN),
            put("empty", b"", 2),
        ],
        WatchCursor::at(2),
    )
    .expect("apply");
    drop(s);
    let s = O::open(dir.path());
    assert_eq!(
        contents(&s),
        vec![
            row("empty", b"", VersionToken::from_u64(2)),
            row("unversioned", b"v", VersionToken::UNKNOWN),
        ]
    );
    assert!(
        s.get("unversioned")
            .expect("get")
            .expect("present")
            .version
            .is_unknown()
    );
}

fn scan_fixture<O: Opener>(dir: &Path) -> O::Store {
    let mut s = O::open(dir);
    // Deliberately out of order, with a reserved `\x01` key and keys around the prefixes.
    let keys = [
        "b.2",
        "a.3",
        "\u{1}retained/x",
        "a.1",
        "ab",
        "a.2",
        "b.1",
        "a",
        "a.10",
    ];
    let batch: Vec<KvUpdate> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| put(k, k.as_bytes(), i as u64 + 1))
        .collect();
    s.apply(&batch, WatchCursor::at(keys.len() as u64))
        .expect("apply");
    s
}

pub(crate) fn scans_visit_a_prefix_in_key_order_and_stop_early<O: Opener>() {
    let dir = tempdir();
    let s = scan_fixture::<O>(dir.path());
    let all: Vec<String> = contents(&s).into_iter().map(|r| r.0).collect();
    assert_eq!(
        all,
        [
            "\u{1}retained/x",
            "a",
            "a.1",
            "a.10",
            "a.2",
            "a.3",
            "ab",
            "b.1",
            "b.2"
        ]
    );
    let in_a: Vec<String> = s
        .range("a.")
        .expect("range")
        .into_iter()
        .map(|e| e.key)
        .collect();
    assert_eq!(in_a, ["a.1", "a.10", "a.2", "a.3"]);
    // Values come back with their keys.
    for e in s.range("b.").expect("range") {
        assert_eq!(e.value.as_ref(), e.key.as_bytes());
    }
    assert_eq!(keys_after(&s, "a.", None, 2), ["a.1", "a.10"]);
    assert!(s.range("zz").expect("range").is_empty());
    assert_eq!(keys_after(&s, "\u{1}", None, 9), ["\u{1}retained/x"]);
}

pub(crate) fn range_after_pages_strictly_after_the_cursor_key<O: Opener>() {
    let dir = tempdir();
    let s = scan_fixture::<O>(dir.path());
    // Paging the whole fold 2 at a time visits every key once, the reserved one first.
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = keys_after(&s, "", after.as_deref(), 2);
        if page.is_empty() {
            break;
        }
        after = page.last().cloned();
        seen.extend(page);
    }
    assert_eq!(
        seen,
        contents(&s).into_iter().map(|r| r.0).collect::<Vec<_>>()
    );
    assert_eq!(seen.first().map(String::as_str), Some("\u{1}retained/x"));
    // Inside a prefix; an `after` that is not a stored key; before and beyond the range.
    assert_eq!(keys_after(&s, "a.", Some("a.10"), 9), ["a.2", "a.3"]);
    assert_eq!(keys_after(&s, "a.", Some("a.15"), 9), ["a.2", "a.3"]);
    assert_eq!(keys_after(&s, "b.", Some("a.3"), 9), ["b.1", "b.2"]);
    assert!(keys_after(&s, "a.", Some("a.3"), 9).is_empty());
    assert!(keys_after(&s, "a.", Some("zz"), 9).is_empty());
    // After the reserved key, the first ordinary key.
    assert_eq!(keys_after(&s, "", Some("\u{1}retained/x"), 1), ["a"]);
}

pub(crate) fn len_counts_live_keys_and_is_right_after_reopen<O: Opener>() {
    let dir = tempdir();
    let mut s = O::open(dir.path());
    assert_eq!(s.len().expect("len"), 0);
    assert!(s.is_empty().expect("is_empty"));
    // Overwrites within and across batches, deletes of absent keys, delete then re-put.
    s.apply(
        &[put("a", b"1", 1), put("a", b"2", 2), put("b", b"1", 3)],
        WatchCursor::at(3),
    )
    .expect("apply");
    s.apply(
        &[
            put("b", b"2", 4),
            del("ghost", 5),
            del("a", 6),
            put("a", b"3", 7),
            put("c", b"1", 8),
            purge("c", 9),
        ],
        WatchCursor::at(9),
    )
    .expect("apply");
    assert_eq!(s.len().expect("len"), 2);
    drop(s);
    let mut s = O::open(dir.path());
    assert_eq!(s.len().expect("len"), 2);
    s.apply(&[put("d", b"1", 10)], WatchCursor::at(10))
        .expect("apply");
    drop(s);
    let s = O::open(dir.path());
    assert_eq!(s.len().expect("len"), 3);
    assert_eq!(s.len().expect("len"), contents(&s).len() as u64);
}

pub(crate) fn export_then_reopen_recovers_the_same_cursor_and_contents<O: Opener>() {
    let dir = tempdir();
    let mut s = O::open(dir.path());
    for rev in 1..=50u64 {
        s.apply(
            &[
                put(&format!("k{:02}", rev % 17), &[rev as u8; 100], rev),
                put("hot", &rev.to_be_bytes(), rev),
            ],
            WatchCursor::at(rev),
        )
        .expect("apply");
    }
    s.apply(
        &[del("k03", 51), put_v("ten", b"x", ten())],
        WatchCursor::at(52),
    )
    .expect("apply");
    let expected = contents(&s);
    let dest = tempdir();
    s.export_to(dest.path()).expect("export");
    // The live store is untouched and keeps working.
    assert_eq!(contents(&s), expected);
    s.apply(&[put("after", b"x", 53)], WatchCursor::at(53))
        .expect("apply after export");
    drop(s);
    let check = |copy: &O::Store| {
        assert_eq!(copy.cursor(), WatchCursor::at(52));
        assert_eq!(contents(copy), expected);
        assert_eq!(copy.len().expect("len"), expected.len() as u64);
    };
    check(&O::open_read_only(dest.path()));
    check(&O::open(dest.path()));
}

pub(crate) fn read_only_open_beside_a_writer_sees_the_fold_and_refuses_writes<O: Opener>() {
    let dir = tempdir();
    let mut w = O::open(dir.path());
    w.apply(&[put("a", b"1", 1), put("b", b"2", 2)], WatchCursor::at(2))
        .expect("apply");
    let mut r = O::open_read_only(dir.path());
    assert_eq!(r.cursor(), WatchCursor::at(2));
    assert_eq!(r.len().expect("len"), 2);
    assert_eq!(contents(&r), contents(&w));
    let err = r
        .apply(&[put("c", b"3", 3)], WatchCursor::at(3))
        .expect_err("read-only");
    assert!(
        matches!(&err, SnapshotError::Io { source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied),
        "{err}"
    );
    // The writer is unaffected.
    w.apply(&[put("c", b"3", 3)], WatchCursor::at(3))
        .expect("writer still writes");
    drop(r);
    drop(w);
    assert_eq!(O::open(dir.path()).cursor(), WatchCursor::at(3));
}

pub(crate) fn a_failed_write_poisons_the_store_until_reopen<O: Opener>() {
    let dir = tempdir();
    let mut s = O::open(dir.path());
    s.apply(&[put("a", b"1", 1)], WatchCursor::at(1))
        .expect("apply");
    O::fail_next_write(&mut s);
    s.apply(&[put("b", b"2", 2)], WatchCursor::at(2))
        .expect_err("injected");
    let err = s
        .apply(&[put("c", b"3", 3)], WatchCursor::at(3))
        .expect_err("poisoned");
    assert!(matches!(err, SnapshotError::Poisoned { .. }), "{err}");
    // Reads still serve the last committed state.
    assert_eq!(s.cursor(), WatchCursor::at(1));
    assert_eq!(
        contents(&s),
        vec![row("a", b"1", VersionToken::from_u64(1))]
    );
    drop(s);
    let mut s = O::open(dir.path());
    assert_eq!(s.cursor(), WatchCursor::at(1));
    assert_eq!(s.len().expect("len"), 1);
    s.apply(&[put("b", b"2", 2)], WatchCursor::at(2))
        .expect("writes again after reopen");
}

pub(crate) fn a_second_writer_is_refused_while_the_first_is_open<O: Opener>() {
    let dir = tempdir();
    let first = O::open(dir.path());
    match O::try_open(dir.path()) {
        Err(SnapshotError::Locked { .. }) => {}
        Err(other) => panic!("expected Locked, got {other}"),
        Ok(_) => panic!("a second writer opened the same store"),
    }
    drop(first);
    assert!(O::try_open(dir.path()).is_ok(), "free again once dropped");
}

pub(crate) fn oversized_values_are_refused_before_anything_is_written<O: Opener>() {
    let dir = tempdir();
    let mut s = O::open(dir.path());
    let big = vec![0u8; super::MAX_VALUE_LEN + 1];
    let err = s
        .apply(
            &[put("ok", b"1", 1), put("big", &big, 2)],
            WatchCursor::at(2),
        )
        .expect_err("too large");
    assert!(matches!(err, SnapshotError::TooLarge(_)), "{err}");
    assert_eq!(s.cursor(), WatchCursor::NONE);
    assert!(s.is_empty().expect("is_empty"));
    s.apply(&[put("ok", b"1", 1)], WatchCursor::at(1))
        .expect("not poisoned by a refusal");
}

/// Instantiates the whole suite for one backend: `conformance_suite!(module_name, OpenerType);`.
macro_rules! conformance_suite {
    ($name:ident, $opener:ty) => {
        mod $name {
            use $crate::snapshot::conformance as c;

            #[test]
            fn apply_then_reopen_round_trips_puts_deletes_and_purges() {
                c::apply_then_reopen_round_trips_puts_deletes_and_purges::<$opener>();
            }
            #[test]
            fn data_and_cursor_are_recovered_together_after_reopen() {
                c::data_and_cursor_are_recovered_together_after_reopen::<$opener>();
            }
            #[test]
            fn a_process_crash_after_apply_returns_keeps_data_and_cursor() {
                let path = module_path!();
                let test = format!(
                    "{}::a_process_crash_after_apply_returns_keeps_data_and_cursor",
                    path.split_once("::").map_or(path, |(_, rest)| rest)
                );
                c::a_process_crash_after_apply_returns_keeps_data_and_cursor::<$opener>(&test);
            }
            #[test]
            fn delete_and_purge_remove_the_key_and_its_count() {
                c::delete_and_purge_remove_the_key_and_its_count::<$opener>();
            }
            #[test]
            fn ten_byte_versions_round_trip_through_reopen() {
                c::ten_byte_versions_round_trip_through_reopen::<$opener>();
            }
            #[test]
            fn unknown_versions_and_empty_values_round_trip() {
                c::unknown_versions_and_empty_values_round_trip::<$opener>();
            }
            #[test]
            fn scans_visit_a_prefix_in_key_order_and_stop_early() {
                c::scans_visit_a_prefix_in_key_order_and_stop_early::<$opener>();
            }
            #[test]
            fn range_after_pages_strictly_after_the_cursor_key() {
                c::range_after_pages_strictly_after_the_cursor_key::<$opener>();
            }
            #[test]
            fn len_counts_live_keys_and_is_right_after_reopen() {
                c::len_counts_live_keys_and_is_right_after_reopen::<$opener>();
            }
            #[test]
            fn cursor_memo_bytes_round_trip_through_reopen_and_export() {
                c::cursor_memo_bytes_round_trip_through_reopen_and_export::<$opener>();
            }
            #[test]
            fn export_then_reopen_recovers_the_same_cursor_and_contents() {
                c::export_then_reopen_recovers_the_same_cursor_and_contents::<$opener>();
            }
            #[test]
            fn read_only_open_beside_a_writer_sees_the_fold_and_refuses_writes() {
                c::read_only_open_beside_a_writer_sees_the_fold_and_refuses_writes::<$opener>();
            }
            #[test]
            fn a_failed_write_poisons_the_store_until_reopen() {
                c::a_failed_write_poisons_the_store_until_reopen::<$opener>();
            }
            #[test]
            fn a_second_writer_is_refused_while_the_first_is_open() {
                c::a_second_writer_is_refused_while_the_first_is_open::<$opener>();
            }
            #[test]
            fn oversized_values_are_refused_before_anything_is_written() {
                c::oversized_values_are_refused_before_anything_is_written::<$opener>();
            }
        }
    };
}

/// The append log.
pub(crate) struct AppendLog;

impl Opener for AppendLog {
    type Store = super::AppendLogSnapshot;
    fn try_open(dir: &Path) -> Result<Self::Store, SnapshotError> {
        super::AppendLogSnapshot::open(dir, super::AppendLogOptions::default()).map(|(s, _)| s)
    }
    fn open_read_only(dir: &Path) -> Self::Store {
        super::AppendLogSnapshot::open_read_only(dir)
            .expect("open read-only")
            .0
    }
    fn fail_next_write(store: &mut Self::Store) {
        store.inject_fault(super::append_log::FaultPoint::PartialWriteUncut);
    }
}

conformance_suite!(append_log, super::AppendLog);

/// fjall.
#[cfg(feature = "fjall")]
pub(crate) struct Fjall;

#[cfg(feature = "fjall")]
impl Opener for Fjall {
    type Store = super::FjallSnapshot;
    fn try_open(dir: &Path) -> Result<Self::Store, SnapshotError> {
        super::FjallSnapshot::open(dir, super::FjallOptions::default())
    }
    fn open_read_only(dir: &Path) -> Self::Store {
        super::FjallSnapshot::open_read_only(dir).expect("open read-only")
    }
    fn fail_next_write(store: &mut Self::Store) {
        store.inject_write_fault();
    }
}

#[cfg(feature = "fjall")]
conformance_suite!(fjall, super::Fjall);

/// RocksDB.
#[cfg(feature = "rocksdb")]
pub(crate) struct RocksDb;

#[cfg(feature = "rocksdb")]
impl Opener for RocksDb {
    type Store = super::RocksDbSnapshot;
    fn try_open(dir: &Path) -> Result<Self::Store, SnapshotError> {
        super::RocksDbSnapshot::open(dir, super::RocksDbOptions::default())
    }
    fn open_read_only(dir: &Path) -> Self::Store {
        super::RocksDbSnapshot::open_read_only(dir).expect("open read-only")
    }
    fn fail_next_write(store: &mut Self::Store) {
        store.inject_write_fault();
    }
}

#[cfg(feature = "rocksdb")]
conformance_suite!(rocksdb, super::RocksDb);
