//! `hairpin-endpoints`: which endpoints get an element, and an element shared by Services.

use super::*;

/// ClusterIP Services svc1 … svcN of one endpoint each, svc2's being svc1's pod: one hairpin
/// element, claimed twice.
fn sharing_one_endpoint(n: u8) -> Cluster {
    let specs: Vec<SvcSpec> = (1..=n)
        .map(|id| SvcSpec {
            id,
            endpoints: vec![1],
            node_port: false,
            udp: false,
            ..SvcSpec::default()
        })
        .collect();
    let mut c = cluster(&specs);
    let slice = ObjectName::new("ns", "svc2-x");
    let mut s = c.slices.get(&slice).unwrap().clone();
    s.endpoints = s
        .endpoints
        .iter()
        .map(|mut e| {
            e.addr = IpAddr::from([10, 180, 1, 1]);
            e
        })
        .collect();
    c.slices.insert(slice, s);
    c
}

#[test]
fn an_endpoint_shared_by_services_stays_until_its_last_service_goes() {
    let mut c = sharing_one_endpoint(3);
    let hairpin = |d: &Desired| {
        d.table().sets["hairpin-endpoints"]
            .elements
            .contains_key(&Key::AddrPair(IpAddr::from([10, 180, 1, 1])))
    };
    let mut desired = Desired::build(&c, &config(), Family::V4);
    assert!(hairpin(&desired));
    let mut state = fresh_state(desired.table());
    for gone in ["svc1", "svc2"] {
        let name = ObjectName::new("ns", gone);
        c.services.remove(&name);
        let updated = desired.update(&c, &config(), [&name]);
        let Updated::Scope(scope) = updated else {
            panic!("a shared plain-set element is no conflict: expected a scoped update");
        };
        assert_eq!(desired.table(), &build(&c, &config(), Family::V4).table);
        step_scope(&mut state, desired.table(), &scope);
        assert_eq!(state, fresh_state(desired.table()));
        assert_eq!(hairpin(&desired), gone == "svc1", "after deleting {gone}");
    }
}

/// A Service added with an endpoint whose hairpin element another Service's holds: the change
/// records the element as present, so the delta plan adds nothing for it, as a plan against
/// the table read back does.
#[test]
fn a_service_added_with_a_shared_endpoint_plans_like_a_read_back() {
    let mut c = sharing_one_endpoint(2);
    let name = ObjectName::new("ns", "svc2");
    let svc2 = c.services.remove(&name).unwrap();
    let mut desired = Desired::build(&c, &config(), Family::V4);
    let mut state = fresh_state(desired.table());
    c.services.insert(name.clone(), svc2);
    let Updated::Scope(scope) = desired.update(&c, &config(), [&name]) else {
        panic!("a shared plain-set element is no conflict: expected a scoped update");
    };
    let tx = step_scope(&mut state, desired.table(), &scope);
    assert!(
        !tx.ops.iter().any(|op| matches!(
            op,
            Op::AddElements { set, .. } if set == "hairpin-endpoints"
        )),
        "{tx:?}"
    );
    assert_eq!(state, fresh_state(desired.table()));
}

#[test]
fn hairpin_elements_are_for_endpoints_a_connection_here_can_come_from() {
    // svc1 (ClusterIP): on this node, on node2, of no node. svc2 (NodePort,
    // externalTrafficPolicy Local): on node2, where a pod reaching this node's NodePort is
    // short-circuited to the cluster endpoints, itself among them.
    let mut c = cluster(&[
        SvcSpec {
            id: 1,
            endpoints: vec![1, 2, 3],
            ..SvcSpec::default()
        },
        SvcSpec {
            id: 2,
            endpoints: vec![1],
            node_port: true,
            ..SvcSpec::default()
        },
    ]);
    let slices = c.slices.clone();
    for (slice, nodes) in [
        ("svc1-x", &[Some("node"), Some("node2"), None][..]),
        ("svc2-x", &[Some("node2")]),
    ] {
        let name = ObjectName::new("ns", slice);
        let mut s = slices.get(&name).unwrap().clone();
        s.endpoints = s
            .endpoints
            .iter()
            .zip(nodes)
            .map(|(mut ep, node)| {
                ep.site = Site::new(*node, Hints::default());
                ep
            })
            .collect();
        c.slices.insert(name, s);
    }
    let svc2 = ObjectName::new("ns", "svc2");
    let set_local = |c: &mut Cluster, local: bool| {
        let mut svc = (**c.services.get(&svc2).unwrap()).clone();
        svc.external_policy_local = local;
        c.services.insert(svc2.clone(), Arc::new(svc));
    };
    set_local(&mut c, true);
    let hairpin = |t: &Table| -> Vec<IpAddr> {
        t.sets["hairpin-endpoints"]
            .elements
            .keys()
            .map(|k| match k {
                Key::AddrPair(a) => a,
                other => panic!("hairpin key {other:?}"),
            })
            .collect()
    };
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let mut desired = Desired::build(&c, &config(), Family::V4);
    assert_eq!(
        hairpin(desired.table()),
        [ip("10.180.1.1"), ip("10.180.1.3"), ip("10.180.2.1")]
    );
    // With externalTrafficPolicy Cluster, traffic from elsewhere is masqueraded anyway.
    set_local(&mut c, false);
    desired.update(&c, &config(), [&svc2]);
    assert_eq!(desired.table(), &build(&c, &config(), Family::V4).table);
    assert_eq!(
        hairpin(desired.table()),
        [ip("10.180.1.1"), ip("10.180.1.3")]
    );
}
