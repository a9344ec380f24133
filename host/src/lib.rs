//! foldhost keeps a local, durable fold of NATS JetStream key-value buckets and runs the domain
//! logic that turns those keys into live structures behind one seam ([`applied::Apply`]).
//!
//! Module map (names follow seed 000 so the two can be read side by side):
//! - [`kv`] — the vocabulary: entries, updates, versions, cursors, errors, the capability traits.
//! - [`stores`] — connections and buckets ([`stores::Connection`], [`stores::KvStore`]).
//! - [`nats`] — the JetStream implementation of the kv layer.
//! - [`protocol`] — every correctness decision as a pure function.
//! - [`snapshot`] — the durable fold contract and the append-log backend.
//! - [`retained`] — deferred records kept in the fold until a guest can decode them.
//! - [`artifact`] — verified copies of a fold: export, import (directory or tar).
//! - [`storedir`] — the store directory: backend choice, read-only opens, the status file.
//! - [`guest`] — WebAssembly guests behind the `Apply` seam (wasmtime).
//! - [`applied`] — `watch_applied` and [`applied::Fold`]: cursor-after-apply.
//! - [`localnats`] — a throwaway local nats-server for the demo and the tests.
//! - [`serve`] — the `--listen` endpoint: `/status`, `/query`, `/swap`.
//! - [`cli`] — the command line.
//! - [`crashpoint`] — named crash points, compiled in only with the `crashpoints` feature (tests).
//! - `testkit` — `SimBucket`, an in-memory JetStream KV bucket for fast tests of the fold (tests and
//!   the `testkit` feature).
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod applied;
pub mod artifact;
pub mod cli;
pub mod crashpoint;
pub mod guest;
pub mod kv;
pub mod localnats;
pub mod nats;
pub mod node;
pub mod protocol;
pub mod repair;
pub mod retained;
pub mod serve;
pub mod snapshot;
pub mod status;
pub mod storedir;
pub mod stores;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
