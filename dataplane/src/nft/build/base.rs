//! The static part of a family's nftables table: base chains (kube-proxy's hooks and
//! priorities), helper chains, the shared dispatch maps and sets, and the fixed chains that
//! DNAT through the endpoint lists.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::affinity;
use super::{
    BuildConfig, CLUSTER_IPS, CLUSTER_IPS_CHECK, Detector, EXTERNAL_TO_CLUSTER_IPS, EndpointLists,
    FIREWALL_CHECK, FIREWALL_IPS, HAIRPIN_ENDPOINTS, LIST_MAX_ENDPOINTS, LOCAL_POLICY_NODEPORTS,
    LOCAL_POLICY_SERVICES, MARK_FOR_MASQUERADE, MASQUERADE_NODEPORTS, MASQUERADE_SERVICES,
    MASQUERADING, NO_ENDPOINT_NODEPORTS, NO_ENDPOINT_SERVICES, NODEPORT_ENDPOINTS_CHECK,
    NODEPORT_IPS, NODEPORT_TO_CLUSTER_IPS, NODEPORT_TO_SERVICE_PORTS, NODEPORTS, NodePortIps,
    REJECT_NODEPORTS, REJECT_SERVICES, SERVICE_ENDPOINTS_CHECK, SERVICE_IPS, SERVICE_NODEPORTS,
    SERVICES, big, empty_set, endpoint_map, goto, jump, local_policy_rules, node_port_ips, regular,
    shared,
};
use crate::decision::{DecisionEnv, InternalMasquerade};
use crate::model::Cluster;
use crate::nft::ruleset::{
    Action, BaseChain, Chain, ChainName, ChainType, Family, Hook, Key, KeyType, Match, Proto, Rule,
    Set, SetDecl, Table, Verdict,
};

