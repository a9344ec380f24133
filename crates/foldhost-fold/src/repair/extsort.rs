//! The external sort of a key listing: runs of at most `run_bytes` of keys sorted in memory and
//! spilled to files, merged back in key order with duplicates dropped. Memory is bounded by the run
//! size, whatever the bucket's size; [`list_sorted`] feeds it from a live listing.

use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use foldhost_core::kv::{KvReader, WatchScope};

use super::{RepairError, block, io_err};

/// Longest key the spill files accept (NATS keys are far shorter; this guards the reader).
pub(super) const MAX_SPILL_KEY: usize = 64 * 1024;

/// Sorts a stream of keys in bounded memory: runs of up to `run_bytes` are sorted and spilled to
/// files in a scratch directory, then merged ([`SortedKeys`]). Duplicates are dropped.
pub struct KeySorter {
    dir: PathBuf,
    run_bytes: usize,
    buf: Vec<String>,
    buf_bytes: usize,
    runs: Vec<PathBuf>,
}

impl KeySorter {
    /// A sorter spilling into `dir` (created if missing).
    pub fn new(dir: &Path, run_bytes: usize) -> Result<Self, RepairError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir, "create"))?;
        Ok(KeySorter {
            dir: dir.to_path_buf(),
            run_bytes: run_bytes.max(1),
            buf: Vec::new(),
            buf_bytes: 0,
            runs: Vec::new(),
        })
    }

    /// Adds one key.
    pub(crate) fn push(&mut self, key: String) -> Result<(), RepairError> {
        if key.len() > MAX_SPILL_KEY {
            return Err(RepairError::Refused(format!(
                "a listed key of {} bytes is over the {MAX_SPILL_KEY}-byte limit",
                key.len()
            )));
        }
        self.buf_bytes += key.len() + std::mem::size_of::<String>();
        self.buf.push(key);
        if self.buf_bytes >= self.run_bytes {
            // Sorting and writing a run blocks; keep it off the runtime's async workers.
            block(|| self.spill())?;
        }
        Ok(())
    }

    /// Runs spilled so far (for tests and logs).
    pub(crate) fn runs(&self) -> usize {
        self.runs.len()
    }

    fn spill(&mut self) -> Result<(), RepairError> {
        self.buf.sort_unstable();
        self.buf.dedup();
        let path = self.dir.join(format!("run-{:06}", self.runs.len()));
        let f = File::create(&path).map_err(io_err(&path, "create run"))?;
        let mut w = BufWriter::new(f);
        for k in self.buf.drain(..) {
            w.write_all(&(k.len() as u32).to_le_bytes())
                .and_then(|()| w.write_all(k.as_bytes()))
                .map_err(io_err(&path, "write run"))?;
        }
        w.flush().map_err(io_err(&path, "write run"))?;
        self.buf_bytes = 0;
        self.runs.push(path);
        Ok(())
    }

    /// Every key pushed, ascending, each once.
    pub(crate) fn finish(mut self) -> Result<SortedKeys, RepairError> {
        if self.runs.is_empty() {
            self.buf.sort_unstable();
            self.buf.dedup();
            return Ok(SortedKeys {
                memory: std::mem::take(&mut self.buf).into_iter(),
                runs: Vec::new(),
                heap: BinaryHeap::new(),
                last: None,
            });
        }
        if !self.buf.is_empty() {
            self.spill()?;
        }
        let mut runs = Vec::with_capacity(self.runs.len());
        let mut heap = BinaryHeap::new();
        for (i, p) in self.runs.iter().enumerate() {
            let f = File::open(p).map_err(io_err(p, "open run"))?;
            let mut r = RunReader {
                path: p.clone(),
                r: BufReader::new(f),
            };
            if let Some(k) = r.next_key()? {
                heap.push(std::cmp::Reverse((k, i)));
            }
            runs.push(r);
        }
        Ok(SortedKeys {
            memory: Vec::new().into_iter(),
            runs,
            heap,
            last: None,
        })
    }
}

struct RunReader {
    path: PathBuf,
    r: BufReader<File>,
}

