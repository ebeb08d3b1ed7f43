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
    // An endpoint belongs only in an endpoint map.
    let mut out = Vec::new();
    let endpoint = Value::Endpoint(v4, 8080);
    assert!(put_elements(Family::V4, &Key::Addr(v4), Some(&endpoint), false, &mut out).is_err());
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
