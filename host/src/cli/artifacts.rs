//! `foldhost export`, `import`, `publish`, `bootstrap` and `prune`: artifacts on disk and in object storage.

use super::*;

/// `foldhost export`.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// The store to export (no host may be running on it; use --listen for a running one).
    #[arg(long, conflicts_with = "listen", required_unless_present = "listen")]
    pub store: Option<PathBuf>,
    /// A running host's `--listen` address: it exports between batches, exactly at its cursor.
    #[arg(long)]
    pub listen: Option<String>,
    /// Where the artifact goes (must not exist): a directory, or a file ending `.tar`.
    #[arg(long)]
    pub out: PathBuf,
    /// The host's admin token, with --listen (default: read from the file the host names in its
    /// `/status`).
    #[arg(long, env = "FOLDHOST_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Read the admin token from this file (with --listen).
    #[arg(long, value_name = "FILE", conflicts_with = "admin_token")]
    pub admin_token_file: Option<PathBuf>,
}

/// `foldhost import`.
#[derive(Args, Debug)]
pub struct ImportArgs {
    /// The artifact: a directory with MANIFEST.json, or a `.tar` of one.
    #[arg(long)]
    pub artifact: PathBuf,
    /// The store to create (must not exist, or be an empty directory).
    #[arg(long)]
    pub store: PathBuf,
    /// The backend the store must have (refused before anything is written when the artifact
    /// holds another).
    #[arg(long)]
    pub backend: Option<Backend>,
}

/// Where a fleet's artifacts live (`publish`, `bootstrap`, `prune`, `run`).
#[derive(Args, Debug, Clone)]
pub struct ArtifactsArgs {
    /// The object store and prefix: `s3://bucket/prefix`, `gs://…`, `az://…`, `file:///dir`.
    /// Credentials and endpoints come from the environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`).
    #[arg(long, value_name = "URL")]
    pub artifacts: String,
    /// The artifact key (one per bucket and scope): letters, digits, `.`, `-`, `_`.
    #[arg(long, value_name = "KEY", value_parser = parse_artifact_key)]
    pub artifact_key: String,
    /// Development only: publish on a store that cannot replace the pointer atomically (the
    /// local file system); every publish says so in the log.
    #[arg(long)]
    pub allow_non_atomic_pointer: bool,
}

pub(super) fn parse_artifact_key(k: &str) -> Result<String, String> {
    if foldhost_artifact::transport::key_allowed(k) {
        Ok(k.to_string())
    } else {
        Err(format!(
            "{k:?}: use letters, digits, '.', '-' and '_', not starting with '.'"
        ))
    }
}

impl ArtifactsArgs {
    fn transport(&self) -> anyhow::Result<foldhost_artifact::transport::ArtifactTransport> {
        Ok(foldhost_artifact::transport::ArtifactTransport::from_url(
            &self.artifacts,
            self.allow_non_atomic_pointer,
        )?)
    }
}

/// `foldhost publish`.
#[derive(Args, Debug)]
pub struct PublishArgs {
    /// The artifact directory (as `foldhost export` writes it).
    #[arg(long)]
    pub artifact: PathBuf,
    /// Where to publish.
    #[command(flatten)]
    pub to: ArtifactsArgs,
}

/// `foldhost bootstrap`.
#[derive(Args, Debug)]
pub struct BootstrapArgs {
    /// Where the artifact is published.
    #[command(flatten)]
    pub from: ArtifactsArgs,
    /// The store to create (must not exist, or be an empty directory).
    #[arg(long)]
    pub store: PathBuf,
    /// The backend the store must have.
    #[arg(long)]
    pub backend: Option<Backend>,
    /// The bucket the store will fold: its stream is read first (through --nats or NATS_URL) and
    /// an artifact of another stream (an earlier incarnation of a recreated bucket) is refused
    /// before the download.
    #[arg(long)]
    pub bucket: Option<String>,
    /// The NATS connection the bucket's stream is read through (with --bucket).
    #[command(flatten)]
    pub nats: super::NatsArgs,
}

