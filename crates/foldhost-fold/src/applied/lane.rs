//! Lanes: the folds of a guest's state buckets beside its main fold (docs/state.md). Each declared
//! bucket is folded by a [`watch_applied`](super::watch_applied) loop of its own, with its own
//! store, cursor, repair, identity check and floor guard; the guest lives in the main loop, and a
//! lane reaches it through [`LaneApply`], which hands each of its flushes to the main loop as a
//! [`LaneSession`] over the control channel ([`Control::Lane`]).
//!
//! Invariants:
//! - **One guest call at a time, and no other call inside a lane's batch.** The main loop serves a
//!   session inline, step by step, from its first `parse` to the `on-applied` after its commit
//!   (or until the lane drops it: a failed call, a discard, the lane's end). Nothing else — no
//!   batch of the main bucket, no query, no rebuild, no other lane — reaches the guest between a
//!   lane's `apply` and its commit, so no instance is ever rebuilt from a lane store that lacks a
//!   batch the instance applied.
//! - **The generation rule holds across lanes**: [`LaneApply::generation`] is the guest's own
//!   ([`LaneLink`]), so a lane batch re-queued after a failed commit and retried on a rebuilt
//!   instance discards that instance ([`LaneLink::request_discard`]) as the main fold does.
//! - A lane never waits on the main loop while the main loop waits on it: a session's steps are
//!   answered by the loop that awaits them, and a lane that goes away ends its session.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot};

use foldhost_core::kv::{KvUpdate, WatchCursor};
use foldhost_core::retained::AppliedIntent;

use super::{Apply, ApplyError, Control, Verdict};

/// What a guest and the lanes that reach it share: the guest's generation (see
/// [`Apply::generation`]) and a lane's request to drop the live instance.
#[derive(Debug, Default)]
pub struct LaneLink {
    generation: AtomicU64,
    discard: AtomicBool,
    intents: AtomicBool,
}

impl LaneLink {
    /// The guest records its generation after every rebuild or swap.
    pub fn set_generation(&self, generation: u64) {
        self.generation.store(generation, Ordering::Release);
    }

    /// The guest's generation, as last recorded.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// A lane asks the guest to drop its live instance before its next call.
    pub fn request_discard(&self) {
        self.discard.store(true, Ordering::Release);
    }

    /// Whether a discard is asked (without taking it).
    pub fn discard_requested(&self) -> bool {
        self.discard.load(Ordering::Acquire)
    }

    /// The guest says whether its `on-applied` may write outside the folds
    /// ([`Apply::records_intents`]): its lanes then record intents too.
    pub fn set_records_intents(&self, records: bool) {
        self.intents.store(records, Ordering::Release);
    }

    /// Whether the guest's `on-applied` may write outside the folds.
    pub fn records_intents(&self) -> bool {
        self.intents.load(Ordering::Acquire)
    }

    /// Takes a lane's discard request: true once per request.
    pub fn take_discard(&self) -> bool {
        self.discard.swap(false, Ordering::AcqRel)
    }
}

/// One step of a lane's flush, as the main loop serves it.
pub enum LaneStep {
    /// `parse` the lane's batch (tagged with its bucket).
    Parse {
        /// The batch.
        batch: Vec<KvUpdate>,
        /// The verdicts, or the call's failure.
        reply: oneshot::Sender<Result<Vec<Verdict>, ApplyError>>,
    },
    /// `apply` what the last `parse` accepted.
    Apply {
        /// The batch `parse` saw.
        batch: Vec<KvUpdate>,
        /// Its verdicts.
        verdicts: Vec<Verdict>,
        /// Done, or the call's failure.
        reply: oneshot::Sender<Result<(), ApplyError>>,
    },
    /// The lane's store committed through `cursor`: `on-applied`, and the session ends.
    OnApplied {
        /// The lane's committed cursor.
        cursor: WatchCursor,
        /// The intent committed with it, when the guest records them.
        intent: Option<AppliedIntent>,
    },
}

/// A lane's exclusive turn at the guest: the main loop serves its steps until `OnApplied` or
/// until the lane drops the sender.
pub struct LaneSession {
    /// The bucket as the guest names it.
    pub bucket: String,
    /// The steps, in order.
    pub steps: mpsc::Receiver<LaneStep>,
}

