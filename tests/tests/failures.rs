//! One failure never takes the rest down (needs root: network namespaces). The real agent,
//! with faults injected through its test hooks (`NFTPROXY_TEST_*`, see the agent's
//! `testhooks` module): a Service whose rules the kernel refuses is quarantined while every
//! other Service keeps working and following changes; an IP family whose syncs fail leaves the
//! other family syncing; a panic ends the process.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use nftproxy_tests::apiserver::in_netns;
use nftproxy_tests::cluster::{Endpoint, Objects, Service, Slice, node};
use nftproxy_tests::{Lab, Ns, Probe, Proc, Proto, Verdict, ip, sa, target_binary};

const CONFIG: &str = "\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
hostnameOverride: test-node
clusterCIDR: 10.180.0.0/16,fd00:10:180::/64
nftables: {syncPeriod: 2s, minSyncPeriod: 100ms}
";

struct World {
    lab: Lab,
    node: Ns,
    client: Ns,
    dir: tempfile::TempDir,
}

fn world() -> World {
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let client = lab
        .pod(&node, "client", &[ip("10.180.0.2"), ip("fd00:10:180::2")])
        .unwrap();
    for (label, v4, v6) in [
        ("ep1", "10.180.1.1", "fd00:10:180::1:1"),
        ("ep2", "10.180.2.1", "fd00:10:180::2:1"),
        ("ep3", "10.180.3.1", "fd00:10:180::3:1"),
    ] {
        let pod = lab.pod(&node, label, &[ip(v4), ip(v6)]).unwrap();
        lab.echo(&pod, &[80]).unwrap();
    }
    World {
        lab,
        node,
        client,
        dir: tempfile::tempdir().unwrap(),
    }
}

fn cluster_yaml(extra_web_endpoint: bool) -> String {
    let web_eps: Vec<&str> = if extra_web_endpoint {
        vec!["10.180.1.1", "10.180.2.1"]
    } else {
        vec!["10.180.1.1"]
    };
    let mut objects = Objects::new().with(node("test-node", &["192.0.2.1"], &[]));
    for (name, vip, eps) in [
        ("web", "172.30.0.10", web_eps),
        ("db", "172.30.0.11", vec!["10.180.2.1"]),
        ("bad", "172.30.0.99", vec!["10.180.3.1"]),
    ] {
        objects.push(Service::new("ns", name, vip).port("http", Proto::Tcp, 80));
        objects.push(
            Slice::new("ns", &format!("{name}-1"), name)
                .port("http", Proto::Tcp, 80)
                .endpoints(eps.iter().map(|e| Endpoint::new(e))),
        );
    }
    objects.push(
        Service::with_cluster_ips("ns", "dual", &["172.30.0.20", "fd00:30::20"]).port(
            "http",
            Proto::Tcp,
            80,
        ),
    );
    objects.push(
        Slice::new("ns", "dual-4", "dual")
            .port("http", Proto::Tcp, 80)
            .endpoint(Endpoint::new("10.180.1.1")),
    );
    objects.push(
        Slice::new("ns", "dual-6", "dual")
            .ipv6()
            .port("http", Proto::Tcp, 80)
            .endpoint(Endpoint::new("fd00:10:180::1:1")),
    );
    objects.to_yaml()
}

fn start(w: &World, env: &[(&str, &str)]) -> Proc {
    std::fs::write(w.dir.path().join("config.yaml"), CONFIG).unwrap();
    std::fs::write(w.dir.path().join("cluster.yaml"), cluster_yaml(false)).unwrap();
    let bin = target_binary("nftproxy").expect("build nftproxy first");
    let mut cmd = w.node.command(bin);
    cmd.args(["run", "--from-file"])
        .arg(w.dir.path().join("cluster.yaml"))
        .arg("--config")
        .arg(w.dir.path().join("config.yaml"))
        .env("RUST_LOG", "info");
    for (k, v) in env {
        cmd.env(k, v);
    }
    w.node.spawn_command(cmd, "nftproxy").unwrap()
}

fn rewrite(w: &World, yaml: &str) {
    let tmp = w.dir.path().join("cluster.yaml.new");
    std::fs::write(&tmp, yaml).unwrap();
    std::fs::rename(&tmp, w.dir.path().join("cluster.yaml")).unwrap();
}

