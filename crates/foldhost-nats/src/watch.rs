//! Watches: the consumer's start point and catch-up, its deliveries (lean or the client's
//! ordered consumer), and the forwarding of checked chunks into the fold's channel.

use super::*;
use foldhost_core::kv::{FLOOR_BACKSTOP, WATCH_CHUNK};

impl NatsKv {
    /// Opens the ordered push consumer of a watch on the stream the fold pinned (which must be the
    /// one here now: read before the consumer exists, so a recreation after this read is caught by
    /// the floor probes, which compare against it). Returns that stream's identity, the message
    /// stream and the consumer's initial backlog.
    async fn open_consumer(
        &self,
        filters: &[String],
        policy: consumer::DeliverPolicy,
        ordered: &AtomicBool,
    ) -> Result<(StreamIdentity, Deliveries, u64, Vec<catchup::Decoded>), KvError> {
        let deliver_subject = self.client.new_inbox();
        let dial = self
            .lean_dial
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        // The watch's own delivery connection opens while the stream is read and the gap caught
        // up: nothing on it depends on them, and a resume waits for both.
        let dialing = async {
            match &dial {
                Some(d) => Some(lean::dial(d, &deliver_subject).await),
                None => None,
            }
        };
        let (start, dialed) = tokio::join!(self.start_point(filters, policy), dialing);
        let (start_identity, filter_subjects, policy, caught_up) = start?;
        let cfg = consumer::push::OrderedConfig {
            deliver_subject,
            filter_subjects,
            deliver_policy: policy,
            ..Default::default()
        };
        let (messages, initial_pending) = match dialed {
            Some(Ok(conn)) => {
                let heartbeat = dial
                    .as_ref()
                    .map_or(DEFAULT_WATCH_HEARTBEAT, |d| d.heartbeat);
                let (name, pending) = self.create_lean_consumer(cfg, heartbeat).await?;
                self.lean_watches.fetch_add(1, Ordering::Relaxed);
                let lean = lean::LeanDeliveries::start(conn, self.bucket.clone());
                (
                    Deliveries::Lean {
                        lean,
                        _cleanup: ConsumerCleanup {
                            stream: self.kv.stream.clone(),
                            name,
                            timeout: self.timeout,
                        },
                    },
                    pending,
                )
            }
            Some(Err(e)) => {
                if let lean::DialError::Unsupported(why) = &e {
                    tracing::info!(event = "lean_delivery_off", bucket = %self.bucket, reason = %why, "watches are delivered through the client's ordered consumer");
                    *lock(&self.lean_dial) = None;
                    *lock(&self.listing_dial) = None;
                } else {
                    tracing::debug!(bucket = %self.bucket, error = %e, "no delivery connection for this watch");
                }
                ordered.store(true, Ordering::Relaxed);
                self.create_ordered_consumer(cfg).await?
            }
            None => {
                ordered.store(true, Ordering::Relaxed);
                self.create_ordered_consumer(cfg).await?
            }
        };
        let head = self.decode_caught_up(&caught_up, initial_pending);
        let initial_pending = initial_pending.saturating_add(head.len() as u64);
        Ok((start_identity, messages, initial_pending, head))
    }

    /// The stream a watch starts on: the one here now, refused when the fold is pinned to
    /// another.
    fn identity_to_start_on(&self, here: StreamIdentity) -> Result<StreamIdentity, KvError> {
        match self.pinned() {
            Some(p) if p != here => Err(KvError::StreamChanged {
                bucket: self.bucket.clone(),
                detail: format!("the fold folds {p}, the bucket is now {here}"),
            }),
            Some(p) => Ok(p),
            None => Ok(here),
        }
    }

