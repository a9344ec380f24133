//! `foldhost put`, `foldhost delete` and `foldhost get`: writes and reads through a running host
//! (`--listen`), each answer one JSON line, each outcome its own exit code (docs/writes.md):
//! 0 applied (or read), 3 pending (or behind), 4 unknown, 5 refused, 6 not found; 1 when the host
//! could not be asked.

use std::io::Read as _;
use std::path::PathBuf;

use anyhow::Context as _;
use base64::Engine as _;
use clap::Args;

use crate::write::{WriteAnswer, WriteRequest};

/// What a write through a host sends beside its key and value.
#[derive(Args, Debug)]
pub struct WriteTarget {
    /// The host's `--listen` address.
    #[arg(long)]
    pub listen: String,
    /// The write token (default: the file the host names in its `/status`, followed only on
    /// loopback and only to a file the host generated).
    #[arg(long, env = "FOLDHOST_WRITE_TOKEN", hide_env_values = true)]
    pub write_token: Option<String>,
    /// Read the write token from this file.
    #[arg(long, value_name = "FILE", conflicts_with = "write_token")]
    pub write_token_file: Option<PathBuf>,
    /// The operation id (a UUIDv7): send the one an earlier attempt printed to retry it.
    #[arg(long, value_name = "UUIDV7")]
    pub op_id: Option<String>,
    /// Compare-and-set: write only if the key is at this revision (0: the key has no record).
    #[arg(long, value_name = "REVISION")]
    pub if_revision: Option<u64>,
    /// How long the host waits for its fold to apply the write before answering `pending`.
    #[arg(long, value_name = "MS")]
    pub wait_ms: Option<u64>,
}

/// `foldhost put`.
#[derive(Args, Debug)]
pub struct PutArgs {
    /// The key.
    pub key: String,
    /// The value (UTF-8); `-` or absent: read it from standard input (any bytes).
    pub value: Option<String>,
    #[command(flatten)]
    pub target: WriteTarget,
}

/// `foldhost delete`.
#[derive(Args, Debug)]
pub struct DeleteArgs {
    /// The key.
    pub key: String,
    /// Purge: remove the key's history too (a rollup), not only mark it deleted.
    #[arg(long)]
    pub purge: bool,
    #[command(flatten)]
    pub target: WriteTarget,
}

/// `foldhost get`.
#[derive(Args, Debug)]
pub struct GetArgs {
    /// The key.
    pub key: String,
    /// The host's `--listen` address.
    #[arg(long)]
    pub listen: String,
    /// Answer only once the host's fold has applied this revision (a write's, say); past a
    /// bounded wait the answer is `behind`, with `retry_after_seconds`.
    #[arg(long, value_name = "REVISION")]
    pub min_revision: Option<u64>,
    /// How long the host may wait for `--min-revision` (default 5 000, at most 60 000).
    #[arg(long, value_name = "MS", requires = "min_revision")]
    pub wait_ms: Option<u64>,
    /// The query token, from this file (where the host requires one).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
}

/// An outcome's exit code, carried as an error so `main` exits with it and prints nothing more
/// (the answer was printed).
#[derive(Debug, thiserror::Error)]
#[error("exit {0}")]
pub struct OutcomeExit(pub i32);

/// The exit code of an answer's outcome.
pub(crate) fn exit_code(outcome: &str) -> i32 {
    match outcome {
        "applied" => 0,
        "pending" => 3,
        "unknown" => 4,
        _ => 5,
    }
}

pub(super) async fn cmd_put(a: PutArgs) -> anyhow::Result<()> {
    let mut req = WriteRequest {
        key: a.key,
        ..request_of(&a.target)
    };
    match a.value.as_deref() {
        Some(v) if v != "-" => req.value = Some(v.to_string()),
        _ => {
            let mut bytes = Vec::new();
            std::io::stdin()
                .take(crate::write::MAX_WRITE_BODY as u64 + 1)
                .read_to_end(&mut bytes)
                .context("reading the value from standard input")?;
            match String::from_utf8(bytes) {
                Ok(text) => req.value = Some(text),
                Err(e) => {
                    req.value_base64 =
                        Some(base64::engine::general_purpose::STANDARD.encode(e.into_bytes()))
                }
            }
        }
    }
    send(&a.target, &req).await
}

pub(super) async fn cmd_delete(a: DeleteArgs) -> anyhow::Result<()> {
    let req = WriteRequest {
        key: a.key,
        op: Some(if a.purge { "purge" } else { "delete" }.into()),
        ..request_of(&a.target)
    };
    send(&a.target, &req).await
}

pub(super) async fn cmd_get(a: GetArgs) -> anyhow::Result<()> {
    let token = a
        .token_file
        .as_deref()
        .map(crate::serve::read_token_file)
        .transpose()?;
    let headers: Vec<(&str, String)> = [
        a.min_revision
            .map(|r| (foldhost_core::protocol::MIN_REVISION_HEADER, r.to_string())),
        a.wait_ms
            .map(|ms| (foldhost_core::protocol::WAIT_MS_HEADER, ms.to_string())),
    ]
    .into_iter()
    .flatten()
    .collect();
    let (code, answer) = crate::serve::call_with_headers(
        &a.listen,
        "POST",
        "/get",
        a.key.as_bytes(),
        token.as_deref(),
        &headers,
        crate::serve::SWAP_TIMEOUT,
    )
    .await
    .with_context(|| format!("get via {}", a.listen))?;
    let parsed: serde_json::Value = serde_json::from_slice(&answer).with_context(|| {
        format!(
            "get via {}: HTTP {code}: {}",
            a.listen,
            String::from_utf8_lossy(&answer).trim_end()
        )
    })?;
    println!("{parsed}");
    match code {
        200 => Ok(()),
        404 => Err(OutcomeExit(6).into()),
        503 if parsed["behind"] == true => Err(OutcomeExit(3).into()),
        _ => Err(OutcomeExit(5).into()),
    }
}

fn request_of(t: &WriteTarget) -> WriteRequest {
    WriteRequest {
        op_id: t.op_id.clone(),
        if_revision: t.if_revision,
        wait_ms: t.wait_ms,
        ..Default::default()
    }
}

/// Sends `req`, prints the answer as one JSON line, and exits with its outcome's code.
async fn send(t: &WriteTarget, req: &WriteRequest) -> anyhow::Result<()> {
    let token = super::tokens::token_for(
        &t.listen,
        t.write_token.clone(),
        t.write_token_file.as_deref(),
        "write_token_file",
        "--write-token",
    )
    .await?;
    let body = serde_json::to_vec(req)?;
    let (code, answer) =
        crate::serve::call_with_token(&t.listen, "POST", "/write", &body, token.as_deref())
            .await
            .with_context(|| format!("write via {}", t.listen))?;
    let parsed: WriteAnswer = serde_json::from_slice(&answer).with_context(|| {
        format!(
            "write via {}: HTTP {code}: {}",
            t.listen,
            String::from_utf8_lossy(&answer).trim_end()
        )
    })?;
    println!("{}", serde_json::to_string(&parsed)?);
    match exit_code(&parsed.outcome) {
        0 => Ok(()),
        n => Err(OutcomeExit(n).into()),
    }
}