/// The static part of the table: base chains, helper chains and the (empty) shared maps.
pub fn base_table(config: &BuildConfig, cluster: &Cluster, family: Family) -> Table {
    let mut t = Table::new(family);
    let mark = 1u32 << config.masquerade_bit;
    let c = &mut t.chains;
    c.insert(
        "filter-prerouting-pre-dnat".into(),
        base(ChainType::Filter, Hook::Prerouting, -110),
    );
    c.insert(
        "filter-output-pre-dnat".into(),
        base(ChainType::Filter, Hook::Output, -110),
    );
    c.insert(
        "nat-prerouting".into(),
        base(ChainType::Nat, Hook::Prerouting, -100),
    );
    c.insert(
        "nat-output".into(),
        base(ChainType::Nat, Hook::Output, -100),
    );
    c.insert(
        "filter-input".into(),
        base(ChainType::Filter, Hook::Input, 0),
    );
    c.insert(
        "filter-forward".into(),
        base(ChainType::Filter, Hook::Forward, 0),
    );
    c.insert(
        "filter-output".into(),
        base(ChainType::Filter, Hook::Output, 0),
    );
    c.insert(
        "nat-postrouting".into(),
        base(ChainType::Nat, Hook::Postrouting, 100),
    );

    let new_jump = |target: &str| Rule::new(vec![Match::CtStateNew], jump(target));
    let push = |c: &mut BTreeMap<ChainName, Chain>, chain: &str, rule: Rule| {
        Arc::make_mut(&mut c.get_mut(chain).expect("base chain").rules).push(rule)
    };
    push(c, "filter-prerouting-pre-dnat", new_jump(FIREWALL_CHECK));
    push(c, "filter-output-pre-dnat", new_jump(FIREWALL_CHECK));
    push(c, "filter-input", new_jump(NODEPORT_ENDPOINTS_CHECK));
    push(c, "filter-input", new_jump(SERVICE_ENDPOINTS_CHECK));
    push(c, "filter-forward", new_jump(SERVICE_ENDPOINTS_CHECK));
    push(c, "filter-forward", new_jump(CLUSTER_IPS_CHECK));
    push(c, "filter-output", new_jump(SERVICE_ENDPOINTS_CHECK));
    push(c, "filter-output", new_jump(CLUSTER_IPS_CHECK));
    push(c, "nat-prerouting", Rule::new(vec![], jump(SERVICES)));
    push(c, "nat-output", Rule::new(vec![], jump(SERVICES)));
    push(c, "nat-postrouting", Rule::new(vec![], jump(MASQUERADING)));
    for chain in ["filter-input", "filter-forward", "filter-output"] {
        push(c, chain, affinity::record_jump());
    }

    c.insert(
        MARK_FOR_MASQUERADE.into(),
        regular(vec![Rule::new(vec![], Action::MarkOr(mark))]),
    );
    c.insert(
        MASQUERADING.into(),
        regular(vec![
            Rule::new(
                vec![
                    Match::CtStatusDnat,
                    Match::SaddrDaddrInSet {
                        set: HAIRPIN_ENDPOINTS.into(),
                    },
                ],
                Action::MarkOr(mark),
            ),
            Rule::new(
                vec![Match::MarkUnset { mask: mark }],
                Action::Verdict(Verdict::Return),
            ),
            Rule::new(vec![], Action::MarkXor(mark)),
            Rule::new(vec![], Action::Masquerade),
        ]),
    );
    c.insert(
        FIREWALL_CHECK.into(),
        regular(vec![Rule::new(
            vec![],
            Action::VmapAddrProtoPort {
                map: FIREWALL_IPS.into(),
            },
        )]),
    );
    // Destinations without endpoints are rejected through a set rather than kube-proxy's
    // `goto reject-chain` elements: adding a `goto` element makes the kernel validate every
    // chain and every such element again (1.5 ms at 100k Services).
    c.insert(
        SERVICE_ENDPOINTS_CHECK.into(),
        regular(vec![
            Rule::new(
                vec![Match::AddrProtoPortInSet {
                    set: REJECT_SERVICES.into(),
                }],
                Action::Reject,
            ),
            Rule::new(
                vec![],
                Action::VmapAddrProtoPort {
                    map: NO_ENDPOINT_SERVICES.into(),
                },
            ),
        ]),
    );

    let loopback = Match::Daddr {
        net: family.loopback(),
        negate: true,
    };
    let (nodeport_match, nodeport_check_match) =
        match node_port_ips(config, cluster, family).without_loopback() {
            NodePortIps::All => (vec![Match::FibDaddrLocal, loopback.clone()], vec![loopback]),
            NodePortIps::List(ips) => {
                let mut s = set(KeyType::Addr, false, "IPs that accept NodePort traffic");
                s.elements = Arc::new(ips.into_iter().map(|ip| (Key::Addr(ip), None)).collect());
                t.sets.insert(NODEPORT_IPS.into(), s);
                let m = Match::DaddrInSet {
                    set: NODEPORT_IPS.into(),
                };
                (vec![m.clone()], vec![m])
            }
        };
    let env = DecisionEnv::new(cluster, config, family);
    let det = Detector::of(&env.local_traffic);
    // ClusterIP traffic from outside the pod network (or all of it with masqueradeAll) is
    // masqueraded: one rule for every ClusterIP instead of one per Service chain.
    let cluster_ip = Match::DaddrInSet {
        set: CLUSTER_IPS.into(),
    };
    let masquerade = match InternalMasquerade::of(&env) {
        InternalMasquerade::All => Some(vec![cluster_ip]),
        InternalMasquerade::NotFromPods => det.is_not_local.clone().map(|m| vec![cluster_ip, m]),
        InternalMasquerade::None => None,
    };
    let mut services = Vec::new();
    if let Some(matches) = masquerade {
        services.push(Rule::new(matches, jump(MARK_FOR_MASQUERADE)));
    }
    let frontend_in = |set: &str| Match::AddrProtoPortInSet { set: set.into() };
    let nodeport_in = |set: &str| Match::ProtoPortInSet { set: set.into() };
    services.extend([
        Rule::new(
            vec![],
            Action::VmapAddrProtoPort {
                map: SERVICE_IPS.into(),
            },
        ),
        Rule::new(
            vec![frontend_in(LOCAL_POLICY_SERVICES)],
            goto(&LOCAL_POLICY_SERVICES.into()),
        ),
        Rule::new(
            vec![frontend_in(MASQUERADE_SERVICES)],
            jump(MARK_FOR_MASQUERADE),
        ),
        Rule::new(
            vec![],
            Action::SetDaddr {
                map: EXTERNAL_TO_CLUSTER_IPS,
                nodeport: false,
            },
        ),
        Rule::new(vec![], jump(EndpointLists::ClusterServices.chain())),
        Rule::new(vec![], jump(EndpointLists::LocalServices.chain())),
        Rule::new(nodeport_match, jump(NODEPORTS)),
    ]);
    let nodeports = vec![
        Rule::new(
            vec![],
            Action::VmapProtoPort {
                map: SERVICE_NODEPORTS.into(),
            },
        ),
        Rule::new(
            vec![nodeport_in(LOCAL_POLICY_NODEPORTS)],
            goto(&LOCAL_POLICY_NODEPORTS.into()),
        ),
        Rule::new(
            vec![nodeport_in(MASQUERADE_NODEPORTS)],
            jump(MARK_FOR_MASQUERADE),
        ),
        // A TCP NodePort that shares its ClusterIP's list becomes that destination (address
        // and port); NodePort traffic never arrives at a ClusterIP, so one that has it now
        // was rewritten.
        Rule::new(
            vec![],
            Action::SetDaddr {
                map: NODEPORT_TO_CLUSTER_IPS,
                nodeport: true,
            },
        ),
        Rule::new(
            vec![Match::L4Proto(Proto::Tcp)],
            Action::SetDport {
                map: NODEPORT_TO_SERVICE_PORTS,
            },
        ),
        Rule::new(
            vec![Match::DaddrInSet {
                set: CLUSTER_IPS.into(),
            }],
            goto(&EndpointLists::ClusterServices.chain().into()),
        ),
        Rule::new(
            vec![],
            goto(&EndpointLists::ClusterNodePorts.chain().into()),
        ),
    ];
    // External traffic to a Service with externalTrafficPolicy Local (what each such
    // Service's external chain does in kube-proxy, shared).
    let local_policy = |cluster: EndpointLists, local: EndpointLists| {
        regular(local_policy_rules(
            &det,
            &cluster.chain().into(),
            Some(&local.chain().into()),
        ))
    };
    let c = &mut t.chains;
    c.insert(SERVICES.into(), regular(services));
    c.insert(NODEPORTS.into(), regular(nodeports));
    c.insert(
        LOCAL_POLICY_SERVICES.into(),
        local_policy(EndpointLists::ClusterServices, EndpointLists::LocalServices),
    );
    c.insert(
        LOCAL_POLICY_NODEPORTS.into(),
        local_policy(
            EndpointLists::ClusterNodePorts,
            EndpointLists::LocalNodePorts,
        ),
    );
    for lists in EndpointLists::ALL {
        let dnat = |map: &str, modulus: u32| {
            Rule::new(
                vec![],
                Action::DnatIndexed {
                    map: map.into(),
                    nodeport: lists.nodeport(),
                    modulus,
                },
            )
        };
        let mut rules = vec![affinity::lookup_rule(lists)];
        rules.extend((1..=LIST_MAX_ENDPOINTS).map(|k| dnat(lists.map(k), k as u32)));
        // The flat path for larger lists (see `big`): a fixed rule per class, then fixed
        // chains that draw until an index below the list's length comes up.
        for j in big::classes() {
            let set = lists.big_class_set(j).into();
            let member = if lists.nodeport() {
                Match::ProtoPortInSet { set }
            } else {
                Match::AddrProtoPortInSet { set }
            };
            let chain: ChainName = lists.big_chain(j).into();
            rules.push(Rule::new(vec![member], goto(&chain)));
            let mut draws: Vec<Rule> = (0..big::DRAWS)
                .map(|_| Rule::new(vec![], jump(lists.big_draw(j))))
                .collect();
            draws.push(Rule::new(vec![], goto(&lists.big_first().into())));
            c.insert(chain, regular(draws));
            c.insert(
                lists.big_draw(j).into(),
                regular(vec![dnat(lists.big_map(), 1 << j)]),
            );
        }
        c.insert(
            lists.big_first().into(),
            regular(vec![dnat(lists.big_map(), 1)]),
        );
        if lists == EndpointLists::ClusterServices {
            shared::add_base(c, &mut t.sets, &mut rules);
        }
        c.insert(lists.chain().into(), regular(rules));
    }
    let mut reject_nodeports = nodeport_check_match.clone();
    reject_nodeports.push(Match::ProtoPortInSet {
        set: REJECT_NODEPORTS.into(),
    });
    c.insert(
        NODEPORT_ENDPOINTS_CHECK.into(),
        regular(vec![
            Rule::new(reject_nodeports, Action::Reject),
            Rule::new(
                nodeport_check_match,
                Action::VmapProtoPort {
                    map: NO_ENDPOINT_NODEPORTS.into(),
                },
            ),
        ]),
    );
    let mut cluster_ips_check = vec![
        Rule::new(
            vec![Match::DaddrInSet {
                set: CLUSTER_IPS.into(),
            }],
            Action::Reject,
        )
        .with_comment("Reject traffic to invalid ports of ClusterIPs"),
    ];
    for cidr in cluster.service_cidrs(family) {
        cluster_ips_check.push(
            Rule::new(
                vec![Match::Daddr {
                    net: cidr,
                    negate: false,
                }],
                Action::Verdict(Verdict::Drop),
            )
            .with_comment("Drop traffic to unallocated ClusterIPs"),
        );
    }
    c.insert(CLUSTER_IPS_CHECK.into(), regular(cluster_ips_check));

    t.sets.insert(
        CLUSTER_IPS.into(),
        set(KeyType::Addr, false, "Active ClusterIPs"),
    );
    t.sets.insert(
        HAIRPIN_ENDPOINTS.into(),
        set(
            KeyType::AddrPair,
            false,
            "endpoints masqueraded when they reach themselves through a Service",
        ),
    );
    for (name, key, comment) in [
        (
            SERVICE_IPS,
            KeyType::AddrProtoPort,
            "ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        (SERVICE_NODEPORTS, KeyType::ProtoPort, "NodePort traffic"),
        (
            NO_ENDPOINT_SERVICES,
            KeyType::AddrProtoPort,
            "vmap to drop packets to services with no (local) endpoints",
        ),
        (
            NO_ENDPOINT_NODEPORTS,
            KeyType::ProtoPort,
            "vmap to drop packets to service nodeports with no (local) endpoints",
        ),
        (
            FIREWALL_IPS,
            KeyType::AddrProtoPort,
            "destinations that are subject to LoadBalancerSourceRanges",
        ),
    ] {
        t.sets.insert(name.into(), set(key, true, comment));
    }
    for (name, key, comment) in [
        (
            REJECT_SERVICES,
            KeyType::AddrProtoPort,
            "destinations of Services with no endpoints, rejected",
        ),
        (
            REJECT_NODEPORTS,
            KeyType::ProtoPort,
            "NodePorts of Services with no endpoints, rejected",
        ),
        (
            MASQUERADE_SERVICES,
            KeyType::AddrProtoPort,
            "external IPs and load-balancer IPs of Services with externalTrafficPolicy Cluster",
        ),
        (
            MASQUERADE_NODEPORTS,
            KeyType::ProtoPort,
            "NodePorts of Services with externalTrafficPolicy Cluster",
        ),
        (
            LOCAL_POLICY_SERVICES,
            KeyType::AddrProtoPort,
            "external IPs and load-balancer IPs of Services with externalTrafficPolicy Local",
        ),
        (
            LOCAL_POLICY_NODEPORTS,
            KeyType::ProtoPort,
            "NodePorts of Services with externalTrafficPolicy Local",
        ),
    ] {
        t.sets.insert(name.into(), set(key, false, comment));
    }
    for (name, key, comment) in [
        (
            EXTERNAL_TO_CLUSTER_IPS,
            KeyType::AddrProtoPortToAddr,
            "external IPs and load-balancer IPs that share their ClusterIP's endpoint list",
        ),
        (
            NODEPORT_TO_CLUSTER_IPS,
            KeyType::ProtoPortToAddr,
            "TCP NodePorts that share their ClusterIP's endpoint list: the ClusterIP",
        ),
        (
            NODEPORT_TO_SERVICE_PORTS,
            KeyType::ProtoPortToPort,
            "TCP NodePorts that share their ClusterIP's endpoint list: the Service port",
        ),
    ] {
        t.sets.insert(
            name.into(),
            empty_set(SetDecl {
                comment: Some(comment.into()),
                ..SetDecl::new(key)
            }),
        );
    }
    affinity::add_base(&mut t);
    for lists in EndpointLists::ALL {
        for k in 1..=LIST_MAX_ENDPOINTS {
            t.sets
                .insert(lists.map(k).into(), endpoint_map(lists.key_type()));
        }
        t.sets
            .insert(lists.big_map().into(), endpoint_map(lists.key_type()));
        let (key, what) = if lists.nodeport() {
            (KeyType::ProtoPort, "NodePorts")
        } else {
            (KeyType::AddrProtoPort, "destinations")
        };
        for j in big::classes() {
            let comment = format!(
                "{what} with {}..{} endpoints in @{}",
                (1 << (j - 1)) + 1,
                1 << j,
                lists.big_map()
            );
            t.sets
                .insert(lists.big_class_set(j).into(), set(key, false, &comment));
        }
    }
    t
}

fn base(chain_type: ChainType, hook: Hook, priority: i32) -> Chain {
    Chain {
        base: Some(BaseChain {
            chain_type,
            hook,
            priority,
        }),
        comment: None,
        rules: Arc::default(),
    }
}

fn set(key: KeyType, is_vmap: bool, comment: &str) -> Set {
    empty_set(SetDecl {
        is_vmap,
        comment: Some(comment.into()),
        ..SetDecl::new(key)
    })
}
