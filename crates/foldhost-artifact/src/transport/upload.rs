//! Publishing: a payload uploaded in segments, then the pointer replaced by compare-and-set.

use super::*;

impl ArtifactTransport {
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
        let manifest = artifact::read_manifest(artifact)?;
        let cursor = manifest.cursor.unwrap_or(0);
        // A pointer too large to read is replaced as a corrupt one (the publish decides).
        let current = match self.pointer(key).await {
            Err(TransportError::TooLarge { .. }) => None,
            other => other?,
        };
        check_not_already_published(key, current.as_ref(), &manifest, cursor)?;
        let published = published_manifest(&manifest, current.as_ref(), cursor);
        let manifest_bytes =
            serde_json::to_vec_pretty(&published).map_err(|e| ArtifactError::Manifest {
                path: manifest_path.clone(),
                reason: e.to_string(),
            })?;
        let name = payload_name(&manifest_bytes, cursor);
        let payload = self.segments_dir(key, &name);
        let segments = self
            .pack_and_upload(artifact, scratch, &name, &manifest_bytes, &payload)
            .await?;
        foldhost_core::crashpoint::hit(foldhost_core::crashpoint::PUBLISH_BEFORE_POINTER);
        foldhost_core::crashpoint::hold(foldhost_core::crashpoint::PUBLISH_BEFORE_POINTER).await;
        self.publish(key, &manifest_bytes, cursor, manifest.stream.as_ref())
            .await?;
        Ok(Published {
            cursor,
            payload: payload.to_string(),
            segments,
        })
    }

    /// Packs `artifact` (with `manifest_bytes` as its manifest) into a tar in `scratch` and
    /// uploads it as the segments of `payload`; returns their count. The tar is removed on every
    /// path.
    async fn pack_and_upload(
        &self,
        artifact: &Path,
        scratch: &Path,
        name: &str,
        manifest_bytes: &[u8],
        payload: &ObjectPath,
    ) -> Result<usize, TransportError> {
        std::fs::create_dir_all(scratch).map_err(|source| TransportError::Io {
            path: scratch.to_path_buf(),
            op: "create scratch",
            source,
        })?;
        let tar = scratch.join(format!(".upload-{name}"));
        let packed = {
            let (a, t, m) = (artifact.to_path_buf(), tar.clone(), manifest_bytes.to_vec());
            tokio::task::spawn_blocking(move || artifact::pack_tar_with(&a, &t, Some(&m)))
                .await
                .map_err(|e| TransportError::Io {
                    path: tar.clone(),
                    op: "pack task",
                    source: std::io::Error::other(e.to_string()),
                })
        };
        let result = match packed {
            Ok(Ok(())) => self.upload_segments(payload, &tar).await,
            Ok(Err(e)) => Err(e.into()),
            Err(e) => Err(e),
        };
        let _ = std::fs::remove_file(&tar);
        result
    }

    /// Cuts the file `tar` into segments under `dir`, each one atomic put (at most
    /// [`UPLOAD_CONCURRENCY`] in flight), then deletes any segment past their count (left by an
    /// earlier attempt at the same payload), so the listing a download reads is exactly this
    /// payload. Returns the count.
    async fn upload_segments(&self, dir: &ObjectPath, tar: &Path) -> Result<usize, TransportError> {
        let io = |op: &'static str| {
            let path = tar.to_path_buf();
            move |source| TransportError::Io { path, op, source }
        };
        let f = Arc::new(std::fs::File::open(tar).map_err(io("open packed payload"))?);
        let len = f.metadata().map_err(io("stat packed payload"))?.len();
        if len == 0 {
            return Err(TransportError::Io {
                path: tar.to_path_buf(),
                op: "cut into segments",
                source: std::io::Error::other("the packed payload is empty"),
            });
        }
        let count = usize::try_from(len.div_ceil(self.segment_bytes).max(1)).unwrap_or(usize::MAX);
        if count > MAX_SEGMENTS {
            return Err(TransportError::Io {
                path: tar.to_path_buf(),
                op: "cut into segments",
                source: std::io::Error::other(format!(
                    "{len} bytes make {count} segments of {} bytes, more than {MAX_SEGMENTS}",
                    self.segment_bytes
                )),
            });
        }
        let mut puts = futures::stream::FuturesUnordered::new();
        for i in 0..count {
            while puts.len() >= UPLOAD_CONCURRENCY {
                if let Some(done) = puts.next().await {
                    done?;
                }
            }
            let start = i as u64 * self.segment_bytes;
            let size = usize::try_from(self.segment_bytes.min(len - start)).unwrap_or(0);
            // Read on a blocking thread: a segment is up to 64 MiB, and an export round shares
            // the runtime with the fold.
            let file = Arc::clone(&f);
            let bytes = tokio::task::spawn_blocking(move || {
                use std::os::unix::fs::FileExt as _;
                let mut bytes = vec![0u8; size];
                file.read_exact_at(&mut bytes, start).map(|()| bytes)
            })
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|read| read)
            .map_err(io("read packed payload"))?;
            let path = dir.clone().join(segment_name(i));
            let store = Arc::clone(&self.store);
            puts.push(async move {
                store
                    .put(&path, PutPayload::from(bytes))
                    .await
                    .map(|_| ())
                    .map_err(Self::store_err("upload", &path))
            });
        }
        while let Some(done) = puts.next().await {
            done?;
        }
        for (name, _) in self.list_segments(dir).await? {
            let ours = name.len() == 6
                && name.bytes().all(|b| b.is_ascii_digit())
                && name.parse::<usize>().is_ok_and(|i| i < count);
            if !ours {
                let path = dir.clone().join(name);
                match self.store.delete(&path).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(Self::store_err("delete stale segment", &path)(e)),
                }
            }
        }
        Ok(count)
    }

    /// The objects under `dir` (a payload's segment directory): name and size each.
    pub(super) async fn list_segments(
        &self,
        dir: &ObjectPath,
    ) -> Result<Vec<(String, u64)>, TransportError> {
        let mut listed = self.store.list(Some(dir));
        let mut out = Vec::new();
        while let Some(meta) = listed.next().await {
            let meta = meta.map_err(Self::store_err("list", dir))?;
            let name = relative_to(dir, &meta.location);
            out.push((name, meta.size));
            // One past the limit is enough for `segment_plan` to refuse the listing: a store
            // holding millions of objects under the prefix is not read whole into memory first.
            if out.len() > MAX_SEGMENTS {
                break;
            }
        }
        Ok(out)
    }

    /// Moves the pointer of `key` to `manifest_bytes` (an artifact at `cursor` of `stream`), never
    /// backward within a stream, never to an earlier incarnation.
    async fn publish(
        &self,
        key: &str,
        manifest_bytes: &[u8],
        cursor: u64,
        stream: Option<&ManifestStream>,
    ) -> Result<(), TransportError> {
        let pointer = self.pointer_path(key);
        for _ in 0..POINTER_ATTEMPTS {
            let (state, version, theirs) = self.read_pointer_state(&pointer).await?;
            let relation = protocol::stream_relation(
                stream.map(ManifestStream::key),
                theirs.as_ref().map(ManifestStream::key),
            );
            if relation == protocol::StreamRelation::Other && matches!(state, PointerState::At(_)) {
                return Err(TransportError::OtherStream {
                    key: key.to_string(),
                    artifact: stream_words(theirs.as_ref()),
                    ours: format!("this exporter folds {}", stream_words(stream)),
                    what: "an earlier incarnation or another stream: the pointer stays",
                });
            }
            if relation == protocol::StreamRelation::Later && matches!(state, PointerState::At(_)) {
                tracing::warn!(event = "pointer_replacing_earlier_stream", key, ours = %stream_words(stream), theirs = %stream_words(theirs.as_ref()), "the pointer names an earlier incarnation of this stream: replacing it");
            }
            if !protocol::pointer_replace_allowed(state, cursor, relation) {
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
                    tracing::warn!(event = "pointer_non_atomic", key, url = %self.url, "publishing a NON-ATOMIC pointer (--allow-non-atomic-pointer): a concurrent exporter may overwrite a newer one");
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
                    tracing::info!(event = "pointer_published", key, cursor, url = %self.url, "artifact pointer published");
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
}

/// Refuses to publish the artifact the pointer `current` already names (ignoring its previous
/// targets): bootstraps are reading its segments, and the publish would be refused (an equal
/// cursor) after rewriting them.
fn check_not_already_published(
    key: &str,
    current: Option<&Pointer>,
    manifest: &ExportManifest,
    cursor: u64,
) -> Result<(), TransportError> {
    let unlisted = |m: &ExportManifest| ExportManifest {
        previous: Vec::new(),
        ..m.clone()
    };
    if let Some(p) = current
        && unlisted(&p.manifest) == unlisted(manifest)
    {
        return Err(TransportError::SupersededByNewer {
            key: key.to_string(),
            current: cursor,
            ours: cursor,
        });
    }
    Ok(())
}

/// The manifest published: the artifact's own with the pointer's recent targets below `cursor`
/// (what prune counts its grace from). Another incarnation's targets are not carried: their
/// cursors belong to another sequence.
fn published_manifest(
    manifest: &ExportManifest,
    current: Option<&Pointer>,
    cursor: u64,
) -> ExportManifest {
    let mut published = ExportManifest {
        previous: Vec::new(),
        ..manifest.clone()
    };
    if let Some(p) = current {
        let relation = protocol::stream_relation(
            manifest.stream.as_ref().map(ManifestStream::key),
            p.manifest.stream.as_ref().map(ManifestStream::key),
        );
        if matches!(
            relation,
            protocol::StreamRelation::Same | protocol::StreamRelation::Unknown
        ) {
            published.previous = p
                .targets()
                .into_iter()
                .filter(|(c, _)| *c < cursor)
                .take(artifact::MAX_PREVIOUS_TARGETS)
                .map(|(cursor, published_unix_ms)| PreviousTarget {
                    cursor,
                    published_unix_ms,
                })
                .collect();
        }
    }
    published
}
