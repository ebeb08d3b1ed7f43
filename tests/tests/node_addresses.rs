//! NodePorts follow the node's addresses: with CIDR `nodePortAddresses`, an address added to
//! the node inside the CIDR starts answering NodePorts without any cluster change, and stops
//! when it is removed (the agent watches rtnetlink address notifications).

use std::time::{Duration, Instant};

use nftproxy_tests::{Lab, Ns, Probe, Proto, Verdict, ip, sa, target_binary};

const CLUSTER: &str = r#"
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: np, namespace: ns}
  spec:
    type: NodePort
    clusterIP: 172.30.0.10
    ports: [{name: http, port: 80, nodePort: 30080}]
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: np-a, namespace: ns, labels: {kubernetes.io/service-name: np}}
  addressType: IPv4
  ports: [{name: http, port: 80}]
  endpoints: [{addresses: [10.180.0.1], nodeName: test-node}]
"#;

const CONFIG: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clusterCIDR: 10.0.0.0/8
hostnameOverride: test-node
nodePortAddresses: [192.168.50.0/24]
nftables: {minSyncPeriod: 200ms}
";

fn verdict(lab: &Lab, from: &Ns, dst: &str) -> Verdict {
    let probe = Probe::new(Proto::Tcp, sa(dst), 4).timeout(Duration::from_millis(300));
    lab.run_probe(from, &probe).unwrap().verdict()
}

fn wait_for(lab: &Lab, from: &Ns, dst: &str, want: impl Fn(&Verdict) -> bool) -> Duration {
    let start = Instant::now();
    loop {
        let got = verdict(lab, from, dst);
        if want(&got) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{dst}: still {got:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn node_ports_follow_address_changes() {
    nftproxy_tests::require_root!();
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let ext = lab
        .external(&node, "ext", &[ip("203.0.113.2")], &[ip("192.168.0.2")])
        .unwrap();
    let up = ext.node_link().unwrap().to_string();
    let ep = lab.pod(&node, "ep", &[ip("10.180.0.1")]).unwrap();
    lab.echo(&ep, &[80]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (cluster, config) = (
        dir.path().join("cluster.yaml"),
        dir.path().join("config.yaml"),
    );
    std::fs::write(&cluster, CLUSTER).unwrap();
    std::fs::write(&config, CONFIG).unwrap();
    let bin = target_binary("nftproxy").expect("build nftproxy first");
    let agent = node
        .spawn(&[
            bin.to_str().unwrap(),
            "run",
            "--from-file",
            cluster.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
        ])
        .unwrap();
    agent
        .wait_stderr(
            |l| l.contains("nftables sync committed"),
            Duration::from_secs(10),
        )
        .unwrap();
    let answered = |v: &Verdict| {
        *v == Verdict::Endpoints {
            set: [sa("10.180.0.1:80")].into(),
            masqueraded: true,
        }
    };
    // 192.168.0.2 is outside the CIDR: its NodePort is not served.
    assert!(!answered(&verdict(&lab, &ext, "192.168.0.2:30080")));
    node.add_addr(&up, ip("192.168.50.2"), 32).unwrap();
    let took = wait_for(&lab, &ext, "192.168.50.2:30080", answered);
    eprintln!("NodePort served on the new address after {took:?}");
    node.ip(&["addr", "del", "192.168.50.2/32", "dev", &up])
        .unwrap();
    let start = Instant::now();
    loop {
        let set = node
            .exec(&["nft", "list", "set", "ip", "nftproxy", "nodeport-ips"])
            .unwrap();
        if !set.contains("192.168.50.2") {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{set}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
