//! A following node's name claim (docs/channels.md, "One name, one node"): before a node reads
//! its channel it holds the lease `=claim.<channel>.<node>` in the channels bucket, renews it
//! while it runs and frees it at its stop, so two processes never write one report key.
//!
//! Invariants:
//! - A node follows a channel only while it holds its name's claim: it is won before the channel
//!   is read, and once another process takes it over the follower stops and writes no report.
//! - A start never takes over a claim whose holder renews it: a claim seen renewed while the
//!   starting node waits refuses the start, naming the holder; one that runs out (its holder was
//!   killed) is taken over, so a restart after a crash waits at most [`protocol::NAME_CLAIM_TTL`].
//! - The claim is written only through [`Lease`]'s compare-and-set calls.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::lease::{HeldLease, Lease, LeaseError};
use crate::protocol;
use crate::status::now_unix_ms;

use super::{GuestChannel, NodeConfig, NodeError};

/// This process's hold on its node name on one channel.
pub(super) struct NameClaim {
    lease: Lease,
    key: String,
    held: tokio::sync::Mutex<Option<HeldLease>>,
    /// Who took the claim over while this node held it: the follower stops.
    lost: std::sync::OnceLock<String>,
}

/// How often a starting node reads a claim another process holds.
const WAIT_STEP: Duration = Duration::from_secs(1);

/// This process as a claim's holder: the host's name, the process id and the start instant, so
/// two processes (a restart included) never share a holder name.
fn holder() -> String {
    format!(
        "{} pid {} at {}",
        super::channel::default_node_name(),
        std::process::id(),
        now_unix_ms()
    )
}

impl NameClaim {
    /// Wins `gc.node`'s claim on `gc.channel`, waiting while a claim another process holds may
    /// yet run out. Refused, naming the holder, when that holder renews it (or it outlives every
    /// expiry a holder can write).
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
        let config = crate::bucket::BucketConfig {
            create: false,
            ..crate::bucket::BucketConfig::default()
        };
        let kv = crate::nats::NatsKv::open(client, &gc.buckets.channels, &config, cfg.op_timeout)
            .await
            .map_err(|e| refused(format!("claim {key}: {e}")))?;
        let lease = Lease::new(kv, key.clone(), holder(), protocol::NAME_CLAIM_TTL);
        let lease_err = |e: LeaseError| refused(format!("claim: {e}"));
        // Any expiry a live holder writes is at most one TTL ahead of its clock.
        let give_up = Instant::now() + protocol::NAME_CLAIM_TTL + protocol::NAME_CLAIM_RENEW;
        let mut first_seen: Option<u64> = None;
        loop {
            if let Some(held) = lease.acquire(now_unix_ms()).await.map_err(lease_err)? {
                tracing::info!(event = "guest_channel_name_claimed", channel = %gc.channel, node = %gc.node, key = %key, "claimed the node name");
                return Ok(Arc::new(NameClaim {
                    lease,
                    key,
                    held: tokio::sync::Mutex::new(Some(held)),
                    lost: std::sync::OnceLock::new(),
                }));
            }
            if let Some(v) = lease.read().await.map_err(lease_err)? {
                let live = first_seen.is_some_and(|e| v.expires_unix_ms > e);
                if live || Instant::now() >= give_up {
                    return Err(refused(format!(
                        "another node runs under this name ({}; it renews its claim {key}): give each node its own --node-id",
                        v.holder
                    )));
                }
                if first_seen.is_none() {
                    tracing::info!(event = "guest_channel_name_waiting", channel = %gc.channel, node = %gc.node, holder = %v.holder, "the node name is claimed: waiting to see whether its holder is alive");
                    first_seen = Some(v.expires_unix_ms);
                }
            }
            tokio::time::sleep(WAIT_STEP).await;
        }
    }

    /// Who took the claim over, once another process did.
    pub(super) fn lost_to(&self) -> Option<&str> {
        self.lost.get().map(String::as_str)
    }

    /// Renews the claim every [`protocol::NAME_CLAIM_RENEW`] until it is lost or freed; a renewal
    /// that fails on the bus is tried again at the next one.
    pub(super) async fn keep(self: Arc<Self>) {
        let mut tick = tokio::time::interval(protocol::NAME_CLAIM_RENEW);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let mut held = self.held.lock().await;
            let Some(h) = held.as_ref() else { return };
            match self.lease.renew(h, now_unix_ms()).await {
                Ok(renewed) => *held = Some(renewed),
                Err(LeaseError::Lost { holder, .. }) => {
                    tracing::error!(event = "guest_channel_name_lost", key = %self.key, holder = %holder, "another process took this node's name over: the node no longer follows its channel");
                    *held = None;
                    let _ = self.lost.set(holder);
                    return;
                }
                Err(e) => {
                    tracing::warn!(event = "guest_channel_name_renew_failed", key = %self.key, error = %e, "the node name's claim was not renewed; tried again");
                }
            }
        }
    }

    /// Frees the claim at a stop, so the next start under this name takes it at once.
    pub(super) async fn release(&self) {
        let Some(held) = self.held.lock().await.take() else {
            return;
        };
        match self.lease.abandon(held, now_unix_ms()).await {
            Ok(()) => {
                tracing::debug!(key = %self.key, "node name's claim freed")
            }
            Err(e) => {
                tracing::warn!(event = "guest_channel_name_release_failed", key = %self.key, error = %e, "the node name's claim was not freed: it runs out on its own")
            }
        }
    }
}
