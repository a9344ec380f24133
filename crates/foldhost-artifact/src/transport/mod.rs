//! The artifact transport (docs/design.md, "Transport and export rounds"): artifacts published to
//! object storage, where a fleet bootstraps from them. One URL names the store and a prefix
//! (`s3://bucket/prefix`, `gs://…`, `az://…`, `file:///…`; credentials from the environment, as the
//! `object_store` crate reads them). Under the prefix, per artifact key:
//!
//! - `<key>.segments/<cursor>-<blake3(manifest)[..16] hex>.tar/NNNNNN` — the payload, a tar
//!   cut into **segments** of [`SEGMENT_BYTES`] (the last one shorter), each its own object, written
//!   once under a name addressed by the cursor and the content (the manifest names every file's
//!   digest, so the manifest's hash names the whole). A download fetches several segments at once
//!   and feeds them to the import in order: on S3 one connection carries about 100 MB/s, and a
//!   store that reads a whole object before its first byte (moto) answers a segment sooner than
//!   the whole. `<key>.payloads/<cursor>-<hex>.tar` — the same payload as one object, the layout
//!   earlier versions published — is still read when no segment is listed. The segments live
//!   beside `<key>.payloads/`, not under it, because an earlier version's prune judges every
//!   object under it by its own name: it would take a segment (`000003`, no cursor) for a foreign
//!   object and delete the published payload's segments during a rolling upgrade.
//! - `<key>.manifest.json` — the pointer: the manifest's bytes exactly, published last. The
//!   published manifest is the artifact's own with the pointer's recent previous targets added
//!   ([`ExportManifest::previous`]: each one's cursor and publish time, at most
//!   [`artifact::MAX_PREVIOUS_TARGETS`]), so the tar carries the same bytes and older readers,
//!   which ignore the field, still name and check the payload by them.
//!
//! Invariants:
//! - **Nothing half-written is addressable**: the segments (each one atomic put, at most
//!   [`UPLOAD_CONCURRENCY`] in flight) go to a name no pointer names yet, any segment past their
//!   count (an earlier attempt's) is deleted, and the pointer moves only after every segment is
//!   whole. A failed upload leaves its segments to prune (nothing names them). A name is always
//!   the same bytes: the manifest carries its export's time, and publishing the same artifact
//!   again packs the same files, so a segment put twice is put with the same bytes.
//! - **A download is bounded and in order**: the listing of a payload's segments must be
//!   contiguous from `000000` ([`segment_plan`]: at most [`MAX_SEGMENTS`], each at most
//!   [`MAX_SEGMENT_BYTES`]); each segment must deliver exactly its listed length; memory holds the
//!   segment the import is reading and at most [`READAHEAD_BYTES`] fetched beside it (or one
//!   segment, when one is larger); a local store's segments are opened one after another.
//! - **The pointer never regresses**: it moves by a conditional put (create-if-absent, or
//!   update-if-unchanged) decided by [`protocol::pointer_publish_allowed`], retried a bounded number
//!   of times; a slower exporter gets [`TransportError::SupersededByNewer`]. A store without
//!   conditional updates (the local file system) **fails closed** unless the operator allows a
//!   non-atomic pointer, and every publish under that allowance says so in the log.
//! - **Nothing read from the store is unbounded**: the pointer's size is read first (its
//!   metadata) and an object over [`artifact::MAX_MANIFEST_BYTES`] is refused without reading it
//!   (a publish replaces it as corrupt); its body is then read as a range of that size; a tar's
//!   extension entries are bounded by [`artifact::TarGuard`] before the `tar` crate reads them.
//! - **A download is untrusted**: the payload streams straight into the import (memory bounded as
//!   below; nothing is stored as a tar), its embedded manifest must equal the
//!   pointer's bytes, every file must be listed there once with its size and BLAKE3 digest, and the
//!   staged copy must reopen at the manifest's cursor before it is renamed into a store.
//! - **Prune** deletes only what [`protocol::payload_prunable`] allows: never the pointer's target,
//!   never a payload at or above the pointer's cursor (one an exporter may still name), and only
//!   once the grace has passed since it stopped being the target
//!   ([`protocol::payload_superseded_at`], from the pointer's own publish time and its previous
//!   targets'); a bootstrap whose payload vanishes anyway reads the pointer again and retries once.
//! - **One stream per pointer at a time**: an exporter of a later incarnation of the pointer's
//!   stream replaces it whatever the cursors, one of an earlier incarnation or another stream never
//!   ([`protocol::pointer_replace_allowed`]); a bootstrap told the bucket's live stream refuses an
//!   artifact of another ([`protocol::bootstrap_stream_allowed`]).

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use object_store::path::Path as ObjectPath;
use object_store::{
    ObjectStore, ObjectStoreExt as _, PutMode, PutOptions, PutPayload, UpdateVersion,
};

