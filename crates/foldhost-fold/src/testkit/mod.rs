//! A simulated JetStream KV bucket, [`SimBucket`], that makes the fold's loop
//! ([`crate::applied::watch_applied`]) testable in milliseconds, without a nats-server.
//!
//! Compiled for this crate's tests and, for other crates' tests, with the cargo feature `testkit`.
//!
//! # What it models
//!
//! - **A stream of messages** with sequences 1, 2, 3, …, each a put, delete or purge of a key.
//!   A purge is a rollup: it removes every earlier message of its key (as NATS KV's purge does).
//! - **A per-key history limit** ([`SimConfig::history`]): a key's messages beyond it are removed
//!   from the log, oldest first, as NATS does with superseded messages.
//! - **Eviction** by the test: [`SimBucket::evict_through`] removes every message at or below a
//!   sequence, as `max_age` or a `discard: old` limit would. The first sequence moves with it
//!   (and with the history limit), and is `last + 1` for an empty log. A per-message TTL running
//!   out ([`SimBucket::expire_now`]) removes a key's messages and appends a server delete marker;
//!   an admin purge of delete markers ([`SimBucket::purge_deletes_through`]) removes keys whose
//!   last message is a marker, marker and all.
//! - **Retention, read live**: [`KvWatcher::retention`] answers
//!   `Some(Retention { evicts_current_values, first_revision })` from [`SimConfig`] (changeable
//!   with [`SimBucket::set_evicts_current_values`]) and the live first sequence.
//! - **A stream identity**: name `KV_sim`, a settable creation time; [`SimBucket::recreate`] empties
//!   the stream and gives it a new creation time (a bucket deleted and created again). A pinned
//!   identity ([`KvWatcher::pin_identity`]) is held to as `nats.rs` holds it: a watch that starts
//!   on, or goes on over, another stream ends with [`KvError::StreamChanged`].
//! - **Watches, mirroring `nats.rs`'s `run_watch`**:
//!   - [`KvWatcher::watch`] (state-sync): the last message of every key in scope (delete and purge
//!     markers included), in sequence order, then live messages. The first event is
//!     `Pending(n)` when there is something to deliver, else `CaughtUp { through: None }`.
//!   - [`KvWatcher::watch_from`] (delta): every message in scope from `cursor + 1`;
//!     [`KvError::CursorExpired`] when [`protocol::resume_window_ok`] fails against the live first
//!     sequence; a cursor without a revision is a state-sync watch.
//!   - Updates go out as [`WatchEvent::Updates`] in sequence order, in chunks of at most
//!     [`WATCH_CHUNK`](foldhost_core::kv::WATCH_CHUNK) (whatever the log holds when the watch
//!     looks: one chunk per look), through the caller's bounded channel (a full channel
//!     backpressures the watch).
//!     [`WatchEvent::CaughtUp`] follows the chunk after which nothing in scope is left, once per
//!     watch, naming the last revision delivered.
//!   - Writes made after a watch started are pushed to every open watch.
//!   - **The live floor guard**: the watch's frontier (the last sequence it passed) starts at the
//!     cursor for a delta and at the level for a state-sync watch, exactly as in `nats.rs`. A
//!     chunk whose first message lies past `frontier + 1` (a gap) is checked before it is passed
//!     on with [`protocol::floor_guard_trips`] against the live first sequence, and the watch ends
//!     with [`KvError::CursorExpired`] when it trips. The same check runs after
//!     [`FLOOR_BACKSTOP`](foldhost_core::kv::FLOOR_BACKSTOP) without a delivery, and a prefix
//!     watch that is level and quiet moves its frontier by the quiet watermark (no in-scope message
//!     after the frontier, nothing after it evicted), as `nats.rs` does (`watch_run.rs`).
//! - **Scripted delivery faults**: [`SimBucket::hold_deliveries`] holds every watch's deliveries
//!   (writes and evictions go on meanwhile) until [`SimBucket::release_deliveries`], so a watch can
//!   be made to see a gap; [`SimBucket::break_watches`] ends every open watch with a chosen error.
//!
//! Everything is deterministic: no thread, no wall clock. Watches wake on a `tokio::sync::watch`
//! change counter; the only timer is the floor guard's backstop (`tokio::time`), which a test
//! with paused time (`#[tokio::test(start_paused = true)]`) advances at will.
//!
//! # What it does not model
//!
//! - Server clocks: no [`WatchEvent::Stamp`] events, so no eviction memo carries a time and the
//!   supersession-only resume (`nats.rs`'s `supersession_resume`) never happens: a cursor below the
//!   first sequence always gets `CursorExpired`.
//! - Real limits: no `max_age`, `max_bytes`, `max_msgs` or message TTLs run by themselves; the test
//!   evicts explicitly ([`SimBucket::evict_through`]).
//! - Consumers: no consumer errors, re-creation, heartbeats or flow control, and no
//!   [`WatchEvent::Pending`] progress after the first event; no 1-second trust of a non-evicting
//!   answer (every check reads the live state).
//! - Subjects: no key validation and no subject-token filters; a scope filters keys exactly with
//!   [`WatchScope::contains`].
//! - Clusters, leader changes, timeouts and connection loss.
//! - The identity check runs at every step of a watch (in NATS it runs at floor checks, which a
//!   recreated stream triggers through consumer errors): the outcome is the same.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::{mpsc, watch};

