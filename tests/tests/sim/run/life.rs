//! One life of the simulated node: its applier (native or the Wasm guest), its store and guest
//! faults, the fold and the driver raced, then the checks of what it committed (cursors never
//! backward, the durable one recorded), the store released and a torn commit cut into the log.

use super::*;

impl Sim {
    pub(super) async fn applier(
        &mut self,
        kind: GuestKind,
        fold: Arc<dyn FoldRead>,
    ) -> Res<Box<dyn Apply>> {
        Ok(match kind {
            GuestKind::Native => Box::new(NativeMap::new(fold)),
            GuestKind::Wasm => {
                let c = components();
                let bytes = if self.on_v2 { &c.v2 } else { &c.v1 };
                let mut g = GuestApply::load(
                    &c.engine,
                    "kvstore.wasm",
                    bytes,
                    GuestLimits::default(),
                    Vec::new(),
                    fold,
                )
                .await
                .map_err(|e| format!("load the guest: {e}"))?;
                g.hydrate().await.map_err(|e| format!("hydrate: {e}"))?;
                Box::new(g)
            }
        })
    }

    /// One life: open, fold with `rounds` rounds of writes (faults armed when `faults`), check, stop.
    pub(super) async fn life(
        &mut self,
        dir: &Path,
        kind: GuestKind,
        faults: bool,
        rounds: u32,
    ) -> Res<()> {
        let inner = self.open(dir)?;
        let (shared, watch, guest_faults) = self.armed(inner, dir, kind, faults);
        let fold_view: Arc<dyn FoldRead> = Arc::new(shared.clone());
        let applier = self.applier(kind, fold_view).await?;
        let mut apply = self.harnessed(applier, &shared, guest_faults);
        let trap_next_query = apply.trap_next_query.clone();
        let status = Arc::new(FoldStatus::default());
        let (ctl_tx, ctl_rx) = mpsc::channel(4);
        let queries = Queries::new(ctl_tx.clone());
        let opts = self.life_options(&queries);
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let watcher: Arc<dyn KvWatcher> = Arc::new(self.bucket.clone());
        let mut fold = Box::pin(watch_applied(
            watcher,
            shared.clone(),
            &mut apply,
            opts,
            status.clone(),
            Some(ctl_rx),
            async move {
                let _ = stop_rx.await;
            },
        ));
        self.asker = Some(Asker {
            ctl: ctl_tx.clone(),
            queries: queries.clone(),
            status: status.clone(),
            trap: trap_next_query,
            traps: faults,
        });
        let end = self
            .race(&mut fold, (&shared, &watch), &ctl_tx, kind, rounds)
            .await?;
        self.out.repairs += status.repairs.load(Ordering::Relaxed);
        if end == LifeEnd::Done && !watch.crashed.load(Ordering::SeqCst) {
            // A clean stop (or a kill: dropping the fold mid-flight is a crash between commits).
            if self.rng.chance(50) {
                let _ = stop_tx.send(());
                match (&mut fold).await {
                    Ok(f) => self.note(format!("stopped at {:?}", f.cursor)),
                    Err(e) => return Err(format!("a clean stop failed: {e}")),
                }
            } else {
                self.note("killed".into());
            }
        }
        drop(fold);
        self.asker = None;
        self.out.guest_traps += apply.traps.load(Ordering::SeqCst);
        drop(apply);
        let torn = self.check_committed(dir, &watch)?;
        if end == LifeEnd::Crashed {
            self.out.crashes += 1;
        }
        release_store(shared).await?;
        if let Some((before, after)) = torn {
            self.tear(dir, before, after)?;
        }
        Ok(())
    }

    /// The life's store `inner` (in `dir`) behind its planned faults, with the watch over its
    /// calls, and the life's guest faults: none without `faults` or in the pinned case.
    fn armed(
        &mut self,
        inner: AnyStore,
        dir: &Path,
        kind: GuestKind,
        faults: bool,
    ) -> (
        SharedStore<FaultStore>,
        Arc<StoreWatch>,
        Vec<(u32, GuestFault)>,
    ) {
        let plan = if faults && !self.sc.pinned_query_trap {
            self.plan_store_faults()
        } else {
            BTreeMap::new()
        };
        let guest_faults = self.plan_guest_faults(kind, faults);
        self.note(format!(
            "life: cursor {}, store faults {plan:?}, guest faults {guest_faults:?}",
            inner.cursor().revision_or_zero()
        ));
        let watch = Arc::new(StoreWatch::default());
        let shared = SharedStore::new(FaultStore {
            inner,
            dir: dir.to_path_buf(),
            plan,
            watch: watch.clone(),
        });
        (shared, watch, guest_faults)
    }

