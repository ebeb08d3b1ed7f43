//! Retry timing after failures: exponential backoff with jitter, so that a family whose syncs
//! keep failing is retried soon after a transient error, then less and less often (never less
//! often than `cap`), and so that thousands of nodes failing at once do not retry in step.

use std::time::{Duration, SystemTime};

/// The delays before the retries of one failing thing.
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    failures: u32,
    jitter: Jitter,
}

impl Backoff {
    /// The first retry comes after about `base`, each next one after twice as long, up to
    /// `cap`.
    pub fn new(base: Duration, cap: Duration) -> Backoff {
        Backoff {
            base: base.min(cap),
            cap,
            failures: 0,
            jitter: Jitter::seeded(),
        }
    }

    /// Records a failure; returns how long to wait before trying again: the exponential delay
    /// times a random factor in [0.8, 1.2), never more than `cap`.
    pub fn failed(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let exp = self.base.saturating_mul(1 << (self.failures - 1).min(20));
        let factor = 0.8 + 0.4 * self.jitter.next();
        exp.min(self.cap).mul_f64(factor).min(self.cap)
    }

    /// Records a success: the next failure starts again from `base`.
    pub fn succeeded(&mut self) {
        self.failures = 0;
    }

    /// Failures since the last success.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

/// A small pseudo-random sequence in [0, 1) (xorshift), seeded from the clock and the process:
/// enough to spread retries apart, no cryptography involved.
#[derive(Clone, Debug)]
struct Jitter(u64);

impl Jitter {
    fn seeded() -> Jitter {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Jitter((nanos ^ (u64::from(std::process::id()) << 32)) | 1)
    }

    fn next(&mut self) -> f64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        (x >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_with_jitter_up_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        let delays: Vec<Duration> = (0..8).map(|_| b.failed()).collect();
        for (i, d) in delays.iter().enumerate() {
            let nominal = Duration::from_secs(1 << i).min(Duration::from_secs(30));
            assert!(*d >= nominal.mul_f64(0.8), "{i}: {d:?}");
            assert!(*d <= Duration::from_secs(30), "{i}: {d:?}");
            if nominal < Duration::from_secs(30) {
                assert!(*d < nominal.mul_f64(1.2), "{i}: {d:?}");
            }
        }
        assert_eq!(b.failures(), 8);
        b.succeeded();
        assert!(b.failed() < Duration::from_millis(1200));
    }

    #[test]
    fn retries_spread_out() {
        let delays: Vec<Duration> = (0..20)
            .map(|_| Backoff::new(Duration::from_secs(10), Duration::from_secs(60)).failed())
            .collect();
        let distinct: std::collections::BTreeSet<_> = delays.iter().collect();
        assert!(distinct.len() > 10, "{delays:?}");
    }
}