use foldhost_core::kv::{
    KvEntry, KvError, KvReader, KvUpdate, KvWatcher, KvWriter, StreamIdentity, StreamState,
    VersionToken, WatchCursor, WatchEvent, WatchScope,
};
use foldhost_core::protocol;

#[cfg(test)]
mod query_tests;
#[cfg(test)]
mod tests;
mod watch_run;

/// The simulated bucket's name ([`KvWatcher::bucket_name`]).
pub(crate) const SIM_BUCKET: &str = "sim";

/// The simulated stream's name (in its [`StreamIdentity`]).
pub(crate) const SIM_STREAM: &str = "KV_sim";

/// What one message of the simulated stream does to its key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimOp {
    /// The key now holds this value (an empty value is a CAS tombstone, as on NATS).
    Put(Bytes),
    /// A delete marker.
    Delete,
    /// A purge marker: removes every earlier message of the key from the log.
    Purge,
}

/// One message of the simulated stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimMessage {
    /// The stream sequence (the key's revision).
    pub sequence: u64,
    /// The key.
    pub key: String,
    /// What the message does.
    pub op: SimOp,
}

impl SimMessage {
    /// The update a watch delivers for this message.
    pub(crate) fn to_update(&self) -> KvUpdate {
        let version = VersionToken::from_u64(self.sequence);
        let key = self.key.clone();
        match &self.op {
            SimOp::Put(value) => KvUpdate::Put(KvEntry {
                key,
                value: value.clone(),
                version,
            }),
            SimOp::Delete => KvUpdate::Delete { key, version },
            SimOp::Purge => KvUpdate::Purge { key, version },
        }
    }

    /// The entry a read returns for this message (markers read as an empty value).
    fn to_entry(&self) -> KvEntry {
        KvEntry {
            key: self.key.clone(),
            value: match &self.op {
                SimOp::Put(v) => v.clone(),
                SimOp::Delete | SimOp::Purge => Bytes::new(),
            },
            version: VersionToken::from_u64(self.sequence),
        }
    }

    /// True for a put of a non-empty value (a live key).
    fn is_live(&self) -> bool {
        matches!(&self.op, SimOp::Put(v) if !v.is_empty())
    }
}

/// How a [`SimBucket`] starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// Messages kept per key (NATS's `history`, 1 to 64); 0 counts as 1.
    pub history: usize,
    /// Whether the bucket's retention can evict a current value (`max_age`, a discard-old limit,
    /// TTLs): what [`KvWatcher::retention`] answers and what the floor guard checks.
    pub evicts_current_values: bool,
    /// The stream's creation time, Unix nanoseconds (part of its identity).
    pub created_unix_ns: u64,
}

impl Default for SimConfig {
    /// History 1, retention that never evicts a current value, created at 2023-11-14T22:13:20Z.
    fn default() -> Self {
        SimConfig {
            history: 1,
            evicts_current_values: false,
            created_unix_ns: 1_700_000_000_000_000_000,
        }
    }
}

/// An in-memory JetStream-KV-like stream implementing [`KvReader`], [`KvWatcher`] and
/// [`KvWriter`] (see the module docs for what it models). A cheap handle: clones share the same
/// bucket, so a test keeps one and hands the fold another (`Arc::new(sim.clone())`).
#[derive(Clone)]
pub struct SimBucket {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    /// Bumped after every change a watch may care about (writes, evictions, held/released,
    /// recreation, injected errors).
    changes: watch::Sender<u64>,
    watches_started: AtomicU64,
    open_watches: AtomicU64,
}

struct State {
    /// The retained messages, by sequence.
    log: BTreeMap<u64, SimMessage>,
    /// Each key's retained sequences, ascending.
    by_key: BTreeMap<String, BTreeSet<u64>>,
    last_sequence: u64,
    history: usize,
    evicts_current_values: bool,
    created_unix_ns: u64,
    pinned: Option<StreamIdentity>,
    held: bool,
    /// Watches started before this epoch end with `break_error`.
    break_epoch: u64,
    break_error: Option<KvError>,
}

