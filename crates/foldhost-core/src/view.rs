//! The fold as its readers see it: [`SharedStore`] (the store shared between the fold, its only
//! writer, and the readers of its committed state, with the fold's retained records beside it) and
//! [`FoldRead`], the read access an applier gets (a guest's `get`/`scan` imports, hydration).
//!
//! Invariants: a reader never sees a reserved key; a key with retained records reads as its base
//! (what the guest last applied), not the fold's latest raw value; reads happen between applies, so
//! the lock is never contended on the hot path.
//!
//! **Pre-images (a swap's view at C).** While a swap candidate hydrates beside the running applier,
//! the fold keeps committing. [`SharedStore::begin_pre_images`] starts a capture at the committed
//! cursor C; from then on, before the fold changes any key's guest view, it records that key's
//! view at C ([`SharedStore::capture_pre_images`], called by the fold *before* parse, retain or
//! commit). A [`PinnedView`] reads the live fold and then the pre-images: a value it read that
//! is newer than C always finds its key's pre-image (recorded before the write, read after it),
//! so the candidate sees exactly the fold at C however long it takes. The capture is bounded
//! ([`MAX_PRE_IMAGE_KEYS`], [`MAX_PRE_IMAGE_BYTES`]); past the bound it is marked overflowed and the
//! swap is refused at its cut-over, never served from a torn view.
//!
//! **Two captures at once.** A store keeps at most one capture per [`CaptureSlot`]: a swap's or a
//! shadow's ([`CaptureSlot::Swap`]) and the query instance's ([`CaptureSlot::Queries`],
//! docs/design.md, "Queries off the fold's path"). The fold records each changed key once into
//! every running capture (one read of its view for all of them), and a view reads only its own
//! capture, so neither capture's rounds move the other's view.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;

use crate::kv::KvEntry;

mod held;
use crate::retained::{Base, RetainedIndex};
use crate::snapshot::{SnapshotError, SnapshotStore, is_reserved};
use held::HeldTally;
pub use held::StoreWrite;

/// Read access to a committed fold, for appliers (a guest's `get`/`scan` imports, hydration).
pub trait FoldRead: Send + Sync {
    /// The live entry for `key`.
    fn get(&self, key: &str) -> Result<Option<KvEntry>, SnapshotError>;
    /// Entries under `prefix`, in key order, strictly after `start_after`, at most `limit`.
    fn scan(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<KvEntry>, SnapshotError>;
    /// Visits every entry under `prefix` in key order (for hydration: never materialises the fold).
    fn visit(
        &self,
        prefix: &str,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError>;
    /// The `on-applied` intent the fold's last commit recorded
    /// ([`crate::retained::ON_APPLIED_KEY`]; `None`: none, or a view that keeps none). A reserved
    /// key: [`Self::get`] never shows it.
    fn applied_intent(&self) -> Result<Option<crate::retained::AppliedIntent>, SnapshotError> {
        Ok(None)
    }
    /// The entries [`Self::scan`] would return, in its order, handed to `each` by reference
    /// instead of returned (a reader that copies them where it wants them needs no owned entry
    /// per key). Returns how many. A view overrides it only where it can skip the copies.
    fn scan_each(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: usize,
        each: &mut dyn FnMut(&KvEntry),
    ) -> Result<usize, SnapshotError> {
        let page = self.scan(prefix, start_after, limit)?;
        page.iter().for_each(&mut *each);
        Ok(page.len())
    }
}

/// A store shared between the fold (the only writer) and readers of its committed state, with the
/// fold's retained records ([`RetainedIndex`]) beside it.
///
/// The fold takes the write lock only inside `apply`; appliers read between applies, so the lock
/// is never contended on the hot path. A panic while holding it (a bug) reads as a poisoned store.
///
/// As a [`FoldRead`] it is the *guest's view*: reserved keys never show, and a key with retained
/// records shows the entry the guest last applied (its base), not the fold's latest raw value.
pub struct SharedStore<S> {
    store: Arc<std::sync::RwLock<S>>,
    /// Loaded from the store on first use.
    retained: Arc<std::sync::Mutex<Option<RetainedIndex>>>,
    /// The running captures of pre-images, one per [`CaptureSlot`].
    pre_images: Arc<std::sync::Mutex<Captures>>,
    /// The last capture generation handed out. Never reused: a [`PinnedView`] whose capture ended
    /// (an adopted guest keeps the view it hydrated through) must never match a later capture, or
    /// it would read that capture's pre-images — the fold as it was when a later swap began.
    generations: Arc<std::sync::atomic::AtomicU64>,
    /// The bytes the bucket's keys hold, kept by every commit once first asked.
    held: Arc<HeldTally>,
}

impl<S> Clone for SharedStore<S> {
    fn clone(&self) -> Self {
        SharedStore {
            store: self.store.clone(),
            retained: self.retained.clone(),
            pre_images: self.pre_images.clone(),
            generations: self.generations.clone(),
            held: self.held.clone(),
        }
    }
}

/// Who a pre-image capture is for: each slot holds at most one running capture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaptureSlot {
    /// A swap's or a shadow's candidate.
    Swap,
    /// The query instance kept level with the fold.
    Queries,
}

/// The running captures, by slot.
#[derive(Debug, Default)]
struct Captures {
    slots: [Option<PreImages>; 2],
}

impl Captures {
    fn slot(&mut self, slot: CaptureSlot) -> &mut Option<PreImages> {
        &mut self.slots[slot as usize]
    }

