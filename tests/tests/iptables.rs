//! iptables mode (`nftproxy run --proxy-mode iptables`) through the real binary, in network
//! namespaces: a handful of flows (ClusterIP, NodePort on every local address and on
//! 127.0.0.1, the no-endpoint reject, eTP=Local), the legacy variant chosen by kubelet's hint,
//! partial restores among 5,000 Services, the canary, switching modes both ways, and
//! `nftproxy cleanup --kube-proxy`. The whole kube-proxy flow suite runs in both modes in
//! `semantics.rs`.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Output;
use std::time::{Duration, Instant};

use nftproxy_tests::cluster::{Endpoint, Objects, Service, Slice, node as node_object};
use nftproxy_tests::{Lab, Ns, Probe, Proto, Verdict, ip, sa, target_binary};

const NODE: &str = "test-node";
const CONFIG: &str = "\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
hostnameOverride: test-node
clusterCIDR: 10.0.0.0/8,fd00:10::/64
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: \"\"
iptables: {syncPeriod: 1s, minSyncPeriod: 100ms}
";

#[path = "iptables/world.rs"]
mod world;

use self::world::*;

#[test]
fn flows_through_iptables_nft() {
    nftproxy_tests::require_root!();
    let w = world();
    let log = w.run_once("iptables", &cluster());
    assert!(log.contains("using iptables-nft"), "{log}");
    assert!(
        log.contains("set net.ipv4.conf.all.route_localnet=1"),
        "{log}"
    );
    assert_eq!(
        w.node
            .sysctl_get("net.ipv4.conf.all.route_localnet")
            .unwrap()
            .trim(),
        "1"
    );
    let errors = check_flows(&w);
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    // Everything is in iptables-nft; nothing in legacy, no nftables table of ours.
    let nft = w.saved("nft");
    assert!(nft.contains(":NFTPROXY-SERVICES - "), "{nft}");
    assert!(
        nft.contains("health check node port\" -m tcp --dport 30000 -j ACCEPT"),
        "{nft}"
    );
    assert!(
        nft.contains("-A NFTPROXY-FORWARD -m conntrack --ctstate INVALID -j DROP"),
        "{nft}"
    );
    assert!(ours(&w.saved("legacy")).is_empty());
    assert!(!w.nft_tables().contains("nftproxy"));
}

#[test]
fn legacy_variant_follows_kubelets_hint() {
    nftproxy_tests::require_root!();
    let w = world();
    // kubelet marks the variant it uses with an empty chain in mangle.
    w.node
        .exec(&[
            "iptables-legacy",
            "-t",
            "mangle",
            "-N",
            "KUBE-IPTABLES-HINT",
        ])
        .unwrap();
    let log = w.run_once("iptables", &cluster());
    assert!(
        log.contains("using iptables-legacy") && log.contains("KUBE-IPTABLES-HINT"),
        "{log}"
    );
    assert!(ours(&w.saved("nft")).is_empty(), "{}", w.saved("nft"));
    assert!(w.saved("legacy").contains(":NFTPROXY-SERVICES - "));
    let errors = check_flows(&w);
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    // A second run (a restart) rewrites the chains but keeps one copy of each jump rule.
    let before = w.saved("legacy");
    w.run_once("iptables", &cluster());
    let after = w.saved("legacy");
    let rules = |s: &str| -> Vec<String> {
        s.lines()
            .filter(|l| l.starts_with('-') || l.starts_with(':'))
            .map(|l| l.split(" [").next().unwrap().to_string())
            .collect()
    };
    assert_eq!(rules(&before), rules(&after));
}

