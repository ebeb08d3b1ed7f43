//! Conflicting frontends (CVE-2020-8554 and double allocations) through the real `nftproxy`
//! binary and the real kernel: a tenant's external IP or load-balancer IP equal to kube-dns's
//! ClusterIP never receives DNS traffic, whatever the endpoint counts (shorter endpoint lists
//! are tried first; a Service with more than 16 endpoints has a chain of its own), and of two
//! Services holding one ClusterIP the older gets the traffic, whatever the names, the order
//! of the input file and the endpoint counts; the same for two Services holding one NodePort
//! (a restored or broken allocator). In nftables mode and in iptables mode. Then the
//! daemon: `nftproxy_frontend_conflicts`, the log lines naming both Services, and the end of a
//! conflict applied by a partial sync.
//!
//! ```text
//!   ext (203.0.113.2) ── upN ── node "test-node"  ── vpN ── client pod (10.0.0.2)
//!                               192.168.0.2,       ── vpN ── "dns" pod: kube-dns's endpoints 10.1.0.1-20
//!                               192.168.1.2 (alt)  ── vpN ── "evil" pod: the tenant's 10.2.0.1-20
//! ```
//!
//! Every endpoint address answers on port 53 (UDP and TCP) and reports the address it was
//! reached at, so the answers say which Service's endpoints got the traffic.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nftproxy_tests::cluster::Endpoint;
use nftproxy_tests::cluster::{Objects, ProxyConfig, Service, Slice, node as node_object};
use nftproxy_tests::{Lab, Ns, Probe, Proc, Proto, ip, sa, target_binary};
use serde_json::{Value, json};

const NODE: &str = "test-node";
const POD: &str = "10.0.0.2";
/// A node address that is not the primary: node-originated probes use it as their source.
const NODE_ALT: &str = "192.168.1.2";
const DNS_IP: &str = "172.30.0.10";
const EVIL_IP: &str = "172.30.0.99";
const OLD: &str = "2020-01-01T00:00:00Z";
const NEW: &str = "2024-06-01T12:00:00Z";
/// More than the shared endpoint lists take: a chain of its own.
const MANY: usize = 20;

struct World {
    lab: Lab,
    node: Ns,
    /// Outside the cluster (203.0.113.2), reaching the node at 192.168.0.2.
    ext: Ns,
    pod: Ns,
    dir: tempfile::TempDir,
}

fn world() -> World {
    assert!(
        nftproxy_tests::privilege::is_root(),
        "namespace tests need root"
    );
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let ext = lab
        .external(&node, "ext", &[ip("203.0.113.2")], &[ip("192.168.0.2")])
        .unwrap();
    let up = ext.node_link().unwrap().to_string();
    node.ip_batch(&[
        format!("route add default dev {up}"),
        format!("addr add {NODE_ALT}/32 dev {up}"),
        // The node's address towards the pods (masquerade picks it).
        "addr add 10.0.0.1/32 dev lo".to_string(),
    ])
    .unwrap();
    let pod = lab.pod(&node, "client", &[ip(POD)]).unwrap();
    for (label, prefix) in [("dns", "10.1.0"), ("evil", "10.2.0")] {
        let ips: Vec<IpAddr> = (1..=MANY).map(|i| ip(&format!("{prefix}.{i}"))).collect();
        let ns = lab.pod(&node, label, &ips).unwrap();
        lab.echo(&ns, &[53]).unwrap();
    }
    World {
        lab,
        node,
        ext,
        pod,
        dir: tempfile::tempdir().unwrap(),
    }
}

fn nftproxy_bin() -> PathBuf {
    target_binary("nftproxy").expect("build nftproxy first (cargo build --workspace --bins)")
}

/// A Service with DNS ports (53 UDP `dns`, 53 TCP `dns-tcp`) created at `created`.
fn dns_service(
    ns: &str,
    name: &str,
    cluster_ip: &str,
    created: &str,
    more: impl FnOnce(Service) -> Service,
) -> Value {
    let svc = Service::new(ns, name, cluster_ip)
        .port("dns", Proto::Udp, 53)
        .port("dns-tcp", Proto::Tcp, 53);
    let mut v: Value = more(svc).into();
    v["metadata"]["creationTimestamp"] = json!(created);
    v
}

