//! A listener's tokens, settled once before it serves: each given inline, read from its file, or
//! generated beside the fold's store (mode 0600, the file named in `/status` so a local caller
//! with the same rights finds it), and the policy `admit` decides with. Shared by a fold's own
//! listener and the process's ([`super::bind_shared`]).

use super::{ListenConfig, NodeConfig};

/// A listener's tokens and policy, settled: each token given, read from its file, or generated
/// beside `cfg`'s store (and the file named, for `/status`).
pub(super) struct Settled {
    pub(super) policy: crate::serve::AccessPolicy,
    pub(super) admin_file: Option<std::path::PathBuf>,
    pub(super) write_file: Option<std::path::PathBuf>,
    pub(super) query_file: Option<std::path::PathBuf>,
}

/// Settles the tokens of the listener at `local` and its policy (logging what it generated).
pub(super) fn settle(
    cfg: &NodeConfig,
    l: &ListenConfig,
    local: std::net::SocketAddr,
) -> std::io::Result<Settled> {
    let (admin_token, admin_file) = match (&l.admin_token, &l.admin_token_file) {
        (Some(t), _) => (t.clone(), None),
        (None, Some(f)) => (crate::serve::read_token_file(f)?, Some(f.clone())),
        (None, None) => {
            let f = cfg.store.join(crate::serve::ADMIN_TOKEN_FILE);
            let t = crate::serve::generate_token_file(&f)?;
            tracing::info!(event = "admin_token_generated", file = %f.display(), "admin token generated (mode 0600): foldhost swap and export --listen read it from there");
            (t, Some(f))
        }
    };
    let (write_token, write_file) = match (&l.write_token, &l.write_token_file) {
        (Some(t), _) => (t.clone(), None),
        (None, Some(f)) => (crate::serve::read_token_file(f)?, Some(f.clone())),
        (None, None) => {
            let f = cfg.store.join(crate::write::WRITE_TOKEN_FILE);
            let t = crate::serve::query_token_from_store(&f)?;
            tracing::info!(event = "write_token_ready", file = %f.display(), "write token (mode 0600): foldhost put and delete --listen read it from there");
            (t, Some(f))
        }
    };
    let (query_token, query_file) = query_token(cfg, l, local)?;
    if local.ip().is_unspecified() && l.hosts.is_empty() {
        tracing::info!(event = "listen_wildcard", addr = %local, "a wildcard listener with no --listen-host: it admits only a Host that is the IP address a client connected to (give --listen-host NAME for each name clients use)");
    }
    tracing::info!(event = "listen_started", addr = %local, "serving /status, /query, /swap and /export");
    Ok(Settled {
        policy: crate::serve::AccessPolicy {
            admin_token,
            write_token,
            query_token,
            listen: local,
            hosts: l.hosts.clone(),
            query_open: l.query_open,
            limits: crate::serve::Limits {
                query_body: l.query_max_bytes,
                ..Default::default()
            },
        },
        admin_file,
        write_file,
        query_file,
    })
}

/// The token `/status` and `/query` need on the listener bound at `local`
/// ([`foldhost_core::protocol::query_access`]): the one given (literally or in a file), `None` where they
/// are open, or — beyond loopback, given none and not `--query-open` — the one in
/// `STORE/query-token`, generated there (mode 0600) when absent. The token itself is never logged.
fn query_token(
    cfg: &NodeConfig,
    l: &ListenConfig,
    local: std::net::SocketAddr,
) -> std::io::Result<(Option<String>, Option<std::path::PathBuf>)> {
    use foldhost_core::protocol::QueryAccess;
    let loopback = local.ip().to_canonical().is_loopback();
    let token_given = l.query_token.is_some() || l.query_token_file.is_some();
    let access = foldhost_core::protocol::query_access(loopback, token_given, l.query_open)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    Ok(match access {
        QueryAccess::GivenToken => match (&l.query_token, &l.query_token_file) {
            (Some(t), _) => (Some(t.clone()), None),
            (None, Some(f)) => (Some(crate::serve::read_token_file(f)?), Some(f.clone())),
            (None, None) => (None, None),
        },
        QueryAccess::GeneratedToken => {
            let f = cfg.store.join(crate::serve::QUERY_TOKEN_FILE);
            let t = crate::serve::query_token_from_store(&f)?;
            tracing::warn!(event = "listen_query_token_generated", addr = %local, file = %f.display(), "a listener beyond loopback: /status and /query answer only with the query token in this file (mode 0600; clients send it as Authorization: Bearer), or give --query-token-file, or --query-open");
            (Some(t), Some(f))
        }
        QueryAccess::Open => (None, None),
        QueryAccess::OpenByChoice => {
            tracing::warn!(event = "listen_query_open", addr = %local, "--query-open: /status and /query answer without a token anyone who can reach this address; they can read the fold through the guest's query and flood the guest with queries");
            (None, None)
        }
    })
}
