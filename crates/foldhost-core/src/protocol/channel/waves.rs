//! A release's waves (docs/channels.md, "Waves"): how `--waves` resolves to nodes at publish,
//! what an entry's waves may say, and which wave is open from the nodes' reports. The invariants
//! are the parent module's.

use serde::{Deserialize, Serialize};

use super::{
    ChannelEntry, Judgement, MAX_BAKE_S, MAX_WAVE_NODES, MAX_WAVES, NodeReport, Rollout,
    name_refusal, ranked,
};

/// One wave of a release: the nodes it opens to, resolved at publish.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wave {
    /// The wave as the publisher gave it: a cumulative count of nodes (`1`) or a percentage of the
    /// known nodes (`10%`); the last wave is `100%`.
    pub spec: String,
    /// The nodes this wave adds. The last wave's list is what was known at publish, for the
    /// operator: the last wave is every node not named in an earlier one.
    pub nodes: Vec<String>,
}

/// Whether `r` says its node baked release `release` of `entry`: clean, running its desired
/// version, baked.
pub fn is_baked(release: u64, entry: &ChannelEntry, r: &NodeReport) -> bool {
    r.release == release
        && r.outcome == Judgement::Clean
        && r.baked
        && r.running.as_ref().map(|v| &v.digest) == Some(&entry.desired.digest)
}

/// The state of a release past its canaries: the first wave one of whose nodes has not baked is
/// open (every earlier one baked); `Rolling` once that is the last.
pub(super) fn open_wave(release: u64, entry: &ChannelEntry, of_this: &[&NodeReport]) -> Rollout {
    let of = entry.waves.len();
    let baked = |n: &String| {
        of_this
            .iter()
            .any(|r| &r.node == n && is_baked(release, entry, r))
    };
    for (i, w) in entry.waves.iter().enumerate().take(of.saturating_sub(1)) {
        let done = w.nodes.iter().filter(|n| baked(n)).count();
        if done < w.nodes.len() {
            return Rollout::Wave {
                wave: i + 1,
                of,
                baked: done,
                in_wave: w.nodes.len(),
            };
        }
    }
    Rollout::Rolling
}

/// The nodes of release `release`'s open wave that have not baked it (empty unless it is in a
/// wave): what holds the next wave back.
pub fn unbaked(
    release: u64,
    entry: &ChannelEntry,
    state: &Rollout,
    reports: &[NodeReport],
) -> Vec<String> {
    let Rollout::Wave { wave, .. } = state else {
        return Vec::new();
    };
    entry.waves.get(wave - 1).map_or(Vec::new(), |w| {
        w.nodes
            .iter()
            .filter(|n| {
                !reports
                    .iter()
                    .any(|r| &r.node == *n && is_baked(release, entry, r))
            })
            .cloned()
            .collect()
    })
}

/// The wave node `me` is in: 0 for a canary (before every wave) or on a release without waves,
/// k (1-based) for a node an earlier wave names, else the last (every node not named earlier).
pub fn wave_of(entry: &ChannelEntry, me: &str) -> usize {
    if entry.waves.is_empty() || entry.canaries.iter().any(|c| c == me) {
        return 0;
    }
    let last = entry.waves.len();
    entry.waves[..last - 1]
        .iter()
        .position(|w| w.nodes.iter().any(|n| n == me))
        .map_or(last, |i| i + 1)
}

/// Whether `state` lets node `me` run the desired version as a rolling release does: `Rolling`,
/// or a wave at or past `me`'s.
pub(super) fn open_to(entry: &ChannelEntry, state: &Rollout, me: &str) -> bool {
    match state {
        Rollout::Rolling => true,
        Rollout::Wave { wave, .. } => wave_of(entry, me) <= *wave,
        Rollout::Canary { .. } | Rollout::Halted { .. } => false,
    }
}

/// A wave's size as `--waves` gives it: a cumulative count of nodes, or a cumulative percentage
/// (1 to 100) of the known nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaveSize {
    /// This many nodes in this wave and the earlier ones.
    Nodes(u64),
    /// This percentage of the known nodes (rounded up) in this wave and the earlier ones.
    Percent(u64),
}

/// Parses one wave of `--waves` (`1`, `10%`), refusing anything else in one line.
pub fn parse_wave(spec: &str) -> Result<WaveSize, String> {
    let bad = || format!("wave {spec:?}: a number of nodes (1, 5) or a percentage (10%, 100%)");
    let (digits, percent) = match spec.strip_suffix('%') {
        Some(p) => (p, true),
        None => (spec, false),
    };
    if digits.is_empty() || digits.starts_with('0') || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    match (digits.parse::<u64>(), percent) {
        (Ok(p @ 1..=100), true) => Ok(WaveSize::Percent(p)),
        (Ok(n), false) => Ok(WaveSize::Nodes(n)),
        _ => Err(bad()),
    }
}

