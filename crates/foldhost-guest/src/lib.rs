//! WebAssembly guests behind the fold's `Apply` seam ([`guest`]): the wasmtime host, the one
//! module that owns `bindgen!` for every released WIT version, the compiled-component cache, and
//! the limits that contain a hostile guest.
#![warn(missing_docs)]

pub mod guest;
