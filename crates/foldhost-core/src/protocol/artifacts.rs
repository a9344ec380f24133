//! Artifacts in object storage: the pointer, stream relations between incarnations, prune, the export lease.

/// What an artifact pointer in the object store holds, as read before a publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PointerState {
    /// No pointer yet.
    Absent,
    /// A pointer that does not parse (a partial write by a store without atomic puts, a foreign
    /// object): replaceable.
    Corrupt,
    /// A pointer to an artifact at this cursor.
    At(u64),
}

/// Whether an exporter may publish a pointer to its artifact at `cursor` over `current`
/// (docs/design.md, "Transport and export rounds", the pointer): never backward, and never sideways
/// to an equal cursor (the pointer's artifact already speaks for it); a corrupt pointer is
/// replaceable. A `false` is `SupersededByNewer` for the exporter, which abandons its round.
pub fn pointer_publish_allowed(current: PointerState, cursor: u64) -> bool {
    match current {
        PointerState::Absent | PointerState::Corrupt => true,
        PointerState::At(c) => cursor > c,
    }
}

/// How this exporter's (or this node's) stream relates to the stream an artifact was exported
/// from, as [`stream_relation`] reads the two identities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamRelation {
    /// The same stream (name and creation time).
    Same,
    /// One side records no stream (an artifact of an earlier version, or one exported without a
    /// running fold): nothing can be told, and the checks of before identities apply.
    Unknown,
    /// A later incarnation of the same stream (same name, created after the artifact's): the
    /// bucket was deleted and created again, and the artifact folds the old one.
    Later,
    /// Another stream: an earlier incarnation, or another name.
    Other,
}

/// Relates `ours` to `theirs`, each a stream's name and creation time (Unix nanoseconds), `None`
/// when it is not recorded.
pub fn stream_relation(ours: Option<(&str, u64)>, theirs: Option<(&str, u64)>) -> StreamRelation {
    match (ours, theirs) {
        (Some(a), Some(b)) if a == b => StreamRelation::Same,
        (Some((an, at)), Some((bn, bt))) if an == bn && at > bt => StreamRelation::Later,
        (Some(_), Some(_)) => StreamRelation::Other,
        _ => StreamRelation::Unknown,
    }
}

/// [`pointer_publish_allowed`] across incarnations: `relation` is the exporter's stream relative
/// to the pointer's artifact's. The cursor comparison holds within one stream (or when either
/// side records none); a later incarnation replaces the pointer whatever the cursors (a recreated
/// bucket's sequences start over, so its cursor is below the old artifact's and the pointer
/// would otherwise never move again); an exporter of an earlier incarnation or of another stream
/// never replaces it. A corrupt or absent pointer is replaceable as ever.
pub fn pointer_replace_allowed(
    current: PointerState,
    cursor: u64,
    relation: StreamRelation,
) -> bool {
    match (current, relation) {
        (PointerState::Absent | PointerState::Corrupt, _) => true,
        (PointerState::At(_), StreamRelation::Later) => true,
        (PointerState::At(_), StreamRelation::Other) => false,
        (PointerState::At(_), StreamRelation::Same | StreamRelation::Unknown) => {
            pointer_publish_allowed(current, cursor)
        }
    }
}

/// Whether a node may bootstrap from an artifact whose stream relates to the bucket's live stream
/// as `relation` (the live one relative to the artifact's): only the same stream; an artifact that
/// records none is taken, and the node's own identity check at its first start decides (as before
/// artifacts recorded their stream).
pub fn bootstrap_stream_allowed(relation: StreamRelation) -> bool {
    matches!(relation, StreamRelation::Same | StreamRelation::Unknown)
}

/// When a payload at `payload_cursor` stopped being the pointer's target, or could no longer
/// become it, from the targets the pointer knows: `targets` holds `(cursor, published_unix_ms)`
/// for its current target (published when the pointer object was last written) and its recent
/// previous targets (the pointer's `previous` list). A payload was replaced no later than the
/// publish of the first target above its cursor (the pointer never moves backward, so once a
/// higher cursor was published no lower one is named again): the earliest publish among the
/// targets above it. A name without a cursor (the earlier form) is older than every target.
/// `None`: no known target lies above it (it is the target, or an exporter may still name it).
pub fn payload_superseded_at(payload_cursor: Option<u64>, targets: &[(u64, i64)]) -> Option<i64> {
    targets
        .iter()
        .filter(|(c, _)| payload_cursor.is_none_or(|p| *c > p))
        .map(|(_, t)| *t)
        .min()
}

