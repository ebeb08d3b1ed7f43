//! The Service model nftproxy computes rules from: validated, normalised, family-aware.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::SystemTime;

use imbl::{OrdMap, OrdSet};
use ipnet::IpNet;
use k8s_openapi::jiff::Timestamp;
use smallvec::SmallVec;

use crate::net::{Family, Proto};

mod by_name;
mod endpoints;
mod services;
mod shared;

use by_name::ByName;
pub use endpoints::{EndpointRef, Endpoints};
pub use services::Services;
pub use shared::Shared;

/// The items `all` lists (a short list, listed anew on each call), each once, in order: a
/// quadratic check allocates nothing.
fn each_once<T: PartialEq, I: Iterator<Item = T>>(all: impl Fn() -> I) -> impl Iterator<Item = T> {
    all()
        .enumerate()
        .filter(move |(i, x)| !all().take(*i).any(|earlier| earlier == *x))
        .map(|(_, x)| x)
}

/// `namespace/name` of a Kubernetes object. Names are copied into many indexes and change
/// sets; shared strings make those copies free and keep them from fragmenting the heap.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectName {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl ObjectName {
    pub fn new(namespace: &str, name: &str) -> ObjectName {
        ObjectName {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for ObjectName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{}", self.name)
        } else {
            write!(f, "{}/{}", self.namespace, self.name)
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServicePort {
    /// The port's name (may be empty for a single unnamed port), shared with every port of
    /// that name (see [`Shared`]).
    pub name: Arc<str>,
    pub protocol: Proto,
    pub port: u16,
    pub node_port: Option<u16>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServiceType {
    ClusterIp,
    NodePort,
    LoadBalancer,
}

/// A Service that nftproxy proxies (headless and ExternalName Services never become one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    pub name: ObjectName,
    pub service_type: ServiceType,
    // Boxed slices, not vectors: a Service is kept as long as it exists, and 100k of them
    // are 100k times the capacity word.
    /// At most one per family.
    pub cluster_ips: Box<[IpAddr]>,
    pub external_ips: Box<[IpAddr]>,
    /// `status.loadBalancer.ingress[].ip` whose `ipMode` is `VIP` or unset.
    pub load_balancer_ips: Box<[IpAddr]>,
    pub load_balancer_source_ranges: Box<[IpNet]>,
    pub external_policy_local: bool,
    pub internal_policy_local: bool,
    pub health_check_node_port: Option<u16>,
    /// ClientIP session affinity timeout in seconds.
    pub affinity_timeout: Option<u32>,
    /// Shared with every Service that has the same ports (see [`Shared`]).
    pub ports: Arc<[ServicePort]>,
    /// `metadata.creationTimestamp`: among Services claiming one frontend the oldest wins (see
    /// [`crate::conflicts`]); a Service without one loses to every Service with one.
    pub creation_timestamp: Option<Timestamp>,
}

impl Service {
    pub fn cluster_ip(&self, family: Family) -> Option<IpAddr> {
        self.cluster_ips
            .iter()
            .copied()
            .find(|ip| Family::of(ip) == family)
    }

    /// The addresses of `family` the Service's ports are reached at: its ClusterIP, external
    /// IPs and LoadBalancer IPs. None without a ClusterIP of the family (not proxied in it).
    pub fn frontend_addrs(&self, family: Family) -> impl Iterator<Item = IpAddr> + '_ {
        self.cluster_ip(family)
            .into_iter()
            .flat_map(move |cluster_ip| {
                let others = self.external_ips.iter().chain(&self.load_balancer_ips);
                std::iter::once(cluster_ip)
                    .chain(others.copied().filter(move |ip| Family::of(ip) == family))
            })
    }

    /// Every address the Service claims a frontend on, in any family: its ClusterIPs, external
    /// IPs and LoadBalancer IPs, each once.
    pub fn claimed_addrs(&self) -> impl Iterator<Item = IpAddr> + '_ {
        each_once(|| {
            self.cluster_ips
                .iter()
                .chain(&self.external_ips)
                .chain(&self.load_balancer_ips)
                .copied()
        })
    }

    /// Every NodePort the Service claims, as protocol and port, each once. A Service proxied in
    /// no family (without a ClusterIP) claims none.
    pub fn claimed_node_ports(&self) -> impl Iterator<Item = (Proto, u16)> + '_ {
        let ports: &[ServicePort] = if self.cluster_ips.is_empty() {
            &[]
        } else {
            &self.ports
        };
        each_once(move || {
            ports
                .iter()
                .filter_map(|p| Some((p.protocol, p.node_port?)))
        })
    }

    /// NodePorts, LoadBalancer IPs or external IPs make a Service reachable from outside.
    pub fn externally_accessible(&self, port: &ServicePort) -> bool {
        port.node_port.is_some()
            || !self.load_balancer_ips.is_empty()
            || !self.external_ips.is_empty()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: IpAddr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// Its node and topology hints, one allocation shared by every endpoint with the same
    /// ones (see [`Shared`]); None when it has neither. An endpoint is most of the model's
    /// memory, and a cluster has far fewer nodes than endpoints.
    pub site: Option<Arc<Site>>,
}

