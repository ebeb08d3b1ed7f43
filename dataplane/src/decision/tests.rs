//! The decisions against kube-proxy's own tables (`pkg/proxy/nftables/proxier_test.go`: the
//! packet-flow tests, `TestNoEndpointsMetric`, `TestHealthCheckNodePortWhenTerminating`), on
//! the decision value alone: no rule is built.

use std::net::IpAddr;
use std::sync::Arc;

use super::*;
use crate::conflicts::suppressed;
use crate::model::{Endpoint, EndpointPort, Hints, Node, ServiceType, Services, Site};
use crate::net::Proto;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

const NODE: &str = "test-node";

/// kube-proxy's test node: `test-node`, primary IP 192.168.0.2, pod CIDR 10.0.0.0/8.
fn env() -> DecisionEnv {
    DecisionEnv {
        family: Family::V4,
        node_name: NODE.into(),
        zone: Some("zone-a".into()),
        node_ip: Some(ip("192.168.0.2")),
        local_traffic: LocalTraffic::Cidr("10.0.0.0/8".parse().unwrap()),
        masquerade_all: false,
    }
}

/// A Service with one port 80/TCP (`p80`).
fn service(cluster_ip: &str, service_type: ServiceType) -> Service {
    Service {
        name: ObjectName::new("ns1", "svc1"),
        service_type,
        cluster_ips: vec![ip(cluster_ip)].into(),
        external_ips: vec![].into(),
        load_balancer_ips: vec![].into(),
        load_balancer_source_ranges: vec![].into(),
        external_policy_local: false,
        internal_policy_local: false,
        health_check_node_port: None,
        affinity_timeout: None,
        ports: vec![ServicePort {
            name: "p80".into(),
            protocol: Proto::Tcp,
            port: 80,
            node_port: None,
        }]
        .into(),
        creation_timestamp: None,
    }
}

/// Endpoint 10.0.1.`last`:80 with conditions written as kube-proxy's tables do: `R`eady,
/// `S`erving, `T`erminating (a missing letter is false), on `node` (None: no nodeName).
fn ep(last: u8, conditions: &str, node: Option<&str>) -> PortEndpoint<'static> {
    PortEndpoint {
        addr: IpAddr::from([10, 0, 1, last]),
        port: 80,
        ready: conditions.contains('R'),
        serving: conditions.contains('S'),
        terminating: conditions.contains('T'),
        placement: Placement::of(node, NODE),
        site: None,
    }
}

fn last_octets(eps: &[PortEndpoint]) -> Vec<u8> {
    eps.iter()
        .map(|e| match e.addr {
            IpAddr::V4(a) => a.octets()[3],
            IpAddr::V6(_) => unreachable!(),
        })
        .collect()
}

