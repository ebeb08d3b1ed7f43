//! The real `nftproxy run` binary against the in-repo API server, inside a namespace lab:
//! changes reach the kernel, API outages and compacted history are survived, restarts (SIGTERM
//! and SIGKILL) do not interrupt traffic, tampering with the tables is repaired, incremental
//! syncs stay small at 10,000 Services, and invalid objects are skipped.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use nftproxy_tests::apiserver::ApiServer;
use nftproxy_tests::connect_loop::{ConnectLoop, Counts};
use nftproxy_tests::{Lab, Ns, Probe, Proc, Proto, Verdict, ip, sa, target_binary};
use serde_json::{Value, json};

struct Topology {
    lab: Lab,
    node: Ns,
    client: Ns,
    api: ApiServer,
    config: PathBuf,
    _dir: tempfile::TempDir,
}

const CONFIG: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clusterCIDR: 10.0.0.0/8
hostnameOverride: test-node
nftables:
  minSyncPeriod: 1s
  syncPeriod: 2s
";

fn topology() -> Topology {
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let ext = lab
        .external(&node, "ext", &[ip("203.0.113.2")], &[ip("192.168.0.2")])
        .unwrap();
    let up = ext.node_link().unwrap().to_string();
    node.add_route(&format!("default dev {up}")).unwrap();
    let client = lab.pod(&node, "client", &[ip("10.180.0.2")]).unwrap();
    for (label, addr) in [
        ("ep1", "10.180.0.1"),
        ("ep2", "10.180.2.1"),
        ("ep3", "10.180.3.1"),
    ] {
        let pod = lab.pod(&node, label, &[ip(addr)]).unwrap();
        lab.echo(&pod, &[80, 8080]).unwrap();
    }
    let api = ApiServer::start_in(&node).unwrap();
    // As in every cluster, this node's Node object exists (the first sync waits for it).
    api.apply(nftproxy_tests::cluster::node(
        "test-node",
        &["192.168.0.2"],
        &[],
    ))
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    Topology {
        lab,
        node,
        client,
        api,
        config,
        _dir: dir,
    }
}

fn service(name: &str, ip: &str, port: u16, target: u16) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"clusterIP": ip, "clusterIPs": [ip],
                 "ports": [{"name": "http", "port": port, "protocol": "TCP", "targetPort": target}]}
    })
}

fn slice(service: &str, port: u16, endpoints: &[&str]) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-abc"), "namespace": "ns",
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints.iter().map(|e| json!({
            "addresses": [e], "nodeName": "test-node", "conditions": {"ready": true}
        })).collect::<Vec<_>>()
    })
}

fn start_agent(t: &Topology) -> Proc {
    let bin = target_binary("nftproxy").expect("build nftproxy first");
    let kubeconfig = t.api.kubeconfig();
    let agent = t
        .node
        .spawn(&[
            bin.to_str().unwrap(),
            "run",
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--config",
            t.config.to_str().unwrap(),
        ])
        .unwrap();
    agent
        .wait_stderr(
            |l| l.contains("nftables sync committed"),
            Duration::from_secs(20),
        )
        .expect("first sync");
    agent
}

