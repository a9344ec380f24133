//! `foldhost guest publish|history|status`: a fleet's guest channels from the operator's side
//! (docs/channels.md). Every state shown is derived by `protocol::rollout` from the release entry
//! and the nodes' reports, exactly as each following node derives it.
//!
//! Invariants:
//! - A publish stores the component before it moves the release entry, and moves the entry only
//!   by compare-and-set: a failed or raced publish leaves the channel as it was.
//! - Nothing is published that does not compile, link and name itself (its manifest is read from
//!   an instance of it first).

use super::*;

use foldhost_core::protocol::{self, ChannelEntry, GuestVersion, NodeReport, Rollout};
use foldhost_nats::channel::{ChannelBuckets, ChannelBus};

/// `foldhost guest`.
#[derive(Subcommand, Debug)]
pub enum GuestCommand {
    /// Store a component in the guests' object store and make it the channel's desired version
    /// (a new release): canaries shadow it first, then every following node swaps to it.
    Publish(GuestPublishArgs),
    /// Every release of a channel the bus still holds, oldest first.
    History(ChannelArgs),
    /// The channel's release, its rollout's state, and every following node's running version
    /// and last report, read from the bus.
    Status(ChannelArgs),
}

/// Where a channel is and how to reach it.
#[derive(Args, Debug)]
pub struct ChannelArgs {
    /// The channel (`A-Z a-z 0-9 _ -`).
    #[arg(long)]
    pub channel: String,
    /// The NATS Object Store bucket holding components.
    #[arg(long, default_value_t = ChannelBuckets::default().objects)]
    pub guest_objects: String,
    /// The NATS KV bucket holding release entries and node reports.
    #[arg(long, default_value_t = ChannelBuckets::default().channels)]
    pub channel_bucket: String,
    /// One JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
    /// The NATS connection.
    #[command(flatten)]
    pub nats: NatsArgs,
}

impl ChannelArgs {
    fn buckets(&self) -> ChannelBuckets {
        ChannelBuckets {
            objects: self.guest_objects.clone(),
            channels: self.channel_bucket.clone(),
        }
    }

    /// The channel's bus, after the flags were checked (the channels bucket created when
    /// `create`).
    async fn open(&self, create: bool) -> anyhow::Result<ChannelBus> {
        if let Some(why) = protocol::name_refusal("--channel", &self.channel) {
            bail!("{why}");
        }
        let opts = self.nats.required()?;
        let timeout = opts.op_timeout;
        let conn = foldhost_nats::NatsConnection::open(opts).await?;
        let client = conn.dial_another().await?;
        Ok(ChannelBus::open(client, &self.buckets(), create, timeout).await?)
    }
}

/// `foldhost guest publish`.
#[derive(Args, Debug)]
pub struct GuestPublishArgs {
    /// The component (`.wasm`).
    pub file: PathBuf,
    /// Canary nodes by name (`run --node-id`), comma-separated: they shadow the new version
    /// before anyone else swaps.
    #[arg(long, value_delimiter = ',', conflicts_with = "canary_fraction")]
    pub canary: Vec<String>,
    /// Canaries as a fraction (0 < F ≤ 1) of the nodes that reported on the channel, at least
    /// one, picked by the component's digest.
    #[arg(long, value_name = "F")]
    pub canary_fraction: Option<f64>,
    /// Batches a canary feeds the new version beside the running one before comparing.
    #[arg(long, default_value_t = 20)]
    pub shadow_batches: u64,
    /// Longest a canary waits for those batches, in seconds (or `5m`); past it, it compares on
    /// what it saw and, short of the batches, tries again.
    #[arg(long, value_name = "SECS", default_value_t = 300, value_parser = super::units::secs)]
    pub shadow_wait: u64,
    /// Requests a canary's comparison may answer differently and still be clean.
    #[arg(long, default_value_t = 0)]
    pub tolerance: u64,
    /// Staged waves after the canaries, comma-separated, each a cumulative number of nodes or
    /// percentage of the nodes that reported on the channel (`1,10%,50%,100%`; the last is
    /// `100%`: every other node, known now or not). Each wave opens only once every node of the
    /// earlier ones ran the version cleanly for `--bake`; a wave that would add no node adds one
    /// while any is left.
    #[arg(long, value_delimiter = ',', value_name = "WAVES", requires = "bake")]
    pub waves: Vec<String>,
    /// How long each node of a wave runs the version cleanly before the next wave opens, in
    /// seconds (or `10m`), by each node's own clock; at most a week.
    #[arg(long, value_name = "SECS", requires = "waves",
          value_parser = super::units::secs_within::<0, { protocol::MAX_BAKE_S }>)]
    pub bake: Option<u64>,
    /// The channel.
    #[command(flatten)]
    pub channel: ChannelArgs,
}

