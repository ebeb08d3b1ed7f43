//! Proptest strategies: Service specs, overlapping claims and changes.

use super::*;

pub fn specs() -> impl Strategy<Value = Vec<SvcSpec>> {
    prop::collection::btree_map(
        1u8..40,
        (
            // Both sides of LIST_MAX_ENDPOINTS and of the flat path's first classes (32 / 33):
            // shared lists and the flat path.
            prop::collection::btree_set(1u16..50, 0..40),
            any::<bool>(),
            any::<bool>(),
        ),
        0..12,
    )
    .prop_map(|m: BTreeMap<u8, _>| {
        m.into_iter()
            .map(|(id, (eps, node_port, udp))| SvcSpec {
                id,
                endpoints: eps.into_iter().collect(),
                node_port,
                udp,
                ..SvcSpec::default()
            })
            .collect()
    })
}

/// An address Services may claim: a ClusterIP of the pool (172.30.0.1-8) or 192.0.2.1-3.
pub fn claimable_addr() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        (1u8..9).prop_map(|n| IpAddr::from([172, 30, 0, n])),
        (1u8..4).prop_map(|n| IpAddr::from([192, 0, 2, n])),
    ]
}

/// Small clusters whose Services fight over frontends: ClusterIPs from a pool of 8 (shared
/// ones), external and load-balancer IPs equal to ClusterIPs or to each other, on port 80 or
/// 53, with and without creation timestamps (ties too), chains of their own (more endpoints
/// than the shared lists take, or session affinity) and NodePorts.
pub fn overlapping_specs() -> impl Strategy<Value = Vec<SvcSpec>> {
    let one = (
        prop::collection::btree_set(1u16..50, 0..LONG as usize + 20),
        any::<bool>(),
        any::<bool>(),
        prop::option::of(1u8..9),
        prop::collection::vec(claimable_addr(), 0..3),
        prop::collection::vec(claimable_addr(), 0..2),
        prop::option::of(Just(53u16)),
        prop::option::of(0u8..3),
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.2),
    );
    prop::collection::btree_map(1u8..10, one, 0..8).prop_map(|m: BTreeMap<u8, _>| {
        m.into_iter()
            .map(
                |(
                    id,
                    (
                        eps,
                        node_port,
                        udp,
                        cluster_ip,
                        external_ips,
                        lb,
                        port,
                        created,
                        affinity,
                        second_port,
                    ),
                )| {
                    SvcSpec {
                        id,
                        endpoints: eps.into_iter().collect(),
                        node_port,
                        udp,
                        cluster_ip,
                        external_ips,
                        load_balancer_ips: lb,
                        port,
                        created,
                        affinity,
                        second_port,
                    }
                },
            )
            .collect()
    })
}

/// Services whose spec differs between `a` and `b` (as the change tracker would report them),
/// plus `extra` unchanged ones (a tracker may report Services that turn out unchanged).
pub fn changed_names(a: &[SvcSpec], b: &[SvcSpec], extra: &[u8]) -> Vec<ObjectName> {
    let key = |s: &SvcSpec| s.clone();
    let ma: BTreeMap<u8, _> = a.iter().map(|s| (s.id, key(s))).collect();
    let mb: BTreeMap<u8, _> = b.iter().map(|s| (s.id, key(s))).collect();
    let mut ids: Vec<u8> = ma
        .keys()
        .chain(mb.keys())
        .copied()
        .filter(|id| ma.get(id) != mb.get(id) || extra.contains(id))
        .collect();
    ids.sort();
    ids.dedup();
    ids.iter()
        .map(|id| ObjectName::new("ns", &format!("svc{id}")))
        .collect()
}

/// One change: a Service created, updated or deleted (`None`).
pub fn change() -> impl Strategy<Value = (u8, Option<SvcSpec>)> {
    (
        1u8..10,
        prop::option::weighted(
            0.8,
            overlapping_specs().prop_filter("one", |v| !v.is_empty()),
        ),
    )
        .prop_map(|(id, spec)| {
            let spec = spec.map(|v| SvcSpec { id, ..v[0].clone() });
            (id, spec)
        })
}
