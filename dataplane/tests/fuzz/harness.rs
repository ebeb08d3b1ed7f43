//! The fuzz runner shared by `dataplane/tests/fuzz.rs` and `agent/tests/fuzz.rs`: proptest
//! generation with a seed and a number of cases taken from the environment, every case run on
//! its own thread with a time limit, and one summary line per target for `scripts/fuzz.sh`.
//!
//! Environment:
//! * `NFTPROXY_FUZZ_CASES`: cases per target (default: the target's own, small, so that
//!   `cargo test` stays fast).
//! * `NFTPROXY_FUZZ_SEED`: a number, or `random`. Default: fixed per target, so that plain
//!   `cargo test` runs are reproducible; `scripts/fuzz.sh` passes random seeds.
//! * `NFTPROXY_FUZZ_TIMEOUT_MS`: how long one case may take before it counts as a hang
//!   (default 10 000 ms; generous, because CI runs debug builds on 2 shared cores).
//! * `NFTPROXY_FUZZ_SECONDS`: keep going, batch after batch of cases (each batch with a seed
//!   of its own, derived from the first), until this many seconds are spent per target.
//!
//! Every target prints `FUZZ-SUMMARY target=... cases=... panics=... hangs=...` (visible with
//! `--nocapture`), with `reached=[...]`: how many inputs got how far (parsed, converted, ...).
//! A failing target then panics with `FUZZ-FAILURE target=... kind=panic|hang seed=...`, the
//! shrunk input and the command that reproduces it.

#![allow(dead_code)]

use std::any::Any;
use std::cell::RefCell;
use std::fmt::Debug;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Once, mpsc};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

/// Name prefix of the threads cases run on (their panics are reported, not printed).
const CASE_THREAD: &str = "fuzz-case";

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

/// Cases per target: `NFTPROXY_FUZZ_CASES`, else `default`.
pub fn cases(default: u32) -> u32 {
    env_u64("NFTPROXY_FUZZ_CASES")
        .map(|n| n.clamp(1, u64::from(u32::MAX)) as u32)
        .unwrap_or(default)
}

/// How long one case may run.
pub fn time_limit() -> Duration {
    Duration::from_millis(env_u64("NFTPROXY_FUZZ_TIMEOUT_MS").unwrap_or(10_000))
}

fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn seed(target: &str) -> u64 {
    match std::env::var("NFTPROXY_FUZZ_SEED").ok().as_deref() {
        Some("random") => {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos() as u64;
            fnv(target) ^ now ^ (u64::from(std::process::id()) << 32)
        }
        Some(_) => env_u64("NFTPROXY_FUZZ_SEED").unwrap_or_else(|| fnv(target)),
        None => fnv(target),
    }
}

fn rng(seed: u64) -> TestRng {
    // splitmix64 spreads the 64-bit seed over ChaCha's 32 bytes.
    let mut state = seed;
    let mut bytes = [0u8; 32];
    for chunk in bytes.chunks_mut(8) {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        chunk.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    TestRng::from_seed(RngAlgorithm::ChaCha, &bytes)
}

thread_local! {
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Panics on case threads are recorded with their location instead of printed (proptest
/// shrinks through many of them); every other thread keeps the default hook.
fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            let on_case_thread = thread::current()
                .name()
                .is_some_and(|n| n.starts_with(CASE_THREAD));
            if on_case_thread {
                let at = info
                    .location()
                    .map(|l| format!(" at {}:{}", l.file(), l.line()))
                    .unwrap_or_default();
                let msg = payload_text(info.payload());
                LAST_PANIC.with(|p| *p.borrow_mut() = Some(format!("{msg}{at}")));
            } else {
                default(info);
            }
        }));
    });
}

fn payload_text(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-text panic payload)".to_string()
    }
}

/// Counts of outcomes targets note, by `target.outcome`: how much of the input got how far.
static NOTES: std::sync::Mutex<std::collections::BTreeMap<String, u64>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Counts one `outcome` of `target` (printed in its summary line), such as `converted`.
pub fn note(target: &str, outcome: &str) {
    if let Ok(mut notes) = NOTES.lock() {
        *notes.entry(format!("{target}.{outcome}")).or_default() += 1;
    }
}

fn notes_of(target: &str) -> String {
    let prefix = format!("{target}.");
    let Ok(notes) = NOTES.lock() else {
        return String::new();
    };
    notes
        .iter()
        .filter_map(|(k, v)| Some(format!("{}={v}", k.strip_prefix(&prefix)?)))
        .collect::<Vec<_>>()
        .join(",")
}

const PANIC: &str = "PANIC";
const HANG: &str = "HANG";

