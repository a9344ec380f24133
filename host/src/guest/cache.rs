//! The compiled-component cache on disk: a component compiled once (a JavaScript or Python guest
//! carries a whole language runtime, ~10 s of compilation) loads on the next start, or on a swap
//! back to a known version, in milliseconds.
//!
//! An entry is one file, `<component BLAKE3>-<engine hash>.cwasm`:
//!
//! ```text
//! MAGIC (16 B) | component BLAKE3 (32 B) | engine hash (8 B, LE) | payload length (8 B, LE)
//!              | payload BLAKE3 (32 B) | payload (wasmtime's serialized component)
//! ```
//!
//! Invariants:
//! - **Nothing in the cache is trusted by being there.** Loading native code is `unsafe`
//!   (`Component::deserialize` runs whatever machine code the bytes hold), so an entry is loaded
//!   only when the directory is a real directory owned by this process's user and writable by no
//!   one else, the file is a regular file owned by the same user and writable by no one else, its
//!   header names exactly the component and the engine asked for, and its payload hashes to the
//!   digest in the header. Anything else — a truncated or torn file, a foreign entry, another
//!   engine's compilation, a loose directory — is ignored (the entry removed when it is ours to
//!   remove) and the component is compiled afresh.
//! - **The cache never decides what runs.** The key is the BLAKE3 of the component's own bytes,
//!   which the host read and hashed itself; the cache can only save a compilation of exactly those
//!   bytes.
//! - **A failed cache write loses nothing.** Entries are written to a temporary file and renamed
//!   into place; a crash leaves a stray temporary file (removed by the next write) or no entry.
//! - **Bounded.** At most [`MAX_ENTRIES`] entries (the least recently written go first) and none
//!   larger than [`MAX_ENTRY_BYTES`].
//! - This is the only module with `unsafe` code: the one call to `Component::deserialize`.

use std::hash::{Hash, Hasher};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use wasmtime::Engine;
use wasmtime::component::Component;

/// The first bytes of every entry (the format's version is its last digit).
const MAGIC: &[u8; 16] = b"foldhost-cwasm-1";
/// The header's length: magic, component digest, engine hash, payload length, payload digest.
const HEADER_LEN: usize = 16 + 32 + 8 + 8 + 32;

/// Most entries kept; writing one more removes the least recently written.
pub const MAX_ENTRIES: usize = 16;
/// Largest entry written or read (a JavaScript engine compiles to ~40 MB).
pub const MAX_ENTRY_BYTES: u64 = 512 * 1024 * 1024;

/// Why an entry or the directory was not used.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A file-system call failed.
    #[error("{path}: {what}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// The directory or the entry may have been written by someone else.
    #[error("{path}: {reason}: not trusted")]
    NotPrivate {
        /// The file or directory.
        path: PathBuf,
        /// Owner or mode, as found.
        reason: String,
    },
    /// The entry's bytes are not what this host wrote for this component and engine.
    #[error("{path}: {reason}")]
    Corrupt {
        /// The entry.
        path: PathBuf,
        /// What did not match.
        reason: String,
    },
    /// wasmtime refused the entry or could not serialize a component.
    #[error("{path}: {reason}")]
    Wasmtime {
        /// The entry.
        path: PathBuf,
        /// wasmtime's message.
        reason: String,
    },
}

/// Where a component's compilation came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// Already compiled by this engine (this process).
    Memory,
    /// Loaded from the cache directory.
    Disk,
    /// Compiled now (and written to the cache directory when there is one).
    Compiled,
}

impl Source {
    /// Short name, as status and logs print it.
    pub fn as_str(&self) -> &'static str {
        match self {
            Source::Memory => "memory",
            Source::Disk => "disk-cache",
            Source::Compiled => "compiled",
        }
    }
}

/// The cache directory of one engine.
#[derive(Debug)]
pub struct DiskCache {
    dir: PathBuf,
    engine_hash: u64,
}

/// The user's default cache directory for compiled components: `$XDG_CACHE_HOME/foldhost/wasm`,
/// else `$HOME/.cache/foldhost/wasm`; `None` when neither variable is set.
pub fn default_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })?;
    Some(base.join("foldhost").join("wasm"))
}

/// A stable digest of what makes compiled code compatible with `engine` (wasmtime's own
/// compatibility hash, folded to 64 bits with a fixed-key hasher).
fn engine_hash(engine: &Engine) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut h);
    h.finish()
}

fn io(path: &Path, what: &'static str) -> impl FnOnce(std::io::Error) -> CacheError {
    let path = path.to_path_buf();
    move |source| CacheError::Io { path, what, source }
}

