//! Processes started inside a namespace, with their collected output lines.

use super::*;

/// Collected output lines of a child process, with waiting for a line to appear.
#[derive(Debug, Default)]
pub(super) struct Lines {
    pub(super) state: Mutex<(Vec<String>, bool)>,
    pub(super) cv: Condvar,
}

impl Lines {
    pub(super) fn reader(self: Arc<Self>, stream: impl Read + Send + 'static) {
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines() {
                let Ok(line) = line else { break };
                self.state
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .0
                    .push(line);
                self.cv.notify_all();
            }
            self.state.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
            self.cv.notify_all();
        });
    }

    pub(super) fn snapshot(&self) -> Vec<String> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone()
    }

    pub(super) fn wait_for(
        &self,
        pred: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> Result<String> {
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(l) = st.0.iter().find(|l| pred(l)) {
                return Ok(l.clone());
            }
            if st.1 {
                bail!("output closed without the expected line; got {:?}", st.0);
            }
            let now = Instant::now();
            if now >= deadline {
                bail!(
                    "timed out after {timeout:?} waiting for a line; got {:?}",
                    st.0
                );
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// A child process (usually `ip netns exec ...`, which execs its command, so the PID is the
/// command's own). Its stdout/stderr lines are collected. Killed with SIGKILL on drop.
///
/// The process also gets SIGKILL if the thread that spawned it ends (`PR_SET_PDEATHSIG`), so
/// nothing outlives a crashed test; spawn from the thread that owns the lab.
#[derive(Debug)]
pub struct Proc {
    pub(super) child: Child,
    pub(super) label: String,
    pub(super) stdout: Arc<Lines>,
    pub(super) stderr: Arc<Lines>,
}

impl Proc {
    pub(super) fn spawn(mut cmd: Command, label: &str) -> Result<Proc> {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawning {label}: {cmd:?}"))?;
        let stdout = Arc::new(Lines::default());
        let stderr = Arc::new(Lines::default());
        stdout
            .clone()
            .reader(child.stdout.take().expect("piped stdout"));
        stderr
            .clone()
            .reader(child.stderr.take().expect("piped stderr"));
        Ok(Proc {
            child,
            label: label.to_string(),
            stdout,
            stderr,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Stdout lines so far.
    pub fn stdout(&self) -> Vec<String> {
        self.stdout.snapshot()
    }

    /// Stderr lines so far.
    pub fn stderr(&self) -> Vec<String> {
        self.stderr.snapshot()
    }

    /// Waits until a stdout line matches `pred` (fails if stdout closes or on timeout).
    pub fn wait_stdout(&self, pred: impl Fn(&str) -> bool, timeout: Duration) -> Result<String> {
        self.stdout
            .wait_for(pred, timeout)
            .with_context(|| self.label.clone())
    }

    /// Waits until a stderr line matches `pred` (fails if stderr closes or on timeout).
    pub fn wait_stderr(&self, pred: impl Fn(&str) -> bool, timeout: Duration) -> Result<String> {
        self.stderr
            .wait_for(pred, timeout)
            .with_context(|| self.label.clone())
    }

    /// The exit status, if it has exited.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        Ok(self.child.try_wait()?)
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait()? {
                return Ok(Some(st));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited after `grace`.
    pub fn terminate(&mut self, grace: Duration) -> Result<ExitStatus> {
        if let Some(st) = self.child.try_wait()? {
            return Ok(st);
        }
        // SAFETY: signalling our own, not yet reaped child by PID.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        match self.wait_timeout(grace)? {
            Some(st) => Ok(st),
            None => self.kill(),
        }
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        if let Some(st) = self.child.try_wait()? {
            return Ok(st);
        }
        let _ = self.child.kill();
        Ok(self.child.wait()?)
    }
}

/// Lines of a process's stderr printed when a test fails while it runs.
const STDERR_TAIL_ON_FAILURE: usize = 80;

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.kill();
        if std::thread::panicking() {
            let lines = self.stderr.snapshot();
            let tail = &lines[lines.len().saturating_sub(STDERR_TAIL_ON_FAILURE)..];
            if !tail.is_empty() {
                eprintln!("{} stderr, last {} lines:", self.label, tail.len());
                for line in tail {
                    eprintln!("  {line}");
                }
            }
        }
    }
}
