//! The NATS connection flags of every command that connects ([`NatsArgs`], flattened into `run`
//! and `bootstrap`), named as users of the `nats` CLI expect them, and the one function that turns
//! them into [`ConnectOptions`] ([`NatsArgs::connect_options`]).
//!
//! Invariants:
//! - **No secret on the command line**: a password comes from `NATS_PASSWORD` or
//!   `--password-file`, an nkey seed and a private key from files; none has a flag of its own
//!   (the command line shows in `ps`). Their text never reaches an error, a log line or `Debug`
//!   (this struct's `Debug` shows only paths; `ConnectOptions`' redacts).
//! - **Everything read before anything is touched**: every file is read, and the seed, the
//!   certificates and the key parsed, here; an error is one line naming the flag and the file.
//! - **Flags before the environment**: `--nats` > `NATS_URL` > `FOLDHOST_NATS` (the earlier
//!   name); `--user` > `NATS_USER` (read only when no `--creds-file` or `--nkey` names the
//!   user); `--password-file` > `NATS_PASSWORD`.
//! - **TLS options both or neither, and TLS required**: `--tls-cert` and `--tls-key` come
//!   together; any TLS flag makes every server of the URL TLS (`bucket::TlsOptions::any`).

use super::*;
use foldhost_core::bucket::{ClientCertificate, ConnectOptions, Secret, TlsOptions};

/// The largest file a NATS flag reads (a PEM bundle of roots is the largest expected).
const MAX_FILE: u64 = 4 * 1024 * 1024;

/// How to reach and authenticate to NATS, as the `nats` CLI takes it.
#[derive(Args, Debug, Clone, Default)]
pub struct NatsArgs {
    /// NATS server URL: `nats://` or `tls://`, comma-separated cluster members; may embed
    /// `user:pass@`. Default: the NATS_URL environment variable.
    #[arg(long, value_name = "URL")]
    pub nats: Option<String>,
    /// A `.creds` file (a user JWT and its nkey seed).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["nkey", "user"])]
    pub creds_file: Option<PathBuf>,
    /// A file holding an nkey user seed (`SU…`): the server's nonce is signed with it.
    #[arg(long, value_name = "SEEDFILE", conflicts_with = "user")]
    pub nkey: Option<PathBuf>,
    /// A NATS user (default: NATS_USER); its password from the NATS_PASSWORD environment
    /// variable or --password-file, never the command line.
    #[arg(long)]
    pub user: Option<String>,
    /// A file holding the user's password (a trailing newline is not part of it).
    #[arg(long, value_name = "FILE")]
    pub password_file: Option<PathBuf>,
    /// PEM certificates to trust as the server's roots, instead of the system's.
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// A client certificate (PEM) to present, for a server that verifies clients; with
    /// --tls-key.
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM); with --tls-cert.
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// The TLS handshake before the server's INFO (a server configured `handshake_first`).
    #[arg(long)]
    pub tls_first: bool,
}

impl NatsArgs {
    /// The connection options these flags and the process's environment describe; `None` when
    /// neither names a URL (and no other NATS flag is given).
    pub(crate) fn connect_options(&self) -> anyhow::Result<Option<ConnectOptions>> {
        self.connect_options_with(|k| std::env::var(k).ok())
    }

    /// [`Self::connect_options`], for a command that cannot run without NATS.
    pub(crate) fn required(&self) -> anyhow::Result<ConnectOptions> {
        self.connect_options()?
            .ok_or_else(|| anyhow!("--nats: no NATS URL (give --nats URL or set NATS_URL)"))
    }

