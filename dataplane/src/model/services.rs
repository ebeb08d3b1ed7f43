//! The cluster's Services by name, with the indexes that find the Services claiming one
//! frontend (see [`crate::conflicts`]).

use std::net::IpAddr;
use std::sync::Arc;

use imbl::{OrdMap, OrdSet};

use super::by_name::ByName;
use super::{ObjectName, Service, precedence};
use crate::net::Proto;

/// The Services that claim one frontend (an address as ClusterIP, external IP or LoadBalancer
/// IP, or a NodePort), oldest first in the order conflicts are decided
/// ([`crate::conflicts::precedence`]). Almost every frontend has one claimant, held inline.
#[derive(Clone, Debug)]
enum Claimants {
    One(Arc<Service>),
    /// A thin pointer: the index holds one entry per address.
    Many(Arc<Vec<Arc<Service>>>),
}

impl Claimants {
    fn as_slice(&self) -> &[Arc<Service>] {
        match self {
            Claimants::One(s) => std::slice::from_ref(s),
            Claimants::Many(v) => v,
        }
    }

    fn from_vec(mut v: Vec<Arc<Service>>) -> Option<Claimants> {
        match v.len() {
            0 => None,
            1 => v.pop().map(Claimants::One),
            _ => Some(Claimants::Many(Arc::new(v))),
        }
    }
}

/// The claimants of each frontend of one kind (addresses, NodePorts), and the frontends more
/// than one Service claims (usually none).
#[derive(Clone, Debug)]
struct ClaimIndex<K: Ord + Clone> {
    by_key: OrdMap<K, Claimants>,
    shared: OrdSet<K>,
}

impl<K: Ord + Clone> Default for ClaimIndex<K> {
    fn default() -> ClaimIndex<K> {
        ClaimIndex {
            by_key: OrdMap::new(),
            shared: OrdSet::new(),
        }
    }
}

impl<K: Ord + Clone> ClaimIndex<K> {
    fn add(&mut self, key: K, svc: &Arc<Service>) {
        // Almost always the frontend's only claimant.
        let claimants = match self.by_key.entry(key.clone()) {
            imbl::ordmap::Entry::Vacant(e) => {
                e.insert(Claimants::One(svc.clone()));
                return;
            }
            imbl::ordmap::Entry::Occupied(e) => e.get().clone(),
        };
        let mut list: Vec<Arc<Service>> = claimants.as_slice().to_vec();
        let rank = precedence(svc);
        let at = list.partition_point(|s| precedence(s) < rank);
        list.insert(at, svc.clone());
        if list.len() > 1 {
            self.shared.insert(key.clone());
        }
        if let Some(c) = Claimants::from_vec(list) {
            self.by_key.insert(key, c);
        }
    }

    fn remove(&mut self, key: K, svc: &Arc<Service>) {
        let Some(claimants) = self.by_key.get(&key) else {
            return;
        };
        if let Claimants::One(only) = claimants
            && Arc::ptr_eq(only, svc)
        {
            self.by_key.remove(&key);
            return;
        }
        let list: Vec<Arc<Service>> = claimants
            .as_slice()
            .iter()
            .filter(|s| !Arc::ptr_eq(s, svc))
            .cloned()
            .collect();
        if list.len() < 2 {
            self.shared.remove(&key);
        }
        match Claimants::from_vec(list) {
            Some(c) => self.by_key.insert(key, c),
            None => self.by_key.remove(&key),
        };
    }

    fn claimants(&self, key: &K) -> &[Arc<Service>] {
        self.by_key.get(key).map_or(&[], Claimants::as_slice)
    }

    fn is_shared(&self, key: &K) -> bool {
        !self.shared.is_empty() && self.shared.contains(key)
    }
}

/// The Services of a [`Cluster`] by name, plus an index from every address a Service claims
/// a frontend on to the Services claiming it, so that conflicts between Services (see
/// [`crate::conflicts`]) are found in O(claimants) in any snapshot of the model, never by a
/// scan. Iterates in name order, like a `BTreeMap`.
///
/// There is deliberately no `get_mut`: changing a Service in place would leave the index
/// stale. Replace a Service with [`Services::insert`] instead.
#[derive(Clone, Debug, Default)]
pub struct Services {
    by_name: OrdSet<ByName<Service>>,
    addrs: ClaimIndex<IpAddr>,
    node_ports: ClaimIndex<(Proto, u16)>,
}

impl PartialEq for Services {
    fn eq(&self, other: &Services) -> bool {
        // The set compares names only; the index follows from the Services.
        self.len() == other.len() && self.values().eq(other.values())
    }
}

impl Eq for Services {}

