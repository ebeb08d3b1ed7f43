use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::model::{
    Endpoint, EndpointPort, EndpointSlice, Hints, ObjectName, Service, ServicePort, ServiceType,
    Site,
};
use crate::nft::ruleset::{KeyType, SetDecl, Verdict};
use crate::nft::state::{Elements, SetState};

const UDP: u8 = 17;
const TCP: u8 = 6;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn service(name: &str, cluster_ips: &[&str], ports: &[(&str, Proto, u16, Option<u16>)]) -> Service {
    Service {
        name: ObjectName::new("ns", name),
        service_type: ServiceType::ClusterIp,
        cluster_ips: cluster_ips.iter().map(|s| ip(s)).collect(),
        external_ips: vec![].into(),
        load_balancer_ips: vec![].into(),
        load_balancer_source_ranges: vec![].into(),
        external_policy_local: false,
        internal_policy_local: false,
        health_check_node_port: None,
        affinity_timeout: None,
        creation_timestamp: None,
        ports: ports
            .iter()
            .map(|(n, protocol, port, node_port)| ServicePort {
                name: (*n).into(),
                protocol: *protocol,
                port: *port,
                node_port: *node_port,
            })
            .collect(),
    }
}

fn endpoint(addr: &str, serving: bool) -> Endpoint {
    Endpoint {
        addr: ip(addr),
        ready: serving,
        serving,
        terminating: false,
        site: Site::new(Some("other-node"), Hints::default()),
    }
}

fn slice(svc: &str, name: &str, ports: &[(&str, Proto, u16)], eps: Vec<Endpoint>) -> EndpointSlice {
    let family = Family::of(&eps.first().map(|e| e.addr).unwrap_or(ip("0.0.0.0")));
    EndpointSlice {
        name: ObjectName::new("ns", name),
        service: ObjectName::new("ns", svc),
        family,
        ports: ports
            .iter()
            .map(|(n, protocol, port)| EndpointPort {
                name: (*n).into(),
                protocol: *protocol,
                port: *port,
            })
            .collect(),
        endpoints: eps.into(),
        trigger_time: None,
    }
}

fn cluster(services: Vec<Service>, slices: Vec<EndpointSlice>) -> Cluster {
    Cluster {
        services: services.into_iter().map(|s| (s.name.clone(), s)).collect(),
        slices: slices.into_iter().map(|s| (s.name.clone(), s)).collect(),
        node: None,
        service_cidrs: BTreeMap::new(),
    }
}

fn tuple(proto: u8, src: &str, sport: u16, dst: &str, dport: u16) -> Tuple {
    Tuple {
        proto,
        src: ip(src),
        dst: ip(dst),
        src_port: sport,
        dst_port: dport,
    }
}

/// An entry from `client` to `frontend`, translated to `endpoint` (reply tuple).
fn entry(proto: u8, client: &str, frontend: (&str, u16), endpoint: (&str, u16)) -> (Tuple, Tuple) {
    let orig = tuple(proto, client, 40000, frontend.0, frontend.1);
    let reply = tuple(proto, endpoint.0, endpoint.1, client, 40000);
    (orig, reply)
}

fn stale(e: &(Tuple, Tuple), current: &Frontends, previous: &Frontends) -> bool {
    is_stale(&e.0, &e.1, current, previous)
}

fn set(ips: &[&str]) -> Serving {
    Arc::new(ips.iter().map(|s| ip(s)).collect())
}

/// kube-proxy's TestCleanStaleEntries layout: a UDP Service with ClusterIP, external IP,
/// LoadBalancer IP and NodePort, two endpoints of which one stopped serving.
fn udp_cluster(serving_b: bool) -> Cluster {
    let mut svc = service(
        "dns",
        &["172.30.0.10", "fd00:172:30::10"],
        &[
            ("dns", Proto::Udp, 53, Some(30053)),
            ("dns-tcp", Proto::Tcp, 53, Some(30054)),
        ],
    );
    svc.service_type = ServiceType::LoadBalancer;
    svc.external_ips = vec![ip("192.0.2.10"), ip("2001:db8::10")].into();
    svc.load_balancer_ips = vec![ip("198.51.100.10")].into();
    let ports = [("dns", Proto::Udp, 5353), ("dns-tcp", Proto::Tcp, 5353)];
    cluster(
        vec![svc],
        vec![
            slice(
                "dns",
                "dns-v4",
                &ports,
                vec![endpoint("10.0.0.1", true), endpoint("10.0.0.2", serving_b)],
            ),
            slice("dns", "dns-v6", &ports, vec![endpoint("fd00:10::1", true)]),
        ],
    )
}