#[test]
fn switching_modes_leaves_nothing_of_the_other_mode() {
    nftproxy_tests::require_root!();
    let w = world();
    let objects = cluster();
    let log = w.run_once("nftables", &objects);
    assert!(log.contains("nftables sync committed"), "{log}");
    assert!(w.nft_tables().contains("table ip nftproxy"));

    let log = w.run_once("iptables", &objects);
    assert!(log.contains("deleted table table=\"ip nftproxy\""), "{log}");
    assert!(!w.nft_tables().contains("nftproxy"), "{}", w.nft_tables());
    assert!(!ours(&w.saved("nft")).is_empty());
    let errors = check_flows(&w);
    assert!(errors.is_empty(), "{}", errors.join("\n"));

    let log = w.run_once("nftables", &objects);
    assert!(
        log.contains("deleted iptables chains left by iptables mode"),
        "{log}"
    );
    for variant in ["nft", "legacy"] {
        let left = w.saved(variant);
        assert!(ours(&left).is_empty(), "{variant}: {left}");
    }
    assert!(w.nft_tables().contains("table ip nftproxy"));
    // The nftables mode's own flows (NodePorts on the primary address only).
    let errors: Vec<String> = [
        w.expect(&w.pod, "10.0.0.2", "172.30.0.10:80", BOTH, false),
        w.expect(&w.ext, "203.0.113.2", "192.168.0.2:30080", BOTH, true),
    ]
    .into_iter()
    .flatten()
    .collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));

    // And back: `nftproxy cleanup` removes both.
    w.run_once("iptables", &objects);
    let out = nftproxy(&w.node, &["cleanup"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(ours(&w.saved("nft")).is_empty());
    assert!(!w.nft_tables().contains("nftproxy"));
}

#[test]
fn cleanup_removes_kube_proxys_leftovers() {
    nftproxy_tests::require_root!();
    let w = world();
    // What kube-proxy leaves: its nftables tables, and iptables-mode chains in both variants
    // (plus kubelet's chains and a CNI chain still using KUBE-MARK-MASQ, which stay).
    w.node
        .exec_input(
            &["nft", "-f", "-"],
            "table ip kube-proxy {\n chain services {\n }\n}\ntable ip6 kube-proxy {\n chain services {\n }\n}\n",
        )
        .unwrap();
    let kube = "\
*mangle
:KUBE-IPTABLES-HINT - [0:0]
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-X27LE4BHSL4DOUIK - [0:0]
:KUBE-SEP-UKSFD7AGPMPPLUHC - [0:0]
:CNI-OWN - [0:0]
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING
-A KUBE-SERVICES -d 172.30.0.43/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-X27LE4BHSL4DOUIK
-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-X27LE4BHSL4DOUIK -j KUBE-SEP-UKSFD7AGPMPPLUHC
-A KUBE-SEP-UKSFD7AGPMPPLUHC -s 10.180.0.3/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-UKSFD7AGPMPPLUHC -p tcp -m tcp -j DNAT --to-destination 10.180.0.3:80
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A CNI-OWN -j KUBE-MARK-MASQ
COMMIT
*filter
:KUBE-FORWARD - [0:0]
:KUBE-FIREWALL - [0:0]
-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD
-A INPUT -j KUBE-FIREWALL
COMMIT
";
    for variant in ["legacy", "nft"] {
        w.node
            .exec_input(&[&format!("iptables-{variant}-restore"), "--noflush"], kube)
            .unwrap();
    }
    // nftproxy's own rules stay: the cleanup runs on nodes nftproxy already serves.
    w.run_once("iptables", &cluster());
    let out = nftproxy(&w.node, &["cleanup", "--kube-proxy"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!w.nft_tables().contains("kube-proxy"), "{}", w.nft_tables());
    assert!(
        ["legacy", "nft"]
            .iter()
            .any(|v| w.saved(v).contains(":NFTPROXY-SERVICES")),
        "nftproxy's chains were removed"
    );
    let out = nftproxy(&w.node, &["cleanup"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for variant in ["legacy", "nft"] {
        let left = w.saved(variant);
        let chains: BTreeSet<&str> = left
            .lines()
            .filter_map(|l| l.strip_prefix(':'))
            .filter_map(|l| l.split(' ').next())
            .filter(|c| {
                c.starts_with("KUBE-") || c.starts_with("NFTPROXY-") || c.starts_with("CNI")
            })
            .collect();
        assert_eq!(
            chains,
            [
                "CNI-OWN",
                "KUBE-FIREWALL",
                "KUBE-IPTABLES-HINT",
                "KUBE-MARK-MASQ"
            ]
            .into_iter()
            .collect(),
            "{variant}:\n{left}"
        );
        assert!(
            !left.contains("kubernetes service portals"),
            "{variant}:\n{left}"
        );
    }
}

/// The `key=value` fields of the log lines containing `needle`.
fn fields(log: &[String], needle: &str) -> Vec<Vec<(String, String)>> {
    log.iter()
        .filter(|l| l.contains(needle))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|w| w.split_once('='))
                .map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string()))
                .collect()
        })
        .collect()
}

fn field(f: &[(String, String)], key: &str) -> String {
    f.iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("no {key} in {f:?}"))
}

