use super::*;

#[test]
fn concat_key_types_match_nft() {
    assert_eq!(key_layout(Family::V4, KeyType::AddrProtoPort), (0x730d, 12));
    assert_eq!(key_layout(Family::V6, KeyType::AddrProtoPort), (0x830d, 24));
    assert_eq!(key_layout(Family::V4, KeyType::ProtoPort), (0x30d, 8));
    assert_eq!(key_layout(Family::V6, KeyType::Addr), (8, 16));
}

#[test]
fn keys_are_padded_per_field() {
    let k = Key::AddrProtoPort(
        "10.0.0.1".parse().unwrap(),
        dataplane::nft::ruleset::Proto::Tcp,
        80,
    );
    assert_eq!(
        key_bytes(Family::V4, &k).unwrap().to_vec(),
        vec![10, 0, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0]
    );
    assert!(key_bytes(Family::V6, &k).is_err());
}

fn hex(s: &str) -> Vec<u8> {
    s.split_whitespace()
        .map(|b| u8::from_str_radix(b, 16).unwrap())
        .collect()
}

/// The user data `nft -f` (1.0.6, x86_64) sent for `typeof numgen random mod 2 : ip daddr .
/// th dport; flags interval`, captured with `nft --debug=mnl`.
#[cfg(target_endian = "little")]
#[test]
fn endpoint_map_udata_is_nfts() {
    let common = "00 04 01 00 00 00 01 04 00 00 00 00 03 1a 00 04 17 00 00 00 01 12 00 04 \
                  01 00 00 00 01 04 02 00 00 00 02 04 00 00 00 00 04 34 00 04 0d 00 00 00 \
                  01 2c 00 14 00 04 07 00 00 00 01 0c 00 04";
    let tail = "01 14 00 04 07 00 00 00 01 0c 00 04 0b 00 00 00 01 04 02 00 00 00 06 04 \
                00 00 00 00";
    let v4 = format!("{common} 0c 00 00 00 01 04 0c 00 00 00 {tail}");
    let v6 = format!("{common} 0d 00 00 00 01 04 09 00 00 00 {tail}");
    assert_eq!(interval_map_udata(Family::V4), hex(&v4));
    assert_eq!(interval_map_udata(Family::V6), hex(&v6));
    assert_eq!(interval_map_udata(Family::V4).len(), 100);
    assert_eq!(endpoint_data_layout(Family::V4), (0x1cd, 8));
    assert_eq!(endpoint_data_layout(Family::V6), (0x20d, 20));
}

#[test]
fn endpoint_list_udata_is_nfts() {
    // What nft 1.0.6 sends for `typeof ip daddr . meta l4proto . th dport . numgen random
    // mod 2 : ip daddr . th dport` (captured with `nft --debug=mnl`), and the same without
    // `ip daddr .`.
    let v4 = "000400000000010400000000036000040d00000001580014000407000000010c00040c0000000104\
              0c000000010e00040900000001060004100000000214000407000000010c00040b00000001040200\
              0000031a0004170000000112000401000000010402000000020400000000043400040d000000012c\
              0014000407000000010c00040c00000001040c0000000114000407000000010c00040b0000000104\
              02000000060400000000";
    let nodeport = "000400000000010400000000034a00040d0000000142000e0004090000000106000410000000\
                    0114000407000000010c00040b000000010402000000021a00041700000001120004010000\
                    00010402000000020400000000043400040d000000012c0014000407000000010c00040c00\
                    000001040c0000000114000407000000010c00040b000000010402000000060400000000";
    let unspaced = |s: &str| -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    };
    assert_eq!(list_udata(Family::V4, false), unspaced(v4));
    assert_eq!(list_udata(Family::V4, true), unspaced(nodeport));
    assert_eq!(
        key_layout(Family::V4, KeyType::AddrProtoPortIndex),
        (0x1cc344, 16)
    );
    assert_eq!(
        key_layout(Family::V4, KeyType::ProtoPortIndex),
        (0xc344, 12)
    );
}

