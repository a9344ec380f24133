//! The capability traits of `foldhost_core::kv` implemented for [`NatsKv`].

use super::*;

fn version_u64(v: VersionToken) -> Result<u64, KvError> {
    v.as_u64()
        .ok_or_else(|| KvError::Invalid(format!("{v:?} is not a NATS revision")))
}

#[async_trait]
impl KvReader for NatsKv {
    async fn get(&self, key: &str) -> Result<Option<KvEntry>, KvError> {
        Ok(self.entry(key).await?.filter(|e| !e.value.is_empty()))
    }

    /// The key's latest message, read from the stream leader as JSON
    /// (`$JS.API.STREAM.MSG.GET`, `last_by_subj`) and decoded by [`protocol::decode_stored`]: no
    /// stored header block reaches the client library (a direct get hands it the block as
    /// stored). An undecodable latest message is an error naming it: what the key holds is then
    /// unknown.
    async fn entry(&self, key: &str) -> Result<Option<KvEntry>, KvError> {
        if !protocol::kv_key_valid(key) {
            return Err(KvError::Invalid(format!("{key:?} is not a valid key")));
        }
        let request =
            serde_json::json!({ "last_by_subj": format!("{}{key}", self.subject_prefix) });
        let answer = timed("entry", self.timeout, async {
            self.client
                .request(
                    format!("$JS.API.STREAM.MSG.GET.{}", self.stream_name),
                    request.to_string().into(),
                )
                .await
                .map_err(|e| backend("entry", e))
        })
        .await?;
        let Some(m) =
            catchup::parse_msg_get_reply(&answer.payload).map_err(|e| backend("entry", e))?
        else {
            return Ok(None);
        };
        let version = VersionToken::from_u64(m.sequence);
        match m.verdict {
            Ok(protocol::KvOp::Put) => Ok(Some(KvEntry {
                key: key.to_string(),
                value: m.payload,
                version,
            })),
            Ok(protocol::KvOp::Delete | protocol::KvOp::Purge) => Ok(Some(KvEntry {
                key: key.to_string(),
                value: Bytes::new(),
                version,
            })),
            Err(reason) => Err(backend(
                "entry",
                format!(
                    "the latest message of {key:?} (revision {}) is undecodable: {reason}",
                    m.sequence
                ),
            )),
        }
    }

    async fn keys(&self, prefix: &str) -> Result<Vec<String>, KvError> {
        Ok(self
            .list(prefix, true)
            .await?
            .into_iter()
            .map(|e| e.key)
            .collect())
    }

    async fn scan(&self, prefix: &str) -> Result<Vec<KvEntry>, KvError> {
        self.list(prefix, false).await
    }

    async fn for_each_key(
        &self,
        scope: &WatchScope,
        each: &mut (dyn FnMut(String) -> Result<(), KvError> + Send),
    ) -> Result<u64, KvError> {
        self.list_each(scope, true, &mut |e| each(e.key)).await
    }
}

#[async_trait]
impl KvWriter for NatsKv {
    async fn put(&self, key: &str, value: Bytes) -> Result<VersionToken, KvError> {
        timed("put", self.timeout, async {
            self.kv
                .put(key, value)
                .await
                .map(VersionToken::from_u64)
                .map_err(|e| backend("put", e))
        })
        .await
    }

    async fn create(&self, key: &str, value: Bytes) -> Result<VersionToken, KvError> {
        timed("create", self.timeout, async {
            match self.kv.create(key, value).await {
                Ok(r) => Ok(VersionToken::from_u64(r)),
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                    Err(KvError::AlreadyExists(key.to_string()))
                }
                Err(e) => Err(backend("create", e)),
            }
        })
        .await
    }

    async fn update(
        &self,
        key: &str,
        value: Bytes,
        expected: VersionToken,
    ) -> Result<VersionToken, KvError> {
        let rev = version_u64(expected)?;
        timed("update", self.timeout, async {
            match self.kv.update(key, value, rev).await {
                Ok(r) => Ok(VersionToken::from_u64(r)),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                    Err(KvError::RevisionMismatch {
                        key: key.to_string(),
                        expected,
                    })
                }
                Err(e) => Err(backend("update", e)),
            }
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<bool, KvError> {
        timed("delete", self.timeout, async {
            self.kv.delete(key).await.map_err(|e| backend("delete", e))
        })
        .await?;
        Ok(true)
    }
}

#[async_trait]
impl KvWatcher for NatsKv {
    async fn retention(&self) -> Result<Option<foldhost_core::protocol::Retention>, KvError> {
        self.read_retention().await.map(Some)
    }

    async fn stored_at(&self, revision: u64) -> Result<Option<u64>, KvError> {
        self.record_time_at(revision).await
    }

    async fn stream_state(&self) -> Result<Option<StreamState>, KvError> {
        let info = self.stream_info().await?;
        Ok(Some(StreamState {
            identity: identity_of(&info),
            last_sequence: info.state.last_sequence,
        }))
    }

    async fn state_and_retention(
        &self,
    ) -> Result<
        (
            Option<StreamState>,
            Option<foldhost_core::protocol::Retention>,
        ),
        KvError,
    > {
        let info = self.stream_info().await?;
        let state = StreamState {
            identity: identity_of(&info),
            last_sequence: info.state.last_sequence,
        };
        Ok((Some(state), Some(retention_of(&info))))
    }

    fn bucket_name(&self) -> String {
        self.bucket.clone()
    }

    fn pin_identity(&self, identity: StreamIdentity) {
        if let Ok(mut p) = self.pinned.lock() {
            *p = Some(identity);
        }
    }

    async fn watch(&self, scope: &WatchScope, tx: mpsc::Sender<WatchEvent>) -> Result<(), KvError> {
        self.run_watch(scope, consumer::DeliverPolicy::LastPerSubject, tx)
            .await
    }

    async fn watch_from(
        &self,
        scope: &WatchScope,
        cursor: WatchCursor,
        tx: mpsc::Sender<WatchEvent>,
    ) -> Result<(), KvError> {
        let Some(rev) = cursor.revision() else {
            return self.watch(scope, tx).await;
        };
        let pos = self.positions().await?;
        if !protocol::resume_window_ok(rev, pos.first_sequence) {
            if let Some(start) = self.supersession_resume(cursor).await? {
                return self
                    .run_watch(
                        scope,
                        consumer::DeliverPolicy::ByStartSequence {
                            start_sequence: start,
                        },
                        tx,
                    )
                    .await;
            }
            return Err(KvError::CursorExpired {
                resume_from: rev.saturating_add(1),
                first_sequence: pos.first_sequence,
            });
        }
        self.run_watch(
            scope,
            consumer::DeliverPolicy::ByStartSequence {
                start_sequence: rev.saturating_add(1),
            },
            tx,
        )
        .await
    }
}
