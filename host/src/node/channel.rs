//! `run --guest-channel`: the node follows a guest channel (docs/channels.md). At start it runs
//! the version the channel's release gives a starting node (`protocol::start_version`); then a
//! side task watches the channel's release entry and every node's report, derives the rollout's
//! state with `protocol::rollout`, and takes the step `protocol::next_step` gives this node —
//! shadow a candidate (a canary), swap to the desired version, or return to the last good one —
//! through the fold's control channel, the machinery `foldhost swap` uses, with its refusals.
//!
//! Invariants:
//! - No component reaches the fold that was not verified against its digest
//!   ([`ChannelBus::fetch`]) and compiled off the fold's path first.
//! - A node never runs a release's desired version before the rollout allows it: a canary only
//!   through a shadow that promoted it, any other node only once the release rolls or its wave
//!   opened.
//! - This node reports `baked` only once it has run the release's desired version for the
//!   release's bake time by its own monotonic clock since it swapped to it, its judgement clean and
//!   no failed call of it counted; a restarted node keeps the `baked` of its own previous report
//!   while it runs that same version. No other node's clock is read.
//! - This node's report is the only key it writes; it says what the node runs and what it found
//!   of the current release, and it is rewritten whenever either changes (a failed write is
//!   tried again at the next tick), and when it leaves the bus (deleted, overwritten).
//! - A halt once read stands: a halting report of the current release deleted or overwritten
//!   since is still counted, so a halted release never resumes on this node.
//! - The follower never stops the fold: a bus it cannot reach, a record it cannot decode, an
//!   object it cannot fetch are said in the status and the log, and tried again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use tokio::sync::mpsc;

use foldhost_core::protocol::{
    self, ChannelEntry, GuestVersion, Judgement, NodeReport, Rollout, Step,
};
use foldhost_core::status::FoldStatus;
use foldhost_core::status::GuestChannelReport;
use foldhost_fold::applied::Control;
use foldhost_guest::guest::GuestEngine;
use foldhost_nats::channel::{ChannelBuckets, ChannelBus, ChannelChange, ChannelError};

/// What the fold answers a shadow.
type ShadowAnswer =
    Result<foldhost_fold::applied::ShadowReport, foldhost_fold::applied::ApplyError>;

use super::{NodeConfig, NodeError};

mod shadow;

/// The channel a node follows (`run --guest-channel`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestChannel {
    /// The channel's name.
    pub channel: String,
    /// Where the fleet keeps channels.
    pub buckets: ChannelBuckets,
    /// This node's name in the channel's reports (`--node-id`, else the host's name).
    pub node: String,
}

/// Requests a canary's comparison samples (keys changed during the shadow first).
const SHADOW_SAMPLE: usize = 200;

/// How often the follower checks the running guest for traps and retries what failed.
const TICK: Duration = Duration::from_secs(1);

/// What a node starting on a channel runs first, and what it read to decide it.
pub(super) struct ChannelStart {
    bus: ChannelBus,
    /// This node's name claim, won before the channel was read.
    claim: Arc<super::claim::NameClaim>,
    /// The version to start with, and its verified bytes.
    pub(super) version: GuestVersion,
    pub(super) bytes: Vec<u8>,
}