fn answers(w: &World, dst: &str, want: &[&str], within: Duration) {
    let want = Verdict::Endpoints {
        set: want.iter().map(|a| sa(a)).collect(),
        masqueraded: false,
    };
    let start = Instant::now();
    loop {
        let probe = Probe::new(Proto::Tcp, sa(dst), 12).timeout(Duration::from_millis(300));
        let got = w.lab.probe_for(&w.client, &probe, &want).unwrap().verdict();
        if got == want {
            return;
        }
        assert!(start.elapsed() < within, "{dst}: {got:?}, want {want:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn get(ns: &Ns, addr: &str, path: &str) -> String {
    let addr: SocketAddr = addr.parse().unwrap();
    let path = path.to_string();
    in_netns(ns.name(), move || {
        let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).unwrap();
        write!(c, "GET {path} HTTP/1.0\r\n\r\n").unwrap();
        let mut text = String::new();
        c.read_to_string(&mut text).unwrap();
        text
    })
    .unwrap()
}

#[test]
fn a_service_the_kernel_refuses_is_quarantined_and_the_rest_keeps_working() {
    nftproxy_tests::require_root!();
    let w = world();
    // The kernel refuses whatever names bad's ClusterIP.
    let agent = start(&w, &[("NFTPROXY_TEST_REFUSE", "172.30.0.99")]);
    agent
        .wait_stderr(
            |l| l.contains("quarantined Service") && l.contains("ns/bad"),
            Duration::from_secs(15),
        )
        .unwrap_or_else(|e| panic!("{e:#}: {:#?}", agent.stderr()));
    answers(
        &w,
        "172.30.0.10:80",
        &["10.180.1.1:80"],
        Duration::from_secs(10),
    );
    answers(
        &w,
        "172.30.0.11:80",
        &["10.180.2.1:80"],
        Duration::from_secs(5),
    );
    answers(
        &w,
        "[fd00:30::20]:80",
        &["[fd00:10:180::1:1]:80"],
        Duration::from_secs(5),
    );
    // Changes to other Services keep being applied, in partial syncs.
    rewrite(&w, &cluster_yaml(true));
    answers(
        &w,
        "172.30.0.10:80",
        &["10.180.1.1:80", "10.180.2.1:80"],
        Duration::from_secs(10),
    );
    let metrics = get(&w.node, "127.0.0.1:10249", "/metrics");
    assert!(
        metrics.contains("\nnftproxy_quarantined_services 1\n"),
        "{metrics}"
    );
    // The refused Service was not programmed at all.
    let table = w
        .node
        .exec(&["nft", "list", "table", "ip", "nftproxy"])
        .unwrap();
    assert!(!table.contains("172.30.0.99"), "{table}");
}

#[test]
fn a_failing_family_leaves_the_other_syncing() {
    nftproxy_tests::require_root!();
    let w = world();
    let agent = start(&w, &[("NFTPROXY_TEST_FAIL_FAMILY", "IPv6")]);
    answers(
        &w,
        "172.30.0.10:80",
        &["10.180.1.1:80"],
        Duration::from_secs(10),
    );
    answers(
        &w,
        "172.30.0.20:80",
        &["10.180.1.1:80"],
        Duration::from_secs(5),
    );
    rewrite(&w, &cluster_yaml(true));
    answers(
        &w,
        "172.30.0.10:80",
        &["10.180.1.1:80", "10.180.2.1:80"],
        Duration::from_secs(5),
    );
    // IPv6 keeps failing and is retried with backoff; the failures are visible.
    std::thread::sleep(Duration::from_secs(2));
    let failures = agent
        .stderr()
        .iter()
        .filter(|l| l.contains("sync failed") && l.contains("IPv6"))
        .count();
    assert!(
        (2..=8).contains(&failures),
        "{failures} failures in ~4 s:\n{:#?}",
        agent.stderr()
    );
    let metrics = get(&w.node, "127.0.0.1:10249", "/metrics");
    let line = metrics
        .lines()
        .find(|l| l.starts_with("nftproxy_sync_consecutive_failures{ip_family=\"IPv6\"}"))
        .unwrap_or_else(|| panic!("{metrics}"));
    let n: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(n >= 2.0, "{line}");
    assert!(metrics.contains("nftproxy_sync_consecutive_failures{ip_family=\"IPv4\"} 0"));
    let health = get(&w.node, "127.0.0.1:10256", "/healthz");
    assert!(health.contains("\"syncFailures\":{\"IPv6\""), "{health}");
    assert!(!health.contains("\"IPv4\":{\"failures\""), "{health}");
}

#[test]
fn a_panic_ends_the_process() {
    nftproxy_tests::require_root!();
    let w = world();
    let mut agent = start(&w, &[("NFTPROXY_TEST_PANIC", "sync")]);
    let status = agent
        .wait_timeout(Duration::from_secs(10))
        .unwrap()
        .unwrap_or_else(|| panic!("still running: {:#?}", agent.stderr()));
    assert!(!status.success());
    let log = agent.stderr().join("\n");
    assert!(
        log.contains("panicked") && log.contains("NFTPROXY_TEST_PANIC"),
        "{log}"
    );
}