use dataplane::nft::ruleset::Proto;
use netlink_packet_core::Emitable;
use netlink_packet_netfilter::nftables::{SetElementAttribute, SetElementFlags};

/// The crate's serialisation of element attributes, which [`put_elements`] must match.
fn crate_bytes(elements: &[ListAttribute<SetElementAttribute>]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in elements {
        let mut b = vec![0; e.buffer_len()];
        e.emit(&mut b);
        out.extend(b);
    }
    out
}

fn written(family: Family, key: &Key, value: Option<&Value>, delete: bool) -> Vec<u8> {
    let mut out = Vec::new();
    put_elements(family, key, value, delete, &mut out).unwrap();
    out
}

#[test]
fn elements_are_written_as_the_crate_would() {
    let v4: IpAddr = "10.0.0.2".parse().unwrap();
    let v6: IpAddr = "fd00::2".parse().unwrap();
    let element = |key: Vec<u8>, data: Option<DataAttribute>| {
        let mut attrs = vec![SetElementAttribute::Key(DataAttribute::Value(key))];
        attrs.extend(data.map(SetElementAttribute::Data));
        ListAttribute::Element(attrs)
    };
    let verdicts = [
        Verdict::Accept,
        Verdict::Drop,
        Verdict::Return,
        Verdict::Jump("mark-for-masquerade".into()),
        Verdict::Goto("service-ABCDEFGH-ns/name/tcp/http".into()),
    ];
    for (family, addr) in [(Family::V4, v4), (Family::V6, v6)] {
        let keys = [
            Key::Addr(addr),
            Key::AddrPair(addr),
            Key::ProtoPort(Proto::Udp, 30053),
            Key::AddrProtoPort(addr, Proto::Sctp, 80),
            Key::AddrProto(addr, Proto::Tcp),
        ];
        for key in &keys {
            let bytes = key_bytes(family, key).unwrap().to_vec();
            let want = crate_bytes(&[element(bytes.clone(), None)]);
            assert_eq!(written(family, key, None, false), want, "{key:?}");
            assert_eq!(written(family, key, None, true), want, "{key:?}");
            for v in &verdicts {
                let data = DataAttribute::Verdict(verdict_attrs(v));
                let want = crate_bytes(&[element(bytes.clone(), Some(data))]);
                let value = Value::Verdict(v.clone());
                assert_eq!(written(family, key, Some(&value), false), want, "{v:?}");
            }
        }
        let endpoint = Value::Endpoint(addr, 8080);
        let data = endpoint_data(family, &addr, 8080).unwrap().to_vec();
        let addr_data = addr_data(family, &addr).unwrap().to_vec();
        for (key, value, data) in [
            (
                Key::AddrProtoIndex(addr, Proto::Tcp, 3),
                Value::Addr(addr),
                addr_data,
            ),
            (
                Key::AddrProtoPort(addr, Proto::Udp, 53),
                Value::Port(5353),
                port_data(5353).to_vec(),
            ),
        ] {
            let bytes = key_bytes(family, &key).unwrap().to_vec();
            let want = crate_bytes(&[element(bytes.clone(), Some(DataAttribute::Value(data)))]);
            assert_eq!(written(family, &key, Some(&value), false), want, "{key:?}");
            let want = crate_bytes(&[element(bytes, None)]);
            assert_eq!(written(family, &key, None, true), want, "{key:?}");
        }
        for key in [
            Key::AddrProtoPortIndex(addr, Proto::Tcp, 80, 4),
            Key::ProtoPortIndex(Proto::Tcp, 30080, 0),
        ] {
            let bytes = key_bytes(family, &key).unwrap().to_vec();
            let want = crate_bytes(&[element(
                bytes.clone(),
                Some(DataAttribute::Value(data.clone())),
            )]);
            assert_eq!(written(family, &key, Some(&endpoint), false), want);
            let want = crate_bytes(&[element(bytes, None)]);
            assert_eq!(written(family, &key, None, true), want);
        }
    }
    // An endpoint belongs only in an endpoint map, an address or a port only in the maps to
    // them.
    let mut out = Vec::new();
    let endpoint = Value::Endpoint(v4, 8080);
    assert!(put_elements(Family::V4, &Key::Addr(v4), Some(&endpoint), false, &mut out).is_err());
    let listed = Key::AddrProtoIndex(v4, Proto::Tcp, 0);
    assert!(put_elements(Family::V4, &listed, Some(&Value::Port(80)), false, &mut out).is_err());
    let shared = Key::AddrProto(v4, Proto::Tcp);
    assert!(put_elements(Family::V4, &shared, Some(&Value::Addr(v4)), false, &mut out).is_err());
}

