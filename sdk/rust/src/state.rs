//! State a guest keeps on the bus (the `state` feature; docs/state.md in the foldhost repository).
//!
//! A guest declares the buckets it owns ([`Manifest::owns`](crate::Manifest::owns)) and other
//! modules' buckets it reads ([`Manifest::reads`](crate::Manifest::reads)). The host folds each
//! beside the main bucket and hands its changes to [`Folder::apply_state`](crate::Folder::apply_state);
//! the functions here read a bucket's committed fold on this node and write an owned one through
//! the host. Every call names the bucket as the manifest declares it: its own by name, another's
//! as `<module>.<name>`.
//!
//! ```no_run
//! use foldhost_guest::state;
//!
//! // From `on_applied`, `on_state_applied` or `query` (never `parse` or `apply`):
//! match state::put("counts", "total", b"42") {
//!     Ok(written) => foldhost_guest::log::info(&format!("durable at {:?}", written.revision)),
//!     Err(refused) => foldhost_guest::log::warn(&format!("{}: {}", refused.reason, refused.message)),
//! }
//! let item = state::get("catalog.items", "sku-1").ok().flatten();
//! # let _ = item;
//! ```

use std::fmt;

use crate::Entry;
use crate::bindings::foldhost::guest::state as raw;

/// A bucket the guest owns, as its manifest declares it. The host creates it when absent, refuses
/// to start when one exists under its name with other limits, and never deletes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateBucket {
    /// The local name: 1 to 32 lowercase letters, digits or hyphens. The server bucket is
    /// `state_<module>_<name>`.
    pub name: String,
    /// Values kept per key (1 to 64).
    pub history: u8,
    /// How long a value lives, in milliseconds; 0: for ever. The foldhost host refuses any value
    /// above 0 at load: a state bucket that ages values out is not folded (its docs/state.md).
    pub max_age_ms: u64,
    /// The most the bucket may hold, in bytes; 0: the host's cap.
    pub max_bytes: u64,
    /// Whether a write may carry a time to live of its own.
    pub per_key_ttl: bool,
}

impl StateBucket {
    /// A bucket named `name`: one value per key, kept for ever, up to the host's cap.
    pub fn new(name: impl Into<String>) -> Self {
        StateBucket {
            name: name.into(),
            history: 1,
            max_age_ms: 0,
            max_bytes: 0,
            per_key_ttl: false,
        }
    }

    /// Keeps `history` values per key.
    pub fn history(mut self, history: u8) -> Self {
        self.history = history;
        self
    }

    /// Values live `ms` milliseconds. The foldhost host refuses any value above 0 at load (a
    /// state bucket that ages values out is not folded): keep an expiry in the values instead.
    pub fn max_age_ms(mut self, ms: u64) -> Self {
        self.max_age_ms = ms;
        self
    }

    /// The bucket holds at most `bytes` bytes.
    pub fn max_bytes(mut self, bytes: u64) -> Self {
        self.max_bytes = bytes;
        self
    }
}

/// Why the host refused a call, before anything reached the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    /// One word to branch on: `undeclared`, `read_only`, `wrong_call`, `too_large`,
    /// `bucket_full`, `credential`, `no_ttl`, or the write path's `conflict`, `op_reused`,
    /// `permission`, `invalid`.
    pub reason: String,
    /// What was refused and why, for a person.
    pub message: String,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "refused ({}): {}", self.reason, self.message)
    }
}

impl std::error::Error for Refused {}

impl From<raw::Refusal> for Refused {
    fn from(r: raw::Refusal) -> Self {
        Refused {
            reason: r.reason,
            message: r.message,
        }
    }
}

/// How a write went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Durable at its revision and applied by this node.
    Applied,
    /// Durable at its revision, not yet applied here: do not retry.
    Pending,
    /// Nothing can be established: retry with the same operation id.
    Unknown,
}

/// A write's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    /// Applied, pending or unknown.
    pub outcome: Outcome,
    /// The operation id (the caller's, or the one the host minted): a retry sends it again.
    pub op_id: String,
    /// The revision it is durable at, when known.
    pub revision: Option<u64>,
}

impl From<raw::Written> for Written {
    fn from(w: raw::Written) -> Self {
        Written {
            outcome: match w.outcome {
                raw::Outcome::Applied => Outcome::Applied,
                raw::Outcome::Pending => Outcome::Pending,
                raw::Outcome::Unknown => Outcome::Unknown,
            },
            op_id: w.op_id,
            revision: w.revision,
        }
    }
}

/// How a write is made ([`put_with`], [`delete_with`]); the default is a plain write.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WriteOptions {
    /// An operation id (a UUIDv7) that makes a retry safe; the host mints one when absent.
    pub op_id: Option<String>,
    /// Compare-and-set: the write lands only if the key's revision is this (0: absent).
    pub if_revision: Option<u64>,
    /// From `query` only: how long to wait for this node to apply it (a write answers once it is
    /// durable where the host cannot wait).
    pub wait_ms: u32,
    /// A time to live of its own, in milliseconds (a bucket declared with `per_key_ttl`).
    pub ttl_ms: Option<u64>,
}

impl WriteOptions {
    fn raw(&self) -> raw::WriteOptions {
        raw::WriteOptions {
            op_id: self.op_id.clone(),
            if_revision: self.if_revision,
            wait_ms: self.wait_ms,
            ttl_ms: self.ttl_ms,
        }
    }
}

/// The live entry for `key` in `bucket`, from this node's committed fold of it.
pub fn get(bucket: &str, key: &str) -> Result<Option<Entry>, Refused> {
    raw::get(bucket, key)
        .map(|e| e.map(Entry::from))
        .map_err(Refused::from)
}

/// Keys of `bucket` starting with `prefix`, in key order, strictly after `start_after` when given,
/// at most `limit` (the host caps it: page on with the last key until a page comes back empty).
pub fn keys(
    bucket: &str,
    prefix: &str,
    start_after: Option<&str>,
    limit: u32,
) -> Result<Vec<String>, Refused> {
    raw::keys(bucket, prefix, start_after, limit).map_err(Refused::from)
}

/// Writes `value` at `key` of an owned bucket.
pub fn put(bucket: &str, key: &str, value: &[u8]) -> Result<Written, Refused> {
    put_with(bucket, key, value, &WriteOptions::default())
}

/// [`put`] with `options`.
pub fn put_with(
    bucket: &str,
    key: &str,
    value: &[u8],
    options: &WriteOptions,
) -> Result<Written, Refused> {
    raw::put(bucket, key, value, &options.raw())
        .map(Written::from)
        .map_err(Refused::from)
}

/// Deletes `key` of an owned bucket.
pub fn delete(bucket: &str, key: &str) -> Result<Written, Refused> {
    delete_with(bucket, key, &WriteOptions::default())
}

/// [`delete`] with `options`.
pub fn delete_with(bucket: &str, key: &str, options: &WriteOptions) -> Result<Written, Refused> {
    raw::delete(bucket, key, &options.raw())
        .map(Written::from)
        .map_err(Refused::from)
}
