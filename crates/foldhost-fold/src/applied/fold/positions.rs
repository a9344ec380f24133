//! What a commit carries beside the batch for the write side and `applied_through`: the
//! operation ledger's rows and its life (docs/writes.md, "The operation ledger") and what a
//! state-sync start left unseen ([`protocol::Unseen`]).
//!
//! Invariants: a ledger row commits in the commit that moves the cursor over its record, never
//! before it, and only for an id a write path could have admitted; a commit that passes records
//! a state-sync did not deliver raises the ledger's horizon in the same commit; what a state-sync skipped is recorded in the commit of the batch that skipped it,
//! and removed only once settled (the cursor at the level, nothing retained) with no state-sync
//! running, so `applied_through` never covers a revision whose key's state is older.

use super::*;

/// What a commit carried beside its batch, to publish once it is committed.
#[derive(Default)]
pub(crate) struct Carried {
    unseen: Option<Option<protocol::Unseen>>,
    checkpoint: Option<(u64, u64)>,
    life: Option<protocol::LedgerLife>,
}

impl<S: SnapshotStore> Fold<S> {
    /// The recorded checkpoint: a revision the cursor covers and when its record was stored.
    pub(crate) fn checkpoint(&self) -> Option<(u64, u64)> {
        self.checkpoint
    }

    /// Forgets the checkpoint (a reset re-folds the bucket from nothing), in one commit under the
    /// current cursor.
    pub(crate) fn forget_checkpoint(&mut self) -> Result<(), SnapshotError> {
        if self.checkpoint.take().is_some() {
            let delete = KvUpdate::Delete {
                key: foldhost_core::retained::CHECKPOINT_KEY.into(),
                version: foldhost_core::kv::VersionToken::UNKNOWN,
            };
            self.store.write()?.apply(&[delete], self.applied)?;
        }
        self.publish_checkpoint();
        Ok(())
    }

    /// The checkpoint into the status.
    pub(super) fn publish_checkpoint(&self) {
        let (rev, ns) = self.checkpoint.unwrap_or((0, 0));
        self.status
            .checkpoint_revision
            .store(rev, Ordering::Relaxed);
        self.status
            .checkpoint_stored_unix_ns
            .store(ns, Ordering::Relaxed);
    }

    /// A watch starts from `start`: a state-sync (a re-list, or no cursor) delivers each key's
    /// latest record only, and what it skips is tracked; a delta delivers every revision in scope.
    pub(crate) fn watch_starts(&mut self, relist: bool, start: WatchCursor) {
        if relist || start.revision().is_none() {
            self.begin_state_sync(start.revision_or_zero());
        } else {
            self.end_state_sync();
        }
    }

    /// A state-sync start begins at `cursor` (0: none): the revisions it skips are tracked, and the
    /// first is recorded as unseen ([`protocol::Unseen`]).
    pub(crate) fn begin_state_sync(&mut self, cursor: u64) {
        self.state_sync = Some(cursor.saturating_add(1));
        self.level = None;
    }

    /// A delta watch: nothing is skipped any more.
    pub(crate) fn end_state_sync(&mut self) {
        self.state_sync = None;
        self.level = None;
    }

    /// The watch is level at `through` (`None`: it delivered nothing; the cursor stands in).
    /// Recorded at once as the level of what a state-sync left unseen, when it has none yet
    /// (one commit under the current cursor: the level is a revision, whatever is committed).
    pub(crate) fn state_sync_level(&mut self, through: Option<u64>) -> Result<(), SnapshotError> {
        let level = through.unwrap_or(self.applied.revision_or_zero());
        self.level = Some(level);
        let unseen = self.store.with_retained(|r| r.unseen())?;
        if let Some(u) = unseen
            && u.level.is_none()
        {
            let u = Some(protocol::Unseen {
                level: Some(level),
                ..u
            });
            self.store.write()?.apply(
                &[foldhost_core::retained::unseen_floor_update(u)],
                self.applied,
            )?;
            self.store.with_retained(|r| r.set_unseen(u))?;
            self.publish_retained()?;
        }
        Ok(())
    }