    /// The fold and the life's driver raced (the fold polled first, so which side runs when
    /// depends only on the seed): how the life ended, or why it failed.
    async fn race<F>(
        &mut self,
        fold: &mut F,
        (shared, watch): (&SharedStore<FaultStore>, &StoreWatch),
        ctl_tx: &mpsc::Sender<Control>,
        kind: GuestKind,
        rounds: u32,
    ) -> Res<LifeEnd>
    where
        F: Future<Output = Result<Finished, AppliedError>> + Unpin,
    {
        let ended = {
            let started = self.bucket.watches_started();
            let driver = self.drive(shared, watch, ctl_tx, kind, rounds, started);
            tokio::pin!(driver);
            // Biased: the fold is polled first, so which side runs when depends only on the seed.
            tokio::select! {
                biased;
                r = &mut *fold => Err(match r {
                    Ok(f) => format!("the fold ended by itself at {:?}", f.cursor),
                    Err(_) if watch.crashed.load(Ordering::SeqCst) => String::new(),
                    Err(e) => format!("the fold stopped: {e}"),
                }),
                d = &mut driver => Ok(d),
            }
        };
        match ended {
            Ok(Ok(end)) => Ok(end),
            Ok(Err(e)) => Err(e),
            Err(e) if e.is_empty() => Ok(LifeEnd::Crashed),
            Err(e) => Err(e),
        }
    }

    /// The guest faults of one life: with `faults`, by chance one `apply` call among the first six
    /// that fails (a Wasm guest's, by chance, a real trap).
    fn plan_guest_faults(&mut self, kind: GuestKind, faults: bool) -> Vec<(u32, GuestFault)> {
        if faults && !self.sc.pinned_query_trap && self.rng.chance(50) {
            let kind = if kind == GuestKind::Wasm && self.rng.chance(50) {
                GuestFault::Interrupt
            } else {
                GuestFault::Error
            };
            vec![(1 + self.rng.below(6) as u32, kind)]
        } else {
            Vec::new()
        }
    }

