//! `examples/`: what a user copies works as it says — the config file passes `config check`, the
//! nats-server configuration is one nats-server accepts and grants every subject `foldhost grants`
//! prints for the config's folds, the service unit runs the command the README documents; each
//! `router-*` project, copied out of the checkout, builds with its one command into a component
//! that answers every route query exactly as `guests/router` does on the same bucket; and
//! `quickstart.sh` goes from the checkout to an answered query, leaving no process behind.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use foldhost_core::kv::KvWriter;
use foldhost_tests::{
    Harness, foldhost, foldhost_bin, guest_wasm, run_command, terminate, test_guest_cache,
    wait_status,
};

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name)
}

#[test]
fn the_example_config_passes_config_check() -> anyhow::Result<()> {
    let out = foldhost()
        .args(["config", "check"])
        .arg(example("foldhost.toml"))
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout);
    for fold in ["name = \"routes\"", "name = \"flags\""] {
        anyhow::ensure!(said.contains(fold), "{fold} missing from:\n{said}");
    }
    Ok(())
}

#[test]
fn the_example_nats_server_config_is_valid_and_grants_what_foldhost_grants_prints()
-> anyhow::Result<()> {
    let conf = example("nats-server.conf");
    let text = std::fs::read_to_string(&conf)?;
    let router = guest_wasm("router");
    for flags in [
        vec![
            "--bucket",
            "routes",
            "--guest",
            router.to_str().unwrap_or_default(),
        ],
        vec!["--bucket", "flags"],
    ] {
        let out = foldhost()
            .arg("grants")
            .args(&flags)
            .arg("--json")
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let grants: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        for side in ["publish", "subscribe"] {
            let subjects = grants[side]
                .as_array()
                .ok_or_else(|| anyhow::anyhow!("no {side} allow list: {grants}"))?;
            for s in subjects {
                let quoted = format!("{s}");
                anyhow::ensure!(
                    text.contains(&quoted),
                    "examples/nats-server.conf lacks {side} {quoted} (grants {flags:?})"
                );
            }
        }
    }
    let bin = std::env::var("NATS_SERVER_BIN").unwrap_or_else(|_| "nats-server".into());
    let checked = std::process::Command::new(bin)
        .arg("-c")
        .arg(&conf)
        .arg("-t")
        .env("NATS_ADMIN_PASSWORD", "admin-secret")
        .env("NATS_FOLDHOST_PASSWORD", "node-secret")
        .output()?;
    anyhow::ensure!(
        checked.status.success(),
        "nats-server -t: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    Ok(())
}

#[test]
fn the_example_service_runs_the_config_and_keeps_its_state_in_its_state_directory()
-> anyhow::Result<()> {
    let unit = std::fs::read_to_string(example("foldhost.service"))?;
    for line in [
        "ExecStart=/usr/local/bin/foldhost run --config /etc/foldhost/foldhost.toml",
        "DynamicUser=yes",
        "StateDirectory=foldhost",
        "ProtectSystem=strict",
    ] {
        anyhow::ensure!(unit.contains(line), "the unit lacks {line}");
    }
    // Every store the example config names is under the unit's state directory.
    let config = std::fs::read_to_string(example("foldhost.toml"))?;
    for store in config.lines().filter_map(|l| l.strip_prefix("store = ")) {
        anyhow::ensure!(
            store.trim_matches('"').starts_with("/var/lib/foldhost/"),
            "{store} is outside StateDirectory=foldhost"
        );
    }
    Ok(())
}

/// The checkout's root.
fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// What a build or a run leaves in an example project (its `.gitignore`s): never copied.
fn is_build_output(name: &str) -> bool {
    [
        "foldhost",
        "target",
        "bindings",
        "__pycache__",
        "node_modules",
        "Cargo.lock",
    ]
    .contains(&name)
        || name.ends_with(".wasm")
}

/// Copies the project `from` to `to`, its sources only, as a user copies it out of the checkout.
fn copy_project(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let name = entry.file_name();
        if is_build_output(&name.to_string_lossy()) {
            continue;
        }
        if entry.file_type()?.is_dir() {
            copy_project(&entry.path(), &to.join(&name))?;
        } else {
            // `fs::copy` keeps the permissions: build.sh stays executable.
            std::fs::copy(entry.path(), to.join(&name))?;
        }
    }
    Ok(())
}