/// Refuses metadata that someone other than this process's user could have written.
fn check_private(path: &Path, meta: &std::fs::Metadata, dir: bool) -> Result<(), CacheError> {
    let kind_ok = if dir {
        meta.file_type().is_dir()
    } else {
        meta.file_type().is_file()
    };
    let me = rustix::process::geteuid().as_raw();
    let reason = if !kind_ok {
        Some(format!(
            "not a {} (a link or another kind of file)",
            if dir { "directory" } else { "regular file" }
        ))
    } else if meta.uid() != me {
        Some(format!(
            "owned by uid {}, this process runs as {me}",
            meta.uid()
        ))
    } else if meta.mode() & 0o022 != 0 {
        Some(format!(
            "mode {:o} lets others write it",
            meta.mode() & 0o7777
        ))
    } else {
        None
    };
    match reason {
        Some(reason) => Err(CacheError::NotPrivate {
            path: path.to_path_buf(),
            reason,
        }),
        None => Ok(()),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The header of an entry for `component` under `engine_hash` holding `payload`.
fn header(component: &[u8; 32], engine_hash: u64, payload: &[u8]) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_LEN);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(component);
    h.extend_from_slice(&engine_hash.to_le_bytes());
    h.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    h.extend_from_slice(blake3::hash(payload).as_bytes());
    h
}

/// The payload of `bytes` when they are a whole entry for `component` under `engine_hash`;
/// otherwise what does not match. Pure: the whole format check, over bytes.
pub fn check_entry<'a>(
    bytes: &'a [u8],
    component: &[u8; 32],
    engine_hash: u64,
) -> Result<&'a [u8], String> {
    if bytes.len() < HEADER_LEN {
        return Err(format!(
            "{} bytes: shorter than the {HEADER_LEN}-byte header",
            bytes.len()
        ));
    }
    let (head, payload) = bytes.split_at(HEADER_LEN);
    if &head[..16] != MAGIC {
        return Err("not a foldhost compiled-component entry (magic)".into());
    }
    if &head[16..48] != component {
        return Err("compiled from another component".into());
    }
    let field = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&head[at..at + 8]);
        u64::from_le_bytes(b)
    };
    if field(48) != engine_hash {
        return Err("compiled by another engine (wasmtime version or settings)".into());
    }
    let len = field(56);
    if len != payload.len() as u64 {
        return Err(format!(
            "payload of {} bytes, the header says {len} (truncated or torn)",
            payload.len()
        ));
    }
    if blake3::hash(payload).as_bytes() != &head[64..96] {
        return Err("payload digest does not match (corrupt)".into());
    }
    Ok(payload)
}

