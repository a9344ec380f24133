//! Guest channels (docs/channels.md): what a channel's release entry and a node's report say, the
//! rollout's state as a function of the two, and what one node does next. The publisher, every
//! following node and `foldhost guest status` decide with these same functions from what they
//! read on the bus, so no one writes the rollout's state: it is derived, and every reader derives
//! the same one from the same entries.
//!
//! Invariants:
//! - A release that any node judged `differed`, `trapped` or `refused` is halted, and a halted
//!   release never resumes: only a new publish (a new release) moves the fleet forward again.
//! - No node that is not a canary runs a release's version before every canary judged it clean.
//! - A halted release sends every node back to the last good version ([`ChannelEntry::previous`]),
//!   never to an unproven one: `previous` is the desired version of a release that reached its
//!   rollout, or that release's own `previous`.
//! - `unfetchable` halts nothing: it says the node could not get or verify the bytes, nothing
//!   about how the version behaves; the node keeps its version and tries again.
//!
//! Waves (a release with [`ChannelEntry::waves`]): after the canaries (if any) judged it clean,
//! the release opens its waves one at a time. Wave k+1 opens only once every node named in waves
//! 1..=k reports, for this release, `clean`, running its desired version and
//! [`NodeReport::baked`] — it ran that version for [`ChannelEntry::bake_s`] by its own clock with
//! no failed call counted. Invariants:
//! - No node of a later wave runs the desired version before every node of the earlier waves
//!   baked ([`next_step`] and [`start_version`] give it `previous`); the last wave is every node
//!   not named earlier, known at publish or not.
//! - A release whose waves have not all opened gives no `previous` to the next publish: a version
//!   that reached some waves is not proven fleet-wide. So `previous` is the desired version of a
//!   release that reached every node's rollout (`rolling`), or that release's own `previous`.
//! - Nothing compares two nodes' clocks: each judges its own bake.
//! - A release with waves carries the canary name [`WAVES_FENCE`] on the wire, which a node older
//!   than waves refuses when it decodes the entry (`=` fails its name check): such a node keeps
//!   its version instead of treating a wave release as one that rolls at once. This code adds the
//!   fence when it encodes an entry with waves, strips it when it decodes one, and refuses it on
//!   an entry without waves (and an entry with waves without it).

use serde::{Deserialize, Serialize};

mod waves;
pub use waves::*;
use waves::{entry_waves_refusal, open_to, open_wave};

/// Longest channel or node name.
pub const MAX_CHANNEL_NAME: usize = 64;
/// Largest release entry or node report the host decodes.
pub const MAX_CHANNEL_RECORD: usize = 64 * 1024;
/// Most canary nodes a release names.
pub const MAX_CANARIES: usize = 64;
/// Largest component a channel carries, in bytes: a publish refuses more, and a node stops
/// reading an object one byte past it.
pub const MAX_COMPONENT_BYTES: u64 = 64 * 1024 * 1024;
/// Longest a canary waits for its shadow's batches, seconds (a day): a release asking more is
/// refused when decoded.
pub const MAX_SHADOW_WAIT_S: u64 = 24 * 3600;
/// Longest detail a node report carries (cut, marked, beyond it).
pub const MAX_REPORT_DETAIL: usize = 1024;
/// Most waves a release has.
pub const MAX_WAVES: usize = 16;
/// Most nodes a release's waves name, all waves together.
pub const MAX_WAVE_NODES: usize = 1024;
/// Longest bake a release asks of each wave, seconds (a week).
pub const MAX_BAKE_S: u64 = 7 * 24 * 3600;
/// The canary name a release with waves carries on the wire so that nodes older than waves refuse
/// it (module docs).
pub const WAVES_FENCE: &str = "=needs-waves";

/// One published component: the lowercase hex BLAKE3 digest of its bytes (its object's name),
/// and the name and version its manifest declares.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestVersion {
    /// 64 lowercase hex digits: BLAKE3 of the component's bytes.
    pub digest: String,
    /// The manifest's name.
    pub name: String,
    /// The manifest's version.
    pub version: String,
    /// The component's size in bytes.
    pub size: u64,
}

impl GuestVersion {
    /// `name@version (digest's first 12 digits)`: how logs and tables name it.
    pub fn label(&self) -> String {
        let short = self.digest.get(..12).unwrap_or(&self.digest);
        format!("{}@{} ({short})", self.name, self.version)
    }
}

