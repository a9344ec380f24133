//! The key-value vocabulary every other module speaks: entries, updates, versions, cursors, errors,
//! and the three narrowed capabilities a bucket vends (`KvReader`, `KvWatcher`, `KvWriter`).
//!
//! Invariants this module keeps:
//! - A [`VersionToken`] is at most [`VersionToken::MAX_LEN`] bytes and never allocates.
//! - A [`WatchCursor`] names a stream position *whose apply has returned* once it is persisted; this
//!   module only defines the type, `foldhost::applied` is the one place that advances it.
//! - Nothing here knows about NATS: the trait objects are backend-neutral, so the fold can be driven
//!   by the simulated bucket of `testkit` (an in-memory log) as well as by `nats`.

use std::fmt;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::mpsc;

/// An opaque per-key version: NATS uses an 8-byte big-endian stream sequence; other backends (an
/// FDB versionstamp) use up to 10 bytes. Stored inline, so copying one never touches the heap.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct VersionToken {
    len: u8,
    bytes: [u8; VersionToken::MAX_LEN],
}

impl VersionToken {
    /// The longest version any backend produces (an FDB versionstamp).
    pub(crate) const MAX_LEN: usize = 10;

    /// The unknown version: carried by updates whose revision could not be read (for instance an
    /// unparseable ACK subject). It never mints or moves a cursor.
    pub const UNKNOWN: VersionToken = VersionToken {
        len: 0,
        bytes: [0; VersionToken::MAX_LEN],
    };

    /// A NATS revision (stream sequence), stored big-endian in 8 bytes.
    pub fn from_u64(revision: u64) -> Self {
        let mut bytes = [0u8; Self::MAX_LEN];
        bytes[..8].copy_from_slice(&revision.to_be_bytes());
        VersionToken { len: 8, bytes }
    }

    /// Builds a token from raw bytes; `None` when they are longer than [`Self::MAX_LEN`].
    pub fn from_bytes(raw: &[u8]) -> Option<Self> {
        if raw.len() > Self::MAX_LEN {
            return None;
        }
        let mut bytes = [0u8; Self::MAX_LEN];
        bytes[..raw.len()].copy_from_slice(raw);
        Some(VersionToken {
            len: raw.len() as u8,
            bytes,
        })
    }

    /// The raw bytes, exactly as long as they were created.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// The revision when this is an 8-byte NATS version, else `None`.
    pub fn as_u64(&self) -> Option<u64> {
        if self.len == 8 {
            let mut b = [0u8; 8];
            b.copy_from_slice(&self.bytes[..8]);
            Some(u64::from_be_bytes(b))
        } else {
            None
        }
    }

    /// True for [`Self::UNKNOWN`].
    pub(crate) fn is_unknown(&self) -> bool {
        self.len == 0
    }
}

impl fmt::Debug for VersionToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.as_u64() {
            Some(r) => write!(f, "rev:{r}"),
            None if self.is_unknown() => write!(f, "rev:unknown"),
            None => write!(f, "ver:{:02x?}", self.as_bytes()),
        }
    }
}

/// A resume position in a watch stream (for NATS, the stream sequence of the last applied update).
/// A revision of `None` means "never applied anything": a start from it is a full state-sync
/// re-list.
///
/// A cursor may carry the **eviction memo** ([`EvictionMemo`]): this fold once saw the bucket's
/// retention evict a current value, so a listing of the bucket is never again the truth for it
/// even if its retention is edited later (docs/design.md, "Cursor-expiry repair"). Every
/// cursor committed after it carries it on, and an artifact's store carries it to the node that
/// imports it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct WatchCursor {
    revision: Option<u64>,
    memo: Option<EvictionMemo>,
}

/// What a fold remembers once it has seen retention evict a current value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct EvictionMemo {
    /// Server time (Unix nanoseconds) of the cursor's message when known, else 0.
    pub server_time_unix_ns: u64,
}

/// The tag after the revision in a cursor with a memo (`'E' 'V' 'M'`, then flags).
const MEMO_TAG: [u8; 3] = *b"EVM";
/// Flag bit: the cursor has a revision (a memo can outlive a cursor-less fold's empty position).
const MEMO_HAS_REVISION: u8 = 1;

