//! Child processes: the kube-proxy-shaped `nft -f` baseline and the real agent, with their CPU
//! time and memory.

use super::*;

// ---------------------------------------------------------------------------------------------
// Child processes

/// How a child process ended, with its resource usage (wait4).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChildRun {
    pub wall_ms: f64,
    pub user_ms: f64,
    pub sys_ms: f64,
    /// Peak resident set size, KiB: the child's VmHWM, polled while it runs. (Its ru_maxrss
    /// would start at the bench's own RSS: std spawns with vfork, and exec takes the
    /// high-water mark of the memory it leaves, which is the bench's.)
    pub max_rss_kib: u64,
    pub status: i32,
}

/// Waits for child `pid` with wait4 (std's `Child` must not wait for it too). With `block`
/// false, returns `None` if it has not exited yet.
pub(super) fn wait4(pid: u32, start: Instant, block: bool) -> Result<Option<ChildRun>> {
    let mut status: libc::c_int = 0;
    let flags = if block { 0 } else { libc::WNOHANG };
    // SAFETY: wait4 on our own child, filling locally owned structs.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        loop {
            let rc = libc::wait4(pid as libc::pid_t, &mut status, flags, &mut ru);
            if rc == pid as libc::pid_t {
                break;
            }
            if rc == 0 {
                return Ok(None);
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(err).context("wait4");
            }
        }
        ru
    };
    netns::unregister_child(pid);
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    };
    Ok(Some(ChildRun {
        wall_ms: ms(start.elapsed()),
        user_ms: ms(tv(ru.ru_utime)),
        sys_ms: ms(tv(ru.ru_stime)),
        max_rss_kib: 0,
        status: code,
    }))
}

