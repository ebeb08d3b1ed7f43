//! Test tables: every kind of chain, rule, set and map nftproxy writes, per family.

use super::*;

// --- Test tables. ---

pub(super) fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

pub(super) fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

pub(super) struct Addrs {
    pub(super) vip: [IpAddr; 5],
    pub(super) ep: [IpAddr; 2],
    pub(super) host: IpNet,
    pub(super) prefix: IpNet,
    pub(super) other_prefix: IpNet,
}

pub(super) fn addrs(family: Family) -> Addrs {
    match family {
        Family::V4 => Addrs {
            vip: [
                ip("10.96.0.1"),
                ip("10.96.0.2"),
                ip("10.96.0.3"),
                ip("10.96.0.4"),
                ip("10.96.0.5"),
            ],
            ep: [ip("10.244.1.2"), ip("10.244.2.3")],
            host: net("10.96.0.10/32"),
            prefix: net("10.244.0.0/16"),
            other_prefix: net("10.0.0.0/12"),
        },
        Family::V6 => Addrs {
            vip: [
                ip("fd00:96::1"),
                ip("fd00:96::2"),
                ip("fd00:96::3"),
                ip("fd00:96::4"),
                ip("fd00:96::5"),
            ],
            ep: [ip("fd00:244:1::2"), ip("fd00:244:2::3")],
            host: net("fd00:96::10/128"),
            prefix: net("fd00:244::/32"),
            other_prefix: net("fd00::/12"),
        },
    }
}

pub(super) fn regular(comment: Option<&str>, rules: Vec<Rule>) -> Chain {
    Chain {
        base: None,
        comment: comment.map(Into::into),
        rules: Arc::new(rules),
    }
}

pub(super) fn base(chain_type: ChainType, hook: Hook, priority: i32, rules: Vec<Rule>) -> Chain {
    Chain {
        base: Some(BaseChain {
            chain_type,
            hook,
            priority,
        }),
        comment: Some(format!("{} hook", hook.name()).into()),
        rules: Arc::new(rules),
    }
}

pub(super) fn set(key: KeyType, is_vmap: bool, comment: Option<&str>, timeout: Option<u32>) -> Set {
    Set {
        decl: SetDecl {
            key,
            is_vmap,
            comment: comment.map(Into::into),
            timeout_secs: timeout,
            size: None,
        },
        elements: ElementMap::new().into(),
    }
}

pub(super) fn jump(c: &str) -> Action {
    Action::Verdict(Verdict::Jump(c.into()))
}

pub(super) fn goto(c: &str) -> Action {
    Action::Verdict(Verdict::Goto(c.into()))
}

/// The endpoint map of the test tables.
pub(super) const ENDPOINT_MAP: usize = 3;

/// `n` endpoints on port 8080: 10.244.3.1, 10.244.3.2, ... (fd00:244:3::1, ... for IPv6).
pub(super) fn region_targets(family: Family, n: usize) -> Vec<(IpAddr, u16)> {
    (1..=n)
        .map(|i| {
            let addr = match family {
                Family::V4 => ip(&format!("10.244.{}.{}", 3 + i / 250, i % 250 + 1)),
                Family::V6 => ip(&format!("fd00:244:3::{i:x}")),
            };
            (addr, 8080)
        })
        .collect()
}

/// Gives `region` of the test table's endpoint map the endpoints `targets` (none: removes it).
pub(super) fn set_region(t: &mut Table, region: u32, targets: &[(IpAddr, u16)]) {
    let offset = region_offset(region);
    let map = t
        .sets
        .get_mut(endpoint_map_name(ENDPOINT_MAP))
        .expect("endpoint map");
    map.elements_mut().retain(
        |k, _| !matches!(k, Key::Interval { at, .. } if dataplane::nft::ruleset::region_at(*at) == region),
    );
    if !targets.is_empty() {
        map.elements_mut().extend(
            region_elements(offset, targets)
                .into_iter()
                .map(|(k, v)| (k, Some(v))),
        );
    }
}

