//! kube-proxy's packet-flow tables, run through the builder and the packet tracer.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};

use nftproxy_dataplane::convert;
use nftproxy_dataplane::model::Cluster;
use nftproxy_dataplane::nft::build::shared::{self, SERVICE_ENDPOINTS, SERVICE_TARGET_PORTS};
use nftproxy_dataplane::nft::build::{
    BuildConfig, EXTERNAL_TO_CLUSTER_IPS, LocalDetector, NODEPORT_TO_CLUSTER_IPS,
    NODEPORT_TO_SERVICE_PORTS, build,
};
use nftproxy_dataplane::nft::ruleset::{Family, Key, Proto};
use nftproxy_dataplane::trace::{Host, Outcome, Packet, trace};

fn fixture() -> Cluster {
    let text = include_str!("../../tests/fixtures/cluster-ip.yaml");
    let (objects, skipped) = nftproxy_dataplane::input::parse_yaml(text).unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    let (cluster, skipped) = convert::cluster(&objects, "test-node", "");
    assert!(skipped.is_empty(), "{skipped:?}");
    cluster
}

fn config() -> BuildConfig {
    BuildConfig {
        node_name: "test-node".into(),
        local_detector: LocalDetector::ClusterCidr(vec![
            "10.0.0.0/8".parse().unwrap(),
            "fd00:10::/32".parse().unwrap(),
        ]),
        ..BuildConfig::default()
    }
}

/// This node (test-node, 192.168.0.2) and `items` (YAML list items), as a cluster.
fn with_node(items: &[String]) -> Cluster {
    let node = "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Node\n  \
                metadata: {name: test-node}\n  \
                status: {addresses: [{type: InternalIP, address: 192.168.0.2}]}\n";
    let (objects, skipped) =
        nftproxy_dataplane::input::parse_yaml(&(node.to_string() + &items.concat())).unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    let (cluster, skipped) = convert::cluster(&objects, "test-node", "");
    assert!(skipped.is_empty(), "{skipped:?}");
    cluster
}

/// `expected`: "REJECT", "DROP", "" (untouched) or a comma-separated endpoint list.
fn check(cluster: &Cluster, src: &str, proto: Proto, dst: &str, expected: &str, masq: bool) {
    let src: IpAddr = src.parse().unwrap();
    let dst: SocketAddr = dst.parse().unwrap();
    let family = Family::of(&src);
    let table = build(cluster, &config(), family).table;
    let host = Host {
        local_addresses: vec![
            "192.168.0.2".parse().unwrap(),
            "2001:db8::1".parse().unwrap(),
        ],
    };
    let t = trace(
        &table,
        &host,
        &Packet {
            src,
            dst,
            proto,
            iif: None,
        },
    );
    let want: BTreeSet<Outcome> = match expected {
        "REJECT" => [Outcome::Reject].into(),
        "DROP" => [Outcome::Drop].into(),
        "" => [Outcome::Untouched].into(),
        list => list
            .split(", ")
            .map(|a| Outcome::Endpoint {
                addr: a.parse().unwrap(),
                masquerade: masq,
            })
            .collect(),
    };
    assert_eq!(t.outcomes, want, "{src} -> {dst} ({proto})");
}

