//! UDP conntrack cleanup, the pure part: which conntrack entries outlived the endpoint they were
//! load-balanced to (kube-proxy's `pkg/proxy/conntrack/cleanup.go`).
//!
//! UDP has no connection end, so a conntrack entry created while a client talked to an endpoint
//! keeps the client's flow DNATed to that endpoint for as long as the client keeps sending, even
//! after the endpoint is gone. After a sync that changed a UDP Service's frontends or serving
//! endpoints (other than by only adding endpoints to frontends that had some, see
//! [`cleanup_needed`]), the agent lists the UDP entries of the family and deletes those
//! [`is_stale`] picks, so that the next packet is load-balanced afresh (or rejected, when no
//! endpoint is left).
//!
//! The decision works on [`Frontends`]: for every UDP Service port, each address it is reached on
//! (ClusterIP, external IPs, LoadBalancer IPs of the family) with its port, and its NodePort, map
//! to the IPs of the port's *serving* endpoints (regardless of traffic policy, topology or
//! terminating, as kube-proxy: UDP behaves like TCP, whose established connections survive until
//! the endpoint stops serving). Differences from kube-proxy:
//! * frontends are keyed by address **and port** (kube-proxy keys by address only, so one UDP
//!   port's endpoints decided for all UDP ports of the same address);
//! * Services scaled to zero count as frontends with no endpoint (kube-proxy fixed that late);
//! * frontends of the previous sync that no longer exist (deleted Services, removed ports,
//!   external IPs) are cleaned too, but only entries that were DNATed (reply source other than
//!   the original destination): after the Service is gone, an untranslated flow to the same
//!   address is somebody else's;
//! * an address frontend decides alone: a NodePort number that happens to equal a Service port
//!   does not make that Service's own entries stale.
//!
//! TCP (and SCTP) entries are never stale: graceful termination relies on existing connections.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use crate::conflicts::suppressed;
use crate::decision::{self, Frontend, port_endpoints};
use crate::model::{Cluster, EndpointSlice, ObjectName, Service, ServicePort};
use crate::nft::ruleset::{Family, Key, Proto};
use crate::nft::state::TableState;

/// One direction of a conntrack entry, as the kernel reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tuple {
    /// IP protocol number (17 for UDP).
    pub proto: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// 0 for protocols without ports.
    pub src_port: u16,
    pub dst_port: u16,
}

/// The IPs of the serving endpoints behind a frontend. Shared: the frontends of one Service
/// port (its ClusterIP, external and load-balancer IPs, NodePort) have the same ones, and the
/// index, its union and the cleanup's record of the last sync all hold them.
pub type Serving = Arc<BTreeSet<IpAddr>>;

/// The UDP frontends of one family and, for each, the IPs of the serving endpoints behind it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frontends {
    /// `(Service address, Service port)` → serving endpoint IPs.
    pub addrs: BTreeMap<(IpAddr, u16), Serving>,
    /// NodePort (on any address) → serving endpoint IPs.
    pub node_ports: BTreeMap<u16, Serving>,
}

impl Frontends {
    /// The UDP frontends `cluster` gives `family`. Services without a ClusterIP of the family
    /// are not proxied in it and have none. A frontend several Services claim (an address or a
    /// NodePort) is the one Service's that [`crate::conflicts`] gives it to (the others'
    /// entries to it are stale).
    pub fn of(cluster: &Cluster, family: Family) -> Frontends {
        FrontendIndex::build(cluster, family).current
    }

    /// The UDP frontends of one Service of `cluster`, without those other Services keep. Its
    /// endpoints and conflicts are looked at only if it has UDP ports (a large TCP Service has
    /// thousands of endpoints).
    fn of_service(cluster: &Cluster, svc: &Service, family: Family) -> Frontends {
        let mut out = Frontends::default();
        let udp = |p: &&ServicePort| p.protocol == Proto::Udp;
        if svc.cluster_ip(family).is_none() || !svc.ports.iter().any(|p| udp(&p)) {
            return out;
        }
        let slices: Vec<&EndpointSlice> = cluster.slices_of(&svc.name).collect();
        let suppressed = suppressed(&cluster.services, svc);
        for port in svc.ports.iter().filter(udp) {
            let frontends = decision::frontends(svc, port, family, &suppressed);
            let kept = frontends.iter().filter(|f| f.kept);
            // The node name only decides `local`, which does not matter here.
            let serving: Serving = Arc::new(
                port_endpoints(&slices, port, family, "")
                    .into_iter()
                    .filter(|e| e.serving)
                    .map(|e| e.addr)
                    .collect(),
            );
            for frontend in kept {
                match frontend.frontend {
                    Frontend::Addr(addr, port) => share(out.addrs.entry((addr, port)), &serving),
                    Frontend::NodePort(np) => share(out.node_ports.entry(np), &serving),
                }
            }
        }
        out
    }

