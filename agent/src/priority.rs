//! Work that should use only CPU time nothing else wants: building the first sync's tables
//! ahead while the initial lists arrive competes with the listing itself (the decoding, and on
//! small nodes the API server) and would delay it. Run at the lowest priority, it takes idle
//! time only; what it could not do is left to the first sync.

use std::sync::OnceLock;

/// The lowest priority (nice value).
const LOWEST: libc::c_int = 19;

/// `CAP_SYS_NICE`, which raising a thread's priority back needs.
const CAP_SYS_NICE: u32 = 23;

/// Runs `f` with the calling thread at the lowest priority, and gives the thread its own back
/// afterwards. Where it could not be given back (no `CAP_SYS_NICE`), `f` runs at the thread's
/// own priority.
pub fn idle<R>(f: impl FnOnce() -> R) -> R {
    if !may_raise() {
        return f();
    }
    // SAFETY: gettid has no memory effects.
    let tid = unsafe { libc::gettid() } as libc::id_t;
    // -1 is a valid priority: errno tells a failure.
    // SAFETY: errno is this thread's; getpriority has no memory effects.
    let own = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, tid)
    };
    // SAFETY: as above.
    if unsafe { *libc::__errno_location() } != 0 {
        return f();
    }
    // SAFETY: setpriority has no memory effects.
    let lowered = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, LOWEST) } == 0;
    let out = f();
    // SAFETY: as above.
    if lowered && unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, own) } != 0 {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "cannot give the sync thread its priority back"
        );
    }
    out
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

    fn priority() -> libc::c_int {
        // SAFETY: no memory effects.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
    }

    #[test]
    fn idle_work_runs_at_the_lowest_priority_and_the_thread_gets_its_own_back() {
        let own = priority();
        let inside = idle(priority);
        assert_eq!(inside, if may_raise() { LOWEST } else { own });
        assert_eq!(priority(), own);
    }
}
