//! The artifact transport (seed 000, "Transport"): artifacts published to object storage, where a
//! fleet bootstraps from them. One URL names the store and a prefix (`s3://bucket/prefix`,
//! `gs://…`, `az://…`, `file:///…`; credentials from the environment, as the `object_store` crate
//! reads them). Under the prefix, per artifact key:
//!
//! - `<key>.payloads/<blake3(manifest)[..16] hex>.tar` — the payload, written once, addressed by
//!   its content (the manifest names every file's digest, so the manifest's hash names the whole);
//! - `<key>.manifest.json` — the pointer: the manifest's bytes exactly, published last.
//!
//! Invariants:
//! - **Nothing half-written is addressable**: the payload is a streamed multipart upload (8 MiB
//!   parts, at most [`UPLOAD_CONCURRENCY`] in flight, aborted on failure) to a name no pointer names
//!   yet; the pointer moves only after the payload is whole.
//! - **The pointer never regresses**: it moves by a conditional put (create-if-absent, or
//!   update-if-unchanged) decided by [`protocol::pointer_publish_allowed`], retried a bounded number
//!   of times; a slower exporter gets [`TransportError::SupersededByNewer`]. A store without
//!   conditional updates (the local file system) **fails closed** unless the operator allows a
//!   non-atomic pointer, and every publish under that allowance says so in the log.
//! - **A download is untrusted**: the payload streams straight into the import (memory bounded by
//!   a few chunks and one buffer; nothing is stored as a tar), its embedded manifest must equal the
//!   pointer's bytes, every file must be listed there once with its size and BLAKE3 digest, and the
//!   staged copy must reopen at the manifest's cursor before it is renamed into a store.
//! - **Prune** deletes only what [`protocol::payload_prunable`] allows: never the pointer's target,
//!   never a payload at or above the pointer's cursor (one an exporter may still name), and only
//!   past the grace.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use object_store::path::Path as ObjectPath;
use object_store::{
    ObjectStore, ObjectStoreExt as _, PutMode, PutOptions, PutPayload, UpdateVersion,
    WriteMultipart,
};

use crate::artifact::{self, ArtifactError, ExportManifest, MANIFEST_FILE};
use crate::protocol::{self, PointerState};

/// Size of one part of a payload upload.
pub const PART_BYTES: usize = 8 << 20;
/// Parts of one upload in flight at once (memory: about this many parts).
pub const UPLOAD_CONCURRENCY: usize = 2;
/// Attempts at publishing a pointer against concurrent exporters before giving up.
pub const POINTER_ATTEMPTS: u32 = 8;

/// Errors of the artifact transport.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The URL does not name a store this build reaches.
    #[error("--artifacts {url}: {reason}")]
    Url {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// The object store failed.
    #[error("{what} {path}: {source}")]
    Store {
        /// What was being done.
        what: &'static str,
        /// The object.
        path: String,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
    /// A local file failed.
    #[error("{}: {op}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The artifact itself (its manifest, its files).
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    /// A newer artifact than this one is already published: the pointer stays.
    #[error("artifact {key}: superseded by a newer one (pointer at cursor {current}, ours {ours})")]
    SupersededByNewer {
        /// The artifact key.
        key: String,
        /// The published cursor.
        current: u64,
        /// This artifact's cursor.
        ours: u64,
    },
    /// Other exporters kept moving the pointer: no publish in [`POINTER_ATTEMPTS`] attempts.
    #[error("artifact {key}: the pointer kept changing; gave up after {attempts} attempts")]
    Contended {
        /// The artifact key.
        key: String,
        /// Attempts made.
        attempts: u32,
    },
    /// The store cannot move a pointer atomically and no non-atomic pointer was allowed.
    #[error(
        "--artifacts {url}: this store cannot replace the pointer atomically (no conditional update); refusing to publish (allow it for development with --allow-non-atomic-pointer)"
    )]
    NoAtomicPointer {
        /// The URL.
        url: String,
    },
    /// Nothing is published under the key.
    #[error("artifact {key}: nothing published under --artifacts {url}")]
    NothingPublished {
        /// The artifact key.
        key: String,
        /// The URL.
        url: String,
    },
}

/// Where a fleet's artifacts live: an object store and a prefix in it.
pub struct ArtifactTransport {
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    url: String,
    /// The store can replace an object conditionally (`If-Match`).
    atomic_pointer: bool,
    /// The operator allowed a non-atomic pointer on a store without conditional updates.
    allow_non_atomic: bool,
}

