//! A shadow's comparison (docs/guests.md, "A trial touches nothing"): the same requests to the
//! running applier and the candidate, with the fold settled, and the promotion when asked and
//! earned.
//!
//! Invariants:
//! - Nothing either side writes while compared is published: both sides' state writes are
//!   captured ([`Apply::begin_capture`]) from the first request to the last, each side answered
//!   from an overlay of its own, and the capture ends on every path out.
//! - A request differs when the answers differ or the writes differ (one side writing and the
//!   other not included); the candidate's captured writes are listed in the report, both sides'
//!   counted.
//! - A side that wrote while compared is rebuilt from the fold before it serves again (its memory
//!   may hold writes answered `applied` that were never made): the running applier at once, a
//!   promoted candidate once adopted.

use std::time::Instant;

use crate::applied::AppliedError;
use crate::applied::{
    Apply, ApplyError, CapturedWrite, MAX_SHADOW_COMPARE, MAX_SHADOW_DIFFERENCES_LISTED,
    MAX_SHADOW_REQUESTS, MAX_SHADOW_WRITES_LISTED, ShadowDifference, ShadowReport, ShadowRequests,
    ShadowWrite, SwapCandidate,
};
use foldhost_core::protocol;
use foldhost_core::snapshot::{SnapshotError, SnapshotStore};
use foldhost_core::view::FoldRead;

use super::super::FoldLoop;
use super::{PendingShadow, PendingSwap, quote, sample_request, scan_prefixes, store_err};

/// Most writes of each side one listed difference quotes (the rest are counted in a last line).
const WRITES_PER_DIFFERENCE: usize = 10;

/// A difference's writes as listed: the first [`WRITES_PER_DIFFERENCE`], then how many more.
fn listed_writes(w: &[CapturedWrite]) -> Vec<String> {
    let mut out: Vec<String> = w
        .iter()
        .take(WRITES_PER_DIFFERENCE)
        .map(CapturedWrite::describe)
        .collect();
    if w.len() > WRITES_PER_DIFFERENCE {
        out.push(format!("… and {} more", w.len() - WRITES_PER_DIFFERENCE));
    }
    out
}

/// What the requests showed, before any promotion.
#[derive(Default)]
struct Compared {
    asked: usize,
    differing: u64,
    differences: Vec<ShadowDifference>,
    candidate_writes: Vec<ShadowWrite>,
    candidate_writes_total: u64,
    live_writes_total: u64,
}