/// A channel's release entry: the KV value of `<channel>.release`, written by compare-and-set.
/// Its KV revision is the release's number. On the wire a release with waves carries the
/// [`WAVES_FENCE`] canary (added and stripped by the (de)serialisation: never in memory).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "EntryWire", into = "EntryWire")]
pub struct ChannelEntry {
    /// The version this release rolls out.
    pub desired: GuestVersion,
    /// The last good version: where a halted rollout returns, what a node starts with while
    /// canaries judge. `None` on a channel's first release (no canary phase then: nothing runs to
    /// compare with).
    pub previous: Option<GuestVersion>,
    /// The nodes that shadow the candidate first (resolved at publish from a fraction, when one
    /// was given).
    pub canaries: Vec<String>,
    /// The fraction the canaries were picked by, when they were.
    #[serde(default)]
    pub canary_fraction: Option<f64>,
    /// Batches a canary feeds the candidate before comparing.
    pub shadow_batches: u64,
    /// Longest a canary waits for those batches before comparing on what it saw, seconds.
    pub shadow_wait_s: u64,
    /// Requests a canary's comparison may answer differently and still be clean.
    pub tolerance: u64,
    /// When it was published (the publisher's clock), Unix milliseconds.
    pub published_unix_ms: u64,
    /// The waves it opens one after the other once the canaries judged it clean; empty: every
    /// node at once.
    pub waves: Vec<Wave>,
    /// How long each node of a wave runs the version cleanly before the next wave opens, seconds.
    pub bake_s: u64,
}

/// A release entry as JSON carries it: [`ChannelEntry`] with the fence among the canaries when it
/// has waves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct EntryWire {
    desired: GuestVersion,
    previous: Option<GuestVersion>,
    canaries: Vec<String>,
    #[serde(default)]
    canary_fraction: Option<f64>,
    shadow_batches: u64,
    shadow_wait_s: u64,
    tolerance: u64,
    published_unix_ms: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    waves: Vec<Wave>,
    #[serde(default, skip_serializing_if = "is_zero")]
    bake_s: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl From<ChannelEntry> for EntryWire {
    fn from(e: ChannelEntry) -> Self {
        let mut canaries = e.canaries;
        if !e.waves.is_empty() {
            canaries.push(WAVES_FENCE.to_string());
        }
        EntryWire {
            desired: e.desired,
            previous: e.previous,
            canaries,
            canary_fraction: e.canary_fraction,
            shadow_batches: e.shadow_batches,
            shadow_wait_s: e.shadow_wait_s,
            tolerance: e.tolerance,
            published_unix_ms: e.published_unix_ms,
            waves: e.waves,
            bake_s: e.bake_s,
        }
    }
}

impl TryFrom<EntryWire> for ChannelEntry {
    type Error = String;

    fn try_from(w: EntryWire) -> Result<Self, String> {
        let fenced = w.canaries.iter().filter(|c| *c == WAVES_FENCE).count();
        match (w.waves.is_empty(), fenced) {
            (true, 0) | (false, 1) => {}
            (true, _) => {
                return Err(format!(
                    "the canary {WAVES_FENCE:?} on a release without waves"
                ));
            }
            (false, _) => {
                return Err(format!(
                    "waves without exactly one {WAVES_FENCE:?} canary (the fence older nodes refuse)"
                ));
            }
        }
        Ok(ChannelEntry {
            desired: w.desired,
            previous: w.previous,
            canaries: w
                .canaries
                .into_iter()
                .filter(|c| c != WAVES_FENCE)
                .collect(),
            canary_fraction: w.canary_fraction,
            shadow_batches: w.shadow_batches,
            shadow_wait_s: w.shadow_wait_s,
            tolerance: w.tolerance,
            published_unix_ms: w.published_unix_ms,
            waves: w.waves,
            bake_s: w.bake_s,
        })
    }
}

/// What a node found of a release.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Judgement {
    /// Nothing judged yet (following, fetching, shadowing).
    Pending,
    /// Shadowed without differences beyond the tolerance, or swapped in and running.
    Clean,
    /// Answered more requests differently than the release tolerates.
    Differed,
    /// Trapped (or hit its deadline) while shadowing or after it was swapped in.
    Trapped,
    /// Failed to compile, link or start: refused by the swap.
    Refused,
    /// The bytes could not be fetched or did not match their digest (the node keeps its version).
    Unfetchable,
}

impl Judgement {
    /// Whether this outcome halts the release it judges.
    pub fn halts(self) -> bool {
        matches!(
            self,
            Judgement::Differed | Judgement::Trapped | Judgement::Refused
        )
    }

    /// The outcome's name as reports and tables spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Judgement::Pending => "pending",
            Judgement::Clean => "clean",
            Judgement::Differed => "differed",
            Judgement::Trapped => "trapped",
            Judgement::Refused => "refused",
            Judgement::Unfetchable => "unfetchable",
        }
    }
}

