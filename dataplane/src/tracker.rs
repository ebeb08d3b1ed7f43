//! The change tracker: keeps the cluster model up to date from watch events and tells the sync
//! which Services changed since the last sync. Updates that change nothing the proxy uses are
//! dropped here, so they never cause a sync.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::SystemTime;

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::api::networking::v1 as networking;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::conflicts::{claims_differ, neighbours};
use crate::convert::{self, Skip, Skipped, object_name};
use crate::model::{Cluster, ObjectName, Service, Shared};
use crate::net::Family;

/// The kinds of object the proxy watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
    ServiceCidr,
}

impl Kind {
    pub const ALL: [Kind; 4] = [
        Kind::Service,
        Kind::EndpointSlice,
        Kind::Node,
        Kind::ServiceCidr,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::ServiceCidr => "ServiceCIDR",
        }
    }
}

/// What changed since the last [`Tracker::take_changes`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Services whose rules may differ: their object or one of their slices changed, or they
    /// share a frontend address with a Service whose addresses, ports or age changed (so a
    /// conflict between them may be decided differently, see [`crate::conflicts`]).
    pub services: BTreeSet<ObjectName>,
    /// Something every Service depends on changed (the Node, ServiceCIDRs): sync everything.
    pub all: bool,
    /// `endpoints.kubernetes.io/last-change-trigger-time` values of the slice changes.
    pub trigger_times: Vec<(Family, SystemTime)>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.services.is_empty() && !self.all
    }
}

/// Event and pending-change counts, for kube-proxy's `sync_proxy_rules_{service,endpoint}_changes_*`
/// metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChangeCounts {
    /// Service events seen (every update or deletion, also those that changed nothing).
    pub service_events: u64,
    /// EndpointSlice events seen.
    pub slice_events: u64,
    /// Services whose Service object changed since the last [`Tracker::take_changes`].
    pub services_pending: usize,
    /// Services whose EndpointSlices changed since the last [`Tracker::take_changes`].
    pub endpoints_pending: usize,
}

#[derive(Clone, Debug, Default)]
struct EventStats {
    service_events: u64,
    slice_events: u64,
    pending_services: HashSet<ObjectName>,
    pending_endpoints: HashSet<ObjectName>,
}

/// Holds the current cluster model and the changes not yet synced. Cloning is cheap (the model
/// is persistent), so a whole input can be staged on a copy.
#[derive(Clone, Debug)]
pub struct Tracker {
    node_name: String,
    proxy_name: String,
    cluster: Cluster,
    /// Whether this node's Node object exists now. `cluster.node` keeps the last one seen
    /// after it is deleted (kube-proxy resolves the node's IPs once and keeps them): only the
    /// node's eligibility for load-balancer traffic follows the deletion.
    node_present: bool,
    /// Names, and endpoints' sites, shared by the objects of the model.
    shared: Shared,
    /// The changed Services (`Changes::services` once taken). A hash set, one table: a B-tree
    /// set filled while a whole cluster is listed and freed at the first sync left its nodes as
    /// holes among the model's allocations; so for the pending counts in `events`.
    changed: HashSet<ObjectName>,
    /// `Changes::all` and `Changes::trigger_times` to come.
    all_changed: bool,
    trigger_times: Vec<(Family, SystemTime)>,
    /// Kinds whose initial list is complete.
    listed: BTreeSet<Kind>,
    /// Objects seen during a re-list in progress, per kind, in the order seen. A vector, not
    /// a set: at 100k Services a set's nodes, all freed at the list's end, left 8 MiB of holes
    /// among the model's allocations; a large vector has pages of its own.
    relisting: BTreeMap<Kind, Vec<ObjectName>>,
    /// Objects skipped as invalid, by kind and name, with the reason (for metrics and logs).
    invalid: BTreeMap<(Kind, ObjectName), Skip>,
    events: EventStats,
}

