//! The NATS connection flags (`host/src/cli/nats.rs`) against real servers: a server that requires
//! TLS from a private CA and verifies client certificates (`--tls-ca --tls-cert --tls-key`), a
//! server that wants the handshake before its `INFO` (`--tls-first`), a server whose only user is
//! an nkey (`--nkey SEEDFILE`), a user and password (`--password-file`, `NATS_PASSWORD`), and
//! `NATS_URL` in place of `--nats`. Each node folds the bucket to its last
//! sequence and its fold equals the bucket; its watches are delivered over the lean connection
//! (the server lists a `foldhost-delivery` connection, over TLS where TLS is asked, and no
//! `foldhost-ordered` one), so both paths authenticate as the flags say.

use std::path::{Path, PathBuf};
use std::process::Command;

use foldhost_core::bucket::{BucketConfig, ClientCertificate, ConnectOptions, Secret, TlsOptions};
use foldhost_core::kv::KvWriter as _;
use foldhost_localnats::{LocalNats, reserved_port};
use foldhost_nats::{NatsConnection, NatsKv};
use foldhost_tests::{
    bucket_contents, dump_store, first_difference, foldhost, terminate, wait_status,
};

/// A CA, a server certificate it signed for 127.0.0.1 and a client certificate it signed, as
/// PEM files in `dir`.
struct Pki {
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

impl Pki {
    fn new(dir: &Path) -> anyhow::Result<Pki> {
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "foldhost test private CA");
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate()?)?;
        let server_key = rcgen::KeyPair::generate()?;
        let server = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])?
            .signed_by(&server_key, &ca)?;
        let client_key = rcgen::KeyPair::generate()?;
        let mut client_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        client_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "foldhost node");
        let client = client_params.signed_by(&client_key, &ca)?;
        let pki = Pki {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server-key.pem"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client-key.pem"),
        };
        std::fs::write(&pki.ca, ca.pem())?;
        std::fs::write(&pki.server_cert, server.pem())?;
        std::fs::write(&pki.server_key, server_key.serialize_pem())?;
        std::fs::write(&pki.client_cert, client.pem())?;
        std::fs::write(&pki.client_key, client_key.serialize_pem())?;
        Ok(pki)
    }

    /// The test's own connection options: trusting the CA, presenting the client certificate.
    fn tls(&self) -> anyhow::Result<TlsOptions> {
        Ok(TlsOptions {
            ca_pem: Some(std::fs::read(&self.ca)?),
            client: Some(ClientCertificate {
                cert_pem: std::fs::read(&self.client_cert)?,
                key_pem: Secret::new(std::fs::read_to_string(&self.client_key)?),
            }),
            first: false,
        })
    }
}

