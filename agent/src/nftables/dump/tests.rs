use super::*;
use dataplane::nft::build::affinity::AFFINITY_CLIENTS;
use dataplane::nft::build::shared::{SERVICE_ENDPOINTS, SERVICE_TARGET_PORTS};
use dataplane::nft::ruleset::{Proto, Set, Table, region_offset};
use netlink_packet_core::Emitable;
use netlink_packet_netfilter::nftables::MetaKey;

/// A notification: nf_tables message `msg` of family `family` with table-name attribute
/// `table` (or, for `NEWGEN`, generation id `generation`).
fn notification(msg: u16, family: u8, table: &str, generation: u32) -> Vec<u8> {
    let payload = if msg == NFT_MSG_NEWGEN {
        generation.to_be_bytes().to_vec()
    } else {
        [table.as_bytes(), &[0]].concat()
    };
    let mut attr = Vec::new();
    attr.extend(((4 + payload.len()) as u16).to_ne_bytes());
    attr.extend(1u16.to_ne_bytes());
    attr.extend(&payload);
    while attr.len() % 4 != 0 {
        attr.push(0);
    }
    let mut m = Vec::new();
    m.extend(((20 + attr.len()) as u32).to_ne_bytes());
    m.extend(((NFNL_SUBSYS_NFTABLES << 8) | msg).to_ne_bytes());
    m.extend([0u8; 10]);
    m.extend([family, 0, 0, 0]);
    m.extend(attr);
    m
}

#[test]
fn notifications_say_whether_our_table_or_the_chain_list_changed() {
    const NEWSETELEM: u16 = 12;
    let v4 = NFPROTO_IPV4;
    // Another table's elements, then a commit: nothing for us.
    let mut c = Commits::default();
    c.take_in(
        &[
            notification(NEWSETELEM, v4, "other", 0),
            notification(NFT_MSG_NEWGEN, 0, "", 41),
        ]
        .concat(),
        v4,
    );
    assert_eq!(
        c,
        Commits {
            last_gen: Some(41),
            commits: 1,
            ..Commits::default()
        }
    );
    assert!(c.seen(40) && c.seen(41) && !c.seen(42));
    // Chains of another ip table come and go: only the chain list moved.
    c.take_in(&notification(NFT_MSG_DELCHAIN, v4, "other", 0), v4);
    assert!(c.chains_moved && !c.ours);
    // Our table, but in the other family: not ours.
    c.take_in(&notification(NEWSETELEM, NFPROTO_IPV6, TABLE, 0), v4);
    assert!(!c.ours);
    c.take_in(&notification(NEWSETELEM, v4, TABLE, 0), v4);
    assert!(c.ours && !c.overflow);
    // Garbage is a loss.
    c.take_in(
        &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
        v4,
    );
    assert!(c.overflow);
    // Generation ids wrap around.
    let c = Commits {
        last_gen: Some(2),
        ..Commits::default()
    };
    assert!(c.seen(u32::MAX) && c.seen(2) && !c.seen(3));
}

