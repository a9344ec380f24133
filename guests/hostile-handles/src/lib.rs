//! `hostile-handles`: leaks WASI handles, to test the host's resource limit.
//!
//! Each WASI resource a guest is handed (an output stream from `get-stderr`, a network from
//! `instance-network`, a pollable from `subscribe-duration`) is an entry in the host's resource
//! table, kept until the guest drops the handle. This guest never drops them:
//!
//! - `apply` leaks handles in an endless loop (three per round: a stream, a network, a pollable,
//!   which holds two entries), so every `apply` runs into the host's limit;
//! - `query` with the request `leak` does the same; `leak:N` leaks N rounds and answers
//!   `leaked N` (the handles stay with the instance); any other request is a key, answered with
//!   its value bytes or the error `missing`.
//!
//! Everything else behaves like `kvstore` (it accepts every update) — but since every `apply`
//! fails, nothing is ever stored.

use std::collections::BTreeMap;

use foldhost_guest::{Change, Folder, Manifest, Verdict};

/// One round of leaks: each handle is forgotten, so the host's entry behind it is never freed.
fn leak_one_round() {
    std::mem::forget(wasip2::cli::stderr::get_stderr());
    std::mem::forget(wasip2::sockets::instance_network::instance_network());
    std::mem::forget(wasip2::clocks::monotonic_clock::subscribe_duration(
        std::hint::black_box(1),
    ));
}

/// A store that never gets anything applied.
#[derive(Default)]
struct HostileHandles {
    entries: BTreeMap<String, Vec<u8>>,
}

impl Folder for HostileHandles {
    type Value = Vec<u8>;

    fn manifest() -> Manifest {
        Manifest::whole_bucket("hostile-handles", "0.1.0")
    }

    fn parse(&self, _key: &str, value: &[u8]) -> Verdict<Vec<u8>> {
        Verdict::Accept(value.to_vec())
    }

    fn apply(&mut self, _changes: Vec<Change<Vec<u8>>>) -> Result<(), String> {
        loop {
            leak_one_round();
        }
    }

    fn query(&self, request: &[u8]) -> Result<Vec<u8>, String> {
        if request == b"leak" {
            loop {
                leak_one_round();
            }
        }
        if let Some(n) = request.strip_prefix(b"leak:") {
            let n: u64 = std::str::from_utf8(n)
                .ok()
                .and_then(|n| n.parse().ok())
                .ok_or("leak:N takes a count")?;
            for _ in 0..n {
                leak_one_round();
            }
            return Ok(format!("leaked {n}").into_bytes());
        }
        let key = std::str::from_utf8(request).map_err(|_| "missing")?;
        self.entries
            .get(key)
            .cloned()
            .ok_or_else(|| "missing".into())
    }
}

foldhost_guest::export_folder!(HostileHandles);
