//! A following node's name claim (docs/channels.md, "One name, one node"): before a node follows
//! its channel it holds the lease `=claim.<channel>.<node>` in the channels bucket, renews it
//! from the moment it is won, and frees it at its stop, so two processes never write one report
//! key.
//!
//! Invariants:
//! - A node acts on its channel (a step, a report) only while its claim is **valid**: renewed
//!   within [`protocol::NAME_CLAIM_TTL`] − [`protocol::NAME_CLAIM_RENEW`] by its own monotonic
//!   clock, and never taken over. Another process takes a held claim over only after seeing it
//!   unchanged for [`protocol::NAME_CLAIM_TTL`] + [`protocol::NAME_CLAIM_RENEW`] by its own clock,
//!   so the two windows never overlap and no wall clock is trusted.
//! - A start never takes over a claim whose holder renews it: one seen renewed while the starting
//!   node waits refuses the start, naming the holder; one freed is taken at once; one that stays
//!   unchanged (its holder was killed) is taken over.
//! - The claim is written only through [`Lease`]'s compare-and-set calls; a write of ours whose
//!   answer was lost is recognised by the holder name, which is this process's alone.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use foldhost_core::protocol;
use foldhost_core::status::now_unix_ms;
use foldhost_nats::lease::{HeldLease, Lease, LeaseError};

use super::{GuestChannel, NodeConfig, NodeError};

/// This process's hold on its node name on one channel.
pub(super) struct NameClaim {
    lease: Lease,
    key: String,
    /// This process as the claim's holder.
    holder: String,
    held: tokio::sync::Mutex<Option<HeldLease>>,
    /// When the claim was last written by this process (won or renewed).
    renewed_at: std::sync::Mutex<Instant>,
    /// Who took the claim over while this node held it: the follower stops.
    lost: std::sync::OnceLock<String>,
    /// The renewals' task.
    keeper: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// How often a starting node reads a claim another process holds.
const WAIT_STEP: Duration = Duration::from_secs(1);

/// Longest a holder's name is quoted in a message (it is read from the bus: anyone's words).
const HOLDER_QUOTED: usize = 120;

/// This host's name as a channel node name: `/proc/sys/kernel/hostname` with every character a
/// name may not hold made `-`, cut to [`protocol::MAX_CHANNEL_NAME`]; `node` when unreadable.
pub(crate) fn default_node_name() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name: String = raw
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(protocol::MAX_CHANNEL_NAME)
        .collect();
    if name.is_empty() { "node".into() } else { name }
}

/// This process as a claim's holder: the host's name, the process id and the start instant, so
/// two processes (a restart included) never share a holder name.
fn holder() -> String {
    format!(
        "{} pid {} at {}",
        default_node_name(),
        std::process::id(),
        now_unix_ms()
    )
}

/// A holder's name as a message quotes it: escaped (one line, no control character) and cut.
pub(super) fn quoted(holder: &str) -> String {
    let cut: String = holder.chars().take(HOLDER_QUOTED).collect();
    format!("{cut:?}")
}

impl NameClaim {
    /// Wins `gc.node`'s claim on `gc.channel`: at once when it is absent or freed; after seeing it
    /// unchanged for a TTL and a renewal when another process holds it; refused, naming the
    /// holder, when that holder renews it meanwhile.
    pub(super) async fn win(
        cfg: &NodeConfig,
        gc: &GuestChannel,
        client: async_nats::Client,
    ) -> Result<Arc<NameClaim>, NodeError> {
        let key = protocol::claim_key(&gc.channel, &gc.node);
        let refused = |why: String| {
            NodeError::Refused(format!(
                "--guest-channel {}: node name {:?}: {why}",
                gc.channel, gc.node
            ))
        };
        let config = foldhost_core::bucket::BucketConfig {
            create: false,
            ..foldhost_core::bucket::BucketConfig::default()
        };
        let kv = foldhost_nats::NatsKv::open(client, &gc.buckets.channels, &config, cfg.op_timeout)
            .await
            .map_err(|e| refused(format!("claim {key}: {e}")))?;
        let holder = holder();
        let lease = Lease::new(kv, key.clone(), holder.clone(), protocol::NAME_CLAIM_TTL);
        let lease_err = |e: LeaseError| refused(format!("claim: {e}"));
        let gone_after = protocol::NAME_CLAIM_TTL + protocol::NAME_CLAIM_RENEW;
        // The held claim as first seen unchanged: its revision and since when (our clock).
        let mut seen: Option<(foldhost_core::kv::VersionToken, Instant)> = None;
        let held = loop {
            let won = match lease.read_versioned().await.map_err(lease_err)? {
                None => lease.acquire(now_unix_ms()).await.map_err(lease_err)?,
                // Freed (by a stop, or a tombstone) or not a claim at all: taken at once.
                Some((version, None)) => lease
                    .take_over(version, now_unix_ms())
                    .await
                    .map_err(lease_err)?,
                Some((version, Some(v))) if v.expires_unix_ms == 0 => lease
                    .take_over(version, now_unix_ms())
                    .await
                    .map_err(lease_err)?,
                Some((version, Some(v))) => match seen {
                    Some((first, _)) if first != version => {
                        return Err(refused(format!(
                            "another node runs under this name ({}, which renews its claim {key}): give this node its own --node-id (node_id in a --config file)",
                            quoted(&v.holder)
                        )));
                    }
                    Some((_, since)) if since.elapsed() >= gone_after => lease
                        .take_over(version, now_unix_ms())
                        .await
                        .map_err(lease_err)?,
                    Some(_) => None,
                    None => {
                        tracing::info!(event = "guest_channel_name_waiting", channel = %gc.channel, node = %gc.node, holder = %quoted(&v.holder), "the node name is claimed: waiting to see whether its holder renews it");
                        seen = Some((version, Instant::now()));
                        None
                    }
                },
            };
            if let Some(held) = won {
                break held;
            }
            tokio::time::sleep(WAIT_STEP).await;
        };
        tracing::info!(event = "guest_channel_name_claimed", channel = %gc.channel, node = %gc.node, key = %key, "claimed the node name");
        let claim = Arc::new(NameClaim {
            lease,
            key,
            holder,
            held: tokio::sync::Mutex::new(Some(held)),
            renewed_at: std::sync::Mutex::new(Instant::now()),
            lost: std::sync::OnceLock::new(),
            keeper: std::sync::Mutex::new(None),
        });
        let keeper = tokio::spawn(tracing::Instrument::in_current_span(keep(Arc::downgrade(
            &claim,
        ))));
        *lock(&claim.keeper) = Some(keeper);
        Ok(claim)
    }

