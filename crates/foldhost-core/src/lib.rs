//! foldhost's lowest layer: what every other crate of the host stands on, and nothing that talks
//! to NATS, runs WebAssembly or reaches object storage (the compiler keeps it so: this crate
//! depends on none of them).
//!
//! - [`protocol`] — every correctness decision as a pure function.
//! - [`kv`] — the vocabulary: entries, updates, versions, cursors, errors, the capability traits.
//! - [`bucket`] — connections and buckets as traits ([`bucket::Connection`],
//!   [`bucket::BucketHandle`]); the NATS implementation lives above.
//! - [`snapshot`] — the durable store contract and its backends (the append log; fjall and
//!   RocksDB behind features).
//! - [`retained`] — deferred records kept in the fold until a guest can decode them.
//! - [`ledger`] — the operation ledger: which write landed where, committed with the fold.
//! - [`view`] — the fold as its readers (guests) see it.
//! - [`storedir`] — the store directory: backend choice, read-only opens, the status file.
//! - [`status`] — the one status model ([`status::StatusReport`]) and the live figures of a
//!   running fold ([`status::FoldStatus`]).
//! - [`staged`] — files written past the page cache and made durable before they are named.
//! - [`crashpoint`] — named crash points, compiled in only with the `crashpoints` feature.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod bucket;
pub mod crashpoint;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod histogram;
pub mod kv;
pub mod ledger;
#[cfg(test)]
mod models;
pub mod protocol;
pub mod retained;
pub mod snapshot;
pub mod staged;
pub mod status;
pub mod storedir;
pub mod view;
