use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use proptest::prelude::*;

use super::*;
use crate::nft::ruleset::{Proto, Verdict};

/// Keys of a few kinds over small ranges, so that operations meet each other: list entries of
/// a few destinations (indices far past a list's end included), and plain keys of both
/// families.
fn key() -> impl Strategy<Value = Key> {
    let addr = (0u8..3).prop_map(|i| IpAddr::V4(Ipv4Addr::new(10, 0, 0, i)));
    let any_addr = prop_oneof![
        3 => addr.clone(),
        1 => (0u16..2).prop_map(|i| IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, i))),
    ];
    prop_oneof![
        4 => (addr.clone(), 0u16..2, prop_oneof![0u16..40, 60u16..70, Just(u16::MAX)])
            .prop_map(|(a, port, i)| Key::AddrProtoPortIndex(a, Proto::Tcp, port, i)),
        2 => (0u16..2, 0u16..40).prop_map(|(port, i)| Key::ProtoPortIndex(Proto::Udp, port, i)),
        2 => (addr.clone(), 0u16..40).prop_map(|(a, i)| Key::AddrProtoIndex(a, Proto::Tcp, i)),
        1 => any_addr.clone().prop_map(Key::Addr),
        1 => any_addr.prop_map(Key::AddrPair),
        1 => (addr, 0u16..2).prop_map(|(a, port)| Key::AddrProtoPort(a, Proto::Tcp, port)),
    ]
}

fn value() -> impl Strategy<Value = Option<Value>> {
    let v4 = (0u8..4).prop_map(|i| IpAddr::V4(Ipv4Addr::new(10, 1, 0, i)));
    let v6 = (0u16..4).prop_map(|i| IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, i)));
    prop_oneof![
        6 => (v4, 80u16..82).prop_map(|(a, p)| Some(Value::Endpoint(a, p))),
        2 => (v6, 80u16..82).prop_map(|(a, p)| Some(Value::Endpoint(a, p))),
        2 => (0u8..4).prop_map(|i| Some(Value::Addr(IpAddr::V4(Ipv4Addr::new(10, 1, 0, i))))),
        1 => Just(Some(Value::Verdict(Verdict::Goto("svc".into())))),
        1 => Just(None),
    ]
}

#[derive(Clone, Debug)]
enum Op {
    Insert(Key, Option<Value>),
    Remove(Key),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (key(), value()).prop_map(|(k, v)| Op::Insert(k, v)),
        2 => key().prop_map(Op::Remove),
    ]
}

/// Keys for a batch: any keys, or a run of one destination's entries (in index order or
/// another), as a large Service's list comes.
fn batch_keys() -> impl Strategy<Value = Vec<Key>> {
    let run = (0u8..3, 0u16..2, 0u16..40, 1u16..40, any::<bool>()).prop_map(
        |(a, port, start, len, reverse)| {
            let a = IpAddr::V4(Ipv4Addr::new(10, 0, 0, a));
            let mut keys: Vec<Key> = (start..start + len)
                .map(|i| Key::AddrProtoPortIndex(a, Proto::Tcp, port, i))
                .collect();
            if reverse {
                keys.reverse();
            }
            keys
        },
    );
    prop_oneof![run, prop::collection::vec(key(), 0..20)]
}

#[derive(Clone, Debug)]
enum Batch {
    Insert(Vec<(Key, Option<Value>)>),
    Remove(Vec<Key>),
}

fn batch() -> impl Strategy<Value = Batch> {
    prop_oneof![
        3 => batch_keys()
            .prop_flat_map(|keys| {
                let n = keys.len();
                (Just(keys), prop::collection::vec(value(), n))
            })
            .prop_map(|(keys, values)| Batch::Insert(keys.into_iter().zip(values).collect())),
        2 => batch_keys().prop_map(Batch::Remove),
    ]
}

fn model(map: &ElementMap) -> Vec<(Key, Option<Value>)> {
    map.iter().collect()
}

