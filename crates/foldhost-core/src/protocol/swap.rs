//! Swaps and shadows: catch-up rounds, the cut-over, shadow steps and promotion.

/// Most catch-up rounds a swap runs beside the fold before its cut-over.
pub(crate) const MAX_SWAP_CATCH_UP_ROUNDS: u32 = 4;

/// Keys changed since the candidate's capture began that the cut-over takes on itself; more, and
/// another catch-up round runs beside the fold first.
pub(crate) const SWAP_CUT_OVER_KEYS: usize = 256;

/// Whether a swap whose candidate is level with its capture's cursor, with `changed` keys changed
/// since and `rounds` catch-up rounds run, runs another round beside the fold before its
/// cut-over. Each round takes the keys changed during the one before, so under a steady writer
/// the cut-over's share shrinks round by round to what changes during one short round — the pause
/// is bounded by the write rate, not by the fold's size. Capped, so a writer faster than the
/// candidate's catch-up cannot hold a swap off for ever: the last round is the cut-over.
pub fn swap_needs_another_round(rounds: u32, changed: usize) -> bool {
    rounds < MAX_SWAP_CATCH_UP_ROUNDS && changed > SWAP_CUT_OVER_KEYS
}

/// What a shadow does next, its candidate level with its capture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShadowStep {
    /// Another catch-up round beside the fold (many keys changed since the capture began).
    CatchUp,
    /// Wait beside the fold for more batches (checked again after each commit).
    Wait,
    /// Settle and compare: the candidate has been fed the batches asked for.
    Compare,
}

/// A shadow's next step, with `seen` of the `wanted` batches committed since it began (`out_of_time`
/// when its wait for them ran out: it then compares on what it saw), `rounds` catch-up rounds run
/// since it stopped waiting, and `changed` keys changed since the capture began.
/// While waiting, a round runs whenever more keys changed than a cut-over takes on itself, so the
/// comparison's pause stays that of a swap's cut-over however many batches the shadow waits for;
/// once every batch was seen it ends as a swap does ([`swap_needs_another_round`]), with a
/// comparison instead of a switch.
pub fn shadow_step(
    seen: u64,
    wanted: u64,
    out_of_time: bool,
    rounds: u32,
    changed: usize,
) -> ShadowStep {
    if seen < wanted && !out_of_time {
        if changed > SWAP_CUT_OVER_KEYS {
            ShadowStep::CatchUp
        } else {
            ShadowStep::Wait
        }
    } else if swap_needs_another_round(rounds, changed) {
        ShadowStep::CatchUp
    } else {
        ShadowStep::Compare
    }
}

/// Whether a shadow's candidate has earned its promotion: `seen` of the `wanted` batches fed,
/// `asked` of the `planned` requests asked (the comparison's time budget can cut it), at most
/// `tolerated` of them answered differently (`differing`; 0 unless the plan says otherwise — a
/// guest channel's release may declare a tolerance, docs/channels.md), and the caller still
/// `waiting` for the answer. `Err`
/// says what is missing. A comparison on nothing proves nothing: no request, or fewer batches than
/// asked (an idle bucket), is not a promotion.
pub fn shadow_promotion(
    seen: u64,
    wanted: u64,
    asked: usize,
    planned: usize,
    differing: u64,
    tolerated: u64,
    waiting: bool,
) -> Result<(), String> {
    if differing > tolerated {
        return Err(format!(
            "{differing} of {asked} requests answered differently"
        ));
    }
    if asked == 0 {
        return Err("no request was compared (nothing in scope to sample?)".into());
    }
    if asked < planned {
        return Err(format!(
            "only {asked} of {planned} requests were compared within the comparison's time budget"
        ));
    }
    if seen < wanted {
        return Err(format!(
            "only {seen} of the {wanted} batches asked for came within the wait"
        ));
    }
    if !waiting {
        return Err("the caller went away before the answer".into());
    }
    Ok(())
}
