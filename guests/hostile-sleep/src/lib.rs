//! `hostile-sleep`: blocks in a host call (a WASI sleep: `poll` on a monotonic-clock
//! subscription) where no wasm runs, so the epoch deadline alone cannot stop it.
//!
//! It sleeps 600 s in `apply` when the batch holds the key `sleep.apply`, in `query` when the
//! request is `sleep`, and in `init` when its config has `sleep_in_init`. Otherwise it behaves like
//! `kvstore`: a query's request is a key, the answer its value bytes or the error `missing`.

use std::collections::BTreeMap;
use std::time::Duration;

use foldhost_guest::{Change, Folder, Manifest, Verdict};

const NAP: Duration = Duration::from_secs(600);

/// A key → value store that naps on request.
#[derive(Default)]
struct HostileSleep {
    entries: BTreeMap<String, Vec<u8>>,
}

impl Folder for HostileSleep {
    type Value = Vec<u8>;

    fn manifest() -> Manifest {
        Manifest::whole_bucket("hostile-sleep", "0.1.0")
    }

    fn init(&mut self, config: &[(String, String)]) -> Result<(), String> {
        if config.iter().any(|(name, _)| name == "sleep_in_init") {
            std::thread::sleep(NAP);
        }
        Ok(())
    }

    fn parse(&self, _key: &str, value: &[u8]) -> Verdict<Vec<u8>> {
        Verdict::Accept(value.to_vec())
    }

    fn apply(&mut self, changes: Vec<Change<Vec<u8>>>) -> Result<(), String> {
        for change in changes {
            match change {
                Change::Put { key, value, .. } => {
                    if key == "sleep.apply" {
                        std::thread::sleep(NAP);
                    }
                    self.entries.insert(key, value);
                }
                Change::Delete { key, .. } => {
                    self.entries.remove(&key);
                }
            }
        }
        Ok(())
    }

    fn query(&self, request: &[u8]) -> Result<Vec<u8>, String> {
        if request == b"sleep" {
            std::thread::sleep(NAP);
        }
        let key = std::str::from_utf8(request).map_err(|_| "missing")?;
        self.entries
            .get(key)
            .cloned()
            .ok_or_else(|| "missing".into())
    }
}

foldhost_guest::export_folder!(HostileSleep);
