//! UDP conntrack cleanup end to end (reference §2.5): a client keeps talking to a UDP Service
//! from one fixed source port, so conntrack keeps its flow on one endpoint; when that endpoint
//! goes away (removed, scaled to zero, Service deleted), the next `nftproxy run --once` deletes
//! the entry and the next datagram is load-balanced afresh — to a remaining endpoint, rejected
//! when none is left, dropped once the ClusterIP is unallocated. Entries to endpoints that still
//! serve, and TCP entries, survive.
//!
//! Without the cleanup every one of these probes would still be answered by the old endpoint:
//! the echo servers keep running, only the Service's endpoint list changes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nftproxy_tests::{Lab, Ns, Probe, Proto, Verdict, ip, sa, target_binary};

/// Endpoint pods: (IPv4, IPv6).
const EPS: [(&str, &str); 3] = [
    ("10.180.0.1", "fd00:10:180::1"),
    ("10.180.2.1", "fd00:10:180::2:1"),
    ("10.180.3.1", "fd00:10:180::3:1"),
];
const CLUSTER_IP: &str = "172.30.0.53";
const CLUSTER_IP6: &str = "fd00:172:30::53";
const NODE_IP: &str = "192.168.0.2";
/// The fixed client ports of the pinned flows.
const UDP_SPORT: u16 = 40053;
const UDP6_SPORT: u16 = 40054;
const NODEPORT_SPORT: u16 = 40055;
const TCP_SPORT: u16 = 40080;

const CONFIG: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clusterCIDR: 10.0.0.0/8,fd00:10::/32
hostnameOverride: test-node
";

/// The cluster: Service ns1/dns (dual-stack, NodePort: UDP 53 → 30053, TCP 80 → 30080) backed
/// by the endpoint pods `eps` (indexes into [`EPS`]); without the Service if `eps` is `None`.
fn cluster_yaml(eps: Option<&[usize]>) -> String {
    let mut y = String::from(
        r#"apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Node
  metadata: {name: test-node}
  status:
    addresses:
    - {type: InternalIP, address: 192.168.0.2}
    - {type: InternalIP, address: "2001:db8::1"}
- apiVersion: networking.k8s.io/v1
  kind: ServiceCIDR
  metadata: {name: kubernetes}
  spec: {cidrs: [172.30.0.0/16, "fd00:172:30::/112"]}
"#,
    );
    let Some(eps) = eps else { return y };
    y.push_str(&format!(
        r#"- apiVersion: v1
  kind: Service
  metadata: {{name: dns, namespace: ns1}}
  spec:
    type: NodePort
    clusterIP: {CLUSTER_IP}
    clusterIPs: [{CLUSTER_IP}, "{CLUSTER_IP6}"]
    ipFamilies: [IPv4, IPv6]
    ports:
    - {{name: dns, port: 53, protocol: UDP, nodePort: 30053}}
    - {{name: web, port: 80, protocol: TCP, nodePort: 30080}}
"#
    ));
    for (family, pick) in [("IPv4", 0), ("IPv6", 1)] {
        let addrs: Vec<String> = eps
            .iter()
            .map(|&i| {
                let a = if pick == 0 { EPS[i].0 } else { EPS[i].1 };
                format!("  - {{addresses: [\"{a}\"], nodeName: node2}}\n")
            })
            .collect();
        y.push_str(&format!(
            r#"- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {{name: dns-{family}, namespace: ns1, labels: {{kubernetes.io/service-name: dns}}}}
  addressType: {family}
  ports:
  - {{name: dns, port: 53, protocol: UDP}}
  - {{name: web, port: 80, protocol: TCP}}
  endpoints:{}
{}"#,
            if addrs.is_empty() { " []" } else { "" },
            addrs.concat()
        ));
    }
    y
}

struct Topology {
    lab: Lab,
    node: Ns,
    client: Ns,
    external: Ns,
    dir: tempfile::TempDir,
}

