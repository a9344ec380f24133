//! The repair model's actions, one function each: what a step does to the next state.
//!
//! Each takes the next state as [`RepairModel`]'s `next_state` cloned it and changes it in place;
//! `None` is an action not enabled there (the state is dropped, as `next_state`'s `None` drops
//! it). Every decision goes through the `protocol` function production calls, forged only where
//! the model's [`Mutation`] says.

use super::{Artifact, Change, Finish, KEYS, MODE, Mutation, Phase, RepairModel, State};
use crate::protocol::{self, KeyRestore, RepairPlan};

impl RepairModel {
    /// A state-sync re-list: its snapshot (each key's latest retained message), and its check at
    /// the first event while the fold has no memo.
    fn state_sync(&self, n: &State) -> Phase {
        Phase::Watching {
            recv: n.len(),
            queue: n.state_sync(),
            vouch: !self.seen_evicting(n),
        }
    }

    /// A start (the first, or a restart after a crash): retention is read (the memo), then a fold
    /// with a cursor resumes or finds it expired, and a cursor-less one repairs first when
    /// [`protocol::cursorless_start_needs_repair`] says so, else starts a state-sync re-list.
    pub(super) fn start(&self, n: &mut State) {
        n.note_retention();
        n.phase = match n.cursor {
            None => {
                let has_data = n.applied.iter().any(Option::is_some);
                if protocol::cursorless_start_needs_repair(MODE, has_data, self.listing_truth(n)) {
                    Phase::Expired
                } else {
                    self.state_sync(n)
                }
            }
            Some(c) if protocol::resume_window_ok(c.into(), n.first.into()) => Phase::Watching {
                recv: c,
                queue: Vec::new(),
                vouch: false,
            },
            Some(_) => Phase::Expired,
        };
    }

    /// The plan: retention read (the memo), the listing's truth, the repair, and for a restore
    /// the artifact's check.
    pub(super) fn plan(&self, n: &mut State) {
        n.note_retention();
        n.phase = match protocol::plan_repair(MODE, self.listing_truth(n)) {
            RepairPlan::Relist => Phase::RelistDiff,
            RepairPlan::Restore => match n.artifact {
                Some(a)
                    if self.mutation == Mutation::RestoreNotAhead
                        || protocol::restore_allowed(
                            a.cursor.into(),
                            n.cursor.map(u64::from),
                            n.first.into(),
                        ) =>
                {
                    Phase::RestoreDiff(a)
                }
                _ => Phase::Stopped,
            },
            RepairPlan::None | RepairPlan::RefuseRelist => Phase::Stopped,
        };
    }

    /// The restore's diff: `restore_key` per key, then the delete candidates checked against the
    /// live listing and retention read again (`None`: the restore is refused). Takes go first.
    fn restore_diff(&self, s: &State, a: Artifact) -> Option<Vec<Change>> {
        let mut pending = Vec::new();
        let mut candidates = Vec::new();
        for key in 0..KEYS {
            let local = s.applied[key as usize];
            let art = a.entries[key as usize];
            let identical = local.is_some() && local == art;
            let local = match self.mutation {
                Mutation::RestoreKeyBackward => local.map(|_| 0),
                _ => local.map(u64::from),
            };
            match (
                protocol::restore_key(
                    local,
                    art.map(u64::from),
                    identical,
                    false,
                    // The mutation forges what the kernel knows of the fold: no newer local
                    // entry, and no cursor that covers the artifact's.
                    match self.mutation {
                        Mutation::RestoreKeyBackward => None,
                        _ => s.cursor.map(u64::from),
                    },
                ),
                art,
            ) {
                (KeyRestore::Take, Some(rev)) => pending.push(Change::Take(key, rev)),
                (KeyRestore::Delete, _) => candidates.push(key),
                _ => {}
            }
        }
        if !candidates.is_empty() {
            for key in candidates {
                let live = s.listed(key) && self.mutation != Mutation::PhantomDelete;
                if protocol::restore_key(Some(1), None, false, live, None) == KeyRestore::Delete {
                    pending.push(Change::Delete(key));
                }
            }
            if !protocol::resume_window_ok(a.cursor.into(), s.first.into()) {
                return None;
            }
        }
        Some(pending)
    }

    /// Retention advances its first revision (an evicting advance the fold has yet to read).
    pub(super) fn evict(n: &mut State) {
        n.first += 1;
        if n.evicting {
            n.unread_eviction = true;
        }
    }

    /// Retention is switched to evicting current values, or back.
    pub(super) fn set_evicting(n: &mut State, on: bool) {
        n.evicting = on;
        n.edits += 1;
        if on {
            n.unread_eviction = true;
        }
    }

    /// A crash: everything in memory is lost; the restart starts the fold again.
    pub(super) fn crash(&self, n: &mut State) {
        n.crashes += 1;
        n.batch.clear();
        self.start(n);
    }

