//! Work on every core, results in order: the pieces of a file are read on worker threads, and
//! their results handed over on the calling thread in file order, a few chunks ahead at most
//! (so that memory holds a window of results, not the file's).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

/// Units per chunk a worker takes at once.
const CHUNK: usize = 16;
/// How many chunks workers may run ahead of the one being handed over. Small: when the
/// calling thread is the slower side (it applies every object), the results workers hold at
/// the end are handed over with no worker left to run beside it, once per piece of a file.
const WINDOW: usize = 16;

/// Runs `work` on every unit and hands the results to `deliver` in unit order, on the calling
/// thread; stops early (soon, not at once) when `deliver` returns false.
pub(crate) fn ordered<U: Sync, R: Send>(
    units: &[U],
    work: impl Fn(&U) -> R + Sync,
    mut deliver: impl FnMut(R) -> bool,
) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    if threads < 2 || units.len() < 2 * CHUNK {
        for unit in units {
            if !deliver(work(unit)) {
                return;
            }
        }
        return;
    }
    let chunks = units.len().div_ceil(CHUNK);
    let next = AtomicUsize::new(0);
    let handed = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let (tx, rx) = mpsc::sync_channel::<(usize, Vec<R>)>(threads * 2);
    std::thread::scope(|s| {
        for _ in 0..threads {
            let tx = tx.clone();
            let (next, handed, stop, work) = (&next, &handed, &stop, &work);
            s.spawn(move || {
                loop {
                    let c = next.fetch_add(1, Ordering::Relaxed);
                    if c >= chunks {
                        return;
                    }
                    while c > handed.load(Ordering::Acquire) + WINDOW {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let end = ((c + 1) * CHUNK).min(units.len());
                    let out = units[c * CHUNK..end].iter().map(work).collect();
                    if tx.send((c, out)).is_err() {
                        return;
                    }
                }
            });
        }
        drop(tx);
        let mut pending = BTreeMap::new();
        let mut want = 0;
        'receive: for (c, out) in rx {
            pending.insert(c, out);
            while let Some(out) = pending.remove(&want) {
                want += 1;
                handed.store(want, Ordering::Release);
                for r in out {
                    if !deliver(r) {
                        stop.store(true, Ordering::Relaxed);
                        break 'receive;
                    }
                }
            }
        }
        // Leaving the loop dropped the receiver: workers still sending stop.
        stop.store(true, Ordering::Relaxed);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_in_order_and_stop_when_asked() {
        let units: Vec<usize> = (0..10_000).collect();
        let mut seen = Vec::new();
        ordered(
            &units,
            |u| u * 2,
            |r| {
                seen.push(r);
                true
            },
        );
        assert_eq!(seen, units.iter().map(|u| u * 2).collect::<Vec<_>>());
        let mut seen = Vec::new();
        ordered(
            &units,
            |u| *u,
            |r| {
                seen.push(r);
                r < 5_000
            },
        );
        assert_eq!(seen, (0..=5_000).collect::<Vec<_>>());
        // Stopping at once, with workers blocked on a full channel, returns.
        let mut seen = 0;
        ordered(
            &units,
            |u| *u,
            |_| {
                std::thread::sleep(Duration::from_millis(5));
                seen += 1;
                false
            },
        );
        assert_eq!(seen, 1);
    }

    /// Whichever thread reads a chunk, and however long it takes, results come in order and
    /// each exactly once.
    #[test]
    fn uneven_work_still_comes_in_order() {
        let units: Vec<u64> = (0..3_000).collect();
        for slow_delivery in [false, true] {
            let mut seen = Vec::new();
            ordered(
                &units,
                |u| {
                    if u % 97 == 0 {
                        std::thread::sleep(Duration::from_micros(300));
                    }
                    *u
                },
                |r| {
                    if slow_delivery && r % 31 == 0 {
                        std::thread::sleep(Duration::from_micros(100));
                    }
                    seen.push(r);
                    true
                },
            );
            assert_eq!(seen, units);
        }
    }
}