impl WatchCursor {
    /// The cursor of a fold that has applied nothing.
    pub const NONE: WatchCursor = WatchCursor {
        revision: None,
        memo: None,
    };

    /// A cursor at `revision`.
    pub fn at(revision: u64) -> Self {
        WatchCursor {
            revision: Some(revision),
            memo: None,
        }
    }

    /// The revision, if any.
    pub fn revision(&self) -> Option<u64> {
        self.revision
    }

    /// The revision, or 0 for a cursor-less fold (comparisons treat "nothing" as 0).
    pub fn revision_or_zero(&self) -> u64 {
        self.revision.unwrap_or(0)
    }

    /// The eviction memo, if this fold has seen retention evict a current value.
    pub fn memo(&self) -> Option<EvictionMemo> {
        self.memo
    }

    /// This cursor carrying `memo` (or none).
    pub fn with_memo(self, memo: Option<EvictionMemo>) -> Self {
        WatchCursor {
            revision: self.revision,
            memo,
        }
    }

    /// The position `revision` keeping this cursor's memo: how a commit moves a cursor on.
    pub fn moved_to(self, revision: Option<u64>) -> Self {
        WatchCursor {
            revision,
            memo: self.memo,
        }
    }

    /// Encoding for durable storage: empty for `NONE`; 8 bytes big-endian for a revision without
    /// the memo (byte for byte the encoding before the memo existed); with the memo, 12 bytes
    /// (`revision ++ "EVM" ++ flags`) or 20 when the server time is known (`++ time`), so a memo
    /// cursor is longer than any bare one and an old reader refuses it rather than misread it.
    pub fn to_bytes(&self) -> Vec<u8> {
        match (self.revision, self.memo) {
            (None, None) => Vec::new(),
            (Some(r), None) => r.to_be_bytes().to_vec(),
            (r, Some(m)) => {
                let mut out = Vec::with_capacity(20);
                out.extend_from_slice(&r.unwrap_or(0).to_be_bytes());
                out.extend_from_slice(&MEMO_TAG);
                out.push(if r.is_some() { MEMO_HAS_REVISION } else { 0 });
                if m.server_time_unix_ns != 0 {
                    out.extend_from_slice(&m.server_time_unix_ns.to_be_bytes());
                }
                out
            }
        }
    }

    /// Decodes [`Self::to_bytes`]; `None` for any other shape (the caller reports corruption).
    pub fn from_bytes(raw: &[u8]) -> Option<Self> {
        let u64_at = |at: usize| -> Option<u64> {
            let b: [u8; 8] = raw.get(at..at + 8)?.try_into().ok()?;
            Some(u64::from_be_bytes(b))
        };
        match raw.len() {
            0 => Some(WatchCursor::NONE),
            8 => Some(WatchCursor::at(u64_at(0)?)),
            12 | 20 => {
                if raw[8..11] != MEMO_TAG || raw[11] & !MEMO_HAS_REVISION != 0 {
                    return None;
                }
                let rev = u64_at(0)?;
                let revision = if raw[11] & MEMO_HAS_REVISION != 0 {
                    Some(rev)
                } else if rev == 0 {
                    None
                } else {
                    return None;
                };
                let server_time_unix_ns = if raw.len() == 20 { u64_at(12)? } else { 0 };
                if raw.len() == 20 && server_time_unix_ns == 0 {
                    return None; // a known time of 0 is written as the 12-byte form
                }
                Some(WatchCursor {
                    revision,
                    memo: Some(EvictionMemo {
                        server_time_unix_ns,
                    }),
                })
            }
            _ => None,
        }
    }
}

impl fmt::Debug for WatchCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.revision {
            Some(r) => write!(f, "cursor:{r}")?,
            None => write!(f, "cursor:none")?,
        }
        if self.memo.is_some() {
            write!(f, "+evicted")?;
        }
        Ok(())
    }
}

impl fmt::Display for WatchCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.revision {
            Some(r) => write!(f, "{r}"),
            None => write!(f, "none"),
        }
    }
}

