//! foldhost keeps a local, durable fold of NATS JetStream key-value buckets and runs the domain
//! logic that turns those keys into live structures behind one seam
//! (`foldhost_fold::applied::Apply`).
//!
//! This crate is the top of the stack: the node, the endpoint, writes and the command line. The
//! layers below are crates of their own, named by their paths (`ARCHITECTURE.md` has the map):
//! `foldhost_core` (the pure decisions in `protocol`, the kv vocabulary, the store and its
//! backends, statuses), `foldhost_nats` (JetStream), `foldhost_artifact` (artifacts and their
//! transport), `foldhost_fold` (the fold's loop and its repairs), `foldhost_guest` (WebAssembly
//! guests) and `foldhost_localnats`. Nothing here re-exports them.
//!
//! Module map:
//! - [`node`] — the composition root: [`node::Node::run`] over a typed [`node::NodeConfig`].
//! - [`write`] — writes through the host: outcomes, operation ids, the ledger's answers.
//! - [`serve`] — the `--listen` endpoint: `/status`, `/query`, `/swap`, `/export`.
//! - [`cli`] — the command line (a shell over `node`).
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod cli;
#[cfg(test)]
mod log_events_tests;
pub(crate) mod metrics;
pub mod node;
pub mod serve;
pub mod write;
