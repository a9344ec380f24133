//! Listings (`keys`, `scan`, the re-list repair): one ephemeral `LastPerSubject` consumer,
//! delivered over a lean connection wherever one can be made.

use super::*;

impl NatsKv {
    /// Lists the latest message of every key under `prefix` through one ephemeral consumer, in key
    /// order. `headers_only` skips the values (for `keys`). Deleted keys and tombstones are dropped.
    pub(crate) async fn list(
        &self,
        prefix: &str,
        headers_only: bool,
    ) -> Result<Vec<KvEntry>, KvError> {
        let scope = if prefix.is_empty() {
            WatchScope::All
        } else {
            WatchScope::Prefix(prefix.to_string())
        };
        let mut out = Vec::new();
        self.list_each(&scope, headers_only, &mut |e| {
            out.push(e);
            Ok(())
        })
        .await?;
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// Streams the latest live entry of every key in `scope` into `each`, in delivery order, through
    /// one ephemeral consumer (nothing is collected here). Returns how many were live.
    ///
    /// Delivered over a lean connection ([`lean`]) wherever the options allow one, whatever
    /// [`LEAN_DELIVERY_ENV`] says: a stored header block is then decoded by
    /// [`protocol::decode_stored`], never by the client library, and an undecodable latest
    /// message lists no entry for its key. Only where no lean connection can be made (a websocket
    /// URL, a handle without options) does the listing go through the client.
    pub(crate) async fn list_each(
        &self,
        scope: &WatchScope,
        headers_only: bool,
        each: &mut (dyn FnMut(KvEntry) -> Result<(), KvError> + Send),
    ) -> Result<u64, KvError> {
        let filters = self.filter_subjects(scope)?;
        let inbox = self.client.new_inbox();
        let cfg = consumer::push::Config {
            deliver_subject: inbox.clone(),
            deliver_policy: consumer::DeliverPolicy::LastPerSubject,
            ack_policy: consumer::AckPolicy::None,
            filter_subjects: filters,
            headers_only,
            flow_control: true,
            idle_heartbeat: lock(&self.listing_dial)
                .as_ref()
                .map_or(DEFAULT_WATCH_HEARTBEAT, |d| d.heartbeat),
            inactive_threshold: Duration::from_secs(30),
            memory_storage: true,
            ..Default::default()
        };
        let mut listed = Listed {
            scope,
            headers_only,
            live: 0,
            remaining: 0,
            each,
        };
        let dial = lock(&self.listing_dial).clone();
        if let Some(d) = dial {
            match lean::dial(&d, &inbox).await {
                Ok(conn) => return self.list_lean(conn, cfg, &mut listed).await,
                Err(lean::DialError::Unsupported(why)) => {
                    tracing::info!(event = "lean_listing_off", bucket = %self.bucket, reason = %why, "listings go through the client");
                    *lock(&self.listing_dial) = None;
                }
                Err(lean::DialError::Transient(why)) => {
                    return Err(backend("list connection", why));
                }
            }
        }
        self.list_through_client(cfg, &mut listed).await
    }

    /// A listing's consumer delivered to a lean connection already subscribed to its deliver
    /// subject.
    async fn list_lean(
        &self,
        conn: lean::Conn,
        cfg: consumer::push::Config,
        listed: &mut Listed<'_, '_>,
    ) -> Result<u64, KvError> {
        let (name, total) = self.create_list_consumer(cfg).await?;
        let _cleanup = ConsumerCleanup {
            stream: self.kv.stream.clone(),
            name,
            timeout: self.timeout,
        };
        let mut deliveries = lean::LeanDeliveries::start(conn, self.bucket.clone());
        listed.remaining = total;
        while listed.remaining > 0 {
            let chunk = match tokio::time::timeout(self.timeout, deliveries.next()).await {
                Ok(Some(c)) => c?,
                Ok(None) => return Err(backend("list", "delivery connection closed")),
                Err(_) => {
                    return Err(KvError::Timeout {
                        op: "list",
                        secs: self.timeout.as_secs(),
                    });
                }
            };
            for d in chunk {
                if let lean::Delivered::Message(msg, meta, verdict, _) = d {
                    self.list_take(&msg, meta, verdict, listed)?;
                }
            }
        }
        Ok(listed.live)
    }

    /// A listing through the client's own subscription (no lean connection can be made).
    async fn list_through_client(
        &self,
        cfg: consumer::push::Config,
        listed: &mut Listed<'_, '_>,
    ) -> Result<u64, KvError> {
        // Subscribe before the consumer exists: the server may deliver before a later subscribe.
        let mut sub = timed("list subscribe", self.timeout, async {
            self.client
                .subscribe(cfg.deliver_subject.clone())
                .await
                .map_err(|e| backend("list subscribe", e))
        })
        .await?;
        let (name, total) = self.create_list_consumer(cfg).await?;
        listed.remaining = total;
        let result = async {
            while listed.remaining > 0 {
                let msg = match tokio::time::timeout(self.timeout, sub.next()).await {
                    Ok(Some(m)) => m,
                    Ok(None) => return Err(backend("list", "subscription closed")),
                    Err(_) => {
                        return Err(KvError::Timeout {
                            op: "list",
                            secs: self.timeout.as_secs(),
                        });
                    }
                };
                if msg.status.is_some() {
                    // Flow control requests carry a reply subject; answering resumes delivery.
                    if let Some(reply) = &msg.reply {
                        let _ = self.client.publish(reply.clone(), Bytes::new()).await;
                    }
                    continue;
                }
                self.list_take(&msg, None, None, listed)?;
            }
            Ok(listed.live)
        }
        .await;
        drop(sub);
        // Best effort: the consumer also expires by its inactivity threshold.
        let _ = tokio::time::timeout(self.timeout, self.kv.stream.delete_consumer(&name)).await;
        result
    }

    /// Creates a listing's consumer: its name and how many messages it will deliver.
    async fn create_list_consumer(
        &self,
        cfg: consumer::push::Config,
    ) -> Result<(String, u64), KvError> {
        let consumer: consumer::Consumer<consumer::push::Config> =
            timed("list consumer", self.timeout, async {
                self.kv
                    .stream
                    .create_consumer(cfg)
                    .await
                    .map_err(|e| backend("list consumer", e))
            })
            .await?;
        let info = consumer.cached_info();
        Ok((info.name.clone(), info.num_pending))
    }

    /// One delivered message of a listing: counted off what remains, and handed to `each` when
    /// it is a live entry in scope (a CAS tombstone is an empty value; a headers-only delivery
    /// reports the size).
    fn list_take(
        &self,
        msg: &async_nats::Message,
        meta: Option<protocol::AckMeta>,
        verdict: Option<Result<protocol::KvOp, protocol::Undecodable>>,
        listed: &mut Listed<'_, '_>,
    ) -> Result<(), KvError> {
        let Some((update, meta, _)) = self.to_update(msg, meta, verdict, None) else {
            return Ok(());
        };
        listed.remaining = match meta {
            Some(m) => m.pending,
            None => listed.remaining.saturating_sub(1),
        };
        if !listed.scope.contains(update.key()) {
            return Ok(());
        }
        if let KvUpdate::Put(e) = update {
            let size = if listed.headers_only {
                msg.headers
                    .as_ref()
                    .and_then(|h| h.get(NATS_MSG_SIZE))
                    .and_then(|v| v.as_str().parse::<u64>().ok())
                    .unwrap_or(1)
            } else {
                e.value.len() as u64
            };
            if size > 0 {
                listed.live += 1;
                (listed.each)(e)?;
            }
        }
        Ok(())
    }
}

/// A listing in progress: what it keeps, what it has counted, what remains to be delivered.
pub(crate) struct Listed<'a, 'b> {
    scope: &'a WatchScope,
    headers_only: bool,
    live: u64,
    remaining: u64,
    each: &'a mut (dyn FnMut(KvEntry) -> Result<(), KvError> + Send + 'b),
}