    /// A state-sync start whose consumer met a message the client library cannot read (the fold
    /// has no cursor yet, so a re-list would meet it again) reads the stream from its first
    /// sequence instead, its first stretch through the stream API: the same fold, each key's
    /// later messages replacing its earlier ones. Any other start keeps its policy.
    fn recovering_policy(
        &self,
        policy: consumer::DeliverPolicy,
        recovering: bool,
        first_sequence: u64,
    ) -> consumer::DeliverPolicy {
        match policy {
            consumer::DeliverPolicy::LastPerSubject if recovering => {
                let first = first_sequence.max(1);
                tracing::info!(event = "watch_unreadable_start", bucket = %self.bucket, first, "the state-sync start met a message the client library cannot read: reading the stream from its first sequence instead");
                consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: first,
                }
            }
            p => p,
        }
    }

    /// Where a watch's consumer starts: the stream's identity (refused when the fold is pinned
    /// to another), the server-side filters, the deliver policy, and the gap before it when a
    /// short one was read directly ([`catchup`]; the policy then starts past it).
    async fn start_point(
        &self,
        filters: &[String],
        policy: consumer::DeliverPolicy,
    ) -> Result<
        (
            StreamIdentity,
            Vec<String>,
            consumer::DeliverPolicy,
            Vec<catchup::StoredMessage>,
        ),
        KvError,
    > {
        let here_info = self.stream_info().await?;
        let start_identity = self.identity_to_start_on(identity_of(&here_info))?;
        let stream_cfg = &here_info.config;
        let recovering = self.recovering.swap(false, Ordering::Relaxed);
        let policy = self.recovering_policy(policy, recovering, here_info.state.first_sequence);
        let filter_subjects = protocol::server_filters(
            filters,
            &stream_cfg.subjects,
            other_inputs(stream_cfg),
            matches!(policy, consumer::DeliverPolicy::LastPerSubject),
        );
        // A short gap is read directly and the consumer starts past it ([`catchup`]).
        let mut caught_up = Vec::new();
        let mut policy = policy;
        // A prefetch is taken by the first watch, used or not.
        let prefetched = match policy {
            consumer::DeliverPolicy::ByStartSequence { start_sequence } => {
                self.take_prefetch(start_sequence, &start_identity).await
            }
            _ => None,
        };
        if let consumer::DeliverPolicy::ByStartSequence { start_sequence } = policy
            && self.direct_catch_up.load(Ordering::Relaxed)
            && let Some(range) = protocol::catch_up_range(
                start_sequence,
                here_info.state.last_sequence,
                self.plain_stream(stream_cfg),
                protocol::direct_reads_allowed(stream_cfg.allow_direct, stream_cfg.num_replicas),
                recovering,
            )
        {
            if recovering {
                tracing::info!(event = "watch_read_past", bucket = %self.bucket, first = *range.start(), last = *range.end(), "reading past the message the client's connection dropped on: these sequences through the stream API, then the consumer");
            }
            let read = match prefetched {
                Some(p) => Some(p),
                None => {
                    let last = *range.end();
                    self.direct_catch_up(range, recovering)
                        .await
                        .map(|m| (last, m))
                }
            };
            if let Some((last, m)) = read {
                caught_up = m;
                policy = consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: last + 1,
                };
            }
        }
        Ok((start_identity, filter_subjects, policy, caught_up))
    }

    /// The client's ordered consumer and its initial backlog, on the ordered consumer's own
    /// connection ([`DeliveryClient`]) when the handle knows how to dial one.
    async fn create_ordered_consumer(
        &self,
        cfg: consumer::push::OrderedConfig,
    ) -> Result<(Deliveries, u64), KvError> {
        let (stream, drops) = self.delivery_stream().await?;
        let consumer = timed("watch consumer", self.timeout, async {
            stream
                .create_consumer(cfg)
                .await
                .map_err(|e| backend("watch consumer", e))
        })
        .await?;
        let initial_pending = consumer.cached_info().num_pending;
        let messages = timed("watch subscribe", self.timeout, async {
            consumer
                .messages()
                .await
                .map_err(|e| backend("watch subscribe", e))
        })
        .await?;
        Ok((
            Deliveries::Ordered {
                chunks: messages.ready_chunks(WATCH_CHUNK),
                drops,
                failed: None,
            },
            initial_pending,
        ))
    }

    /// The stream handle the ordered consumer is created through, and the drop count of its
    /// connection: the [`DeliveryClient`] (dialled when there is none), or the node's client
    /// when the handle has no options to dial with.
    async fn delivery_stream(
        &self,
    ) -> Result<
        (
            jetstream::stream::Stream,
            Option<tokio::sync::watch::Receiver<u64>>,
        ),
        KvError,
    > {
        let Some(opts) = lock(&self.connect_opts).clone() else {
            let drops = lock(&self.drops).clone();
            return Ok((self.kv.stream.clone(), drops));
        };
        let mut delivery = self.delivery.lock().await;
        if let Some(d) = delivery.as_ref() {
            return Ok((d.stream.clone(), Some(d.drops.clone())));
        }
        let drops = Arc::new(tokio::sync::watch::channel(0).0);
        let mut opts = opts;
        opts.name = opts.name.map(|n| format!("{n}-ordered"));
        let client =
            connect_client(&opts, Arc::new(AtomicBool::new(true)), drops.clone(), None).await?;
        let stream = timed("delivery stream", self.timeout, async {
            jetstream::new(client)
                .get_stream(&self.stream_name)
                .await
                .map_err(|e| backend("delivery stream", e))
        })
        .await?;
        let d = DeliveryClient {
            stream: stream.clone(),
            drops: drops.subscribe(),
        };
        *delivery = Some(d);
        Ok((stream, Some(drops.subscribe())))
    }

    /// Forgets the ordered consumer's connection (dropped, or failed in the library): the next
    /// watch dials a new one.
    async fn discard_delivery(&self) {
        self.delivery.lock().await.take();
    }

    /// The same consumer as the ordered one (its very configuration), delivered to a lean
    /// connection already subscribed to its deliver subject: its name and initial backlog.
    async fn create_lean_consumer(
        &self,
        cfg: consumer::push::OrderedConfig,
        heartbeat: std::time::Duration,
    ) -> Result<(String, u64), KvError> {
        use consumer::IntoConsumerConfig as _;
        let mut config: consumer::Config = cfg.into_consumer_config();
        config.idle_heartbeat = heartbeat;
        let consumer = timed("watch consumer", self.timeout, async {
            self.kv
                .stream
                .create_consumer(config)
                .await
                .map_err(|e| backend("watch consumer", e))
        })
        .await?;
        let info = consumer.cached_info();
        Ok((info.name.clone(), info.num_pending))
    }

    /// Runs a watch ([`NatsKv::deliver_watch`]); when it ends in an error after taking the
    /// client's ordered consumer, whatever ended it (a drop, the library's failure on a stored
    /// message, the subscription's end when its connection task died, a request on that dead
    /// connection), that connection is discarded and the next watch reads the first sequences
    /// after the cursor through the stream API ([`protocol::catch_up_range`]).
    pub(crate) async fn run_watch(
        &self,
        scope: &WatchScope,
        policy: consumer::DeliverPolicy,
        tx: mpsc::Sender<WatchEvent>,
    ) -> Result<(), KvError> {
        let ordered = AtomicBool::new(false);
        let r = self.deliver_watch(scope, policy, tx, &ordered).await;
        if r.is_err() && ordered.load(Ordering::Relaxed) {
            self.recovering.store(true, Ordering::Relaxed);
            self.discard_delivery().await;
        }
        r
    }

    /// The directly read gap, forwarded first and checked as any delivered chunk is (the consumer
    /// after it is a new one, its first delivery numbered 1); then, for a state-sync start level
    /// at once, the guard set from the stream's last sequence. False when the receiver went.
    async fn forward_head(
        &self,
        scope: &WatchScope,
        head: Vec<catchup::Decoded>,
        out: &mut Forwarder,
        guard: &mut FloorGuard,
    ) -> Result<bool, KvError> {
        if !head.is_empty() {
            guard
                .before_chunk(self, head.iter().filter_map(|(_, m, _)| m.as_ref()))
                .await?;
            if !out.forward(scope, head, guard).await {
                return Ok(false);
            }
            guard.consumer_started();
        }
        if out.level && !guard.is_guarded() {
            // A state-sync start with nothing pending is level at once: guard from the stream's
            // last sequence, read after the consumer exists (a message written in between is
            // delivered anyway, so a frontier ahead of it only forgoes one check).
            guard.guard_from(self.positions().await?.last_sequence);
        }
        Ok(true)
    }

    /// A chunk of deliveries decoded into updates; a consumer error counts toward the limit on a
    /// run of them (the ordered consumer recreates itself after a gap or missed heartbeats; a long
    /// run of errors means it cannot).
    fn decode_chunk(
        &self,
        chunk: Vec<lean::Delivered>,
        consecutive_errors: &mut u32,
        guard: &mut FloorGuard,
    ) -> Result<Vec<catchup::Decoded>, KvError> {
        let mut decoded = Vec::with_capacity(chunk.len());
        for item in chunk {
            match item {
                lean::Delivered::Message(m, meta, verdict, op_id) => {
                    *consecutive_errors = 0;
                    if let Some(d) = self.to_update(&m, meta, verdict, op_id) {
                        decoded.push(d);
                    }
                }
                lean::Delivered::Recreating(e) => {
                    *consecutive_errors += 1;
                    guard.consumer_error();
                    tracing::warn!(event = "watch_consumer_recreated", bucket = %self.bucket, error = %e, "watch: consumer error (recreating)");
                    if *consecutive_errors >= 30 {
                        return Err(KvError::WatchError(format!(
                            "bucket {}: {consecutive_errors} consecutive consumer errors, last: {e}",
                            self.bucket
                        )));
                    }
                }
            }
        }
        Ok(decoded)
    }

    /// An ordered consumer re-created before its first delivery starts over at the stream's first
    /// message (async-nats: `DeliverPolicy::All` when it has delivered nothing) — after a direct
    /// catch-up, or on a quiet bucket, that is a replay of the whole stream. A delta watch ends
    /// instead (an error), and the fold restarts it from its cursor.
    fn behind(&self, decoded: &[catchup::Decoded], passed: Option<u64>) -> Result<(), KvError> {
        if let Some(passed) = passed
            && let Some(m) = decoded
                .iter()
                .filter_map(|(_, m, _)| m.as_ref())
                .find(|m| m.stream_sequence <= passed)
        {
            return Err(KvError::WatchError(format!(
                "bucket {}: the watch's consumer was re-created behind it (sequence {} after {passed}); restarting from the cursor",
                self.bucket, m.stream_sequence
            )));
        }
        Ok(())
    }

    /// Runs an ordered push consumer with `policy` over `scope`, pushing events into `tx` until the
    /// receiver is dropped (`Ok`) or the watch fails. Every chunk passes the floor guard
    /// ([`floor::FloorGuard`]) before it is forwarded ([`Forwarder`]): the order "check, then
    /// forward" is read in the one `select!` loop here.
    async fn deliver_watch(
        &self,
        scope: &WatchScope,
        policy: consumer::DeliverPolicy,
        tx: mpsc::Sender<WatchEvent>,
        ordered: &AtomicBool,
    ) -> Result<(), KvError> {
        let filters = self.filter_subjects(scope)?;
        let start_frontier = frontier_of(&policy);
        let (start_identity, messages, initial_pending, head) =
            self.open_consumer(&filters, policy, ordered).await?;
        let mut out = Forwarder::new(tx, self.subject_prefix.clone());
        if !out.start(initial_pending).await {
            return Ok(());
        }
        // A delta watch is guarded from its cursor, a state-sync one once it is level (its re-list
        // skips superseded sequences by design).
        let prefix_scope = !matches!(scope, WatchScope::All);
        let mut guard = FloorGuard::new(start_frontier, start_identity, filters, prefix_scope);
        // A delta watch's highest delivered stream sequence (see `behind`).
        let mut passed: Option<u64> = start_frontier
            .and_then(|f| highest_sequence(&head).or(if f > 0 { Some(f) } else { None }));
        if !self.forward_head(scope, head, &mut out, &mut guard).await? {
            return Ok(());
        }
        let mut consecutive_errors = 0u32;
        let mut drops = messages.drops();
        let mut backstop = floor_backstop();
        // Whatever the client already holds is taken as one chunk: one channel send (and at most
        // one wake-up of the fold) per chunk instead of per update.
        let mut messages = messages;
        loop {
            let chunk = tokio::select! {
                c = messages.next() => match c {
                    Some(Ok(c)) => c,
                    Some(Err(e)) => {
                        if let Deliveries::Ordered { failed: Some(why), .. } = &messages {
                            tracing::warn!(event = "watch_client_failed", bucket = %self.bucket, error = %why, "the client library failed on a delivery; the next watch reads past it through the stream API on a new connection");
                        }
                        return Err(e);
                    }
                    None => break,
                },
                _ = backstop.tick() => {
                    guard.backstop(self, out.level).await?;
                    continue;
                }
                () = dropped(&mut drops) => {
                    return Err(KvError::WatchError(format!(
                        "bucket {}: the client's connection dropped; resuming from the cursor",
                        self.bucket
                    )));
                }
            };
            let decoded = self.decode_chunk(chunk, &mut consecutive_errors, &mut guard)?;
            if decoded.is_empty() {
                guard.after_errors(self).await?;
                continue;
            }
            self.behind(&decoded, passed)?;
            if start_frontier.is_some() {
                passed = highest_sequence(&decoded).max(passed);
            }
            guard
                .before_chunk(self, decoded.iter().filter_map(|(_, m, _)| m.as_ref()))
                .await?;
            if !out.forward(scope, decoded, &mut guard).await {
                return Ok(());
            }
        }
        if matches!(messages, Deliveries::Ordered { .. }) {
            tracing::warn!(event = "watch_consumer_ended", bucket = %self.bucket, "the client's ordered consumer ended: its connection is gone (the client library fails on some stored messages); the next watch reads past it through the stream API on a new connection");
        }
        Err(KvError::WatchError(format!(
            "bucket {}: watch stream ended",
            self.bucket
        )))
    }
}

