//! The one backoff every retry loop uses: a first delay doubling per failure in a row, capped.
//!
//! Invariants: a delay is never zero and never above its cap, it never shrinks as the count of
//! failures grows, and no count (up to `u32::MAX`) overflows. Each loop that waits names its
//! schedule here, beside the reason for its figures, so the schedules are read in one place.

use std::time::Duration;

/// A doubling delay: `first` after the first counted failure, twice that after the next, up to
/// `cap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
    /// The count of failures that waits `first`: 0 when the count starts at zero (a streak), 1
    /// when it starts at one (a count of failures, where none does not wait).
    counted_from: u32,
}

impl Backoff {
    /// Before retrying a failed apply of the fold's batch: 50 ms doubling, capped at 3.2 s.
    pub const APPLY: Backoff =
        Backoff::new(Duration::from_millis(50), Duration::from_millis(3_200));

    /// Before resuming a watch that broke for the `streak`-th time in a row (the count resets once
    /// a resumed watch commits): 100 ms doubling, capped at 5 s — bounded, so a server that comes
    /// back is picked up within seconds, and never a tight loop.
    pub const WATCH_RESUME: Backoff =
        Backoff::new(Duration::from_millis(100), Duration::from_secs(5));

    /// Before a following node tries again after `failures` in a row (a fetch, an inconclusive
    /// shadow, a broken watch): 2 s doubling, capped at 60 s. Counted from one.
    pub const CHANNEL_RETRY: Backoff =
        Backoff::new(Duration::from_secs(2), Duration::from_secs(60)).counted_from(1);

    /// Before the fold builds another query instance after `failures` were lost in a row
    /// (docs/design.md, "Queries off the fold's path"): 1 s doubling, capped at 60 s. A query that
    /// traps the instance every time costs at most one hydration a minute beside the fold.
    pub const QUERY_INSTANCE: Backoff =
        Backoff::new(Duration::from_secs(1), Duration::from_secs(60));

    /// A schedule starting at `first` (at a count of 0) and capped at `cap`.
    pub const fn new(first: Duration, cap: Duration) -> Self {
        Self {
            first,
            cap,
            counted_from: 0,
        }
    }

    /// The same schedule with `first` waited at a count of `n` (and at every count below it).
    pub const fn counted_from(self, n: u32) -> Self {
        Self {
            counted_from: n,
            ..self
        }
    }

    /// How long to wait after `n` failures (as the loop counts them).
    pub fn after(&self, n: u32) -> Duration {
        // 2^20 × any first delay this project uses is far past every cap; the bound keeps the
        // shift in range for every `n`.
        let doublings = n.saturating_sub(self.counted_from).min(20);
        self.first
            .checked_mul(1 << doublings)
            .map_or(self.cap, |d| d.min(self.cap))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The schedules as each loop wrote them before they shared this type.
    fn written_out(name: &str, n: u32) -> Duration {
        match name {
            "apply" => Duration::from_millis(50u64.saturating_mul(1 << n.min(6))),
            "watch" => Duration::from_millis(100u64.saturating_mul(1 << n.min(10)).min(5_000)),
            "channel" => {
                Duration::from_secs(2u64.saturating_mul(1 << n.saturating_sub(1).min(5)).min(60))
            }
            "query" => Duration::from_secs(1u64.saturating_mul(1 << n.min(6)).min(60)),
            _ => unreachable!("{name}"),
        }
    }

    #[test]
    fn every_named_schedule_waits_what_its_loop_waited_before_for_every_count() {
        let named = [
            ("apply", Backoff::APPLY),
            ("watch", Backoff::WATCH_RESUME),
            ("channel", Backoff::CHANNEL_RETRY),
            ("query", Backoff::QUERY_INSTANCE),
        ];
        for (name, b) in named {
            for n in (0..=64).chain([1_000, u32::MAX - 1, u32::MAX]) {
                assert_eq!(b.after(n), written_out(name, n), "{name} after {n}");
            }
        }
    }

    #[test]
    fn a_delay_is_never_zero_never_above_its_cap_and_never_shrinks() {
        for b in [
            Backoff::APPLY,
            Backoff::WATCH_RESUME,
            Backoff::CHANNEL_RETRY,
            Backoff::QUERY_INSTANCE,
            Backoff::new(Duration::from_secs(u64::MAX / 2), Duration::MAX),
        ] {
            let mut last = Duration::ZERO;
            for n in (0..=80).chain([u32::MAX]) {
                let d = b.after(n);
                assert!(
                    d > Duration::ZERO && d <= b.cap && d >= last,
                    "{b:?} {n}: {d:?}"
                );
                last = d;
            }
        }
    }

    #[test]
    fn a_broken_watch_is_resumed_after_a_bounded_growing_backoff() {
        let b = Backoff::WATCH_RESUME;
        assert_eq!(b.after(0), Duration::from_millis(100));
        assert_eq!(b.after(1), Duration::from_millis(200));
        assert_eq!(b.after(5), Duration::from_millis(3_200));
        for streak in [6, 10, 31, u32::MAX] {
            assert_eq!(b.after(streak), Duration::from_secs(5), "{streak}");
        }
    }
}
