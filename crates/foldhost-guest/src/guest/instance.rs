//! One instance of a guest: instantiation, the calls (manifest, init, parse, apply, query, hydration's feed) under their deadlines, and what a trap or a refusal becomes.

use super::*;

impl Core {
    pub(super) fn describe(&self) -> String {
        format!("{}@{}", self.manifest.name, self.manifest.version)
    }

    /// The declared bucket the guest names `bucket`, once the state is attached.
    pub(super) fn lane(&self, bucket: &str) -> Option<&state::StateLane> {
        self.state.get().and_then(|s| s.lane(bucket))
    }

    pub(super) fn err(&self, call: &'static str, message: String) -> ApplyError {
        ApplyError {
            applier: self.describe(),
            call,
            message,
        }
    }

    /// Explains a failed call: deadline, memory cap, the guest's panic message, or the trap.
    pub(super) fn call_error(
        &self,
        live: &Live,
        call: &'static str,
        e: wasmtime::Error,
    ) -> ApplyError {
        let limit_hit = e.chain().find_map(|c| {
            c.downcast_ref::<bindings::MemoryCapHit>()
                .map(ToString::to_string)
                .or_else(|| {
                    c.downcast_ref::<bindings::TableCapHit>()
                        .map(ToString::to_string)
                })
                .or_else(|| bindings::resource_limit_hit(c, self.limits.resource_entries))
        });
        let deadline = matches!(
            e.downcast_ref::<wasmtime::Trap>(),
            Some(wasmtime::Trap::Interrupt)
        );
        let memory = format!("{e:#}").contains("forcing trap when growing memory");
        let counter = match (deadline, limit_hit.is_some() || memory) {
            (true, _) => &self.counters.deadline_hits,
            (false, true) => &self.counters.limit_hits,
            (false, false) => &self.counters.traps,
        };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if !self.trial {
            self.counters
                .running_failures
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let message = if deadline {
            format!(
                "deadline of {} ms exceeded (interrupted)",
                self.limits.call_deadline.as_millis()
            )
        } else if let Some(hit) = limit_hit {
            hit
        } else {
            let text = format!("{e:#}");
            if text.contains("forcing trap when growing memory") {
                format!(
                    "memory cap of {} MiB hit ({})",
                    self.limits.memory_bytes / (1024 * 1024),
                    text.lines().next().unwrap_or_default()
                )
            } else {
                let cause = match e.downcast_ref::<wasmtime::Trap>() {
                    Some(trap) => trap.to_string(),
                    None => e.root_cause().to_string(),
                };
                match live.store.data().panic_message() {
                    Some(panic) => format!("trapped ({cause}): {panic}"),
                    None => format!("trapped ({cause})"),
                }
            }
        };
        self.err(call, message)
    }

    /// The call deadline in epoch ticks (at least one).
    pub(super) fn deadline_ticks(&self) -> u64 {
        let ticks = self.limits.call_deadline.as_micros() / TICK.as_micros();
        u64::try_from(ticks).unwrap_or(u64::MAX).max(1)
    }

    /// Re-arms the deadline before a call: a deadline is relative to the epoch when it is set.
    /// Also resets the call's log-line count and records which call runs (a state write is
    /// allowed from some only) and until when.
    pub(super) fn arm(&self, live: &mut Live, call: foldhost_core::protocol::GuestCall) {
        live.store.set_epoch_deadline(self.deadline_ticks());
        let data = live.store.data_mut();
        data.call = call;
        data.deadline = Some(tokio::time::Instant::now() + self.limits.call_deadline);
        #[cfg(any(test, feature = "testkit"))]
        if self.interrupt_next.swap(false, Ordering::Relaxed) {
            live.store.set_epoch_deadline(0);
        }
        live.store.data_mut().log_lines = 0;
    }

    /// Runs one guest call under the call deadline in wall-clock time. The epoch deadline stops a
    /// guest that computes; this stops one that waits in a host call (a WASI sleep or poll),
    /// where no wasm runs and the epoch cannot interrupt it. The call's future is dropped at the
    /// deadline, and with it the instance's state: the caller drops the instance.
    pub(super) async fn within<F: std::future::Future>(
        &self,
        call: &'static str,
        fut: F,
    ) -> Result<F::Output, ApplyError> {
        tokio::time::timeout(self.limits.call_deadline, fut)
            .await
            .map_err(|_| {
                self.err(
                    call,
                    format!(
                        "deadline of {} ms exceeded (wall clock: the guest was waiting in a host call)",
                        self.limits.call_deadline.as_millis()
                    ),
                )
            })
    }

    pub(super) async fn instantiate(&self) -> Result<Live, ApplyError> {
        let state = HostState::new(
            self.fold.clone(),
            self.describe(),
            self.limits.memory_bytes,
            self.limits.resource_entries,
            &self.engine.random_seed(),
            &self.digest,
            self.state.clone(),
        );
        let mut store = Store::new(self.pre.engine(), state);
        store.data_mut().may_wait = self.answers_beside_fold;
        store.data_mut().capture = self.capture.clone();
        store.limiter(|s| &mut s.limits);
        // The handles the guest's own tables hold (wasmtime's default is 100 000): as bounded as
        // the host resources behind them.
        store.set_max_component_handles(self.limits.resource_entries);
        // Instantiation runs guest start-up code too: it gets a deadline like every call.
        store.set_epoch_deadline(self.deadline_ticks());
        let guest = self
            .within("instantiate", self.pre.instantiate_async(&mut store))
            .await?
            .map_err(|e| self.err("instantiate", format!("{e:#}")))?;
        Ok(Live { store, guest })
    }

    pub(super) async fn call_manifest(&self, live: &mut Live) -> Result<GuestManifest, ApplyError> {
        self.arm(live, foldhost_core::protocol::GuestCall::Setup);
        let m = self
            .within("manifest", live.guest.manifest(&mut live.store))
            .await?
            .map_err(|e| self.call_error(live, "manifest", e))?;
        // The name and version go into every log line, error and status: short, printable.
        let printable = |s: &str| {
            !s.is_empty() && s.len() <= MAX_MANIFEST_NAME && !s.chars().any(char::is_control)
        };
        if !printable(&m.name) || !printable(&m.version) {
            return Err(self.err(
                "manifest",
                format!(
                    "name and version must be 1 to {MAX_MANIFEST_NAME} printable bytes (got {} and {} bytes)",
                    m.name.len(),
                    m.version.len()
                ),
            ));
        }
        if m.scope.len() > MAX_SCOPE_PREFIXES || m.scope.iter().any(|p| p.len() > MAX_MESSAGE_BYTES)
        {
            return Err(self.err(
                "manifest",
                format!(
                    "scope must be at most {MAX_SCOPE_PREFIXES} prefixes of at most {MAX_MESSAGE_BYTES} bytes"
                ),
            ));
        }
        if m.state.len() + m.reads.len() > foldhost_core::protocol::MAX_STATE_BUCKETS {
            return Err(self.err(
                "manifest",
                format!(
                    "{} buckets declared: at most {}",
                    m.state.len() + m.reads.len(),
                    foldhost_core::protocol::MAX_STATE_BUCKETS
                ),
            ));
        }
        Ok(GuestManifest {
            name: m.name,
            version: m.version,
            scope: m.scope,
            state: m.state,
            reads: m.reads,
        })
    }

    pub(super) async fn call_init(&self, live: &mut Live) -> Result<(), ApplyError> {
        self.arm(live, foldhost_core::protocol::GuestCall::Setup);
        let config: Vec<(&str, &str)> = self
            .config
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        self.within("init", live.guest.init(&mut live.store, &config))
            .await?
            .map_err(|e| self.call_error(live, "init", e))?
            .map_err(|m| self.err("init", clip_text(m, MAX_MESSAGE_BYTES)))
    }

    /// A fresh instance: instantiated, checked to be the same guest, initialised (not hydrated).
    pub(super) async fn fresh(&self) -> Result<Live, ApplyError> {
        let mut live = self.instantiate().await?;
        let m = self.call_manifest(&mut live).await?;
        if m.name != self.manifest.name
            || m.version != self.manifest.version
            || m.state != self.manifest.state
            || m.reads != self.manifest.reads
        {
            return Err(self.err(
                "manifest",
                format!("a fresh instance says it is {}@{}", m.name, m.version),
            ));
        }
        self.call_init(&mut live).await?;
        Ok(live)
    }

    pub(super) async fn call_parse(
        &self,
        live: &mut Live,
        bucket: &str,
        batch: &[bindings::Update<'_>],
    ) -> Result<Vec<Verdict>, ApplyError> {
        self.arm(live, foldhost_core::protocol::GuestCall::Parse);
        let verdicts = self
            .within("parse", live.guest.parse(&mut live.store, bucket, batch))
            .await?
            .map_err(|e| self.call_error(live, "parse", e))?;
        if verdicts.len() != batch.len() {
            return Err(self.err(
                "parse",
                format!(
                    "answered {} verdicts for a batch of {}",
                    verdicts.len(),
                    batch.len()
                ),
            ));
        }
        verdicts
            .into_iter()
            .map(|v| match v {
                bindings::Verdict::Accept => Ok(Verdict::Accept),
                bindings::Verdict::Skip => Ok(Verdict::Skip),
                bindings::Verdict::Defer => Ok(Verdict::Defer),
            })
            .collect()
    }

    /// One `query` call: `Ok` with the guest's own answer — its response (at most
    /// [`MAX_QUERY_ANSWER_BYTES`]) or the error it chose to give — or `Err` when the call itself
    /// failed (a trap, a deadline): the caller then drops `live`, which is dead.
    pub(super) async fn query(
        &self,
        live: &mut Live,
        request: &[u8],
    ) -> Result<Result<Vec<u8>, String>, ApplyError> {
        self.arm(live, foldhost_core::protocol::GuestCall::Query);
        let answer = self
            .within("query", live.guest.query(&mut live.store, request))
            .await?
            .map_err(|e| self.call_error(live, "query", e))?;
        Ok(match answer {
            Ok(a) if a.len() > MAX_QUERY_ANSWER_BYTES => Err(format!(
                "answer of {} bytes is over the limit of {MAX_QUERY_ANSWER_BYTES}",
                a.len()
            )),
            Ok(a) => Ok(a),
            Err(m) => Err(clip_text(m, MAX_MESSAGE_BYTES)),
        })
    }

    pub(super) async fn call_apply(&self, live: &mut Live) -> Result<(), ApplyError> {
        self.arm(live, foldhost_core::protocol::GuestCall::Apply);
        self.within("apply", live.guest.apply(&mut live.store))
            .await?
            .map_err(|e| self.call_error(live, "apply", e))?
            .map_err(|m| self.err("apply", clip_text(m, MAX_MESSAGE_BYTES)))
    }

    /// Parses and applies `updates` in calls of at most `hydrate_chunk` entries and
    /// `max_batch_bytes` bytes (a single update over the byte limit is refused, named). Verdicts
    /// are the guest's own business here: what it skips or defers it does not build.
    pub(super) async fn feed(
        &self,
        live: &mut Live,
        bucket: &str,
        updates: Vec<bindings::Update<'_>>,
    ) -> Result<(), ApplyError> {
        let chunk = self.limits.hydrate_chunk.max(1);
        let mut rest = updates.into_iter().peekable();
        while rest.peek().is_some() {
            let mut call = Vec::with_capacity(chunk);
            let mut bytes = 0usize;
            while let Some(u) = rest.peek() {
                let size = u.key.len() + u.value.len();
                if call.len() == chunk
                    || (!call.is_empty() && bytes + size > self.limits.max_batch_bytes)
                {
                    break;
                }
                if size > self.limits.max_batch_bytes {
                    return Err(self.err(
                        "hydrate",
                        format!(
                            "entry {:?} carries {size} bytes, over the guest's max-batch-bytes limit of {}",
                            u.key, self.limits.max_batch_bytes
                        ),
                    ));
                }
                bytes += size;
                call.extend(rest.next());
            }
            self.call_parse(live, bucket, &call).await?;
            self.call_apply(live).await?;
            // A guest call runs to its end without yielding (its deadline traps, it does not
            // yield), so a hydration of many chunks would hold its worker thread throughout: on a
            // runtime with one worker, the fold beside a swap's hydration would stop. Yield
            // between chunks.
            tokio::task::yield_now().await;
        }
        Ok(())
    }

    /// Streams the fold (in scope, through this guest's view of it) through parse/apply in chunks.
    /// `swapping`: this is a swap candidate's hydration (the fold keeps going beside it), where the
    /// [`foldhost_core::crashpoint::SWAP_HYDRATING`] hold point sits after the first chunk.
    pub(super) async fn stream_fold(
        &self,
        live: &mut Live,
        swapping: bool,
    ) -> Result<(u64, Duration), ApplyError> {
        let t = Instant::now();
        let prefixes = self.manifest.hydration_prefixes();
        let chunk = self.limits.hydrate_chunk.max(1);
        let mut total = 0u64;
        // Pages are read on a thread of their own, one page ahead of the guest: reading the next
        // page (the store's scan and the copy into the page) overlaps the guest's parse and apply
        // of this one. Every read goes through the same view, so when a page is read does not
        // change what it holds (a swap candidate's view stands at C whatever the fold does).
        let mut pages = PageReader::start(self.fold.clone(), prefixes, chunk);
        while let Some(read) = pages.next().await {
            let page = read.map_err(|e| self.err("hydrate", format!("read the fold: {e}")))?;
            total += page.items.len() as u64;
            self.feed(live, "", page.updates()).await?;
            pages.recycle(page);
            if swapping {
                foldhost_core::crashpoint::hold(foldhost_core::crashpoint::SWAP_HYDRATING).await;
            }
        }
        self.call_end_of_current(live, "").await?;
        // A swap's candidate is handed the state buckets at the cut-over (`hydrate_lanes`), when
        // no lane's batch is between its apply and its commit; a rebuild, here.
        if !swapping {
            total += self.hydrate_lanes(live).await?;
        }
        tracing::info!(event = "guest_hydrated",
            guest = %self.describe(),
            entries = total,
            buckets = 1 + self.state.get().map_or(0, |s| s.lanes.len()),
            ms = t.elapsed().as_millis() as u64,
            "guest hydrated from the fold"
        );
        Ok((total, t.elapsed()))
    }

    /// `end-of-current` of `bucket`, under the call deadline.
    pub(super) async fn call_end_of_current(
        &self,
        live: &mut Live,
        bucket: &str,
    ) -> Result<(), ApplyError> {
        self.arm(live, foldhost_core::protocol::GuestCall::Apply);
        self.within(
            "end-of-current",
            live.guest.end_of_current(&mut live.store, bucket),
        )
        .await?
        .map_err(|e| self.call_error(live, "end-of-current", e))
    }

    /// Streams every state bucket's committed fold into `live`, each bucket's current values then
    /// its `end-of-current`, in the order declared; returns the entries handed over.
    pub(super) async fn hydrate_lanes(&self, live: &mut Live) -> Result<u64, ApplyError> {
        let Some(access) = self.state.get() else {
            return Ok(0);
        };
        let chunk = self.limits.hydrate_chunk.max(1);
        let mut total = 0u64;
        for lane in &access.lanes {
            let mut pages = PageReader::start(lane.read.clone(), vec![String::new()], chunk);
            while let Some(read) = pages.next().await {
                let page = read.map_err(|e| {
                    self.err(
                        "hydrate",
                        format!("read the fold of {:?}: {e}", lane.decl.local),
                    )
                })?;
                total += page.items.len() as u64;
                self.feed(live, &lane.decl.local, page.updates()).await?;
                pages.recycle(page);
            }
            self.call_end_of_current(live, &lane.decl.local).await?;
        }
        Ok(total)
    }
}
