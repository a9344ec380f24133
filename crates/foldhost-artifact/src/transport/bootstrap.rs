//! Bootstrapping: the pointer read, its payload's segments fetched ahead in order and imported as one tar stream (or files from a local store).

use super::*;

impl ArtifactTransport {
    /// Makes the store `dest` (absent, or an empty directory) from the artifact the pointer of
    /// `key` names, streaming the payload from the object store straight into the import
    /// ([`artifact::import_tar_stream`]): every file is written once, into the stage, while it is
    /// hashed against the pointer's manifest; nothing is stored as a tar first. The payload's
    /// segments are fetched several at once and handed over in order. Memory: the segment being
    /// read and those fetched beside it ([`READAHEAD_BYTES`], or one segment when one is larger),
    /// the channel's few chunks and the import's buffer, never the artifact. On any failure `dest`
    /// is untouched.
    ///
    /// `live`, when given, is the bucket's stream now: an artifact of another stream is refused
    /// before anything is downloaded ([`protocol::bootstrap_stream_allowed`]). A payload that
    /// vanishes mid-download (a prune after the pointer moved on) makes it read the pointer again
    /// and retry once, saying so in the log.
    pub async fn bootstrap_into(
        &self,
        key: &str,
        dest: &Path,
        want: Option<foldhost_core::storedir::Backend>,
        live: Option<&ManifestStream>,
    ) -> Result<ExportManifest, TransportError> {
        let read = self.pointer(key).await?;
        let first = read.as_ref().map(|p| p.bytes.clone());
        match self.bootstrap_from(key, read, dest, want, live).await {
            Err(e) if e.payload_gone() => {
                // Retried only when the pointer has moved on: a payload with a hole that it
                // still names is refused as it is.
                let again = self.pointer(key).await?;
                if again.as_ref().map(|p| &p.bytes) == first.as_ref() {
                    return Err(e);
                }
                tracing::warn!(event = "bootstrap_retrying", key, error = %e, "bootstrap: the payload vanished mid-download (pruned after the pointer moved on); read the pointer again, retrying once");
                self.bootstrap_from(key, again, dest, want, live).await
            }
            other => other,
        }
    }

    /// One bootstrap attempt from the pointer as `read`.
    async fn bootstrap_from(
        &self,
        key: &str,
        read: Option<Pointer>,
        dest: &Path,
        want: Option<foldhost_core::storedir::Backend>,
        live: Option<&ManifestStream>,
    ) -> Result<ExportManifest, TransportError> {
        let Some(Pointer {
            bytes: manifest_bytes,
            manifest,
            ..
        }) = read
        else {
            return Err(TransportError::NothingPublished {
                key: key.to_string(),
                url: self.url.clone(),
            });
        };
        check_bootstrap_stream(key, &manifest, live)?;
        foldhost_core::crashpoint::hold(foldhost_core::crashpoint::BOOTSTRAP_BEFORE_PAYLOAD).await;
        let segments = self
            .payload_segments(key, &manifest_bytes, &manifest)
            .await?;
        tracing::debug!(key, segments = segments.len(), "bootstrap: payload listed");
        if self.local {
            return self
                .bootstrap_from_files(segments, manifest_bytes, dest, want)
                .await;
        }
        self.bootstrap_from_stream(segments, manifest_bytes, dest, want)
            .await
    }

    /// The segments of the payload `manifest_bytes` names, in order: its listed segments when it
    /// has any (contiguous from zero, each with its listed size), else the earlier single object.
    async fn payload_segments(
        &self,
        key: &str,
        manifest_bytes: &[u8],
        manifest: &ExportManifest,
    ) -> Result<Vec<Segment>, TransportError> {
        let name = payload_name(manifest_bytes, manifest.cursor.unwrap_or(0));
        let dir = self.segments_dir(key, &name);
        let plan = segment_plan(&self.list_segments(&dir).await?).map_err(|reason| {
            TransportError::Io {
                path: PathBuf::from(dir.to_string()),
                op: LIST_SEGMENTS_OP,
                source: std::io::Error::other(reason),
            }
        })?;
        Ok(if plan.is_empty() {
            // The earlier layout: the payload as one object, its size whatever the store says.
            vec![Segment {
                path: self.payloads_dir(key).join(name),
                size: None,
            }]
        } else {
            plan.into_iter()
                .enumerate()
                .map(|(i, size)| Segment {
                    path: dir.clone().join(segment_name(i)),
                    size: Some(size),
                })
                .collect()
        })
    }

