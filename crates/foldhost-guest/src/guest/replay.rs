//! Writes from `on-applied`, at least once (docs/state.md, "Writes from `on-applied`"). A guest
//! that owns a state bucket writes from `on-applied`, after the commit it reports: a crash
//! between the commit and the call, or a failure part-way through it, would lose those writes.
//! So every commit of such a guest's folds records an intent (the cursor, and the instant the
//! ids of its writes are minted at), and `on-applied` is called again for it — on the instance
//! hydrated at the next start, and on the fresh instance after it failed — with the same
//! operation ids, so the write path's ledger answers a write that landed instead of publishing it
//! again.
//!
//! Invariants:
//! - **An id names one write**: a write from `on-applied` without an op id of the guest's gets one
//!   derived from the guest's name, the bucket `on-applied` reports, its revision, and the write
//!   itself (its bucket, key, operation and value, and how many identical writes came before it in
//!   the call). The same write at the same cursor has the same id — whichever instance or start
//!   makes it — and another write never shares it, so a replay whose writes differ from the first
//!   run's (a guest that writes what its state lacks) is never refused `op_reused`.
//! - **Its instant is the commit's**: the id's UUIDv7 time is the intent's, recorded in the commit,
//!   so the ledger's watermark and the broker's window judge a replay as a retry of the first run.
//! - **A replay is tried once**: a replay that fails again is logged and not retried (a guest that
//!   always fails there would otherwise rebuild forever); a guest-given op id is used as it is.

use std::collections::BTreeMap;

use foldhost_core::retained::AppliedIntent;

use super::Live;
use foldhost_core::protocol::GuestCall;
use foldhost_fold::applied::ApplyError;

/// The ids of one `on-applied` call's writes, derived from its intent.
pub(crate) struct DerivedIds {
    minted_unix_ms: u64,
    /// The call is made again (its writes are retries of the first call's).
    replay: bool,
    /// BLAKE3 of the guest's name, the reported bucket and revision: what every write of the call
    /// shares.
    call: blake3::Hasher,
    /// How many times each write (by its digest) was made in this call.
    made: BTreeMap<[u8; 32], u32>,
}

impl DerivedIds {
    /// The ids of `on-applied(bucket, intent.revision)` of the guest `guest`, made for the first
    /// time or again (`replay`).
    pub(crate) fn new(guest: &str, bucket: &str, intent: AppliedIntent, replay: bool) -> Self {
        let mut call = blake3::Hasher::new();
        call.update(b"foldhost on-applied op id\0");
        for part in [guest.as_bytes(), bucket.as_bytes()] {
            call.update(&(part.len() as u64).to_be_bytes());
            call.update(part);
        }
        call.update(&intent.revision.to_be_bytes());
        call.update(&intent.nonce.to_be_bytes());
        DerivedIds {
            minted_unix_ms: intent.minted_unix_ms,
            replay,
            call,
            made: BTreeMap::new(),
        }
    }

    /// Whether the call is made again.
    pub(crate) fn replay(&self) -> bool {
        self.replay
    }

    /// The id of the next write of `key` to `bucket` (as the guest names it): a put of `value`, or
    /// a delete (`None`).
    pub(crate) fn next(&mut self, bucket: &str, key: &str, value: Option<&[u8]>) -> String {
        let mut h = blake3::Hasher::new();
        for part in [bucket.as_bytes(), key.as_bytes()] {
            h.update(&(part.len() as u64).to_be_bytes());
            h.update(part);
        }
        match value {
            Some(v) => {
                h.update(b"p");
                h.update(&(v.len() as u64).to_be_bytes());
                h.update(v);
            }
            None => {
                h.update(b"d");
            }
        }
        let write = *h.finalize().as_bytes();
        let n = self.made.entry(write).or_insert(0);
        let ordinal = *n;
        *n = n.saturating_add(1);
        let mut id = self.call.clone();
        id.update(&write);
        id.update(&ordinal.to_be_bytes());
        let digest = id.finalize();
        let mut random = [0u8; 10];
        random.copy_from_slice(&digest.as_bytes()[..10]);
        uuid::Builder::from_unix_timestamp_millis(self.minted_unix_ms, &random)
            .into_uuid()
            .to_string()
    }
}

