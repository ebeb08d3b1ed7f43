use super::*;
use dataplane::nft::build::affinity::AFFINITY_CLIENTS;
use dataplane::nft::ruleset::{Proto, region_offset};
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