/// What [`ArtifactTransport::upload`] published.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Published {
    /// The artifact's cursor.
    pub cursor: u64,
    /// The payload's object path.
    pub payload: String,
}

/// The payload name of a manifest at `cursor`: the cursor (20 digits) and the first 16 bytes of
/// the manifest's BLAKE3, in hex. The cursor is in the name so a prune can tell, from a listing
/// alone, a payload no publish can name any more (below the pointer) from one an exporter may be
/// about to name ([`protocol::payload_prunable`]).
pub fn payload_name(manifest_bytes: &[u8], cursor: u64) -> String {
    let h = blake3::hash(manifest_bytes);
    let hex: String = h.as_bytes()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{cursor:020}-{hex}.tar")
}

/// The cursor a payload's name carries; `None` for a name of the earlier form (`<hex>.tar`) or a
/// foreign object.
pub fn payload_cursor(name: &str) -> Option<u64> {
    let (cursor, rest) = name.split_once('-')?;
    if cursor.len() != 20 || !cursor.bytes().all(|b| b.is_ascii_digit()) || !rest.ends_with(".tar")
    {
        return None;
    }
    cursor.parse().ok()
}

/// Whether `key` is a usable artifact key (a path segment of the store: letters, digits, `.`,
/// `-`, `_`, not starting with `.`).
pub fn key_allowed(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 200
        && !key.starts_with('.')
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
}