impl State {
    fn first_sequence(&self) -> u64 {
        self.log
            .keys()
            .next()
            .copied()
            .unwrap_or(self.last_sequence.saturating_add(1))
    }

    fn identity(&self) -> StreamIdentity {
        StreamIdentity {
            name: SIM_STREAM.to_string(),
            created_unix_ns: self.created_unix_ns,
        }
    }

    fn latest(&self, key: &str) -> Option<&SimMessage> {
        let seq = self.by_key.get(key)?.last()?;
        self.log.get(seq)
    }

    fn remove(&mut self, seq: u64) {
        if let Some(m) = self.log.remove(&seq)
            && let Some(seqs) = self.by_key.get_mut(&m.key)
        {
            seqs.remove(&seq);
            if seqs.is_empty() {
                self.by_key.remove(&m.key);
            }
        }
    }

    fn append(&mut self, key: &str, op: SimOp) -> u64 {
        self.last_sequence = self.last_sequence.saturating_add(1);
        let sequence = self.last_sequence;
        if op == SimOp::Purge {
            // The rollup: every earlier message of the key goes.
            let earlier: Vec<u64> = self
                .by_key
                .get(key)
                .map(|s| s.iter().copied().collect())
                .unwrap_or_default();
            for seq in earlier {
                self.remove(seq);
            }
        }
        self.log.insert(
            sequence,
            SimMessage {
                sequence,
                key: key.to_string(),
                op,
            },
        );
        let seqs = self.by_key.entry(key.to_string()).or_default();
        seqs.insert(sequence);
        let excess = seqs.len().saturating_sub(self.history.max(1));
        let superseded: Vec<u64> = seqs.iter().take(excess).copied().collect();
        for seq in superseded {
            self.remove(seq);
        }
        sequence
    }

    /// `nats.rs`'s `check_floor` (with `check_same_stream`): the stream must be the one the watch
    /// started on and reach `frontier`, and the floor guard must not trip.
    fn check_floor(&self, frontier: u64, start: &StreamIdentity) -> Result<(), KvError> {
        self.check_same_stream(start)?;
        if self.last_sequence < frontier {
            return Err(stream_changed(format!(
                "its last sequence {} is below the {frontier} the watch already passed",
                self.last_sequence
            )));
        }
        let first = self.first_sequence();
        if protocol::floor_guard_trips(self.evicts_current_values, frontier, first) {
            return Err(KvError::CursorExpired {
                resume_from: frontier.saturating_add(1),
                first_sequence: first,
            });
        }
        Ok(())
    }

    fn check_same_stream(&self, start: &StreamIdentity) -> Result<(), KvError> {
        let found = self.identity();
        if found != *start {
            return Err(stream_changed(format!(
                "the watch started on {start}, the bucket is now {found}"
            )));
        }
        Ok(())
    }

    /// Whether any message in scope lies at or after `from`.
    fn any_in_scope_from(&self, from: u64, scope: &WatchScope) -> bool {
        self.log.range(from..).any(|(_, m)| scope.contains(&m.key))
    }
}

fn stream_changed(detail: String) -> KvError {
    KvError::StreamChanged {
        bucket: SIM_BUCKET.to_string(),
        detail,
    }
}

impl Default for SimBucket {
    fn default() -> Self {
        SimBucket::new()
    }
}

impl std::fmt::Debug for SimBucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.state();
        f.debug_struct("SimBucket")
            .field("first_sequence", &st.first_sequence())
            .field("last_sequence", &st.last_sequence)
            .field("messages", &st.log.len())
            .field("held", &st.held)
            .finish_non_exhaustive()
    }
}

impl SimBucket {
    /// An empty bucket with [`SimConfig::default`].
    pub fn new() -> Self {
        SimBucket::with_config(SimConfig::default())
    }