/// Whether a payload may be pruned: never the pointer's target (whatever its age, even at zero
/// grace); never one whose cursor is at or above the pointer's, nor any while there is no pointer
/// (an exporter may have uploaded it and be about to publish: the pointer would dangle — found by
/// the fleet model at zero grace); a payload below the pointer no publish can name
/// ([`pointer_publish_allowed`] refuses it), so it goes once the grace has passed **since it
/// stopped being the target** (`since_superseded`, from [`payload_superseded_at`]; `None`: not
/// known to be replaced, kept) — a node that read the pointer just before it moved has the grace
/// to download, however long ago the payload was uploaded — and since its upload (`age`). A
/// payload whose name carries no cursor (named before cursors were) is judged as below the pointer.
pub fn payload_prunable(
    is_pointer_target: bool,
    payload_cursor: Option<u64>,
    pointer_cursor: Option<u64>,
    age: std::time::Duration,
    since_superseded: Option<std::time::Duration>,
    grace: std::time::Duration,
) -> bool {
    let unreachable = match (payload_cursor, pointer_cursor) {
        (_, None) => false,
        (Some(p), Some(t)) => p < t,
        (None, Some(_)) => true,
    };
    !is_pointer_target && unreachable && age > grace && since_superseded.is_some_and(|s| s > grace)
}

/// How useful the newest published artifact still is to a node whose cursor expires
/// (docs/operations.md, "Artifact freshness").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreshnessState {
    /// A node can resume from it gap-free, with more than a quarter of the stream's age left.
    Fresh,
    /// Within a quarter of the stream's age of being stale.
    AtRisk,
    /// The stream's first sequence passed its cursor: a node restored from it would miss records,
    /// so a restore refuses it, and an expired cursor anywhere is a stop.
    Stale,
    /// No artifact was ever published under the key.
    Missing,
    /// One is published, but a restore here would refuse it ([`artifact_unusable`]).
    Unusable,
    /// The check has failed several times in a row: nothing is known.
    Unknown,
}

impl FreshnessState {
    /// The state as `/status` and the log spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            FreshnessState::Fresh => "fresh",
            FreshnessState::AtRisk => "at_risk",
            FreshnessState::Stale => "stale",
            FreshnessState::Missing => "missing",
            FreshnessState::Unusable => "unusable",
            FreshnessState::Unknown => "unknown",
        }
    }
}

/// Why a restore on this node would refuse the newest artifact before its cursor is even weighed
/// (as the restore itself checks): another incarnation of the stream, a cursor past the stream's
/// last sequence, or a scope that does not cover the node's. `None`: usable.
pub fn artifact_unusable(
    cursor: Option<u64>,
    last_sequence: u64,
    stream_allowed: bool,
    covers_scope: bool,
) -> Option<&'static str> {
    if !stream_allowed {
        return Some("it folds another incarnation of the stream");
    }
    if cursor.is_none() {
        return Some("its manifest has no cursor");
    }
    if cursor.is_some_and(|c| c > last_sequence) {
        return Some("its cursor is past the stream's last sequence");
    }
    if !covers_scope {
        return Some("its scope does not cover this node's");
    }
    None
}

/// The newest artifact's distance from being stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Freshness {
    /// Fresh, at risk, stale or missing.
    pub state: FreshnessState,
    /// Records the stream may still drop from its head before the artifact is stale: its cursor +
    /// 1 − the stream's first sequence (below 0: stale by that many). `None` without an artifact.
    pub headroom_records: Option<i64>,
    /// Seconds until the record after the artifact's cursor ages out, on a stream with an age
    /// limit (below 0: stale); `None` when the stream has no age limit, or holds no record after
    /// the cursor (the artifact is at the head: it cannot go stale before the stream moves).
    pub headroom_seconds: Option<i64>,
}

