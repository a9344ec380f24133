//! Read access to the host's committed fold (never the batch being applied).
//!
//! The fold is the host's durable key → value map of the bucket, as of the last committed batch.
//! Values are the raw bytes from the bucket, not what [`Folder::parse`](crate::Folder::parse) made
//! of them.

use crate::Entry;
use crate::bindings::foldhost::guest::fold as raw;

/// The live entry for `key`, if the committed fold has one.
pub fn get(key: &str) -> Option<Entry> {
    raw::get(key).map(Entry::from)
}

/// Entries whose key starts with `prefix`, in key order, strictly after `start_after` when given, at
/// most `limit` of them (the host caps it, so fewer than `limit` does not mean the end: page on
/// with the last key as `start_after` until a page comes back empty).
pub fn scan(prefix: &str, start_after: Option<&str>, limit: u32) -> Vec<Entry> {
    raw::scan(prefix, start_after, limit)
        .into_iter()
        .map(Entry::from)
        .collect()
}

/// Every entry whose key starts with `prefix`, in key order, read page by page (1 000 entries a
/// call) as the iterator is consumed. Each page is read when it is reached, from the committed fold
/// as it is then.
///
/// ```no_run
/// for entry in foldhost_guest::fold::scan_all("route.") {
///     foldhost_guest::info!("{} = {} bytes", entry.key, entry.value.len());
/// }
/// ```
pub fn scan_all(prefix: &str) -> impl Iterator<Item = Entry> + '_ {
    let mut after: Option<String> = None;
    let mut page: std::vec::IntoIter<Entry> = Vec::new().into_iter();
    let mut done = false;
    std::iter::from_fn(move || {
        loop {
            if let Some(e) = page.next() {
                after = Some(e.key.clone());
                return Some(e);
            }
            if done {
                return None;
            }
            let next = scan(prefix, after.as_deref(), 1000);
            // An empty page is the end (a short page is not: the host may cap a page).
            done = next.is_empty();
            page = next.into_iter();
        }
    })
}

impl From<raw::Entry> for Entry {
    fn from(entry: raw::Entry) -> Self {
        Entry {
            key: entry.key,
            value: entry.value,
            revision: entry.revision,
        }
    }
}
