//! Planner invariants over generated clusters: plan(a, b) applied to a gives b, plan(b, b) is
//! empty, and the result does not depend on the path taken.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use nftproxy_dataplane::conflicts::{Conflict, conflicts, suppressed};
use nftproxy_dataplane::model::{
    Cluster, Endpoint, EndpointPort, EndpointSlice, ObjectName, Service, ServicePort, ServiceType,
};
use nftproxy_dataplane::nft::build::{BuildConfig, LIST_MAX_ENDPOINTS, LocalDetector, build};
use nftproxy_dataplane::nft::desired::{Before, Desired, Scope, Updated};
use nftproxy_dataplane::nft::plan::{
    fingerprint, plan, plan_cleanup, plan_cleanup_scope, plan_scope, split_new_chains,
};
use nftproxy_dataplane::nft::render;
use nftproxy_dataplane::nft::ruleset::{
    Action, Chain, Family, Key, KeyType, Proto, Rule, Set, Table, Value, Verdict, region_at,
};
use nftproxy_dataplane::nft::state::{ChainState, Elements, SetState, TableState, dnat_region};
use nftproxy_dataplane::nft::transaction::{Op, Transaction};
use proptest::prelude::*;

/// The fewest endpoints that give a Service port a chain of its own (more than the shared
/// endpoint lists take).
const LONG: u8 = LIST_MAX_ENDPOINTS as u8 + 1;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct SvcSpec {
    id: u8,
    endpoints: Vec<u8>,
    node_port: bool,
    udp: bool,
    /// The last octet of the ClusterIP 172.30.0.N (default: `id`); Services with the same
    /// one conflict.
    cluster_ip: Option<u8>,
    /// External and load-balancer IPs: 172.30.0.N (maybe another Service's ClusterIP) or
    /// 192.0.2.N.
    external_ips: Vec<IpAddr>,
    load_balancer_ips: Vec<IpAddr>,
    /// The Service port (default 80).
    port: Option<u16>,
    /// `creationTimestamp`, in seconds after 2020-01-01.
    created: Option<u8>,
    affinity: bool,
}

fn cluster(specs: &[SvcSpec]) -> Cluster {
    let mut c = Cluster::default();
    for s in specs {
        let name = ObjectName::new("ns", &format!("svc{}", s.id));
        let protocol = if s.udp { Proto::Udp } else { Proto::Tcp };
        c.services.insert(
            name.clone(),
            Arc::new(Service {
                name: name.clone(),
                service_type: if s.node_port {
                    ServiceType::NodePort
                } else {
                    ServiceType::ClusterIp
                },
                cluster_ips: vec![IpAddr::from([172, 30, 0, s.cluster_ip.unwrap_or(s.id)])],
                external_ips: s.external_ips.clone(),
                load_balancer_ips: s.load_balancer_ips.clone(),
                load_balancer_source_ranges: vec![],
                external_policy_local: false,
                internal_policy_local: false,
                health_check_node_port: None,
                affinity_timeout: s.affinity.then_some(60),
                ports: vec![ServicePort {
                    name: "p".into(),
                    protocol,
                    port: s.port.unwrap_or(80),
                    node_port: s.node_port.then_some(30000 + u16::from(s.id)),
                }],
                creation_timestamp: s
                    .created
                    .map(|t| Timestamp::from_second(1_577_836_800 + i64::from(t)).unwrap()),
            }),
        );
        let slice = ObjectName::new("ns", &format!("svc{}-x", s.id));
        c.slices.insert(
            slice.clone(),
            EndpointSlice {
                name: slice,
                service: name,
                family: Family::V4,
                ports: vec![EndpointPort {
                    name: "p".into(),
                    protocol,
                    port: 8080,
                }],
                endpoints: s
                    .endpoints
                    .iter()
                    .map(|e| Endpoint {
                        addr: IpAddr::from([10, 180, s.id, *e]),
                        ready: true,
                        serving: true,
                        terminating: false,
                        node_name: Some("node".into()),
                        zone_hints: Box::default(),
                        node_hints: Box::default(),
                    })
                    .collect(),
                trigger_time: None,
            },
        );
    }
    c
}

fn config() -> BuildConfig {
    BuildConfig {
        node_name: "node".into(),
        local_detector: LocalDetector::ClusterCidr(vec!["10.0.0.0/8".parse().unwrap()]),
        ..BuildConfig::default()
    }
}

