//! The cluster the workload runs (nodes, proxies, the nemesis), the workload tests, and the write
//! mutations the checker must catch.

use super::*;

struct Cluster {
    h: Harness,
    proxy: Proxy,
    bucket: String,
    tmp: tempfile::TempDir,
    nodes: Vec<Node>,
    targets: Targets,
    next_fold: usize,
    recorder: Arc<Recorder>,
    log: Log,
    incarnation: Arc<AtomicUsize>,
    env: Vec<(String, String)>,
    clients: Vec<Client>,
}

impl Cluster {
    /// A server, a bucket keeping [`HISTORY`] revisions per key, a proxy in front of the server,
    /// and `nodes` nodes folding the bucket through it, with `env` in their environment.
    async fn start(
        seed: u64,
        nodes: usize,
        clients: usize,
        env: &[(&str, String)],
    ) -> anyhow::Result<Cluster> {
        let h = Harness::start().await?;
        let bucket = "hist".to_string();
        h.bucket_with_history(&bucket, HISTORY).await?;
        let proxy = Proxy::start(&h.url().replace("nats://", "")).await?;
        let mut c = Cluster {
            h,
            proxy,
            bucket,
            tmp: tempfile::tempdir()?,
            nodes: Vec::new(),
            targets: Arc::new(RwLock::new(Vec::new())),
            next_fold: 0,
            recorder: Arc::new(Recorder::default()),
            log: Log {
                incarnations: vec![Incarnation::default()],
            },
            incarnation: Arc::new(AtomicUsize::new(0)),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            clients: (0..clients)
                .map(|i| Client::new(i, seed.wrapping_add(i as u64 + 1)))
                .collect(),
        };
        for i in 0..nodes {
            let store = c.tmp.path().join(format!("fold-{i}"));
            let fold = c.next_fold;
            c.next_fold += 1;
            let (child, addr) = c.spawn_node(&store, &[]).await?;
            c.nodes.push(Node {
                child: Some(child),
                addr: addr.clone(),
                store,
                fold,
                extra: Vec::new(),
            });
            c.set_target(i, Some(Target { addr, fold }));
        }
        Ok(c)
    }

    fn set_target(&self, i: usize, t: Option<Target>) {
        let mut targets = self
            .targets
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if targets.len() <= i {
            targets.resize(i + 1, None);
        }
        targets[i] = t;
    }

