//! A client that opens a new TCP connection to one address at a steady pace until stopped,
//! counting the connections an echo server answered and those that failed: what a prober
//! sees of a Service while the agent restarts, waits or resyncs.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::apiserver::in_netns;
use crate::lab::Ns;

/// What a [`ConnectLoop`] saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub answered: usize,
    pub failed: usize,
    /// Failures after the first answer.
    pub failed_after_first: usize,
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    answered: AtomicUsize,
    failed: AtomicUsize,
    failed_after_first: AtomicUsize,
    /// The first failures: when (from the start) and why.
    failures: Mutex<Vec<String>>,
}

/// Failures kept with their reason; the count goes on past it.
const FAILURES_KEPT: usize = 10;

/// Connects from `ns` to `dst` every `every` until [`ConnectLoop::finish`].
pub struct ConnectLoop {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl ConnectLoop {
    /// A connection counts as answered when the peer sends something before closing; each
    /// attempt gives up after `timeout`.
    pub fn start(ns: &Ns, dst: SocketAddr, every: Duration, timeout: Duration) -> ConnectLoop {
        let shared = Arc::new(Shared::default());
        let name = ns.name().to_string();
        let s = shared.clone();
        let thread = std::thread::spawn(move || {
            in_netns(&name, || {
                let started = Instant::now();
                while !s.stop.load(Ordering::SeqCst) {
                    let attempt = Instant::now();
                    let answered = TcpStream::connect_timeout(&dst, timeout).and_then(|mut c| {
                        c.set_read_timeout(Some(timeout))?;
                        let mut buf = String::new();
                        c.read_to_string(&mut buf)?;
                        Ok(!buf.is_empty())
                    });
                    if let Ok(true) = answered {
                        s.answered.fetch_add(1, Ordering::SeqCst);
                    } else {
                        s.failed.fetch_add(1, Ordering::SeqCst);
                        if s.answered.load(Ordering::SeqCst) > 0 {
                            s.failed_after_first.fetch_add(1, Ordering::SeqCst);
                        }
                        let why = match answered {
                            Ok(_) => "closed without an answer".to_string(),
                            Err(e) => e.to_string(),
                        };
                        let mut failures = s.failures.lock().unwrap();
                        if failures.len() < FAILURES_KEPT {
                            failures.push(format!(
                                "at {:.3}s (after {:.3}s): {why}",
                                attempt.duration_since(started).as_secs_f64(),
                                attempt.elapsed().as_secs_f64()
                            ));
                        }
                    }
                    std::thread::sleep(every);
                }
            })
            .expect("entering the prober's namespace");
        });
        ConnectLoop {
            shared,
            thread: Some(thread),
        }
    }

    pub fn counts(&self) -> Counts {
        Counts {
            answered: self.shared.answered.load(Ordering::SeqCst),
            failed: self.shared.failed.load(Ordering::SeqCst),
            failed_after_first: self.shared.failed_after_first.load(Ordering::SeqCst),
        }
    }

    /// The first failures, each with its time from the start and its reason.
    pub fn failures(&self) -> Vec<String> {
        self.shared.failures.lock().unwrap().clone()
    }

    /// Stops and returns the final counts.
    pub fn finish(mut self) -> Counts {
        self.stop();
        self.counts()
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ConnectLoop {
    fn drop(&mut self) {
        self.stop();
    }
}
