//! A lease: one key in a NATS KV bucket that at most one holder has at a time, won by
//! compare-and-set only — a create-only write when the key is absent, a CAS takeover (on the
//! revision read) when the lease it holds has expired or does not decode. The expiry lives inside
//! the value, so no clock on the server is trusted and a dropped holder's lease simply runs out.
//! Two things are leases: the export lease (docs/operations.md, "A fleet: artifacts in object
//! storage": at most one node of a fleet exports an artifact of a bucket per round) and a channel
//! node's name claim (docs/channels.md, "One name, one node": at most one process follows a
//! channel under a node name).
//!
//! Invariants: every write is a CAS on what was read (two holders can never both win); the
//! decision to take a lease over is [`foldhost_core::protocol::lease_takeover_allowed`]; a held
//! lease is renewed or released only by its holder (`renew` moves the expiry on, `complete`
//! stamps the exported cursor, `abandon` frees it), each again a CAS — a holder whose lease was
//! taken over after it expired gets `Lost`, never overwrites the new holder.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use foldhost_core::kv::{KvError, KvReader, KvWriter, VersionToken};
use foldhost_core::protocol::{self, LeaseState};

/// Why a lease call failed.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The bucket could not be read or written.
    #[error("lease {key}: {source}")]
    Kv {
        /// The lease key.
        key: String,
        /// The bucket's error.
        #[source]
        source: KvError,
    },
    /// The lease this holder had was taken over (it expired first): the round is not its own.
    #[error("lease {key}: lost to {holder} (ours expired)")]
    Lost {
        /// The lease key.
        key: String,
        /// Who holds it now, as far as the last read tells.
        holder: String,
    },
}

/// The lease's value: who holds it, until when, and what the last completed round exported.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseValue {
    /// The holder's name (a node id).
    pub holder: String,
    /// When the lease runs out, Unix milliseconds (0: free).
    pub expires_unix_ms: u64,
    /// The cursor of the last completed export round.
    pub last_cursor: Option<u64>,
    /// When the last round completed, Unix milliseconds.
    pub last_unix_ms: Option<u64>,
}

impl LeaseValue {
    fn to_bytes(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    /// Decodes a lease value; `None` for anything else (a corrupt lease is taken over).
    pub fn from_bytes(raw: &[u8]) -> Option<Self> {
        if raw.len() > MAX_LEASE_BYTES {
            return None;
        }
        serde_json::from_slice(raw).ok()
    }
}

/// Largest lease value read (a lease is a few dozen bytes; anything larger is not one).
const MAX_LEASE_BYTES: usize = 4096;

/// A bucket the lease lives in: reads and compare-and-set writes.
pub trait LeaseBucket: KvReader + KvWriter {}
impl<T: KvReader + KvWriter + ?Sized> LeaseBucket for T {}

/// One lease key (an artifact's export lease, a channel node's name claim), as one holder sees it.
pub struct Lease {
    bucket: Arc<dyn LeaseBucket>,
    key: String,
    holder: String,
    ttl: Duration,
}

/// A lease this node holds for one round: the revision it wrote, to CAS its release on.
#[derive(Debug)]
pub struct HeldLease {
    version: VersionToken,
    value: LeaseValue,
}

impl HeldLease {
    /// When the lease runs out if not released (Unix milliseconds).
    pub fn expires_unix_ms(&self) -> u64 {
        self.value.expires_unix_ms
    }

    /// The bucket revision of the write that won the lease: unique per won round, since every
    /// win is a compare-and-set on the revision before it.
    pub fn revision(&self) -> u64 {
        self.version.as_u64().unwrap_or(0)
    }
}

impl Lease {
    /// The lease `key` in `bucket`, for the node `holder`, held for `ttl` per round.
    pub fn new(
        bucket: Arc<dyn LeaseBucket>,
        key: impl Into<String>,
        holder: impl Into<String>,
        ttl: Duration,
    ) -> Self {
        Lease {
            bucket,
            key: key.into(),
            holder: holder.into(),
            ttl,
        }
    }

    fn kv(&self, source: KvError) -> LeaseError {
        LeaseError::Kv {
            key: self.key.clone(),
            source,
        }
    }

    /// Tries to win this round at `now_unix_ms`: `Some` when this node now holds the lease,
    /// `None` when another holder's lease is still running (or another node won the race for an
    /// expired one). The last completed round's cursor is carried over.
    pub async fn acquire(&self, now_unix_ms: u64) -> Result<Option<HeldLease>, LeaseError> {
        let current = self.bucket.entry(&self.key).await.map_err(|e| self.kv(e))?;
        let (state, read, carried) = match &current {
            None => (LeaseState::Absent, None, LeaseValue::default()),
            Some(e) if e.value.is_empty() => {
                (LeaseState::Free, Some(e.version), LeaseValue::default())
            }
            Some(e) => match LeaseValue::from_bytes(&e.value) {
                None => (LeaseState::Corrupt, Some(e.version), LeaseValue::default()),
                Some(v) => (
                    LeaseState::Held {
                        expires_unix_ms: v.expires_unix_ms,
                    },
                    Some(e.version),
                    v,
                ),
            },
        };
        if !protocol::lease_takeover_allowed(state, now_unix_ms) {
            return Ok(None);
        }
        let value = LeaseValue {
            holder: self.holder.clone(),
            expires_unix_ms: now_unix_ms.saturating_add(self.ttl.as_millis() as u64),
            ..carried
        };
        let written = match read {
            None => self.bucket.create(&self.key, value.to_bytes()).await,
            Some(v) => self.bucket.update(&self.key, value.to_bytes(), v).await,
        };
        match written {
            Ok(version) => Ok(Some(HeldLease { version, value })),
            // Another node won the race for this round.
            Err(KvError::AlreadyExists(_) | KvError::RevisionMismatch { .. }) => Ok(None),
            Err(e) => Err(self.kv(e)),
        }
    }