/// SIGTERM, up to 10 s to exit, then SIGKILL; reaps the child.
pub(super) fn terminate(pid: u32, start: Instant) -> Result<ChildRun> {
    // SAFETY: kill(2) of our own child, not yet reaped (so its PID cannot be reused).
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    for _ in 0..200 {
        if let Some(run) = wait4(pid, start, false)? {
            return Ok(run);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    Ok(wait4(pid, start, true)?.expect("blocking wait4 returns the child"))
}

/// Runs `cmd` to completion with its stderr in `stderr_file`; the run and its resources.
pub(super) fn run_child(mut cmd: Command, stderr_file: &Path) -> Result<ChildRun> {
    let err = std::fs::File::create(stderr_file)?;
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(err);
    let start = Instant::now();
    let child = cmd.spawn().with_context(|| format!("spawning {cmd:?}"))?;
    let pid = child.id();
    netns::register_child(pid);
    let mut hwm_mib: f64 = 0.0;
    let mut run = loop {
        // A zombie has no memory left to report: the last reading before exit is the peak.
        if let Ok((_, hwm)) = process_rss(pid) {
            hwm_mib = hwm_mib.max(hwm);
        }
        if let Some(run) = wait4(pid, start, false)? {
            break run;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    run.max_rss_kib = (hwm_mib * 1024.0) as u64;
    if run.status != 0 {
        let text = std::fs::read_to_string(stderr_file).unwrap_or_default();
        let tail: String = text.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
        bail!("{cmd:?} exited with {}: {tail}", run.status);
    }
    Ok(run)
}

// ---------------------------------------------------------------------------------------------
// The kube-proxy-shaped baseline

#[derive(Clone, Debug, Default, Serialize)]
pub struct BaselineResult {
    /// `nft -f` of the full table into an empty namespace.
    pub full: ChildRun,
    pub text_bytes: usize,
    pub text_lines: usize,
    /// `nft -f` of one more Service on top (median of the repetitions).
    pub add_service_ms: f64,
    pub add_service_runs_ms: Vec<f64>,
}

pub fn baseline_bench(
    label: &str,
    cluster: &Cluster,
    n: usize,
    k: usize,
    reps: usize,
    dir: &Path,
) -> Result<BaselineResult> {
    use crate::kubeproxy::{Env, full_text, one_service_text};
    let env = Env {
        node_name: synth::NODE,
        cluster_cidr: synth::CLUSTER_CIDR_V4,
    };
    let text = full_text(cluster, &env, synth::SERVICE_CIDR_V4, synth::NODE_IP_V4);
    let file = dir.join(format!("kube-proxy-{n}.nft"));
    std::fs::write(&file, &text)?;
    let mut out = BaselineResult {
        text_bytes: text.len(),
        text_lines: text.lines().count(),
        ..BaselineResult::default()
    };
    drop(text);
    let ns = Netns::create(label)?;
    let mut cmd = ns.command("nft")?;
    cmd.arg("-f").arg(&file);
    out.full = run_child(cmd, &dir.join("nft.err")).context("nft -f (full)")?;
    let _ = std::fs::remove_file(&file);
    let mut cluster = cluster.clone();
    for rep in 0..reps {
        let spec = synth::extra_spec(n, rep, k);
        let mut objects = vec![spec.service()];
        objects.extend(spec.slices());
        synth::add_to_cluster(&mut cluster, &objects)?;
        let svc = &cluster.services[&spec.object_name()];
        let text = one_service_text(&cluster, svc, &env);
        let file = dir.join("kube-proxy-add.nft");
        std::fs::write(&file, &text)?;
        let mut cmd = ns.command("nft")?;
        cmd.arg("-f").arg(&file);
        let run = run_child(cmd, &dir.join("nft.err")).context("nft -f (one Service)")?;
        out.add_service_runs_ms.push(run.wall_ms);
    }
    out.add_service_ms = median(out.add_service_runs_ms.clone());
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// The real agent

#[derive(Clone, Debug, Default, Serialize)]
pub struct AgentResult {
    pub file_bytes: u64,
    /// `nftproxy run --once --from-file`: parse, convert, one full sync, exit.
    pub once: ChildRun,
    /// `nftproxy run --from-file` (the daemon): time until both families were committed.
    pub daemon_first_sync_ms: f64,
    /// VmRSS of the daemon after its first sync (steady state), MiB.
    pub daemon_rss_mib: f64,
    /// VmHWM (peak RSS) of the daemon, MiB.
    pub daemon_peak_rss_mib: f64,
    /// CPU (user+sys, all threads) the daemon used over the idle window, ms.
    pub idle_cpu_ms: f64,
    pub idle_window_s: f64,
    /// How long `nft delete table ip nftproxy` took (while the daemon's drift monitor listens,
    /// the kernel builds a notification for every object it deletes), ms.
    pub table_delete_ms: f64,
    /// From the end of that `nft delete` until the daemon committed the IPv4 table again: the
    /// drift monitor's notice and a full sync rebuilding it, ms.
    pub daemon_repair_ms: f64,
}

/// What the daemon's log said so far.
#[derive(Default)]
pub(super) struct DaemonLog {
    /// "nftables sync committed" lines, and those of them for IPv4.
    pub(super) commits: usize,
    pub(super) ipv4_commits: usize,
    /// The first lines, for error messages.
    pub(super) head: Vec<String>,
    pub(super) closed: bool,
}

pub fn agent_bench(
    label: &str,
    agent: &Path,
    objects_file: &Path,
    config_file: &Path,
    file_bytes: u64,
    idle: Duration,
    dir: &Path,
) -> Result<AgentResult> {
    let mut out = AgentResult {
        file_bytes,
        idle_window_s: idle.as_secs_f64(),
        ..AgentResult::default()
    };
    {
        let ns = Netns::create(&format!("{label}-once"))?;
        let mut cmd = ns.command(agent)?;
        cmd.args(["run", "--once", "--from-file"])
            .arg(objects_file)
            .arg("--config")
            .arg(config_file)
            .env("RUST_LOG", "info");
        out.once = run_child(cmd, &dir.join("agent-once.err")).context("nftproxy run --once")?;
    }
    if idle.is_zero() {
        return Ok(out);
    }
    let ns = Netns::create(&format!("{label}-daemon"))?;
    let mut cmd = ns.command(agent)?;
    cmd.args(["run", "--from-file"])
        .arg(objects_file)
        .arg("--config")
        .arg(config_file)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd.spawn().with_context(|| format!("spawning {cmd:?}"))?;
    let pid = child.id();
    netns::register_child(pid);
    let stderr = child.stderr.take().expect("piped stderr");
    let seen = Arc::new((Mutex::new(DaemonLog::default()), Condvar::new()));
    {
        let seen = seen.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let (lock, cv) = &*seen;
                let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
                if line.contains("nftables sync committed") {
                    st.commits += 1;
                    if line.contains("IPv4") {
                        st.ipv4_commits += 1;
                    }
                }
                if st.head.len() < 50 {
                    st.head.push(line);
                }
                cv.notify_all();
            }
            let (lock, cv) = &*seen;
            lock.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
            cv.notify_all();
        });
    }
    // Waits until `done` holds for the daemon's log.
    let wait_log = |what: &str, done: &dyn Fn(&DaemonLog) -> bool| -> Result<()> {
        let (lock, cv) = &*seen;
        let deadline = Instant::now() + Duration::from_secs(900);
        let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
        while !done(&st) {
            ensure!(
                !st.closed,
                "the agent exited before {what}: {}",
                st.head.join(" | ")
            );
            let now = Instant::now();
            ensure!(now < deadline, "no {what} after 900 s");
            st = cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    };
    let result = (|| -> Result<()> {
        // One "nftables sync committed" line per family.
        wait_log("its first sync", &|st| st.commits >= Family::ALL.len())?;
        out.daemon_first_sync_ms = ms(start.elapsed());
        // Let the sync loop and the file watcher settle.
        std::thread::sleep(Duration::from_secs(1));
        let cpu0 = process_cpu(pid)?;
        std::thread::sleep(idle);
        let cpu1 = process_cpu(pid)?;
        out.idle_cpu_ms = ms(cpu1.saturating_sub(cpu0));
        let (rss, hwm) = process_rss(pid)?;
        out.daemon_rss_mib = rss;
        out.daemon_peak_rss_mib = hwm;
        // Someone deletes the table: the drift monitor notices, a full sync rebuilds it.
        let before = seen
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .ipv4_commits;
        let delete = Instant::now();
        let status = ns
            .command("nft")?
            .args(["delete", "table", "ip", "nftproxy"])
            .status()?;
        ensure!(status.success(), "nft delete table failed: {status}");
        out.table_delete_ms = ms(delete.elapsed());
        let repair = Instant::now();
        wait_log("the repair", &|st| st.ipv4_commits > before)?;
        out.daemon_repair_ms = ms(repair.elapsed());
        Ok(())
    })();
    let _ = terminate(pid, start);
    drop(child);
    result.map(|()| out)
}

/// utime + stime of all threads of `pid` (`/proc/<pid>/stat`).
pub(super) fn process_cpu(pid: u32) -> Result<Duration> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = text
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("bad /proc stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields after the command: state is index 0, utime is field 14 overall (index 11 here).
    let utime: u64 = fields.get(11).context("no utime")?.parse()?;
    let stime: u64 = fields.get(12).context("no stime")?.parse()?;
    // SAFETY: sysconf has no memory effects.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(Duration::from_secs_f64((utime + stime) as f64 / tck))
}

/// VmRSS and VmHWM of `pid`, MiB.
pub(super) fn process_rss(pid: u32) -> Result<(f64, f64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<f64> {
        let line = text
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("no {name}"))?;
        let kib: f64 = line
            .split_whitespace()
            .nth(1)
            .context("bad status line")?
            .parse()?;
        Ok(kib / 1024.0)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}