    /// The frontends among `keys`, with their endpoints.
    pub fn restricted(&self, keys: &FrontendKeys) -> Frontends {
        Frontends {
            addrs: keys
                .addrs
                .iter()
                .filter_map(|k| self.addrs.get(k).map(|v| (*k, v.clone())))
                .collect(),
            node_ports: keys
                .node_ports
                .iter()
                .filter_map(|k| self.node_ports.get(k).map(|v| (*k, v.clone())))
                .collect(),
        }
    }

    /// Makes the frontends among `keys` those of `from` (dropping those `from` lacks).
    pub fn replace(&mut self, keys: &FrontendKeys, from: &Frontends) {
        for k in &keys.addrs {
            match from.addrs.get(k) {
                Some(v) => self.addrs.insert(*k, v.clone()),
                None => self.addrs.remove(k),
            };
        }
        for k in &keys.node_ports {
            match from.node_ports.get(k) {
                Some(v) => self.node_ports.insert(*k, v.clone()),
                None => self.node_ports.remove(k),
            };
        }
    }

    /// Adds the frontends of `from` this lacks, with their endpoints: after a failed cleanup,
    /// so that a frontend that appeared in that sync is still known as one should it go away
    /// before a cleanup succeeds (its translated entries are stale then).
    pub fn add_missing(&mut self, from: &Frontends) {
        for (k, v) in &from.addrs {
            self.addrs.entry(*k).or_insert_with(|| v.clone());
        }
        for (k, v) in &from.node_ports {
            self.node_ports.entry(*k).or_insert_with(|| v.clone());
        }
    }

    fn keys(&self) -> impl Iterator<Item = FrontendKey> + '_ {
        self.addrs
            .keys()
            .map(|k| FrontendKey::Addr(*k))
            .chain(self.node_ports.keys().map(|k| FrontendKey::NodePort(*k)))
    }

    /// The UDP frontends programmed in a table read back from the kernel (the map keys of
    /// `service-ips`, `service-nodeports`, `no-endpoint-services`, the endpoint lists ...), with their endpoints
    /// unknown (empty). After a restart this is what the previous run served, so that entries
    /// to Services deleted while the agent was down are still recognised.
    pub fn from_table_state(state: Option<&TableState>) -> Frontends {
        let mut out = Frontends::default();
        let keys = state
            .into_iter()
            .flat_map(|s| s.sets.values())
            .filter_map(|s| s.elements.read())
            .flat_map(|elements| elements.keys());
        for key in keys {
            match key {
                Key::AddrProtoPort(addr, Proto::Udp, port)
                | Key::AddrProtoPortIndex(addr, Proto::Udp, port, _) => {
                    out.addrs.entry((addr, port)).or_default();
                }
                Key::ProtoPort(Proto::Udp, port) | Key::ProtoPortIndex(Proto::Udp, port, _) => {
                    out.node_ports.entry(port).or_default();
                }
                _ => {}
            }
        }
        out
    }

    pub fn is_empty(&self) -> bool {
        self.addrs.is_empty() && self.node_ports.is_empty()
    }
}

/// One frontend: an address and port, or a NodePort.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum FrontendKey {
    Addr((IpAddr, u16)),
    NodePort(u16),
}

/// A set of frontends (without their endpoints).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FrontendKeys {
    pub addrs: BTreeSet<(IpAddr, u16)>,
    pub node_ports: BTreeSet<u16>,
}

impl FrontendKeys {
    pub fn is_empty(&self) -> bool {
        self.addrs.is_empty() && self.node_ports.is_empty()
    }

    pub fn extend(&mut self, other: &FrontendKeys) {
        self.addrs.extend(other.addrs.iter().copied());
        self.node_ports.extend(other.node_ports.iter().copied());
    }

    fn insert(&mut self, key: FrontendKey) {
        match key {
            FrontendKey::Addr(k) => {
                self.addrs.insert(k);
            }
            FrontendKey::NodePort(k) => {
                self.node_ports.insert(k);
            }
        }
    }
}

/// One family's UDP frontends, kept per Service so that a sync that changed a few Services
/// updates them in O(change) rather than recomputing them from the whole cluster.
#[derive(Clone, Debug, Default)]
pub struct FrontendIndex {
    family: Option<Family>,
    services: HashMap<ObjectName, Frontends>,
    owners: HashMap<FrontendKey, BTreeSet<ObjectName>>,
    current: Frontends,
}

impl FrontendIndex {
    pub fn build(cluster: &Cluster, family: Family) -> FrontendIndex {
        let mut index = FrontendIndex {
            family: Some(family),
            ..FrontendIndex::default()
        };
        let names: Vec<&ObjectName> = cluster.services.keys().collect();
        index.update(cluster, names);
        index
    }

    /// All frontends, as of the last update.
    pub fn current(&self) -> &Frontends {
        &self.current
    }

