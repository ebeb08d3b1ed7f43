//! The agent process as the soak and the live benchmark run it: `nftproxy run --kubeconfig`
//! inside a namespace, its log followed for commits and warnings, stopped by PID.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use crate::netns::{self, Netns};

/// Parses a command-line duration as the agent's configuration does (`10ms`, `1m30s`).
pub fn go_duration(s: &str) -> Result<Duration, String> {
    nftproxy::config::parse_duration(s).ok_or_else(|| format!("not a duration: {s:?}"))
}

pub fn agent_binary(flag: Option<&Path>) -> Result<PathBuf> {
    let path = match flag {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe()?
            .parent()
            .context("no directory of this binary")?
            .join("nftproxy"),
    };
    ensure!(
        path.is_file(),
        "{} not found (cargo build --release -p nftproxy, or --agent PATH)",
        path.display()
    );
    Ok(path)
}

#[derive(Default)]
pub struct AgentLog {
    /// "nftables sync committed" lines.
    pub commits: usize,
    pub warnings: usize,
    pub errors: usize,
    pub first_warnings: Vec<String>,
    pub tail: VecDeque<String>,
    pub closed: bool,
    /// When the "listed" and "nftables sync committed" lines arrived (the first few), for the
    /// live bench's timeline of a cold start.
    pub marks: Vec<(Instant, String)>,
}

/// Lines kept in `marks` (a cold start logs four lists and two commits).
const MAX_MARKS: usize = 16;

/// The agent, started inside the namespace; stopped (SIGTERM, then SIGKILL) by PID on drop.
pub struct Agent {
    pub child: Child,
    pub pid: u32,
    pub started: Instant,
    pub log: Arc<(Mutex<AgentLog>, Condvar)>,
    pub exit: Option<ExitStatus>,
}

impl Agent {
    pub fn start(
        ns: &Netns,
        bin: &Path,
        kubeconfig: &Path,
        config: &Path,
        log_file: Option<&Path>,
    ) -> Result<Agent> {
        let mut cmd = ns.command(bin)?;
        cmd.arg("run")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--config")
            .arg(config)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut file = match log_file {
            Some(p) => Some(std::fs::File::create(p).with_context(|| p.display().to_string())?),
            None => None,
        };
        // Spawned by the main thread, which lives as long as the run: the child's
        // PR_SET_PDEATHSIG follows the thread that spawned it.
        let mut child = cmd.spawn().with_context(|| format!("spawning {cmd:?}"))?;
        let pid = child.id();
        netns::register_child(pid);
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new((Mutex::new(AgentLog::default()), Condvar::new()));
        let shared = log.clone();
        std::thread::Builder::new()
            .name("agent-log".into())
            .spawn(move || {
                let (lock, cv) = &*shared;
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if let Some(f) = file.as_mut() {
                        let _ = writeln!(f, "{line}");
                    }
                    let at = Instant::now();
                    let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
                    let committed = line.contains("nftables sync committed");
                    st.commits += usize::from(committed);
                    if (committed || line.contains(" listed ")) && st.marks.len() < MAX_MARKS {
                        st.marks.push((at, line.clone()));
                    }
                    let warn = line.contains(" WARN ");
                    let error = line.contains(" ERROR ");
                    st.warnings += usize::from(warn);
                    st.errors += usize::from(error);
                    if (warn || error) && st.first_warnings.len() < 20 {
                        st.first_warnings.push(line.clone());
                    }
                    if st.tail.len() == 30 {
                        st.tail.pop_front();
                    }
                    st.tail.push_back(line);
                    cv.notify_all();
                }
                lock.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
                cv.notify_all();
            })?;
        Ok(Agent {
            child,
            pid,
            started: Instant::now(),
            log,
            exit: None,
        })
    }

    pub fn with_log<T>(&self, f: impl FnOnce(&AgentLog) -> T) -> T {
        f(&self.log.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn tail(&self) -> String {
        self.with_log(|l| {
            l.tail
                .iter()
                .map(|s| format!("\n    {s}"))
                .collect::<String>()
        })
    }

    /// Waits until the agent logged `n` commits.
    pub fn wait_commits(&mut self, n: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let (commits, closed) = self.with_log(|l| (l.commits, l.closed));
            if commits >= n {
                return Ok(());
            }
            if closed || self.exited().is_some() {
                bail!("the agent exited before its first sync:{}", self.tail());
            }
            ensure!(
                Instant::now() < deadline,
                "no first sync after {timeout:?}:{}",
                self.tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The agent's exit status, if it exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none()
            && let Ok(Some(status)) = self.child.try_wait()
        {
            netns::unregister_child(self.pid);
            self.exit = Some(status);
        }
        self.exit
    }

    /// SIGTERM, up to 10 s to exit, then SIGKILL.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        if self.exited().is_none() {
            // SAFETY: kill(2) of our own child, not yet reaped (its PID cannot be reused).
            unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while self.exited().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if self.exited().is_none() {
                let _ = self.child.kill();
                if let Ok(status) = self.child.wait() {
                    self.exit = Some(status);
                }
                netns::unregister_child(self.pid);
            }
        }
        self.exit
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
    }
}