    /// The running capture with this generation, whichever slot holds it.
    fn of(&self, generation: u64) -> Option<&PreImages> {
        self.slots
            .iter()
            .flatten()
            .find(|p| p.generation == generation)
    }

    fn slot_of(&mut self, generation: u64) -> Option<&mut Option<PreImages>> {
        self.slots
            .iter_mut()
            .find(|p| p.as_ref().is_some_and(|p| p.generation == generation))
    }
}

/// Most keys a pre-image capture records before it overflows (the swap is then refused).
pub const MAX_PRE_IMAGE_KEYS: usize = 1 << 20;
/// Most key and value bytes a pre-image capture holds before it overflows.
pub const MAX_PRE_IMAGE_BYTES: usize = 256 * 1024 * 1024;

/// The guest views at C of the keys the fold changed since a capture began (see the module docs).
#[derive(Debug, Default)]
pub struct PreImages {
    /// Which capture this is: a [`PinnedView`] reads only its own.
    generation: u64,
    /// Key → its guest view at C (`None`: absent at C).
    keys: BTreeMap<String, Base>,
    bytes: usize,
    overflowed: bool,
    max_keys: usize,
    max_bytes: usize,
}

impl PreImages {
    /// True when the capture passed its bounds (its view at C is incomplete).
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// Keys recorded.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// The keys changed since C, in key order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// True when no key changed since C.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The catch-up of a candidate hydrated at C, with `now` the guest view of the fold now: one
    /// update per key whose view differs from its view at C — a put of its entry now, or a
    /// synthetic delete (version unknown) when it is gone — in key order. A key changed and changed
    /// back reads the same and is left out. So the candidate never gets an update it already
    /// applied at C (nothing applied twice), and every key ends at its view now (nothing skipped).
    pub fn catch_up(self, now: &dyn FoldRead) -> Result<Vec<crate::kv::KvUpdate>, SnapshotError> {
        let mut out = Vec::new();
        for (key, at_c) in self.keys {
            let current = now.get(&key)?;
            if current == at_c {
                continue;
            }
            out.push(match current {
                Some(e) => crate::kv::KvUpdate::Put(e),
                None => crate::kv::KvUpdate::Delete {
                    key,
                    version: crate::kv::VersionToken::UNKNOWN,
                },
            });
        }
        Ok(out)
    }
}

fn poisoned() -> SnapshotError {
    SnapshotError::Poisoned {
        path: PathBuf::new(),
        cause: "a thread panicked while holding the store".into(),
    }
}

impl<S: SnapshotStore> SharedStore<S> {
    /// Shares `store`.
    pub fn new(store: S) -> Self {
        SharedStore {
            store: Arc::new(std::sync::RwLock::new(store)),
            retained: Arc::new(std::sync::Mutex::new(None)),
            pre_images: Arc::new(std::sync::Mutex::new(Captures::default())),
            generations: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            held: Arc::default(),
        }
    }

    /// Starts capturing pre-images at the committed cursor (the fold must be settled: nothing
    /// applied and uncommitted) and returns the view of the fold as it is now, which keeps reading
    /// the fold at this point until the capture ends ([`SharedStore::take_pre_images`]). A capture
    /// already running is replaced (its view then reads the live fold).
    pub fn begin_pre_images(&self) -> Result<PinnedView<S>, SnapshotError> {
        self.begin_pre_images_bounded(MAX_PRE_IMAGE_KEYS, MAX_PRE_IMAGE_BYTES)
    }

    /// [`SharedStore::begin_pre_images`] with bounds of its own (the tests' small ones).
    pub(crate) fn begin_pre_images_bounded(
        &self,
        max_keys: usize,
        max_bytes: usize,
    ) -> Result<PinnedView<S>, SnapshotError> {
        self.begin_capture(CaptureSlot::Swap, max_keys, max_bytes)
    }

    /// [`SharedStore::begin_pre_images`] for the capture of `slot` (the other slot's capture goes
    /// on untouched).
    pub fn begin_capture_in(&self, slot: CaptureSlot) -> Result<PinnedView<S>, SnapshotError> {
        self.begin_capture(slot, MAX_PRE_IMAGE_KEYS, MAX_PRE_IMAGE_BYTES)
    }