/// Reads the channel and fetches the version a starting node runs. Refused, naming the channel,
/// when nothing was published, when the only release is halted, or when the bytes cannot be
/// fetched or verified: the node does not start on a guest it could not prove. Then wins the
/// node's name claim (`claim.rs`): refused, naming the holder, while another process runs under
/// the name.
pub(super) async fn start(cfg: &NodeConfig, gc: &GuestChannel) -> Result<ChannelStart, NodeError> {
    let refused =
        |why: String| NodeError::Refused(format!("--guest-channel {}: {why}", gc.channel));
    let (bus, client) = open_bus(cfg, gc)
        .await
        .map_err(|e| refused(e.to_string()))?;
    let Some((release, entry)) = bus
        .release(&gc.channel)
        .await
        .map_err(|e| refused(e.to_string()))?
    else {
        return Err(refused(
            "nothing was published (foldhost guest publish FILE --channel NAME)".into(),
        ));
    };
    let reports = bus
        .reports(&gc.channel)
        .await
        .map_err(|e| refused(e.to_string()))?;
    let state = protocol::rollout(release, &entry, &reports);
    let Some(version) = protocol::start_version(&entry, &state, &gc.node).cloned() else {
        return Err(refused(format!(
            "release {release} ({}) is {} and no earlier version was good",
            entry.desired.label(),
            state.as_str()
        )));
    };
    let bytes = bus
        .fetch(&version, protocol::MAX_COMPONENT_BYTES)
        .await
        .map_err(|e| refused(format!("release {release}: {}: {e}", version.label())))?;
    // Claimed only once the start is otherwise sure: a refused start leaves no claim behind.
    let claim = super::claim::NameClaim::win(cfg, gc, client).await?;
    tracing::info!(event = "guest_channel_start", channel = %gc.channel, node = %gc.node, release, state = state.as_str(), guest = %version.label(), "starting on the channel's version");
    Ok(ChannelStart {
        bus,
        claim,
        version,
        bytes,
    })
}

async fn open_bus(
    cfg: &NodeConfig,
    gc: &GuestChannel,
) -> Result<(ChannelBus, async_nats::Client), ChannelError> {
    let mut opts = cfg.nats.clone();
    opts.op_timeout = cfg.op_timeout;
    let client = foldhost_nats::NatsConnection::new(opts)
        .dial_another()
        .await
        .map_err(|e| ChannelError::Bus {
            op: "connect".into(),
            reason: e.to_string(),
        })?;
    let bus = ChannelBus::open(client.clone(), &gc.buckets, false, cfg.op_timeout).await?;
    Ok((bus, client))
}

/// The follower: what it holds between steps.
pub(super) struct Follower {
    bus: ChannelBus,
    /// This node's name claim: once another process takes it, the follower stops; while it is
    /// not valid, the follower takes no step and writes no report.
    claim: Arc<super::claim::NameClaim>,
    /// The follower said its claim was not valid (cleared once it is again).
    claim_paused: bool,
    gc: GuestChannel,
    engine: Arc<GuestEngine>,
    control: mpsc::Sender<Control>,
    status: Arc<FoldStatus>,
    /// What the fold runs, as far as this follower made it so.
    running: GuestVersion,
    /// The bytes of what runs (a rollback's target is usually what ran before).
    kept: BTreeMap<String, Vec<u8>>,
    /// What this node found of the release it last judged: (release, judgement, detail).
    mine: Option<(u64, Judgement, String)>,
    /// The report last written (rewritten when it differs from the one due).
    written: Option<NodeReport>,
    /// The release whose failed fetch or inconclusive shadow is tried again, when, and the
    /// failures in a row.
    retry: Option<(u64, Instant, u32)>,
    /// The running guest's failed calls when it was swapped in (a rise is a trap).
    failures_at_swap: u64,
    /// When the running version started running here (this process's monotonic clock): its bake
    /// counts from then.
    running_since: Instant,
    /// A release and digest this node's own report on the bus said it baked (kept across a
    /// restart while the node runs that digest).
    baked_kept: Option<(u64, String)>,
    /// This process wrote a report: a bake read from the bus after that is not its own.
    wrote_any: bool,
    /// The halting reports read, by node (of the current release and later ones).
    halts_seen: BTreeMap<String, NodeReport>,
    /// The checks of the running version's failed calls so far.
    checks: u64,
    /// The version this node shadows now (a canary's trial), while it does.
    shadowing: Option<String>,
    /// The watch failed or ended while a shadow waited: it is opened again once the step ends.
    watch_lost: bool,
    /// The release and entry last read, and every node's report.
    release: Option<(u64, ChannelEntry)>,
    reports: BTreeMap<String, NodeReport>,
}

