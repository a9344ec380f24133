//! The bucket identity check a run makes before it opens its store for writing.

use std::path::Path;

use foldhost_core::storedir::{self, AnyStore};
use foldhost_nats::NatsKv;

use super::NodeError;

/// Refuses, before the store is opened for writing, a fold of another stream than the bucket's
/// (recreated, or another bucket's store): the fold's recorded identity and cursor are read from
/// the clean-stop record when the store is exactly as its last run left it, else through a
/// read-only open; either way a refused run leaves every file of the store as it was. Returns
/// the fold's cursor as read (none without a fold).
pub(super) async fn refuse_another_stream(
    store: &Path,
    bucket: &str,
    kv: &NatsKv,
) -> Result<foldhost_core::kv::WatchCursor, NodeError> {
    if storedir::backend_of(store).is_err() {
        // No fold yet (or not one: the writable open reports that).
        return Ok(foldhost_core::kv::WatchCursor::NONE);
    }
    let dir = store.to_path_buf();
    let (recorded, cursor) = tokio::task::spawn_blocking(move || -> Result<_, NodeError> {
        // A clean stop left the identity and cursor beside the store: nothing to open.
        if let Some(closed) = storedir::closed::read(&dir) {
            tracing::debug!(cursor = %closed.cursor, "identity check from the clean-stop record");
            let recorded = match closed.identity {
                Some(bytes) => Some(decode_identity(&dir, &bytes)?),
                None => None,
            };
            return Ok((recorded, closed.cursor));
        }
        let (ro, _) = AnyStore::open_read_only(&dir).map_err(|source| NodeError::Store {
            path: dir.clone(),
            source,
        })?;
        let recorded = match foldhost_core::snapshot::SnapshotStore::get(
            &ro,
            foldhost_core::retained::IDENTITY_KEY,
        )? {
            Some(e) => Some(decode_identity(&dir, &e.value)?),
            None => None,
        };
        Ok((
            recorded,
            foldhost_core::snapshot::SnapshotStore::cursor(&ro),
        ))
    })
    .await
    .map_err(|e| NodeError::Task("store identity read", e.to_string()))??;
    // The bucket's opening answer, when young (`NatsKv::start_state`): a refusal needs no request
    // of its own, and the fold checks again, afresh, once its store is open.
    let found = kv.start_state().await?;
    if let Some(line) =
        foldhost_fold::applied::identity_refusal(bucket, recorded.as_ref(), cursor, &found)
    {
        return Err(NodeError::Refused(line));
    }
    Ok(cursor)
}

fn decode_identity(
    dir: &Path,
    bytes: &[u8],
) -> Result<foldhost_core::kv::StreamIdentity, NodeError> {
    foldhost_core::kv::StreamIdentity::from_bytes(bytes).ok_or_else(|| {
        NodeError::Refused(format!(
            "{}: the fold's stream identity record does not decode",
            dir.display()
        ))
    })
}