impl ArtifactTransport {
    /// The transport at `url`, configured from the environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`).
    pub fn from_url(url: &str, allow_non_atomic: bool) -> Result<Self, TransportError> {
        let bad = |reason: String| TransportError::Url {
            url: url.to_string(),
            reason,
        };
        let u = url::Url::parse(url).map_err(|e| bad(e.to_string()))?;
        let options: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| {
                let k = k.to_ascii_uppercase();
                k.starts_with("AWS_") || k.starts_with("GOOGLE_") || k.starts_with("AZURE_")
            })
            .map(|(k, v)| (k.to_ascii_lowercase(), v))
            .collect();
        let (store, prefix) =
            object_store::parse_url_opts(&u, options).map_err(|e| bad(e.to_string()))?;
        // The local file system creates conditionally but cannot update conditionally.
        let atomic_pointer = u.scheme() != "file";
        Ok(ArtifactTransport {
            store: Arc::from(store),
            prefix,
            url: url.to_string(),
            atomic_pointer,
            allow_non_atomic,
        })
    }

    /// The URL this transport was made from.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn pointer_path(&self, key: &str) -> ObjectPath {
        self.prefix.clone().join(format!("{key}.manifest.json"))
    }

    fn payloads_dir(&self, key: &str) -> ObjectPath {
        self.prefix.clone().join(format!("{key}.payloads"))
    }

    fn store_err(
        what: &'static str,
        path: &ObjectPath,
    ) -> impl FnOnce(object_store::Error) -> TransportError {
        let path = path.to_string();
        move |source| TransportError::Store { what, path, source }
    }

    /// Publishes the artifact directory `artifact` under `key`: the payload first (a tar packed in
    /// `scratch`, streamed up in parts), then the pointer. The packed tar is removed on every path.
    pub async fn upload(
        &self,
        key: &str,
        artifact: &Path,
        scratch: &Path,
    ) -> Result<Published, TransportError> {
        if !self.atomic_pointer && !self.allow_non_atomic {
            return Err(TransportError::NoAtomicPointer {
                url: self.url.clone(),
            });
        }
        let manifest_path = artifact.join(MANIFEST_FILE);
        let manifest_bytes =
            std::fs::read(&manifest_path).map_err(|source| TransportError::Io {
                path: manifest_path.clone(),
                op: "read manifest",
                source,
            })?;
        let manifest = artifact::read_manifest(artifact)?;
        let cursor = manifest.cursor.unwrap_or(0);
        let payload = self
            .payloads_dir(key)
            .join(payload_name(&manifest_bytes, cursor));
        std::fs::create_dir_all(scratch).map_err(|source| TransportError::Io {
            path: scratch.to_path_buf(),
            op: "create scratch",
            source,
        })?;
        let tar = scratch.join(format!(".upload-{}", payload_name(&manifest_bytes, cursor)));
        let packed = {
            let (a, t) = (artifact.to_path_buf(), tar.clone());
            tokio::task::spawn_blocking(move || artifact::pack_tar(&a, &t))
                .await
                .map_err(|e| TransportError::Io {
                    path: tar.clone(),
                    op: "pack task",
                    source: std::io::Error::other(e.to_string()),
                })
        };
        let result = match packed {
            Ok(Ok(())) => self.upload_payload(&payload, &tar).await,
            Ok(Err(e)) => Err(e.into()),
            Err(e) => Err(e),
        };
        let _ = std::fs::remove_file(&tar);
        result?;
        crate::crashpoint::hit(crate::crashpoint::PUBLISH_BEFORE_POINTER);
        crate::crashpoint::hold(crate::crashpoint::PUBLISH_BEFORE_POINTER).await;
        self.publish(key, &manifest_bytes, cursor).await?;
        Ok(Published {
            cursor,
            payload: payload.to_string(),
        })
    }

    /// Streams the file `tar` to `payload` in parts; aborts the upload on any failure, so no
    /// partial object is ever addressable.
    async fn upload_payload(&self, payload: &ObjectPath, tar: &Path) -> Result<(), TransportError> {
        let upload = self
            .store
            .put_multipart(payload)
            .await
            .map_err(Self::store_err("start upload of", payload))?;
        let mut w = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
        let streamed: Result<(), TransportError> = async {
            let mut f = std::fs::File::open(tar).map_err(|source| TransportError::Io {
                path: tar.to_path_buf(),
                op: "open packed payload",
                source,
            })?;
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = f.read(&mut buf).map_err(|source| TransportError::Io {
                    path: tar.to_path_buf(),
                    op: "read packed payload",
                    source,
                })?;
                if n == 0 {
                    return Ok(());
                }
                w.wait_for_capacity(UPLOAD_CONCURRENCY)
                    .await
                    .map_err(Self::store_err("upload", payload))?;
                w.write(&buf[..n]);
            }
        }
        .await;
        match streamed {
            Ok(()) => {
                w.finish()
                    .await
                    .map_err(Self::store_err("finish upload of", payload))?;
                Ok(())
            }
            Err(e) => {
                let _ = w.abort().await;
                Err(e)
            }
        }
    }

    /// Moves the pointer of `key` to `manifest_bytes` (an artifact at `cursor`), never backward.
    async fn publish(
        &self,
        key: &str,
        manifest_bytes: &[u8],
        cursor: u64,
    ) -> Result<(), TransportError> {
        let pointer = self.pointer_path(key);
        for _ in 0..POINTER_ATTEMPTS {
            let (state, version) = self.read_pointer_state(&pointer).await?;
            if !protocol::pointer_publish_allowed(state, cursor) {
                let current = match state {
                    PointerState::At(c) => c,
                    _ => 0,
                };
                return Err(TransportError::SupersededByNewer {
                    key: key.to_string(),
                    current,
                    ours: cursor,
                });
            }
            let mode = match (&state, version) {
                _ if !self.atomic_pointer => {
                    tracing::warn!(key, url = %self.url, "publishing a NON-ATOMIC pointer (--allow-non-atomic-pointer): a concurrent exporter may overwrite a newer one");
                    PutMode::Overwrite
                }
                (PointerState::Absent, _) => PutMode::Create,
                (_, Some(v)) => PutMode::Update(v),
                (_, None) => PutMode::Create,
            };
            let put = self
                .store
                .put_opts(
                    &pointer,
                    PutPayload::from(manifest_bytes.to_vec()),
                    PutOptions::from(mode),
                )
                .await;
            match put {
                Ok(_) => {
                    tracing::info!(key, cursor, url = %self.url, "artifact pointer published");
                    return Ok(());
                }
                // Another exporter moved it between the read and the put: read again.
                Err(
                    object_store::Error::AlreadyExists { .. }
                    | object_store::Error::Precondition { .. }
                    | object_store::Error::NotFound { .. },
                ) => continue,
                Err(e) => return Err(Self::store_err("publish pointer", &pointer)(e)),
            }
        }
        Err(TransportError::Contended {
            key: key.to_string(),
            attempts: POINTER_ATTEMPTS,
        })
    }

    /// The pointer's state and the version a conditional update must match.
    async fn read_pointer_state(
        &self,
        pointer: &ObjectPath,
    ) -> Result<(PointerState, Option<UpdateVersion>), TransportError> {
        match self.store.get(pointer).await {
            Ok(r) => {
                let version = UpdateVersion {
                    e_tag: r.meta.e_tag.clone(),
                    version: r.meta.version.clone(),
                };
                let bytes = r
                    .bytes()
                    .await
                    .map_err(Self::store_err("read pointer", pointer))?;
                let state = match parse_pointer(&bytes) {
                    Some(m) => PointerState::At(m.cursor.unwrap_or(0)),
                    None => PointerState::Corrupt,
                };
                Ok((state, Some(version)))
            }
            Err(object_store::Error::NotFound { .. }) => Ok((PointerState::Absent, None)),
            Err(e) => Err(Self::store_err("read pointer", pointer)(e)),
        }
    }

    /// The published manifest of `key` (its exact bytes, parsed), if any; a corrupt pointer reads
    /// as none.
    pub async fn pointer(
        &self,
        key: &str,
    ) -> Result<Option<(Vec<u8>, ExportManifest)>, TransportError> {
        let pointer = self.pointer_path(key);
        match self.store.get(&pointer).await {
            Ok(r) => {
                let bytes = r
                    .bytes()
                    .await
                    .map_err(Self::store_err("read pointer", &pointer))?;
                Ok(parse_pointer(&bytes).map(|m| (bytes.to_vec(), m)))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(Self::store_err("read pointer", &pointer)(e)),
        }
    }

    /// Makes the store `dest` (absent, or an empty directory) from the artifact the pointer of
    /// `key` names, streaming the payload from the object store straight into the import
    /// ([`artifact::import_tar_stream`]): every file is written once, into the stage, while it is
    /// hashed against the pointer's manifest; nothing is stored as a tar first. Memory: the
    /// channel's few chunks and the import's buffer, never the artifact. On any failure `dest` is
    /// untouched.
    pub async fn bootstrap_into(
        &self,
        key: &str,
        dest: &Path,
        want: Option<crate::storedir::Backend>,
    ) -> Result<ExportManifest, TransportError> {
        let Some((manifest_bytes, manifest)) = self.pointer(key).await? else {
            return Err(TransportError::NothingPublished {
                key: key.to_string(),
                url: self.url.clone(),
            });
        };
        let payload = self
            .payloads_dir(key)
            .join(payload_name(&manifest_bytes, manifest.cursor.unwrap_or(0)));
        let r = self
            .store
            .get(&payload)
            .await
            .map_err(Self::store_err("download", &payload))?;
        let range = r.range.clone();
        let mut stream = match r.payload {
            // A local object (`file://`): read on the import's own blocking thread. Its stream
            // would hand it over in 8 KiB chunks, each read by a blocking task of its own, which
            // took a 150 MB bootstrap from about 0.3 to 1.8 s.
            object_store::GetResultPayload::File(file, path) => {
                let dest_owned = dest.to_path_buf();
                let imported = tokio::task::spawn_blocking(move || {
                    use std::io::{Read as _, Seek as _};
                    let mut file = file;
                    file.seek(std::io::SeekFrom::Start(range.start))
                        .map_err(|source| TransportError::Io {
                            path: path.clone(),
                            op: "seek the payload",
                            source,
                        })?;
                    let reader = std::io::BufReader::with_capacity(
                        LOCAL_READ_BYTES,
                        file.take(range.end - range.start),
                    );
                    artifact::import_tar_stream(
                        reader,
                        &manifest_bytes,
                        &dest_owned,
                        want,
                        &mut |_, _| {},
                    )
                    .map_err(TransportError::from)
                });
                return imported.await.map_err(|e| TransportError::Io {
                    path: dest.to_path_buf(),
                    op: "import task",
                    source: std::io::Error::other(e.to_string()),
                })?;
            }
            object_store::GetResultPayload::Stream(s) => s,
        };
        let (tx, rx) =
            tokio::sync::mpsc::channel::<std::io::Result<bytes::Bytes>>(DOWNLOAD_CHUNKS_IN_FLIGHT);
        let dest_owned = dest.to_path_buf();
        let import = tokio::task::spawn_blocking(move || {
            let reader = ChunkReader {
                rx,
                current: bytes::Bytes::new(),
            };
            artifact::import_tar_stream(reader, &manifest_bytes, &dest_owned, want, &mut |_, _| {})
        });
        let mut download_error = None;
        while let Some(chunk) = stream.next().await {
            let chunk = match chunk {
                Ok(c) => Ok(c),
                Err(e) => {
                    let err = Self::store_err("download", &payload)(e);
                    let line = err.to_string();
                    download_error = Some(err);
                    Err(std::io::Error::other(line))
                }
            };
            let stop = chunk.is_err();
            // A closed channel: the import refused the payload already; its error says why.
            if tx.send(chunk).await.is_err() || stop {
                break;
            }
        }
        drop(tx);
        let imported = import.await.map_err(|e| TransportError::Io {
            path: dest.to_path_buf(),
            op: "import task",
            source: std::io::Error::other(e.to_string()),
        })?;
        match (imported, download_error) {
            (Ok(m), _) => Ok(m),
            (Err(_), Some(download)) => Err(download),
            (Err(e), None) => Err(e.into()),
        }
    }

    /// Deletes the payloads of `key` that [`protocol::payload_prunable`] allows at `now`: older
    /// than `grace`, below the pointer's cursor, and never the pointer's target (with no pointer,
    /// none). Returns how many went.
    pub async fn prune(
        &self,
        key: &str,
        grace: Duration,
        now: clock::Now,
    ) -> Result<u64, TransportError> {
        let pointer = self.pointer(key).await?;
        let pointer_cursor = pointer.as_ref().map(|(_, m)| m.cursor.unwrap_or(0));
        let target = pointer.map(|(bytes, m)| payload_name(&bytes, m.cursor.unwrap_or(0)));
        let dir = self.payloads_dir(key);
        let mut listed = self.store.list(Some(&dir));
        let mut doomed = Vec::new();
        while let Some(meta) = listed.next().await {
            let meta = meta.map_err(Self::store_err("list", &dir))?;
            let is_target = target
                .as_deref()
                .is_some_and(|t| meta.location.filename() == Some(t));
            let age = now.since(meta.last_modified.timestamp_millis());
            let cursor = meta.location.filename().and_then(payload_cursor);
            if protocol::payload_prunable(is_target, cursor, pointer_cursor, age, grace) {
                doomed.push(meta.location);
            }
        }
        let mut n = 0;
        for path in doomed {
            match self.store.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => n += 1,
                Err(e) => return Err(Self::store_err("prune", &path)(e)),
            }
        }
        Ok(n)
    }
}