    /// Starts `foldhost run` on `store` through the proxy, on a new reserved port; waits until
    /// it serves.
    async fn spawn_node(&self, store: &Path, extra: &[String]) -> anyhow::Result<(Child, String)> {
        let addr = format!("127.0.0.1:{}", foldhost_localnats::reserved_port()?);
        let token_file = store.with_extension("write-token");
        std::fs::write(&token_file, TOKEN)?;
        let mut cmd = foldhost();
        cmd.args(["run", "--bucket", &self.bucket, "--nats"])
            .arg(self.proxy.url())
            .arg("--store")
            .arg(store)
            .args(["--listen", &addr])
            .arg("--write-token-file")
            .arg(&token_file)
            // A read the proxy blocks fails soon; a watch over a cut connection, and one whose
            // stream was recreated, is noticed within seconds.
            .args(["--nats-op-timeout", "3", "--watch-heartbeat", "1"])
            .args(["--on-recreated", "relist"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(if std::env::var_os("FOLDHOST_HISTORY_NODE_LOG").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            });
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let child = cmd.spawn()?;
        wait_status(&addr, |s| s.state == "running").await?;
        Ok((child, addr))
    }

    /// SIGKILLs node `i`; its clients see it gone.
    fn kill_node(&mut self, i: usize) -> anyhow::Result<()> {
        self.set_target(i, None);
        if let Some(mut child) = self.nodes[i].child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Starts node `i` again (a new fold and store when `empty`), with `extra` arguments.
    async fn restart_node(&mut self, i: usize, empty: bool, extra: &[&str]) -> anyhow::Result<()> {
        if empty {
            self.new_fold(i);
        }
        self.start_node(i, extra).await
    }

    /// Gives node `i` a new fold whose store does not exist yet.
    fn new_fold(&mut self, i: usize) {
        self.nodes[i].store = self.tmp.path().join(format!("fold-{i}-{}", self.next_fold));
        self.nodes[i].fold = self.next_fold;
        self.next_fold += 1;
    }

    /// Node `i`'s store becomes a new fold imported from an artifact node `peer` exports while it
    /// runs (exactly at its cursor, between two of its batches).
    fn import_from_peer(&mut self, i: usize, peer: usize) -> anyhow::Result<()> {
        let artifact = self.tmp.path().join(format!("artifact-{}", self.next_fold));
        let out = foldhost()
            .args(["export", "--listen", &self.nodes[peer].addr, "--out"])
            .arg(&artifact)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "export from node {peer}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.new_fold(i);
        let out = foldhost()
            .args(["import", "--artifact"])
            .arg(&artifact)
            .arg("--store")
            .arg(&self.nodes[i].store)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "import into node {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// Starts node `i` on its store with `extra` arguments; its clients see it once it serves.
    async fn start_node(&mut self, i: usize, extra: &[&str]) -> anyhow::Result<()> {
        self.nodes[i].extra = extra.iter().map(|s| s.to_string()).collect();
        let (child, addr) = self
            .spawn_node(&self.nodes[i].store.clone(), &self.nodes[i].extra.clone())
            .await?;
        self.nodes[i].child = Some(child);
        self.nodes[i].addr = addr.clone();
        self.set_target(
            i,
            Some(Target {
                addr,
                fold: self.nodes[i].fold,
            }),
        );
        Ok(())
    }

    /// The bucket's stream's last sequence, asked until the server answers.
    async fn last_sequence(&self) -> anyhow::Result<u64> {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let kv = self.h.bucket_with_history(&self.bucket, HISTORY).await;
            match kv {
                Ok(kv) => match kv.positions().await {
                    Ok(p) => return Ok(p.last_sequence),
                    Err(e) => {
                        anyhow::ensure!(std::time::Instant::now() < deadline, "positions: {e}")
                    }
                },
                Err(e) => anyhow::ensure!(std::time::Instant::now() < deadline, "bucket: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Every node up, every fold level with the log, and the log read.
    async fn settle(&mut self) -> anyhow::Result<()> {
        self.proxy.refuse_new(false);
        for i in 0..self.nodes.len() {
            if self.nodes[i].child.is_none() {
                self.restart_node(i, false, &[]).await?;
            }
        }
        let last = self.last_sequence().await?;
        for n in &self.nodes {
            wait_status(&n.addr, |s| {
                s.state == "running" && s.applied_through >= last
            })
            .await?;
        }
        self.read_log().await
    }

    async fn read_log(&mut self) -> anyhow::Result<()> {
        let kv = self.h.bucket_with_history(&self.bucket, HISTORY).await?;
        let inc = self
            .log
            .incarnations
            .last_mut()
            .ok_or_else(|| anyhow::anyhow!("no incarnation"))?;
        history::read_log(kv.jetstream(), &self.bucket, inc).await
    }

    /// One phase: every client runs `ops` operations (`Mode`), and `fault`, when given, strikes
    /// once a third of them completed. Then everything settles and the log is read.
    async fn phase(
        &mut self,
        rng: &mut StdRng,
        ops: usize,
        mode: Mode,
        fault: Option<Fault>,
    ) -> anyhow::Result<()> {
        if fault == Some(Fault::Recreate) {
            self.recreate().await?;
        }
        let progress = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for mut client in std::mem::take(&mut self.clients) {
            let env = Env {
                recorder: self.recorder.clone(),
                targets: self.targets.clone(),
                incarnation: self.incarnation.clone(),
                progress: progress.clone(),
            };
            tasks.push(tokio::spawn(async move {
                let r = client.run(&env, ops, mode).await;
                (client, r)
            }));
        }
        if let Some(fault) = fault.filter(|f| *f != Fault::Recreate) {
            let total = ops * tasks.len();
            let at = total / 3;
            wait_until("a third of the phase", || {
                progress.load(Ordering::SeqCst) >= at || tasks.iter().all(|t| t.is_finished())
            })
            .await?;
            self.strike(rng, fault, &progress, &tasks).await?;
        }
        for t in tasks {
            let (client, r) = t.await?;
            self.clients.push(client);
            r?;
        }
        self.settle().await
    }

    /// Injects `fault` while the clients run.
    async fn strike(
        &mut self,
        rng: &mut StdRng,
        fault: Fault,
        progress: &AtomicUsize,
        tasks: &[tokio::task::JoinHandle<(Client, anyhow::Result<()>)>],
    ) -> anyhow::Result<()> {
        // Waits until `n` more operations completed (or the clients are done).
        let more = |n: usize| {
            let from = progress.load(Ordering::SeqCst);
            wait_until("operations under the fault", move || {
                progress.load(Ordering::SeqCst) >= from + n || tasks.iter().all(|t| t.is_finished())
            })
        };
        eprintln!("history: {fault:?}");
        match fault {
            Fault::KillServer => self.h.server.restart()?,
            Fault::CutConnections => {
                let prefix = format!("$KV.{}.", self.bucket);
                for round in 0..3 {
                    let cuts = self.proxy.cuts();
                    // Once, nobody may reconnect until a few more operations were answered.
                    let refuse = round == 1;
                    self.proxy.refuse_new(refuse);
                    self.proxy.cut_after_publish_to(&prefix);
                    wait_until("a cut", || {
                        self.proxy.cuts() > cuts || tasks.iter().all(|t| t.is_finished())
                    })
                    .await?;
                    if refuse {
                        more(tasks.len()).await?;
                        self.proxy.refuse_new(false);
                    }
                }
                // An armed cut nobody reached is disarmed: the next phase starts clean.
                self.proxy.cut_after_publish_to("$nothing.");
            }
            Fault::KillNode(from) => {
                let i = rng.random_range(0..self.nodes.len());
                self.kill_node(i)?;
                more(tasks.len()).await?;
                match from {
                    Restart::OwnStore => self.restart_node(i, false, &[]).await?,
                    Restart::Empty => self.restart_node(i, true, &[]).await?,
                    Restart::PeerArtifact => {
                        // Every other node is up: the nemesis strikes one node at a time.
                        let peer =
                            (i + 1 + rng.random_range(0..self.nodes.len() - 1)) % self.nodes.len();
                        tokio::task::block_in_place(|| self.import_from_peer(i, peer))?;
                        self.start_node(i, &[]).await?;
                    }
                }
            }
            Fault::ShortDuplicateWindow => self.short_duplicate_window().await?,
            Fault::SweepLedger => {
                let i = rng.random_range(0..self.nodes.len());
                self.kill_node(i)?;
                // Rows older than the retention are swept at start: let a second pass (a
                // precondition, not a synchronisation).
                tokio::time::sleep(Duration::from_millis(1500)).await;
                self.restart_node(i, false, &["--ledger-retention", "1s"])
                    .await?;
                wait_status(&self.nodes[i].addr, |s| s.ledger_sweeps >= 1).await?;
            }
            Fault::Recreate => self.recreate().await?,
        }
        Ok(())
    }

    /// Shortens the stream's duplicate window to a second (as `short_duplicate_window` in
    /// writes.rs).
    async fn short_duplicate_window(&self) -> anyhow::Result<()> {
        let kv = self.h.bucket_with_history(&self.bucket, HISTORY).await?;
        let js = kv.jetstream();
        let mut config = js
            .get_stream(format!("KV_{}", self.bucket))
            .await?
            .cached_info()
            .config
            .clone();
        config.duplicate_window = Duration::from_secs(1);
        js.update_stream(config).await?;
        Ok(())
    }

    /// Reads the stream's log whole, deletes the stream, creates the bucket again, and waits
    /// until every node relisted it. Requests from here on are the new incarnation's.
    async fn recreate(&mut self) -> anyhow::Result<()> {
        eprintln!("history: Recreate");
        self.settle().await?;
        let mut repairs = Vec::new();
        for n in &self.nodes {
            repairs.push(wait_status(&n.addr, |_| true).await?.repairs);
        }
        let kv = self.h.bucket_with_history(&self.bucket, HISTORY).await?;
        kv.jetstream()
            .delete_stream(format!("KV_{}", self.bucket))
            .await?;
        self.h.bucket_with_history(&self.bucket, HISTORY).await?;
        self.log.incarnations.push(Incarnation::default());
        self.incarnation
            .store(self.log.incarnations.len() - 1, Ordering::SeqCst);
        for (n, before) in self.nodes.iter().zip(repairs) {
            wait_status(&n.addr, |s| s.state == "running" && s.repairs > before).await?;
        }
        Ok(())
    }

    /// Every fold's contents, read with `POST /get` once it applied the log's end.
    async fn finals(&mut self) -> anyhow::Result<Vec<FinalFold>> {
        self.settle().await?;
        let last = self.last_sequence().await?;
        let mut out = Vec::new();
        for n in &self.nodes {
            let mut contents = Contents::new();
            for key in KEYS {
                match get(&n.addr, key, Some(last), 60_000).await {
                    Answer::Found {
                        value, revision, ..
                    } => {
                        contents.insert(key.to_string(), (value, revision));
                    }
                    Answer::NotFound { .. } => {}
                    other => anyhow::bail!("final read of {key} on {}: {other:?}", n.addr),
                }
            }
            out.push(FinalFold {
                node: n.fold,
                contents,
            });
        }
        Ok(out)
    }

    /// The checker's verdict on everything recorded.
    async fn check(&mut self) -> anyhow::Result<Vec<history::Anomaly>> {
        let finals = self.finals().await?;
        let ops = self.recorder.ops();
        let anomalies = history::check(&ops, &self.log, &finals);
        let writes = ops.iter().filter(|o| o.request.is_write()).count();
        let count = |f: &dyn Fn(&Answer) -> bool| ops.iter().filter(|o| f(&o.answer)).count();
        eprintln!(
            "history: {} ops ({writes} writes: {} applied, {} pending, {} unknown, {} transport, \
             {} refused; {} retries), {} records over {} incarnation(s), {} anomalies",
            ops.len(),
            count(&|a| matches!(a, Answer::Applied { .. })),
            count(&|a| matches!(a, Answer::Pending { .. })),
            count(&|a| matches!(a, Answer::Unknown)),
            count(&|a| matches!(a, Answer::Transport(_))),
            count(&|a| matches!(a, Answer::Refused { .. })),
            ops.iter().filter(|o| o.retry).count(),
            self.log
                .incarnations
                .iter()
                .map(|i| i.records.len())
                .sum::<usize>(),
            self.log.incarnations.len(),
            anomalies.len()
        );
        Ok(anomalies)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = terminate(&mut c);
            }
        }
    }
}

/// Runs one seed: `faults` in the seed's order, one per phase, after a quiet first phase; then
/// the checker. Returns the anomalies.
async fn run_seed(seed: u64, faults: &[Fault]) -> anyhow::Result<Vec<history::Anomaly>> {
    eprintln!("history seed {seed:#x}");
    let size = Size::get();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut faults = faults.to_vec();
    // A seeded shuffle, a recreation kept last (it ends the old stream's log).
    for i in (1..faults.len()).rev() {
        let j = rng.random_range(0..=i);
        faults.swap(i, j);
    }
    faults.sort_by_key(|f| *f == Fault::Recreate);
    let mut c = Cluster::start(seed, size.nodes, size.clients, &[]).await?;
    c.phase(&mut rng, size.ops_per_client, Mode::Mixed, None)
        .await?;
    for f in faults {
        c.phase(&mut rng, size.ops_per_client, Mode::Mixed, Some(f))
            .await?;
    }
    let anomalies = c.check().await?;
    if !anomalies.is_empty() {
        eprintln!(
            "{}",
            history::explain(&anomalies, &c.recorder.ops(), &c.log)
        );
    }
    Ok(anomalies)
}

/// Runs the seeds of `faults`, and fails naming every anomaly of every seed that has any.
async fn every_answer_holds(faults: &[Fault]) -> anyhow::Result<()> {
    let mut failed = Vec::new();
    for seed in seeds(2)? {
        let anomalies = run_seed(seed, faults).await?;
        if !anomalies.is_empty() {
            failed.push(format!(
                "history seed {seed:#x} (replay with FOLDHOST_HISTORY_SEED={seed:#x}): {} \
                 anomalies:\n{}",
                anomalies.len(),
                history::describe(&anomalies)
            ));
        }
    }
    anyhow::ensure!(failed.is_empty(), "{}", failed.join("\n"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_write_answer_holds_under_server_kills_connection_cuts_and_node_restarts_by_the_history_checker()
-> anyhow::Result<()> {
    every_answer_holds(&[
        Fault::KillServer,
        Fault::CutConnections,
        Fault::KillNode(Restart::OwnStore),
        Fault::KillNode(Restart::Empty),
        Fault::KillNode(Restart::PeerArtifact),
    ])
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_write_answer_holds_past_a_short_duplicate_window_a_swept_ledger_and_a_recreated_bucket_by_the_history_checker()
-> anyhow::Result<()> {
    every_answer_holds(&[
        Fault::ShortDuplicateWindow,
        Fault::SweepLedger,
        Fault::CutConnections,
        Fault::Recreate,
    ])
    .await
}

// ---------------------------------------------------------------------------------------------
// The mutations: a host built to break one promise, and the checker catching it.
// ---------------------------------------------------------------------------------------------

/// Fails unless the checker reports an anomaly by `rule` for a host carrying `mutation` (the
/// rule the mutation breaks: an anomaly of another rule would not show the checker sees this
/// one).
fn caught(
    mutation: &str,
    rule: char,
    seed: u64,
    anomalies: &[history::Anomaly],
) -> anyhow::Result<()> {
    anyhow::ensure!(
        anomalies.iter().any(|a| a.rule == rule),
        "history seed {seed:#x}: the host ran with {MUTATION_ENV}={mutation} and the checker \
         found no anomaly of rule ({rule}) (a host without the mutation answers correctly; is \
         it built in?); it found:\n{}",
        history::describe(anomalies)
    );
    eprintln!(
        "{mutation} caught:\n{}",
        history::describe(&anomalies[..anomalies.len().min(5)])
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_history_checker_catches_a_retry_republished() -> anyhow::Result<()> {
    let seed = seeds(1)?[0];
    eprintln!("history seed {seed:#x}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mutation = "republish_retry";
    let mut c = Cluster::start(seed, 2, 3, &[(MUTATION_ENV, mutation.into())]).await?;
    c.short_duplicate_window().await?;
    c.phase(&mut rng, 8, Mode::Writes, None).await?;
    // Past the broker's window only the ledger stands between a retry and a second record (a
    // precondition, not a synchronisation).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    c.phase(&mut rng, 0, Mode::ResendAll, None).await?;
    let anomalies = c.check().await?;
    caught(mutation, 'b', seed, &anomalies)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_history_checker_catches_an_applied_answer_before_the_fold_holds_it()
-> anyhow::Result<()> {
    let seed = seeds(1)?[0];
    eprintln!("history seed {seed:#x}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mutation = "early_applied";
    let tmp = tempfile::tempdir()?;
    let hold = tmp.path().join("hold");
    // The fold holds before the first commit that records a ledger row: a write through it is
    // durable and not applied, and a read right after cannot see it.
    let mut c = Cluster::start(
        seed,
        1,
        2,
        &[
            (MUTATION_ENV, mutation.into()),
            (
                foldhost_core::crashpoint::HOLD_ENV,
                format!(
                    "{}:{}",
                    foldhost_core::crashpoint::FOLD_LEDGER_COMMIT,
                    hold.display()
                ),
            ),
        ],
    )
    .await?;
    let env = Env {
        recorder: c.recorder.clone(),
        targets: c.targets.clone(),
        incarnation: c.incarnation.clone(),
        progress: Arc::new(AtomicUsize::new(0)),
    };
    let mut client = std::mem::take(&mut c.clients)
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no client"))?;
    let op_id = client.mint()?;
    let sent = Sent {
        op_id: op_id.clone(),
        body: serde_json::json!({"key": "k.a", "value": "held", "op_id": op_id, "wait_ms": 300}),
        request: put("k.a", "held", None),
    };
    client.write(&env, sent, false, 0).await?;
    client.read(&env, 0, "k.a", None).await;
    std::fs::write(hold.with_extension("release"), "")?;
    c.clients.push(client);
    c.clients.push(Client::new(1, seed ^ 1));
    c.settle().await?;
    c.phase(&mut rng, 10, Mode::Mixed, None).await?;
    let anomalies = c.check().await?;
    caught(mutation, 'e', seed, &anomalies)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_history_checker_catches_a_ledger_row_of_the_buckets_previous_life()
-> anyhow::Result<()> {
    let seed = seeds(1)?[0];
    eprintln!("history seed {seed:#x}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mutation = "stale_row";
    let mut c = Cluster::start(seed, 2, 3, &[(MUTATION_ENV, mutation.into())]).await?;
    c.phase(&mut rng, 8, Mode::Writes, None).await?;
    c.recreate().await?;
    // Every write of the old life sent again: its row is gone with the old stream.
    c.phase(&mut rng, 0, Mode::ResendAll, None).await?;
    let anomalies = c.check().await?;
    caught(mutation, 'a', seed, &anomalies)
}