#[test]
fn frontends_of_a_udp_service() {
    let f = Frontends::of(&udp_cluster(false), Family::V4);
    let a = set(&["10.0.0.1"]);
    let want_addrs: BTreeMap<(IpAddr, u16), Serving> = [
        ((ip("172.30.0.10"), 53), a.clone()),
        ((ip("192.0.2.10"), 53), a.clone()),
        ((ip("198.51.100.10"), 53), a.clone()),
    ]
    .into();
    assert_eq!(f.addrs, want_addrs);
    assert_eq!(f.node_ports, [(30053, a)].into());

    let f6 = Frontends::of(&udp_cluster(false), Family::V6);
    let want6: BTreeMap<(IpAddr, u16), Serving> = [
        ((ip("fd00:172:30::10"), 53), set(&["fd00:10::1"])),
        ((ip("2001:db8::10"), 53), set(&["fd00:10::1"])),
    ]
    .into();
    assert_eq!(f6.addrs, want6);
    assert_eq!(f6.node_ports, [(30053, set(&["fd00:10::1"]))].into());
}

#[test]
fn the_frontends_of_a_service_port_share_their_endpoints() {
    let index = FrontendIndex::build(&udp_cluster(true), Family::V4);
    let f = index.current();
    let first = &f.addrs[&(ip("172.30.0.10"), 53)];
    assert_eq!(**first, *set(&["10.0.0.1", "10.0.0.2"]));
    for serving in f.addrs.values().chain(f.node_ports.values()) {
        assert!(Arc::ptr_eq(first, serving));
    }
}

#[test]
fn serving_counts_not_ready_or_policy() {
    let mut c = udp_cluster(true);
    // Terminating but serving: still a valid target for existing flows.
    let mut s = c.slices.values().next().unwrap().clone();
    s.endpoints.update(1, |e| {
        e.ready = false;
        e.terminating = true;
    });
    c.slices.insert(s.name.clone(), s);
    let mut svc = Service::clone(c.services.values().next().unwrap());
    svc.internal_policy_local = true;
    svc.external_policy_local = true;
    c.services
        .insert(svc.name.clone(), std::sync::Arc::new(svc));
    let f = Frontends::of(&c, Family::V4);
    assert_eq!(
        f.addrs[&(ip("172.30.0.10"), 53)],
        set(&["10.0.0.1", "10.0.0.2"])
    );
    // Not serving (e.g. failing readiness, not terminating): not a target.
    let mut s = c.slices.values().next().unwrap().clone();
    s.endpoints.update(1, |e| {
        e.serving = false;
        e.terminating = false;
    });
    c.slices.insert(s.name.clone(), s);
    let f = Frontends::of(&c, Family::V4);
    assert_eq!(f.addrs[&(ip("172.30.0.10"), 53)], set(&["10.0.0.1"]));
}

/// kube-proxy's cases: an entry to each frontend, one to a serving endpoint (kept) and one
/// to the endpoint that stopped serving (deleted).
#[test]
fn kube_proxy_cases() {
    let current = Frontends::of(&udp_cluster(false), Family::V4);
    let previous = Frontends::of(&udp_cluster(true), Family::V4);
    for frontend in [
        ("172.30.0.10", 53),    // ClusterIP
        ("198.51.100.10", 53),  // LoadBalancer VIP
        ("192.0.2.10", 53),     // ExternalIP
        ("192.168.0.2", 30053), // NodePort, on the node's address
        ("127.0.0.1", 30053),   // NodePort, on any address
    ] {
        let good = entry(UDP, "10.0.5.5", frontend, ("10.0.0.1", 5353));
        let gone = entry(UDP, "10.0.5.5", frontend, ("10.0.0.2", 5353));
        assert!(
            !stale(&good, &current, &previous),
            "{frontend:?} to a serving endpoint"
        );
        assert!(
            stale(&gone, &current, &previous),
            "{frontend:?} to a gone endpoint"
        );
        // TCP is never touched, even to the gone endpoint.
        let tcp = entry(TCP, "10.0.5.5", frontend, ("10.0.0.2", 5353));
        assert!(!stale(&tcp, &current, &previous), "{frontend:?} TCP");
    }
    // Another port of the same address, and unrelated traffic: untouched.
    let other_port = entry(UDP, "10.0.5.5", ("172.30.0.10", 54), ("10.0.0.2", 54));
    assert!(!stale(&other_port, &current, &previous));
    let unrelated = entry(UDP, "10.0.5.5", ("8.8.8.8", 53), ("8.8.8.8", 53));
    assert!(!stale(&unrelated, &current, &previous));
    // Pod to pod, bypassing the Service.
    let direct = entry(UDP, "10.0.5.5", ("10.0.0.2", 5353), ("10.0.0.2", 5353));
    assert!(!stale(&direct, &current, &previous));
}

