//! Work that should use only CPU time nothing else wants: building the first sync's tables
//! ahead while the initial lists arrive competes with the listing itself (the decoding, and on
//! small nodes the API server) and would delay it. Run at the lowest priority, it takes idle
//! time only; what it could not do is left to the first sync. Once the lists are complete, the
//! work in progress gets its thread's own priority back at once ([`Idle::end`]), so that a busy
//! CPU does not hold the first sync up.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// The lowest priority (nice value).
const LOWEST: libc::c_int = 19;

/// `CAP_SYS_NICE`, which raising a thread's priority back needs.
const CAP_SYS_NICE: u32 = 23;

/// Runs work at the lowest priority until [`Idle::end`].
#[derive(Debug, Default)]
pub struct Idle {
    /// The thread running at the lowest priority now (0: none), and its own priority.
    tid: AtomicI32,
    own: AtomicI32,
    ended: AtomicBool,
}

impl Idle {
    /// Runs `f` with the calling thread at the lowest priority, and gives the thread its own
    /// back afterwards (or at [`Idle::end`], whichever comes first). After `end`, or where the
    /// priority could not be given back (no `CAP_SYS_NICE`), `f` runs at the thread's own.
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        if self.ended.load(Ordering::SeqCst) || !may_raise() {
            return f();
        }
        // SAFETY: gettid has no memory effects.
        let tid = unsafe { libc::gettid() };
        let Some(own) = priority(tid) else {
            return f();
        };
        self.own.store(own, Ordering::SeqCst);
        if !set_priority(tid, LOWEST) {
            return f();
        }
        self.tid.store(tid, Ordering::SeqCst);
        // `end` may have come in between and found no thread to raise.
        if self.ended.load(Ordering::SeqCst) {
            self.restore();
        }
        let out = f();
        self.restore();
        out
    }

    /// From now on nothing runs at the lowest priority: work in progress gets its thread's own
    /// priority back. Any thread may call it.
    pub fn end(&self) {
        self.ended.store(true, Ordering::SeqCst);
        self.restore();
    }

    fn restore(&self) {
        let tid = self.tid.swap(0, Ordering::SeqCst);
        if tid != 0 && !set_priority(tid, self.own.load(Ordering::SeqCst)) {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "cannot give the sync thread its priority back"
            );
        }
    }
}

/// The nice value of thread `tid`.
fn priority(tid: libc::pid_t) -> Option<libc::c_int> {
    // -1 is a valid priority: errno tells a failure.
    // SAFETY: errno is this thread's; getpriority has no memory effects.
    unsafe {
        *libc::__errno_location() = 0;
        let p = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
        (*libc::__errno_location() == 0).then_some(p)
    }
}

fn set_priority(tid: libc::pid_t, nice: libc::c_int) -> bool {
    // SAFETY: setpriority has no memory effects.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) == 0 }
}

/// Whether this process may raise a thread's priority (`CAP_SYS_NICE` is effective).
fn may_raise() -> bool {
    static MAY: OnceLock<bool> = OnceLock::new();
    *MAY.get_or_init(|| {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .is_some_and(|caps| caps & (1 << CAP_SYS_NICE) != 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mine() -> libc::c_int {
        // SAFETY: gettid has no memory effects.
        priority(unsafe { libc::gettid() }).expect("own priority")
    }

    #[test]
    fn idle_work_runs_at_the_lowest_priority_and_the_thread_gets_its_own_back() {
        let own = mine();
        let idle = Idle::default();
        assert_eq!(idle.run(mine), if may_raise() { LOWEST } else { own });
        assert_eq!(mine(), own);
        // Ended from within (as another thread would): the rest runs at the thread's own.
        let during = idle.run(|| {
            idle.end();
            mine()
        });
        assert_eq!(during, own);
        assert_eq!(idle.run(mine), own, "after the end");
        assert_eq!(mine(), own);
    }
}