    fn begin_capture(
        &self,
        slot: CaptureSlot,
        max_keys: usize,
        max_bytes: usize,
    ) -> Result<PinnedView<S>, SnapshotError> {
        let mut guard = self.pre_images.lock().map_err(|_| poisoned())?;
        let generation = self.next_generation();
        *guard.slot(slot) = Some(PreImages {
            generation,
            max_keys,
            max_bytes,
            ..PreImages::default()
        });
        Ok(PinnedView {
            shared: self.clone(),
            generation: Arc::new(std::sync::atomic::AtomicU64::new(generation)),
        })
    }

    /// Ends the running capture and starts the next one at the committed cursor now, moving `view`
    /// to it (a swap's catch-up round: the candidate, level with the fold at the old capture's
    /// cursor once it applied the old capture's keys read through `view`, is level with the new
    /// one). Returns the old capture; `None` (and nothing started) when `view`'s capture is over.
    pub fn restart_pre_images(
        &self,
        view: &PinnedView<S>,
    ) -> Result<Option<PreImages>, SnapshotError> {
        use std::sync::atomic::Ordering;
        let mut guard = self.pre_images.lock().map_err(|_| poisoned())?;
        let current = view.generation.load(Ordering::Acquire);
        let Some(slot) = guard.slot_of(current) else {
            return Ok(None);
        };
        let generation = self.next_generation();
        let next = PreImages {
            generation,
            max_keys: slot.as_ref().map_or(MAX_PRE_IMAGE_KEYS, |p| p.max_keys),
            max_bytes: slot.as_ref().map_or(MAX_PRE_IMAGE_BYTES, |p| p.max_bytes),
            ..PreImages::default()
        };
        let old = slot.replace(next);
        view.generation.store(generation, Ordering::Release);
        Ok(old)
    }

    /// A capture generation never handed out before by this store.
    fn next_generation(&self) -> u64 {
        self.generations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1
    }

    /// Keys recorded by the running swap capture (0 when none runs).
    pub fn pre_images_len(&self) -> Result<usize, SnapshotError> {
        let mut guard = self.pre_images.lock().map_err(|_| poisoned())?;
        Ok(guard
            .slot(CaptureSlot::Swap)
            .as_ref()
            .map_or(0, |p| p.keys.len()))
    }

    /// Keys recorded by the capture `view` reads (`None` when it is over), and whether it
    /// overflowed.
    pub fn capture_len(
        &self,
        view: &PinnedView<S>,
    ) -> Result<Option<(usize, bool)>, SnapshotError> {
        let guard = self.pre_images.lock().map_err(|_| poisoned())?;
        Ok(guard
            .of(view.generation())
            .map(|p| (p.keys.len(), p.overflowed)))
    }

    /// Ends the capture `view` reads (a no-op when it is over); `view` reads the live fold from
    /// here on.
    pub fn end_capture(&self, view: &PinnedView<S>) -> Result<(), SnapshotError> {
        let mut guard = self.pre_images.lock().map_err(|_| poisoned())?;
        if let Some(slot) = guard.slot_of(view.generation()) {
            *slot = None;
        }
        Ok(())
    }

    /// Records the guest view of each of `keys` not recorded yet, when a capture runs. The fold
    /// calls this before anything can change those keys' views (parse, retain, commit, release).
    pub fn capture_pre_images<'k>(
        &self,
        keys: impl IntoIterator<Item = &'k str>,
    ) -> Result<(), SnapshotError> {
        let mut guard = self.pre_images.lock().map_err(|_| poisoned())?;
        if guard.slots.iter().flatten().all(|p| p.overflowed) {
            return Ok(());
        }
        for key in keys {
            if is_reserved(key) {
                continue;
            }
            let wanted = |p: &PreImages| !p.overflowed && !p.keys.contains_key(key);
            if !guard.slots.iter().flatten().any(wanted) {
                continue;
            }
            // Lock order: pre-images, then the retained index, then the store (a reader never
            // holds the latter two while it takes the first). One read serves every capture.
            let view = self.get(key)?;
            for p in guard.slots.iter_mut().flatten() {
                if !wanted(p) {
                    continue;
                }
                p.bytes += key.len() + view.as_ref().map_or(0, |e| e.value.len());
                p.keys.insert(key.to_string(), view.clone());
                if p.keys.len() > p.max_keys || p.bytes > p.max_bytes {
                    p.overflowed = true;
                    p.keys.clear();
                }
            }
        }
        Ok(())
    }

    /// Ends the running swap capture and hands over what it recorded; its [`PinnedView`] reads
    /// the live fold from here on.
    pub fn take_pre_images(&self) -> Result<Option<PreImages>, SnapshotError> {
        let mut guard = self.pre_images.lock().map_err(|_| poisoned())?;
        Ok(guard.slot(CaptureSlot::Swap).take())
    }