/// Which stream a fold folds: the stream's name and the server's creation time for it. A bucket
/// deleted and created again under the same name is a different stream (a new creation time, its
/// sequences starting over), and a fold of the old one must never be resumed on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamIdentity {
    /// The stream's name (`KV_<bucket>` on NATS).
    pub name: String,
    /// When the server created the stream, Unix nanoseconds.
    pub created_unix_ns: u64,
}

/// Format tag of an encoded [`StreamIdentity`] (`'I'`, then a version byte).
const IDENTITY_TAG: [u8; 2] = [b'I', 1];

/// Longest stream name an identity holds (NATS limits stream names to 255 bytes).
const MAX_STREAM_NAME: usize = 255;

impl StreamIdentity {
    /// Encoding for the store: tag, creation time (8 bytes big-endian), then the name's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(10 + self.name.len());
        out.extend_from_slice(&IDENTITY_TAG);
        out.extend_from_slice(&self.created_unix_ns.to_be_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out
    }

    /// Decodes [`Self::to_bytes`]; `None` for any other shape (the caller reports corruption).
    pub fn from_bytes(raw: &[u8]) -> Option<Self> {
        let rest = raw.strip_prefix(&IDENTITY_TAG)?;
        let (time, name) = rest.split_at_checked(8)?;
        if name.is_empty() || name.len() > MAX_STREAM_NAME {
            return None;
        }
        Some(StreamIdentity {
            name: std::str::from_utf8(name).ok()?.to_string(),
            created_unix_ns: u64::from_be_bytes(time.try_into().ok()?),
        })
    }
}

impl fmt::Display for StreamIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = i128::from(self.created_unix_ns);
        match time::OffsetDateTime::from_unix_timestamp_nanos(t)
            .ok()
            .and_then(|d| {
                d.format(&time::format_description::well_known::Rfc3339)
                    .ok()
            }) {
            Some(d) => write!(f, "stream {} created {d}", self.name),
            None => write!(
                f,
                "stream {} created at {} ns",
                self.name, self.created_unix_ns
            ),
        }
    }
}

/// A stream's identity with its last sequence, read live (for the identity check at a watch start).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamState {
    /// The stream's identity.
    pub identity: StreamIdentity,
    /// The last sequence written.
    pub last_sequence: u64,
}

/// One key, its value and its version, as read. Immutable once returned.
#[derive(Clone, PartialEq, Eq)]
pub struct KvEntry {
    /// The key, without any bucket prefix.
    pub key: String,
    /// The value bytes (shared, not copied).
    pub value: Bytes,
    /// The key's version at this read.
    pub version: VersionToken,
}

impl fmt::Debug for KvEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KvEntry({:?}, {} bytes, {:?})",
            self.key,
            self.value.len(),
            self.version
        )
    }
}

/// A record that carries an operation id ([`crate::protocol::OP_ID_HEADER`]): which operation
/// landed where.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct OpRecord {
    /// The operation.
    pub op: crate::protocol::OpId,
    /// The record's revision.
    pub revision: u64,
    /// The key it wrote.
    pub key: String,
    /// What it wrote ([`crate::protocol::write_digest`]).
    pub digest: crate::protocol::WriteDigest,
    /// When the server stored it, Unix milliseconds (0: not known).
    pub stored_unix_ms: u64,
}

/// One watch event.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum KvUpdate {
    /// The key now holds this value.
    Put(KvEntry),
    /// The key was deleted (a delete marker).
    Delete {
        /// The deleted key.
        key: String,
        /// The marker's version.
        version: VersionToken,
    },
    /// The key's history was purged; a fold treats it as a delete.
    Purge {
        /// The purged key.
        key: String,
        /// The purge marker's version.
        version: VersionToken,
    },
}

impl KvUpdate {
    /// The key this update is about.
    pub fn key(&self) -> &str {
        match self {
            KvUpdate::Put(e) => &e.key,
            KvUpdate::Delete { key, .. } | KvUpdate::Purge { key, .. } => key,
        }
    }

