//! The endpoint's token files: read (trimmed, bounded), generated (private, 0600, renamed into
//! place), and followed only when a host generated them.

/// The admin token file a host generates in its store directory when no token is given.
pub(crate) const ADMIN_TOKEN_FILE: &str = "admin-token";
/// The query token file a host listening beyond loopback generates in its store directory when
/// no query token is given (and `--query-open` is not).
pub(crate) const QUERY_TOKEN_FILE: &str = "query-token";
/// Largest token file read.
const MAX_TOKEN_FILE: u64 = 4096;

/// Reads a token file: its content, trimmed, must be non-empty and at most 4 KiB.
pub(crate) fn read_token_file(path: &std::path::Path) -> std::io::Result<String> {
    use std::io::Read as _;
    let f = std::fs::File::open(path).map_err(|e| {
        std::io::Error::new(e.kind(), format!("token file {}: {e}", path.display()))
    })?;
    let mut text = String::new();
    f.take(MAX_TOKEN_FILE + 1)
        .read_to_string(&mut text)
        .map_err(|e| {
            std::io::Error::new(e.kind(), format!("token file {}: {e}", path.display()))
        })?;
    let t = text.trim();
    if t.is_empty() || text.len() as u64 > MAX_TOKEN_FILE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("token file {}: empty or over 4 KiB", path.display()),
        ));
    }
    Ok(t.to_string())
}

/// Reads a token file a host generated ([`generate_token_file`]), refusing anything else: the
/// file must be named [`ADMIN_TOKEN_FILE`] or [`crate::write::WRITE_TOKEN_FILE`], be a regular file no one but its owner can read
/// (mode 0600 or stricter), and hold 64 hex digits. A client that follows the path a listener
/// names in `/status` uses this, so a listener that is not the host (a squatter on the port)
/// cannot make it send some other file (a private key) as a bearer token.
pub(crate) fn read_generated_token(path: &std::path::Path) -> std::io::Result<String> {
    use std::os::unix::fs::PermissionsExt as _;
    let refuse = |why: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{}: not a token file a host generated: {why}",
                path.display()
            ),
        )
    };
    let name = path.file_name();
    if name != Some(std::ffi::OsStr::new(ADMIN_TOKEN_FILE))
        && name != Some(std::ffi::OsStr::new(crate::write::WRITE_TOKEN_FILE))
    {
        return Err(refuse("wrong name"));
    }
    let meta = std::fs::symlink_metadata(path)?;
    if !meta.file_type().is_file() || meta.permissions().mode() & 0o077 != 0 {
        return Err(refuse("not a private regular file"));
    }
    let token = read_token_file(path)?;
    if token.len() != 64 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(refuse("not 64 hex digits"));
    }
    Ok(token)
}

/// The query token a host listening beyond loopback uses when given none: the one in `path`
/// ([`QUERY_TOKEN_FILE`] in the store) if a run before generated it and it is still private,
/// else a new one generated there ([`generate_token_file`]). Kept across restarts, so remote
/// clients that copied it once keep working; delete the file to change it.
pub(crate) fn query_token_from_store(path: &std::path::Path) -> std::io::Result<String> {
    use std::os::unix::fs::PermissionsExt as _;
    let private = std::fs::symlink_metadata(path)
        .is_ok_and(|m| m.file_type().is_file() && m.permissions().mode() & 0o077 == 0);
    match read_token_file(path) {
        Ok(t) if private && t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()) => Ok(t),
        _ => generate_token_file(path),
    }
}

/// Generates a token (32 bytes from the OS's random source, hex) and writes it to `path`
/// readable and writable by this user only (mode 0600, written beside and renamed into place).
pub(crate) fn generate_token_file(path: &std::path::Path) -> std::io::Result<String> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let token = random_token()?;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(token.as_bytes())?;
            f.write_all(b"\n")?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    written.map_err(|e| {
        std::io::Error::new(e.kind(), format!("token file {}: {e}", path.display()))
    })?;
    Ok(token)
}

/// A token: 32 bytes from the OS's random source, as 64 hex digits.
pub(crate) fn random_token() -> std::io::Result<String> {
    use std::io::Read as _;
    let mut raw = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut raw))
        .map_err(|e| std::io::Error::new(e.kind(), format!("/dev/urandom: {e}")))?;
    Ok(raw.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_generated_private_token_file_is_followed() -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir()?;
        let file = dir.path().join(ADMIN_TOKEN_FILE);
        let token = generate_token_file(&file)?;
        assert_eq!(
            std::fs::metadata(&file)?.permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(read_generated_token(&file)?, token);
        // Readable by others: refused.
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644))?;
        assert!(read_generated_token(&file).is_err());
        // Another name (a private key, say), or content that is not a generated token: refused.
        let key = dir.path().join("id_ed25519");
        std::fs::write(&key, "-----BEGIN OPENSSH PRIVATE KEY-----\n")?;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))?;
        assert!(read_generated_token(&key).is_err());
        let other = dir.path().join("sub");
        std::fs::create_dir(&other)?;
        let fake = other.join(ADMIN_TOKEN_FILE);
        std::fs::write(&fake, "-----BEGIN OPENSSH PRIVATE KEY-----\n")?;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o600))?;
        assert!(read_generated_token(&fake).is_err());
        Ok(())
    }
}
