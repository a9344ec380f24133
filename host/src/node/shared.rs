//! One listener for every fold of the process (`run --config` with a top-level `listen`: docs/operations.md,
//! "Several folds from one file"): bound once, before any fold starts, with the tokens settled
//! as a fold's own listener settles them — given, or generated beside the first fold's store —
//! and each fold then registered under its name ([`crate::serve::FoldRegistry`]). A fold that
//! fails keeps its entry (its `/folds/NAME/status` says why); the listener outlives every fold
//! until the process stops.

use std::sync::Arc;

use tokio::task::JoinHandle;

use super::{ListenConfig, NodeConfig, NodeError};
use crate::serve::FoldRegistry;

/// Where a fold of a shared listener registers.
#[derive(Clone, Debug)]
pub(crate) struct SharedListen {
    /// The folds the listener serves.
    pub(crate) registry: Arc<FoldRegistry>,
    /// The address it is bound to.
    pub(crate) addr: std::net::SocketAddr,
}

/// Binds `l.addr` for every fold of the process and serves it; returns the listen settings each
/// fold takes (the same token files, `shared` set, its own `query_max_bytes` and `ready_max_lag`
/// kept by the caller) and the serving task.
pub(crate) async fn bind_shared(
    first: &NodeConfig,
    l: &ListenConfig,
) -> Result<(ListenConfig, JoinHandle<()>), NodeError> {
    let io = |source| NodeError::Listen {
        addr: l.addr.clone(),
        source,
    };
    let listener = tokio::net::TcpListener::bind(&l.addr).await.map_err(io)?;
    let local = listener.local_addr().map_err(io)?;
    // Tokens not given by file are generated into the first fold's store, made here.
    std::fs::create_dir_all(&first.store).map_err(|source| NodeError::Listen {
        addr: format!(
            "{} (its tokens' directory {})",
            l.addr,
            first.store.display()
        ),
        source,
    })?;
    let settled = super::tokens::settle(first, l, local).map_err(io)?;
    let registry = Arc::new(FoldRegistry::default());
    let state = Arc::new(crate::serve::ServeState::process(
        settled.policy,
        registry.clone(),
        l.ready_max_lag,
    ));
    let serving = tokio::spawn(crate::serve::serve(listener, state));
    // Every fold reads the tokens the listener admits with: those given (inline or by file), or
    // the files just generated.
    let each = ListenConfig {
        addr: local.to_string(),
        admin_token_file: settled.admin_file.or_else(|| l.admin_token_file.clone()),
        write_token_file: settled.write_file.or_else(|| l.write_token_file.clone()),
        query_token_file: settled.query_file.or_else(|| l.query_token_file.clone()),
        shared: Some(SharedListen {
            registry,
            addr: local,
        }),
        ..l.clone()
    };
    Ok((each, serving))
}