    /// The update's version (the stream sequence for NATS).
    pub(crate) fn version(&self) -> VersionToken {
        match self {
            KvUpdate::Put(e) => e.version,
            KvUpdate::Delete { version, .. } | KvUpdate::Purge { version, .. } => *version,
        }
    }

    /// The revision, when the version is a readable NATS one.
    pub fn revision(&self) -> Option<u64> {
        self.version().as_u64()
    }

    /// Bytes this update occupies (key + value), for limits and metrics.
    pub fn byte_len(&self) -> usize {
        match self {
            KvUpdate::Put(e) => e.key.len() + e.value.len(),
            KvUpdate::Delete { key, .. } | KvUpdate::Purge { key, .. } => key.len(),
        }
    }
}

/// Most updates a watch sends through the fold's channel as one [`WatchEvent::Updates`].
pub const WATCH_CHUNK: usize = 64;

/// Period of the floor guard's backstop probe: when no delivery arrives for this long, the stream's
/// first sequence is checked against the frontier directly (every 30 s). The NATS watch and the
/// simulated bucket (`foldhost_fold::testkit`) both tick at it.
pub const FLOOR_BACKSTOP: std::time::Duration = std::time::Duration::from_secs(30);

/// What a watch delivers into the fold's channel: updates, plus the watch's own progress signals.
#[derive(Debug)]
pub enum WatchEvent {
    /// Updates from the stream, in revision order (a chunk of what the client had ready, at most
    /// [`WATCH_CHUNK`]).
    Updates(Vec<KvUpdate>),
    /// Everything in scope that existed when the watch started has been delivered, through this
    /// revision (the re-list is complete, or the delta caught up). Used by `--catch-up` and by
    /// hydration progress.
    CaughtUp {
        /// The revision of the last update delivered before the watch was level (`None`: nothing).
        through: Option<u64>,
    },
    /// Progress while catching up: how many updates remain pending on the server.
    Pending(u64),
    /// The operation ids carried by updates of the next `Updates` chunks (in scope, in revision
    /// order), sent before them: the fold records each in its operation ledger in the commit that
    /// moves its cursor over the revision (docs/writes.md, "The operation ledger").
    Ops(Vec<OpRecord>),
    /// When the server stored the message at `revision` (the last update of a chunk just sent).
    /// A fold whose cursor carries the eviction memo keeps the newest such time at or below its
    /// cursor, for the supersession-only resume.
    Stamp {
        /// The message's revision.
        revision: u64,
        /// Server time, Unix nanoseconds.
        server_time_unix_ns: u64,
    },
}

/// Errors from the key-value layer. `Clone` so one failed connect can fan out to many waiters; the
/// cause chains of non-`Clone` client errors are rendered into the message at the boundary.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum KvError {
    /// Connecting or authenticating failed.
    #[error("connect to {url}: {reason}")]
    Connect {
        /// The server URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// An operation needs a connection and there is none.
    #[error("not connected")]
    NotConnected,
    /// The bucket does not exist (and was not to be created).
    #[error("bucket {0:?} not found")]
    BucketNotFound(String),
    /// A create found the key already present.
    #[error("key {0:?} already exists")]
    AlreadyExists(String),
    /// A compare-and-set lost: the key's version is not the expected one.
    #[error("key {key:?}: revision mismatch (expected {expected:?})")]
    RevisionMismatch {
        /// The key.
        key: String,
        /// The version the caller expected.
        expected: VersionToken,
    },
    /// The resume position is older than the stream's first retained sequence: resuming would
    /// silently skip evicted messages (NATS clamps without an error), so we refuse.
    #[error(
        "cursor expired: resume needs revision {resume_from} but the stream's first retained revision is {first_sequence}"
    )]
    CursorExpired {
        /// The revision the resume would start from (cursor + 1).
        resume_from: u64,
        /// The stream's first retained sequence.
        first_sequence: u64,
    },
    /// A NATS call did not answer in time.
    #[error("{op}: timed out after {secs} s")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The limit that passed.
        secs: u64,
    },
    /// The watch stream failed or ended.
    #[error("watch: {0}")]
    WatchError(String),
    /// Any other backend error, rendered.
    #[error("{op}: {reason}")]
    Backend {
        /// The operation.
        op: &'static str,
        /// The backend's message.
        reason: String,
    },
    /// The caller passed something the layer refuses (a bad key, a bad scope).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The stream under the watch is not the one it started on (the bucket was deleted and
    /// created again), or its last sequence is below what the watch delivered.
    #[error("bucket {bucket}: the stream changed under the watch: {detail}")]
    StreamChanged {
        /// The bucket.
        bucket: String,
        /// What was found.
        detail: String,
    },
}

