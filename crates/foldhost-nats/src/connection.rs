//! The node's connection to NATS ([`NatsConnection`]) and the ordered consumer's own one
//! ([`DeliveryClient`]).

use super::*;

/// A NATS connection: dial, shut down, health, and bucket handles.
pub struct NatsConnection {
    opts: ConnectOptions,
    client: Mutex<Option<async_nats::Client>>,
    healthy: Arc<AtomicBool>,
    /// How many times the client's connection dropped: a watch delivered through the client's
    /// ordered consumer ends at a drop (see `run_watch`).
    drops: Arc<tokio::sync::watch::Sender<u64>>,
    /// The permission violations the server reported on the connection.
    denials: Arc<tokio::sync::watch::Sender<Denials>>,
}

/// How many of a connection's latest permission violations are kept.
const DENIALS_KEPT: usize = 32;

/// The permission violations a server reported on a connection ([`protocol::permission_violation`]),
/// each numbered in the order they came; the latest [`DENIALS_KEPT`].
#[derive(Clone, Debug, Default)]
pub struct Denials {
    /// Violations so far; the newest's number.
    pub count: u64,
    /// The latest: (number, what was denied, the subject).
    pub recent: std::collections::VecDeque<(u64, protocol::Denied, String)>,
}

impl Denials {
    fn record(&mut self, denied: protocol::Denied, subject: &str) {
        self.count += 1;
        if self.recent.len() == DENIALS_KEPT {
            self.recent.pop_front();
        }
        self.recent
            .push_back((self.count, denied, subject.to_string()));
    }

    /// The first violation numbered after `since` that `pick` accepts.
    pub fn after(
        &self,
        since: u64,
        pick: impl Fn(protocol::Denied, &str) -> bool,
    ) -> Option<(protocol::Denied, String)> {
        self.recent
            .iter()
            .find(|(n, d, s)| *n > since && pick(*d, s))
            .map(|(_, d, s)| (*d, s.clone()))
    }
}

impl NatsConnection {
    /// A connection that has not dialled yet.
    pub fn new(opts: ConnectOptions) -> Self {
        NatsConnection {
            opts,
            client: Mutex::new(None),
            healthy: Arc::new(AtomicBool::new(false)),
            drops: Arc::new(tokio::sync::watch::channel(0).0),
            denials: Arc::new(tokio::sync::watch::channel(Denials::default()).0),
        }
    }

    /// The permission violations the server reports on this connection, as they come.
    pub fn denials(&self) -> tokio::sync::watch::Receiver<Denials> {
        self.denials.subscribe()
    }

    /// Dials and returns the connection (a convenience for `new` + `connect`).
    pub async fn open(opts: ConnectOptions) -> Result<Self, KvError> {
        let c = Self::new(opts);
        c.connect().await?;
        Ok(c)
    }

    /// The connected client.
    pub async fn client(&self) -> Result<async_nats::Client, KvError> {
        self.client
            .lock()
            .await
            .clone()
            .ok_or(KvError::NotConnected)
    }

    /// A client of its own, dialled with this connection's options: for traffic whose stored
    /// messages the client library parses (the guest channels' watch and objects,
    /// docs/channels.md), so a message it cannot read takes down that client only.
    pub async fn dial_another(&self) -> Result<async_nats::Client, KvError> {
        connect_client(
            &self.opts,
            Arc::new(AtomicBool::new(false)),
            Arc::new(tokio::sync::watch::channel(0).0),
            None,
        )
        .await
    }

    /// The limit every NATS call of this connection runs under.
    pub fn op_timeout(&self) -> Duration {
        self.opts.op_timeout
    }

    /// Opens a bucket and returns the concrete handle (the trait method wraps it in a [`BucketHandle`]).
    pub async fn bucket(&self, name: &str, config: &BucketConfig) -> Result<Arc<NatsKv>, KvError> {
        let client = self.client().await?;
        let kv = NatsKv::open(client, name, config, self.opts.op_timeout).await?;
        kv.set_lean_delivery(Some(&self.opts));
        if let Ok(mut d) = kv.drops.lock() {
            *d = Some(self.drops.subscribe());
        }
        *lock(&kv.denials) = Some(self.denials.subscribe());
        Ok(kv)
    }
}