/// What a guest still owes `on-applied`: the intent handed over for each bucket's next call, and
/// the calls to make again on the next fresh instance.
#[derive(Default)]
pub(crate) struct Replays {
    /// Bucket (`""`: the main one) → the intent of its coming `on-applied`.
    pub(crate) next: BTreeMap<String, AppliedIntent>,
    /// `on-applied` calls to make again, in order, on the next fresh instance.
    pub(crate) due: Vec<(String, AppliedIntent)>,
    /// The intents the folds recorded were read (once, at the first hydration).
    pub(crate) read: bool,
}

impl Replays {
    /// `on-applied(bucket)` with `intent` failed (or could not be made): make it again on the next
    /// fresh instance. One already owed for the bucket is kept: its writes may have landed under
    /// its ids, and the call made again under them collapses onto them.
    pub(crate) fn failed(&mut self, bucket: &str, intent: AppliedIntent) {
        if !self.due.iter().any(|(b, _)| b == bucket) {
            self.due.push((bucket.to_string(), intent));
        }
    }
}

impl super::GuestApply {
    /// `on-applied(bucket, revision)` on `live`, its writes' ids derived from `intent` when there
    /// is one. An error leaves the instance untrustworthy: the caller drops it.
    pub(super) async fn call_on_applied(
        &mut self,
        live: &mut Live,
        bucket: &str,
        revision: u64,
        intent: Option<(AppliedIntent, bool)>,
    ) -> Result<(), ApplyError> {
        self.core.arm(live, GuestCall::OnApplied);
        live.store.data_mut().derived =
            intent.map(|(i, again)| DerivedIds::new(&self.core.manifest.name, bucket, i, again));
        let called = self
            .core
            .within(
                "on-applied",
                live.guest.on_applied(&mut live.store, bucket, revision),
            )
            .await;
        live.store.data_mut().derived = None;
        match called {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(self.core.call_error(live, "on-applied", e)),
            Err(err) => Err(err),
        }
    }

    /// The `on-applied` calls a fresh, hydrated instance owes (the intents the folds' last commits
    /// recorded, at the first hydration; the calls that failed since, afterwards), made on it in
    /// order. `None` when one failed again: the instance is gone, that call is not retried, and
    /// the rest stay owed. While a capture runs (a shadow's comparison), nothing is made: a write
    /// would be captured, not published, so the calls stay owed.
    pub(super) async fn replay_due(&mut self, mut live: Live) -> Result<Option<Live>, ApplyError> {
        if !self.replays.read {
            if self.core.link.records_intents() {
                self.replays.due = self.recorded_intents()?;
            }
            self.replays.read = true;
        }
        if self.core.capturing() {
            return Ok(Some(live));
        }
        while !self.replays.due.is_empty() {
            let (bucket, intent) = self.replays.due.remove(0);
            let shown = if bucket.is_empty() { "(main)" } else { &bucket };
            let called = self
                .call_on_applied(&mut live, &bucket, intent.revision, Some((intent, true)))
                .await;
            if let Err(err) = called {
                tracing::warn!(event = "on_applied_replay_failed", guest = %self.core.describe(), bucket = shown, revision = intent.revision, error = %err, "on-applied failed again when called for a commit whose writes were not known to have landed; not retried");
                return Ok(None);
            }
            tracing::info!(event = "on_applied_replayed", guest = %self.core.describe(), bucket = shown, revision = intent.revision, "on-applied called again for a commit whose writes were not known to have landed");
        }
        Ok(Some(live))
    }

    /// A swap cut over: the calls the replaced version owed are not made by the new one (its
    /// instance was hydrated at the cut-over, and its code is not the code that owed them).
    pub(super) fn drop_owed(&mut self) {
        for (bucket, intent) in std::mem::take(&mut self.replays.due) {
            let shown = if bucket.is_empty() { "(main)" } else { &bucket };
            tracing::warn!(event = "on_applied_replay_dropped", guest = %self.core.describe(), bucket = shown, revision = intent.revision, "a swap cut over before on-applied was called again for a commit whose writes were not known to have landed");
        }
    }

