//! The fold's retained records: a guest's deferrals kept until a version that can decode them
//! is running ([`Fold::release`]), and the warnings about those kept longer than the grace.

use super::*;

impl<S: SnapshotStore> Fold<S> {
    /// Warns (once per record and run) about records retained longer than `grace`, and lists them
    /// in the status.
    pub(crate) fn check_grace(&mut self, grace: Duration) -> Result<(), SnapshotError> {
        if self.status.retained.load(Ordering::Relaxed) == 0 {
            if let Ok(mut w) = self.status.warnings.lock() {
                w.clear();
            }
            return Ok(());
        }
        let now = now_unix_ms();
        let grace_ms = grace.as_millis() as u64;
        let overdue: Vec<(String, String, u64, u64)> = self.store.with_retained(|r| {
            r.records()
                .filter(|rec| now.saturating_sub(rec.retained_unix_ms) > grace_ms)
                .map(|rec| {
                    (
                        rec.store_key(),
                        rec.update.key().to_string(),
                        rec.position(),
                        now.saturating_sub(rec.retained_unix_ms) / 1000,
                    )
                })
                .collect()
        })?;
        let mut lines = Vec::new();
        for (store_key, key, revision, age_s) in &overdue {
            if self.warned.insert(store_key.clone()) {
                tracing::warn!(event = "record_retained_overdue", key = %key, revision, age_s, grace_s = grace.as_secs(), "record retained longer than the grace: no running guest version can decode it");
            }
            if lines.len() < MAX_WARNINGS {
                lines.push(format!(
                    "{key} at revision {revision} retained {age_s} s, longer than the {} s grace",
                    grace.as_secs()
                ));
            }
        }
        if overdue.len() > MAX_WARNINGS {
            lines.push(format!(
                "and {} more retained records past the grace",
                overdue.len() - MAX_WARNINGS
            ));
        }
        if let Ok(mut w) = self.status.warnings.lock() {
            *w = lines;
        }
        Ok(())
    }

    /// Records of `batch` marked in `deferred`, as retained records; the first of each key not
    /// blocked yet carries the key's base (its entry just before it). Updates the index.
    pub(super) fn retain(
        &mut self,
        batch: &[KvUpdate],
        deferred: &[bool],
    ) -> Result<Vec<RetainedRecord>, SnapshotError> {
        let now = now_unix_ms();
        let store = self.store.clone();
        let requeued = &self.requeued;
        let at = self.applied.revision_or_zero();
        self.store.with_retained(|index| {
            let mut out = Vec::new();
            // The position of an update of unknown revision: the highest revision before it, in
            // the committed fold or earlier in this batch (log order, never 0).
            let mut position = at;
            let mut positions = Vec::with_capacity(batch.len());
            for u in batch {
                positions.push(position);
                position = position.max(u.revision().unwrap_or(0));
            }
            for (i, u) in batch.iter().enumerate().filter(|(i, _)| deferred[*i]) {
                let key = u.key();
                let base = if index.is_blocked(key) {
                    None
                } else {
                    // The key's last update before this one is applied (else the key would be
                    // blocked): in this batch, in the re-queued updates, or committed.
                    let before = batch[..i]
                        .iter()
                        .rev()
                        .chain(requeued.iter().rev().filter(|r| !is_reserved(r.key())))
                        .find(|p| p.key() == key);
                    Some(match before {
                        Some(p) => entry_of(p),
                        None => store.read()?.get(key)?,
                    })
                };
                let order = u
                    .revision()
                    .is_none()
                    .then(|| (positions[i], index.next_sequence()));
                let r = RetainedRecord {
                    update: u.clone(),
                    retained_unix_ms: now,
                    base,
                    order,
                };
                index.insert(r.clone());
                out.push(r);
            }
            Ok(out)
        })?
    }