impl Services {
    pub fn new() -> Services {
        Services::default()
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    pub fn get(&self, name: &ObjectName) -> Option<&Arc<Service>> {
        self.by_name.get(name).map(|s| &s.0)
    }

    /// The name as this map holds it, whose strings others can share.
    pub fn shared_name(&self, name: &ObjectName) -> Option<ObjectName> {
        self.by_name.get(name).map(|s| s.name().clone())
    }

    pub fn contains_key(&self, name: &ObjectName) -> bool {
        self.by_name.contains(name)
    }

    /// Adds or replaces the Service `name` (which should be `svc.name`), returning the one it
    /// replaced.
    pub fn insert(
        &mut self,
        name: ObjectName,
        svc: impl Into<Arc<Service>>,
    ) -> Option<Arc<Service>> {
        let mut svc: Arc<Service> = svc.into();
        // The set finds a Service by its own name.
        if svc.name != name {
            Arc::make_mut(&mut svc).name = name;
        }
        let old = self.by_name.insert(ByName(svc.clone())).map(|o| o.0);
        if let Some(o) = &old {
            self.unindex(o);
        }
        self.index(&svc);
        old
    }

    pub fn remove(&mut self, name: &ObjectName) -> Option<Arc<Service>> {
        let old = self.by_name.remove(name)?.0;
        self.unindex(&old);
        Some(old)
    }

    fn index(&mut self, svc: &Arc<Service>) {
        for addr in svc.claimed_addrs() {
            self.addrs.add(addr, svc);
        }
        for np in svc.claimed_node_ports() {
            self.node_ports.add(np, svc);
        }
    }

    fn unindex(&mut self, svc: &Arc<Service>) {
        for addr in svc.claimed_addrs() {
            self.addrs.remove(addr, svc);
        }
        for np in svc.claimed_node_ports() {
            self.node_ports.remove(np, svc);
        }
    }

    /// The Services claiming `addr` as ClusterIP, external IP or LoadBalancer IP, in any
    /// family, oldest first ([`crate::conflicts::precedence`]).
    pub fn claimants(&self, addr: &IpAddr) -> &[Arc<Service>] {
        self.addrs.claimants(addr)
    }

    /// Whether more than one Service claims `addr`.
    pub fn is_shared(&self, addr: &IpAddr) -> bool {
        self.addrs.is_shared(addr)
    }

    /// The addresses more than one Service claims, in order.
    pub fn shared_addrs(&self) -> impl Iterator<Item = &IpAddr> {
        self.addrs.shared.iter()
    }

    /// The Services claiming NodePort `port` on `proto`, oldest first.
    pub fn node_port_claimants(&self, proto: Proto, port: u16) -> &[Arc<Service>] {
        self.node_ports.claimants(&(proto, port))
    }

    /// Whether more than one Service claims NodePort `port` on `proto`.
    pub fn is_node_port_shared(&self, proto: Proto, port: u16) -> bool {
        self.node_ports.is_shared(&(proto, port))
    }

    /// The NodePorts (protocol and port) more than one Service claims, in order.
    pub fn shared_node_ports(&self) -> impl Iterator<Item = &(Proto, u16)> {
        self.node_ports.shared.iter()
    }

    /// All Services with their names, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&ObjectName, &Arc<Service>)> {
        self.by_name.iter().map(|s| (s.name(), &s.0))
    }

    pub fn keys(&self) -> impl Iterator<Item = &ObjectName> {
        self.by_name.iter().map(ByName::name)
    }

    /// All Services, in name order.
    pub fn values(&self) -> impl Iterator<Item = &Arc<Service>> {
        self.by_name.iter().map(|s| &s.0)
    }
}

impl std::ops::Index<&ObjectName> for Services {
    type Output = Arc<Service>;

    fn index(&self, name: &ObjectName) -> &Arc<Service> {
        match self.get(name) {
            Some(svc) => svc,
            None => panic!("no Service {name}"),
        }
    }
}

impl<V: Into<Arc<Service>>> FromIterator<(ObjectName, V)> for Services {
    fn from_iter<I: IntoIterator<Item = (ObjectName, V)>>(iter: I) -> Services {
        let mut out = Services::default();
        out.extend(iter);
        out
    }
}

impl<V: Into<Arc<Service>>> Extend<(ObjectName, V)> for Services {
    fn extend<I: IntoIterator<Item = (ObjectName, V)>>(&mut self, iter: I) {
        for (name, svc) in iter {
            self.insert(name, svc);
        }
    }
}

impl IntoIterator for Services {
    type Item = (ObjectName, Arc<Service>);
    type IntoIter = Box<dyn Iterator<Item = (ObjectName, Arc<Service>)>>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.by_name.into_iter().map(|s| (s.name().clone(), s.0)))
    }
}

impl<'a> IntoIterator for &'a Services {
    type Item = (&'a ObjectName, &'a Arc<Service>);
    type IntoIter = Box<dyn Iterator<Item = (&'a ObjectName, &'a Arc<Service>)> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}
