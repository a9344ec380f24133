//! `examples/`: what a user copies works as it says — the config file passes `config check`, the
//! nats-server configuration is one nats-server accepts and grants every subject `foldhost grants`
//! prints for the config's folds, and the service unit runs the command the README documents.

use std::path::{Path, PathBuf};

use foldhost_tests::{foldhost, guest_wasm};

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