impl RunReader {
    fn next_key(&mut self) -> Result<Option<String>, RepairError> {
        let mut len = [0u8; 4];
        match self.r.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(io_err(&self.path, "read run")(e)),
        }
        let n = u32::from_le_bytes(len) as usize;
        if n > MAX_SPILL_KEY {
            return Err(RepairError::Corrupt {
                path: self.path.clone(),
                reason: format!("a key length of {n} bytes"),
            });
        }
        let mut b = vec![0u8; n];
        self.r
            .read_exact(&mut b)
            .map_err(io_err(&self.path, "read run"))?;
        String::from_utf8(b)
            .map(Some)
            .map_err(|_| RepairError::Corrupt {
                path: self.path.clone(),
                reason: "a key is not UTF-8".into(),
            })
    }
}

/// The merged, ascending, de-duplicated output of a [`KeySorter`].
pub struct SortedKeys {
    memory: std::vec::IntoIter<String>,
    runs: Vec<RunReader>,
    heap: BinaryHeap<std::cmp::Reverse<(String, usize)>>,
    last: Option<String>,
}

impl SortedKeys {
    /// The next key, or `None` at the end.
    pub(crate) fn next_key(&mut self) -> Result<Option<String>, RepairError> {
        if self.runs.is_empty() {
            return Ok(self.memory.next());
        }
        loop {
            let Some(std::cmp::Reverse((k, i))) = self.heap.pop() else {
                return Ok(None);
            };
            if let Some(next) = self.runs[i].next_key()? {
                self.heap.push(std::cmp::Reverse((next, i)));
            }
            if self.last.as_deref() == Some(k.as_str()) {
                continue;
            }
            self.last = Some(k.clone());
            return Ok(Some(k));
        }
    }
}

/// A one-key lookahead over [`SortedKeys`].
pub(super) struct Peekable {
    keys: SortedKeys,
    pub(super) head: Option<String>,
}

impl Peekable {
    pub(super) fn new(mut keys: SortedKeys) -> Result<Self, RepairError> {
        let head = keys.next_key()?;
        Ok(Peekable { keys, head })
    }
    pub(super) fn advance(&mut self) -> Result<(), RepairError> {
        self.head = self.keys.next_key()?;
        Ok(())
    }
}

/// Lists `scope`'s live keys into a sorter under `dir`.
pub(super) async fn list_sorted(
    lister: &dyn KvReader,
    scope: &WatchScope,
    dir: &Path,
    run_bytes: usize,
) -> Result<(SortedKeys, u64), RepairError> {
    let mut sorter = KeySorter::new(dir, run_bytes)?;
    let mut failed: Option<RepairError> = None;
    let n = lister
        .for_each_key(scope, &mut |k| {
            if failed.is_none()
                && let Err(e) = sorter.push(k)
            {
                failed = Some(e);
            }
            Ok(())
        })
        .await?;
    if let Some(e) = failed {
        return Err(e);
    }
    tracing::info!(
        event = "repair_listed",
        keys = n,
        runs = sorter.runs(),
        "repair: bucket listed"
    );
    Ok((block(|| sorter.finish())?, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(keys: &[&str], run_bytes: usize) -> (Vec<String>, usize) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = KeySorter::new(dir.path(), run_bytes).expect("sorter");
        for k in keys {
            s.push(k.to_string()).expect("push");
        }
        let runs = s.runs();
        let mut out = Vec::new();
        let mut it = s.finish().expect("finish");
        while let Some(k) = it.next_key().expect("next") {
            out.push(k);
        }
        (out, runs)
    }

    #[test]
    fn the_key_sorter_sorts_and_dedups_in_memory_and_across_spilled_runs() {
        let keys: Vec<String> = (0..5000u32)
            .map(|i| format!("k{:05}", (i * 7919) % 3000))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut want: Vec<String> = keys.clone();
        want.sort();
        want.dedup();
        let (mem, runs) = sorted(&refs, usize::MAX);
        assert_eq!(runs, 0);
        assert_eq!(mem, want);
        // Tiny runs: many spills, the same answer.
        let (spilled, runs) = sorted(&refs, 2048);
        assert!(runs > 10, "{runs} runs");
        assert_eq!(spilled, want);
    }
}