impl Tracker {
    pub fn new(node_name: &str, proxy_name: &str) -> Tracker {
        Tracker {
            node_name: node_name.to_string(),
            proxy_name: proxy_name.to_string(),
            cluster: Cluster::default(),
            node_present: false,
            shared: Shared::default(),
            changed: HashSet::new(),
            all_changed: false,
            trigger_times: Vec::new(),
            listed: BTreeSet::new(),
            relisting: BTreeMap::new(),
            invalid: BTreeMap::new(),
            events: EventStats::default(),
        }
    }

    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Services and EndpointSlices have both been listed completely once: syncing may start.
    pub fn ready(&self) -> bool {
        self.listed.contains(&Kind::Service) && self.listed.contains(&Kind::EndpointSlice)
    }

    /// This node's Node object has been seen (it may have been deleted since: the model keeps
    /// its addresses and labels).
    pub fn node_known(&self) -> bool {
        self.cluster.node.is_some()
    }

    /// This node's Node object as it exists now: `None` before it is seen and after it is
    /// deleted.
    pub fn node(&self) -> Option<&crate::model::Node> {
        self.cluster.node.as_ref().filter(|_| self.node_present)
    }

    pub fn has_changes(&self) -> bool {
        !self.changed.is_empty() || self.all_changed
    }

    /// Hands the accumulated changes to the sync and starts a new batch.
    pub fn take_changes(&mut self) -> Changes {
        // Taken, not cleared: a table sized for a whole cluster would stay.
        self.events.pending_services = HashSet::new();
        self.events.pending_endpoints = HashSet::new();
        Changes {
            services: std::mem::take(&mut self.changed).into_iter().collect(),
            all: std::mem::take(&mut self.all_changed),
            trigger_times: std::mem::take(&mut self.trigger_times),
        }
    }

    /// Events seen so far and changes pending (for metrics).
    pub fn change_counts(&self) -> ChangeCounts {
        ChangeCounts {
            service_events: self.events.service_events,
            slice_events: self.events.slice_events,
            services_pending: self.events.pending_services.len(),
            endpoints_pending: self.events.pending_endpoints.len(),
        }
    }

    /// Invalid objects currently skipped, with the reason.
    pub fn invalid_objects(&self) -> impl Iterator<Item = (Kind, &ObjectName, &Skip)> {
        self.invalid
            .iter()
            .map(|((kind, name), skip)| (*kind, name, skip))
    }

    /// Invalid objects currently skipped, per kind.
    pub fn invalid_counts(&self) -> BTreeMap<Kind, usize> {
        let mut out = BTreeMap::new();
        for (kind, _) in self.invalid.keys() {
            *out.entry(*kind).or_default() += 1;
        }
        out
    }

    fn note_invalid(
        &mut self,
        kind: Kind,
        name: &ObjectName,
        skip: Option<Skip>,
    ) -> Option<Skipped> {
        let key = (kind, name.clone());
        match skip {
            Some(skip @ Skip::Invalid(..)) => {
                let fresh = self.invalid.get(&key) != Some(&skip);
                self.invalid.insert(key, skip.clone());
                fresh.then(|| Skipped {
                    kind: kind.name().to_string(),
                    name: name.to_string(),
                    skip,
                })
            }
            _ => {
                self.invalid.remove(&key);
                None
            }
        }
    }

    /// Notes an object of a re-list in progress.
    fn seen(&mut self, kind: Kind, name: &ObjectName) {
        if let Some(seen) = self.relisting.get_mut(&kind) {
            seen.push(name.clone());
        }
    }

    /// A (re-)list of `kind` begins: objects it does not mention are deleted at its end.
    pub fn begin_list(&mut self, kind: Kind) {
        self.relisting.insert(kind, Vec::new());
    }