impl<S: SnapshotStore, A: Apply + ?Sized> FoldLoop<'_, S, A> {
    /// The comparison itself, and the promotion when asked and earned.
    pub(super) async fn ask_both(
        &mut self,
        p: &mut PendingSwap,
        shadow: &PendingShadow,
        mut candidate: Box<dyn SwapCandidate>,
        batches: u64,
        paused: Instant,
    ) -> Result<Result<ShadowReport, ApplyError>, AppliedError> {
        let requests = self.shadow_requests(shadow).map_err(store_err)?;
        self.apply.begin_capture();
        candidate.begin_capture();
        let compared = self.send_to_both(&requests, candidate.as_mut()).await;
        self.apply.end_capture();
        candidate.end_capture();
        let live_wrote = compared.as_ref().is_ok_and(|c| c.live_writes_total > 0);
        if live_wrote {
            self.apply.discard();
        }
        let c = match compared {
            Ok(c) => c,
            // The candidate failed (a trap, a deadline): the shadow fails, nothing promoted.
            Err(e) => return Ok(Err(e)),
        };
        let candidate_name = candidate.describe();
        let mut promoted = false;
        let evidence = protocol::shadow_promotion(
            batches,
            shadow.plan.batches,
            c.asked,
            requests.len(),
            c.differing,
            shadow.plan.tolerated,
            shadow.reply.as_ref().is_some_and(|r| !r.is_closed()),
        );
        let not_promoted = match (shadow.plan.promote, evidence) {
            (false, _) => None,
            (true, Ok(())) => match self.switch_to(candidate).await? {
                Ok(_) => {
                    promoted = true;
                    if c.candidate_writes_total > 0 {
                        self.apply.discard();
                    }
                    None
                }
                Err(e) => Some(format!("the switch failed: {e}")),
            },
            (true, Err(why)) => Some(why),
        };
        Ok(Ok(ShadowReport {
            live: p.from.clone(),
            candidate: candidate_name,
            hydrated_entries: p.entries.map_or(0, |(n, _)| n),
            hydrate_ms: p.entries.map_or(0, |(_, ms)| ms),
            batches,
            caught_up: p.caught_up,
            requests: c.asked as u64,
            differing: c.differing,
            differences: c.differences,
            candidate_writes: c.candidate_writes,
            candidate_writes_total: c.candidate_writes_total,
            live_writes_total: c.live_writes_total,
            promoted,
            not_promoted,
            paused_ms: paused.elapsed().as_millis() as u64,
        }))
    }

    /// Sends each request to both sides, their writes captured: `Err` when the candidate's call
    /// failed.
    async fn send_to_both(
        &mut self,
        requests: &[Vec<u8>],
        candidate: &mut dyn SwapCandidate,
    ) -> Result<Compared, ApplyError> {
        let mut c = Compared::default();
        let started = Instant::now();
        for request in requests {
            if started.elapsed() > MAX_SHADOW_COMPARE {
                // The fold waits while this runs: a slow guest (or a live one rebuilt after a
                // failed query) must not hold it for ever. The report says how many were asked.
                break;
            }
            c.asked += 1;
            // A live instance lost to an earlier query is rebuilt here (the fold is settled), so
            // the comparison never counts a "guest rebuilding" answer as the live one.
            if self.apply.rebuild_due() {
                let _ = self.apply.rebuild().await;
            }
            let live = self.apply.query(request).await.map_err(|e| e.message);
            let live_writes = self.apply.take_captured();
            let answer = candidate.query(request).await?;
            let candidate_writes = candidate.take_captured();
            c.live_writes_total += live_writes.len() as u64;
            c.candidate_writes_total += candidate_writes.len() as u64;
            let text = String::from_utf8_lossy(request);
            for w in &candidate_writes {
                if c.candidate_writes.len() < MAX_SHADOW_WRITES_LISTED {
                    c.candidate_writes.push(ShadowWrite {
                        request: text.to_string(),
                        write: w.describe(),
                    });
                }
            }
            let writes_differ = live_writes != candidate_writes;
            if live != answer || writes_differ {
                c.differing += 1;
                if c.differences.len() < MAX_SHADOW_DIFFERENCES_LISTED {
                    let listed = |w: &[CapturedWrite]| {
                        if writes_differ {
                            listed_writes(w)
                        } else {
                            Vec::new()
                        }
                    };
                    c.differences.push(ShadowDifference {
                        request: text.into_owned(),
                        live: quote(&live),
                        candidate: quote(&answer),
                        live_writes: listed(&live_writes),
                        candidate_writes: listed(&candidate_writes),
                    });
                }
            }
        }
        Ok(c)
    }

    /// The requests a shadow sends: the operator's list, or a sample of keys in scope (those
    /// changed during the shadow first, then the fold's first keys), each as [`sample_request`].
    fn shadow_requests(&self, shadow: &PendingShadow) -> Result<Vec<Vec<u8>>, SnapshotError> {
        let want = match &shadow.plan.requests {
            ShadowRequests::List(list) => {
                return Ok(list.iter().take(MAX_SHADOW_REQUESTS).cloned().collect());
            }
            ShadowRequests::Sample(n) => (*n).min(MAX_SHADOW_REQUESTS),
        };
        let scope = &self.opts.scope;
        let mut keys: Vec<String> = Vec::with_capacity(want);
        let mut seen = std::collections::HashSet::new();
        for k in &shadow.changed {
            if keys.len() < want && scope.contains(k) && seen.insert(k.clone()) {
                keys.push(k.clone());
            }
        }
        let store = self.fold.store();
        for prefix in scan_prefixes(scope) {
            let mut after: Option<String> = None;
            while keys.len() < want {
                let page = store.scan(&prefix, after.as_deref(), 1000)?;
                let Some(last) = page.last() else { break };
                after = Some(last.key.clone());
                for e in page {
                    if keys.len() < want && seen.insert(e.key.clone()) {
                        keys.push(e.key);
                    }
                }
            }
        }
        Ok(keys.iter().map(|k| sample_request(scope, k)).collect())
    }
}