/// The applier of a lane's fold: every call goes to the guest in the main loop.
pub struct LaneApply {
    bucket: String,
    describe: String,
    control: mpsc::Sender<Control>,
    session: Option<mpsc::Sender<LaneStep>>,
    link: Arc<LaneLink>,
    intent: Option<AppliedIntent>,
}

impl LaneApply {
    /// The applier of lane `bucket` (as the guest names it), reaching the guest `describe` through
    /// the main loop's `control` channel.
    pub fn new(
        bucket: String,
        describe: String,
        control: mpsc::Sender<Control>,
        link: Arc<LaneLink>,
    ) -> Self {
        LaneApply {
            bucket,
            describe,
            control,
            session: None,
            link,
            intent: None,
        }
    }

    fn gone(&self, call: &'static str) -> ApplyError {
        ApplyError {
            applier: self.describe.clone(),
            call,
            message: format!(
                "the guest's fold has stopped (state bucket {:?} cannot reach it)",
                self.bucket
            ),
        }
    }

    /// The open session, opening one (a turn at the guest) when none is.
    async fn session(&mut self, call: &'static str) -> Result<mpsc::Sender<LaneStep>, ApplyError> {
        if let Some(s) = &self.session {
            return Ok(s.clone());
        }
        let (tx, rx) = mpsc::channel(1);
        let session = LaneSession {
            bucket: self.bucket.clone(),
            steps: rx,
        };
        self.control
            .send(Control::Lane(session))
            .await
            .map_err(|_| self.gone(call))?;
        self.session = Some(tx.clone());
        Ok(tx)
    }

    async fn step<T>(
        &mut self,
        call: &'static str,
        make: impl FnOnce(oneshot::Sender<Result<T, ApplyError>>) -> LaneStep,
    ) -> Result<T, ApplyError> {
        let tx = self.session(call).await?;
        let (reply, rx) = oneshot::channel();
        let answer = match tx.send(make(reply)).await {
            Ok(()) => rx.await.map_err(|_| self.gone(call)).and_then(|r| r),
            Err(_) => Err(self.gone(call)),
        };
        if answer.is_err() {
            // A failed call ends the turn: the fold retries the batch in a session of its own.
            self.session = None;
        }
        answer
    }
}

#[async_trait]
impl Apply for LaneApply {
    fn describe(&self) -> String {
        self.describe.clone()
    }

    async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
        let batch = batch.to_vec();
        self.step("parse", |reply| LaneStep::Parse { batch, reply })
            .await
    }

    async fn apply(&mut self, batch: &[KvUpdate], verdicts: &[Verdict]) -> Result<(), ApplyError> {
        let (batch, verdicts) = (batch.to_vec(), verdicts.to_vec());
        self.step("apply", |reply| LaneStep::Apply {
            batch,
            verdicts,
            reply,
        })
        .await
    }

    fn records_intents(&self) -> bool {
        self.link.records_intents()
    }

    fn intend(&mut self, _bucket: &str, intent: AppliedIntent) {
        self.intent = Some(intent);
    }

    async fn on_applied(&mut self, cursor: WatchCursor) {
        let intent = self.intent.take();
        if let Ok(tx) = self.session("on-applied").await {
            let _ = tx.send(LaneStep::OnApplied { cursor, intent }).await;
        }
        // The turn ends with its commit.
        self.session = None;
    }

    fn discard(&mut self) {
        self.link.request_discard();
        self.session = None;
    }

    fn generation(&self) -> u64 {
        self.link.generation()
    }
}