    /// A (re-)list of `kind` is complete. Warns about objects it named twice (a file may: the
    /// last copy won).
    pub fn end_list(&mut self, kind: Kind) {
        if let Some(mut seen) = self.relisting.remove(&kind) {
            seen.sort_unstable();
            for twice in seen.chunk_by(|a, b| a == b).filter(|c| c.len() > 1) {
                tracing::warn!(
                    kind = kind.name(),
                    name = %twice[0],
                    "object listed more than once; the last copy wins"
                );
            }
            seen.dedup();
            let seen = |name: &ObjectName| seen.binary_search(name).is_ok();
            let stale: Vec<ObjectName> = match kind {
                Kind::Service => self.cluster.services.keys().cloned().collect(),
                Kind::EndpointSlice => self.cluster.slices.keys().cloned().collect(),
                Kind::Node => self
                    .cluster
                    .node
                    .iter()
                    .map(|n| ObjectName::new("", &n.name))
                    .collect(),
                Kind::ServiceCidr => self
                    .cluster
                    .service_cidrs
                    .keys()
                    .map(|n| ObjectName::new("", n))
                    .collect(),
            };
            for name in stale.into_iter().filter(|n| !seen(n)) {
                self.delete(kind, &name);
            }
            self.invalid.retain(|(k, name), _| *k != kind || seen(name));
        }
        self.listed.insert(kind);
    }

    /// After Service `name` changed from `old` to what the model holds now: if its claims on
    /// addresses changed, the Services sharing one of its addresses (before or now) are
    /// reported as changed too, as a conflict with them may be decided differently. The
    /// model's address index makes this O(claimants).
    fn note_neighbours(&mut self, old: Option<&Service>, name: &ObjectName) {
        let services = &self.cluster.services;
        let new = services.get(name).map(|s| &**s);
        if !claims_differ(old, new) {
            return;
        }
        let around = old
            .into_iter()
            .chain(new)
            .flat_map(|svc| neighbours(services, svc));
        for svc in around {
            if !self.changed.contains(&svc.name) {
                self.changed.insert(svc.name.clone());
            }
        }
    }

    /// An object's name, its namespace shared with every other object of the namespace (the
    /// model keeps each name in several places: the maps' keys, the objects, the change sets).
    fn name_of(&mut self, meta: &ObjectMeta) -> ObjectName {
        ObjectName {
            namespace: self.shared.name(meta.namespace.as_deref().unwrap_or("")),
            name: meta.name.as_deref().unwrap_or("").into(),
        }
    }

    /// Records a created or updated Service. Returns the reason if it is invalid (it is then
    /// removed, as it no longer describes anything the proxy can program).
    pub fn apply_service(&mut self, svc: &core::Service) -> Option<Skipped> {
        let name = self.name_of(&svc.metadata);
        self.seen(Kind::Service, &name);
        self.events.service_events += 1;
        let (new, skip) =
            match convert::service(svc, name.clone(), &mut self.shared, &self.proxy_name) {
                Ok(s) => (Some(s), None),
                Err(e) => (None, Some(e)),
            };
        let old = self.cluster.services.get(&name).cloned();
        if old.as_deref() != new.as_ref() {
            match new {
                Some(s) => self.cluster.services.insert(name.clone(), Arc::new(s)),
                None => self.cluster.services.remove(&name),
            };
            self.changed.insert(name.clone());
            self.events.pending_services.insert(name.clone());
            self.note_neighbours(old.as_deref(), &name);
        }
        self.note_invalid(Kind::Service, &name, skip)
    }