/// Resolves when the connection's drop count moves; never without one.
async fn dropped(drops: &mut Option<tokio::sync::watch::Receiver<u64>>) {
    if let Some(d) = drops
        && d.changed().await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// A watch's consumer deliveries: through the client's ordered consumer, or over a lean
/// connection of the watch's own (`lean.rs`).
pub(crate) enum Deliveries {
    Ordered {
        chunks: futures::stream::ReadyChunks<consumer::push::Ordered>,
        /// The drop count of the connection it delivers on.
        drops: Option<tokio::sync::watch::Receiver<u64>>,
        /// Set when the library panicked while delivering: never polled again.
        failed: Option<String>,
    },
    Lean {
        lean: lean::LeanDeliveries,
        _cleanup: ConsumerCleanup,
    },
}

impl Deliveries {
    /// The drop count of the connection the client's ordered consumer delivers on, marked seen:
    /// that consumer re-creates itself after its connection dropped, silently, and when a stored
    /// message the library cannot read dropped it, every re-creation meets that message again.
    /// The watch ends at a drop instead, and the next reads past the message through the stream
    /// API (`catchup.rs`). `None` for a lean delivery.
    fn drops(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        let Deliveries::Ordered { drops, .. } = self else {
            return None;
        };
        let mut d = drops.clone()?;
        d.mark_unchanged();
        Some(d)
    }

    /// The next chunk (cancel-safe: both sources are); `None` when the deliveries ended, an error
    /// when a lean connection failed (the watch ends; the fold resumes from its cursor).
    ///
    /// A panic of the client library while delivering (async-nats 0.51 asserts on a CR inside a
    /// header value, and its consumer then polls a finished future) is caught here: the watch
    /// ends with an error naming it, and `failed` says so.
    async fn next(&mut self) -> Option<Result<Vec<lean::Delivered>, KvError>> {
        match self {
            Deliveries::Ordered { chunks, failed, .. } => {
                if let Some(why) = failed {
                    return Some(Err(KvError::WatchError(why.clone())));
                }
                match std::panic::AssertUnwindSafe(chunks.next())
                    .catch_unwind()
                    .await
                {
                    Ok(c) => c.map(|c| {
                        Ok(c.into_iter()
                            .map(|item| match item {
                                Ok(m) => lean::Delivered::Message(m.message, None, None, None),
                                Err(e) => lean::Delivered::Recreating(e.to_string()),
                            })
                            .collect())
                    }),
                    Err(panic) => {
                        let what = panic
                            .downcast_ref::<&str>()
                            .map(|s| (*s).to_string())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "a panic".into());
                        let why = format!(
                            "the client library failed while delivering ({what}); a stored message it cannot read is read through the stream API"
                        );
                        *failed = Some(why.clone());
                        Some(Err(KvError::WatchError(why)))
                    }
                }
            }
            Deliveries::Lean { lean, .. } => lean.next().await,
        }
    }
}