    /// Offers every retained record, in log order, to `apply` (after a swap or at start); what it
    /// accepts or skips is released, in one commit that does not move the cursor. What it defers
    /// again stays retained, with its key's base moved past what was released. A failed offer
    /// leaves everything retained and has the applier rebuild from the fold.
    pub async fn release<A: Apply + ?Sized>(
        &mut self,
        apply: &mut A,
    ) -> Result<(u64, u64), AppliedError> {
        let store_err = |e| AppliedError::Store { streak: 0, last: e };
        let (records, old) = self
            .store
            .with_retained(|r| (r.records().cloned().collect::<Vec<_>>(), r.clone()))
            .map_err(store_err)?;
        if records.is_empty() {
            return Ok((0, 0));
        }
        self.store
            .capture_pre_images(records.iter().map(|r| r.update.key()))
            .map_err(store_err)?;
        let batch: Vec<KvUpdate> = records.iter().map(|r| r.update.clone()).collect();
        let deferred = match parse_with_deferral(apply, &batch, vec![false; batch.len()]).await {
            Ok(d) => d,
            Err(e) => {
                apply.discard();
                tracing::warn!(event = "record_release_failed", error = %e, retained = records.len(), "retained records could not be applied; they stay retained");
                return Ok((0, records.len() as u64));
            }
        };
        let (index, mut writes) = release_plan(&records, &deferred, &old);
        let released = records.len() - index.len();
        let cursor = self.applied;
        let intent = super::intent::with_intent(apply, cursor, &mut writes);
        let (_, result) = commit(&self.store, writes, cursor).await?;
        if let Err(e) = result {
            apply.discard();
            self.status.set_error(Some(e.to_string()));
            if matches!(e, SnapshotError::Poisoned { .. }) {
                return Err(store_err(e));
            }
            tracing::warn!(event = "record_release_failed", error = %e, "releasing retained records failed to commit; they stay retained");
            return Ok((0, records.len() as u64));
        }
        let still = index.len() as u64;
        self.store
            .with_retained(|r| *r = index)
            .map_err(store_err)?;
        self.warned.clear();
        if still == 0
            && let Ok(mut w) = self.status.warnings.lock()
        {
            w.clear();
        }
        self.publish_retained().map_err(store_err)?;
        super::intent::on_applied_with(apply, cursor, intent).await;
        tracing::info!(
            event = "record_released",
            released,
            still_retained = still,
            "retained records released"
        );
        Ok((released as u64, still))
    }
}

/// Parses and applies `batch` except the updates already `held`, holding back every update that
/// follows a deferred one of its key (re-parsing without them: the guest applies what the *last*
/// `parse` accepted). Returns which updates are deferred (held or deferred by the guest). Each
/// re-parse holds at least one more update, so there are at most `batch.len()` rounds; in the
/// usual batch (no defer) there is exactly one.
pub(super) async fn parse_with_deferral<A: Apply + ?Sized>(
    apply: &mut A,
    batch: &[KvUpdate],
    mut held: Vec<bool>,
) -> Result<Vec<bool>, ApplyError> {
    let keys: Vec<&str> = batch.iter().map(KvUpdate::key).collect();
    loop {
        let offered: Vec<usize> = (0..batch.len()).filter(|&i| !held[i]).collect();
        if offered.is_empty() {
            return Ok(held);
        }
        let owned: Vec<KvUpdate>;
        let sub: &[KvUpdate] = if offered.len() == batch.len() {
            batch
        } else {
            owned = offered.iter().map(|&i| batch[i].clone()).collect();
            &owned
        };
        let verdicts = apply.parse(sub).await?;
        if verdicts.len() != sub.len() {
            return Err(ApplyError {
                applier: apply.describe(),
                call: "parse",
                message: format!(
                    "answered {} verdicts for a batch of {}",
                    verdicts.len(),
                    sub.len()
                ),
            });
        }
        let mut deferred = held.clone();
        for (j, &i) in offered.iter().enumerate() {
            if verdicts[j] == Verdict::Defer {
                deferred[i] = true;
            }
        }
        let later = protocol::held_after_defers(&keys, &deferred);
        if later.is_empty() {
            apply.apply(sub, &verdicts).await?;
            return Ok(deferred);
        }
        held = deferred;
        for i in later {
            held[i] = true;
        }
    }
}

/// What releasing `records` (those `deferred` stay retained) leaves: the retained index, and the
/// store writes that get there — each released record removed, each kept one re-based on the
/// last released value of its key (or `old`'s base) unless a key before it is blocked.
fn release_plan(
    records: &[RetainedRecord],
    deferred: &[bool],
    old: &RetainedIndex,
) -> (RetainedIndex, Vec<KvUpdate>) {
    let mut index = RetainedIndex::default();
    let mut writes = Vec::new();
    let mut released_last: std::collections::HashMap<&str, Base> = Default::default();
    for (r, d) in records.iter().zip(deferred) {
        let key = r.update.key();
        if !d {
            writes.push(r.to_delete());
            released_last.insert(key, entry_of(&r.update));
            continue;
        }
        let base = if index.is_blocked(key) {
            None
        } else {
            match released_last.get(key) {
                Some(b) => Some(b.clone()),
                None => old.base(key).cloned(),
            }
        };
        let kept = RetainedRecord { base, ..r.clone() };
        if kept != *r {
            writes.push(kept.to_put());
        }
        index.insert(kept);
    }
    (index, writes)
}
