//! The lab of the suite: a node with a client and endpoints, the cluster it serves, the runs of
//! `nftproxy` that program it, and the flows checked through it.

use super::*;

pub(super) fn nftproxy(ns: &Ns, args: &[&str]) -> Output {
    let bin =
        target_binary("nftproxy").expect("build nftproxy first (cargo build --workspace --bins)");
    ns.command(bin)
        .args(args)
        .env("RUST_LOG", "info")
        .output()
        .expect("run nftproxy")
}

/// A node (192.168.0.2 and 192.168.1.2, 2001:db8::1) with an external client on its uplink,
/// a client pod and one namespace holding every endpoint.
pub(super) struct World {
    pub(super) lab: Lab,
    pub(super) node: Ns,
    pub(super) ext: Ns,
    pub(super) pod: Ns,
    pub(super) dir: tempfile::TempDir,
}

pub(super) fn world() -> World {
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
            &[ip("203.0.113.2"), ip("2600:5200::1")],
            &[ip("192.168.0.2"), ip("2001:db8::1")],
        )
        .unwrap();
    let up = ext.node_link().unwrap().to_string();
    node.ip_batch(&[
        format!("route add default dev {up}"),
        format!("route add ::/0 dev {up}"),
        format!("addr add 192.168.1.2/32 dev {up}"),
        // Masquerade towards the pods picks this address (see semantics.rs).
        "addr add 10.0.0.1/32 dev lo".to_string(),
        "addr add fd00:10::1/128 dev lo nodad".to_string(),
    ])
    .unwrap();
    let pod = lab
        .pod(&node, "pod", &[ip("10.0.0.2"), ip("fd00:10::2")])
        .unwrap();
    let eps = lab
        .pod(
            &node,
            "eps",
            &[ip("10.180.0.1"), ip("10.180.2.1"), ip("fd00:10:180::1")],
        )
        .unwrap();
    lab.echo(&eps, &[80]).unwrap();
    World {
        lab,
        node,
        ext,
        pod,
        dir: tempfile::tempdir().unwrap(),
    }
}

impl World {
    pub(super) fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `nftproxy run --once` of `objects` in `mode`; returns the log.
    pub(super) fn run_once(&self, mode: &str, objects: &Objects) -> String {
        std::fs::write(self.path("cluster.yaml"), objects.to_yaml()).unwrap();
        std::fs::write(self.path("config.yaml"), CONFIG).unwrap();
        let out = nftproxy(
            &self.node,
            &[
                "run",
                "--once",
                "--proxy-mode",
                mode,
                "--from-file",
                self.path("cluster.yaml").to_str().unwrap(),
                "--config",
                self.path("config.yaml").to_str().unwrap(),
            ],
        );
        let log = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "nftproxy run --once failed: {log}");
        log
    }

    pub(super) fn expect(
        &self,
        from: &Ns,
        src: &str,
        dst: &str,
        want: &str,
        masq: bool,
    ) -> Option<String> {
        let probe = Probe::new(Proto::Tcp, sa(dst), 12)
            .src(ip(src))
            .parallel(6)
            .timeout(Duration::from_millis(600));
        let want_verdict = match want {
            "REJECT" => Verdict::Reject,
            "DROP" => Verdict::Drop,
            list => Verdict::Endpoints {
                set: list.split(", ").map(sa).collect(),
                masqueraded: masq,
            },
        };
        let got = self
            .lab
            .probe_for(from, &probe, &want_verdict)
            .unwrap()
            .verdict();
        (got != want_verdict).then(|| {
            format!(
                "{src} -> {dst} from {}: want {want_verdict:?}, got {got:?}",
                from.label()
            )
        })
    }

    /// nftproxy's rules as iptables-save shows them, per variant (both families).
    pub(super) fn saved(&self, variant: &str) -> String {
        ["iptables", "ip6tables"]
            .iter()
            .map(|t| {
                self.node
                    .exec(&[&format!("{t}-{variant}-save")])
                    .unwrap_or_default()
            })
            .collect()
    }

    pub(super) fn nft_tables(&self) -> String {
        self.node.exec(&["nft", "list", "tables"]).unwrap()
    }
}

/// Rules (and chain declarations) mentioning nftproxy's chains.
pub(super) fn ours(save: &str) -> Vec<&str> {
    save.lines().filter(|l| l.contains("NFTPROXY-")).collect()
}