#[test]
fn untranslated_entry_to_a_frontend_is_stale() {
    // Created before the Service had endpoints (or existed): it would keep the client's
    // packets away from the new endpoints.
    let current = Frontends::of(&udp_cluster(true), Family::V4);
    let e = entry(UDP, "10.0.5.5", ("172.30.0.10", 53), ("172.30.0.10", 53));
    assert!(stale(&e, &current, &Frontends::default()));
    let np = entry(
        UDP,
        "203.0.113.9",
        ("192.168.0.2", 30053),
        ("192.168.0.2", 30053),
    );
    assert!(stale(&np, &current, &Frontends::default()));
}

#[test]
fn scale_to_zero_cleans_every_entry() {
    let previous = Frontends::of(&udp_cluster(true), Family::V4);
    let mut c = udp_cluster(true);
    c.slices.clear();
    let current = Frontends::of(&c, Family::V4);
    assert!(current.addrs[&(ip("172.30.0.10"), 53)].is_empty());
    for ep in ["10.0.0.1", "10.0.0.2"] {
        for frontend in [("172.30.0.10", 53), ("192.168.0.2", 30053)] {
            let e = entry(UDP, "10.0.5.5", frontend, (ep, 5353));
            assert!(stale(&e, &current, &previous));
        }
    }
    assert!(cleanup_needed(&previous, true, &current));
}

#[test]
fn deleted_service_frontends_are_cleaned() {
    let previous = Frontends::of(&udp_cluster(true), Family::V4);
    let current = Frontends::of(&cluster(vec![], vec![]), Family::V4);
    assert!(current.is_empty());
    for frontend in [
        ("172.30.0.10", 53),
        ("198.51.100.10", 53),
        ("192.0.2.10", 53),
        ("192.168.0.2", 30053),
    ] {
        let e = entry(UDP, "10.0.5.5", frontend, ("10.0.0.1", 5353));
        assert!(stale(&e, &current, &previous), "{frontend:?}");
        // Not translated: somebody else's flow to that address now.
        let plain = entry(UDP, "10.0.5.5", frontend, (frontend.0, frontend.1));
        assert!(
            !stale(&plain, &current, &previous),
            "{frontend:?} untranslated"
        );
    }
    assert!(cleanup_needed(&previous, true, &current));
}

#[test]
fn address_frontend_decides_over_an_equal_node_port() {
    // Service b listens on port 30053 of its ClusterIP, a has NodePort 30053.
    let a = service("a", &["172.30.0.10"], &[("p", Proto::Udp, 53, Some(30053))]);
    let b = service("b", &["172.30.0.11"], &[("p", Proto::Udp, 30053, None)]);
    let c = cluster(
        vec![a, b],
        vec![
            slice(
                "a",
                "a1",
                &[("p", Proto::Udp, 53)],
                vec![endpoint("10.0.0.1", true)],
            ),
            slice(
                "b",
                "b1",
                &[("p", Proto::Udp, 30053)],
                vec![endpoint("10.0.0.9", true)],
            ),
        ],
    );
    let f = Frontends::of(&c, Family::V4);
    let to_b = entry(UDP, "10.0.5.5", ("172.30.0.11", 30053), ("10.0.0.9", 30053));
    assert!(!stale(&to_b, &f, &f));
    let via_np = entry(UDP, "10.0.5.5", ("192.168.0.2", 30053), ("10.0.0.9", 30053));
    assert!(stale(&via_np, &f, &f));
}

