//! The lean delivery connection (crates/foldhost-nats/src/lean.rs) wherever the client library connects: a
//! `tls://` server (certificates made per test, trusted through `SSL_CERT_FILE` as the system's
//! roots) and an operator-mode server whose user authenticates with a `.creds` file (JWTs made
//! per test). On each the node's watches are delivered lean — seen from the server's side, as a
//! connection named `foldhost-delivery` (TLS on the first) — so no stored header block reaches
//! the client library on the fold's path; the fold reaches the stream's last sequence.

use base64::Engine as _;
use foldhost_core::bucket::{BucketConfig, ConnectOptions};
use foldhost_core::kv::KvWriter as _;
use foldhost_localnats::{LocalNats, reserved_port};
use foldhost_nats::NatsConnection;
use foldhost_tests::{foldhost, terminate, wait_status};

use crate::watch_semantics::raw_publish;

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

/// Waits until the server lists a connection named `name`; returns its TLS version.
async fn connection_named(monitor: &str, name: &str) -> anyhow::Result<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let all = connections(monitor).await?;
        if let Some((_, tls)) = all.iter().find(|(n, _)| n == name) {
            return Ok(tls.clone());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "no connection named {name} in 120 s; the server lists {all:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A CA, and a server certificate it signed for 127.0.0.1, written as PEM files in `dir`:
/// (CA, certificate, key).
fn certificates(dir: &std::path::Path) -> anyhow::Result<[std::path::PathBuf; 3]> {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "foldhost test CA");
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate()?)?;
    let key = rcgen::KeyPair::generate()?;
    let cert =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])?.signed_by(&key, &ca)?;
    let paths = [
        dir.join("ca.pem"),
        dir.join("cert.pem"),
        dir.join("key.pem"),
    ];
    std::fs::write(&paths[0], ca.pem())?;
    std::fs::write(&paths[1], cert.pem())?;
    std::fs::write(&paths[2], key.serialize_pem())?;
    Ok(paths)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_server_delivers_the_nodes_watches_over_a_lean_tls_connection() -> anyhow::Result<()>
{
    let tmp = tempfile::tempdir()?;
    let [ca, cert, key] = certificates(tmp.path())?;
    let monitor = format!("127.0.0.1:{}", reserved_port()?);
    // TLS for every client that asks; the test's own writer (and its raw publishes) stay plain.
    let server = LocalNats::start_with_config(&format!(
        "tls {{ cert_file: {cert:?}, key_file: {key:?} }}\nallow_non_tls: true\nhttp: {monitor:?}\n"
    ))?;
    let conn = NatsConnection::open(ConnectOptions::new(server.url())).await?;
    let kv = conn.bucket("tlsb", &BucketConfig::default()).await?;
    for i in 0..50 {
        kv.put(&format!("k.{i}"), format!("v{i}").into()).await?;
    }
    let listen = format!("127.0.0.1:{}", reserved_port()?);
    let log = tmp.path().join("node.log");
    let mut node = foldhost()
        .args(["run", "--bucket", "tlsb", "--store"])
        .arg(tmp.path().join("store"))
        .args([
            "--nats",
            &format!("tls://127.0.0.1:{}", server.port()),
            "--listen",
            &listen,
        ])
        .env("SSL_CERT_FILE", &ca)
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let result = async {
        let last = kv.positions().await?.last_sequence;
        wait_status(&listen, |s| s.cursor == Some(last)).await?;
        let tls = connection_named(&monitor, "foldhost-delivery").await?;
        anyhow::ensure!(!tls.is_empty(), "the delivery connection is not TLS");
        // A CR inside a value: the lean reader decodes it; the library never sees it.
        raw_publish(
            &server.url(),
            "$KV.tlsb.odd",
            b"NATS/1.0\r\nKV-Operation: DE\rL\r\n\r\n",
            b"x",
        )
        .await?;
        kv.put("after", "ok".into()).await?;
        let last = kv.positions().await?.last_sequence;
        let s = wait_status(&listen, |s| s.cursor == Some(last)).await?;
        anyhow::ensure!(s.state == "running" && s.skipped_messages == 1, "{s:?}");
        let names: Vec<String> = connections(&monitor)
            .await?
            .into_iter()
            .map(|c| c.0)
            .collect();
        anyhow::ensure!(
            !names.iter().any(|n| n == "foldhost-ordered"),
            "no watch took the client's ordered consumer: {names:?}"
        );
        Ok(())
    }
    .await;
    terminate(&mut node)?;
    result.map_err(|e| e.context(std::fs::read_to_string(&log).unwrap_or_default()))
}

