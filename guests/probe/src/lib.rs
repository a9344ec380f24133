//! `probe`: a test guest that reports what the host lets a guest observe, so tests can hold the
//! host to its determinism promise.
//!
//! Queries (UTF-8 requests, UTF-8 answers):
//! - `random` — 16 bytes from `wasi:random/random` (through `getrandom`), in hex, then the hash
//!   std's `HashMap` gives a fixed key (std seeds its hasher from `wasi:random/insecure-seed`):
//!   what a guest's draws and its hash tables depend on.
//! - `clock` — the wall clock and the monotonic clock, in nanoseconds.
//! - `count` — how many `probe.*` updates this instance applied.

use std::hash::BuildHasher;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use foldhost_guest::{Change, Folder, Manifest, Verdict};

#[derive(Default)]
struct Probe {
    applied: u64,
    /// The first instant this instance saw: the monotonic clock is read against it.
    started: Option<Instant>,
}

/// 16 random bytes and a std hash of a fixed key, as hex (an error if the host gives none).
fn draw_hex() -> Result<String, String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| format!("no random bytes: {e}"))?;
    let hashed = std::collections::hash_map::RandomState::new().hash_one("probe");
    let mut out: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    out.push_str(&format!("{hashed:016x}"));
    Ok(out)
}

impl Folder for Probe {
    type Value = ();

    fn manifest() -> Manifest {
        Manifest::new("probe", "0.1.0", ["probe."])
    }

    fn parse(&self, _key: &str, _value: &[u8]) -> Verdict<()> {
        Verdict::Accept(())
    }

    fn apply(&mut self, changes: Vec<Change<()>>) -> Result<(), String> {
        self.started.get_or_insert_with(Instant::now);
        self.applied += changes.len() as u64;
        Ok(())
    }

    fn query(&self, request: &[u8]) -> Result<Vec<u8>, String> {
        let answer = match request {
            b"random" => draw_hex()?,
            b"clock" => {
                let wall = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0);
                let mono = self.started.map(|s| s.elapsed().as_nanos()).unwrap_or(0);
                format!("wall={wall} monotonic={mono}")
            }
            b"count" => self.applied.to_string(),
            other => {
                return Err(format!(
                    "unknown probe {:?}",
                    String::from_utf8_lossy(other)
                ));
            }
        };
        Ok(answer.into_bytes())
    }
}

foldhost_guest::export_folder!(Probe);