/// Why a list of waves is refused, if it is: 1 to [`MAX_WAVES`] of them, each well-formed, the
/// last `100%` and no earlier one, counts and percentages each rising.
pub fn waves_refusal(specs: &[String]) -> Option<String> {
    if specs.is_empty() || specs.len() > MAX_WAVES {
        return Some(format!("{} waves (1 to {MAX_WAVES})", specs.len()));
    }
    let mut last_nodes = 0;
    let mut last_percent = 0;
    for (i, spec) in specs.iter().enumerate() {
        let size = match parse_wave(spec) {
            Ok(s) => s,
            Err(why) => return Some(why),
        };
        let is_last = i + 1 == specs.len();
        match size {
            WaveSize::Percent(100) if is_last => {}
            _ if is_last => return Some(format!("the last wave is {spec:?}: it must be 100%")),
            WaveSize::Percent(100) => {
                return Some("only the last wave is 100% (it takes every node left)".into());
            }
            WaveSize::Nodes(n) if n <= last_nodes => {
                return Some(format!("wave {spec:?} is no larger than the one before it"));
            }
            WaveSize::Percent(p) if p <= last_percent => {
                return Some(format!("wave {spec:?} is no larger than the one before it"));
            }
            WaveSize::Nodes(n) => last_nodes = n,
            WaveSize::Percent(p) => last_percent = p,
        }
    }
    None
}

/// The waves `specs` resolve to over the known `nodes` (the canaries left out: they come before
/// every wave), in the order of [`super::pick_canaries`]' ranking for `digest`: wave k takes the
/// next nodes up to its cumulative count (a number, or a percentage of the known nodes other than
/// canaries rounded up), and at least one more than the wave before while any node is left; the
/// last wave takes every node left. A wave past the known nodes names none.
pub fn resolve_waves(
    specs: &[String],
    nodes: &[String],
    canaries: &[String],
    digest: &str,
) -> Result<Vec<Wave>, String> {
    if let Some(why) = waves_refusal(specs) {
        return Err(why);
    }
    let pool: Vec<String> = ranked(nodes, digest)
        .into_iter()
        .filter(|n| !canaries.contains(n))
        .collect();
    let n = pool.len();
    let mut taken = 0usize;
    let mut waves = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let upto = if i + 1 == specs.len() {
            n
        } else {
            let target = match parse_wave(spec)? {
                WaveSize::Nodes(c) => usize::try_from(c).unwrap_or(usize::MAX),
                WaveSize::Percent(p) => (n * p as usize).div_ceil(100),
            };
            target.max(taken + 1).min(n)
        };
        waves.push(Wave {
            spec: spec.clone(),
            nodes: pool[taken..upto].to_vec(),
        });
        taken = upto;
    }
    Ok(waves)
}

/// Why an entry's waves are refused, if they are: their specs as `--waves` takes them, at most
/// [`MAX_WAVE_NODES`] names in all, each valid, none in two waves nor a canary; a bake of at most
/// [`MAX_BAKE_S`].
pub(super) fn entry_waves_refusal(e: &ChannelEntry) -> Option<String> {
    if e.bake_s > MAX_BAKE_S {
        return Some(format!("bake_s {} (most {MAX_BAKE_S})", e.bake_s));
    }
    if e.waves.is_empty() {
        return None;
    }
    let specs: Vec<String> = e.waves.iter().map(|w| w.spec.clone()).collect();
    if let Some(why) = waves_refusal(&specs) {
        return Some(format!("waves: {why}"));
    }
    let names = e.waves.iter().map(|w| w.nodes.len()).sum::<usize>();
    if names > MAX_WAVE_NODES {
        return Some(format!("waves name {names} nodes (most {MAX_WAVE_NODES})"));
    }
    let mut seen = std::collections::BTreeSet::new();
    for n in e.waves.iter().flat_map(|w| &w.nodes) {
        if let Some(why) = name_refusal("wave node", n) {
            return Some(why);
        }
        if e.canaries.contains(n) {
            return Some(format!("wave node {n:?} is a canary"));
        }
        if !seen.insert(n.as_str()) {
            return Some(format!("wave node {n:?} is in two waves"));
        }
    }
    None
}
