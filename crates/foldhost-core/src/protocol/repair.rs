//! Cursor expiry and its repairs: retention, the listing's truth, the repair plan, restores, the floor guard, stream identity, the watch's resume backoff.

use super::*;

/// How an expired cursor may be repaired (`--repair`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RepairMode {
    /// Re-list where the listing is the truth, restore from an artifact otherwise.
    Auto,
    /// Only the key-listing diff (refused where the listing is not the truth).
    Relist,
    /// Only an artifact restore.
    Restore,
    /// No repair: an expired cursor stops the fold.
    None,
}

/// What to do about an expired cursor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RepairPlan {
    /// Nothing: the fold stops with `CursorExpired`.
    None,
    /// Diff the fold against the bucket's live key listing.
    Relist,
    /// Restore from a newer artifact.
    Restore,
    /// A re-list was asked for where a listing cannot tell a deleted key from an evicted one.
    RefuseRelist,
}

/// A bucket's retention as read live from its stream: whether it can evict a current value (an
/// age limit, or a size/count limit with `discard: old`; per-message TTLs are their writer's own
/// deletes and do not count — `StreamLimits::evicts_current_values`), and its first retained
/// revision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// Retention can remove a key's *current* value (not only superseded ones).
    pub evicts_current_values: bool,
    /// The stream's first retained sequence.
    pub first_revision: u64,
}

/// Whether "not listed" means "deleted": yes when retention never evicts current values, or when
/// it can but has evicted nothing yet (first retained revision ≤ 1) — and never once this fold has
/// seen it evict (`seen_evicting`, the cursor's memo).
pub fn listing_is_truth(
    evicts_current_values: bool,
    first_revision: u64,
    seen_evicting: bool,
) -> bool {
    !seen_evicting && (!evicts_current_values || first_revision <= 1)
}

/// Whether a read of retention shows it has evicted a current value (eviction is on and the log
/// is past its first revision): the moment a fold commits its eviction memo.
pub fn retention_has_evicted(r: Retention) -> bool {
    r.evicts_current_values && r.first_revision > 1
}

/// [`listing_is_truth`] for a retention that may be unknown (`None`: the backend cannot say),
/// which answers `None` unless the memo already settles it.
pub fn listing_truth(retention: Option<Retention>, seen_evicting: bool) -> Option<bool> {
    if seen_evicting {
        return Some(false);
    }
    retention.map(|r| listing_is_truth(r.evicts_current_values, r.first_revision, false))
}

/// The repair for an expired cursor under `mode`, given whether the listing is the truth.
pub fn plan_repair(mode: RepairMode, listing_truth: Option<bool>) -> RepairPlan {
    match (mode, listing_truth) {
        (RepairMode::None, _) => RepairPlan::None,
        (RepairMode::Relist, Some(true)) => RepairPlan::Relist,
        (RepairMode::Relist, _) => RepairPlan::RefuseRelist,
        (RepairMode::Restore, _) => RepairPlan::Restore,
        (RepairMode::Auto, Some(true)) => RepairPlan::Relist,
        (RepairMode::Auto, _) => RepairPlan::Restore,
    }
}

/// Whether a start without a cursor must repair first: when the fold holds data anyway (a re-list
/// never removes what it does not deliver), or, with a restore armed, when the listing is not the
/// truth (a re-list would miss evicted keys).
pub fn cursorless_start_needs_repair(
    mode: RepairMode,
    fold_has_data: bool,
    listing_truth: Option<bool>,
) -> bool {
    let restore_armed = matches!(mode, RepairMode::Restore | RepairMode::Auto);
    fold_has_data || (restore_armed && listing_truth != Some(true))
}

/// Whether an artifact at `artifact_revision` is strictly ahead of the local fold (a restore never
/// moves the fold, or a guest's structure, backward).
pub(crate) fn restore_ahead(artifact_revision: u64, local_revision: Option<u64>) -> bool {
    local_revision.is_none_or(|l| artifact_revision > l)
}

/// Whether an expired fold may be replaced by an artifact: strictly ahead of it, and with its
/// cursor still inside retention so the resume from it is gap-free.
pub fn restore_allowed(
    artifact_revision: u64,
    local_revision: Option<u64>,
    first_sequence: u64,
) -> bool {
    restore_ahead(artifact_revision, local_revision)
        && resume_window_ok(artifact_revision, first_sequence)
}

/// What a restore does to one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyRestore {
    /// Leave the local entry (or absence) as it is.
    Keep,
    /// Take the artifact's entry.
    Take,
    /// Delete the local entry.
    Delete,
}

/// The per-key restore decision. `local` and `artifact` are the entries' revisions (`None`:
/// absent; an unknown local version is passed as 0, older than any artifact entry); `identical`
/// says both entries are byte-equal; `listed_live` says the bucket's live listing has the key;
/// `fold_cursor` is the local fold's cursor. Take the artifact's entry unless the local one is
/// newer (never a move backward) or the fold's cursor already covers it (an entry at or below the
/// cursor is never news: an artifact exported mid catch-up can hold an older value of a key the
/// fold has since deleted, and taking it would bring the key back until the resume delivered its
/// later write — found by the repair model, `crates/foldhost-core/src/models/repair.rs`); delete a key the artifact
/// lacks unless the bucket lists it live (never a phantom delete).
pub fn restore_key(
    local: Option<u64>,
    artifact: Option<u64>,
    identical: bool,
    listed_live: bool,
    fold_cursor: Option<u64>,
) -> KeyRestore {
    match (local, artifact) {
        (_, Some(_)) if identical => KeyRestore::Keep,
        (_, Some(a)) if fold_cursor.is_some_and(|c| a <= c) => KeyRestore::Keep,
        (Some(l), Some(a)) if l > a => KeyRestore::Keep,
        (_, Some(_)) => KeyRestore::Take,
        (Some(_), None) if listed_live => KeyRestore::Keep,
        (Some(_), None) => KeyRestore::Delete,
        (None, None) => KeyRestore::Keep,
    }
}