/// Probes until the verdict is `want` or `within` passes; returns how long it took.
fn until(t: &Topology, dst: &str, want: &Verdict, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let probe = Probe::new(Proto::Tcp, sa(dst), 12).timeout(Duration::from_millis(300));
        let got = t.lab.probe_for(&t.client, &probe, want).unwrap().verdict();
        if &got == want {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "{dst}: still {got:?} after {within:?}, want {want:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn endpoints(list: &[&str]) -> Verdict {
    Verdict::Endpoints {
        set: list.iter().map(|a| sa(a)).collect(),
        masqueraded: false,
    }
}

/// Committed message counts logged by the agent since line `from`.
fn committed_messages(agent: &Proc, from: usize) -> Vec<usize> {
    agent.stderr()[from..]
        .iter()
        .filter(|l| l.contains("nftables sync committed"))
        .filter_map(|l| {
            l.split("messages=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

#[test]
fn changes_through_the_api_reach_the_kernel() {
    nftproxy_tests::require_root!();
    let t = topology();
    let _agent = start_agent(&t);
    // A slice that another proxy handles (the EndpointSlice controller copies the Service's
    // service-proxy-name label to its slices) is not listed, as by kube-proxy: its endpoint
    // never receives traffic. Applied first, so it is seen before the slice that counts.
    let mut other = slice("web", 80, &["10.180.9.9"]);
    other["metadata"]["name"] = json!("web-other");
    other["metadata"]["labels"]["service.kubernetes.io/service-proxy-name"] = json!("other");
    t.api.apply(other).unwrap();
    t.api.apply(service("web", "172.30.0.10", 80, 80)).unwrap();
    t.api.apply(slice("web", 80, &["10.180.0.1"])).unwrap();
    // minSyncPeriod (1 s) + 1 s.
    let took = until(
        &t,
        "172.30.0.10:80",
        &endpoints(&["10.180.0.1:80"]),
        Duration::from_secs(2),
    );
    eprintln!("new Service reachable after {took:?}");
    t.api
        .apply(slice(
            "web",
            80,
            &["10.180.0.1", "10.180.2.1", "10.180.3.1"],
        ))
        .unwrap();
    let all = endpoints(&["10.180.0.1:80", "10.180.2.1:80", "10.180.3.1:80"]);
    until(&t, "172.30.0.10:80", &all, Duration::from_secs(3));
    t.api.apply(slice("web", 80, &["10.180.2.1"])).unwrap();
    until(
        &t,
        "172.30.0.10:80",
        &endpoints(&["10.180.2.1:80"]),
        Duration::from_secs(3),
    );
    // Port change: the Service moves to 8080, the endpoints to 8080.
    t.api
        .apply(service("web", "172.30.0.10", 8080, 8080))
        .unwrap();
    t.api.apply(slice("web", 8080, &["10.180.2.1"])).unwrap();
    until(
        &t,
        "172.30.0.10:8080",
        &endpoints(&["10.180.2.1:8080"]),
        Duration::from_secs(3),
    );
    until(
        &t,
        "172.30.0.10:80",
        &Verdict::Reject,
        Duration::from_secs(3),
    );
    t.api.delete("Service", "ns", "web").unwrap();
    t.api.delete("EndpointSlice", "ns", "web-abc").unwrap();
    // A deleted Service's address is an unallocated address of the ServiceCIDR, if one is
    // known; without ServiceCIDRs nothing answers for it any more: it is routed onwards.
    let start = Instant::now();
    loop {
        let listing = t
            .node
            .exec(&["nft", "list", "table", "ip", "nftproxy"])
            .unwrap();
        if !listing.contains("172.30.0.10") {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(3), "{listing}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn api_outage_and_compacted_history() {
    nftproxy_tests::require_root!();
    let t = topology();
    t.api.apply(service("web", "172.30.0.10", 80, 80)).unwrap();
    t.api.apply(slice("web", 80, &["10.180.0.1"])).unwrap();
    t.api.apply(service("gone", "172.30.0.11", 80, 80)).unwrap();
    t.api.apply(slice("gone", 80, &["10.180.2.1"])).unwrap();
    let agent = start_agent(&t);
    until(
        &t,
        "172.30.0.10:80",
        &endpoints(&["10.180.0.1:80"]),
        Duration::from_secs(3),
    );
    until(
        &t,
        "172.30.0.11:80",
        &endpoints(&["10.180.2.1:80"]),
        Duration::from_secs(3),
    );
    // The rules as the agent left them once its start-up syncs are over: the same listing
    // twice, a second apart (a sync still under way would change it).
    let listing = || t.node.exec(&["nft", "list", "ruleset"]).unwrap();
    let settled = Instant::now();
    let mut before = listing();
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let again = listing();
        if again == before {
            break;
        }
        assert!(
            settled.elapsed() < Duration::from_secs(15),
            "the rules keep changing with no change in the cluster"
        );
        before = again;
    }
    let log_start = agent.stderr().len();

    t.api.set_refuse(true);
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(10) {
        let r = t
            .lab
            .run_probe(&t.client, &Probe::new(Proto::Tcp, sa("172.30.0.10:80"), 5))
            .unwrap();
        assert_eq!(
            r.verdict(),
            endpoints(&["10.180.0.1:80"]),
            "traffic during the outage"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(listing(), before);
    // Meanwhile: one Service deleted, one endpoint moved; then history is compacted.
    t.api.delete("Service", "ns", "gone").unwrap();
    t.api.delete("EndpointSlice", "ns", "gone-abc").unwrap();
    t.api.apply(slice("web", 80, &["10.180.3.1"])).unwrap();
    t.api.compact();
    t.api.set_refuse(false);
    until(
        &t,
        "172.30.0.10:80",
        &endpoints(&["10.180.3.1:80"]),
        Duration::from_secs(40),
    );
    let start = Instant::now();
    while t
        .node
        .exec(&["nft", "list", "table", "ip", "nftproxy"])
        .unwrap()
        .contains("172.30.0.11")
    {
        // Each watcher backs off on its own: the Service watcher may come back after the
        // EndpointSlice watcher did.
        assert!(
            start.elapsed() < Duration::from_secs(40),
            "deleted Service still programmed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let warnings = agent.stderr()[log_start..]
        .iter()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .count();
    assert!(
        warnings <= 8,
        "error spam during a 10 s outage: {warnings} lines:\n{:#?}",
        &agent.stderr()[log_start..]
    );
}

#[test]
fn restarts_do_not_interrupt_traffic() {
    nftproxy_tests::require_root!();
    let t = topology();
    t.api.apply(service("web", "172.30.0.10", 80, 80)).unwrap();
    t.api
        .apply(slice("web", 80, &["10.180.0.1", "10.180.2.1"]))
        .unwrap();
    let mut agent = start_agent(&t);
    until(
        &t,
        "172.30.0.10:80",
        &endpoints(&["10.180.0.1:80", "10.180.2.1:80"]),
        Duration::from_secs(3),
    );
    let client = ConnectLoop::start(
        &t.client,
        sa("172.30.0.10:80"),
        Duration::from_millis(20),
        Duration::from_secs(1),
    );
    std::thread::sleep(Duration::from_millis(500));
    agent.terminate(Duration::from_secs(5)).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let mut agent = start_agent(&t);
    std::thread::sleep(Duration::from_millis(1500));
    agent.kill().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let agent = start_agent(&t);
    std::thread::sleep(Duration::from_millis(1500));
    let Counts {
        answered: ok,
        failed,
        ..
    } = client.finish();
    assert!(ok > 100, "only {ok} connections");
    assert_eq!(failed, 0, "{failed} of {} connections failed", ok + failed);
    // A restarted agent adopts the rules it finds: its first sync sends nothing.
    assert_eq!(
        committed_messages(&agent, 0)[..2],
        [0, 0],
        "{:#?}",
        agent.stderr()
    );
}

#[test]
fn tampering_is_repaired_within_two_seconds() {
    nftproxy_tests::require_root!();
    let t = topology();
    t.api.apply(service("web", "172.30.0.10", 80, 80)).unwrap();
    t.api.apply(slice("web", 80, &["10.180.0.1"])).unwrap();
    let _agent = start_agent(&t);
    let web = endpoints(&["10.180.0.1:80"]);
    until(&t, "172.30.0.10:80", &web, Duration::from_secs(3));
    std::thread::sleep(Duration::from_millis(1200));
    t.node
        .exec(&["nft", "delete", "table", "ip", "nftproxy"])
        .unwrap();
    let took = until(&t, "172.30.0.10:80", &web, Duration::from_secs(2));
    eprintln!("table restored after {took:?}");
    std::thread::sleep(Duration::from_millis(1200));
    t.node.exec(&["nft", "flush", "ruleset"]).unwrap();
    let took = until(&t, "172.30.0.10:80", &web, Duration::from_secs(2));
    eprintln!("ruleset restored after {took:?}");
}

/// Loads `n` Services with one endpoint each, then changes one EndpointSlice; returns the
/// netlink messages of that change's sync.
fn one_change_at_scale(n: usize) -> usize {
    let t = topology();
    for i in 0..n {
        let name = format!("svc{i}");
        let addr = format!("172.30.{}.{}", 100 + i / 250, 1 + i % 250);
        t.api.apply(service(&name, &addr, 80, 80)).unwrap();
        t.api.apply(slice(&name, 80, &["10.180.0.1"])).unwrap();
    }
    t.api.apply(service("web", "172.30.0.10", 80, 80)).unwrap();
    t.api.apply(slice("web", 80, &["10.180.0.1"])).unwrap();
    let agent = start_agent(&t);
    until(
        &t,
        "172.30.0.10:80",
        &endpoints(&["10.180.0.1:80"]),
        Duration::from_secs(30),
    );
    std::thread::sleep(Duration::from_millis(1200));
    let from = agent.stderr().len();
    t.api
        .apply(slice("web", 80, &["10.180.0.1", "10.180.2.1"]))
        .unwrap();
    until(
        &t,
        "172.30.0.10:80",
        &endpoints(&["10.180.0.1:80", "10.180.2.1:80"]),
        Duration::from_secs(10),
    );
    // The log line may trail the kernel update the probe already saw.
    let start = Instant::now();
    loop {
        let sent: usize = committed_messages(&agent, from).iter().sum();
        if sent > 0 || start.elapsed() > Duration::from_secs(10) {
            return sent;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn one_slice_change_costs_the_same_at_10000_services() {
    nftproxy_tests::require_root!();
    let small = one_change_at_scale(10);
    let large = one_change_at_scale(10_000);
    eprintln!("messages for one EndpointSlice change: {small} at 10 Services, {large} at 10,000");
    assert!(small > 0);
    assert_eq!(small, large);
}

#[test]
fn invalid_objects_are_skipped_and_named() {
    nftproxy_tests::require_root!();
    let t = topology();
    t.api.apply(service("web", "172.30.0.10", 80, 80)).unwrap();
    t.api.apply(slice("web", 80, &["10.180.0.1"])).unwrap();
    let mut bad_ip = service("bad-ip", "172.30.0.300", 80, 80);
    bad_ip["spec"]["clusterIPs"] = json!(["172.30.0.300"]);
    t.api.apply(bad_ip).unwrap();
    t.api
        .apply(service("bad-port", "172.30.0.12", 0, 80))
        .unwrap();
    let mut dup = service("dup-port", "172.30.0.13", 80, 80);
    dup["spec"]["ports"] = json!([{"name": "a", "port": 80}, {"name": "b", "port": 80}]);
    t.api.apply(dup).unwrap();
    t.api
        .apply(slice("bad-slice", 80, &["10.180.999.1"]))
        .unwrap();
    let agent = start_agent(&t);
    until(
        &t,
        "172.30.0.10:80",
        &endpoints(&["10.180.0.1:80"]),
        Duration::from_secs(3),
    );
    for (name, reason) in [
        ("ns/bad-ip", "invalid IP"),
        ("ns/bad-port", "out of range"),
        ("ns/dup-port", "duplicate port"),
        ("ns/bad-slice-abc", "invalid address"),
    ] {
        agent
            .wait_stderr(
                |l| l.contains(name) && l.contains(reason),
                Duration::from_secs(3),
            )
            .unwrap_or_else(|_| panic!("no log line names {name} ({reason})"));
    }
    let listing = t
        .node
        .exec(&["nft", "list", "table", "ip", "nftproxy"])
        .unwrap();
    for bad in ["172.30.0.12", "172.30.0.13"] {
        assert!(!listing.contains(bad), "{bad} programmed");
    }
}