impl KvError {
    /// Whether a watch that ended with this error is resumed from the applied cursor rather than
    /// ending the fold: the connection, the server or the consumer failed, not the fold's position
    /// (`CursorExpired`, handled by the repair), the stream (`StreamChanged`, by the identity
    /// check) or the caller's request (`Invalid`).
    pub fn watch_resumable(&self) -> bool {
        matches!(
            self,
            KvError::Connect { .. }
                | KvError::NotConnected
                | KvError::Timeout { .. }
                | KvError::WatchError(_)
                | KvError::Backend { .. }
        )
    }
}

/// Point-in-time reads of one bucket.
#[async_trait]
pub trait KvReader: Send + Sync {
    /// The live value of `key`; deleted keys and CAS tombstones (empty values) read as `None`.
    async fn get(&self, key: &str) -> Result<Option<KvEntry>, KvError>;
    /// The raw latest entry of `key`, tombstones included (for CAS callers needing the version).
    async fn entry(&self, key: &str) -> Result<Option<KvEntry>, KvError>;
    /// Every live key under `prefix` (empty: all), in key order.
    async fn keys(&self, prefix: &str) -> Result<Vec<String>, KvError>;
    /// Every live entry under `prefix` (empty: all), in key order.
    async fn scan(&self, prefix: &str) -> Result<Vec<KvEntry>, KvError>;
    /// Calls `each` with every live key in `scope`, in no particular order, and returns how many.
    /// A backend that can stream its listing overrides this so the listing is never held in
    /// memory (the repair sorts it externally); the default lists through [`Self::keys`].
    async fn for_each_key(
        &self,
        scope: &WatchScope,
        each: &mut (dyn FnMut(String) -> Result<(), KvError> + Send),
    ) -> Result<u64, KvError> {
        let mut n = 0u64;
        for prefix in scope.disjoint_prefixes() {
            for k in self.keys(&prefix).await? {
                if scope.contains(&k) {
                    each(k)?;
                    n += 1;
                }
            }
        }
        Ok(n)
    }
}

/// Writes, soft deletes and compare-and-set. No multi-key transactions.
#[async_trait]
pub trait KvWriter: Send + Sync {
    /// Unconditional put; returns the new version.
    async fn put(&self, key: &str, value: Bytes) -> Result<VersionToken, KvError>;
    /// Create only if absent (or deleted); `AlreadyExists` otherwise.
    async fn create(&self, key: &str, value: Bytes) -> Result<VersionToken, KvError>;
    /// Compare-and-set on the key's current version; `RevisionMismatch` otherwise.
    async fn update(
        &self,
        key: &str,
        value: Bytes,
        expected: VersionToken,
    ) -> Result<VersionToken, KvError>;
    /// Soft delete (a delete marker). Always `Ok(true)` on NATS.
    async fn delete(&self, key: &str) -> Result<bool, KvError>;
    /// CAS delete: writes an empty value (a tombstone) only if the version matches. One body
    /// for every writer: a CAS write of an empty value, so concurrent writers see a conflict and
    /// readers a tombstone.
    async fn delete_with_version(
        &self,
        key: &str,
        expected: VersionToken,
    ) -> Result<bool, KvError> {
        self.update(key, Bytes::new(), expected).await?;
        Ok(true)
    }
}

/// What a watch covers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchScope {
    /// Every key in the bucket.
    All,
    /// Keys starting with this prefix.
    Prefix(String),
    /// The union of several prefixes, served by one multi-filter consumer.
    Prefixes(Vec<String>),
}

