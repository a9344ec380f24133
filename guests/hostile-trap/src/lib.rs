//! `hostile-trap`: a key → value store whose `apply` traps (panics) on one key.
//!
//! The key is the `init` config's `trap_key` (default `trap.me`): a batch holding a put or a delete
//! of it logs a warning, then traps in `apply`. With the config key `fail_init` set, `init` fails.
//! Otherwise it behaves like `kvstore`: a query's request is a key, the answer its value bytes, or
//! the error `missing` — but a query for the trap key traps too (a trap on live traffic that
//! leaves the fold going).

use std::collections::BTreeMap;

use foldhost_guest::{Change, Folder, Manifest, Verdict};

/// The store, and the key that traps.
struct HostileTrap {
    trap_key: String,
    entries: BTreeMap<String, Vec<u8>>,
}

impl Default for HostileTrap {
    fn default() -> Self {
        HostileTrap {
            trap_key: "trap.me".into(),
            entries: BTreeMap::new(),
        }
    }
}

impl Folder for HostileTrap {
    type Value = Vec<u8>;

    fn manifest() -> Manifest {
        Manifest::whole_bucket("hostile-trap", "0.1.0")
    }

    fn init(&mut self, config: &[(String, String)]) -> Result<(), String> {
        if config.iter().any(|(name, _)| name == "fail_init") {
            return Err("refusing to start: fail_init is set".into());
        }
        if let Some((_, key)) = config.iter().find(|(name, _)| name == "trap_key") {
            self.trap_key = key.clone();
        }
        Ok(())
    }

    fn parse(&self, _key: &str, value: &[u8]) -> Verdict<Vec<u8>> {
        Verdict::Accept(value.to_vec())
    }

    fn apply(&mut self, changes: Vec<Change<Vec<u8>>>) -> Result<(), String> {
        for change in changes {
            if change.key() == self.trap_key {
                foldhost_guest::log::warn(&format!("trapping on {}", self.trap_key));
                panic!("hostile-trap: trapping on {}", self.trap_key);
            }
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
        if key == self.trap_key {
            panic!("hostile-trap: trapping on a query for {}", self.trap_key);
        }
        self.entries
            .get(key)
            .cloned()
            .ok_or_else(|| "missing".into())
    }
}

foldhost_guest::export_folder!(HostileTrap);
