//! [`Queries`]: where a running fold's queries go — the query instance, a second instance of the
//! applier kept level with the committed fold beside it, when one is level; the fold loop
//! ([`Control::Query`], between batches) otherwise (docs/design.md, "Queries off the fold's path").
//!
//! Invariants:
//! - A query is answered by one instance whose structure is a whole committed state: the query
//!   instance between its catch-up rounds, or the running applier between batches. Never a
//!   half-applied batch.
//! - A query asked of the query instance never waits for a batch of the fold, and the fold never
//!   waits for a query: the two meet only at a round's start (a capture restart, between batches).
//! - The query instance answers only while it is level with the version the fold runs: the fold
//!   loop withdraws it ([`Queries::withdraw`]) before a swap's new version answers its first
//!   query, and when the running applier was rebuilt; until the next one is level the fold loop
//!   answers.
//! - Lookups asked together are answered together, in order, by the same instance with nothing
//!   applied between them.
//! - **Never older than what was answered applied.** An ask is answered from a state at or past
//!   the fold's `applied_through` when it was asked (every write this node answered `applied`
//!   before, every `Foldhost-Min-Revision` the caller already waited for): the query instance only
//!   once its level reaches it ([`LEVEL_WAIT`]), the fold loop otherwise.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, oneshot};

use super::{ApplyError, Control};

/// Most lookups one ask may carry.
pub const MAX_LOOKUPS_PER_ASK: usize = 4096;

/// How long an ask waits for the query instance to reach the fold's `applied_through` (normally
/// one round, right after the batch that moved it) before the fold loop answers it instead.
pub(crate) const LEVEL_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Asks waiting for the query instance at once; beyond, an ask waits for room.
pub(crate) const ASK_QUEUE: usize = 256;

/// One ask: lookups answered in order by one instance.
pub(crate) struct Ask {
    pub(crate) lookups: Vec<Vec<u8>>,
    pub(crate) reply: oneshot::Sender<Vec<Result<Vec<u8>, ApplyError>>>,
}

/// Why an ask got no answers at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unanswered {
    /// The fold stopped.
    #[error("the fold is not running")]
    Stopped,
    /// More lookups than [`MAX_LOOKUPS_PER_ASK`].
    #[error("more than {MAX_LOOKUPS_PER_ASK} lookups in one ask")]
    TooMany,
}

/// The query route of one fold: cloned into everything that answers queries (HTTP, NATS).
#[derive(Clone)]
pub struct Queries {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Queries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queries")
            .field("instance_level", &self.instance_level())
            .finish()
    }
}

struct Shared {
    control: mpsc::Sender<Control>,
    /// Where the level and the counts are published too (`/status`, `/metrics`), when given.
    status: Option<Arc<foldhost_core::status::FoldStatus>>,
    /// The query instance's channel, while one is level, and the epoch: raised by every
    /// withdrawal, so an instance withdrawn while its task still runs can never install itself
    /// or move the level again.
    instance: Mutex<(Option<mpsc::Sender<Ask>>, u64)>,
    /// The revision the query instance is level with, plus one (0: none is level).
    level: AtomicU64,
    /// Told whenever the level moves (or the instance is withdrawn).
    level_moved: tokio::sync::Notify,
    /// Lookups the query instance answered, and those the fold loop answered.
    by_instance: AtomicU64,
    by_fold: AtomicU64,
}

impl Queries {
    /// The route of the fold whose control channel is `control`: the fold loop answers until a
    /// query instance is level.
    pub fn new(control: mpsc::Sender<Control>) -> Self {
        Self::build(control, None)
    }

    /// [`Queries::new`], publishing the query instance's level and the lookups each side
    /// answered into the fold's `status` as well.
    pub fn reporting(
        control: mpsc::Sender<Control>,
        status: Arc<foldhost_core::status::FoldStatus>,
    ) -> Self {
        Self::build(control, Some(status))
    }

    fn build(
        control: mpsc::Sender<Control>,
        status: Option<Arc<foldhost_core::status::FoldStatus>>,
    ) -> Self {
        Queries {
            shared: Arc::new(Shared {
                control,
                status,
                instance: Mutex::new((None, 0)),
                level: AtomicU64::new(0),
                level_moved: tokio::sync::Notify::new(),
                by_instance: AtomicU64::new(0),
                by_fold: AtomicU64::new(0),
            }),
        }
    }

    /// Whether a query instance answers now.
    pub fn instance_level(&self) -> bool {
        self.shared
            .instance
            .lock()
            .map(|i| i.0.as_ref().is_some_and(|s| !s.is_closed()))
            .unwrap_or(false)
    }

    /// The committed revision the query instance answers from (every answer it gives from now on
    /// is the fold at this revision or later); `None` while none is level. 0: an empty fold.
    pub fn level(&self) -> Option<u64> {
        match self.shared.level.load(Ordering::Acquire) {
            0 => None,
            r => Some(r - 1),
        }
    }

    /// The epoch an instance starting now belongs to.
    pub(crate) fn epoch(&self) -> u64 {
        self.shared.instance.lock().map_or(u64::MAX, |i| i.1)
    }

    /// The query instance of `epoch` is level with the committed fold at `revision` (ignored
    /// once that epoch was withdrawn).
    pub(crate) fn set_level(&self, revision: u64, epoch: u64) {
        if let Ok(i) = self.shared.instance.lock()
            && i.1 == epoch
        {
            self.publish_level(revision.saturating_add(1));
        }
    }