impl WatchScope {
    /// Parses the CLI form: `all`, `prefix:P`, or `prefixes:P1,P2`.
    pub fn parse(s: &str) -> Result<Self, KvError> {
        if s == "all" {
            return Ok(WatchScope::All);
        }
        if let Some(p) = s.strip_prefix("prefix:") {
            if p.is_empty() {
                return Err(KvError::Invalid("scope prefix: is empty".into()));
            }
            return Ok(WatchScope::Prefix(p.to_string()));
        }
        if let Some(ps) = s.strip_prefix("prefixes:") {
            let v: Vec<String> = ps
                .split(',')
                .filter(|p| !p.is_empty())
                .map(str::to_string)
                .collect();
            if v.is_empty() {
                return Err(KvError::Invalid("scope prefixes: is empty".into()));
            }
            return Ok(WatchScope::Prefixes(v));
        }
        Err(KvError::Invalid(format!(
            "scope {s:?}: expected all, prefix:P or prefixes:P1,P2"
        )))
    }

    /// The scope as key prefixes in ascending order, none a prefix of another (`All` is `[""]`):
    /// scanning each in turn visits every key in scope exactly once, in key order.
    pub fn disjoint_prefixes(&self) -> Vec<String> {
        let mut ps: Vec<String> = match self {
            WatchScope::All => return vec![String::new()],
            WatchScope::Prefix(p) => return vec![p.clone()],
            WatchScope::Prefixes(ps) => ps.clone(),
        };
        ps.sort();
        ps.dedup();
        let mut out: Vec<String> = Vec::with_capacity(ps.len());
        for p in ps {
            // Sorted: a prefix that covers `p` sorts right before it (or before a run it covers).
            if out.last().is_some_and(|q| p.starts_with(q.as_str())) {
                continue;
            }
            out.push(p);
        }
        out
    }

    /// Whether `key` is inside this scope.
    pub fn contains(&self, key: &str) -> bool {
        match self {
            WatchScope::All => true,
            WatchScope::Prefix(p) => key.starts_with(p.as_str()),
            WatchScope::Prefixes(ps) => ps.iter().any(|p| key.starts_with(p.as_str())),
        }
    }
}

impl fmt::Display for WatchScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WatchScope::All => write!(f, "all"),
            WatchScope::Prefix(p) => write!(f, "prefix:{p}"),
            WatchScope::Prefixes(ps) => write!(f, "prefixes:{}", ps.join(",")),
        }
    }
}

/// A live update stream: events are pushed into the caller's channel (bounded: a full channel
/// backpressures the watch). Every method returns when the watch ends (error, or the receiver
/// dropped, which is a clean `Ok`).
#[async_trait]
pub trait KvWatcher: Send + Sync {
    /// State-sync watch: the current value of every key in scope first (the re-list), then live
    /// updates. No separate scan, so no seed-then-watch race.
    async fn watch(&self, scope: &WatchScope, tx: mpsc::Sender<WatchEvent>) -> Result<(), KvError>;
    /// Delta watch from `cursor + 1`. `CursorExpired` when the stream no longer holds that
    /// revision (never the server's silent clamp); a `NONE` cursor is a state-sync [`Self::watch`].
    async fn watch_from(
        &self,
        scope: &WatchScope,
        cursor: WatchCursor,
        tx: mpsc::Sender<WatchEvent>,
    ) -> Result<(), KvError>;

    /// The bucket's retention as the server holds it *now* (never the creation-time config:
    /// retention can be edited). `None` when this backend cannot say.
    async fn retention(&self) -> Result<Option<crate::protocol::Retention>, KvError> {
        Ok(None)
    }

    /// The stream's identity and last sequence as the server holds them *now*. `None` when this
    /// backend has no notion of a stream's identity (the identity check is then skipped).
    async fn stream_state(&self) -> Result<Option<StreamState>, KvError> {
        Ok(None)
    }

    /// [`Self::stream_state`] and [`Self::retention`] as of one moment: a fold's start checks
    /// both, and a backend that learns both from one answer (NATS: one stream info) overrides
    /// this to ask once.
    async fn state_and_retention(
        &self,
    ) -> Result<(Option<StreamState>, Option<crate::protocol::Retention>), KvError> {
        Ok((self.stream_state().await?, self.retention().await?))
    }

