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
//! - **One directory, held open.** The directory is opened once (`O_DIRECTORY | O_NOFOLLOW`) and
//!   checked on that descriptor; every entry is then opened, created, renamed and removed relative
//!   to it (`openat`, `renameat`, `unlinkat`, never following a link), so no path swapped in later
//!   is ever read.
//! - **A failed cache write loses nothing.** Entries are written to a temporary file of a random
//!   name created exclusively (`O_EXCL`, mode 0600) and renamed into place; a crash leaves a stray
//!   temporary file (removed by a later write) or no entry. Entries are not fsynced: one torn by a
//!   power loss fails its digest and is compiled afresh.
//! - **Bounded.** At most [`MAX_ENTRIES`] entries (the least recently written go first) and none
//!   larger than [`MAX_ENTRY_BYTES`].
//! - This is the only module with `unsafe` code: the one call to `Component::deserialize`.

use std::hash::{Hash, Hasher};
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, Stat};

use wasmtime::Engine;
use wasmtime::component::Component;

/// The first bytes of every entry (the format's version is its last digit).
const MAGIC: &[u8; 16] = b"foldhost-cwasm-1";
/// The header's length: magic, component digest, engine hash, payload length, payload digest.
const HEADER_LEN: usize = 16 + 32 + 8 + 8 + 32;

/// Most entries kept; writing one more removes the least recently written.
pub(crate) const MAX_ENTRIES: usize = 16;
/// Largest entry written or read (a JavaScript engine compiles to ~40 MB).
pub(crate) const MAX_ENTRY_BYTES: u64 = 512 * 1024 * 1024;

/// Why an entry or the directory was not used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CacheError {
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

/// The cache directory of one engine, held open.
#[derive(Debug)]
pub(crate) struct DiskCache {
    dir: PathBuf,
    /// The directory, opened once and checked: every entry is reached relative to it.
    fd: OwnedFd,
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

/// A digest of what makes compiled code compatible with `engine` (wasmtime's own compatibility
/// hash, folded to 64 bits with std's fixed-key hasher). Stable for one build of foldhost; another
/// Rust release may fold it differently, which only costs a recompile (the entry's name and header
/// no longer match), never a wrong load: wasmtime checks its own header again.
fn engine_hash(engine: &Engine) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut h);
    h.finish()
}

fn io(path: &Path, what: &'static str) -> impl FnOnce(std::io::Error) -> CacheError {
    let path = path.to_path_buf();
    move |source| CacheError::Io { path, what, source }
}

