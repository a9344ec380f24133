//! Why a running fold stops besides its own end: a shutdown (after the state buckets stop), a
//! state bucket's failure, or a permission the node's own work needs being refused.
//!
//! Invariants:
//! - **A permission the fold's own work lacks stops the node, naming it once**; a write the
//!   server refuses is answered to its writer instead (`refused: permission`).
//! - **A state bucket's failure or a denial is the run's outcome**, whatever the fold loop
//!   returned; a denial is overridden by a state bucket's failure.

use std::sync::{Mutex, PoisonError};

use foldhost_core::protocol::Denied;
use foldhost_nats::NatsConnection;

use super::{NodeError, denial, lanes, signalled};

/// What stopped the fold, if it was not the fold loop's own end nor a plain shutdown.
#[derive(Default)]
pub(super) struct StopCause {
    denied: Mutex<Option<(Denied, String)>>,
    lane_failure: Mutex<Option<String>>,
}

impl StopCause {
    /// Resolves when the fold must stop, noting why.
    pub(super) async fn wait(
        &self,
        running: &mut lanes::Running,
        shutdown: &tokio::sync::watch::Receiver<bool>,
        conn: &NatsConnection,
        written: &[String],
    ) {
        // On a shutdown the state buckets stop first (the main loop serves their last
        // batches), then the main fold; a state bucket's failure stops the node.
        let lanes_then_shutdown = async {
            let failed = running.failed().await;
            if failed.is_none() {
                signalled(shutdown.clone()).await;
            }
            failed
        };
        tokio::select! {
            failed = lanes_then_shutdown => {
                *self.lane_failure.lock().unwrap_or_else(PoisonError::into_inner) = failed;
            }
            d = denial::fold_denial(conn.denials(), written) => {
                // Said once, by the error the run ends with (`NodeError::Denied`).
                tracing::debug!(denied = d.0.as_str(), subject = %d.1, "a permission the node's own work needs was refused: stopping");
                *self.denied.lock().unwrap_or_else(PoisonError::into_inner) = Some(d);
            }
        }
    }

    /// The run's outcome: `outcome`, unless a denial or a state bucket's failure stopped it.
    pub(super) fn apply<T>(&self, mut outcome: Result<T, NodeError>) -> Result<T, NodeError> {
        if let Some((d, subject)) = self
            .denied
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            outcome = Err(NodeError::Denied {
                denied: d.as_str(),
                subject,
            });
        }
        if let Some(why) = self
            .lane_failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            outcome = Err(NodeError::State(why));
        }
        outcome
    }
}