#[test]
fn a_shared_frontend_is_the_winners() {
    let mut a = service("a", &["172.30.0.10"], &[("p", Proto::Udp, 53, None)]);
    a.external_ips = vec![ip("192.0.2.10")].into();
    let mut b = service("b", &["172.30.0.11"], &[("p", Proto::Udp, 53, None)]);
    b.external_ips = vec![ip("192.0.2.10")].into();
    let c = cluster(
        vec![a, b],
        vec![
            slice(
                "a",
                "a1",
                &[("p", Proto::Udp, 53)],
                vec![endpoint("10.0.0.1", true)],
            ),
            slice(
                "b",
                "b1",
                &[("p", Proto::Udp, 53)],
                vec![endpoint("10.0.0.2", true)],
            ),
        ],
    );
    // ns/a wins the external IP (see crate::conflicts): entries that ns/b's endpoint
    // answers are stale, as that endpoint no longer gets the frontend's traffic.
    let f = Frontends::of(&c, Family::V4);
    assert_eq!(f.addrs[&(ip("192.0.2.10"), 53)], set(&["10.0.0.1"]));
    let to_b = entry(UDP, "10.0.5.5", ("192.0.2.10", 53), ("10.0.0.2", 53));
    assert!(stale(&to_b, &f, &f));
}

#[test]
fn tcp_only_services_have_no_frontends() {
    let s = service(
        "web",
        &["172.30.0.20"],
        &[("http", Proto::Tcp, 80, Some(30080))],
    );
    let c = cluster(
        vec![s],
        vec![slice(
            "web",
            "w",
            &[("http", Proto::Tcp, 80)],
            vec![endpoint("10.0.0.1", true)],
        )],
    );
    assert!(Frontends::of(&c, Family::V4).is_empty());
    assert!(!cleanup_needed(
        &Frontends::default(),
        false,
        &Frontends::of(&c, Family::V4)
    ));
}

#[test]
fn cleanup_needed_on_changes_only() {
    let a = Frontends::of(&udp_cluster(true), Family::V4);
    let b = Frontends::of(&udp_cluster(false), Family::V4);
    assert!(!cleanup_needed(&a, true, &a.clone()));
    // 10.0.0.2 stopped serving.
    assert!(cleanup_needed(&a, true, &b));
    assert!(cleanup_needed(&Frontends::default(), true, &a));
    assert!(cleanup_needed(&a, true, &Frontends::default()));
    assert!(!cleanup_needed(
        &Frontends::default(),
        true,
        &Frontends::default()
    ));
    // Unknown endpoints: a cleanup whenever UDP is around, before or now.
    assert!(cleanup_needed(&a, false, &a.clone()));
    assert!(cleanup_needed(&b, false, &a));
    assert!(cleanup_needed(&Frontends::default(), false, &a));
    assert!(cleanup_needed(&a, false, &Frontends::default()));
    assert!(!cleanup_needed(
        &Frontends::default(),
        false,
        &Frontends::default()
    ));
}

/// One address frontend and one NodePort, with the endpoints given.
fn frontends(addr_eps: &[&str], node_port_eps: &[&str]) -> Frontends {
    Frontends {
        addrs: [((ip("172.30.0.10"), 53), set(addr_eps))].into(),
        node_ports: [(30053, set(node_port_eps))].into(),
    }
}

#[test]
fn an_endpoint_added_to_a_frontend_that_had_one_needs_no_cleanup() {
    // 10.0.0.2 became serving: the Service's address and NodePort frontends both gained it.
    let b = Frontends::of(&udp_cluster(false), Family::V4);
    let a = Frontends::of(&udp_cluster(true), Family::V4);
    assert!(!cleanup_needed(&b, true, &a));

    let one = frontends(&["10.0.0.1"], &["10.0.0.1"]);
    let more = frontends(&["10.0.0.1", "10.0.0.2", "10.0.0.3"], &["10.0.0.1"]);
    assert!(!cleanup_needed(&one, true, &more));
    let np_only = frontends(&["10.0.0.1"], &["10.0.0.1", "10.0.0.2"]);
    assert!(!cleanup_needed(&one, true, &np_only));
    // Entries of the previous endpoints are not stale: nothing a dump could find.
    for (f, dst) in [
        (("172.30.0.10", 53), ("10.0.0.1", 5353)),
        (("192.168.0.2", 30053), ("10.0.0.1", 5353)),
    ] {
        let e = entry(UDP, "10.0.5.5", f, dst);
        assert!(!stale(&e, &more, &one));
        assert!(!stale(&e, &np_only, &one));
    }
    // Unknown previous endpoints: as before, a cleanup.
    assert!(cleanup_needed(&one, false, &more));
}

