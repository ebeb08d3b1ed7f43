//! `nftproxy demo`: builds a lab of network namespaces, programs an example cluster into its
//! node with the real agent, sends traffic through every Service, prints what happened next to
//! what `nftproxy trace` predicts, and removes everything (also on Ctrl-C).

mod echo;
mod lab;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::io::{ErrorKind, Read};
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dataplane::nft::build::build;
use dataplane::nft::ruleset::{Family, Proto};
use dataplane::trace::{Host, Outcome, Packet, trace};

pub use self::echo::serve as echo_serve;
use self::lab::{Lab, in_netns};
use crate::config::{KubeProxyConfiguration, Overrides, Settings};
use crate::source;

pub const CLUSTER: &str = include_str!("../../../examples/demo-cluster.yaml");
pub const CONFIG: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
hostnameOverride: demo-node
";

const NODE_IPS: [&str; 2] = ["192.168.0.2", "2001:db8::2"];
const EXTERNAL_IPS: [&str; 2] = ["203.0.113.10", "2001:db8:ff::10"];
const ECHO_PORTS: &str = "8080,5353";

/// The pods: name, addresses.
const PODS: [(&str, [&str; 2]); 4] = [
    ("web-1", ["10.244.1.11", "fd00:10:244:1::11"]),
    ("web-2", ["10.244.1.12", "fd00:10:244:1::12"]),
    ("web-3", ["10.244.2.13", "fd00:10:244:2::13"]),
    ("client", ["10.244.1.100", "fd00:10:244:1::100"]),
];

/// One kind of traffic the demo sends.
struct Flow {
    service: &'static str,
    what: &'static str,
    from: &'static str,
    proto: Proto,
    dst: &'static str,
    count: usize,
}

const FLOWS: &[Flow] = &[
    Flow {
        service: "demo/web",
        what: "ClusterIP",
        from: "client",
        proto: Proto::Tcp,
        dst: "10.96.0.10:80",
        count: 30,
    },
    Flow {
        service: "demo/web-nodeport",
        what: "NodePort on the node's IP",
        from: "external",
        proto: Proto::Tcp,
        dst: "192.168.0.2:30080",
        count: 30,
    },
    Flow {
        service: "demo/web-lb",
        what: "LoadBalancer IP, externalTrafficPolicy Local",
        from: "external",
        proto: Proto::Tcp,
        dst: "198.51.100.10:80",
        count: 30,
    },
    Flow {
        service: "demo/web-lb",
        what: "LoadBalancer IP, from a pod (short-circuited)",
        from: "client",
        proto: Proto::Tcp,
        dst: "198.51.100.10:80",
        count: 30,
    },
    Flow {
        service: "demo/dns",
        what: "dual-stack ClusterIP, IPv4 UDP",
        from: "client",
        proto: Proto::Udp,
        dst: "10.96.0.53:53",
        count: 20,
    },
    Flow {
        service: "demo/dns",
        what: "dual-stack ClusterIP, IPv6 TCP",
        from: "client",
        proto: Proto::Tcp,
        dst: "[fd00:10:96::53]:53",
        count: 20,
    },
    Flow {
        service: "demo/empty",
        what: "ClusterIP without endpoints",
        from: "client",
        proto: Proto::Tcp,
        dst: "10.96.0.99:80",
        count: 5,
    },
    Flow {
        service: "(none)",
        what: "unallocated address in the ServiceCIDR",
        from: "client",
        proto: Proto::Tcp,
        dst: "10.96.0.200:80",
        count: 3,
    },
];

/// What one attempt saw.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Seen {
    Answered { endpoint: String, masqueraded: bool },
    Refused,
    TimedOut,
    Error(String),
}

