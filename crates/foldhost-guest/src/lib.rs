//! WebAssembly guests behind the fold's `Apply` seam ([`guest`]): the wasmtime host, the one
//! module that owns `bindgen!` for every released WIT version, the compiled-component cache, and
//! the limits that contain a hostile guest.
#![warn(missing_docs)]

pub(crate) use foldhost_core::{crashpoint, kv, protocol, snapshot, view};
pub(crate) use foldhost_fold::applied;

pub mod guest;
