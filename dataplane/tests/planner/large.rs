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
    ) {
        // A second large Service shares the flat-path maps.
        let other = spec(2, &(1..=40).collect(), false);
        let mut eps = start;
        let c = cluster(&[spec(1, &eps, node_port), other.clone()]);
        let mut desired = Desired::build(&c, &config(), Family::V4);
        let mut state = fresh_state(desired.table());
        for (gone, came) in steps {
            let was = eps.len();
            let removed = gone.iter().filter(|e| eps.remove(e)).count();
            let added = came.iter().filter(|e| eps.insert(**e)).count();
            let c = cluster(&[spec(1, &eps, node_port), other.clone()]);
            let updated = desired.update(&c, &config(), [&ObjectName::new("ns", "svc1")]);
            let full = build(&c, &config(), Family::V4);
            prop_assert_eq!(without_regions(desired.table()), without_regions(&full.table));
            prop_assert_eq!(desired.no_local_endpoints(), full.no_local_endpoints);
            match updated {
                Updated::Scope(scope) => {
                    // On the flat path before and after: per endpoint its hairpin element and
                    // two entries of each list (ClusterIP, NodePort), and the class sets.
                    let flat = |n: usize| n > LIST_MAX_ENDPOINTS;
                    if flat(was) && flat(eps.len()) {
                        let touched: usize = scope.elements.values().map(|k| k.len()).sum();
                        prop_assert!(touched <= 5 * (removed + added) + 4, "{touched}");
                    }
                    step_scope(&mut state, desired.table(), &scope);
                }
                Updated::All(before) => step_from(&mut state, desired.table(), &before),
            }
            prop_assert_eq!(&state, &fresh_state(desired.table()));
        }
    }
}