proptest! {
    /// Whatever is inserted and removed, the map answers as a `BTreeMap` would: the values
    /// returned, lookups, the length, iteration in key order and from any key.
    #[test]
    fn behaves_as_a_btree_map(ops in prop::collection::vec(op(), 0..300), probes in prop::collection::vec(key(), 1..20)) {
        let mut map = ElementMap::new();
        let mut want: BTreeMap<Key, Option<Value>> = BTreeMap::new();
        for op in &ops {
            match op {
                Op::Insert(k, v) => prop_assert_eq!(map.insert(*k, v.clone()), want.insert(*k, v.clone())),
                Op::Remove(k) => prop_assert_eq!(map.remove(k), want.remove(k)),
            }
            prop_assert_eq!(map.len(), want.len());
        }
        let all: Vec<_> = want.iter().map(|(k, v)| (*k, v.clone())).collect();
        prop_assert_eq!(model(&map), all.clone());
        prop_assert_eq!(map.keys().collect::<Vec<_>>(), want.keys().copied().collect::<Vec<_>>());
        for probe in &probes {
            prop_assert_eq!(map.get(probe), want.get(probe).cloned());
            prop_assert_eq!(map.contains_key(probe), want.contains_key(probe));
            let from: Vec<_> = want.range(*probe..).map(|(k, v)| (*k, v.clone())).collect();
            prop_assert_eq!(map.iter_from(*probe).collect::<Vec<_>>(), from);
        }
        // Looked up together, sorted (runs of one destination) and as they come.
        let mut sorted = probes.clone();
        sorted.sort();
        for keys in [&probes, &sorted] {
            let each: Vec<_> = map.get_each(keys.iter()).collect();
            let one_by_one: Vec<_> = keys.iter().map(|k| want.get(k).cloned()).collect();
            prop_assert_eq!(each, one_by_one);
        }
        // A destination's list, read whole, is its entries' lookups.
        for probe in &probes {
            if let Some((dest, _)) = probe.list_destination() {
                for n in [0, 1, 5, 40, 80] {
                    let one_by_one: Vec<_> = (0..n)
                        .map(|i| {
                            let key = dest.list_entry(i).expect("a destination");
                            let value = want.get(&key)?;
                            as_entry(&key, value).map(|(_, _, target)| target)
                        })
                        .collect();
                    prop_assert_eq!(map.list_targets(dest, usize::from(n)), one_by_one);
                }
            }
        }
        // Built at once from the same elements, in any order, it is the same map.
        let mut shuffled = all.clone();
        shuffled.reverse();
        let built: ElementMap = shuffled.into_iter().collect();
        prop_assert_eq!(&built, &map);
        prop_assert_eq!(model(&built), all);
        prop_assert_eq!(built.len(), want.len());
    }

    /// Inserted or removed in batches, the map answers as a `BTreeMap` one element at a time.
    #[test]
    fn batches_behave_as_single_changes(batches in prop::collection::vec(batch(), 0..30)) {
        let mut map = ElementMap::new();
        let mut want: BTreeMap<Key, Option<Value>> = BTreeMap::new();
        for batch in batches {
            let mut got = Vec::new();
            let mut expected = Vec::new();
            match batch {
                Batch::Insert(elements) => {
                    for (k, v) in &elements {
                        expected.push((*k, v.is_some(), want.insert(*k, v.clone())));
                    }
                    map.insert_each(elements, |k, has_value, was| got.push((k, has_value, was)));
                }
                Batch::Remove(keys) => {
                    for k in &keys {
                        expected.push((*k, false, want.remove(k)));
                    }
                    map.remove_each(keys, |k, was| got.push((k, false, was)));
                }
            }
            prop_assert_eq!(got, expected);
            prop_assert_eq!(map.len(), want.len());
        }
        let all: Vec<_> = want.into_iter().collect();
        prop_assert_eq!(model(&map), all.clone());
        // Its lists are as an element-by-element build would leave them.
        prop_assert_eq!(&map, &all.into_iter().collect::<ElementMap>());
    }

    /// Of two elements with one key, the later stays (as `BTreeMap::from_iter` does).
    #[test]
    fn collecting_keeps_the_last_of_one_key(elements in prop::collection::vec((key(), value()), 0..100)) {
        let map: ElementMap = elements.iter().cloned().collect();
        let want: BTreeMap<_, _> = elements.into_iter().collect();
        prop_assert_eq!(model(&map), want.into_iter().collect::<Vec<_>>());
    }
}

fn entry(i: u16) -> Key {
    Key::AddrProtoPortIndex(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 1)), Proto::Tcp, 80, i)
}

fn endpoint(i: u8) -> Option<Value> {
    Some(Value::Endpoint(
        IpAddr::V4(Ipv4Addr::new(10, 1, 0, i)),
        8080,
    ))
}