/// Every Match and Action survives encode → decode (the kernel-side round trip, register
/// renumbering included, is covered by the kernel tests).
#[test]
fn rules_round_trip_through_the_encoder() {
    for family in Family::ALL {
        let (net, host, addr): (IpNet, IpNet, IpAddr) = match family {
            Family::V4 => (
                "10.0.0.0/8".parse().unwrap(),
                "10.1.2.3/32".parse().unwrap(),
                "10.9.9.9".parse().unwrap(),
            ),
            Family::V6 => (
                "fd00::/12".parse().unwrap(),
                "fd00::1/128".parse().unwrap(),
                "fd00::9".parse().unwrap(),
            ),
        };
        let matches = vec![
            Match::CtStateNew,
            Match::Daddr {
                net: host,
                negate: false,
            },
            Match::Saddr { net, negate: true },
            Match::DaddrInSet { set: "s".into() },
            Match::SaddrInSet { set: "s".into() },
            Match::CtStatusDnat,
            Match::SaddrDaddrInSet {
                set: "pairs".into(),
            },
            Match::AddrProtoPortInSet {
                set: "frontends".into(),
            },
            Match::ProtoPortInSet {
                set: "nodeports".into(),
            },
            Match::AddrProtoInSet {
                set: "shared-frontends".into(),
            },
            Match::CtOriginalAddrProtoPortInSet {
                set: "affinity-frontends".into(),
            },
            Match::CtOriginalProtoPortInSet {
                set: "affinity-nodeports".into(),
            },
            Match::FibSaddrLocal,
            Match::FibDaddrLocal,
            Match::L4Proto(Proto::Sctp),
            Match::Numgen {
                modulus: 3,
                value: 2,
            },
            Match::MarkUnset { mask: 0x4000 },
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
        ];
        let actions = vec![
            Action::Verdict(Verdict::Accept),
            Action::Verdict(Verdict::Drop),
            Action::Verdict(Verdict::Return),
            Action::Verdict(Verdict::Jump("c".into())),
            Action::Verdict(Verdict::Goto("c".into())),
            Action::VmapAddrProtoPort { map: "m".into() },
            Action::VmapProtoPort { map: "m".into() },
            Action::Reject,
            Action::Dnat { addr, port: 8080 },
            Action::Masquerade,
            Action::MarkOr(0x4000),
            Action::MarkXor(0x4000),
            Action::UpdateSaddr { set: "aff".into() },
            Action::DnatRegion {
                map: endpoint_map_name(17),
                offset: region_offset(3),
            },
            Action::DnatRegion {
                map: endpoint_map_name(0),
                offset: 0,
            },
            Action::DnatIndexed {
                map: "cluster-endpoints-3".into(),
                nodeport: false,
                modulus: 3,
            },
            Action::DnatIndexed {
                map: "local-nodeport-endpoints-1".into(),
                nodeport: true,
                modulus: 1,
            },
            Action::DnatAffinity {
                map: AFFINITY_CLIENTS,
            },
            Action::SetDaddr {
                map: dataplane::nft::build::EXTERNAL_TO_CLUSTER_IPS,
                nodeport: false,
            },
            Action::SetDaddr {
                map: dataplane::nft::build::NODEPORT_TO_CLUSTER_IPS,
                nodeport: true,
            },
            Action::SetDport {
                map: dataplane::nft::build::NODEPORT_TO_SERVICE_PORTS,
            },
            Action::UpdateAffinity {
                map: AFFINITY_CLIENTS,
                timeout_secs: 10_800,
            },
            Action::DnatShared {
                addresses: SERVICE_ENDPOINTS,
                ports: SERVICE_TARGET_PORTS,
                modulus: 32,
            },
            Action::DnatShared {
                addresses: SERVICE_ENDPOINTS,
                ports: SERVICE_TARGET_PORTS,
                modulus: 1,
            },
        ];
        for action in actions {
            let rule = Rule::new(matches.clone(), action).with_comment("c");
            let attr = RuleAttribute::Expressions(rule_exprs(family, &rule).unwrap());
            let mut buf = vec![0; attr.buffer_len()];
            attr.emit(&mut buf);
            let back = decode_rule(family, &buf[4..], rule.comment.clone());
            assert_eq!(back.as_ref(), Some(&rule), "{family:?}");
        }
    }
}

#[test]
fn meta_key_numbers() {
    assert_eq!(u32::from(MetaKey::L4Proto), META_L4PROTO);
    assert_eq!(u32::from(MetaKey::Mark), META_MARK);
    assert_eq!(u32::from(MetaKey::Iifname), META_IIFNAME);
}

/// The expressions of `rule` as the decoder sees them.
fn exprs_of(family: Family, rule: &Rule) -> Vec<Ex> {
    let attr = RuleAttribute::Expressions(rule_exprs(family, rule).unwrap());
    let mut buf = vec![0; attr.buffer_len()];
    attr.emit(&mut buf);
    nlas(&buf[4..])
        .unwrap()
        .into_iter()
        .map(|(_, e)| raw_expr(e).unwrap())
        .collect()
}