fn attempt(proto: Proto, dst: SocketAddr) -> Seen {
    let timeout = Duration::from_millis(800);
    let result = match proto {
        Proto::Tcp => TcpStream::connect_timeout(&dst, timeout).and_then(|mut s| {
            s.set_read_timeout(Some(timeout))?;
            let local = s.local_addr()?.ip();
            let mut reply = String::new();
            s.read_to_string(&mut reply)?;
            Ok((local, reply))
        }),
        Proto::Udp => {
            let bind: SocketAddr = if dst.is_ipv4() {
                "0.0.0.0:0".parse().expect("literal")
            } else {
                "[::]:0".parse().expect("literal")
            };
            UdpSocket::bind(bind).and_then(|s| {
                s.connect(dst)?;
                s.set_read_timeout(Some(timeout))?;
                s.send(b"hello")?;
                let mut buf = [0u8; 512];
                let n = s.recv(&mut buf)?;
                Ok((
                    s.local_addr()?.ip(),
                    String::from_utf8_lossy(&buf[..n]).into_owned(),
                ))
            })
        }
        Proto::Sctp => return Seen::Error("SCTP is not probed by the demo".into()),
    };
    match result {
        Ok((local, reply)) => {
            let mut parts = reply.split_whitespace();
            let endpoint = parts.next().unwrap_or("?").to_string();
            let peer: Option<IpAddr> = parts.next().and_then(|p| p.parse().ok());
            Seen::Answered {
                endpoint,
                masqueraded: peer != Some(local),
            }
        }
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => Seen::Refused,
        Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock) => Seen::TimedOut,
        Err(e) => Seen::Error(e.to_string()),
    }
}

/// Removes the demo's files when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn interrupted(stop: &AtomicBool) -> Result<(), String> {
    if stop.load(Ordering::SeqCst) {
        Err("interrupted; everything the demo created has been removed".into())
    } else {
        Ok(())
    }
}

/// The trace's prediction for a flow, summarised like an observation.
fn predict(settings: &Settings, flow: &Flow, src: IpAddr) -> Result<BTreeSet<Seen>, String> {
    let (cluster, _) = source::load_text(CLUSTER, &settings.node_name, "")?;
    let dst: SocketAddr = flow.dst.parse().map_err(|e| format!("{e}"))?;
    let table = build(&cluster, &settings.build, Family::of(&dst.ip())).table;
    let host = Host {
        local_addresses: NODE_IPS
            .iter()
            .map(|a| a.parse().expect("literal"))
            .collect(),
    };
    let t = trace(
        &table,
        &host,
        &Packet {
            src,
            dst,
            proto: flow.proto,
            iif: None,
        },
    );
    let names: BTreeMap<IpAddr, &str> = PODS
        .iter()
        .flat_map(|(name, ips)| {
            ips.iter()
                .map(move |ip| (ip.parse().expect("literal"), *name))
        })
        .collect();
    Ok(t.outcomes
        .iter()
        .map(|o| match o {
            Outcome::Endpoint { addr, masquerade } => Seen::Answered {
                endpoint: names.get(&addr.ip()).unwrap_or(&"?").to_string(),
                masqueraded: *masquerade,
            },
            Outcome::Reject => Seen::Refused,
            Outcome::Drop | Outcome::Untouched => Seen::TimedOut,
        })
        .collect())
}

fn describe(seen: &Seen) -> String {
    match seen {
        Seen::Answered {
            endpoint,
            masqueraded,
        } => format!(
            "{endpoint:<7} {}",
            if *masqueraded {
                "client address masqueraded"
            } else {
                "client address kept"
            }
        ),
        Seen::Refused => "refused (REJECT)".to_string(),
        Seen::TimedOut => "no answer (DROP)".to_string(),
        Seen::Error(e) => format!("error: {e}"),
    }
}