#[test]
fn a_first_endpoint_needs_a_cleanup() {
    // Entries made while the frontend had none were not translated (or were rejected).
    let none = frontends(&[], &["10.0.0.1"]);
    let first = frontends(&["10.0.0.1"], &["10.0.0.1"]);
    assert!(cleanup_needed(&none, true, &first));
    let untranslated = entry(UDP, "10.0.5.5", ("172.30.0.10", 53), ("172.30.0.10", 53));
    assert!(stale(&untranslated, &first, &none));
    let np_none = frontends(&["10.0.0.1"], &[]);
    assert!(cleanup_needed(&np_none, true, &first));
    // Still none: nothing changed.
    assert!(!cleanup_needed(&none, true, &none.clone()));
}

#[test]
fn an_endpoint_removed_or_replaced_needs_a_cleanup() {
    let two = frontends(&["10.0.0.1", "10.0.0.2"], &["10.0.0.1", "10.0.0.2"]);
    let removed = frontends(&["10.0.0.1"], &["10.0.0.1", "10.0.0.2"]);
    assert!(cleanup_needed(&two, true, &removed));
    let np_removed = frontends(&["10.0.0.1", "10.0.0.2"], &["10.0.0.2"]);
    assert!(cleanup_needed(&two, true, &np_removed));
    let replaced = frontends(&["10.0.0.1", "10.0.0.3"], &["10.0.0.1", "10.0.0.2"]);
    assert!(cleanup_needed(&two, true, &replaced));
    // One frontend gains, another loses: the loss decides.
    let mixed = frontends(&["10.0.0.1", "10.0.0.2", "10.0.0.3"], &["10.0.0.2"]);
    assert!(cleanup_needed(&two, true, &mixed));
}

#[test]
fn a_frontend_added_or_removed_needs_a_cleanup() {
    let one = frontends(&["10.0.0.1"], &["10.0.0.1"]);
    let mut added = one.clone();
    added
        .addrs
        .insert((ip("192.0.2.10"), 53), set(&["10.0.0.1"]));
    assert!(cleanup_needed(&one, true, &added));
    assert!(cleanup_needed(&added, true, &one));
    let mut port_added = one.clone();
    port_added.node_ports.insert(30054, set(&["10.0.0.1"]));
    assert!(cleanup_needed(&one, true, &port_added));
    assert!(cleanup_needed(&port_added, true, &one));
    // A frontend replaced by another (same count) with more endpoints.
    let mut moved = Frontends::default();
    moved
        .addrs
        .insert((ip("172.30.0.10"), 54), set(&["10.0.0.1", "10.0.0.2"]));
    moved.node_ports = one.node_ports.clone();
    assert!(cleanup_needed(&one, true, &moved));
}

#[test]
fn a_frontend_whose_cleanup_failed_is_still_known_when_it_goes() {
    // A sync added frontend 192.0.2.10:53 and its cleanup failed: what is recorded as cleaned
    // still lacks it, and is told of it.
    let before = frontends(&["10.0.0.1"], &["10.0.0.1"]);
    let mut with = before.clone();
    with.addrs
        .insert((ip("192.0.2.10"), 53), set(&["10.0.0.2"]));
    let mut recorded = before.clone();
    recorded.add_missing(&with);
    assert_eq!(recorded, with);
    // Gone again before a cleanup succeeded: its translated entries are stale.
    let e = entry(UDP, "10.0.5.5", ("192.0.2.10", 53), ("10.0.0.2", 53));
    assert!(stale(&e, &before, &recorded));
    assert!(!stale(&e, &before, &before), "unknown without the record");
    // What is recorded already stays as it was.
    let mut other = with.clone();
    other
        .addrs
        .insert((ip("192.0.2.10"), 53), set(&["10.0.0.9"]));
    recorded.add_missing(&other);
    assert_eq!(recorded, with);
}

