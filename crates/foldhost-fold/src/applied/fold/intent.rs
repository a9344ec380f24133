//! The `on-applied` intent a commit records for an applier whose `on-applied` writes outside the
//! fold (docs/state.md, "Writes from `on-applied`, at least once").
//!
//! Invariants:
//! - Every commit that ends in `on-applied` of such an applier records its intent in the same
//!   commit, so the store never holds a cursor without the intent of its `on-applied`.
//! - The intent is handed over just before that `on-applied`, never after it.

use foldhost_core::kv::{KvUpdate, WatchCursor};
use foldhost_core::retained::AppliedIntent;

use super::super::Apply;
use super::now_unix_ms;

/// The intent a commit that ends in `on-applied` at `cursor` records, added to `records`, for an
/// applier that records them ([`Apply::records_intents`]): the cursor's revision, now, and a
/// random nonce.
pub(super) fn with_intent<A: Apply + ?Sized>(
    apply: &A,
    cursor: WatchCursor,
    records: &mut Vec<KvUpdate>,
) -> Option<AppliedIntent> {
    let intent = apply.records_intents().then(|| AppliedIntent {
        revision: cursor.revision_or_zero(),
        minted_unix_ms: now_unix_ms(),
        nonce: rand::random(),
    });
    records.extend(intent.map(AppliedIntent::to_put));
    intent
}

/// Hands `intent` over (when there is one), then `on-applied`.
pub(super) async fn on_applied_with<A: Apply + ?Sized>(
    apply: &mut A,
    cursor: WatchCursor,
    intent: Option<AppliedIntent>,
) {
    if let Some(i) = intent {
        apply.intend("", i);
    }
    apply.on_applied(cursor).await;
}