use crate::artifact::{
    self, ArtifactError, ExportManifest, MANIFEST_FILE, ManifestStream, PreviousTarget,
};
use foldhost_core::protocol::{self, PointerState};

mod bootstrap;
mod upload;

#[cfg(test)]
use bootstrap::Concat;
use bootstrap::relative_to;

/// Size of one segment of a payload (the last one is shorter). `FOLDHOST_ARTIFACT_SEGMENT_BYTES`
/// overrides it, between [`MIN_SEGMENT_BYTES`] and [`MAX_SEGMENT_BYTES`].
pub(crate) const SEGMENT_BYTES: u64 = 16 << 20;
/// The smallest segment size a publisher may be set to.
pub(crate) const MIN_SEGMENT_BYTES: u64 = 64 << 10;
/// The largest segment a download accepts (a listing saying more is refused): the bound on what
/// one segment fetched ahead can hold in memory.
pub const MAX_SEGMENT_BYTES: u64 = 64 << 20;
/// The most segments one payload may have (a listing with more is refused): their names stay six
/// digits.
pub(crate) const MAX_SEGMENTS: usize = 1_000_000;
/// Bytes of segments a download fetches ahead of the one the import is reading (at least one
/// segment is always fetched ahead when there is one).
pub(crate) const READAHEAD_BYTES: u64 = 32 << 20;
/// Segments of one upload in flight at once (memory: about this many segments).
pub(crate) const UPLOAD_CONCURRENCY: usize = 2;