impl Follower {
    /// The follower of a node that started on `start`.
    pub(super) fn new(
        start: ChannelStart,
        gc: GuestChannel,
        engine: Arc<GuestEngine>,
        control: mpsc::Sender<Control>,
        status: Arc<FoldStatus>,
    ) -> Self {
        // The fold's status is this process's: every failed call of the version it started with
        // counts, those before the follower was built (a trap while hydrating) included.
        let failures_at_swap = 0;
        let mut kept = BTreeMap::new();
        kept.insert(start.version.digest.clone(), start.bytes);
        Follower {
            bus: start.bus,
            claim: start.claim,
            claim_paused: false,
            gc,
            engine,
            control,
            status,
            running: start.version,
            kept,
            mine: None,
            written: None,
            retry: None,
            failures_at_swap,
            running_since: Instant::now(),
            baked_kept: None,
            wrote_any: false,
            halts_seen: BTreeMap::new(),
            checks: 0,
            shadowing: None,
            watch_lost: false,
            release: None,
            reports: BTreeMap::new(),
        }
    }

    /// This node's name claim (renewed and freed beside the follower).
    pub(super) fn claim(&self) -> Arc<super::claim::NameClaim> {
        self.claim.clone()
    }

    /// Follows the channel until the node stops (the task is aborted) or another process takes
    /// its name's claim over.
    pub(super) async fn run(mut self) {
        tracing::info!(event = "guest_channel_following", channel = %self.gc.channel, node = %self.gc.node, guest = %self.running.label(), "following the guest channel");
        let mut watch_failures = 0u32;
        loop {
            let mut watch = match self.bus.watch(&self.gc.channel).await {
                Ok(w) => w,
                Err(e) => {
                    self.said_error(Some(e.to_string()));
                    watch_failures += 1;
                    tokio::time::sleep(protocol::Backoff::CHANNEL_RETRY.after(watch_failures))
                        .await;
                    continue;
                }
            };
            self.release = None;
            self.reports.clear();
            // The bus may have lost this node's report while the watch was down: write it again.
            self.written = None;
            let mut current = false;
            let mut tick = tokio::time::interval(TICK);
            // After a long step (a shadow), one tick, not a burst of the ones missed.
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    change = watch.next() => match change {
                        Some(Ok(ChannelChange::Current)) => {
                            current = true;
                            watch_failures = 0;
                            self.said_error(None);
                            self.act(&mut watch).await;
                            if std::mem::take(&mut self.watch_lost) {
                                break;
                            }
                        }
                        Some(Ok(c)) => {
                            self.take(c);
                        }
                        Some(Err(e)) => {
                            self.said_error(Some(e.to_string()));
                            break;
                        }
                        None => {
                            self.said_error(Some("the channel's watch ended".into()));
                            break;
                        }
                    },
                    _ = tick.tick() => {
                        if let Some(holder) = self.claim.lost_to() {
                            self.said_error(Some(format!("node name {:?} was taken over by {} (this node could not renew its claim in time): the node keeps its version and no longer follows the channel", self.gc.node, super::claim::quoted(holder))));
                            return;
                        }
                        if !self.claim.valid() {
                            self.claim_paused = true;
                            self.said_error(Some(format!("node name {:?}: its claim was not renewed lately: the node takes no step and writes no report until it is", self.gc.node)));
                        } else if std::mem::take(&mut self.claim_paused) {
                            self.said_error(None);
                        }
                        if current {
                            self.check_traps();
                            self.act(&mut watch).await;
                            if std::mem::take(&mut self.watch_lost) {
                                break;
                            }
                        }
                    }
                }
            }
            watch_failures += 1;
            tokio::time::sleep(protocol::Backoff::CHANNEL_RETRY.after(watch_failures)).await;
        }
    }

    /// Takes one change of the channel into the follower's view.
    fn take(&mut self, c: ChannelChange) {
        match c {
            ChannelChange::Release(n, Ok(e)) => {
                // Only the current release's halts are kept.
                self.halts_seen.retain(|_, r| r.release >= n);
                self.release = Some((n, e));
            }
            ChannelChange::Release(n, Err(why)) => {
                tracing::warn!(event = "channel_record_undecodable", key = %protocol::release_key(&self.gc.channel), release = n, error = %why, "the channel's release entry does not decode; the node keeps its version");
                self.release = None;
                self.said_error(Some(format!("release {n} does not decode: {why}")));
            }
            ChannelChange::ReleaseGone => self.release = None,
            ChannelChange::Report(node, Ok(r)) => {
                if node == self.gc.node {
                    self.own_report_read(&r);
                }
                if r.outcome.halts() {
                    self.halts_seen.insert(node.clone(), r.clone());
                }
                self.reports.insert(node, r);
            }
            ChannelChange::Report(node, Err(why)) => {
                tracing::warn!(event = "channel_record_undecodable", key = %protocol::report_key(&self.gc.channel, &node), error = %why, "a node report does not decode; left out");
                self.own_report_lost(&node);
                self.reports.remove(&node);
            }
            ChannelChange::ReportGone(node) => {
                self.own_report_lost(&node);
                self.reports.remove(&node);
            }
            ChannelChange::Current => {}
        }
    }

    /// `node`'s report left the bus (deleted, purged or overwritten with what does not decode):
    /// when it is this node's, it is written again, so a halt or a bake it reported stands.
    fn own_report_lost(&mut self, node: &str) {
        if node == self.gc.node {
            self.written = None;
        }
    }

    /// This node's report as the bus holds it. A judgement this process has not made (it was
    /// made before a restart) is taken as its own when it says something of the version —
    /// `clean`, or one that halts: a restarted node never erases the halt it reported. A copy
    /// other than the one last written is written again.
    fn own_report_read(&mut self, r: &NodeReport) {
        let newer = self
            .mine
            .as_ref()
            .is_none_or(|(rel, _, _)| *rel < r.release);
        if newer && (r.outcome == Judgement::Clean || r.outcome.halts()) {
            self.mine = Some((r.release, r.outcome, r.detail.clone()));
        }
        // A bake this node reported before this process wrote anything (a restart) is kept while
        // it runs the version it baked; a copy read later is not taken as its own (anyone can
        // write it).
        if r.baked
            && !self.wrote_any
            && r.outcome == Judgement::Clean
            && r.running.as_ref().map(|v| &v.digest) == Some(&self.running.digest)
        {
            self.baked_kept = Some((r.release, self.running.digest.clone()));
        }
        let mut unstamped = r.clone();
        unstamped.unix_ms = 0;
        if self.written.as_ref() != Some(&unstamped) {
            self.written = None;
        }
    }

    /// The current release and its state, this node's judgement of it, and the step to take.
    fn decide(&self) -> Option<(u64, ChannelEntry, Rollout, Step)> {
        let (release, entry) = self.release.clone()?;
        let mut reports: Vec<NodeReport> = self.reports.values().cloned().collect();
        // This node's own judgement counts at once, before its report comes back on the watch.
        reports.retain(|r| r.node != self.gc.node);
        if let Some(mine) = self.report_due(release) {
            reports.push(mine);
        }
        // A halt once read stands: a halting report deleted or overwritten since (by anyone) is
        // still counted, so a halted release never resumes here.
        for (node, halt) in &self.halts_seen {
            if halt.release == release
                && !reports.iter().any(|r| &r.node == node && r.outcome.halts())
            {
                reports.retain(|r| &r.node != node);
                reports.push(halt.clone());
            }
        }
        let state = protocol::rollout(release, &entry, &reports);
        let mine = self.judged(release).map(|(j, _)| j);
        let step = protocol::next_step(
            &entry,
            &state,
            &self.gc.node,
            Some(&self.running.digest),
            mine,
        );
        Some((release, entry, state, step))
    }

    /// Takes the next step, if one is due, and keeps the status and this node's report current.
    /// `watch` is read while a shadow waits (a halt or a new release abandons it).
    async fn act<W>(&mut self, watch: &mut W)
    where
        W: futures::Stream<Item = Result<ChannelChange, ChannelError>> + Unpin,
    {
        if !self.claim.valid() {
            // No step on a name this node may no longer hold (`claim.rs`).
            return;
        }
        let Some((release, entry, state, step)) = self.decide() else {
            self.show(None, None);
            self.write_report().await;
            return;
        };
        self.show(Some((release, &entry)), Some(&state));
        let due = match self.retry {
            Some((r, at, _)) => r != release || Instant::now() >= at,
            None => true,
        };
        // Said before a step that may take long (a shadow waits for its batches).
        self.write_report().await;
        match step {
            Step::Stay => {}
            Step::Shadow(v) if due => self.shadow(release, &entry, v, watch).await,
            Step::Swap(v) if due => self.swap(release, &entry, v).await,
            Step::Shadow(_) | Step::Swap(_) => {}
        }
        if let Some((release, entry, state, _)) = self.decide() {
            self.show(Some((release, &entry)), Some(&state));
        }
        self.write_report().await;
    }

    /// This node's judgement of `release`, if it judged it.
    fn judged(&self, release: u64) -> Option<(Judgement, &str)> {
        match &self.mine {
            Some((r, j, d)) if *r == release => Some((*j, d.as_str())),
            _ => None,
        }
    }

    fn judge(&mut self, release: u64, j: Judgement, detail: String) {
        let detail = protocol::report_detail(&detail);
        match j {
            Judgement::Clean => {
                tracing::info!(event = "guest_channel_judged", channel = %self.gc.channel, release, judgement = j.as_str(), detail = %detail, "judged the release")
            }
            Judgement::Pending => {}
            _ => {
                tracing::warn!(event = "guest_channel_judged_bad", channel = %self.gc.channel, release, judgement = j.as_str(), detail = %detail, "judged the release: not clean")
            }
        }
        self.mine = Some((release, j, detail));
    }

    /// The report this node owes: its judgement of `release` (pending if none yet; clean once
    /// it runs the release's desired version without a worse judgement) and what it runs.
    fn report_due(&self, release: u64) -> Option<NodeReport> {
        let (_, entry) = self.release.as_ref()?;
        let (judgement, detail) = match self.judged(release) {
            Some((j, d)) => (j, d.to_string()),
            None if self.running.digest == entry.desired.digest => {
                (Judgement::Clean, String::new())
            }
            None => (Judgement::Pending, String::new()),
        };
        Some(NodeReport {
            node: self.gc.node.clone(),
            release,
            outcome: judgement,
            detail,
            running: Some(self.running.clone()),
            unix_ms: 0,
            baked: judgement == Judgement::Clean && self.baked(release, entry),
        })
    }

    /// Whether this node baked `release` (of `entry`): it runs the desired version, has counted
    /// no failed call of it since it swapped, and either ran it for the bake time by this
    /// process's clock or reported it baked before (a restart).
    fn baked(&self, release: u64, entry: &ChannelEntry) -> bool {
        let digest = &entry.desired.digest;
        self.running.digest == *digest
            && failures(&self.status) <= self.failures_at_swap
            && !foldhost_core::crashpoint::gated(foldhost_core::crashpoint::CHANNEL_BAKE)
            && (self.running_since.elapsed() >= Duration::from_secs(entry.bake_s)
                || self.baked_kept.as_ref() == Some(&(release, digest.clone())))
    }

    async fn write_report(&mut self) {
        let Some((release, _)) = &self.release else {
            return;
        };
        if !self.claim.valid() {
            // The name may be another process's now: its report is not this node's to write.
            return;
        }
        let Some(mut due) = self.report_due(*release) else {
            return;
        };
        if self.written.as_ref() == Some(&due) {
            return;
        }
        let unstamped = due.clone();
        due.unix_ms = foldhost_core::status::now_unix_ms();
        match self.bus.put_report(&self.gc.channel, &due).await {
            Ok(()) => {
                self.written = Some(unstamped);
                self.wrote_any = true;
            }
            Err(e) => {
                tracing::warn!(event = "guest_channel_report_failed", channel = %self.gc.channel, error = %e, "this node's report was not written; tried again at the next tick")
            }
        }
    }

    /// Sets the retry of `release` after one more failure in a row.
    fn retry_later(&mut self, release: u64) {
        let n = match self.retry {
            Some((r, _, n)) if r == release => n + 1,
            _ => 1,
        };
        self.retry = Some((
            release,
            Instant::now() + protocol::Backoff::CHANNEL_RETRY.after(n),
            n,
        ));
    }

    /// Fetches `v` (kept bytes first) and compiles it off the fold's path. A failure is tried
    /// again later; it judges the release only when `v` is its desired version (`judging`).
    async fn fetched(&mut self, release: u64, v: &GuestVersion, judging: bool) -> Option<Vec<u8>> {
        let bytes = match self.kept.get(&v.digest) {
            Some(b) => b.clone(),
            None => match self.bus.fetch(v, protocol::MAX_COMPONENT_BYTES).await {
                Ok(b) => b,
                Err(e) => {
                    self.retry_later(release);
                    tracing::warn!(event = "guest_channel_unfetchable", channel = %self.gc.channel, release, guest = %v.label(), error = %e, "the version could not be fetched; the running guest stays");
                    if judging {
                        self.judge(release, Judgement::Unfetchable, e.to_string());
                    }
                    return None;
                }
            },
        };
        let compiled = {
            let (engine, bytes, what) = (self.engine.clone(), bytes.clone(), v.label());
            tokio::task::spawn_blocking(move || engine.prepare(&what, &bytes).map(|_| ()))
                .await
                .unwrap_or_else(|e| {
                    Err(foldhost_guest::guest::GuestError::Engine(format!(
                        "compile task: {e}"
                    )))
                })
        };
        match compiled {
            Ok(()) => Some(bytes),
            Err(e) => {
                self.retry_later(release);
                tracing::warn!(event = "guest_channel_refused", channel = %self.gc.channel, release, guest = %v.label(), error = %e, "the version does not compile or link; the running guest stays");
                if judging {
                    self.judge(release, Judgement::Refused, e.to_string());
                }
                None
            }
        }
    }

    /// Swaps the fold to `v`: the release's desired version (judged by the swap), or the last
    /// good one (a return).
    async fn swap(&mut self, release: u64, entry: &ChannelEntry, v: GuestVersion) {
        let forward = v.digest == entry.desired.digest;
        let Some(bytes) = self.fetched(release, &v, forward).await else {
            return;
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let asked = Control::Swap {
            bytes: bytes.clone(),
            what: v.label(),
            reply: tx,
        };
        if self.control.send(asked).await.is_err() {
            return;
        }
        match rx.await {
            Err(_) => {}
            Ok(Err(e)) if e.says_nothing_of_the_candidate() => self.not_now(release, &e),
            Ok(Err(e)) if forward => self.judge(release, Judgement::Refused, e.to_string()),
            Ok(Err(e)) => {
                self.retry_later(release);
                tracing::error!(event = "guest_channel_return_failed", channel = %self.gc.channel, release, guest = %v.label(), error = %e, "the return to the last good version was refused; the running guest stays");
                self.said_error(Some(format!(
                    "the return to {} was refused: {e}",
                    v.label()
                )));
            }
            Ok(Ok(_)) => {
                let from = self.running.label();
                self.now_running(v.clone(), bytes);
                self.retry = None;
                if forward {
                    tracing::info!(event = "guest_channel_swapped", channel = %self.gc.channel, release, from = %from, to = %v.label(), "swapped to the release's version");
                    self.judge(release, Judgement::Clean, String::new());
                } else {
                    tracing::warn!(event = "guest_channel_returned", channel = %self.gc.channel, release, from = %from, to = %v.label(), "returned to the last good version");
                }
            }
        }
    }

    /// A swap or shadow the node could not run now, for a reason of its own (another swap in
    /// progress, the fold's change capture overflowed): nothing judged, tried again later.
    fn not_now(&mut self, release: u64, e: &foldhost_fold::applied::ApplyError) {
        self.retry_later(release);
        tracing::info!(event = "guest_channel_step_deferred", channel = %self.gc.channel, release, error = %e, "the node could not take its step now; tried again later");
    }

    fn now_running(&mut self, v: GuestVersion, bytes: Vec<u8>) {
        // Keep what ran (a return's usual target) and what runs now; nothing more.
        let previous = self.running.digest.clone();
        self.kept.retain(|d, _| *d == previous);
        self.kept.insert(v.digest.clone(), bytes);
        self.running = v;
        self.failures_at_swap = failures(&self.status);
        self.running_since = Instant::now();
        self.baked_kept = None;
    }

    /// A trap (or a deadline hit) of the running guest after it was swapped in to the current
    /// release's desired version judges that release `trapped`.
    fn check_traps(&mut self) {
        self.checks += 1;
        let Some((release, entry)) = self.release.clone() else {
            return;
        };
        if self.running.digest != entry.desired.digest {
            return;
        }
        if matches!(self.judged(release), Some((j, _)) if j.halts()) {
            return;
        }
        let now = failures(&self.status);
        if now > self.failures_at_swap {
            let n = now - self.failures_at_swap;
            self.judge(
                release,
                Judgement::Trapped,
                format!(
                    "{n} guest calls trapped, hit their deadline or a resource cap since the swap"
                ),
            );
        }
    }

    /// Shows the follower's view in the fold's status.
    fn show(&self, current: Option<(u64, &ChannelEntry)>, state: Option<&Rollout>) {
        let mut r = GuestChannelReport {
            channel: self.gc.channel.clone(),
            node: self.gc.node.clone(),
            running: Some(self.running.label()),
            running_digest: Some(self.running.digest.clone()),
            failed_calls: failures(&self.status).saturating_sub(self.failures_at_swap),
            checks: self.checks,
            shadowing: self.shadowing.clone(),
            ..GuestChannelReport::default()
        };
        r.state = state.map_or("unpublished", Rollout::as_str).to_string();
        if let Some((release, entry)) = current {
            if let Some(Rollout::Wave {
                wave,
                of,
                baked,
                in_wave,
            }) = state
            {
                r.wave = Some(format!(
                    "{wave} of {of} ({baked} of {in_wave} baked; this node's wave: {})",
                    protocol::wave_of(entry, &self.gc.node)
                ));
            }
            r.baked = self.report_due(release).is_some_and(|d| d.baked);
            r.release = release;
            r.desired = Some(entry.desired.label());
            r.desired_digest = Some(entry.desired.digest.clone());
            r.canary = entry.canaries.contains(&self.gc.node);
            if let Some((j, d)) = self.judged(release) {
                r.judgement = j.as_str().to_string();
                r.detail = d.to_string();
            }
        }
        if let Some(Rollout::Halted { by, why }) = state {
            r.halted_by = Some(format!("{by}: {why}"));
        }
        if let Ok(mut slot) = self.status.guest_channel.lock() {
            r.error = slot.as_ref().and_then(|s| s.error.clone());
            *slot = Some(r);
        }
    }

    fn said_error(&self, error: Option<String>) {
        if let Some(e) = &error {
            tracing::warn!(event = "guest_channel_watch_failed", channel = %self.gc.channel, error = %e, "the channel could not be read; the node keeps its version and tries again");
        }
        if let Ok(mut slot) = self.status.guest_channel.lock() {
            let r = slot.get_or_insert_with(|| GuestChannelReport {
                channel: self.gc.channel.clone(),
                node: self.gc.node.clone(),
                state: "unknown".into(),
                running: Some(self.running.label()),
                running_digest: Some(self.running.digest.clone()),
                ..GuestChannelReport::default()
            });
            r.error = error;
        }
    }
}

/// The failed calls that judge the running version: its traps, deadline hits and resource caps,
/// never a local trial's (an operator's `swap` or `--shadow` candidate).
fn failures(status: &FoldStatus) -> u64 {
    status
        .guest_counters
        .running_failures
        .load(Ordering::Relaxed)
}