/// Wall-clock time for prune decisions, passed in so a caller (and a test) states it.
pub mod clock {
    use std::time::Duration;

    /// A point in time, Unix milliseconds.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Now(pub i64);

    impl Now {
        /// The wall clock now.
        pub fn system() -> Self {
            Now(crate::status::now_unix_ms() as i64)
        }

        /// How long ago `then_ms` was (zero when it is in the future).
        pub fn since(self, then_ms: i64) -> Duration {
            Duration::from_millis(u64::try_from(self.0.saturating_sub(then_ms)).unwrap_or(0))
        }
    }
}

/// A pointer's manifest, or `None` when the bytes are not one (a corrupt pointer).
fn parse_pointer(bytes: &[u8]) -> Option<ExportManifest> {
    if bytes.len() as u64 > artifact::MAX_MANIFEST_BYTES {
        return None;
    }
    serde_json::from_slice(bytes).ok()
}

/// The read size for a payload on the local file system.
const LOCAL_READ_BYTES: usize = 1 << 20;

/// Downloaded chunks queued between the object store's stream and the import (each is what the
/// store hands over, typically well under 1 MiB).
const DOWNLOAD_CHUNKS_IN_FLIGHT: usize = 8;

/// A blocking `Read` over the chunks of a download, for the import running on a blocking thread.
struct ChunkReader {
    rx: tokio::sync::mpsc::Receiver<std::io::Result<bytes::Bytes>>,
    current: bytes::Bytes,
}

