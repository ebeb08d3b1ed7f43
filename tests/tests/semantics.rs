//! kube-proxy's packet-flow tables (reference §7.1, §7.3–§7.8) replayed on a real kernel, plus
//! the semantics around them: session affinity, mixed protocols, multiple and named ports,
//! `service-proxy-name`, and every masquerade / detect-local mode.
//!
//! Each test builds the topology of kube-proxy's test harness (§7.0) in network namespaces:
//!
//! ```text
//!   ext (203.0.113.2, 203.0.113.130,        node "test-node"                  pod (10.0.0.2, fd00:10::2)
//!        2600:5200::1) ── upN ── 192.168.0.2 (primary), 192.168.1.2 (alt),  ── vpN ──
//!                                192.168.99.11 (externalIP), 2001:db8::1,       eps (10.180.0.1, 10.180.2.1,
//!   lbsrc (1.2.3.4, 5.6.7.8) ── upM         2001:db8:1::2 (alt)              ── vpN ──  10.0.1.1-5, fd00:10:180::1,
//!                                lo: 10.0.0.1, fd00:10::1 (masquerade)              fd00:10:180::2:1)
//! ```
//!
//! Every endpoint IP lives in one "eps" namespace behind the node (nodeName in the slices is
//! only metadata for local/remote). Node-originated flows run in the node namespace with the
//! table's source address, so they take the output hooks. The node runs an echo of its own on a
//! few ports, so a packet nftproxy leaves alone ("" in kube-proxy's tables) is *seen* to reach
//! the host stack (answered with the original destination) instead of being refused.
//!
//! For every flow three answers must agree: the reference table, the kernel (the real
//! `nftproxy run --once` binary programs the node, `nettest` probes), and the pure packet
//! tracer (`dataplane::trace` over `dataplane::nft::build` for the same files and the node's
//! addresses).
//!
//! Every suite runs in both modes (`name::nftables`, `name::iptables`: `--proxy-mode`). In
//! iptables mode the kernel must show kube-proxy's iptables-mode semantics: a flow whose
//! answer differs says so with [`Flow::iptables`] and names the documented difference (the
//! reference's §1.16); the tracer models the nftables ruleset only and is not consulted. Masquerade: an endpoint saw another source address than the prober used. The
//! node's address towards the pods (what masquerade picks) is 10.0.0.1 / fd00:10::1, like a
//! CNI bridge's address in the node's pod CIDR, so it differs from every probe source, also
//! from the node's own 192.168.0.2 (a masquerade to the prober's own address would only show
//! as a new source port, which an unrelated NAT port clash can also cause).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::Output;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dataplane::nft::build::build;
use dataplane::nft::ruleset::{Family, Proto as NftProto, Table};
use dataplane::trace::{Host, Outcome, Packet, trace};
use nftproxy::config::{KubeProxyConfiguration, Overrides, Settings};
use nftproxy_tests::cluster::{
    Endpoint, Objects, ProxyConfig, Service, Slice, node as node_object, service_cidr,
};
use nftproxy_tests::{Attempt, Lab, Ns, Probe, Proto, ip, sa, target_binary};

const NODE_NAME: &str = "test-node";
const POD: &str = "10.0.0.2";
const POD6: &str = "fd00:10::2";
/// A pod inside the cluster CIDR but outside this node's pod CIDR (10.0.0.0/24), on its own
/// node link, for the detect-local modes.
const POD2: &str = "10.1.0.2";
const EXT: &str = "203.0.113.2";
const EXT_BLOCKED: &str = "203.0.113.130";
const EXT6: &str = "2600:5200::1";
const NODE_IP: &str = "192.168.0.2";
const NODE_ALT: &str = "192.168.1.2";
const NODE_EXTERNAL_IP: &str = "192.168.99.11";
const NODE_IP6: &str = "2001:db8::1";
const NODE_ALT6: &str = "2001:db8:1::2";
/// The node's address towards its pods, which masquerade uses.
const MASQ_IP: &str = "10.0.0.1";
const MASQ_IP6: &str = "fd00:10::1";
const LB1: &str = "1.2.3.4";
const LB2: &str = "5.6.7.8";
const LB6: &str = "2001:db8:ff::4";
const ENDPOINT_IPS: &[&str] = &[
    "10.180.0.1",
    "10.180.0.2",
    "10.180.0.3",
    "10.180.1.1",
    "10.180.1.2",
    "10.180.1.3",
    "10.180.2.1",
    "10.0.1.1",
    "10.0.1.2",
    "10.0.1.3",
    "10.0.1.4",
    "10.0.1.5",
    "fd00:10:180::1",
    "fd00:10:180::2:1",
];
const ENDPOINT_PORTS: &[u16] = &[80, 53, 5353, 8080, 8443];
/// Ports the node itself answers on ("" flows: the packet reaches the host stack unchanged).
const NODE_PORTS: &[u16] = &[80, 3001, 3080];

const DROP_TIMEOUT: Duration = Duration::from_millis(400);
/// Flows expected to be answered (or refused) take milliseconds; the generous timeout lets TCP
/// retransmit a SYN (after 1 s) that a busy host dropped.
const ANSWER_TIMEOUT: Duration = Duration::from_millis(3000);

// ------------------------------------------------------------------------------------------
// The two modes.

/// The backend `nftproxy run --proxy-mode` programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Nftables,
    Iptables,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Nftables => "nftables",
            Mode::Iptables => "iptables",
        }
    }
}

/// Runs each suite in both modes, as `suite::nftables` and `suite::iptables`.
macro_rules! in_both_modes {
    ($($suite:ident),* $(,)?) => {$(
        mod $suite {
            #[test]
            fn nftables() {
                nftproxy_tests::require_root!();
                super::$suite(super::Mode::Nftables)
            }
            #[test]
            fn iptables() {
                nftproxy_tests::require_root!();
                super::$suite(super::Mode::Iptables)
            }
        }
    )*};
}

// Where kube-proxy's iptables mode differs from its nftables mode (reference §1.16); the only
// reasons a flow may expect something else in iptables mode.

/// iptables mode does not reject packets to a port a ClusterIP does not serve: they are
/// routed on like any packet (here: out of the node's uplink, unanswered).
const NO_WRONG_PORT_REJECT: &str = "no reject for ports a ClusterIP does not serve";
/// iptables mode does not drop packets to unallocated addresses of the ServiceCIDRs.
const NO_UNALLOCATED_DROP: &str = "no drop for unallocated ClusterIPs";
/// iptables mode serves NodePorts on every local address when `nodePortAddresses` is unset
/// (nftables mode: the Node's primary addresses).
const NODE_PORTS_ON_ALL_ADDRESSES: &str = "NodePorts on every local address by default";
/// iptables mode serves IPv4 NodePorts on 127.0.0.1 (`localhostNodePorts`, route_localnet).
const LOCALHOST_NODE_PORTS: &str = "NodePorts on 127.0.0.1";
/// Found by this suite, faithful to kube-proxy: iptables mode rejects (or drops) traffic to
/// external and load-balancer IPs without (local) endpoints in `KUBE-EXTERNAL-SERVICES`, which
/// only INPUT and FORWARD jump to: the node's own traffic to a load-balancer IP (not a local
/// address) is not rejected but routed on (here: unanswered).
const NO_LB_REJECT_FROM_HOST: &str = "no reject of the node's own traffic to a load-balancer IP";

// ------------------------------------------------------------------------------------------
// Objects shared by the tables.

fn base_objects() -> Objects {
    Objects::new()
        .with(node_object(
            NODE_NAME,
            &[NODE_IP, NODE_IP6],
            &["10.0.0.0/24", "fd00:10::/64"],
        ))
        .with(service_cidr(
            "kubernetes",
            &["172.30.0.0/16", "fd00:10:96::/112"],
        ))
}

/// kube-proxy's harness configuration, with our default `nodePortAddresses` (primary).
fn base_config() -> ProxyConfig {
    ProxyConfig::new(NODE_NAME).cluster_cidr("10.0.0.0/8,fd00:10::/64")
}

fn ep(ip: &str) -> Endpoint {
    Endpoint::new(ip)
}

/// An endpoint written as in the reference: `(ready, serving, terminating)` and a node.
fn ep_rst(ip: &str, r: bool, s: bool, t: bool, node: &str) -> Endpoint {
    Endpoint::new(ip).conditions(r, s, t).node(node)
}

// ------------------------------------------------------------------------------------------
// What a flow does.

/// The fate of a connection's first packet, as the table, the kernel or the tracer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Fate {
    /// Translated to one of these endpoints; `masq` if the source was rewritten.
    Endpoints {
        set: BTreeSet<SocketAddr>,
        masq: bool,
    },
    /// Not touched by nftproxy: it reached the node's own stack at its original destination.
    Host,
    Drop,
    Reject,
    Other(String),
}

impl fmt::Display for Fate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fate::Endpoints { set, masq } => {
                let list: Vec<String> = set.iter().map(ToString::to_string).collect();
                write!(
                    f,
                    "{}{}",
                    list.join(", "),
                    if *masq { " (masq)" } else { " (no masq)" }
                )
            }
            Fate::Host => f.write_str("\"\" (host)"),
            Fate::Drop => f.write_str("DROP"),
            Fate::Reject => f.write_str("REJECT"),
            Fate::Other(s) => write!(f, "?? {s}"),
        }
    }
}

/// `want` as written in the reference tables: "REJECT", "DROP", "" or "IP:port, IP:port".
fn table_fate(want: &str, masq: bool) -> Fate {
    match want {
        "REJECT" => Fate::Reject,
        "DROP" => Fate::Drop,
        "" => Fate::Host,
        list => Fate::Endpoints {
            set: list.split(',').map(|s| sa(s.trim())).collect(),
            masq,
        },
    }
}

