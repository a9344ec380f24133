//! The fold loop's hot swap and shadow: a candidate built beside the running applier from the fold
//! at a cursor C, caught up in rounds beside the fold, and then either switched in at a batch
//! boundary (a swap) or — a shadow — fed what the fold's next N batches change as well (each
//! changed key once, with its value when it is handed over, as a swap's catch-up does; not
//! `on-applied`), compared with the running applier on the same requests at the same cursor, and
//! dropped or (asked, with the evidence [`protocol::shadow_promotion`] requires) switched in.
//!
//! Invariants:
//! - The running applier and the fold never notice a candidate that fails: every failure (a bad
//!   component, a trap while hydrating, catching up or answering, a scope change, a capture that
//!   overflowed) ends the swap or the shadow with its reason and leaves both as they were.
//! - Only the end runs on the fold's path (settle, the last catch-up, then the switch or the
//!   comparison): `paused_ms`. Hydration and the rounds before it run in a task of their own.
//! - Nothing is applied twice or skipped: the candidate is hydrated at C, then handed each key
//!   whose view changed since, once, with its value when it is handed over
//!   ([`PreImages::catch_up`]); the comparison and the switch happen with the fold settled, so both
//!   sides stand at the same committed cursor.
//! - A shadow is never promoted by itself: only with `promote` asked, every batch asked for seen,
//!   at least one request asked, none answered differently, and the caller still waiting for the
//!   answer. A shadow whose caller went away, or asked to abandon it, ends without promoting.
//! - No catch-up round restarts the capture while a failed commit waits for its retry: its keys
//!   are recorded in the running capture only.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::applied::{
    AppliedError, Apply, ApplyError, ShadowPlan, ShadowReport, ShadowRequests, SwapCandidate,
    SwapReport,
};
use crate::applied::{MAX_SHADOW_QUOTE, MAX_SHADOW_REQUESTS};
use foldhost_core::kv::WatchScope;
use foldhost_core::protocol::{self, ShadowStep};
use foldhost_core::snapshot::{SnapshotError, SnapshotStore};
use foldhost_core::view::{FoldRead, PreImages};

use super::{AbortOnDrop, FoldLoop, Turn};

mod compare;

/// Where a swap's outcome goes.
pub(super) type SwapReply = tokio::sync::oneshot::Sender<Result<SwapReport, ApplyError>>;
/// Where a shadow's outcome goes.
pub(super) type ShadowReply = tokio::sync::oneshot::Sender<Result<ShadowReport, ApplyError>>;

/// What a candidate's task hands back: the candidate, and how many entries or updates it took
/// (or why it failed).
type CandidateRun = (Box<dyn SwapCandidate>, Result<u64, ApplyError>);

/// A hydration's end: the candidate back with what its hydration said, or the task's failure.
pub(super) type Hydrated = Result<CandidateRun, tokio::task::JoinError>;

/// A swap or a shadow whose candidate is built beside the running applier. Dropped (the loop
/// ended, or it finished), it aborts the candidate's task and ends the pre-image capture.
pub(super) struct PendingSwap {
    /// The candidate's hydration or catch-up round, while one runs.
    task: Option<AbortOnDrop<CandidateRun>>,
    /// A shadow's candidate, level with its capture, waiting for the fold's batches.
    parked: Option<Box<dyn SwapCandidate>>,
    /// Taken when the outcome is sent; dropped unsent, the requester hears the fold stopped.
    reply: Option<SwapReply>,
    /// Present for a shadow.
    shadow: Option<PendingShadow>,
    what: String,
    from: String,
    began: Instant,
    /// The candidate's view of the fold.
    view: Arc<dyn FoldRead>,
    /// Entries hydrated and the hydration's milliseconds, once it ended.
    entries: Option<(u64, u64)>,
    /// Catch-up rounds run beside the fold, and the updates they applied.
    rounds: u32,
    caught_up: u64,
    /// Restarts the capture at the cursor now, moving the candidate's view to it.
    restart: Box<dyn Fn() -> Result<Option<PreImages>, SnapshotError> + Send>,
    /// Ends the capture.
    store: Box<dyn Fn() + Send>,
}