pub(super) fn cluster() -> Objects {
    Objects::new()
        .with(node_object(
            NODE,
            &["192.168.0.2", "2001:db8::1"],
            &["10.0.0.0/24", "fd00:10::/64"],
        ))
        .with(
            Service::with_cluster_ips("ns", "web", &["172.30.0.10", "fd00:172:30::10"])
                .node_port_type()
                .port("http", Proto::Tcp, 80)
                .node_port(30080),
        )
        .with(
            Slice::new("ns", "web-a", "web")
                .port("http", Proto::Tcp, 80)
                .endpoint(Endpoint::new("10.180.0.1").node(NODE))
                .endpoint(Endpoint::new("10.180.2.1").node("node2")),
        )
        .with(
            Slice::new("ns", "web-b", "web")
                .ipv6()
                .port("http", Proto::Tcp, 80)
                .endpoint(Endpoint::new("fd00:10:180::1").node(NODE)),
        )
        .with(
            Service::new("ns", "empty", "172.30.0.11")
                .node_port_type()
                .port("http", Proto::Tcp, 80)
                .node_port(30081),
        )
        .with(
            Service::new("ns", "local", "172.30.0.12")
                .load_balancer(&["1.2.3.4"])
                .external_local()
                .health_check_node_port(30000)
                .port("http", Proto::Tcp, 80)
                .node_port(30082),
        )
        .with(
            Slice::new("ns", "local-a", "local")
                .port("http", Proto::Tcp, 80)
                .endpoint(Endpoint::new("10.180.0.1").node(NODE))
                .endpoint(Endpoint::new("10.180.2.1").node("node2")),
        )
        .with(
            Service::new("ns", "remote", "172.30.0.13")
                .node_port_type()
                .external_local()
                .port("http", Proto::Tcp, 80)
                .node_port(30083),
        )
        .with(
            Slice::new("ns", "remote-a", "remote")
                .port("http", Proto::Tcp, 80)
                .endpoint(Endpoint::new("10.180.2.1").node("node2")),
        )
}

pub(super) const BOTH: &str = "10.180.0.1:80, 10.180.2.1:80";

/// The flows of [`cluster`] in iptables mode; mismatches as messages.
pub(super) fn check_flows(w: &World) -> Vec<String> {
    let (pod, ext, node) = (&w.pod, &w.ext, &w.node);
    #[rustfmt::skip]
    let flows: Vec<(&Ns, &str, &str, &str, bool)> = vec![
        (pod,  "10.0.0.2",     "172.30.0.10:80",       BOTH,              false),
        (node, "192.168.0.2",  "172.30.0.10:80",       BOTH,              true),
        (ext,  "203.0.113.2",  "192.168.0.2:30080",    BOTH,              true),
        // NodePorts on every local address (nodePortAddresses unset), and on localhost.
        (ext,  "203.0.113.2",  "192.168.1.2:30080",    BOTH,              true),
        (node, "127.0.0.1",    "127.0.0.1:30080",      BOTH,              true),
        // No endpoints: REJECT.
        (pod,  "10.0.0.2",     "172.30.0.11:80",       "REJECT",          false),
        (ext,  "203.0.113.2",  "192.168.0.2:30081",    "REJECT",          false),
        // eTP=Local: external clients reach the local endpoint, unmasqueraded; pods are
        // short-circuited to every endpoint; no local endpoint: DROP.
        (ext,  "203.0.113.2",  "1.2.3.4:80",           "10.180.0.1:80",   false),
        (ext,  "203.0.113.2",  "192.168.0.2:30082",    "10.180.0.1:80",   false),
        (pod,  "10.0.0.2",     "1.2.3.4:80",           BOTH,              false),
        (ext,  "203.0.113.2",  "192.168.0.2:30083",    "DROP",            false),
        (pod,  "10.0.0.2",     "172.30.0.13:80",       "10.180.2.1:80",   false),
        // IPv6.
        (pod,  "fd00:10::2",   "[fd00:172:30::10]:80", "[fd00:10:180::1]:80", false),
        (ext,  "2600:5200::1", "[2001:db8::1]:30080",  "[fd00:10:180::1]:80", true),
    ];
    std::thread::scope(|s| {
        let handles: Vec<_> = flows
            .iter()
            .map(|(from, src, dst, want, masq)| {
                s.spawn(move || w.expect(from, src, dst, want, *masq))
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().unwrap())
            .collect()
    })
}
