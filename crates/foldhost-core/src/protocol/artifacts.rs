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