/// One row of a table.
#[derive(Clone, Debug)]
struct Flow {
    name: String,
    proto: Proto,
    src: IpAddr,
    dst: SocketAddr,
    want: Fate,
    /// What iptables mode does instead, and the documented difference that makes it so.
    iptables: Option<(Fate, &'static str)>,
}

impl Flow {
    /// In iptables mode this flow ends as `want` (as in the tables), because of `why` (one of
    /// the differences above).
    fn iptables(mut self, want: &str, masq: bool, why: &'static str) -> Flow {
        self.iptables = Some((table_fate(want, masq), why));
        self
    }

    /// The expected fate in `mode`.
    fn want(&self, mode: Mode) -> &Fate {
        match (&self.iptables, mode) {
            (Some((fate, _)), Mode::Iptables) => fate,
            _ => &self.want,
        }
    }
}

fn flow(name: &str, proto: Proto, src: &str, dst: &str, want: &str, masq: bool) -> Flow {
    Flow {
        name: name.to_string(),
        proto,
        src: ip(src),
        dst: sa(dst),
        want: table_fate(want, masq),
        iptables: None,
    }
}

fn tcp(name: &str, src: &str, dst: &str, want: &str, masq: bool) -> Flow {
    flow(name, Proto::Tcp, src, dst, want, masq)
}

fn nft_proto(p: Proto) -> NftProto {
    match p {
        Proto::Tcp => NftProto::Tcp,
        Proto::Udp => NftProto::Udp,
        Proto::Sctp => NftProto::Sctp,
    }
}

/// Adds up a probe's attempts. Masquerade: an endpoint saw another source address.
fn kernel_fate(attempts: &[Attempt], dst: SocketAddr, node_addrs: &[IpAddr]) -> Fate {
    let total = attempts.len();
    let mut set = BTreeSet::new();
    let (mut masq_count, mut masq_sources) = (0, BTreeSet::new());
    let (mut refused, mut timeouts, mut errors) = (0, 0, BTreeMap::<String, usize>::new());
    for a in attempts {
        match a {
            Attempt::Answered { src, local, peer } => {
                set.insert(*local);
                if peer.ip() != src.ip() {
                    masq_count += 1;
                    masq_sources.insert(peer.ip());
                }
            }
            Attempt::Refused => refused += 1,
            Attempt::Timeout => timeouts += 1,
            Attempt::Error { error } => *errors.entry(error.clone()).or_default() += 1,
        }
    }
    masq_sources.retain(|a| *a != ip(MASQ_IP) && *a != ip(MASQ_IP6));
    if !masq_sources.is_empty() {
        return Fate::Other(format!(
            "source rewritten to {masq_sources:?}, not the node's"
        ));
    }
    let answered = total - refused - timeouts - errors.values().sum::<usize>();
    if masq_count > 0 && masq_count < answered {
        return Fate::Other(format!(
            "{masq_count} of {answered} answers masqueraded, by {set:?}"
        ));
    }
    let masq = masq_count > 0;
    if total > 0 && set.len() == 1 && set.contains(&dst) && node_addrs.contains(&dst.ip()) {
        if masq {
            return Fate::Other("the host answered a masqueraded packet".into());
        }
        if refused + timeouts + errors.len() == 0 {
            return Fate::Host;
        }
    }
    if total > 0 && answered == total {
        Fate::Endpoints { set, masq }
    } else if total > 0 && refused == total {
        Fate::Reject
    } else if total > 0 && timeouts == total {
        Fate::Drop
    } else {
        Fate::Other(format!(
            "answered by {set:?} ({answered}), refused {refused}, timeouts {timeouts}, errors {errors:?}"
        ))
    }
}

fn tracer_fate(outcomes: &BTreeSet<Outcome>, dst: SocketAddr, node_addrs: &[IpAddr]) -> Fate {
    let endpoints: Vec<(SocketAddr, bool)> = outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::Endpoint { addr, masquerade } => Some((*addr, *masquerade)),
            _ => None,
        })
        .collect();
    if !endpoints.is_empty() && endpoints.len() == outcomes.len() {
        let masq = endpoints[0].1;
        if endpoints.iter().any(|(_, m)| *m != masq) {
            return Fate::Other(format!("masquerade differs by endpoint: {outcomes:?}"));
        }
        return Fate::Endpoints {
            set: endpoints.into_iter().map(|(a, _)| a).collect(),
            masq,
        };
    }
    let only = |o: Outcome| outcomes.len() == 1 && outcomes.contains(&o);
    if only(Outcome::Drop) {
        Fate::Drop
    } else if only(Outcome::Reject) {
        Fate::Reject
    } else if only(Outcome::Untouched) && node_addrs.contains(&dst.ip()) {
        Fate::Host
    } else {
        Fate::Other(format!("{outcomes:?}"))
    }
}

// ------------------------------------------------------------------------------------------
// The lab.

#[derive(Clone, Copy, Default)]
struct Opts {
    /// A namespace outside the node holding the LB IPs (§7.3 "same node to LB, SNATted to LB").
    lbsrc: bool,
    /// The second pod ([`POD2`]).
    pod2: bool,
    /// Extra client addresses on the pod: 10.0.0.3, 10.0.0.4, ...
    extra_clients: u8,
}

