//! The real `nftproxy run` binary against an API server that misbehaves, inside a namespace
//! lab with traffic through the kernel: blackholed (connections accepted, never answered),
//! refusing connections, compacted history, watches gone silent, `Retry-After`; and lists
//! served from the watch cache in pages.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use nftproxy_tests::apiserver::{ApiServer, RequestLog};
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

/// The collections the agent lists and watches.
const COLLECTIONS: [&str; 4] = [
    "/api/v1/services",
    "/apis/discovery.k8s.io/v1/endpointslices",
    "/api/v1/nodes",
    "/apis/networking.k8s.io/v1/servicecidrs",
];

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
        lab.echo(&pod, &[80]).unwrap();
    }
    let api = ApiServer::start_in(&node).unwrap();
    // The first sync waits for this node's Node object.
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

fn service(name: &str, ip: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"clusterIP": ip, "clusterIPs": [ip],
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 80}]}
    })
}

fn slice(service: &str, endpoints: &[&str]) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-abc"), "namespace": "ns",
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
        "endpoints": endpoints.iter().map(|e| json!({
            "addresses": [e], "nodeName": "test-node", "conditions": {"ready": true}
        })).collect::<Vec<_>>()
    })
}

/// A Service at `ip` with its one-endpoint slice.
fn apply_service(t: &Topology, name: &str, ip: &str, endpoint: &str) {
    t.api.apply(service(name, ip)).unwrap();
    t.api.apply(slice(name, &[endpoint])).unwrap();
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

fn endpoints(list: &[&str]) -> Verdict {
    Verdict::Endpoints {
        set: list.iter().map(|a| sa(a)).collect(),
        masqueraded: false,
    }
}

/// Probes until the verdict is `want` or `within` passes; returns how long it took.
fn until(t: &Topology, dst: &str, want: &Verdict, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let probe = Probe::new(Proto::Tcp, sa(dst), 6).timeout(Duration::from_millis(300));
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

/// The agent's steady state: `web` (172.30.0.10) served by ep1.
fn with_web(t: &Topology) -> Proc {
    apply_service(t, "web", "172.30.0.10", "10.180.0.1");
    let agent = start_agent(t);
    until(
        t,
        "172.30.0.10:80",
        &endpoints(&["10.180.0.1:80"]),
        Duration::from_secs(3),
    );
    agent
}

/// A connect loop to `web` every 30 ms. What these tests look for is rules that go away while
/// the API server misbehaves, which fails every connection from then on; an attempt gets 2 s,
/// past the first SYN retransmission (1 s), so one SYN lost on a busy machine is not counted.
fn prober(t: &Topology) -> ConnectLoop {
    ConnectLoop::start(
        &t.client,
        sa("172.30.0.10:80"),
        Duration::from_millis(30),
        Duration::from_secs(2),
    )
}

/// `failures`: the prober's first failures, with when and why.
fn assert_never_failed(counts: Counts, failures: Vec<String>, during: &str) {
    assert!(counts.answered > 100, "only {counts:?} {during}");
    assert_eq!(
        counts.failed, 0,
        "connections failed {during}: {counts:?}; the first: {failures:#?}"
    );
}

fn param<'a>(r: &'a RequestLog, key: &str) -> Option<&'a str> {
    let query = r.uri.split_once('?')?.1;
    query
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// The agent's lists (GETs of a collection, not watches), from `since`.
fn lists(log: &[RequestLog], since: Instant) -> Vec<&RequestLog> {
    log.iter()
        .filter(|r| r.at >= since && r.method == "GET" && !r.is_watch())
        .filter(|r| COLLECTIONS.contains(&r.path()))
        .collect()
}

fn watches<'a>(log: &'a [RequestLog], path: &str, since: Instant) -> Vec<&'a RequestLog> {
    log.iter()
        .filter(|r| r.at >= since && r.is_watch() && r.path() == path)
        .collect()
}

fn print_log(log: &[RequestLog], since: Instant) {
    for r in log.iter().filter(|r| r.at >= since) {
        let at = r.at.saturating_duration_since(since).as_secs_f64();
        let status = r.status.map_or("-".into(), |s| s.to_string());
        eprintln!("  {at:>7.3}s {status} {} {}", r.method, r.uri);
    }
}

