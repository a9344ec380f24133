//! TEMPORARY placeholder (replaced by the real append log).
use super::{Recovery, SnapshotError, SnapshotStore};
use crate::kv::{KvEntry, KvUpdate, WatchCursor};
use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
/// Options.
#[derive(Default, Clone, Copy, Debug)]
pub struct AppendLogOptions {
    /// t
    pub compact_threshold: u64,
}
/// Placeholder.
pub struct AppendLogSnapshot {
    map: BTreeMap<String, KvEntry>,
    cursor: WatchCursor,
    path: PathBuf,
}
impl AppendLogSnapshot {
    /// open
    pub fn open(dir: &Path, _o: AppendLogOptions) -> Result<(Self, Recovery), SnapshotError> {
        Ok((
            Self {
                map: BTreeMap::new(),
                cursor: WatchCursor::NONE,
                path: dir.join("fold.log"),
            },
            Recovery::default(),
        ))
    }
    /// ro
    pub fn open_read_only(dir: &Path) -> Result<(Self, Recovery), SnapshotError> {
        Self::open(dir, AppendLogOptions::default())
    }
    /// path
    pub fn path(&self) -> &Path {
        &self.path
    }
}
impl SnapshotStore for AppendLogSnapshot {
    fn backend(&self) -> &'static str {
        "append-log"
    }
    fn cursor(&self) -> WatchCursor {
        self.cursor
    }
    fn apply(&mut self, batch: &[KvUpdate], cursor: WatchCursor) -> Result<(), SnapshotError> {
        for u in batch {
            match u {
                KvUpdate::Put(e) => {
                    self.map.insert(e.key.clone(), e.clone());
                }
                _ => {
                    self.map.remove(u.key());
                }
            }
        }
        self.cursor = cursor;
        Ok(())
    }
    fn get(&self, key: &str) -> Result<Option<KvEntry>, SnapshotError> {
        Ok(self.map.get(key).cloned())
    }
    fn for_each_in_range(
        &self,
        prefix: &str,
        visit: &mut dyn FnMut(&KvEntry) -> ControlFlow<()>,
    ) -> Result<(), SnapshotError> {
        for (k, e) in self.map.range(prefix.to_string()..) {
            if !k.starts_with(prefix) {
                break;
            }
            if visit(e).is_break() {
                break;
            }
        }
        Ok(())
    }
    fn len(&self) -> Result<u64, SnapshotError> {
        Ok(self.map.len() as u64)
    }
}