/// `foldhost prune`.
#[derive(Args, Debug)]
pub struct PruneArgs {
    /// Where the payloads are.
    #[command(flatten)]
    pub at: ArtifactsArgs,
    /// Keep every payload uploaded, or replaced as the pointer's target, less than this many
    /// seconds ago (a node may still be downloading one a newer pointer has just replaced).
    #[arg(long, default_value_t = 4 * 60)]
    pub grace_secs: u64,
}

/// A byte-progress display for long copies and hashes: a bar on a terminal, nothing otherwise.
pub(super) fn byte_progress(what: &'static str) -> impl FnMut(u64, u64) {
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new(0);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b.set_message(what);
        b
    });
    move |done, total| {
        if let Some(b) = &bar {
            b.set_length(total);
            b.set_position(done);
            if done >= total {
                b.finish_and_clear();
            }
        }
    }
}

pub(super) async fn cmd_export(a: ExportArgs) -> anyhow::Result<()> {
    let manifest = match (&a.listen, &a.store) {
        (Some(addr), _) => {
            let path = a.out.to_string_lossy().into_owned();
            let token =
                admin_token_for(addr, a.admin_token.clone(), a.admin_token_file.as_deref()).await?;
            let (code, body) = crate::serve::call_with_token(
                addr,
                "POST",
                "/export",
                path.as_bytes(),
                token.as_deref(),
            )
            .await
            .with_context(|| format!("export via {addr}"))?;
            let text = String::from_utf8_lossy(&body).trim_end().to_string();
            if code != 200 {
                bail!("export to {}: {text}", a.out.display());
            }
            text
        }
        (None, Some(dir)) => {
            let dir = dir.clone();
            let out = a.out.clone();
            let m = tokio::task::spawn_blocking(move || {
                // Opened for writing: its lock proves no host is running on it, and the copy is
                // taken from a writer's view (RocksDB cannot checkpoint a read-only instance).
                let backend = storedir::backend_of(&dir)?;
                let (store, _) = AnyStore::open(&dir, backend).with_context(|| {
                    format!(
                        "open {} (is a host running on it? export with --listen)",
                        dir.display()
                    )
                })?;
                // Every state bucket's fold under it too, declared or kept (each opened for
                // writing, for the same reasons).
                let lanes = open_state_folds(&dir, backend)?;
                let sources: Vec<foldhost_artifact::artifact::StateFoldSource> = lanes
                    .iter()
                    .map(
                        |(local, store)| foldhost_artifact::artifact::StateFoldSource {
                            local: local.clone(),
                            store: store.downgrade(),
                        },
                    )
                    .collect();
                let mut progress = byte_progress("hashing");
                foldhost_artifact::artifact::export_store(
                    &store,
                    backend,
                    &sources,
                    &out,
                    None,
                    &mut progress,
                )
                .with_context(|| format!("export to {}", out.display()))
            })
            .await
            .context("export task")??;
            serde_json::to_string(&m)?
        }
        (None, None) => bail!("export needs --store or --listen"),
    };
    println!("{manifest}");
    Ok(())
}

/// The state buckets' folds under the store `dir` (`state/<local>/`), each opened for writing
/// with `backend`; a directory that is not a state bucket's name is refused.
fn open_state_folds(
    dir: &Path,
    backend: storedir::Backend,
) -> anyhow::Result<Vec<(String, foldhost_core::view::SharedStore<AnyStore>)>> {
    let root = dir.join(storedir::STATE_DIR);
    let mut out = Vec::new();
    for local in crate::node::lanes::undeclared(dir, std::iter::empty()) {
        if !foldhost_core::protocol::is_state_local(&local) {
            bail!(
                "{}: {local:?} is not a state bucket's directory (remove it, or move it out of the store)",
                root.display()
            );
        }
        let path = root.join(&local);
        let (store, _) = AnyStore::open(&path, backend)
            .with_context(|| format!("open state bucket {local:?} at {}", path.display()))?;
        out.push((local, foldhost_core::view::SharedStore::new(store)));
    }
    Ok(out)
}

