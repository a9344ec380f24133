//! `foldhost swap`: a new guest into a running node (or a shadow beside it first), with the admin token the rules allow.

use super::*;

/// `foldhost swap`.
#[derive(Args, Debug)]
pub struct SwapArgs {
    /// The running host's `--listen` address.
    #[arg(long)]
    pub listen: String,
    /// The new guest component.
    #[arg(long)]
    pub guest: PathBuf,
    /// The host's admin token (default: read from the file the host names in its `/status`).
    #[arg(long, env = "FOLDHOST_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Read the admin token from this file.
    #[arg(long, value_name = "FILE", conflicts_with = "admin_token")]
    pub admin_token_file: Option<PathBuf>,
    /// Shadow first: hydrate the new guest beside the running one, feed it the fold's next N
    /// batches too, then send the same requests to both and list what they answer differently.
    /// The running guest stays unless `--promote` is given and nothing differed. Exits 0 when the
    /// new guest answered every request as the running one (and was promoted, if asked), 3 when it
    /// answered any differently, 4 when `--promote` was asked and refused for another reason (too
    /// few batches, …), 1 when the shadow itself failed.
    #[arg(long, value_name = "N")]
    pub shadow: Option<u64>,
    /// With `--shadow`: ask this many keys in scope (those the batches changed first), each as the
    /// key without its scope prefix.
    #[arg(long, value_name = "K", default_value_t = 100, requires = "shadow")]
    pub sample: usize,
    /// With `--shadow`: send these requests instead of a sample, one per line.
    #[arg(long, value_name = "FILE", requires = "shadow")]
    pub requests: Option<PathBuf>,
    /// With `--shadow`: swap to the new guest when it answered every request as the running one.
    #[arg(long, requires = "shadow")]
    pub promote: bool,
    /// With `--shadow`: the longest wait for the N batches, in seconds (an idle bucket may never
    /// commit them; the comparison then runs on what came).
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 60,
        requires = "shadow"
    )]
    pub shadow_wait: u64,
}

/// The admin token for the host at `listen`: given, read from `file`, or read from the file the
/// host names in its `/status` (`admin_token_file`: readable only by the host's user, so only a
/// local caller with the same rights finds it; and only a file the host generated is followed,
/// see [`crate::serve::read_generated_token`]). `None` when none of these has one.
pub(super) async fn admin_token_for(
    listen: &str,
    token: Option<String>,
    file: Option<&Path>,
) -> anyhow::Result<Option<String>> {
    token_for(listen, token, file, "admin_token_file", "--admin-token").await
}

/// The token for the host at `listen` that its `/status` names the file of in `field`
/// (`admin_token_file`, `write_token_file`): given, read from `file`, or followed as
/// [`admin_token_for`] says. `flag` names the option that gives it, for the refusal.
pub(super) async fn token_for(
    listen: &str,
    token: Option<String>,
    file: Option<&Path>,
    field: &str,
    flag: &str,
) -> anyhow::Result<Option<String>> {
    if token.is_some() {
        return Ok(token);
    }
    if let Some(f) = file {
        return Ok(Some(crate::serve::read_token_file(f)?));
    }
    let Ok((200, body)) = crate::serve::call(listen, "GET", "/status", b"").await else {
        return Ok(None);
    };
    let named = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v[field].as_str().map(PathBuf::from));
    let Some(file) = named else {
        return Ok(None);
    };
    // Whatever answers at `listen` names the file: only a host whose own store says it listens
    // there (its `status.json`, beside the generated token file, written by that host) is given
    // the token, and only over loopback.
    let store_status = file.parent().and_then(storedir::read_status);
    if let Err(why) = token_file_followable(listen, &file, store_status.as_ref()) {
        bail!(
            "{listen}: not sending the {} token of {}: {why}; pass {flag}-file (or set its environment variable)",
            field.trim_end_matches("_token_file"),
            file.display()
        );
    }
    Ok(crate::serve::read_generated_token(&file).ok())
}

