//! Network namespaces wired with veth pairs: a "node", pods behind it, external hosts on
//! uplinks. Everything a [`Lab`] creates is torn down when it is dropped (also on panic).

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Once};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};

use crate::probe::{Attempt, Probe, ProbeResult, Proto, Verdict};

/// Every namespace the harness creates is named `nftpt-<pid>-<lab seq>-<label>`.
mod process;

pub use self::process::*;

pub const NS_PREFIX: &str = "nftpt-";
/// Gateway address pods use, configured on every pod veth on the node side.
pub const POD_GATEWAY_V4: &str = "169.254.1.1";
/// IPv6 link-local gateway pods use, configured on every pod veth on the node side.
pub const POD_GATEWAY_V6: &str = "fe80::1";

static LAB_SEQ: AtomicUsize = AtomicUsize::new(0);
static STALE_CLEANUP: Once = Once::new();

/// Sysctls set in every namespace (before any interface exists):
/// - no IPv6 duplicate address detection, so addresses (also the automatic link-local ones)
///   are usable at once;
/// - no ICMP error rate limits: an nft `reject` or a closed UDP port answers with ICMP
///   errors, and the per-peer defaults (IPv4 1 s, IPv6 100 ms, after a burst of 6) turn
///   a quick series of refused attempts into timeouts. (IPv4 "no route" errors have their
///   own limit, `net.ipv4.route.error_cost`, which only exists in the root namespace.)
const BASE_SYSCTLS: &[(&str, &str)] = &[
    ("net.ipv6.conf.all.accept_dad", "0"),
    ("net.ipv6.conf.default.accept_dad", "0"),
    ("net.ipv4.icmp_ratelimit", "0"),
    ("net.ipv6.icmp.ratelimit", "0"),
    ("net.ipv4.icmp_msgs_per_sec", "1000000"),
    ("net.ipv4.icmp_msgs_burst", "1000000"),
];

/// Sysctls of a node: a router that does not drop asymmetric (NATed) traffic.
const NODE_SYSCTLS: &[(&str, &str)] = &[
    ("net.ipv4.ip_forward", "1"),
    ("net.ipv6.conf.all.forwarding", "1"),
    ("net.ipv6.conf.default.forwarding", "1"),
    ("net.ipv4.conf.all.rp_filter", "0"),
    ("net.ipv4.conf.default.rp_filter", "0"),
];

/// A set of namespaces, deleted (with every process inside) on drop.
pub struct Lab {
    prefix: String,
    nettest: PathBuf,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    namespaces: Vec<String>,
    links: usize,
    procs: Vec<Proc>,
}

/// A handle to one of the lab's namespaces. Cheap to clone; only valid while its lab lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ns {
    name: String,
    label: String,
    ips: Vec<IpAddr>,
    node_link: Option<String>,
}

/// An echo server started by [`Lab::echo`]; the lab owns (and eventually kills) the process.
#[derive(Clone, Debug)]
pub struct Echo {
    pub pid: u32,
    pub ns: String,
    pub ports: Vec<u16>,
    log: Arc<Lines>,
}

impl Echo {
    /// The JSON event lines the echo printed so far (`{"event":"tcp","local":..,"peer":..}`).
    pub fn events(&self) -> Vec<String> {
        self.log.snapshot()
    }
}

impl Lab {
    /// A new lab, finding `nettest` next to the running test binary (or `$NFTPT_BIN_NETTEST`).
    pub fn new() -> Result<Lab> {
        Lab::with_nettest(target_binary("nettest")?)
    }

    /// A new lab using this `nettest` binary (e.g. `env!("CARGO_BIN_EXE_nettest")`).
    pub fn with_nettest(nettest: impl Into<PathBuf>) -> Result<Lab> {
        let nettest = nettest.into();
        ensure!(
            nettest.is_file(),
            "nettest binary {} not found",
            nettest.display()
        );
        STALE_CLEANUP.call_once(remove_stale_namespaces);
        let seq = LAB_SEQ.fetch_add(1, Ordering::Relaxed);
        Ok(Lab {
            prefix: format!("{NS_PREFIX}{}-{seq}-", std::process::id()),
            nettest,
            state: Mutex::new(State::default()),
        })
    }