/// Runs `foldhost guest …`.
pub(super) async fn cmd_guest(c: GuestCommand) -> anyhow::Result<()> {
    match c {
        GuestCommand::Publish(a) => publish(a).await,
        GuestCommand::History(a) => history(a).await,
        GuestCommand::Status(a) => status(a).await,
    }
}

async fn publish(a: GuestPublishArgs) -> anyhow::Result<()> {
    check_publish_args(&a)?;
    let (desired, bytes) = read_desired(&a.file).await?;
    let bus = a.channel.open(true).await?;
    let channel = &a.channel.channel;
    let current = bus.release(channel).await?;
    let reports = bus.reports(channel).await?;
    let state = current
        .as_ref()
        .map(|(n, e)| protocol::rollout(*n, e, &reports));
    if let (Some((n, e)), Some(s)) = (&current, &state)
        && e.desired.digest == desired.digest
        && !matches!(s, Rollout::Halted { .. })
    {
        println!(
            "channel {channel}: {} is already release {n}'s desired version ({}); nothing published",
            desired.label(),
            s.as_str()
        );
        return Ok(());
    }
    let canaries = match a.canary_fraction {
        Some(f) => {
            let nodes: Vec<String> = reports.iter().map(|r| r.node.clone()).collect();
            protocol::pick_canaries(f, &nodes, &desired.digest)
        }
        None => a.canary.clone(),
    };
    let previous = protocol::previous_for_publish(
        current
            .as_ref()
            .zip(state.as_ref())
            .map(|((_, e), s)| (e, s)),
    );
    let known: Vec<String> = reports.iter().map(|r| r.node.clone()).collect();
    let waves = if a.waves.is_empty() {
        Vec::new()
    } else {
        protocol::resolve_waves(&a.waves, &known, &canaries, &desired.digest)
            .map_err(|why| anyhow!("--waves {}: {why}", a.waves.join(",")))?
    };
    note_fallback(previous.is_some(), canaries.is_empty(), waves.len(), &a);
    let entry = ChannelEntry {
        desired,
        previous,
        canaries,
        canary_fraction: a.canary_fraction,
        shadow_batches: a.shadow_batches,
        shadow_wait_s: a.shadow_wait,
        tolerance: a.tolerance,
        published_unix_ms: foldhost_core::status::now_unix_ms(),
        waves,
        bake_s: a.bake.unwrap_or(0),
    };
    bus.put_component(&entry.desired, &bytes).await?;
    let mut release = bus
        .publish_release(channel, &entry, current.as_ref().map(|(n, _)| *n))
        .await?;
    if let Some((n, old)) = &current {
        release = republish_if_halted(&bus, channel, (*n, old), &entry, release).await?;
    }
    println!(
        "{}",
        serde_json::json!({
            "channel": channel,
            "release": release,
            "desired": entry.desired,
            "previous": entry.previous,
            "canaries": entry.canaries,
            "waves": entry.waves,
            "bake_s": entry.bake_s,
        })
    );
    Ok(())
}