/// A node's report: the KV value of `<channel>.node.<node>`, written only by that node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReport {
    /// The node's name.
    pub node: String,
    /// The release judged (its entry's KV revision).
    pub release: u64,
    /// What the node found of it.
    pub outcome: Judgement,
    /// Why, in words (the difference, the trap, the fetch error), at most
    /// [`MAX_REPORT_DETAIL`] bytes.
    pub detail: String,
    /// The version the node runs now.
    pub running: Option<GuestVersion>,
    /// When the node wrote this (its clock), Unix milliseconds.
    pub unix_ms: u64,
    /// Whether the node has run the release's desired version cleanly for the release's bake
    /// time, by its own clock since it swapped to it (kept across its restarts while it runs it).
    #[serde(default)]
    pub baked: bool,
}

/// Where a release stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rollout {
    /// The canaries are shadowing the candidate; no one else moves.
    Canary {
        /// Canaries that judged it clean so far.
        clean: usize,
        /// Canaries in all.
        of: usize,
    },
    /// The canaries judged it clean and its waves open one after the other: the nodes of waves
    /// 1..=`wave` swap to it, the others run the last good version.
    Wave {
        /// The open wave (1-based; never the last: the last open is `Rolling`).
        wave: usize,
        /// Waves in all.
        of: usize,
        /// Nodes of the open wave that baked so far.
        baked: usize,
        /// Nodes of the open wave.
        in_wave: usize,
    },
    /// Every canary judged it clean (or the release has none) and its last wave (if it has
    /// waves) opened: every node swaps to it.
    Rolling,
    /// A node judged it bad: every node returns to the last good version.
    Halted {
        /// The first node (by name) whose report halted it.
        by: String,
        /// Its outcome and detail.
        why: String,
    },
}

impl Rollout {
    /// The state's name: `canary`, `wave`, `rolling` or `halted`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Rollout::Canary { .. } => "canary",
            Rollout::Wave { .. } => "wave",
            Rollout::Rolling => "rolling",
            Rollout::Halted { .. } => "halted",
        }
    }
}

/// The state of release `release` of `entry`, from every node's report (reports of other
/// releases are ignored).
pub fn rollout(release: u64, entry: &ChannelEntry, reports: &[NodeReport]) -> Rollout {
    let mut of_this: Vec<&NodeReport> = reports.iter().filter(|r| r.release == release).collect();
    of_this.sort_by(|a, b| a.node.cmp(&b.node));
    if let Some(bad) = of_this.iter().find(|r| r.outcome.halts()) {
        return Rollout::Halted {
            by: bad.node.clone(),
            why: format!("{}: {}", bad.outcome.as_str(), bad.detail),
        };
    }
    if entry.previous.is_none() {
        // Nothing to run instead: no canary phase, no waves.
        return Rollout::Rolling;
    }
    let clean = entry
        .canaries
        .iter()
        .filter(|c| {
            of_this
                .iter()
                .any(|r| &r.node == *c && r.outcome == Judgement::Clean)
        })
        .count();
    if clean == entry.canaries.len() {
        open_wave(release, entry, &of_this)
    } else {
        Rollout::Canary {
            clean,
            of: entry.canaries.len(),
        }
    }
}

/// What a following node does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing: it runs what it should, or already judged this release.
    Stay,
    /// Shadow the candidate beside the running guest and promote it when clean (a canary).
    Shadow(GuestVersion),
    /// Swap to this version (the release's desired one, or the last good one).
    Swap(GuestVersion),
}

/// The version node `me` starting now runs first: the desired one while rolling or once its wave
/// opened, the last good one while canaries judge, before its wave opened, or once halted; `None`
/// when the channel's only release is halted (no good version exists).
pub fn start_version<'a>(
    entry: &'a ChannelEntry,
    state: &Rollout,
    me: &str,
) -> Option<&'a GuestVersion> {
    if open_to(entry, state, me) {
        Some(&entry.desired)
    } else {
        entry.previous.as_ref()
    }
}