#[test]
fn slot_elements_are_big_endian_keys_with_padded_ports() {
    let interval = Key::Interval {
        at: 0x0048_cc40,
        end: 0x0048_cc50,
    };
    let endpoint = Value::Endpoint("10.0.0.2".parse().unwrap(), 8080);
    let added = written(Family::V4, &interval, Some(&endpoint), false);
    assert!(put_elements(Family::V4, &interval, None, false, &mut Vec::new()).is_err());
    let deleted = written(Family::V4, &interval, None, true);
    let start = |key: u32, data: Option<&str>| {
        let mut attrs = vec![SetElementAttribute::Key(DataAttribute::Value(
            key.to_be_bytes().to_vec(),
        ))];
        if let Some(d) = data {
            attrs.push(SetElementAttribute::Data(DataAttribute::Value(hex(d))));
        }
        ListAttribute::Element(attrs)
    };
    let end = ListAttribute::Element(vec![
        SetElementAttribute::Key(DataAttribute::Value(vec![0x00, 0x48, 0xcc, 0x50])),
        SetElementAttribute::Flags(SetElementFlags::IntervalEnd),
    ]);
    assert_eq!(
        added,
        crate_bytes(&[
            start(0x0048_cc40, Some("0a 00 00 02 1f 90 00 00")),
            end.clone()
        ])
    );
    assert_eq!(deleted, crate_bytes(&[start(0x0048_cc40, None), end]));
    assert_eq!(
        endpoint_data(Family::V4, &"10.0.0.2".parse().unwrap(), 8080)
            .unwrap()
            .to_vec(),
        hex("0a 00 00 02 1f 90 00 00")
    );
    assert!(endpoint_data(Family::V6, &"10.0.0.2".parse().unwrap(), 8080).is_err());
}

#[test]
fn large_element_lists_are_split() {
    let elements: Vec<(Key, Option<Value>)> = (0..2000u32)
        .map(|i| {
            (
                Key::Addr(IpAddr::V6(std::net::Ipv6Addr::from(u128::from(i)))),
                Some(Value::Verdict(Verdict::Goto(
                    format!("a-rather-long-chain-name-{i:08}").into(),
                ))),
            )
        })
        .collect();
    let op = Op::AddElements {
        set: "m".to_string(),
        elements: elements.into(),
    };
    let cmds = encode_op(Family::V6, &op, &mut 0).unwrap();
    assert!(cmds.len() > 1);
    for c in &cmds {
        assert!(c.msg.buffer_len() < MAX_MESSAGE_BYTES);
    }
}