/// `guest publish`'s rollout flags, each within its bounds.
fn check_publish_args(a: &GuestPublishArgs) -> anyhow::Result<()> {
    for c in &a.canary {
        if let Some(why) = protocol::name_refusal("--canary", c) {
            bail!("{why}");
        }
    }
    if a.canary.len() > protocol::MAX_CANARIES {
        bail!(
            "--canary: {} nodes (most {})",
            a.canary.len(),
            protocol::MAX_CANARIES
        );
    }
    if let Some(f) = a.canary_fraction
        && !(f > 0.0 && f <= 1.0)
    {
        bail!("--canary-fraction {f}: between 0 (exclusive) and 1");
    }
    if !a.waves.is_empty()
        && let Some(why) = protocol::waves_refusal(&a.waves)
    {
        bail!("--waves {}: {why}", a.waves.join(","));
    }
    if a.shadow_wait > protocol::MAX_SHADOW_WAIT_S {
        bail!(
            "--shadow-wait {}: at most {} seconds",
            a.shadow_wait,
            protocol::MAX_SHADOW_WAIT_S
        );
    }
    Ok(())
}

/// The component at `file`, and the version it is: its digest, its manifest's name and version,
/// its size.
async fn read_desired(file: &Path) -> anyhow::Result<(GuestVersion, Vec<u8>)> {
    let what = file.display().to_string();
    let bytes = read_component(file)?;
    let engine = foldhost_guest::guest::GuestEngine::new()?;
    let manifest = foldhost_guest::guest::GuestApply::read_manifest(&engine, &what, &bytes).await?;
    let desired = GuestVersion {
        digest: blake3::hash(&bytes).to_hex().to_string(),
        name: manifest.name,
        version: manifest.version,
        size: bytes.len() as u64,
    };
    Ok((desired, bytes))
}

/// Says when the release swaps every node at once: no previous version to run instead, or no
/// canary.
fn note_fallback(has_previous: bool, no_canary: bool, waves: usize, a: &GuestPublishArgs) {
    if !has_previous && waves > 0 {
        eprintln!(
            "note: no previous version to run instead: every node swaps at once (the waves wait for nothing)"
        );
    }
    if has_previous && no_canary && waves < 2 {
        eprintln!(
            "note: no canary (none named{}): every node swaps at once",
            if a.canary_fraction.is_some() {
                ", and no node reported on the channel yet"
            } else {
                ""
            }
        );
    }
}

/// A report halting the release this one replaces (`n`, `old`) may have come between the read
/// and the write: its version is then no last good one, and the new release falls back to its
/// own. The release number now current.
async fn republish_if_halted(
    bus: &ChannelBus,
    channel: &str,
    (n, old): (u64, &ChannelEntry),
    entry: &ChannelEntry,
    mut release: u64,
) -> anyhow::Result<u64> {
    if entry.previous.as_ref() == Some(&old.desired) {
        let reports = bus.reports(channel).await?;
        if let Rollout::Halted { by, why } = protocol::rollout(n, old, &reports) {
            let fixed = ChannelEntry {
                previous: old.previous.clone(),
                ..entry.clone()
            };
            eprintln!(
                "note: release {n} was halted by {by} ({why}) while this one was published: its previous is {} instead",
                fixed
                    .previous
                    .as_ref()
                    .map_or("none".into(), GuestVersion::label)
            );
            release = bus.publish_release(channel, &fixed, Some(release)).await?;
        }
    }
    Ok(release)
}

/// `[a,b] [c] [rest: d]`: a release's waves as `status` and `history` print them.
fn waves_line(e: &ChannelEntry) -> String {
    let last = e.waves.len();
    let waves: Vec<String> = e
        .waves
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let rest = if i + 1 == last { "rest: " } else { "" };
            format!("{}=[{rest}{}]", w.spec, w.nodes.join(","))
        })
        .collect();
    format!("waves {} bake {}s", waves.join(" "), e.bake_s)
}

/// The component at `path`, at most `protocol::MAX_COMPONENT_BYTES`.
fn read_component(path: &Path) -> anyhow::Result<Vec<u8>> {
    let len = std::fs::metadata(path)
        .with_context(|| path.display().to_string())?
        .len();
    if len > protocol::MAX_COMPONENT_BYTES {
        bail!(
            "{}: {len} bytes (a channel takes components of at most {} bytes)",
            path.display(),
            protocol::MAX_COMPONENT_BYTES
        );
    }
    std::fs::read(path).with_context(|| path.display().to_string())
}