/// Serves `session` against `apply` until it ends (the main loop's side of a lane's turn). With
/// `feed`, each batch `apply` took is noted, and handed on as committed at the `on-applied` that
/// follows its commit (the query instance's copy of the lane, [`LaneFeed`]).
pub(crate) async fn serve<A: Apply + ?Sized>(
    apply: &mut A,
    mut session: LaneSession,
    mut feed: Option<&mut LaneFeed>,
) {
    while let Some(step) = session.steps.recv().await {
        match step {
            LaneStep::Parse { batch, reply } => {
                if let Some(f) = feed.as_deref_mut() {
                    f.parsing(&session.bucket);
                }
                let r = apply.parse_lane(&session.bucket, &batch).await;
                let _ = reply.send(r);
            }
            LaneStep::Apply {
                batch,
                verdicts,
                reply,
            } => {
                let r = apply.apply(&batch, &verdicts).await;
                if r.is_ok()
                    && let Some(f) = feed.as_deref_mut()
                {
                    f.applied(&session.bucket, batch);
                }
                let _ = reply.send(r);
            }
            LaneStep::OnApplied { cursor, intent } => {
                if let Some(f) = feed.as_deref_mut() {
                    f.committed(&session.bucket);
                }
                if let Some(i) = intent {
                    apply.intend(&session.bucket, i);
                }
                apply.on_applied_lane(&session.bucket, cursor).await;
                return;
            }
        }
    }
}

/// Most bytes of lane batches a [`LaneFeed`] holds for the query instance; past it the feed
/// overflows and the query instance is rebuilt from the folds.
pub(crate) const MAX_LANE_FEED_BYTES: usize = 64 * 1024 * 1024;

/// The state buckets' batches on their way to the query instance: noted when the guest applied
/// them, handed on once their lane committed them (a batch applied and not committed — its commit
/// failed and is retried — waits for the `on-applied` of the retry; one still pending when the
/// bucket's next batch is parsed was never committed, and is dropped).
#[derive(Debug, Default)]
pub(crate) struct LaneFeed {
    /// Applied, not yet committed, per bucket.
    pending: std::collections::BTreeMap<String, Vec<Vec<KvUpdate>>>,
    /// Committed, in commit order, not yet handed to the query instance.
    committed: Vec<(String, Vec<KvUpdate>)>,
    bytes: usize,
    overflowed: bool,
}

impl LaneFeed {
    fn applied(&mut self, bucket: &str, batch: Vec<KvUpdate>) {
        if self.overflowed {
            return;
        }
        self.bytes += batch.iter().map(KvUpdate::byte_len).sum::<usize>();
        if self.bytes > MAX_LANE_FEED_BYTES {
            self.overflowed = true;
            self.pending.clear();
            self.committed.clear();
            return;
        }
        self.pending
            .entry(bucket.to_string())
            .or_default()
            .push(batch);
    }

    /// A new batch of `bucket` reaches the guest: a batch of it applied before and still not
    /// committed never will be (a lane commits a re-queued batch before the guest sees a newer
    /// one; one that is never committed — a failed release — was dropped).
    fn parsing(&mut self, bucket: &str) {
        self.pending.remove(bucket);
    }

    fn committed(&mut self, bucket: &str) {
        if let Some(batches) = self.pending.remove(bucket) {
            self.committed
                .extend(batches.into_iter().map(|b| (bucket.to_string(), b)));
        }
    }

    /// Whether committed batches wait.
    pub(crate) fn has_committed(&self) -> bool {
        !self.committed.is_empty()
    }