#[test]
fn cluster_ip_general_ipv4() {
    let c = fixture();
    use Proto::*;
    check(
        &c,
        "10.180.0.2",
        Tcp,
        "172.30.0.41:80",
        "10.180.0.1:80",
        false,
    );
    check(
        &c,
        "10.180.0.1",
        Tcp,
        "172.30.0.41:80",
        "10.180.0.1:80",
        true,
    );
    check(
        &c,
        "10.180.0.2",
        Tcp,
        "172.30.0.42:80",
        "10.180.0.1:80, 10.180.2.1:80",
        false,
    );
    check(
        &c,
        "10.180.0.2",
        Tcp,
        "172.30.0.42:443",
        "10.180.0.1:8443, 10.180.2.1:8443",
        false,
    );
    check(
        &c,
        "10.180.0.2",
        Tcp,
        "172.30.0.42:53",
        "10.180.0.1:5353, 10.180.2.1:5353",
        false,
    );
    check(
        &c,
        "10.180.0.2",
        Udp,
        "172.30.0.42:53",
        "10.180.0.1:53, 10.180.2.1:53",
        false,
    );
    check(
        &c,
        "10.180.0.2",
        Sctp,
        "172.30.0.42:53",
        "10.180.0.1:53, 10.180.2.1:53",
        false,
    );
    check(&c, "10.180.0.2", Udp, "172.30.0.42:80", "REJECT", false);
    check(&c, "10.180.0.2", Tcp, "172.30.0.41:443", "REJECT", false);
    check(&c, "10.180.0.2", Tcp, "172.30.0.50:80", "DROP", false);
    // From outside the cluster CIDR: masqueraded. From the node itself: output hooks, same.
    check(
        &c,
        "203.0.113.2",
        Tcp,
        "172.30.0.41:80",
        "10.180.0.1:80",
        true,
    );
    check(
        &c,
        "192.168.0.2",
        Tcp,
        "172.30.0.41:80",
        "10.180.0.1:80",
        true,
    );
    check(&c, "192.168.0.2", Tcp, "172.30.0.50:80", "DROP", false);
}

#[test]
fn cluster_ip_general_ipv6() {
    let c = fixture();
    use Proto::*;
    let two = |p: u16| format!("[fd00:10:180::1]:{p}, [fd00:10:180::2:1]:{p}");
    check(
        &c,
        "fd00:10:180::2",
        Tcp,
        "[fd00:172:30::41]:80",
        "[fd00:10:180::1]:80",
        false,
    );
    check(
        &c,
        "fd00:10:180::1",
        Tcp,
        "[fd00:172:30::41]:80",
        "[fd00:10:180::1]:80",
        true,
    );
    check(
        &c,
        "fd00:10:180::2",
        Tcp,
        "[fd00:172:30::42]:80",
        &two(80),
        false,
    );
    check(
        &c,
        "fd00:10:180::2",
        Tcp,
        "[fd00:172:30::42]:443",
        &two(8443),
        false,
    );
    check(
        &c,
        "fd00:10:180::2",
        Tcp,
        "[fd00:172:30::42]:53",
        &two(5353),
        false,
    );
    check(
        &c,
        "fd00:10:180::2",
        Udp,
        "[fd00:172:30::42]:53",
        &two(53),
        false,
    );
    check(
        &c,
        "fd00:10:180::2",
        Sctp,
        "[fd00:172:30::42]:53",
        &two(53),
        false,
    );
    check(
        &c,
        "fd00:10:180::2",
        Udp,
        "[fd00:172:30::42]:80",
        "REJECT",
        false,
    );
    check(
        &c,
        "fd00:10:180::2",
        Tcp,
        "[fd00:172:30::41]:443",
        "REJECT",
        false,
    );
    check(
        &c,
        "fd00:10:180::2",
        Tcp,
        "[fd00:172:30::50]:80",
        "DROP",
        false,
    );
}

#[test]
fn dual_stack_and_no_endpoints() {
    let c = fixture();
    use Proto::*;
    check(
        &c,
        "10.180.0.2",
        Tcp,
        "172.30.0.43:80",
        "10.180.0.1:80, 10.180.2.1:80",
        false,
    );
    let both6 = "[fd00:10:180::1]:80, [fd00:10:180::2:1]:80";
    check(
        &c,
        "fd00:10:180::2",
        Tcp,
        "[fd00:172:30::43]:80",
        both6,
        false,
    );
    check(&c, "10.180.0.2", Tcp, "172.30.0.44:80", "REJECT", false);
    check(&c, "203.0.113.2", Tcp, "192.168.99.11:80", "REJECT", false);
    check(&c, "10.180.0.2", Tcp, "192.168.0.2:3001", "REJECT", false);
    check(&c, "203.0.113.2", Tcp, "192.168.0.2:3001", "REJECT", false);
    check(&c, "10.180.0.2", Tcp, "1.2.3.4:80", "REJECT", false);
    check(&c, "203.0.113.2", Tcp, "1.2.3.4:80", "REJECT", false);
    // The node to its own NodePort: output hooks, then (loopback) the input hook, whose
    // NodePort no-endpoint check rejects it, as the kernel does.
    check(&c, "192.168.0.2", Tcp, "192.168.0.2:3001", "REJECT", false);
}