    pub fn apply_slice(&mut self, slice: &discovery::EndpointSlice) -> Option<Skipped> {
        let name = self.name_of(&slice.metadata);
        self.seen(Kind::EndpointSlice, &name);
        self.events.slice_events += 1;
        let converted =
            convert::endpoint_slice(slice, name.clone(), &mut self.shared, &self.proxy_name);
        let (new, skip) = match converted {
            Ok(mut s) => {
                if let Some(shared) = self.cluster.services.shared_name(&s.service) {
                    s.service = shared;
                }
                (Some(s), None)
            }
            Err(e) => (None, Some(e)),
        };
        let old = self.cluster.slices.get(&name);
        let same = match (old, &new) {
            (Some(o), Some(n)) => {
                // The trigger time alone changes nothing in the rules.
                o.service == n.service
                    && o.family == n.family
                    && o.ports == n.ports
                    && o.endpoints == n.endpoints
            }
            (None, None) => true,
            _ => false,
        };
        if !same {
            if let Some(o) = old {
                self.changed.insert(o.service.clone());
                self.events.pending_endpoints.insert(o.service.clone());
            }
            match new {
                Some(s) => {
                    self.changed.insert(s.service.clone());
                    self.events.pending_endpoints.insert(s.service.clone());
                    if let Some(t) = &s.trigger_time {
                        self.trigger_times.push((s.family, *t));
                    }
                    self.cluster.slices.insert(name.clone(), s);
                }
                None => {
                    self.cluster.slices.remove(&name);
                }
            }
        } else if let Some(n) = new {
            // Only the trigger time differs: keep the latest without reporting a change.
            self.cluster.slices.insert(name.clone(), n);
        }
        self.note_invalid(Kind::EndpointSlice, &name, skip)
    }

    pub fn apply_node(&mut self, node: &core::Node) -> Option<Skipped> {
        let name = object_name(&node.metadata);
        if *name.name != *self.node_name {
            return None;
        }
        self.seen(Kind::Node, &name);
        self.node_present = true;
        // An invalid update keeps the last valid addresses and labels.
        let (new, skip) = match convert::node(node) {
            Ok(n) => (Some(n), None),
            Err(e) => (None, Some(e)),
        };
        if new.is_some() && self.cluster.node != new {
            self.cluster.node = new;
            self.all_changed = true;
        }
        self.note_invalid(Kind::Node, &name, skip)
    }

    pub fn apply_service_cidr(&mut self, cidr: &networking::ServiceCIDR) -> Option<Skipped> {
        let name = object_name(&cidr.metadata);
        self.seen(Kind::ServiceCidr, &name);
        let (new, skip) = match convert::service_cidr(cidr) {
            Ok((_, nets)) => (Some(nets), None),
            Err(e) => (None, Some(e)),
        };
        if self.cluster.service_cidrs.get(&*name.name) != new.as_ref() {
            match new {
                Some(nets) => self
                    .cluster
                    .service_cidrs
                    .insert(name.name.to_string(), nets),
                None => self.cluster.service_cidrs.remove(&*name.name),
            };
            self.all_changed = true;
        }
        self.note_invalid(Kind::ServiceCidr, &name, skip)
    }

    /// Records a deletion.
    pub fn delete(&mut self, kind: Kind, name: &ObjectName) {
        self.invalid.remove(&(kind, name.clone()));
        match kind {
            Kind::Service => {
                self.events.service_events += 1;
                if let Some(old) = self.cluster.services.remove(name) {
                    self.changed.insert(name.clone());
                    self.events.pending_services.insert(name.clone());
                    self.note_neighbours(Some(&old), name);
                }
            }
            Kind::EndpointSlice => {
                self.events.slice_events += 1;
                if let Some(s) = self.cluster.slices.remove(name) {
                    self.events.pending_endpoints.insert(s.service.clone());
                    self.changed.insert(s.service.clone());
                }
            }
            // The rules keep the last known addresses and labels: a deleted or re-registered
            // Node must not empty the NodePort addresses.
            Kind::Node => {
                if *name.name == *self.node_name {
                    self.node_present = false;
                }
            }
            Kind::ServiceCidr => {
                if self.cluster.service_cidrs.remove(&*name.name).is_some() {
                    self.all_changed = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(name: &str, ip: &str, port: i32) -> core::Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns", "resourceVersion": "1"},
            "spec": {"clusterIP": ip, "ports": [{"name": "p", "port": port}]}
        }))
        .unwrap()
    }

