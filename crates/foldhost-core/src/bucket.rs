//! Connections and buckets (the NATS side; the local fold is the *store*): [`Connection`] manages a
//! socket's lifecycle and vends [`BucketHandle`]s; a `BucketHandle` is a named bucket that vends
//! narrowed capabilities (reader, watcher, writer).
//!
//! Invariants:
//! - Credentials are chosen by one pure function, [`credential_source`]: `creds` (inline) >
//!   `creds_file` > an nkey seed > a user and password > a URL with embedded user info > none.
//!   Both delivery paths (the client library's and the lean connection) authenticate from it.
//! - No secret is printed: a password, an nkey seed, a private key and inline `.creds` are
//!   [`Secret`]s or redacted by [`ConnectOptions`]' own `Debug` (a URL's password included), so
//!   no log line, status or `{:?}` of a configuration shows one.
//! - TLS options ([`TlsOptions`]) are the files' contents, read once by whoever builds the
//!   options (the CLI names the file in its error): a connection never reads them again, and any
//!   of them makes TLS required, on every server of the URL.
//! - Bucket configuration applies only at creation: an existing bucket is returned as it is.
//! - `is_healthy` is an atomic load, never a network call.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::kv::{KvError, KvReader, KvWatcher, KvWriter};

/// A secret's text (a password, an nkey seed, a private key): its `Debug` prints `<redacted>`,
/// and it has no `Display`, so it reaches no log by accident; [`Secret::expose`] hands it to the
/// one place that sends or parses it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps `text`.
    pub fn new(text: impl Into<String>) -> Self {
        Secret(text.into())
    }

    /// The text, for the code that sends or parses it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// TLS beyond what a `tls://` URL asks: the roots to trust, a client certificate, the handshake
/// before the server's `INFO`. Any of them makes TLS required ([`TlsOptions::any`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsOptions {
    /// PEM certificates to trust as roots instead of the system's (the content of `--tls-ca`).
    pub ca_pem: Option<Vec<u8>>,
    /// A client certificate chain (PEM) and its private key (PEM): presented to a server that
    /// verifies clients.
    pub client: Option<ClientCertificate>,
    /// The TLS handshake first, before the server's `INFO` (a server configured
    /// `handshake_first`).
    pub first: bool,
}

impl TlsOptions {
    /// Whether any option is set: the connection then requires TLS.
    pub fn any(&self) -> bool {
        self.ca_pem.is_some() || self.client.is_some() || self.first
    }
}

/// A client certificate and its key, as PEM text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientCertificate {
    /// The certificate chain, PEM.
    pub cert_pem: Vec<u8>,
    /// The private key, PEM.
    pub key_pem: Secret,
}

/// How to reach and authenticate to a server.
#[derive(Clone)]
pub struct ConnectOptions {
    /// `nats://host:port` or `tls://…`, or several separated by commas (the members of a cluster,
    /// as the nats tools take them: the client connects to one and reconnects to another when it
    /// dies); may embed `user:pass@`.
    pub url: String,
    /// The content of a `.creds` file (for containers without a file mount).
    pub creds: Option<String>,
    /// A path to a `.creds` file.
    pub creds_file: Option<PathBuf>,
    /// An nkey user seed (`SU…`): the server's nonce is signed with it.
    pub nkey_seed: Option<Secret>,
    /// A user and its password.
    pub user_password: Option<(String, Secret)>,
    /// TLS: the roots, a client certificate, the handshake first.
    pub tls: TlsOptions,
    /// A client name shown by the server's monitoring.
    pub name: Option<String>,
    /// The limit on every NATS call (default 30 s): a half-dead TCP connection otherwise parks an
    /// await forever, because the client does not fail in-flight requests when the socket dies.
    pub op_timeout: Duration,
    /// The idle heartbeat asked of every consumer delivered over a lean connection (default
    /// 5 s): a delivery silent for three of them ends its watch, which then resumes from the
    /// cursor. Shorter notices a deleted consumer or a dead route sooner, at the cost of a
    /// heartbeat message per period on an idle bucket.
    pub watch_heartbeat: Duration,
}