fn many(n: usize, moved: Option<usize>) -> Objects {
    let mut o = Objects::new().with(node_object(NODE, &["192.168.0.2"], &["10.0.0.0/24"]));
    for i in 0..n {
        let name = format!("svc-{i}");
        o.push(
            Service::new("ns", &name, &format!("172.30.{}.{}", i / 250, i % 250 + 1)).port(
                "http",
                Proto::Tcp,
                80,
            ),
        );
        let ep = if moved == Some(i) {
            "10.180.2.1"
        } else {
            "10.180.0.1"
        };
        o.push(
            Slice::new("ns", &format!("{name}-a"), &name)
                .port("http", Proto::Tcp, 80)
                .endpoint(Endpoint::new(ep)),
        );
    }
    o
}

#[test]
fn partial_restore_among_5000_services_rewrites_only_the_change() {
    nftproxy_tests::require_root!();
    const N: usize = 5000;
    let w = world();
    std::fs::write(w.path("config.yaml"), CONFIG).unwrap();
    std::fs::write(w.path("cluster.yaml"), many(N, None).to_yaml()).unwrap();
    let bin = target_binary("nftproxy").unwrap();
    let mut cmd = w.node.command(bin);
    cmd.args(["run", "--proxy-mode", "iptables", "--from-file"])
        .arg(w.path("cluster.yaml"))
        .arg("--config")
        .arg(w.path("config.yaml"))
        .env("RUST_LOG", "info");
    let agent = w.node.spawn_command(cmd, "nftproxy").unwrap();
    let committed = |count: usize, timeout: Duration| {
        let deadline = Instant::now() + timeout;
        loop {
            let log = agent.stderr();
            let f = fields(&log, "iptables restore committed");
            if f.len() >= count {
                return f;
            }
            assert!(Instant::now() < deadline, "timed out: {log:#?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let start = Instant::now();
    let first = committed(2, Duration::from_secs(180));
    let full_v4 = first
        .iter()
        .find(|f| field(f, "family") == "IPv4")
        .unwrap()
        .clone();
    eprintln!(
        "full restore of {N} Services: {} lines, {} bytes, {} (first sync after {:?})",
        field(&full_v4, "lines"),
        field(&full_v4, "bytes"),
        field(&full_v4, "elapsed"),
        start.elapsed()
    );
    assert_eq!(field(&full_v4, "full"), "true");
    let full_lines: usize = field(&full_v4, "lines").parse().unwrap();
    assert!(full_lines > 5 * N, "{full_v4:?}");
    assert!(
        w.expect(
            &w.pod,
            "10.0.0.2",
            "172.30.4.235:80",
            "10.180.0.1:80",
            false
        )
        .is_none()
    );

    // Service 1234's endpoint moves.
    let tmp = w.path("cluster.yaml.new");
    std::fs::write(&tmp, many(N, Some(1234)).to_yaml()).unwrap();
    std::fs::rename(&tmp, w.path("cluster.yaml")).unwrap();
    let second = committed(4, Duration::from_secs(60));
    let partial_v4 = second[2..]
        .iter()
        .find(|f| field(f, "family") == "IPv4")
        .unwrap()
        .clone();
    eprintln!(
        "partial restore among {N} Services: {} lines, {} bytes, {}",
        field(&partial_v4, "lines"),
        field(&partial_v4, "bytes"),
        field(&partial_v4, "elapsed"),
    );
    assert_eq!(field(&partial_v4, "full"), "false");
    // *nat, 3 chain declarations (SVC rewritten, new SEP, old SEP flushed), 2 + 2 rules,
    // -X of the old SEP, COMMIT: nothing of the other 4,999 Services, no dispatch chain.
    assert_eq!(field(&partial_v4, "lines"), "10", "{partial_v4:?}");
    assert_eq!(field(&partial_v4, "chains_written"), "3");
    assert_eq!(field(&partial_v4, "chains_deleted"), "1");
    assert_eq!(field(&partial_v4, "nat_rules_written"), "4");
    assert_eq!(field(&partial_v4, "filter_rules_written"), "0");
    let bytes: usize = field(&partial_v4, "bytes").parse().unwrap();
    assert!(bytes < 1000, "{partial_v4:?}");
    let svc = "172.30.4.235:80"; // Service 1234
    assert_eq!(format!("172.30.{}.{}:80", 1234 / 250, 1234 % 250 + 1), svc);
    let errors: Vec<String> = [
        w.expect(&w.pod, "10.0.0.2", svc, "10.180.2.1:80", false),
        w.expect(
            &w.pod,
            "10.0.0.2",
            "172.30.19.250:80",
            "10.180.0.1:80",
            false,
        ),
    ]
    .into_iter()
    .flatten()
    .collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    // kube-proxy's iptables gauges: rules owned, and rules the last restore wrote.
    let metrics = w
        .node
        .exec(&["curl", "-s", "http://127.0.0.1:10249/metrics"])
        .unwrap();
    assert!(
        metrics.contains(
            "kubeproxy_sync_proxy_rules_iptables_last{ip_family=\"IPv4\",table=\"nat\"} 4\n"
        ),
        "{metrics}"
    );
    let total: f64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "kubeproxy_sync_proxy_rules_iptables_total{ip_family=\"IPv4\",table=\"nat\"} ",
            )
        })
        .expect("iptables_total")
        .parse()
        .unwrap();
    assert!(total > (5 * N) as f64, "{total}");
    drop(agent);
}