/// What a shadow keeps beside its pending swap.
pub(super) struct PendingShadow {
    plan: ShadowPlan,
    reply: Option<ShadowReply>,
    /// The fold's committed batches when the shadow began.
    batches_at_start: u64,
    /// When the wait for the batches runs out.
    deadline: Instant,
    /// Catch-up rounds since every batch asked for was seen.
    rounds_after: u32,
    /// Keys changed during the shadow (the first of the sample), at most the sample's size.
    changed: Vec<String>,
}

impl Drop for PendingSwap {
    fn drop(&mut self) {
        (self.store)();
    }
}

/// Waits for the pending swap's task (forever when none runs).
pub(super) async fn hydrated(swap: &mut Option<PendingSwap>) -> Hydrated {
    match swap {
        Some(PendingSwap {
            task: Some(task), ..
        }) => (&mut task.0).await,
        _ => std::future::pending().await,
    }
}

/// The refusal of a swap to `what`, with `e` as the reason.
fn refused(from: &str, what: &str, e: &ApplyError) -> ApplyError {
    ApplyError {
        applier: from.to_string(),
        call: kept_call(e, "swap"),
        message: format!("{what} refused, {from} keeps running: {e}"),
    }
}

/// What the status keeps of a completed swap (`kind`: `swap`, or `shadow` for a promoted one),
/// completed now.
fn swapped(from: &str, to: &str, paused_ms: u64, kind: &str) -> foldhost_core::status::SwapRecord {
    foldhost_core::status::SwapRecord {
        from: from.to_string(),
        to: to.to_string(),
        unix_ms: foldhost_core::status::now_unix_ms(),
        paused_ms,
        kind: kind.to_string(),
    }
}

/// The failure of a shadow of `what`, with `e` as the reason.
fn shadow_failed(from: &str, what: &str, e: &ApplyError) -> ApplyError {
    ApplyError {
        applier: from.to_string(),
        call: kept_call(e, "shadow"),
        message: format!("the shadow of {what} failed, {from} keeps running untouched: {e}"),
    }
}

