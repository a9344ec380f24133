//! TEMPORARY placeholder (replaced by the real codec).
/// Max value.
pub const MAX_VALUE_LEN: usize = 64 * 1024 * 1024;
/// Max key.
pub const MAX_KEY_LEN: usize = u16::MAX as usize;