fn decide_one<'a>(svc: &'a Service, eps: &[PortEndpoint<'a>]) -> PortDecision<'a> {
    decide(svc, &svc.ports[0], eps.to_vec(), &Suppressed::NONE, &env())
}

/// The endpoints a traffic target reaches, as last octets (None for reject/drop).
fn reached(d: &PortDecision<'_>, target: Target) -> Option<Vec<u8>> {
    match target {
        Target::Cluster => Some(last_octets(d.cluster_endpoints())),
        Target::Local => Some(last_octets(d.local_endpoints())),
        Target::Reject | Target::Drop => None,
    }
}

#[test]
fn no_endpoints_reject_everywhere() {
    // TestNoEndpointsReject: every frontend of a LoadBalancer without endpoints rejects.
    let mut svc = service("172.30.0.41", ServiceType::LoadBalancer);
    Arc::make_mut(&mut svc.ports)[0].node_port = Some(3001);
    svc.external_ips = vec![ip("192.168.99.11")].into();
    svc.load_balancer_ips = vec![ip("1.2.3.4")].into();
    let d = decide_one(&svc, &[]);
    assert_eq!(d.internal, Some(Target::Reject));
    assert_eq!(d.external.map(|e| e.target), Some(Target::Reject));
    assert!(!d.external.unwrap().short_circuit);
    assert_eq!(d.no_local_endpoints, NoLocalEndpoints::default());
    assert_eq!(d.firewall, None);
    let frontends: Vec<(FrontendKind, Frontend, bool)> = d
        .frontends
        .iter()
        .map(|f| (f.kind, f.frontend, f.kept))
        .collect();
    assert_eq!(
        frontends,
        vec![
            (
                FrontendKind::ClusterIp,
                Frontend::Addr(ip("172.30.0.41"), 80),
                true
            ),
            (
                FrontendKind::ExternalIp,
                Frontend::Addr(ip("192.168.99.11"), 80),
                true
            ),
            (
                FrontendKind::LoadBalancerIp,
                Frontend::Addr(ip("1.2.3.4"), 80),
                true
            ),
            (FrontendKind::NodePort, Frontend::NodePort(3001), true),
        ]
    );
}

#[test]
fn internal_traffic_policy() {
    // TestInternalTrafficPolicy: (iTP Local, endpoints as (last octet, node)) -> what pod ->
    // ClusterIP reaches; with the slice deleted, always REJECT.
    type Case = (bool, &'static [(u8, &'static str)], Target, &'static [u8]);
    let cases: &[Case] = &[
        (
            false,
            &[(1, NODE), (2, "node1"), (3, "node2")],
            Target::Cluster,
            &[1, 2, 3],
        ),
        (
            true,
            &[(1, NODE), (2, "node1"), (3, "node2")],
            Target::Local,
            &[1],
        ),
        (
            true,
            &[(1, NODE), (2, NODE), (3, "node2")],
            Target::Local,
            &[1, 2],
        ),
        (
            true,
            &[(1, "node0"), (2, "node1"), (3, "node2")],
            Target::Drop,
            &[],
        ),
    ];
    for (i, (local, eps, target, expected)) in cases.iter().enumerate() {
        let mut svc = service("172.30.1.1", ServiceType::ClusterIp);
        Arc::make_mut(&mut svc.ports)[0].name = "".into();
        svc.internal_policy_local = *local;
        let eps: Vec<PortEndpoint> = eps.iter().map(|(l, n)| ep(*l, "RS", Some(n))).collect();
        let d = decide_one(&svc, &eps);
        assert_eq!(d.internal, Some(*target), "case {i}");
        if target.has_endpoints() {
            assert_eq!(reached(&d, *target).unwrap(), *expected, "case {i}");
        }
        assert_eq!(d.external, None, "case {i}: not externally accessible");
        assert_eq!(
            d.no_local_endpoints.internal,
            u64::from(*target == Target::Drop),
            "case {i}"
        );
        let gone = decide_one(&svc, &[]);
        assert_eq!(
            gone.internal,
            Some(Target::Reject),
            "case {i}, slice deleted"
        );
    }
}