    /// When the server stored the record at `revision`, Unix nanoseconds (`Ok(None)`: no record
    /// there any more, or this backend keeps no times). What a fold checks its checkpoint
    /// against: another time at the same revision is another record (a log restored from an
    /// older copy and written past the fold).
    async fn stored_at(&self, _revision: u64) -> Result<Option<u64>, KvError> {
        Ok(None)
    }

    /// The bucket's name, for messages.
    fn bucket_name(&self) -> String {
        String::new()
    }

    /// Holds every later watch to `identity`, the stream the fold checked and recorded: a watch
    /// that starts on, or a floor probe that reads, another stream ends with
    /// [`KvError::StreamChanged`]. A backend without identities ignores it.
    fn pin_identity(&self, _identity: StreamIdentity) {}

    /// State-sync watch of the whole bucket.
    async fn watch_all(&self, tx: mpsc::Sender<WatchEvent>) -> Result<(), KvError> {
        self.watch(&WatchScope::All, tx).await
    }

    /// State-sync watch of the keys under `prefix`.
    async fn watch_prefix(
        &self,
        prefix: &str,
        tx: mpsc::Sender<WatchEvent>,
    ) -> Result<(), KvError> {
        self.watch(&WatchScope::Prefix(prefix.to_string()), tx)
            .await
    }

    /// State-sync watch of the union of `prefixes`, through one multi-filter consumer.
    async fn watch_prefixes(
        &self,
        prefixes: &[String],
        tx: mpsc::Sender<WatchEvent>,
    ) -> Result<(), KvError> {
        self.watch(&WatchScope::Prefixes(prefixes.to_vec()), tx)
            .await
    }

    /// Delta watch of the whole bucket from `cursor + 1`.
    async fn watch_all_from(
        &self,
        cursor: WatchCursor,
        tx: mpsc::Sender<WatchEvent>,
    ) -> Result<(), KvError> {
        self.watch_from(&WatchScope::All, cursor, tx).await
    }

    /// Delta watch of the keys under `prefix` from `cursor + 1`.
    async fn watch_prefix_from(
        &self,
        prefix: &str,
        cursor: WatchCursor,
        tx: mpsc::Sender<WatchEvent>,
    ) -> Result<(), KvError> {
        self.watch_from(&WatchScope::Prefix(prefix.to_string()), cursor, tx)
            .await
    }