/// What node `me`, running `running` (a digest) and having reported `mine` of this release (its
/// report, if it is of this release), does next.
pub fn next_step(
    entry: &ChannelEntry,
    state: &Rollout,
    me: &str,
    running: Option<&str>,
    mine: Option<Judgement>,
) -> Step {
    let runs = |v: &GuestVersion| running == Some(v.digest.as_str());
    let to = |v: &GuestVersion| {
        if runs(v) {
            Step::Stay
        } else {
            Step::Swap(v.clone())
        }
    };
    match state {
        Rollout::Halted { .. } => entry.previous.as_ref().map_or(Step::Stay, to),
        Rollout::Canary { .. } if entry.canaries.iter().any(|c| c == me) => match mine {
            Some(Judgement::Clean) => Step::Stay,
            _ if runs(&entry.desired) => Step::Stay,
            _ => Step::Shadow(entry.desired.clone()),
        },
        Rollout::Rolling | Rollout::Wave { .. } if open_to(entry, state, me) => match mine {
            Some(o) if o.halts() => Step::Stay,
            _ => to(&entry.desired),
        },
        Rollout::Canary { .. } | Rollout::Wave { .. } | Rollout::Rolling => {
            entry.previous.as_ref().map_or(Step::Stay, to)
        }
    }
}

/// The `previous` of a release published over `current` (its entry and state): the current
/// desired version once it rolls to every node (its canaries clean and its last wave open), else
/// the current release's own last good one.
pub fn previous_for_publish(current: Option<(&ChannelEntry, &Rollout)>) -> Option<GuestVersion> {
    match current {
        None => None,
        Some((e, Rollout::Rolling)) => Some(e.desired.clone()),
        Some((e, _)) => e.previous.clone(),
    }
}

/// The canaries a `fraction` of `nodes` picks for the component `digest`: ⌈fraction × n⌉ of them
/// (at least one when `fraction` > 0 and any node is known), ordered by BLAKE3 of the digest and
/// the node's name — the same nodes for the same component, different nodes for the next.
pub fn pick_canaries(fraction: f64, nodes: &[String], digest: &str) -> Vec<String> {
    if fraction.is_nan() || fraction <= 0.0 || nodes.is_empty() {
        return Vec::new();
    }
    let want = ((fraction.min(1.0) * nodes.len() as f64).ceil() as usize)
        .clamp(1, nodes.len())
        .min(MAX_CANARIES);
    ranked(nodes, digest).into_iter().take(want).collect()
}

/// `nodes` without repeats, ordered by BLAKE3 of `digest` and the node's name.
fn ranked(nodes: &[String], digest: &str) -> Vec<String> {
    let mut ranked: Vec<([u8; 32], &String)> = nodes
        .iter()
        .map(|n| {
            let mut h = blake3::Hasher::new();
            h.update(digest.as_bytes());
            h.update(&[0]);
            h.update(n.as_bytes());
            (*h.finalize().as_bytes(), n)
        })
        .collect();
    ranked.sort();
    ranked.dedup_by(|a, b| a.1 == b.1);
    ranked.into_iter().map(|(_, n)| n.clone()).collect()
}