#[test]
fn a_blackholed_api_server_never_interrupts_traffic_and_changes_follow_its_return() {
    nftproxy_tests::require_root!();
    let t = topology();
    let agent = with_web(&t);
    let prober = prober(&t);
    // An agent that has run for a while knows its watches' bookmark cadence (1 s here).
    std::thread::sleep(Duration::from_secs(3));
    let log_from = agent.stderr().len();
    t.api.set_stall(true);
    let stalled = Instant::now();
    std::thread::sleep(Duration::from_secs(10));
    // Meanwhile: a new Service.
    apply_service(&t, "new", "172.30.0.20", "10.180.2.1");
    std::thread::sleep(Duration::from_secs(60).saturating_sub(stalled.elapsed()));
    assert_never_failed(
        prober.counts(),
        prober.failures(),
        "while the API server was blackholed",
    );
    t.api.set_stall(false);
    let back = Instant::now();
    let took = until(
        &t,
        "172.30.0.20:80",
        &endpoints(&["10.180.2.1:80"]),
        Duration::from_secs(15),
    );
    eprintln!(
        "after a 60 s blackhole: the new Service carries traffic {took:?} after the API server answers again"
    );
    let failures = prober.failures();
    assert_never_failed(prober.finish(), failures, "during and after the blackhole");

    let log = t.api.requests();
    print_log(&log, stalled);
    // No request waited forever: the watchdog ended the silent watches, and every request that
    // got no answer was given up after 30 s and made again.
    for path in &COLLECTIONS[..2] {
        let asked: Vec<Instant> = watches(&log, path, stalled)
            .iter()
            .map(|r| r.at)
            .filter(|at| *at < back)
            .collect();
        assert!(
            asked.len() >= 2,
            "{path}: watches during the stall {asked:?}"
        );
        assert!(
            asked[0] - stalled < Duration::from_secs(10),
            "{path}: the silent watch was restarted after {:?}",
            asked[0] - stalled
        );
        for pair in asked.windows(2) {
            assert!(
                pair[1] - pair[0] < Duration::from_secs(33),
                "{path}: an unanswered watch waited {:?}",
                pair[1] - pair[0]
            );
        }
    }
    let lines = &agent.stderr()[log_from..];
    assert!(
        lines.iter().any(|l| l.contains("watchdog")),
        "no watchdog in the log: {lines:#?}"
    );
    let warnings = lines
        .iter()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .count();
    assert!(warnings <= 8, "{warnings} warnings: {lines:#?}");
}

#[test]
fn a_service_created_while_the_api_server_refuses_connections_follows_within_5s() {
    nftproxy_tests::require_root!();
    let t = topology();
    let _agent = with_web(&t);
    let prober = prober(&t);
    t.api.set_refuse(true);
    let outage = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    apply_service(&t, "new", "172.30.0.20", "10.180.2.1");
    std::thread::sleep(Duration::from_secs(10).saturating_sub(outage.elapsed()));
    t.api.set_refuse(false);
    let took = until(
        &t,
        "172.30.0.20:80",
        &endpoints(&["10.180.2.1:80"]),
        Duration::from_secs(5),
    );
    eprintln!(
        "after a 10 s outage (refused): the new Service carries traffic {took:?} after the API server is back"
    );
    let failures = prober.failures();
    assert_never_failed(prober.finish(), failures, "during the outage");
}

