//! Stateright models of the fold's protocol, compiled into the crate's tests only.
//!
//! Invariants:
//! - A model decides nothing itself: every correctness decision it makes goes through the same
//!   `protocol` function production calls, never a copy.
//! - A mutation is the model run with one decision forged (a kernel's input or answer replaced),
//!   and each mutation has a test asserting the checker finds its counterexample.

mod channel;
mod cursor;
mod deferral;
mod fleet;
mod floor;
mod ledger;
mod log;
mod repair;
mod resync;
