//! `hostile-membomb`: `apply` allocates without bound, to test the host's memory cap.
//!
//! `apply` keeps 1 MiB blocks, each filled (so every page is touched), until an allocation fails
//! (which aborts: a trap). Everything else behaves like `kvstore` (it accepts every update; a
//! query's request is a key, the answer its value bytes or the error `missing`) — but nothing is
//! ever stored.

use std::collections::BTreeMap;

use foldhost_guest::{Change, Folder, Manifest, Verdict};

const MIB: usize = 1 << 20;

/// A store that never gets anything applied.
#[derive(Default)]
struct HostileMembomb {
    entries: BTreeMap<String, Vec<u8>>,
}

impl Folder for HostileMembomb {
    type Value = Vec<u8>;

    fn manifest() -> Manifest {
        Manifest::whole_bucket("hostile-membomb", "0.1.0")
    }

    fn parse(&self, _key: &str, value: &[u8]) -> Verdict<Vec<u8>> {
        Verdict::Accept(value.to_vec())
    }

    fn apply(&mut self, _changes: Vec<Change<Vec<u8>>>) -> Result<(), String> {
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        loop {
            // A non-zero fill writes every byte; `black_box` keeps the blocks alive and written.
            let block = std::hint::black_box(vec![0xa5u8; MIB]);
            hoard.push(block);
            std::hint::black_box(&mut hoard);
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

foldhost_guest::export_folder!(HostileMembomb);
