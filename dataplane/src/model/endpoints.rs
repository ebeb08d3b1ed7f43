//! A slice's endpoints, packed: endpoints are most of the model's memory (1.2 M of them at
//! 100k Services of the realistic shape), and most are IPv4.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use super::{Endpoint, Site};
use crate::net::Family;

/// The endpoints of one slice, in order. An IPv4 endpoint is held in 16 bytes (address,
/// conditions as bits, site), half of an [`Endpoint`]; a list holding any IPv6 endpoint keeps
/// whole ones, which take no less packed. Endpoints are handed out by value.
#[derive(Clone, Default)]
pub struct Endpoints(Store);

#[derive(Clone)]
enum Store {
    V4(Vec<Packed4>),
    Any(Vec<Endpoint>),
}

impl Default for Store {
    fn default() -> Store {
        Store::V4(Vec::new())
    }
}

#[derive(Clone)]
struct Packed4 {
    addr: Ipv4Addr,
    conditions: u8,
    site: Option<Arc<Site>>,
}

const READY: u8 = 1;
const SERVING: u8 = 2;
const TERMINATING: u8 = 4;

impl Packed4 {
    fn new(addr: Ipv4Addr, e: Endpoint) -> Packed4 {
        let bit = |on: bool, bit: u8| if on { bit } else { 0 };
        Packed4 {
            addr,
            conditions: bit(e.ready, READY)
                | bit(e.serving, SERVING)
                | bit(e.terminating, TERMINATING),
            site: e.site,
        }
    }

    fn unpack(&self) -> Endpoint {
        Endpoint {
            addr: IpAddr::V4(self.addr),
            ready: self.conditions & READY != 0,
            serving: self.conditions & SERVING != 0,
            terminating: self.conditions & TERMINATING != 0,
            site: self.site.clone(),
        }
    }
}

impl Endpoints {
    pub fn new() -> Endpoints {
        Endpoints::default()
    }

    /// Room for `n` endpoints of `family` (a slice's endpoints are of its address type).
    pub fn with_capacity(family: Family, n: usize) -> Endpoints {
        Endpoints(match family {
            Family::V4 => Store::V4(Vec::with_capacity(n)),
            Family::V6 => Store::Any(Vec::with_capacity(n)),
        })
    }

    pub fn len(&self) -> usize {
        match &self.0 {
            Store::V4(v) => v.len(),
            Store::Any(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, i: usize) -> Option<Endpoint> {
        match &self.0 {
            Store::V4(v) => v.get(i).map(Packed4::unpack),
            Store::Any(v) => v.get(i).cloned(),
        }
    }

    /// The endpoints in place, their sites borrowed. Handing an endpoint out by value shares
    /// its site once more (an atomic count, and another to drop it): per endpoint of a large
    /// Service, on every build of its part.
    pub fn refs(&self) -> impl Iterator<Item = EndpointRef<'_>> {
        let (v4, any) = match &self.0 {
            Store::V4(v) => (v.as_slice(), &[][..]),
            Store::Any(v) => (&[][..], v.as_slice()),
        };
        let v4 = v4.iter().map(|p| EndpointRef {
            addr: IpAddr::V4(p.addr),
            ready: p.conditions & READY != 0,
            serving: p.conditions & SERVING != 0,
            terminating: p.conditions & TERMINATING != 0,
            site: p.site.as_deref(),
        });
        v4.chain(any.iter().map(Endpoint::borrowed))
    }

    pub fn iter(&self) -> Iter<'_> {
        Iter(match &self.0 {
            Store::V4(v) => IterStore::V4(v.iter()),
            Store::Any(v) => IterStore::Any(v.iter()),
        })
    }

    pub fn push(&mut self, e: Endpoint) {
        match (&mut self.0, e.addr) {
            (Store::V4(v), IpAddr::V4(addr)) => v.push(Packed4::new(addr, e)),
            _ => self.whole().push(e),
        }
    }

    /// Changes endpoint `i` in place through `change`; does nothing when there is none.
    pub fn update(&mut self, i: usize, change: impl FnOnce(&mut Endpoint)) {
        let Some(mut e) = self.get(i) else {
            return;
        };
        change(&mut e);
        match (&mut self.0, e.addr) {
            (Store::V4(v), IpAddr::V4(addr)) => v[i] = Packed4::new(addr, e),
            _ => self.whole()[i] = e,
        }
    }