    /// The options with the environment read through `env` (the tests pass their own).
    pub(crate) fn connect_options_with(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> anyhow::Result<Option<ConnectOptions>> {
        let Some(url) = self
            .nats
            .clone()
            .or_else(|| env("NATS_URL"))
            .or_else(|| env("FOLDHOST_NATS"))
            .filter(|u| !u.trim().is_empty())
        else {
            if let Some(flag) = self.flag_given() {
                bail!("{flag}: no NATS URL to connect to (give --nats URL or set NATS_URL)");
            }
            return Ok(None);
        };
        let mut o = ConnectOptions::new(url);
        o.creds_file = self.creds_file.clone();
        if let Some(p) = &self.creds_file {
            // Read now so a missing file fails before anything starts; the client reads it
            // again as it dials.
            read_text("--creds-file", p)?;
        }
        if let Some(p) = &self.nkey {
            let seed = read_text("--nkey", p)?;
            let seed = seed.trim();
            foldhost_nats::nkey_user_public_key(seed)
                .map_err(|why| anyhow!("--nkey {}: {why}", p.display()))?;
            o.nkey_seed = Some(Secret::new(seed));
        }
        let named_elsewhere = self.creds_file.is_some() || self.nkey.is_some();
        let user = match &self.user {
            Some(u) => Some(u.clone()),
            None if !named_elsewhere => env("NATS_USER").filter(|u| !u.is_empty()),
            None => None,
        };
        match (user, &self.password_file) {
            (Some(user), Some(p)) => {
                let text = read_text("--password-file", p)?;
                let pass = text.strip_suffix('\n').unwrap_or(&text);
                let pass = pass.strip_suffix('\r').unwrap_or(pass);
                o.user_password = Some((user, Secret::new(pass)));
            }
            (Some(user), None) => {
                let pass = env("NATS_PASSWORD").ok_or_else(|| {
                    anyhow!(
                        "--user {user}: no password (set NATS_PASSWORD or give --password-file FILE)"
                    )
                })?;
                o.user_password = Some((user, Secret::new(pass)));
            }
            (None, Some(p)) => bail!(
                "--password-file {}: no user to go with it (give --user or set NATS_USER)",
                p.display()
            ),
            (None, None) => {}
        }
        o.tls = self.tls_options()?;
        Ok(Some(o))
    }

    /// The TLS options, the files read and checked (the roots, the pair's certificate and key).
    fn tls_options(&self) -> anyhow::Result<TlsOptions> {
        let mut tls = TlsOptions {
            first: self.tls_first,
            ..TlsOptions::default()
        };
        if let Some(p) = &self.tls_ca {
            tls.ca_pem = Some(read_bytes("--tls-ca", p)?);
            foldhost_nats::check_tls(&tls)
                .map_err(|why| anyhow!("--tls-ca {}: {why}", p.display()))?;
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                let cert_pem = read_bytes("--tls-cert", cert)?;
                let key_pem = Secret::new(read_text("--tls-key", key)?);
                tls.client = Some(ClientCertificate { cert_pem, key_pem });
                foldhost_nats::check_tls(&tls).map_err(|why| {
                    anyhow!(
                        "--tls-cert {} / --tls-key {}: {why}",
                        cert.display(),
                        key.display()
                    )
                })?;
            }
            (Some(cert), None) => bail!(
                "--tls-cert {}: a client certificate needs its key (--tls-key FILE)",
                cert.display()
            ),
            (None, Some(key)) => bail!(
                "--tls-key {}: a key needs its client certificate (--tls-cert FILE)",
                key.display()
            ),
            (None, None) => {}
        }
        Ok(tls)
    }

    /// The first NATS flag given besides the URL (they need one).
    fn flag_given(&self) -> Option<&'static str> {
        [
            ("--creds-file", self.creds_file.is_some()),
            ("--nkey", self.nkey.is_some()),
            ("--user", self.user.is_some()),
            ("--password-file", self.password_file.is_some()),
            ("--tls-ca", self.tls_ca.is_some()),
            ("--tls-cert", self.tls_cert.is_some()),
            ("--tls-key", self.tls_key.is_some()),
            ("--tls-first", self.tls_first),
        ]
        .into_iter()
        .find_map(|(flag, given)| given.then_some(flag))
    }
}

