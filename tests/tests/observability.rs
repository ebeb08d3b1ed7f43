//! Observability of the real `nftproxy` binary in a network-namespace lab: a real Prometheus
//! scraping `/metrics` (kube-proxy's sync histogram and `no_local_endpoints` gauge, `promtool`),
//! `/healthz` and `/livez` through first sync, node deletion and failing syncs, a per-Service
//! health-check node port (body and headers byte for byte, terminating endpoints, closing), and
//! that port under a slow-loris client, 1,000 concurrent connections and garbage.
//!
//! Failing syncs are made by taking nftproxy's table away from it: in the node's namespace an
//! `nft -i` session deletes `table ip nftproxy` and re-creates it with `flags owner` in the
//! same transaction. While that session lives the kernel refuses every change to the table from
//! any other netlink socket (EPERM), so each of the agent's syncs fails; nothing outside the
//! namespace is touched, and killing the session (by PID) removes the owned table with it, after
//! which the agent repairs the table on its next sync.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nftproxy_tests::{Lab, Ns, Proc, ip, target_binary};
use serde_json::Value;

#[path = "observability/helpers.rs"]
mod helpers;

use self::helpers::*;

// ---------------------------------------------------------------------------------------------
// Cluster files.

const NODE: &str = "\
- apiVersion: v1
  kind: Node
  metadata: {name: test-node}
  status:
    addresses:
    - {type: InternalIP, address: 192.168.0.2}
";

