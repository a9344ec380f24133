//! `guest-seed`: the store's secret seed of its guests' random streams (`guest::random`).
//!
//! 32 random bytes, made by the first run that needs them, private to the user (mode 0600). It stays
//! with the store, so every instance a host rebuilds from this fold — after a trap, a restart, a
//! swap back — draws the same random numbers, and it is not shared: an artifact never carries it
//! (artifacts hold the backend's files only), so a bucket writer who reads a published artifact
//! still cannot predict a guest's hash seeds. A fleet that wants identical guests everywhere gives
//! every host the same `--guest-seed` instead.
//!
//! Invariant: a seed file that is not exactly 32 bytes is an error naming the file, never replaced
//! silently (a new seed would change what the guests draw).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::StoreDirError;

/// The seed file's name in the store directory.
pub(crate) const GUEST_SEED_FILE: &str = "guest-seed";

fn err(path: &Path, reason: String) -> StoreDirError {
    StoreDirError::Meta {
        path: path.to_path_buf(),
        reason,
    }
}

/// The store's guest seed, made (random, durable) when the store has none.
pub fn load_or_create(dir: &Path) -> Result<[u8; 32], StoreDirError> {
    let path = dir.join(GUEST_SEED_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => {
            return <[u8; 32]>::try_from(bytes.as_slice()).map_err(|_| {
                err(
                    &path,
                    format!(
                        "{} bytes, a guest seed is 32: restore it, or remove it to make a new one (guests then draw other random numbers)",
                        bytes.len()
                    ),
                )
            });
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(&path, format!("read: {e}"))),
    }
    let mut seed = [0u8; 32];
    rustix::rand::getrandom(&mut seed, rustix::rand::GetRandomFlags::empty())
        .map_err(|e| err(&path, format!("no random bytes for a new seed: {e}")))
        .and_then(|n| {
            (n == seed.len())
                .then_some(())
                .ok_or_else(|| err(&path, format!("only {n} random bytes for a new seed")))
        })?;
    let tmp = dir.join(format!("{GUEST_SEED_FILE}.tmp"));
    let write = || -> std::io::Result<()> {
        // A temporary file a crashed run left goes first: the seed is only ever written into a
        // file this run created, private from its first byte, never through a link.
        match std::fs::remove_file(&tmp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(&tmp)?;
        f.write_all(&seed)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(dir)?.sync_all()
    };
    write().map_err(|e| err(&path, format!("write a new seed: {e}")))?;
    Ok(seed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_store_keeps_its_seed_private_and_a_damaged_seed_is_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let first = load_or_create(tmp.path()).expect("made");
        assert_eq!(load_or_create(tmp.path()).expect("read"), first);
        let path = tmp.path().join(GUEST_SEED_FILE);
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let other = tempfile::tempdir().expect("tempdir");
        assert_ne!(load_or_create(other.path()).expect("made"), first);
        std::fs::write(&path, &first[..31]).expect("truncate");
        let e = load_or_create(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("guest-seed") && e.contains("31 bytes"), "{e}");
        assert_eq!(
            std::fs::read(&path).expect("kept").len(),
            31,
            "never replaced"
        );
    }
}