fn topology() -> Topology {
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let external = lab
        .external(
            &node,
            "ext",
            &[ip("203.0.113.2"), ip("2600:5200::1")],
            &[ip(NODE_IP), ip("2001:db8::1")],
        )
        .unwrap();
    // A real node has a default route: packets no rule translates are routed, not refused.
    let up = external.node_link().unwrap().to_string();
    node.add_route(&format!("default dev {up}")).unwrap();
    node.ip(&["-6", "route", "add", "default", "dev", &up])
        .unwrap();
    let client = lab
        .pod(&node, "client", &[ip("10.180.9.2"), ip("fd00:10:180::9:2")])
        .unwrap();
    for (i, (v4, v6)) in EPS.iter().enumerate() {
        let ep = lab
            .pod(&node, &format!("ep{}", i + 1), &[ip(v4), ip(v6)])
            .unwrap();
        lab.echo(&ep, &[53, 80]).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.yaml"), CONFIG).unwrap();
    Topology {
        lab,
        node,
        client,
        external,
        dir,
    }
}

/// One `nftproxy run --once` with the cluster of `eps`; its log.
fn sync(t: &Topology, eps: Option<&[usize]>) -> String {
    let file: PathBuf = t.dir.path().join("cluster.yaml");
    std::fs::write(&file, cluster_yaml(eps)).unwrap();
    let bin =
        target_binary("nftproxy").expect("build nftproxy first (cargo build --workspace --bins)");
    let config = t.dir.path().join("config.yaml");
    let out = t
        .node
        .command(bin)
        .args(["run", "--once", "--from-file"])
        .arg(&file)
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "info")
        .output()
        .expect("run nftproxy");
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "nftproxy run --once failed: {log}");
    log
}

/// `deleted=` of the IPv4 and IPv6 cleanups logged by one run.
/// The entries each family's cleanup deleted, IPv4 first.
fn deleted(log: &str) -> Vec<usize> {
    nftproxy_tests::per_family_field(log, "UDP conntrack cleanup", "deleted")
}

/// `count` datagrams from `from`, all from source port `sport`.
fn pinned(t: &Topology, from: &Ns, dst: &str, sport: u16, count: usize) -> Verdict {
    let probe = Probe::new(Proto::Udp, sa(dst), count)
        .sport(sport)
        .timeout(Duration::from_millis(400));
    t.lab.run_probe(from, &probe).unwrap().verdict()
}

/// The single endpoint (address) that answered, or a failure naming the verdict.
fn one_endpoint(v: &Verdict) -> SocketAddr {
    match v {
        Verdict::Endpoints { set, .. } if set.len() == 1 => *set.iter().next().unwrap(),
        other => panic!("expected one endpoint, got {other:?}"),
    }
}

fn ep_index(addr: &SocketAddr) -> usize {
    EPS.iter()
        .position(|(v4, v6)| addr.ip() == ip(v4) || addr.ip() == ip(v6))
        .unwrap_or_else(|| panic!("{addr} is no endpoint"))
}

/// The node's conntrack entries (`conntrack -L` lines) from source port `sport`.
fn entries(t: &Topology, proto: &str, sport: u16) -> Vec<String> {
    let mut out = Vec::new();
    for family in ["ipv4", "ipv6"] {
        let text = t
            .node
            .exec(&[
                "conntrack",
                "-L",
                "-f",
                family,
                "-p",
                proto,
                "--sport",
                &sport.to_string(),
            ])
            .unwrap();
        out.extend(text.lines().map(str::to_string));
    }
    out
}

