//! `run --config FILE` (docs/operations.md, "Several folds from one file"): three folds in one process — an
//! append log with a Rust guest, fjall with the JavaScript router, RocksDB with the native applier
//! — each fold its bucket, each resumes from its own cursor after a SIGKILL, a guest trapping in
//! one leaves the other two folding; a key no flag has is refused naming its line.

use std::path::Path;
use std::process::Stdio;

use foldhost_core::kv::KvWriter as _;
use foldhost_tests::*;

/// The three folds' buckets, stores and listen addresses.
struct Three {
    dir: tempfile::TempDir,
    file: std::path::PathBuf,
    addrs: [String; 3],
}

const BUCKETS: [&str; 3] = ["cfg_log", "cfg_fjall", "cfg_rocks"];

fn config(h: &Harness) -> anyhow::Result<Three> {
    let dir = tempfile::tempdir()?;
    let addrs = [
        format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?),
        format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?),
        format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?),
    ];
    let store = |n: &str| dir.path().join(n).display().to_string();
    let text = format!(
        r#"nats = "{nats}"
batch_window_ms = "20ms"

[[folds]]
name = "log"
bucket = "cfg_log"
store = "{s0}"
guest = "{g0}"
listen = "{a0}"

[[folds]]
name = "fjall"
bucket = "cfg_fjall"
store = "{s1}"
backend = "fjall"
guest = "{g1}"
listen = "{a1}"

[[folds]]
name = "rocks"
bucket = "cfg_rocks"
store = "{s2}"
backend = "rocksdb"
listen = "{a2}"
"#,
        nats = h.url(),
        s0 = store("log"),
        s1 = store("fjall"),
        s2 = store("rocks"),
        g0 = guest_wasm("hostile_trap").display(),
        g1 = guest_wasm("router_js").display(),
        a0 = addrs[0],
        a1 = addrs[1],
        a2 = addrs[2],
    );
    let file = dir.path().join("foldhost.toml");
    std::fs::write(&file, text)?;
    Ok(Three { dir, file, addrs })
}

fn start(t: &Three, log: &str) -> anyhow::Result<std::process::Child> {
    Ok(foldhost()
        .args(["run", "--config"])
        .arg(&t.file)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(t.dir.path().join(log))?)
        .spawn()?)
}

/// Puts `n` keys from `from` into each bucket (routes for the router).
async fn write(
    kvs: &[std::sync::Arc<foldhost_nats::NatsKv>],
    from: usize,
    n: usize,
) -> anyhow::Result<()> {
    for i in from..from + n {
        let route = format!("{{\"upstream\":\"10.0.0.{}:80\"}}", i % 250);
        kvs[0]
            .put(&format!("k.{i:03}"), format!("v{i}").into())
            .await?;
        kvs[1]
            .put(&format!("route.h{i:03}.example"), route.into())
            .await?;
        kvs[2]
            .put(&format!("k.{i:03}"), format!("v{i}").into())
            .await?;
    }
    Ok(())
}

