//! A throw-away network namespace for the agent's kernel tests.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

static NEXT_NS: AtomicUsize = AtomicUsize::new(0);

/// A uniquely named network namespace with `lo` up, deleted on drop (also on panic).
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// `kind` goes into the name (`nftp-KIND-PID-N`) so leftovers say which test made them.
    pub fn new(kind: &str) -> Netns {
        assert!(
            nftproxy_tests::privilege::is_root(),
            "the kernel tests need root (they create network namespaces)"
        );
        let name = format!(
            "nftp-{kind}-{}-{}",
            std::process::id(),
            NEXT_NS.fetch_add(1, Ordering::SeqCst)
        );
        let st = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("run ip netns add");
        assert!(st.success(), "ip netns add {name} failed");
        let ns = Netns { name };
        ns.exec(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    /// Runs `f` on a thread that entered the namespace (sockets it opens stay in it).
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let file = File::open(&path).expect("open netns file");
            // SAFETY: setns on a valid namespace fd; it only affects this thread.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .expect("netns thread")
    }

    /// Runs a command in the namespace; panics with its stderr if it fails.
    pub fn exec(&self, argv: &[&str]) -> String {
        let (ok, out, err) = self.try_exec(argv);
        assert!(ok, "{argv:?} failed: {err}");
        out
    }

    /// Runs a command in the namespace: (success, stdout, stderr).
    pub fn try_exec(&self, argv: &[&str]) -> (bool, String, String) {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(argv)
            .output()
            .expect("run ip netns exec");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}