impl Endpoint {
    /// `nodeName`.
    pub fn node_name(&self) -> Option<&str> {
        self.site.as_ref()?.node_name.as_deref()
    }

    /// This endpoint in place, its site borrowed.
    pub fn borrowed(&self) -> EndpointRef<'_> {
        EndpointRef {
            addr: self.addr,
            ready: self.ready,
            serving: self.serving,
            terminating: self.terminating,
            site: self.site.as_deref(),
        }
    }
}

/// Where an endpoint runs: its `nodeName` and topology hints.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Site {
    pub node_name: Option<Arc<str>>,
    pub hints: Hints,
}

impl Site {
    /// A site of its own (not shared); None when it says nothing.
    pub fn new(node_name: Option<&str>, hints: Hints) -> Option<Arc<Site>> {
        let site = Site {
            node_name: node_name.map(Into::into),
            hints,
        };
        (site != Site::default()).then(|| Arc::new(site))
    }
}

/// An endpoint's topology hints (`hints.forZones`, `hints.forNodes`); both empty when it has
/// none.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Hints {
    pub zones: Box<[String]>,
    pub nodes: Box<[String]>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EndpointPort {
    /// Shared with every port of that name (see [`Shared`]).
    pub name: Arc<str>,
    pub protocol: Proto,
    pub port: u16,
}

/// A discovery.k8s.io/v1 EndpointSlice reduced to what the proxy needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSlice {
    pub name: ObjectName,
    pub service: ObjectName,
    pub family: Family,
    /// Shared with every slice that lists the same ports (see [`Shared`]).
    pub ports: Arc<[EndpointPort]>,
    pub endpoints: Endpoints,
    /// `endpoints.kubernetes.io/last-change-trigger-time`; None without one or when it is not
    /// an RFC 3339 time (then no programming latency is reported for it, as by kube-proxy).
    pub trigger_time: Option<SystemTime>,
}

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Node {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub pod_cidrs: Vec<IpNet>,
    /// InternalIP addresses first, then ExternalIP, in the Node's order.
    pub addresses: Vec<IpAddr>,
    pub deleting: bool,
    pub taint_keys: Vec<String>,
}

/// EndpointSlices by name, plus an index from each Service to the names of its slices so that
/// [`Slices::of_service`] costs O(that Service's slices) rather than a scan of every slice.
///
/// There is deliberately no `get_mut`: changing a slice's `service` in place would leave the
/// index stale. Replace a slice with [`Slices::insert`] instead.
#[derive(Clone, Debug, Default)]
pub struct Slices {
    /// Boxed: a node of a persistent set holds its entries inline and is about half full, so
    /// inline slices would cost twice their size; and copying a node on a change (the sync
    /// loop and the desired table hold snapshots) copies pointers instead of whole slices.
    by_name: OrdSet<ByName<EndpointSlice>>,
    /// Each Service's slices, in slice name order: the `Arc`s `by_name` holds. Most
    /// Services have one slice, held in place; an `OrdSet` would allocate a whole B-tree node
    /// (about 3 KiB) for each.
    by_service: OrdMap<ObjectName, SmallVec<[Arc<EndpointSlice>; 1]>>,
}