pub(super) async fn cmd_import(a: ImportArgs) -> anyhow::Result<()> {
    let m = tokio::task::spawn_blocking(move || {
        let mut progress = byte_progress("verifying");
        foldhost_artifact::artifact::import_artifact(
            &a.artifact,
            &a.store,
            a.backend,
            &mut progress,
        )
        .with_context(|| format!("import {} into {}", a.artifact.display(), a.store.display()))
    })
    .await
    .context("import task")??;
    println!("{}", serde_json::to_string(&m)?);
    Ok(())
}

pub(super) async fn cmd_publish(a: PublishArgs) -> anyhow::Result<()> {
    let t = a.to.transport()?;
    let scratch = a
        .artifact
        .parent()
        .unwrap_or_else(|| Path::new("."))
        .join(".foldhost-publish");
    let published = t.upload(&a.to.artifact_key, &a.artifact, &scratch).await;
    let _ = std::fs::remove_dir_all(&scratch);
    let p = published?;
    println!(
        "{}",
        serde_json::json!({"cursor": p.cursor, "payload": p.payload, "segments": p.segments})
    );
    Ok(())
}

pub(super) async fn cmd_bootstrap(a: BootstrapArgs) -> anyhow::Result<()> {
    // The NATS flags are read (every file, every check) before anything is fetched or made.
    let nats = match &a.bucket {
        Some(_) => Some(a.nats.connect_options()?.ok_or_else(|| {
            anyhow!(
                "--bucket: no NATS URL to read its stream through (give --nats URL or set NATS_URL)"
            )
        })?),
        None if a.nats.nats.is_some() => {
            bail!("--nats: a bootstrap reads a bucket's stream: give --bucket too")
        }
        None => None,
    };
    let t = a.from.transport()?;
    let live = match (nats, &a.bucket) {
        (Some(opts), Some(bucket)) => live_stream(opts, bucket).await?,
        _ => None,
    };
    let m = t
        .bootstrap_into(&a.from.artifact_key, &a.store, a.backend, live.as_ref())
        .await
        .with_context(|| format!("bootstrap {}", a.store.display()))?;
    println!("{}", serde_json::to_string(&m)?);
    Ok(())
}

/// The stream of `bucket` now, as a bootstrap checks an artifact against it.
pub(super) async fn live_stream(
    opts: foldhost_core::bucket::ConnectOptions,
    bucket: &str,
) -> anyhow::Result<Option<foldhost_artifact::artifact::ManifestStream>> {
    use foldhost_core::bucket::Connection as _;
    use foldhost_core::kv::KvWatcher as _;
    let conn = foldhost_nats::NatsConnection::open(opts).await?;
    let kv = conn
        .bucket(
            bucket,
            &foldhost_core::bucket::BucketConfig {
                create: false,
                ..foldhost_core::bucket::BucketConfig::default()
            },
        )
        .await?;
    let state = kv
        .stream_state()
        .await
        .with_context(|| format!("bucket {bucket}: its stream"))?;
    conn.shutdown().await;
    Ok(state.map(|s| foldhost_artifact::artifact::ManifestStream::from(&s.identity)))
}

pub(super) async fn cmd_prune(a: PruneArgs) -> anyhow::Result<()> {
    let t = a.at.transport()?;
    let n = t
        .prune(
            &a.at.artifact_key,
            Duration::from_secs(a.grace_secs),
            foldhost_artifact::transport::clock::Now::system(),
        )
        .await?;
    println!("{}", serde_json::json!({"pruned": n}));
    Ok(())
}
