//! `kvstore`: a plain key → value copy of the whole bucket, for the host's hydration tests.
//!
//! Every put's raw value is stored; a delete or purge removes the key. A query's request is a key
//! (UTF-8); the answer is its value bytes, or the error `missing`. `init` logs one debug line.
//!
//! A value starting with `fmt2:` is in a format only version 0.2.0 (`kvstore-v2`) decodes: this
//! version answers `defer` for it, so the host retains it until 0.2.0 runs.

use std::collections::BTreeMap;

use foldhost_guest::{Change, Folder, Manifest, Verdict};

/// The copy: key → raw value.
#[derive(Default)]
struct KvStore {
    entries: BTreeMap<String, Vec<u8>>,
}

impl Folder for KvStore {
    type Value = Vec<u8>;

    fn manifest() -> Manifest {
        Manifest::whole_bucket("kvstore", "0.1.0")
    }

    fn init(&mut self, config: &[(String, String)]) -> Result<(), String> {
        foldhost_guest::log::debug(&format!(
            "kvstore: init with {} config entries",
            config.len()
        ));
        Ok(())
    }

    fn parse(&self, _key: &str, value: &[u8]) -> Verdict<Vec<u8>> {
        // A newer writer's format this version cannot read: the host keeps it for 0.2.0.
        if value.starts_with(b"fmt2:") {
            return Verdict::Defer;
        }
        Verdict::Accept(value.to_vec())
    }

    fn apply(&mut self, changes: Vec<Change<Vec<u8>>>) -> Result<(), String> {
        for change in changes {
            match change {
                Change::Put { key, value, .. } => {
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
        let key = std::str::from_utf8(request).map_err(|_| "missing")?;
        self.entries
            .get(key)
            .cloned()
            .ok_or_else(|| "missing".into())
    }
}

foldhost_guest::export_folder!(KvStore);
