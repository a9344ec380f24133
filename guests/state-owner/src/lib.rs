//! `state-owner`: a test guest of contract 0.3.0 (`wit/v0.3.0/guest.wit`) that owns state buckets,
//! for the host's live tests of module state.
//!
//! Manifest: name `owner`, version `0.3.0`, the whole main bucket, two owned buckets `notes` and
//! `tally` (history 1, no age or size limit, no per-key TTL), no reads. Its first owned bucket,
//! the one its probe and mirror writes go to, is `notes`.
//!
//! The behaviour is shared with `state-reader` and lives in
//! [`../state-common/guest.rs`](../../state-common/guest.rs): it records every bucket it is given
//! (entries, `end-of-current`, a per-bucket event log, contract violations), mirrors main-bucket
//! changes under `mirror/` into its first owned bucket from `on-applied`, optionally tries writes
//! from `parse` and `apply` (which the host must refuse), and answers JSON queries that read and
//! write state through the `state` import.

/// The module's name in the manifest.
const NAME: &str = "owner";
/// The buckets it owns, in manifest order; the first is where its own writes go.
const OWNED: &[&str] = &["notes", "tally"];
/// The other modules' buckets it reads.
const READS: &[&str] = &[];

#[path = "../../state-common/guest.rs"]
mod guest;