/// A flag's file, at most [`MAX_FILE`] bytes; the error names the flag and the file.
fn read_bytes(flag: &str, path: &Path) -> anyhow::Result<Vec<u8>> {
    use std::io::Read as _;
    let named = |e: std::io::Error| anyhow!("{flag} {}: {e}", path.display());
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .map_err(named)?
        .take(MAX_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(named)?;
    if bytes.len() as u64 > MAX_FILE {
        bail!("{flag} {}: larger than {MAX_FILE} bytes", path.display());
    }
    Ok(bytes)
}

/// [`read_bytes`] as UTF-8 text (the error never quotes it).
fn read_text(flag: &str, path: &Path) -> anyhow::Result<String> {
    String::from_utf8(read_bytes(flag, path)?)
        .map_err(|_| anyhow!("{flag} {}: not UTF-8 text", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    fn parse(args: &[&str]) -> NatsArgs {
        #[derive(Parser)]
        struct Wrap {
            #[command(flatten)]
            nats: NatsArgs,
        }
        let mut all = vec!["x"];
        all.extend_from_slice(args);
        Wrap::try_parse_from(all).expect("parses").nats
    }

    #[test]
    fn the_nats_flag_wins_over_nats_url_which_wins_over_the_earlier_name() {
        let env = env_of(&[
            ("NATS_URL", "nats://env:1"),
            ("FOLDHOST_NATS", "nats://old:1"),
        ]);
        let url = |a: &NatsArgs, env: &dyn Fn(&str) -> Option<String>| {
            a.connect_options_with(env).expect("options").map(|o| o.url)
        };
        assert_eq!(
            url(&parse(&["--nats", "nats://flag:1"]), &env),
            Some("nats://flag:1".into())
        );
        assert_eq!(url(&parse(&[]), &env), Some("nats://env:1".into()));
        assert_eq!(
            url(&parse(&[]), &env_of(&[("FOLDHOST_NATS", "nats://old:1")])),
            Some("nats://old:1".into())
        );
        assert_eq!(url(&parse(&[]), &no_env), None);
        let e = parse(&["--tls-first"])
            .connect_options_with(no_env)
            .expect_err("a TLS flag without a URL");
        assert!(e.to_string().starts_with("--tls-first: no NATS URL"), "{e}");
    }

    #[test]
    fn a_client_certificate_and_its_key_come_both_or_neither() {
        let tmp = tempfile::tempdir().expect("tmp");
        let not_pem = tmp.path().join("not.pem");
        std::fs::write(&not_pem, "PRIVATE-TEXT").expect("write");
        let p = not_pem.to_str().expect("utf-8");
        let with = |args: &[&str]| {
            let mut all = vec!["--nats", "tls://h:1"];
            all.extend_from_slice(args);
            parse(&all).connect_options_with(no_env)
        };
        let e = with(&["--tls-key", p]).expect_err("a key alone");
        assert_eq!(
            e.to_string(),
            format!("--tls-key {p}: a key needs its client certificate (--tls-cert FILE)")
        );
        let e = with(&["--tls-cert", p]).expect_err("a certificate alone");
        assert_eq!(
            e.to_string(),
            format!("--tls-cert {p}: a client certificate needs its key (--tls-key FILE)")
        );
        // A file that is missing, or not what the flag wants, is named with its flag, and its
        // text is not quoted.
        let e = with(&["--tls-ca", "/nonexistent/ca.pem"]).expect_err("missing");
        assert!(
            e.to_string().starts_with("--tls-ca /nonexistent/ca.pem: "),
            "{e}"
        );
        let e = with(&["--tls-ca", p]).expect_err("not PEM");
        assert!(e.to_string().starts_with(&format!("--tls-ca {p}: ")), "{e}");
        let e = with(&["--tls-cert", p, "--tls-key", p]).expect_err("not PEM");
        assert!(
            e.to_string()
                .starts_with(&format!("--tls-cert {p} / --tls-key {p}: "))
                && !e.to_string().contains("PRIVATE-TEXT"),
            "{e}"
        );
        let e =
            with(&["--tls-cert", p, "--tls-key", "/nonexistent/key.pem"]).expect_err("missing key");
        assert!(
            e.to_string()
                .starts_with("--tls-key /nonexistent/key.pem: "),
            "{e}"
        );
        // A handshake first asks for nothing but TLS.
        let o = with(&["--tls-first"]).expect("options").expect("a URL");
        assert!(o.tls.first && o.tls.any() && o.tls.client.is_none());
    }

    #[test]
    fn a_user_takes_its_password_from_a_file_or_the_environment_and_never_shows_it() {
        let tmp = tempfile::tempdir().expect("tmp");
        let pw = tmp.path().join("pw");
        std::fs::write(&pw, "from-file\n").expect("write");
        let file = parse(&[
            "--nats",
            "nats://h:1",
            "--user",
            "alice",
            "--password-file",
            pw.to_str().expect("utf-8"),
        ]);
        let o = file
            .connect_options_with(env_of(&[("NATS_PASSWORD", "from-env")]))
            .expect("options")
            .expect("a URL");
        let (user, pass) = o.user_password.clone().expect("a user");
        assert_eq!((user.as_str(), pass.expose()), ("alice", "from-file"));
        let shown = format!("{o:?} {file:?}");
        assert!(
            !shown.contains("from-file") && !shown.contains("from-env"),
            "{shown}"
        );
        // From the environment: the user too.
        let o = parse(&["--nats", "nats://h:1"])
            .connect_options_with(env_of(&[
                ("NATS_USER", "bob"),
                ("NATS_PASSWORD", "from-env"),
            ]))
            .expect("options")
            .expect("a URL");
        let (user, pass) = o.user_password.expect("a user");
        assert_eq!((user.as_str(), pass.expose()), ("bob", "from-env"));
        // A user without a password, a password file without a user: refused, one line.
        let e = parse(&["--nats", "nats://h:1", "--user", "carol"])
            .connect_options_with(no_env)
            .expect_err("no password");
        assert!(e.to_string().contains("NATS_PASSWORD"), "{e}");
        let e = NatsArgs {
            password_file: Some(pw),
            ..parse(&["--nats", "nats://h:1"])
        }
        .connect_options_with(no_env)
        .expect_err("no user");
        assert!(e.to_string().starts_with("--password-file "), "{e}");
        // No password flag exists at all.
        #[derive(Parser, Debug)]
        struct Wrap {
            #[command(flatten)]
            _nats: NatsArgs,
        }
        assert!(Wrap::try_parse_from(["x", "--password", "p"]).is_err());
    }

    /// The example user seed of the nats client libraries' documentation (no server trusts it).
    const DOC_SEED: &str = "SUANQDPB2RUOE4ETUA26CNX7FUKE5ZZKFCQIIW63OX225F2CO7UEXTM7ZY";

    #[test]
    fn an_nkey_seed_file_must_hold_a_user_seed_and_is_named_when_it_does_not() {
        let tmp = tempfile::tempdir().expect("tmp");
        let seed_file = tmp.path().join("user.nk");
        std::fs::write(&seed_file, format!("{DOC_SEED}\n")).expect("write");
        let args = parse(&[
            "--nats",
            "nats://h:1",
            "--nkey",
            seed_file.to_str().expect("utf-8"),
        ]);
        let o = args
            .connect_options_with(env_of(&[("NATS_USER", "ignored")]))
            .expect("options")
            .expect("a URL");
        assert_eq!(o.nkey_seed.as_ref().map(Secret::expose), Some(DOC_SEED));
        assert!(
            o.user_password.is_none(),
            "NATS_USER does not join an nkey user"
        );
        assert!(!format!("{o:?}").contains(DOC_SEED));
        std::fs::write(&seed_file, "SUNOTASEED\n").expect("write");
        let e = args.connect_options_with(no_env).expect_err("a bad seed");
        assert!(
            e.to_string()
                .starts_with(&format!("--nkey {}: ", seed_file.display()))
                && !e.to_string().contains("SUNOTASEED"),
            "{e}"
        );
        // A seed, a creds file and a user are one identity: clap refuses two.
        #[derive(Parser, Debug)]
        struct Wrap {
            #[command(flatten)]
            _nats: NatsArgs,
        }
        assert!(Wrap::try_parse_from(["x", "--nkey", "a", "--user", "u"]).is_err());
        assert!(Wrap::try_parse_from(["x", "--nkey", "a", "--creds-file", "c"]).is_err());
    }
}