fn table(specs: &[SvcSpec]) -> Table {
    build(&cluster(specs), &config(), Family::V4).table
}

/// `t` without its choice of endpoint-map regions: every `DnatRegion` rule becomes one `dnat` rule
/// per endpoint of its region, in order, and the endpoint maps go. Two tables that agree here
/// send every connection to the same endpoints with the same odds.
fn without_regions(t: &Table) -> Table {
    let mut out = t.clone();
    out.sets.retain(|_, s| s.decl.key != KeyType::Interval);
    // Set sizes depend on history too (a set keeps its size while it fits).
    for set in out.sets.values_mut() {
        set.decl.size = None;
    }
    for chain in out.chains.values_mut() {
        let rules = chain
            .rules
            .iter()
            .flat_map(|rule| match &rule.action {
                Action::DnatRegion { map, offset } => t.sets[*map]
                    .elements
                    .iter()
                    .filter_map(|(k, v)| match (k, v) {
                        (Key::Interval { at, .. }, Some(Value::Endpoint(addr, port)))
                            if region_at(*at) == region_at(*offset) =>
                        {
                            Some(Rule::new(
                                rule.matches.clone(),
                                Action::Dnat {
                                    addr: *addr,
                                    port: *port,
                                },
                            ))
                        }
                        _ => None,
                    })
                    .collect(),
                _ => vec![rule.clone()],
            })
            .collect();
        *chain = Chain {
            rules: Arc::new(rules),
            ..chain.clone()
        };
    }
    out
}

/// A strict model of table `nftproxy` in the kernel, elements included: it refuses what
/// nf_tables refuses (rules in missing chains, rules, elements and verdicts naming missing
/// sets or chains, an element added again with other data, deleting a missing element, a chain
/// with rules or one something still jumps to, a set a rule still uses). The planner's own
/// [`TableState`] is thin (no elements), so it cannot serve as the kernel here.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Kernel {
    table: Option<Table>,
}

/// The sets (`@name`) and chains (`jump`/`goto name`) nft text refers to.
fn references(text: &str) -> (Vec<String>, Vec<String>) {
    let words: Vec<&str> = text
        .split(|c: char| c.is_whitespace() || c == ',' || c == '{' || c == '}' || c == ':')
        .filter(|w| !w.is_empty())
        .collect();
    let sets = words
        .iter()
        .filter_map(|w| w.strip_prefix('@'))
        .map(str::to_string)
        .collect();
    let chains = words
        .windows(2)
        .filter(|w| w[0] == "jump" || w[0] == "goto")
        .map(|w| w[1].to_string())
        .collect();
    (sets, chains)
}

fn value_chain(v: &Option<Value>) -> Option<&str> {
    match v {
        Some(Value::Verdict(Verdict::Jump(c) | Verdict::Goto(c))) => Some(c),
        _ => None,
    }
}

impl Kernel {
    fn table(&mut self) -> &mut Table {
        self.table.as_mut().expect("ENOENT: no table")
    }

    /// Applies `tx` as nf_tables would, panicking where it would refuse it.
    fn apply(&mut self, tx: &Transaction) {
        for op in &tx.ops {
            self.apply_op(op);
        }
    }

