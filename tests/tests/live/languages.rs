//! Guests in every language the project supports, against a real nats-server: the JavaScript and
//! Python routers through the same SIGKILL-and-query test as the Rust and C ones; the JavaScript
//! router swapped in for the Rust one under a writer and back, every host answered like the
//! bucket; a large component compiled once and loaded from the compiled-component cache after;
//! and `foldhost new-guest` for each language built with its one command and folding.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use foldhost_core::kv::KvWriter;
use foldhost_tests::{
    Harness, bucket_contents, foldhost, guest_wasm, run_command, terminate, wait_status, wait_until,
};

use crate::guests::router_survives_sigkills_and_answers_every_host_like_the_bucket;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn javascript_router_survives_sigkills_and_answers_every_host_like_the_bucket()
-> anyhow::Result<()> {
    router_survives_sigkills_and_answers_every_host_like_the_bucket("router_js", "0.1.0").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_router_survives_sigkills_and_answers_every_host_like_the_bucket()
-> anyhow::Result<()> {
    router_survives_sigkills_and_answers_every_host_like_the_bucket("router_py", "0.1.0").await
}

/// `{"upstream":"10.<g>.<i/250>.<i%250>:80"}`.
fn upstream(i: u32, generation: u64) -> String {
    format!(
        "{{\"upstream\":\"10.{}.{}.{}:80\"}}",
        generation % 250,
        i / 250,
        i % 250
    )
}

/// Asks the host at `addr` for every host `h0000`…: each live route answers exactly its value in
/// the bucket (both routers answer the stored JSON's upstream as compact JSON), each deleted one
/// is unknown (422).
async fn answers_like_the_bucket(
    addr: &str,
    kv: &foldhost_nats::NatsKv,
    hosts: u32,
) -> anyhow::Result<()> {
    let want = bucket_contents(kv).await?;
    for i in 0..hosts {
        let key = format!("route.h{i:04}");
        let (code, body) =
            foldhost::serve::call(addr, "POST", "/query", format!("h{i:04}").as_bytes()).await?;
        match want.get(&key) {
            Some((value, _)) => {
                assert_eq!(code, 200, "{key}: {}", String::from_utf8_lossy(&body));
                assert_eq!(body, *value, "{key}");
            }
            None => assert_eq!(
                code,
                422,
                "{key} is deleted: {}",
                String::from_utf8_lossy(&body)
            ),
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_javascript_router_swaps_in_for_the_rust_router_under_load_and_back_losing_nothing()
-> anyhow::Result<()> {
    const HOSTS: u32 = 3000;
    let h = Harness::start().await?;
    let kv = h.bucket("lang").await?;
    for i in 0..HOSTS {
        kv.put(&format!("route.h{i:04}"), upstream(i, 0).into())
            .await?;
    }
    let tmp = tempfile::tempdir()?;

    // The JavaScript component (~12 MB, an engine inside) compiles once; the next start loads it
    // from the compiled-component cache.
    let cache = tmp.path().join("cache");
    let mut compiled_from = Vec::new();
    for round in 0..2 {
        let store = tmp.path().join(format!("warm{round}"));
        let o = run_command(&h, "lang", &store, None)
            .args(["--catch-up", "--guest"])
            .arg(guest_wasm("router_js"))
            .arg("--guest-cache")
            .arg(&cache)
            .output()?;
        anyhow::ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let s = foldhost_core::storedir::read_status(&store)
            .ok_or_else(|| anyhow::anyhow!("no status after the run"))?;
        compiled_from.push((s.guest_compiled, s.guest_compile_ms));
    }
    eprintln!("router_js compiled code: {compiled_from:?}");
    assert_eq!(compiled_from[0].0.as_deref(), Some("compiled"));
    assert_eq!(
        compiled_from[1].0.as_deref(),
        Some("disk-cache"),
        "the second start loads it"
    );

    let store = tmp.path().join("fold");
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = run_command(&h, "lang", &store, Some(&addr))
        .arg("--guest")
        .arg(guest_wasm("router"))
        .stderr(Stdio::null())
        .spawn()?;
    wait_status(&addr, |s| s.applied_through >= u64::from(HOSTS)).await?;

    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicU64::new(0));
    let writer = {
        let (kv, stop, acked) = (kv.clone(), stop.clone(), acked.clone());
        tokio::spawn(async move {
            let js = kv.jetstream().clone();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let mut acks = Vec::with_capacity(100);
                for _ in 0..100 {
                    let i = u32::try_from(n.wrapping_mul(7919) % u64::from(HOSTS))?;
                    acks.push(
                        js.publish(format!("$KV.lang.route.h{i:04}"), upstream(i, n).into())
                            .await?,
                    );
                    n += 1;
                }
                for a in acks {
                    a.await?;
                }
                kv.delete(&format!("route.h{:04}", n % u64::from(HOSTS)))
                    .await?;
                n += 1;
                acked.store(n, Ordering::Relaxed);
            }
            anyhow::Ok(n)
        })
    };
    for (i, (guest, to)) in [("router_js", "router-js@0.1.0"), ("router", "router@0.1.0")]
        .into_iter()
        .enumerate()
    {
        let target = 2000 * (i as u64 + 1);
        wait_until("more acknowledged writes", || {
            acked.load(Ordering::Relaxed) >= target
        })
        .await?;
        let out = foldhost()
            .args(["swap", "--listen", &addr, "--guest"])
            .arg(guest_wasm(guest))
            .env_remove("FOLDHOST_ADMIN_TOKEN")
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "swap to {to}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: serde_json::Value = serde_json::from_str(text.trim())?;
        assert_eq!(report["to"], to, "{text}");
        if i == 0 {
            // Answered by the JavaScript router while the writer still writes.
            let s = wait_status(&addr, |_| true).await?;
            assert_eq!(s.guest.as_deref(), Some("router-js@0.1.0"));
        }
    }
    let target = acked.load(Ordering::Relaxed) + 1000;
    wait_until("writes after the last swap", || {
        acked.load(Ordering::Relaxed) >= target
    })
    .await?;
    stop.store(true, Ordering::Relaxed);
    writer.await??;
    let last = kv.positions().await?.last_sequence;
    let s = wait_status(&addr, |s| s.applied_through >= last || s.state == "failed").await?;
    assert_eq!(s.state, "running", "{s:?}");
    answers_like_the_bucket(&addr, &kv, HOSTS).await?;
    // And the JavaScript router once more, now answering every host itself.
    let out = foldhost()
        .args(["swap", "--listen", &addr, "--guest"])
        .arg(guest_wasm("router_js"))
        .env_remove("FOLDHOST_ADMIN_TOKEN")
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    answers_like_the_bucket(&addr, &kv, HOSTS).await?;
    terminate(&mut host)?;
    Ok(())
}

/// `foldhost new-guest my-guest --lang LANG`, built with the scaffold's one command; returns the
/// component.
fn scaffold(lang: &str, dir: &Path) -> anyhow::Result<PathBuf> {
    scaffold_with(lang, dir, &[])
}

/// [`scaffold`] with more `new-guest` flags.
///
/// Rust and Python scaffolds carry the SDK and the WIT the binary holds (the project, in a
/// temporary directory outside the checkout, builds from its own `foldhost/`); JavaScript ones
/// link the checkout's SDK, whose installed toolchain they share (a carried one installs its own
/// with `npm ci` at its first build).
fn scaffold_with(lang: &str, dir: &Path, flags: &[&str]) -> anyhow::Result<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut new_guest = foldhost();
    new_guest
        .args(["new-guest", "my-guest", "--lang", lang, "--dir"])
        .arg(dir)
        .args(flags);
    if lang == "js" && !flags.contains(&"--sdk") {
        new_guest
            .arg("--sdk")
            .arg(root.join("sdk/js"))
            .arg("--wit")
            .arg(root.join("wit"));
    }
    let out = new_guest.output()?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout);
    let (mut build, wasm) = if lang == "rust" {
        // Sharing the guests' target directory, so the SDK compiles once.
        let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../guests/target");
        let mut c = std::process::Command::new("cargo");
        c.args(["build", "--release", "--target", "wasm32-wasip2", "--quiet"])
            .env("CARGO_TARGET_DIR", &target);
        (c, target.join("wasm32-wasip2/release/my_guest.wasm"))
    } else {
        (
            std::process::Command::new("./build.sh"),
            dir.join("my_guest.wasm"),
        )
    };
    assert!(
        said.contains("my_guest.wasm"),
        "says what it builds: {said}"
    );
    let built = build.current_dir(dir).output()?;
    anyhow::ensure!(
        built.status.success(),
        "{lang} build: {}{}",
        String::from_utf8_lossy(&built.stdout),
        String::from_utf8_lossy(&built.stderr)
    );
    anyhow::ensure!(wasm.is_file(), "{} not built", wasm.display());
    Ok(wasm)
}