#[test]
fn after_an_outage_with_compacted_history_changes_follow_within_5s() {
    nftproxy_tests::require_root!();
    let t = topology();
    apply_service(&t, "gone", "172.30.0.11", "10.180.2.1");
    let _agent = with_web(&t);
    until(
        &t,
        "172.30.0.11:80",
        &endpoints(&["10.180.2.1:80"]),
        Duration::from_secs(3),
    );
    t.api.set_refuse(true);
    std::thread::sleep(Duration::from_secs(3));
    // Meanwhile: an endpoint moves, a Service goes; then the history is compacted, as by an API
    // server restart.
    t.api.apply(slice("web", &["10.180.3.1"])).unwrap();
    t.api.delete("Service", "ns", "gone").unwrap();
    t.api.delete("EndpointSlice", "ns", "gone-abc").unwrap();
    t.api.compact();
    t.api.set_refuse(false);
    let back = Instant::now();
    until(
        &t,
        "172.30.0.10:80",
        &endpoints(&["10.180.3.1:80"]),
        Duration::from_secs(5),
    );
    loop {
        let table = t
            .node
            .exec(&["nft", "list", "table", "ip", "nftproxy"])
            .unwrap();
        if !table.contains("172.30.0.11") {
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(5),
            "deleted Service still programmed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "after an outage with compacted history: changes applied {:?} after the API server is back",
        back.elapsed()
    );
    // The relists came from the watch cache too.
    let log = t.api.requests();
    let relists = lists(&log, back);
    assert!(
        relists.iter().any(|r| r.path() == COLLECTIONS[0]),
        "no relist of Services: {relists:#?}"
    );
    for r in relists {
        assert_eq!(param(r, "resourceVersion"), Some("0"), "{}", r.uri);
    }
}

#[test]
fn lists_come_from_the_watch_cache_in_pages_of_500() {
    nftproxy_tests::require_root!();
    let t = topology();
    // 1,200 Services: three pages.
    for i in 0..1200 {
        let addr = format!("172.30.{}.{}", 100 + i / 250, 1 + i % 250);
        t.api.apply(service(&format!("svc{i}"), &addr)).unwrap();
    }
    let start = Instant::now();
    let _agent = with_web(&t);
    let log = t.api.requests();
    let lists = lists(&log, start);
    for path in COLLECTIONS {
        assert!(
            lists.iter().any(|r| r.path() == path),
            "{path} not listed: {lists:#?}"
        );
    }
    for r in &lists {
        assert_eq!(param(r, "limit"), Some("500"), "{}", r.uri);
        match param(r, "continue") {
            // A first page: from the watch cache.
            None => assert_eq!(param(r, "resourceVersion"), Some("0"), "{}", r.uri),
            // Further pages: the token alone says where.
            Some(_) => assert_eq!(param(r, "resourceVersion"), None, "{}", r.uri),
        }
        assert_eq!(r.status, Some(200), "{}", r.uri);
    }
    let pages = lists.iter().filter(|r| r.path() == COLLECTIONS[0]).count();
    assert_eq!(pages, 3, "pages of Services: {lists:#?}");
    // Every page made it into the kernel.
    let table = t
        .node
        .exec(&["nft", "list", "table", "ip", "nftproxy"])
        .unwrap();
    for addr in ["172.30.100.1", "172.30.102.1", "172.30.104.200"] {
        assert!(table.contains(addr), "{addr} not programmed");
    }
    // Watches ask for bookmarks (the watchdog learns their cadence from them).
    let watch = log
        .iter()
        .find(|r| r.is_watch() && r.at >= start)
        .expect("a watch");
    assert_eq!(
        param(watch, "allowWatchBookmarks"),
        Some("true"),
        "{}",
        watch.uri
    );
}

#[test]
fn a_watch_gone_silent_is_restarted_by_the_watchdog() {
    nftproxy_tests::require_root!();
    let t = topology();
    let agent = with_web(&t);
    // Let the agent learn the bookmark cadence (1 s).
    std::thread::sleep(Duration::from_secs(3));
    let log_from = agent.stderr().len();
    // Every open watch goes silent, as over a connection that died without a word; the server
    // itself answers as usual.
    t.api.set_mute_watches(true);
    let muted = Instant::now();
    t.api.apply(slice("web", &["10.180.2.1"])).unwrap();
    let took = until(
        &t,
        "172.30.0.10:80",
        &endpoints(&["10.180.2.1:80"]),
        Duration::from_secs(12),
    );
    eprintln!("a change behind a silent watch applied after {took:?}");
    let log = t.api.requests();
    print_log(&log, muted);
    // The watch was resumed from where it was, not relisted.
    let resumed = watches(&log, COLLECTIONS[1], muted);
    assert!(!resumed.is_empty(), "EndpointSlice watch not restarted");
    let rv: u64 = param(resumed[0], "resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(rv > 0, "{}", resumed[0].uri);
    assert!(
        lists(&log, muted).is_empty(),
        "relisted: {:#?}",
        lists(&log, muted)
    );
    let lines = &agent.stderr()[log_from..];
    assert!(
        lines
            .iter()
            .any(|l| l.contains("watchdog") && l.contains("EndpointSlice")),
        "{lines:#?}"
    );
    t.api.set_mute_watches(false);
}

#[test]
fn retry_after_is_honoured() {
    nftproxy_tests::require_root!();
    let t = topology();
    let _agent = with_web(&t);
    t.api.set_retry_after(Some(Duration::from_secs(4)));
    t.api.set_fail("services", Some(503));
    t.api.drop_connections();
    let failing = Instant::now();
    std::thread::sleep(Duration::from_secs(10));
    t.api.set_fail("services", None);
    t.api.apply(service("new", "172.30.0.20")).unwrap();
    t.api.apply(slice("new", &["10.180.2.1"])).unwrap();
    until(
        &t,
        "172.30.0.20:80",
        &endpoints(&["10.180.2.1:80"]),
        Duration::from_secs(7),
    );
    let log = t.api.requests();
    let asked: Vec<&RequestLog> = log
        .iter()
        .filter(|r| r.at >= failing && r.path() == COLLECTIONS[0])
        .collect();
    let refused: Vec<&&RequestLog> = asked.iter().filter(|r| r.status == Some(503)).collect();
    assert!(refused.len() >= 2, "{asked:#?}");
    for pair in asked.windows(2).filter(|p| p[0].status == Some(503)) {
        let gap = pair[1].at - pair[0].at;
        assert!(
            gap >= Duration::from_millis(3900),
            "asked again {gap:?} after a Retry-After of 4 s"
        );
    }
}