    /// The prefix of all of this lab's namespace names.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn nettest(&self) -> &Path {
        &self.nettest
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A bare namespace: loopback up, no IPv6 DAD. Labels are `[a-z0-9-]`, unique in the lab.
    pub fn namespace(&self, label: &str) -> Result<Ns> {
        ensure!(
            !label.is_empty()
                && label.len() <= 40
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
            "bad namespace label {label:?}"
        );
        let name = format!("{}{label}", self.prefix);
        {
            let mut st = self.state();
            ensure!(
                !st.namespaces.contains(&name),
                "namespace label {label:?} used twice"
            );
            // Registered before creation, so a half-made namespace is still cleaned up.
            st.namespaces.push(name.clone());
        }
        run_checked(Command::new("ip").args(["netns", "add", &name]))?;
        let ns = Ns {
            name,
            label: label.to_string(),
            ips: Vec::new(),
            node_link: None,
        };
        ns.ip_batch(&["link set lo up".to_string()])?;
        ns.sysctl(BASE_SYSCTLS)?;
        Ok(ns)
    }

    /// The node: a router (IPv4 and IPv6 forwarding on, rp_filter off) where nftproxy runs.
    pub fn node(&self, label: &str) -> Result<Ns> {
        let ns = self.namespace(label)?;
        ns.sysctl(NODE_SYSCTLS)?;
        Ok(ns)
    }

    fn next_link(&self, kind: &str) -> String {
        let mut st = self.state();
        st.links += 1;
        format!("{kind}{}", st.links)
    }

    /// A pod behind `node`: `eth0` holds `ips` as /32 (/128) addresses with default routes
    /// via [`POD_GATEWAY_V4`] / [`POD_GATEWAY_V6`], which the node side of the veth
    /// (`vpN`, see [`Ns::node_link`]) holds; the node routes each pod IP to that veth.
    ///
    /// Both gateway addresses are link-scoped, so the node never uses them as a source
    /// for routed traffic: `masquerade` towards a pod picks a node IP (e.g. one given to
    /// [`Lab::external`], or `node.add_addr("lo", ip, 32)`); a node without any global
    /// address cannot masquerade.
    pub fn pod(&self, node: &Ns, label: &str, ips: &[IpAddr]) -> Result<Ns> {
        let mut pod = self.namespace(label)?;
        let link = self.next_link("vp");
        veth(node, &link, &pod)?;
        let mut n = vec![
            format!("link set {link} up"),
            format!("addr add {POD_GATEWAY_V4}/32 dev {link} scope link"),
            format!("addr add {POD_GATEWAY_V6}/64 dev {link} nodad"),
        ];
        let mut p = vec!["link set eth0 up".to_string()];
        for ip in ips {
            n.push(format!("route add {} dev {link}", host_prefix(*ip)));
            p.push(format!(
                "addr add {} dev eth0{}",
                host_prefix(*ip),
                nodad(*ip)
            ));
        }
        if ips.iter().any(IpAddr::is_ipv4) {
            p.push(format!("route add {POD_GATEWAY_V4} dev eth0 scope link"));
            p.push(format!("route add default via {POD_GATEWAY_V4} dev eth0"));
        }
        if ips.iter().any(IpAddr::is_ipv6) {
            p.push(format!("route add default via {POD_GATEWAY_V6} dev eth0"));
        }
        node.ip_batch(&n)?;
        pod.ip_batch(&p)?;
        pod.ips = ips.to_vec();
        pod.node_link = Some(link);
        Ok(pod)
    }

    /// An external host on its own uplink of `node` (node side `upN`, see [`Ns::node_link`]).
    /// The host's `eth0` gets `ips`, the node's uplink gets `node_ips` (all as /32, /128);
    /// each side routes the other's addresses to the link, and the host's default routes
    /// (per family) go via the first node IP of that family, so service VIPs reach the node.
    pub fn external(
        &self,
        node: &Ns,
        label: &str,
        ips: &[IpAddr],
        node_ips: &[IpAddr],
    ) -> Result<Ns> {
        let mut ext = self.namespace(label)?;
        let link = self.next_link("up");
        veth(node, &link, &ext)?;
        let mut n = vec![format!("link set {link} up")];
        let mut e = vec!["link set eth0 up".to_string()];
        for ip in node_ips {
            n.push(format!(
                "addr add {} dev {link}{}",
                host_prefix(*ip),
                nodad(*ip)
            ));
            e.push(format!("route add {} dev eth0", host_prefix(*ip)));
        }
        for ip in ips {
            e.push(format!(
                "addr add {} dev eth0{}",
                host_prefix(*ip),
                nodad(*ip)
            ));
            n.push(format!("route add {} dev {link}", host_prefix(*ip)));
        }
        for v4 in [true, false] {
            if let Some(gw) = node_ips.iter().find(|ip| ip.is_ipv4() == v4) {
                e.push(format!("route add default via {gw} dev eth0"));
            }
        }
        node.ip_batch(&n)?;
        ext.ip_batch(&e)?;
        ext.ips = ips.to_vec();
        ext.node_link = Some(link);
        Ok(ext)
    }