/// `call`, unless `e` is the node's own condition ([`crate::applied::NODE_CONDITION`]), which the
/// wrapping error keeps so its caller can tell it from the candidate's failure.
fn kept_call(e: &ApplyError, call: &'static str) -> &'static str {
    if e.says_nothing_of_the_candidate() {
        crate::applied::NODE_CONDITION
    } else {
        call
    }
}

/// The node's own condition ended the swap or shadow of `c` (not the candidate's failure).
fn node_condition(c: &dyn SwapCandidate, message: String) -> ApplyError {
    ApplyError {
        applier: c.describe(),
        call: crate::applied::NODE_CONDITION,
        message,
    }
}

/// Why a swap whose capture overflowed is refused.
fn overflow_message() -> String {
    format!(
        "the fold changed more than {} keys or {} MiB beside the candidate; retry when fewer keys change",
        foldhost_core::view::MAX_PRE_IMAGE_KEYS,
        foldhost_core::view::MAX_PRE_IMAGE_BYTES >> 20
    )
}

pub(super) fn store_err(last: SnapshotError) -> AppliedError {
    AppliedError::Store { streak: 0, last }
}

/// An answer as a report quotes it: `ok: …` or `error: …`, cut at [`MAX_SHADOW_QUOTE`] bytes.
fn quote(answer: &Result<Vec<u8>, String>) -> String {
    let (tag, text) = match answer {
        Ok(bytes) => ("ok", String::from_utf8_lossy(bytes).into_owned()),
        Err(message) => ("error", message.clone()),
    };
    let mut end = text.len().min(MAX_SHADOW_QUOTE);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let cut = if end < text.len() { "…" } else { "" };
    format!("{tag}: {}{cut}", &text[..end])
}

/// `key` as a sampled request: without the scope prefix it matched (all of it for a whole-bucket
/// scope). Pure.
pub(crate) fn sample_request(scope: &WatchScope, key: &str) -> Vec<u8> {
    let stripped = match scope {
        WatchScope::All => key,
        WatchScope::Prefix(p) => key.strip_prefix(p.as_str()).unwrap_or(key),
        WatchScope::Prefixes(ps) => ps
            .iter()
            .find_map(|p| key.strip_prefix(p.as_str()))
            .unwrap_or(key),
    };
    stripped.as_bytes().to_vec()
}

/// The prefixes a sample reads the fold under (one empty prefix for the whole bucket), each key
/// under one of them only (overlapping prefixes would sample a key twice).
fn scan_prefixes(scope: &WatchScope) -> Vec<String> {
    scope.disjoint_prefixes()
}

impl<S: SnapshotStore, A: Apply + ?Sized> FoldLoop<'_, S, A> {
    /// A swap's first half: settle (so the candidate's view starts at the committed fold with
    /// nothing applied and uncommitted), start the pre-image capture at that cursor C, and hydrate
    /// the candidate from the fold at C in a task of its own, beside the running applier. The fold
    /// goes on at once; the end ([`FoldLoop::cut_over`], or a shadow's comparison) follows when the
    /// candidate is level.
    pub(super) async fn start_swap(
        &mut self,
        bytes: Vec<u8>,
        what: String,
        reply: SwapReply,
        t: &mut Turn,
    ) -> Result<(), AppliedError> {
        let from = self.apply.describe();
        if let Some(busy) = self.busy_with_swap(&what) {
            let _ = reply.send(Err(busy));
            return Ok(());
        }
        if let Err(e) = self.begin_candidate(bytes, what.clone(), t).await? {
            tracing::warn!(event = "swap_refused", error = %e, "swap refused; the running guest stays");
            let _ = reply.send(Err(refused(&from, &what, &e)));
            return Ok(());
        }
        if let Some(p) = self.swap.as_mut() {
            p.reply = Some(reply);
        }
        Ok(())
    }

    /// A shadow's first half: as a swap's, with the plan kept beside it.
    pub(super) async fn start_shadow(
        &mut self,
        bytes: Vec<u8>,
        what: String,
        plan: ShadowPlan,
        reply: ShadowReply,
        t: &mut Turn,
    ) -> Result<(), AppliedError> {
        let from = self.apply.describe();
        if let Some(busy) = self.busy_with_swap(&what) {
            let _ = reply.send(Err(busy));
            return Ok(());
        }
        if let Err(e) = self.begin_candidate(bytes, what.clone(), t).await? {
            tracing::warn!(event = "shadow_refused", error = %e, "shadow refused; the running guest stays");
            let _ = reply.send(Err(shadow_failed(&from, &what, &e)));
            return Ok(());
        }
        let batches_at_start = self.status.batches.load(Ordering::Relaxed);
        if let Some(p) = self.swap.as_mut() {
            tracing::info!(
                event = "shadow_started",
                batches = plan.batches,
                "shadow: the candidate will be fed the fold's next batches"
            );
            p.shadow = Some(PendingShadow {
                deadline: Instant::now() + plan.max_wait,
                plan,
                reply: Some(reply),
                batches_at_start,
                rounds_after: 0,
                changed: Vec::new(),
            });
        }
        Ok(())
    }

    /// The refusal of a second swap or shadow while one is pending.
    fn busy_with_swap(&self, what: &str) -> Option<ApplyError> {
        let p = self.swap.as_ref()?;
        let from = self.apply.describe();
        Some(ApplyError {
            applier: from.clone(),
            call: crate::applied::NODE_CONDITION,
            message: if p.shadow.is_some() {
                format!(
                    "{what} refused, {from} keeps running: the shadow of {} is still running",
                    p.what
                )
            } else {
                format!(
                    "{what} refused, {from} keeps running: the swap to {} is still hydrating",
                    p.what
                )
            },
        })
    }

    /// Settles, starts the capture at C and the candidate's hydration; the candidate's refusal
    /// (a bad component) is the inner error, with nothing started.
    async fn begin_candidate(
        &mut self,
        bytes: Vec<u8>,
        what: String,
        t: &mut Turn,
    ) -> Result<Result<(), ApplyError>, AppliedError> {
        let from = self.apply.describe();
        self.settle(t).await?;
        let store = self.fold.store().clone();
        let pinned = store.begin_pre_images().map_err(store_err)?;
        let view: Arc<dyn FoldRead> = Arc::new(pinned.clone());
        let mut candidate = match self.apply.swap_candidate(&what, &bytes, view.clone()) {
            Ok(c) => c,
            Err(e) => {
                store.take_pre_images().map_err(store_err)?;
                return Ok(Err(e));
            }
        };
        tracing::info!(event = "swap_started", from = %from, cursor = %self.fold.cursor(), "swap: hydrating the new version beside the running one");
        let task = tokio::spawn(tracing::Instrument::in_current_span(async move {
            let r = candidate.hydrate().await;
            (candidate, r)
        }));
        let restart_store = store.clone();
        self.swap = Some(PendingSwap {
            task: Some(AbortOnDrop(task)),
            parked: None,
            reply: None,
            shadow: None,
            what,
            from,
            began: Instant::now(),
            view,
            entries: None,
            rounds: 0,
            caught_up: 0,
            restart: Box::new(move || restart_store.restart_pre_images(&pinned)),
            store: Box::new(move || {
                let _ = store.take_pre_images();
            }),
        });
        Ok(Ok(()))
    }

    /// A task of the pending swap ended (its hydration, or a catch-up round): another round, a
    /// wait (a shadow short of its batches), or the end.
    pub(super) async fn on_swap_task(
        &mut self,
        done: Hydrated,
        t: &mut Turn,
    ) -> Result<(), AppliedError> {
        let Some(p) = self.swap.as_mut() else {
            return Ok(());
        };
        p.task = None;
        let (candidate, n) = match done {
            Ok((candidate, Ok(n))) => (candidate, n),
            failed => return self.conclude(failed, t).await,
        };
        match p.entries {
            None => p.entries = Some((n, p.began.elapsed().as_millis() as u64)),
            Some(_) => p.caught_up += n,
        }
        self.advance(candidate, t).await
    }

    /// Ends the pending shadow of `what` at its requester's word: its reply says so, the running
    /// applier and the fold untouched; the candidate's task (hydration or a catch-up round) is
    /// aborted as the pending swap drops.
    pub(super) fn abandon_shadow(&mut self, what: &str) {
        let Some(p) = self.swap.as_mut().filter(|p| p.what == what) else {
            return;
        };
        let Some(reply) = p.shadow.as_mut().and_then(|s| s.reply.take()) else {
            return;
        };
        tracing::warn!(event = "shadow_abandoned", candidate = %what, "shadow abandoned: its caller asked");
        let _ = reply.send(Err(ApplyError {
            applier: p.from.clone(),
            call: crate::applied::NODE_CONDITION,
            message: format!(
                "the shadow of {what} was abandoned at its caller's request; {} keeps running untouched",
                p.from
            ),
        }));
        self.swap = None;
    }

    /// After each commit, and on the loop's one-second tick: a parked shadow candidate may now
    /// have its batches, be out of time, or need a round.
    pub(super) async fn on_committed(&mut self, t: &mut Turn) -> Result<(), AppliedError> {
        let Some(candidate) = self.swap.as_mut().and_then(|p| p.parked.take()) else {
            return Ok(());
        };
        self.advance(candidate, t).await
    }

    /// The next step of a candidate level with its capture ([`protocol::swap_needs_another_round`]
    /// for a swap, [`protocol::shadow_step`] for a shadow).
    async fn advance(
        &mut self,
        candidate: Box<dyn SwapCandidate>,
        t: &mut Turn,
    ) -> Result<(), AppliedError> {
        let changed = self.fold.store().pre_images_len().map_err(store_err)?;
        let batches = self.status.batches.load(Ordering::Relaxed);
        let settled = self.fold.is_settled();
        let Some(p) = self.swap.as_mut() else {
            return Ok(());
        };
        if p.shadow
            .as_ref()
            .is_some_and(|s| s.reply.as_ref().is_none_or(|r| r.is_closed()))
        {
            // Nobody waits for this shadow's answer any more (the caller gave up): it ends here,
            // and never promotes anything nobody would hear of.
            tracing::warn!(event = "shadow_abandoned", candidate = %candidate.describe(), "shadow abandoned: its caller went away");
            self.swap = None;
            return Ok(());
        }
        let step = match &p.shadow {
            Some(s) => protocol::shadow_step(
                batches.saturating_sub(s.batches_at_start),
                s.plan.batches,
                Instant::now() >= s.deadline,
                s.rounds_after,
                changed,
            ),
            None if protocol::swap_needs_another_round(p.rounds, changed) => ShadowStep::CatchUp,
            None => ShadowStep::Compare,
        };
        match step {
            ShadowStep::Compare => self.conclude(Ok((candidate, Ok(0))), t).await,
            ShadowStep::CatchUp if settled => self.catch_up_round(candidate, t).await,
            // A commit that failed is retried with the keys it already recorded in this capture: a
            // round now would restart the capture before the retry commits them, and they would
            // reach neither this capture nor the next. Wait for the retry (a commit calls back).
            ShadowStep::Wait | ShadowStep::CatchUp => {
                p.parked = Some(candidate);
                Ok(())
            }
        }
    }

    /// Restarts the capture at the cursor now and catches the candidate up, in a task, on the
    /// keys the old capture recorded, read at that cursor.
    async fn catch_up_round(
        &mut self,
        mut candidate: Box<dyn SwapCandidate>,
        t: &mut Turn,
    ) -> Result<(), AppliedError> {
        let Some(p) = self.swap.as_mut() else {
            return Ok(());
        };
        let pre = match (p.restart)().map_err(store_err)? {
            Some(pre) if !pre.overflowed() => pre,
            // Refused at the end: the capture is over, or overflowed.
            lost => {
                let why = if lost.is_some() {
                    overflow_message()
                } else {
                    "its view of the fold was lost (another capture replaced it)".into()
                };
                let e = node_condition(&*candidate, why);
                return self.conclude(Ok((candidate, Err(e))), t).await;
            }
        };
        p.rounds += 1;
        if let Some(s) = p.shadow.as_mut() {
            let batches = self.status.batches.load(Ordering::Relaxed);
            if batches.saturating_sub(s.batches_at_start) >= s.plan.batches
                || Instant::now() >= s.deadline
            {
                s.rounds_after += 1;
            }
            note_changed(s, pre.keys());
        }
        let view = p.view.clone();
        tracing::info!(
            event = "swap_catching_up",
            round = p.rounds,
            keys = pre.len(),
            "swap: catching the new version up beside the fold"
        );
        p.task = Some(AbortOnDrop(tokio::spawn(
            tracing::Instrument::in_current_span(async move {
                let r = match pre.catch_up(&*view) {
                    Ok(updates) => candidate
                        .catch_up(&updates)
                        .await
                        .map(|()| updates.len() as u64),
                    Err(e) => Err(node_condition(
                        &*candidate,
                        format!("read the fold for a catch-up round: {e}"),
                    )),
                };
                (candidate, r)
            }),
        )));
        Ok(())
    }

    /// The end of a swap ([`FoldLoop::cut_over`]) or a shadow ([`FoldLoop::compare`]).
    async fn conclude(&mut self, done: Hydrated, t: &mut Turn) -> Result<(), AppliedError> {
        if self.swap.as_ref().is_some_and(|p| p.shadow.is_some()) {
            self.compare(done, t).await
        } else {
            self.cut_over(done, t).await
        }
    }

    /// A swap's second half, between batches once the candidate hydrated: settle, end the
    /// capture, catch the candidate up with the keys changed since C (each once, its value now),
    /// switch, and offer it the retained records. Only this is on the fold's path (`paused_ms`).
    /// Any failure refuses the swap; the running applier never noticed.
    async fn cut_over(&mut self, done: Hydrated, t: &mut Turn) -> Result<(), AppliedError> {
        let Some(mut p) = self.swap.take() else {
            return Ok(());
        };
        let hydrate_ms = p
            .entries
            .map_or_else(|| p.began.elapsed().as_millis() as u64, |(_, ms)| ms);
        let paused = Instant::now();
        let outcome = match self.level_candidate(&mut p, done, t).await? {
            Ok((candidate, updates)) => {
                self.switch_to(candidate)
                    .await?
                    .map(|(released, still_retained)| SwapReport {
                        from: p.from.clone(),
                        to: self.apply.describe(),
                        hydrated_entries: p.entries.map_or(0, |(n, _)| n),
                        hydrate_ms,
                        caught_up: p.caught_up + updates,
                        catch_up_rounds: p.rounds + 1,
                        paused_ms: paused.elapsed().as_millis() as u64,
                        released,
                        still_retained,
                    })
            }
            Err(e) => Err(e),
        };
        let outcome = outcome.map_err(|e| refused(&p.from, &p.what, &e));
        match &outcome {
            Ok(r) => {
                self.status
                    .set_applier(&self.apply.describe(), self.apply.contract());
                self.status
                    .note_swap(swapped(&r.from, &r.to, r.paused_ms, "swap"));
                tracing::info!(event = "guest_swapped", from = %r.from, to = %r.to, hydrated = r.hydrated_entries, caught_up = r.caught_up, hydrate_ms = r.hydrate_ms, paused_ms = r.paused_ms, "guest swapped");
            }
            Err(e) => {
                tracing::warn!(event = "swap_refused", error = %e, "swap refused; the running guest stays")
            }
        }
        if let Some(reply) = p.reply.take() {
            let _ = reply.send(outcome);
        }
        Ok(())
    }

    /// The end's common first steps, on the fold's path: the candidate's task outcome checked,
    /// the fold settled, the capture ended, and the candidate caught up on what it recorded.
    /// Returns the candidate, level with the committed fold, and the updates of that last
    /// catch-up; the inner error is the candidate's failure (the capture is over either way).
    async fn level_candidate(
        &mut self,
        p: &mut PendingSwap,
        done: Hydrated,
        t: &mut Turn,
    ) -> Result<Result<(Box<dyn SwapCandidate>, u64), ApplyError>, AppliedError> {
        let (mut candidate, hydrated) = match done {
            Ok(pair) => pair,
            Err(e) => {
                return Ok(Err(ApplyError {
                    applier: p.what.clone(),
                    call: "hydrate",
                    message: format!("the candidate's task failed: {e}"),
                }));
            }
        };
        if let Err(e) = hydrated {
            return Ok(Err(e));
        }
        self.settle(t).await?;
        let store = self.fold.store().clone();
        let Some(pre) = store.take_pre_images().map_err(store_err)? else {
            return Ok(Err(node_condition(
                &*candidate,
                "its view of the fold was lost (another capture replaced it)".into(),
            )));
        };
        if pre.overflowed() {
            return Ok(Err(node_condition(&*candidate, overflow_message())));
        }
        if let Some(s) = p.shadow.as_mut() {
            note_changed(s, pre.keys());
        }
        let updates = pre.catch_up(&store).map_err(store_err)?;
        if let Err(e) = candidate.catch_up(&updates).await {
            return Ok(Err(e));
        }
        // The state buckets last, here: no lane's batch is between its apply and its commit.
        if let Err(e) = candidate.catch_up_lanes().await {
            return Ok(Err(e));
        }
        Ok(Ok((candidate, updates.len() as u64)))
    }

    /// Switches to the levelled candidate and offers it the retained records first; returns the
    /// records it released and those still retained.
    async fn switch_to(
        &mut self,
        candidate: Box<dyn SwapCandidate>,
    ) -> Result<Result<(u64, u64), ApplyError>, AppliedError> {
        match self.apply.adopt(candidate) {
            // The old instance is freed off the fold's path (a big one takes milliseconds).
            Ok(retired) => drop(tokio::task::spawn_blocking(move || drop(retired))),
            Err(e) => return Ok(Err(e)),
        }
        // No query is answered by the version before from here on (before the caller hears of the
        // swap): the fold loop answers until a query instance of this one is level.
        self.retire_query_instance();
        let (released, still_retained) = self.fold.release(self.apply).await?;
        Ok(Ok((released, still_retained)))
    }

    /// A shadow's end, on the fold's path: level the candidate with the settled fold, send every
    /// request to both, list the differences, then drop the candidate — or, with `promote` asked
    /// and no difference, switch to it.
    async fn compare(&mut self, done: Hydrated, t: &mut Turn) -> Result<(), AppliedError> {
        let Some(mut p) = self.swap.take() else {
            return Ok(());
        };
        let paused = Instant::now();
        // Levelled with the shadow still in `p`: the last capture's keys join the sample.
        let levelled = self.level_candidate(&mut p, done, t).await?;
        let Some(mut shadow) = p.shadow.take() else {
            return Ok(());
        };
        let batches = self
            .status
            .batches
            .load(Ordering::Relaxed)
            .saturating_sub(shadow.batches_at_start);
        let outcome = match levelled {
            Ok((candidate, updates)) => {
                p.caught_up += updates;
                self.ask_both(&mut p, &shadow, candidate, batches, paused)
                    .await?
            }
            Err(e) => Err(e),
        };
        let outcome = outcome.map_err(|e| shadow_failed(&p.from, &p.what, &e));
        match &outcome {
            Ok(r) => {
                if r.promoted {
                    self.status
                        .set_applier(&self.apply.describe(), self.apply.contract());
                    self.status
                        .note_swap(swapped(&r.live, &r.candidate, r.paused_ms, "shadow"));
                }
                tracing::info!(event = "shadow_compared", live = %r.live, candidate = %r.candidate, batches = r.batches, requests = r.requests, differing = r.differing, promoted = r.promoted, paused_ms = r.paused_ms, "shadow compared");
            }
            Err(e) => {
                tracing::warn!(event = "shadow_failed", error = %e, "shadow failed; the running guest stays")
            }
        }
        if let Some(reply) = shadow.reply.take() {
            let _ = reply.send(outcome);
        }
        Ok(())
    }
}

