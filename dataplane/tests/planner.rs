//! Planner invariants over generated clusters: plan(a, b) applied to a gives b, plan(b, b) is
//! empty, and the result does not depend on the path taken.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use nftproxy_dataplane::conflicts::{Conflict, conflicts, suppressed};
use nftproxy_dataplane::model::{
    Cluster, Endpoint, EndpointPort, EndpointSlice, Hints, ObjectName, Service, ServicePort,
    ServiceType, Site,
};
use nftproxy_dataplane::nft::build::{
    BIG_MAX_ENDPOINTS, BuildConfig, EXTERNAL_TO_CLUSTER_IPS, EndpointLists, LIST_MAX_ENDPOINTS,
    LocalDetector, affinity, build, shared,
};
use nftproxy_dataplane::nft::desired::{Before, Desired, Scope, Updated};
use nftproxy_dataplane::nft::plan::{
    plan, plan_cleanup, plan_cleanup_scope, plan_scope, split_new_chains,
};
use nftproxy_dataplane::nft::render;
use nftproxy_dataplane::nft::ruleset::{
    Action, Chain, ElementMap, Family, Key, KeyType, Proto, Rule, Set, Table, Value, Verdict,
    region_at,
};
use nftproxy_dataplane::nft::state::{TableState, fingerprint};
use nftproxy_dataplane::nft::transaction::{Op, Transaction};
use proptest::prelude::*;

#[path = "planner/hairpin.rs"]
mod hairpin;
#[path = "planner/kernel.rs"]
mod kernel;
#[path = "planner/large.rs"]
mod large;
#[path = "planner/strategies.rs"]
mod strategies;
#[path = "planner/world.rs"]
mod world;

use kernel::*;
use strategies::*;
use world::*;

proptest! {
    #[test]
    fn plan_reaches_the_desired_state(a in specs(), b in specs()) {
        let ta = table(&a);
        let tb = table(&b);
        let mut kernel = Kernel::default();
        step(&mut kernel, &ta);
        step(&mut kernel, &tb);
        prop_assert_eq!(&kernel, &fresh_state(&tb));
        // Nothing left to do afterwards, whether planned against the table read back or
        // against what the agent keeps.
        let state = kernel.read().unwrap();
        prop_assert!(plan(Some(&state), &Before::Nothing, &tb).is_empty());
        prop_assert!(plan_cleanup(&state, &tb).is_empty());
        let thin = kernel.thin();
        prop_assert!(plan(Some(&thin), &Before::Delta(Default::default()), &tb).is_empty());
        prop_assert!(plan(Some(&thin), &Before::Sets(tb.sets.clone()), &tb).is_empty());
        prop_assert!(thin.agrees_with(&state, &tb));
    }
}

proptest! {
    #[test]
    fn split_parts_reach_the_same_state_and_only_the_last_is_visible(
        a in specs(),
        b in specs(),
        cold in any::<bool>(),
        per_part in 1usize..8,
    ) {
        let mut kernel = Kernel::default();
        if !cold {
            step(&mut kernel, &table(&a));
        }
        let start = kernel.read();
        let tb = table(&b);
        let tx = plan(start.as_ref(), &Before::Nothing, &tb);
        let parts = split_new_chains(start.as_ref(), tx.clone(), per_part);

        let mut whole = kernel.clone();
        whole.apply(&tx);
        let mut stepwise = kernel.clone();
        for part in &parts {
            stepwise.apply(part);
        }
        prop_assert_eq!(&stepwise, &whole);
        // The state the agent keeps, part by part, is the one the whole transaction gives.
        let mut planned = start.clone().unwrap_or_default();
        planned.settle();
        let mut at_once = planned.clone();
        at_once.apply(&tx);
        for part in &parts {
            planned.apply(part);
        }
        prop_assert_eq!(&planned, &at_once);
        prop_assert_eq!(
            parts.iter().map(|p| p.ops.len()).sum::<usize>(),
            tx.ops.len()
        );

        let existed = |chain: &str| start.as_ref().is_some_and(|s| s.chains.contains_key(chain));
        let (_, early) = parts.split_last().expect("at least one part");
        for part in early {
            let mut rules = 0;
            for op in &part.ops {
                match op {
                    Op::AddTable => prop_assert!(start.is_none()),
                    Op::AddSet { name, .. } => {
                        prop_assert!(!start.as_ref().is_some_and(|s| s.sets.contains_key(name)))
                    }
                    Op::AddChain { name, .. } => prop_assert!(!existed(name), "{:?}", op),
                    Op::AddRules { chain, rules: r } => {
                        prop_assert!(!existed(chain), "{:?}", op);
                        prop_assert!(tb.chains[chain].base.is_none());
                        rules += r.len();
                    }
                    other => prop_assert!(false, "{:?} before the last part", other),
                }
            }
            let rule_ops = part.ops.iter().filter(|op| matches!(op, Op::AddRules { .. })).count();
            prop_assert!(rules <= per_part || rule_ops == 1, "{} rules in a part", rules);
        }
    }
}

