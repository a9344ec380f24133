//! The fleet model's actions, one function each: what a step does to the next state.
//!
//! Each takes the next state as [`FleetModel`]'s `next_state` cloned it and changes it in place;
//! `None` is an action not enabled there (the state is dropped, as `next_state`'s `None` drops
//! it). Every decision goes through the `protocol` function production calls, forged only where
//! the model's [`Mutation`] says.

use super::{
    Boot, FleetModel, FleetState, Grace, KEYS, MODE, Mutation, PAYLOADS, Payload, Round, Status,
};
use crate::protocol::{self, KeyRestore, PointerState};

impl FleetModel {
    /// An exporter's restore from the published artifact, as `repair::restore` runs it (in one
    /// step here: the steps are the repair model's). `false`: refused, nothing changes.
    pub(super) fn restore(n: &mut FleetState, i: usize) -> bool {
        let Some(t) = n.pointer else {
            return false;
        };
        let Some(art) = n.payloads[t as usize].filter(|p| p.present) else {
            return false;
        };
        let e = n.exporters[i];
        if !protocol::restore_allowed(art.cursor.into(), e.cursor.map(u64::from), n.first.into()) {
            return false;
        }
        let mut fold = e.fold;
        for key in 0..KEYS {
            let k = key as usize;
            let local = e.fold[k];
            let identical = local.is_some() && local == art.entries[k];
            match protocol::restore_key(
                local.map(u64::from),
                art.entries[k].map(u64::from),
                identical,
                false,
                e.cursor.map(u64::from),
            ) {
                KeyRestore::Take => fold[k] = art.entries[k],
                KeyRestore::Delete => {
                    if protocol::restore_key(Some(1), None, false, n.listed(key), None)
                        == KeyRestore::Delete
                    {
                        fold[k] = None;
                    }
                }
                KeyRestore::Keep => {}
            }
        }
        let e = &mut n.exporters[i];
        e.fold = fold;
        e.cursor = Some(art.cursor);
        e.status = Status::Running;
        e.restored = true;
        true
    }

    /// Exporter `i`'s cursor-less start: a repair first when
    /// [`protocol::cursorless_start_needs_repair`] says so, else a watch.
    pub(super) fn start(n: &mut FleetState, i: usize) {
        let truth = protocol::listing_truth(Some(n.retention()), false);
        n.exporters[i].status = if protocol::cursorless_start_needs_repair(MODE, false, truth) {
            Status::Expired
        } else {
            // A state-sync re-list of a log nothing was evicted from yet: modelled as a watch
            // from the start, floor-guarded.
            Status::Running
        };
    }

    /// Exporter `i` is delivered the message after its cursor, the floor guard first.
    pub(super) fn deliver(&self, n: &mut FleetState, i: usize) -> Option<()> {
        let len = n.log.len() as u8;
        let e = &mut n.exporters[i];
        let mut at = e.cursor.unwrap_or(0);
        if protocol::floor_guard_trips(true, at.into(), n.first.into()) {
            if self.mutation != Mutation::ExporterPublishesUnrepairedFold {
                e.status = Status::Expired;
                return Some(());
            }
            // NATS's silent clamp: on from the first retained revision.
            at = n.first - 1;
        }
        e.status = Status::Running;
        if at >= len {
            // Nothing retained to deliver yet.
            return Some(());
        }
        let rev = at + 1;
        let op = n.log[at as usize];
        e.fold[op.key as usize] = op.put.then_some(rev);
        e.cursor =
            protocol::commit_cursor(e.cursor.map(u64::from), Some(rev.into())).map(|c| c as u8);
        Some(())
    }

    /// Exporter `i` starts an export round: its fold at its cursor named as a new payload.
    pub(super) fn export(n: &mut FleetState, i: usize) -> Option<()> {
        let j = n.payloads.iter().position(Option::is_none)?;
        let e = &mut n.exporters[i];
        n.payloads[j] = Some(Payload {
            cursor: e.cursor?,
            entries: e.fold,
            present: false,
        });
        e.rounds += 1;
        e.round = Some(Round {
            payload: j as u8,
            uploaded: false,
            read: None,
            published: false,
        });
        Some(())
    }

