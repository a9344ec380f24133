//! The `artifact` benchmark: export and import throughput per backend, against reading and
//! BLAKE3-hashing the same bytes and against the disk's own durable copy of the same files.

use std::time::Instant;

use foldhost_core::snapshot::SnapshotStore;

use super::{median, table};

/// Copies every file under `src` into `dst` and fsyncs each (the disk's floor for a durable copy).
fn copy_fsync(src: &std::path::Path, dst: &std::path::Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dst)?;
    for e in std::fs::read_dir(src)? {
        let e = e?;
        let to = dst.join(e.file_name());
        if e.file_type()?.is_dir() {
            copy_fsync(&e.path(), &to)?;
        } else {
            std::fs::copy(e.path(), &to)?;
            std::fs::File::open(&to)?.sync_all()?;
        }
    }
    Ok(())
}

/// Reads and BLAKE3-hashes every file under `dir` (the `b3sum` baseline, timed on its second pass,
/// from the page cache); returns bytes hashed.
fn hash_tree(dir: &std::path::Path) -> anyhow::Result<u64> {
    let mut total = 0u64;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            total += hash_tree(&e.path())?;
        } else {
            let mut h = blake3::Hasher::new();
            let mut f = std::fs::File::open(e.path())?;
            total += std::io::copy(&mut f, &mut h)?;
            std::hint::black_box(h.finalize());
        }
    }
    Ok(total)
}

pub(crate) fn bench_artifact(keys: u64, runs: usize) -> anyhow::Result<()> {
    use foldhost_core::storedir::Backend;
    for backend in [Backend::AppendLog, Backend::Fjall, Backend::RocksDb] {
        if backend.is_compiled() {
            bench_artifact_of(backend, keys, runs)?;
        }
    }
    Ok(())
}

/// A value of `len` bytes distinct per key that compresses about as well as real configuration
/// (hex digits, about 2:1), as the bootstrap bench's values do. A repeated byte compresses 50:1
/// in RocksDB and fjall: their artifacts shrank to a few MB, and the MB/s of an export or import
/// measured its fixed costs (a checkpoint, a verifying open) instead of its throughput.
fn hex_value(i: u64, len: usize) -> bytes::Bytes {
    let mut v = Vec::with_capacity(len + 64);
    let mut n = 0u64;
    while v.len() < len {
        let h = blake3::hash(&[i.to_le_bytes(), n.to_le_bytes()].concat());
        v.extend_from_slice(h.to_hex().as_bytes());
        n += 1;
    }
    v.truncate(len);
    v.into()
}

/// Export and import of a `keys`-key fold of `backend`, `runs` times, against read + BLAKE3 of
/// the same bytes and the disk's durable copy of the same files; prints the medians and adds
/// them to the table.
fn bench_artifact_of(
    backend: foldhost_core::storedir::Backend,
    keys: u64,
    runs: usize,
) -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let src = tmp.path().join("src");
    fill(&src, backend, keys)?;
    let (mut exp, mut imp, mut hash, mut disk) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut bytes = 0u64;
    for i in 0..runs {
        let r = one_run(tmp.path(), &src, backend, i)?;
        bytes = r.bytes;
        disk.push(r.disk);
        exp.push(r.export);
        imp.push(r.import);
        hash.push(r.hash);
    }
    let (e, i, h, d) = (median(exp), median(imp), median(hash), median(disk));
    report(backend.as_str(), keys, runs, bytes, (e, i, h, d));
    Ok(())
}

/// Folds `keys` keys of 256 B hex values into a new store of `backend` at `src`.
fn fill(
    src: &std::path::Path,
    backend: foldhost_core::storedir::Backend,
    keys: u64,
) -> anyhow::Result<()> {
    use foldhost_core::kv::{KvEntry, KvUpdate, VersionToken, WatchCursor};
    use foldhost_core::storedir::AnyStore;
    let (mut store, _) = AnyStore::open(src, backend)?;
    let mut rev = 0u64;
    while rev < keys {
        let batch: Vec<KvUpdate> = (rev + 1..=(rev + 1000).min(keys))
            .map(|r| {
                KvUpdate::Put(KvEntry {
                    key: format!("key.{r:012}"),
                    value: hex_value(r, 256),
                    version: VersionToken::from_u64(r),
                })
            })
            .collect();
        rev += batch.len() as u64;
        store.apply(&batch, WatchCursor::at(rev))?;
    }
    Ok(())
}