/// Whether an update that planned everything had to: a set needs another size, or a
/// session-affinity timeout came or went (its record rules are rewritten).
fn full_plan_called_for(state: &Kernel, table: &Table) -> bool {
    let resized = table.sets.iter().any(|(name, s)| {
        state
            .thin()
            .sets
            .get(name)
            .is_some_and(|k| k.decl.size != s.decl.size)
    });
    let timeouts = |names: Vec<&String>| -> Vec<String> {
        names
            .into_iter()
            .filter(|n| affinity::timeout_of_set(n).is_some())
            .cloned()
            .collect()
    };
    let before = timeouts(state.thin().sets.keys().collect());
    resized || before != timeouts(table.sets.keys().collect())
}

proptest! {
    #[test]
    fn incremental_update_equals_full_build(
        a in overlapping_specs(),
        b in overlapping_specs(),
        extra in prop::collection::vec(1u8..10, 0..3),
    ) {
        let (ca, cb) = (cluster(&a), cluster(&b));
        let mut desired = Desired::build(&ca, &config(), Family::V4);
        prop_assert_eq!(desired.table(), &table(&a));
        let mut state = Kernel::default();
        step(&mut state, desired.table());

        let names = changed_names(&a, &b, &extra);
        let updated = desired.update(&cb, &config(), &names);
        let full = build(&cb, &config(), Family::V4);
        prop_assert_eq!(without_regions(desired.table()), without_regions(&full.table));
        prop_assert!(desired.table().set_sizes_fit(desired.table().sets.keys().map(String::as_str)));
        prop_assert_eq!(desired.no_local_endpoints(), full.no_local_endpoints);
        let counts = desired.object_counts();
        prop_assert_eq!(counts.0, full.table.chains.len());
        prop_assert_eq!(counts.1, full.table.chains.values().map(|c| c.rules.len()).sum::<usize>());
        prop_assert_eq!(counts.3, full.table.sets.values().map(|s| s.elements.len()).sum::<usize>());

        // Planning only the scope takes the kernel to the same state as planning everything.
        // Without a node-wide change, only a set that needs another size makes the update
        // plan everything: conflicting frontends are decided per Service.
        match updated {
            Updated::Scope(scope) => {
                step_scope(&mut state, desired.table(), &scope);
            }
            Updated::All(before) => {
                prop_assert!(
                    full_plan_called_for(&state, desired.table()),
                    "a full plan without a resized set or a new or last session-affinity timeout"
                );
                step_from(&mut state, desired.table(), &before);
            }
        }
        prop_assert_eq!(&state, &fresh_state(desired.table()));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    /// A sequence of changes (batches of one to three Services), each applied incrementally:
    /// after every batch the desired table is a full build's, the scoped plan takes the
    /// kernel there, and no conflict ever costs more than the Services involved.
    #[test]
    fn incremental_updates_through_a_sequence_of_conflicts_equal_full_builds(
        start in overlapping_specs(),
        batches in prop::collection::vec(prop::collection::vec(change(), 1..4), 1..6),
    ) {
        let mut specs: BTreeMap<u8, SvcSpec> = start.into_iter().map(|s| (s.id, s)).collect();
        let c = cluster(&specs.values().cloned().collect::<Vec<_>>());
        let mut desired = Desired::build(&c, &config(), Family::V4);
        let mut state = fresh_state(desired.table());
        for batch in batches {
            let mut names = Vec::new();
            for (id, spec) in batch {
                match spec {
                    Some(s) => specs.insert(id, s),
                    None => specs.remove(&id),
                };
                names.push(ObjectName::new("ns", &format!("svc{id}")));
            }
            let c = cluster(&specs.values().cloned().collect::<Vec<_>>());
            let updated = desired.update(&c, &config(), &names);
            let full = build(&c, &config(), Family::V4);
            prop_assert_eq!(without_regions(desired.table()), without_regions(&full.table));
            prop_assert_eq!(desired.no_local_endpoints(), full.no_local_endpoints);
            match updated {
                Updated::Scope(scope) => {
                    step_scope(&mut state, desired.table(), &scope);
                }
                Updated::All(before) => {
                    prop_assert!(
                        full_plan_called_for(&state, desired.table()),
                        "a full plan without a resized set or a new or last affinity timeout"
                    );
                    step_from(&mut state, desired.table(), &before);
                }
            }
            prop_assert_eq!(&state, &fresh_state(desired.table()));
        }
    }
}

#[test]
fn regions_stay_with_their_chains_and_are_reused() {
    let spec = |id, endpoints: Vec<u16>| SvcSpec {
        id,
        endpoints,
        node_port: false,
        udp: false,
        ..SvcSpec::default()
    };
    let region_of = |t: &Table, svc: &str| {
        t.chains
            .iter()
            .find(|(name, _)| name.starts_with("service-") && name.contains(svc))
            .and_then(|(_, c)| match &c.rules[0].action {
                Action::DnatRegion { map, offset } => Some((*map, *offset)),
                _ => None,
            })
    };
    // More endpoints than the flat path takes: svc1 has a chain and a region; svc2 none.
    let many = |from: u16, to: u16| (from..=to).collect::<Vec<u16>>();
    let mut c = cluster(&[spec(1, many(1, HUGE)), spec(2, many(1, LONG + 1))]);
    let mut desired = Desired::build(&c, &config(), Family::V4);
    let before = region_of(desired.table(), "ns/svc1/").expect("svc1 uses an endpoint map");
    // Endpoints come and go: the rule, and so the region, stays.
    for endpoints in [many(1, HUGE + 1), many(3, HUGE + 2), many(4, HUGE + 11)] {
        c = cluster(&[spec(1, endpoints), spec(2, many(1, LONG + 1))]);
        let updated = desired.update(&c, &config(), [&ObjectName::new("ns", "svc1")]);
        assert!(matches!(updated, Updated::Scope(_)));
        assert_eq!(region_of(desired.table(), "ns/svc1/"), Some(before));
    }
    // Deleted, the region is free for the next chain of its map; its elements are gone.
    c = cluster(&[spec(2, many(1, LONG + 1))]);
    desired.update(&c, &config(), [&ObjectName::new("ns", "svc1")]);
    let left: usize = desired
        .table()
        .sets
        .values()
        .filter(|s| s.decl.key == KeyType::Interval)
        .map(|s| s.elements.len())
        .sum();
    assert_eq!(left, 0, "svc2 is on the flat path");
    assert!(
        !desired.table().sets.contains_key(before.0)
            || region_of(desired.table(), "ns/svc2/").is_some_and(|s| s.0 == before.0)
    );
}

#[test]
fn services_claiming_one_frontend_update_in_place_like_a_full_build() {
    let plain = |id| SvcSpec {
        id,
        endpoints: vec![1],
        ..SvcSpec::default()
    };
    let shared: IpAddr = "192.0.2.7".parse().unwrap();
    let claims = |id| SvcSpec {
        external_ips: vec![shared],
        ..plain(id)
    };
    let mut specs = vec![claims(1), claims(2), plain(3)];
    let mut c = cluster(&specs);
    let mut desired = Desired::build(&c, &config(), Family::V4);
    assert_eq!(desired.table(), &build(&c, &config(), Family::V4).table);
    let mut state = fresh_state(desired.table());
    // The external IP shares its owner's ClusterIP list.
    let owner = |d: &Desired| -> Vec<IpAddr> {
        let external = Key::AddrProtoPort(shared, Proto::Tcp, 80);
        let Some(Some(Value::Addr(cluster_ip))) = d.table().sets[EXTERNAL_TO_CLUSTER_IPS]
            .elements
            .get(&external)
        else {
            return Vec::new();
        };
        let key = Key::AddrProtoPort(cluster_ip, Proto::Tcp, 80)
            .list_entry(0)
            .unwrap();
        d.table().sets["cluster-endpoints-1"]
            .elements
            .get(&key)
            .into_iter()
            .filter_map(|v| match v {
                Some(Value::Endpoint(addr, _)) => Some(addr),
                _ => None,
            })
            .collect()
    };
    // Without timestamps, svc1 (first by name) wins.
    assert_eq!(owner(&desired), [IpAddr::from([10, 180, 1, 1])]);
    // Each step changes one Service; the frontend moves between them in place.
    let steps: Vec<(u8, SvcSpec, [u8; 4])> = vec![
        // svc2 becomes older: it wins.
        (
            2,
            SvcSpec {
                created: Some(1),
                ..claims(2)
            },
            [10, 180, 2, 1],
        ),
        // svc1 becomes older still.
        (
            1,
            SvcSpec {
                created: Some(0),
                ..claims(1)
            },
            [10, 180, 1, 1],
        ),
        // svc1 gives the address up: svc2 gets it back.
        (
            1,
            SvcSpec {
                created: Some(0),
                ..plain(1)
            },
            [10, 180, 2, 1],
        ),
    ];
    for (id, spec, want) in steps {
        specs[usize::from(id) - 1] = spec;
        c = cluster(&specs);
        let name = ObjectName::new("ns", &format!("svc{id}"));
        let Updated::Scope(scope) = desired.update(&c, &config(), [&name]) else {
            panic!("a conflict costs a partial update");
        };
        assert_eq!(
            without_regions(desired.table()),
            without_regions(&build(&c, &config(), Family::V4).table)
        );
        assert_eq!(owner(&desired), [IpAddr::from(want)]);
        step_scope(&mut state, desired.table(), &scope);
        assert_eq!(state, fresh_state(desired.table()));
    }
    // A new Service whose ClusterIP is svc2's new external IP: it is the ClusterIP's.
    specs.push(SvcSpec {
        id: 4,
        cluster_ip: Some(7),
        ..plain(4)
    });
    specs[1].external_ips = vec![IpAddr::from([172, 30, 0, 7])];
    let c = cluster(&specs);
    let names: Vec<ObjectName> = ["svc2", "svc4"]
        .iter()
        .map(|n| ObjectName::new("ns", n))
        .collect();
    assert!(matches!(
        desired.update(&c, &config(), &names),
        Updated::Scope(_)
    ));
    assert_eq!(
        without_regions(desired.table()),
        without_regions(&build(&c, &config(), Family::V4).table)
    );
    let conflicts: Vec<Conflict> = conflicts(&c.services);
    assert_eq!(conflicts.len(), 1, "{conflicts:?}");
    assert_eq!(conflicts[0].winner, ObjectName::new("ns", "svc4"));
    assert_eq!(conflicts[0].losers, [ObjectName::new("ns", "svc2")]);
}

#[test]
fn one_endpoint_change_touches_only_that_service() {
    // Two endpoints (the shared lists), LONG + 1 (the flat path) and, for svc8 and svc100,
    // HUGE + 1 (a chain of their own, with an endpoint-map region).
    let many: Vec<SvcSpec> = (1..=200u8)
        .map(|id| SvcSpec {
            id,
            endpoints: if id == 8 || id == 100 {
                (1..=HUGE + 1).collect()
            } else if id % 2 == 0 {
                (1..=LONG + 1).collect()
            } else {
                vec![1, 2]
            },
            node_port: false,
            udp: false,
            ..SvcSpec::default()
        })
        .collect();
    let mut kernel = Kernel::default();
    step(&mut kernel, &table(&many));
    let state = kernel.read();

    // svc7 (2 → 3 endpoints): its list moves from the 2- to the 3-endpoint map.
    let mut changed = many.clone();
    changed[6].endpoints.push(3);
    let after = table(&changed);
    let tx = plan(state.as_ref(), &Before::Nothing, &after);
    assert!(tx.ops.len() <= 3, "{:#?}", tx.ops);
    let cip: IpAddr = "172.30.0.7".parse().unwrap();
    for op in &tx.ops {
        let ok = match op {
            Op::AddElements { set, elements } if set == "hairpin-endpoints" => elements
                .iter()
                .all(|(k, _)| k == Key::AddrPair("10.180.7.3".parse().unwrap())),
            Op::AddElements { set, elements } => {
                set == "cluster-endpoints-3"
                    && elements.len() == 3
                    && elements
                        .iter()
                        .all(|(k, _)| matches!(k, Key::AddrProtoPortIndex(a, ..) if a == cip))
            }
            Op::DeleteElements { set, keys } => {
                set == "cluster-endpoints-2"
                    && keys.len() == 2
                    && keys
                        .iter()
                        .all(|k| matches!(k, Key::AddrProtoPortIndex(a, ..) if *a == cip))
            }
            _ => false,
        };
        assert!(ok, "unexpected op {op:?}");
    }

    // svc8 (one more endpoint): no rule is written (that would make the kernel re-validate
    // the whole table), svc8's region of its endpoint map is replaced, and the new endpoint
    // gets its hairpin element.
    let mut changed = many.clone();
    changed[7].endpoints.push(HUGE + 2);
    let after = table(&changed);
    let tx = plan(state.as_ref(), &Before::Nothing, &after);
    let (map, offset) = after
        .chains
        .iter()
        .find(|(name, _)| name.contains("ns/svc8/"))
        .and_then(|(_, c)| match &c.rules[0].action {
            Action::DnatRegion { map, offset } => Some((*map, *offset)),
            _ => None,
        })
        .expect("svc8 uses an endpoint map");
    let in_region =
        |k: &Key| matches!(k, Key::Interval { at, .. } if region_at(*at) == region_at(offset));
    for op in &tx.ops {
        let touches_svc8 = match op {
            Op::AddElements { set, elements } if set == "hairpin-endpoints" => {
                elements.iter().all(|(k, _)| {
                    k == Key::AddrPair(IpAddr::from([
                        10,
                        180 + ((HUGE + 2) >> 8) as u8,
                        8,
                        (HUGE + 2) as u8,
                    ]))
                })
            }
            Op::AddElements { set, elements } => {
                set == map && elements.iter().all(|(k, _)| in_region(&k))
            }
            Op::DeleteElements { set, keys } => set == map && keys.iter().all(in_region),
            _ => false,
        };
        assert!(touches_svc8, "unexpected op {op:?}");
    }
}

#[test]
fn fingerprints_differ_when_rules_differ() {
    let a = table(&[SvcSpec {
        id: 1,
        endpoints: (1..=HUGE).collect(),
        node_port: false,
        udp: false,
        ..SvcSpec::default()
    }]);
    let b = table(&[SvcSpec {
        id: 1,
        endpoints: (1..=HUGE).collect(),
        node_port: false,
        udp: true,
        ..SvcSpec::default()
    }]);
    let service_chain = |t: &Table| {
        t.chains
            .iter()
            .find(|(k, _)| k.starts_with("service-"))
            .map(|(_, c)| c.clone())
            .unwrap()
    };
    assert_ne!(
        fingerprint(&service_chain(&a)),
        fingerprint(&service_chain(&b))
    );
}

#[test]
fn a_restart_adopts_the_regions_the_kernel_has() {
    // Region chains (every 20th Service) and the flat path; later, the flat path's Services
    // lose their first endpoint, whose index the last one takes.
    let spec = |id: u8, later: bool| SvcSpec {
        id,
        endpoints: if id.is_multiple_of(20) {
            (1..=HUGE).collect()
        } else {
            (1 + u16::from(later)..=LONG + u16::from(id % 7)).collect()
        },
        node_port: id.is_multiple_of(3),
        udp: false,
        ..SvcSpec::default()
    };
    // Services come and go, so regions are no longer in name order.
    let first: Vec<SvcSpec> = (1..=60).map(|id| spec(id, false)).collect();
    let mut desired = Desired::build(&cluster(&first), &config(), Family::V4);
    let mut state = fresh_state(desired.table());
    let later: Vec<SvcSpec> = (20..=120).map(|id| spec(id, true)).collect();
    let c = cluster(&later);
    let names: Vec<ObjectName> = (1..=120)
        .map(|id| ObjectName::new("ns", &format!("svc{id}")))
        .collect();
    match desired.update(&c, &config(), &names) {
        Updated::Scope(scope) => {
            step_scope(&mut state, desired.table(), &scope);
        }
        // A set outgrew its size.
        Updated::All(before) => step_from(&mut state, desired.table(), &before),
    }
    assert_ne!(
        desired.table(),
        &build(&c, &config(), Family::V4).table,
        "the regions should differ from a fresh build's for this test to mean anything"
    );

    // A new process: the first build adopts the kernel's regions, and nothing is rewritten.
    let state = state.read().unwrap();
    let restarted = Desired::build_adopting(&c, &config(), Family::V4, &state);
    assert_eq!(restarted.table(), desired.table());
    assert!(plan(Some(&state), &Before::Nothing, restarted.table()).is_empty());
}

#[test]
fn without_a_free_region_a_chain_falls_back_to_the_cascade() {
    use nftproxy_dataplane::nft::build::{BuildEnv, base_table, service_fragment};
    use nftproxy_dataplane::nft::regions::{RegionSource, Regions};
    use nftproxy_dataplane::trace::{Host, Packet, trace};

    let c = cluster(&[SvcSpec {
        id: 1,
        endpoints: (1..=HUGE).collect(),
        node_port: false,
        udp: false,
        ..SvcSpec::default()
    }]);
    let config = config();
    let env = BuildEnv::new(&c, &config, Family::V4);
    let svc = c.services.values().next().unwrap();
    let table_with = |regions: &mut RegionSource<'_>| {
        let mut t = base_table(&config, &c, Family::V4);
        let sup = suppressed(&c.services, svc);
        service_fragment(svc, c.slices_of(&svc.name), &env, regions, &sup).merge_into(&mut t);
        t
    };
    let full = Regions::new();
    let cascade = table_with(&mut RegionSource::Lookup(&full));
    let mut regions = Regions::new();
    let mapped = table_with(&mut RegionSource::Assign(&mut regions));

    let service_rules = |t: &Table| {
        t.chains
            .iter()
            .find(|(name, _)| name.starts_with("service-"))
            .map(|(_, c)| c.rules.clone())
            .unwrap()
    };
    assert_eq!(
        service_rules(&cascade).len(),
        usize::from(HUGE),
        "one dnat rule per endpoint"
    );
    assert!(
        !cascade
            .sets
            .values()
            .any(|s| s.decl.key == KeyType::Interval)
    );
    assert!(matches!(
        service_rules(&mapped)[..],
        [Rule {
            action: Action::DnatRegion { .. },
            ..
        }]
    ));

    // Either way a connection reaches the same endpoints.
    let pkt = Packet {
        src: IpAddr::from([10, 180, 9, 9]),
        dst: "172.30.0.1:80".parse().unwrap(),
        proto: Proto::Tcp,
        iif: None,
    };
    // The tracer follows the cascade's rules recursively: give it room.
    let (a, b) = std::thread::Builder::new()
        .stack_size(1 << 30)
        .spawn(move || {
            let a = trace(&cascade, &Host::default(), &pkt);
            (a, trace(&mapped, &Host::default(), &pkt))
        })
        .unwrap()
        .join()
        .unwrap();
    assert_eq!(a.endpoints().len(), usize::from(HUGE));
    assert_eq!(a.outcomes, b.outcomes);
}