/// `examples/DIR` copied into `outside` (a directory outside the checkout) and built there with its
/// one command, `./build.sh`; returns the component, `WASM` in the copy.
///
/// The Rust, Python and C copies take the SDK and the WIT from the foldhost binary (`FOLDHOST`),
/// as on a machine with no checkout, and the test checks they did: `foldhost/` is a directory of
/// their own. The JavaScript copy links the checkout's SDK instead, whose toolchain
/// `scripts/setup.sh` installed (a carried SDK installs its own with `npm ci` at its first build:
/// the network, and a minute), as the JavaScript scaffold's test does. The Rust build shares the
/// guests' target directory, so its dependencies compile once.
fn build_copy(dir: &str, wasm: &str, outside: &Path) -> anyhow::Result<PathBuf> {
    let copy = outside.join(dir);
    copy_project(&example(dir), &copy)?;
    let linked = dir == "router-js";
    if linked {
        std::fs::create_dir(copy.join("foldhost"))?;
        for part in ["sdk", "wit"] {
            let target = std::fs::canonicalize(checkout().join(part))?;
            std::os::unix::fs::symlink(target, copy.join("foldhost").join(part))?;
        }
    }
    let mut build = Command::new(copy.join("build.sh"));
    build
        .current_dir(&copy)
        .env("FOLDHOST", foldhost_bin())
        .stdin(Stdio::null());
    if dir == "router-rust" {
        build.env("CARGO_TARGET_DIR", checkout().join("guests/target"));
    }
    let built = build.output()?;
    anyhow::ensure!(
        built.status.success(),
        "{dir}/build.sh: {}{}",
        String::from_utf8_lossy(&built.stdout),
        String::from_utf8_lossy(&built.stderr)
    );
    if !linked {
        let wit = std::fs::symlink_metadata(copy.join("foldhost/wit"))?;
        anyhow::ensure!(
            wit.is_dir(),
            "{dir}: foldhost/wit is not the binary's carried copy"
        );
    }
    let component = copy.join(wasm);
    anyhow::ensure!(component.is_file(), "{} not built", component.display());
    Ok(component)
}

/// A `foldhost run` this test started, stopped (SIGTERM, waited for) however the test ends.
struct Node {
    child: Child,
    addr: String,
}

impl Node {
    /// `guest` folding `bucket` on `h`'s server into `store`, listening on a reserved port.
    fn start(h: &Harness, bucket: &str, store: &Path, guest: &Path) -> anyhow::Result<Self> {
        let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
        let child = run_command(h, bucket, store, Some(&addr))
            .arg("--guest")
            .arg(guest)
            .stderr(Stdio::null())
            .spawn()?;
        Ok(Node { child, addr })
    }

    /// Waits until it has applied everything up to `last`; returns its guest (`name@version`).
    async fn caught_up(&self, last: u64) -> anyhow::Result<String> {
        let s = wait_status(&self.addr, |s| {
            s.applied_through >= last || s.state == "failed"
        })
        .await?;
        anyhow::ensure!(s.state == "running", "{}: {s:?}", self.addr);
        s.guest
            .clone()
            .ok_or_else(|| anyhow::anyhow!("{}: no guest in {s:?}", self.addr))
    }

    /// `POST /query` with `request`: the status code and the body, an error's body without the
    /// `name@version: ` prefix the host puts before the guest's own message.
    async fn ask(&self, guest: &str, request: &[u8]) -> anyhow::Result<(u16, Vec<u8>)> {
        let (code, body) = foldhost::serve::call(&self.addr, "POST", "/query", request).await?;
        let prefix = format!("{guest}: ");
        let body = match body.strip_prefix(prefix.as_bytes()) {
            Some(message) if code != 200 => message.to_vec(),
            _ => body,
        };
        Ok((code, body))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = terminate(&mut self.child);
    }
}