    /// The intents the folds' last commits recorded: the main fold's, then each state bucket's in
    /// declaration order.
    fn recorded_intents(&self) -> Result<Vec<(String, AppliedIntent)>, ApplyError> {
        let read_err = |e: foldhost_core::snapshot::SnapshotError| {
            self.core
                .err("hydrate", format!("read the fold's on-applied intent: {e}"))
        };
        let mut due = Vec::new();
        if let Some(i) = self.core.fold.applied_intent().map_err(read_err)? {
            due.push((String::new(), i));
        }
        for lane in self.core.state.get().map_or(&[][..], |s| &s.lanes) {
            if let Some(i) = lane.read.applied_intent().map_err(read_err)? {
                due.push((lane.decl.local.clone(), i));
            }
        }
        Ok(due)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn intent(revision: u64) -> AppliedIntent {
        AppliedIntent {
            revision,
            minted_unix_ms: 1_700_000_000_000,
            nonce: 7,
        }
    }

    #[test]
    fn the_same_write_at_the_same_cursor_gets_the_same_id_and_any_other_write_another() {
        let mut first = DerivedIds::new("mirror", "", intent(7), false);
        let mut again = DerivedIds::new("mirror", "", intent(7), false);
        let a = first.next("notes", "a", Some(b"1"));
        // A replay that skips a write the first run made still names the next one alike.
        let b = first.next("notes", "b", Some(b"2"));
        assert_eq!(again.next("notes", "b", Some(b"2")), b);
        assert_eq!(again.next("notes", "a", Some(b"1")), a);
        assert_ne!(a, b);
        for other in [
            DerivedIds::new("mirror", "", intent(8), false).next("notes", "a", Some(b"1")),
            DerivedIds::new("mirror", "notes", intent(7), false).next("notes", "a", Some(b"1")),
            DerivedIds::new("other", "", intent(7), false).next("notes", "a", Some(b"1")),
            DerivedIds::new("mirror", "", intent(7), false).next("notes", "a", Some(b"2")),
            DerivedIds::new("mirror", "", intent(7), false).next("notes", "a", None),
            DerivedIds::new("mirror", "", intent(7), false).next("other", "a", Some(b"1")),
        ] {
            assert_ne!(other, a);
        }
    }

    #[test]
    fn a_write_repeated_in_one_call_gets_a_new_id_each_time() {
        let mut ids = DerivedIds::new("g", "", intent(3), false);
        let put = ids.next("notes", "k", Some(b"v"));
        let del = ids.next("notes", "k", None);
        let put_again = ids.next("notes", "k", Some(b"v"));
        assert_ne!(put, put_again);
        assert_ne!(put, del);
    }

    #[test]
    fn a_derived_id_is_a_uuidv7_of_the_intents_instant() {
        let id = DerivedIds::new("g", "", intent(3), false).next("notes", "k", Some(b"v"));
        let u = uuid::Uuid::parse_str(&id).expect("a uuid");
        assert_eq!(u.get_version_num(), 7);
        let (secs, nanos) = u.get_timestamp().expect("a timestamp").to_unix();
        assert_eq!(
            secs * 1000 + u64::from(nanos) / 1_000_000,
            1_700_000_000_000
        );
    }

    #[test]
    fn a_failed_call_is_due_once_with_its_oldest_intent() {
        let mut r = Replays::default();
        r.failed("", intent(3));
        r.failed("notes", intent(4));
        r.failed("", intent(5));
        assert_eq!(
            r.due,
            vec![(String::new(), intent(3)), ("notes".to_string(), intent(4))]
        );
    }

    #[test]
    fn another_nonce_gives_every_write_another_id() {
        let other = AppliedIntent {
            nonce: 8,
            ..intent(7)
        };
        assert_ne!(
            DerivedIds::new("g", "", intent(7), false).next("notes", "a", Some(b"1")),
            DerivedIds::new("g", "", other, false).next("notes", "a", Some(b"1"))
        );
    }
}