#[test]
fn a_set_that_outgrows_its_size_is_recreated_with_room() {
    let spec = |id| SvcSpec {
        id,
        endpoints: vec![1, 2],
        node_port: false,
        udp: false,
        ..SvcSpec::default()
    };
    // 30 Services: 60 elements in `cluster-endpoints-2`, size 192.
    let before: Vec<SvcSpec> = (1..=30).map(spec).collect();
    let mut desired = Desired::build(&cluster(&before), &config(), Family::V4);
    let size_of = |d: &Desired| d.table().sets["cluster-endpoints-2"].decl.size;
    assert_eq!(size_of(&desired), Some(192));
    let mut state = fresh_state(desired.table());

    // 50 more: 160 elements, more than three quarters of 192.
    let after: Vec<SvcSpec> = (1..=80).map(spec).collect();
    let names: Vec<ObjectName> = (31..=80)
        .map(|id| ObjectName::new("ns", &format!("svc{id}")))
        .collect();
    let c = cluster(&after);
    let Updated::All(before) = desired.update(&c, &config(), &names) else {
        panic!("expected a full plan");
    };
    assert_eq!(size_of(&desired), Some(384));
    let tx = plan(Some(&state.thin()), &before, desired.table());
    assert_eq!(
        tx,
        plan(state.read().as_ref(), &Before::Nothing, desired.table()),
        "delta and read-back plans differ"
    );
    assert!(
        tx.ops
            .iter()
            .any(|op| matches!(op, Op::DeleteSet { name } if name == "cluster-endpoints-2"))
    );
    // The chain that uses the map is rewritten with it.
    assert!(
        tx.ops
            .iter()
            .any(|op| matches!(op, Op::AddRules { chain, .. } if &**chain == "cluster-endpoints"))
    );
    step_from(&mut state, desired.table(), &before);
    assert_eq!(state, fresh_state(desired.table()));

    // One Service fewer keeps the new size (no recreation back and forth).
    let fewer: Vec<SvcSpec> = (1..=79).map(spec).collect();
    let gone = [ObjectName::new("ns", "svc80")];
    assert!(matches!(
        desired.update(&cluster(&fewer), &config(), &gone),
        Updated::Scope(_)
    ));
    assert_eq!(size_of(&desired), Some(384));
}