/// A DNAT through the shared lists or a membership test in nft's registers reads back; with
/// any register, offset, load or map of it changed it is foreign.
#[test]
fn shared_list_rules_decode_only_in_nfts_registers() {
    let shared = Action::DnatShared {
        addresses: SERVICE_ENDPOINTS,
        ports: SERVICE_TARGET_PORTS,
        modulus: 32,
    };
    let member = Match::AddrProtoInSet { set: "cls".into() };
    for family in Family::ALL {
        let words = addr_layout(family).2 / 4;
        let ex = exprs_of(family, &Rule::new(vec![], shared.clone()));
        assert_eq!(decode_action(family, &ex), Some(shared.clone()));
        let set_u32 = |e: &mut Ex, k: u16, v: u32| match e {
            Ex::Other { attrs, .. } => {
                attrs.insert(k, v.to_be_bytes().to_vec());
            }
            _ => panic!("{e:?}"),
        };
        type Mutation<'a> = Box<dyn Fn(&mut Vec<Ex>) + 'a>;
        let mutations: Vec<(&str, Mutation)> = vec![
            (
                "numgen offset",
                Box::new(|ex| set_u32(&mut ex[2], NFTA_NG_OFFSET, 1)),
            ),
            // Into the protocol's word (reg 9 / reg 2 as a 32-bit word).
            (
                "numgen register",
                Box::new(move |ex| set_u32(&mut ex[2], NFTA_NG_DREG, 8 + words)),
            ),
            (
                "address written where the port key goes",
                Box::new(|ex| {
                    if let Ex::Lookup { dreg, .. } = &mut ex[3] {
                        *dreg = Some(4);
                    }
                }),
            ),
            (
                "port key read from word 0",
                Box::new(|ex| {
                    if let Ex::Lookup { sreg, .. } = &mut ex[7] {
                        *sreg = 0;
                    }
                }),
            ),
            (
                "port written elsewhere",
                Box::new(|ex| {
                    if let Ex::Lookup { dreg, .. } = &mut ex[7] {
                        *dreg = Some(8);
                    }
                }),
            ),
            (
                "port key without its address",
                Box::new(|ex| drop(ex.remove(4))),
            ),
            (
                "DNAT to the port's register as the address",
                Box::new(|ex| set_u32(&mut ex[8], NFTA_NAT_REG_ADDR_MIN, 2)),
            ),
            (
                "another address list",
                Box::new(|ex| {
                    if let Ex::Lookup { set, .. } = &mut ex[3] {
                        *set = "addrs".into();
                    }
                }),
            ),
            (
                "the maps swapped",
                Box::new(|ex| {
                    let Ex::Lookup { set: a, .. } = &ex[3] else {
                        return;
                    };
                    let a = a.clone();
                    let Ex::Lookup { set: p, .. } = &mut ex[7] else {
                        return;
                    };
                    let p = std::mem::replace(p, a);
                    if let Ex::Lookup { set, .. } = &mut ex[3] {
                        *set = p;
                    }
                }),
            ),
            (
                "masquerade instead",
                Box::new(|ex| {
                    if let Ex::Other { name, .. } = &mut ex[8] {
                        *name = "masq".into();
                    }
                }),
            ),
        ];
        for (what, mutate) in mutations {
            let mut ex = exprs_of(family, &Rule::new(vec![], shared.clone()));
            mutate(&mut ex);
            assert_eq!(decode_action(family, &ex), None, "{family:?}: {what}");
        }

        let ex = exprs_of(family, &Rule::new(vec![member.clone()], shared.clone()));
        assert_eq!(decode_match(family, &ex), Some((member.clone(), 3)));
        let mut ex = exprs_of(family, &Rule::new(vec![member.clone()], shared.clone()));
        if let Ex::MetaLoad { dreg, .. } = &mut ex[1] {
            *dreg += 1;
        }
        assert_eq!(decode_match(family, &ex[..3]), None, "{family:?}");
    }
}

/// The shared address lists: a set of ClusterIP and protocol, the list of addresses, the
/// ports, and the rules that use them.
fn shared_table(family: Family) -> Table {
    let ip = |v4: &str, v6: &str| -> IpAddr {
        match family {
            Family::V4 => v4.parse().unwrap(),
            Family::V6 => v6.parse().unwrap(),
        }
    };
    let (vip, ep, ep2) = (
        ip("10.96.0.10", "fd00::10"),
        ip("10.244.1.2", "fd00::1:2"),
        ip("10.244.2.3", "fd00::2:3"),
    );
    let mut t = Table::new(family);
    let decl = |key| SetDecl {
        size: Some(96),
        ..SetDecl::new(key)
    };
    let mut cls = Set::new(
        SetDecl {
            comment: Some("c".into()),
            ..decl(KeyType::AddrProto)
        },
        ElementMap::new(),
    );
    for p in [Proto::Tcp, Proto::Udp] {
        cls.elements_mut().insert(Key::AddrProto(vip, p), None);
    }
    let mut addrs = Set::new(decl(KeyType::AddrProtoIndex), ElementMap::new());
    for (i, e) in [ep, ep2].into_iter().enumerate() {
        addrs.elements_mut().insert(
            Key::AddrProtoIndex(vip, Proto::Tcp, i as u16),
            Some(Value::Addr(e)),
        );
    }
    addrs.elements_mut().insert(
        Key::AddrProtoIndex(vip, Proto::Udp, 0),
        Some(Value::Addr(ep)),
    );
    let mut tports = Set::new(decl(KeyType::AddrProtoPortToPort), ElementMap::new());
    for (p, port, target) in [
        (Proto::Tcp, 80, 8080),
        (Proto::Tcp, 443, 8443),
        (Proto::Udp, 53, 5353),
    ] {
        tports
            .elements_mut()
            .insert(Key::AddrProtoPort(vip, p, port), Some(Value::Port(target)));
    }
    t.sets.insert("cls".into(), cls);
    t.sets.insert(SERVICE_ENDPOINTS.into(), addrs);
    t.sets.insert(SERVICE_TARGET_PORTS.into(), tports);
    let chain = |rules| Chain {
        base: None,
        comment: None,
        rules: std::sync::Arc::new(rules),
    };
    t.chains.insert("big-service-5".into(), chain(vec![]));
    t.chains.insert(
        "d".into(),
        chain(vec![
            Rule::new(
                vec![Match::AddrProtoInSet { set: "cls".into() }],
                Action::Verdict(Verdict::Goto("big-service-5".into())),
            ),
            Rule::new(
                vec![],
                Action::DnatShared {
                    addresses: SERVICE_ENDPOINTS,
                    ports: SERVICE_TARGET_PORTS,
                    modulus: 32,
                },
            ),
        ]),
    );
    t
}