/// Waits until the fold at `addr` is level with its bucket and holds what it holds.
async fn level_and_equal(
    addr: &str,
    kv: &foldhost_nats::NatsKv,
    store: &Path,
) -> anyhow::Result<foldhost_core::status::StatusReport> {
    let last = kv.positions().await?.last_sequence;
    let s = wait_status(addr, |s| s.state == "running" && s.applied_through >= last).await?;
    let want = bucket_contents(kv).await?;
    let got = dump_store(store)?;
    anyhow::ensure!(
        first_difference(&want, &got).is_none(),
        "{addr}: {:?}",
        first_difference(&want, &got)
    );
    Ok(s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_folds_in_one_process_each_resume_from_their_cursor_and_fail_alone()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let mut kvs = Vec::new();
    for b in BUCKETS {
        kvs.push(h.bucket(b).await?);
    }
    write(&kvs, 0, 40).await?;
    let t = config(&h)?;
    let stores = ["log", "fjall", "rocks"].map(|n| t.dir.path().join(n));
    let mut node = start(&t, "first.log")?;
    for i in 0..3 {
        level_and_equal(&t.addrs[i], &kvs[i], &stores[i]).await?;
    }
    // Killed, written to, started again: each fold resumes from its own cursor.
    node.kill()?;
    node.wait()?;
    write(&kvs, 40, 5).await?;
    let mut node = start(&t, "second.log")?;
    for i in 0..3 {
        let s = level_and_equal(&t.addrs[i], &kvs[i], &stores[i]).await?;
        anyhow::ensure!(
            s.delivered <= 5,
            "fold {i} resumed from its cursor, not from the start: {s:?}"
        );
    }
    // The log fold's guest traps on `trap.me`: that fold stops, the other two go on folding.
    kvs[0].put("trap.me", "x".into()).await?;
    let failed = wait_status(&t.addrs[0], |s| s.state == "failed").await?;
    anyhow::ensure!(
        failed
            .error
            .as_deref()
            .is_some_and(|e| e.contains("hostile-trap")),
        "{failed:?}"
    );
    write(&kvs, 45, 5).await?;
    for i in 1..3 {
        level_and_equal(&t.addrs[i], &kvs[i], &stores[i]).await?;
    }
    anyhow::ensure!(node.try_wait()?.is_none(), "the process runs on");
    let status = terminate(&mut node)?;
    anyhow::ensure!(
        !status.success(),
        "a fold failed: the process says so at its stop"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_no_flag_has_is_refused_naming_its_line_and_nothing_is_opened() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let store = dir.path().join("store");
    let file = dir.path().join("foldhost.toml");
    std::fs::write(
        &file,
        format!(
            "nats = \"nats://127.0.0.1:1\"\n\n[[folds]]\nbucket = \"b\"\nstore = \"{}\"\nbakend = \"fjall\"\n",
            store.display()
        ),
    )?;
    for args in [vec!["config", "check"], vec!["run", "--config"]] {
        let out = foldhost().args(&args).arg(&file).output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        anyhow::ensure!(out.status.code() == Some(1), "{args:?}: {err}");
        anyhow::ensure!(
            err.lines().count() == 1
                && err.contains("foldhost.toml:6:")
                && err.contains("unknown key `bakend`"),
            "{args:?}: one line naming the file, the line and the key: {err}"
        );
        anyhow::ensure!(!store.exists(), "nothing opened");
    }
    // The same file without the typo checks, printing every effective value.
    std::fs::write(
        &file,
        format!(
            "nats = \"nats://u:secret@127.0.0.1:1\"\n\n[[folds]]\nbucket = \"b\"\nstore = \"{}\"\nbackend = \"fjall\"\n",
            store.display()
        ),
    )?;
    let out = foldhost().args(["config", "check"]).arg(&file).output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    anyhow::ensure!(
        text.contains("backend = \"fjall\"\n")
            && text.contains("batch_max = ")
            && !text.contains("secret"),
        "{text}"
    );
    anyhow::ensure!(!store.exists(), "config check opens nothing");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_listen_address_serves_every_fold_under_its_name_and_the_process_across_them()
-> anyhow::Result<()> {
    let h = Harness::start().await?;
    let (a, b) = (h.bucket("one_a").await?, h.bucket("one_b").await?);
    a.put("k.a", "va".into()).await?;
    b.put("k.b", "vb".into()).await?;
    let dir = tempfile::tempdir()?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let file = dir.path().join("foldhost.toml");
    std::fs::write(
        &file,
        format!(
            "nats = \"{}\"\nlisten = \"{addr}\"\n\n[[folds]]\nname = \"a\"\nbucket = \"one_a\"\nstore = \"{}\"\nguest = \"{}\"\n\n[[folds]]\nname = \"b\"\nbucket = \"one_b\"\nstore = \"{}\"\nbackend = \"fjall\"\n",
            h.url(),
            dir.path().join("a").display(),
            guest_wasm("kvstore").display(),
            dir.path().join("b").display(),
        ),
    )?;
    let mut node = foldhost()
        .args(["run", "--config"])
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("run.log"))?)
        .spawn()?;
    // Each fold under its name: its own status, its own guest.
    let fold_a = format!("{addr}/folds/a");
    let fold_b = format!("{addr}/folds/b");
    let sa = wait_status(&fold_a, |s| s.caught_up && s.applied_through >= 1).await?;
    let sb = wait_status(&fold_b, |s| s.caught_up && s.applied_through >= 1).await?;
    anyhow::ensure!(
        sa.bucket == "one_a" && sb.bucket == "one_b",
        "{sa:?} {sb:?}"
    );
    let (code, answer) = foldhost::serve::call(&fold_a, "POST", "/query", b"k.a").await?;
    anyhow::ensure!((code, answer.as_slice()) == (200, &b"va"[..]), "{code}");
    // The process's own routes, across the folds.
    let (code, body) = foldhost::serve::call(&addr, "GET", "/status", b"").await?;
    let v: serde_json::Value = serde_json::from_slice(&body)?;
    anyhow::ensure!(
        code == 200 && v["folds"].as_array().map(Vec::len) == Some(2),
        "{v}"
    );
    let (code, body) = foldhost::serve::call(&addr, "GET", "/readyz", b"").await?;
    let text = String::from_utf8_lossy(&body);
    anyhow::ensure!(
        code == 200 && text == "ready: fold a, fold b\n",
        "{code} {text:?} {v}"
    );
    let (_, body) = foldhost::serve::call(&addr, "GET", "/metrics", b"").await?;
    let text = String::from_utf8_lossy(&body);
    for fold in ["a", "b"] {
        anyhow::ensure!(
            text.contains(&format!("foldhost_applied_through{{fold=\"{fold}\"}} ")),
            "{text}"
        );
    }
    // A fold route without a fold, or naming none here: 404 saying why.
    let (code, body) = foldhost::serve::call(&addr, "POST", "/query", b"k.a").await?;
    anyhow::ensure!(
        code == 404 && String::from_utf8_lossy(&body).contains("/folds/NAME"),
        "{code}"
    );
    let (code, _) = foldhost::serve::call(&addr, "GET", "/folds/zz/status", b"").await?;
    anyhow::ensure!(code == 404, "{code}");
    // The CLI reaches one fold as ADDR/folds/NAME: a swap of fold a alone.
    let report = swap_to(&fold_a, "kvstore_v2", None)?;
    anyhow::ensure!(report["to"] == "kvstore@0.2.0", "{report}");
    let sb = wait_status(&fold_b, |_| true).await?;
    anyhow::ensure!(
        sb.guest.is_none() || sb.guest.as_deref() == Some("native:count"),
        "{sb:?}"
    );
    // status --watch: a line per fold.
    let watch = foldhost()
        .args([
            "status", "--listen", &addr, "--watch", "0.2", "--count", "1",
        ])
        .output()?;
    let text = String::from_utf8(watch.stdout)?;
    let firsts: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    anyhow::ensure!(firsts == ["one_a", "one_b"], "{text}");
    terminate(&mut node)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_one_listen_a_folds_own_listener_setting_or_unservable_name_is_refused_in_one_line()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("foldhost.toml");
    let stores = [dir.path().join("sa"), dir.path().join("sb")];
    let head = format!(
        "nats = \"nats://127.0.0.1:1\"\nlisten = \"127.0.0.1:0\"\n\n[[folds]]\nbucket = \"a\"\nstore = \"{}\"\n\n[[folds]]\n",
        stores[0].display()
    );
    // Line 9 on: fold 2's table.
    let second = format!("store = \"{}\"\n", stores[1].display());
    for (fold2, line, says) in [
        (
            format!("bucket = \"b\"\n{second}query_open = true\n"),
            11,
            "`query_open`",
        ),
        (
            format!("bucket = \"b\"\n{second}admin_token_file = \"/tmp/t\"\n"),
            11,
            "`admin_token_file`",
        ),
        (
            format!("name = \"b b\"\nbucket = \"b\"\n{second}"),
            9,
            "\"b b\"",
        ),
    ] {
        std::fs::write(&file, format!("{head}{fold2}"))?;
        for args in [vec!["config", "check"], vec!["run", "--config"]] {
            let out = foldhost().args(&args).arg(&file).output()?;
            let err = String::from_utf8_lossy(&out.stderr);
            anyhow::ensure!(out.status.code() == Some(1), "{args:?}: {err}");
            anyhow::ensure!(
                err.lines().count() == 1
                    && err.contains(&format!("foldhost.toml:{line}:"))
                    && err.contains("fold 2")
                    && err.contains(says),
                "{args:?}: one line naming the file, the line, the fold and the key: {err}"
            );
            for s in &stores {
                anyhow::ensure!(!s.exists(), "nothing opened");
            }
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_check_prints_each_value_in_the_type_the_file_takes_and_its_output_checks_the_same()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("foldhost.toml");
    std::fs::write(
        &file,
        format!(
            "nats = \"nats://127.0.0.1:1\"\nlisten = \"127.0.0.1:0\"\nquery_max_bytes = \"1MiB\"\n\n[[folds]]\nbucket = \"a\"\nstore = \"{}\"\n\n[[folds]]\nname = \"b2\"\nbucket = \"b\"\nstore = \"{}\"\nbatch_max = 50\n",
            dir.path().join("sa").display(),
            dir.path().join("sb").display()
        ),
    )?;
    let check = |f: &std::path::Path| -> anyhow::Result<String> {
        let out = foldhost().args(["config", "check"]).arg(f).output()?;
        anyhow::ensure!(
            out.status.success(),
            "{}: {}",
            f.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let first = check(&file)?;
    for want in [
        "batch_max = 100  # default\n",
        "batch_max = 50\n",
        "guest_deadline_ms = 1000  # default\n",
        "sync = false  # default\n",
        "query_max_bytes = \"1MiB\"\n",
    ] {
        anyhow::ensure!(first.contains(want), "{want:?} in:\n{first}");
    }
    // The listener's keys once, at the top: no fold's table sets them.
    let folds_part = first.split("[[folds]]").skip(1).collect::<String>();
    anyhow::ensure!(
        first.matches("query_open = ").count() == 1 && !folds_part.contains("query_max_bytes"),
        "{first}"
    );
    // Its output is a file run takes, and checks to the same values.
    let copy = dir.path().join("copy.toml");
    std::fs::write(&copy, &first)?;
    let again = check(&copy)?;
    // (Only the `# default` marks go: a value the file now gives is no default.)
    let values = |t: &str| t.replace("  # default", "");
    anyhow::ensure!(
        values(&again) == values(&first),
        "first:\n{first}\nagain:\n{again}"
    );
    Ok(())
}
