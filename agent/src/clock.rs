//! Time for the sync loop: the system clock in the agent, a manual one in tests, so that
//! coalescing, backoff and periodic syncs are tested in milliseconds without sleeping.

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// What the sync loop needs of time: the time, sleeping, and waiting for a message.
pub trait Clock {
    fn now(&self) -> Instant;

    /// Returns at `deadline` (at once if it has passed).
    fn sleep_until(&mut self, deadline: Instant);

    /// The next message of `rx`, waiting for it until `deadline`.
    fn recv_until<T>(&mut self, rx: &Receiver<T>, deadline: Instant)
    -> Result<T, RecvTimeoutError>;
}

/// The real time.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep_until(&mut self, deadline: Instant) {
        std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
    }

    fn recv_until<T>(
        &mut self,
        rx: &Receiver<T>,
        deadline: Instant,
    ) -> Result<T, RecvTimeoutError> {
        rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
    }
}

type Event = Box<dyn FnOnce() + Send>;

/// A clock that moves only when whoever uses it waits, and then straight to the next thing
/// that happens: a scheduled event (which typically changes the cluster and sends a
/// wake-up) or the deadline. Once nothing is left before `end`, waiting for a message reports
/// the sender gone, which ends the sync loop.
pub struct TestClock {
    now: Instant,
    start: Instant,
    end: Instant,
    events: BTreeMap<(Instant, u64), Event>,
    seq: u64,
}

impl TestClock {
    /// A clock at an arbitrary start, ending `end` after it.
    pub fn new(end: Duration) -> TestClock {
        let start = Instant::now();
        TestClock {
            now: start,
            start,
            end: start + end,
            events: BTreeMap::new(),
            seq: 0,
        }
    }

    /// Time since the start.
    pub fn elapsed(&self) -> Duration {
        self.now - self.start
    }

    /// Runs `event` when the clock reaches `at` after the start.
    pub fn at(&mut self, at: Duration, event: impl FnOnce() + Send + 'static) {
        self.seq += 1;
        self.events
            .insert((self.start + at, self.seq), Box::new(event));
    }

    /// Runs the next event due by `t`, moving the clock to it; false if there is none.
    fn run_next(&mut self, t: Instant) -> bool {
        let Some(entry) = self.events.first_entry() else {
            return false;
        };
        if entry.key().0 > t {
            return false;
        }
        let ((at, _), event) = entry.remove_entry();
        self.now = self.now.max(at);
        event();
        true
    }
}

impl Clock for TestClock {
    fn now(&self) -> Instant {
        self.now
    }

    fn sleep_until(&mut self, deadline: Instant) {
        while self.run_next(deadline) {}
        self.now = self.now.max(deadline);
    }

    fn recv_until<T>(
        &mut self,
        rx: &Receiver<T>,
        deadline: Instant,
    ) -> Result<T, RecvTimeoutError> {
        loop {
            if let Ok(m) = rx.try_recv() {
                return Ok(m);
            }
            if self.run_next(deadline.min(self.end)) {
                continue;
            }
            if deadline > self.end {
                self.now = self.now.max(self.end);
                return Err(RecvTimeoutError::Disconnected);
            }
            self.now = self.now.max(deadline);
            return Err(RecvTimeoutError::Timeout);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::channel;

    use super::*;

    #[test]
    fn a_test_clock_runs_events_in_order_and_ends() {
        let (tx, rx) = channel();
        let mut clock = TestClock::new(Duration::from_secs(10));
        let start = clock.now();
        let t2 = tx.clone();
        clock.at(Duration::from_secs(3), move || t2.send(3).unwrap());
        clock.at(Duration::from_secs(1), move || tx.send(1).unwrap());
        let far = start + Duration::from_secs(5);
        assert_eq!(clock.recv_until(&rx, far), Ok(1));
        assert_eq!(clock.elapsed(), Duration::from_secs(1));
        clock.sleep_until(start + Duration::from_secs(4));
        assert_eq!(clock.elapsed(), Duration::from_secs(4));
        // The event at 3 s ran during the sleep; its message waits.
        assert_eq!(clock.recv_until(&rx, far), Ok(3));
        assert_eq!(clock.recv_until(&rx, far), Err(RecvTimeoutError::Timeout));
        assert_eq!(clock.elapsed(), Duration::from_secs(5));
        let later = start + Duration::from_secs(60);
        assert_eq!(
            clock.recv_until(&rx, later),
            Err(RecvTimeoutError::Disconnected)
        );
    }
}