    /// Re-reads the Services in `changed` from `cluster`; returns the frontends that may have
    /// changed (before or after). `changed` must include the Services whose conflicts a
    /// change decides differently (the change tracker reports them, see
    /// [`crate::conflicts::neighbours`]).
    pub fn update<'a>(
        &mut self,
        cluster: &Cluster,
        changed: impl IntoIterator<Item = &'a ObjectName>,
    ) -> FrontendKeys {
        let Some(family) = self.family else {
            return FrontendKeys::default();
        };
        let mut touched = FrontendKeys::default();
        for name in changed {
            let new = cluster
                .services
                .get(name)
                .map(|svc| Frontends::of_service(cluster, svc, family));
            let old = match new {
                Some(f) if !f.is_empty() => self.services.insert(name.clone(), f),
                _ => self.services.remove(name),
            };
            for key in old.iter().flat_map(Frontends::keys) {
                if let Some(owners) = self.owners.get_mut(&key) {
                    owners.remove(name);
                    if owners.is_empty() {
                        self.owners.remove(&key);
                    }
                }
                touched.insert(key);
            }
            if let Some(f) = self.services.get(name) {
                for key in f.keys() {
                    self.owners.entry(key).or_default().insert(name.clone());
                    touched.insert(key);
                }
            }
        }
        for k in &touched.addrs {
            let union = self.union(FrontendKey::Addr(*k), |f| f.addrs.get(k));
            match union {
                Some(v) => self.current.addrs.insert(*k, v),
                None => self.current.addrs.remove(k),
            };
        }
        for k in &touched.node_ports {
            let union = self.union(FrontendKey::NodePort(*k), |f| f.node_ports.get(k));
            match union {
                Some(v) => self.current.node_ports.insert(*k, v),
                None => self.current.node_ports.remove(k),
            };
        }
        touched
    }

    /// The endpoints of frontend `key` over all the Services claiming it.
    fn union(
        &self,
        key: FrontendKey,
        get: impl Fn(&Frontends) -> Option<&Serving>,
    ) -> Option<Serving> {
        let owners = self.owners.get(&key)?;
        let mut sets = owners
            .iter()
            .filter_map(|name| self.services.get(name).and_then(&get));
        // Almost always one owner: its set is shared, not copied.
        let mut out = sets.next().cloned().unwrap_or_default();
        for eps in sets {
            Arc::make_mut(&mut out).extend(eps.iter().copied());
        }
        Some(out)
    }
}

/// Whether the conntrack entry `orig`/`reply` must be deleted now that `current` holds the
/// frontends, `previous` those of the sync before (see the module documentation).
pub fn is_stale(orig: &Tuple, reply: &Tuple, current: &Frontends, previous: &Frontends) -> bool {
    if orig.proto != Proto::Udp.number() {
        return false;
    }
    // The endpoint the entry translates to (the address replies come from).
    let endpoint = reply.src;
    if let Some(serving) = current.addrs.get(&(orig.dst, orig.dst_port)) {
        return !serving.contains(&endpoint);
    }
    if let Some(serving) = current.node_ports.get(&orig.dst_port) {
        return !serving.contains(&endpoint);
    }
    let was_frontend = previous.addrs.contains_key(&(orig.dst, orig.dst_port))
        || previous.node_ports.contains_key(&orig.dst_port);
    was_frontend && endpoint != orig.dst
}

/// Whether a sync that moved from `previous` to `current` calls for a cleanup.
///
/// When `previous_exact` (`previous` holds the frontends as of the last cleanup, or of the last
/// sync that needed none, and no flow can have been DNATed to an endpoint it lacks since): when
/// a frontend appeared or disappeared, lost a serving endpoint or got its first one.
/// A sync that only added serving endpoints to frontends that had some needs none: since then,
/// every UDP entry of such a frontend leads to one of its previous serving endpoints (the rules
/// DNAT to serving endpoints only, and the last cleanup deleted the rest), which all still
/// serve, and [`is_stale`] judges an entry by its frontend's current endpoints alone. A
/// frontend without endpoints may have entries that were never translated, so its first
/// endpoint calls for a cleanup.
///
/// When the previous endpoints are unknown or not a bound (`previous_exact` false: the first
/// sync of the process, `previous` read back from the kernel; a sync or a cleanup failed since
/// `previous` was recorded), whenever there is a UDP frontend, before or now.
pub fn cleanup_needed(previous: &Frontends, previous_exact: bool, current: &Frontends) -> bool {
    if previous_exact {
        !only_added(&previous.addrs, &current.addrs)
            || !only_added(&previous.node_ports, &current.node_ports)
    } else {
        !previous.is_empty() || !current.is_empty()
    }
}

/// Gives a frontend `serving`'s endpoints too (usually its only ones: then shared).
fn share<K: Ord>(entry: Entry<'_, K, Serving>, serving: &Serving) {
    match entry {
        Entry::Vacant(e) => {
            e.insert(serving.clone());
        }
        Entry::Occupied(mut e) => Arc::make_mut(e.get_mut()).extend(serving.iter()),
    }
}

/// Whether `previous` and `current` hold the same frontends, each with the same serving
/// endpoints or with more than the ones it had (at least one).
fn only_added<K: Ord>(previous: &BTreeMap<K, Serving>, current: &BTreeMap<K, Serving>) -> bool {
    previous.len() == current.len()
        && previous.iter().zip(current).all(|((k, was), (l, now))| {
            k == l && (was == now || (!was.is_empty() && was.is_subset(now)))
        })
}

#[cfg(test)]
mod tests;