/// How fresh the newest artifact at `cursor` is (`None`: none published) against a stream whose
/// first retained sequence is `first_sequence`, whose age limit is `max_age_ms` (0: none), and
/// whose record after the cursor was stored at `next_record_unix_ms` (`None`: no record there).
/// Stale once the first sequence passed `cursor + 1`; at risk once less than a quarter of the age
/// limit is left before the record after the cursor ages out.
pub fn artifact_freshness(
    cursor: Option<u64>,
    first_sequence: u64,
    max_age_ms: u64,
    next_record_unix_ms: Option<u64>,
    now_unix_ms: u64,
) -> Freshness {
    let Some(cursor) = cursor else {
        return Freshness {
            state: FreshnessState::Missing,
            headroom_records: None,
            headroom_seconds: None,
        };
    };
    let records = i64::try_from(cursor.saturating_add(1))
        .unwrap_or(i64::MAX)
        .saturating_sub(i64::try_from(first_sequence).unwrap_or(i64::MAX));
    let left_ms = next_record_unix_ms.filter(|_| max_age_ms > 0).map(|t| {
        i64::try_from(t.saturating_add(max_age_ms)).unwrap_or(i64::MAX)
            - i64::try_from(now_unix_ms).unwrap_or(i64::MAX)
    });
    let quarter = i64::try_from(max_age_ms / 4).unwrap_or(i64::MAX);
    let state = if records < 0 {
        FreshnessState::Stale
    } else if left_ms.is_some_and(|l| l < quarter) {
        FreshnessState::AtRisk
    } else {
        FreshnessState::Fresh
    };
    Freshness {
        state,
        headroom_records: Some(records),
        headroom_seconds: left_ms.map(|l| l.div_euclid(1000)),
    }
}

/// What the export lease key holds, as read before a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseState {
    /// No lease key yet.
    Absent,
    /// A tombstone (an empty value): freed.
    Free,
    /// A value that does not decode: nobody can be holding it.
    Corrupt,
    /// A lease that runs out at this time (Unix milliseconds, the holder's clock).
    Held {
        /// Expiry.
        expires_unix_ms: u64,
    },
}

/// Whether a node may take the export lease (docs/operations.md, "A fleet: artifacts in object storage"): when
/// it is absent, freed or corrupt, or when the holder's expiry has passed by the taker's clock. The
/// take is itself a CAS on the revision read, so of two nodes deciding "yes" at once only one wins.
pub fn lease_takeover_allowed(state: LeaseState, now_unix_ms: u64) -> bool {
    match state {
        LeaseState::Absent | LeaseState::Free | LeaseState::Corrupt => true,
        LeaseState::Held { expires_unix_ms } => now_unix_ms >= expires_unix_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_artifact_is_stale_once_the_streams_first_sequence_passes_its_cursor_and_at_risk_in_the_last_quarter_of_the_age()
     {
        let day = 86_400_000;
        let now = 10 * day;
        // No artifact at all.
        assert_eq!(
            artifact_freshness(None, 1, day, None, now).state,
            FreshnessState::Missing
        );
        // At the head of the stream: nothing after its cursor can age out yet.
        let head = artifact_freshness(Some(100), 90, day, None, now);
        assert_eq!(head.state, FreshnessState::Fresh);
        assert_eq!(head.headroom_records, Some(11));
        assert_eq!(head.headroom_seconds, None);
        // The record after the cursor is half a day old: half the age left.
        let half = artifact_freshness(Some(100), 90, day, Some(now - day / 2), now);
        assert_eq!(half.state, FreshnessState::Fresh);
        assert_eq!(half.headroom_seconds, Some(43_200));
        // Less than a quarter left.
        let late = artifact_freshness(Some(100), 90, day, Some(now - day + 1000), now);
        assert_eq!(late.state, FreshnessState::AtRisk);
        assert_eq!(late.headroom_seconds, Some(1));
        // The first sequence is exactly the record after the cursor: still gap-free.
        assert_eq!(
            artifact_freshness(Some(100), 101, 0, None, now).state,
            FreshnessState::Fresh
        );
        // One past it: a restore from it would miss record 101.
        let stale = artifact_freshness(Some(100), 102, day, Some(now - 2 * day), now);
        assert_eq!(stale.state, FreshnessState::Stale);
        assert_eq!(stale.headroom_records, Some(-1));
        // No age limit (a size limit evicts): only the records say.
        let sized = artifact_freshness(Some(100), 50, 0, Some(now - 5 * day), now);
        assert_eq!(sized.state, FreshnessState::Fresh);
        assert_eq!(sized.headroom_seconds, None);
    }

    #[test]
    fn an_artifact_a_restore_here_would_refuse_is_unusable_whatever_its_cursor() {
        assert_eq!(artifact_unusable(Some(10), 20, true, true), None);
        assert!(
            artifact_unusable(Some(10), 20, false, true).is_some_and(|w| w.contains("incarnation"))
        );
        assert!(artifact_unusable(None, 20, true, true).is_some());
        assert!(artifact_unusable(Some(21), 20, true, true).is_some_and(|w| w.contains("past")));
        assert!(artifact_unusable(Some(10), 20, true, false).is_some_and(|w| w.contains("scope")));
    }
}
