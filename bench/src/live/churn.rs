//! Matching EndpointSlice writes with the kernel notifications that apply them.
//!
//! Every write gives a Service at least one endpoint it did not have (its fresh endpoints). A
//! write has reached the kernel when a notification adds an element keyed by the Service's
//! address whose value is one of its fresh endpoints; writes to the same Service before it
//! count as applied then too (the agent may coalesce them, and the kernel then never sees
//! the older ones' endpoints).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

struct Write {
    at: Instant,
    fresh: Vec<u32>,
}

/// Writes not yet seen in the kernel, and the latencies of those that were.
#[derive(Default)]
pub struct Matcher {
    pending: HashMap<u32, VecDeque<Write>>,
    pending_count: usize,
    pub latencies: Vec<Duration>,
    /// Writes applied together with a later write to the same Service.
    pub coalesced: usize,
}

impl Matcher {
    /// A write at `at` gave the Service at `service` (its address) the `fresh` endpoints.
    pub fn wrote(&mut self, service: u32, at: Instant, fresh: Vec<u32>) {
        self.pending
            .entry(service)
            .or_default()
            .push_back(Write { at, fresh });
        self.pending_count += 1;
    }

    /// The kernel added an element `service → endpoint` at `at`.
    pub fn seen(&mut self, service: u32, endpoint: u32, at: Instant) {
        let Some(queue) = self.pending.get_mut(&service) else {
            return;
        };
        let Some(i) = queue.iter().position(|w| w.fresh.contains(&endpoint)) else {
            return;
        };
        for (j, w) in queue.drain(..=i).enumerate() {
            self.latencies.push(at.saturating_duration_since(w.at));
            self.coalesced += usize::from(j < i);
            self.pending_count -= 1;
        }
        if queue.is_empty() {
            self.pending.remove(&service);
        }
    }

    /// Writes never seen in the kernel.
    pub fn lost(&self) -> usize {
        self.pending_count
    }
}

/// The `p`-th percentile (0–100) of sorted `v`, nearest rank.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_are_matched_and_coalesced() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut m = Matcher::default();
        m.wrote(1, t0, vec![10, 11]);
        m.wrote(1, t0 + ms(2), vec![12]);
        m.wrote(2, t0 + ms(3), vec![10]);
        assert_eq!(m.lost(), 3);
        // Another Service's element, an endpoint no write gave: nothing.
        m.seen(3, 10, t0 + ms(4));
        m.seen(1, 99, t0 + ms(4));
        assert_eq!(m.lost(), 3);
        // The second write's endpoint: both writes to Service 1 are applied.
        m.seen(1, 12, t0 + ms(10));
        assert_eq!(m.lost(), 1);
        assert_eq!(m.latencies, vec![ms(10), ms(8)]);
        assert_eq!(m.coalesced, 1);
        // Seen again later: counted once.
        m.seen(1, 11, t0 + ms(20));
        assert_eq!(m.latencies.len(), 2);
        m.seen(2, 10, t0 + ms(5));
        assert_eq!(m.lost(), 0);
        assert_eq!(m.latencies[2], ms(2));
    }

    #[test]
    fn percentiles() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&v, 50.0), Duration::from_millis(50));
        assert_eq!(percentile(&v, 99.0), Duration::from_millis(99));
        assert_eq!(percentile(&v, 100.0), Duration::from_millis(100));
        assert_eq!(percentile(&[], 99.0), Duration::ZERO);
    }
}