/// The route values at the router's edges, as the bucket holds them: well-formed routes, values
/// that are not routes (each removes its host's route), the forms serde_json takes that a plain
/// JSON parser decodes differently (a one-element array, a duplicate field, escapes, a lone
/// surrogate, bytes that are not UTF-8), and a key out of scope.
const ROUTES: &[(&str, &[u8])] = &[
    ("route.a.example", br#"{"upstream":"10.0.0.1:8080"}"#),
    (
        "route.b.example",
        br#"{ "extra": [1, {"x": null}], "upstream" : "10.0.0.2:80" }"#,
    ),
    ("route.c.example", b"not json"),
    ("route.d.example", b"{}"),
    ("route.e.example", br#"{"upstream": 7}"#),
    ("route.f.example", br#"{"upstream": ""}"#),
    ("route.g.example", br#"["10.0.0.7:80"]"#),
    (
        "route.h.example",
        br#"{"upstream":"1:80","upstream":"2:80"}"#,
    ),
    (
        "route.i.example",
        br#"{"upstream":"caf\u00e9:80 \"q\" \\ \n \ud83d\ude00"}"#,
    ),
    ("route.j.example", br#"{"upstream":"\ud800"}"#),
    ("route.k.example", b"\xff\xfe{"),
    ("route.l.example", br#"{"upstream":"10.0.0.12:80"}"#),
    ("route.m.example", br#"{"upstream":"10.0.0.13:80"}"#),
    ("route.n.example", b"[]"),
    ("other.o.example", br#"{"upstream":"10.0.0.15:80"}"#),
];

/// Writes [`ROUTES`], then deletes `l`, turns `m` into a value that is not a route and `n` into a
/// route; returns the bucket's last sequence.
async fn write_routes(kv: &foldhost_nats::NatsKv) -> anyhow::Result<u64> {
    for (key, value) in ROUTES {
        kv.put(key, value.to_vec().into()).await?;
    }
    kv.delete("route.l.example").await?;
    kv.put("route.m.example", b"{\"upstream\":null}".to_vec().into())
        .await?;
    kv.put(
        "route.n.example",
        br#"{"upstream":"10.0.0.14:80"}"#.to_vec().into(),
    )
    .await?;
    Ok(kv.positions().await?.last_sequence)
}

/// The example `dir`, copied outside the checkout and built, folds the bucket [`write_routes`]
/// makes beside the checkout's `guests/router` on the same server, and answers every request
/// exactly as it does: the same status, the same body (an error's message after the guest's
/// name).
async fn example_router_answers_as_the_rust_router(
    dir: &str,
    wasm: &str,
    guest: &str,
) -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let component = build_copy(dir, wasm, tmp.path())?;
    let h = Harness::start().await?;
    let kv = h.bucket("routes").await?;
    let last = write_routes(&kv).await?;
    let reference = Node::start(
        &h,
        "routes",
        &tmp.path().join("reference"),
        &guest_wasm("router"),
    )?;
    let example = Node::start(&h, "routes", &tmp.path().join("example"), &component)?;
    let reference_guest = reference.caught_up(last).await?;
    assert_eq!(reference_guest, "router@0.1.0");
    assert_eq!(example.caught_up(last).await?, guest);
    let mut requests: Vec<Vec<u8>> = ('a'..='o')
        .map(|c| format!("{c}.example").into_bytes())
        .collect();
    requests.extend([
        b"unknown.example".to_vec(),
        b"".to_vec(),
        b"\xffz".to_vec(),
        b"A.EXAMPLE".to_vec(),
    ]);
    let mut answered = 0;
    for request in &requests {
        let want = reference.ask(&reference_guest, request).await?;
        let got = example.ask(guest, request).await?;
        assert_eq!(
            (got.0, String::from_utf8_lossy(&got.1)),
            (want.0, String::from_utf8_lossy(&want.1)),
            "{dir} asked {:?}",
            String::from_utf8_lossy(request)
        );
        answered += usize::from(want.0 == 200);
    }
    // a, b, g, i, n: the values serde_json reads as routes.
    assert_eq!(answered, 5, "the bucket holds five routes");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_router_example_built_outside_the_checkout_answers_as_guests_router()
-> anyhow::Result<()> {
    example_router_answers_as_the_rust_router("router-rust", "router_rust.wasm", "router@0.1.0")
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_c_router_example_built_outside_the_checkout_answers_as_guests_router()
-> anyhow::Result<()> {
    example_router_answers_as_the_rust_router("router-c", "router_c.wasm", "router-c@0.1.0").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_javascript_router_example_built_outside_the_checkout_answers_as_guests_router()
-> anyhow::Result<()> {
    example_router_answers_as_the_rust_router("router-js", "router_js.wasm", "router-js@0.1.0")
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_router_example_built_outside_the_checkout_answers_as_guests_router()
-> anyhow::Result<()> {
    example_router_answers_as_the_rust_router("router-python", "router_py.wasm", "router-py@0.1.0")
        .await
}

#[test]
fn the_router_examples_hold_the_guests_router_sources_byte_for_byte() -> anyhow::Result<()> {
    for (example_file, guest_file) in [
        ("router-rust/src/lib.rs", "router/src/lib.rs"),
        ("router-c/router.c", "router-c/router.c"),
        ("router-c/router.h", "router-c/router.h"),
        ("router-c/exports.c", "router-c/exports.c"),
        ("router-js/router.js", "router-js/router.js"),
        ("router-python/router.py", "router-py/router.py"),
    ] {
        let ours = std::fs::read(example(example_file))?;
        let theirs = std::fs::read(checkout().join("guests").join(guest_file))?;
        anyhow::ensure!(
            ours == theirs,
            "examples/{example_file} differs from guests/{guest_file}: change both"
        );
    }
    Ok(())
}

#[test]
fn the_examples_pin_the_versions_scripts_setup_pins() -> anyhow::Result<()> {
    let setup = std::fs::read_to_string(checkout().join("scripts/setup.sh"))?;
    let pinned = |var: &str| {
        setup.lines().find_map(|l| {
            l.strip_prefix(&format!("{var}=\"${{{var}:-"))
                .and_then(|rest| rest.strip_suffix("}\""))
                .map(str::to_owned)
        })
    };
    for (file, line) in [
        (
            "router-python/build.sh",
            format!(
                "componentize_py={}",
                pinned("COMPONENTIZE_PY_VERSION").unwrap_or_default()
            ),
        ),
        (
            "quickstart.sh",
            format!(
                "NATS_SERVER_VERSION=\"${{NATS_SERVER_VERSION:-{}}}\"",
                pinned("NATS_SERVER_VERSION").unwrap_or_default()
            ),
        ),
    ] {
        let text = std::fs::read_to_string(example(file))?;
        anyhow::ensure!(
            text.lines().any(|l| l == line),
            "examples/{file} lacks the line {line:?} (scripts/setup.sh's pin)"
        );
    }
    Ok(())
}

#[test]
fn the_quickstart_answers_its_query_and_leaves_no_process_behind() -> anyhow::Result<()> {
    let out = Command::new(example("quickstart.sh"))
        .env("FOLDHOST", foldhost_bin())
        .env("ROUTER_WASM", guest_wasm("router"))
        .env("FOLDHOST_GUEST_CACHE", test_guest_cache())
        .stdin(Stdio::null())
        .output()?;
    let said = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(out.status.success(), "quickstart.sh: {said}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "{\"upstream\":\"10.0.0.1:8080\"}\n",
        "the answer, on stdout; stderr:\n{said}"
    );
    // Every process it started, by the pid it printed, is gone — or, should the pid be reused
    // already, is not one of its (none other names its temporary directory).
    let tmp = said
        .lines()
        .find_map(|l| {
            l.split_once("storing under ")
                .map(|(_, p)| p.trim_end_matches("/nats"))
        })
        .ok_or_else(|| anyhow::anyhow!("no temporary directory named in:\n{said}"))?;
    anyhow::ensure!(!Path::new(tmp).exists(), "{tmp} is left behind");
    let mut started = 0;
    for line in said.lines().filter(|l| l.contains("started ")) {
        let pid = line
            .split_once("(pid ")
            .and_then(|(_, rest)| rest.split_once(')'))
            .map(|(pid, _)| pid)
            .ok_or_else(|| anyhow::anyhow!("no pid in {line:?}"))?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        anyhow::ensure!(
            !String::from_utf8_lossy(&cmdline).contains(tmp),
            "pid {pid} is still running: {line}"
        );
        started += 1;
    }
    assert_eq!(started, 2, "a nats-server and a node:\n{said}");
    Ok(())
}

#[test]
fn foldhost_demo_runs_end_to_end_and_resumes_with_a_delta() -> anyhow::Result<()> {
    // `make demo`'s command, on the router guest the suite builds.
    let out = foldhost()
        .args(["demo", "--routes", "500", "--guest"])
        .arg(guest_wasm("router"))
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    anyhow::ensure!(
        text.contains("seeded 500 routes")
            && text.contains("11 updates delivered (a delta, not a replay)")
            && text.trim_end().ends_with("demo ok"),
        "{text}"
    );
    Ok(())
}
