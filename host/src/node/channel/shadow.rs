//! A canary's shadow (docs/channels.md, "Judgements"): the candidate beside the running guest,
//! judged by the fold's comparison, abandoned once the release is halted or replaced.

use std::time::Duration;

use futures::StreamExt as _;

use super::{Follower, SHADOW_SAMPLE, ShadowAnswer};
use foldhost_core::protocol::{self, ChannelEntry, GuestVersion, Judgement, Step};
use foldhost_fold::applied::{Control, ShadowPlan, ShadowRequests};
use foldhost_nats::channel::{ChannelChange, ChannelError};

impl Follower {
    /// A canary's shadow of `v`: promoted when clean (the node then runs it), judged by its
    /// report.
    pub(super) async fn shadow<W>(
        &mut self,
        release: u64,
        entry: &ChannelEntry,
        v: GuestVersion,
        watch: &mut W,
    ) where
        W: futures::Stream<Item = Result<ChannelChange, ChannelError>> + Unpin,
    {
        let Some(bytes) = self.fetched(release, &v, true).await else {
            return;
        };
        tracing::info!(event = "guest_channel_shadowing", channel = %self.gc.channel, release, guest = %v.label(), batches = entry.shadow_batches, "shadowing the release's version beside the running one (a canary)");
        let (tx, rx) = tokio::sync::oneshot::channel();
        let asked = Control::Shadow {
            bytes: bytes.clone(),
            what: v.label(),
            plan: ShadowPlan {
                batches: entry.shadow_batches,
                requests: ShadowRequests::Sample(SHADOW_SAMPLE),
                promote: true,
                tolerated: entry.tolerance,
                max_wait: Duration::from_secs(entry.shadow_wait_s.min(protocol::MAX_SHADOW_WAIT_S)),
            },
            reply: tx,
        };
        if self.control.send(asked).await.is_err() {
            return;
        }
        self.shadowing = Some(v.label());
        if let Some((r, e, s, _)) = self.decide() {
            self.show(Some((r, &e)), Some(&s));
        }
        let (outcome, abandoned) = self.await_shadow(rx, release, &v, watch).await;
        self.shadowing = None;
        match outcome {
            Err(_) => {}                  // the fold stopped
            Ok(Err(_)) if abandoned => {} // the release moved on: nothing to judge
            Ok(Err(e)) if e.says_nothing_of_the_candidate() => self.not_now(release, &e),
            Ok(Err(e)) => self.judge(release, Judgement::Trapped, e.to_string()),
            Ok(Ok(r)) if r.promoted => {
                self.now_running(v, bytes);
                self.retry = None;
                self.judge(
                    release,
                    Judgement::Clean,
                    format!(
                        "shadowed {} batches, {} requests, {} differing",
                        r.batches, r.requests, r.differing
                    ),
                );
            }
            Ok(Ok(r)) if r.differing > entry.tolerance => {
                let first = r.differences.first().map_or(String::new(), |d| {
                    format!(
                        "; first: {:?} live {} candidate {}",
                        d.request, d.live, d.candidate
                    )
                });
                self.judge(
                    release,
                    Judgement::Differed,
                    format!(
                        "{} of {} requests answered differently (tolerance {}){first}",
                        r.differing, r.requests, entry.tolerance
                    ),
                );
            }
            Ok(Ok(r)) => {
                // Inconclusive (too few batches or requests): shadow again later.
                self.retry_later(release);
                let why = r.not_promoted.unwrap_or_default();
                tracing::info!(event = "guest_channel_shadow_inconclusive", channel = %self.gc.channel, release, why = %why, "the shadow proved nothing either way; tried again");
                self.judge(release, Judgement::Pending, why);
            }
        }
    }

    /// Waits for the shadow of `v` to end, reading the channel meanwhile: once the release is
    /// halted or replaced (the step is no longer this shadow), the fold is asked to abandon it
    /// and its answer awaited still — so a promotion that raced the ask is never missed. Returns
    /// the answer and whether this follower asked to abandon it.
    async fn await_shadow<W>(
        &mut self,
        mut rx: tokio::sync::oneshot::Receiver<ShadowAnswer>,
        release: u64,
        v: &GuestVersion,
        watch: &mut W,
    ) -> (
        Result<ShadowAnswer, tokio::sync::oneshot::error::RecvError>,
        bool,
    )
    where
        W: futures::Stream<Item = Result<ChannelChange, ChannelError>> + Unpin,
    {
        let mut abandoning = false;
        loop {
            tokio::select! {
                biased;
                outcome = &mut rx => return (outcome, abandoning),
                change = watch.next(), if !abandoning && !self.watch_lost => {
                    match change {
                        Some(Ok(ChannelChange::Current)) => {}
                        Some(Ok(c)) => self.take(c),
                        Some(Err(e)) => {
                            self.said_error(Some(e.to_string()));
                            self.watch_lost = true;
                        }
                        None => {
                            self.said_error(Some("the channel's watch ended".into()));
                            self.watch_lost = true;
                        }
                    }
                    // A canary that cannot read its channel cannot hear a halt: it abandons the
                    // shadow too, and shadows again once the watch is back.
                    let decided = self.decide();
                    let still = !self.watch_lost
                        && matches!(
                            &decided,
                            Some((r, _, _, Step::Shadow(w))) if *r == release && w.digest == v.digest
                        );
                    if !still {
                        let why = match &decided {
                            _ if self.watch_lost => "the channel's watch failed".to_string(),
                            Some((r, _, s, _)) => format!("release {r} is {}", s.as_str()),
                            None => "no release".to_string(),
                        };
                        tracing::info!(event = "guest_channel_shadow_abandoned", channel = %self.gc.channel, release, guest = %v.label(), why = %why, "the release moved on while this canary shadowed it: the shadow is abandoned");
                        abandoning = true;
                        if self
                            .control
                            .send(Control::AbandonShadow { what: v.label() })
                            .await
                            .is_err()
                        {
                            return (rx.await, true);
                        }
                    }
                    if let Some((r, e, s, _)) = decided {
                        self.show(Some((r, &e)), Some(&s));
                    }
                }
            }
        }
    }
}
