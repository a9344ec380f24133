//! What stops a node for its NATS user's permissions: a violation the server reports for the
//! node's own work (its fold, listings, exports, replies). A write the server refuses is not one
//! of them: its writer is answered `refused: permission` (docs/writes.md).

/// The first permission violation the server reports for the node's own work: anything but a
/// write to one of `buckets` (the main bucket and the guest's state buckets: their writers are
/// answered).
pub(super) async fn fold_denial(
    mut rx: tokio::sync::watch::Receiver<foldhost_nats::Denials>,
    buckets: &[String],
) -> (foldhost_core::protocol::Denied, String) {
    let writes: Vec<String> = buckets.iter().map(|b| format!("$KV.{b}.")).collect();
    loop {
        // From the connection's first report on: one during the start-up counts too.
        let found = rx.borrow_and_update().after(0, |d, s| {
            !(d == foldhost_core::protocol::Denied::Publish
                && writes.iter().any(|w| s.starts_with(w)))
        });
        if let Some(d) = found {
            return d;
        }
        if rx.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}