/// The set declarations of the shared address lists as nft 1.0.6 sends them (captured with
/// `nft --debug=mnl -f` of `set cls { type ipv4_addr . inet_proto; }`, `map addrs { typeof ip
/// daddr . meta l4proto . numgen random mod 2 : ip daddr; }` and `map tports { type ipv4_addr
/// . inet_proto . inet_service : inet_service; }`, and the same in an ip6 table).
#[cfg(target_endian = "little")]
#[test]
fn shared_list_declarations_are_nfts() {
    let layouts = [
        (KeyType::AddrProto, (0x1cc, 8), (0x20c, 20), None),
        (
            KeyType::AddrProtoIndex,
            (0x7304, 12),
            (0x8304, 24),
            Some([(7, 4), (8, 16)]),
        ),
        (
            KeyType::AddrProtoPortToPort,
            (0x730d, 12),
            (0x830d, 24),
            Some([(13, 2), (13, 2)]),
        ),
    ];
    for (key, v4, v6, data) in layouts {
        assert_eq!(key_layout(Family::V4, key), v4, "{key:?}");
        assert_eq!(key_layout(Family::V6, key), v6, "{key:?}");
        assert_eq!(value_data_layout(Family::V4, key), data.map(|d| d[0]));
        assert_eq!(value_data_layout(Family::V6, key), data.map(|d| d[1]));
    }
    let udata = |family, key, is_vmap| {
        set_udata(
            family,
            &SetDecl {
                is_vmap,
                ..SetDecl::new(key)
            },
        )
    };
    let shared_list = |daddr: &str| {
        hex(&format!(
            "00 04 00 00 00 00 01 04 02 00 00 00 03 4a 00 04 0d 00 00 00 01 42 00 14 00 04 07 \
             00 00 00 01 0c {daddr} 01 0e 00 04 09 00 00 00 01 06 00 04 10 00 00 00 02 1a 00 \
             04 17 00 00 00 01 12 00 04 01 00 00 00 01 04 02 00 00 00 02 04 00 00 00 00 04 14 \
             00 04 07 00 00 00 01 0c {daddr} 06 04 00 00 00 00"
        ))
    };
    let v4_daddr = "00 04 0c 00 00 00 01 04 0c 00 00 00";
    let v6_daddr = "00 04 0d 00 00 00 01 04 09 00 00 00";
    for family in Family::ALL {
        assert_eq!(
            udata(family, KeyType::AddrProto, false),
            hex("00 04 00 00 00 00 03 08 00 04 0d 00 00 00 01 00")
        );
        // `map vm { type ipv4_addr . inet_proto : verdict; }`
        assert_eq!(
            udata(family, KeyType::AddrProto, true),
            hex(
                "00 04 00 00 00 00 01 04 00 00 00 00 03 08 00 04 0d 00 00 00 01 00 06 04 00 00 00 00"
            )
        );
        assert_eq!(
            udata(family, KeyType::AddrProtoPortToPort, false),
            hex(
                "00 04 00 00 00 00 01 04 02 00 00 00 03 08 00 04 0d 00 00 00 01 00 06 04 00 00 00 00"
            )
        );
    }
    assert_eq!(
        udata(Family::V4, KeyType::AddrProtoIndex, false),
        shared_list(v4_daddr)
    );
    assert_eq!(
        udata(Family::V6, KeyType::AddrProtoIndex, false),
        shared_list(v6_daddr)
    );
}