/// The EndpointSlice of `ns/name` with `n` endpoints `PREFIX.1` … `PREFIX.n`.
fn dns_slice(ns: &str, name: &str, prefix: &str, n: usize) -> Slice {
    Slice::new(ns, &format!("{name}-x"), name)
        .port("dns", Proto::Udp, 53)
        .port("dns-tcp", Proto::Tcp, 53)
        .endpoints((1..=n).map(|i| Endpoint::new(&format!("{prefix}.{i}")).node(NODE)))
}

fn objects(items: Vec<Value>) -> Objects {
    let mut o = Objects::new().with(node_object(NODE, &["192.168.0.2"], &["10.0.0.0/24"]));
    for item in items {
        o.push(item);
    }
    o
}

fn addrs(prefix: &str, n: usize) -> BTreeSet<IpAddr> {
    (1..=n).map(|i| ip(&format!("{prefix}.{i}"))).collect()
}

impl World {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn write_config(&self) -> PathBuf {
        let config = ProxyConfig::new(NODE).cluster_cidr("10.0.0.0/8").to_yaml();
        let path = self.path("config.yaml");
        std::fs::write(&path, config).unwrap();
        path
    }

    /// `nftproxy run --once` of `objects` in `mode` (nftables or iptables).
    fn run_once(&self, mode: &str, objects: &Objects) {
        std::fs::write(self.path("cluster.yaml"), objects.to_yaml()).unwrap();
        let config = self.write_config();
        let out = self
            .node
            .command(nftproxy_bin())
            .args(["run", "--once", "--proxy-mode", mode, "--from-file"])
            .arg(self.path("cluster.yaml"))
            .arg("--config")
            .arg(config)
            .env("RUST_LOG", "info")
            .output()
            .expect("run nftproxy");
        assert!(
            out.status.success(),
            "nftproxy run --once failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Probes `dst` from `from` (with source `src`): every attempt must be answered, and only
    /// by endpoints among `allowed`.
    fn only(
        &self,
        from: &Ns,
        src: Option<&str>,
        proto: Proto,
        dst: &str,
        allowed: &BTreeSet<IpAddr>,
    ) {
        let mut probe = Probe::new(proto, sa(dst), 24).timeout(Duration::from_millis(2000));
        if let Some(src) = src {
            probe = probe.src(ip(src));
        }
        let r = self.lab.run_probe(from, &probe).unwrap();
        let got: BTreeSet<IpAddr> = r.endpoints().iter().map(SocketAddr::ip).collect();
        assert!(
            r.answered_total() == r.total() && got.is_subset(allowed) && !got.is_empty(),
            "{proto} {dst} from {}: {r}; allowed: {allowed:?}",
            from.label()
        );
    }

    /// DNS to `dst` over UDP and TCP, from the client pod and from the node itself, reaches
    /// only `allowed`.
    fn dns_only(&self, dst: &str, allowed: &BTreeSet<IpAddr>) {
        for proto in [Proto::Udp, Proto::Tcp] {
            self.only(&self.pod, None, proto, dst, allowed);
            self.only(&self.node, Some(NODE_ALT), proto, dst, allowed);
        }
    }
}

/// kube-dns (created last: a ClusterIP keeps its traffic whatever its age) and a tenant whose
/// `frontend` (an external IP or a load-balancer IP) is kube-dns's ClusterIP.
fn hijack(dns_eps: usize, evil_eps: usize, load_balancer: bool) -> Objects {
    objects(vec![
        dns_service("kube-system", "kube-dns", DNS_IP, NEW, |s| s),
        dns_slice("kube-system", "kube-dns", "10.1.0", dns_eps).into(),
        dns_service("a-tenant", "evil", EVIL_IP, OLD, |s| {
            if load_balancer {
                s.load_balancer(&[DNS_IP])
            } else {
                s.external_ips(&[DNS_IP])
            }
        }),
        dns_slice("a-tenant", "evil", "10.2.0", evil_eps).into(),
    ])
}

/// Endpoint counts: the attacker with fewer endpoints than kube-dns (its list would be tried
/// first), with more, and kube-dns with more than 16 (a chain of its own, which the attacker's
/// shared lists would have beaten).
const CASES: [(usize, usize); 4] = [(2, 1), (2, 3), (MANY, 1), (2, MANY)];

fn hijack_suite(mode: &str, load_balancer: bool) {
    let w = world();
    for (dns_eps, evil_eps) in CASES {
        w.run_once(mode, &hijack(dns_eps, evil_eps, load_balancer));
        w.dns_only(&format!("{DNS_IP}:53"), &addrs("10.1.0", dns_eps));
        // The attacker's own ClusterIP still works.
        w.only(
            &w.pod,
            None,
            Proto::Udp,
            &format!("{EVIL_IP}:53"),
            &addrs("10.2.0", evil_eps),
        );
    }
}

#[test]
fn an_external_ip_equal_to_kube_dns_cluster_ip_gets_no_dns_traffic() {
    nftproxy_tests::require_root!();
    hijack_suite("nftables", false);
}

#[test]
fn an_external_ip_equal_to_kube_dns_cluster_ip_gets_no_dns_traffic_iptables() {
    nftproxy_tests::require_root!();
    hijack_suite("iptables", false);
}

#[test]
fn a_load_balancer_ip_equal_to_kube_dns_cluster_ip_gets_no_dns_traffic() {
    nftproxy_tests::require_root!();
    hijack_suite("nftables", true);
}

#[test]
fn a_load_balancer_ip_equal_to_kube_dns_cluster_ip_gets_no_dns_traffic_iptables() {
    nftproxy_tests::require_root!();
    hijack_suite("iptables", true);
}

#[test]
fn trace_names_the_conflict_and_the_service_that_gets_the_traffic() {
    nftproxy_tests::require_root!();
    let w = world();
    std::fs::write(w.path("cluster.yaml"), hijack(2, 1, false).to_yaml()).unwrap();
    let config = w.write_config();
    let out = std::process::Command::new(nftproxy_bin())
        .args(["trace", "--from-file"])
        .arg(w.path("cluster.yaml"))
        .arg("--config")
        .arg(config)
        .args([
            "--src",
            POD,
            "--dst",
            &format!("{DNS_IP}:53"),
            "--proto",
            "udp",
        ])
        .output()
        .expect("run nftproxy trace");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "service:  kube-system/kube-dns:dns\n",
        "conflict: external-ip 172.30.0.10:53/udp: kube-system/kube-dns keeps it (its ClusterIP); not programmed as external IP of a-tenant/evil: a ClusterIP keeps its own traffic\n",
        "10.1.0.1:53",
        "10.1.0.2:53",
    ] {
        assert!(text.contains(want), "{want:?} not in:\n{text}");
    }
    assert!(!text.contains("10.2.0.1"), "{text}");
}

/// Two Services, older and newer: their names, the older's endpoint count (10.1.0.x), the
/// newer's (10.2.0.x), and whether the file lists them in reverse.
type Pair<'a> = ((&'a str, &'a str), (&'a str, &'a str), usize, usize, bool);

/// Two Services with ClusterIP 172.30.0.20 (see [`Pair`]).
fn twins(case: Pair<'_>) -> Objects {
    pair(case, |(ns, name), created| {
        dns_service(ns, name, "172.30.0.20", created, |s| s)
    })
}

/// The older Service of `case` (created at [`OLD`]) and the newer (at [`NEW`]), made by
/// `service(name, created)`, with their endpoints.
fn pair(case: Pair<'_>, service: impl Fn((&str, &str), &str) -> Value) -> Objects {
    let (older, newer, older_eps, newer_eps, reversed) = case;
    let mut items = vec![
        service(older, OLD),
        dns_slice(older.0, older.1, "10.1.0", older_eps).into(),
        service(newer, NEW),
        dns_slice(newer.0, newer.1, "10.2.0", newer_eps).into(),
    ];
    if reversed {
        items.reverse();
    }
    objects(items)
}

fn twins_suite(mode: &str) {
    let w = world();
    let cases = [
        // (older, newer, older's endpoints, newer's endpoints, file order reversed)
        (("ns", "a"), ("ns", "b"), 1, 2, false),
        (("ns", "b"), ("ns", "a"), 1, 2, true),
        (("zz", "x"), ("aa", "y"), 2, 1, false),
        (("zz", "x"), ("aa", "y"), MANY, 1, true),
        (("ns", "b"), ("ns", "a"), 1, MANY, false),
    ];
    for case in cases {
        w.run_once(mode, &twins(case));
        w.dns_only("172.30.0.20:53", &addrs("10.1.0", case.2));
    }
}

#[test]
fn of_two_services_with_one_cluster_ip_the_older_gets_the_traffic() {
    nftproxy_tests::require_root!();
    twins_suite("nftables");
}

#[test]
fn of_two_services_with_one_cluster_ip_the_older_gets_the_traffic_iptables() {
    nftproxy_tests::require_root!();
    twins_suite("iptables");
}

/// Two NodePort Services, both with NodePorts 30053 (UDP `dns`) and 30054 (TCP `dns-tcp`),
/// each with a ClusterIP of its own (172.30.0.21 the older's, .22 the newer's; see [`Pair`]).
fn node_port_twins(case: Pair<'_>) -> Objects {
    pair(case, |(ns, name), created| {
        let cluster_ip = if created == OLD {
            "172.30.0.21"
        } else {
            "172.30.0.22"
        };
        let svc = Service::new(ns, name, cluster_ip)
            .node_port_type()
            .port("dns", Proto::Udp, 53)
            .node_port(30053)
            .port("dns-tcp", Proto::Tcp, 53)
            .node_port(30054);
        let mut v: Value = svc.into();
        v["metadata"]["creationTimestamp"] = json!(created);
        v
    })
}

fn node_port_twins_suite(mode: &str) {
    let w = world();
    let cases = [
        // (older, newer, older's endpoints, newer's endpoints, file order reversed): the
        // newer last by name (a full build's last write) and first (iptables' first rule),
        // with as many endpoints (one shared list) and with a chain of its own.
        (("ns", "a"), ("ns", "b"), 2, 2, false),
        (("ns", "b"), ("ns", "a"), 2, 2, true),
        (("zz", "x"), ("aa", "y"), 2, 1, false),
        (("ns", "b"), ("ns", "a"), 1, MANY, false),
    ];
    for case in cases {
        let (_, _, older_eps, newer_eps, _) = case;
        w.run_once(mode, &node_port_twins(case));
        let older_addrs = addrs("10.1.0", older_eps);
        for (proto, dst) in [
            (Proto::Udp, "192.168.0.2:30053"),
            (Proto::Tcp, "192.168.0.2:30054"),
        ] {
            w.only(&w.ext, None, proto, dst, &older_addrs);
        }
        // The newer keeps its ClusterIP.
        w.only(
            &w.pod,
            None,
            Proto::Udp,
            "172.30.0.22:53",
            &addrs("10.2.0", newer_eps),
        );
    }
}

#[test]
fn of_two_services_with_one_node_port_the_older_gets_the_traffic() {
    nftproxy_tests::require_root!();
    node_port_twins_suite("nftables");
}

#[test]
fn of_two_services_with_one_node_port_the_older_gets_the_traffic_iptables() {
    nftproxy_tests::require_root!();
    node_port_twins_suite("iptables");
}

// ------------------------------------------------------------------------------------------
// The daemon: the gauge, the log, and partial syncs.

/// Runs `f` on a thread that has joined the network namespace `ns`.
fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    nftproxy_tests::apiserver::in_netns(ns, f).expect("enter the namespace")
}