    /// True once the feed dropped batches (over its bound): the query instance must be rebuilt.
    pub(crate) fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// The committed batches, in commit order, handed on.
    pub(crate) fn take_committed(&mut self) -> Vec<(String, Vec<KvUpdate>)> {
        let out = std::mem::take(&mut self.committed);
        self.bytes = self
            .pending
            .values()
            .flatten()
            .flatten()
            .map(KvUpdate::byte_len)
            .sum();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An applier that records what each call saw, tagged with its bucket.
    #[derive(Default)]
    struct Tagged {
        calls: Vec<String>,
    }

    #[async_trait]
    impl Apply for Tagged {
        fn describe(&self) -> String {
            "tagged".into()
        }
        async fn parse(&mut self, batch: &[KvUpdate]) -> Result<Vec<Verdict>, ApplyError> {
            self.calls.push(format!("parse :{}", batch.len()));
            Ok(vec![Verdict::Accept; batch.len()])
        }
        async fn parse_lane(
            &mut self,
            bucket: &str,
            batch: &[KvUpdate],
        ) -> Result<Vec<Verdict>, ApplyError> {
            if batch.iter().any(|u| u.key() == "poison") {
                return Err(ApplyError {
                    applier: "tagged".into(),
                    call: "parse",
                    message: "poison".into(),
                });
            }
            self.calls.push(format!("parse {bucket}:{}", batch.len()));
            Ok(vec![Verdict::Accept; batch.len()])
        }
        async fn apply(&mut self, batch: &[KvUpdate], _: &[Verdict]) -> Result<(), ApplyError> {
            self.calls.push(format!("apply {}", batch.len()));
            Ok(())
        }
        async fn on_applied(&mut self, cursor: WatchCursor) {
            self.calls
                .push(format!("on-applied :{}", cursor.revision_or_zero()));
        }
        async fn on_applied_lane(&mut self, bucket: &str, cursor: WatchCursor) {
            self.calls
                .push(format!("on-applied {bucket}:{}", cursor.revision_or_zero()));
        }
    }

    /// The main loop's side: a task serving sessions, one at a time, against a [`Tagged`].
    fn main_loop() -> (mpsc::Sender<Control>, tokio::task::JoinHandle<Tagged>) {
        let (tx, mut rx) = mpsc::channel::<Control>(4);
        let task = tokio::spawn(async move {
            let mut apply = Tagged::default();
            while let Some(c) = rx.recv().await {
                if let Control::Lane(s) = c {
                    serve(&mut apply, s, None).await;
                }
            }
            apply
        });
        (tx, task)
    }

    fn put(key: &str, revision: u64) -> KvUpdate {
        KvUpdate::Put(foldhost_core::kv::KvEntry {
            key: key.into(),
            value: bytes::Bytes::from_static(b"v"),
            version: foldhost_core::kv::VersionToken::from_u64(revision),
        })
    }

    #[tokio::test]
    async fn a_lane_batch_reaches_the_guest_tagged_and_two_lanes_never_interleave_within_a_turn() {
        let (tx, task) = main_loop();
        let link = Arc::new(LaneLink::default());
        let mut notes = LaneApply::new("notes".into(), "g@1".into(), tx.clone(), link.clone());
        let mut tally = LaneApply::new("owner.tally".into(), "g@1".into(), tx.clone(), link);
        let batch = vec![put("a", 1), put("b", 2)];
        let v = notes.parse(&batch).await.expect("parsed");
        assert_eq!(v, [Verdict::Accept, Verdict::Accept]);
        // `tally` asks for its turn while `notes` holds one: it is served only after notes's
        // on-applied ends it.
        let second = tokio::spawn(async move {
            let v = tally.parse(&[put("c", 9)]).await.expect("parsed");
            tally.apply(&[put("c", 9)], &v).await.expect("applied");
            tally.on_applied(WatchCursor::at(9)).await;
        });
        tokio::task::yield_now().await;
        notes.apply(&batch, &v).await.expect("applied");
        notes.on_applied(WatchCursor::at(2)).await;
        second.await.expect("second lane");
        // A failed call ends the turn; the next call opens another.
        let err = notes.parse(&[put("poison", 3)]).await.expect_err("refused");
        assert_eq!(err.message, "poison");
        assert!(notes.session.is_none(), "a failed call ends the turn");
        drop(notes);
        drop(tx);
        let apply = task.await.expect("the loop ends");
        assert_eq!(
            apply.calls,
            [
                "parse notes:2",
                "apply 2",
                "on-applied notes:2",
                "parse owner.tally:1",
                "apply 1",
                "on-applied owner.tally:9",
            ]
        );
    }

    #[tokio::test]
    async fn a_lane_whose_guest_loop_is_gone_gets_an_error_naming_its_bucket() {
        let (tx, rx) = mpsc::channel::<Control>(1);
        drop(rx);
        let mut lane = LaneApply::new(
            "tally".into(),
            "g@1".into(),
            tx,
            Arc::new(LaneLink::default()),
        );
        let err = lane.parse(&[put("a", 1)]).await.expect_err("gone");
        assert!(err.message.contains("\"tally\""), "{err}");
    }

    #[test]
    fn a_discard_request_is_taken_once_and_the_generation_is_the_guests() {
        let link = LaneLink::default();
        link.set_generation(3);
        assert_eq!(link.generation(), 3);
        assert!(!link.take_discard());
        link.request_discard();
        assert!(link.discard_requested());
        assert!(link.take_discard());
        assert!(!link.take_discard());
    }
}