/// Frontends over a small universe of addresses, ports and endpoints.
fn arb_frontends() -> impl Strategy<Value = Frontends> {
    let eps = || proptest::collection::btree_set(0u8..4, 0..4);
    let addr_key = (0usize..3, 0usize..2);
    (
        proptest::collection::btree_map(addr_key, eps(), 0..4),
        proptest::collection::btree_map(0usize..2, eps(), 0..3),
    )
        .prop_map(|(addrs, node_ports)| {
            let ep = |e: BTreeSet<u8>| -> Serving {
                Arc::new(
                    e.into_iter()
                        .map(|i| IpAddr::from([10, 0, 0, i + 1]))
                        .collect(),
                )
            };
            Frontends {
                addrs: addrs
                    .into_iter()
                    .map(|((a, p), e)| ((ip(FRONT_ADDRS[a]), FRONT_PORTS[p]), ep(e)))
                    .collect(),
                node_ports: node_ports
                    .into_iter()
                    .map(|(p, e)| (FRONT_PORTS[2 + p], ep(e)))
                    .collect(),
            }
        })
}

const FRONT_ADDRS: [&str; 3] = ["172.30.0.10", "192.0.2.10", "192.168.0.2"];
const FRONT_PORTS: [u16; 4] = [53, 54, 30053, 30054];

/// `previous` and frontends after a sync: mostly endpoints added to it, sometimes some removed
/// too, sometimes unrelated frontends.
fn arb_sync() -> impl Strategy<Value = (Frontends, Frontends)> {
    arb_frontends().prop_flat_map(|previous| {
        let changes = proptest::collection::vec(
            (
                proptest::collection::btree_set(0u8..4, 0..3),
                proptest::option::weighted(0.2, 0u8..4),
            ),
            previous.addrs.len() + previous.node_ports.len(),
        );
        let derived = changes.prop_map({
            let previous = previous.clone();
            move |changes| {
                let mut current = previous.clone();
                let sets = current
                    .addrs
                    .values_mut()
                    .chain(current.node_ports.values_mut());
                for (eps, (added, removed)) in sets.zip(changes) {
                    let eps = Arc::make_mut(eps);
                    eps.extend(added.into_iter().map(|i| IpAddr::from([10, 0, 0, i + 1])));
                    if let Some(i) = removed {
                        eps.remove(&IpAddr::from([10, 0, 0, i + 1]));
                    }
                }
                current
            }
        });
        let current = prop_oneof![4 => derived, 1 => arb_frontends()];
        (Just(previous), current)
    })
}

proptest! {
    /// When `cleanup_needed` says no, a dump would find nothing stale among the entries that
    /// can exist after the cleanup at `previous`: to a frontend, only entries to its endpoints
    /// (none while it has none: its packets are rejected); to other addresses, anything.
    #[test]
    fn no_cleanup_means_nothing_stale((previous, current) in arb_sync()) {
        prop_assume!(!cleanup_needed(&previous, true, &current));
        for dst in FRONT_ADDRS {
            for port in FRONT_PORTS {
                let frontend = previous
                    .addrs
                    .get(&(ip(dst), port))
                    .or_else(|| previous.node_ports.get(&port));
                let endpoints: Vec<IpAddr> = match frontend {
                    Some(eps) => eps.iter().copied().collect(),
                    None => (1..=5)
                        .map(|i| IpAddr::from([10, 0, 0, i]))
                        .chain([ip(dst)])
                        .collect(),
                };
                for ep in endpoints {
                    let e = entry(UDP, "10.0.5.5", (dst, port), (&ep.to_string(), 5353));
                    prop_assert!(!stale(&e, &current, &previous), "{e:?}");
                }
            }
        }
    }
}

