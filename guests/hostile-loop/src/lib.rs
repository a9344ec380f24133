//! `hostile-loop`: `apply` never returns, to test the host's deadline.
//!
//! Everything else behaves like `kvstore` (it accepts every update; a query's request is a key,
//! the answer its value bytes or the error `missing`) — but since every `apply` spins forever,
//! nothing is ever stored.

use std::collections::BTreeMap;

use foldhost_guest::{Change, Folder, Manifest, Verdict};

/// A store that never gets anything applied.
#[derive(Default)]
struct HostileLoop {
    entries: BTreeMap<String, Vec<u8>>,
}

impl Folder for HostileLoop {
    type Value = Vec<u8>;

    fn manifest() -> Manifest {
        Manifest::whole_bucket("hostile-loop", "0.1.0")
    }

    fn parse(&self, _key: &str, value: &[u8]) -> Verdict<Vec<u8>> {
        Verdict::Accept(value.to_vec())
    }

    fn apply(&mut self, changes: Vec<Change<Vec<u8>>>) -> Result<(), String> {
        // `black_box` hides the counter from the optimizer, so the loop stays.
        let mut spins = std::hint::black_box(changes.len() as u64);
        loop {
            spins = std::hint::black_box(spins.wrapping_add(1));
        }
    }

    fn query(&self, request: &[u8]) -> Result<Vec<u8>, String> {
        let key = std::str::from_utf8(request).map_err(|_| "missing")?;
        self.entries
            .get(key)
            .cloned()
            .ok_or_else(|| "missing".into())
    }
}

foldhost_guest::export_folder!(HostileLoop);