/// Runs `check(input)` on a fresh thread (default 2 MiB stack, like tokio's workers); an error
/// naming a panic (with its message and location) or a hang (no answer within `limit`).
pub fn run_bounded<T: Send + 'static>(
    limit: Duration,
    input: T,
    check: Arc<dyn Fn(T) + Send + Sync>,
) -> Result<(), String> {
    let (tx, rx) = mpsc::channel();
    let spawned = thread::Builder::new()
        .name(format!("{CASE_THREAD}-{:?}", thread::current().id()))
        .spawn(move || {
            let result = panic::catch_unwind(AssertUnwindSafe(|| check(input)));
            let outcome = result.map_err(|payload| {
                LAST_PANIC
                    .with(|p| p.borrow_mut().take())
                    .unwrap_or_else(|| payload_text(&*payload))
            });
            let _ = tx.send(outcome);
        });
    if let Err(e) = spawned {
        return Err(format!("{PANIC}: could not start a case thread: {e}"));
    }
    match rx.recv_timeout(limit) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(msg)) => Err(format!("{PANIC}: {msg}")),
        // The thread is left running: it cannot be stopped, and the test fails anyway.
        Err(mpsc::RecvTimeoutError::Timeout) => Err(format!("{HANG}: no answer within {limit:?}")),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            Err(format!("{PANIC}: the case thread died without a result"))
        }
    }
}

/// A time budget per target: `NFTPROXY_FUZZ_SECONDS` (then batches of cases run, each with
/// its own seed, until it is spent).
fn budget() -> Option<Duration> {
    env_u64("NFTPROXY_FUZZ_SECONDS").map(Duration::from_secs)
}

/// The seed of batch `i` of a run that started with `seed`.
fn batch_seed(seed: u64, i: u64) -> u64 {
    if i == 0 {
        seed
    } else {
        seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(17)
    }
}

/// Fuzzes `check` with `strategy`: `NFTPROXY_FUZZ_CASES` cases (else `default_cases`), each on
/// its own thread under the time limit; with `NFTPROXY_FUZZ_SECONDS`, batches of that many
/// cases until the time is spent. `check` asserts what must hold (it may panic); any panic or
/// overrun fails the test with the shrunk input and the seed of its batch.
pub fn fuzz<S>(
    target: &str,
    default_cases: u32,
    strategy: S,
    check: impl Fn(S::Value) + Send + Sync + 'static,
) where
    S: Strategy,
    S::Value: Clone + Debug + Send + 'static,
{
    install_panic_hook();
    let cases = cases(default_cases);
    let seed = seed(target);
    let limit = time_limit();
    let budget = budget();
    let check: Arc<dyn Fn(S::Value) + Send + Sync> = Arc::new(check);
    let runs = Arc::new(AtomicU64::new(0));
    let slowest = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut batches = 0u64;
    let failure = loop {
        let this_seed = batch_seed(seed, batches);
        let config = Config {
            cases,
            failure_persistence: None,
            max_shrink_iters: 2048,
            max_shrink_time: 60_000,
            // Generation may reject a few inputs (filters); never give up on a target for that.
            max_global_rejects: cases.saturating_mul(64).max(1024),
            ..Config::default()
        };
        let mut runner = TestRunner::new_with_rng(config, rng(this_seed));
        let (runs, slowest, check) = (runs.clone(), slowest.clone(), check.clone());
        let result = runner.run(&strategy, move |input| {
            runs.fetch_add(1, Ordering::Relaxed);
            let t = Instant::now();
            let r = run_bounded(limit, input, check.clone());
            slowest.fetch_max(t.elapsed().as_micros() as u64, Ordering::Relaxed);
            r.map_err(TestCaseError::fail)
        });
        batches += 1;
        match result {
            Ok(()) if budget.is_some_and(|b| started.elapsed() < b) => continue,
            Ok(()) => break None,
            Err(e) => break Some((this_seed, e)),
        }
    };
    let ms = started.elapsed().as_millis();
    let runs = runs.load(Ordering::Relaxed);
    let slowest_ms = slowest.load(Ordering::Relaxed) as f64 / 1000.0;
    let summary = |panics: u32, hangs: u32| {
        println!(
            "FUZZ-SUMMARY target={target} cases={runs} batches={batches} seed={seed:#018x} \
             ms={ms} slowest_case_ms={slowest_ms:.1} panics={panics} hangs={hangs} \
             reached=[{}]",
            notes_of(target)
        )
    };
    match failure {
        None => summary(0, 0),
        Some((seed, TestError::Fail(reason, input))) => {
            let reason = reason.to_string();
            let kind = if reason.starts_with(HANG) {
                summary(0, 1);
                "hang"
            } else {
                summary(1, 0);
                "panic"
            };
            panic!(
                "FUZZ-FAILURE target={target} kind={kind} seed={seed:#018x}\n\
                 {reason}\n\
                 shrunk input: {input:#?}\n\
                 reproduce: NFTPROXY_FUZZ_SEED={seed:#018x} NFTPROXY_FUZZ_CASES={cases} \
                 cargo test -p {} --test fuzz -- --exact {target}",
                env!("CARGO_PKG_NAME")
            );
        }
        Some((seed, TestError::Abort(reason))) => {
            summary(1, 0);
            panic!("FUZZ-FAILURE target={target} kind=abort seed={seed:#018x}: {reason}")
        }
    }
}