/// A table using every Match and Action variant, both vmap kinds and all verdicts.
pub(super) fn full_table(family: Family) -> Table {
    let a = addrs(family);
    let mut t = Table::new(family);

    let mut service_ips = set(
        KeyType::AddrProtoPort,
        true,
        Some("ClusterIP, ExternalIP and LoadBalancer IP traffic"),
        None,
    );
    let verdicts = [
        Verdict::Goto("svc-a".into()),
        Verdict::Jump("svc-b".into()),
        Verdict::Drop,
        Verdict::Accept,
        Verdict::Return,
    ];
    for (i, v) in verdicts.into_iter().enumerate() {
        let proto = [Proto::Tcp, Proto::Udp, Proto::Sctp][i % 3];
        service_ips.elements_mut().insert(
            Key::AddrProtoPort(a.vip[i], proto, 80 + i as u16),
            Some(v.into()),
        );
    }
    service_ips.elements_mut().insert(
        Key::AddrProtoPort(a.vip[4], Proto::Tcp, 443),
        Some(Verdict::Goto("svc-slot".into()).into()),
    );
    service_ips.elements_mut().insert(
        Key::AddrProtoPort(a.vip[4], Proto::Udp, 53),
        Some(Verdict::Goto("svc-slot-dns".into()).into()),
    );
    t.sets.insert("service-ips".into(), service_ips);

    // An endpoint map with two regions: 3 endpoints at region 0, 1 at region 5.
    t.sets.insert(
        endpoint_map_name(ENDPOINT_MAP).into(),
        set(KeyType::Interval, false, None, None),
    );
    set_region(&mut t, 0, &region_targets(family, 3));
    set_region(&mut t, 5, &[(a.ep[1], 53)]);

    let mut nodeports = set(KeyType::ProtoPort, true, None, None);
    nodeports.elements_mut().insert(
        Key::ProtoPort(Proto::Tcp, 30080),
        Some(Verdict::Goto("svc-a".into()).into()),
    );
    nodeports.elements_mut().insert(
        Key::ProtoPort(Proto::Sctp, 30081),
        Some(Verdict::Drop.into()),
    );
    t.sets.insert("service-nodeports".into(), nodeports);

    let mut local = set(KeyType::Addr, false, Some("local addresses"), None);
    local.elements_mut().insert(Key::Addr(a.vip[0]), None);
    local.elements_mut().insert(Key::Addr(a.vip[1]), None);
    t.sets.insert("local-addrs".into(), local);

    t.sets.insert(
        "affinity-a".into(),
        set(
            KeyType::Addr,
            false,
            Some("ns/a:http affinity"),
            Some(10800),
        ),
    );
    t.sets.insert(
        "empty-set".into(),
        set(KeyType::AddrProtoPort, false, None, None),
    );

    t.chains.insert(
        "nat-prerouting".into(),
        base(
            ChainType::Nat,
            Hook::Prerouting,
            -100,
            vec![Rule::new(vec![], jump("services"))],
        ),
    );
    t.chains.insert(
        "nat-output".into(),
        base(
            ChainType::Nat,
            Hook::Output,
            -100,
            vec![Rule::new(vec![], jump("services"))],
        ),
    );
    t.chains.insert(
        "nat-postrouting".into(),
        base(
            ChainType::Nat,
            Hook::Postrouting,
            100,
            vec![
                Rule::new(
                    vec![Match::MarkUnset { mask: 0x4000 }],
                    Action::Verdict(Verdict::Return),
                ),
                Rule::new(vec![], Action::MarkXor(0x4000)),
                Rule::new(vec![], Action::Masquerade).with_comment("masquerade marked traffic"),
            ],
        ),
    );
    t.chains.insert(
        "filter-forward".into(),
        base(
            ChainType::Filter,
            Hook::Forward,
            0,
            vec![
                Rule::new(
                    vec![
                        Match::CtStateNew,
                        Match::Daddr {
                            net: a.host,
                            negate: false,
                        },
                        Match::Saddr {
                            net: a.prefix,
                            negate: true,
                        },
                        Match::Daddr {
                            net: a.other_prefix,
                            negate: false,
                        },
                        Match::Saddr {
                            net: a.host,
                            negate: true,
                        },
                        Match::IifName {
                            name: "eth0".into(),
                            prefix: false,
                            negate: false,
                        },
                        Match::IifName {
                            name: "veth".into(),
                            prefix: true,
                            negate: true,
                        },
                        Match::FibSaddrLocal,
                    ],
                    Action::Reject,
                )
                .with_comment("reject traffic to services without endpoints"),
                Rule::new(
                    vec![
                        Match::IifName {
                            name: "lo".into(),
                            prefix: false,
                            negate: true,
                        },
                        Match::IifName {
                            name: "cali".into(),
                            prefix: true,
                            negate: false,
                        },
                    ],
                    Action::Verdict(Verdict::Accept),
                ),
            ],
        ),
    );
    t.chains.insert(
        "filter-input".into(),
        base(
            ChainType::Filter,
            Hook::Input,
            -10,
            vec![
                Rule::new(
                    vec![Match::DaddrInSet {
                        set: "local-addrs".into(),
                    }],
                    Action::Verdict(Verdict::Drop),
                ),
                Rule::new(vec![], Action::Verdict(Verdict::Return)),
            ],
        ),
    );
    t.chains.insert(
        "services".into(),
        regular(
            Some("service dispatch"),
            vec![
                Rule::new(
                    vec![],
                    Action::VmapAddrProtoPort {
                        map: "service-ips".into(),
                    },
                ),
                Rule::new(
                    vec![Match::FibDaddrLocal],
                    Action::VmapProtoPort {
                        map: "service-nodeports".into(),
                    },
                ),
            ],
        ),
    );
    t.chains.insert(
        "svc-a".into(),
        regular(
            Some("ns/a:http"),
            vec![
                Rule::new(
                    vec![Match::SaddrInSet {
                        set: "affinity-a".into(),
                    }],
                    goto("ep-a-0"),
                ),
                Rule::new(
                    vec![Match::Numgen {
                        modulus: 2,
                        value: 0,
                    }],
                    goto("ep-a-0"),
                ),
                Rule::new(
                    vec![Match::Numgen {
                        modulus: 2,
                        value: 1,
                    }],
                    goto("ep-a-1"),
                ),
            ],
        ),
    );
    for (i, ep) in a.ep.iter().enumerate() {
        t.chains.insert(
            format!("ep-a-{i}").into(),
            regular(
                Some(&format!("ns/a:http endpoint {ep}")),
                vec![
                    Rule::new(
                        vec![Match::Saddr {
                            net: IpNet::from(*ep),
                            negate: false,
                        }],
                        Action::MarkOr(0x4000),
                    ),
                    Rule::new(
                        vec![],
                        Action::UpdateSaddr {
                            set: "affinity-a".into(),
                        },
                    ),
                    Rule::new(
                        vec![Match::L4Proto(Proto::Tcp)],
                        Action::Dnat {
                            addr: *ep,
                            port: 8080,
                        },
                    ),
                ],
            ),
        );
    }
    t.chains.insert(
        "svc-b".into(),
        regular(
            None,
            vec![Rule::new(
                vec![
                    Match::L4Proto(Proto::Udp),
                    Match::DaddrInSet {
                        set: "local-addrs".into(),
                    },
                ],
                Action::Dnat {
                    addr: a.ep[1],
                    port: 53,
                },
            )],
        ),
    );
    t.chains.insert(
        "svc-slot".into(),
        regular(
            Some("ns/slot:https"),
            vec![
                Rule::new(vec![Match::CtStateNew], Action::MarkOr(0x4000)),
                Rule::new(
                    vec![Match::L4Proto(Proto::Tcp)],
                    Action::DnatRegion {
                        map: endpoint_map_name(ENDPOINT_MAP),
                        offset: region_offset(0),
                    },
                ),
            ],
        ),
    );
    t.chains.insert(
        "svc-slot-dns".into(),
        regular(
            None,
            vec![
                Rule::new(
                    vec![Match::L4Proto(Proto::Udp)],
                    Action::DnatRegion {
                        map: endpoint_map_name(ENDPOINT_MAP),
                        offset: region_offset(5),
                    },
                )
                .with_comment("dns"),
            ],
        ),
    );
    t.chains.insert("empty-chain".into(), regular(None, vec![]));
    t
}