/// Deletes a lean watch's consumer when the watch ends (best effort: the server also removes it
/// after its inactivity threshold once the socket has closed).
pub(crate) struct ConsumerCleanup {
    pub(crate) stream: jetstream::stream::Stream,
    pub(crate) name: String,
    pub(crate) timeout: Duration,
}

impl Drop for ConsumerCleanup {
    fn drop(&mut self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (stream, name, timeout) = (
            self.stream.clone(),
            std::mem::take(&mut self.name),
            self.timeout,
        );
        rt.spawn(async move {
            let _ = tokio::time::timeout(timeout, stream.delete_consumer(&name)).await;
        });
    }
}

/// Forwards a watch's decoded chunks into the fold's channel: the updates in scope, the level
/// marker once the consumer has nothing pending (everything before it first), progress counts, and
/// sparse delivery stamps. Every method answers `false` once the fold has gone (the receiver was
/// dropped): the watch then ends quietly.
pub(crate) struct Forwarder {
    tx: mpsc::Sender<WatchEvent>,
    /// The bucket's subject prefix (`$KV.<bucket>.`): an undecodable message's key is its
    /// subject's ([`NatsKv::scope_key`]).
    subject_prefix: String,
    /// The watch reported it is level with the stream.
    level: bool,
    last_delivered: Option<u64>,
    since_progress: u32,
    last_stamp: std::time::Instant,
}