/// A JWT signed by `issuer` about `subject`, as nats-server's operator mode reads them.
fn jwt(
    issuer: &nkeys::KeyPair,
    subject: &str,
    name: &str,
    nats: serde_json::Value,
) -> anyhow::Result<String> {
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let header = b64.encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let iat = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let mut claims = serde_json::json!({
        "iat": iat,
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    claims["jti"] = blake3::hash(claims.to_string().as_bytes()).to_hex()[..52]
        .to_ascii_uppercase()
        .into();
    let body = b64.encode(claims.to_string());
    let sig = issuer
        .sign(format!("{header}.{body}").as_bytes())
        .map_err(|e| anyhow::anyhow!("sign: {e}"))?;
    Ok(format!("{header}.{body}.{}", b64.encode(sig)))
}

/// An operator, its system account, an account with JetStream, and a user of it: the server's configuration and the
/// user's `.creds` text.
fn operator_mode(monitor: &str) -> anyhow::Result<(String, String)> {
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let system = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let op_jwt = jwt(
        &operator,
        &operator.public_key(),
        "op",
        serde_json::json!({"type": "operator", "version": 2}),
    )?;
    let acc_jwt = jwt(
        &operator,
        &account.public_key(),
        "acc",
        serde_json::json!({
            "type": "account", "version": 2,
            "limits": {
                "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                "wildcards": true, "conn": -1, "leaf": -1,
                "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1
            }
        }),
    )?;
    // JetStream needs the server's system account.
    let sys_jwt = jwt(
        &operator,
        &system.public_key(),
        "sys",
        serde_json::json!({"type": "account", "version": 2}),
    )?;
    let user_jwt = jwt(
        &account,
        &user.public_key(),
        "user",
        serde_json::json!({
            "type": "user", "version": 2,
            "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1
        }),
    )?;
    let seed = user.seed().map_err(|e| anyhow::anyhow!("seed: {e}"))?;
    let config = format!(
        "operator: {op_jwt:?}\nsystem_account: {}\nresolver: MEMORY\n\
         resolver_preload: {{\n  {}: {acc_jwt:?}\n  {}: {sys_jwt:?}\n}}\nhttp: {monitor:?}\n",
        system.public_key(),
        account.public_key(),
        system.public_key()
    );
    let creds = format!(
        "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    );
    Ok((config, creds))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_creds_file_user_is_delivered_its_watches_over_a_lean_connection_it_authenticates()
-> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let monitor = format!("127.0.0.1:{}", reserved_port()?);
    let (config, creds) = operator_mode(&monitor)?;
    let creds_file = tmp.path().join("user.creds");
    std::fs::write(&creds_file, &creds)?;
    let server = LocalNats::start_with_config(&config)?;
    let mut opts = ConnectOptions::new(server.url());
    opts.creds = Some(creds);
    // JetStream in a new account comes up a moment after the server: the first bucket call
    // retries until it answers.
    let conn = NatsConnection::open(opts).await?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let kv = loop {
        match conn.bucket("credsb", &BucketConfig::default()).await {
            Ok(kv) => break kv,
            Err(_) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    for i in 0..50 {
        kv.put(&format!("k.{i}"), format!("v{i}").into()).await?;
    }
    let listen = format!("127.0.0.1:{}", reserved_port()?);
    let log = tmp.path().join("node.log");
    let mut node = foldhost()
        .args(["run", "--bucket", "credsb", "--store"])
        .arg(tmp.path().join("store"))
        .args(["--nats", &server.url(), "--listen", &listen, "--creds-file"])
        .arg(&creds_file)
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let result = async {
        let last = kv.positions().await?.last_sequence;
        wait_status(&listen, |s| s.cursor == Some(last)).await?;
        connection_named(&monitor, "foldhost-delivery").await?;
        kv.put("after", "ok".into()).await?;
        let last = kv.positions().await?.last_sequence;
        wait_status(&listen, |s| s.cursor == Some(last)).await?;
        let names: Vec<String> = connections(&monitor)
            .await?
            .into_iter()
            .map(|c| c.0)
            .collect();
        anyhow::ensure!(
            !names.iter().any(|n| n == "foldhost-ordered"),
            "no watch took the client's ordered consumer: {names:?}"
        );
        Ok(())
    }
    .await;
    terminate(&mut node)?;
    result.map_err(|e| e.context(std::fs::read_to_string(&log).unwrap_or_default()))
}