    /// The pre-image of `key` in capture `generation`: `Some(view at C)` when the key changed since.
    fn pre_image(&self, generation: u64, key: &str) -> Result<Option<Base>, SnapshotError> {
        let guard = self.pre_images.lock().map_err(|_| poisoned())?;
        Ok(guard.of(generation).and_then(|p| p.keys.get(key).cloned()))
    }

    /// The pre-images of capture `generation` with keys under `prefix` in `(after, through]`;
    /// `None` when that capture is over.
    fn pre_images_in(
        &self,
        generation: u64,
        prefix: &str,
        after: Option<&str>,
        through: Option<&str>,
    ) -> Result<Option<Vec<(String, Base)>>, SnapshotError> {
        use std::ops::Bound;
        let guard = self.pre_images.lock().map_err(|_| poisoned())?;
        let Some(p) = guard.of(generation) else {
            return Ok(None);
        };
        let lower = match after {
            Some(a) if a >= prefix => Bound::Excluded(a),
            _ => Bound::Included(prefix),
        };
        Ok(Some(
            p.keys
                .range::<str, _>((lower, Bound::Unbounded))
                .take_while(|(k, _)| {
                    k.starts_with(prefix) && through.is_none_or(|t| k.as_str() <= t)
                })
                .map(|(k, b)| (k.clone(), b.clone()))
                .collect(),
        ))
    }

    /// The store itself, when this is its last handle (and no writer panicked holding it).
    pub fn try_into_inner(self) -> Option<S> {
        std::sync::Arc::try_unwrap(self.store)
            .ok()?
            .into_inner()
            .ok()
    }

    /// Reads the store.
    pub fn read(&self) -> Result<std::sync::RwLockReadGuard<'_, S>, SnapshotError> {
        self.store.read().map_err(|_| poisoned())
    }

    /// The store for a reader that must not keep it alive: the node's side tasks outlive the fold,
    /// and a store still shared when the fold stops is closed without its clean-stop record.
    pub fn downgrade(&self) -> std::sync::Weak<std::sync::RwLock<S>> {
        Arc::downgrade(&self.store)
    }

    /// Writes the store (the fold only): every commit goes through [`StoreWrite::apply`].
    pub fn write(&self) -> Result<StoreWrite<'_, S>, SnapshotError> {
        Ok(StoreWrite {
            guard: self.store.write().map_err(|_| poisoned())?,
            held: &self.held,
        })
    }

    /// The bytes (keys and values) of the bucket's keys in the fold, reserved keys excluded:
    /// counted on the first ask, then kept by every commit (what a state bucket's size cap is
    /// checked against at each guest write).
    pub fn held_bytes(&self) -> Result<u64, SnapshotError> {
        self.held.get_or_count(&*self.read()?)
    }

    /// Runs `f` on the retained records, loading them from the store the first time.
    pub fn with_retained<R>(
        &self,
        f: impl FnOnce(&mut RetainedIndex) -> R,
    ) -> Result<R, SnapshotError> {
        let mut guard = self.retained.lock().map_err(|_| poisoned())?;
        if guard.is_none() {
            *guard = Some(RetainedIndex::load(&*self.read()?)?);
        }
        match guard.as_mut() {
            Some(index) => Ok(f(index)),
            None => Err(poisoned()),
        }
    }

    /// The store back, when this is the last handle.
    pub fn into_inner(self) -> Result<S, Self> {
        let retained = self.retained;
        match std::sync::Arc::try_unwrap(self.store) {
            Ok(lock) => lock.into_inner().map_err(|p| SharedStore {
                store: Arc::new(std::sync::RwLock::new(p.into_inner())),
                retained,
                pre_images: self.pre_images,
                generations: self.generations,
                held: self.held,
            }),
            Err(store) => Err(SharedStore {
                store,
                retained,
                pre_images: self.pre_images,
                generations: self.generations,
                held: self.held,
            }),
        }
    }
}

/// A fold with nothing in it: what a guest sees while it is proven to start (instantiate,
/// `manifest`, `init`) before any store is opened.
#[derive(Debug, Default, Clone, Copy)]
pub struct EmptyFold;

impl FoldRead for EmptyFold {
    fn get(&self, _key: &str) -> Result<Option<KvEntry>, SnapshotError> {
        Ok(None)
    }

    fn scan(
        &self,
        _prefix: &str,
        _start_after: Option<&str>,
        _limit: usize,
    ) -> Result<Vec<KvEntry>, SnapshotError> {
        Ok(Vec::new())
    }

    fn visit(
        &self,
        _prefix: &str,
        _visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        Ok(())
    }
}

impl<S: SnapshotStore> FoldRead for SharedStore<S> {
    fn get(&self, key: &str) -> Result<Option<KvEntry>, SnapshotError> {
        if is_reserved(key) {
            return Ok(None);
        }
        if let Some(base) = self.with_retained(|r| r.base(key).cloned())? {
            return Ok(base);
        }
        self.read()?.get(key)
    }