#[test]
fn frontends_from_a_table_read_back() {
    let decl = |key| SetDecl {
        key,
        is_vmap: true,
        comment: None,
        timeout_secs: None,
        size: None,
    };
    let goto = Some(crate::nft::ruleset::Value::Verdict(Verdict::Goto(
        "reject-chain".into(),
    )));
    let mut state = TableState::default();
    state.sets.insert(
        "service-ips".into(),
        SetState {
            decl: decl(KeyType::AddrProtoPort),
            elements: Elements::Read(
                [
                    (
                        Key::AddrProtoPort(ip("172.30.0.10"), Proto::Udp, 53),
                        goto.clone(),
                    ),
                    (
                        Key::AddrProtoPort(ip("172.30.0.10"), Proto::Tcp, 53),
                        goto.clone(),
                    ),
                ]
                .into(),
            ),
        },
    );
    state.sets.insert(
        "no-endpoint-nodeports".into(),
        SetState {
            decl: decl(KeyType::ProtoPort),
            elements: Elements::Read(
                [
                    (Key::ProtoPort(Proto::Udp, 30053), goto.clone()),
                    (Key::ProtoPort(Proto::Sctp, 30054), goto.clone()),
                ]
                .into(),
            ),
        },
    );
    state.sets.insert(
        "cluster-ips".into(),
        SetState {
            decl: SetDecl {
                is_vmap: false,
                ..decl(KeyType::Addr)
            },
            elements: Elements::Read([(Key::Addr(ip("172.30.0.10")), None)].into()),
        },
    );
    // Services without chains are known by their endpoint lists.
    let endpoint = Some(crate::nft::ruleset::Value::Endpoint(ip("10.0.0.1"), 5353));
    state.sets.insert(
        "cluster-endpoints-1".into(),
        SetState {
            decl: SetDecl {
                is_vmap: false,
                ..decl(KeyType::AddrProtoPortIndex)
            },
            elements: Elements::Read(
                [(
                    Key::AddrProtoPortIndex(ip("172.30.0.11"), Proto::Udp, 53, 0),
                    endpoint.clone(),
                )]
                .into(),
            ),
        },
    );
    state.sets.insert(
        "cluster-nodeport-endpoints-1".into(),
        SetState {
            decl: SetDecl {
                is_vmap: false,
                ..decl(KeyType::ProtoPortIndex)
            },
            elements: Elements::Read(
                [(Key::ProtoPortIndex(Proto::Udp, 30055, 0), endpoint)].into(),
            ),
        },
    );
    let f = Frontends::from_table_state(Some(&state));
    assert_eq!(
        f.addrs,
        [
            ((ip("172.30.0.10"), 53), set(&[])),
            ((ip("172.30.0.11"), 53), set(&[]))
        ]
        .into()
    );
    assert_eq!(f.node_ports, [(30053, set(&[])), (30055, set(&[]))].into());
    assert!(Frontends::from_table_state(None).is_empty());
    // What a restarted agent makes of an entry to a Service deleted meanwhile.
    let e = entry(UDP, "10.0.5.5", ("172.30.0.10", 53), ("10.0.0.1", 5353));
    assert!(stale(&e, &Frontends::default(), &f));
}

#[test]
fn index_updates_like_a_rebuild() {
    let shared = |name: &str, cip: &str| {
        let mut s = service(name, &[cip], &[("p", Proto::Udp, 53, Some(30053))]);
        s.external_ips = vec![ip("192.0.2.10")].into();
        s
    };
    let one_slice = |svc: &str, eps: &[&str]| {
        slice(
            svc,
            &format!("{svc}1"),
            &[("p", Proto::Udp, 53)],
            eps.iter().map(|e| endpoint(e, true)).collect(),
        )
    };
    let before = cluster(
        vec![shared("a", "172.30.0.10"), shared("b", "172.30.0.11")],
        vec![one_slice("a", &["10.0.0.1"]), one_slice("b", &["10.0.0.2"])],
    );
    let after = cluster(
        vec![shared("b", "172.30.0.11")],
        vec![one_slice("b", &["10.0.0.3"])],
    );
    let mut index = FrontendIndex::build(&before, Family::V4);
    assert_eq!(index.current(), &Frontends::of(&before, Family::V4));
    let (a, b) = (ObjectName::new("ns", "a"), ObjectName::new("ns", "b"));
    let touched = index.update(&after, [&a, &b]);
    assert_eq!(index.current(), &Frontends::of(&after, Family::V4));
    assert_eq!(
        index.current().addrs[&(ip("192.0.2.10"), 53)],
        set(&["10.0.0.3"])
    );
    assert!(touched.addrs.contains(&(ip("172.30.0.10"), 53)));
    assert!(touched.addrs.contains(&(ip("192.0.2.10"), 53)));
    assert!(touched.node_ports.contains(&30053));
    // Only what was touched is compared and carried over.
    let mut previous = Frontends::of(&before, Family::V4);
    previous.replace(&touched, index.current());
    assert_eq!(&previous, index.current());
}