/// Keeps the first changed keys a sample will ask about.
fn note_changed<'k>(s: &mut PendingShadow, keys: impl Iterator<Item = &'k str>) {
    let want = match s.plan.requests {
        ShadowRequests::Sample(n) => n.min(MAX_SHADOW_REQUESTS),
        ShadowRequests::List(_) => 0,
    };
    for k in keys {
        if s.changed.len() >= want {
            break;
        }
        s.changed.push(k.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sampled_key_is_asked_without_its_scope_prefix() {
        let one = WatchScope::Prefix("route.".into());
        assert_eq!(sample_request(&one, "route.a.example"), b"a.example");
        let many = WatchScope::Prefixes(vec!["a.".into(), "b.".into()]);
        assert_eq!(sample_request(&many, "b.x"), b"x");
        assert_eq!(sample_request(&WatchScope::All, "route.a"), b"route.a");
    }

    #[test]
    fn a_quoted_answer_is_tagged_and_cut_at_a_character() {
        assert_eq!(quote(&Ok(b"{}".to_vec())), "ok: {}");
        assert_eq!(
            quote(&Err("unknown host: a".into())),
            "error: unknown host: a"
        );
        let long = "é".repeat(MAX_SHADOW_QUOTE);
        let q = quote(&Err(long));
        assert!(q.ends_with('…') && q.len() <= MAX_SHADOW_QUOTE + "error: …".len() + 2);
    }
}