    fn apply_op(&mut self, op: &Op) {
        match op {
            Op::AddTable => {
                self.table.get_or_insert_with(|| Table::new(Family::V4));
            }
            Op::DeleteTable => self.table = None,
            Op::AddChain { name, base, .. } => {
                let t = self.table();
                match t.chains.get(name) {
                    Some(c) => assert_eq!(&c.base, base, "EEXIST: chain {name} hook changed"),
                    None => {
                        t.chains.insert(
                            name.clone(),
                            Chain {
                                base: *base,
                                comment: None,
                                rules: Arc::new(Vec::new()),
                            },
                        );
                    }
                }
            }
            Op::FlushChain { name } => {
                let c = self.table().chains.get_mut(name);
                c.unwrap_or_else(|| panic!("ENOENT: flush chain {name}"))
                    .rules = Arc::new(Vec::new());
            }
            Op::DeleteChain { name } => {
                let t = self.table();
                let c = t
                    .chains
                    .get(name)
                    .unwrap_or_else(|| panic!("ENOENT: chain {name}"));
                assert!(c.rules.is_empty(), "EBUSY: chain {name} has rules");
                let jumped = t.chains.values().flat_map(|c| c.rules.iter()).any(|r| {
                    references(&render::rule_text(r))
                        .1
                        .iter()
                        .any(|c| c == &**name)
                });
                let mapped = t
                    .sets
                    .values()
                    .flat_map(|s| s.elements.values())
                    .any(|v| value_chain(v) == Some(name));
                assert!(!jumped && !mapped, "EBUSY: chain {name} in use");
                t.chains.remove(name);
            }
            Op::AddRules { chain, rules } => {
                let t = self.table();
                for r in rules.iter() {
                    let (sets, chains) = references(&render::rule_text(r));
                    for s in sets {
                        assert!(t.sets.contains_key(&s), "ENOENT: set {s} in {chain}");
                    }
                    for c in chains {
                        assert!(
                            t.chains.contains_key(c.as_str()),
                            "ENOENT: chain {c} in {chain}"
                        );
                    }
                }
                let c = t
                    .chains
                    .get_mut(chain)
                    .unwrap_or_else(|| panic!("ENOENT: add rules to {chain}"));
                Arc::make_mut(&mut c.rules).extend(rules.iter().cloned());
            }
            Op::AddSet { name, decl } => {
                let t = self.table();
                match t.sets.get(name) {
                    Some(s) => assert_eq!(&s.decl, decl, "EEXIST: set {name} declared again"),
                    None => {
                        t.sets.insert(
                            name.clone(),
                            Set {
                                decl: decl.clone(),
                                elements: BTreeMap::new(),
                            },
                        );
                    }
                }
            }
            Op::DeleteSet { name } => {
                let t = self.table();
                let used = t.chains.values().flat_map(|c| c.rules.iter()).any(|r| {
                    references(&render::rule_text(r))
                        .0
                        .iter()
                        .any(|s| s == name)
                });
                assert!(!used, "EBUSY: set {name} in use");
                assert!(t.sets.remove(name).is_some(), "ENOENT: set {name}");
            }
            Op::AddElements { set, elements } => {
                let t = self.table();
                for (_, v) in elements {
                    if let Some(c) = value_chain(v) {
                        assert!(t.chains.contains_key(c), "ENOENT: chain {c} in @{set}");
                    }
                }
                let s = t
                    .sets
                    .get_mut(set)
                    .unwrap_or_else(|| panic!("ENOENT: elements of {set}"));
                for (k, v) in elements {
                    if let Some(old) = s.elements.insert(*k, v.clone()) {
                        assert_eq!(&old, v, "EEXIST: {k:?} in {set} with other data");
                    }
                }
            }
            Op::DeleteElements { set, keys } => {
                let s = self
                    .table()
                    .sets
                    .get_mut(set)
                    .unwrap_or_else(|| panic!("ENOENT: elements of {set}"));
                for k in keys {
                    assert!(s.elements.remove(k).is_some(), "ENOENT: {k:?} in {set}");
                }
            }
        }
    }

    /// What reading the table back gives (elements included).
    fn read(&self) -> Option<TableState> {
        let t = self.table.as_ref()?;
        let chains = t
            .chains
            .iter()
            .map(|(name, c)| {
                let state = ChainState {
                    base: c.base,
                    fingerprint: Some(fingerprint(c)),
                    empty: c.rules.is_empty(),
                    region: dnat_region(&c.rules),
                };
                (name.clone(), state)
            })
            .collect();
        let sets = t
            .sets
            .iter()
            .map(|(name, s)| {
                let state = SetState {
                    decl: s.decl.clone(),
                    elements: Elements::Read(s.elements.clone()),
                };
                (name.clone(), state)
            })
            .collect();
        Some(TableState { chains, sets })
    }

    /// What the agent keeps after committing the desired table the kernel holds now.
    fn thin(&self) -> TableState {
        let mut state = self.read().unwrap_or_default();
        state.settle();
        state
    }
}

/// The kernel's table if `t` had been written from scratch.
fn fresh_state(t: &Table) -> Kernel {
    let mut k = Kernel::default();
    k.apply(&plan(None, &Before::Nothing, t));
    k
}

/// Applies plan + cleanup of a whole table after an update that returned `before`, planned
/// against the thin state the agent keeps: it must leave the kernel as a plan against the table
/// read back does.
fn step_from(kernel: &mut Kernel, t: &Table, before: &Before) {
    let mut read_back = kernel.clone();
    step(&mut read_back, t);
    let mut state = kernel.thin();
    let tx = plan(Some(&state), before, t);
    kernel.apply(&tx);
    state.apply(&tx);
    kernel.apply(&plan_cleanup(&state, t));
    assert_eq!(kernel, &read_back, "delta and read-back plans differ");
}