    /// An empty bucket configured by `config`.
    pub fn with_config(config: SimConfig) -> Self {
        let (changes, _) = watch::channel(0);
        SimBucket {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    log: BTreeMap::new(),
                    by_key: BTreeMap::new(),
                    last_sequence: 0,
                    history: config.history.max(1),
                    evicts_current_values: config.evicts_current_values,
                    created_unix_ns: config.created_unix_ns,
                    pinned: None,
                    held: false,
                    break_epoch: 0,
                    break_error: None,
                }),
                changes,
                watches_started: AtomicU64::new(0),
                open_watches: AtomicU64::new(0),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock is a test's own bug; the state is still readable.
        self.inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `f` on the state, then wakes every watch.
    fn change<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let r = f(&mut self.state());
        self.inner.changes.send_modify(|n| *n = n.wrapping_add(1));
        r
    }

    /// Appends a put of `value` to `key`; returns its sequence.
    pub fn put_now(&self, key: &str, value: impl Into<Bytes>) -> u64 {
        let value = value.into();
        self.change(|st| st.append(key, SimOp::Put(value)))
    }

    /// Appends a delete marker for `key`; returns its sequence.
    pub fn delete_now(&self, key: &str) -> u64 {
        self.change(|st| st.append(key, SimOp::Delete))
    }

    /// Appends a purge marker for `key` (removing the key's earlier messages); returns its
    /// sequence.
    pub fn purge_now(&self, key: &str) -> u64 {
        self.change(|st| st.append(key, SimOp::Purge))
    }

    /// A per-message TTL running out on `key`'s current value (NATS 2.11 `SubjectDeleteMarkerTTL`):
    /// the key's messages are removed and the server appends a delete marker in their place;
    /// returns the marker's sequence. A fold sees a delete; the value is gone from the log.
    pub fn expire_now(&self, key: &str) -> u64 {
        self.change(|st| {
            let seqs: Vec<u64> = st
                .by_key
                .get(key)
                .map(|s| s.iter().copied().collect())
                .unwrap_or_default();
            for seq in seqs {
                st.remove(seq);
            }
            st.append(key, SimOp::Delete)
        })
    }

    /// Removes every message at or below `sequence` (at most the last one), as `max_age` or a
    /// `discard: old` limit would; returns how many went. The first sequence moves past them.
    pub fn evict_through(&self, sequence: u64) -> usize {
        self.change(|st| {
            let gone: Vec<u64> = st
                .log
                .range(..=sequence.min(st.last_sequence))
                .map(|(s, _)| *s)
                .collect();
            for seq in &gone {
                st.remove(*seq);
            }
            gone.len()
        })
    }

    /// Removes every key whose last message is a delete or purge marker at or below `sequence`,
    /// marker and all, as NATS KV's `purge_deletes` does with markers older than its threshold;
    /// returns how many messages went. No watch can deliver such a delete any more: a fold that
    /// had not seen it learns of it only from a key-listing repair.
    pub fn purge_deletes_through(&self, sequence: u64) -> usize {
        self.change(|st| {
            let doomed: Vec<u64> = st
                .by_key
                .values()
                .filter(|seqs| {
                    seqs.last().is_some_and(|last| {
                        *last <= sequence
                            && st
                                .log
                                .get(last)
                                .is_some_and(|m| !matches!(m.op, SimOp::Put(_)))
                    })
                })
                .flat_map(|seqs| seqs.iter().copied())
                .collect();
            for seq in &doomed {
                st.remove(*seq);
            }
            doomed.len()
        })
    }

    /// Sets whether retention can evict a current value (retention can be edited).
    pub fn set_evicts_current_values(&self, evicts: bool) {
        self.change(|st| st.evicts_current_values = evicts);
    }

    /// Deletes the stream and creates it again, empty, created at `created_unix_ns`: a new
    /// identity, sequences from 1. Open watches end with [`KvError::StreamChanged`].
    pub fn recreate(&self, created_unix_ns: u64) {
        self.change(|st| {
            st.log.clear();
            st.by_key.clear();
            st.last_sequence = 0;
            st.created_unix_ns = created_unix_ns;
        });
    }

    /// Holds every watch's deliveries (writes and evictions go on) until
    /// [`Self::release_deliveries`].
    pub fn hold_deliveries(&self) {
        self.change(|st| st.held = true);
    }

    /// Lets held watches deliver again: each looks at the log as it is now, so what was evicted
    /// meanwhile shows as a gap.
    pub fn release_deliveries(&self) {
        self.change(|st| st.held = false);
    }

    /// Ends every watch open now with `error` at its next step (watches started later are not
    /// affected).
    pub fn break_watches(&self, error: KvError) {
        self.change(|st| {
            st.break_epoch = st.break_epoch.saturating_add(1);
            st.break_error = Some(error);
        });
    }

    /// The first retained sequence (`last + 1` when the log is empty).
    pub fn first_sequence(&self) -> u64 {
        self.state().first_sequence()
    }

    /// The last sequence written.
    pub fn last_sequence(&self) -> u64 {
        self.state().last_sequence
    }

    /// The retained messages, in sequence order.
    pub fn messages(&self) -> Vec<SimMessage> {
        self.state().log.values().cloned().collect()
    }

    /// The stream's identity now.
    pub fn identity(&self) -> StreamIdentity {
        self.state().identity()
    }

    /// Watches started so far (including ones refused at start).
    pub fn watches_started(&self) -> u64 {
        self.inner.watches_started.load(Ordering::Relaxed)
    }

    /// Watches running now.
    pub fn open_watches(&self) -> u64 {
        self.inner.open_watches.load(Ordering::Relaxed)
    }

    fn write_checked(
        &self,
        key: &str,
        op: SimOp,
        check: impl FnOnce(Option<&SimMessage>) -> Result<(), KvError>,
    ) -> Result<u64, KvError> {
        let r = {
            let mut st = self.state();
            check(st.latest(key)).map(|()| st.append(key, op))
        };
        if r.is_ok() {
            self.inner.changes.send_modify(|n| *n = n.wrapping_add(1));
        }
        r
    }

    fn live_entries(&self, prefix: &str) -> Vec<KvEntry> {
        let st = self.state();
        st.by_key
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .filter_map(|(_, seqs)| st.log.get(seqs.last()?))
            .filter(|m| m.is_live())
            .map(SimMessage::to_entry)
            .collect()
    }
}