    /// The endpoints as whole ones, converting packed ones first (an IPv6 endpoint joins).
    fn whole(&mut self) -> &mut Vec<Endpoint> {
        if let Store::V4(v) = &self.0 {
            let mut all = Vec::with_capacity(v.capacity().max(v.len() + 1));
            all.extend(v.iter().map(Packed4::unpack));
            self.0 = Store::Any(all);
        }
        match &mut self.0 {
            Store::Any(v) => v,
            Store::V4(_) => unreachable!("converted above"),
        }
    }

    /// Keeps the endpoints for which `keep` returns true.
    pub fn retain(&mut self, mut keep: impl FnMut(&Endpoint) -> bool) {
        match &mut self.0 {
            Store::V4(v) => v.retain(|p| keep(&p.unpack())),
            Store::Any(v) => v.retain(keep),
        }
    }
}

/// An endpoint as a slice holds it, its site borrowed ([`Endpoints::refs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointRef<'a> {
    pub addr: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub site: Option<&'a Site>,
}

impl<'a> EndpointRef<'a> {
    /// `nodeName`.
    pub fn node_name(&self) -> Option<&'a str> {
        self.site?.node_name.as_deref()
    }
}

/// The endpoints of a slice, by value.
pub struct Iter<'a>(IterStore<'a>);