async fn history(a: ChannelArgs) -> anyhow::Result<()> {
    let bus = a.open(false).await?;
    let releases = bus.history(&a.channel).await?;
    if releases.is_empty() {
        bail!("channel {}: nothing was published", a.channel);
    }
    for r in releases {
        if a.json {
            let entry = match &r.entry {
                Ok(e) => serde_json::to_value(e)?,
                Err(why) => serde_json::json!({ "undecodable": why }),
            };
            println!(
                "{}",
                serde_json::json!({"release": r.release, "stored_unix_ms": r.stored_unix_ms, "entry": entry})
            );
            continue;
        }
        let when = when(r.stored_unix_ms);
        match r.entry {
            Ok(e) => println!(
                "{:>6}  {when}  {}  canaries [{}]{}  previous {}",
                r.release,
                e.desired.label(),
                e.canaries.join(","),
                if e.waves.is_empty() {
                    String::new()
                } else {
                    format!("  {}", waves_line(&e))
                },
                e.previous
                    .as_ref()
                    .map_or("none".into(), GuestVersion::label)
            ),
            Err(why) => println!("{:>6}  {when}  undecodable: {why}", r.release),
        }
    }
    Ok(())
}

async fn status(a: ChannelArgs) -> anyhow::Result<()> {
    let bus = a.open(false).await?;
    let Some((release, entry)) = bus.release(&a.channel).await? else {
        bail!("channel {}: nothing was published", a.channel);
    };
    let reports = bus.reports(&a.channel).await?;
    let state = protocol::rollout(release, &entry, &reports);
    let running_desired = reports
        .iter()
        .filter(|r| r.running.as_ref().map(|v| &v.digest) == Some(&entry.desired.digest))
        .count();
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "channel": a.channel,
                "release": release,
                "state": state.as_str(),
                "halted": match &state { Rollout::Halted { by, why } => serde_json::json!({"by": by, "why": why}), _ => serde_json::Value::Null },
                "desired": entry.desired,
                "previous": entry.previous,
                "canaries": entry.canaries,
                "wave": match &state { Rollout::Wave { wave, of, baked, in_wave } => serde_json::json!({"wave": wave, "of": of, "baked": baked, "in_wave": in_wave, "unbaked": protocol::unbaked(release, &entry, &state, &reports)}), _ => serde_json::Value::Null },
                "entry": entry,
                "nodes": reports,
            })
        );
        return Ok(());
    }
    let detail = match &state {
        Rollout::Canary { clean, of } => format!("canary: {clean} of {of} canaries clean"),
        Rollout::Wave {
            wave,
            of,
            baked,
            in_wave,
        } => format!(
            "wave {wave} of {of}: {baked} of {in_wave} of its nodes baked ({}s), waiting for [{}]",
            entry.bake_s,
            protocol::unbaked(release, &entry, &state, &reports).join(",")
        ),
        Rollout::Rolling => "rolling".into(),
        Rollout::Halted { by, why } => format!("halted by {by} ({why})"),
    };
    println!(
        "channel {} release {release}: {} — {detail}; {running_desired} of {} nodes run it",
        a.channel,
        entry.desired.label(),
        reports.len()
    );
    if !entry.waves.is_empty() {
        println!("  {}", waves_line(&entry));
    }
    for r in &reports {
        print_report(r, release);
    }
    Ok(())
}

fn print_report(r: &NodeReport, release: u64) {
    let running = r
        .running
        .as_ref()
        .map_or("none".into(), GuestVersion::label);
    let of = if r.release == release {
        String::new()
    } else {
        format!(" (of release {})", r.release)
    };
    let detail = if r.detail.is_empty() {
        String::new()
    } else {
        format!(": {}", r.detail)
    };
    println!(
        "  {:<20} runs {running}  {}{}{of}{detail}  at {}",
        r.node,
        r.outcome.as_str(),
        if r.baked { ", baked" } else { "" },
        when(r.unix_ms)
    );
}

/// `unix_ms` as RFC 3339, or the number when it is out of range.
fn when(unix_ms: u64) -> String {
    foldhost_core::status::rfc3339(unix_ms.saturating_mul(1_000_000))
        .unwrap_or_else(|| unix_ms.to_string())
}
