//! The tokens the CLI sends to a running host: given, read from a file, or followed from the file
//! the host names in its `/status` — only a file that host generated, only over loopback.

use super::*;

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