impl std::io::Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(chunk)) => self.current = chunk,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_names_address_the_manifest_and_keys_are_plain_segments() {
        let a = payload_name(b"{\"cursor\":1}", 1);
        assert_eq!(a.len(), 20 + 1 + 32 + 4);
        assert!(a.ends_with(".tar"));
        assert_ne!(a, payload_name(b"{\"cursor\":2}", 2));
        assert_eq!(payload_cursor(&a), Some(1));
        assert_eq!(
            payload_cursor(&payload_name(b"m", u64::MAX)),
            Some(u64::MAX)
        );
        // The earlier form, and foreign objects, carry none.
        for other in [
            "0123456789abcdef0123456789abcdef.tar",
            "12-abc.tar",
            "0000000000000000000x-abc.tar",
            "00000000000000000001-abc.txt",
        ] {
            assert_eq!(payload_cursor(other), None, "{other}");
        }
        assert!(key_allowed("routes.prod-1") && key_allowed("a_b"));
        for bad in ["", ".hidden", "a/b", "a b", "..", &"k".repeat(201)] {
            assert!(!key_allowed(bad), "{bad:?}");
        }
    }

    #[test]
    fn prune_ages_are_never_negative() {
        let now = clock::Now(10_000);
        assert_eq!(now.since(4_000), Duration::from_secs(6));
        assert_eq!(now.since(20_000), Duration::ZERO);
    }
}