/// The messages of the set declarations: the flags, types, lengths and user data nft sends
/// (`comment "c"` last, as nft puts it).
#[cfg(target_endian = "little")]
#[test]
fn shared_list_set_messages_carry_nfts_attributes() {
    let decl = |key| SetDecl {
        comment: Some("c".into()),
        size: Some(96),
        ..SetDecl::new(key)
    };
    let attrs = |family, key| match set_message(family, "m", &decl(key), 1).unwrap().msg {
        NfTablesMessage::NewSet(SetMessage { attributes }) => attributes,
        _ => unreachable!(),
    };
    let flags_of = |a: &[SetAttribute]| {
        a.iter().find_map(|a| match a {
            SetAttribute::Flags(f) => Some(*f),
            _ => None,
        })
    };
    let udata_of = |a: &[SetAttribute]| {
        a.iter().find_map(|a| match a {
            SetAttribute::UserData(u) => Some(u.clone()),
            _ => None,
        })
    };
    for family in Family::ALL {
        let cls = attrs(family, KeyType::AddrProto);
        assert_eq!(flags_of(&cls), Some(SetFlags::empty()));
        assert!(!cls.iter().any(|a| matches!(a, SetAttribute::DataType(_))));
        assert_eq!(
            udata_of(&cls),
            Some(hex(
                "00 04 00 00 00 00 03 08 00 04 0d 00 00 00 01 00 07 02 63 00"
            ))
        );
        for key in [KeyType::AddrProtoIndex, KeyType::AddrProtoPortToPort] {
            let map = attrs(family, key);
            assert_eq!(flags_of(&map), Some(SetFlags::Map), "{key:?}");
            let (data_type, data_len) = value_data_layout(family, key).unwrap();
            assert!(map.contains(&SetAttribute::DataType(data_type)));
            assert!(map.contains(&SetAttribute::DataLen(data_len)));
            let (key_type, key_len) = key_layout(family, key);
            assert!(map.contains(&SetAttribute::KeyType(key_type)));
            assert!(map.contains(&SetAttribute::KeyLen(key_len)));
        }
        // An address list's data cannot be a verdict, nor expire.
        for key in [KeyType::AddrProtoIndex, KeyType::AddrProtoPortToPort] {
            let vmap = SetDecl {
                is_vmap: true,
                ..SetDecl::new(key)
            };
            assert!(set_message(family, "m", &vmap, 1).is_err());
        }
    }
}

/// Keys and data of the shared address lists as `nft --debug=netlink` shows nft's: the
/// protocol and the index each in a 4-byte register, the index host-endian as `numgen`
/// writes it.
#[cfg(target_endian = "little")]
#[test]
fn shared_list_elements_are_nfts() {
    let vip: IpAddr = "10.96.0.10".parse().unwrap();
    let vip6: IpAddr = "fd00::10".parse().unwrap();
    let key = |family, k: Key| key_bytes(family, &k).unwrap().to_vec();
    assert_eq!(
        key(Family::V4, Key::AddrProto(vip, Proto::Tcp)),
        hex("0a 60 00 0a 06 00 00 00")
    );
    assert_eq!(
        key(Family::V4, Key::AddrProtoIndex(vip, Proto::Tcp, 1)),
        hex("0a 60 00 0a 06 00 00 00 01 00 00 00")
    );
    assert_eq!(
        key(Family::V4, Key::AddrProtoPort(vip, Proto::Tcp, 80)),
        hex("0a 60 00 0a 06 00 00 00 00 50 00 00")
    );
    assert_eq!(
        key(Family::V6, Key::AddrProto(vip6, Proto::Tcp)),
        hex("fd 00 00 00 00 00 00 00 00 00 00 00 00 00 00 10 06 00 00 00")
    );
    assert_eq!(
        key(Family::V6, Key::AddrProtoIndex(vip6, Proto::Udp, 0)),
        hex("fd 00 00 00 00 00 00 00 00 00 00 00 00 00 00 10 11 00 00 00 00 00 00 00")
    );
    assert!(key_bytes(Family::V6, &Key::AddrProto(vip, Proto::Tcp)).is_err());
    assert!(key_bytes(Family::V4, &Key::AddrProtoIndex(vip6, Proto::Tcp, 0)).is_err());
    assert_eq!(
        addr_data(Family::V4, &"10.244.1.2".parse().unwrap())
            .unwrap()
            .to_vec(),
        hex("0a f4 01 02")
    );
    assert_eq!(port_data(8080).to_vec(), hex("1f 90"));
}

/// An expression's name and attributes.
type RawExpr = (String, Vec<(u16, Vec<u8>)>);

