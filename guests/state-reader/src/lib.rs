//! `state-reader`: a test guest of contract 0.3.0 (`wit/v0.3.0/guest.wit`) that reads another
//! module's state bucket, for the host's live tests of module state.
//!
//! Manifest: name `reader`, version `0.3.0`, the whole main bucket, one owned bucket `mine`
//! (history 1, no age or size limit, no per-key TTL), and it reads `owner.notes` (the first owned
//! bucket of `state-owner`). Its first owned bucket, the one its probe and mirror writes go to, is
//! `mine`; a write to `owner.notes` is the host's to refuse (`read_only`).
//!
//! The behaviour is shared with `state-owner` and lives in
//! [`../state-common/guest.rs`](../../state-common/guest.rs): it records every bucket it is given
//! (entries, `end-of-current`, a per-bucket event log, contract violations), mirrors main-bucket
//! changes under `mirror/` into its first owned bucket from `on-applied`, optionally tries writes
//! from `parse` and `apply` (which the host must refuse), and answers JSON queries that read and
//! write state through the `state` import.

/// The module's name in the manifest.
const NAME: &str = "reader";
/// The buckets it owns, in manifest order; the first is where its own writes go.
const OWNED: &[&str] = &["mine"];
/// The other modules' buckets it reads.
const READS: &[&str] = &["owner.notes"];

#[path = "../../state-common/guest.rs"]
mod guest;