/// The messages of a cold sync of the shared lists, decoded as the kernel's dumps of them,
/// are the state the planner expects, and planning again finds nothing to send.
#[test]
fn shared_lists_read_back_as_written() {
    use dataplane::nft::desired::Before;
    use dataplane::nft::plan::{plan, plan_cleanup};
    const NEWCHAIN: u16 = 3;
    const NEWRULE: u16 = 6;
    const NEWSET: u16 = 9;
    const NEWSETELEM: u16 = 12;
    const NFTA_SET_ELEM_LIST_SET: u16 = 2;
    for family in Family::ALL {
        let table = shared_table(family);
        let tx = plan(None, &Before::Nothing, &table);
        let (mut chains, mut rules, mut sets) = (Vec::new(), Vec::new(), Vec::new());
        let mut elements: HashMap<String, Vec<Vec<u8>>> = HashMap::new();
        for m in transaction_messages(&tx).unwrap() {
            match u16::from_ne_bytes([m[4], m[5]]) & 0xff {
                NEWCHAIN => chains.push(m),
                NEWRULE => rules.push(m),
                NEWSET => sets.push(m),
                NEWSETELEM => {
                    let set = message_nlas(&m)
                        .unwrap()
                        .into_iter()
                        .find(|(k, _)| *k == NFTA_SET_ELEM_LIST_SET)
                        .and_then(|(_, v)| c_string(v))
                        .unwrap();
                    elements.entry(set).or_default().push(m);
                }
                _ => {}
            }
        }
        let state = decode_state(family, &chains, &rules, &sets, |set| {
            Ok(Some(elements.get(set).cloned().unwrap_or_default()))
        })
        .unwrap()
        .unwrap();
        let mut expected = TableState::default();
        expected.apply(&tx);
        assert!(
            expected.agrees_with(&state, &table),
            "{state:?} read back, {expected:?} committed"
        );
        assert!(plan(Some(&state), &Before::Nothing, &table).is_empty());
        assert!(plan_cleanup(&state, &table).is_empty());
    }
}

/// Keys of the shared lists that nftproxy would not write are foreign.
#[test]
fn malformed_shared_list_keys_are_foreign() {
    let hex = |b: &str| -> Vec<u8> {
        b.split_whitespace()
            .map(|b| u8::from_str_radix(b, 16).unwrap())
            .collect()
    };
    let key = |t, b: &[u8]| decode_key(Family::V4, t, b);
    let vip = "10.96.0.10".parse().unwrap();
    assert_eq!(
        key(KeyType::AddrProto, &hex("0a 60 00 0a 06 00 00 00")),
        Some(Key::AddrProto(vip, Proto::Tcp))
    );
    for bad in [
        "0a 60 00 0a 06 00 01 00",
        "0a 60 00 0a 63 00 00 00",
        "0a 60 00 0a 06 00 00 00 00 00 00 00",
    ] {
        assert_eq!(key(KeyType::AddrProto, &hex(bad)), None, "{bad}");
    }
    let indexed = |i: u32| [hex("0a 60 00 0a 11 00 00 00"), i.to_ne_bytes().to_vec()].concat();
    assert_eq!(
        key(KeyType::AddrProtoIndex, &indexed(7)),
        Some(Key::AddrProtoIndex(vip, Proto::Udp, 7))
    );
    assert_eq!(key(KeyType::AddrProtoIndex, &indexed(1 << 16)), None);
    assert_eq!(
        key(KeyType::AddrProtoIndex, &hex("0a 60 00 0a 06 00 00 00")),
        None
    );
    assert_eq!(
        key(
            KeyType::AddrProtoPortToPort,
            &hex("0a 60 00 0a 06 00 00 00 00 50 00 00")
        ),
        Some(Key::AddrProtoPort(vip, Proto::Tcp, 80))
    );
}
