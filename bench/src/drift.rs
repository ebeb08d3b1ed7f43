//! The daemon's drift monitor for the benches' in-process `Syncer`s: the daemon always has one,
//! and while it listens the kernel builds a notification for every object a commit adds or
//! deletes that the `Syncer` does not pause it for.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use anyhow::{Context, Result};
use nftproxy::nftables::monitor::Monitor;
use nftproxy::proxier::Syncer;

/// A `Syncer` as the daemon has it, with its drift monitor (keep both while syncing). Call in
/// the namespace the `Syncer` is to program.
pub fn daemon_syncer() -> Result<(Syncer, DriftMonitor)> {
    let mut syncer = Syncer::new().context("opening the Syncer")?;
    let monitor = DriftMonitor::attach(&mut syncer)?;
    Ok((syncer, monitor))
}

/// Subscribed to nf_tables notifications in the namespace, read by a thread of its own, and
/// paused by the `Syncer` around its large transactions, as in the daemon.
pub struct DriftMonitor {
    stop: Arc<AtomicBool>,
    reader: Option<JoinHandle<()>>,
}

impl DriftMonitor {
    /// Call in the namespace of `syncer`'s tables.
    fn attach(syncer: &mut Syncer) -> Result<DriftMonitor> {
        let portid = syncer
            .portid()
            .context("the Syncer has no nftables connection")?;
        let mut monitor = Monitor::open(portid).context("opening the drift monitor")?;
        syncer.set_quieter(
            monitor.quieter(|| eprintln!("bench: a commit went unseen by the drift monitor")),
        );
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let reader = std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let mut pfd = libc::pollfd {
                    fd: monitor.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: poll on one live pollfd; the timeout lets the thread see `stop`.
                if unsafe { libc::poll(&mut pfd, 1, 20) } > 0 {
                    monitor.drain();
                }
            }
        });
        Ok(DriftMonitor {
            stop,
            reader: Some(reader),
        })
    }
}

impl Drop for DriftMonitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}
