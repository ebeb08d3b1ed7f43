//! A client that opens a new TCP connection to one address at a steady pace until stopped,
//! counting the connections an echo server answered and those that failed: what a prober
//! sees of a Service while the agent restarts, waits or resyncs.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

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
}

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
                while !s.stop.load(Ordering::SeqCst) {
                    let answered = TcpStream::connect_timeout(&dst, timeout)
                        .and_then(|mut c| {
                            c.set_read_timeout(Some(timeout))?;
                            let mut buf = String::new();
                            c.read_to_string(&mut buf)?;
                            Ok(!buf.is_empty())
                        })
                        .unwrap_or(false);
                    if answered {
                        s.answered.fetch_add(1, Ordering::SeqCst);
                    } else {
                        s.failed.fetch_add(1, Ordering::SeqCst);
                        if s.answered.load(Ordering::SeqCst) > 0 {
                            s.failed_after_first.fetch_add(1, Ordering::SeqCst);
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