#[async_trait]
impl Connection for NatsConnection {
    async fn connect(&self) -> Result<(), KvError> {
        let mut guard = self.client.lock().await;
        if guard.is_some() {
            return Ok(());
        }
        let client = connect_client(
            &self.opts,
            self.healthy.clone(),
            self.drops.clone(),
            Some(self.denials.clone()),
        )
        .await?;
        self.healthy.store(true, Ordering::Release);
        *guard = Some(client);
        Ok(())
    }

    /// Hands the server what the client still holds, within [`SHUTDOWN_BUDGET`], and only while
    /// connected: a stop must not wait on a server that is gone (the flush waited out the whole
    /// operation timeout, 30 s, on a SIGTERM after the server had stopped).
    async fn shutdown(&self) {
        if let Some(c) = self.client.lock().await.take()
            && c.connection_state() == async_nats::connection::State::Connected
        {
            let budget = self.opts.op_timeout.min(SHUTDOWN_BUDGET);
            // A flush that fails means the socket is already gone; nothing more to do.
            let _ = timed("flush", budget, async {
                c.flush().await.map_err(|e| backend("flush", e))
            })
            .await;
            let _ = tokio::time::timeout(budget, c.drain()).await;
        }
        self.healthy.store(false, Ordering::Release);
    }

    fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    async fn open_bucket(
        &self,
        bucket: &str,
        config: &BucketConfig,
    ) -> Result<BucketHandle, KvError> {
        let kv = self.bucket(bucket, config).await?;
        Ok(BucketHandle::new(bucket, kv.clone(), kv.clone(), kv))
    }

    fn capabilities(&self) -> ConnectionCapabilities {
        let server_version = self
            .client
            .try_lock()
            .ok()
            .and_then(|c| c.as_ref().map(|c| c.server_info().version))
            .unwrap_or_default();
        let (message_ttl, conditional_publish, direct_get) =
            protocol::server_features(&server_version);
        ConnectionCapabilities {
            cas: true,
            streaming_watch: true,
            writes: true,
            server_version,
            message_ttl,
            conditional_publish,
            direct_get,
        }
    }
}

/// A std mutex's guard, poisoned or not (what these mutexes hold is replaced whole).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The key pair of an nkey *user* seed (`SU…`, what a server's `nkey` user signs with); the
/// error never quotes the seed.
pub(crate) fn user_nkey(seed: &str) -> Result<nkeys::KeyPair, &'static str> {
    match nkeys::KeyPair::from_seed(seed.trim()) {
        Ok(k) if k.key_pair_type() == nkeys::KeyPairType::User => Ok(k),
        Ok(_) => Err("the nkey seed is not a user's (SU…)"),
        Err(_) => Err("the nkey seed does not parse (an nkey user seed is SU…, 58 characters)"),
    }
}

/// The public key (`U…`) of an nkey user seed, as a server's `nkey` user names it; the error
/// never quotes the seed.
pub fn nkey_user_public_key(seed: &str) -> Result<String, &'static str> {
    user_nkey(seed).map(|k| k.public_key())
}

