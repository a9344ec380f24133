//! `foldhost:guest@0.3.0` (`wit/v0.3.0/guest.wit`): the state buckets. Its `fold` and `log`
//! imports are served by the same [`HostState`] code as every version's; its `state` import is
//! served here, every decision the protocol's ([`foldhost_core::protocol::admit_state_write`]).

use foldhost_core::kv::KvEntry;
use foldhost_core::protocol::{self, GuestCall, StateWrite};

use super::HostState;
use crate::guest::state::{StateWriteRequest, WrittenOutcome};

wasmtime::component::bindgen!({
    path: "../../wit/v0.3.0",
    world: "foldhost:guest/guest@0.3.0",
    imports: {
        // A write goes to the server through the host's write path.
        "foldhost:guest/state.put": async | trappable,
        "foldhost:guest/state.delete": async | trappable,
        default: trappable,
    },
    exports: { default: async },
    ownership: Borrowing { duplicate_if_necessary: true },
});

use foldhost::guest::state::{Outcome, Refusal, WriteOptions, Written};
use foldhost::guest::types::Entry;

/// The most keys one `keys` call returns, whatever the guest asks.
pub(crate) const MAX_KEYS_LIMIT: u32 = 10_000;

fn entry(e: KvEntry) -> Entry {
    Entry {
        revision: e.version.as_u64().unwrap_or(0),
        key: e.key,
        value: e.value.to_vec(),
    }
}

/// A page of the fold's keys (sorted; `asked` were asked for: `limit` and the overlay's
/// deletions) with a trial's overlay over it: its deletions gone, its puts in, sorted, at most
/// `limit`. A full page may end before the fold does, so the overlay's keys past its last are
/// left to the next page: no key is ever returned out of order, and a full page still yields
/// `limit` keys (at most `asked - limit` of its keys are deleted).
fn merge_keys(
    fold: impl Iterator<Item = String>,
    overlay: Vec<(String, bool)>,
    limit: usize,
    asked: usize,
) -> Vec<String> {
    let fold: Vec<String> = fold.collect();
    let full = fold.len() >= asked;
    let last = fold.last().cloned();
    let mut keys: std::collections::BTreeSet<String> = fold.into_iter().collect();
    for (k, present) in overlay {
        if !present {
            keys.remove(&k);
        } else if !full || last.as_ref().is_none_or(|l| &k <= l) {
            keys.insert(k);
        }
    }
    keys.into_iter().take(limit).collect()
}

fn refusal(reason: &str, message: String) -> Refusal {
    Refusal {
        reason: reason.to_string(),
        message,
    }
}

impl HostState {
    /// The lane `bucket` names, or the refusal of an undeclared name.
    fn read_lane(&self, bucket: &str) -> Result<crate::guest::state::StateLane, Refusal> {
        self.state
            .get()
            .and_then(|s| s.lane(bucket))
            .cloned()
            .ok_or_else(|| {
                let r = protocol::StateRefusal::Undeclared(bucket.to_string());
                refusal(r.reason(), r.to_string())
            })
    }

    /// A put (`value`) or delete, admitted by the protocol, then handed to the writer with what is
    /// left of the call's deadline.
    async fn state_write(
        &mut self,
        bucket: String,
        key: String,
        value: Option<Vec<u8>>,
        options: WriteOptions,
    ) -> Result<Written, Refusal> {
        let Some(access) = self.state.get().cloned() else {
            let r = protocol::StateRefusal::Undeclared(bucket);
            return Err(refusal(r.reason(), r.to_string()));
        };
        let lane = access.lane(&bucket);
        let holds = lane.map_or(0, |l| (l.holds)());
        let admitted = protocol::admit_state_write(
            StateWrite {
                local: &bucket,
                call: self.call,
                value: value.as_deref(),
                ttl: options.ttl_ms.is_some(),
            },
            lane.map(|l| &l.decl),
            holds,
            access.caps,
        );
        if let Err(r) = admitted
            && !(access.unchecked && self.call != GuestCall::Setup)
        {
            return Err(refusal(r.reason(), r.to_string()));
        }
        if options.ttl_ms.is_some() {
            return Err(refusal(
                "invalid",
                "a time to live per key is not written by this host yet: leave ttl-ms unset".into(),
            ));
        }
        let (Some(lane), Some(writer)) = (lane, access.writer.as_ref()) else {
            return Err(refusal(
                "invalid",
                format!("this host lends no writer for bucket {bucket:?}"),
            ));
        };
        if key.is_empty() {
            return Err(refusal("invalid", "the key is empty".into()));
        }
        // A trial's write (a shadow's comparison) is captured, answered from its overlay, and
        // never reaches the writer.
        if let Some(capture) = self.capturing() {
            return match capture.record(&bucket, &key, value, options.op_id) {
                Ok(op_id) => Ok(Written {
                    outcome: Outcome::Applied,
                    op_id,
                    revision: None,
                }),
                Err(why) => Err(refusal("invalid", why)),
            };
        }
        let req = self.request_of(&bucket, key, value, options);
        match writer.write(&lane.decl, req).await {
            Ok(w) => Ok(Written {
                outcome: match w.outcome {
                    WrittenOutcome::Applied => Outcome::Applied,
                    WrittenOutcome::Pending => Outcome::Pending,
                    WrittenOutcome::Unknown => Outcome::Unknown,
                },
                op_id: w.op_id,
                revision: w.revision,
            }),
            Err(r) => Err(refusal(&r.reason, r.message)),
        }
    }