    fn slice(name: &str, svc: &str, ips: &[&str], trigger: &str) -> discovery::EndpointSlice {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns",
                "labels": {"kubernetes.io/service-name": svc},
                "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": trigger}},
            "addressType": "IPv4",
            "ports": [{"name": "p", "port": 8080}],
            "endpoints": ips.iter().map(|ip| serde_json::json!({"addresses": [ip]})).collect::<Vec<_>>()
        }))
        .unwrap()
    }

    #[test]
    fn names_share_their_strings() {
        let mut t = Tracker::new("node", "");
        t.apply_service(&svc("a", "172.30.0.1", 80));
        t.apply_slice(&slice("a-1", "a", &["10.0.0.1"], "t"));
        t.apply_slice(&slice("b-1", "b", &["10.0.0.2"], "t"));
        let key = ObjectName::new("ns", "a");
        let (svc_key, svc) = t
            .cluster
            .services
            .shared_name(&key)
            .zip(t.cluster.services.get(&key))
            .unwrap();
        let a = t.cluster.slices.get(&ObjectName::new("ns", "a-1")).unwrap();
        let b = t.cluster.slices.get(&ObjectName::new("ns", "b-1")).unwrap();
        // The Service's own name, the slice's Service name and every namespace are one string.
        assert!(Arc::ptr_eq(&svc.name.name, &svc_key.name));
        assert!(Arc::ptr_eq(&a.service.name, &svc_key.name));
        for ns in [
            &svc.name.namespace,
            &a.name.namespace,
            &a.service.namespace,
            &b.service.namespace,
        ] {
            assert!(Arc::ptr_eq(ns, &svc_key.namespace));
        }
        // A slice whose Service is not known yet keeps a name of its own.
        assert_eq!(&*b.service.name, "b");
        // Port names too: the Service's port "p" and the slices'.
        assert!(Arc::ptr_eq(&svc.ports[0].name, &a.ports[0].name));
        assert!(Arc::ptr_eq(&a.ports[0].name, &b.ports[0].name));
    }

    #[test]
    fn endpoints_on_one_node_share_their_site() {
        let mut t = Tracker::new("node", "");
        let on = |name: &str, nodes: &[&str]| -> discovery::EndpointSlice {
            let mut s = slice(name, "a", &[], "t");
            s.endpoints = nodes
                .iter()
                .enumerate()
                .map(|(i, n)| {
                    serde_json::from_value(serde_json::json!({
                        "addresses": [format!("10.0.{}.{i}", name.len())], "nodeName": n
                    }))
                    .unwrap()
                })
                .collect();
            s
        };
        t.apply_slice(&on("a-1", &["n1", "n2"]));
        t.apply_slice(&on("a-22", &["n1"]));
        let site = |slice: &str, i: usize| {
            let s = t.cluster.slices.get(&ObjectName::new("ns", slice)).unwrap();
            s.endpoints.get(i).unwrap().site.unwrap()
        };
        assert!(Arc::ptr_eq(&site("a-1", 0), &site("a-22", 0)));
        assert!(!Arc::ptr_eq(&site("a-1", 0), &site("a-1", 1)));
        assert_eq!(site("a-1", 1).node_name.as_deref(), Some("n2"));
    }

    #[test]
    fn no_op_updates_are_dropped() {
        let mut t = Tracker::new("node", "");
        t.apply_service(&svc("a", "172.30.0.1", 80));
        t.apply_slice(&slice("a-1", "a", &["10.0.0.1"], "2026-12-05T10:00:01Z"));
        assert_eq!(t.take_changes().services.len(), 1);
        let mut again = svc("a", "172.30.0.1", 80);
        again.metadata.resource_version = Some("2".into());
        t.apply_service(&again);
        t.apply_slice(&slice("a-1", "a", &["10.0.0.1"], "2026-12-05T10:00:02Z"));
        assert!(t.take_changes().is_empty());
        t.apply_slice(&slice(
            "a-1",
            "a",
            &["10.0.0.2"],
            "2026-12-05T10:00:03.5+01:00",
        ));
        let c = t.take_changes();
        assert_eq!(c.services, [ObjectName::new("ns", "a")].into());
        let t3 = std::time::UNIX_EPOCH + std::time::Duration::from_millis(1_796_461_203_500);
        assert_eq!(c.trigger_times, vec![(Family::V4, t3)]);
        // A trigger time that is not an RFC 3339 time is none.
        t.apply_slice(&slice("a-1", "a", &["10.0.0.3"], "yesterday"));
        let c = t.take_changes();
        assert_eq!(c.services.len(), 1);
        assert!(c.trigger_times.is_empty());
    }

    #[test]
    fn relist_removes_what_disappeared() {
        let mut t = Tracker::new("node", "");
        t.begin_list(Kind::Service);
        t.apply_service(&svc("a", "172.30.0.1", 80));
        t.apply_service(&svc("b", "172.30.0.2", 80));
        t.end_list(Kind::Service);
        assert!(!t.ready());
        t.begin_list(Kind::EndpointSlice);
        t.end_list(Kind::EndpointSlice);
        assert!(t.ready());
        t.take_changes();
        t.begin_list(Kind::Service);
        t.apply_service(&svc("b", "172.30.0.2", 80));
        t.end_list(Kind::Service);
        assert_eq!(t.cluster().services.len(), 1);
        assert_eq!(
            t.take_changes().services,
            [ObjectName::new("ns", "a")].into()
        );
    }

    fn node(name: &str, ip: &str) -> core::Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": "z1"}},
            "status": {"addresses": [{"type": "InternalIP", "address": ip}]}
        }))
        .unwrap()
    }

    #[test]
    fn a_deleted_node_keeps_its_addresses_and_labels() {
        let mut t = Tracker::new("node", "");
        assert!(!t.node_known() && t.node().is_none());
        t.apply_node(&node("other", "192.0.2.9"));
        assert!(!t.node_known(), "another node's object is ignored");
        t.apply_node(&node("node", "192.0.2.1"));
        assert!(t.node_known() && t.node().is_some());
        assert!(t.take_changes().all);
        t.delete(Kind::Node, &ObjectName::new("", "node"));
        assert!(t.node().is_none(), "not eligible once deleted");
        assert!(t.node_known());
        let kept = t.cluster().node.as_ref().unwrap();
        assert_eq!(
            kept.addresses,
            ["192.0.2.1".parse::<std::net::IpAddr>().unwrap()]
        );
        assert_eq!(kept.zone(), Some("z1"));
        assert!(!t.has_changes(), "nothing to re-program");
        // A relist without the Node (a failed or filtered watch) is the same as a deletion.
        t.apply_node(&node("node", "192.0.2.1"));
        t.begin_list(Kind::Node);
        t.end_list(Kind::Node);
        assert!(t.node().is_none() && t.node_known());
        // Re-registered with a new address: that is used.
        t.apply_node(&node("node", "192.0.2.2"));
        assert!(t.take_changes().all);
        assert_eq!(t.node().unwrap().addresses.len(), 1);
        assert_eq!(
            t.cluster().node.as_ref().unwrap().addresses[0].to_string(),
            "192.0.2.2"
        );
    }

    #[test]
    fn an_invalid_node_update_keeps_the_last_valid_one() {
        let mut t = Tracker::new("node", "");
        t.apply_node(&node("node", "192.0.2.1"));
        let mut bad = node("node", "192.0.2.1");
        bad.spec =
            Some(serde_json::from_value(serde_json::json!({"podCIDRs": ["nonsense"]})).unwrap());
        assert!(t.apply_node(&bad).is_some(), "reported as invalid");
        assert_eq!(t.cluster().node.as_ref().unwrap().addresses.len(), 1);
        assert!(t.node().is_some());
    }

    #[test]
    fn events_and_pending_changes_are_counted() {
        let mut t = Tracker::new("node", "");
        t.apply_service(&svc("a", "172.30.0.1", 80));
        t.apply_service(&svc("a", "172.30.0.1", 80));
        t.apply_slice(&slice("a-1", "a", &["10.0.0.1"], "t1"));
        t.apply_slice(&slice("a-2", "a", &["10.0.0.2"], "t1"));
        let c = t.change_counts();
        assert_eq!((c.service_events, c.slice_events), (2, 2));
        assert_eq!((c.services_pending, c.endpoints_pending), (1, 1));
        t.take_changes();
        t.delete(Kind::EndpointSlice, &ObjectName::new("ns", "a-1"));
        let c = t.change_counts();
        assert_eq!((c.service_events, c.slice_events), (2, 3));
        assert_eq!((c.services_pending, c.endpoints_pending), (0, 1));
    }

    fn svc_with(name: &str, ip: &str, external: &[&str], created: &str) -> core::Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created},
            "spec": {"clusterIP": ip, "externalIPs": external,
                     "ports": [{"name": "p", "port": 53, "protocol": "UDP"}]}
        }))
        .unwrap()
    }

    #[test]
    fn services_sharing_an_address_with_a_changed_one_are_reported() {
        let mut t = Tracker::new("node", "");
        t.apply_service(&svc_with("dns", "172.30.0.10", &[], "2020-01-01T00:00:00Z"));
        t.apply_service(&svc_with("web", "172.30.0.20", &[], "2020-01-01T00:00:00Z"));
        t.take_changes();
        let names =
            |c: Changes| -> Vec<String> { c.services.iter().map(ToString::to_string).collect() };
        // A tenant claims kube-dns's ClusterIP: kube-dns is re-planned too, not "web".
        let evil = svc_with(
            "evil",
            "172.30.0.99",
            &["172.30.0.10"],
            "2019-01-01T00:00:00Z",
        );
        t.apply_service(&evil);
        assert_eq!(names(t.take_changes()), ["ns/dns", "ns/evil"]);
        // A change that claims nothing new reports only the Service itself.
        let mut same = evil.clone();
        same.spec.as_mut().unwrap().session_affinity = Some("ClientIP".into());
        t.apply_service(&same);
        assert_eq!(names(t.take_changes()), ["ns/evil"]);
        // Dropping the claim (the conflict ends), and deleting: the other side too.
        t.apply_service(&svc_with(
            "evil",
            "172.30.0.99",
            &[],
            "2019-01-01T00:00:00Z",
        ));
        assert_eq!(names(t.take_changes()), ["ns/dns", "ns/evil"]);
        t.apply_service(&evil);
        t.take_changes();
        t.delete(Kind::Service, &ObjectName::new("ns", "evil"));
        assert_eq!(names(t.take_changes()), ["ns/dns", "ns/evil"]);
        // Only the Service's own change counts as pending for the metrics.
        assert_eq!(t.change_counts().services_pending, 0);
    }

    #[test]
    fn invalid_objects_are_reported_once_and_removed() {
        let mut t = Tracker::new("node", "");
        t.apply_service(&svc("a", "172.30.0.1", 80));
        let bad = svc("a", "172.30.0.1", 0);
        let first = t.apply_service(&bad).expect("invalid");
        assert!(first.to_string().contains("ns/a"), "{first}");
        assert!(t.apply_service(&bad).is_none(), "reported only once");
        assert!(t.cluster().services.is_empty());
        assert_eq!(t.invalid_counts()[&Kind::Service], 1);
        t.apply_service(&svc("a", "172.30.0.1", 80));
        assert!(t.invalid_counts().is_empty());
    }
}