/// Dials a client with `opts`: its health kept in `healthy`, each drop (a disconnection or the
/// connection's close) counted in `drops`.
pub(crate) async fn connect_client(
    opts: &ConnectOptions,
    healthy: Arc<AtomicBool>,
    drops: Arc<tokio::sync::watch::Sender<u64>>,
    denials: Option<Arc<tokio::sync::watch::Sender<Denials>>>,
) -> Result<async_nats::Client, KvError> {
    // The client library builds its TLS configuration with the process's default provider, and
    // the build has two (ring through the client, aws-lc-rs through the object store's HTTP
    // client): without one installed, a `tls://` connection panics. Installing an already
    // installed one is a no-op.
    let _ = rustls::crypto::ring::default_provider().install_default();
    // An error names the URL without its userinfo (a password or a token lives there).
    let url = foldhost_core::bucket::redacted_url(&opts.url);
    let err = |reason: String| KvError::Connect {
        url: url.clone(),
        reason,
    };
    let mut o = async_nats::ConnectOptions::new()
        .connection_timeout(opts.op_timeout.min(Duration::from_secs(10)))
        .request_timeout(Some(opts.op_timeout))
        .event_callback(move |ev| {
            let healthy = healthy.clone();
            let drops = drops.clone();
            let denials = denials.clone();
            async move {
                match ev {
                    async_nats::Event::ServerError(async_nats::ServerError::Other(m)) => {
                        if let Some((d, subject)) = protocol::permission_violation(&m) {
                            tracing::debug!(
                                denied = d.as_str(),
                                subject,
                                "the server reported a permission violation"
                            );
                            if let Some(denials) = &denials {
                                denials.send_modify(|l| l.record(d, subject));
                            }
                        }
                    }
                    async_nats::Event::Connected => healthy.store(true, Ordering::Release),
                    async_nats::Event::Disconnected | async_nats::Event::Closed => {
                        drops.send_modify(|n| *n += 1);
                        healthy.store(false, Ordering::Release)
                    }
                    _ => {}
                }
            }
        });
    if let Some(n) = &opts.name {
        o = o.name(n);
    }
    o = authenticated(o, opts).await.map_err(err)?;
    // Every member of the cluster named: the client connects to one and, when that server
    // dies, reconnects to another (the watch then resumes from the applied cursor).
    let servers = foldhost_core::bucket::server_urls(&opts.url);
    if servers.is_empty() {
        return Err(err("no server URL".into()));
    }
    timed("connect", opts.op_timeout, async {
        o.connect(servers).await.map_err(|e| err(e.to_string()))
    })
    .await
}

/// `o` with the credentials ([`credential_source`]) and the TLS options of `opts`; the error
/// never quotes a secret.
async fn authenticated(
    o: async_nats::ConnectOptions,
    opts: &ConnectOptions,
) -> Result<async_nats::ConnectOptions, String> {
    let mut o = match credential_source(opts) {
        CredentialSource::Creds => {
            let creds = opts.creds.as_deref().unwrap_or_default();
            o.credentials(creds).map_err(|e| e.to_string())?
        }
        CredentialSource::CredsFile(p) => o
            .credentials_file(&p)
            .await
            .map_err(|e| format!("{}: {e}", p.display()))?,
        CredentialSource::Nkey => {
            let seed = opts.nkey_seed.as_ref().map(Secret::expose).unwrap_or("");
            // The library only logs a seed it cannot read, then fails as "authentication":
            // checked here so the error says what is wrong (never the seed itself).
            user_nkey(seed)?;
            o.nkey(seed.trim().to_string())
        }
        CredentialSource::UserPassword => match &opts.user_password {
            Some((user, pass)) => o.user_and_password(user.clone(), pass.expose().to_string()),
            None => o,
        },
        CredentialSource::Url => match foldhost_core::bucket::url_credentials(&opts.url) {
            Some((user, Some(pass))) => o.user_and_password(user, pass),
            Some((token, None)) => o.token(token),
            None => o,
        },
        CredentialSource::None => o,
    };
    // TLS options: the one configuration the lean connections use too (`tls.rs`), and TLS
    // required on every server; the handshake before `INFO` when asked.
    if opts.tls.any() {
        if opts.tls.ca_pem.is_some() || opts.tls.client.is_some() {
            let config = crate::tls::client_config(&opts.tls)?;
            o = o.tls_client_config((*config).clone());
        }
        o = o.require_tls(true);
        if opts.tls.first {
            o = o.tls_first();
        }
    }
    Ok(o)
}

/// The connection the client's ordered consumer delivers a watch on: a client of its own, so a
/// stored message the library cannot read takes down this connection only (async-nats 0.51
/// panics its connection task on a CR inside a header value), never the one the node's requests
/// share. Discarded when a watch on it ends by a drop or a library failure; the next watch dials
/// a new one.
pub(crate) struct DeliveryClient {
    pub(crate) stream: jetstream::stream::Stream,
    /// Its drop count.
    pub(crate) drops: tokio::sync::watch::Receiver<u64>,
}