impl std::fmt::Debug for ConnectOptions {
    /// Every secret redacted: inline `.creds`, a URL's password, the seed, the password, the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectOptions")
            .field("url", &redacted_url(&self.url))
            .field("creds", &self.creds.as_ref().map(|_| "<redacted>"))
            .field("creds_file", &self.creds_file)
            .field("nkey_seed", &self.nkey_seed)
            .field("user_password", &self.user_password)
            .field("tls", &self.tls)
            .field("name", &self.name)
            .field("op_timeout", &self.op_timeout)
            .field("watch_heartbeat", &self.watch_heartbeat)
            .finish()
    }
}

impl ConnectOptions {
    /// Options for `url` with the defaults.
    pub fn new(url: impl Into<String>) -> Self {
        ConnectOptions {
            url: url.into(),
            creds: None,
            creds_file: None,
            nkey_seed: None,
            user_password: None,
            tls: TlsOptions::default(),
            name: Some("foldhost".into()),
            op_timeout: DEFAULT_OP_TIMEOUT,
            watch_heartbeat: DEFAULT_WATCH_HEARTBEAT,
        }
    }
}

/// A `--nats` value as it may be shown: each URL's userinfo replaced by `<redacted>@` (a
/// password or a token lives there).
pub fn redacted_url(urls: &str) -> String {
    urls.split(',')
        .map(|u| {
            let start = u
                .find("://")
                .map_or_else(|| u.len() - u.trim_start().len(), |i| i + 3);
            let end = u[start..].find('/').map_or(u.len(), |i| start + i);
            match u[start..end].rfind('@') {
                Some(at) => format!("{}<redacted>{}", &u[..start], &u[start + at..]),
                None => u.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The default idle heartbeat of a watch's consumer ([`ConnectOptions::watch_heartbeat`]).
pub const DEFAULT_WATCH_HEARTBEAT: Duration = Duration::from_secs(5);

/// The default limit on one NATS call.
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(30);

/// Which credentials a connection uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CredentialSource {
    /// Inline `.creds` content.
    Creds,
    /// A `.creds` file.
    CredsFile(PathBuf),
    /// An nkey seed signs the nonce.
    Nkey,
    /// A user and password given apart from the URL.
    UserPassword,
    /// User info embedded in the URL.
    Url,
    /// No authentication.
    None,
}

/// The credential priority: creds > creds_file > nkey seed > user and password > URL-embedded >
/// none.
pub fn credential_source(opts: &ConnectOptions) -> CredentialSource {
    if opts.creds.is_some() {
        CredentialSource::Creds
    } else if let Some(p) = &opts.creds_file {
        CredentialSource::CredsFile(p.clone())
    } else if opts.nkey_seed.is_some() {
        CredentialSource::Nkey
    } else if opts.user_password.is_some() {
        CredentialSource::UserPassword
    } else if url_has_userinfo(&opts.url) {
        CredentialSource::Url
    } else {
        CredentialSource::None
    }
}

/// The server URLs of a `--nats` value: comma-separated, trimmed, empty ones dropped.
pub fn server_urls(url: &str) -> Vec<&str> {
    url.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

/// The credentials embedded in a `--nats` value's first URL that carries any, percent-decoded:
/// `(user, Some(password))` for `user:pass@`, `(token, None)` for a bare `token@`. The nats client
/// does not read them from the URL itself (async-nats 0.51 parses but never sends them), so the
/// connection passes them explicitly; without this a URL-authenticated server refuses the node.
pub fn url_credentials(urls: &str) -> Option<(String, Option<String>)> {
    server_urls(urls).into_iter().find_map(|u| {
        let with_scheme = if u.contains("://") {
            u.to_string()
        } else {
            format!("nats://{u}")
        };
        let parsed = url::Url::parse(&with_scheme).ok()?;
        if parsed.username().is_empty() {
            return None;
        }
        Some((
            percent_decode(parsed.username()),
            parsed.password().map(percent_decode),
        ))
    })
}

/// Decodes the `%XX` escapes a URL's userinfo keeps; a malformed escape or a result that is not
/// UTF-8 leaves the text as written.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (b[i], hex) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_string())
}

fn url_has_userinfo(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    authority.contains('@')
}

/// Where a bucket's messages live on the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum StorageType {
    /// On disk (the default).
    #[default]
    File,
    /// In memory.
    Memory,
}

/// Bucket configuration, applied only when the bucket is created.
#[derive(Clone, Debug)]
pub struct BucketConfig {
    /// Total size cap. Default 10 MiB (Synadia Cloud requires one); `None` for unlimited.
    pub max_bytes: Option<i64>,
    /// Values kept per key. Default 1.
    pub max_history: i64,
    /// Replicas. Default 1; use 3 for production clusters.
    pub num_replicas: usize,
    /// Age limit. Default none. An age limit evicts current values: expired consumers then need an
    /// artifact restore.
    pub max_age: Option<Duration>,
    /// Storage type. Default file.
    pub storage: StorageType,
    /// Create the bucket when it does not exist (otherwise `BucketNotFound`). Default true.
    pub create: bool,
}

impl Default for BucketConfig {
    fn default() -> Self {
        BucketConfig {
            max_bytes: Some(10 * 1024 * 1024),
            max_history: 1,
            num_replicas: 1,
            max_age: None,
            storage: StorageType::File,
            create: true,
        }
    }
}

/// Advisory feature flags for callers that branch on what a backend supports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectionCapabilities {
    /// Compare-and-set writes.
    pub cas: bool,
    /// Push-based watches.
    pub streaming_watch: bool,
    /// Writes at all.
    pub writes: bool,
    /// The server's version, as it announced it (empty before a connection).
    pub server_version: String,
    /// Messages may carry their own TTL, with server delete markers (NATS 2.11+).
    pub message_ttl: bool,
    /// Publishes conditional on a subject's last sequence (`Nats-Expected-Last-Subject-Sequence`).
    pub conditional_publish: bool,
    /// Direct gets (reads served by any replica).
    pub direct_get: bool,
}

/// A named bucket: vends the three capabilities. Holds no socket of its own.
#[derive(Clone)]
pub struct BucketHandle {
    /// The bucket name.
    pub name: String,
    reader: Arc<dyn KvReader>,
    watcher: Arc<dyn KvWatcher>,
    writer: Arc<dyn KvWriter>,
}

impl BucketHandle {
    /// Bundles a backend's capabilities.
    pub fn new(
        name: impl Into<String>,
        reader: Arc<dyn KvReader>,
        watcher: Arc<dyn KvWatcher>,
        writer: Arc<dyn KvWriter>,
    ) -> Self {
        BucketHandle {
            name: name.into(),
            reader,
            watcher,
            writer,
        }
    }

    /// Point-in-time reads.
    pub fn reader(&self) -> Arc<dyn KvReader> {
        self.reader.clone()
    }

    /// Live watches.
    pub fn watcher(&self) -> Arc<dyn KvWatcher> {
        self.watcher.clone()
    }

    /// Writes.
    pub fn writer(&self) -> Arc<dyn KvWriter> {
        self.writer.clone()
    }
}

/// A socket lifecycle manager and bucket factory.
#[async_trait]
pub trait Connection: Send + Sync {
    /// Dials (idempotent while connected).
    async fn connect(&self) -> Result<(), KvError>;
    /// Closes the socket; `connect` may be called again.
    async fn shutdown(&self);
    /// Whether the socket is up (an atomic load).
    fn is_healthy(&self) -> bool;
    /// Opens (or, per `config.create`, creates) a bucket.
    async fn open_bucket(
        &self,
        bucket: &str,
        config: &BucketConfig,
    ) -> Result<BucketHandle, KvError>;
    /// What this backend supports.
    fn capabilities(&self) -> ConnectionCapabilities;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nats_value_names_every_member_of_a_cluster() {
        assert_eq!(server_urls("nats://a:4222"), ["nats://a:4222"]);
        assert_eq!(
            server_urls("nats://a:4222, nats://b:4222,,nats://c:4222 "),
            ["nats://a:4222", "nats://b:4222", "nats://c:4222"]
        );
        assert!(server_urls(" , ").is_empty());
    }

    #[test]
    fn url_credentials_are_read_from_the_first_url_that_has_them_and_decoded() {
        assert_eq!(
            url_credentials("nats://a:4222, nats://u%40x:p%3Aw@b:4222"),
            Some(("u@x".into(), Some("p:w".into())))
        );
        assert_eq!(
            url_credentials("tls://s3cr3t@host:4222"),
            Some(("s3cr3t".into(), None))
        );
        assert_eq!(url_credentials("nats://host:4222,nats://h2"), None);
        assert_eq!(
            url_credentials("user:pw@host:4222").map(|c| c.0),
            Some("user".into())
        );
        assert_eq!(percent_decode("a%zzb%4"), "a%zzb%4");
    }

    #[test]
    fn credentials_priority_is_creds_then_file_then_nkey_then_user_then_url_then_none() {
        let mut o = ConnectOptions::new("nats://u:p@127.0.0.1:4222");
        o.creds = Some("---".into());
        o.creds_file = Some("/x.creds".into());
        o.nkey_seed = Some(Secret::new("SU"));
        o.user_password = Some(("a".into(), Secret::new("b")));
        assert_eq!(credential_source(&o), CredentialSource::Creds);
        o.creds = None;
        assert_eq!(
            credential_source(&o),
            CredentialSource::CredsFile("/x.creds".into())
        );
        o.creds_file = None;
        assert_eq!(credential_source(&o), CredentialSource::Nkey);
        o.nkey_seed = None;
        assert_eq!(credential_source(&o), CredentialSource::UserPassword);
        o.user_password = None;
        assert_eq!(credential_source(&o), CredentialSource::Url);
        o.url = "nats://127.0.0.1:4222/a@b".into();
        assert_eq!(credential_source(&o), CredentialSource::None);
    }

    #[test]
    fn no_secret_of_the_options_shows_in_their_debug_output() {
        let mut o = ConnectOptions::new("nats://a:4222,tls://usr:pw-in-url@b:4222/x,tok-en@c");
        o.creds = Some("creds-seed-text".into());
        o.nkey_seed = Some(Secret::new("SUSEEDTEXT"));
        o.user_password = Some(("alice".into(), Secret::new("hunter2")));
        o.tls.client = Some(ClientCertificate {
            cert_pem: b"CERT".to_vec(),
            key_pem: Secret::new("PRIVATE-KEY-TEXT"),
        });
        let shown = format!("{o:?}");
        for secret in [
            "pw-in-url",
            "tok-en",
            "creds-seed-text",
            "SUSEEDTEXT",
            "hunter2",
            "PRIVATE-KEY-TEXT",
        ] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("alice") && shown.contains("tls://<redacted>@b:4222/x"));
        assert_eq!(
            redacted_url("nats://a:4222, u:p@h"),
            "nats://a:4222, <redacted>@h"
        );
    }

    #[test]
    fn any_tls_option_makes_tls_required() {
        let mut t = TlsOptions::default();
        assert!(!t.any());
        t.first = true;
        assert!(t.any());
        let t = TlsOptions {
            ca_pem: Some(Vec::new()),
            ..TlsOptions::default()
        };
        assert!(t.any());
    }
}