impl Slices {
    pub fn new() -> Slices {
        Slices::default()
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    pub fn get(&self, name: &ObjectName) -> Option<&EndpointSlice> {
        self.by_name.get(name).map(|s| &*s.0)
    }

    pub fn contains_key(&self, name: &ObjectName) -> bool {
        self.by_name.contains(name)
    }

    /// Adds or replaces the slice `name`, returning the one it replaced.
    pub fn insert(
        &mut self,
        name: ObjectName,
        mut slice: EndpointSlice,
    ) -> Option<Arc<EndpointSlice>> {
        // The set finds a slice by its own name.
        if slice.name != name {
            slice.name = name.clone();
        }
        let service = slice.service.clone();
        let slice = Arc::new(slice);
        let old = self.by_name.insert(ByName(slice.clone())).map(|o| o.0);
        if let Some(o) = &old {
            self.unindex(&o.service, &name);
        }
        let slices = self.by_service.entry(service).or_default();
        let i = slices.partition_point(|s| s.name < name);
        // A vector grown by inserting would hold four.
        slices.reserve_exact(1);
        slices.insert(i, slice);
        old
    }

    pub fn remove(&mut self, name: &ObjectName) -> Option<Arc<EndpointSlice>> {
        let old = self.by_name.remove(name)?.0;
        self.unindex(&old.service, name);
        Some(old)
    }

    fn unindex(&mut self, service: &ObjectName, name: &ObjectName) {
        if let Some(slices) = self.by_service.get_mut(service) {
            if let Ok(i) = slices.binary_search_by(|s| s.name.cmp(name)) {
                slices.remove(i);
            }
            // Drop empty entries so that `services()` lists only Services with slices.
            if slices.is_empty() {
                self.by_service.remove(service);
            }
        }
    }

    /// Keeps only the slices for which `keep` returns true.
    pub fn retain(&mut self, mut keep: impl FnMut(&ObjectName, &EndpointSlice) -> bool) {
        let gone: Vec<ObjectName> = self
            .iter()
            .filter(|(name, slice)| !keep(name, slice))
            .map(|(name, _)| name.clone())
            .collect();
        for name in &gone {
            self.remove(name);
        }
    }

    pub fn clear(&mut self) {
        *self = Slices::default();
    }

    /// All slices with their names, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&ObjectName, &EndpointSlice)> {
        self.by_name.iter().map(|s| (s.name(), &*s.0))
    }

    pub fn keys(&self) -> impl Iterator<Item = &ObjectName> {
        self.by_name.iter().map(ByName::name)
    }

    /// All slices, in name order.
    pub fn values(&self) -> impl Iterator<Item = &EndpointSlice> {
        self.by_name.iter().map(|s| &*s.0)
    }

    /// The Services that have at least one slice, in name order.
    pub fn services(&self) -> impl Iterator<Item = &ObjectName> {
        self.by_service.keys()
    }

    /// The slices of `service`, in slice name order.
    pub fn of_service<'a>(
        &'a self,
        service: &ObjectName,
    ) -> impl Iterator<Item = &'a EndpointSlice> + use<'a> {
        self.by_service
            .get(service)
            .into_iter()
            .flatten()
            .map(|s| &**s)
    }
}

impl PartialEq for Slices {
    fn eq(&self, other: &Slices) -> bool {
        // The set compares names only; the index follows from the slices.
        self.len() == other.len() && self.values().eq(other.values())
    }
}

impl Eq for Slices {}

impl FromIterator<(ObjectName, EndpointSlice)> for Slices {
    fn from_iter<I: IntoIterator<Item = (ObjectName, EndpointSlice)>>(iter: I) -> Slices {
        let mut out = Slices::default();
        out.extend(iter);
        out
    }
}

impl Extend<(ObjectName, EndpointSlice)> for Slices {
    fn extend<I: IntoIterator<Item = (ObjectName, EndpointSlice)>>(&mut self, iter: I) {
        for (name, slice) in iter {
            self.insert(name, slice);
        }
    }
}

impl IntoIterator for Slices {
    type Item = (ObjectName, EndpointSlice);
    type IntoIter = Box<dyn Iterator<Item = (ObjectName, EndpointSlice)>>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.by_name.into_iter().map(|s| {
            let slice = Arc::unwrap_or_clone(s.0);
            (slice.name.clone(), slice)
        }))
    }
}