#[test]
fn a_flat_path_endpoint_change_is_a_few_elements() {
    // UDP, so that the NodePort keeps a list of its own (a TCP one shares the ClusterIP's).
    let spec = |endpoints: Vec<u16>| SvcSpec {
        id: 1,
        endpoints,
        node_port: true,
        udp: true,
        ..SvcSpec::default()
    };
    let c = cluster(&[spec((1..=1000).collect())]);
    let mut desired = Desired::build(&c, &config(), Family::V4);
    let mut state = fresh_state(desired.table());
    // The elements of the flat path a change sends (a replaced value counts once).
    let mut change = |endpoints: Vec<u16>| -> (usize, BTreeMap<String, usize>) {
        let c = cluster(&[spec(endpoints)]);
        let Updated::Scope(scope) = desired.update(&c, &config(), [&ObjectName::new("ns", "svc1")])
        else {
            panic!("expected a scoped update");
        };
        let tx = step_scope(&mut state, desired.table(), &scope);
        assert_eq!(state, fresh_state(desired.table()));
        let mut touched: BTreeMap<String, std::collections::BTreeSet<Key>> = BTreeMap::new();
        for op in &tx.ops {
            match op {
                Op::AddElements { set, elements } => touched
                    .entry(set.clone())
                    .or_default()
                    .extend(elements.iter().map(|(k, _)| k)),
                Op::DeleteElements { set, keys } => touched
                    .entry(set.clone())
                    .or_default()
                    .extend(keys.iter().copied()),
                other => panic!("unexpected op {other:?}"),
            }
        }
        let sizes: BTreeMap<String, usize> =
            touched.iter().map(|(s, k)| (s.clone(), k.len())).collect();
        (sizes.values().sum(), sizes)
    };
    // Endpoint 500 removed: its index gets the last endpoint, the last index goes (ClusterIP
    // and NodePort lists), and its hairpin element.
    let without_500: Vec<u16> = (1..=1000).filter(|e| *e != 500).collect();
    let (n, sets) = change(without_500.clone());
    assert_eq!(n, 5, "{sets:?}");
    assert_eq!(sets["big-endpoints"], 2);
    assert_eq!(sets["big-nodeport-endpoints"], 2);
    // One added: one new index per list.
    let mut more = without_500.clone();
    more.push(1001);
    let (n, sets) = change(more);
    assert_eq!(n, 3, "{sets:?}");
    // 1,024 → 1,025 endpoints moves the destinations to the next class.
    let (_, sets) = change((1..=1024).collect());
    assert!(sets["big-endpoints"] <= 26, "{sets:?}");
    let (n, sets) = change((1..=1025).collect());
    assert_eq!(n, 7, "{sets:?}");
    assert_eq!(sets["big-class-10"] + sets["big-class-11"], 2);
    // Down to 16: back to the shared lists (the emptied maps are resized: a full plan).
    let c = cluster(&[spec((1..=16).collect())]);
    desired.update(&c, &config(), [&ObjectName::new("ns", "svc1")]);
    let t = desired.table();
    assert_eq!(t.sets["cluster-endpoints-16"].elements.len(), 16);
    assert!(t.sets["big-endpoints"].elements.is_empty());
}