    /// The applier of one life inside the harness that checks what it is shown and injects
    /// `guest_faults`.
    fn harnessed(
        &self,
        applier: Box<dyn Apply>,
        shared: &SharedStore<FaultStore>,
        guest_faults: Vec<(u32, GuestFault)>,
    ) -> Harnessed {
        Harnessed {
            inner: applier,
            bucket: self.bucket.clone(),
            store: shared.clone(),
            truth: self.truth.clone(),
            violations: self.violations.clone(),
            faults: guest_faults,
            calls: Arc::new(AtomicU32::new(0)),
            traps: Arc::new(AtomicU32::new(0)),
            trap_next_query: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The fold's options in one life: the scenario's scope and batch size, automatic repairs
    /// (the key listing from the bucket, the peer's artifacts), queries through `queries`.
    fn life_options(&self, queries: &Queries) -> WatchOptions {
        WatchOptions {
            scope: self.sc.scope.clone(),
            batch: BatchConfig {
                window: Duration::from_millis(5),
                max: self.sc.batch_max,
                ..BatchConfig::default()
            },
            catch_up: false,
            defer_grace: foldhost_fold::applied::DEFAULT_DEFER_GRACE,
            repair: RepairConfig {
                mode: RepairMode::Auto,
                restore_from: Some(RestoreSource::new(&self.peer_dir)),
                lister: Some(Arc::new(self.bucket.clone()) as Arc<dyn KvReader>),
                scratch: Some(self.root.join("scratch")),
                ..RepairConfig::default()
            },
            queries: Some(queries.clone()),
        }
    }

    /// The committed cursors of a life never move backward; the last durable one is recorded for
    /// `dir`. Returns the torn commit, if the life tore one.
    fn check_committed(&mut self, dir: &Path, watch: &StoreWatch) -> Res<Option<(u64, u64)>> {
        let committed = watch
            .committed
            .lock()
            .map(|c| c.clone())
            .unwrap_or_default();
        self.note(format!("committed cursors {committed:?}"));
        if let Some(w) = committed.windows(2).find(|w| w[1] < w[0]) {
            return Err(format!("the cursor moved backward: {} then {}", w[0], w[1]));
        }
        let torn = watch.torn.lock().ok().and_then(|t| *t);
        let durable_now = match torn {
            // The torn commit is not durable: the one before it is.
            Some(_) => committed.iter().rev().nth(1).copied(),
            None => committed.last().copied(),
        };
        if let Some(d) = durable_now {
            let e = self.durable.entry(dir.to_path_buf()).or_insert(0);
            *e = (*e).max(d);
        }
        Ok(torn)
    }

    /// Tears the last commit: the append log in `dir` cut between `before` and `after` bytes.
    fn tear(&mut self, dir: &Path, before: u64, after: u64) -> Res<()> {
        let cut = before + self.rng.below(after - before);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(crate::faults::log_file(dir))
            .map_err(|e| format!("open the log to tear it: {e}"))?;
        f.set_len(cut).map_err(|e| format!("tear the log: {e}"))?;
        self.out.torn += 1;
        self.note(format!(
            "torn the last commit: log cut to {cut} of {after} bytes"
        ));
        Ok(())
    }

    /// The driver of one life: rounds of writes with the fold running, each waited on until the
    /// fold holds the truth; then the guest is checked against a fresh one hydrated from the fold.
    async fn drive(
        &mut self,
        shared: &SharedStore<FaultStore>,
        watch: &StoreWatch,
        ctl: &mpsc::Sender<Control>,
        kind: GuestKind,
        rounds: u32,
        started: u64,
    ) -> Res<LifeEnd> {
        if rounds > 0 && self.rng.chance(30) {
            // Writes and eviction while the fold starts: between its start-up decisions and its
            // first watch's snapshot.
            let n = 1 + self.rng.below(6);
            self.writes(n);
            self.maybe_evict();
            self.note(format!("{n} writes while the fold starts"));
        }
        if self.wait_level(shared, watch, started).await? == LifeEnd::Crashed {
            return Ok(LifeEnd::Crashed);
        }
        if self.sc.pinned_query_trap && rounds > 0 {
            return self
                .trap_a_query_before_a_retry(shared, watch, ctl, kind, started)
                .await;
        }
        for round in 0..rounds {
            let n = 1 + self.rng.below(10);
            if self.rng.chance(30) {
                // A delivery gap: the watch sees nothing while the bucket writes and evicts.
                self.bucket.hold_deliveries();
                self.writes(n);
                if self.rng.chance(60) {
                    self.publish_peer();
                }
                self.maybe_evict();
                self.bucket.release_deliveries();
                self.note(format!("round {round}: {n} writes in a delivery gap"));
            } else {
                self.writes(n);
                if self.rng.chance(30) {
                    self.publish_peer();
                }
                self.maybe_evict();
                self.note(format!("round {round}: {n} writes"));
            }
            if kind == GuestKind::Wasm && !self.on_v2 && self.rng.chance(30) {
                self.swap(ctl).await?;
            }
            if self.rng.chance(25) {
                self.export(ctl).await;
            }
            if self.wait_level(shared, watch, started).await? == LifeEnd::Crashed {
                return Ok(LifeEnd::Crashed);
            }
            // After every round: the running guest is what a fresh one built from the fold is.
            self.check_guest(shared, ctl, kind).await?;
        }
        self.check_guest(shared, ctl, kind).await?;
        Ok(LifeEnd::Done)
    }

    /// The pinned case: a batch applied by the guest, its commit failed and re-queued; before the
    /// retry, a query traps (the instance is dropped) and another query follows (which, answered
    /// by a rebuilt instance, would see a fold without the batch); then the retry commits and the
    /// running guest must answer as a fresh one built from the fold.
    async fn trap_a_query_before_a_retry(
        &mut self,
        shared: &SharedStore<FaultStore>,
        watch: &StoreWatch,
        ctl: &mpsc::Sender<Control>,
        kind: GuestKind,
        started: u64,
    ) -> Res<LifeEnd> {
        let next = watch.calls.load(Ordering::SeqCst) + 1;
        shared
            .write()
            .map_err(|e| e.to_string())?
            .plan
            .insert(next, StoreFault::Fail);
        let key = KEYS[0];
        self.counter += 1;
        let value = Bytes::from(format!("{key}={}", self.counter));
        let seq = self.bucket.put_now(key, value.clone());
        self.truth
            .lock()
            .expect("truth")
            .record(seq, key, Op::Put(value));
        self.note(format!("put {key} at {seq}; store call {next} fails"));
        let status = self.asker.as_ref().map(|a| a.status.clone());
        let Some(status) = status else {
            return Err("no running life".into());
        };
        let start = tokio::time::Instant::now();
        while status.store_failure_streak.load(Ordering::SeqCst) == 0 {
            if start.elapsed() > STUCK {
                return Err("the planned store failure never happened".into());
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let trapped = self.ask(key, true).await?;
        let after = self.ask(key, false).await?;
        self.note(format!(
            "between the failed commit and its retry: a trapping query ({trapped}), then {after}"
        ));
        if status.store_failure_streak.load(Ordering::SeqCst) == 0 {
            return Err("the retry came before the queries: the case was not placed".into());
        }
        self.out.queries_before_retry += 2;
        if self.wait_level(shared, watch, started).await? == LifeEnd::Crashed {
            return Err("the pinned case crashed".into());
        }
        self.check_guest(shared, ctl, kind).await?;
        Ok(LifeEnd::Done)
    }
}

/// Closes the store with its last handle (a crash drops it without a clean close). A commit the
/// dropped fold handed to a blocking thread may still hold one: waits for it.
async fn release_store(mut shared: SharedStore<FaultStore>) -> Res<()> {
    let mut waits = 0;
    loop {
        match shared.into_inner() {
            Ok(store) => {
                drop(store);
                return Ok(());
            }
            Err(back) if waits < 1000 => {
                shared = back;
                waits += 1;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Err(_) => return Err("the store is still shared after the fold ended".into()),
        }
    }
}
