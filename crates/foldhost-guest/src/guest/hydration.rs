//! Hydration's pages: the fold read in key order on a thread of its own, a page at a time, each page handed to the guest and reused.

use super::*;

/// One hydration page: its entries' keys in one string and their values in one buffer, both
/// reused from page to page, and where each entry's lie in them.
#[derive(Default)]
pub(super) struct Page {
    pub(super) keys: String,
    pub(super) values: Vec<u8>,
    /// Per entry: its key's end in `keys`, its value's end in `values`, its revision (each starts
    /// where the entry before it ends).
    pub(super) items: Vec<(usize, usize, u64)>,
}

impl Page {
    pub(super) fn clear(&mut self) {
        self.keys.clear();
        self.values.clear();
        self.items.clear();
    }

    pub(super) fn push(&mut self, e: &KvEntry) {
        self.keys.push_str(&e.key);
        self.values.extend_from_slice(&e.value);
        self.items.push((
            self.keys.len(),
            self.values.len(),
            e.version.as_u64().unwrap_or(0),
        ));
    }

    pub(super) fn last_key(&self) -> Option<&str> {
        let n = self.items.len();
        let end = self.items.last()?.0;
        let start = n.checked_sub(2).map_or(0, |i| self.items[i].0);
        self.keys.get(start..end)
    }

    /// The page's entries as puts, borrowing the page.
    pub(super) fn updates(&self) -> Vec<bindings::Update<'_>> {
        let (mut key_at, mut value_at) = (0, 0);
        self.items
            .iter()
            .map(|&(key_end, value_end, revision)| {
                let u = bindings::Update {
                    // Whole keys were pushed: every boundary is a character boundary.
                    key: self.keys.get(key_at..key_end).unwrap_or_default(),
                    value: &self.values[value_at..value_end],
                    revision,
                    op: bindings::Op::Put,
                };
                (key_at, value_at) = (key_end, value_end);
                u
            })
            .collect()
    }
}

/// Pages of the fold read ahead of a hydration on a blocking task of its own
/// ([`Core::stream_fold`]).
///
/// Two pages circulate: the reader fills one while the hydration feeds the other to the guest, and
/// the fed page comes back through [`PageReader::recycle`]. Dropped (the hydration ended, failed,
/// or its task was aborted), its channels close and the reader ends after the page it is reading.
/// A blocking task rather than a bare thread: while it runs, a runtime with paused time (the
/// simulator) does not jump its clock ahead as if everything were idle.
pub(super) struct PageReader {
    full: tokio::sync::mpsc::Receiver<Result<Page, foldhost_core::snapshot::SnapshotError>>,
    empty: std::sync::mpsc::Sender<Page>,
}

impl PageReader {
    /// Starts reading `prefixes` (each in key order, `chunk` entries a page) through `fold`.
    pub(super) fn start(fold: Arc<dyn FoldRead>, prefixes: Vec<String>, chunk: usize) -> Self {
        let (full_tx, full) = tokio::sync::mpsc::channel(1);
        let (empty, empty_rx) = std::sync::mpsc::channel::<Page>();
        for _ in 0..2 {
            // Cannot fail: the receiver is alive, owned below.
            let _ = empty.send(Page::default());
        }
        // Detached: it ends by itself once the pages or the hydration run out.
        drop(tokio::task::spawn_blocking(move || {
            for prefix in prefixes {
                let mut after: Option<String> = None;
                loop {
                    // No page back: the hydration is gone.
                    let Ok(mut page) = empty_rx.recv() else {
                        return;
                    };
                    page.clear();
                    let n = match fold
                        .scan_each(&prefix, after.as_deref(), chunk, &mut |e| page.push(e))
                    {
                        Ok(n) => n,
                        Err(e) => {
                            let _ = full_tx.blocking_send(Err(e));
                            return;
                        }
                    };
                    let Some(last) = page.last_key() else { break };
                    after = Some(last.to_string());
                    if full_tx.blocking_send(Ok(page)).is_err() {
                        return;
                    }
                    if n < chunk {
                        break;
                    }
                }
            }
        }));
        PageReader { full, empty }
    }

    /// The next page, an error reading it, or `None` when the fold is read to its end.
    pub(super) async fn next(
        &mut self,
    ) -> Option<Result<Page, foldhost_core::snapshot::SnapshotError>> {
        self.full.recv().await
    }

    /// Hands a fed page back to be filled again.
    pub(super) fn recycle(&self, page: Page) {
        // The reader may be done already: nothing to hand back to then.
        let _ = self.empty.send(page);
    }
}
