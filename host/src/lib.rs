//! foldhost keeps a local, durable fold of NATS JetStream key-value buckets and runs the domain
//! logic that turns those keys into live structures behind one seam ([`applied::Apply`]).
//!
//! Module map (`ARCHITECTURE.md` has the crates, the map and where to start reading):
//! - [`node`] — the composition root: [`node::Node::run`] over a typed [`node::NodeConfig`].
//! - [`protocol`] — every correctness decision as a pure function.
//! - [`kv`] — the vocabulary: entries, updates, versions, cursors, errors, the capability traits.
//! - [`bucket`] — connections and buckets ([`bucket::Connection`], [`bucket::BucketHandle`]).
//! - [`nats`] — the JetStream implementation of the kv layer, and the live floor guard.
//! - [`snapshot`] — the durable store contract and its backends.
//! - [`retained`] — deferred records kept in the fold until a guest can decode them.
//! - [`view`] — the fold as its readers (guests) see it.
//! - [`applied`] — the fold: the `Apply` seam, [`applied::Fold`], the loop (`watch_applied`).
//! - [`repair`] — the cursor-expiry repairs (key-listing diff, artifact restore).
//! - [`artifact`] — verified copies of a fold: export, import (directory or tar).
//! - [`transport`] — artifacts in object storage: content-addressed payloads, a CAS pointer, prune.
//! - [`lease`] — the export lease: one exporter per round across a fleet (NATS KV CAS).
//! - [`storedir`] — the store directory: backend choice, read-only opens, the status file.
//! - [`status`] — the one status model ([`status::StatusReport`]).
//! - [`guest`] — WebAssembly guests behind the `Apply` seam (wasmtime).
//! - [`write`] — writes through the host: outcomes, operation ids, the ledger's answers.
//! - [`serve`] — the `--listen` endpoint: `/status`, `/query`, `/swap`, `/export`.
//! - [`cli`] — the command line (a shell over `node`).
//! - [`crashpoint`] — named crash points, compiled in only with the `crashpoints` feature (tests).
//! - `testkit` — `SimBucket`, an in-memory JetStream KV bucket for fast tests of the fold (tests and
//!   the `testkit` feature).
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub use foldhost_artifact::artifact;
pub use foldhost_core::bucket;
pub use foldhost_fold::applied;
pub mod cli;
pub use foldhost_core::crashpoint;
pub use foldhost_core::kv;
pub use foldhost_core::ledger;
pub use foldhost_guest::guest;
use foldhost_localnats as localnats;
pub use foldhost_nats::lease;
#[cfg(test)]
mod log_events_tests;
pub(crate) mod metrics;
#[cfg(test)]
mod models;
pub use foldhost_nats as nats;
pub mod node;
pub use foldhost_core::protocol;
pub use foldhost_core::retained;
pub use foldhost_fold::repair;
pub mod serve;
pub use foldhost_core::snapshot;
pub use foldhost_core::status;
pub use foldhost_core::storedir;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
pub use foldhost_artifact::transport;
pub use foldhost_core::view;
pub mod write;