    /// A state-sync re-list's first event: [`protocol::relist_still_vouched`], else a repair.
    pub(super) fn first_event(&self, n: &mut State) {
        let vouched = self.mutation == Mutation::RelistNotVouched
            || protocol::relist_still_vouched(Some(n.retention()));
        if vouched {
            if let Phase::Watching { vouch, .. } = &mut n.phase {
                *vouch = false;
            }
        } else {
            // Retention began evicting under the re-list: the memo, and a repair.
            n.note_retention();
            n.phase = Phase::Expired;
        }
    }

    /// The watch delivers its next update into the batch: a re-list's initial value, else the
    /// next retained revision, a gap going to the floor guard first.
    pub(super) fn deliver(n: &mut State) -> Option<()> {
        let len = n.len();
        let Phase::Watching { recv, queue, .. } = &mut n.phase else {
            return None;
        };
        if !queue.is_empty() {
            let rev = queue.remove(0);
            // An initial value evicted before delivery is skipped (none is: an axiom).
            if rev >= n.first {
                n.batch.push(rev);
            }
        } else {
            let mut next = *recv + 1;
            if next < n.first {
                // A delivery gap: the floor guard decides.
                if protocol::floor_guard_trips(n.evicting, (*recv).into(), n.first.into()) {
                    n.phase = Phase::Expired;
                    return Some(());
                }
                next = n.first;
            }
            *recv = next.min(len);
            if next <= len {
                n.batch.push(next);
            }
        }
        Some(())
    }

    /// The batch is committed: its updates applied, the cursor [`protocol::commit_cursor`] gives.
    pub(super) fn flush(n: &mut State) {
        let batch = std::mem::take(&mut n.batch);
        for rev in &batch {
            n.apply_message(*rev);
        }
        let high = batch.iter().copied().max().map(u64::from);
        let to = protocol::commit_cursor(n.cursor.map(u64::from), high);
        n.move_cursor(to.map(|c| c as u8));
    }

    /// The watch's retention tick (the memo) and the floor guard's probe.
    pub(super) fn read_retention(n: &mut State) {
        n.note_retention();
        if let Phase::Watching { recv, queue, .. } = &n.phase
            && queue.is_empty()
            && protocol::floor_guard_trips(n.evicting, (*recv).into(), n.first.into())
        {
            n.phase = Phase::Expired;
        }
    }

    /// The planned repair's difference: the key-listing's deletes, or the restore's.
    pub(super) fn diff(&self, n: &mut State) -> Option<()> {
        n.phase = match n.phase {
            // The listing, then retention read again before anything is deleted
            // (`repair::relist`): eviction begun since the plan refuses the diff.
            Phase::RelistDiff
                if self.mutation != Mutation::RelistListingNotRechecked
                    && !protocol::relist_still_vouched(Some(n.retention())) =>
            {
                Phase::Stopped
            }
            Phase::RelistDiff => Phase::Applying {
                pending: (0..KEYS)
                    .filter(|&k| n.applied[k as usize].is_some() && !n.listed(k))
                    .map(Change::Delete)
                    .collect(),
                finish: Finish::Relist,
                cursor_moved: false,
            },
            Phase::RestoreDiff(a) => match self.restore_diff(n, a) {
                Some(pending) => Phase::Applying {
                    pending,
                    finish: Finish::Restore(a.cursor),
                    cursor_moved: false,
                },
                None => Phase::Stopped,
            },
            _ => return None,
        };
        Some(())
    }

    /// One chunk of the difference applied under the old cursor.
    pub(super) fn apply_chunk(n: &mut State) -> Option<()> {
        let Phase::Applying { pending, .. } = &mut n.phase else {
            return None;
        };
        match pending.remove(0) {
            Change::Take(key, rev) => n.put(key, rev),
            Change::Delete(key) => n.delete(key),
        }
        Some(())
    }

    /// `CursorBeforeLastChunk`: the artifact's cursor committed before the last chunk.
    pub(super) fn commit_cursor_early(n: &mut State) -> Option<()> {
        let Phase::Applying {
            finish: Finish::Restore(c),
            cursor_moved,
            ..
        } = &mut n.phase
        else {
            return None;
        };
        *cursor_moved = true;
        let c = *c;
        n.move_cursor(Some(c));
        Some(())
    }

    /// The repair's last step: a re-list keeps the cursor and starts a state-sync re-list; a
    /// restore commits the artifact's cursor, then the resume check.
    pub(super) fn finish(&self, n: &mut State) -> Option<()> {
        let Phase::Applying { finish, .. } = n.phase else {
            return None;
        };
        n.repaired = true;
        n.phase = match finish {
            Finish::Relist => self.state_sync(n),
            Finish::Restore(c) => {
                n.move_cursor(Some(c));
                if protocol::resume_window_ok(c.into(), n.first.into()) {
                    Phase::Watching {
                        recv: c,
                        queue: Vec::new(),
                        vouch: false,
                    }
                } else {
                    Phase::Expired
                }
            }
        };
        Some(())
    }
}
