//! How the agent's heap gives memory back to the kernel.

/// Allocations of at least this many bytes get pages of their own.
#[cfg(target_env = "gnu")]
const MMAP_THRESHOLD: libc::c_int = 128 << 10;

/// Makes large buffers go back to the kernel when they are freed. glibc serves them from
/// pages of their own at first, but raises that threshold to the size of each such buffer
/// freed (up to 32 MiB), after which buffers of that size come from the heap and, once freed,
/// stay there as free memory: a cold sync's element vectors, the file's pieces and the
/// netlink batches left 30 MiB of it at 30,000 Services, and set the process's peak RSS. A
/// fixed threshold keeps them apart. Call it first thing, before other threads start.
pub fn return_large_buffers() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes a setting of the allocator; no pointer is passed.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
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