/// Applies plan + cleanup, planned against the table read back, like the agent's full syncs.
fn step(kernel: &mut Kernel, t: &Table) -> usize {
    let read = kernel.read();
    let tx = plan(read.as_ref(), &Before::Nothing, t);
    kernel.apply(&tx);
    let mut state = read.unwrap_or_default();
    state.settle();
    state.apply(&tx);
    let cleanup = plan_cleanup(&state, t);
    kernel.apply(&cleanup);
    tx.ops.len() + cleanup.ops.len()
}

/// Plans a change confined to `scope` twice, against the thin state the agent keeps (from the
/// changes the update recorded) and against the table read back: both must agree. Applies it.
fn step_scope(kernel: &mut Kernel, t: &Table, scope: &Scope) -> Transaction {
    let thin = kernel.thin();
    let tx = plan_scope(&thin, t, scope);
    let read = kernel.read().unwrap_or_default();
    assert_eq!(
        tx,
        plan_scope(&read, t, scope),
        "delta and read-back plans differ"
    );
    kernel.apply(&tx);
    let mut state = thin;
    state.apply(&tx);
    let cleanup = plan_cleanup_scope(&state, t, scope);
    kernel.apply(&cleanup);
    tx
}

fn specs() -> impl Strategy<Value = Vec<SvcSpec>> {
    prop::collection::btree_map(
        1u8..40,
        (
            // Both sides of LIST_MAX_ENDPOINTS: shared lists and Service chains.
            prop::collection::btree_set(1u8..40, 0..LONG as usize + 5),
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
fn claimable_addr() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        (1u8..9).prop_map(|n| IpAddr::from([172, 30, 0, n])),
        (1u8..4).prop_map(|n| IpAddr::from([192, 0, 2, n])),
    ]
}

/// Small clusters whose Services fight over frontends: ClusterIPs from a pool of 8 (shared
/// ones), external and load-balancer IPs equal to ClusterIPs or to each other, on port 80 or
/// 53, with and without creation timestamps (ties too), chains of their own (more endpoints
/// than the shared lists take, or session affinity) and NodePorts.
fn overlapping_specs() -> impl Strategy<Value = Vec<SvcSpec>> {
    let one = (
        prop::collection::btree_set(1u8..40, 0..LONG as usize + 3),
        any::<bool>(),
        any::<bool>(),
        prop::option::of(1u8..9),
        prop::collection::vec(claimable_addr(), 0..3),
        prop::collection::vec(claimable_addr(), 0..2),
        prop::option::of(Just(53u16)),
        prop::option::of(0u8..3),
        prop::bool::weighted(0.2),
    );
    prop::collection::btree_map(1u8..10, one, 0..8).prop_map(|m: BTreeMap<u8, _>| {
        m.into_iter()
            .map(
                |(
                    id,
                    (eps, node_port, udp, cluster_ip, external_ips, lb, port, created, affinity),
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
                    }
                },
            )
            .collect()
    })
}

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

/// Services whose spec differs between `a` and `b` (as the change tracker would report them),
/// plus `extra` unchanged ones (a tracker may report Services that turn out unchanged).
fn changed_names(a: &[SvcSpec], b: &[SvcSpec], extra: &[u8]) -> Vec<ObjectName> {
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
                let resized = desired.table().sets.iter().any(|(name, s)| {
                    state.thin().sets.get(name).is_some_and(|k| k.decl.size != s.decl.size)
                });
                prop_assert!(resized, "a full plan without a resized set");
                step_from(&mut state, desired.table(), &before);
            }
        }
        prop_assert_eq!(&state, &fresh_state(desired.table()));
    }
}

/// One change: a Service created, updated or deleted (`None`).
fn change() -> impl Strategy<Value = (u8, Option<SvcSpec>)> {
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
                    let resized = desired.table().sets.iter().any(|(name, s)| {
                        state.thin().sets.get(name).is_some_and(|k| k.decl.size != s.decl.size)
                    });
                    prop_assert!(resized, "a full plan without a resized set");
                    step_from(&mut state, desired.table(), &before);
                }
            }
            prop_assert_eq!(&state, &fresh_state(desired.table()));
        }
    }
}

