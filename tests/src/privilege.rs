//! Root-only tests on a developer's machine. `cargo test --workspace` as an ordinary user runs
//! the unit and property tests and skips the suites that need root (network namespaces, the
//! kernel's nftables), naming each skipped test on stderr. As root (`scripts/test.sh`, CI)
//! nothing is skipped: a missing tool fails its test.

use std::io::Write;
use std::process::{Command, Stdio};

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Whether the calling test must be skipped because it needs root and this is not root;
/// if so, says so on stderr. Use [`require_root!`](crate::require_root) at a test's start.
pub fn skip_unless_root() -> bool {
    if is_root() {
        return false;
    }
    skipped("needs root and network namespaces");
    true
}

/// Whether the calling test must be skipped because `tool` cannot be run here (by an ordinary
/// user who has not installed it); if so, says so on stderr. As root it never skips: the
/// test runs and fails on the missing tool.
pub fn skip_without_tool(tool: &str) -> bool {
    if is_root() || runs(tool) {
        return false;
    }
    skipped(&format!("needs {tool}"));
    true
}

fn runs(tool: &str) -> bool {
    Command::new(tool)
        .arg("--help")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `SKIPPED (why): test name`, written to the process's stderr directly: the test harness
/// captures `eprintln!`, and a skip must be seen.
fn skipped(why: &str) {
    let thread = std::thread::current();
    // The test harness runs each test on a thread named after it.
    let test = thread.name().unwrap_or("<unnamed test>");
    // One write, so that the line is not split by the harness's own output.
    let line = format!("SKIPPED ({why}): {test}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Returns from the calling test (with the given value, for tests returning a `Result`) if
/// it needs root and this is not root, naming it as skipped.
#[macro_export]
macro_rules! require_root {
    () => {
        if $crate::privilege::skip_unless_root() {
            return;
        }
    };
    ($skipped:expr) => {
        if $crate::privilege::skip_unless_root() {
            return $skipped;
        }
    };
}