impl Node {
    /// The Node's primary IP of `family`: its first InternalIP, else its first ExternalIP.
    pub fn primary_ip(&self, family: Family) -> Option<IpAddr> {
        self.addresses
            .iter()
            .copied()
            .find(|a| Family::of(a) == family && !a.is_loopback())
    }

    pub fn zone(&self) -> Option<&str> {
        self.labels
            .get("topology.kubernetes.io/zone")
            .map(String::as_str)
    }
}

/// Everything the proxy knows about the cluster at one moment.
///
/// Services and slices live in persistent maps so that a clone (taken on every sync) is O(1)
/// and shares structure with the original. Both iterate in name order, like a `BTreeMap`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cluster {
    /// Boxed, like the slices in [`Slices`]; indexed by the addresses they claim.
    pub services: Services,
    pub slices: Slices,
    pub node: Option<Node>,
    pub service_cidrs: BTreeMap<String, Vec<IpNet>>,
}

impl Cluster {
    /// The EndpointSlices of one Service, in name order.
    pub fn slices_of<'a>(
        &'a self,
        service: &ObjectName,
    ) -> impl Iterator<Item = &'a EndpointSlice> + use<'a> {
        self.slices.of_service(service)
    }

    pub fn service_cidrs(&self, family: Family) -> Vec<IpNet> {
        let mut out: Vec<IpNet> = self
            .service_cidrs
            .values()
            .flatten()
            .copied()
            .filter(|n| Family::of_net(n) == family)
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// `ns/name:port` (`ns/name` for an unnamed port): how chain comments and traces name a
/// Service port.
pub fn port_label(svc: &Service, port: &ServicePort) -> String {
    if port.name.is_empty() {
        svc.name.to_string()
    } else {
        format!("{}:{}", svc.name, port.name)
    }
}

/// The order in which conflicting claims are decided: oldest `creationTimestamp` first, then
/// namespace/name; a Service without a timestamp after every Service with one.
pub fn precedence(svc: &Service) -> (bool, Option<Timestamp>, &ObjectName) {
    (
        svc.creation_timestamp.is_none(),
        svc.creation_timestamp,
        &svc.name,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_stay_small() {
        // Endpoints are most of the model: 1.2 M of them at 100k Services (realistic shape).
        assert!(std::mem::size_of::<Endpoint>() <= 32);
    }

    fn slice(name: &str, service: &str) -> EndpointSlice {
        EndpointSlice {
            name: ObjectName::new("ns", name),
            service: ObjectName::new("ns", service),
            family: Family::V4,
            ports: Arc::new([]),
            endpoints: Endpoints::new(),
            trigger_time: None,
        }
    }

    fn names_of(c: &Cluster, service: &str) -> Vec<String> {
        c.slices_of(&ObjectName::new("ns", service))
            .map(|s| s.name.name.to_string())
            .collect()
    }

    #[test]
    fn slice_index_follows_inserts_moves_and_removals() {
        let mut c = Cluster::default();
        for (name, service) in [("b-2", "b"), ("a-1", "a"), ("b-1", "b"), ("b-3", "b")] {
            c.slices
                .insert(ObjectName::new("ns", name), slice(name, service));
        }
        assert_eq!(names_of(&c, "b"), ["b-1", "b-2", "b-3"], "slice name order");
        assert_eq!(names_of(&c, "a"), ["a-1"]);

        // A slice that changes Service leaves the old one's index.
        c.slices
            .insert(ObjectName::new("ns", "b-2"), slice("b-2", "a"));
        assert_eq!(names_of(&c, "a"), ["a-1", "b-2"]);
        assert_eq!(names_of(&c, "b"), ["b-1", "b-3"]);

        c.slices.remove(&ObjectName::new("ns", "a-1"));
        c.slices.retain(|name, _| &*name.name != "b-2");
        assert!(names_of(&c, "a").is_empty());
        let services: Vec<&ObjectName> = c.slices.services().collect();
        assert_eq!(services, [&ObjectName::new("ns", "b")]);
        assert_eq!(c.slices.len(), 2);

        // A clone is independent of later changes to the original.
        let before = c.clone();
        c.slices.clear();
        assert!(c.slices.is_empty() && names_of(&c, "b").is_empty());
        assert_eq!(names_of(&before, "b"), ["b-1", "b-3"]);
    }
}