    /// Who took the claim over, once another process did.
    pub(super) fn lost_to(&self) -> Option<&str> {
        self.lost.get().map(String::as_str)
    }

    /// Whether this node may act on its channel now: the claim is its own and was renewed
    /// recently enough that no other process can have taken it over.
    pub(super) fn valid(&self) -> bool {
        self.lost.get().is_none()
            && lock(&self.renewed_at).elapsed()
                < protocol::NAME_CLAIM_TTL - protocol::NAME_CLAIM_RENEW
    }

    /// One renewal: `false` once the claim is lost or freed (the renewals end).
    async fn renew(&self) -> bool {
        let mut held = self.held.lock().await;
        let Some(h) = held.as_ref() else { return false };
        let renewed = match self.lease.renew(h, now_unix_ms()).await {
            // A renewal whose answer was lost landed all the same: the claim is still ours.
            Err(LeaseError::Lost { holder, .. }) if holder == self.holder => {
                self.lease.held_if_mine().await.and_then(|mine| {
                    mine.ok_or_else(|| LeaseError::Lost {
                        key: self.key.clone(),
                        holder: "nobody".into(),
                    })
                })
            }
            other => other,
        };
        match renewed {
            Ok(r) => {
                *held = Some(r);
                *lock(&self.renewed_at) = Instant::now();
            }
            Err(LeaseError::Lost { holder, .. }) => {
                tracing::error!(event = "guest_channel_name_lost", key = %self.key, holder = %quoted(&holder), "another process took this node's name over: the node no longer follows its channel");
                *held = None;
                let _ = self.lost.set(holder);
                return false;
            }
            Err(e) => {
                tracing::warn!(event = "guest_channel_name_renew_failed", key = %self.key, error = %e, "the node name's claim was not renewed; tried again");
            }
        }
        true
    }

    /// Frees the claim at a stop, so the next start under this name takes it at once.
    pub(super) async fn release(&self) {
        let keeper = lock(&self.keeper).take();
        if let Some(k) = keeper {
            k.abort();
            let _ = k.await;
        }
        let Some(held) = self.held.lock().await.take() else {
            return;
        };
        let freed = match self.lease.free(held).await {
            // The last renewal landed unanswered: free it at the revision it wrote.
            Err(LeaseError::Lost { holder, .. }) if holder == self.holder => {
                match self.lease.held_if_mine().await {
                    Ok(Some(mine)) => self.lease.free(mine).await,
                    Ok(None) => Ok(()),
                    Err(e) => Err(e),
                }
            }
            other => other,
        };
        match freed {
            Ok(()) => tracing::debug!(key = %self.key, "node name's claim freed"),
            Err(e) => {
                tracing::warn!(event = "guest_channel_name_release_failed", key = %self.key, error = %e, "the node name's claim was not freed: another start under it waits until it is seen unrenewed")
            }
        }
    }
}

impl Drop for NameClaim {
    fn drop(&mut self) {
        if let Some(k) = lock(&self.keeper).take() {
            k.abort();
        }
    }
}

/// Renews the claim every [`protocol::NAME_CLAIM_RENEW`] until it is lost, freed or dropped; a
/// renewal that fails on the bus is tried again at the next one.
async fn keep(claim: Weak<NameClaim>) {
    loop {
        tokio::time::sleep(protocol::NAME_CLAIM_RENEW).await;
        let Some(claim) = claim.upgrade() else { return };
        if !claim.renew().await {
            return;
        }
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
