//! A lock-free histogram of whole numbers for the fold's metrics (durations in microseconds,
//! batch sizes), read by `/metrics` at each scrape.
//!
//! Invariant: an observation is never lost; a scrape may see a sum a moment ahead of a bucket.

use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds of [`Histogram`]'s buckets: 1, 2.5, 5 per decade from 1 to 10^7 (a duration in
/// microseconds up to 10 s, a batch's size up to 10 million updates); above the last, `+Inf`.
pub const HISTOGRAM_BOUNDS: [u64; 22] = [
    1, 2, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000,
    250_000, 500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000,
];

/// A histogram of whole numbers, lock-free: a count per bucket of [`HISTOGRAM_BOUNDS`] (and one
/// past the last), their sum and count. Observations are relaxed: a scrape may see a sum a moment
/// ahead of a bucket, never a lost observation.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; HISTOGRAM_BOUNDS.len() + 1],
    sum: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    /// Records `v`.
    pub fn observe(&self, v: u64) {
        let i = HISTOGRAM_BOUNDS.partition_point(|b| *b < v);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(v, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// `(sum, count, [(upper bound, count in that bucket alone)])`, the last bound `None`
    /// (`+Inf`); an exposition accumulates them.
    pub fn snapshot(&self) -> (u64, u64, Vec<(Option<u64>, u64)>) {
        let buckets = self
            .buckets
            .iter()
            .enumerate()
            .map(|(i, b)| (HISTOGRAM_BOUNDS.get(i).copied(), b.load(Ordering::Relaxed)))
            .collect();
        (
            self.sum.load(Ordering::Relaxed),
            self.count.load(Ordering::Relaxed),
            buckets,
        )
    }
}