/// The flat path for large Services: a LoadBalancer Service with 60 endpoints (20 on this node,
/// externalTrafficPolicy Local) and a NodePort Service with 40, traced through the draws.
#[test]
fn large_services_reach_every_endpoint_through_the_draws() {
    let eps = |n: usize| -> String {
        (0..n)
            .map(|i| {
                let node = if i % 3 == 0 { "test-node" } else { "other" };
                format!(
                    "  - {{addresses: [10.180.{}.{}], conditions: {{ready: true}}, nodeName: {node}}}\n",
                    i / 200,
                    i % 200 + 1
                )
            })
            .collect()
    };
    let text = format!(
        "apiVersion: v1\nkind: List\nitems:\n\
         - apiVersion: v1\n  kind: Node\n  metadata: {{name: test-node}}\n  status:\n    addresses: [{{type: InternalIP, address: 192.168.0.2}}]\n\
         - apiVersion: v1\n  kind: Service\n  metadata: {{name: web, namespace: ns}}\n  spec:\n    type: LoadBalancer\n    externalTrafficPolicy: Local\n    healthCheckNodePort: 32000\n    clusterIPs: [172.30.0.10]\n    ports: [{{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}}]\n  status: {{loadBalancer: {{ingress: [{{ip: 5.6.7.8}}]}}}}\n\
         - apiVersion: v1\n  kind: Service\n  metadata: {{name: dns, namespace: ns}}\n  spec:\n    type: NodePort\n    clusterIPs: [172.30.0.11]\n    ports: [{{name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 30053}}]\n\
         - apiVersion: discovery.k8s.io/v1\n  kind: EndpointSlice\n  metadata: {{name: web-a, namespace: ns, labels: {{kubernetes.io/service-name: web}}}}\n  addressType: IPv4\n  ports: [{{name: http, port: 8080, protocol: TCP}}]\n  endpoints:\n{}\
         - apiVersion: discovery.k8s.io/v1\n  kind: EndpointSlice\n  metadata: {{name: dns-a, namespace: ns, labels: {{kubernetes.io/service-name: dns}}}}\n  addressType: IPv4\n  ports: [{{name: dns, port: 5353, protocol: UDP}}]\n  endpoints:\n{}",
        eps(60),
        eps(40)
    );
    let (objects, skipped) = nftproxy_dataplane::input::parse_yaml(&text).unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    let (cluster, skipped) = convert::cluster(&objects, "test-node", "");
    assert!(skipped.is_empty(), "{skipped:?}");
    let table = build(&cluster, &config(), Family::V4).table;
    let host = Host {
        local_addresses: vec!["192.168.0.2".parse().unwrap()],
    };
    let endpoints = |n: usize, port: u16, only_local: bool| -> BTreeSet<SocketAddr> {
        (0..n)
            .filter(|i| !only_local || i % 3 == 0)
            .map(|i| {
                SocketAddr::new(
                    IpAddr::from([10, 180, (i / 200) as u8, (i % 200 + 1) as u8]),
                    port,
                )
            })
            .collect()
    };
    for (src, proto, dst, want, masquerade) in [
        // From a pod: all 60, the source kept.
        (
            "10.99.0.1",
            Proto::Tcp,
            "172.30.0.10:80",
            endpoints(60, 8080, false),
            false,
        ),
        // From outside the pod network: all 60, masqueraded.
        (
            "192.168.5.5",
            Proto::Tcp,
            "172.30.0.10:80",
            endpoints(60, 8080, false),
            true,
        ),
        // Load-balancer IP and NodePort, externalTrafficPolicy Local: this node's 20, the
        // source kept.
        (
            "203.0.113.9",
            Proto::Tcp,
            "5.6.7.8:80",
            endpoints(60, 8080, true),
            false,
        ),
        (
            "203.0.113.9",
            Proto::Tcp,
            "192.168.0.2:30080",
            endpoints(60, 8080, true),
            false,
        ),
        // From a pod to the load-balancer IP: short-circuited to all 60.
        (
            "10.99.0.1",
            Proto::Tcp,
            "5.6.7.8:80",
            endpoints(60, 8080, false),
            false,
        ),
        // NodePort, externalTrafficPolicy Cluster: all 40, masqueraded.
        (
            "203.0.113.9",
            Proto::Udp,
            "192.168.0.2:30053",
            endpoints(40, 5353, false),
            true,
        ),
    ] {
        let pkt = Packet {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            proto,
            iif: None,
        };
        let t = trace(&table, &host, &pkt);
        let got: BTreeSet<Outcome> = want
            .iter()
            .map(|addr| Outcome::Endpoint {
                addr: *addr,
                masquerade,
            })
            .collect();
        assert_eq!(t.outcomes, got, "{src} -> {dst}");
        assert!(t.redraws, "{src} -> {dst}");
        assert!(
            t.chains
                .iter()
                .any(|c| c.starts_with("big-") && c.contains("-draw-")),
            "{:?}",
            t.chains
        );
    }
}