#[test]
fn canary_brings_flushed_rules_back() {
    nftproxy_tests::require_root!();
    let w = world();
    std::fs::write(w.path("config.yaml"), CONFIG).unwrap();
    std::fs::write(w.path("cluster.yaml"), cluster().to_yaml()).unwrap();
    let bin = target_binary("nftproxy").unwrap();
    let mut cmd = w.node.command(bin);
    cmd.args(["run", "--proxy-mode", "iptables", "--from-file"])
        .arg(w.path("cluster.yaml"))
        .arg("--config")
        .arg(w.path("config.yaml"))
        .env("RUST_LOG", "info");
    let agent = w.node.spawn_command(cmd, "nftproxy").unwrap();
    agent
        .wait_stderr(
            |l| l.contains("iptables restore committed"),
            Duration::from_secs(20),
        )
        .unwrap();
    // Let the canary check (every syncPeriod, 1 s) see the canary once.
    std::thread::sleep(Duration::from_millis(2500));
    // A firewall reload: every table flushed, every chain deleted.
    for table in ["filter", "nat"] {
        for op in ["-F", "-X"] {
            w.node.exec(&["iptables-nft", "-t", table, op]).unwrap();
        }
    }
    agent
        .wait_stderr(
            |l| l.contains("canary chains are gone"),
            Duration::from_secs(10),
        )
        .unwrap();
    // Restored: a full restore of both families committed after the canary went missing (the
    // IPv4 chains alone may be back before the agent's whole sync is through).
    let deadline = Instant::now() + Duration::from_secs(10);
    let restored = || {
        agent
            .stderr()
            .iter()
            .skip_while(|l| !l.contains("canary chains are gone"))
            .any(|l| {
                l.contains("iptables restore committed")
                    && l.contains("full=true")
                    && l.contains("IPv6")
            })
    };
    while !restored() {
        assert!(Instant::now() < deadline, "rules not restored");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(w.saved("nft").contains(":NFTPROXY-SERVICES - "));
    let errors: Vec<String> = [
        w.expect(&w.pod, "10.0.0.2", "172.30.0.10:80", BOTH, false),
        w.expect(&w.ext, "203.0.113.2", "192.168.0.2:30080", BOTH, true),
    ]
    .into_iter()
    .flatten()
    .collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn drop_policy_firewall_lets_health_checks_and_node_ports_in() {
    nftproxy_tests::require_root!();
    let w = world();
    std::fs::write(w.path("config.yaml"), CONFIG).unwrap();
    std::fs::write(w.path("cluster.yaml"), cluster().to_yaml()).unwrap();
    // A host firewall that drops what it does not know, in the variant nftproxy will use.
    for chain in ["INPUT", "FORWARD"] {
        w.node.exec(&["iptables-nft", "-P", chain, "DROP"]).unwrap();
    }
    let bin = target_binary("nftproxy").unwrap();
    let mut cmd = w.node.command(bin);
    cmd.args(["run", "--proxy-mode", "iptables", "--from-file"])
        .arg(w.path("cluster.yaml"))
        .arg("--config")
        .arg(w.path("config.yaml"))
        .env("RUST_LOG", "info");
    let agent = w.node.spawn_command(cmd, "nftproxy").unwrap();
    agent
        .wait_stderr(
            |l| l.contains("iptables restore committed") && l.contains("IPv6"),
            Duration::from_secs(20),
        )
        .unwrap();
    // The health-check node port of the eTP=Local Service is ACCEPTed in INPUT (one local
    // endpoint: 200), and NodePort traffic (marked for masquerade) is forwarded.
    let deadline = Instant::now() + Duration::from_secs(10);
    let code = loop {
        let code = w
            .ext
            .exec(&[
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "1",
                "http://192.168.0.2:30000/",
            ])
            .unwrap_or_default();
        if code == "200" || Instant::now() > deadline {
            break code;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(code, "200");
    let errors: Vec<String> = [
        w.expect(&w.ext, "203.0.113.2", "192.168.0.2:30080", BOTH, true),
        // As with kube-proxy: eTP=Local traffic is not marked, so only the CNI's own FORWARD
        // rules could let it through.
        w.expect(&w.ext, "203.0.113.2", "192.168.0.2:30082", "DROP", false),
    ]
    .into_iter()
    .flatten()
    .collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    drop(agent);
}

/// `n` NodePort Services with an external IP each; `skip` are absent, `moved` have two
/// endpoints (one local) instead of one, every third has none.
fn mix(n: u8, skip: &[u8], moved: &[u8]) -> Objects {
    let mut o = Objects::new().with(node_object(NODE, &["192.168.0.2"], &["10.0.0.0/24"]));
    for i in (0..n).filter(|i| !skip.contains(i)) {
        let name = format!("s{i}");
        o.push(
            Service::new("ns", &name, &format!("172.30.0.{}", i + 1))
                .node_port_type()
                .external_ips(&[&format!("192.168.99.{}", i + 1)])
                .port("http", Proto::Tcp, 80)
                .node_port(30000 + u16::from(i)),
        );
        let mut slice = Slice::new("ns", &format!("{name}-a"), &name).port("http", Proto::Tcp, 80);
        if i % 3 != 2 {
            slice = if moved.contains(&i) {
                slice
                    .endpoint(Endpoint::new(&format!("10.180.1.{}", i + 1)))
                    .endpoint(Endpoint::new(&format!("10.180.2.{}", i + 1)).node(NODE))
            } else {
                slice.endpoint(Endpoint::new(&format!("10.180.0.{}", i + 1)))
            };
        }
        o.push(slice);
    }
    o
}

/// nftproxy's chains and rules, sorted (dispatch chains are edited in place, so their order
/// differs from a fresh restore's), counters dropped.
fn sorted_rules(save: &str) -> Vec<String> {
    let mut v: Vec<String> = ours(save)
        .into_iter()
        .map(|l| l.split(" [").next().unwrap().to_string())
        .collect();
    v.sort();
    v
}

/// Partial restores (Services added, removed, endpoints moved, emptied) leave exactly the
/// rules a full restore of the end state writes, in both variants.
#[test]
fn partial_restores_converge_to_a_full_restore() {
    nftproxy_tests::require_root!();
    for variant in ["legacy", "nft"] {
        let w = world();
        if variant == "legacy" {
            w.node
                .exec(&[
                    "iptables-legacy",
                    "-t",
                    "mangle",
                    "-N",
                    "KUBE-IPTABLES-HINT",
                ])
                .unwrap();
        }
        std::fs::write(w.path("config.yaml"), CONFIG).unwrap();
        std::fs::write(w.path("cluster.yaml"), mix(10, &[], &[]).to_yaml()).unwrap();
        let bin = target_binary("nftproxy").unwrap();
        let mut cmd = w.node.command(bin);
        cmd.args(["run", "--proxy-mode", "iptables", "--from-file"])
            .arg(w.path("cluster.yaml"))
            .arg("--config")
            .arg(w.path("config.yaml"))
            .env("RUST_LOG", "info");
        let agent = w.node.spawn_command(cmd, "nftproxy").unwrap();
        let syncs = |n: usize| {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let log = agent.stderr();
                let f = fields(&log, "iptables restore committed");
                if f.len() >= 2 * n {
                    return f;
                }
                assert!(Instant::now() < deadline, "{variant}: {log:#?}");
                std::thread::sleep(Duration::from_millis(50));
            }
        };
        syncs(1);
        let steps = [
            mix(12, &[3], &[1, 4]),
            mix(12, &[3, 5], &[1]),
            mix(11, &[5], &[]),
        ];
        for (i, objects) in steps.iter().enumerate() {
            let tmp = w.path("cluster.yaml.new");
            std::fs::write(&tmp, objects.to_yaml()).unwrap();
            std::fs::rename(&tmp, w.path("cluster.yaml")).unwrap();
            let f = syncs(i + 2);
            let last = &f[f.len() - 2];
            assert_eq!(field(last, "variant"), variant);
            assert_eq!(field(last, "full"), "false", "{variant}: {f:?}");
        }
        let partial = sorted_rules(&w.saved(variant));
        drop(agent);
        let log = w.run_once("iptables", &steps[2]);
        assert!(log.contains("full=true"), "{log}");
        let full = sorted_rules(&w.saved(variant));
        assert_eq!(partial, full, "{variant}");
        assert!(full.len() > 100, "{variant}: {full:?}");
    }
}