    /// Delta watch of the union of `prefixes` from `cursor + 1` (a hand-built ordered consumer
    /// with several filter subjects: the client library has no such watch).
    async fn watch_prefixes_from(
        &self,
        prefixes: &[String],
        cursor: WatchCursor,
        tx: mpsc::Sender<WatchEvent>,
    ) -> Result<(), KvError> {
        self.watch_from(&WatchScope::Prefixes(prefixes.to_vec()), cursor, tx)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_identities_round_trip_and_every_other_shape_is_refused() {
        let id = StreamIdentity {
            name: "KV_routes".into(),
            created_unix_ns: 1_764_000_000_123_456_789,
        };
        let bytes = id.to_bytes();
        assert_eq!(StreamIdentity::from_bytes(&bytes), Some(id.clone()));
        for cut in 0..bytes.len() - "KV_routes".len() + 1 {
            assert_eq!(
                StreamIdentity::from_bytes(&bytes[..cut]),
                None,
                "cut at {cut}"
            );
        }
        let mut other_version = bytes.clone();
        other_version[1] = 2;
        assert_eq!(StreamIdentity::from_bytes(&other_version), None);
        let mut not_utf8 = bytes.clone();
        not_utf8.push(0xff);
        assert_eq!(StreamIdentity::from_bytes(&not_utf8), None);
        assert!(id.to_string().contains("KV_routes created 2025-"), "{id}");
    }

    #[test]
    fn version_token_round_trips_ten_bytes_and_u64() {
        let v = VersionToken::from_u64(u64::MAX);
        assert_eq!(v.as_u64(), Some(u64::MAX));
        let raw = [1u8, 2, 3, 4, 5, 6, 7, 8, 9, 10];
        let t = VersionToken::from_bytes(&raw).expect("10 bytes fit");
        assert_eq!(t.as_bytes(), &raw);
        assert_eq!(t.as_u64(), None);
        assert!(VersionToken::from_bytes(&[0u8; 11]).is_none());
        assert!(VersionToken::UNKNOWN.is_unknown());
    }

    #[test]
    fn cursor_bytes_round_trip_and_reject_other_lengths() {
        for c in [
            WatchCursor::NONE,
            WatchCursor::at(0),
            WatchCursor::at(u64::MAX),
        ] {
            assert_eq!(WatchCursor::from_bytes(&c.to_bytes()), Some(c));
        }
        assert_eq!(WatchCursor::from_bytes(&[1, 2, 3]), None);
    }

    #[test]
    fn cursor_memo_round_trips_and_leaves_a_bare_cursor_byte_for_byte() {
        let memo = Some(EvictionMemo {
            server_time_unix_ns: 0,
        });
        let timed = Some(EvictionMemo {
            server_time_unix_ns: 1_700_000_000_000_000_000,
        });
        // A bare cursor is the encoding every older fold holds: exactly 8 big-endian bytes.
        assert_eq!(WatchCursor::at(7).to_bytes(), 7u64.to_be_bytes().to_vec());
        for (c, len) in [
            (WatchCursor::at(7).with_memo(memo), 12),
            (WatchCursor::at(7).with_memo(timed), 20),
            (WatchCursor::NONE.with_memo(memo), 12),
            (WatchCursor::NONE.with_memo(timed), 20),
            (WatchCursor::at(0).with_memo(memo), 12),
        ] {
            let b = c.to_bytes();
            assert_eq!(b.len(), len, "{c:?}");
            assert_eq!(WatchCursor::from_bytes(&b), Some(c), "{c:?}");
        }
        // The memo survives a move; a fresh cursor has none.
        let moved = WatchCursor::at(7).with_memo(memo).moved_to(Some(9));
        assert_eq!(moved.revision(), Some(9));
        assert_eq!(moved.memo(), memo);
        // Bad tags, flags, a revision without its flag, a zero 20-byte time: refused.
        let mut bad = WatchCursor::at(7).with_memo(memo).to_bytes();
        bad[9] = b'X';
        assert_eq!(WatchCursor::from_bytes(&bad), None);
        let mut bad = WatchCursor::at(7).with_memo(memo).to_bytes();
        bad[11] = 0x80;
        assert_eq!(WatchCursor::from_bytes(&bad), None);
        let mut bad = WatchCursor::at(7).with_memo(memo).to_bytes();
        bad[11] = 0;
        assert_eq!(WatchCursor::from_bytes(&bad), None);
        let mut bad = WatchCursor::at(7).with_memo(memo).to_bytes();
        bad.extend_from_slice(&[0; 8]);
        assert_eq!(WatchCursor::from_bytes(&bad), None);
    }

    #[test]
    fn disjoint_prefixes_visit_each_key_in_scope_once_in_order() {
        assert_eq!(WatchScope::All.disjoint_prefixes(), vec![String::new()]);
        let s = WatchScope::Prefixes(vec!["b/".into(), "a".into(), "ab".into(), "b/".into()]);
        assert_eq!(
            s.disjoint_prefixes(),
            vec!["a".to_string(), "b/".to_string()]
        );
        let s = WatchScope::Prefixes(vec!["x1".into(), "x".into(), "x2".into(), "y".into()]);
        assert_eq!(
            s.disjoint_prefixes(),
            vec!["x".to_string(), "y".to_string()]
        );
    }

    #[test]
    fn scope_parses_cli_forms_and_rejects_empty() {
        assert_eq!(WatchScope::parse("all"), Ok(WatchScope::All));
        assert_eq!(
            WatchScope::parse("prefix:route."),
            Ok(WatchScope::Prefix("route.".into()))
        );
        assert!(WatchScope::parse("prefix:").is_err());
        assert!(WatchScope::parse("everything").is_err());
        let s = WatchScope::parse("prefixes:a.,b.").expect("valid");
        assert!(s.contains("b.x") && !s.contains("c.x"));
    }
}