#[test]
fn regions_stay_with_their_chains_and_are_reused() {
    let spec = |id, endpoints: Vec<u8>| SvcSpec {
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
    // More endpoints than the shared lists take: svc1 has a chain and a region; svc2 none.
    let many = |from: u8, to: u8| (from..=to).collect::<Vec<u8>>();
    let mut c = cluster(&[spec(1, many(1, LONG)), spec(2, many(1, LONG + 1))]);
    let mut desired = Desired::build(&c, &config(), Family::V4);
    let before = region_of(desired.table(), "ns/svc1/").expect("svc1 uses an endpoint map");
    // Endpoints come and go: the rule, and so the region, stays.
    for endpoints in [many(1, LONG + 1), many(3, LONG + 2), many(4, LONG + 11)] {
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
    assert_eq!(left, usize::from(LONG + 1), "svc2's endpoints");
    assert!(
        !desired.table().sets.contains_key(before.0)
            || region_of(desired.table(), "ns/svc2/").is_some_and(|s| s.0 == before.0)
    );
}

#[test]
fn an_endpoint_shared_by_services_stays_until_its_last_service_goes() {
    let spec = |id| SvcSpec {
        id,
        endpoints: vec![1],
        node_port: false,
        udp: false,
        ..SvcSpec::default()
    };
    let mut c = cluster(&[spec(1), spec(2), spec(3)]);
    // svc2's endpoint is svc1's pod: one hairpin element, claimed twice.
    let slice = ObjectName::new("ns", "svc2-x");
    let mut s = c.slices.get(&slice).unwrap().clone();
    s.endpoints[0].addr = IpAddr::from([10, 180, 1, 1]);
    c.slices.insert(slice, s);
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
    let owner = |d: &Desired| -> Vec<IpAddr> {
        let key = Key::AddrProtoPort(shared, Proto::Tcp, 80)
            .list_entry(0)
            .unwrap();
        d.table().sets["cluster-endpoints-1"]
            .elements
            .get(&key)
            .into_iter()
            .filter_map(|v| match v {
                Some(Value::Endpoint(addr, _)) => Some(*addr),
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
    // Two endpoints (the shared lists) and LONG + 1 (a chain of their own, with an
    // endpoint-map region) alternate.
    let many: Vec<SvcSpec> = (1..=200u8)
        .map(|id| SvcSpec {
            id,
            endpoints: if id % 2 == 0 {
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
                .all(|(k, _)| *k == Key::AddrPair("10.180.7.3".parse().unwrap())),
            Op::AddElements { set, elements } => {
                set == "cluster-endpoints-3"
                    && elements.len() == 3
                    && elements
                        .iter()
                        .all(|(k, _)| matches!(k, Key::AddrProtoPortIndex(a, ..) if *a == cip))
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
    changed[7].endpoints.push(LONG + 2);
    let after = table(&changed);
    let tx = plan(state.as_ref(), &Before::Nothing, &after);
    assert!(tx.ops.len() <= 3, "{:#?}", tx.ops);
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
                    *k == Key::AddrPair(format!("10.180.8.{}", LONG + 2).parse().unwrap())
                })
            }
            Op::AddElements { set, elements } => {
                set == map && elements.iter().all(|(k, _)| in_region(k))
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
        endpoints: (1..=LONG).collect(),
        node_port: false,
        udp: false,
        ..SvcSpec::default()
    }]);
    let b = table(&[SvcSpec {
        id: 1,
        endpoints: (1..=LONG).collect(),
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
    let spec = |id| SvcSpec {
        id,
        endpoints: (1..=LONG).collect(),
        node_port: id % 3 == 0,
        udp: false,
        ..SvcSpec::default()
    };
    // Services come and go, so regions are no longer in name order.
    let first: Vec<SvcSpec> = (1..=60).map(spec).collect();
    let mut desired = Desired::build(&cluster(&first), &config(), Family::V4);
    let mut state = fresh_state(desired.table());
    let later: Vec<SvcSpec> = (20..=120).map(spec).collect();
    let c = cluster(&later);
    let names: Vec<ObjectName> = (1..=120)
        .map(|id| ObjectName::new("ns", &format!("svc{id}")))
        .collect();
    let Updated::Scope(scope) = desired.update(&c, &config(), &names) else {
        panic!("expected a scoped update");
    };
    step_scope(&mut state, desired.table(), &scope);
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
        endpoints: (1..=LONG).collect(),
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
        usize::from(LONG),
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
    let a = trace(&cascade, &Host::default(), &pkt);
    let b = trace(&mapped, &Host::default(), &pkt);
    assert_eq!(a.endpoints().len(), usize::from(LONG), "{a:?}");
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
