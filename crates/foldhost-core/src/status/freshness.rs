//! The newest artifact's freshness as `/status` shows it (docs/operations.md, "Artifact
//! freshness"): figures only, decided by [`crate::protocol::artifact_freshness`].

use serde::{Deserialize, Serialize};

/// How useful the newest published artifact still is to a node whose cursor expires
/// ([`crate::protocol::artifact_freshness`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct ArtifactFreshnessReport {
    /// `fresh`, `at_risk`, `stale`, `missing`, `unusable` or `unknown`.
    pub state: String,
    /// Why it is `unusable` or `unknown`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The artifact key.
    pub key: String,
    /// The newest artifact's cursor (none published: `None`).
    pub cursor: Option<u64>,
    /// The stream's first retained sequence when checked.
    pub stream_first_sequence: u64,
    /// Records the stream may still drop before the artifact is stale (below 0: stale).
    pub headroom_records: Option<i64>,
    /// Seconds until the record after its cursor ages out (below 0: stale); `None` without an
    /// age limit or a record after the cursor.
    pub headroom_seconds: Option<i64>,
    /// When it was checked, Unix milliseconds.
    pub checked_unix_ms: u64,
}

impl ArtifactFreshnessReport {
    /// The warning `/status` and `/readyz` say while it is not fresh, in words.
    pub fn warning(&self) -> Option<String> {
        let seconds = self
            .headroom_seconds
            .map(|s| format!(", {s} s of the stream's age left"))
            .unwrap_or_default();
        match self.state.as_str() {
            "missing" => Some(format!(
                "artifact {}: none published on an evicting bucket: an expired cursor has nothing to restore from",
                self.key
            )),
            "stale" => Some(format!(
                "artifact {}: stale: the stream's first sequence {} passed its cursor {}: an expired cursor has nothing to restore from",
                self.key,
                self.stream_first_sequence,
                self.cursor.unwrap_or(0)
            )),
            "unusable" => Some(format!(
                "artifact {}: a restore here would refuse it ({}): an expired cursor has nothing to restore from",
                self.key,
                self.reason.as_deref().unwrap_or("?")
            )),
            "unknown" => Some(format!(
                "artifact {}: freshness unknown ({})",
                self.key,
                self.reason.as_deref().unwrap_or("?")
            )),
            "at_risk" => Some(format!(
                "artifact {}: at risk: cursor {}, {} records ahead of the stream's first sequence{seconds}",
                self.key,
                self.cursor.unwrap_or(0),
                self.headroom_records.unwrap_or(0)
            )),
            _ => None,
        }
    }
}