/// One run's figures, in MB/s, and the artifact's payload in bytes.
struct Run {
    bytes: u64,
    export: f64,
    import: f64,
    hash: f64,
    disk: f64,
}

/// Run `i`: the export of the store at `src` into `tmp`, its files read and hashed, copied and
/// fsynced, and imported; every copy removed after.
fn one_run(
    tmp: &std::path::Path,
    src: &std::path::Path,
    backend: foldhost_core::storedir::Backend,
    i: usize,
) -> anyhow::Result<Run> {
    use foldhost_core::storedir::AnyStore;
    let art = tmp.join(format!("art{i}"));
    // The export of an open store (a running host's is): the open itself is not timed.
    // Writable, as `foldhost export --store` opens it (RocksDB cannot checkpoint read-only).
    let (store, _) = AnyStore::open(src, backend)?;
    let t = Instant::now();
    foldhost_artifact::artifact::export_store(&store, backend, &[], &art, None, &mut |_, _| {})?;
    let e = t.elapsed().as_secs_f64();
    drop(store);
    // The baseline reads a warm page cache: an export written past the cache (the append
    // log's) would otherwise hand it a disk read, a slower baseline than the one it had.
    hash_tree(&art.join("data"))?;
    let t = Instant::now();
    let bytes = hash_tree(&art.join("data"))?;
    let hsec = t.elapsed().as_secs_f64();
    // The disk's own floor for a durable copy: the same files copied and fsynced.
    let t = Instant::now();
    copy_fsync(&art.join("data"), &tmp.join(format!("disk{i}")))?;
    let disk = bytes as f64 / 1e6 / t.elapsed().as_secs_f64();
    std::fs::remove_dir_all(tmp.join(format!("disk{i}")))?;
    let dest = tmp.join(format!("node{i}"));
    let t = Instant::now();
    foldhost_artifact::artifact::import_artifact(&art, &dest, None, &mut |_, _| {})?;
    let isec = t.elapsed().as_secs_f64();
    let mb = bytes as f64 / 1e6;
    std::fs::remove_dir_all(&art)?;
    std::fs::remove_dir_all(&dest)?;
    Ok(Run {
        bytes,
        export: mb / e,
        import: mb / isec,
        hash: mb / hsec,
        disk,
    })
}

/// Prints backend `name`'s medians (export, import, hash, disk in MB/s) and adds them to the
/// table.
fn report(name: &str, keys: u64, runs: usize, bytes: u64, (e, i, h, d): (f64, f64, f64, f64)) {
    println!(
        "artifact, {name}: {keys} keys, {:.1} MB payload; export {e:.0} MB/s, import {i:.0} MB/s; read+BLAKE3 of the same bytes {h:.0} MB/s (ratios export {:.2}, import {:.2}); copy + fsync of the same files {d:.0} MB/s (ratios {:.2}, {:.2}) (median of {runs})",
        bytes as f64 / 1e6,
        e / h,
        i / h,
        e / d,
        i / d
    );
    let mb = bytes as f64 / 1e6;
    table::row(
        format!("export, {name}, {keys} keys of 256 B ({mb:.0} MB payload)"),
        format!("{e:.0} MB/s"),
        format!("read + BLAKE3 of the same files {h:.0} MB/s"),
        e / h,
        "≥ 0.5",
    );
    table::row(
        format!("import, {name}, same artifact"),
        format!("{i:.0} MB/s"),
        format!("read + BLAKE3 of the same files {h:.0} MB/s"),
        i / h,
        "≥ 0.5",
    );
    table::row(
        format!("export, {name}, ÷ the disk's durable copy"),
        format!("{e:.0} MB/s"),
        format!("copy + fsync of the same files {d:.0} MB/s"),
        e / d,
        "",
    );
    table::row(
        format!("import, {name}, ÷ the disk's durable copy"),
        format!("{i:.0} MB/s"),
        format!("copy + fsync of the same files {d:.0} MB/s"),
        i / d,
        "",
    );
}