impl Forwarder {
    fn new(tx: mpsc::Sender<WatchEvent>, subject_prefix: String) -> Self {
        Forwarder {
            tx,
            subject_prefix,
            level: false,
            last_delivered: None,
            since_progress: 0,
            last_stamp: std::time::Instant::now() - STAMP_PERIOD,
        }
    }

    /// Reports the consumer's initial backlog: level at once when nothing is pending.
    async fn start(&mut self, initial_pending: u64) -> bool {
        if initial_pending == 0 {
            self.level = true;
            self.send(WatchEvent::CaughtUp { through: None }).await
        } else {
            self.send(WatchEvent::Pending(initial_pending)).await
        }
    }

    async fn send(&self, ev: WatchEvent) -> bool {
        self.tx.send(ev).await.is_ok()
    }

    /// The operation ids of a chunk's records in scope (an undecodable record carries none).
    fn ops_of(&self, scope: &WatchScope, decoded: &[catchup::Decoded]) -> Vec<OpRecord> {
        decoded
            .iter()
            .filter_map(|(update, meta, op)| {
                let (op, revision) = ((*op)?, update.revision()?);
                let key = NatsKv::scope_key(&self.subject_prefix, update);
                let digest = match update {
                    KvUpdate::Put(e) => protocol::write_digest(protocol::KvOp::Put, &e.value),
                    KvUpdate::Delete { .. } => protocol::write_digest(protocol::KvOp::Delete, &[]),
                    KvUpdate::Purge { .. } => protocol::write_digest(protocol::KvOp::Purge, &[]),
                };
                (scope.contains(key) && key == update.key()).then(|| OpRecord {
                    op,
                    revision,
                    key: key.to_string(),
                    digest,
                    stored_unix_ms: meta.map_or(0, |m| m.timestamp_unix_ns / 1_000_000),
                })
            })
            .collect()
    }

