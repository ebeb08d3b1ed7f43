//! The order of [`Key`]s. Keys are compared constantly (the desired table's B-trees, sorted
//! element runs, the scope of a change); a derived `Ord` compares an IPv4 address as a byte
//! slice (`memcmp`). This order is the same, with addresses compared as numbers.

use std::cmp::Ordering;
use std::net::IpAddr;

use super::Key;

/// Addresses as `IpAddr` orders them (every IPv4 address first), as numbers.
#[inline]
fn addr_cmp(a: &IpAddr, b: &IpAddr) -> Ordering {
    match (a, b) {
        (IpAddr::V4(a), IpAddr::V4(b)) => a.to_bits().cmp(&b.to_bits()),
        (IpAddr::V6(a), IpAddr::V6(b)) => a.to_bits().cmp(&b.to_bits()),
        (IpAddr::V4(_), IpAddr::V6(_)) => Ordering::Less,
        (IpAddr::V6(_), IpAddr::V4(_)) => Ordering::Greater,
    }
}

impl Key {
    /// The variant's place in the declaration.
    fn variant(&self) -> u8 {
        match self {
            Key::Addr(_) => 0,
            Key::AddrProtoPort(..) => 1,
            Key::ProtoPort(..) => 2,
            Key::AddrPair(_) => 3,
            Key::Interval { .. } => 4,
            Key::AddrProtoPortIndex(..) => 5,
            Key::ProtoPortIndex(..) => 6,
            Key::AddrProto(..) => 7,
            Key::AddrProtoIndex(..) => 8,
        }
    }
}

impl Ord for Key {
    #[inline]
    fn cmp(&self, other: &Key) -> Ordering {
        match (self, other) {
            (Key::Addr(a), Key::Addr(b)) | (Key::AddrPair(a), Key::AddrPair(b)) => addr_cmp(a, b),
            (Key::AddrProtoPort(a, p, n), Key::AddrProtoPort(b, q, m)) => {
                addr_cmp(a, b).then_with(|| (p, n).cmp(&(q, m)))
            }
            (Key::ProtoPort(p, n), Key::ProtoPort(q, m)) => (p, n).cmp(&(q, m)),
            (Key::Interval { at, end }, Key::Interval { at: a, end: e }) => (at, end).cmp(&(a, e)),
            (Key::AddrProtoPortIndex(a, p, n, i), Key::AddrProtoPortIndex(b, q, m, j)) => {
                addr_cmp(a, b).then_with(|| (p, n, i).cmp(&(q, m, j)))
            }
            (Key::ProtoPortIndex(p, n, i), Key::ProtoPortIndex(q, m, j)) => {
                (p, n, i).cmp(&(q, m, j))
            }
            (Key::AddrProto(a, p), Key::AddrProto(b, q)) => addr_cmp(a, b).then_with(|| p.cmp(q)),
            (Key::AddrProtoIndex(a, p, i), Key::AddrProtoIndex(b, q, j)) => {
                addr_cmp(a, b).then_with(|| (p, i).cmp(&(q, j)))
            }
            _ => self.variant().cmp(&other.variant()),
        }
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Key) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::Proto;
    use proptest::prelude::*;

    /// `Key` with the derived order, to hold the hand-written one to.
    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    enum Derived {
        Addr(IpAddr),
        AddrProtoPort(IpAddr, Proto, u16),
        ProtoPort(Proto, u16),
        AddrPair(IpAddr),
        Interval { at: u32, end: u32 },
        AddrProtoPortIndex(IpAddr, Proto, u16, u16),
        ProtoPortIndex(Proto, u16, u16),
        AddrProto(IpAddr, Proto),
        AddrProtoIndex(IpAddr, Proto, u16),
    }

    fn derived(k: Key) -> Derived {
        match k {
            Key::Addr(a) => Derived::Addr(a),
            Key::AddrProtoPort(a, p, n) => Derived::AddrProtoPort(a, p, n),
            Key::ProtoPort(p, n) => Derived::ProtoPort(p, n),
            Key::AddrPair(a) => Derived::AddrPair(a),
            Key::Interval { at, end } => Derived::Interval { at, end },
            Key::AddrProtoPortIndex(a, p, n, i) => Derived::AddrProtoPortIndex(a, p, n, i),
            Key::ProtoPortIndex(p, n, i) => Derived::ProtoPortIndex(p, n, i),
            Key::AddrProto(a, p) => Derived::AddrProto(a, p),
            Key::AddrProtoIndex(a, p, i) => Derived::AddrProtoIndex(a, p, i),
        }
    }

    /// Few distinct values per field, so that equal prefixes (and so the later fields) are
    /// compared often.
    fn addr() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            (0u32..4).prop_map(|n| IpAddr::from(std::net::Ipv4Addr::from_bits(n << 30 | n))),
            (0u128..4).prop_map(|n| IpAddr::from(std::net::Ipv6Addr::from_bits(n << 126 | n))),
        ]
    }

    fn key() -> impl Strategy<Value = Key> {
        (0u8..9, fields()).prop_map(|(v, f)| of_variant(v, f))
    }

    /// A key of variant `v` made of `fields`.
    fn of_variant(v: u8, (a, p, n, i, at, end): (IpAddr, Proto, u16, u16, u32, u32)) -> Key {
        match v {
            0 => Key::Addr(a),
            1 => Key::AddrProtoPort(a, p, n),
            2 => Key::ProtoPort(p, n),
            3 => Key::AddrPair(a),
            4 => Key::Interval { at, end },
            5 => Key::AddrProtoPortIndex(a, p, n, i),
            6 => Key::ProtoPortIndex(p, n, i),
            7 => Key::AddrProto(a, p),
            _ => Key::AddrProtoIndex(a, p, i),
        }
    }

    fn fields() -> impl Strategy<Value = (IpAddr, Proto, u16, u16, u32, u32)> {
        let proto = prop_oneof![Just(Proto::Tcp), Just(Proto::Udp), Just(Proto::Sctp)];
        let small = || prop_oneof![Just(0u16), Just(1), Just(u16::MAX)];
        let wide = || prop_oneof![Just(0u32), Just(1), Just(u32::MAX)];
        (addr(), proto, small(), small(), wide(), wide())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]
        #[test]
        fn orders_as_derived(a in key(), b in key()) {
            prop_assert_eq!(a.cmp(&b), derived(a).cmp(&derived(b)));
            prop_assert_eq!(a.cmp(&b) == Ordering::Equal, a == b);
        }

        /// Keys of one variant, so that every field decides some comparisons.
        #[test]
        fn orders_one_variant_as_derived(v in 0u8..9, x in fields(), y in fields()) {
            let (a, b) = (of_variant(v, x), of_variant(v, y));
            prop_assert_eq!(a.cmp(&b), derived(a).cmp(&derived(b)));
        }
    }
}