/// Whether a cursor that looks expired on an age-only bucket hides no eviction: when age is the
/// bucket's only way to evict a current value and the cursor's message is at most half of
/// `max_age` old, every later message is younger still, so none aged out and each missing one was
/// superseded by a later write the resume delivers (half is headroom for clock steps and leader
/// changes).
pub fn gap_holds_no_eviction(
    age_only: bool,
    max_age: std::time::Duration,
    cursor_message_age: std::time::Duration,
) -> bool {
    age_only && !max_age.is_zero() && cursor_message_age.saturating_mul(2) <= max_age
}

/// Whether a state-sync re-list that was started trusting the key listing (the fold had no
/// eviction memo) may still be trusted when its first event arrives: retention read *now*, after
/// the watch's snapshot exists, must still make the listing the truth. A bucket that began evicting
/// between the decision and the snapshot may have removed current values the snapshot silently
/// lacks, and a state-sync watch has no frontier for the floor guard to check until it is level
/// (found by the seeded simulation, `tests/tests/sim/`). An unknown retention (`None`) changes
/// nothing: the decision was made without it too.
pub fn relist_still_vouched(retention_now: Option<Retention>) -> bool {
    retention_now.is_none_or(|r| listing_is_truth(r.evicts_current_values, r.first_revision, false))
}

/// Whether the live floor guard ends a watch: after a delivery gap (or a quiet period) following
/// `frontier`, the last sequence delivered, the stream's first retained sequence has passed
/// `frontier + 1` on a stream whose retention evicts current values — messages after the frontier
/// were evicted unseen (NATS skips them silently). Where retention never evicts a current value a
/// skipped message was superseded and its successor is delivered, so the guard stays quiet.
pub fn floor_guard_trips(evicts_current_values: bool, frontier: u64, first_sequence: u64) -> bool {
    evicts_current_values && !resume_window_ok(frontier, first_sequence)
}

/// Whether every watch prefix lies inside some prefix an artifact covers (`""` covers every key),
/// so a restore from it can speak for every key the watch folds.
pub fn scope_covers(artifact_prefixes: &[&str], watch_prefixes: &[&str]) -> bool {
    watch_prefixes
        .iter()
        .all(|w| artifact_prefixes.iter().any(|a| w.starts_with(a)))
}

/// What the identity check at a watch start found (see [`stream_identity_check`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdentityVerdict {
    /// The fold folds this stream: go on.
    Same,
    /// The fold records no identity yet (a first start, or a store written before identities
    /// were recorded, whose cursor the stream still covers): record the found one, then go on.
    Record,
    /// The stream is not the one the fold recorded (deleted and created again, or another
    /// bucket's): resuming would mix two streams' keys.
    Recreated,
    /// The fold's cursor is above the stream's last sequence: whatever the identity says, the fold
    /// has seen revisions this stream never wrote (a recreated stream before identities were
    /// recorded, or a server that lost its tail), and a resume would wait for — then fold — the
    /// new stream's writes on top of the old keys.
    CursorAhead,
}

/// The bucket identity check, made at every start and every watch (re)start, before a revision is
/// trusted (docs/design.md, "Bucket identity"). `recorded_is_found` says whether the identity
/// committed with the fold is the stream's now (`None`: the fold records none yet), `cursor` is the
/// fold's cursor and `last_sequence` the stream's last sequence. Another stream (a change of name
/// or creation time) is [`IdentityVerdict::Recreated`]; a cursor past the stream's end is
/// [`IdentityVerdict::CursorAhead`]; a fold with no identity adopts the found one only when the
/// cursor passes that test. Never silently mixes two streams: every other answer ends the run or
/// repairs as a cursor-less start (`--on-recreated`).
pub fn stream_identity_check(
    recorded_is_found: Option<bool>,
    cursor: Option<u64>,
    last_sequence: u64,
) -> IdentityVerdict {
    match recorded_is_found {
        Some(false) => IdentityVerdict::Recreated,
        _ if cursor.is_some_and(|c| c > last_sequence) => IdentityVerdict::CursorAhead,
        Some(true) => IdentityVerdict::Same,
        None => IdentityVerdict::Record,
    }
}

impl std::str::FromStr for RepairMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(RepairMode::Auto),
            "relist" => Ok(RepairMode::Relist),
            "restore" => Ok(RepairMode::Restore),
            "none" => Ok(RepairMode::None),
            other => Err(format!(
                "{other:?} is not a repair mode (auto, relist, restore, none)"
            )),
        }
    }
}

impl std::fmt::Display for RepairMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RepairMode::Auto => "auto",
            RepairMode::Relist => "relist",
            RepairMode::Restore => "restore",
            RepairMode::None => "none",
        })
    }
}
