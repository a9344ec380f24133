//! Guest channels on the bus (docs/channels.md): components in a NATS Object Store bucket, each
//! named by the BLAKE3 digest of its bytes, and per channel a release entry and one report per
//! node in a KV bucket. What the entries mean, and every decision taken from them, is
//! `protocol`'s (`protocol::rollout`, `protocol::next_step`).
//!
//! Invariants:
//! - No component leaves [`ChannelBus::fetch`] unless its BLAKE3 digest is the one it was asked
//!   for and it is at most the caller's size limit; the read stops one byte past the limit.
//! - A release entry only moves by compare-and-set against the revision it was read at
//!   ([`ChannelBus::publish_release`]): two publishers racing cannot both win.
//! - Every record read from the bus goes through `protocol::decode_entry` /
//!   `protocol::decode_report` (size-capped, validated); one that does not decode is reported with
//!   its key and skipped, never guessed at.
//! - Every call runs under the operation timeout; the bus is a client of its own
//!   (`NatsConnection::dial_another`), so a stored message the client library cannot read takes
//!   down this connection only, never the fold's.

use std::time::Duration;

use async_nats::jetstream::{self, kv, object_store};
use foldhost_core::protocol::{self, ChannelEntry, GuestVersion, NodeReport};
use futures::StreamExt as _;
use tokio::io::AsyncReadExt as _;

/// Where a fleet keeps its channels: the object store of components and the KV bucket of
/// releases and reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelBuckets {
    /// The Object Store bucket of components (default `foldhost-guests`).
    pub objects: String,
    /// The KV bucket of release entries and node reports (default `foldhost-channels`).
    pub channels: String,
}

impl Default for ChannelBuckets {
    fn default() -> Self {
        ChannelBuckets {
            objects: "foldhost-guests".into(),
            channels: "foldhost-channels".into(),
        }
    }
}

/// Revisions of a release entry the channels bucket keeps (`guest history`).
pub const CHANNEL_HISTORY: i64 = 64;

/// A failed channel operation, naming what it was doing.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// The server refused or failed the operation.
    #[error("{op}: {reason}")]
    Bus {
        /// What was being done.
        op: String,
        /// The server's or the library's words.
        reason: String,
    },
    /// The operation did not finish within the connection's operation timeout.
    #[error("{op}: no answer within {secs} s")]
    Timeout {
        /// What was being done.
        op: String,
        /// The limit.
        secs: u64,
    },
    /// A bucket or an object is not there.
    #[error("{0} does not exist")]
    Missing(String),
    /// The bytes fetched are not the component asked for.
    #[error("object {expected}: its bytes hash to {got} (a tampered or replaced object)")]
    Digest {
        /// The digest asked for (the object's name).
        expected: String,
        /// What the bytes hash to.
        got: String,
    },
    /// The object is larger than the caller accepts.
    #[error("object {name}: larger than {max} bytes")]
    TooLarge {
        /// The object.
        name: String,
        /// The limit.
        max: u64,
    },
    /// The release entry moved since it was read (another publish won).
    #[error(
        "channel {0}: the release entry changed since it was read (another publish?); read it again and retry"
    )]
    Conflict(String),
    /// A record on the bus does not decode.
    #[error("{key}: {why}")]
    Undecodable {
        /// Its key.
        key: String,
        /// Why.
        why: String,
    },
}

async fn timed<T>(
    op: &str,
    limit: Duration,
    fut: impl Future<Output = Result<T, ChannelError>>,
) -> Result<T, ChannelError> {
    tokio::time::timeout(limit, fut).await.unwrap_or_else(|_| {
        Err(ChannelError::Timeout {
            op: op.to_string(),
            secs: limit.as_secs(),
        })
    })
}

fn bus(op: &str, e: impl std::fmt::Display) -> ChannelError {
    ChannelError::Bus {
        op: op.to_string(),
        reason: e.to_string(),
    }
}

/// One release of a channel as its history holds it.
#[derive(Clone, Debug)]
pub struct Release {
    /// The entry's KV revision: the release's number.
    pub release: u64,
    /// When the server stored it, Unix milliseconds.
    pub stored_unix_ms: u64,
    /// The entry, or why it does not decode.
    pub entry: Result<ChannelEntry, String>,
}

