//! What a node following a guest channel shows of it in `/status` (docs/channels.md).

use serde::{Deserialize, Serialize};

/// What a node following a guest channel shows of it: what it runs, what the channel wants,
/// the rollout's state and this node's judgement of the release.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct GuestChannelReport {
    /// The channel.
    pub channel: String,
    /// This node's name in it.
    pub node: String,
    /// The current release (0: none read yet).
    pub release: u64,
    /// `canary`, `wave`, `rolling`, `halted`; `unpublished` when the channel has no release,
    /// `unknown` before the channel was read.
    pub state: String,
    /// While the release opens its waves: `K of N (B of M baked; this node's wave: W)` — the open
    /// wave, how many of its nodes baked, and the wave this node is in (0: a canary).
    pub wave: Option<String>,
    /// Whether this node has baked the release: run its desired version cleanly for its bake
    /// time.
    pub baked: bool,
    /// Who halted the release, and why, when it is halted.
    pub halted_by: Option<String>,
    /// The running version (`name@version (digest)`).
    pub running: Option<String>,
    /// Its digest.
    pub running_digest: Option<String>,
    /// The release's desired version.
    pub desired: Option<String>,
    /// Its digest.
    pub desired_digest: Option<String>,
    /// Whether this node is one of the release's canaries.
    pub canary: bool,
    /// This node's judgement of the release (empty before it judged).
    pub judgement: String,
    /// Why (the difference, the trap, the fetch error).
    pub detail: String,
    /// Why the channel cannot be read now, while it cannot.
    pub error: Option<String>,
    /// The running version's failed calls (traps, deadline hits, resource caps) since this node
    /// swapped to it — a local trial's never count — as of the last check.
    pub failed_calls: u64,
    /// How many times this node has checked them since it started following (once a second
    /// while the channel is read): a check counted after a failure judged it.
    pub checks: u64,
    /// The version this node shadows now (a canary's trial), while it does.
    pub shadowing: Option<String>,
}