/// Runs the demo; `bin` is the nftproxy binary (for the agent and the echo servers).
pub fn run(bin: &Path) -> Result<String, String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("nftproxy demo needs root: it creates network namespaces and programs nftables inside them (try: sudo nftproxy demo)".into());
    }
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst))
            .map_err(|e| format!("cannot handle Ctrl-C: {e}"))?;
    }
    let dir = TempDir(std::env::temp_dir().join(format!("nftpdemo-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).map_err(|e| e.to_string())?;
    let cluster_file = dir.0.join("cluster.yaml");
    let config_file = dir.0.join("config.yaml");
    std::fs::write(&cluster_file, CLUSTER).map_err(|e| e.to_string())?;
    std::fs::write(&config_file, CONFIG).map_err(|e| e.to_string())?;
    let file_config = KubeProxyConfiguration::parse(CONFIG)?;
    let settings =
        Settings::resolve(&file_config, &Overrides::default()).map_err(|e| e.to_string())?;

    let mut out = String::new();
    let mut lab = Lab::new();
    let node = lab.node()?;
    let ips = |list: &[&str]| -> Vec<IpAddr> {
        list.iter().map(|a| a.parse().expect("literal")).collect()
    };
    let mut pods = BTreeMap::new();
    for (name, addrs) in PODS {
        interrupted(&stop)?;
        let ns = lab.pod(&node, name, &ips(&addrs))?;
        if name != "client" {
            let lab_name = lab.name("");
            lab.spawn(
                &ns,
                bin,
                &[
                    "demo-echo",
                    "--name",
                    name,
                    "--lab",
                    &lab_name,
                    "--ports",
                    ECHO_PORTS,
                ],
            )?;
        }
        pods.insert(name, ns);
    }
    let external = lab.external(
        &node,
        &ips(&EXTERNAL_IPS),
        &ips(&NODE_IPS),
        &["198.51.100.10/32"],
    )?;
    pods.insert("external", external);
    interrupted(&stop)?;

    let cluster = cluster_file.to_str().ok_or("temp path is not UTF-8")?;
    let config = config_file.to_str().ok_or("temp path is not UTF-8")?;
    lab.run(
        &node,
        bin,
        &["run", "--once", "--from-file", cluster, "--config", config],
    )?;
    let _ = writeln!(
        out,
        "Programmed examples/demo-cluster.yaml into network namespace {node} (node demo-node, 192.168.0.2).\n"
    );
    // The echo servers start in the background; wait until the first one answers.
    let probe_ns = pods["client"].clone();
    in_netns(&probe_ns, || {
        for _ in 0..100 {
            if TcpStream::connect_timeout(
                &"10.244.1.11:8080".parse().expect("literal"),
                Duration::from_millis(100),
            )
            .is_ok()
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    })?;

    let mut agreements = 0;
    for flow in FLOWS {
        interrupted(&stop)?;
        let ns = pods[flow.from].clone();
        let dst: SocketAddr = flow.dst.parse().map_err(|e| format!("{e}"))?;
        let (proto, count) = (flow.proto, flow.count);
        let seen: Vec<Seen> = in_netns(&ns, move || {
            (0..count).map(|_| attempt(proto, dst)).collect()
        })?;
        let src = if flow.from == "external" {
            EXTERNAL_IPS[usize::from(dst.is_ipv6())]
        } else {
            PODS[3].1[usize::from(dst.is_ipv6())]
        };
        let mut tally: BTreeMap<&Seen, usize> = BTreeMap::new();
        for s in &seen {
            *tally.entry(s).or_default() += 1;
        }
        let _ = writeln!(
            out,
            "{} — {}: {} {} from {} ({src}), {count} attempts",
            flow.service, flow.what, flow.proto, flow.dst, flow.from
        );
        for (s, n) in &tally {
            let _ = writeln!(out, "    {n:>3}  {}", describe(s));
        }
        let observed: BTreeSet<Seen> = seen.into_iter().collect();
        let predicted = predict(&settings, flow, src.parse().expect("literal"))?;
        let agrees = observed == predicted;
        agreements += usize::from(agrees);
        let list: Vec<String> = predicted.iter().map(describe).collect();
        let _ = writeln!(
            out,
            "    trace predicted: {} [{}]\n",
            list.join("; "),
            if agrees { "agrees" } else { "DIFFERS" }
        );
    }
    let _ = writeln!(
        out,
        "{agreements} of {} flows behaved exactly as `nftproxy trace` predicts.\nRemoving the lab.",
        FLOWS.len()
    );
    drop(lab);
    Ok(out)
}