pub(super) fn check_full_table(family: Family) {
    let ns = Netns::new("nl");
    let mut nft = ns.open();
    assert!(nft.read_table(family).expect("read_table").is_none());
    let table = full_table(family);
    let tx = plan(None, &Before::Nothing, &table);
    let stats = nft.apply(&tx).expect("apply the full table");
    let messages: usize = tx
        .ops
        .iter()
        .map(|op| match op {
            Op::AddRules { rules, .. } => rules.len(),
            _ => 1,
        })
        .sum();
    assert_eq!(stats.messages, messages + 2);
    assert_listing(&ns, &table, false);

    let state = assert_idempotent(&mut nft, &table);
    // The read-back state is exactly what the planner tracks in memory after the commit.
    let mut tracked = TableState::default();
    tracked.apply(&tx);
    assert!(
        tracked.agrees_with(&state, &table),
        "{state:?}\n{tracked:?}"
    );

    // Applying the same full transaction again is harmless (everything is create-or-keep), but
    // appends the rules a second time; the planner never does that. Deleting works.
    assert!(nft.delete_table(family).expect("delete"));
    assert!(!nft.delete_table(family).expect("delete again"));
    assert!(nft.read_table(family).expect("read_table").is_none());
    assert_eq!(
        nft.apply(&Transaction {
            family,
            ops: vec![]
        })
        .expect("empty"),
        Default::default()
    );
}