/// Refuses a file or directory (its `fstat`) that someone other than this process's user could
/// have written, or that is not the kind expected.
fn check_private(path: &Path, st: &Stat, dir: bool) -> Result<(), CacheError> {
    let kind = FileType::from_raw_mode(st.st_mode);
    let kind_ok = if dir {
        kind == FileType::Directory
    } else {
        kind == FileType::RegularFile
    };
    let me = rustix::process::geteuid().as_raw();
    let reason = if !kind_ok {
        Some(format!(
            "not a {} (a link or another kind of file)",
            if dir { "directory" } else { "regular file" }
        ))
    } else if st.st_uid != me {
        Some(format!(
            "owned by uid {}, this process runs as {me}",
            st.st_uid
        ))
    } else if st.st_mode & 0o022 != 0 {
        Some(format!(
            "mode {:o} lets others write it",
            st.st_mode & 0o7777
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

fn errno(path: &Path, what: &'static str) -> impl FnOnce(rustix::io::Errno) -> CacheError {
    let path = path.to_path_buf();
    move |e| CacheError::Io {
        path,
        what,
        source: e.into(),
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
pub(crate) fn check_entry<'a>(
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
    /// `engine`. A directory others could write, or a link, is refused: nothing would be loaded
    /// from it.
    pub fn open(dir: &Path, engine: &Engine) -> Result<DiskCache, CacheError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io(dir, "create the cache directory"))?;
        let fd = rustix::fs::open(
            dir,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            if e == rustix::io::Errno::LOOP || e == rustix::io::Errno::NOTDIR {
                CacheError::NotPrivate {
                    path: dir.to_path_buf(),
                    reason: "not a directory (a link or another kind of file)".into(),
                }
            } else {
                errno(dir, "open the cache directory")(e)
            }
        })?;
        let st = rustix::fs::fstat(&fd).map_err(errno(dir, "stat the cache directory"))?;
        check_private(dir, &st, true)?;
        Ok(DiskCache {
            dir: dir.to_path_buf(),
            fd,
            engine_hash: engine_hash(engine),
        })
    }

    /// The directory.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// The entry's file name for a component digest.
    fn entry_name(&self, component: &[u8; 32]) -> String {
        format!("{}-{:016x}.cwasm", hex(component), self.engine_hash)
    }

    /// The entry's path for a component digest (for messages and tests).
    #[cfg(test)]
    pub(crate) fn entry_path(&self, component: &[u8; 32]) -> PathBuf {
        self.dir.join(self.entry_name(component))
    }

    /// The compiled component for `component` (its BLAKE3), `Ok(None)` when there is no entry.
    /// An entry that fails any check is an error (the caller compiles afresh) and is removed.
    pub fn load(
        &self,
        engine: &Engine,
        component: &[u8; 32],
    ) -> Result<Option<Component>, CacheError> {
        let name = self.entry_name(component);
        let path = self.dir.join(&name);
        // O_NOFOLLOW: a link in the entry's place is refused, not followed.
        let fd = match rustix::fs::openat(
            &self.fd,
            name.as_str(),
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(e) => {
                self.remove_if_ours(&name);
                return Err(if e == rustix::io::Errno::LOOP {
                    CacheError::NotPrivate {
                        path,
                        reason: "a link, not a regular file".into(),
                    }
                } else {
                    errno(&path, "open")(e)
                });
            }
        };
        let checked = self.read_checked(engine, component, &path, fd);
        if checked.is_err() {
            self.remove_if_ours(&name);
        }
        checked.map(Some)
    }

    /// Removes `name` when this user owns it: a bad entry of ours makes room for a good one;
    /// someone else's file is left alone.
    fn remove_if_ours(&self, name: &str) {
        let me = rustix::process::geteuid().as_raw();
        if rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW)
            .is_ok_and(|st| st.st_uid == me)
        {
            let _ = rustix::fs::unlinkat(&self.fd, name, AtFlags::empty());
        }
    }

    fn read_checked(
        &self,
        engine: &Engine,
        component: &[u8; 32],
        path: &Path,
        fd: OwnedFd,
    ) -> Result<Component, CacheError> {
        // Checked on the open file itself: what is read is what was checked.
        let st = rustix::fs::fstat(&fd).map_err(errno(path, "stat"))?;
        check_private(path, &st, false)?;
        let len = u64::try_from(st.st_size).unwrap_or(u64::MAX);
        if len > MAX_ENTRY_BYTES {
            return Err(CacheError::Corrupt {
                path: path.to_path_buf(),
                reason: format!("{len} bytes, over the {MAX_ENTRY_BYTES}-byte limit"),
            });
        }
        let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
        std::fs::File::from(fd)
            .take(MAX_ENTRY_BYTES + 1)
            .read_to_end(&mut bytes)
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

    /// Writes `compiled` as the entry of `component` (a new temporary file, then a rename), then
    /// trims the directory to [`MAX_ENTRIES`].
    pub fn store(&self, component: &[u8; 32], compiled: &Component) -> Result<(), CacheError> {
        let name = self.entry_name(component);
        let path = self.dir.join(&name);
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
        let mut nonce = [0u8; 8];
        rustix::rand::getrandom(&mut nonce, rustix::rand::GetRandomFlags::empty())
            .map_err(errno(&path, "a temporary name"))?;
        let tmp = format!(".tmp-{}", hex(&nonce));
        // O_EXCL: a file of this name that exists (another writer's) is never written into.
        let fd = rustix::fs::openat(
            &self.fd,
            tmp.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(errno(&path, "create a temporary entry"))?;
        let mut f = std::fs::File::from(fd);
        let written = f
            .write_all(&header(component, self.engine_hash, &payload))
            .and_then(|()| f.write_all(&payload))
            .and_then(|()| f.flush())
            .map_err(io(&path, "write the entry"))
            .and_then(|()| {
                rustix::fs::renameat(&self.fd, tmp.as_str(), &self.fd, name.as_str())
                    .map_err(errno(&path, "rename the entry into place"))
            });
        if written.is_err() {
            let _ = rustix::fs::unlinkat(&self.fd, tmp.as_str(), AtFlags::empty());
        }
        written?;
        self.trim();
        Ok(())
    }

    /// Removes the least recently written entries past [`MAX_ENTRIES`], and temporary files a
    /// crashed writer left (older than a minute). Best effort.
    fn trim(&self) {
        let Ok(listing) = rustix::fs::Dir::read_from(&self.fd) else {
            return;
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        let mut entries = Vec::new();
        for e in listing.flatten() {
            let Ok(name) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let Ok(st) = rustix::fs::statat(&self.fd, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
            else {
                continue;
            };
            if name.starts_with(".tmp-") {
                if now - st.st_mtime > 60 {
                    let _ = rustix::fs::unlinkat(&self.fd, name.as_str(), AtFlags::empty());
                }
            } else if name.ends_with(".cwasm") {
                entries.push((st.st_mtime, st.st_mtime_nsec, name));
            }
        }
        if entries.len() <= MAX_ENTRIES {
            return;
        }
        entries.sort();
        for (_, _, name) in &entries[..entries.len() - MAX_ENTRIES] {
            let _ = rustix::fs::unlinkat(&self.fd, name.as_str(), AtFlags::empty());
        }
    }
}

/// Loads a compiled component whose bytes passed [`check_entry`].
#[allow(unsafe_code)]
fn deserialize(engine: &Engine, payload: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: `Component::deserialize` runs the machine code in `payload`, so it must be bytes
    // `Component::serialize` produced for a compatible engine. They are, as far as anyone but this
    // user can tell: the entry was opened without following links, relative to the cache
    // directory held open since it was checked to be a directory only this user can write, and
    // the open file itself is a regular file only this user can write (`check_private` on
    // `fstat`); its header names this component and this engine's compatibility hash, and its
    // payload hashes to the digest written beside it by `DiskCache::store`, so a torn or truncated
    // write is never loaded. (Anyone who can write as this user can run code as this user anyway.)
    // wasmtime checks its own header and engine settings again.
    unsafe { Component::deserialize(engine, payload) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn entries(dir: &Path) -> usize {
        std::fs::read_dir(dir)
            .expect("list")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".cwasm"))
            .count()
    }

    #[test]
    fn an_entry_loads_only_for_its_own_component_never_through_a_link_and_at_most_sixteen_stay() {
        let engine = Engine::default();
        let tmp = tempfile::tempdir().expect("tempdir");
        let cache = DiskCache::open(&tmp.path().join("c"), &engine).expect("open");
        let a = Component::new(&engine, "(component)").expect("a");
        let b = Component::new(&engine, "(component (core module))").expect("b");
        let (ha, hb) = ([1u8; 32], [2u8; 32]);
        cache.store(&ha, &a).expect("store a");
        assert!(cache.load(&engine, &ha).expect("load a").is_some());
        let mode = std::fs::metadata(cache.entry_path(&ha))
            .expect("stat")
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600);
        // b's entry renamed into a's place: it names another component, so it is refused and
        // removed.
        cache.store(&hb, &b).expect("store b");
        std::fs::rename(cache.entry_path(&hb), cache.entry_path(&ha)).expect("rename");
        let e = cache
            .load(&engine, &ha)
            .expect_err("another component's code");
        assert!(e.to_string().contains("another component"), "{e}");
        assert!(!cache.entry_path(&ha).exists());
        // A link in an entry's place is refused, not followed; the link goes, its target stays.
        cache.store(&hb, &b).expect("store b");
        std::os::unix::fs::symlink(cache.entry_path(&hb), cache.entry_path(&ha)).expect("link");
        let e = cache.load(&engine, &ha).expect_err("a link");
        assert!(matches!(e, CacheError::NotPrivate { .. }), "{e}");
        assert!(cache.entry_path(&hb).exists());
        assert!(std::fs::symlink_metadata(cache.entry_path(&ha)).is_err());
        // Bounded: past MAX_ENTRIES the oldest go.
        for i in 0..MAX_ENTRIES + 3 {
            cache.store(&[10 + i as u8; 32], &a).expect("store");
        }
        assert_eq!(entries(cache.dir()), MAX_ENTRIES);
    }

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