/// Whether the CLI may send the token in `file`, which the listener at `listen` named in its
/// `/status`, to that listener: only when `listen` is a loopback address and the store the file
/// belongs to (its directory) has a `status.json` of a running host that listens at that same
/// address and names that same file. A listener squatting a port cannot make another store's
/// status say it listens there. Pure.
pub(super) fn token_file_followable(
    listen: &str,
    file: &Path,
    store_status: Option<&StatusReport>,
) -> Result<(), String> {
    let addr: std::net::SocketAddr = crate::serve::split_listen(listen)
        .0
        .parse()
        .map_err(|_| "the address is not a literal IP address and port".to_string())?;
    if !addr.ip().is_loopback() {
        return Err("the listener is not on a loopback address".into());
    }
    let Some(status) = store_status else {
        return Err("its store has no readable status.json".into());
    };
    let listens = status
        .listen
        .as_deref()
        .and_then(|l| l.parse::<std::net::SocketAddr>().ok());
    if listens != Some(addr) {
        return Err(format!(
            "its store's status.json says its host listens at {}",
            status.listen.as_deref().unwrap_or("no address")
        ));
    }
    let names_file = status.admin_token_file.as_deref().map(Path::new) == Some(file)
        || status.write_token_file.as_deref().map(Path::new) == Some(file);
    if !names_file || status.state == "stopped" {
        return Err("its store's status.json is not of a running host using that file".into());
    }
    Ok(())
}

pub(super) async fn cmd_swap(a: SwapArgs) -> anyhow::Result<()> {
    let bytes = crate::guest::read_guest_file(&a.guest)?;
    let token = admin_token_for(
        &a.listen,
        a.admin_token.clone(),
        a.admin_token_file.as_deref(),
    )
    .await?;
    if let Some(batches) = a.shadow {
        return shadow_swap(&a, batches, bytes, token.as_deref()).await;
    }
    let (code, body) =
        crate::serve::call_with_token(&a.listen, "POST", "/swap", &bytes, token.as_deref())
            .await
            .with_context(|| format!("swap via {}", a.listen))?;
    let text = String::from_utf8_lossy(&body).trim_end().to_string();
    if code != 200 {
        bail!("{}: {text}", a.guest.display());
    }
    println!("{text}");
    Ok(())
}

/// `foldhost swap --shadow N`: prints the report; exits [`SHADOW_DIFFERED`] when anything
/// differed, [`SHADOW_NOT_PROMOTED`] when a promotion asked for was refused.
pub(super) async fn shadow_swap(
    a: &SwapArgs,
    batches: u64,
    component: Vec<u8>,
    token: Option<&str>,
) -> anyhow::Result<()> {
    let requests = match &a.requests {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("--requests {}", path.display()))?
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect(),
        None => Vec::new(),
    };
    let header = crate::serve::ShadowHeader {
        batches,
        sample: a.sample,
        requests,
        promote: a.promote,
        max_wait_s: a.shadow_wait,
    };
    let mut body = serde_json::to_vec(&header)?;
    body.push(b'\n');
    body.extend_from_slice(&component);
    let deadline = crate::serve::shadow_deadline(Duration::from_secs(
        a.shadow_wait.min(crate::serve::MAX_SHADOW_WAIT_S),
    ));
    let (code, answer) =
        crate::serve::call_with_deadline(&a.listen, "POST", "/shadow", &body, token, deadline)
            .await
            .with_context(|| format!("shadow via {}", a.listen))?;
    let text = String::from_utf8_lossy(&answer).trim_end().to_string();
    if code != 200 {
        bail!("{}: {text}", a.guest.display());
    }
    println!("{text}");
    let report: crate::applied::ShadowReport =
        serde_json::from_slice(&answer).context("the shadow report")?;
    if report.differing > 0 {
        eprintln!(
            "foldhost: {} answered {} of {} requests differently from {}; {}",
            report.candidate,
            report.differing,
            report.requests,
            report.live,
            if report.promoted {
                "promoted"
            } else {
                "not promoted"
            }
        );
        return Err(super::write::OutcomeExit(SHADOW_DIFFERED).into());
    }
    if a.promote && !report.promoted {
        eprintln!(
            "foldhost: {} not promoted: {}",
            report.candidate,
            report.not_promoted.as_deref().unwrap_or("unknown")
        );
        return Err(super::write::OutcomeExit(SHADOW_NOT_PROMOTED).into());
    }
    Ok(())
}

/// `swap --shadow`'s exit code when the new guest answered a request differently.
pub(crate) const SHADOW_DIFFERED: i32 = 3;
/// `swap --shadow --promote`'s exit code when nothing differed but the promotion was refused.
pub(crate) const SHADOW_NOT_PROMOTED: i32 = 4;