    /// The request of an admitted write to `bucket`: from `on-applied` with an intent, a write
    /// without an id of the guest's gets one derived from the call and the write itself
    /// (`super::super::replay`), so calling it again collapses onto this one; a first call's is
    /// published as new, only a call made again retries.
    fn request_of(
        &mut self,
        bucket: &str,
        key: String,
        value: Option<Vec<u8>>,
        mut options: WriteOptions,
    ) -> StateWriteRequest {
        let mut host_minted = false;
        if options.op_id.is_none()
            && self.call == GuestCall::OnApplied
            && let Some(ids) = self.derived.as_mut()
        {
            options.op_id = Some(ids.next(bucket, &key, value.as_deref()));
            host_minted = !ids.replay();
        }
        let mut req = self.write_request(key, value, options);
        req.host_minted = host_minted;
        req
    }

    /// The request an admitted write is handed to the writer as, with what is left of the call.
    fn write_request(
        &self,
        key: String,
        value: Option<Vec<u8>>,
        options: WriteOptions,
    ) -> StateWriteRequest {
        // Nine tenths of what is left of the call: a write that cannot finish in time answers
        // `unknown` (with its op id, to retry with) before the call itself is stopped.
        let left = self.time_left();
        let within = left.saturating_sub(left / 10);
        // Waiting for this node to apply it is possible only where the fold is free to: from
        // `query` on the query instance. Elsewhere the fold that would apply it waits for this
        // call, and the write answers once it is durable.
        let wait = if self.call == GuestCall::Query && self.may_wait {
            std::time::Duration::from_millis(u64::from(options.wait_ms)).min(within)
        } else {
            std::time::Duration::ZERO
        };
        StateWriteRequest {
            key,
            value,
            op_id: options.op_id,
            host_minted: false,
            if_revision: options.if_revision,
            within,
            wait,
        }
    }
}

impl foldhost::guest::state::Host for HostState {
    fn get(
        &mut self,
        bucket: String,
        key: String,
    ) -> wasmtime::Result<Result<Option<Entry>, Refusal>> {
        let lane = match self.read_lane(&bucket) {
            Ok(l) => l,
            Err(r) => return Ok(Err(r)),
        };
        if let Some(written) = self.capturing().and_then(|c| c.get(&bucket, &key)) {
            // A trial reads what it wrote (revision unknown: it was never published).
            return Ok(Ok(written.map(|value| Entry {
                key,
                value,
                revision: 0,
            })));
        }
        let got = lane
            .read
            .get(&key)
            .map_err(|e| wasmtime::Error::msg(format!("state get {bucket:?} {key:?}: {e}")))?;
        Ok(Ok(got.map(entry)))
    }

    fn keys(
        &mut self,
        bucket: String,
        prefix: String,
        start_after: Option<String>,
        limit: u32,
    ) -> wasmtime::Result<Result<Vec<String>, Refusal>> {
        let lane = match self.read_lane(&bucket) {
            Ok(l) => l,
            Err(r) => return Ok(Err(r)),
        };
        let limit = limit.min(MAX_KEYS_LIMIT) as usize;
        let overlay = self
            .capturing()
            .map(|c| c.keys(&bucket, &prefix, start_after.as_deref()))
            .unwrap_or_default();
        // Enough of the fold's keys that the ones a trial deleted leave `limit` behind.
        // (At most `MAX_KEYS_LIMIT` more: a trial that deleted more may get a short page.)
        let gone = overlay.iter().filter(|(_, present)| !present).count();
        let asked = limit.saturating_add(gone.min(MAX_KEYS_LIMIT as usize));
        let got = lane
            .read
            .scan(&prefix, start_after.as_deref(), asked)
            .map_err(|e| wasmtime::Error::msg(format!("state keys {bucket:?} {prefix:?}: {e}")))?;
        if overlay.is_empty() {
            return Ok(Ok(got.into_iter().map(|e| e.key).collect()));
        }
        Ok(Ok(merge_keys(
            got.into_iter().map(|e| e.key),
            overlay,
            limit,
            asked,
        )))
    }

    async fn put(
        &mut self,
        bucket: String,
        key: String,
        value: Vec<u8>,
        options: WriteOptions,
    ) -> wasmtime::Result<Result<Written, Refusal>> {
        Ok(self.state_write(bucket, key, Some(value), options).await)
    }

    async fn delete(
        &mut self,
        bucket: String,
        key: String,
        options: WriteOptions,
    ) -> wasmtime::Result<Result<Written, Refusal>> {
        Ok(self.state_write(bucket, key, None, options).await)
    }
}

#[cfg(test)]
mod tests {
    use super::merge_keys;

    fn keys(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_trials_overlay_hides_its_deletions_adds_its_puts_and_never_orders_a_page_wrongly() {
        // A page that is not full: the fold ended, every put of the overlay belongs.
        let got = merge_keys(
            keys(&["a", "c"]).into_iter(),
            vec![("b".into(), true), ("c".into(), false), ("z".into(), true)],
            10,
            11,
        );
        assert_eq!(got, keys(&["a", "b", "z"]));
        // A full page: a put past its last key waits for the next page (the fold may hold keys
        // between), and the deletions still leave `limit` keys.
        let got = merge_keys(
            keys(&["a", "b", "c"]).into_iter(),
            vec![("b".into(), false), ("bb".into(), true), ("d".into(), true)],
            2,
            3,
        );
        assert_eq!(got, keys(&["a", "bb"]));
    }
}
