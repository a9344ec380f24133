//! A swap's candidate: a new guest hydrated and caught up beside the running one, answering queries for a shadow before it is adopted.

use super::*;

/// A guest built beside the running one ([`Apply::swap_candidate`]): its own engine store and
/// instance, reading the fold through the swap's view (the fold at C until the cut-over).
pub(super) struct GuestCandidate {
    pub(super) core: Core,
    pub(super) live: Option<Live>,
    /// The running guest's manifest (a scope change is refused).
    pub(super) running: GuestManifest,
    /// Entries hydrated and how long it took, once hydrated.
    pub(super) hydrated: Option<(u64, Duration)>,
}

#[async_trait]
impl SwapCandidate for GuestCandidate {
    fn describe(&self) -> String {
        self.core.describe()
    }

    async fn hydrate(&mut self) -> Result<u64, ApplyError> {
        let mut live = self.core.instantiate().await?;
        self.core.manifest = self.core.call_manifest(&mut live).await?;
        live.store.data_mut().set_guest(self.core.describe());
        if self.core.manifest.scope != self.running.scope {
            return Err(self.core.err(
                "swap",
                format!(
                    "its scope {} differs from the running {} (a scope change needs a restart)",
                    self.core.manifest.watch_scope(),
                    self.running.watch_scope()
                ),
            ));
        }
        if self.core.manifest.state != self.running.state
            || self.core.manifest.reads != self.running.reads
        {
            return Err(self.core.err(
                "swap",
                "its state buckets differ from the running guest's (a change of `state` or `reads` needs a restart)".into(),
            ));
        }
        self.core.call_init(&mut live).await?;
        let stats = self
            .core
            .stream_fold(&mut live, true)
            .await
            .map_err(|e| self.core.err("swap", format!("hydration failed: {e}")))?;
        self.live = Some(live);
        self.hydrated = Some(stats);
        Ok(stats.0)
    }

    async fn catch_up(&mut self, updates: &[KvUpdate]) -> Result<(), ApplyError> {
        let Some(mut live) = self.live.take() else {
            return Err(self
                .core
                .err("swap", "caught up before it was hydrated".into()));
        };
        let scope = self.core.manifest.watch_scope();
        let updates: Vec<bindings::Update<'_>> = updates
            .iter()
            .filter(|u| scope.contains(u.key()))
            .map(bindings::to_wit_update)
            .collect();
        self.core
            .feed(&mut live, "", updates)
            .await
            .map_err(|e| self.core.err("swap", format!("catch-up failed: {e}")))?;
        self.live = Some(live);
        Ok(())
    }

    async fn catch_up_lanes(&mut self) -> Result<(), ApplyError> {
        let Some(mut live) = self.live.take() else {
            return Err(self
                .core
                .err("swap", "caught up before it was hydrated".into()));
        };
        let entries = self
            .core
            .hydrate_lanes(&mut live)
            .await
            .map_err(|e| self.core.err("swap", format!("state buckets: {e}")))?;
        if let Some(h) = self.hydrated.as_mut() {
            h.0 += entries;
        }
        self.live = Some(live);
        Ok(())
    }

    async fn apply_lane(&mut self, bucket: &str, updates: &[KvUpdate]) -> Result<(), ApplyError> {
        if bucket.is_empty() || self.core.lane(bucket).is_none() {
            return Err(self.core.err(
                "apply",
                format!("{bucket:?} is not a bucket this guest declares"),
            ));
        }
        let Some(mut live) = self.live.take() else {
            return Err(self.core.err(
                "apply",
                "a state bucket's batch before it was hydrated".into(),
            ));
        };
        let updates: Vec<bindings::Update<'_>> =
            updates.iter().map(bindings::to_wit_update).collect();
        self.core.feed(&mut live, bucket, updates).await?;
        self.live = Some(live);
        Ok(())
    }

    async fn query(&mut self, request: &[u8]) -> Result<Result<Vec<u8>, String>, ApplyError> {
        let Some(mut live) = self.live.take() else {
            return Err(self
                .core
                .err("query", "queried before it was hydrated".into()));
        };
        let answer = self.core.query(&mut live, request).await?;
        self.live = Some(live);
        Ok(answer)
    }

    fn begin_capture(&mut self) {
        self.core.begin_capture();
    }

    fn take_captured(&mut self) -> Vec<foldhost_fold::applied::CapturedWrite> {
        self.core.take_captured()
    }

    fn end_capture(&mut self) {
        self.core.end_capture();
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}