/// A change seen by [`ChannelBus::watch`].
#[derive(Clone, Debug)]
pub enum ChannelChange {
    /// The release entry is now this (or does not decode: the error).
    Release(u64, Result<ChannelEntry, String>),
    /// The release entry was deleted or purged.
    ReleaseGone,
    /// A node's report is now this (or does not decode).
    Report(String, Result<NodeReport, String>),
    /// A node's report was deleted or purged.
    ReportGone(String),
    /// Every record that existed when the watch began was delivered.
    Current,
}

/// A handle on a fleet's channels.
pub struct ChannelBus {
    js: jetstream::Context,
    buckets: ChannelBuckets,
    kv: kv::Store,
    timeout: Duration,
}

impl ChannelBus {
    /// Opens the channels bucket (created, with [`CHANNEL_HISTORY`] revisions per key, when
    /// `create`: a publisher's; a following node never creates it).
    pub async fn open(
        client: async_nats::Client,
        buckets: &ChannelBuckets,
        create: bool,
        timeout: Duration,
    ) -> Result<Self, ChannelError> {
        let js = jetstream::new(client);
        let name = buckets.channels.clone();
        let kv = timed("open the channels bucket", timeout, async {
            match js.get_key_value(&name).await {
                Ok(kv) => Ok(kv),
                Err(e) if create && stream_missing(&e) => js
                    .create_key_value(kv::Config {
                        bucket: name.clone(),
                        history: CHANNEL_HISTORY,
                        // The server refuses a record the readers would refuse anyway.
                        max_value_size: protocol::MAX_CHANNEL_RECORD as i32,
                        description: "foldhost guest channels: releases and node reports".into(),
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| bus(&format!("create KV bucket {name}"), e)),
                Err(e) if stream_missing(&e) => Err(ChannelError::Missing(format!(
                    "KV bucket {name} (no channel was published yet)"
                ))),
                Err(e) => Err(bus(&format!("KV bucket {name}"), e)),
            }
        })
        .await?;
        Ok(ChannelBus {
            js,
            buckets: buckets.clone(),
            kv,
            timeout,
        })
    }

    async fn objects(&self, create: bool) -> Result<object_store::ObjectStore, ChannelError> {
        let name = self.buckets.objects.clone();
        timed("open the guests' object store", self.timeout, async {
            match self.js.get_object_store(&name).await {
                Ok(o) => Ok(o),
                Err(e) if create && stream_missing(&e) => self
                    .js
                    .create_object_store(object_store::Config {
                        bucket: name.clone(),
                        description: Some("foldhost guest components, named by BLAKE3".into()),
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| bus(&format!("create object store {name}"), e)),
                Err(e) if stream_missing(&e) => {
                    Err(ChannelError::Missing(format!("object store {name}")))
                }
                Err(e) => Err(bus(&format!("object store {name}"), e)),
            }
        })
        .await
    }

    /// Stores `bytes` as the object named by `version.digest` (which must be their BLAKE3), with
    /// the manifest's name and version as metadata. Storing it again replaces it.
    pub async fn put_component(
        &self,
        version: &GuestVersion,
        bytes: &[u8],
    ) -> Result<(), ChannelError> {
        let got = blake3::hash(bytes).to_hex().to_string();
        if got != version.digest {
            return Err(ChannelError::Digest {
                expected: version.digest.clone(),
                got,
            });
        }
        let store = self.objects(true).await?;
        let meta = object_store::ObjectMetadata {
            name: version.digest.clone(),
            description: Some(format!("{}@{}", version.name, version.version)),
            metadata: [
                ("name".to_string(), version.name.clone()),
                ("version".to_string(), version.version.clone()),
            ]
            .into_iter()
            .collect(),
            ..Default::default()
        };
        let op = format!("store object {}", version.digest);
        let mut reader = bytes;
        timed(&op, self.timeout, async {
            store
                .put(meta, &mut reader)
                .await
                .map(|_| ())
                .map_err(|e| bus(&op, e))
        })
        .await
    }

    /// The component `version` names, read whole (at most `max` bytes) and checked against its
    /// digest.
    pub async fn fetch(&self, version: &GuestVersion, max: u64) -> Result<Vec<u8>, ChannelError> {
        let store = self.objects(false).await?;
        let name = version.digest.clone();
        let op = format!("fetch object {name}");
        let bytes = timed(&op, self.timeout, async {
            let object = match store.get(&name).await {
                Ok(o) => o,
                Err(e) if e.kind() == object_store::GetErrorKind::NotFound => {
                    return Err(ChannelError::Missing(format!(
                        "object {name} in {}",
                        self.buckets.objects
                    )));
                }
                Err(e) => return Err(bus(&op, e)),
            };
            if object.info.size as u64 > max {
                return Err(ChannelError::TooLarge {
                    name: name.clone(),
                    max,
                });
            }
            let mut bytes = Vec::new();
            object
                .take(max.saturating_add(1))
                .read_to_end(&mut bytes)
                .await
                .map_err(|e| bus(&op, e))?;
            Ok(bytes)
        })
        .await?;
        if bytes.len() as u64 > max {
            return Err(ChannelError::TooLarge { name, max });
        }
        let got = blake3::hash(&bytes).to_hex().to_string();
        if got != name {
            return Err(ChannelError::Digest {
                expected: name,
                got,
            });
        }
        Ok(bytes)
    }

    /// The channel's current release: its number and entry, `None` when nothing was published.
    pub async fn release(
        &self,
        channel: &str,
    ) -> Result<Option<(u64, ChannelEntry)>, ChannelError> {
        let key = protocol::release_key(channel);
        let op = format!("read {key}");
        let entry = timed(&op, self.timeout, async {
            self.kv.entry(key.clone()).await.map_err(|e| bus(&op, e))
        })
        .await?;
        match entry {
            Some(e) if e.operation == kv::Operation::Put => {
                let decoded = protocol::decode_entry(&e.value)
                    .map_err(|why| ChannelError::Undecodable { key, why })?;
                Ok(Some((e.revision, decoded)))
            }
            _ => Ok(None),
        }
    }

    /// Writes the channel's release entry if it is still at `expected` (`None`: if nothing was
    /// published); returns the new release's number.
    pub async fn publish_release(
        &self,
        channel: &str,
        entry: &ChannelEntry,
        expected: Option<u64>,
    ) -> Result<u64, ChannelError> {
        let key = protocol::release_key(channel);
        let value: bytes::Bytes = serde_json::to_vec(entry)
            .map_err(|e| bus("encode the release entry", e))?
            .into();
        // Never write an entry every reader would refuse (a node name from a forged report, too
        // many of them): the fleet would stop following, and the next publish could not read it.
        protocol::decode_entry(&value)
            .map_err(|why| bus("check the release entry before writing it", why))?;
        let op = format!("write {key}");
        timed(&op, self.timeout, async {
            let r = match expected {
                Some(rev) => self.kv.update(&key, value, rev).await.map_err(|e| {
                    (
                        e.kind() == kv::UpdateErrorKind::WrongLastRevision,
                        e.to_string(),
                    )
                }),
                None => self.kv.create(&key, value).await.map_err(|e| {
                    (
                        e.kind() == kv::CreateErrorKind::AlreadyExists,
                        e.to_string(),
                    )
                }),
            };
            match r {
                Ok(rev) => Ok(rev),
                Err((true, _)) => Err(ChannelError::Conflict(channel.to_string())),
                Err((false, why)) => Err(bus(&op, why)),
            }
        })
        .await
    }

    /// Every node's report on `channel` (one that does not decode is logged and left out).
    pub async fn reports(&self, channel: &str) -> Result<Vec<NodeReport>, ChannelError> {
        let mut watch = self.watch(channel).await?;
        let mut out = std::collections::BTreeMap::new();
        loop {
            let next = tokio::time::timeout(self.timeout, watch.next()).await;
            match next {
                Ok(Some(Ok(ChannelChange::Report(node, Ok(r))))) => {
                    out.insert(node, r);
                }
                Ok(Some(Ok(ChannelChange::Report(node, Err(why))))) => {
                    tracing::warn!(event = "channel_record_undecodable", key = %protocol::report_key(channel, &node), error = %why, "a node report does not decode; left out");
                    out.remove(&node);
                }
                Ok(Some(Ok(ChannelChange::ReportGone(node)))) => {
                    out.remove(&node);
                }
                Ok(Some(Ok(ChannelChange::Current))) => break,
                Ok(None) => {
                    return Err(bus(
                        &format!("list the reports of {channel}"),
                        "the watch ended before every report was read",
                    ));
                }
                Ok(Some(Ok(_))) => {}
                Ok(Some(Err(e))) => return Err(e),
                Err(_) => {
                    return Err(ChannelError::Timeout {
                        op: format!("list the reports of {channel}"),
                        secs: self.timeout.as_secs(),
                    });
                }
            }
        }
        Ok(out.into_values().collect())
    }

    /// Writes `report` under its node's key of `channel`.
    pub async fn put_report(&self, channel: &str, report: &NodeReport) -> Result<(), ChannelError> {
        let key = protocol::report_key(channel, &report.node);
        let value: bytes::Bytes = serde_json::to_vec(report)
            .map_err(|e| bus("encode the report", e))?
            .into();
        let op = format!("write {key}");
        timed(&op, self.timeout, async {
            self.kv
                .put(&key, value)
                .await
                .map(|_| ())
                .map_err(|e| bus(&op, e))
        })
        .await
    }

    /// Every release of `channel` the bucket still holds, oldest first.
    pub async fn history(&self, channel: &str) -> Result<Vec<Release>, ChannelError> {
        let key = protocol::release_key(channel);
        let op = format!("history of {key}");
        timed(&op, self.timeout, async {
            let mut h = match self.kv.history(&key).await {
                Ok(h) => h,
                Err(e) => return Err(bus(&op, e)),
            };
            let mut out = Vec::new();
            while let Some(e) = h.next().await {
                let e = e.map_err(|e| bus(&op, e))?;
                if e.operation != kv::Operation::Put {
                    continue;
                }
                out.push(Release {
                    release: e.revision,
                    stored_unix_ms: (e.created.unix_timestamp_nanos() / 1_000_000).max(0) as u64,
                    entry: protocol::decode_entry(&e.value),
                });
                if out.len() as i64 >= CHANNEL_HISTORY * 2 {
                    break;
                }
            }
            Ok(out)
        })
        .await
        .or_else(|e| match e {
            // No message for the key: nothing was published.
            ChannelError::Bus { reason, .. } if reason.contains("no messages") => Ok(Vec::new()),
            e => Err(e),
        })
    }

    /// Every record of `channel` as it stands, then [`ChannelChange::Current`], then each change
    /// as it happens. The stream ends (or yields an error) when the watch breaks; the caller
    /// starts another, which delivers the whole state again.
    pub async fn watch(
        &self,
        channel: &str,
    ) -> Result<
        impl futures::Stream<Item = Result<ChannelChange, ChannelError>> + Send + Unpin + 'static,
        ChannelError,
    > {
        let op = format!("watch channel {channel}");
        let filter = format!("{channel}.>");
        let w = timed(&op, self.timeout, async {
            self.kv
                .watch_with_history(&filter)
                .await
                .map_err(|e| bus(&op, e))
        })
        .await?;
        // An empty channel delivers nothing: its "current" point is at once.
        let empty = timed(&op, self.timeout, async {
            let mut keys = self.kv.keys().await.map_err(|e| bus(&op, e))?;
            while let Some(k) = keys.next().await {
                let k = k.map_err(|e| bus(&op, e))?;
                if k.starts_with(&format!("{channel}.")) {
                    return Ok(false);
                }
            }
            Ok(true)
        })
        .await?;
        let channel = channel.to_string();
        let first = futures::stream::iter(empty.then_some(Ok(ChannelChange::Current)));
        let changes = w.flat_map(move |e| {
            let items: Vec<Result<ChannelChange, ChannelError>> = match e {
                Err(e) => vec![Err(bus("channel watch", e))],
                Ok(e) => {
                    let mut v = Vec::with_capacity(2);
                    if let Some(c) = change(&channel, &e) {
                        v.push(Ok(c));
                    }
                    if e.delta == 0 {
                        v.push(Ok(ChannelChange::Current));
                    }
                    v
                }
            };
            futures::stream::iter(items)
        });
        Ok(Box::pin(first.chain(changes)))
    }
}

/// What a watched entry of `channel` says.
fn change(channel: &str, e: &kv::Entry) -> Option<ChannelChange> {
    let put = e.operation == kv::Operation::Put;
    if e.key == protocol::release_key(channel) {
        return Some(if put {
            ChannelChange::Release(e.revision, protocol::decode_entry(&e.value))
        } else {
            ChannelChange::ReleaseGone
        });
    }
    let node = protocol::report_node(channel, &e.key)?.to_string();
    Some(if put {
        let r = protocol::decode_report(&node, &e.value);
        ChannelChange::Report(node, r)
    } else {
        ChannelChange::ReportGone(node)
    })
}

/// Whether `e` (or what caused it) is the server's "stream not found": the bucket does not exist.
fn stream_missing(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(g) = c.downcast_ref::<jetstream::context::GetStreamError>() {
            return matches!(g.kind(), jetstream::context::GetStreamErrorKind::JetStream(j)
                if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND);
        }
        cause = c.source();
    }
    false
}