    /// What a state-sync left unseen after this commit, when the commit changes it: a skipped
    /// revision found (the lowest stands), the level added, or the record removed once settled
    /// (as of before the commit, with no state-sync tracking).
    fn unseen_change(
        &mut self,
        raw: &[KvUpdate],
    ) -> Result<(Option<Option<protocol::Unseen>>, bool), SnapshotError> {
        let (before, retained) = self.store.with_retained(|r| (r.unseen(), r.len()))?;
        let mut first = None;
        if let Some(next) = self.state_sync {
            let (skipped, next) =
                protocol::first_unseen(next, raw.iter().filter_map(KvUpdate::revision));
            self.state_sync = Some(next);
            first = skipped;
        }
        let after = protocol::unseen_after(
            before,
            first,
            self.level,
            self.state_sync.is_some(),
            self.applied.revision(),
            retained > 0,
        );
        Ok(((after != before).then_some(after), first.is_some()))
    }

    /// Operation ids of records about to be delivered ([`foldhost_core::kv::WatchEvent::Ops`]). Ids of
    /// revisions the cursor already covers are dropped (a re-delivery after a restart: the first
    /// commit recorded them); past [`MAX_PENDING_OPS`] the oldest go, with a warning (a watch
    /// never sends that many ahead of the batch that commits them).
    pub(crate) fn note_ops(&mut self, ops: Vec<foldhost_core::kv::OpRecord>) {
        let cursor = self.applied.revision_or_zero();
        for op in ops {
            if op.revision <= cursor || self.ops.back().is_some_and(|b| b.revision >= op.revision) {
                continue;
            }
            if self.ops.len() >= MAX_PENDING_OPS {
                let dropped = self.ops.pop_front();
                // Its row is lost: the next commit raises the ledger's horizon.
                self.ids_dropped = true;
                tracing::warn!(
                    event = "ledger_ids_dropped",
                    ?dropped,
                    "operation ids queued past the limit: the oldest is not recorded in the ledger"
                );
            }
            self.ops.push_back(op);
        }
    }

    /// The ledger rows of the queued operation ids at or below `through`, taken off the queue: one
    /// per record whose id a write path could have admitted ([`protocol::row_admitted`]), in the
    /// ledger's current life.
    fn take_ledger_rows(&mut self, through: u64) -> Vec<KvUpdate> {
        let now = now_unix_ms();
        let mut rows = Vec::new();
        while self.ops.front().is_some_and(|o| o.revision <= through) {
            let Some(o) = self.ops.pop_front() else { break };
            if !protocol::row_admitted(&o.op, o.stored_unix_ms, now) {
                tracing::warn!(
                    event = "ledger_id_not_admitted",
                    op_id = %o.op,
                    revision = o.revision,
                    minted_unix_ms = o.op.minted_unix_ms(),
                    stored_unix_ms = o.stored_unix_ms,
                    "a record carries an operation id minted further past its own time than any write path admits: it leaves no ledger row"
                );
                continue;
            }
            let row = protocol::LedgerRow {
                revision: o.revision,
                key: o.key,
                recorded_unix_ms: now,
                epoch: self.life.epoch,
                digest: Some(o.digest),
            };
            rows.push(foldhost_core::ledger::row_put(&o.op, &row));
        }
        rows
    }

    /// Starts a new life of the ledger for a fold re-folded from a recreated or diverged bucket
    /// (every row so far answers nothing; the horizon is now), in one commit under the current
    /// cursor.
    pub(crate) fn new_ledger_life(&mut self) -> Result<(), SnapshotError> {
        let life = self.life.new_incarnation(now_unix_ms());
        self.store
            .write()?
            .apply(&[foldhost_core::ledger::life_put(&life)], self.applied)?;
        self.life = life;
        self.publish_life();
        Ok(())
    }

    /// Reads the ledger's life from the store (a fold that opens), into the status too.
    pub(super) fn load_life(&mut self) -> Result<(), SnapshotError> {
        self.life = foldhost_core::ledger::read_life(&*self.store.read()?).map_err(|e| {
            SnapshotError::InvalidFormat {
                path: "the operation ledger's life".into(),
                reason: e.to_string(),
            }
        })?;
        self.publish_life();
        Ok(())
    }

    /// The ledger's horizon into the status.
    pub(super) fn publish_life(&self) {
        self.status
            .ledger_horizon_unix_ms
            .store(self.life.horizon_unix_ms, Ordering::Relaxed);
    }

