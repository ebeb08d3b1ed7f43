//! Large Services on the flat path changing a few endpoints at a time: an update only
//! compares what changed (`build::diff`), and the result must still be a full build's table,
//! reached by a scoped plan of a few elements.

use std::collections::BTreeSet;

use super::*;

fn spec(id: u8, endpoints: &BTreeSet<u16>, node_port: bool) -> SvcSpec {
    SvcSpec {
        id,
        endpoints: endpoints.iter().copied().collect(),
        node_port,
        ..SvcSpec::default()
    }
}

/// [`spec`], with a load-balancer IP if `load_balancer` (one more list of the same endpoints)
/// and a second port if `second_port` (each list twice, to another target port).
fn spec_at(
    id: u8,
    endpoints: &BTreeSet<u16>,
    node_port: bool,
    load_balancer: bool,
    second_port: bool,
) -> SvcSpec {
    SvcSpec {
        load_balancer_ips: if load_balancer {
            vec![IpAddr::from([192, 0, 2, id])]
        } else {
            vec![]
        },
        second_port,
        ..spec(id, endpoints, node_port)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn large_service_endpoint_changes_equal_full_builds(
        start in prop::collection::btree_set(1u16..1200, 10..600),
        steps in prop::collection::vec(
            (
                prop::collection::btree_set(1u16..1200, 0..4),
                prop::collection::btree_set(1u16..1200, 0..3),
            ),
            1..8,
        ),
        node_port in any::<bool>(),
        load_balancer in any::<bool>(),
        second_port in any::<bool>(),
    ) {
        // A second large Service shares the flat-path maps.
        let other = spec(2, &(1..=40).collect(), false);
        let mut eps = start;
        let c = cluster(&[spec_at(1, &eps, node_port, load_balancer, second_port), other.clone()]);
        let mut desired = Desired::build(&c, &config(), Family::V4);
        let mut state = fresh_state(desired.table());
        for (gone, came) in steps {
            let was = eps.len();
            let removed = gone.iter().filter(|e| eps.remove(e)).count();
            let added = came.iter().filter(|e| eps.insert(**e)).count();
            let c = cluster(&[spec_at(1, &eps, node_port, load_balancer, second_port), other.clone()]);
            let updated = desired.update(&c, &config(), [&ObjectName::new("ns", "svc1")]);
            let full = build(&c, &config(), Family::V4);
            prop_assert_eq!(without_regions(desired.table()), without_regions(&full.table));
            prop_assert_eq!(desired.no_local_endpoints(), full.no_local_endpoints);
            match updated {
                Updated::Scope(scope) => {
                    // On the flat path before and after: per endpoint its hairpin element and
                    // two entries of each list (ClusterIP, NodePort, load-balancer IP, for each
                    // port), and the class sets.
                    let flat = |n: usize| n > LIST_MAX_ENDPOINTS;
                    let lists = (1 + usize::from(node_port) + usize::from(load_balancer))
                        * (1 + usize::from(second_port));
                    if flat(was) && flat(eps.len()) {
                        let touched: usize = scope.elements.values().map(|k| k.len()).sum();
                        let most = (1 + 2 * lists) * (removed + added) + 2 * lists;
                        prop_assert!(touched <= most, "{touched} > {most}");
                    }
                    step_scope(&mut state, desired.table(), &scope);
                }
                Updated::All(before) => step_from(&mut state, desired.table(), &before),
            }
            prop_assert_eq!(&state, &fresh_state(desired.table()));
        }
    }
}

/// A Service whose two ports share one address list stops sharing when one port's endpoints
/// differ (a slice of its own with one more endpoint) and shares again when they agree: each
/// update equals a full build, and the kernel state follows the scoped plans.
#[test]
fn ports_that_stop_and_start_sharing_update_like_a_full_build() {
    use nftproxy_dataplane::nft::build::shared::{SERVICE_ENDPOINTS, SERVICE_TARGET_PORTS};
    let eps: BTreeSet<u16> = (1..=40).collect();
    let alike = cluster(&[spec_at(1, &eps, true, true, true)]);
    // Port "q" gets a slice of its own with one more endpoint.
    let mut apart = alike.clone();
    let mut slices: Vec<EndpointSlice> = apart.slices.values().cloned().collect();
    let mut q = slices[0].clone();
    slices[0].ports = slices[0]
        .ports
        .iter()
        .filter(|p| &*p.name == "p")
        .cloned()
        .collect();
    q.name = ObjectName::new("ns", "svc1-q");
    q.ports = q
        .ports
        .iter()
        .filter(|p| &*p.name == "q")
        .cloned()
        .collect();
    let mut extra = q.endpoints.iter().next().expect("an endpoint").clone();
    extra.addr = IpAddr::from([10, 190, 1, 1]);
    q.endpoints.push(extra);
    slices.push(q);
    apart.slices = slices.into_iter().map(|s| (s.name.clone(), s)).collect();
    let shares = |t: &Table| !t.sets[SERVICE_TARGET_PORTS].elements.is_empty();
    let mut desired = Desired::build(&alike, &config(), Family::V4);
    assert!(shares(desired.table()));
    assert_eq!(desired.table().sets[SERVICE_ENDPOINTS].elements.len(), 40);
    let mut state = fresh_state(desired.table());
    for (c, sharing) in [(&apart, false), (&alike, true), (&apart, false)] {
        let updated = desired.update(c, &config(), [&ObjectName::new("ns", "svc1")]);
        let full = build(c, &config(), Family::V4);
        assert_eq!(shares(&full.table), sharing);
        assert_eq!(
            without_regions(desired.table()),
            without_regions(&full.table)
        );
        match updated {
            Updated::Scope(scope) => {
                step_scope(&mut state, desired.table(), &scope);
            }
            Updated::All(before) => step_from(&mut state, desired.table(), &before),
        }
        assert_eq!(&state, &fresh_state(desired.table()));
    }
}