    /// Starts `nettest echo` in `ns`: TCP and UDP listeners on `ports` (IPv4 and IPv6, all
    /// addresses) and a raw SCTP responder for those ports. Returns once all are listening.
    /// The process lives until the lab is dropped or [`Lab::stop_echo`].
    pub fn echo(&self, ns: &Ns, ports: &[u16]) -> Result<Echo> {
        ensure!(!ports.is_empty(), "echo needs at least one port");
        let list = ports
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let mut cmd = ns.command(&self.nettest);
        cmd.args(["echo", "--ports", &list]);
        let proc = ns.spawn_command(cmd, "echo")?;
        let echo = Echo {
            pid: proc.pid(),
            ns: ns.name.clone(),
            ports: ports.to_vec(),
            log: proc.stdout.clone(),
        };
        // Registered before waiting, so the lab kills it even if readiness fails.
        self.state().procs.push(proc);
        echo.log
            .wait_for(
                |l| l.contains(r#""event":"ready""#),
                Duration::from_secs(10),
            )
            .with_context(|| format!("echo in {} did not get ready", ns.label))?;
        Ok(echo)
    }

    /// Kills an echo started by [`Lab::echo`].
    pub fn stop_echo(&self, echo: &Echo) {
        let proc = {
            let mut st = self.state();
            st.procs
                .iter()
                .position(|p| p.pid() == echo.pid)
                .map(|i| st.procs.swap_remove(i))
        };
        drop(proc);
    }

    /// `count` attempts of `proto` from `ns` to `dst`, with the defaults of [`Probe::new`].
    pub fn probe(
        &self,
        ns: &Ns,
        proto: Proto,
        dst: SocketAddr,
        count: usize,
    ) -> Result<ProbeResult> {
        self.run_probe(ns, &Probe::new(proto, dst, count))
    }

    /// Runs `probe`, then more attempts while every answer came from some but not all of the
    /// endpoints `want` lists: the kernel picks endpoints at random, so a handful of attempts
    /// can miss one by chance (12 attempts over 2 endpoints do, once in 2,048). Four top-ups
    /// of 16 attempts per endpoint make a miss by chance negligible; an endpoint the rules
    /// never pick is still missing afterwards.
    pub fn probe_for(&self, ns: &Ns, probe: &Probe, want: &Verdict) -> Result<ProbeResult> {
        let mut r = self.run_probe(ns, probe)?;
        let mut more = probe.clone();
        if let Verdict::Endpoints { set, .. } = want {
            more.count = 16 * set.len();
        }
        for _ in 0..4 {
            if !r.short_of(want) {
                break;
            }
            r.absorb(self.run_probe(ns, &more)?);
        }
        Ok(r)
    }

    /// Runs `nettest probe` in `ns` and adds up its attempts.
    pub fn run_probe(&self, ns: &Ns, probe: &Probe) -> Result<ProbeResult> {
        let start = Instant::now();
        let mut cmd = ns.command(&self.nettest);
        cmd.args(probe.args());
        let out = output(&mut cmd, None)?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success(),
            "nettest probe in {} failed ({}): {}{}",
            ns.label,
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
        let attempts = stdout
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                serde_json::from_str::<Attempt>(l).with_context(|| format!("bad probe line {l:?}"))
            })
            .collect::<Result<Vec<_>>>()?;
        ensure!(
            attempts.len() == probe.count,
            "probe printed {} attempts, expected {}",
            attempts.len(),
            probe.count
        );
        let mut r = ProbeResult::from_attempts(&attempts);
        r.elapsed = start.elapsed();
        Ok(r)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let st = std::mem::take(self.state.get_mut().unwrap_or_else(|e| e.into_inner()));
        drop(st.procs); // kills and reaps our own children
        for name in st.namespaces.iter().rev() {
            kill_namespace_processes(name);
        }
        for name in st.namespaces.iter().rev() {
            if let Err(e) = run_checked(Command::new("ip").args(["netns", "del", name])) {
                eprintln!("nftproxy-tests: cannot delete namespace {name}: {e:#}");
            }
        }
    }
}

