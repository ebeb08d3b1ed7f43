//! Network namespaces (and child processes) owned by this benchmark run.
//!
//! Every namespace is named `nftpb-<pid>-<label>` and registered before it is created, so that
//! it is deleted on every way out: normal return (the [`Netns`] guard), a panic (the guard
//! again), SIGINT/SIGTERM/SIGHUP (the signal thread started by [`install_signal_handler`]
//! deletes whatever is still registered, kills registered children and exits). Namespaces of
//! earlier runs whose process is gone are removed at startup ([`remove_stale`]).

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use anyhow::{Context, Result, bail};

/// Prefix of every namespace a benchmark run creates.
pub const NS_PREFIX: &str = "nftpb-";

struct Registry {
    namespaces: Vec<String>,
    children: Vec<u32>,
    temp_dirs: Vec<PathBuf>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    namespaces: Vec::new(),
    children: Vec::new(),
    temp_dirs: Vec::new(),
});

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Blocks SIGINT, SIGTERM and SIGHUP in every thread (call before starting any thread) and
/// starts a thread that, on any of them, deletes everything registered and exits with 130.
pub fn install_signal_handler() -> Result<()> {
    // SAFETY: plain signal-mask calls on a locally owned sigset_t.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            bail!("pthread_sigmask: {}", std::io::Error::from_raw_os_error(rc));
        }
        set
    };
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` is a valid, initialised sigset_t owned by this closure.
            let rc = unsafe { libc::sigwait(&set, &mut sig) };
            if rc == 0 {
                eprintln!("nftproxy-bench: signal {sig}: cleaning up");
                cleanup_all();
                std::process::exit(130);
            }
        })
        .context("starting the signal thread")?;
    Ok(())
}

/// Kills registered children and deletes registered namespaces and temporary directories.
pub fn cleanup_all() {
    let (children, namespaces, dirs) = {
        let mut r = registry();
        (
            std::mem::take(&mut r.children),
            std::mem::take(&mut r.namespaces),
            std::mem::take(&mut r.temp_dirs),
        )
    };
    for pid in children {
        // SAFETY: kill(2) of a child process this program started (by PID).
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    }
    for name in namespaces.iter().rev() {
        delete_namespace(name);
    }
    for dir in dirs {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Registers a child process to be killed if the run is interrupted.
pub fn register_child(pid: u32) {
    registry().children.push(pid);
}

pub fn unregister_child(pid: u32) {
    registry().children.retain(|&p| p != pid);
}

/// Registers a directory created elsewhere (nftproxy-soak: the test API server's), to be
/// removed if the run is interrupted.
#[allow(dead_code)] // Used by nftproxy-soak only.
pub fn register_temp_dir(path: PathBuf) {
    registry().temp_dirs.push(path);
}

/// A temporary directory, removed on drop and on interruption.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn new() -> Result<TempDir> {
        let path = std::env::temp_dir().join(format!("nftpb-{}", std::process::id()));
        registry().temp_dirs.push(path.clone());
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(TempDir { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
        registry().temp_dirs.retain(|p| p != &self.path);
    }
}

/// A network namespace owned by this run; deleted (with its processes) on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates `nftpb-<pid>-<label>` with loopback up.
    pub fn create(label: &str) -> Result<Netns> {
        let name = format!("{NS_PREFIX}{}-{label}", std::process::id());
        registry().namespaces.push(name.clone());
        let ns = Netns { name };
        run(Command::new("ip").args(["netns", "add", &ns.name]))?;
        ns.ip_batch(&["link set lo up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    fn open(&self) -> Result<File> {
        File::open(self.path()).with_context(|| format!("opening {}", self.path().display()))
    }

    /// Runs `f` on a new OS thread that has entered this namespace, and returns its result.
    /// Sockets `f` opens belong to the namespace.
    pub fn run_in<T: Send>(&self, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        let file = self.open()?;
        std::thread::scope(|s| {
            std::thread::Builder::new()
                .name(format!("in-{}", self.name))
                .spawn_scoped(s, move || {
                    // SAFETY: setns(2) on an open namespace file; affects only this thread.
                    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        return Err(std::io::Error::last_os_error())
                            .context("setns into the benchmark namespace");
                    }
                    drop(file);
                    f()
                })
                .context("starting a thread")?
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }

    /// A command that runs inside this namespace (entered between fork and exec), gets SIGKILL
    /// if this process dies, and starts with no blocked signals.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Result<Command> {
        let file = self.open()?;
        let mut cmd = Command::new(program);
        // SAFETY: only async-signal-safe syscalls between fork and exec; `file` stays open in
        // the parent for as long as the Command lives (it is moved into the closure).
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let mut empty: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut empty);
                libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(cmd)
    }

    /// `ip -n <ns> -batch -`.
    pub fn ip_batch(&self, lines: &[&str]) -> Result<()> {
        let script: String = lines.iter().map(|l| format!("{l}\n")).collect();
        run_input(
            Command::new("ip").args(["-n", &self.name, "-batch", "-"]),
            &script,
        )
        .with_context(|| format!("in {}:\n{script}", self.name))
    }

    /// Sets sysctls inside the namespace.
    pub fn sysctl(&self, settings: &[(&str, &str)]) -> Result<()> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, "sysctl", "-q", "-w"]);
        cmd.args(settings.iter().map(|(k, v)| format!("{k}={v}")));
        run(&mut cmd)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        delete_namespace(&self.name);
        registry().namespaces.retain(|n| n != &self.name);
    }
}

fn namespace_pids(name: &str) -> Vec<u32> {
    Command::new("ip")
        .args(["netns", "pids", name])
        .stderr(Stdio::null())
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Kills the processes inside one of our namespaces (by PID) and deletes it.
fn delete_namespace(name: &str) {
    for _ in 0..100 {
        let pids: Vec<u32> = namespace_pids(name)
            .into_iter()
            .filter(|&p| p != std::process::id())
            .collect();
        if pids.is_empty() {
            break;
        }
        for pid in pids {
            // SAFETY: kill(2) of a process inside a namespace this program created.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = Command::new("ip")
        .args(["netns", "del", name])
        .stderr(Stdio::null())
        .status();
}

/// Deletes `nftpb-<pid>-*` namespaces whose process no longer exists (interrupted runs).
pub fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        let Some(pid) = name
            .strip_prefix(NS_PREFIX)
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            delete_namespace(name);
        }
    }
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn run_input(cmd: &mut Command, input: &str) -> Result<()> {
    use std::io::Write;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {cmd:?}"))?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let input = input.to_string();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output()?;
    let _ = writer.join();
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
