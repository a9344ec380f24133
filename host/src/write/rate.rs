//! The fold's measured apply rate, for the lag a pending write or a waiting read is told: records
//! applied per second over the last 30 seconds, sampled from the fold's committed count.
//!
//! Invariants: bounded (at most [`SAMPLES`] samples, one per [`PERIOD`]); a rate is only ever
//! computed from two samples at least a period apart, never from one instant.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use foldhost_core::status::FoldStatus;

/// How often the committed count is sampled.
pub(crate) const PERIOD: Duration = Duration::from_secs(1);
/// Samples kept.
const SAMPLES: usize = 31;

/// Samples of (when, records committed so far).
#[derive(Default)]
pub(crate) struct ApplyRate {
    samples: std::sync::Mutex<VecDeque<(Instant, u64)>>,
}

impl ApplyRate {
    /// Samples `status` every [`PERIOD`] until the returned task is aborted.
    pub(crate) fn start(status: Arc<FoldStatus>) -> (Arc<ApplyRate>, tokio::task::JoinHandle<()>) {
        let rate = Arc::new(ApplyRate::default());
        let r = rate.clone();
        let task = tokio::spawn(tracing::Instrument::in_current_span(async move {
            let mut tick = tokio::time::interval(PERIOD);
            loop {
                tick.tick().await;
                r.sample(Instant::now(), status.committed.load(Ordering::Relaxed));
            }
        }));
        (rate, task)
    }

    /// Records `committed` at `at`.
    pub(crate) fn sample(&self, at: Instant, committed: u64) {
        if let Ok(mut s) = self.samples.lock() {
            if s.len() >= SAMPLES {
                s.pop_front();
            }
            s.push_back((at, committed));
        }
    }

    /// Records applied per second between the oldest and the newest sample (0 with fewer than
    /// two, or none a period apart).
    pub(crate) fn per_second(&self) -> f64 {
        let Ok(s) = self.samples.lock() else {
            return 0.0;
        };
        match (s.front(), s.back()) {
            (Some(&(t0, c0)), Some(&(t1, c1))) if t1.duration_since(t0) >= PERIOD => {
                c1.saturating_sub(c0) as f64 / t1.duration_since(t0).as_secs_f64()
            }
            _ => 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_is_measured_between_samples_a_period_apart_and_is_zero_before() {
        let r = ApplyRate::default();
        let t = Instant::now();
        assert_eq!(r.per_second(), 0.0);
        r.sample(t, 100);
        assert_eq!(r.per_second(), 0.0, "one sample says no rate");
        r.sample(t + Duration::from_millis(500), 150);
        assert_eq!(r.per_second(), 0.0, "half a period says no rate");
        r.sample(t + Duration::from_secs(2), 300);
        assert_eq!(r.per_second(), 100.0);
    }

    #[test]
    fn only_the_last_samples_are_kept() {
        let r = ApplyRate::default();
        let t = Instant::now();
        for i in 0..100u64 {
            r.sample(t + Duration::from_secs(i), i * 10);
        }
        assert_eq!(r.samples.lock().map(|s| s.len()).unwrap_or(0), SAMPLES);
        assert_eq!(r.per_second(), 10.0);
    }
}