#[test]
fn udp_flows_follow_endpoint_changes() {
    nftproxy_tests::require_root!();
    let t = topology();
    let c = &t.client;
    let cip = format!("{CLUSTER_IP}:53");
    let cip6 = format!("[{CLUSTER_IP6}]:53");
    let nodeport = format!("{NODE_IP}:30053");

    // 1. Two endpoints: each pinned flow stays on one of them.
    sync(&t, Some(&[0, 1]));
    let x = one_endpoint(&pinned(&t, c, &cip, UDP_SPORT, 5));
    let x6 = one_endpoint(&pinned(&t, c, &cip6, UDP6_SPORT, 5));
    let xn = one_endpoint(&pinned(&t, &t.external, &nodeport, NODEPORT_SPORT, 5));
    let tcp = Probe::new(Proto::Tcp, sa(&format!("{CLUSTER_IP}:80")), 1).sport(TCP_SPORT);
    let tcp_ep = one_endpoint(&t.lab.run_probe(c, &tcp).unwrap().verdict());
    assert_eq!(entries(&t, "tcp", TCP_SPORT).len(), 1);

    // 2. A third endpoint appears: nothing stale, nothing moves.
    let log = sync(&t, Some(&[0, 1, 2]));
    assert_eq!(deleted(&log), vec![0, 0], "{log}");
    assert_eq!(one_endpoint(&pinned(&t, c, &cip, UDP_SPORT, 3)), x);
    assert_eq!(one_endpoint(&pinned(&t, c, &cip6, UDP6_SPORT, 3)), x6);

    // 3. The IPv4 flow's endpoint goes: within this one sync, the next datagrams of that
    //    flow (ClusterIP and NodePort alike) reach a remaining endpoint.
    let gone = ep_index(&x);
    let left: Vec<usize> = (0..3).filter(|&i| i != gone).collect();
    let started = Instant::now();
    let log = sync(&t, Some(&left));
    let synced_in = started.elapsed();
    let d = deleted(&log);
    let moved_v6 = usize::from(ep_index(&x6) == gone);
    let moved_np = usize::from(ep_index(&xn) == gone);
    assert_eq!(d, vec![1 + moved_np, moved_v6], "{log}");
    let y = one_endpoint(&pinned(&t, c, &cip, UDP_SPORT, 5));
    assert_ne!(ep_index(&y), gone);
    assert_eq!(y.port(), 53);
    let y6 = one_endpoint(&pinned(&t, c, &cip6, UDP6_SPORT, 5));
    assert_ne!(ep_index(&y6), gone);
    if moved_v6 == 0 {
        assert_eq!(y6, x6, "an entry to a serving endpoint was deleted");
    }
    let yn = one_endpoint(&pinned(&t, &t.external, &nodeport, NODEPORT_SPORT, 5));
    assert_ne!(ep_index(&yn), gone);
    // The kernel's view: the flow's entry now replies from the new endpoint.
    let e = entries(&t, "udp", UDP_SPORT);
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].contains(&format!("src={}", y.ip())), "{e:?}");

    // 4. Scale to zero: the entries go, the next datagrams are rejected (not blackholed into
    //    a dead endpoint), and the TCP entry made in step 1 survives although its endpoint is
    //    gone too.
    let log = sync(&t, Some(&[]));
    assert_eq!(deleted(&log), vec![2, 1], "{log}");
    assert_eq!(pinned(&t, c, &cip, UDP_SPORT, 3), Verdict::Reject);
    assert_eq!(pinned(&t, c, &cip6, UDP6_SPORT, 3), Verdict::Reject);
    assert_eq!(
        pinned(&t, &t.external, &nodeport, NODEPORT_SPORT, 3),
        Verdict::Reject
    );
    let tcp_entries = entries(&t, "tcp", TCP_SPORT);
    assert_eq!(tcp_entries.len(), 1, "the TCP entry was deleted");
    assert!(
        tcp_entries[0].contains(&format!("src={}", tcp_ep.ip())),
        "{tcp_entries:?}"
    );

    // 5. Back up with a new endpoint: the same flows reach it.
    sync(&t, Some(&[2]));
    assert_eq!(
        ep_index(&one_endpoint(&pinned(&t, c, &cip, UDP_SPORT, 3))),
        2
    );
    assert_eq!(
        ep_index(&one_endpoint(&pinned(&t, c, &cip6, UDP6_SPORT, 3))),
        2
    );
    assert_eq!(
        ep_index(&one_endpoint(&pinned(
            &t,
            &t.external,
            &nodeport,
            NODEPORT_SPORT,
            3
        ))),
        2
    );

    // 6. The Service is deleted: its flows are cleaned too (the new process learns the old
    //    frontends from the table it replaces). The ClusterIP is now unallocated: dropped.
    let log = sync(&t, None);
    assert_eq!(deleted(&log), vec![2, 1], "{log}");
    assert_eq!(pinned(&t, c, &cip, UDP_SPORT, 2), Verdict::Drop);
    assert_eq!(pinned(&t, c, &cip6, UDP6_SPORT, 2), Verdict::Drop);
    assert!(entries(&t, "tcp", TCP_SPORT).len() == 1, "TCP entry kept");

    eprintln!("endpoint removal: sync with cleanup in {synced_in:?}");
}

#[test]
fn second_run_without_changes_cleans_nothing() {
    nftproxy_tests::require_root!();
    let t = topology();
    sync(&t, Some(&[0, 1]));
    let x = one_endpoint(&pinned(
        &t,
        &t.client,
        &format!("{CLUSTER_IP}:53"),
        UDP_SPORT,
        3,
    ));
    // A restarted agent cannot know the old endpoints, so it looks, but deletes nothing.
    let log = sync(&t, Some(&[0, 1]));
    assert_eq!(deleted(&log), vec![0, 0], "{log}");
    assert_eq!(
        one_endpoint(&pinned(
            &t,
            &t.client,
            &format!("{CLUSTER_IP}:53"),
            UDP_SPORT,
            3
        )),
        x
    );
}
