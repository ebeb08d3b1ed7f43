//! Returning freed heap to the kernel.

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