    /// One step of a sweep of the operation ledger, under the current cursor
    /// ([`foldhost_core::ledger::sweep_step`]): how many rows went, and the key to resume after (`None`:
    /// the sweep is done, and counted).
    pub(crate) fn sweep_ledger(
        &mut self,
        cutoff_unix_ms: u64,
        after: Option<&str>,
    ) -> Result<(u64, Option<String>), String> {
        let (updates, next) = {
            let store = self.store.read().map_err(|e| e.to_string())?;
            foldhost_core::ledger::sweep_step(&*store, cutoff_unix_ms, now_unix_ms(), after)
                .map_err(|e| e.to_string())?
        };
        let n = updates
            .iter()
            .filter(|u| matches!(u, KvUpdate::Delete { .. }))
            .count() as u64;
        if !updates.is_empty() {
            self.store
                .write()
                .map_err(|e| e.to_string())?
                .apply(&updates, self.applied)
                .map_err(|e| e.to_string())?;
        }
        self.publish_watermark().map_err(|e| e.to_string())?;
        if next.is_none() {
            self.status.ledger_sweeps.fetch_add(1, Ordering::Relaxed);
        }
        Ok((n, next))
    }

    /// Brings the status's ledger watermark in line with the store's.
    pub(super) fn publish_watermark(&self) -> Result<(), foldhost_core::ledger::LedgerError> {
        let watermark = foldhost_core::ledger::read_watermark(&*self.store.read()?)?;
        self.status
            .ledger_watermark_unix_ms
            .store(watermark, Ordering::Relaxed);
        Ok(())
    }

    /// The reserved updates this commit carries (appended to `raw`): the unseen record when it
    /// changes, the checkpoint when a newer delivery stamp is covered, and the ledger rows of the
    /// records the commit moves the cursor to `cursor` over. Returns what to publish once
    /// committed.
    pub(super) async fn carry_positions(
        &mut self,
        raw: &mut Vec<KvUpdate>,
        cursor: WatchCursor,
    ) -> Result<Carried, SnapshotError> {
        if self.frozen {
            return Ok(Carried::default());
        }
        let (unseen, _) = self.unseen_change(raw)?;
        if let Some(u) = unseen {
            raw.push(foldhost_core::retained::unseen_floor_update(u));
        }
        let through = cursor.revision_or_zero();
        // The commit passes records it was never delivered (a state-sync delivers each key's
        // newest only; a record superseded, purged or expired before the watch read it is gone;
        // on a scoped fold, another scope's), or ids were dropped: whatever operation ids they
        // carried leave no rows, so the ledger's horizon moves up in this very commit
        // (docs/writes.md, "When a node cannot vouch for an id").
        let gap = protocol::passes_unseen(
            self.applied.revision_or_zero(),
            raw.iter().filter_map(KvUpdate::revision),
            through,
        );
        let life = (gap || std::mem::take(&mut self.ids_dropped))
            .then(|| self.life.passed_without_rows(now_unix_ms()));
        if let Some(l) = &life {
            raw.push(foldhost_core::ledger::life_put(l));
        }
        let checkpoint = self
            .stamps
            .iter()
            .rev()
            .find(|(r, _)| *r <= through)
            .copied()
            .filter(|(r, _)| self.checkpoint.is_none_or(|(c, _)| *r > c));
        if let Some((rev, ns)) = checkpoint {
            raw.push(foldhost_core::retained::checkpoint_put(rev, ns));
        }
        let rows = self.take_ledger_rows(through);
        if !rows.is_empty() {
            crashpoint::hold(crashpoint::FOLD_LEDGER_COMMIT).await;
        }
        raw.extend(rows);
        Ok(Carried {
            unseen,
            checkpoint,
            life,
        })
    }

    /// After a commit: what it carried published (the unseen record to the index, the
    /// checkpoint to the status), and the state-sync tracking ended once the cursor passed the
    /// level (past it every revision in scope comes).
    pub(super) fn positions_committed(&mut self, carried: Carried) -> Result<(), SnapshotError> {
        if let Some(u) = carried.unseen {
            self.store.with_retained(|r| r.set_unseen(u))?;
        }
        if let Some(c) = carried.checkpoint {
            self.checkpoint = Some(c);
            self.publish_checkpoint();
        }
        if let Some(l) = carried.life {
            self.life = l;
            self.publish_life();
        }
        if self
            .level
            .is_some_and(|l| self.applied.revision_or_zero() >= l)
        {
            self.state_sync = None;
        }
        Ok(())
    }
}
