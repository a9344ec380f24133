//! The fold: [`applied`] (the `Apply` seam, `Fold`, the loop over a bucket's watch: batches,
//! commits, retention, swaps, queries between batches) and [`repair`] (the cursor-expiry repairs:
//! the key-listing diff and the artifact restore). It knows buckets only through the capability
//! traits of `foldhost_core::kv` and guests only through `applied::Apply`. `testkit` (tests and
//! the `testkit` feature) is `SimBucket`, an in-memory JetStream KV bucket that runs the fold's loop
//! without a nats-server, and the fold loop's fast tests over it.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod applied;
pub mod repair;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