enum IterStore<'a> {
    V4(std::slice::Iter<'a, Packed4>),
    Any(std::slice::Iter<'a, Endpoint>),
}

impl Iterator for Iter<'_> {
    type Item = Endpoint;

    fn next(&mut self) -> Option<Endpoint> {
        match &mut self.0 {
            IterStore::V4(i) => i.next().map(Packed4::unpack),
            IterStore::Any(i) => i.next().cloned(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match &self.0 {
            IterStore::V4(i) => i.size_hint(),
            IterStore::Any(i) => i.size_hint(),
        }
    }
}

impl ExactSizeIterator for Iter<'_> {}

impl<'a> IntoIterator for &'a Endpoints {
    type Item = Endpoint;
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

impl FromIterator<Endpoint> for Endpoints {
    fn from_iter<I: IntoIterator<Item = Endpoint>>(iter: I) -> Endpoints {
        let iter = iter.into_iter();
        let mut out = Endpoints::with_capacity(Family::V4, iter.size_hint().0);
        for e in iter {
            out.push(e);
        }
        out
    }
}

impl From<Vec<Endpoint>> for Endpoints {
    fn from(v: Vec<Endpoint>) -> Endpoints {
        v.into_iter().collect()
    }
}

impl PartialEq for Endpoints {
    fn eq(&self, other: &Endpoints) -> bool {
        // The same endpoints may be stored either way (an IPv6 endpoint pushed and removed).
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for Endpoints {}

impl fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn ep(addr: &str, ready: bool, serving: bool, terminating: bool) -> Endpoint {
        Endpoint {
            addr: addr.parse().unwrap(),
            ready,
            serving,
            terminating,
            site: Site::new(Some("node-a"), Default::default()),
        }
    }

    #[test]
    fn an_ipv4_endpoint_takes_half_an_endpoint() {
        assert_eq!(std::mem::size_of::<Packed4>(), 16);
        assert_eq!(std::mem::size_of::<Endpoint>(), 32);
    }

    #[test]
    fn endpoints_come_back_as_they_went_in() {
        let all: Vec<Endpoint> = (0..8u8)
            .map(|bits| {
                ep(
                    &format!("10.0.0.{bits}"),
                    bits & 1 != 0,
                    bits & 2 != 0,
                    bits & 4 != 0,
                )
            })
            .collect();
        let eps = Endpoints::from(all.clone());
        assert!(matches!(eps.0, Store::V4(_)));
        assert_eq!(eps.len(), 8);
        assert_eq!(eps.iter().collect::<Vec<_>>(), all);
        assert_eq!(eps.get(5), Some(all[5].clone()));
        assert_eq!(eps.get(8), None);
    }

    #[test]
    fn an_ipv6_endpoint_keeps_whole_endpoints() {
        let mut eps = Endpoints::from(vec![ep("10.0.0.1", true, true, false)]);
        eps.push(ep("fd00::1", false, true, true));
        assert!(matches!(eps.0, Store::Any(_)));
        let addrs: Vec<String> = eps.iter().map(|e| e.addr.to_string()).collect();
        assert_eq!(addrs, ["10.0.0.1", "fd00::1"]);
        assert_eq!(eps.get(1), Some(ep("fd00::1", false, true, true)));

        // Equal whichever way they are stored.
        eps.retain(|e| e.addr.is_ipv4());
        assert_eq!(
            eps,
            Endpoints::from(vec![ep("10.0.0.1", true, true, false)])
        );
        assert_ne!(eps, Endpoints::new());
    }

    #[test]
    fn update_changes_one_endpoint() {
        let mut eps = Endpoints::from(vec![
            ep("10.0.0.1", true, true, false),
            ep("10.0.0.2", true, true, false),
        ]);
        eps.update(1, |e| e.terminating = true);
        eps.update(2, |_| unreachable!("no endpoint 2"));
        assert_eq!(eps.get(1), Some(ep("10.0.0.2", true, true, true)));
        eps.update(0, |e| e.addr = "fd00::1".parse().unwrap());
        let addrs: Vec<String> = eps.iter().map(|e| e.addr.to_string()).collect();
        assert_eq!(addrs, ["fd00::1", "10.0.0.2"]);
    }

    #[test]
    fn retain_sees_every_endpoint_in_order() {
        let mut eps: Endpoints = (1..=5)
            .map(|i| ep(&format!("10.0.0.{i}"), true, true, false))
            .collect();
        let mut seen = Vec::new();
        eps.retain(|e| {
            seen.push(e.addr.to_string());
            e.addr != "10.0.0.3".parse::<IpAddr>().unwrap()
        });
        assert_eq!(seen.len(), 5);
        let left: Vec<String> = eps.iter().map(|e| e.addr.to_string()).collect();
        assert_eq!(left, ["10.0.0.1", "10.0.0.2", "10.0.0.4", "10.0.0.5"]);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Push(Endpoint),
        Update(usize, Endpoint),
        RetainNot(IpAddr),
    }

    fn endpoint() -> impl Strategy<Value = Endpoint> {
        // Few addresses, so that retains hit; IPv6 rarely, as in a dual-stack cluster's
        // IPv4 slices (where it cannot occur) and IPv6 ones.
        let addr = prop_oneof![
            9 => (0u8..6).prop_map(|i| IpAddr::from([10, 0, 0, i])),
            1 => (0u16..3).prop_map(|i| IpAddr::from([0xfd00, 0, 0, 0, 0, 0, 0, i])),
        ];
        let site = prop_oneof![Just(None), Just(Some("node-a")), Just(Some("node-b"))];
        (addr, any::<[bool; 3]>(), site).prop_map(|(addr, [ready, serving, terminating], node)| {
            Endpoint {
                addr,
                ready,
                serving,
                terminating,
                site: Site::new(node, Default::default()),
            }
        })
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => endpoint().prop_map(Op::Push),
            2 => (0usize..12, endpoint()).prop_map(|(i, e)| Op::Update(i, e)),
            1 => endpoint().prop_map(|e| Op::RetainNot(e.addr)),
        ]
    }

    proptest! {
        /// Whatever is pushed, changed and removed, the list holds what a vector would, in
        /// the same order, whichever way it stores it.
        #[test]
        fn behaves_as_a_vector(start in prop::collection::vec(endpoint(), 0..8), ops in prop::collection::vec(op(), 0..40)) {
            let mut eps = Endpoints::from(start.clone());
            let mut want = start;
            for op in ops {
                match op {
                    Op::Push(e) => {
                        eps.push(e.clone());
                        want.push(e);
                    }
                    Op::Update(i, e) => {
                        eps.update(i, |x| *x = e.clone());
                        if let Some(x) = want.get_mut(i) {
                            *x = e;
                        }
                    }
                    Op::RetainNot(addr) => {
                        eps.retain(|e| e.addr != addr);
                        want.retain(|e| e.addr != addr);
                    }
                }
                prop_assert_eq!(eps.len(), want.len());
                prop_assert_eq!(eps.iter().collect::<Vec<_>>(), want.clone());
                // Seen in place, the same endpoints with the same sites.
                let seen: Vec<EndpointRef<'_>> = eps.refs().collect();
                let by_value: Vec<EndpointRef<'_>> = want.iter().map(Endpoint::borrowed).collect();
                prop_assert_eq!(seen, by_value);
            }
            for (i, e) in want.iter().enumerate() {
                prop_assert_eq!(eps.get(i), Some(e.clone()));
            }
            prop_assert_eq!(&eps, &Endpoints::from(want.clone()));
        }
    }
}