    /// Forwards one checked chunk; live after the level, the guard's frontier follows every
    /// delivered sequence, and the level itself guards a state-sync watch from there.
    async fn forward(
        &mut self,
        scope: &WatchScope,
        decoded: Vec<catchup::Decoded>,
        guard: &mut FloorGuard,
    ) -> bool {
        // The chunk's operation ids go first: the fold records each with the commit that moves
        // its cursor over the record.
        let ops = self.ops_of(scope, &decoded);
        if !ops.is_empty() && !self.send(WatchEvent::Ops(ops)).await {
            return false;
        }
        let mut out: Vec<KvUpdate> = Vec::with_capacity(decoded.len());
        let mut stamp: Option<(u64, u64)> = None;
        for (update, meta, _) in decoded {
            if scope.contains(NatsKv::scope_key(&self.subject_prefix, &update)) {
                self.last_delivered = update.revision().or(self.last_delivered);
                if let (Some(r), Some(m)) = (update.revision(), meta)
                    && m.timestamp_unix_ns > 0
                {
                    stamp = Some((r, m.timestamp_unix_ns));
                }
                out.push(update);
            }
            let Some(m) = meta else { continue };
            if self.level {
                guard.follow(m.stream_sequence);
                continue;
            }
            if m.pending == 0 {
                // Level: everything before this point goes first, then the marker.
                self.level = true;
                guard.guard_from(m.stream_sequence);
                let done = std::mem::take(&mut out);
                // The stamp goes before the level: a `--catch-up` fold commits and stops on the
                // level, and its memo should carry the time of what it committed.
                if !done.is_empty() && !self.send(WatchEvent::Updates(done)).await {
                    return false;
                }
                if !send_stamp(&self.tx, stamp).await {
                    return false;
                }
                let through = self.last_delivered;
                if !self.send(WatchEvent::CaughtUp { through }).await {
                    return false;
                }
            } else {
                self.since_progress += 1;
                if self.since_progress >= 1024 {
                    self.since_progress = 0;
                    if !self.send(WatchEvent::Pending(m.pending)).await {
                        return false;
                    }
                }
            }
        }
        if !out.is_empty() && !self.send(WatchEvent::Updates(out)).await {
            return false;
        }
        // Stamps are sparse (one per period, and one before the level): an older stamp only makes
        // the memo's time older, which errs on the safe side, and a send per chunk would double
        // the channel traffic of the hot path.
        if stamp.is_some() && self.last_stamp.elapsed() >= STAMP_PERIOD {
            self.last_stamp = std::time::Instant::now();
            if !send_stamp(&self.tx, stamp).await {
                return false;
            }
        }
        true
    }
}