fn host_prefix(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(_) => format!("{ip}/32"),
        IpAddr::V6(_) => format!("{ip}/128"),
    }
}

fn nodad(ip: IpAddr) -> &'static str {
    if ip.is_ipv6() { " nodad" } else { "" }
}

/// A veth pair `node_side` (in `node`) <-> `eth0` (in `peer`), created inside `node`, so
/// it never exists in the root namespace.
///
/// Checksum offload is off on both ends, as on a link between hosts: senders compute every
/// checksum and receivers verify it. With it on, a veth hands packets over with their
/// checksums unchecked, so a rule that rewrites a header without fixing the checksum (an
/// `ip daddr set`) would pass here and break on a real network.
fn veth(node: &Ns, node_side: &str, peer: &Ns) -> Result<()> {
    node.ip_batch(&[format!(
        "link add {node_side} type veth peer name eth0 netns {}",
        peer.name
    )])?;
    for (ns, link) in [(node, node_side), (peer, "eth0")] {
        run_checked(
            ns.command("ethtool")
                .args(["-K", link, "tx", "off", "rx", "off"]),
        )
        .context("ethtool (package ethtool) turns checksum offload off")?;
    }
    Ok(())
}

impl Ns {
    /// The full namespace name (for `ip netns exec`, `ip -n`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The label it was created with ("node", "pod-a", ...).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The addresses given at creation (pods, external hosts).
    pub fn ips(&self) -> &[IpAddr] {
        &self.ips
    }

    /// The first IPv4 address given at creation.
    pub fn ipv4(&self) -> Option<IpAddr> {
        self.ips.iter().copied().find(IpAddr::is_ipv4)
    }

    /// The first IPv6 address given at creation.
    pub fn ipv6(&self) -> Option<IpAddr> {
        self.ips.iter().copied().find(IpAddr::is_ipv6)
    }

    /// The node-side interface of this namespace's veth (pods: `vpN`, external: `upN`).
    pub fn node_link(&self) -> Option<&str> {
        self.node_link.as_deref()
    }

    /// `ip netns exec <ns> <program>`: add args/env, then run or spawn it.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }

    fn argv_command(&self, argv: &[&str]) -> Result<Command> {
        let (program, args) = argv.split_first().ok_or_else(|| anyhow!("empty command"))?;
        let mut c = self.command(program);
        c.args(args);
        Ok(c)
    }

    /// Runs a command in the namespace; output and exit status, whatever the status.
    pub fn run(&self, argv: &[&str]) -> Result<Output> {
        output(&mut self.argv_command(argv)?, None)
    }

    /// Runs a command in the namespace; its stdout, or an error (with stderr) if it fails.
    pub fn exec(&self, argv: &[&str]) -> Result<String> {
        run_checked(&mut self.argv_command(argv)?)
    }

    /// Like [`Ns::exec`], feeding `input` on stdin.
    pub fn exec_input(&self, argv: &[&str], input: &str) -> Result<String> {
        let mut cmd = self.argv_command(argv)?;
        let out = output(&mut cmd, Some(input))?;
        check(&cmd, out)
    }

    /// Loads an nft script (`nft -f -`) in the namespace.
    pub fn nft(&self, script: &str) -> Result<String> {
        self.exec_input(&["nft", "-f", "-"], script)
            .with_context(|| format!("nft script:\n{script}"))
    }