    /// Ends a round that exported `cursor` at `now_unix_ms`: the lease is freed (its expiry set to
    /// now) and stamped with the cursor, by CAS on the revision this holder wrote.
    pub async fn complete(
        &self,
        held: HeldLease,
        cursor: u64,
        now_unix_ms: u64,
    ) -> Result<(), LeaseError> {
        let value = LeaseValue {
            expires_unix_ms: now_unix_ms,
            last_cursor: Some(cursor),
            last_unix_ms: Some(now_unix_ms),
            ..held.value.clone()
        };
        self.release(held, value).await
    }

    /// Ends a round that exported nothing: the lease is freed, the last round's stamp kept.
    pub async fn abandon(&self, held: HeldLease, now_unix_ms: u64) -> Result<(), LeaseError> {
        let value = LeaseValue {
            expires_unix_ms: now_unix_ms,
            ..held.value.clone()
        };
        self.release(held, value).await
    }

    /// Keeps a held lease for another `ttl` from `now_unix_ms`, by CAS on the revision this holder
    /// wrote last: the lease as now held, or `Lost` when another holder took it over.
    pub async fn renew(&self, held: &HeldLease, now_unix_ms: u64) -> Result<HeldLease, LeaseError> {
        let value = LeaseValue {
            expires_unix_ms: now_unix_ms.saturating_add(self.ttl.as_millis() as u64),
            ..held.value.clone()
        };
        let version = self.write_held(held, &value).await?;
        Ok(HeldLease { version, value })
    }

    /// Frees a held lease for good (expiry 0: [`LeaseValue`]'s "free"), by CAS: the next
    /// claimant takes it at once, whatever its clock says.
    pub async fn free(&self, held: HeldLease) -> Result<(), LeaseError> {
        let value = LeaseValue {
            expires_unix_ms: 0,
            ..held.value.clone()
        };
        self.release(held, value).await
    }

    /// The lease as it stands with the revision it was read at: `None` when absent; the value
    /// `None` when freed by a tombstone or corrupt.
    pub async fn read_versioned(
        &self,
    ) -> Result<Option<(VersionToken, Option<LeaseValue>)>, LeaseError> {
        let e = self.bucket.entry(&self.key).await.map_err(|e| self.kv(e))?;
        Ok(e.map(|e| {
            let value = if e.value.is_empty() {
                None
            } else {
                LeaseValue::from_bytes(&e.value)
            };
            (e.version, value)
        }))
    }

    /// Takes the lease over from the revision `seen`, whatever it holds (the caller decided, by
    /// its own clock, that its holder is gone): `None` when the key moved since.
    pub async fn take_over(
        &self,
        seen: VersionToken,
        now_unix_ms: u64,
    ) -> Result<Option<HeldLease>, LeaseError> {
        let value = LeaseValue {
            holder: self.holder.clone(),
            expires_unix_ms: now_unix_ms.saturating_add(self.ttl.as_millis() as u64),
            ..LeaseValue::default()
        };
        match self.bucket.update(&self.key, value.to_bytes(), seen).await {
            Ok(version) => Ok(Some(HeldLease { version, value })),
            Err(KvError::RevisionMismatch { .. }) => Ok(None),
            Err(e) => Err(self.kv(e)),
        }
    }

    /// The lease as held now, when its holder is this one: a write of ours whose answer was lost
    /// landed all the same. Only for a holder name no other holder shares (a process's own).
    pub async fn held_if_mine(&self) -> Result<Option<HeldLease>, LeaseError> {
        Ok(match self.read_versioned().await? {
            Some((version, Some(value))) if value.holder == self.holder => {
                Some(HeldLease { version, value })
            }
            _ => None,
        })
    }

    async fn release(&self, held: HeldLease, value: LeaseValue) -> Result<(), LeaseError> {
        self.write_held(&held, &value).await.map(|_| ())
    }

    async fn write_held(
        &self,
        held: &HeldLease,
        value: &LeaseValue,
    ) -> Result<VersionToken, LeaseError> {
        match self
            .bucket
            .update(&self.key, value.to_bytes(), held.version)
            .await
        {
            Ok(v) => Ok(v),
            Err(KvError::RevisionMismatch { .. }) => {
                // A read that fails says nothing of who holds it: the error, not a loss.
                let holder = self
                    .read()
                    .await?
                    .map_or_else(|| "nobody".to_string(), |v| v.holder);
                Err(LeaseError::Lost {
                    key: self.key.clone(),
                    holder,
                })
            }
            Err(e) => Err(self.kv(e)),
        }
    }

    /// The lease's value as it stands (`None`: absent, freed by a tombstone, or corrupt).
    pub async fn read(&self) -> Result<Option<LeaseValue>, LeaseError> {
        let e = self.bucket.entry(&self.key).await.map_err(|e| self.kv(e))?;
        Ok(e.and_then(|e| LeaseValue::from_bytes(&e.value)))
    }
}
