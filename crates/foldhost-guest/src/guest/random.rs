//! What a guest gets when it asks for random numbers: a deterministic stream, so the same fold
//! rebuilds the same state.
//!
//! Every instance of a component starts the same three streams (`wasi:random/random`,
//! `wasi:random/insecure` and the `insecure-seed` pair), each the BLAKE3 output stream keyed by the
//! host's seed over a label and the component's own BLAKE3. So:
//! - every instance of a component starts the same streams: one rebuilt from the fold (after a
//!   trap, a restart, on another host with the same seed) draws the numbers the one before it drew
//!   for the same sequence of calls — so its hash seeds, which are drawn first, are the same; what
//!   it draws later depends on the calls it gets, which a rebuild (hydration, not the original
//!   batches) need not repeat;
//! - another component (a new version, a shadow candidate) draws other numbers: a guest whose
//!   answers depend on them (a hash map's iteration order in a listing) answers differently;
//! - two components never share a stream, and neither do the three interfaces;
//! - a guest's hash tables are seeded from this stream (Rust's `HashMap` is), so whoever knows the
//!   seed can compute keys that collide. The seed is therefore the host's secret: `foldhost run`
//!   keeps one per store (`guest-seed`, 32 random bytes, private to the user) unless the operator
//!   gives one (`--guest-seed`), which a fleet that wants identical guests on every node does.
//!
//! The construction is fixed (a change is a new label), so a stream is the same in every foldhost
//! build that has this label.

use std::convert::Infallible;

/// The label of this construction; a different construction must use a different label.
const LABEL: &[u8] = b"foldhost guest random v1\0";

/// One deterministic random stream (BLAKE3's extendable output).
pub(crate) struct GuestRandom(blake3::OutputReader);

impl GuestRandom {
    /// The stream named `stream` of the component whose BLAKE3 is `component`, under `seed`.
    pub fn new(seed: &[u8; 32], component: &[u8; 32], stream: &str) -> Self {
        let mut h = blake3::Hasher::new_keyed(seed);
        h.update(LABEL);
        h.update(stream.as_bytes());
        h.update(&[0]);
        h.update(component);
        GuestRandom(h.finalize_xof())
    }

    /// The first 16 bytes of the stream, as a number (`wasi:random/insecure-seed`).
    pub(crate) fn first_u128(mut self) -> u128 {
        let mut b = [0u8; 16];
        self.0.fill(&mut b);
        u128::from_le_bytes(b)
    }
}

impl rand_core::TryRng for GuestRandom {
    type Error = Infallible;

    fn try_next_u32(&mut self) -> Result<u32, Infallible> {
        let mut b = [0u8; 4];
        self.0.fill(&mut b);
        Ok(u32::from_le_bytes(b))
    }

    fn try_next_u64(&mut self) -> Result<u64, Infallible> {
        let mut b = [0u8; 8];
        self.0.fill(&mut b);
        Ok(u64::from_le_bytes(b))
    }

    fn try_fill_bytes(&mut self, dst: &mut [u8]) -> Result<(), Infallible> {
        self.0.fill(dst);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_core::Rng;

    #[test]
    fn a_stream_is_fixed_by_seed_component_and_name() {
        let draw = |seed: u8, component: u8, stream: &str| {
            let mut r = GuestRandom::new(&[seed; 32], &[component; 32], stream);
            let mut b = [0u8; 40];
            r.fill_bytes(&mut b);
            (b, r.next_u64())
        };
        assert_eq!(draw(1, 2, "random"), draw(1, 2, "random"));
        assert_ne!(draw(1, 2, "random"), draw(9, 2, "random"));
        assert_ne!(draw(1, 2, "random"), draw(1, 9, "random"));
        assert_ne!(draw(1, 2, "random"), draw(1, 2, "insecure"));
        // Fixed across builds: the first word of one stream, as this construction defines it.
        let mut r = GuestRandom::new(&[0; 32], &[0; 32], "random");
        let first = r.next_u64();
        let mut h = blake3::Hasher::new_keyed(&[0; 32]);
        h.update(b"foldhost guest random v1\0random\0");
        h.update(&[0; 32]);
        let mut b = [0u8; 8];
        h.finalize_xof().fill(&mut b);
        assert_eq!(first, u64::from_le_bytes(b));
    }
}