    /// `ip -n <ns> <args>`.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        run_checked(Command::new("ip").args(["-n", &self.name]).args(args))
    }

    /// Runs `ip` commands (one per line, without the leading `ip`) in one `ip -batch`.
    pub fn ip_batch<S: AsRef<str>>(&self, lines: &[S]) -> Result<()> {
        let script: String = lines.iter().map(|l| format!("{}\n", l.as_ref())).collect();
        let mut cmd = Command::new("ip");
        cmd.args(["-n", &self.name, "-batch", "-"]);
        let out = output(&mut cmd, Some(&script))?;
        check(&cmd, out)
            .with_context(|| format!("in {}:\n{script}", self.name))
            .map(drop)
    }

    /// Sets sysctls in the namespace (`sysctl -w key=value ...`).
    pub fn sysctl(&self, settings: &[(&str, &str)]) -> Result<()> {
        let mut argv = vec!["sysctl".to_string(), "-q".into(), "-w".into()];
        argv.extend(settings.iter().map(|(k, v)| format!("{k}={v}")));
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        self.exec(&argv).map(drop)
    }

    /// Reads a sysctl.
    pub fn sysctl_get(&self, key: &str) -> Result<String> {
        Ok(self.exec(&["sysctl", "-n", key])?.trim().to_string())
    }

    /// Adds `ip/prefix_len` to `dev` (IPv6 without DAD).
    pub fn add_addr(&self, dev: &str, ip: IpAddr, prefix_len: u8) -> Result<()> {
        self.ip_batch(&[format!("addr add {ip}/{prefix_len} dev {dev}{}", nodad(ip))])
    }

    /// `ip route add <route>`, e.g. `"172.30.0.0/16 via 192.168.0.1"` or `"blackhole 10.9.0.0/16"`.
    pub fn add_route(&self, route: &str) -> Result<()> {
        self.ip_batch(&[format!("route add {route}")])
    }

    /// Starts a long-running process in the namespace; killed (by PID) when the [`Proc`] drops.
    pub fn spawn(&self, argv: &[&str]) -> Result<Proc> {
        let label = argv.first().copied().unwrap_or_default().to_string();
        self.spawn_command(self.argv_command(argv)?, &label)
    }

    /// Starts a command built with [`Ns::command`] (env, args, ...) as a [`Proc`].
    pub fn spawn_command(&self, cmd: Command, label: &str) -> Result<Proc> {
        Proc::spawn(cmd, &format!("{label} in {}", self.label))
    }

    /// PIDs of all processes in the namespace.
    pub fn pids(&self) -> Result<Vec<u32>> {
        namespace_pids(&self.name)
    }
}

/// Finds a binary of this workspace's target directory next to the running executable
/// (`target/<profile>/deps/test-xxx` -> `target/<profile>/<name>`). `$NFTPT_BIN_<NAME>`
/// (upper case, `-` as `_`) overrides, e.g. `NFTPT_BIN_NETTEST`.
pub fn target_binary(name: &str) -> Result<PathBuf> {
    let var = format!("NFTPT_BIN_{}", name.to_ascii_uppercase().replace('-', "_"));
    if let Some(p) = std::env::var_os(&var) {
        return Ok(p.into());
    }
    let exe = std::env::current_exe()?;
    exe.ancestors()
        .skip(1)
        .take(3)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            anyhow!(
                "binary {name} not found near {} (build it, or set ${var})",
                exe.display()
            )
        })
}

/// Names of all network namespaces (`ip netns list`).
pub fn list_namespaces() -> Result<BTreeSet<String>> {
    let out = run_checked(Command::new("ip").args(["netns", "list"]))?;
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect())
}

fn namespace_pids(name: &str) -> Result<Vec<u32>> {
    let out = run_checked(Command::new("ip").args(["netns", "pids", name]))?;
    Ok(out
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect())
}

/// SIGKILLs every process in one of our namespaces (by PID) and waits until they are gone.
fn kill_namespace_processes(name: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let pids = match namespace_pids(name) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("nftproxy-tests: listing processes of {name}: {e:#}");
                return;
            }
        };
        let pids: Vec<u32> = pids
            .into_iter()
            .filter(|&p| p != std::process::id())
            .collect();
        if pids.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            eprintln!("nftproxy-tests: processes {pids:?} in {name} survive SIGKILL");
            return;
        }
        for pid in pids {
            // SAFETY: plain kill(2) of a process inside a namespace we created.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Deletes namespaces left by earlier test processes that no longer exist (killed runs).
fn remove_stale_namespaces() {
    let Ok(names) = list_namespaces() else { return };
    for name in names {
        let Some(pid) = name
            .strip_prefix(NS_PREFIX)
            .and_then(|r| r.split('-').next())
        else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        kill_namespace_processes(&name);
        let _ = run_checked(Command::new("ip").args(["netns", "del", &name]));
    }
}

/// Runs a command to completion, optionally feeding stdin.
fn output(cmd: &mut Command, input: Option<&str>) -> Result<Output> {
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("spawning {cmd:?}"))?;
    if let Some(input) = input {
        let mut stdin = child.stdin.take().expect("piped stdin");
        let input = input.to_string();
        // A thread, so a child that stops reading cannot deadlock us.
        std::thread::spawn(move || {
            let _ = stdin.write_all(input.as_bytes());
        });
    }
    child
        .wait_with_output()
        .with_context(|| format!("running {cmd:?}"))
}

fn check(cmd: &Command, out: Output) -> Result<String> {
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn run_checked(cmd: &mut Command) -> Result<String> {
    let out = output(cmd, None)?;
    check(cmd, out)
}