/// The server's connections as its monitoring endpoint lists them: (name, TLS version).
async fn connections(monitor: &str) -> anyhow::Result<Vec<(String, String)>> {
    let (code, body) = foldhost::serve::call(monitor, "GET", "/connz", b"").await?;
    anyhow::ensure!(code == 200, "connz answered {code}");
    let v: serde_json::Value = serde_json::from_slice(&body)?;
    Ok(v["connections"]
        .as_array()
        .map(|cs| {
            cs.iter()
                .map(|c| {
                    (
                        c["name"].as_str().unwrap_or_default().to_string(),
                        c["tls_version"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default())
}

/// Waits until the server lists the node's lean delivery connection (`foldhost-delivery`) and
/// checks no watch took the client's ordered consumer (`foldhost-ordered`); returns the delivery
/// connection's TLS version (empty when plain).
async fn delivered_lean(monitor: &str) -> anyhow::Result<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let all = connections(monitor).await?;
        anyhow::ensure!(
            !all.iter().any(|(n, _)| n == "foldhost-ordered"),
            "a watch took the client's ordered consumer: {all:?}"
        );
        if let Some((_, tls)) = all.iter().find(|(n, _)| n == "foldhost-delivery") {
            return Ok(tls.clone());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "no lean delivery connection in 120 s; the server lists {all:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Opens (creating) `name` through `opts` and writes puts and deletes into it. JetStream may
/// answer a moment after the server is up: the first bucket call retries until it does.
async fn filled_bucket(
    opts: ConnectOptions,
    name: &str,
) -> anyhow::Result<(NatsConnection, std::sync::Arc<NatsKv>)> {
    let conn = NatsConnection::open(opts).await?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let kv = loop {
        match conn.bucket(name, &BucketConfig::default()).await {
            Ok(kv) => break kv,
            Err(_) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    for i in 0..60 {
        kv.put(&format!("k.{i}"), format!("v{i}").into()).await?;
    }
    for i in (0..60).step_by(7) {
        kv.delete(&format!("k.{i}")).await?;
    }
    Ok((conn, kv))
}

/// Runs `node` (a `foldhost run` of `kv`'s bucket into `store`, serving status on `listen`),
/// waits until it has folded the bucket's last sequence over a lean connection, stops it, and
/// checks its fold equals the bucket. Returns the delivery connection's TLS version.
async fn folds_the_bucket(
    mut node: Command,
    kv: &NatsKv,
    store: &Path,
    listen: &str,
    monitor: &str,
) -> anyhow::Result<String> {
    let log = store.with_extension("log");
    let mut child = node.stderr(std::fs::File::create(&log)?).spawn()?;
    let result = async {
        let last = kv.positions().await?.last_sequence;
        wait_status(listen, |s| s.cursor == Some(last)).await?;
        let tls = delivered_lean(monitor).await?;
        kv.put("after", "ok".into()).await?;
        let last = kv.positions().await?.last_sequence;
        let s = wait_status(listen, |s| s.cursor == Some(last)).await?;
        anyhow::ensure!(s.state == "running", "{s:?}");
        Ok(tls)
    }
    .await;
    let stopped = terminate(&mut child);
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    let tls = result.map_err(|e| e.context(log_text.clone()))?;
    anyhow::ensure!(
        stopped?.success(),
        "the node did not stop cleanly:\n{log_text}"
    );
    let want = bucket_contents(kv).await?;
    let got = dump_store(store)?;
    if let Some(d) = first_difference(&want, &got) {
        anyhow::bail!("the fold differs from the bucket: {d}");
    }
    anyhow::ensure!(!want.is_empty(), "an empty bucket proves nothing");
    Ok(tls)
}

/// `foldhost run` of `bucket` into `store`, serving status on `listen`, with no NATS flag yet.
fn run(bucket: &str, store: &Path, listen: &str) -> Command {
    let mut c = foldhost();
    c.args(["run", "--bucket", bucket, "--listen", listen, "--store"])
        .arg(store)
        .env("FOLDHOST_LOG", "info")
        // The test's environment names no server or user for the node but the test's own.
        .env_remove("NATS_URL")
        .env_remove("NATS_USER")
        .env_remove("NATS_PASSWORD");
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_folds_through_a_private_ca_and_a_client_certificate_and_is_refused_without_one()
-> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let pki = Pki::new(tmp.path())?;
    let monitor = format!("127.0.0.1:{}", reserved_port()?);
    let server = LocalNats::start_with_config(&format!(
        "tls {{ cert_file: {:?}, key_file: {:?}, ca_file: {:?}, verify: true }}\nhttp: {monitor:?}\n",
        pki.server_cert, pki.server_key, pki.ca
    ))?;
    let mut opts = ConnectOptions::new(server.url());
    opts.tls = pki.tls()?;
    let (_conn, kv) = filled_bucket(opts, "tlsb").await?;
    let store = tmp.path().join("store");
    let listen = format!("127.0.0.1:{}", reserved_port()?);
    let mut node = run("tlsb", &store, &listen);
    node.args(["--nats", &server.url(), "--tls-ca"])
        .arg(&pki.ca)
        .arg("--tls-cert")
        .arg(&pki.client_cert)
        .arg("--tls-key")
        .arg(&pki.client_key);
    let tls = folds_the_bucket(node, &kv, &store, &listen, &monitor).await?;
    anyhow::ensure!(!tls.is_empty(), "the lean delivery connection is not TLS");

    // The same run without the client certificate: refused by the server, one line, exit 1,
    // no store made.
    let refused_store = tmp.path().join("refused");
    let out = run("tlsb", &refused_store, &listen)
        .args(["--nats", &server.url(), "--tls-ca"])
        .arg(&pki.ca)
        .env("FOLDHOST_LOG", "off")
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(
        out.status.code() == Some(1)
            && stderr.trim().lines().count() == 1
            && stderr.contains("connect"),
        "without a client certificate: {} {stderr}",
        out.status
    );
    anyhow::ensure!(
        !refused_store.exists(),
        "a refused connection made the store"
    );
    // A key without its certificate is refused before anything starts, naming the flag.
    let out = run("tlsb", &refused_store, &listen)
        .args(["--nats", &server.url(), "--tls-key"])
        .arg(&pki.client_key)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(
        out.status.code() == Some(1)
            && stderr.contains("--tls-key")
            && stderr.contains("--tls-cert")
            && !refused_store.exists(),
        "a key alone: {} {stderr}",
        out.status
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_folds_from_a_server_that_wants_the_tls_handshake_before_its_info()
-> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let pki = Pki::new(tmp.path())?;
    let monitor = format!("127.0.0.1:{}", reserved_port()?);
    let server = LocalNats::start_with_config(&format!(
        "tls {{ cert_file: {:?}, key_file: {:?}, handshake_first: true }}\nhttp: {monitor:?}\n",
        pki.server_cert, pki.server_key
    ))?;
    let mut opts = ConnectOptions::new(server.url());
    opts.tls = TlsOptions {
        client: None,
        first: true,
        ..pki.tls()?
    };
    let (_conn, kv) = filled_bucket(opts, "firstb").await?;
    let store = tmp.path().join("store");
    let listen = format!("127.0.0.1:{}", reserved_port()?);
    let mut node = run("firstb", &store, &listen);
    node.args(["--nats", &server.url(), "--tls-first", "--tls-ca"])
        .arg(&pki.ca);
    let tls = folds_the_bucket(node, &kv, &store, &listen, &monitor).await?;
    anyhow::ensure!(!tls.is_empty(), "the lean delivery connection is not TLS");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_folds_as_an_nkey_user_whose_seed_is_in_a_file() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let user = nkeys::KeyPair::new_user();
    let seed = user.seed().map_err(|e| anyhow::anyhow!("seed: {e}"))?;
    let seed_file = tmp.path().join("user.nk");
    std::fs::write(&seed_file, format!("{seed}\n"))?;
    let monitor = format!("127.0.0.1:{}", reserved_port()?);
    let server = LocalNats::start_with_config(&format!(
        "authorization {{ users = [ {{ nkey: {} }} ] }}\nhttp: {monitor:?}\n",
        user.public_key()
    ))?;
    let mut opts = ConnectOptions::new(server.url());
    opts.nkey_seed = Some(Secret::new(seed.clone()));
    let (_conn, kv) = filled_bucket(opts, "nkeyb").await?;
    let store = tmp.path().join("store");
    let listen = format!("127.0.0.1:{}", reserved_port()?);
    let mut node = run("nkeyb", &store, &listen);
    node.args(["--nats", &server.url(), "--nkey"])
        .arg(&seed_file);
    folds_the_bucket(node, &kv, &store, &listen, &monitor).await?;
    // Without the seed the server refuses the node.
    let out = run("nkeyb", &tmp.path().join("refused"), &listen)
        .args(["--nats", &server.url()])
        .env("FOLDHOST_LOG", "off")
        .output()?;
    anyhow::ensure!(
        out.status.code() == Some(1) && !tmp.path().join("refused").exists(),
        "without the seed: {} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_password_comes_from_a_file_or_nats_password_and_never_from_the_command_line()
-> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let monitor = format!("127.0.0.1:{}", reserved_port()?);
    let server = LocalNats::start_with_config(&format!(
        "authorization {{ users = [ {{ user: alice, password: \"pw-of-alice\" }} ] }}\nhttp: {monitor:?}\n"
    ))?;
    let mut opts = ConnectOptions::new(server.url());
    opts.user_password = Some(("alice".into(), Secret::new("pw-of-alice")));
    let (_conn, kv) = filled_bucket(opts, "userb").await?;
    let pw = tmp.path().join("password");
    std::fs::write(&pw, "pw-of-alice\n")?;

    let store = tmp.path().join("from-file");
    let listen = format!("127.0.0.1:{}", reserved_port()?);
    let mut node = run("userb", &store, &listen);
    node.args([
        "--nats",
        &server.url(),
        "--user",
        "alice",
        "--password-file",
    ])
    .arg(&pw);
    folds_the_bucket(node, &kv, &store, &listen, &monitor).await?;
    let log = std::fs::read_to_string(store.with_extension("log"))?;
    anyhow::ensure!(
        !log.contains("pw-of-alice"),
        "the password is in the log:\n{log}"
    );

    let store = tmp.path().join("from-env");
    let mut node = run("userb", &store, &listen);
    node.args(["--nats", &server.url()])
        .env("NATS_USER", "alice")
        .env("NATS_PASSWORD", "pw-of-alice");
    folds_the_bucket(node, &kv, &store, &listen, &monitor).await?;

    // A password flag does not exist: the command line is refused as usage.
    let out = run("userb", &tmp.path().join("refused"), &listen)
        .args([
            "--nats",
            &server.url(),
            "--user",
            "alice",
            "--password",
            "pw-of-alice",
        ])
        .output()?;
    anyhow::ensure!(
        out.status.code() == Some(2),
        "a password on the command line: {} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_url_names_the_server_when_no_nats_flag_is_given() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let monitor = format!("127.0.0.1:{}", reserved_port()?);
    let server = LocalNats::start_with_config(&format!("http: {monitor:?}\n"))?;
    let (_conn, kv) = filled_bucket(ConnectOptions::new(server.url()), "envb").await?;
    let store = tmp.path().join("store");
    let listen = format!("127.0.0.1:{}", reserved_port()?);
    let mut node = run("envb", &store, &listen);
    node.env("NATS_URL", server.url());
    folds_the_bucket(node, &kv, &store, &listen, &monitor).await?;
    // Neither the flag nor the variable: one line saying how to name the server.
    let out = run("envb", &tmp.path().join("none"), &listen).output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(
        out.status.code() == Some(1) && stderr.contains("NATS_URL"),
        "no URL: {} {stderr}",
        out.status
    );
    Ok(())
}
