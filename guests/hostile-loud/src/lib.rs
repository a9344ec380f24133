//! `hostile-loud`: says too much, to test the host's caps on what crosses the boundary.
//!
//! Its `apply` logs one 10 MiB line when the batch holds the key `loud.log`, and fails with a
//! 100 MiB error message when it holds `loud.error`; its `query` answers 120 MiB to the request
//! `big`. Otherwise it behaves like `kvstore`: a query's request is a key, the answer its value
//! bytes or the error `missing`.

use std::collections::BTreeMap;

use foldhost_guest::{Change, Folder, Manifest, Verdict};

/// A key → value store with a loud streak.
#[derive(Default)]
struct HostileLoud {
    entries: BTreeMap<String, Vec<u8>>,
}

impl Folder for HostileLoud {
    type Value = Vec<u8>;

    fn manifest() -> Manifest {
        Manifest::whole_bucket("hostile-loud", "0.1.0")
    }

    fn parse(&self, _key: &str, value: &[u8]) -> Verdict<Vec<u8>> {
        Verdict::Accept(value.to_vec())
    }

    fn apply(&mut self, changes: Vec<Change<Vec<u8>>>) -> Result<(), String> {
        for change in changes {
            match change {
                Change::Put { key, value, .. } => {
                    if key == "loud.error" {
                        return Err("E".repeat(100 << 20));
                    }
                    if key == "loud.log" {
                        foldhost_guest::log::info(&"L".repeat(10 << 20));
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
        if request == b"big" {
            return Ok(vec![b'A'; 120 << 20]);
        }
        let key = std::str::from_utf8(request).map_err(|_| "missing")?;
        self.entries
            .get(key)
            .cloned()
            .ok_or_else(|| "missing".into())
    }
}

foldhost_guest::export_folder!(HostileLoud);