/// External IPs, load-balancer IPs and TCP NodePorts whose traffic goes to the ClusterIP's
/// endpoints share the ClusterIP's list (the destination is rewritten first); the others keep
/// lists of their own.
#[test]
fn external_destinations_share_the_cluster_ip_list_when_their_endpoints_agree() {
    // Service n: ClusterIP 172.30.0.n, load-balancer IP 5.6.7.n, NodePort 300n, an endpoint on
    // this node (10.180.n.1) and one elsewhere (10.180.n.2).
    let service = |name: &str, n: u8, extra: &str| {
        let proto = if name == "udp" { "UDP" } else { "TCP" };
        format!(
            "- apiVersion: v1
  kind: Service
  metadata: {{name: {name}, namespace: ns}}
  spec:
    type: LoadBalancer
    clusterIP: 172.30.0.{n}
    ports: [{{name: p, port: 80, protocol: {proto}, nodePort: 300{n}}}]
    {extra}
  status: {{loadBalancer: {{ingress: [{{ip: 5.6.7.{n}}}]}}}}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {{name: {name}-a, namespace: ns, labels: {{kubernetes.io/service-name: {name}}}}}
  addressType: IPv4
  ports: [{{name: p, port: 8080, protocol: {proto}}}]
  endpoints:
  - {{addresses: [10.180.{n}.1], nodeName: test-node}}
  - {{addresses: [10.180.{n}.2], nodeName: node2}}
"
        )
    };
    let c = with_node(&[
        service("plain", 51, "externalIPs: [5.6.8.51]"),
        service("local", 52, "externalTrafficPolicy: Local"),
        service("sticky", 53, "sessionAffinity: ClientIP"),
        service("inside", 54, "internalTrafficPolicy: Local"),
        service("udp", 55, ""),
    ]);
    let table = build(&c, &config(), Family::V4).table;
    let shared: Vec<String> = table.sets[EXTERNAL_TO_CLUSTER_IPS]
        .elements
        .iter()
        .map(|(k, v)| format!("{k:?} -> {v:?}"))
        .collect();
    assert_eq!(
        shared,
        [
            "AddrProtoPort(5.6.7.51, Tcp, 80) -> Some(Addr(172.30.0.51))",
            "AddrProtoPort(5.6.7.55, Udp, 80) -> Some(Addr(172.30.0.55))",
            "AddrProtoPort(5.6.8.51, Tcp, 80) -> Some(Addr(172.30.0.51))",
        ]
    );
    // A NodePort is rewritten to its ClusterIP and port for TCP only: rewriting a UDP port
    // would break a checksum of 0.
    let nodeports: Vec<String> = [NODEPORT_TO_CLUSTER_IPS, NODEPORT_TO_SERVICE_PORTS]
        .iter()
        .flat_map(|m| table.sets[*m].elements.iter())
        .map(|(k, v)| format!("{k:?} -> {v:?}"))
        .collect();
    assert_eq!(
        nodeports,
        [
            "ProtoPort(Tcp, 30051) -> Some(Addr(172.30.0.51))",
            "ProtoPort(Tcp, 30051) -> Some(Port(80))",
        ]
    );
    let nodeport_lists: BTreeSet<u16> = table
        .sets
        .values()
        .flat_map(|s| s.elements.keys())
        .filter_map(|k| match k.list_destination() {
            Some((Key::ProtoPort(_, port), _)) => Some(port),
            _ => None,
        })
        .collect();
    assert_eq!(nodeport_lists, [30052, 30053, 30054, 30055].into());
    // Only the others' external destinations have lists of their own.
    let lists: BTreeSet<IpAddr> = table
        .sets
        .values()
        .flat_map(|s| s.elements.keys())
        .filter_map(|k| match k.list_destination() {
            Some((Key::AddrProtoPort(ip, ..), _)) => Some(ip),
            _ => None,
        })
        .filter(|ip| !ip.to_string().starts_with("172.30."))
        .collect();
    let want: BTreeSet<IpAddr> = ["5.6.7.52", "5.6.7.53", "5.6.7.54"]
        .map(|a| a.parse().unwrap())
        .into();
    assert_eq!(lists, want);
    // Traffic reaches the same endpoints as before: from outside masqueraded (Cluster policy)
    // but for externalTrafficPolicy Local; the ClusterIPs from a pod.
    use Proto::{Tcp, Udp};
    let (ext, pod) = ("203.0.113.2", "10.1.0.2");
    let both = |n: u8| format!("10.180.{n}.1:8080, 10.180.{n}.2:8080");
    #[rustfmt::skip]
    let flows = [
        (ext, Tcp, "5.6.7.51:80",       both(51),                  true),
        (ext, Tcp, "5.6.8.51:80",       both(51),                  true),
        (ext, Tcp, "5.6.7.52:80",       "10.180.52.1:8080".into(), false),
        (ext, Tcp, "5.6.7.53:80",       both(53),                  true),
        (ext, Tcp, "5.6.7.54:80",       both(54),                  true),
        (ext, Udp, "5.6.7.55:80",       both(55),                  true),
        // NodePorts: the TCP one through the ClusterIP's list, the UDP one through its own.
        (ext, Tcp, "192.168.0.2:30051", both(51),                  true),
        (ext, Udp, "192.168.0.2:30055", both(55),                  true),
        // The ClusterIP the rewrite points at is its own destination still; the one with
        // internalTrafficPolicy Local has this node's endpoint only.
        (pod, Tcp, "172.30.0.51:80",    both(51),                  false),
        (pod, Tcp, "172.30.0.54:80",    "10.180.54.1:8080".into(), false),
    ];
    for (src, proto, dst, want, masq) in flows {
        check(&c, src, proto, dst, &want, masq);
    }
}