/// Why a channel or node name is refused, if it is: 1 to [`MAX_CHANNEL_NAME`] of `A-Z a-z 0-9 _
/// -` (one KV key token, so `<channel>.node.<node>` stays unambiguous).
pub fn name_refusal(what: &str, name: &str) -> Option<String> {
    if name.is_empty() || name.len() > MAX_CHANNEL_NAME {
        return Some(format!(
            "{what} {name:?}: 1 to {MAX_CHANNEL_NAME} characters"
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        return Some(format!(
            "{what} {name:?}: {c:?} is not allowed (A-Z, a-z, 0-9, _ and - only)"
        ));
    }
    None
}

/// Whether `digest` is a BLAKE3 digest as channels spell it: 64 lowercase hex digits.
pub fn is_digest(digest: &str) -> bool {
    digest.len() == 64
        && digest
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// What a node following `channel` as `node` publishes beyond reading the two buckets (which
/// `compose_grants` grants as folded, read-only buckets): its own report's and name claim's keys,
/// and the object store's reads — the stream's info, the object's info by a stream get, and the
/// ordered consumer its chunks come on. Nothing else of either bucket is written.
pub fn channel_grants(channel: &str, node: &str, objects: &str, channels: &str) -> Vec<String> {
    let stream = format!("OBJ_{objects}");
    vec![
        format!("$KV.{channels}.{}", report_key(channel, node)),
        format!("$KV.{channels}.{}", claim_key(channel, node)),
        format!("$JS.API.STREAM.INFO.{stream}"),
        format!("$JS.API.STREAM.MSG.GET.{stream}"),
        format!("$JS.API.DIRECT.GET.{stream}"),
        format!("$JS.API.DIRECT.GET.{stream}.>"),
        format!("$JS.API.CONSUMER.CREATE.{stream}"),
        format!("$JS.API.CONSUMER.CREATE.{stream}.>"),
        format!("$JS.API.CONSUMER.DELETE.{stream}.>"),
        format!("$JS.FC.{stream}.>"),
    ]
}

/// The KV key of `node`'s name claim on `channel` (docs/channels.md, "One name, one node"). It
/// lies outside the channel's `<channel>.>` keys, so the claims' renewals never reach a watch of
/// the channel: a channel name never starts with `=`.
pub fn claim_key(channel: &str, node: &str) -> String {
    format!("=claim.{channel}.{node}")
}

/// How long a node's name claim holds without a renewal: a node killed without a stop frees its
/// name this long after its last renewal.
pub const NAME_CLAIM_TTL: std::time::Duration = std::time::Duration::from_secs(20);

/// How often a following node renews its name claim (a quarter of [`NAME_CLAIM_TTL`], so three
/// renewals in a row can fail before it runs out).
pub const NAME_CLAIM_RENEW: std::time::Duration = std::time::Duration::from_secs(5);

/// The KV key of a channel's release entry.
pub fn release_key(channel: &str) -> String {
    format!("{channel}.release")
}

/// The KV key of `node`'s report on `channel`.
pub fn report_key(channel: &str, node: &str) -> String {
    format!("{channel}.node.{node}")
}

/// The node a KV key of `channel` reports for, if it is a report key.
pub fn report_node<'a>(channel: &str, key: &'a str) -> Option<&'a str> {
    key.strip_prefix(channel)?.strip_prefix(".node.")
}

/// Decodes a release entry, refusing one larger than [`MAX_CHANNEL_RECORD`], one that does not
/// parse, and one whose digests or canary names are malformed: the one line says which.
pub fn decode_entry(bytes: &[u8]) -> Result<ChannelEntry, String> {
    if bytes.len() > MAX_CHANNEL_RECORD {
        return Err(format!(
            "release entry of {} bytes (most {MAX_CHANNEL_RECORD})",
            bytes.len()
        ));
    }
    let e: ChannelEntry =
        serde_json::from_slice(bytes).map_err(|e| format!("release entry: {e}"))?;
    for v in std::iter::once(&e.desired).chain(e.previous.as_ref()) {
        if !is_digest(&v.digest) {
            return Err(format!(
                "release entry: digest {:?} is not 64 hex digits",
                v.digest
            ));
        }
    }
    if e.shadow_wait_s > MAX_SHADOW_WAIT_S {
        return Err(format!(
            "release entry: shadow_wait_s {} (most {MAX_SHADOW_WAIT_S})",
            e.shadow_wait_s
        ));
    }
    if e.canaries.len() > MAX_CANARIES {
        return Err(format!(
            "release entry: {} canaries (most {MAX_CANARIES})",
            e.canaries.len()
        ));
    }
    if let Some(why) = e.canaries.iter().find_map(|c| name_refusal("canary", c)) {
        return Err(format!("release entry: {why}"));
    }
    if let Some(why) = entry_waves_refusal(&e) {
        return Err(format!("release entry: {why}"));
    }
    Ok(e)
}

/// Decodes a node report written under `node`'s key: refused when larger than
/// [`MAX_CHANNEL_RECORD`], unparsable, or naming another node than its key.
pub fn decode_report(node: &str, bytes: &[u8]) -> Result<NodeReport, String> {
    if let Some(why) = name_refusal("report of node", node) {
        return Err(why);
    }
    if bytes.len() > MAX_CHANNEL_RECORD {
        return Err(format!(
            "report of {node}: {} bytes (most {MAX_CHANNEL_RECORD})",
            bytes.len()
        ));
    }
    let r: NodeReport =
        serde_json::from_slice(bytes).map_err(|e| format!("report of {node}: {e}"))?;
    if r.node != node {
        return Err(format!("report under {node}'s key names {:?}", r.node));
    }
    if r.detail.len() > MAX_REPORT_DETAIL {
        return Err(format!(
            "report of {node}: a detail of {} bytes (most {MAX_REPORT_DETAIL})",
            r.detail.len()
        ));
    }
    if let Some(v) = r.running.as_ref().filter(|v| !is_digest(&v.digest)) {
        return Err(format!(
            "report of {node}: running digest {:?} is not 64 hex digits",
            v.digest
        ));
    }
    Ok(r)
}

/// `detail` cut to [`MAX_REPORT_DETAIL`] bytes at a character boundary, marked when cut.
pub fn report_detail(detail: &str) -> String {
    if detail.len() <= MAX_REPORT_DETAIL {
        return detail.to_string();
    }
    let mut end = MAX_REPORT_DETAIL - 3;
    while !detail.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &detail[..end])
}

#[cfg(test)]
#[path = "channel_tests.rs"]
mod tests;