    /// The level, plus one (0: none), here and in the fold's status.
    fn publish_level(&self, level: u64) {
        self.shared.level.store(level, Ordering::Release);
        self.shared.level_moved.notify_waiters();
        if let Some(s) = &self.shared.status {
            s.query_instance_level.store(level, Ordering::Relaxed);
        }
    }

    /// `n` lookups answered, by the query instance or by the fold loop.
    fn count(&self, n: u64, by_instance: bool) {
        let (here, there) = match (&self.shared.status, by_instance) {
            (s, true) => (
                &self.shared.by_instance,
                s.as_ref().map(|s| &s.queries_by_instance),
            ),
            (s, false) => (&self.shared.by_fold, s.as_ref().map(|s| &s.queries_by_fold)),
        };
        here.fetch_add(n, Ordering::Relaxed);
        if let Some(t) = there {
            t.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Lookups answered so far by the query instance and by the fold loop.
    pub fn answered(&self) -> (u64, u64) {
        (
            self.shared.by_instance.load(Ordering::Relaxed),
            self.shared.by_fold.load(Ordering::Relaxed),
        )
    }

    /// The query instance `tx` of `epoch` answers from now on (unless that epoch was withdrawn).
    pub(crate) fn install(&self, tx: mpsc::Sender<Ask>, epoch: u64) {
        if let Ok(mut i) = self.shared.instance.lock()
            && i.1 == epoch
        {
            i.0 = Some(tx);
        }
    }

    /// No query instance answers from now on (asks already taken by one are still answered by
    /// it), and none of the current epoch ever again.
    pub(crate) fn withdraw(&self) {
        if let Ok(mut i) = self.shared.instance.lock() {
            i.0 = None;
            i.1 = i.1.wrapping_add(1);
            self.publish_level(0);
        }
    }

    /// One lookup: the applier's answer or its error.
    pub async fn ask(&self, request: Vec<u8>) -> Result<Result<Vec<u8>, ApplyError>, Unanswered> {
        let mut answers = self.ask_many(vec![request]).await?;
        answers.pop().ok_or(Unanswered::Stopped)
    }

    /// Several lookups answered in order by one instance, nothing applied between them.
    pub async fn ask_many(
        &self,
        lookups: Vec<Vec<u8>>,
    ) -> Result<Vec<Result<Vec<u8>, ApplyError>>, Unanswered> {
        if lookups.len() > MAX_LOOKUPS_PER_ASK {
            return Err(Unanswered::TooMany);
        }
        if lookups.is_empty() {
            return Ok(Vec::new());
        }
        let n = lookups.len() as u64;
        let instance = match self.floor() {
            Some(floor) => self.instance_at(floor).await,
            None => self.instance(),
        };
        let lookups = match instance {
            Some(tx) => {
                let (reply, rx) = oneshot::channel();
                match tx.send(Ask { lookups, reply }).await {
                    Ok(()) => match rx.await {
                        Ok(answers) => {
                            self.count(n, true);
                            return Ok(answers);
                        }
                        // The instance ended before it answered: the fold loop answers.
                        Err(_) => return self.ask_fold_loop_again(n).await,
                    },
                    // Ended before it took the ask: the lookups come back.
                    Err(mpsc::error::SendError(ask)) => ask.lookups,
                }
            }
            None => lookups,
        };
        self.ask_fold_loop(lookups).await
    }

    /// The query instance's channel, while one is level.
    fn instance(&self) -> Option<mpsc::Sender<Ask>> {
        self.shared.instance.lock().ok().and_then(|i| i.0.clone())
    }

    /// The revision an answer must include: the fold's `applied_through` now (`None` without a
    /// status to read it from).
    fn floor(&self) -> Option<u64> {
        self.shared
            .status
            .as_ref()
            .map(|s| s.applied_through.load(Ordering::Acquire))
    }

    /// The query instance once its level reaches `floor`, waiting at most [`LEVEL_WAIT`]; `None`
    /// (the fold loop answers) when none is level or it does not reach it in time.
    async fn instance_at(&self, floor: u64) -> Option<mpsc::Sender<Ask>> {
        let reached = |q: &Self| q.level().is_some_and(|l| l >= floor);
        if reached(self) {
            return self.instance();
        }
        self.instance()?;
        if let Some(s) = &self.shared.status {
            s.queries_waited_for_level.fetch_add(1, Ordering::Relaxed);
        }
        let deadline = tokio::time::Instant::now() + LEVEL_WAIT;
        loop {
            let moved = self.shared.level_moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            if reached(self) {
                return self.instance();
            }
            if self.level().is_none() || tokio::time::timeout_at(deadline, moved).await.is_err() {
                return None;
            }
        }
    }

    /// The lookups of an ask whose instance ended holding them cannot be asked again (they were
    /// moved into it): answered as a lost instance's queries are.
    async fn ask_fold_loop_again(
        &self,
        n: u64,
    ) -> Result<Vec<Result<Vec<u8>, ApplyError>>, Unanswered> {
        Ok((0..n)
            .map(|_| {
                Err(ApplyError::rebuilding(
                    "query instance".into(),
                    "it ended while answering",
                ))
            })
            .collect())
    }

    /// The lookups through the fold loop, in a row between two batches.
    async fn ask_fold_loop(
        &self,
        lookups: Vec<Vec<u8>>,
    ) -> Result<Vec<Result<Vec<u8>, ApplyError>>, Unanswered> {
        let n = lookups.len() as u64;
        let (reply, rx) = oneshot::channel();
        self.shared
            .control
            .send(Control::Queries { lookups, reply })
            .await
            .map_err(|_| Unanswered::Stopped)?;
        let answers = rx.await.map_err(|_| Unanswered::Stopped)?;
        self.count(n, false);
        Ok(answers)
    }
}
