//! The order of [`Key`]s. Keys are compared constantly (the desired table's B-trees, sorted
//! element runs, the scope of a change); a derived `Ord` compares an IPv4 address as a byte
//! slice (`memcmp`) and walks the fields one by one. This order is the same, computed from
//! three integers.

use std::cmp::Ordering;
use std::net::IpAddr;

use super::Key;

/// An address as (family, value), ordered as `IpAddr` orders: every IPv4 address first.
#[inline]
fn addr_rank(addr: IpAddr) -> (u8, u128) {
    match addr {
        IpAddr::V4(a) => (0, u128::from(a.to_bits())),
        IpAddr::V6(a) => (1, a.to_bits()),
    }
}

/// Protocol, port and a third number (an index or an interval end), most significant first.
#[inline]
fn tail(proto: u8, port: u16, low: u32) -> u64 {
    (u64::from(proto) << 48) | (u64::from(port) << 32) | u64::from(low)
}

impl Key {
    /// (variant, address family, address, rest): compared as a tuple, the derived order.
    #[inline]
    fn rank(&self) -> (u8, u8, u128, u64) {
        match *self {
            Key::Addr(a) => {
                let (family, value) = addr_rank(a);
                (0, family, value, 0)
            }
            Key::AddrProtoPort(a, proto, port) => {
                let (family, value) = addr_rank(a);
                (1, family, value, tail(proto as u8, port, 0))
            }
            Key::ProtoPort(proto, port) => (2, 0, 0, tail(proto as u8, port, 0)),
            Key::AddrPair(a) => {
                let (family, value) = addr_rank(a);
                (3, family, value, 0)
            }
            Key::Interval { at, end } => (4, 0, 0, (u64::from(at) << 32) | u64::from(end)),
            Key::AddrProtoPortIndex(a, proto, port, i) => {
                let (family, value) = addr_rank(a);
                (5, family, value, tail(proto as u8, port, u32::from(i)))
            }
            Key::ProtoPortIndex(proto, port, i) => (6, 0, 0, tail(proto as u8, port, u32::from(i))),
        }
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Key) -> Ordering {
        self.rank().cmp(&other.rank())
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
        let proto = prop_oneof![Just(Proto::Tcp), Just(Proto::Udp), Just(Proto::Sctp)];
        let small = || prop_oneof![Just(0u16), Just(1), Just(u16::MAX)];
        let wide = || prop_oneof![Just(0u32), Just(1), Just(u32::MAX)];
        prop_oneof![
            addr().prop_map(Key::Addr),
            (addr(), proto.clone(), small()).prop_map(|(a, p, n)| Key::AddrProtoPort(a, p, n)),
            (proto.clone(), small()).prop_map(|(p, n)| Key::ProtoPort(p, n)),
            addr().prop_map(Key::AddrPair),
            (wide(), wide()).prop_map(|(at, end)| Key::Interval { at, end }),
            (addr(), proto.clone(), small(), small())
                .prop_map(|(a, p, n, i)| Key::AddrProtoPortIndex(a, p, n, i)),
            (proto, small(), small()).prop_map(|(p, n, i)| Key::ProtoPortIndex(p, n, i)),
        ]
    }

    proptest! {
        #[test]
        fn orders_as_derived(a in key(), b in key()) {
            prop_assert_eq!(a.cmp(&b), derived(a).cmp(&derived(b)));
            prop_assert_eq!(a.cmp(&b) == Ordering::Equal, a == b);
        }
    }
}