    fn applied_intent(&self) -> Result<Option<crate::retained::AppliedIntent>, SnapshotError> {
        Ok(self
            .read()?
            .get(crate::retained::ON_APPLIED_KEY)?
            .and_then(|e| crate::retained::AppliedIntent::from_bytes(&e.value)))
    }

    fn scan(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<KvEntry>, SnapshotError> {
        let mut out = Vec::new();
        if limit == 0 {
            return Ok(out);
        }
        // Blocked keys in range show their base instead of the fold's entry (usually there are
        // none). Collected first: the index lock is not taken per entry.
        let in_range: Vec<(String, Base)> = self.with_retained(|r| {
            r.bases_in(prefix)
                .filter(|(k, _)| start_after.is_none_or(|a| k.as_str() > a))
                .map(|(k, b)| (k.clone(), b.clone()))
                .collect()
        })?;
        let blocked = |k: &str| {
            in_range
                .binary_search_by(|(b, _)| b.as_str().cmp(k))
                .is_ok()
        };
        let from = crate::snapshot::scan_start(prefix, start_after);
        self.read()?
            .for_each_in_range_after(prefix, from, &mut |e| {
                if is_reserved(&e.key) || (!in_range.is_empty() && blocked(&e.key)) {
                    return ControlFlow::Continue(());
                }
                out.push(e.clone());
                if out.len() >= limit {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })?;
        if !in_range.is_empty() {
            // A full page covers keys up to its last one; a short one, everything after start_after.
            let bound = if out.len() >= limit {
                out.last().map(|e| e.key.clone())
            } else {
                None
            };
            out.extend(
                in_range
                    .into_iter()
                    .filter_map(|(_, b)| b)
                    .filter(|b| bound.as_ref().is_none_or(|k| b.key <= *k)),
            );
            out.sort_by(|a, b| a.key.cmp(&b.key));
            out.truncate(limit);
        }
        Ok(out)
    }

    fn visit(
        &self,
        prefix: &str,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        visit_by_pages(self, prefix, visit)
    }

    /// Straight from the store's iteration when no key in range has retained records (the usual
    /// case: then `scan` is exactly the store's entries minus reserved keys); through `scan`
    /// otherwise.
    fn scan_each(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: usize,
        each: &mut dyn FnMut(&KvEntry),
    ) -> Result<usize, SnapshotError> {
        if limit == 0 {
            return Ok(0);
        }
        let any_base = self.with_retained(|r| {
            r.bases_in(prefix)
                .any(|(k, _)| start_after.is_none_or(|a| k.as_str() > a))
        })?;
        if any_base {
            let page = self.scan(prefix, start_after, limit)?;
            page.iter().for_each(&mut *each);
            return Ok(page.len());
        }
        let mut n = 0usize;
        let from = crate::snapshot::scan_start(prefix, start_after);
        self.read()?
            .for_each_in_range_after(prefix, from, &mut |e| {
                if is_reserved(&e.key) {
                    return ControlFlow::Continue(());
                }
                each(e);
                n += 1;
                if n >= limit {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })?;
        Ok(n)
    }
}

/// Visits through `scan` pages, so a reader's view is the same whichever way it is read.
fn visit_by_pages(
    reader: &dyn FoldRead,
    prefix: &str,
    visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
) -> Result<(), SnapshotError> {
    const PAGE: usize = 4096;
    let mut after: Option<String> = None;
    loop {
        let page = reader.scan(prefix, after.as_deref(), PAGE)?;
        for e in &page {
            if visit(e).is_break() {
                return Ok(());
            }
        }
        match page.last() {
            Some(last) if page.len() == PAGE => after = Some(last.key.clone()),
            _ => return Ok(()),
        }
    }
}

/// The fold as it was when a pre-image capture began ([`SharedStore::begin_pre_images`]), for as
/// long as that capture runs; the live fold after it ends. What a swap candidate hydrates from.
pub struct PinnedView<S> {
    shared: SharedStore<S>,
    /// The capture it reads (moved on by [`SharedStore::restart_pre_images`]; read once per call).
    generation: Arc<std::sync::atomic::AtomicU64>,
}

impl<S> Clone for PinnedView<S> {
    fn clone(&self) -> Self {
        PinnedView {
            shared: self.shared.clone(),
            generation: self.generation.clone(),
        }
    }
}

impl<S> PinnedView<S> {
    fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl<S: SnapshotStore> FoldRead for PinnedView<S> {
    fn get(&self, key: &str) -> Result<Option<KvEntry>, SnapshotError> {
        // Live first, pre-image after: a live value newer than C has its pre-image recorded by then.
        let generation = self.generation();
        let live = self.shared.get(key)?;
        Ok(match self.shared.pre_image(generation, key)? {
            Some(at_c) => at_c,
            None => live,
        })
    }

    fn scan(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<KvEntry>, SnapshotError> {
        let generation = self.generation();
        let mut out: Vec<KvEntry> = Vec::new();
        let mut after: Option<String> = start_after.map(str::to_string);
        // Each round reads a live page, then the pre-images over the same key range (after it:
        // see `get`), and replaces the page's changed keys with their views at C. A round can come
        // out short while the fold goes on, so rounds repeat until the page is full or the live
        // fold ends: a short answer still means "nothing after this".
        while out.len() < limit {
            let want = limit - out.len();
            let page = self.shared.scan(prefix, after.as_deref(), want)?;
            let full = page.len() == want;
            let through = if full {
                page.last().map(|e| e.key.clone())
            } else {
                None
            };
            let Some(pre) = self.shared.pre_images_in(
                generation,
                prefix,
                after.as_deref(),
                through.as_deref(),
            )?
            else {
                // The capture ended: the live page is the answer.
                out.extend(page);
                break;
            };
            let changed = |k: &str| pre.binary_search_by(|(p, _)| p.as_str().cmp(k)).is_ok();
            let mut round: Vec<KvEntry> = page.into_iter().filter(|e| !changed(&e.key)).collect();
            round.extend(pre.into_iter().filter_map(|(_, b)| b));
            round.sort_by(|a, b| a.key.cmp(&b.key));
            out.extend(round);
            match through {
                Some(t) => after = Some(t),
                None => break,
            }
        }
        out.truncate(limit);
        Ok(out)
    }

    fn visit(
        &self,
        prefix: &str,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        visit_by_pages(self, prefix, visit)
    }
}

/// Test support: `reader`'s [`FoldRead::scan_each`] hands over exactly what its `scan` returns,
/// page by page at every page size given, through the whole `prefix`.
#[cfg(any(test, feature = "testkit"))]
pub fn assert_scan_each_is_scan(reader: &dyn FoldRead, prefix: &str, limits: &[usize]) {
    for &limit in limits {
        let mut after: Option<String> = None;
        loop {
            let want = reader.scan(prefix, after.as_deref(), limit).expect("scan");
            let mut got = Vec::new();
            let n = reader
                .scan_each(prefix, after.as_deref(), limit, &mut |e| {
                    got.push(e.clone())
                })
                .expect("scan_each");
            assert_eq!(got, want, "page after {after:?}, limit {limit}");
            assert_eq!(n, want.len());
            match want.last() {
                Some(last) if want.len() == limit => after = Some(last.key.clone()),
                _ => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvUpdate, VersionToken, WatchCursor};
    use crate::snapshot::{AppendLogOptions, AppendLogSnapshot};

    fn keys(v: Vec<KvEntry>) -> Vec<String> {
        v.into_iter().map(|e| e.key).collect()
    }

    fn put(key: &str, value: &'static str, rev: u64) -> KvUpdate {
        KvUpdate::Put(KvEntry {
            key: key.to_string(),
            value: bytes::Bytes::from_static(value.as_bytes()),
            version: VersionToken::from_u64(rev),
        })
    }

    /// A scan of the whole fold starts past the host's reserved keys (the operation ledger's
    /// rows among them) instead of walking them, and still shows every bucket key.
    #[test]
    fn a_scan_of_the_whole_fold_starts_past_the_reserved_keys_and_misses_no_bucket_key() {
        assert_eq!(
            crate::snapshot::scan_start("", None),
            crate::snapshot::scan_start("", Some("\u{1}op/x"))
        );
        assert_eq!(crate::snapshot::scan_start("", Some("a")), Some("a"));
        assert_eq!(crate::snapshot::scan_start("k.", None), None);
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) =
            AppendLogSnapshot::open(dir.path(), AppendLogOptions::default()).expect("open");
        let mut updates = vec![put("-dash", "a", 1), put("0", "b", 2), put("z", "c", 3)];
        for i in 0..100 {
            updates.push(KvUpdate::Put(KvEntry {
                key: format!("\u{1}op/{i:03}"),
                value: bytes::Bytes::from_static(b"row"),
                version: VersionToken::UNKNOWN,
            }));
        }
        store.apply(&updates, WatchCursor::at(3)).expect("apply");
        let shared = SharedStore::new(store);
        assert_eq!(
            keys(shared.scan("", None, 10).expect("scan")),
            vec!["-dash", "0", "z"]
        );
        let mut seen = Vec::new();
        shared
            .scan_each("", None, 10, &mut |e| seen.push(e.key.clone()))
            .expect("scan_each");
        assert_eq!(seen, vec!["-dash", "0", "z"]);
    }

    /// The bug this prevents: a guest adopted by a swap keeps the pinned view it hydrated
    /// through. When a later swap started a capture with the same generation, that guest read the
    /// later capture's pre-images — stale values — and a rebuild of it lost the changes for good.
    #[test]
    fn a_view_whose_capture_ended_reads_the_live_fold_through_every_later_capture() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) =
            AppendLogSnapshot::open(dir.path(), AppendLogOptions::default()).expect("open");
        store
            .apply(&[put("k", "old", 1)], WatchCursor::at(1))
            .expect("apply");
        let shared = SharedStore::new(store);
        let adopted = shared.begin_pre_images().expect("first swap");
        shared.take_pre_images().expect("its cut-over");
        for round in 0..3 {
            // A later swap (or a shadow, or a catch-up round of one) captures k, then changes it.
            let later = shared.begin_pre_images().expect("a later swap");
            if round == 1 {
                shared.restart_pre_images(&later).expect("a round");
            }
            shared.capture_pre_images(["k"]).expect("capture");
            let value = format!("new{round}");
            shared
                .write()
                .expect("write")
                .apply(
                    &[KvUpdate::Put(KvEntry {
                        key: "k".into(),
                        value: bytes::Bytes::from(value.clone()),
                        version: VersionToken::from_u64(2 + round),
                    })],
                    WatchCursor::at(2 + round),
                )
                .expect("apply");
            let seen = adopted.get("k").expect("get").map(|e| e.value);
            assert_eq!(seen.as_deref(), Some(value.as_bytes()), "round {round}");
            assert_ne!(
                later.get("k").expect("get").map(|e| e.value).as_deref(),
                Some(value.as_bytes())
            );
            shared.take_pre_images().expect("end");
        }
    }

    #[test]
    fn a_pinned_view_reads_the_fold_at_the_capture_however_it_changes_after() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) =
            AppendLogSnapshot::open(dir.path(), AppendLogOptions::default()).expect("open");
        let at_c: Vec<KvUpdate> = (1..=9).map(|i| put(&format!("k{i}"), "c", i)).collect();
        store.apply(&at_c, WatchCursor::at(9)).expect("apply");
        let shared = SharedStore::new(store);
        let view = shared.begin_pre_images().expect("begin");
        // The fold changes after C: each change records its pre-image first, as the fold does.
        let later = vec![
            put("k2", "later", 10),
            KvUpdate::Delete {
                key: "k3".into(),
                version: VersionToken::from_u64(11),
            },
            put("k35", "new", 12),
            put("k9", "later", 13),
        ];
        shared
            .capture_pre_images(later.iter().map(KvUpdate::key))
            .expect("capture");
        shared
            .write()
            .expect("write")
            .apply(&later, WatchCursor::at(13))
            .expect("apply");
        // Through the view, every page and every get is the fold at C.
        let mut paged = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let page = view.scan("k", after.as_deref(), 2).expect("scan");
            paged.extend(page.iter().map(|e| (e.key.clone(), e.version.as_u64())));
            match page.last() {
                Some(l) if page.len() == 2 => after = Some(l.key.clone()),
                _ => break,
            }
        }
        let want: Vec<(String, Option<u64>)> =
            (1..=9).map(|i| (format!("k{i}"), Some(i))).collect();
        assert_eq!(paged, want);
        assert_eq!(
            view.get("k3").expect("get").map(|e| e.version.as_u64()),
            Some(Some(3))
        );
        assert_eq!(view.get("k35").expect("get"), None);
        // The live fold is the new one; the catch-up is each changed key once, its value now.
        assert_eq!(shared.get("k3").expect("get"), None);
        let pre = shared.take_pre_images().expect("take").expect("a capture");
        let catch_up: Vec<(String, Option<u64>)> = pre
            .catch_up(&shared)
            .expect("catch up")
            .iter()
            .map(|u| (u.key().to_string(), u.revision()))
            .collect();
        assert_eq!(
            catch_up,
            [
                ("k2".to_string(), Some(10)),
                ("k3".to_string(), None),
                ("k35".to_string(), Some(12)),
                ("k9".to_string(), Some(13)),
            ]
        );
        // The capture is over: the view reads the live fold.
        assert_eq!(view.get("k3").expect("get"), None);
        assert_eq!(view.scan("k", None, 100).expect("scan").len(), 9);
    }

    /// The query instance's capture and a swap's run side by side: each view reads the fold at
    /// its own capture, a round of one never moves the other, and ending one leaves the other.
    #[test]
    fn a_swap_capture_and_the_query_capture_each_keep_their_own_view() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) =
            AppendLogSnapshot::open(dir.path(), AppendLogOptions::default()).expect("open");
        store
            .apply(&[put("k", "v1", 1)], WatchCursor::at(1))
            .expect("apply");
        let shared = SharedStore::new(store);
        let change = |value: &'static str, rev: u64| {
            shared.capture_pre_images(["k"]).expect("capture");
            shared
                .write()
                .expect("write")
                .apply(&[put("k", value, rev)], WatchCursor::at(rev))
                .expect("apply");
        };
        let value = |view: &PinnedView<AppendLogSnapshot>| {
            view.get("k")
                .expect("get")
                .map(|e| String::from_utf8_lossy(&e.value).into_owned())
        };
        let queries = shared
            .begin_capture_in(CaptureSlot::Queries)
            .expect("query capture");
        change("v2", 2);
        let swap = shared.begin_pre_images().expect("swap capture");
        change("v3", 3);
        assert_eq!(value(&queries).as_deref(), Some("v1"));
        assert_eq!(value(&swap).as_deref(), Some("v2"));
        assert_eq!(shared.capture_len(&queries).expect("len"), Some((1, false)));
        // A round of the query capture moves its view to now; the swap's stays at v2.
        let old = shared
            .restart_pre_images(&queries)
            .expect("round")
            .expect("its capture");
        assert_eq!(old.keys().collect::<Vec<_>>(), ["k"]);
        assert_eq!(value(&queries).as_deref(), Some("v3"));
        assert_eq!(value(&swap).as_deref(), Some("v2"));
        change("v4", 4);
        assert_eq!(value(&queries).as_deref(), Some("v3"));
        // The swap ends: the query capture goes on.
        let taken = shared.take_pre_images().expect("take").expect("the swap's");
        assert_eq!(taken.len(), 1);
        assert_eq!(value(&swap).as_deref(), Some("v4"));
        assert_eq!(value(&queries).as_deref(), Some("v3"));
        shared.end_capture(&queries).expect("end");
        assert_eq!(shared.capture_len(&queries).expect("len"), None);
        assert_eq!(value(&queries).as_deref(), Some("v4"));
    }

    #[test]
    fn a_capture_past_its_bound_is_marked_overflowed_and_keeps_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, _) =
            AppendLogSnapshot::open(dir.path(), AppendLogOptions::default()).expect("open");
        let shared = SharedStore::new(store);
        let _view = shared.begin_pre_images_bounded(3, 1 << 20).expect("begin");
        shared.capture_pre_images(["a", "b", "c"]).expect("capture");
        assert_eq!(shared.pre_images_len().expect("len"), 3);
        shared.capture_pre_images(["d"]).expect("capture");
        let pre = shared.take_pre_images().expect("take").expect("a capture");
        assert!(pre.overflowed(), "a fourth key passes a bound of 3");
        assert!(pre.is_empty(), "an overflowed capture keeps nothing");
        // By bytes too.
        let _view = shared.begin_pre_images_bounded(100, 4).expect("begin");
        shared.capture_pre_images(["abc", "de"]).expect("capture");
        assert!(
            shared
                .take_pre_images()
                .expect("take")
                .expect("a capture")
                .overflowed()
        );
    }

    #[test]
    fn scan_pages_through_a_prefix_with_start_after() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) =
            AppendLogSnapshot::open(dir.path(), AppendLogOptions::default()).expect("open");
        // A reserved key too: no view shows it, by page or by reference.
        let batch: Vec<KvUpdate> = ["a.1", "a.2", "a.3", "a.4", "a.5", "b.1", "ab", "\u{1}host"]
            .iter()
            .map(|k| {
                KvUpdate::Put(KvEntry {
                    key: (*k).to_string(),
                    value: bytes::Bytes::from_static(b"v"),
                    version: VersionToken::from_u64(1),
                })
            })
            .collect();
        store.apply(&batch, WatchCursor::at(1)).expect("apply");
        let shared = SharedStore::new(store);
        assert_eq!(
            keys(shared.scan("a.", None, 2).expect("scan")),
            ["a.1", "a.2"]
        );
        assert_eq!(
            keys(shared.scan("a.", Some("a.2"), 2).expect("scan")),
            ["a.3", "a.4"]
        );
        assert_eq!(
            keys(shared.scan("a.", Some("a.4"), 9).expect("scan")),
            ["a.5"]
        );
        assert!(shared.scan("a.", Some("a.5"), 9).expect("scan").is_empty());
        // `start_after` before the prefix starts at the prefix; after the range, nothing.
        assert_eq!(
            keys(shared.scan("b.", Some("a.3"), 9).expect("scan")),
            ["b.1"]
        );
        assert!(shared.scan("a.", Some("zz"), 9).expect("scan").is_empty());
        assert!(shared.scan("a.", None, 0).expect("scan").is_empty());
        assert!(
            !keys(shared.scan("", None, 100).expect("scan")).contains(&"\u{1}host".to_string())
        );
        for prefix in ["a.", "b.", "", "\u{1}", "zz"] {
            assert_scan_each_is_scan(&shared, prefix, &[1, 2, 3, 100]);
        }
        let mut none = Vec::new();
        assert_eq!(
            shared
                .scan_each("a.", None, 0, &mut |e| none.push(e.clone()))
                .expect("scan_each"),
            0
        );
        assert!(none.is_empty());
    }
}
