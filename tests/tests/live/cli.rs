//! The command line as a contract: exit codes, one-line errors, JSON shapes, and bad input that
//! loses nothing.

use std::process::Output;

use foldhost_core::kv::KvWriter;
use foldhost_tests::{Harness, dump_store, foldhost, status_store};

fn one_line_error(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one line on stderr, got: {err}");
    assert!(lines[0].starts_with("foldhost: error: "), "{err}");
    lines[0].to_string()
}

#[test]
fn usage_errors_exit_2() -> anyhow::Result<()> {
    let out = foldhost().args(["run", "--bucket"]).output()?;
    assert_eq!(out.status.code(), Some(2));
    let out = foldhost().args(["no-such-command"]).output()?;
    assert_eq!(out.status.code(), Some(2));
    let out = foldhost().args(["status", "--json"]).output()?;
    assert_eq!(
        out.status.code(),
        Some(2),
        "status needs --store or --listen"
    );
    Ok(())
}

#[test]
fn status_of_a_missing_store_is_one_line_and_exit_1() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let out = foldhost()
        .args(["status", "--store"])
        .arg(tmp.path().join("nope"))
        .output()?;
    assert_eq!(out.status.code(), Some(1));
    let line = one_line_error(&out);
    assert!(line.contains("no foldhost store"), "{line}");
    Ok(())
}

#[test]
fn a_corrupt_store_is_refused_by_status_dump_and_run_and_left_byte_identical() -> anyhow::Result<()>
{
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("s");
    std::fs::create_dir_all(&store)?;
    let garbage = b"NOTAFOLD\x01\x02\x03 this is not an append log".to_vec();
    std::fs::write(store.join("fold.log"), &garbage)?;
    for args in [
        vec!["status", "--store"],
        vec!["dump", "--store"],
        vec![
            "run",
            "--nats",
            "nats://127.0.0.1:1",
            "--bucket",
            "b",
            "--store",
        ],
    ] {
        let out = foldhost().args(&args).arg(&store).output()?;
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let line = one_line_error(&out);
        assert!(
            line.contains("fold.log") || line.contains("connect"),
            "{args:?}: the error names the file (or the unreachable server): {line}"
        );
    }
    assert_eq!(std::fs::read(store.join("fold.log"))?, garbage);
    Ok(())
}

#[test]
fn an_unreachable_server_is_one_line_exit_1_and_creates_no_store() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("s");
    let port = foldhost_localnats::reserved_port()?;
    let out = foldhost()
        .args(["run", "--bucket", "b", "--catch-up", "--nats"])
        .arg(format!("nats://127.0.0.1:{port}"))
        .arg("--store")
        .arg(&store)
        .output()?;
    assert_eq!(out.status.code(), Some(1));
    let line = one_line_error(&out);
    assert!(line.contains(&port.to_string()), "names the server: {line}");
    assert!(
        !store.exists(),
        "nothing written for a run that never connected"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_catch_up_then_status_and_dump_json_shapes() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("shapes").await?;
    kv.put("route.a", "{\"upstream\":\"1\"}".into()).await?;
    kv.put("route.b", bytes::Bytes::from_static(&[0, 159, 146, 150]))
        .await?;
    kv.put("other", "x".into()).await?;
    let tmp = tempfile::tempdir()?;
    let store = tmp.path().join("s");
    let out = foldhost()
        .args([
            "run",
            "--catch-up",
            "--bucket",
            "shapes",
            "--scope",
            "prefix:route.",
        ])
        .args(["--nats", &h.url(), "--store"])
        .arg(&store)
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = status_store(&store)?;
    assert_eq!(s.cursor, Some(2));
    assert_eq!(s.applied_through, 2);
    assert_eq!(s.seq, 2);
    assert_eq!(s.backend, "append-log");
    assert_eq!(s.guest.as_deref(), Some("native:count"));
    assert_eq!(s.keys, Some(2));
    let d = dump_store(&store)?;
    assert_eq!(d.len(), 2, "the scope keeps `other` out");
    assert_eq!(d["route.b"], (vec![0, 159, 146, 150], 2));

    let missing = foldhost()
        .args([
            "run",
            "--catch-up",
            "--bucket",
            "nope",
            "--nats",
            &h.url(),
            "--store",
        ])
        .arg(tmp.path().join("t"))
        .output()?;
    assert_eq!(missing.status.code(), Some(1));
    assert!(one_line_error(&missing).contains("\"nope\" not found"));
    Ok(())
}

/// The backends this test build (and so, under `make test`, the `foldhost` binary) includes.
fn compiled_backends() -> Vec<&'static str> {
    let mut v = vec!["append-log"];
    if cfg!(feature = "fjall") {
        v.push("fjall");
    }
    if cfg!(feature = "rocksdb") {
        v.push("rocksdb");
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_backend_reaches_every_compiled_backend_and_status_and_dump_read_it()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let kv = h.bucket("backends").await?;
    kv.put("a", "1".into()).await?;
    kv.put("b", "2".into()).await?;
    kv.put("a", "3".into()).await?;
    kv.delete("b").await?;
    kv.put("c", "4".into()).await?;
    let tmp = tempfile::tempdir()?;
    for backend in compiled_backends() {
        let store = tmp.path().join(backend);
        let run = |b: &str| {
            foldhost()
                .args(["run", "--catch-up", "--bucket", "backends", "--backend", b])
                .args(["--nats", &h.url(), "--store"])
                .arg(&store)
                .output()
        };
        let out = run(backend)?;
        assert!(
            out.status.success(),
            "{backend}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let s = status_store(&store)?;
        assert_eq!(s.backend, backend);
        assert_eq!(s.cursor, Some(5), "{backend}");
        assert_eq!(s.keys, Some(2), "{backend}");
        let d = dump_store(&store)?;
        assert_eq!(d.len(), 2, "{backend}");
        assert_eq!(d["a"], (b"3".to_vec(), 3), "{backend}");
        assert_eq!(d["c"], (b"4".to_vec(), 5), "{backend}");
        // A second run resumes (the cursor came back from this backend).
        assert!(run(backend)?.status.success());
        assert_eq!(status_store(&store)?.cursor, Some(5));
        // The store refuses another backend, in one line.
        let other = if backend == "append-log" {
            compiled_backends().get(1).copied().unwrap_or("fjall")
        } else {
            "append-log"
        };
        let out = run(other)?;
        assert_eq!(out.status.code(), Some(1), "{backend} opened as {other}");
        let line = one_line_error(&out);
        assert!(
            line.contains("holds backend") || line.contains("--features"),
            "{line}"
        );
    }
    Ok(())
}

#[test]
fn a_backend_not_built_in_is_a_one_line_error_naming_its_feature() -> anyhow::Result<()> {
    for backend in ["fjall", "rocksdb"] {
        if compiled_backends().contains(&backend) {
            continue;
        }
        let tmp = tempfile::tempdir()?;
        let out = foldhost()
            .args(["run", "--bucket", "b", "--backend", backend, "--store"])
            .arg(tmp.path().join("s"))
            .output()?;
        assert_ne!(out.status.code(), Some(0));
        let line = one_line_error(&out);
        assert!(line.contains(&format!("--features {backend}")), "{line}");
    }
    Ok(())
}