impl DiskCache {
    /// Opens (creating it, private to this user, when missing) the cache directory `dir` for
    /// `engine`. A directory others could write is refused: nothing would be loaded from it.
    pub fn open(dir: &Path, engine: &Engine) -> Result<DiskCache, CacheError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io(dir, "create the cache directory"))?;
        let meta = std::fs::symlink_metadata(dir).map_err(io(dir, "stat the cache directory"))?;
        check_private(dir, &meta, true)?;
        Ok(DiskCache {
            dir: dir.to_path_buf(),
            engine_hash: engine_hash(engine),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The entry's path for a component digest.
    pub fn entry_path(&self, component: &[u8; 32]) -> PathBuf {
        self.dir.join(format!(
            "{}-{:016x}.cwasm",
            hex(component),
            self.engine_hash
        ))
    }

    /// The compiled component for `component` (its BLAKE3), `Ok(None)` when there is no entry.
    /// An entry that fails any check is an error (the caller compiles afresh) and is removed.
    pub fn load(
        &self,
        engine: &Engine,
        component: &[u8; 32],
    ) -> Result<Option<Component>, CacheError> {
        let path = self.entry_path(component);
        let meta = match std::fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&path, "stat")(e)),
        };
        let checked = self.read_checked(engine, component, &path, &meta);
        if checked.is_err() && meta.uid() == rustix::process::geteuid().as_raw() {
            // Ours and bad: make room for a good one. (Someone else's file is left alone.)
            let _ = std::fs::remove_file(&path);
        }
        checked.map(Some)
    }

    fn read_checked(
        &self,
        engine: &Engine,
        component: &[u8; 32],
        path: &Path,
        meta: &std::fs::Metadata,
    ) -> Result<Component, CacheError> {
        check_private(path, meta, false)?;
        if meta.len() > MAX_ENTRY_BYTES {
            return Err(CacheError::Corrupt {
                path: path.to_path_buf(),
                reason: format!(
                    "{} bytes, over the {MAX_ENTRY_BYTES}-byte limit",
                    meta.len()
                ),
            });
        }
        // O_NOFOLLOW: the file checked above is the file read, not a link swapped in since.
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(path)
            .map_err(io(path, "open"))?;
        let opened = file.metadata().map_err(io(path, "stat"))?;
        check_private(path, &opened, false)?;
        let mut bytes = Vec::with_capacity(usize::try_from(opened.len()).unwrap_or(0));
        std::io::Read::read_to_end(
            &mut std::io::Read::take(&mut file, MAX_ENTRY_BYTES + 1),
            &mut bytes,
        )
        .map_err(io(path, "read"))?;
        let payload = check_entry(&bytes, component, self.engine_hash).map_err(|reason| {
            CacheError::Corrupt {
                path: path.to_path_buf(),
                reason,
            }
        })?;
        deserialize(engine, payload).map_err(|e| CacheError::Wasmtime {
            path: path.to_path_buf(),
            reason: format!("{e:#}"),
        })
    }

    /// Writes `compiled` as the entry of `component` (temporary file, then rename), then trims
    /// the directory to [`MAX_ENTRIES`].
    pub fn store(&self, component: &[u8; 32], compiled: &Component) -> Result<(), CacheError> {
        let path = self.entry_path(component);
        let payload = compiled.serialize().map_err(|e| CacheError::Wasmtime {
            path: path.clone(),
            reason: format!("serialize: {e:#}"),
        })?;
        if payload.len() as u64 > MAX_ENTRY_BYTES {
            return Err(CacheError::Corrupt {
                path,
                reason: format!(
                    "{} bytes, over the {MAX_ENTRY_BYTES}-byte limit: not cached",
                    payload.len()
                ),
            });
        }
        let tmp = self.dir.join(format!(
            ".tmp-{}-{}",
            hex(&component[..8]),
            std::process::id()
        ));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
                .open(&tmp)?;
            // A file this process did not create (the name existed) keeps its old mode.
            f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
            f.write_all(&header(component, self.engine_hash, &payload))?;
            f.write_all(&payload)?;
            f.flush()?;
            std::fs::rename(&tmp, &path)
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(&path, "write the entry")(e));
        }
        self.trim();
        Ok(())
    }

    /// Removes the least recently written entries past [`MAX_ENTRIES`], and temporary files a
    /// crashed writer left (older than a minute). Best effort.
    fn trim(&self) {
        let Ok(listing) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut entries = Vec::new();
        for e in listing.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let Ok(meta) = e.metadata() else { continue };
            let modified = meta.modified().ok();
            if name.starts_with(".tmp-") {
                let stale = modified
                    .and_then(|m| m.elapsed().ok())
                    .is_some_and(|age| age.as_secs() > 60);
                if stale {
                    let _ = std::fs::remove_file(e.path());
                }
            } else if name.ends_with(".cwasm") {
                entries.push((modified, e.path()));
            }
        }
        if entries.len() <= MAX_ENTRIES {
            return;
        }
        entries.sort();
        for (_, path) in &entries[..entries.len() - MAX_ENTRIES] {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Loads a compiled component whose bytes passed [`check_entry`].
#[allow(unsafe_code)]
fn deserialize(engine: &Engine, payload: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: `Component::deserialize` runs the machine code in `payload`, so it must be bytes
    // `Component::serialize` produced for a compatible engine. They are: the entry is in a
    // directory and a file only this user can write (`check_private`, on the open file itself),
    // its header names this component and this engine's compatibility hash, and its payload hashes
    // to the digest written beside it by `DiskCache::store`, so a torn or truncated write is never
    // loaded. wasmtime checks its own header and engine settings again.
    unsafe { Component::deserialize(engine, payload) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_is_accepted_only_whole_and_for_its_component_and_engine() {
        let component = [7u8; 32];
        let payload = b"compiled bytes".to_vec();
        let mut entry = header(&component, 42, &payload);
        entry.extend_from_slice(&payload);
        assert_eq!(check_entry(&entry, &component, 42), Ok(&payload[..]));
        // Every cut of the entry is refused: a torn write never loads.
        for cut in 0..entry.len() {
            assert!(
                check_entry(&entry[..cut], &component, 42).is_err(),
                "cut at {cut}"
            );
        }
        assert!(check_entry(&entry, &[8u8; 32], 42).is_err());
        assert!(check_entry(&entry, &component, 43).is_err());
        let mut flipped = entry.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(
            check_entry(&flipped, &component, 42)
                .unwrap_err()
                .contains("digest")
        );
        let mut grown = entry.clone();
        grown.push(0);
        assert!(check_entry(&grown, &component, 42).is_err());
    }

    #[test]
    fn a_directory_others_can_write_is_refused() {
        let engine = Engine::default();
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("cache");
        let cache = DiskCache::open(&dir, &engine).expect("a fresh private directory");
        let mode = std::fs::metadata(cache.dir()).expect("stat").mode() & 0o777;
        assert_eq!(mode, 0o700);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let err = DiskCache::open(&dir, &engine).unwrap_err();
        assert!(matches!(err, CacheError::NotPrivate { .. }), "{err}");
        let link = tmp.path().join("link");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        std::os::unix::fs::symlink(&dir, &link).expect("symlink");
        assert!(matches!(
            DiskCache::open(&link, &engine),
            Err(CacheError::NotPrivate { .. })
        ));
    }
}