/// One row of TestTerminatingEndpointsTrafficPolicy{Local,Cluster}: endpoints, then the pod
/// flow to the ClusterIP (P) and the external flow to the LB IP (E): endpoints or None for
/// DROP/REJECT, and the target.
struct TerminatingCase {
    name: &'static str,
    endpoints: Vec<PortEndpoint<'static>>,
    pod: (Target, &'static [u8]),
    external: (Target, &'static [u8]),
}

fn terminating(external_local: bool, cases: Vec<TerminatingCase>) {
    let mut svc = service("172.30.1.1", ServiceType::LoadBalancer);
    Arc::make_mut(&mut svc.ports)[0].name = "".into();
    svc.load_balancer_ips = vec![ip("1.2.3.4")].into();
    svc.external_policy_local = external_local;
    svc.health_check_node_port = external_local.then_some(30000);
    for case in cases {
        let d = decide_one(&svc, &case.endpoints);
        let name = case.name;
        assert_eq!(
            d.health_check_node_port, svc.health_check_node_port,
            "{name}"
        );
        assert_eq!(d.internal, Some(case.pod.0), "{name}: P");
        assert_eq!(
            reached(&d, case.pod.0).unwrap_or_default(),
            case.pod.1,
            "{name}: P"
        );
        let external = d.external.expect("externally accessible");
        assert_eq!(external.target, case.external.0, "{name}: E");
        assert_eq!(
            reached(&d, external.target).unwrap_or_default(),
            case.external.1,
            "{name}: E"
        );
        // eTP Local keeps the client's address, Cluster masquerades it.
        assert_eq!(external.masquerade, !external_local, "{name}");
        // The node's pods and the node itself reach every endpoint with eTP Local.
        assert_eq!(
            external.short_circuit,
            external_local && d.has_endpoints(),
            "{name}"
        );
        assert_eq!(
            d.no_local_endpoints.external,
            u64::from(external.target == Target::Drop),
            "{name}"
        );
        let gone = decide_one(&svc, &[]);
        assert_eq!(gone.internal, Some(Target::Reject), "{name}, slice deleted");
        assert_eq!(gone.external.map(|e| e.target), Some(Target::Reject));
    }
}

#[test]
fn terminating_endpoints_external_policy_local() {
    // TestTerminatingEndpointsTrafficPolicyLocal.
    let n = Some(NODE);
    let other = Some("node-1");
    terminating(
        true,
        vec![
            TerminatingCase {
                name: "ready endpoints exist",
                endpoints: vec![
                    ep(1, "RS", n),
                    ep(2, "RS", n),
                    ep(3, "ST", n),
                    ep(4, "T", n),
                    ep(5, "RS", other),
                ],
                pod: (Target::Cluster, &[1, 2, 5]),
                external: (Target::Local, &[1, 2]),
            },
            TerminatingCase {
                name: "only terminating endpoints exist",
                endpoints: vec![
                    ep(2, "ST", n),
                    ep(3, "ST", n),
                    ep(4, "T", n),
                    ep(5, "RS", other),
                ],
                pod: (Target::Cluster, &[5]),
                external: (Target::Local, &[2, 3]),
            },
            TerminatingCase {
                name: "terminating endpoints on remote node",
                endpoints: vec![ep(5, "ST", other)],
                pod: (Target::Cluster, &[5]),
                external: (Target::Drop, &[]),
            },
            TerminatingCase {
                name: "no usable endpoints on any node",
                endpoints: vec![ep(5, "T", n), ep(5, "T", other)],
                pod: (Target::Reject, &[]),
                external: (Target::Reject, &[]),
            },
        ],
    );
}

#[test]
fn terminating_endpoints_external_policy_cluster() {
    // TestTerminatingEndpointsTrafficPolicyCluster.
    let n = Some(NODE);
    let other = Some("another-node");
    terminating(
        false,
        vec![
            TerminatingCase {
                name: "ready endpoints exist",
                endpoints: vec![
                    ep(1, "RS", n),
                    ep(2, "RS", n),
                    ep(3, "ST", other),
                    ep(4, "T", other),
                    ep(5, "RS", other),
                ],
                pod: (Target::Cluster, &[1, 2, 5]),
                external: (Target::Cluster, &[1, 2, 5]),
            },
            TerminatingCase {
                name: "only terminating endpoints exist",
                endpoints: vec![
                    ep(2, "ST", n),
                    ep(3, "ST", n),
                    ep(4, "T", other),
                    ep(5, "ST", other),
                ],
                pod: (Target::Cluster, &[2, 3, 5]),
                external: (Target::Cluster, &[2, 3, 5]),
            },
            TerminatingCase {
                name: "terminating endpoints on remote node",
                endpoints: vec![ep(5, "ST", Some("node-1"))],
                pod: (Target::Cluster, &[5]),
                external: (Target::Cluster, &[5]),
            },
            TerminatingCase {
                name: "no usable endpoints on any node",
                endpoints: vec![ep(5, "T", n), ep(5, "T", Some("node-1"))],
                pod: (Target::Reject, &[]),
                external: (Target::Reject, &[]),
            },
        ],
    );
}

#[test]
fn external_traffic_policy_frontends() {
    // TestExternalTrafficPolicyLocal / Cluster: 10.180.0.1 remote, 10.180.2.1 local. Pods
    // reach both through every frontend (short-circuit with Local); external clients reach
    // only the local one with Local, both (masqueraded) with Cluster.
    for local in [true, false] {
        let mut svc = service("172.30.0.41", ServiceType::LoadBalancer);
        Arc::make_mut(&mut svc.ports)[0].node_port = Some(3001);
        svc.external_ips = vec![ip("192.168.99.11")].into();
        svc.load_balancer_ips = vec![ip("1.2.3.4")].into();
        svc.external_policy_local = local;
        let eps = vec![ep(1, "RS", None), ep(2, "RS", Some(NODE))];
        let d = decide_one(&svc, &eps);
        assert_eq!(d.internal, Some(Target::Cluster));
        assert_eq!(last_octets(d.cluster_endpoints()), [1, 2]);
        let e = d.external.unwrap();
        if local {
            assert_eq!(
                (e.target, e.short_circuit, e.masquerade),
                (Target::Local, true, false)
            );
            assert_eq!(last_octets(d.local_endpoints()), [2]);
        } else {
            assert_eq!(
                (e.target, e.short_circuit, e.masquerade),
                (Target::Cluster, false, true)
            );
            assert!(d.local_endpoints().is_empty(), "not needed");
        }
        let external: Vec<Frontend> = d.external_frontends().collect();
        assert_eq!(
            external,
            [
                Frontend::Addr(ip("192.168.99.11"), 80),
                Frontend::Addr(ip("1.2.3.4"), 80),
                Frontend::NodePort(3001)
            ]
        );
    }
}

#[test]
fn no_local_endpoints_metric() {
    // TestNoEndpointsMetric: (iTP Local, eTP Local, endpoints' nodes) -> (internal, external).
    type Case = (bool, bool, &'static [&'static str], u64, u64);
    let all = &[NODE, "node1", "node2"][..];
    let remote = &["node0", "node1", "node2"][..];
    let cases: &[Case] = &[
        (true, false, all, 0, 0),
        (false, true, all, 0, 0),
        (true, true, all, 0, 0),
        (true, false, remote, 1, 0),
        (false, true, remote, 0, 1),
        (true, true, remote, 1, 1),
        (true, true, &[], 0, 0),
    ];
    for (i, (itp, etp, nodes, internal, external)) in cases.iter().enumerate() {
        let mut svc = service("172.30.1.1", ServiceType::ClusterIp);
        svc.internal_policy_local = *itp;
        if *etp {
            svc.service_type = ServiceType::NodePort;
            Arc::make_mut(&mut svc.ports)[0].node_port = Some(123);
            svc.external_policy_local = true;
        }
        let eps: Vec<PortEndpoint> = (1u8..)
            .zip(nodes.iter())
            .map(|(l, n)| ep(l, "RS", Some(n)))
            .collect();
        let d = decide_one(&svc, &eps);
        assert_eq!(
            d.no_local_endpoints,
            NoLocalEndpoints {
                internal: *internal,
                external: *external
            },
            "case {}",
            i + 1
        );
    }
}

#[test]
fn load_balancer_source_ranges() {
    // TestLoadBalancer: the ranges hold the node's IP, so the LB IPs are allowed as sources
    // too; the NodePort is not subject to them (the firewall covers LB IPs only).
    let mut svc = service("172.30.0.41", ServiceType::LoadBalancer);
    Arc::make_mut(&mut svc.ports)[0].node_port = Some(3001);
    svc.load_balancer_ips = vec![ip("1.2.3.4"), ip("5.6.7.8")].into();
    svc.load_balancer_source_ranges = vec![
        "192.168.0.0/24".parse().unwrap(),
        "203.0.113.0/25".parse().unwrap(),
        "2001:db8::/64".parse().unwrap(),
        "0.0.0.0/0".parse().unwrap(),
    ]
    .into();
    let eps = [ep(1, "RS", None)];
    let d = decide_one(&svc, &eps);
    assert_eq!(
        d.firewall,
        Some(Firewall {
            ranges: vec![
                "192.168.0.0/24".parse().unwrap(),
                "203.0.113.0/25".parse().unwrap()
            ],
            allow_lb_ips: true,
        })
    );
    let e = d.external.unwrap();
    assert_eq!((e.target, e.masquerade), (Target::Cluster, true));
    // Without the node's IP in a range, only the ranges.
    svc.load_balancer_source_ranges = vec!["203.0.113.0/25".parse().unwrap()].into();
    assert!(!decide_one(&svc, &eps).firewall.unwrap().allow_lb_ips);
    // No endpoints: rejected before any firewall; no LB IP: nothing to guard.
    assert_eq!(decide_one(&svc, &[]).firewall, None);
    svc.load_balancer_ips = Box::default();
    assert_eq!(decide_one(&svc, &eps).firewall, None);
}

#[test]
fn masquerade_of_cluster_ip_traffic() {
    // masqueradeAll, a detector, or no detector for the family (no ClusterIP masquerade).
    let svc = service("172.30.0.41", ServiceType::ClusterIp);
    let eps = [ep(1, "RS", None)];
    let with = |f: &dyn Fn(&mut DecisionEnv)| {
        let mut env = env();
        f(&mut env);
        decide(&svc, &svc.ports[0], eps.to_vec(), &Suppressed::NONE, &env).internal_masquerade
    };
    assert_eq!(with(&|_| {}), InternalMasquerade::NotFromPods);
    assert_eq!(with(&|e| e.masquerade_all = true), InternalMasquerade::All);
    assert_eq!(
        with(&|e| e.local_traffic = LocalTraffic::Unknown),
        InternalMasquerade::None
    );
    // ClusterCIDR takes the first CIDR of the family; none of it means no detector.
    let config = BuildConfig {
        local_detector: LocalDetector::ClusterCidr(vec!["fd00:10::/64".parse().unwrap()]),
        ..BuildConfig::default()
    };
    let cluster = Cluster::default();
    assert_eq!(
        LocalTraffic::of(&config, &cluster, Family::V4),
        LocalTraffic::Unknown
    );
    assert_eq!(
        LocalTraffic::of(&config, &cluster, Family::V6),
        LocalTraffic::Cidr("fd00:10::/64".parse().unwrap())
    );
    let config = BuildConfig {
        local_detector: LocalDetector::InterfaceNamePrefix("veth".into()),
        ..BuildConfig::default()
    };
    assert_eq!(
        LocalTraffic::of(&config, &cluster, Family::V4),
        LocalTraffic::Interface {
            name: "veth".into(),
            prefix: true
        }
    );
}

#[test]
fn conflicting_frontends_are_not_kept() {
    // A tenant's external IP equal to kube-dns's ClusterIP is not programmed; with nothing
    // else external, the port takes no external traffic. A ClusterIP lost to an older Service
    // leaves the port only its external frontends.
    let mut dns = service("172.30.0.10", ServiceType::ClusterIp);
    dns.name = ObjectName::new("kube-system", "kube-dns");
    let mut evil = service("172.30.0.99", ServiceType::ClusterIp);
    evil.name = ObjectName::new("tenant", "evil");
    evil.external_ips = vec![ip("172.30.0.10")].into();
    let mut twin = service("172.30.0.10", ServiceType::NodePort);
    twin.name = ObjectName::new("tenant", "twin");
    Arc::make_mut(&mut twin.ports)[0].node_port = Some(30080);
    let mut services = Services::new();
    dns.creation_timestamp = Some("2020-01-01T00:00:00Z".parse().unwrap());
    for s in [&dns, &evil, &twin] {
        services.insert(s.name.clone(), Arc::new(s.clone()));
    }
    let eps = [ep(1, "RS", None)];
    let evil_d = decide(
        &evil,
        &evil.ports[0],
        eps.to_vec(),
        &suppressed(&services, &evil),
        &env(),
    );
    let kept: Vec<(FrontendKind, bool)> =
        evil_d.frontends.iter().map(|f| (f.kind, f.kept)).collect();
    assert_eq!(
        kept,
        [
            (FrontendKind::ClusterIp, true),
            (FrontendKind::ExternalIp, false)
        ]
    );
    assert_eq!(evil_d.external, None);
    assert_eq!(evil_d.external_frontends().count(), 0);

    let twin_d = decide(
        &twin,
        &twin.ports[0],
        eps.to_vec(),
        &suppressed(&services, &twin),
        &env(),
    );
    assert_eq!(twin_d.cluster_ip(), None);
    assert_eq!(twin_d.internal, None);
    assert!(twin_d.has_frontends());
    assert_eq!(
        twin_d.external.map(|e| e.target),
        Some(Target::Cluster),
        "the NodePort still works"
    );
    // Without its ClusterIP, the port needs endpoints for external traffic only.
    assert!(twin_d.usage.uses_cluster && !twin_d.usage.uses_local);
}

#[test]
fn topology_hints_and_session_affinity() {
    // Zone hints decide the cluster endpoints when every ready endpoint has one; the local
    // list ignores them. Session affinity is the Service's.
    let mut svc = service("172.30.0.41", ServiceType::NodePort);
    Arc::make_mut(&mut svc.ports)[0].node_port = Some(3001);
    svc.external_policy_local = true;
    svc.affinity_timeout = Some(10800);
    let mut a = ep(1, "RS", None);
    let site_a = Site {
        node_name: None,
        hints: Hints {
            zones: ["zone-a".into()].into(),
            nodes: [].into(),
        },
    };
    a.site = Some(&site_a);
    let mut b = ep(2, "RS", Some(NODE));
    let site_b = Site {
        node_name: None,
        hints: Hints {
            zones: ["zone-b".into()].into(),
            nodes: [].into(),
        },
    };
    b.site = Some(&site_b);
    let d = decide_one(&svc, &[a, b]);
    assert_eq!(last_octets(d.cluster_endpoints()), [1]);
    assert_eq!(last_octets(d.local_endpoints()), [2]);
    // Every endpoint either list may use is reachable (hairpin, affinity chains).
    assert_eq!(last_octets(d.endpoints.all_reachable()), [1, 2]);
    assert_eq!(d.affinity_timeout, Some(10800));
}

#[test]
fn service_decisions_read_slices_of_the_family() {
    // Endpoints come from the slices of the family, matched by port name and protocol, with
    // the slice's port number; none for a Service without a ClusterIP of the family.
    let svc = service("172.30.0.41", ServiceType::ClusterIp);
    let endpoint = |addr: &str, node: &str| Endpoint {
        addr: ip(addr),
        ready: true,
        serving: true,
        terminating: false,
        site: Site::new(Some(node), Hints::default()),
    };
    let slice = |name: &str, family, port_name: &str, eps: Vec<Endpoint>| EndpointSlice {
        name: ObjectName::new("ns1", name),
        service: svc.name.clone(),
        family,
        ports: vec![EndpointPort {
            name: port_name.into(),
            protocol: Proto::Tcp,
            port: 8080,
        }]
        .into(),
        endpoints: eps.into(),
        trigger_time: None,
    };
    let a = slice(
        "a",
        Family::V4,
        "p80",
        vec![endpoint("10.0.1.1", NODE), endpoint("10.0.1.2", "other")],
    );
    let b = slice(
        "b",
        Family::V4,
        "other-port",
        vec![endpoint("10.0.1.3", NODE)],
    );
    let c = slice("c", Family::V6, "p80", vec![endpoint("fd00::1", NODE)]);
    let d = service_decisions(&svc, &[&a, &b, &c], &Suppressed::NONE, &env());
    assert_eq!(d.len(), 1);
    let eps: Vec<(IpAddr, u16, bool)> = d[0]
        .cluster_endpoints()
        .iter()
        .map(|e| (e.addr, e.port, e.local()))
        .collect();
    assert_eq!(
        eps,
        [(ip("10.0.1.1"), 8080, true), (ip("10.0.1.2"), 8080, false)]
    );
    let v6 = DecisionEnv {
        family: Family::V6,
        ..env()
    };
    assert!(service_decisions(&svc, &[&c], &Suppressed::NONE, &v6).is_empty());
}

#[test]
fn health_check_counts_local_ready_endpoint_ips() {
    // TestHealthCheckNodePortWhenTerminating: 3 local ready endpoints and 1 not ready count
    // 3; once all local endpoints terminate, 0 (the load balancer drains the node).
    let mut svc = service("172.30.0.41", ServiceType::LoadBalancer);
    svc.external_policy_local = true;
    svc.health_check_node_port = Some(30000);
    let mut cluster = Cluster {
        node: Some(Node {
            name: NODE.into(),
            ..Node::default()
        }),
        ..Cluster::default()
    };
    cluster
        .services
        .insert(svc.name.clone(), Arc::new(svc.clone()));
    let endpoint = |last: u8, ready: bool, terminating: bool| Endpoint {
        addr: IpAddr::from([10, 0, 1, last]),
        ready,
        serving: true,
        terminating,
        site: Site::new(Some(NODE), Hints::default()),
    };
    let put = |cluster: &mut Cluster, eps: Vec<Endpoint>| {
        let name = ObjectName::new("ns1", "svc1-abc");
        cluster.slices.insert(
            name.clone(),
            EndpointSlice {
                name,
                service: svc.name.clone(),
                family: Family::V4,
                ports: vec![EndpointPort {
                    name: "p80".into(),
                    protocol: Proto::Tcp,
                    port: 80,
                }]
                .into(),
                endpoints: eps.into(),
                trigger_time: None,
            },
        );
    };
    put(
        &mut cluster,
        vec![
            endpoint(1, true, false),
            endpoint(2, true, false),
            endpoint(3, true, false),
            endpoint(4, false, false),
        ],
    );
    let check = health_check(&cluster, &svc, NODE).unwrap();
    assert_eq!(check.node_port, 30000);
    assert_eq!(
        (check.local_ready(Family::V4), check.local_ready(Family::V6)),
        (3, 0)
    );
    put(
        &mut cluster,
        (1..=4).map(|l| endpoint(l, false, true)).collect(),
    );
    assert_eq!(
        health_check(&cluster, &svc, NODE)
            .unwrap()
            .local_ready(Family::V4),
        0
    );
    // No node name: nothing is local. No health-check port: no check.
    assert_eq!(
        health_check(&cluster, &svc, "")
            .unwrap()
            .local_ready(Family::V4),
        0
    );
    let mut plain = svc.clone();
    plain.health_check_node_port = None;
    assert_eq!(health_check(&cluster, &plain, NODE), None);
}

#[test]
fn an_address_in_two_slices_is_one_endpoint_of_each_port() {
    // A Service of two ports; slices `a` and `b` both list 10.0.1.2 with the same port numbers
    // (as while an endpoint moves between slices): each port has it once, where it came first.
    let mut svc = service("172.30.0.42", ServiceType::ClusterIp);
    svc.ports = ["p80", "p81"]
        .into_iter()
        .zip(80..)
        .map(|(name, port)| ServicePort {
            name: name.into(),
            protocol: Proto::Tcp,
            port,
            node_port: None,
        })
        .collect();
    let slice = |name: &str, addrs: &[&str]| EndpointSlice {
        name: ObjectName::new("ns1", name),
        service: svc.name.clone(),
        family: Family::V4,
        ports: ["p80", "p81"]
            .into_iter()
            .zip(8080..)
            .map(|(name, port)| EndpointPort {
                name: name.into(),
                protocol: Proto::Tcp,
                port,
            })
            .collect(),
        endpoints: addrs
            .iter()
            .map(|a| Endpoint {
                addr: ip(a),
                ready: true,
                serving: true,
                terminating: false,
                site: Site::new(Some("other"), Hints::default()),
            })
            .collect::<Vec<_>>()
            .into(),
        trigger_time: None,
    };
    let addrs_of = |d: &PortDecision| -> Vec<(IpAddr, u16)> {
        d.cluster_endpoints()
            .iter()
            .map(|e| (e.addr, e.port))
            .collect()
    };
    let a = slice("a", &["10.0.1.1", "10.0.1.2"]);
    let b = slice("b", &["10.0.1.2", "10.0.1.3"]);
    let d = service_decisions(&svc, &[&a, &b], &Suppressed::NONE, &env());
    for (decision, port) in d.iter().zip([8080, 8081]) {
        let want: Vec<(IpAddr, u16)> = ["10.0.1.1", "10.0.1.2", "10.0.1.3"]
            .iter()
            .map(|a| (ip(a), port))
            .collect();
        assert_eq!(addrs_of(decision), want);
    }
    // Distinct addresses: every one, for each port.
    let b = slice("b", &["10.0.1.3"]);
    let d = service_decisions(&svc, &[&a, &b], &Suppressed::NONE, &env());
    assert_eq!(
        d.iter().map(|p| addrs_of(p).len()).collect::<Vec<_>>(),
        [3, 3]
    );
}