    /// [`Self::bootstrap_into`] from a remote store: the segments streamed, fetched ahead, into
    /// the import on a blocking thread; a download error wins over the import's error it caused.
    async fn bootstrap_from_stream(
        &self,
        segments: Vec<Segment>,
        manifest_bytes: Vec<u8>,
        dest: &Path,
        want: Option<foldhost_core::storedir::Backend>,
    ) -> Result<ExportManifest, TransportError> {
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
        let download_error = match self.feed_segments(&segments, &tx).await {
            Ok(()) => None,
            Err(e) => {
                // The import stops at this error; a closed channel means it stopped already.
                let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
                Some(e)
            }
        };
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

    /// Sends the bytes of `segments`, in order, to the import: the head segment streams through
    /// while the ones behind it (up to [`READAHEAD_BYTES`], at least one) download beside it.
    /// Returns early, without error, when the import has stopped (its own error says why).
    async fn feed_segments(
        &self,
        segments: &[Segment],
        tx: &tokio::sync::mpsc::Sender<std::io::Result<bytes::Bytes>>,
    ) -> Result<(), TransportError> {
        let mut fetching: std::collections::VecDeque<Fetch> = std::collections::VecDeque::new();
        let mut next = 0;
        // Each fetch sends its request once the one before it has its response: a store that
        // reads a whole object before answering (moto) then prepares one segment while it sends
        // the one before, instead of all of them at once while the import waits for the first.
        let mut go: Option<tokio::sync::oneshot::Receiver<()>> = None;
        loop {
            // Start fetches while what is fetched behind the head stays under the read-ahead.
            while next < segments.len() {
                let ahead: u64 = fetching
                    .iter()
                    .skip(1)
                    .map(|f| f.segment.size.unwrap_or(MAX_SEGMENT_BYTES))
                    .sum();
                let size = segments[next].size.unwrap_or(MAX_SEGMENT_BYTES);
                if fetching.len() >= 2 && ahead + size > READAHEAD_BYTES {
                    break;
                }
                let (fetch, after) =
                    Fetch::start(Arc::clone(&self.store), segments[next].clone(), go.take());
                fetching.push_back(fetch);
                go = Some(after);
                next += 1;
            }
            let Some(mut head) = fetching.pop_front() else {
                return Ok(());
            };
            tracing::debug!(segment = %head.segment.path, "bootstrap: segment's turn");
            let mut got: u64 = 0;
            loop {
                let chunk = tokio::select! {
                    chunk = head.chunks.recv() => chunk,
                    // The import stopped (its error says why): stop waiting on the store.
                    () = tx.closed() => return Ok(()),
                };
                let Some(chunk) = chunk else { break };
                let chunk = chunk?;
                got += chunk.len() as u64;
                if tx.send(Ok(chunk)).await.is_err() {
                    return Ok(());
                }
            }
            // The fetch checks the length as it reads; this holds should its task have ended
            // without a word.
            if let Some(size) = head.segment.size.filter(|&s| s != got) {
                return Err(TransportError::Io {
                    path: PathBuf::from(head.segment.path.to_string()),
                    op: "download",
                    source: std::io::Error::other(format!(
                        "{got} bytes of the {size} listed for this segment"
                    )),
                });
            }
            tracing::debug!(segment = %head.segment.path, "bootstrap: segment handed over");
        }
    }

    /// [`Self::bootstrap_into`] from the local file system: each segment read on the import's own
    /// blocking thread, one after the other. The store's stream would hand a local object over in
    /// 8 KiB chunks, each read by a blocking task of its own, which took a 150 MB bootstrap from
    /// about 0.3 to 1.8 s.
    async fn bootstrap_from_files(
        &self,
        segments: Vec<Segment>,
        manifest_bytes: Vec<u8>,
        dest: &Path,
        want: Option<foldhost_core::storedir::Backend>,
    ) -> Result<ExportManifest, TransportError> {
        // Opened here one after another and handed over through a short queue: a payload of
        // many segments never holds more than a few open at once.
        let (tx, mut rx) =
            tokio::sync::mpsc::channel::<std::io::Result<std::io::Take<std::fs::File>>>(2);
        let dest_owned = dest.to_path_buf();
        let import = tokio::task::spawn_blocking(move || {
            let parts = std::iter::from_fn(move || rx.blocking_recv());
            let reader = std::io::BufReader::with_capacity(
                LOCAL_READ_BYTES,
                Concat {
                    parts,
                    current: None,
                },
            );
            artifact::import_tar_stream(reader, &manifest_bytes, &dest_owned, want, &mut |_, _| {})
        });
        let mut open_error = None;
        for segment in &segments {
            let sent = match self.open_local(segment).await {
                Ok(file) => tx.send(Ok(file)).await,
                Err(e) => {
                    let line = e.to_string();
                    open_error = Some(e);
                    let _ = tx.send(Err(std::io::Error::other(line))).await;
                    break;
                }
            };
            // A closed queue: the import refused the payload already; its error says why.
            if sent.is_err() {
                break;
            }
        }
        drop(tx);
        let imported = import.await.map_err(|e| TransportError::Io {
            path: dest.to_path_buf(),
            op: "import task",
            source: std::io::Error::other(e.to_string()),
        })?;
        match (imported, open_error) {
            (Ok(m), _) => Ok(m),
            (Err(_), Some(open)) => Err(open),
            (Err(e), None) => Err(e.into()),
        }
    }

    /// A local segment's file, positioned at its start and limited to its length (which must be
    /// its listed size).
    async fn open_local(
        &self,
        segment: &Segment,
    ) -> Result<std::io::Take<std::fs::File>, TransportError> {
        use std::io::Seek as _;
        let r = self
            .store
            .get(&segment.path)
            .await
            .map_err(Self::store_err("download", &segment.path))?;
        let range = r.range.clone();
        let object_store::GetResultPayload::File(mut file, path) = r.payload else {
            return Err(TransportError::Io {
                path: PathBuf::from(segment.path.to_string()),
                op: "download",
                source: std::io::Error::other("the local store answered with a stream"),
            });
        };
        let len = range.end - range.start;
        if segment.size.is_some_and(|s| s != len) {
            return Err(TransportError::Io {
                path,
                op: "download",
                source: std::io::Error::other("the segment changed size since it was listed"),
            });
        }
        file.seek(std::io::SeekFrom::Start(range.start))
            .map_err(|source| TransportError::Io {
                path,
                op: "seek the payload",
                source,
            })?;
        Ok(file.take(len))
    }
}

/// Refuses to bootstrap `key` from an artifact of another stream than the bucket's `live` one
/// ([`protocol::bootstrap_stream_allowed`]); without `live` every artifact passes.
fn check_bootstrap_stream(
    key: &str,
    manifest: &ExportManifest,
    live: Option<&ManifestStream>,
) -> Result<(), TransportError> {
    if let Some(live) = live {
        let relation = protocol::stream_relation(
            Some(live.key()),
            manifest.stream.as_ref().map(ManifestStream::key),
        );
        if !protocol::bootstrap_stream_allowed(relation) {
            return Err(TransportError::OtherStream {
                key: key.to_string(),
                artifact: stream_words(manifest.stream.as_ref()),
                ours: format!("the bucket is {}", live.identity()),
                what: "refusing to bootstrap from another incarnation of the bucket",
            });
        }
    }
    Ok(())
}

/// The read size for a payload on the local file system.
const LOCAL_READ_BYTES: usize = 1 << 20;

/// Downloaded chunks queued between the object store's stream and the import (each is what the
/// store hands over, typically well under 1 MiB).
const DOWNLOAD_CHUNKS_IN_FLIGHT: usize = 8;

/// `location`'s path below `dir` (all of it when it is not below `dir`).
pub(super) fn relative_to(dir: &ObjectPath, location: &ObjectPath) -> String {
    location
        .as_ref()
        .strip_prefix(dir.as_ref())
        .and_then(|r| r.strip_prefix('/'))
        .unwrap_or(location.as_ref())
        .to_string()
}

/// One object of a payload to download, and its listed size (`None` for a whole payload of the
/// earlier layout, whose size is whatever the store sends).
#[derive(Clone, Debug)]
struct Segment {
    path: ObjectPath,
    size: Option<u64>,
}

/// A segment being downloaded by a task of its own into a channel. A listed segment's channel
/// holds as many chunks as come (its listed size bounds the bytes: the task stops with an error
/// at the first byte past it), so it downloads whole while the import reads an earlier one; a
/// whole payload of the earlier layout has no listed size, and its channel holds
/// [`DOWNLOAD_CHUNKS_IN_FLIGHT`] chunks, so the import's pace reaches the store. Dropping a
/// `Fetch` stops its task.
struct Fetch {
    segment: Segment,
    chunks: tokio::sync::mpsc::Receiver<Result<bytes::Bytes, TransportError>>,
    task: tokio::task::AbortHandle,
}

/// The chunks a listed segment's channel may hold (the bytes are bounded by its size).
const SEGMENT_CHUNKS: usize = 1 << 20;

impl Fetch {
    /// Starts downloading `segment` once `go` fires (or its sender is gone; at once without one).
    /// Returns the fetch and what fires when this one has its response (or has failed).
    fn start(
        store: Arc<dyn ObjectStore>,
        segment: Segment,
        go: Option<tokio::sync::oneshot::Receiver<()>>,
    ) -> (Fetch, tokio::sync::oneshot::Receiver<()>) {
        let capacity = match segment.size {
            Some(_) => SEGMENT_CHUNKS,
            None => DOWNLOAD_CHUNKS_IN_FLIGHT,
        };
        let (tx, chunks) = tokio::sync::mpsc::channel(capacity);
        let (responded, after) = tokio::sync::oneshot::channel();
        let seg = segment.clone();
        let task = tokio::spawn(tracing::Instrument::in_current_span(async move {
            if let Some(go) = go {
                let _ = go.await;
            }
            let got = store.get(&seg.path).await;
            let _ = responded.send(());
            let failed =
                |e: object_store::Error| ArtifactTransport::store_err("download", &seg.path)(e);
            let short = |what: String| TransportError::Io {
                path: PathBuf::from(seg.path.to_string()),
                op: "download",
                source: std::io::Error::other(what),
            };
            let mut stream = match got {
                Ok(r) => r.into_stream(),
                Err(e) => {
                    let _ = tx.send(Err(failed(e))).await;
                    return;
                }
            };
            tracing::debug!(segment = %seg.path, "bootstrap: segment's response");
            let mut got: u64 = 0;
            while let Some(chunk) = stream.next().await {
                let chunk = match chunk {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = tx.send(Err(failed(e))).await;
                        return;
                    }
                };
                got += chunk.len() as u64;
                if let Some(size) = seg.size.filter(|&s| got > s) {
                    let _ = tx
                        .send(Err(short(format!(
                            "more than the {size} bytes listed for this segment"
                        ))))
                        .await;
                    return;
                }
                if tx.send(Ok(chunk)).await.is_err() {
                    return;
                }
            }
            if let Some(size) = seg.size.filter(|&s| got != s) {
                let _ = tx
                    .send(Err(short(format!(
                        "{got} bytes of the {size} listed for this segment"
                    ))))
                    .await;
            }
        }))
        .abort_handle();
        (
            Fetch {
                segment,
                chunks,
                task,
            },
            after,
        )
    }
}

impl Drop for Fetch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A `Read` over several readers, one after the other, each taken from `parts` when the one
/// before is exhausted (an error in their place is answered as the read's).
pub(super) struct Concat<R, I> {
    pub(super) parts: I,
    pub(super) current: Option<R>,
}

impl<R: std::io::Read, I: Iterator<Item = std::io::Result<R>>> std::io::Read for Concat<R, I> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let part = match &mut self.current {
                Some(part) => part,
                None => match self.parts.next() {
                    Some(next) => self.current.insert(next?),
                    None => return Ok(0),
                },
            };
            let n = part.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            self.current = None;
        }
    }
}

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