/// Attempts at publishing a pointer against concurrent exporters before giving up.
pub(crate) const POINTER_ATTEMPTS: u32 = 8;

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
    /// An object is larger than what is read of its kind: refused before its body is read.
    #[error("{what} {path}: {size} bytes, over the limit of {limit} bytes; not read")]
    TooLarge {
        /// What the object is.
        what: &'static str,
        /// The object.
        path: String,
        /// Its size, as the store reports it.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The pointer names an artifact of another stream than the one asked for.
    #[error("artifact {key}: it folds {artifact}, but {ours}; {what}")]
    OtherStream {
        /// The artifact key.
        key: String,
        /// The pointer's artifact's stream.
        artifact: String,
        /// Ours, in words (`this exporter folds …`, `the bucket is …`).
        ours: String,
        /// What was refused.
        what: &'static str,
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

impl TransportError {
    /// Whether a download failed because its payload is gone (an object not found, or a segment
    /// listing with a hole: a prune deleting it meanwhile): a bootstrap reads the pointer again
    /// and retries once.
    pub(crate) fn payload_gone(&self) -> bool {
        match self {
            TransportError::Store { source, .. } => {
                matches!(source, object_store::Error::NotFound { .. })
            }
            TransportError::Io { op, .. } => *op == LIST_SEGMENTS_OP,
            _ => false,
        }
    }
}

/// The operation named by a refused segment listing.
const LIST_SEGMENTS_OP: &str = "list the payload's segments";

/// The pointer object as read: its bytes (`None`: over [`artifact::MAX_MANIFEST_BYTES`], not
/// read), its size, the version a conditional update must match and its last change.
struct PointerObject {
    bytes: Option<Vec<u8>>,
    size: u64,
    version: UpdateVersion,
    last_modified_ms: i64,
}

/// The published pointer: its exact bytes, the manifest they parse to, and when it was published.
#[derive(Clone, Debug)]
pub struct Pointer {
    /// The manifest's bytes, exactly.
    pub bytes: Vec<u8>,
    /// The manifest.
    pub manifest: ExportManifest,
    /// When the pointer object was last written, Unix milliseconds (the store's clock).
    pub published_unix_ms: i64,
}

impl Pointer {
    /// The targets prune judges against: this one and the previous ones it lists, each
    /// `(cursor, published_unix_ms)`.
    pub(crate) fn targets(&self) -> Vec<(u64, i64)> {
        std::iter::once((self.manifest.cursor.unwrap_or(0), self.published_unix_ms))
            .chain(
                self.manifest
                    .previous
                    .iter()
                    .map(|p| (p.cursor, p.published_unix_ms)),
            )
            .collect()
    }
}

/// A stream in words, for one-line messages.
fn stream_words(s: Option<&ManifestStream>) -> String {
    s.map_or_else(
        || "an unrecorded stream".to_string(),
        |s| s.identity().to_string(),
    )
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
    /// The size of the segments this transport publishes.
    segment_bytes: u64,
    /// The store is the local file system (`file://`): its objects are read as files.
    local: bool,
}

/// What [`ArtifactTransport::upload`] published.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Published {
    /// The artifact's cursor.
    pub cursor: u64,
    /// The payload's object path (the directory of its segments).
    pub payload: String,
    /// How many segments it was cut into.
    pub segments: usize,
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
pub(crate) fn payload_cursor(name: &str) -> Option<u64> {
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

/// The name of segment `i` of a payload: six digits (below [`MAX_SEGMENTS`]).
pub fn segment_name(i: usize) -> String {
    format!("{i:06}")
}

/// The payload an object belongs to, from its path relative to the key's segment directory
/// (`X.tar/NNNNNN`, a segment of `X.tar`) or payloads directory (`X.tar`, a whole payload of the
/// earlier layout): the first component. Prune judges payloads, so every segment of one stands
/// or falls with it; an object of no such shape is judged under a name that carries no cursor.
pub(crate) fn payload_of(relative: &str) -> &str {
    match relative.split_once('/') {
        Some((first, _)) => first,
        None => relative,
    }
}

/// The segments of a payload, in order, from a listing of its segment directory (each object's
/// name and size): `Ok` of the sizes when the names are exactly `000000` up to the count, at most
/// [`MAX_SEGMENTS`], each of 1 to [`MAX_SEGMENT_BYTES`] bytes; otherwise why not. An empty listing
/// is an empty plan (the payload is not segmented). The listing comes from the store, so nothing
/// in it is trusted: a gap would feed the import a tar with a hole, an oversized segment would
/// break the download's memory bound.
pub(crate) fn segment_plan(listed: &[(String, u64)]) -> Result<Vec<u64>, String> {
    if listed.len() > MAX_SEGMENTS {
        // The listing stops one past the limit, so its length is not the store's count.
        return Err(format!("more than {MAX_SEGMENTS} segments listed"));
    }
    let mut sizes = std::collections::BTreeMap::new();
    for (name, size) in listed {
        let index = (name.len() == 6 && name.bytes().all(|b| b.is_ascii_digit()))
            .then(|| name.parse::<usize>().ok())
            .flatten()
            .ok_or_else(|| format!("{name:?} is not a segment's name (six digits)"))?;
        if *size == 0 || *size > MAX_SEGMENT_BYTES {
            return Err(format!(
                "segment {name} is {size} bytes (1 to {MAX_SEGMENT_BYTES} allowed)"
            ));
        }
        if sizes.insert(index, *size).is_some() {
            return Err(format!("segment {name} is listed twice"));
        }
    }
    // Indices ascend from the map; the first that is not its position names the gap.
    let mut plan = Vec::with_capacity(sizes.len());
    for (position, (index, size)) in sizes.into_iter().enumerate() {
        if index != position {
            return Err(format!(
                "segment {} is missing ({} listed, up to {})",
                segment_name(position),
                listed.len(),
                segment_name(index.max(position))
            ));
        }
        plan.push(size);
    }
    Ok(plan)
}

/// The segment size set by `FOLDHOST_ARTIFACT_SEGMENT_BYTES`, or [`SEGMENT_BYTES`].
fn segment_bytes_from_env() -> Result<u64, String> {
    match std::env::var("FOLDHOST_ARTIFACT_SEGMENT_BYTES") {
        Err(_) => Ok(SEGMENT_BYTES),
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|n| (MIN_SEGMENT_BYTES..=MAX_SEGMENT_BYTES).contains(n))
            .ok_or_else(|| {
                format!(
                    "FOLDHOST_ARTIFACT_SEGMENT_BYTES={v}: not a size from {MIN_SEGMENT_BYTES} to {MAX_SEGMENT_BYTES} bytes"
                )
            }),
    }
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
        let segment_bytes = segment_bytes_from_env().map_err(bad)?;
        // The local file system creates conditionally but cannot update conditionally.
        let local = u.scheme() == "file";
        Ok(ArtifactTransport {
            store: Arc::from(store),
            prefix,
            url: url.to_string(),
            atomic_pointer: !local,
            allow_non_atomic,
            segment_bytes,
            local,
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

    /// Where the segmented payloads of `key` live (beside its payloads directory, see the module
    /// docs).
    fn segments_root(&self, key: &str) -> ObjectPath {
        self.prefix.clone().join(format!("{key}.segments"))
    }

    /// The directory of the segments of the payload `name` of `key`.
    fn segments_dir(&self, key: &str, name: &str) -> ObjectPath {
        self.segments_root(key).join(name)
    }

    fn store_err(
        what: &'static str,
        path: &ObjectPath,
    ) -> impl FnOnce(object_store::Error) -> TransportError {
        let path = path.to_string();
        move |source| TransportError::Store { what, path, source }
    }

    /// The pointer object of `pointer`, its size read first: one over
    /// [`artifact::MAX_MANIFEST_BYTES`] is not read at all, and a smaller one is read as a range of
    /// the size its metadata gave (an object replaced in between is read no further).
    async fn read_pointer_object(
        &self,
        pointer: &ObjectPath,
    ) -> Result<Option<PointerObject>, TransportError> {
        let head = match self.store.head(pointer).await {
            Ok(m) => m,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(Self::store_err("read pointer", pointer)(e)),
        };
        let limit = artifact::MAX_MANIFEST_BYTES;
        let of = |m: &object_store::ObjectMeta| {
            (
                UpdateVersion {
                    e_tag: m.e_tag.clone(),
                    version: m.version.clone(),
                },
                m.last_modified.timestamp_millis(),
            )
        };
        if head.size > limit || head.size == 0 {
            let (version, last_modified_ms) = of(&head);
            return Ok(Some(PointerObject {
                bytes: (head.size == 0).then(Vec::new),
                size: head.size,
                version,
                last_modified_ms,
            }));
        }
        let opts = object_store::GetOptions {
            range: Some(object_store::GetRange::Bounded(0..head.size)),
            ..Default::default()
        };
        let r = match self.store.get_opts(pointer, opts).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(Self::store_err("read pointer", pointer)(e)),
        };
        let (version, last_modified_ms) = of(&r.meta);
        let size = r.meta.size;
        let bytes = r
            .bytes()
            .await
            .map_err(Self::store_err("read pointer", pointer))?;
        Ok(Some(PointerObject {
            // Replaced by a larger object since the size was read: too large (nothing past the
            // range was read); by another one within the limit: what the range read, which parses
            // only if it is whole.
            bytes: (size <= limit).then(|| bytes.to_vec()),
            size,
            version,
            last_modified_ms,
        }))
    }

    /// The pointer's state, the version a conditional update must match, and the stream its
    /// artifact records. A pointer too large to read is corrupt (replaceable).
    async fn read_pointer_state(
        &self,
        pointer: &ObjectPath,
    ) -> Result<(PointerState, Option<UpdateVersion>, Option<ManifestStream>), TransportError> {
        let Some(o) = self.read_pointer_object(pointer).await? else {
            return Ok((PointerState::Absent, None, None));
        };
        let (state, stream) = match o.bytes.as_deref().and_then(parse_pointer) {
            Some(m) => (PointerState::At(m.cursor.unwrap_or(0)), m.stream),
            None => (PointerState::Corrupt, None),
        };
        Ok((state, Some(o.version), stream))
    }

    /// The published pointer of `key`, if any; a corrupt pointer reads as none, and one over
    /// [`artifact::MAX_MANIFEST_BYTES`] is refused ([`TransportError::TooLarge`]) without being
    /// read.
    pub(crate) async fn published(&self, key: &str) -> Result<Option<Pointer>, TransportError> {
        let path = self.pointer_path(key);
        let Some(o) = self.read_pointer_object(&path).await? else {
            return Ok(None);
        };
        let Some(bytes) = o.bytes else {
            return Err(TransportError::TooLarge {
                what: "artifact pointer",
                path: path.to_string(),
                size: o.size,
                limit: artifact::MAX_MANIFEST_BYTES,
            });
        };
        Ok(parse_pointer(&bytes).map(|manifest| Pointer {
            bytes,
            manifest,
            published_unix_ms: o.last_modified_ms,
        }))
    }

    /// The published manifest of `key` (its exact bytes, parsed), if any; a corrupt pointer reads
    /// as none (see [`Self::published`]).
    pub async fn pointer(&self, key: &str) -> Result<Option<Pointer>, TransportError> {
        self.published(key).await
    }

    /// Every object under `dir`: its path relative to `dir`, its last change (Unix milliseconds)
    /// and its location.
    async fn list_under(
        &self,
        dir: &ObjectPath,
    ) -> Result<Vec<(String, i64, ObjectPath)>, TransportError> {
        let mut listed = self.store.list(Some(dir));
        let mut out = Vec::new();
        while let Some(meta) = listed.next().await {
            let meta = meta.map_err(Self::store_err("list", dir))?;
            let relative = relative_to(dir, &meta.location);
            out.push((
                relative,
                meta.last_modified.timestamp_millis(),
                meta.location,
            ));
        }
        Ok(out)
    }

    /// Deletes the payloads of `key` that [`protocol::payload_prunable`] allows at `now`: below the
    /// pointer's cursor, replaced (and uploaded) more than `grace` ago, and never the pointer's
    /// target (with no pointer, none); a segmented payload goes with all its segments. Returns how
    /// many payloads went.
    pub async fn prune(
        &self,
        key: &str,
        grace: Duration,
        now: clock::Now,
    ) -> Result<u64, TransportError> {
        let pointer = self.pointer(key).await?;
        let pointer_cursor = pointer.as_ref().map(|p| p.manifest.cursor.unwrap_or(0));
        let targets = pointer.as_ref().map(Pointer::targets).unwrap_or_default();
        let target = pointer.map(|p| payload_name(&p.bytes, p.manifest.cursor.unwrap_or(0)));
        // Each payload with its objects (a whole one, or its segments), judged as one: its age is
        // its newest object's, so a payload being uploaded again is as young as its last segment.
        let mut payloads: std::collections::BTreeMap<String, (i64, Vec<ObjectPath>)> =
            std::collections::BTreeMap::new();
        let mut listed = self.list_under(&self.payloads_dir(key)).await?;
        listed.extend(self.list_under(&self.segments_root(key)).await?);
        for (relative, modified, location) in listed {
            let entry = payloads
                .entry(payload_of(&relative).to_string())
                .or_insert((i64::MIN, Vec::new()));
            entry.0 = entry.0.max(modified);
            entry.1.push(location);
        }
        let mut n = 0;
        for (name, (modified, objects)) in payloads {
            let is_target = target.as_deref() == Some(name.as_str());
            let age = now.since(modified);
            let cursor = payload_cursor(&name);
            let since_superseded =
                protocol::payload_superseded_at(cursor, &targets).map(|t| now.since(t));
            if !protocol::payload_prunable(
                is_target,
                cursor,
                pointer_cursor,
                age,
                since_superseded,
                grace,
            ) {
                continue;
            }
            for path in objects {
                match self.store.delete(&path).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(Self::store_err("prune", &path)(e)),
                }
            }
            n += 1;
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
            Now(foldhost_core::status::now_unix_ms() as i64)
        }

        /// How long ago `then_ms` was (zero when it is in the future).
        pub(crate) fn since(self, then_ms: i64) -> Duration {
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
    fn a_segment_listing_is_a_plan_only_when_contiguous_from_zero_and_within_the_bounds() {
        let l = |items: &[(&str, u64)]| -> Vec<(String, u64)> {
            items.iter().map(|(n, s)| (n.to_string(), *s)).collect()
        };
        assert_eq!(segment_plan(&[]), Ok(vec![]));
        // Listed in any order, planned in index order.
        assert_eq!(
            segment_plan(&l(&[("000002", 3), ("000000", 10), ("000001", 10)])),
            Ok(vec![10, 10, 3])
        );
        for (bad, words) in [
            (
                l(&[("000000", 10), ("000002", 3)]),
                "segment 000001 is missing",
            ),
            (l(&[("000001", 10)]), "segment 000000 is missing"),
            (l(&[("000000", 10), ("000000", 10)]), "listed twice"),
            (l(&[("0", 10)]), "not a segment's name"),
            (l(&[("00000a", 10)]), "not a segment's name"),
            (l(&[("0000000", 10)]), "not a segment's name"),
            (l(&[("x/000000", 10)]), "not a segment's name"),
            (l(&[("000000", 0)]), "0 bytes"),
            (l(&[("000000", MAX_SEGMENT_BYTES + 1)]), "bytes (1 to"),
        ] {
            let e = segment_plan(&bad).expect_err(&format!("{bad:?}"));
            assert!(e.contains(words), "{bad:?}: {e}");
        }
        assert_eq!(
            segment_plan(&l(&[("000000", MAX_SEGMENT_BYTES)])),
            Ok(vec![MAX_SEGMENT_BYTES])
        );
        assert_eq!(segment_name(7), "000007");
        assert_eq!(segment_name(MAX_SEGMENTS - 1), "999999");
    }

    #[test]
    fn every_segment_of_a_payload_belongs_to_it_and_other_objects_to_themselves() {
        let name = payload_name(b"m", 5);
        assert_eq!(payload_of(&name), name);
        assert_eq!(payload_of(&format!("{name}/000003")), name);
        assert_eq!(
            payload_cursor(payload_of(&format!("{name}/000000"))),
            Some(5)
        );
        // A foreign directory is judged under its own name, without a cursor (prunable once a
        // pointer exists).
        assert_eq!(payload_of("junk/000000"), "junk");
        assert_eq!(payload_cursor(payload_of("junk/000000")), None);
    }

    #[test]
    fn concatenated_readers_read_as_one_across_empty_and_short_parts() {
        use std::io::Read as _;
        let parts = [&b"ab"[..], b"", b"cde", b"f"].into_iter().map(Ok);
        let mut out = Vec::new();
        let mut r = Concat {
            parts,
            current: None,
        };
        let mut buf = [0u8; 2];
        loop {
            let n = r.read(&mut buf).expect("slices read");
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        assert_eq!(out, b"abcdef");
    }

    #[test]
    fn prune_ages_are_never_negative() {
        let now = clock::Now(10_000);
        assert_eq!(now.since(4_000), Duration::from_secs(6));
        assert_eq!(now.since(20_000), Duration::ZERO);
    }
}
