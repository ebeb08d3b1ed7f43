//! A throwaway lab of network namespaces for the demo: a node, pods behind it, an external
//! client on its uplink. Everything is removed on drop, processes by PID first.

use std::fs::File;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// Runs `ip` with the given arguments (inside `netns` when given).
fn ip(netns: Option<&str>, args: &[&str]) -> Result<(), String> {
    let mut cmd = Command::new("ip");
    if let Some(ns) = netns {
        cmd.args(["netns", "exec", ns, "ip"]);
    }
    let out = cmd
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run ip (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn sysctl(netns: &str, key: &str, value: &str) -> Result<(), String> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            netns,
            "sh",
            "-c",
            &format!("echo {value} > {path}"),
        ])
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("sysctl {key}={value} in {netns} failed"))
    }
}

fn host_prefix(ip: &IpAddr) -> String {
    match ip {
        IpAddr::V4(a) => format!("{a}/32"),
        IpAddr::V6(a) => format!("{a}/128"),
    }
}

pub struct Lab {
    prefix: String,
    namespaces: Vec<String>,
    children: Vec<Child>,
    links: usize,
}

impl Lab {
    pub fn new() -> Lab {
        Lab {
            prefix: format!("nftpdemo-{}", std::process::id()),
            namespaces: Vec::new(),
            children: Vec::new(),
            links: 0,
        }
    }

    pub fn name(&self, label: &str) -> String {
        format!("{}-{label}", self.prefix)
    }

    pub fn namespace(&mut self, label: &str) -> Result<String, String> {
        let name = self.name(label);
        ip(None, &["netns", "add", &name])?;
        self.namespaces.push(name.clone());
        ip(Some(&name), &["link", "set", "lo", "up"])?;
        // ICMP errors (rejects) must not be rate-limited away in a demo that sends many.
        sysctl(&name, "net.ipv4.icmp_ratelimit", "0")?;
        sysctl(&name, "net.ipv6.icmp.ratelimit", "0")?;
        Ok(name)
    }

    /// The node: a router with IPv4 and IPv6 forwarding.
    pub fn node(&mut self) -> Result<String, String> {
        let node = self.namespace("node")?;
        sysctl(&node, "net.ipv4.ip_forward", "1")?;
        sysctl(&node, "net.ipv6.conf.all.forwarding", "1")?;
        Ok(node)
    }

    fn veth(&mut self, node: &str, other: &str) -> Result<String, String> {
        self.links += 1;
        let link = format!("veth{}", self.links);
        ip(
            None,
            &[
                "link", "add", &link, "netns", node, "type", "veth", "peer", "name", "eth0",
                "netns", other,
            ],
        )?;
        ip(Some(node), &["link", "set", &link, "up"])?;
        ip(Some(other), &["link", "set", "eth0", "up"])?;
        Ok(link)
    }

    /// A pod behind the node, with link-local gateways on the node side (as Calico does).
    pub fn pod(&mut self, node: &str, label: &str, ips: &[IpAddr]) -> Result<String, String> {
        let pod = self.namespace(label)?;
        let link = self.veth(node, &pod)?;
        ip(
            Some(node),
            &[
                "addr",
                "add",
                "169.254.1.1/32",
                "dev",
                &link,
                "scope",
                "link",
            ],
        )?;
        ip(
            Some(node),
            &["-6", "addr", "add", "fe80::1/64", "dev", &link, "nodad"],
        )?;
        for addr in ips {
            let p = host_prefix(addr);
            ip(Some(node), &["route", "add", &p, "dev", &link])?;
            ip(Some(&pod), &["addr", "add", &p, "dev", "eth0", "nodad"])?;
        }
        ip(
            Some(&pod),
            &[
                "route",
                "add",
                "169.254.1.1",
                "dev",
                "eth0",
                "scope",
                "link",
            ],
        )?;
        ip(
            Some(&pod),
            &[
                "route",
                "add",
                "default",
                "via",
                "169.254.1.1",
                "dev",
                "eth0",
            ],
        )?;
        ip(
            Some(&pod),
            &[
                "-6", "route", "add", "default", "via", "fe80::1", "dev", "eth0",
            ],
        )?;
        Ok(pod)
    }

    /// An external host on the node's uplink. The node holds `node_ips` there and routes
    /// everything it does not know to it; the host routes `routed` (Service VIPs) to the node.
    pub fn external(
        &mut self,
        node: &str,
        ips: &[IpAddr],
        node_ips: &[IpAddr],
        routed: &[&str],
    ) -> Result<String, String> {
        let ext = self.namespace("external")?;
        let link = self.veth(node, &ext)?;
        for addr in node_ips {
            let p = host_prefix(addr);
            ip(Some(node), &["addr", "add", &p, "dev", &link, "nodad"])?;
            ip(Some(&ext), &["route", "add", &p, "dev", "eth0"])?;
        }
        for addr in ips {
            let p = host_prefix(addr);
            ip(Some(&ext), &["addr", "add", &p, "dev", "eth0", "nodad"])?;
            ip(Some(node), &["route", "add", &p, "dev", &link])?;
        }
        ip(Some(node), &["route", "add", "default", "dev", &link])?;
        ip(Some(node), &["-6", "route", "add", "default", "dev", &link])?;
        for net in routed {
            let gw = node_ips
                .iter()
                .find(|a| a.is_ipv4() != net.contains(':'))
                .ok_or("no node address of that family")?
                .to_string();
            ip(
                Some(&ext),
                &["route", "add", net, "via", &gw, "dev", "eth0"],
            )?;
        }
        Ok(ext)
    }

    /// Starts a process inside `netns`; it is killed when the lab is dropped.
    pub fn spawn(&mut self, netns: &str, program: &Path, args: &[&str]) -> Result<(), String> {
        let child = Command::new("ip")
            .args(["netns", "exec", netns])
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", program.display()))?;
        self.children.push(child);
        Ok(())
    }

    /// Runs a command inside `netns` and returns its output, failing on a non-zero exit.
    pub fn run(&self, netns: &str, program: &Path, args: &[&str]) -> Result<String, String> {
        let out = Command::new("ip")
            .args(["netns", "exec", netns])
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
        if !out.status.success() {
            return Err(format!(
                "{} {} failed: {}",
                program.display(),
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        for ns in self.namespaces.iter().rev() {
            let _ = ip(None, &["netns", "del", ns]);
        }
    }
}

/// Runs `f` on a thread that has entered network namespace `netns`.
pub fn in_netns<T: Send + 'static>(
    netns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let path = format!("/run/netns/{netns}");
    let file = File::open(&path).map_err(|e| format!("{path}: {e}"))?;
    std::thread::spawn(move || {
        // SAFETY: setns on a valid namespace file descriptor affects only this thread.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        if rc != 0 {
            return Err(format!("setns: {}", std::io::Error::last_os_error()));
        }
        Ok(f())
    })
    .join()
    .map_err(|_| "probe thread panicked".to_string())?
}