/// Sends a chunk's delivery stamp (`(revision, server time)`), if it has one. False when the
/// receiver is gone.
async fn send_stamp(tx: &mpsc::Sender<WatchEvent>, stamp: Option<(u64, u64)>) -> bool {
    match stamp {
        Some((revision, server_time_unix_ns)) => tx
            .send(WatchEvent::Stamp {
                revision,
                server_time_unix_ns,
            })
            .await
            .is_ok(),
        None => true,
    }
}

/// The highest stream sequence among decoded updates.
fn highest_sequence(decoded: &[catchup::Decoded]) -> Option<u64> {
    decoded
        .iter()
        .filter_map(|(_, m, _)| m.as_ref().map(|m| m.stream_sequence))
        .max()
}

/// The floor guard's backstop: a tick every [`FLOOR_BACKSTOP`], the first one period from now.
fn floor_backstop() -> tokio::time::Interval {
    let mut backstop = tokio::time::interval(FLOOR_BACKSTOP);
    backstop.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    backstop.reset();
    backstop
}

/// A delta watch's frontier: the sequence before its start (`None` for a state-sync start).
fn frontier_of(policy: &consumer::DeliverPolicy) -> Option<u64> {
    match policy {
        consumer::DeliverPolicy::ByStartSequence { start_sequence } => {
            Some(start_sequence.saturating_sub(1))
        }
        _ => None,
    }
}