/// `/metrics` of the agent in the node's namespace.
fn scrape(node: &Ns) -> Result<String, String> {
    in_netns(node.name(), || {
        let addr: SocketAddr = "127.0.0.1:10249".parse().unwrap();
        let mut s =
            TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )
        .map_err(|e| e.to_string())?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).map_err(|e| e.to_string())?;
        Ok(String::from_utf8_lossy(&raw).into_owned())
    })
}

/// The value of the sample `series` (`name{labels}`) in an exposition.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

struct Daemon {
    proc: Proc,
}

impl Daemon {
    fn start(w: &World, objects: &Objects) -> Daemon {
        std::fs::write(w.path("cluster.yaml"), objects.to_yaml()).unwrap();
        // The configuration is JSON (which is YAML): add the daemon's settings to it.
        let base = ProxyConfig::new(NODE).cluster_cidr("10.0.0.0/8").to_yaml();
        let mut v: Value = serde_json::from_str(&base).unwrap();
        v["metricsBindAddress"] = json!("127.0.0.1:10249");
        v["nftables"] = json!({"syncPeriod": "1s", "minSyncPeriod": "100ms"});
        std::fs::write(w.path("daemon.yaml"), v.to_string()).unwrap();
        let mut cmd = w.node.command(nftproxy_bin());
        cmd.args(["run", "--from-file"])
            .arg(w.path("cluster.yaml"))
            .arg("--config")
            .arg(w.path("daemon.yaml"))
            // The desired table says at debug level when it had to rebuild everything.
            .env("RUST_LOG", "info,nftproxy_dataplane=debug");
        let proc = w
            .node
            .spawn_command(cmd, "nftproxy")
            .expect("start nftproxy");
        let d = Daemon { proc };
        d.wait_log(0, "nftables sync committed");
        d
    }