/// `(name, attributes)` of each expression of `rule`, attributes sorted by type: nft writes
/// them in another order, which the kernel does not care about.
fn expressions(family: Family, rule: &Rule) -> Vec<RawExpr> {
    fn attrs(mut b: &[u8]) -> Vec<(u16, Vec<u8>)> {
        let mut out = Vec::new();
        while b.len() >= 4 {
            let len = usize::from(u16::from_ne_bytes([b[0], b[1]]));
            let kind = u16::from_ne_bytes([b[2], b[3]]) & !NLA_F_NESTED;
            out.push((kind, b[4..len].to_vec()));
            b = b.get((len + 3) & !3..).unwrap_or_default();
        }
        out.sort();
        out
    }
    let mut out = Vec::new();
    for e in rule_exprs(family, rule).unwrap() {
        let mut buf = vec![0; e.buffer_len()];
        e.emit(&mut buf);
        let parts = attrs(&buf[4..]);
        let name = String::from_utf8(parts[0].1.clone()).unwrap();
        out.push((name.trim_end_matches('\0').to_string(), attrs(&parts[1].1)));
    }
    out
}

/// The shared lists' rules are the expressions nft 1.0.6 sends for `ip daddr . meta l4proto
/// @cls goto c` and `dnat ip to ip daddr . meta l4proto . numgen random mod 32 map @addrs :
/// ip daddr . meta l4proto . th dport map @tports` (`nft --debug=mnl -f`; it also sends the
/// lookups' set ids, which name the sets of its own batch), in both families.
#[test]
fn shared_list_rules_are_nfts() {
    let u = |k: u16, v: u32| (k, v.to_be_bytes().to_vec());
    let name = |k: u16, s: &str| (k, format!("{s}\0").into_bytes());
    let expr = |n: &str, mut a: Vec<(u16, Vec<u8>)>| {
        a.sort();
        (n.to_string(), a)
    };
    let payload = |dreg, base, offset, len| {
        expr(
            "payload",
            vec![u(1, dreg), u(2, base), u(3, offset), u(4, len)],
        )
    };
    let meta_l4proto = |dreg| expr("meta", vec![u(2, 16), u(1, dreg)]);
    let lookup = |set: &str, sreg, dreg: Option<u32>| {
        let mut a = vec![name(1, set), u(2, sreg)];
        a.extend(dreg.map(|d| u(3, d)));
        expr("lookup", a)
    };
    let member = Rule::new(
        vec![Match::AddrProtoInSet { set: "cls".into() }],
        Action::Verdict(Verdict::Goto("c".into())),
    );
    let shared = Rule::new(
        vec![],
        Action::DnatShared {
            addresses: "addrs",
            ports: "tports",
            modulus: 32,
        },
    );
    // Registers: the protocol's, numgen's, the port key's address, protocol and port.
    for (family, nfproto, (offset, len), [proto, ng, key, key_proto, key_port]) in [
        (Family::V4, 2, (16, 4), [9, 10, 2, 13, 14]),
        (Family::V6, 10, (24, 16), [2, 13, 2, 3, 17]),
    ] {
        let got = expressions(family, &member);
        assert_eq!(
            got[..3],
            [
                payload(1, 1, offset, len),
                meta_l4proto(proto),
                lookup("cls", 1, None),
            ],
            "{family:?}"
        );
        assert_eq!(
            expressions(family, &shared),
            [
                payload(1, 1, offset, len),
                meta_l4proto(proto),
                expr("numgen", vec![u(1, ng), u(2, 32), u(3, 1), u(4, 0)]),
                lookup("addrs", 1, Some(1)),
                payload(key, 1, offset, len),
                meta_l4proto(key_proto),
                payload(key_port, 2, 2, 2),
                lookup("tports", 2, Some(2)),
                expr(
                    "nat",
                    vec![u(1, 1), u(2, nfproto), u(3, 1), u(5, 2), u(7, 2)]
                ),
            ],
            "{family:?}"
        );
    }
}