/// A TCP NodePort that two Services claim: the trace names the conflict and the Service that
/// keeps it, although the packet reaches the endpoints through the ClusterIP's list.
#[test]
fn trace_names_a_node_port_conflict_through_the_shared_list() {
    let service = |name: &str, n: u8, created: &str| {
        format!(
            "- apiVersion: v1
  kind: Service
  metadata: {{name: {name}, namespace: ns, creationTimestamp: \"{created}\"}}
  spec:
    type: NodePort
    clusterIP: 172.30.0.{n}
    ports: [{{name: p, port: 80, protocol: TCP, nodePort: 30080}}]
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {{name: {name}-a, namespace: ns, labels: {{kubernetes.io/service-name: {name}}}}}
  addressType: IPv4
  ports: [{{name: p, port: 8080, protocol: TCP}}]
  endpoints:
  - {{addresses: [10.180.{n}.1], nodeName: test-node}}
"
        )
    };
    let c = with_node(&[
        service("newer", 61, "2024-01-02T00:00:00Z"),
        service("older", 62, "2024-01-01T00:00:00Z"),
    ]);
    let table = build(&c, &config(), Family::V4).table;
    let host = Host {
        local_addresses: vec!["192.168.0.2".parse().unwrap()],
    };
    let pkt = Packet {
        src: "203.0.113.2".parse().unwrap(),
        dst: "192.168.0.2:30080".parse().unwrap(),
        proto: Proto::Tcp,
        iif: None,
    };
    let mut t = trace(&table, &host, &pkt);
    t.name_services(&c, Family::V4);
    assert_eq!(t.endpoints(), ["10.180.62.1:8080".parse().unwrap()].into());
    assert_eq!(t.shared_list, Some("172.30.0.62:80".parse().unwrap()));
    assert_eq!(t.services, ["ns/older:p".to_string()].into());
    assert_eq!(t.conflicts.len(), 1, "{:?}", t.conflicts);
}

/// The ports of one protocol of a large Service share one address list when their endpoints
/// agree (each port reads its own target port); otherwise each keeps its own list.
#[test]
fn large_services_ports_share_one_address_list_when_their_endpoints_agree() {
    // Service n: ClusterIP 172.30.1.n, load-balancer IP 5.6.9.n, TCP ports 80 (→ 8080) and
    // 443 (→ 8443) with NodePorts 310n0 and 310n1, UDP port 53 (→ 5353); 20 endpoints
    // 10.181.n.1 … 10.181.n.20, `extra_ep` appended to the endpoint list of the slice for
    // port 443 only (when set), `extra` in the spec.
    let service = |name: &str, n: u8, extra: &str, split: bool| {
        let eps: String = (1..=20)
            .map(|i| format!("  - {{addresses: [10.181.{n}.{i}], nodeName: node2}}\n"))
            .collect();
        let slice = |suffix: &str, ports: &str, eps: &str| {
            format!(
                "- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {{name: {name}-{suffix}, namespace: ns, labels: {{kubernetes.io/service-name: {name}}}}}
  addressType: IPv4
  ports: [{ports}]
  endpoints:
{eps}"
            )
        };
        let https = "{name: https, port: 8443, protocol: TCP}";
        let others =
            "{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}";
        let slices = if split {
            // Port 443's endpoints: one more than the others'.
            let more = format!("{eps}  - {{addresses: [10.181.{n}.99], nodeName: node2}}\n");
            slice("a", others, &eps) + &slice("b", https, &more)
        } else {
            slice("a", &format!("{others}, {https}"), &eps)
        };
        format!(
            "- apiVersion: v1
  kind: Service
  metadata: {{name: {name}, namespace: ns}}
  spec:
    type: LoadBalancer
    clusterIP: 172.30.1.{n}
    ports:
    - {{name: http, port: 80, targetPort: http, protocol: TCP, nodePort: 310{n}0}}
    - {{name: https, port: 443, targetPort: https, protocol: TCP, nodePort: 310{n}1}}
    - {{name: dns, port: 53, targetPort: dns, protocol: UDP, nodePort: 310{n}2}}
    {extra}
  status: {{loadBalancer: {{ingress: [{{ip: 5.6.9.{n}}}]}}}}
{slices}"
        )
    };
    let c = with_node(&[
        service("alike", 1, "", false),
        service("split", 2, "", true),
        service("sticky", 3, "sessionAffinity: ClientIP", false),
        service("inside", 4, "internalTrafficPolicy: Local", false),
    ]);
    let table = build(&c, &config(), Family::V4).table;
    let elements = |set: &str| -> Vec<String> {
        table.sets[set]
            .elements
            .iter()
            .map(|(k, v)| format!("{k:?} -> {v:?}"))
            .collect()
    };
    // Only the first Service's TCP ports share (its one UDP port keeps its list).
    assert_eq!(
        elements(SERVICE_TARGET_PORTS),
        [
            "AddrProtoPort(172.30.1.1, Tcp, 80) -> Some(Port(8080))",
            "AddrProtoPort(172.30.1.1, Tcp, 443) -> Some(Port(8443))",
        ]
    );
    assert_eq!(
        elements(shared::class_set(5)),
        ["AddrProto(172.30.1.1, Tcp) -> None"]
    );
    let list = elements(SERVICE_ENDPOINTS);
    assert_eq!(list.len(), 20);
    assert_eq!(
        list[0],
        "AddrProtoIndex(172.30.1.1, Tcp, 0) -> Some(Addr(10.181.1.1))"
    );
    // No list of its own at the ClusterIP for a sharing port; every other port has one, but
    // for internalTrafficPolicy Local without endpoints on this node.
    let own: BTreeSet<(IpAddr, u16)> = table
        .sets
        .values()
        .flat_map(|s| s.elements.keys())
        .filter_map(|k| match k.list_destination() {
            Some((Key::AddrProtoPort(ip, _, port), _))
                if ip.to_string().starts_with("172.30.1.") =>
            {
                Some((ip, port))
            }
            _ => None,
        })
        .collect();
    let want: BTreeSet<(IpAddr, u16)> = [
        (1, 53),
        (2, 53),
        (2, 80),
        (2, 443),
        (3, 53),
        (3, 80),
        (3, 443),
    ]
    .map(|(n, port)| (format!("172.30.1.{n}").parse().unwrap(), port))
    .into();
    assert_eq!(own, want);
    // Traffic: every port reaches all its endpoints with its own target port, from a pod, from
    // outside through the load-balancer IP and the TCP NodePorts.
    use Proto::{Tcp, Udp};
    let (ext, pod) = ("203.0.113.2", "10.1.0.2");
    let all = |n: u8, port: u16, extra: bool| {
        let mut eps: Vec<String> = (1..=20).map(|i| format!("10.181.{n}.{i}:{port}")).collect();
        if extra {
            eps.push(format!("10.181.{n}.99:{port}"));
        }
        eps.join(", ")
    };
    #[rustfmt::skip]
    let flows = [
        (pod, Tcp, "172.30.1.1:80",      all(1, 8080, false), false),
        (pod, Tcp, "172.30.1.1:443",     all(1, 8443, false), false),
        (pod, Udp, "172.30.1.1:53",      all(1, 5353, false), false),
        (ext, Tcp, "5.6.9.1:80",         all(1, 8080, false), true),
        (ext, Tcp, "5.6.9.1:443",        all(1, 8443, false), true),
        (ext, Tcp, "192.168.0.2:31011",  all(1, 8443, false), true),
        (ext, Udp, "192.168.0.2:31012",  all(1, 5353, false), true),
        // A port of the ClusterIP that is no Service port is rejected, as before.
        (pod, Tcp, "172.30.1.1:81",      "REJECT".into(),     false),
        (pod, Tcp, "172.30.1.2:80",      all(2, 8080, false), false),
        (pod, Tcp, "172.30.1.2:443",     all(2, 8443, true),  false),
        (ext, Tcp, "5.6.9.2:443",        all(2, 8443, true),  true),
        (pod, Tcp, "172.30.1.3:443",     all(3, 8443, false), false),
        (pod, Tcp, "172.30.1.4:443",     "DROP".into(),       false),
        (ext, Tcp, "5.6.9.4:443",        all(4, 8443, false), true),
    ];
    for (src, proto, dst, want, masq) in flows {
        check(&c, src, proto, dst, &want, masq);
    }
}