    fn lines(&self) -> Vec<String> {
        self.proc.stderr()
    }

    /// Waits for a log line containing `needle` after the first `from` lines; its index.
    fn wait_log(&self, from: usize, needle: &str) -> usize {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(i) = self
                .lines()
                .iter()
                .skip(from)
                .position(|l| l.contains(needle))
            {
                return from + i;
            }
            assert!(
                Instant::now() < deadline,
                "no log line with {needle:?} after line {from}:\n{}",
                self.lines().join("\n")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until `/metrics` shows `series` at `value`.
    fn wait_metric(&self, node: &Ns, series: &str, value: f64) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let got = scrape(node).ok().and_then(|t| sample(&t, series));
            if got == Some(value) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{series} is {got:?}, not {value}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Every sync between log lines `from` and `to` was partial, and the desired table was
    /// never rebuilt whole.
    fn only_partial_syncs(&self, from: usize, to: usize) {
        let lines = self.lines();
        let window = &lines[from..=to];
        let syncs: Vec<&String> = window
            .iter()
            .filter(|l| l.contains("nftables sync committed"))
            .collect();
        assert!(!syncs.is_empty(), "no sync:\n{}", window.join("\n"));
        for l in syncs {
            assert!(l.contains("full=false"), "a full sync: {l}");
        }
        assert!(
            !window
                .iter()
                .any(|l| l.contains("rebuilding the desired table")),
            "{}",
            window.join("\n")
        );
    }

    /// Replaces the followed file atomically.
    fn rewrite(&self, w: &World, objects: &Objects) -> usize {
        let from = self.lines().len();
        let tmp = w.path("cluster.yaml.new");
        std::fs::write(&tmp, objects.to_yaml()).unwrap();
        std::fs::rename(&tmp, w.path("cluster.yaml")).unwrap();
        from
    }
}

const EXTERNAL: &str = "nftproxy_frontend_conflicts{kind=\"external-ip\"}";
const CLUSTER: &str = "nftproxy_frontend_conflicts{kind=\"cluster-ip\"}";
const NODE_PORT: &str = "nftproxy_frontend_conflicts{kind=\"node-port\"}";

#[test]
fn the_daemon_counts_logs_and_ends_conflicts_with_partial_syncs() {
    nftproxy_tests::require_root!();
    let w = world();
    let kube_dns = || {
        vec![
            dns_service("kube-system", "kube-dns", DNS_IP, NEW, |s| s),
            dns_slice("kube-system", "kube-dns", "10.1.0", 2).into(),
        ]
    };
    let evil = |claims: bool| {
        vec![
            dns_service("a-tenant", "evil", EVIL_IP, OLD, |s| {
                if claims { s.external_ips(&[DNS_IP]) } else { s }
            }),
            dns_slice("a-tenant", "evil", "10.2.0", 1).into(),
        ]
    };
    let d = Daemon::start(&w, &objects(kube_dns()));
    d.wait_metric(&w.node, EXTERNAL, 0.0);
    w.dns_only(&format!("{DNS_IP}:53"), &addrs("10.1.0", 2));

    // The tenant claims kube-dns's ClusterIP (UDP and TCP port 53: two frontends).
    let from = d.rewrite(&w, &objects([kube_dns(), evil(true)].concat()));
    let warned = d.wait_log(from, "frontend conflict: external-ip 172.30.0.10:53/udp");
    let line = &d.lines()[warned];
    for want in [
        "WARN",
        "a-tenant/evil",
        "kube-system/kube-dns",
        "a ClusterIP keeps its own traffic",
    ] {
        assert!(line.contains(want), "{want:?} not in {line}");
    }
    d.wait_metric(&w.node, EXTERNAL, 2.0);
    d.only_partial_syncs(from, warned);
    w.dns_only(&format!("{DNS_IP}:53"), &addrs("10.1.0", 2));
    w.only(
        &w.pod,
        None,
        Proto::Udp,
        &format!("{EVIL_IP}:53"),
        &addrs("10.2.0", 1),
    );
    // Logged once, not at every sync.
    let from2 = d.rewrite(
        &w,
        &objects(
            [
                kube_dns(),
                evil(true),
                vec![dns_service("other", "web", "172.30.0.50", NEW, |s| s)],
            ]
            .concat(),
        ),
    );
    d.wait_log(from2, "nftables sync committed");
    let again = d
        .lines()
        .iter()
        .filter(|l| l.contains("frontend conflict: external-ip 172.30.0.10:53/udp"))
        .count();
    assert_eq!(again, 1);

    // The tenant drops the claim: the end is logged, the gauge goes to 0, by partial syncs.
    let from = d.rewrite(&w, &objects([kube_dns(), evil(false)].concat()));
    let ended = d.wait_log(
        from,
        "frontend conflict ended: external-ip 172.30.0.10:53/udp",
    );
    let line = &d.lines()[ended];
    for want in ["INFO", "a-tenant/evil", "kube-system/kube-dns"] {
        assert!(line.contains(want), "{want:?} not in {line}");
    }
    d.wait_metric(&w.node, EXTERNAL, 0.0);
    d.only_partial_syncs(from, ended);
    w.dns_only(&format!("{DNS_IP}:53"), &addrs("10.1.0", 2));

    // Two Services with one ClusterIP: the older gets it; when it goes, a partial sync hands
    // the ClusterIP to the other, which did not change itself.
    let twin = |name: &str, created: &str, prefix: &str| {
        vec![
            dns_service("ns", name, "172.30.0.20", created, |s| s),
            dns_slice("ns", name, prefix, 1).into(),
        ]
    };
    let from = d.rewrite(
        &w,
        &objects(
            [
                kube_dns(),
                twin("b-old", OLD, "10.1.0"),
                twin("a-new", NEW, "10.2.0"),
            ]
            .concat(),
        ),
    );
    let warned = d.wait_log(from, "frontend conflict: cluster-ip 172.30.0.20");
    assert!(d.lines()[warned].contains("ns/b-old") && d.lines()[warned].contains("ns/a-new"));
    d.wait_metric(&w.node, CLUSTER, 1.0);
    w.dns_only("172.30.0.20:53", &addrs("10.1.0", 1));
    let from = d.rewrite(
        &w,
        &objects([kube_dns(), twin("a-new", NEW, "10.2.0")].concat()),
    );
    let ended = d.wait_log(from, "frontend conflict ended: cluster-ip 172.30.0.20");
    d.wait_metric(&w.node, CLUSTER, 0.0);
    d.only_partial_syncs(from, ended);
    w.dns_only("172.30.0.20:53", &addrs("10.2.0", 1));

    // Two Services with one NodePort: the older gets it, by partial syncs, and a change of the
    // newer is a partial sync too (it rebuilt the whole table before the policy covered
    // NodePorts); when the older goes, the newer gets the NodePort.
    let both = |older: bool, newer_eps: usize| {
        let twins = node_port_twins((("ns", "b-old"), ("ns", "a-new"), 2, newer_eps, false));
        // Past the node object.
        let items = twins.items().iter().skip(1).cloned();
        let mut o = objects(kube_dns());
        for item in items.skip(if older { 0 } else { 2 }) {
            o.push(item);
        }
        o
    };
    let from = d.rewrite(&w, &both(true, 1));
    let warned = d.wait_log(from, "frontend conflict: node-port NodePort 30053/udp");
    let line = &d.lines()[warned];
    for want in ["WARN", "ns/b-old keeps it", "ns/a-new"] {
        assert!(line.contains(want), "{want:?} not in {line}");
    }
    d.wait_metric(&w.node, NODE_PORT, 2.0);
    d.only_partial_syncs(from, warned);
    w.only(
        &w.ext,
        None,
        Proto::Udp,
        "192.168.0.2:30053",
        &addrs("10.1.0", 2),
    );
    let from = d.rewrite(&w, &both(true, 3));
    let synced = d.wait_log(from, "nftables sync committed");
    d.only_partial_syncs(from, synced);
    w.only(
        &w.pod,
        None,
        Proto::Udp,
        "172.30.0.22:53",
        &addrs("10.2.0", 3),
    );
    w.only(
        &w.ext,
        None,
        Proto::Udp,
        "192.168.0.2:30053",
        &addrs("10.1.0", 2),
    );
    let from = d.rewrite(&w, &both(false, 3));
    let ended = d.wait_log(
        from,
        "frontend conflict ended: node-port NodePort 30053/udp",
    );
    d.wait_metric(&w.node, NODE_PORT, 0.0);
    d.only_partial_syncs(from, ended);
    w.only(
        &w.ext,
        None,
        Proto::Udp,
        "192.168.0.2:30053",
        &addrs("10.2.0", 3),
    );
}