#[async_trait]
impl KvReader for SimBucket {
    async fn get(&self, key: &str) -> Result<Option<KvEntry>, KvError> {
        Ok(self.entry(key).await?.filter(|e| !e.value.is_empty()))
    }

    async fn entry(&self, key: &str) -> Result<Option<KvEntry>, KvError> {
        Ok(self.state().latest(key).map(SimMessage::to_entry))
    }

    async fn keys(&self, prefix: &str) -> Result<Vec<String>, KvError> {
        Ok(self
            .live_entries(prefix)
            .into_iter()
            .map(|e| e.key)
            .collect())
    }

    async fn scan(&self, prefix: &str) -> Result<Vec<KvEntry>, KvError> {
        Ok(self.live_entries(prefix))
    }
}

fn revision_of(v: VersionToken) -> Result<u64, KvError> {
    v.as_u64()
        .ok_or_else(|| KvError::Invalid(format!("{v:?} is not a NATS revision")))
}

#[async_trait]
impl KvWriter for SimBucket {
    async fn put(&self, key: &str, value: Bytes) -> Result<VersionToken, KvError> {
        Ok(VersionToken::from_u64(self.put_now(key, value)))
    }

    async fn create(&self, key: &str, value: Bytes) -> Result<VersionToken, KvError> {
        self.write_checked(key, SimOp::Put(value), |latest| match latest {
            Some(m) if matches!(m.op, SimOp::Put(_)) => Err(KvError::AlreadyExists(key.into())),
            _ => Ok(()),
        })
        .map(VersionToken::from_u64)
    }

    async fn update(
        &self,
        key: &str,
        value: Bytes,
        expected: VersionToken,
    ) -> Result<VersionToken, KvError> {
        let want = revision_of(expected)?;
        self.write_checked(key, SimOp::Put(value), |latest| {
            if latest.map_or(0, |m| m.sequence) == want {
                Ok(())
            } else {
                Err(KvError::RevisionMismatch {
                    key: key.to_string(),
                    expected,
                })
            }
        })
        .map(VersionToken::from_u64)
    }

    async fn delete(&self, key: &str) -> Result<bool, KvError> {
        self.delete_now(key);
        Ok(true)
    }
}

#[async_trait]
impl KvWatcher for SimBucket {
    async fn watch(&self, scope: &WatchScope, tx: mpsc::Sender<WatchEvent>) -> Result<(), KvError> {
        self.run(scope, None, tx).await
    }

    async fn watch_from(
        &self,
        scope: &WatchScope,
        cursor: WatchCursor,
        tx: mpsc::Sender<WatchEvent>,
    ) -> Result<(), KvError> {
        self.run(scope, cursor.revision(), tx).await
    }

    async fn retention(&self) -> Result<Option<protocol::Retention>, KvError> {
        let st = self.state();
        Ok(Some(protocol::Retention {
            evicts_current_values: st.evicts_current_values,
            first_revision: st.first_sequence(),
        }))
    }

    async fn stream_state(&self) -> Result<Option<StreamState>, KvError> {
        let st = self.state();
        Ok(Some(StreamState {
            identity: st.identity(),
            last_sequence: st.last_sequence,
        }))
    }

    fn bucket_name(&self) -> String {
        SIM_BUCKET.to_string()
    }

    fn pin_identity(&self, identity: StreamIdentity) {
        self.state().pinned = Some(identity);
    }
}
