//! The key-listing diff (for buckets whose listing is the truth): every fold key in scope the
//! bucket no longer lists gets a synthetic delete (unknown version: it never moves the cursor),
//! folded through the applier in batches. The caller then starts a state-sync re-list.

use std::ops::ControlFlow;

use foldhost_core::crashpoint;
use foldhost_core::kv::{KvUpdate, KvWatcher, VersionToken, WatchScope};
use foldhost_core::protocol;
use foldhost_core::retained::is_reserved;
use foldhost_core::snapshot::SnapshotStore;

use super::extsort::{Peekable, SortedKeys, list_sorted};
use super::{
    MAX_HELD_KEYS, RepairConfig, RepairError, RepairReport, RepairTarget, block, clear_dir,
};

/// Fold keys in `scope` the sorted listing does not have (reserved keys excluded): one
/// merge-join of two key-ordered streams. Memory: the result.
fn stale_keys<S: SnapshotStore + ?Sized>(
    store: &S,
    scope: &WatchScope,
    listing: SortedKeys,
) -> Result<Vec<String>, RepairError> {
    let mut listing = Peekable::new(listing)?;
    let mut stale = Vec::new();
    let mut failed: Option<RepairError> = None;
    for prefix in scope.disjoint_prefixes() {
        store.for_each_in_range(&prefix, &mut |e| {
            if is_reserved(&e.key) {
                return ControlFlow::Continue(());
            }
            loop {
                match listing.head.as_deref() {
                    Some(l) if l < e.key.as_str() => {
                        if let Err(err) = listing.advance() {
                            failed = Some(err);
                            return ControlFlow::Break(());
                        }
                    }
                    Some(l) if l == e.key.as_str() => {
                        if let Err(err) = listing.advance() {
                            failed = Some(err);
                            return ControlFlow::Break(());
                        }
                        return ControlFlow::Continue(());
                    }
                    _ => break,
                }
            }
            if stale.len() >= MAX_HELD_KEYS {
                failed = Some(RepairError::Refused(format!(
                    "more than {MAX_HELD_KEYS} stale keys"
                )));
                return ControlFlow::Break(());
            }
            stale.push(e.key.clone());
            ControlFlow::Continue(())
        })?;
        if let Some(e) = failed.take() {
            return Err(e);
        }
    }
    Ok(stale)
}

/// Folds synthetic deletes of `keys` (unknown version: no cursor move) in batches of `max`,
/// passing the crash point `point` after each committed batch.
pub(super) async fn fold_deletes<T: RepairTarget>(
    target: &mut T,
    keys: Vec<String>,
    max: usize,
    point: &'static str,
) -> Result<u64, T::Error> {
    let n = keys.len() as u64;
    let mut batch: Vec<KvUpdate> = Vec::with_capacity(max);
    for key in keys {
        batch.push(KvUpdate::Delete {
            key,
            version: VersionToken::UNKNOWN,
        });
        if batch.len() >= max {
            target.commit_all(&mut batch, max).await?;
            crashpoint::hit(point);
        }
    }
    if !batch.is_empty() {
        target.commit_all(&mut batch, max).await?;
        crashpoint::hit(point);
    }
    Ok(n)
}

/// The key-listing diff: deletes every fold key in `scope` the bucket no longer lists. The fold
/// must be settled. The caller starts a state-sync re-list afterwards (the cursor is unchanged).
pub async fn relist<T: RepairTarget>(
    target: &mut T,
    cfg: &RepairConfig,
    watcher: &dyn KvWatcher,
    scope: &WatchScope,
    max: usize,
) -> Result<RepairReport, T::Error> {
    let lister = cfg
        .lister
        .clone()
        .ok_or_else(|| RepairError::Refused("no key listing available for a re-list".into()))?;
    let scratch = cfg.scratch_dir();
    block(|| clear_dir(&scratch))?;
    let (listing, listed) =
        list_sorted(&*lister, scope, &scratch.join("sort"), cfg.sort_run_bytes).await?;
    // The listing vouches for "not listed means deleted" only if retention still evicts nothing:
    // read it again now that the listing is taken, before anything is deleted (eviction turned on
    // between the plan and the listing would otherwise delete keys that only aged out).
    if !protocol::relist_still_vouched(watcher.retention().await.map_err(RepairError::from)?) {
        let _ = std::fs::remove_dir_all(&scratch);
        return Err(RepairError::Refused(
            "retention began evicting current values during the key-listing repair: the listing cannot tell an aged-out key from a deleted one; nothing was deleted (with --restore-from, the next start repairs by restore)".into(),
        )
        .into());
    }
    let store = target.store();
    let stale = block(|| -> Result<Vec<String>, RepairError> {
        let s = store.read()?;
        stale_keys(&*s, scope, listing)
    })?;
    tracing::info!(
        event = "repair_relist_diff",
        listed,
        stale = stale.len(),
        "repair: re-list diff"
    );
    let deleted = fold_deletes(target, stale, max, crashpoint::RELIST_BATCH).await?;
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(RepairReport {
        kind: "relist",
        listed,
        deleted,
        cursor: target.cursor().revision(),
        ..Default::default()
    })
}