#[test]
fn endpoint_lists_are_compact() {
    let map: ElementMap = (0..200u16).map(|i| (entry(i), endpoint(i as u8))).collect();
    assert_eq!(map.len(), 200);
    // One list, an IPv4 entry in 8 bytes; nothing in the B-tree.
    assert!(map.other.is_empty());
    assert_eq!(map.lists.len(), 1);
    match map.lists.values().next() {
        Some(List::V4(v)) => {
            assert_eq!(v.len(), 200);
            assert_eq!(v.capacity(), 200);
            assert_eq!(std::mem::size_of_val(&v[0]), 8);
        }
        other => panic!("not an IPv4 list: {other:?}"),
    }
}

#[test]
fn a_wild_index_does_not_grow_a_list() {
    let mut map = ElementMap::new();
    map.insert(entry(0), endpoint(1));
    map.insert(entry(u16::MAX), endpoint(2));
    assert_eq!(map.lists.values().map(List::len).sum::<usize>(), 1);
    assert_eq!(map.other.len(), 1);
    assert_eq!(map.get(&entry(u16::MAX)), Some(endpoint(2)));
    assert_eq!(
        map.keys().collect::<Vec<_>>(),
        vec![entry(0), entry(u16::MAX)]
    );
}

#[test]
fn a_wild_index_in_a_run_does_not_grow_a_list() {
    let mut map = ElementMap::new();
    let run = [
        (entry(0), endpoint(1)),
        (entry(1), endpoint(2)),
        (entry(u16::MAX), endpoint(3)),
    ];
    map.insert_each(run, |_, _, was| assert_eq!(was, None));
    assert_eq!(map.lists.values().map(List::len).sum::<usize>(), 2);
    assert_eq!(map.other.len(), 1);
    let mut gone = Vec::new();
    map.remove_each([entry(0), entry(u16::MAX), entry(1)], |key, was| {
        gone.push((key, was))
    });
    assert_eq!(
        gone,
        [
            (entry(0), endpoint(1)),
            (entry(u16::MAX), endpoint(3)),
            (entry(1), endpoint(2))
        ]
        .map(|(key, value)| (key, Some(value)))
    );
    assert!(map.is_empty() && map.lists.is_empty() && map.other.is_empty());
}

#[test]
fn removing_the_last_entries_drops_the_list() {
    let mut map: ElementMap = (0..3u16).map(|i| (entry(i), endpoint(i as u8))).collect();
    assert_eq!(map.remove(&entry(1)), Some(endpoint(1)));
    assert_eq!(map.remove(&entry(2)), Some(endpoint(2)));
    assert_eq!(map.lists.values().next().map(List::len), Some(1));
    assert_eq!(map.remove(&entry(0)), Some(endpoint(0)));
    assert!(map.lists.is_empty());
    assert!(map.is_empty());
    assert_eq!(map, ElementMap::new());
}

#[test]
fn ipv4_addresses_of_plain_sets_are_numbers() {
    let a = |i: u8| IpAddr::V4(Ipv4Addr::new(10, 96, 0, i));
    let six = IpAddr::V6(Ipv6Addr::LOCALHOST);
    let map: ElementMap = [
        (Key::AddrPair(a(1)), None),
        (Key::Addr(six), None),
        (Key::Addr(a(2)), None),
        (Key::Addr(a(1)), Some(Value::Verdict(Verdict::Accept))),
        (Key::AddrPair(six), None),
    ]
    .into();
    assert_eq!(map.addrs.len(), 2);
    assert_eq!(
        map.keys().collect::<Vec<_>>(),
        vec![
            Key::Addr(a(1)),
            Key::Addr(a(2)),
            Key::Addr(six),
            Key::AddrPair(a(1)),
            Key::AddrPair(six)
        ]
    );
    assert_eq!(
        map.keys_from(Key::Addr(six)).collect::<Vec<_>>(),
        vec![Key::Addr(six), Key::AddrPair(a(1)), Key::AddrPair(six)]
    );
}

#[test]
fn short_lists_hold_their_entries_in_place() {
    assert_eq!(std::mem::size_of::<List>(), 32);
    let map: ElementMap = (0..2u16).map(|i| (entry(i), endpoint(i as u8))).collect();
    match map.lists.values().next() {
        Some(List::V4(v)) => assert!(!v.spilled()),
        other => panic!("not an IPv4 list: {other:?}"),
    }
}
