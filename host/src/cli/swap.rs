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

pub(super) async fn cmd_swap(a: SwapArgs) -> anyhow::Result<()> {
    let bytes = foldhost_guest::guest::read_guest_file(&a.guest)?;
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
    let report: foldhost_fold::applied::ShadowReport =
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