    /// Exporter `i`'s round uploads its payload (the round ends if it already published).
    pub(super) fn upload(n: &mut FleetState, i: usize) -> Option<()> {
        let r = n.exporters[i].round.as_mut()?;
        r.uploaded = true;
        let (j, done) = (r.payload, r.published);
        if let Some(p) = &mut n.payloads[j as usize] {
            p.present = true;
        }
        if done {
            n.exporters[i].round = None;
        }
        Some(())
    }

    /// Exporter `i`'s round reads the pointer and asks [`protocol::pointer_publish_allowed`]: a
    /// `false` abandons the round.
    pub(super) fn read_pointer(&self, n: &mut FleetState, i: usize) -> Option<()> {
        let current = match self.mutation {
            Mutation::PublishEqualOrBackward => PointerState::Absent,
            _ => n.pointer_state(),
        };
        let version = n.version;
        let r = n.exporters[i].round?;
        let ours = n.payloads[r.payload as usize]?.cursor;
        if protocol::pointer_publish_allowed(current, ours.into()) {
            if let Some(r) = &mut n.exporters[i].round {
                r.read = Some(version);
            }
        } else {
            // `SupersededByNewer`: the round is abandoned.
            n.exporters[i].round = None;
        }
        Some(())
    }

    /// Exporter `i`'s round publishes the pointer by a put conditional on the version it read.
    pub(super) fn publish(n: &mut FleetState, i: usize) -> Option<()> {
        let r = n.exporters[i].round?;
        if r.read != Some(n.version) {
            // The conditional put failed: read again.
            if let Some(r) = &mut n.exporters[i].round {
                r.read = None;
            }
            return Some(());
        }
        let ours = n.payloads[r.payload as usize]?.cursor;
        if let PointerState::At(c) = n.pointer_state()
            && u64::from(ours) < c
        {
            n.regressed = true;
        }
        n.pointer = Some(r.payload);
        n.version += 1;
        if n.exporters[i].restored {
            n.restored_published = true;
        }
        if r.uploaded {
            n.exporters[i].round = None;
        } else if let Some(r) = &mut n.exporters[i].round {
            r.published = true;
            r.read = None;
        }
        Some(())
    }

    /// A prune pass starts (`ArtifactTransport::prune`): the pointer read, the payloads listed,
    /// each judged by [`protocol::payload_prunable`]. `None`: nothing to delete.
    pub(super) fn prune_list(&self, n: &mut FleetState) -> Option<()> {
        // Ages are taken at the pass's start: a payload uploaded since is not listed.
        for j in 0..PAYLOADS {
            if !n.payloads[j].is_some_and(|p| p.present) {
                continue;
            }
            let is_target =
                n.pointer == Some(j as u8) && self.mutation != Mutation::PruneIgnoresPointer;
            let older = match self.grace {
                Grace::Zero => true,
                Grace::OutlastsEveryRound => !n.held(j as u8),
            };
            // Since it stopped being the target: past the grace unless a bootstrap is between
            // reading the pointer that named it and fetching it.
            let replaced_older = match (self.grace, self.mutation) {
                (_, Mutation::PruneAgesFromUpload) => older,
                (Grace::Zero, _) => true,
                (Grace::OutlastsEveryRound, _) => n.boot != Boot::Read(j as u8),
            };
            let pointer_cursor = match self.mutation {
                Mutation::PruneIgnoresPointer | Mutation::PruneAtOrAbovePointer => Some(u64::MAX),
                _ => n
                    .pointer
                    .and_then(|t| n.payloads[t as usize])
                    .map(|p| u64::from(p.cursor)),
            };
            n.doomed[j] = protocol::payload_prunable(
                is_target,
                n.payloads[j].map(|p| u64::from(p.cursor)),
                pointer_cursor,
                self.grace.age(older),
                Some(self.grace.age(replaced_older)),
                self.grace.duration(),
            );
        }
        n.doomed.contains(&true).then_some(())
    }

    /// The prune pass deletes doomed payload `j`.
    pub(super) fn prune_delete(n: &mut FleetState, j: u8) {
        n.doomed[j as usize] = false;
        if let Some(p) = &mut n.payloads[j as usize] {
            p.present = false;
        }
    }

    /// The bootstrapping node fetches the payload the pointer it read named.
    pub(super) fn boot_fetch(n: &mut FleetState) -> Option<()> {
        let Boot::Read(t) = n.boot else {
            return None;
        };
        n.boot = match n.payloads[t as usize] {
            Some(p) if p.present => Boot::Done(t),
            _ => Boot::Failed,
        };
        Some(())
    }
}
