//! The agent's heap: mimalloc, and how it gives memory back to the kernel.
//!
//! A partial sync of a large Service allocates and frees thousands of blocks. With glibc's
//! allocator, the first choice, a third of such a sync's own work (before the commit) went to
//! merging and sorting the blocks freed by the previous one (`malloc_consolidate`); mimalloc
//! keeps free blocks per page and size and does none of that (docs/performance.md, "Whole
//! large Services: the kernel's floor and the agent's part").

/// The allocator of the `nftproxy` binary (declared there, so that the library's users, the
/// tests and the bench, choose their own).
pub type Allocator = mimalloc::MiMalloc;

/// Options of the mimalloc this crate builds, as its `mimalloc.h` numbers them (the bindings
/// do not name them); a test checks them. `mi_option_arena_eager_commit`, 0 from the build
/// (`.cargo/config.toml`: set at run time it would come after the first arena is made):
#[cfg(test)]
const ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;
/// `mi_option_purge_delay`:
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps the agent's resident memory where glibc's allocator had it: freed pages go back to
/// the kernel at once rather than a second later (a cold sync frees tens of MiB as it goes; an
/// idle agent would never get to them), as memory is committed as it is used (the build's
/// setting). What an operator sizes the DaemonSet by is the RSS after the first sync and its
/// peak. Call it first thing.
pub fn configure() {
    // SAFETY: sets one of the allocator's options; no pointer is passed.
    unsafe {
        libmimalloc_sys::mi_option_set(PURGE_DELAY, 0);
    }
}

/// Hands the freed memory of the heap back to the kernel. A cold sync or a file load frees tens
/// of MiB of small allocations at once, on threads that have ended since.
pub fn release_freed() {
    // SAFETY: mi_collect only walks the allocator's own structures; no pointer is passed.
    unsafe {
        libmimalloc_sys::mi_collect(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_options_are_the_ones_named() {
        for (option, env, want, why) in [
            (
                ARENA_EAGER_COMMIT,
                "MIMALLOC_ARENA_EAGER_COMMIT",
                0,
                "not built with .cargo/config.toml's CFLAGS, or the option numbering changed",
            ),
            (
                PURGE_DELAY,
                "MIMALLOC_PURGE_DELAY",
                1000,
                "the option numbering changed (its default is 1000 ms)",
            ),
        ] {
            if std::env::var_os(env).is_some() {
                continue;
            }
            // SAFETY: reads one of the allocator's options.
            let value = unsafe { libmimalloc_sys::mi_option_get(option) };
            assert_eq!(value, want, "{env}: {why}");
        }
    }
}
