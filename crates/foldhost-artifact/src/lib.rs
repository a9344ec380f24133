//! Verified copies of a fold and their transport: [`artifact`] (export, import, the manifest, the
//! tar form) and [`transport`] (artifacts in object storage: content-addressed payloads, a
//! compare-and-set pointer, prune). Below the fold's loop: a running fold exports through a copier
//! it is handed ([`artifact::export_live_with`]), never through the loop's own types.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod artifact;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod transport;