/// Every scaffold is the same greeter: keys `greeting.<name>`, a query by name.
async fn scaffold_builds_and_folds(lang: &str) -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("my-guest");
    let wasm = scaffold(lang, &dir)?;
    let h = Harness::start().await?;
    let kv = h.bucket("scaffold").await?;
    kv.put("greeting.alice", "hello".into()).await?;
    kv.put("greeting.bob", "hi".into()).await?;
    kv.put("other.carol", "out of scope".into()).await?;
    kv.delete("greeting.bob").await?;
    kv.put("greeting.dave", "hey".into()).await?;
    kv.put("greeting.dave", "good day".into()).await?;
    let last = kv.positions().await?.last_sequence;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = run_command(&h, "scaffold", &tmp.path().join("fold"), Some(&addr))
        .arg("--guest")
        .arg(&wasm)
        .stderr(Stdio::null())
        .spawn()?;
    let s = wait_status(&addr, |s| s.applied_through >= last || s.state == "failed").await?;
    assert_eq!(s.state, "running", "{s:?}");
    assert_eq!(s.guest.as_deref(), Some("my-guest@0.1.0"));
    let ask = |name: &'static str| {
        let addr = addr.clone();
        async move { foldhost::serve::call(&addr, "POST", "/query", name.as_bytes()).await }
    };
    assert_eq!(ask("alice").await?, (200, b"hello".to_vec()));
    assert_eq!(ask("dave").await?, (200, b"good day".to_vec()));
    assert_eq!(ask("bob").await?.0, 422, "deleted");
    assert_eq!(ask("carol").await?.0, 422, "out of scope");
    terminate(&mut host)?;
    // And it refuses to overwrite.
    let again = foldhost()
        .args(["new-guest", "my-guest", "--lang", lang, "--dir"])
        .arg(&dir)
        .output()?;
    assert_eq!(again.status.code(), Some(1));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_guest_in_rust_builds_with_one_command_and_folds() -> anyhow::Result<()> {
    scaffold_builds_and_folds("rust").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_guest_in_javascript_builds_with_one_command_and_folds() -> anyhow::Result<()> {
    scaffold_builds_and_folds("js").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_guest_in_python_builds_with_one_command_and_folds() -> anyhow::Result<()> {
    scaffold_builds_and_folds("python").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_guest_in_c_builds_with_one_command_and_folds() -> anyhow::Result<()> {
    scaffold_builds_and_folds("c").await
}

/// Every state scaffold is the same counter (docs/state.md): it owns `counts`, where it writes how
/// many keys its main bucket holds, and reads `catalog.items`, another module's bucket.
async fn state_scaffold_keeps_and_follows_state(lang: &str) -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("my-guest");
    let wasm = scaffold_with(lang, &dir, &["--state"])?;
    let h = Harness::start().await?;
    // The catalog module's bucket, written before the guest ever ran.
    let items = h.bucket("state_catalog_items").await?;
    items.put("sku-1", "widget".into()).await?;
    let kv = h.bucket("scaffold").await?;
    kv.put("a", "1".into()).await?;
    kv.put("b", "2".into()).await?;
    let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
    let mut host = run_command(&h, "scaffold", &tmp.path().join("fold"), Some(&addr))
        .arg("--guest")
        .arg(&wasm)
        .stderr(Stdio::null())
        .spawn()?;
    let s = wait_status(&addr, |s| s.state != "running" || s.applied_through >= 2).await?;
    assert_eq!(s.state, "running", "{s:?}");
    assert_eq!(s.guest_contract.as_deref(), Some("0.3.0"));
    let ask = |request: String| {
        let addr = addr.clone();
        async move { foldhost::serve::call(&addr, "POST", "/query", request.as_bytes()).await }
    };
    let until = |request: &'static str, want: &'static [u8]| {
        let ask = &ask;
        async move {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
            loop {
                let got = ask(request.to_string()).await?;
                if got == (200, want.to_vec()) {
                    return anyhow::Ok(());
                }
                anyhow::ensure!(
                    std::time::Instant::now() < deadline,
                    "{request}: {got:?}, never {:?}",
                    String::from_utf8_lossy(want)
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    };
    // Read from the other module's bucket, as it stood before the guest started.
    until("item:sku-1", b"widget").await?;
    // Written to its own bucket from on-applied, then folded back.
    until("total", b"2").await?;
    // Changes afterwards reach it, in both directions.
    items.put("sku-2", "gadget".into()).await?;
    until("item:sku-2", b"gadget").await?;
    kv.put("c", "3".into()).await?;
    until("total", b"3").await?;
    terminate(&mut host)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_guest_with_state_in_rust_owns_one_bucket_and_reads_another() -> anyhow::Result<()> {
    state_scaffold_keeps_and_follows_state("rust").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_guest_with_state_in_javascript_owns_one_bucket_and_reads_another() -> anyhow::Result<()>
{
    state_scaffold_keeps_and_follows_state("js").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_guest_with_state_in_python_owns_one_bucket_and_reads_another() -> anyhow::Result<()> {
    state_scaffold_keeps_and_follows_state("python").await
}
