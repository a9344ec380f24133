//! The integration suites, linked into one test binary.
//!
//! Every suite runs the real `foldhost` binary or library against a real nats-server. They live in
//! one binary on purpose: each test binary links wasmtime, fjall and RocksDB (hundreds of MB with
//! debug info), so nine binaries cost nine links and several GB of disk on a 2-core CI machine.
//! nextest still runs every test in its own process.

mod artifact_store;
mod artifacts;
mod channel;
mod cli;
mod cluster;
mod config;
mod crash_safety;
mod defer;
mod endpoint;
mod examples;
mod fairness;
mod floor;
mod grants;
mod guest_runtime;
mod guests;
mod history;
mod hosted;
mod identity;
mod languages;
mod lean_auth;
mod lease;
mod localnats;
mod log_events;
mod nats_auth;
mod page;
mod probes;
mod queries;
mod repair;
mod resume;
mod server_restart;
mod shadow;
mod state;
mod swap;
mod transport;
mod undecodable;
mod users;
mod watch_semantics;
mod waves;
mod write_faults;
mod writes;
