//! How the agent's heap gives memory back to the kernel.

/// Allocations of at least this many bytes get pages of their own.
#[cfg(target_env = "gnu")]
const MMAP_THRESHOLD: libc::c_int = 128 << 10;

/// Heaps (glibc arenas) the threads share: the main thread's and one for all others.
#[cfg(target_env = "gnu")]
const ARENAS: libc::c_int = 2;

/// Sets up the allocator for a process that keeps a large model for long. Call it first
/// thing, before other threads start.
///
/// - Large buffers go back to the kernel when they are freed. glibc serves them from pages of
///   their own at first, but raises that threshold to the size of each such buffer freed (up
///   to 32 MiB), after which buffers of that size come from the heap and, once freed, stay
///   there as free memory: a cold sync's element vectors, the file's pieces and the netlink
///   batches left 30 MiB of it at 30,000 Services, and set the process's peak RSS. A fixed
///   threshold keeps them apart.
/// - Two arenas instead of one per thread (up to 8 per CPU): memory a thread frees (the
///   file's parsers, the sync thread's temporaries) is reused by the others instead of staying
///   in an arena of its own. At 100,000 Services this took 15–21 MiB off the RSS after the
///   first sync; the threads that allocate much at once (decoding, the sync) rarely run
///   together.
pub fn tune_allocator() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes settings of the allocator; no pointer is passed.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_ARENA_MAX, ARENAS);
    }
}

/// Hands the free pages of the heap back to the kernel. A cold sync or a file load frees tens
/// of MiB of small allocations at once; glibc keeps them mapped (it only trims the top of the
/// main heap), so without this the agent's RSS would stay at its peak until reused.
pub fn release_freed() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks the allocator's own free lists; no pointer is passed.
    unsafe {
        libc::malloc_trim(0);
    }
}