const DELETING_NODE: &str = "\
- apiVersion: v1
  kind: Node
  metadata: {name: test-node, deletionTimestamp: \"2026-01-01T00:00:00Z\", finalizers: [x]}
  status:
    addresses:
    - {type: InternalIP, address: 192.168.0.2}
";

/// A ClusterIP Service with `internalTrafficPolicy: Local` and endpoints on other nodes, plus
/// one on this node when `local` is set.
fn itp_local_cluster(local: bool) -> String {
    let mut eps = String::from(
        "  - {addresses: [10.180.1.1], nodeName: node-1}\n  - {addresses: [10.180.2.1], nodeName: node-2}\n",
    );
    if local {
        eps.push_str("  - {addresses: [10.180.0.1], nodeName: test-node}\n");
    }
    format!(
        "apiVersion: v1\nkind: List\nitems:\n{NODE}\
- apiVersion: v1
  kind: Service
  metadata: {{name: itp, namespace: ns1}}
  spec:
    clusterIP: 172.30.0.41
    internalTrafficPolicy: Local
    ports: [{{name: http, port: 80, protocol: TCP}}]
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {{name: itp-a, namespace: ns1, labels: {{kubernetes.io/service-name: itp}}}}
  addressType: IPv4
  ports: [{{name: http, port: 80, protocol: TCP}}]
  endpoints:
{eps}"
    )
}

/// A Service with an invalid cluster IP (skipped, counted in `nftproxy_invalid_objects`).
const INVALID: &str = "\
- apiVersion: v1
  kind: Service
  metadata: {name: broken, namespace: ns1}
  spec:
    clusterIP: 172.30.0.999
    ports: [{name: http, port: 80, protocol: TCP}]
";

const HC_PORT: u16 = 30100;

/// An `externalTrafficPolicy: Local` LoadBalancer Service with health-check node port
/// [`HC_PORT`]: two endpoints on this node (ready, or terminating) and one elsewhere; without
/// the Service when `service` is false.
fn lb_cluster(node: &str, local_terminating: bool, service: bool) -> String {
    let local = if local_terminating {
        "conditions: {ready: false, serving: true, terminating: true}"
    } else {
        "conditions: {ready: true}"
    };
    let svc = if service {
        format!(
            "\
- apiVersion: v1
  kind: Service
  metadata: {{name: web, namespace: shop}}
  spec:
    type: LoadBalancer
    clusterIP: 172.30.0.50
    externalTrafficPolicy: Local
    healthCheckNodePort: {HC_PORT}
    ports: [{{name: http, port: 80, protocol: TCP, nodePort: 31080}}]
  status:
    loadBalancer:
      ingress: [{{ip: 198.51.100.10}}]
"
        )
    } else {
        String::new()
    };
    format!(
        "apiVersion: v1\nkind: List\nitems:\n{node}{svc}\
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {{name: web-a, namespace: shop, labels: {{kubernetes.io/service-name: web}}}}
  addressType: IPv4
  ports: [{{name: http, port: 80, protocol: TCP}}]
  endpoints:
  - {{addresses: [10.180.0.1], nodeName: test-node, {local}}}
  - {{addresses: [10.180.0.2], nodeName: test-node, {local}}}
  - {{addresses: [10.180.3.1], nodeName: node-3, conditions: {{ready: true}}}}
"
    )
}

// ---------------------------------------------------------------------------------------------
// Tests.

/// `promtool check metrics` accepts the exposition. Its only lint complaint may be the one every
/// kube-proxy gets: the gauge `kubeproxy_sync_proxy_rules_no_local_endpoints_total` keeps
/// kube-proxy's name although it ends in `_total`. Exit status 3 means lint findings only; a
/// parse error is status 1.
fn promtool_accepts(exposition: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package prometheus)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(exposition.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let findings: Vec<&str> = report.lines().filter(|l| !l.trim().is_empty()).collect();
    match out.status.code() {
        Some(0) => {}
        Some(3) => {
            for f in &findings {
                assert!(
                    f.starts_with("kubeproxy_sync_proxy_rules_no_local_endpoints_total ")
                        && f.contains("_total"),
                    "promtool: unexpected finding {f:?}\n{report}"
                );
            }
        }
        other => panic!("promtool check metrics failed ({other:?}):\n{report}\n{exposition}"),
    }
}

#[test]
fn prometheus_scrapes_kube_proxy_metrics() {
    nftproxy_tests::require_root!();
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let agent = Agent::start(&node, &format!("{}{INVALID}", itp_local_cluster(false)));
    let prom = Prometheus::start(&node);

    // The scrape works and the sync histogram has samples.
    prom.wait_value("up{job=\"nftproxy\"}", 1.0);
    let count = wait_for(
        "sync duration samples",
        Duration::from_secs(20),
        || match prom.query("sum(kubeproxy_sync_proxy_rules_duration_seconds_count)") {
            Ok(s) if s.len() == 1 && s[0].1 >= 1.0 => Ok(s[0].1),
            other => Err(format!("{other:?}")),
        },
    );
    assert!(count >= 1.0);
    let buckets = prom
        .query("kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\"}")
        .unwrap();
    assert_eq!(buckets.len(), 16, "15 buckets and +Inf: {buckets:?}");
    assert!(
        buckets
            .iter()
            .any(|(l, _)| l.get("le").map(String::as_str) == Some("16.384"))
    );

    // iTP=Local with only remote endpoints: one Service without a local endpoint...
    let internal = "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\",ip_family=\"IPv4\"}";
    let external = "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\",ip_family=\"IPv4\"}";
    prom.wait_value(internal, 1.0);
    prom.wait_value(external, 0.0);
    // ...until a local endpoint appears in the followed file.
    agent.rewrite(&format!("{}{INVALID}", itp_local_cluster(true)));
    prom.wait_value(internal, 0.0);
    assert_eq!(prom.query(external).unwrap()[0].1, 0.0);

    // nftproxy's own: the invalid Service, the objects it owns, a repaired drift.
    prom.wait_value(
        "nftproxy_invalid_objects{kind=\"Service\",reason=\"invalid_ip\"}",
        1.0,
    );
    let chains = prom
        .query("nftproxy_kernel_objects{ip_family=\"IPv4\",type=\"chains\"}")
        .unwrap();
    assert!(chains.len() == 1 && chains[0].1 >= 10.0, "{chains:?}");
    node.exec(&["nft", "flush", "chain", "ip", "nftproxy", "services"])
        .unwrap();
    prom.wait_value("nftproxy_drift_repairs_total{ip_family=\"IPv4\"}", 1.0);
    let services = node
        .exec(&["nft", "list", "chain", "ip", "nftproxy", "services"])
        .unwrap();
    assert!(
        services.contains("vmap @service-ips"),
        "not repaired:\n{services}"
    );

    let exposition = get(&node, METRICS.parse().unwrap(), "/metrics").unwrap();
    assert_eq!(exposition.status, 200);
    assert_eq!(
        exposition.header("Content-Type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    for line in [
        "# HELP kubeproxy_sync_proxy_rules_duration_seconds [ALPHA] SyncProxyRules latency in seconds\n",
        "# TYPE kubeproxy_sync_proxy_rules_no_local_endpoints_total gauge\n",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"internal\"} 0\n",
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.001\"} ",
    ] {
        assert!(
            exposition.body.contains(line),
            "missing {line:?}:\n{}",
            exposition.body
        );
    }
    promtool_accepts(&exposition.body);
    drop(prom);
    drop(agent);
}

fn health(node: &Ns, path: &str) -> Result<(u16, Value, HttpResponse), String> {
    let r = get(node, HEALTHZ.parse().unwrap(), path)?;
    let v: Value = serde_json::from_str(&r.body).map_err(|e| format!("{e}: {:?}", r.body))?;
    Ok((r.status, v, r))
}

#[test]
fn healthz_and_livez_follow_syncs_node_deletion_and_failures() {
    nftproxy_tests::require_root!();
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let agent = Agent::start(&node, &itp_local_cluster(false));

    // After the first sync: both 200, kube-proxy's JSON and headers.
    let (code, v, r) = health(&node, "/healthz").unwrap();
    assert_eq!(code, 200, "{v}");
    assert_eq!(r.header("Content-Type"), Some("application/json"));
    assert_eq!(r.header("X-Content-Type-Options"), Some("nosniff"));
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "currentTime",
            "healthy",
            "lastUpdated",
            "nodeEligible",
            "status"
        ],
        "{v}"
    );
    assert!(
        r.body.starts_with("{\"lastUpdated\":\""),
        "key order: {}",
        r.body
    );
    assert_eq!(v["nodeEligible"], true);
    assert_eq!(v["healthy"], true);
    assert_eq!(v["status"]["IPv4"]["healthy"], true);
    assert_eq!(v["status"]["IPv6"]["healthy"], true);
    let (code, v, _) = health(&node, "/livez").unwrap();
    assert_eq!(code, 200, "{v}");
    assert!(v.get("nodeEligible").is_none(), "{v}");
    let r = get(&node, HEALTHZ.parse().unwrap(), "/other").unwrap();
    assert_eq!(r.status, 404, "{r:?}");

    // The Node gets a deletion timestamp: /healthz 503 (not eligible), /livez still 200.
    agent.rewrite(&itp_local_cluster(false).replace(NODE, DELETING_NODE));
    wait_for(
        "/healthz 503 for a deleting node",
        Duration::from_secs(10),
        || match health(&node, "/healthz") {
            Ok((503, v, _)) if v["nodeEligible"] == false && v["healthy"] == true => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    let (code, v, _) = health(&node, "/livez").unwrap();
    assert_eq!(code, 200, "{v}");

    // Syncs fail (another netlink socket owns `table ip nftproxy`) while a change is queued:
    // past 2 x syncPeriod both answer 503.
    let mut cmd = node.command("nft");
    cmd.arg("-i");
    let mut owner = Piped::spawn(cmd);
    // The table's deletion is a foreign change the drift monitor queues a sync for, so the
    // 2 s timeout can start here, before the rewrite below.
    let failed_at = Instant::now();
    owner.send("delete table ip nftproxy; add table ip nftproxy { flags owner ; }\n");
    wait_for("the owned table", Duration::from_secs(5), || {
        match node.exec(&["nft", "list", "table", "ip", "nftproxy"]) {
            Ok(t) if t.contains("flags owner") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    let failures_before = agent.log_count("sync failed");
    agent.rewrite(&itp_local_cluster(true));
    wait_for(
        "both 503 after failing syncs",
        Duration::from_secs(10),
        || match (health(&node, "/healthz"), health(&node, "/livez")) {
            (Ok((503, h, _)), Ok((503, l, _)))
                if h["healthy"] == false && l["healthy"] == false =>
            {
                Ok((h, l))
            }
            other => Err(format!("{other:?}")),
        },
    );
    assert!(
        failed_at.elapsed() >= Duration::from_secs(1),
        "unhealthy only past the 2 s timeout, was after {:?}",
        failed_at.elapsed()
    );
    assert!(agent.log_count("sync failed") > failures_before);
    let m = get(&node, METRICS.parse().unwrap(), "/metrics")
        .unwrap()
        .body;
    let failures: f64 = m
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family=\"IPv4\"} ",
            )
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no sync failure counter:\n{m}"));
    assert!(failures >= 1.0);
    assert!(m.contains("kubeproxy_proxy_healthz_total{code=\"503\"} "));
    assert!(m.contains("kubeproxy_proxy_livez_total{code=\"503\"} "));

    // The owner goes away (its table with it); the next retry succeeds: healthy again.
    drop(owner);
    wait_for("recovery", Duration::from_secs(10), || {
        match (health(&node, "/healthz"), health(&node, "/livez")) {
            (Ok((200, _, _)), Ok((200, _, _))) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    let table = node
        .exec(&["nft", "list", "table", "ip", "nftproxy"])
        .unwrap();
    assert!(table.contains("10.180.0.1"), "repaired table:\n{table}");
}

/// A node (192.168.0.2 on its uplink) with a load balancer's prober on the other side.
fn lb_lab() -> (Lab, Ns, Ns) {
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let prober = lab
        .external(&node, "lb", &[ip("203.0.113.2")], &[ip("192.168.0.2")])
        .unwrap();
    (lab, node, prober)
}

fn hc_addr() -> SocketAddr {
    SocketAddr::new(ip("192.168.0.2"), HC_PORT)
}

fn expected_hc_body(count: usize) -> String {
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": \"shop\",\n\t\t\"name\": \"web\"\n\t}},\n\t\
         \"localEndpoints\": {count},\n\t\"serviceProxyHealthy\": true\n}}"
    )
}

/// Status, body and headers of a health-check answer, byte for byte (`Date` by form).
fn assert_hc_answer(r: &HttpResponse, status: u16, count: usize) {
    assert_eq!(r.status, status, "{r:?}");
    assert_eq!(r.body, expected_hc_body(count));
    let names: Vec<&str> = r.headers.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "Content-Type",
            "X-Content-Type-Options",
            "X-Load-Balancing-Endpoint-Weight",
            "Date",
            "Content-Length",
            "Connection",
        ],
        "{r:?}"
    );
    assert_eq!(r.header("Content-Type"), Some("application/json"));
    assert_eq!(r.header("X-Content-Type-Options"), Some("nosniff"));
    assert_eq!(
        r.header("X-Load-Balancing-Endpoint-Weight"),
        Some(count.to_string().as_str())
    );
    assert_eq!(
        r.header("Content-Length"),
        Some(expected_hc_body(count).len().to_string().as_str())
    );
    assert!(r.header("Date").unwrap().ends_with(" GMT"), "{r:?}");
}

#[test]
fn health_check_node_port_counts_local_ready_endpoints() {
    nftproxy_tests::require_root!();
    let (_lab, node, prober) = lb_lab();
    let agent = Agent::start(&node, &lb_cluster(NODE, false, true));

    let r = wait_for(
        "the health-check node port",
        Duration::from_secs(10),
        || get(&prober, hc_addr(), "/healthz"),
    );
    assert_hc_answer(&r, 200, 2);
    // Any path, any method.
    let r = in_netns(prober.name(), || {
        let mut s = TcpStream::connect(hc_addr()).unwrap();
        s.write_all(b"POST /anything?x=1 HTTP/1.1\r\nHost: lb\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        parse_response(&raw).unwrap()
    });
    assert_hc_answer(&r, 200, 2);

    // Both local endpoints terminating (still serving): 503, 0.
    agent.rewrite(&lb_cluster(NODE, true, true));
    let r = wait_for(
        "503 with 0 local endpoints",
        Duration::from_secs(10),
        || match get(&prober, hc_addr(), "/") {
            Ok(r) if r.status == 503 => Ok(r),
            other => Err(format!("{other:?}")),
        },
    );
    assert_hc_answer(&r, 503, 0);

    // The Service is deleted: the port stops listening.
    agent.rewrite(&lb_cluster(NODE, true, false));
    wait_for(
        "the port to close",
        Duration::from_secs(10),
        || match in_netns(prober.name(), || {
            TcpStream::connect_timeout(&hc_addr(), Duration::from_secs(1))
        }) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    agent.wait_log("closing health-check node port");
}

#[test]
fn health_check_node_port_withstands_bad_clients() {
    nftproxy_tests::require_root!();
    raise_fd_limit();
    let (_lab, node, prober) = lb_lab();
    let agent = Agent::start(&node, &lb_cluster(NODE, false, true));
    wait_for(
        "the health-check node port",
        Duration::from_secs(10),
        || get(&prober, hc_addr(), "/"),
    );

    let report = in_netns(prober.name(), move || {
        let addr = hc_addr();
        // A slow-loris client: a request head that never ends, one byte at a time.
        let mut loris = TcpStream::connect(addr).unwrap();
        loris.write_all(b"GET / HTTP/1.1\r\nHost: lb\r\n").unwrap();
        let loris_start = Instant::now();
        let loris_reader = loris.try_clone().unwrap();
        let dribble = std::thread::spawn(move || {
            for _ in 0..40 {
                if loris.write_all(b"X").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        // 1,000 concurrent connections, each with half a request.
        let mut idle = Vec::new();
        for i in 0..1000 {
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
                .unwrap_or_else(|e| panic!("connection {i}: {e}"));
            let _ = s.write_all(b"GET / HTTP/1.1\r\n");
            idle.push(s);
        }
        // Garbage and an oversized head get an error answer or a closed connection.
        let mut garbage = TcpStream::connect(addr).unwrap();
        garbage
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let noise: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let _ = garbage.write_all(&noise);
        let mut answer = Vec::new();
        let _ = garbage.read_to_end(&mut answer);
        let mut big = TcpStream::connect(addr).unwrap();
        big.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = big.write_all(b"GET / HTTP/1.1\r\nHost: lb\r\nX-Big: ");
        let _ = big.write_all(&vec![b'a'; 64 * 1024]);
        let _ = big.write_all(b"\r\n\r\n");
        let mut big_answer = Vec::new();
        let _ = big.read_to_end(&mut big_answer);
        // Meanwhile a normal client is answered fast.
        let mut latencies = Vec::new();
        for _ in 0..20 {
            let start = Instant::now();
            let r = get_here(addr, "/", Duration::from_secs(5)).unwrap();
            latencies.push(start.elapsed());
            assert_eq!(r.status, 200);
            assert_eq!(r.body, expected_hc_body(2));
        }
        // The slow-loris connection is closed by the server's header read timeout.
        loris_reader
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut buf = [0u8; 1024];
        let mut r = &loris_reader;
        let closed = match r.read(&mut buf) {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        };
        let loris_closed_after = loris_start.elapsed();
        let _ = loris_reader.shutdown(Shutdown::Both);
        dribble.join().unwrap();
        drop(idle);
        (
            latencies,
            String::from_utf8_lossy(&answer[..answer.len().min(40)]).to_string(),
            String::from_utf8_lossy(&big_answer[..big_answer.len().min(40)]).to_string(),
            closed,
            loris_closed_after,
        )
    });
    let (latencies, garbage_answer, big_answer, loris_closed, loris_after) = report;
    let worst = latencies.iter().max().unwrap();
    eprintln!(
        "health answers under load: worst {worst:?}, median {:?}; garbage -> {garbage_answer:?}; \
         64 KiB header -> {big_answer:?}; slow-loris closed after {loris_after:?}",
        {
            let mut l = latencies.clone();
            l.sort();
            l[l.len() / 2]
        }
    );
    assert!(
        *worst < Duration::from_millis(100),
        "a health answer took {worst:?}: {latencies:?}"
    );
    assert!(
        garbage_answer.is_empty() || garbage_answer.starts_with("HTTP/1.1 400"),
        "{garbage_answer:?}"
    );
    assert!(
        big_answer.is_empty() || big_answer.starts_with("HTTP/1.1 431"),
        "{big_answer:?}"
    );
    assert!(loris_closed, "the slow-loris connection stayed open");
    assert!(
        loris_after < Duration::from_secs(9),
        "slow-loris closed only after {loris_after:?}"
    );
    // Still serving afterwards, and the agent is alive.
    let r = get(&prober, hc_addr(), "/").unwrap();
    assert_hc_answer(&r, 200, 2);
    drop(agent);
}

#[test]
fn cluster_files_are_valid_yaml() {
    // Guards the format! templates above: every variant parses as a Kubernetes List.
    for text in [
        format!("{}{INVALID}", itp_local_cluster(false)),
        itp_local_cluster(true),
        lb_cluster(NODE, false, true),
        lb_cluster(DELETING_NODE, true, false),
    ] {
        let v: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert!(v["items"].as_sequence().is_some_and(|s| !s.is_empty()));
    }
}