struct World {
    mode: Mode,
    lab: Lab,
    node: Ns,
    ext: Ns,
    pod: Ns,
    pod2: Option<Ns>,
    lbsrc: Option<Ns>,
    /// Holds every endpoint address; a client only for hairpin flows.
    eps: Ns,
    dir: PathBuf,
    /// Every address of the node namespace (the tracer's and the builder's local addresses).
    node_addrs: Vec<IpAddr>,
    /// Tables built from the files of the last [`World::apply`], per family.
    tables: BTreeMap<Family, Table>,
    errors: Mutex<Vec<String>>,
    case: String,
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn addresses(ns: &Ns) -> Vec<IpAddr> {
    let out = ns.exec(&["ip", "-j", "addr", "show"]).unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
        .filter_map(|a| a["local"].as_str().and_then(|s| s.parse().ok()))
        .collect()
}

fn world(mode: Mode, opts: Opts) -> World {
    assert!(
        nftproxy_tests::privilege::is_root(),
        "namespace tests need root"
    );
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let ext = lab
        .external(
            &node,
            "ext",
            &[ip(EXT), ip(EXT_BLOCKED), ip(EXT6)],
            &[ip(NODE_IP), ip(NODE_IP6)],
        )
        .unwrap();
    let up = ext.node_link().unwrap().to_string();
    // A real node has default routes: without them, Service addresses nothing translates would
    // be refused by routing before the filter hooks see them.
    // The pod links only have link-scoped gateway addresses, so masquerade towards a pod picks
    // the first global address of the first device (IPv4: lo comes first) or the best match
    // by RFC 6724 (IPv6: same label as the ULA pod addresses): MASQ_IP / MASQ_IP6.
    node.ip_batch(&[
        format!("route add default dev {up}"),
        format!("route add ::/0 dev {up}"),
        format!("addr add {NODE_ALT}/32 dev {up}"),
        format!("addr add {NODE_EXTERNAL_IP}/32 dev {up}"),
        format!("addr add {NODE_ALT6}/128 dev {up} nodad"),
        format!("addr add {MASQ_IP}/32 dev lo"),
        format!("addr add {MASQ_IP6}/128 dev lo nodad"),
    ])
    .unwrap();
    let mut pod_ips = vec![ip(POD), ip(POD6)];
    for i in 0..opts.extra_clients {
        pod_ips.push(IpAddr::from([10, 0, 0, 3 + i]));
    }
    let pod = lab.pod(&node, "pod", &pod_ips).unwrap();
    let pod2 = opts
        .pod2
        .then(|| lab.pod(&node, "pod2", &[ip(POD2)]).unwrap());
    let ep_ips: Vec<IpAddr> = ENDPOINT_IPS.iter().map(|s| ip(s)).collect();
    let eps = lab.pod(&node, "eps", &ep_ips).unwrap();
    let lbsrc = opts.lbsrc.then(|| {
        // Traffic the node sent to an LB that comes back SNATted to the LB IP: a host outside
        // the node whose own addresses are the LB IPs, sending to them through the node.
        // Local routing is moved behind a rule that sends its own LB-addressed packets out, and
        // it accepts the answers that carry its own address as source.
        let ns = lab
            .external(&node, "lbsrc", &[ip(LB1), ip(LB2)], &[])
            .unwrap();
        ns.sysctl(&[
            ("net.ipv4.conf.all.accept_local", "1"),
            ("net.ipv4.conf.eth0.accept_local", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.eth0.rp_filter", "0"),
        ])
        .unwrap();
        ns.ip_batch(&[
            format!("route add {NODE_IP} dev eth0"),
            format!("route add default via {NODE_IP} dev eth0"),
            format!("route add default via {NODE_IP} dev eth0 onlink table 100"),
            format!("rule add pref 10 iif lo to {LB1} lookup 100"),
            format!("rule add pref 11 iif lo to {LB2} lookup 100"),
            "rule add pref 100 lookup local".to_string(),
            "rule del pref 0 lookup local".to_string(),
        ])
        .unwrap();
        ns
    });
    lab.echo(&eps, ENDPOINT_PORTS).unwrap();
    lab.echo(&node, NODE_PORTS).unwrap();
    let node_addrs = addresses(&node);
    let dir = std::env::temp_dir().join(format!("nftproxy-semantics-{}", lab.prefix()));
    std::fs::create_dir_all(&dir).unwrap();
    World {
        mode,
        lab,
        node,
        ext,
        pod,
        pod2,
        lbsrc,
        eps,
        dir,
        node_addrs,
        tables: BTreeMap::new(),
        errors: Mutex::new(Vec::new()),
        case: String::new(),
    }
}

/// The `ops=` of each "nftables sync committed" log line (one per family).
fn committed_ops(log: &str) -> Vec<usize> {
    log.lines()
        .filter(|l| l.contains("nftables sync committed"))
        .filter_map(|l| {
            l.split("ops=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

fn nftproxy(ns: &Ns, args: &[&str]) -> Output {
    let bin =
        target_binary("nftproxy").expect("build nftproxy first (cargo build --workspace --bins)");
    ns.command(bin)
        .args(args)
        .env("RUST_LOG", "info")
        .output()
        .expect("run nftproxy")
}

/// The tracer's answer for a flow and the chains it went through.
type Traced = (Fate, Vec<String>);

impl World {
    /// Writes the objects and the configuration, programs the node with
    /// `nftproxy run --once`, and builds the same tables for the tracer.
    fn apply(&mut self, case: &str, objects: &Objects, config: &ProxyConfig) {
        self.case = case.to_string();
        let cluster_path = self.dir.join("cluster.yaml");
        let config_path = self.dir.join("config.yaml");
        let config_text = config.to_yaml();
        std::fs::write(&cluster_path, objects.to_yaml()).unwrap();
        std::fs::write(&config_path, &config_text).unwrap();
        let run = || {
            let out = nftproxy(
                &self.node,
                &[
                    "run",
                    "--once",
                    "--proxy-mode",
                    self.mode.name(),
                    "--from-file",
                    cluster_path.to_str().unwrap(),
                    "--config",
                    config_path.to_str().unwrap(),
                ],
            );
            let log = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(
                out.status.success(),
                "[{case}] nftproxy run --once failed: {log}"
            );
            log
        };
        match self.mode {
            Mode::Nftables => {
                // Each run reads the kernel's table and sends only the difference (a partial
                // update after the first case); a second run must then find nothing left to do.
                let first = committed_ops(&run());
                let again = committed_ops(&run());
                if again.len() != 2 || again.iter().any(|n| *n != 0) {
                    self.fail(format!(
                        "a second identical run sent {again:?} operations (first run: {first:?})"
                    ));
                }
            }
            Mode::Iptables => {
                // A new process restores everything (iptables has no cheap read-back); a
                // second run must leave exactly the same rules.
                run();
                let first = self.listing();
                run();
                let again = self.listing();
                if again != first {
                    self.fail(format!(
                        "a second identical run changed the rules:\n{first}\n---\n{again}"
                    ));
                }
            }
        }
        let file = KubeProxyConfiguration::parse(&config_text).unwrap();
        let overrides = Overrides {
            proxy_mode: Some(self.mode.name().to_string()),
            ..Overrides::default()
        };
        let mut settings = Settings::resolve(&file, &overrides).unwrap();
        settings.build.local_addresses = self.node_addrs.clone();
        let (cluster, skipped) =
            nftproxy::source::load_file(&cluster_path, &settings.node_name, "").unwrap();
        assert!(skipped.is_empty(), "[{case}] skipped objects: {skipped:?}");
        self.tables = Family::ALL
            .iter()
            .map(|f| (*f, build(&cluster, &settings.build, *f).table))
            .collect();
    }

    /// The namespace that owns `src` (the node for node addresses).
    fn ns_of(&self, src: IpAddr) -> &Ns {
        if self.node_addrs.contains(&src) {
            return &self.node;
        }
        [
            Some(&self.pod),
            self.pod2.as_ref(),
            Some(&self.ext),
            self.lbsrc.as_ref(),
            Some(&self.eps),
        ]
        .into_iter()
        .flatten()
        .find(|ns| ns.ips().contains(&src))
        .unwrap_or_else(|| panic!("no namespace has {src}"))
    }

    /// Runs `nettest probe` and returns its attempts.
    fn attempts(&self, ns: &Ns, probe: &Probe) -> Vec<Attempt> {
        let out = ns
            .command(self.lab.nettest())
            .args(probe.args())
            .output()
            .expect("run nettest probe");
        assert!(
            out.status.success(),
            "nettest probe in {} failed: {}",
            ns.label(),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
            .collect()
    }

    /// The kernel's answer for a flow: enough attempts to see every expected endpoint.
    fn kernel(&self, f: &Flow) -> Fate {
        let mut fate = self.kernel_once(f);
        // The host's per-CPU packet backlog is shared by every namespace, so a busy machine
        // (other suites, benchmarks) can drop an odd packet: a few timeouts among otherwise
        // expected answers are probed again, twice at most. A real difference is consistent.
        for _ in 0..2 {
            let lossy = match (&fate, f.want(self.mode)) {
                (Fate::Other(_), want) => *want != Fate::Drop,
                _ => false,
            };
            if !lossy {
                break;
            }
            fate = self.kernel_once(f);
        }
        fate
    }

    fn kernel_once(&self, f: &Flow) -> Fate {
        let ns = self.ns_of(f.src);
        let base = Probe::new(f.proto, f.dst, 1).src(f.src).parallel(8);
        let (count, timeout) = match f.want(self.mode) {
            Fate::Endpoints { set, .. } => (8 * set.len().max(1), ANSWER_TIMEOUT),
            Fate::Drop => (3, DROP_TIMEOUT),
            _ => (4, ANSWER_TIMEOUT),
        };
        let mut probe = base.clone().timeout(timeout);
        probe.count = count;
        let mut attempts = self.attempts(ns, &probe);
        // Random choices: top up until every expected endpoint answered (or something else).
        for _ in 0..4 {
            match (
                kernel_fate(&attempts, f.dst, &self.node_addrs),
                f.want(self.mode),
            ) {
                (Fate::Endpoints { set: got, .. }, Fate::Endpoints { set: want, .. })
                    if got != *want && got.is_subset(want) =>
                {
                    probe.count = 16 * want.len();
                    attempts.extend(self.attempts(ns, &probe));
                }
                _ => break,
            }
        }
        kernel_fate(&attempts, f.dst, &self.node_addrs)
    }

    /// The tracer's answer for a flow, and the chains it went through.
    fn tracer(&self, f: &Flow) -> (Fate, Vec<String>) {
        let family = Family::of(&f.src);
        let ns = self.ns_of(f.src);
        let iif = (ns != &self.node)
            .then(|| ns.node_link().map(str::to_string))
            .flatten();
        let host = Host {
            local_addresses: self.node_addrs.clone(),
        };
        let pkt = Packet {
            src: f.src,
            dst: f.dst,
            proto: nft_proto(f.proto),
            iif,
        };
        let t = trace(&self.tables[&family], &host, &pkt);
        (tracer_fate(&t.outcomes, f.dst, &self.node_addrs), t.chains)
    }

    /// Checks flows (concurrently); mismatches are collected and reported by [`World::finish`].
    fn check(&self, flows: &[Flow]) {
        // The tracer models the nftables ruleset: in iptables mode only the kernel is asked.
        let tracer = |f: &Flow| match self.mode {
            Mode::Nftables => Some(self.tracer(f)),
            Mode::Iptables => None,
        };
        let results: Vec<(Fate, Option<Traced>)> = std::thread::scope(|s| {
            let handles: Vec<_> = flows
                .iter()
                .map(|f| s.spawn(move || (self.kernel(f), tracer(f))))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (f, (kernel, traced)) in flows.iter().zip(results) {
            let want = f.want(self.mode);
            let tracer_ok = traced.as_ref().is_none_or(|(t, _)| t == want);
            if kernel != *want || !tracer_ok {
                let why = match (&f.iptables, self.mode) {
                    (Some((_, why)), Mode::Iptables) => format!(" (iptables mode: {why})"),
                    _ => String::new(),
                };
                let (tracer, chains) = match &traced {
                    Some((t, c)) => (t.to_string(), c.join(" > ")),
                    None => (
                        "(not run: it models nftables mode)".to_string(),
                        String::new(),
                    ),
                };
                self.errors.lock().unwrap().push(format!(
                    "[{} {}] {}: {} {} -> {}\n    table:  {}{}\n    kernel: {}\n    tracer: {}\n    tracer chains: {}\n    conntrack:\n{}",
                    self.mode.name(),
                    self.case,
                    f.name,
                    f.proto,
                    f.src,
                    f.dst,
                    want,
                    why,
                    kernel,
                    tracer,
                    chains,
                    self.conntrack(f)
                ));
            }
        }
    }

    /// The node's conntrack entries of a flow's source and original destination (diagnostics).
    fn conntrack(&self, f: &Flow) -> String {
        let out = self
            .node
            .run(&[
                "conntrack",
                "-L",
                "-s",
                &f.src.to_string(),
                "-d",
                &f.dst.ip().to_string(),
            ])
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_else(|e| format!("({e})"));
        let mut text: String = out.lines().map(|l| format!("      {l}\n")).collect();
        for ns in [self.ns_of(f.src), &self.node] {
            let nstat = ns
                .run(&["nstat", "-az"])
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            for l in nstat.lines() {
                let mut it = l.split_whitespace();
                if let (Some(k), Some(v)) = (it.next(), it.next())
                    && v != "0"
                    && (k.contains("Icmp")
                        || k.contains("Drop")
                        || k.contains("Fail")
                        || k.contains("Rst")
                        || k.contains("Retrans"))
                {
                    text.push_str(&format!("      {} {k} {v}\n", ns.label()));
                }
            }
        }
        text
    }

    fn fail(&self, message: String) {
        self.errors
            .lock()
            .unwrap()
            .push(format!("[{} {}] {message}", self.mode.name(), self.case));
    }

    fn finish(self) {
        let errors = self.errors.lock().unwrap();
        assert!(
            errors.is_empty(),
            "{} flow(s) disagree:\n{}",
            errors.len(),
            errors.join("\n")
        );
    }

    /// nftproxy's rules: its nftables tables, or its iptables chains (nft variant, the one a
    /// fresh namespace gets) as `iptables-save` shows them.
    fn listing(&self) -> String {
        match self.mode {
            Mode::Nftables => ["ip", "ip6"]
                .iter()
                .map(|f| {
                    self.node
                        .exec(&["nft", "list", "table", f, "nftproxy"])
                        .unwrap()
                })
                .collect(),
            Mode::Iptables => ["iptables-nft-save", "ip6tables-nft-save"]
                .iter()
                .flat_map(|t| {
                    let out = self.node.exec(&[t]).unwrap();
                    out.lines()
                        .filter(|l| l.contains("NFTPROXY-"))
                        .map(|l| format!("{l}\n"))
                        .collect::<Vec<_>>()
                })
                .collect(),
        }
    }
}

// ------------------------------------------------------------------------------------------
// §7.1 TestNoEndpointsReject

fn no_endpoints_reject(mode: Mode) {
    let mut w = world(mode, Opts::default());
    let objects = base_objects().with(
        Service::new("ns1", "svc1", "172.30.0.41")
            .load_balancer(&[LB1])
            .external_ips(&[NODE_EXTERNAL_IP])
            .port("p80", Proto::Tcp, 80)
            .node_port(3001),
    );
    w.apply("7.1", &objects, &base_config());
    use Proto::*;
    #[rustfmt::skip]
    let flows = [
        tcp("pod to cluster IP",       POD, "172.30.0.41:80",   "REJECT", false),
        tcp("external to external IP", EXT, "192.168.99.11:80", "REJECT", false),
        tcp("pod to NodePort",         POD, "192.168.0.2:3001", "REJECT", false),
        tcp("external to NodePort",    EXT, "192.168.0.2:3001", "REJECT", false),
        tcp("pod to LB",               POD, "1.2.3.4:80",       "REJECT", false),
        tcp("external to LB",          EXT, "1.2.3.4:80",       "REJECT", false),
        // Beyond the table: the node itself (output hooks), and the other protocols.
        tcp("node to cluster IP",       NODE_IP, "172.30.0.41:80",   "REJECT", false),
        tcp("node to its external IP",  NODE_IP, "192.168.99.11:80", "REJECT", false),
        tcp("node to its NodePort",     NODE_IP, "192.168.0.2:3001", "REJECT", false),
        tcp("node to LB",               NODE_IP, "1.2.3.4:80",       "REJECT", false)
            .iptables("DROP", false, NO_LB_REJECT_FROM_HOST),
        flow("UDP to the TCP port",  Udp,  POD, "172.30.0.41:80", "REJECT", false)
            .iptables("DROP", false, NO_WRONG_PORT_REJECT),
        flow("SCTP to the TCP port", Sctp, POD, "172.30.0.41:80", "REJECT", false)
            .iptables("DROP", false, NO_WRONG_PORT_REJECT),
    ];
    w.check(&flows);
    w.finish();
}

// ------------------------------------------------------------------------------------------
// §7.3 TestLoadBalancer

fn load_balancer(mode: Mode) {
    let mut w = world(
        mode,
        Opts {
            lbsrc: true,
            ..Opts::default()
        },
    );
    let objects = base_objects()
        .with(
            Service::new("ns1", "svc1", "172.30.0.41")
                .load_balancer(&[LB1, LB2])
                .port("p80", Proto::Tcp, 80)
                .node_port(3001)
                .source_ranges(&["192.168.0.0/24", " 203.0.113.0/25"]),
        )
        .with(
            Slice::new("ns1", "svc1-a", "svc1")
                .port("p80", Proto::Tcp, 80)
                .endpoint(ep("10.180.0.1")),
        )
        // Beyond the table: ranges without the node IP do not let the node (or LB1) in.
        .with(
            Service::new("ns1", "svc2", "172.30.0.42")
                .load_balancer(&["1.2.3.5"])
                .port("p80", Proto::Tcp, 80)
                .node_port(3002)
                .source_ranges(&["203.0.113.0/25"]),
        )
        .with(
            Slice::new("ns1", "svc2-a", "svc2")
                .port("p80", Proto::Tcp, 80)
                .endpoint(ep("10.180.2.1")),
        );
    w.apply("7.3", &objects, &base_config());
    let e = "10.180.0.1:80";
    let e2 = "10.180.2.1:80";
    #[rustfmt::skip]
    let flows = [
        tcp("pod to cluster IP",                     POD,         "172.30.0.41:80",   e,      false),
        tcp("external to nodePort",                  EXT,         "192.168.0.2:3001", e,      true),
        tcp("nodePort bypasses LBSourceRanges",      EXT_BLOCKED, "192.168.0.2:3001", e,      true),
        tcp("accepted external to LB1",              EXT,         "1.2.3.4:80",       e,      true),
        tcp("accepted external to LB2",              EXT,         "5.6.7.8:80",       e,      true),
        tcp("blocked external to LB1",               EXT_BLOCKED, "1.2.3.4:80",       "DROP", false),
        tcp("blocked external to LB2",               EXT_BLOCKED, "5.6.7.8:80",       "DROP", false),
        tcp("pod to LB1 (blocked by ranges)",        POD,         "1.2.3.4:80",       "DROP", false),
        tcp("pod to LB2 (blocked by ranges)",        POD,         "5.6.7.8:80",       "DROP", false),
        tcp("node to LB1 (allowed by ranges)",       NODE_IP,     "1.2.3.4:80",       e,      true),
        tcp("node to LB2 (allowed by ranges)",       NODE_IP,     "5.6.7.8:80",       e,      true),
        tcp("same node to LB1, SNATted to LB1",      LB1,         "1.2.3.4:80",       e,      true),
        tcp("same node to LB2, SNATted to LB2",      LB2,         "5.6.7.8:80",       e,      true),
        tcp("svc2: accepted external",               EXT,         "1.2.3.5:80",       e2,     true),
        tcp("svc2: blocked external",                EXT_BLOCKED, "1.2.3.5:80",       "DROP", false),
        tcp("svc2: node (not in ranges)",            NODE_IP,     "1.2.3.5:80",       "DROP", false),
        tcp("svc2: SNATted to LB1 (not in ranges)",  LB1,         "1.2.3.5:80",       "DROP", false),
        tcp("svc2: pod",                             POD,         "1.2.3.5:80",       "DROP", false),
        tcp("svc2: blocked external to nodePort",    EXT_BLOCKED, "192.168.0.2:3002", e2,     true),
    ];
    w.check(&flows);
    w.finish();
}

// ------------------------------------------------------------------------------------------
// §7.4 TestNodePorts

fn node_ports(mode: Mode, v6: bool) {
    let mut w = world(mode, Opts::default());
    let (cip, ep1, ep2) = if v6 {
        ("fd00:172:30::41", "fd00:10:180::1", "fd00:10:180::2:1")
    } else {
        ("172.30.0.41", "10.180.0.1", "10.180.2.1")
    };
    let objects = base_objects()
        .with(
            Service::new("ns1", "svc1", cip)
                .node_port_type()
                .port("p80", Proto::Tcp, 80)
                .node_port(3001),
        )
        .with(
            Slice::new("ns1", "svc1-a", "svc1")
                .port("p80", Proto::Tcp, 80)
                .endpoint(ep(ep1))
                .endpoint(ep(ep2).node(NODE_NAME)),
        );
    let at = |a: &str, port: u16| SocketAddr::new(ip(a), port).to_string();
    let both = format!("{}, {}", at(ep1, 80), at(ep2, 80));
    let (pod, ext, primary, alt) = if v6 {
        (POD6, EXT6, NODE_IP6, NODE_ALT6)
    } else {
        (POD, EXT, NODE_IP, NODE_ALT)
    };
    let multiple: &[&str] = if v6 {
        &[
            "192.168.0.0/24",
            "192.168.1.0/24",
            "2001:db8::/64",
            "2001:db8:1::2/128",
        ]
    } else {
        &["192.168.0.0/24", "192.168.1.0/24", "2001:db8::/64"]
    };
    let family = if v6 { "ipv6" } else { "ipv4" };
    let harness_default = ["192.168.0.2/32", "2001:db8::1/128"];
    #[rustfmt::skip]
    let subtests = [
        // The default: nftables mode, the Node's primary IPs; iptables mode, every local
        // address and, for IPv4, 127.0.0.1.
        (format!("{family}, default"), base_config(), "", false, true),
        // kube-proxy's harness default.
        (format!("{family}, {}", harness_default.join(" ")),
         base_config().node_port_addresses(&harness_default), "", false, false),
        (format!("{family}, multiple"), base_config().node_port_addresses(multiple), both.as_str(), true, false),
    ];
    let localhost = if v6 { "::1" } else { "127.0.0.1" };
    for (case, config, alt_want, alt_masq, default) in subtests {
        w.apply(&case, &objects, &config);
        let mut alt_flow = tcp(
            "external to nodePort on alternate IP",
            ext,
            &at(alt, 3001),
            alt_want,
            alt_masq,
        );
        let mut localhost_flow = tcp(
            "node to localhost nodePort",
            localhost,
            &at(localhost, 3001),
            "",
            false,
        );
        if default {
            alt_flow = alt_flow.iptables(&both, true, NODE_PORTS_ON_ALL_ADDRESSES);
            if !v6 {
                localhost_flow = localhost_flow.iptables(&both, true, LOCALHOST_NODE_PORTS);
            }
        }
        #[rustfmt::skip]
        let flows = [
            tcp("pod to cluster IP",     pod,     &at(cip, 80),       &both,    false),
            tcp("external to nodePort",  ext,     &at(primary, 3001), &both,    true),
            tcp("node to nodePort",      primary, &at(primary, 3001), &both,    true),
            alt_flow,
            localhost_flow,
        ];
        w.check(&flows);
    }
    w.finish();
}

fn node_ports_ipv4(mode: Mode) {
    node_ports(mode, false);
}

fn node_ports_ipv6(mode: Mode) {
    node_ports(mode, true);
}

// ------------------------------------------------------------------------------------------
// §7.5 TestExternalTrafficPolicyLocal / TestExternalTrafficPolicyCluster

fn external_traffic_policy(mode: Mode, local: bool) {
    let mut w = world(mode, Opts::default());
    // kube-proxy's Service is IPv4 only; ours is dual-stack (same IPv4 table) so that the IPv6
    // rules are checked too, beyond the table.
    let mut svc = Service::with_cluster_ips("ns1", "svc1", &["172.30.0.41", "fd00:172:30::41"])
        .load_balancer(&[LB1, LB6])
        .external_ips(&[NODE_EXTERNAL_IP])
        .port("p80", Proto::Tcp, 80)
        .target_port("80")
        .node_port(3001);
    let mut svc2 = Service::new("ns1", "svc2", "172.30.0.42")
        .load_balancer(&[LB2])
        .external_ips(&[NODE_ALT])
        .port("p80", Proto::Tcp, 80)
        .node_port(3002);
    if local {
        svc = svc.external_local().health_check_node_port(30000);
        svc2 = svc2.external_local().health_check_node_port(30001);
    }
    let objects = base_objects()
        .with(svc)
        .with(
            Slice::new("ns1", "svc1-a", "svc1")
                .port("p80", Proto::Tcp, 80)
                .endpoint(ep("10.180.0.1"))
                .endpoint(ep("10.180.2.1").node(NODE_NAME)),
        )
        .with(
            Slice::new("ns1", "svc1-b", "svc1")
                .port("p80", Proto::Tcp, 80)
                .endpoint(ep("fd00:10:180::1"))
                .endpoint(ep("fd00:10:180::2:1").node(NODE_NAME)),
        )
        // Beyond the table: the same policy with no local endpoint.
        .with(svc2)
        .with(
            Slice::new("ns1", "svc2-a", "svc2")
                .port("p80", Proto::Tcp, 80)
                .endpoint(ep("10.180.0.1").node("node2")),
        );
    let case = if local {
        "7.5 eTP=Local"
    } else {
        "7.5 eTP=Cluster"
    };
    w.apply(case, &objects, &base_config());
    let both = "10.180.0.1:80, 10.180.2.1:80";
    let both6 = "[fd00:10:180::1]:80, [fd00:10:180::2:1]:80";
    let remote = "10.180.0.1:80";
    let ext_remote = if local { "DROP" } else { remote };
    let (ext, ext6, masq) = if local {
        ("10.180.2.1:80", "[fd00:10:180::2:1]:80", false)
    } else {
        (both, both6, true)
    };
    #[rustfmt::skip]
    let flows = [
        tcp("pod to cluster IP",       POD, "172.30.0.41:80",   both, false),
        tcp("pod to external IP",      POD, "192.168.99.11:80", both, masq),
        tcp("external to external IP", EXT, "192.168.99.11:80", ext,  masq),
        tcp("pod to LB",               POD, "1.2.3.4:80",       both, masq),
        tcp("external to LB",          EXT, "1.2.3.4:80",       ext,  masq),
        tcp("pod to NodePort",         POD, "192.168.0.2:3001", both, masq),
        tcp("external to NodePort",    EXT, "192.168.0.2:3001", ext,  masq),
        // Beyond the table: the node's own traffic is short-circuited and masqueraded.
        tcp("node to external IP", NODE_IP, "192.168.99.11:80", both, true),
        tcp("node to LB",          NODE_IP, "1.2.3.4:80",       both, true),
        tcp("node to NodePort",    NODE_IP, "192.168.0.2:3001", both, true),
        // Beyond the table: the same in IPv6.
        tcp("IPv6 pod to cluster IP",    POD6,     "[fd00:172:30::41]:80", both6, false),
        tcp("IPv6 pod to LB",            POD6,     "[2001:db8:ff::4]:80",  both6, masq),
        tcp("IPv6 external to LB",       EXT6,     "[2001:db8:ff::4]:80",  ext6,  masq),
        tcp("IPv6 pod to NodePort",      POD6,     "[2001:db8::1]:3001",   both6, masq),
        tcp("IPv6 external to NodePort", EXT6,     "[2001:db8::1]:3001",   ext6,  masq),
        tcp("IPv6 node to LB",           NODE_IP6, "[2001:db8:ff::4]:80",  both6, true),
        tcp("IPv6 node to NodePort",     NODE_IP6, "[2001:db8::1]:3001",   both6, true),
        // svc2: external traffic is dropped (eTP=Local); pod and node traffic is short-circuited
        // before the no-endpoint check could drop it.
        tcp("svc2: pod to cluster IP",       POD,     "172.30.0.42:80",   remote,     false),
        tcp("svc2: external to LB",          EXT,     "5.6.7.8:80",       ext_remote, masq),
        tcp("svc2: external to external IP", EXT,     "192.168.1.2:80",   ext_remote, masq),
        tcp("svc2: external to NodePort",    EXT,     "192.168.0.2:3002", ext_remote, masq),
        tcp("svc2: pod to LB",               POD,     "5.6.7.8:80",       remote,     masq),
        tcp("svc2: pod to external IP",      POD,     "192.168.1.2:80",   remote,     masq),
        tcp("svc2: pod to NodePort",         POD,     "192.168.0.2:3002", remote,     masq),
        tcp("svc2: node to LB",              NODE_IP, "5.6.7.8:80",       remote,     true),
        tcp("svc2: node to NodePort",        NODE_IP, "192.168.0.2:3002", remote,     true),
    ];
    w.check(&flows);
    w.finish();
}

fn external_traffic_policy_local(mode: Mode) {
    external_traffic_policy(mode, true);
}

fn external_traffic_policy_cluster(mode: Mode) {
    external_traffic_policy(mode, false);
}

// ------------------------------------------------------------------------------------------
// §7.6 TestInternalTrafficPolicy

fn internal_traffic_policy(mode: Mode) {
    let mut w = world(mode, Opts::default());
    let svc = |local: bool| {
        let s = Service::new("ns1", "svc1", "172.30.1.1").port("", Proto::Tcp, 80);
        if local { s.internal_local() } else { s }
    };
    let slice = |nodes: [&str; 3]| {
        Slice::new("ns1", "svc1-a", "svc1")
            .port("", Proto::Tcp, 80)
            .endpoint(ep("10.0.1.1").node(nodes[0]))
            .endpoint(ep("10.0.1.2").node(nodes[1]))
            .endpoint(ep("10.0.1.3").node(nodes[2]))
    };
    let me = NODE_NAME;
    #[rustfmt::skip]
    let cases = [
        ("a: iTP=Cluster",       false, [me, "node1", "node2"],      "10.0.1.1:80, 10.0.1.2:80, 10.0.1.3:80"),
        ("b: iTP=Local",         true,  [me, "node1", "node2"],      "10.0.1.1:80"),
        ("c: iTP=Local, 2 local", true, [me, me, "node2"],           "10.0.1.1:80, 10.0.1.2:80"),
        ("d: iTP=Local, 0 local", true, ["node0", "node1", "node2"], "DROP"),
    ];
    for (case, local, nodes, want) in cases {
        let objects = base_objects().with(svc(local)).with(slice(nodes));
        w.apply(&format!("7.6 {case}"), &objects, &base_config());
        w.check(&[
            tcp("pod to cluster IP", POD, "172.30.1.1:80", want, false),
            // Beyond the table: iTP does not change the masquerade of the node's own traffic.
            tcp("node to cluster IP", NODE_IP, "172.30.1.1:80", want, true),
        ]);
        let objects = base_objects().with(svc(local));
        w.apply(
            &format!("7.6 {case}, slice deleted"),
            &objects,
            &base_config(),
        );
        w.check(&[tcp(
            "pod to cluster IP",
            POD,
            "172.30.1.1:80",
            "REJECT",
            false,
        )]);
    }
    w.finish();
}

// ------------------------------------------------------------------------------------------
// §7.7 / §7.8 TestTerminatingEndpointsTrafficPolicyLocal / ...Cluster

fn terminating_endpoints(mode: Mode, local: bool) {
    let mut w = world(mode, Opts::default());
    let mut svc = Service::new("ns1", "svc1", "172.30.1.1")
        .load_balancer(&[LB1])
        .port("", Proto::Tcp, 80)
        .target_port("80");
    if local {
        svc = svc.external_local().health_check_node_port(30000);
    }
    let slice = |eps: Vec<Endpoint>| {
        Slice::new("ns1", "svc1-a", "svc1")
            .port("", Proto::Tcp, 80)
            .endpoints(eps)
    };
    // An endpoint 10.0.1.n with its (ready, serving, terminating) conditions, on a node.
    let e = |n: u8, rst: (bool, bool, bool), node: &str| {
        ep_rst(&format!("10.0.1.{n}"), rst.0, rst.1, rst.2, node)
    };
    const RSN: (bool, bool, bool) = (true, true, false); // ready, serving, not terminating
    const NST: (bool, bool, bool) = (false, true, true); // serving while terminating
    const NNT: (bool, bool, bool) = (false, false, true); // terminating, not serving
    let me = NODE_NAME;
    #[rustfmt::skip]
    let cases: Vec<(&str, Vec<Endpoint>, &str, &str)> = if local {
        let n1 = "node-1";
        vec![
            ("ready endpoints exist",
             vec![e(1, RSN, me), e(2, RSN, me), e(3, NST, me), e(4, NNT, me), e(5, RSN, n1)],
             "10.0.1.1:80, 10.0.1.2:80, 10.0.1.5:80", "10.0.1.1:80, 10.0.1.2:80"),
            ("only terminating endpoints exist",
             vec![e(2, NST, me), e(3, NST, me), e(4, NNT, me), e(5, RSN, n1)],
             "10.0.1.5:80", "10.0.1.2:80, 10.0.1.3:80"),
            ("terminating endpoints on remote node",
             vec![e(5, NST, n1)],
             "10.0.1.5:80", "DROP"),
            ("no usable endpoints on any node",
             vec![e(5, NNT, me), e(5, NNT, n1)],
             "REJECT", "REJECT"),
        ]
    } else {
        let an = "another-node";
        vec![
            ("ready endpoints exist",
             vec![e(1, RSN, me), e(2, RSN, me), e(3, NST, an), e(4, NNT, an), e(5, RSN, an)],
             "10.0.1.1:80, 10.0.1.2:80, 10.0.1.5:80", "10.0.1.1:80, 10.0.1.2:80, 10.0.1.5:80"),
            ("only terminating endpoints exist",
             vec![e(2, NST, me), e(3, NST, me), e(4, NNT, an), e(5, NST, an)],
             "10.0.1.2:80, 10.0.1.3:80, 10.0.1.5:80", "10.0.1.2:80, 10.0.1.3:80, 10.0.1.5:80"),
            ("terminating endpoints on remote node",
             vec![e(5, NST, "node-1")],
             "10.0.1.5:80", "10.0.1.5:80"),
            ("no usable endpoints on any node",
             vec![e(5, NNT, me), e(5, NNT, "node-1")],
             "REJECT", "REJECT"),
        ]
    };
    // External traffic is masqueraded for eTP=Cluster only.
    let e_masq = !local;
    let section = if local {
        "7.7 eTP=Local"
    } else {
        "7.8 eTP=Cluster"
    };
    for (case, eps, p_want, e_want) in cases {
        let objects = base_objects().with(svc.clone()).with(slice(eps));
        w.apply(&format!("{section}: {case}"), &objects, &base_config());
        w.check(&[
            tcp("P: pod to cluster IP", POD, "172.30.1.1:80", p_want, false),
            tcp("E: external to LB", EXT, "1.2.3.4:80", e_want, e_masq),
            // Beyond the table: pod and node traffic to the LB uses the cluster endpoints
            // (short-circuited with eTP=Local), the node's masqueraded.
            tcp("pod to LB", POD, "1.2.3.4:80", p_want, e_masq),
            if p_want == "REJECT" {
                tcp("node to LB", NODE_IP, "1.2.3.4:80", p_want, true).iptables(
                    "DROP",
                    false,
                    NO_LB_REJECT_FROM_HOST,
                )
            } else {
                tcp("node to LB", NODE_IP, "1.2.3.4:80", p_want, true)
            },
        ]);
        let objects = base_objects().with(svc.clone());
        w.apply(
            &format!("{section}: {case}, slice deleted"),
            &objects,
            &base_config(),
        );
        w.check(&[
            tcp(
                "P: pod to cluster IP",
                POD,
                "172.30.1.1:80",
                "REJECT",
                false,
            ),
            tcp("E: external to LB", EXT, "1.2.3.4:80", "REJECT", false),
        ]);
    }
    w.finish();
}

fn terminating_endpoints_external_policy_local(mode: Mode) {
    terminating_endpoints(mode, true);
}

fn terminating_endpoints_external_policy_cluster(mode: Mode) {
    terminating_endpoints(mode, false);
}

// ------------------------------------------------------------------------------------------
// Session affinity

/// The single endpoint every attempt reached, or why not.
fn one_endpoint(attempts: &[Attempt]) -> Result<SocketAddr, String> {
    let set: BTreeSet<SocketAddr> = attempts
        .iter()
        .filter_map(|a| match a {
            Attempt::Answered { local, .. } => Some(*local),
            _ => None,
        })
        .collect();
    match (set.len(), attempts.len()) {
        (1, n)
            if attempts
                .iter()
                .all(|a| matches!(a, Attempt::Answered { .. }))
                && n > 0 =>
        {
            Ok(*set.first().unwrap())
        }
        _ => Err(format!("{attempts:?}")),
    }
}

fn session_affinity(mode: Mode) {
    const CLIENTS: u8 = 12;
    let mut w = world(
        mode,
        Opts {
            extra_clients: CLIENTS - 1,
            ..Opts::default()
        },
    );
    let three = || {
        [
            ep("10.0.1.1").node(NODE_NAME),
            ep("10.0.1.2").node("node1"),
            ep("10.0.1.3").node("node2"),
        ]
    };
    let objects = base_objects()
        .with(
            Service::new("ns1", "aff", "172.30.0.60")
                .node_port_type()
                .external_ips(&[NODE_EXTERNAL_IP])
                .port("http", Proto::Tcp, 80)
                .node_port(3001)
                .client_ip_affinity(3),
        )
        .with(
            Slice::new("ns1", "aff-a", "aff")
                .port("http", Proto::Tcp, 80)
                .endpoints(three()),
        )
        .with(Service::new("ns1", "noaff", "172.30.0.61").port("http", Proto::Tcp, 80))
        .with(
            Slice::new("ns1", "noaff-a", "noaff")
                .port("http", Proto::Tcp, 80)
                .endpoints(three()),
        );
    w.apply("affinity", &objects, &base_config());
    let all: BTreeSet<SocketAddr> = ["10.0.1.1:80", "10.0.1.2:80", "10.0.1.3:80"]
        .iter()
        .map(|s| sa(s))
        .collect();
    // The tracer knows nothing of the run-time affinity sets: a first connection may go to
    // any endpoint.
    if mode == Mode::Nftables {
        let (fate, _) = w.tracer(&tcp("", POD, "172.30.0.60:80", "", false));
        assert_eq!(
            fate,
            Fate::Endpoints {
                set: all.clone(),
                masq: false
            }
        );
    }
    let clients: Vec<IpAddr> = (0..CLIENTS)
        .map(|i| IpAddr::from([10, 0, 0, 2 + i]))
        .collect();
    let cip = sa("172.30.0.60:80");
    let vips = [cip, sa("192.168.99.11:80"), sa("192.168.0.2:3001")];
    let probe = |src: IpAddr, dst: SocketAddr, count: usize, parallel: usize| {
        let mut p = Probe::new(Proto::Tcp, dst, count)
            .src(src)
            .parallel(parallel)
            .timeout(ANSWER_TIMEOUT);
        p.count = count;
        w.attempts(&w.pod, &p)
    };
    // One round: each client's first connection alone (it creates the affinity entry; racing
    // first connections could each pick an endpoint), then more to every address of the port.
    let round = |per_vip: usize| -> BTreeMap<IpAddr, Result<SocketAddr, String>> {
        std::thread::scope(|s| {
            let handles: Vec<_> = clients
                .iter()
                .map(|&c| {
                    s.spawn(move || {
                        let mut attempts = probe(c, cip, 1, 1);
                        for vip in vips {
                            attempts.extend(probe(c, vip, per_vip, 8));
                        }
                        (c, one_endpoint(&attempts))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    // 50 connections from one client all reach one endpoint.
    let mut first = probe(clients[0], cip, 1, 1);
    first.extend(probe(clients[0], cip, 49, 8));
    if let Err(e) = one_endpoint(&first) {
        w.fail(format!("50 connections from {} spread: {e}", clients[0]));
    }
    let before = round(6);
    let done = Instant::now();
    // Without affinity the same client spreads.
    let spread = probe(clients[0], sa("172.30.0.61:80"), 50, 8);
    let seen: BTreeSet<SocketAddr> = spread
        .iter()
        .filter_map(|a| match a {
            Attempt::Answered { local, .. } => Some(*local),
            _ => None,
        })
        .collect();
    if seen.len() < 2 || !seen.is_subset(&all) {
        w.fail(format!("without affinity, 50 connections reached {seen:?}"));
    }
    // Past the timeout, each client chooses again.
    std::thread::sleep(Duration::from_millis(3600).saturating_sub(done.elapsed()));
    let after = round(4);
    let mut changed = 0;
    let mut chosen = BTreeSet::new();
    for c in &clients {
        match (&before[c], &after[c]) {
            (Ok(a), Ok(b)) => {
                changed += usize::from(a != b);
                chosen.insert(*a);
                chosen.insert(*b);
                if !all.contains(a) || !all.contains(b) {
                    w.fail(format!("{c} reached {a} / {b}, not an endpoint"));
                }
            }
            (a, b) => w.fail(format!(
                "{c}: the ClusterIP, external IP and NodePort did not all reach one endpoint: {a:?} / {b:?}"
            )),
        }
    }
    // 12 clients, 2 rounds: all choices equal or no change has a chance of about 1e-6.
    if chosen.len() < 2 {
        w.fail(format!("all clients chose {chosen:?}"));
    }
    if changed == 0 {
        w.fail("no client chose a new endpoint after the affinity timeout".into());
    }
    w.finish();
}

// ------------------------------------------------------------------------------------------
// Protocols and ports

fn mixed_protocol_load_balancer(mode: Mode) {
    let mut w = world(mode, Opts::default());
    let objects = base_objects()
        .with(
            Service::new("ns1", "dns", "172.30.0.70")
                .load_balancer(&[LB2])
                .port("dns-tcp", Proto::Tcp, 53)
                .target_port("5353")
                .node_port(3053)
                .port("dns-udp", Proto::Udp, 53)
                .node_port(3053)
                .port("dns-sctp", Proto::Sctp, 53)
                .node_port(3053),
        )
        .with(
            Slice::new("ns1", "dns-a", "dns")
                .port("dns-tcp", Proto::Tcp, 5353)
                .port("dns-udp", Proto::Udp, 53)
                .port("dns-sctp", Proto::Sctp, 53)
                .endpoint(ep("10.180.0.1").node(NODE_NAME))
                .endpoint(ep("10.180.2.1").node("node2")),
        )
        .with(
            Service::new("ns1", "no-endpoints", "172.30.0.72")
                .port("sctp", Proto::Sctp, 53)
                .port("udp", Proto::Udp, 54),
        );
    w.apply("mixed protocols", &objects, &base_config());
    let both = |p: u16| format!("10.180.0.1:{p}, 10.180.2.1:{p}");
    let (b53, b5353) = (both(53), both(5353));
    use Proto::*;
    #[rustfmt::skip]
    let flows = [
        flow("pod to cluster IP, TCP",     Tcp,  POD,     "172.30.0.70:53",   &b5353, false),
        flow("pod to cluster IP, UDP",     Udp,  POD,     "172.30.0.70:53",   &b53,   false),
        flow("pod to cluster IP, SCTP",    Sctp, POD,     "172.30.0.70:53",   &b53,   false),
        flow("external to LB, TCP",        Tcp,  EXT,     "5.6.7.8:53",       &b5353, true),
        flow("external to LB, UDP",        Udp,  EXT,     "5.6.7.8:53",       &b53,   true),
        flow("external to LB, SCTP",       Sctp, EXT,     "5.6.7.8:53",       &b53,   true),
        flow("external to NodePort, TCP",  Tcp,  EXT,     "192.168.0.2:3053", &b5353, true),
        flow("external to NodePort, UDP",  Udp,  EXT,     "192.168.0.2:3053", &b53,   true),
        flow("external to NodePort, SCTP", Sctp, EXT,     "192.168.0.2:3053", &b53,   true),
        flow("node to LB, UDP",            Udp,  NODE_IP, "5.6.7.8:53",       &b53,   true),
        flow("node to NodePort, SCTP",     Sctp, NODE_IP, "192.168.0.2:3053", &b53,   true),
        flow("invalid port of a cluster IP", Tcp,  POD, "172.30.0.70:54", "REJECT", false)
            .iptables("DROP", false, NO_WRONG_PORT_REJECT),
        flow("SCTP port without endpoints",  Sctp, POD, "172.30.0.72:53", "REJECT", false),
        flow("UDP port without endpoints",   Udp,  POD, "172.30.0.72:54", "REJECT", false),
        flow("TCP to an SCTP-only port",     Tcp,  POD, "172.30.0.72:53", "REJECT", false)
            .iptables("DROP", false, NO_WRONG_PORT_REJECT),
    ];
    w.check(&flows);
    w.finish();
}

fn multiple_ports_and_named_target_port(mode: Mode) {
    let mut w = world(mode, Opts::default());
    let objects = base_objects()
        .with(
            Service::new("ns1", "web", "172.30.0.71")
                .node_port_type()
                .port("http", Proto::Tcp, 80)
                .target_port("web")
                .node_port(3071)
                .port("https", Proto::Tcp, 443)
                .target_port("8443")
                .node_port(3443)
                .port("admin", Proto::Tcp, 8081)
                .target_port("admin")
                .node_port(3081),
        )
        // The EndpointSlice controller resolved "web" to 8080; no pod has an "admin" port.
        .with(
            Slice::new("ns1", "web-a", "web")
                .port("http", Proto::Tcp, 8080)
                .port("https", Proto::Tcp, 8443)
                .endpoint(ep("10.180.0.1").node(NODE_NAME))
                .endpoint(ep("10.180.2.1").node("node2")),
        );
    w.apply("multiple ports", &objects, &base_config());
    let both = |p: u16| format!("10.180.0.1:{p}, 10.180.2.1:{p}");
    let (b8080, b8443) = (both(8080), both(8443));
    #[rustfmt::skip]
    let flows = [
        tcp("named target port",            POD, "172.30.0.71:80",   &b8080,   false),
        tcp("numeric target port",          POD, "172.30.0.71:443",  &b8443,   false),
        tcp("port without endpoints",       POD, "172.30.0.71:8081", "REJECT", false),
        tcp("NodePort of the named port",   EXT, "192.168.0.2:3071", &b8080,   true),
        tcp("NodePort of the numeric port", EXT, "192.168.0.2:3443", &b8443,   true),
        tcp("NodePort without endpoints",   EXT, "192.168.0.2:3081", "REJECT", false),
        tcp("a port the Service lacks",     POD, "172.30.0.71:8080", "REJECT", false)
            .iptables("DROP", false, NO_WRONG_PORT_REJECT),
    ];
    w.check(&flows);
    w.finish();
}

// ------------------------------------------------------------------------------------------
// service.kubernetes.io/service-proxy-name

fn services_of_another_proxy_are_not_programmed(mode: Mode) {
    let mut w = world(mode, Opts::default());
    let slice = |svc: &str| {
        Slice::new("ns1", &format!("{svc}-a"), svc)
            .port("p80", Proto::Tcp, 80)
            .endpoint(ep("10.180.0.1").node(NODE_NAME))
    };
    let objects = base_objects()
        .with(
            Service::new("ns1", "theirs", "172.30.0.80")
                .node_port_type()
                .label("service.kubernetes.io/service-proxy-name", "other-proxy")
                .port("p80", Proto::Tcp, 80)
                .node_port(3080),
        )
        .with(slice("theirs"))
        .with(
            Service::new("ns1", "mine", "172.30.0.81")
                .node_port_type()
                .port("p80", Proto::Tcp, 80)
                .node_port(3001),
        )
        .with(slice("mine"));
    w.apply("service-proxy-name", &objects, &base_config());
    let e = "10.180.0.1:80";
    #[rustfmt::skip]
    let flows = [
        // iptables mode does not drop it, but routed on it goes unanswered here just the same.
        tcp("labelled: unallocated cluster IP", POD, "172.30.0.80:80",   "DROP", false)
            .iptables("DROP", false, NO_UNALLOCATED_DROP),
        tcp("labelled: no NodePort",            EXT, "192.168.0.2:3080", "",     false),
        tcp("unlabelled cluster IP",            POD, "172.30.0.81:80",   e,      false),
        tcp("unlabelled NodePort",              EXT, "192.168.0.2:3001", e,      true),
    ];
    w.check(&flows);
    let listing = w.listing();
    for absent in ["172.30.0.80", "theirs", "3080"] {
        if listing.contains(absent) {
            w.fail(format!("{absent} is programmed:\n{listing}"));
        }
    }
    w.finish();
}

// ------------------------------------------------------------------------------------------
// Masquerade and detect-local modes

/// kube-proxy's TestInternalExternalMasquerade (not in the reference's §7, same file): every
/// source (pod, node, external) to every address (ClusterIP, NodePort, LB) of a Cluster, an
/// eTP=Local and an iTP=Local Service, with and without detect-local and masqueradeAll.
fn internal_external_masquerade(mode: Mode) {
    let mut w = world(mode, Opts::default());
    let mut objects = base_objects();
    for (n, lb, policy) in [
        (1, "1.2.3.4", ""),
        (2, "5.6.7.8", "eTP"),
        (3, "9.10.11.12", "iTP"),
    ] {
        let name = format!("svc{n}");
        let mut svc = Service::new(&format!("ns{n}"), &name, &format!("172.30.0.4{n}"))
            .load_balancer(&[lb])
            .port("p80", Proto::Tcp, 80)
            .node_port(3000 + n)
            .health_check_node_port(30000 + n);
        svc = match policy {
            "eTP" => svc.external_local(),
            "iTP" => svc.internal_local(),
            _ => svc,
        };
        objects.push(svc);
        objects.push(
            Slice::new(&format!("ns{n}"), &format!("{name}-a"), &name)
                .port("p80", Proto::Tcp, 80)
                .endpoint(ep(&format!("10.180.0.{n}")).node(NODE_NAME))
                .endpoint(ep(&format!("10.180.1.{n}")).node("remote")),
        );
    }
    let b1 = "10.180.0.1:80, 10.180.1.1:80";
    let b2 = "10.180.0.2:80, 10.180.1.2:80";
    let b3 = "10.180.0.3:80, 10.180.1.3:80";
    let l2 = "10.180.0.2:80";
    let l3 = "10.180.0.3:80";
    #[rustfmt::skip]
    let base: Vec<(&str, &str, &str, &str, bool)> = vec![
        ("pod to ClusterIP",                     POD,     "172.30.0.41:80",   b1, false),
        ("pod to NodePort",                      POD,     "192.168.0.2:3001", b1, true),
        ("pod to LB",                            POD,     "1.2.3.4:80",       b1, true),
        ("node to ClusterIP",                    NODE_IP, "172.30.0.41:80",   b1, true),
        ("node to NodePort",                     NODE_IP, "192.168.0.2:3001", b1, true),
        ("node to LB",                           NODE_IP, "1.2.3.4:80",       b1, true),
        ("external to ClusterIP",                EXT,     "172.30.0.41:80",   b1, true),
        ("external to NodePort",                 EXT,     "192.168.0.2:3001", b1, true),
        ("external to LB",                       EXT,     "1.2.3.4:80",       b1, true),
        ("pod to ClusterIP with eTP:Local",      POD,     "172.30.0.42:80",   b2, false),
        ("pod to NodePort with eTP:Local",       POD,     "192.168.0.2:3002", b2, false),
        ("pod to LB with eTP:Local",             POD,     "5.6.7.8:80",       b2, false),
        ("node to ClusterIP with eTP:Local",     NODE_IP, "172.30.0.42:80",   b2, true),
        // Upstream's "node to NodePort with eTP:Local" probes svc1's NodePort 3001 (its
        // expected output is svc1's endpoints); we probe svc2's 3002 as the name says.
        ("node to NodePort with eTP:Local",      NODE_IP, "192.168.0.2:3002", b2, true),
        ("node to LB with eTP:Local",            NODE_IP, "5.6.7.8:80",       b2, true),
        ("external to ClusterIP with eTP:Local", EXT,     "172.30.0.42:80",   b2, true),
        ("external to NodePort with eTP:Local",  EXT,     "192.168.0.2:3002", l2, false),
        ("external to LB with eTP:Local",        EXT,     "5.6.7.8:80",       l2, false),
        ("pod to ClusterIP with iTP:Local",      POD,     "172.30.0.43:80",   l3, false),
        ("pod to NodePort with iTP:Local",       POD,     "192.168.0.2:3003", b3, true),
        ("pod to LB with iTP:Local",             POD,     "9.10.11.12:80",    b3, true),
        ("node to ClusterIP with iTP:Local",     NODE_IP, "172.30.0.43:80",   l3, true),
        ("node to NodePort with iTP:Local",      NODE_IP, "192.168.0.2:3003", b3, true),
        ("node to LB with iTP:Local",            NODE_IP, "9.10.11.12:80",    b3, true),
        ("external to ClusterIP with iTP:Local", EXT,     "172.30.0.43:80",   l3, true),
        ("external to NodePort with iTP:Local",  EXT,     "192.168.0.2:3003", b3, true),
        ("external to LB with iTP:Local",        EXT,     "9.10.11.12:80",    b3, true),
    ];
    // Per case: the flows whose masquerade or output differs from `base`.
    let no_detector: &[(&str, Option<bool>, Option<&str>)] = &[
        ("node to ClusterIP", Some(false), None),
        ("node to ClusterIP with eTP:Local", Some(false), None),
        ("node to ClusterIP with iTP:Local", Some(false), None),
        ("external to ClusterIP", Some(false), None),
        ("external to ClusterIP with eTP:Local", Some(false), None),
        ("external to ClusterIP with iTP:Local", Some(false), None),
        ("pod to NodePort with eTP:Local", None, Some(l2)),
        ("pod to LB with eTP:Local", None, Some(l2)),
    ];
    let masquerade_all: &[(&str, Option<bool>, Option<&str>)] = &[
        ("pod to ClusterIP", Some(true), None),
        ("pod to ClusterIP with eTP:Local", Some(true), None),
        ("pod to ClusterIP with iTP:Local", Some(true), None),
    ];
    let both: Vec<_> = masquerade_all
        .iter()
        .chain(no_detector.iter().filter(|o| o.2.is_some()))
        .copied()
        .collect();
    let cases = [
        ("base", base_config(), &[][..]),
        (
            "no LocalTrafficDetector",
            ProxyConfig::new(NODE_NAME),
            no_detector,
        ),
        (
            "masqueradeAll",
            base_config().masquerade_all(true),
            masquerade_all,
        ),
        (
            "masqueradeAll, no LocalTrafficDetector",
            ProxyConfig::new(NODE_NAME).masquerade_all(true),
            &both[..],
        ),
    ];
    for (case, config, overrides) in cases {
        w.apply(case, &objects, &config);
        let flows: Vec<Flow> = base
            .iter()
            .map(|&(name, src, dst, out, masq)| {
                let o = overrides.iter().find(|o| o.0 == name);
                let masq = o.and_then(|o| o.1).unwrap_or(masq);
                let out = o.and_then(|o| o.2).unwrap_or(out);
                tcp(name, src, dst, out, masq)
            })
            .collect();
        w.check(&flows);
    }
    w.finish();
}

fn masquerade_and_detect_local_modes(mode: Mode) {
    let mut w = world(
        mode,
        Opts {
            pod2: true,
            ..Opts::default()
        },
    );
    let pod_link = w.pod.node_link().unwrap().to_string();
    let slice = |name: &str, svc: &str| {
        Slice::new("ns1", name, svc)
            .port("p80", Proto::Tcp, 80)
            .endpoint(ep("10.180.0.1"))
            .endpoint(ep("10.180.2.1").node(NODE_NAME))
    };
    let objects = base_objects()
        .with(Service::new("ns1", "cip", "172.30.0.90").port("p80", Proto::Tcp, 80))
        .with(slice("cip-a", "cip"))
        .with(
            Service::new("ns1", "lb", "172.30.0.91")
                .load_balancer(&[LB1])
                .external_local()
                .health_check_node_port(30000)
                .port("p80", Proto::Tcp, 80)
                .node_port(3001),
        )
        .with(slice("lb-a", "lb"));
    let both = "10.180.0.1:80, 10.180.2.1:80";
    let local = "10.180.2.1:80";
    // Per mode: is ClusterIP traffic from pod, pod2, external, node masqueraded; where does
    // pod and pod2 traffic to the eTP=Local LB go (short-circuited to all endpoints when the
    // source is detected as local, else to local endpoints only).
    #[rustfmt::skip]
    let modes = [
        ("ClusterCIDR",         base_config(),
         [false, false, true,  true ], [both,  both ]),
        ("masqueradeAll",       base_config().masquerade_all(true),
         [true,  true,  true,  true ], [both,  both ]),
        ("NodeCIDR",            base_config().detect_local_mode("NodeCIDR"),
         [false, true,  true,  true ], [both,  local]),
        ("BridgeInterface",     base_config().bridge_interface(&pod_link),
         [false, true,  true,  true ], [both,  local]),
        ("InterfaceNamePrefix", base_config().interface_name_prefix("vp"),
         [false, false, true,  true ], [both,  both ]),
        ("no detect-local",     ProxyConfig::new(NODE_NAME),
         [false, false, false, false], [local, local]),
    ];
    for (mode, config, [m_pod, m_pod2, m_ext, m_node], [lb_pod, lb_pod2]) in modes {
        w.apply(mode, &objects, &config);
        #[rustfmt::skip]
        let flows = [
            tcp("pod to cluster IP",         POD,     "172.30.0.90:80", both,    m_pod),
            tcp("pod2 to cluster IP",        POD2,    "172.30.0.90:80", both,    m_pod2),
            tcp("external to cluster IP",    EXT,     "172.30.0.90:80", both,    m_ext),
            tcp("node to cluster IP",        NODE_IP, "172.30.0.90:80", both,    m_node),
            tcp("pod to eTP=Local LB",       POD,     "1.2.3.4:80",     lb_pod,  false),
            tcp("pod2 to eTP=Local LB",      POD2,    "1.2.3.4:80",     lb_pod2, false),
            tcp("external to eTP=Local LB",  EXT,     "1.2.3.4:80",     local,   false),
            tcp("node to eTP=Local LB",      NODE_IP, "1.2.3.4:80",     both,    true),
        ];
        w.check(&flows);
    }
    w.finish();
}

// ------------------------------------------------------------------------------------------
// Hairpin: an endpoint reaching itself through its Service is masqueraded, or its own answer
// would bypass the node's reverse translation. Only that endpoint: other clients are not.

fn hairpin(mode: Mode) {
    let mut w = world(mode, Opts::default());
    let objects = base_objects()
        .with(Service::new("ns1", "hp", "172.30.0.70").port("", Proto::Tcp, 80))
        .with(
            Slice::new("ns1", "hp-a", "hp")
                .port("", Proto::Tcp, 80)
                .endpoint(ep("10.180.0.1").node(NODE_NAME)),
        )
        .with(
            Service::new("ns1", "hp-udp", "172.30.0.71")
                .port("dns", Proto::Udp, 53)
                .client_ip_affinity(10800),
        )
        .with(
            Slice::new("ns1", "hp-udp-a", "hp-udp")
                .port("dns", Proto::Udp, 53)
                .endpoint(ep("10.180.0.2").node(NODE_NAME)),
        )
        // The same endpoint behind a second Service: deleting one keeps the other's hairpin.
        .with(Service::new("ns1", "hp2", "172.30.0.72").port("", Proto::Tcp, 80))
        .with(
            Slice::new("ns1", "hp2-a", "hp2")
                .port("", Proto::Tcp, 80)
                .endpoint(ep("10.180.0.1").node(NODE_NAME)),
        );
    w.apply("hairpin", &objects, &base_config());
    #[rustfmt::skip]
    w.check(&[
        tcp("endpoint to its own Service",        "10.180.0.1", "172.30.0.70:80", "10.180.0.1:80", true),
        tcp("endpoint to the second Service",     "10.180.0.1", "172.30.0.72:80", "10.180.0.1:80", true),
        flow("endpoint to its own UDP Service with affinity", Proto::Udp, "10.180.0.2", "172.30.0.71:53", "10.180.0.2:53", true),
        tcp("pod to the Service",                 POD,          "172.30.0.70:80", "10.180.0.1:80", false),
    ]);
    let objects = base_objects()
        .with(Service::new("ns1", "hp2", "172.30.0.72").port("", Proto::Tcp, 80))
        .with(
            Slice::new("ns1", "hp2-a", "hp2")
                .port("", Proto::Tcp, 80)
                .endpoint(ep("10.180.0.1").node(NODE_NAME)),
        );
    w.apply("hairpin, first Service deleted", &objects, &base_config());
    #[rustfmt::skip]
    w.check(&[
        tcp("endpoint to the second Service", "10.180.0.1", "172.30.0.72:80", "10.180.0.1:80", true),
    ]);
    w.finish();
}

in_both_modes!(
    hairpin,
    no_endpoints_reject,
    load_balancer,
    node_ports_ipv4,
    node_ports_ipv6,
    external_traffic_policy_local,
    external_traffic_policy_cluster,
    internal_traffic_policy,
    terminating_endpoints_external_policy_local,
    terminating_endpoints_external_policy_cluster,
    session_affinity,
    mixed_protocol_load_balancer,
    multiple_ports_and_named_target_port,
    services_of_another_proxy_are_not_programmed,
    internal_external_masquerade,
    masquerade_and_detect_local_modes,
);
