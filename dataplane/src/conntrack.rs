//! UDP conntrack cleanup, the pure part: which conntrack entries outlived the endpoint they were
//! load-balanced to (kube-proxy's `pkg/proxy/conntrack/cleanup.go`).
//!
//! UDP has no connection end, so a conntrack entry created while a client talked to an endpoint
//! keeps the client's flow DNATed to that endpoint for as long as the client keeps sending, even
//! after the endpoint is gone. After every sync that changed a UDP Service, the agent lists the
//! UDP entries of the family and deletes those [`is_stale`] picks, so that the next packet is
//! load-balanced afresh (or rejected, when no endpoint is left).
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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use crate::conflicts::{Suppressed, suppressed};
use crate::decision::{self, Frontend, port_endpoints};
use crate::model::{Cluster, EndpointSlice, ObjectName, Service};
use crate::plan::TableState;
use crate::ruleset::{Family, Key, Proto};

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

/// The UDP frontends of one family and, for each, the IPs of the serving endpoints behind it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frontends {
    /// `(Service address, Service port)` → serving endpoint IPs.
    pub addrs: BTreeMap<(IpAddr, u16), BTreeSet<IpAddr>>,
    /// NodePort (on any address) → serving endpoint IPs.
    pub node_ports: BTreeMap<u16, BTreeSet<IpAddr>>,
}

impl Frontends {
    /// The UDP frontends `cluster` gives `family`. Services without a ClusterIP of the family
    /// are not proxied in it and have none. An address frontend several Services claim is the
    /// one Service's that [`crate::conflicts`] gives it to (the others' entries to it are
    /// stale); two Services claiming one NodePort share it: the endpoints of both count.
    pub fn of(cluster: &Cluster, family: Family) -> Frontends {
        FrontendIndex::build(cluster, family).current
    }

    /// The UDP frontends of one Service, without those other Services keep (`suppressed`).
    fn of_service(
        svc: &Service,
        slices: &[&EndpointSlice],
        family: Family,
        suppressed: &Suppressed,
    ) -> Frontends {
        let mut out = Frontends::default();
        if svc.cluster_ip(family).is_none() {
            return out;
        }
        for port in svc.ports.iter().filter(|p| p.protocol == Proto::Udp) {
            let frontends = decision::frontends(svc, port, family, suppressed);
            let kept = frontends.iter().filter(|f| f.kept);
            // The node name only decides `local`, which does not matter here.
            let serving: BTreeSet<IpAddr> = port_endpoints(slices, port, family, "")
                .into_iter()
                .filter(|e| e.serving)
                .map(|e| e.addr)
                .collect();
            for frontend in kept {
                let eps = match frontend.frontend {
                    Frontend::Addr(addr, port) => out.addrs.entry((addr, port)).or_default(),
                    Frontend::NodePort(np) => out.node_ports.entry(np).or_default(),
                };
                eps.extend(&serving);
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
            .flat_map(|s| s.elements.keys());
        for key in keys {
            match *key {
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
            let new = cluster.services.get(name).map(|svc| {
                let slices: Vec<&EndpointSlice> = cluster.slices_of(name).collect();
                let sup = suppressed(&cluster.services, svc);
                Frontends::of_service(svc, &slices, family, &sup)
            });
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
        get: impl Fn(&Frontends) -> Option<&BTreeSet<IpAddr>>,
    ) -> Option<BTreeSet<IpAddr>> {
        let owners = self.owners.get(&key)?;
        let mut out = BTreeSet::new();
        for name in owners {
            if let Some(eps) = self.services.get(name).and_then(&get) {
                out.extend(eps.iter().copied());
            }
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

/// Whether a sync that moved from `previous` to `current` calls for a cleanup: when any UDP
/// frontend or its serving endpoints changed. When the previous endpoints are unknown
/// (`previous_exact` false: the first sync of the process, `previous` read back from the kernel),
/// whenever there is a UDP frontend, before or now.
pub fn cleanup_needed(previous: &Frontends, previous_exact: bool, current: &Frontends) -> bool {
    if previous_exact {
        previous != current
    } else {
        !previous.is_empty() || !current.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::model::{
        Endpoint, EndpointPort, EndpointSlice, ObjectName, Service, ServicePort, ServiceType,
    };
    use crate::plan::SetState;
    use crate::ruleset::{KeyType, SetDecl, Verdict};

    const UDP: u8 = 17;
    const TCP: u8 = 6;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn service(
        name: &str,
        cluster_ips: &[&str],
        ports: &[(&str, Proto, u16, Option<u16>)],
    ) -> Service {
        Service {
            name: ObjectName::new("ns", name),
            service_type: ServiceType::ClusterIp,
            cluster_ips: cluster_ips.iter().map(|s| ip(s)).collect(),
            external_ips: vec![],
            load_balancer_ips: vec![],
            load_balancer_source_ranges: vec![],
            external_policy_local: false,
            internal_policy_local: false,
            health_check_node_port: None,
            affinity_timeout: None,
            creation_timestamp: None,
            ports: ports
                .iter()
                .map(|(n, protocol, port, node_port)| ServicePort {
                    name: n.to_string(),
                    protocol: *protocol,
                    port: *port,
                    node_port: *node_port,
                })
                .collect(),
        }
    }

    fn endpoint(addr: &str, serving: bool) -> Endpoint {
        Endpoint {
            addr: ip(addr),
            ready: serving,
            serving,
            terminating: false,
            node_name: Some("other-node".into()),
            zone_hints: Box::default(),
            node_hints: Box::default(),
        }
    }

    fn slice(
        svc: &str,
        name: &str,
        ports: &[(&str, Proto, u16)],
        eps: Vec<Endpoint>,
    ) -> EndpointSlice {
        let family = Family::of(&eps.first().map(|e| e.addr).unwrap_or(ip("0.0.0.0")));
        EndpointSlice {
            name: ObjectName::new("ns", name),
            service: ObjectName::new("ns", svc),
            family,
            ports: ports
                .iter()
                .map(|(n, protocol, port)| EndpointPort {
                    name: n.to_string(),
                    protocol: *protocol,
                    port: *port,
                })
                .collect(),
            endpoints: eps,
            trigger_time: None,
        }
    }

    fn cluster(services: Vec<Service>, slices: Vec<EndpointSlice>) -> Cluster {
        Cluster {
            services: services.into_iter().map(|s| (s.name.clone(), s)).collect(),
            slices: slices.into_iter().map(|s| (s.name.clone(), s)).collect(),
            node: None,
            service_cidrs: BTreeMap::new(),
        }
    }

    fn tuple(proto: u8, src: &str, sport: u16, dst: &str, dport: u16) -> Tuple {
        Tuple {
            proto,
            src: ip(src),
            dst: ip(dst),
            src_port: sport,
            dst_port: dport,
        }
    }

    /// An entry from `client` to `frontend`, translated to `endpoint` (reply tuple).
    fn entry(
        proto: u8,
        client: &str,
        frontend: (&str, u16),
        endpoint: (&str, u16),
    ) -> (Tuple, Tuple) {
        let orig = tuple(proto, client, 40000, frontend.0, frontend.1);
        let reply = tuple(proto, endpoint.0, endpoint.1, client, 40000);
        (orig, reply)
    }

    fn stale(e: &(Tuple, Tuple), current: &Frontends, previous: &Frontends) -> bool {
        is_stale(&e.0, &e.1, current, previous)
    }

    fn set(ips: &[&str]) -> BTreeSet<IpAddr> {
        ips.iter().map(|s| ip(s)).collect()
    }

    /// kube-proxy's TestCleanStaleEntries layout: a UDP Service with ClusterIP, external IP,
    /// LoadBalancer IP and NodePort, two endpoints of which one stopped serving.
    fn udp_cluster(serving_b: bool) -> Cluster {
        let mut svc = service(
            "dns",
            &["172.30.0.10", "fd00:172:30::10"],
            &[
                ("dns", Proto::Udp, 53, Some(30053)),
                ("dns-tcp", Proto::Tcp, 53, Some(30054)),
            ],
        );
        svc.service_type = ServiceType::LoadBalancer;
        svc.external_ips = vec![ip("192.0.2.10"), ip("2001:db8::10")];
        svc.load_balancer_ips = vec![ip("198.51.100.10")];
        let ports = [("dns", Proto::Udp, 5353), ("dns-tcp", Proto::Tcp, 5353)];
        cluster(
            vec![svc],
            vec![
                slice(
                    "dns",
                    "dns-v4",
                    &ports,
                    vec![endpoint("10.0.0.1", true), endpoint("10.0.0.2", serving_b)],
                ),
                slice("dns", "dns-v6", &ports, vec![endpoint("fd00:10::1", true)]),
            ],
        )
    }

    #[test]
    fn frontends_of_a_udp_service() {
        let f = Frontends::of(&udp_cluster(false), Family::V4);
        let a = set(&["10.0.0.1"]);
        let want_addrs: BTreeMap<(IpAddr, u16), BTreeSet<IpAddr>> = [
            ((ip("172.30.0.10"), 53), a.clone()),
            ((ip("192.0.2.10"), 53), a.clone()),
            ((ip("198.51.100.10"), 53), a.clone()),
        ]
        .into();
        assert_eq!(f.addrs, want_addrs);
        assert_eq!(f.node_ports, [(30053, a)].into());

        let f6 = Frontends::of(&udp_cluster(false), Family::V6);
        let want6: BTreeMap<(IpAddr, u16), BTreeSet<IpAddr>> = [
            ((ip("fd00:172:30::10"), 53), set(&["fd00:10::1"])),
            ((ip("2001:db8::10"), 53), set(&["fd00:10::1"])),
        ]
        .into();
        assert_eq!(f6.addrs, want6);
        assert_eq!(f6.node_ports, [(30053, set(&["fd00:10::1"]))].into());
    }

    #[test]
    fn serving_counts_not_ready_or_policy() {
        let mut c = udp_cluster(true);
        // Terminating but serving: still a valid target for existing flows.
        let mut s = c.slices.values().next().unwrap().clone();
        s.endpoints[1].ready = false;
        s.endpoints[1].terminating = true;
        c.slices.insert(s.name.clone(), s);
        let mut svc = Service::clone(c.services.values().next().unwrap());
        svc.internal_policy_local = true;
        svc.external_policy_local = true;
        c.services
            .insert(svc.name.clone(), std::sync::Arc::new(svc));
        let f = Frontends::of(&c, Family::V4);
        assert_eq!(
            f.addrs[&(ip("172.30.0.10"), 53)],
            set(&["10.0.0.1", "10.0.0.2"])
        );
        // Not serving (e.g. failing readiness, not terminating): not a target.
        let mut s = c.slices.values().next().unwrap().clone();
        s.endpoints[1].serving = false;
        s.endpoints[1].terminating = false;
        c.slices.insert(s.name.clone(), s);
        let f = Frontends::of(&c, Family::V4);
        assert_eq!(f.addrs[&(ip("172.30.0.10"), 53)], set(&["10.0.0.1"]));
    }

    /// kube-proxy's cases: an entry to each frontend, one to a serving endpoint (kept) and one
    /// to the endpoint that stopped serving (deleted).
    #[test]
    fn kube_proxy_cases() {
        let current = Frontends::of(&udp_cluster(false), Family::V4);
        let previous = Frontends::of(&udp_cluster(true), Family::V4);
        for frontend in [
            ("172.30.0.10", 53),    // ClusterIP
            ("198.51.100.10", 53),  // LoadBalancer VIP
            ("192.0.2.10", 53),     // ExternalIP
            ("192.168.0.2", 30053), // NodePort, on the node's address
            ("127.0.0.1", 30053),   // NodePort, on any address
        ] {
            let good = entry(UDP, "10.0.5.5", frontend, ("10.0.0.1", 5353));
            let gone = entry(UDP, "10.0.5.5", frontend, ("10.0.0.2", 5353));
            assert!(
                !stale(&good, &current, &previous),
                "{frontend:?} to a serving endpoint"
            );
            assert!(
                stale(&gone, &current, &previous),
                "{frontend:?} to a gone endpoint"
            );
            // TCP is never touched, even to the gone endpoint.
            let tcp = entry(TCP, "10.0.5.5", frontend, ("10.0.0.2", 5353));
            assert!(!stale(&tcp, &current, &previous), "{frontend:?} TCP");
        }
        // Another port of the same address, and unrelated traffic: untouched.
        let other_port = entry(UDP, "10.0.5.5", ("172.30.0.10", 54), ("10.0.0.2", 54));
        assert!(!stale(&other_port, &current, &previous));
        let unrelated = entry(UDP, "10.0.5.5", ("8.8.8.8", 53), ("8.8.8.8", 53));
        assert!(!stale(&unrelated, &current, &previous));
        // Pod to pod, bypassing the Service.
        let direct = entry(UDP, "10.0.5.5", ("10.0.0.2", 5353), ("10.0.0.2", 5353));
        assert!(!stale(&direct, &current, &previous));
    }

    #[test]
    fn untranslated_entry_to_a_frontend_is_stale() {
        // Created before the Service had endpoints (or existed): it would keep the client's
        // packets away from the new endpoints.
        let current = Frontends::of(&udp_cluster(true), Family::V4);
        let e = entry(UDP, "10.0.5.5", ("172.30.0.10", 53), ("172.30.0.10", 53));
        assert!(stale(&e, &current, &Frontends::default()));
        let np = entry(
            UDP,
            "203.0.113.9",
            ("192.168.0.2", 30053),
            ("192.168.0.2", 30053),
        );
        assert!(stale(&np, &current, &Frontends::default()));
    }

    #[test]
    fn scale_to_zero_cleans_every_entry() {
        let previous = Frontends::of(&udp_cluster(true), Family::V4);
        let mut c = udp_cluster(true);
        c.slices.clear();
        let current = Frontends::of(&c, Family::V4);
        assert_eq!(current.addrs[&(ip("172.30.0.10"), 53)], BTreeSet::new());
        for ep in ["10.0.0.1", "10.0.0.2"] {
            for frontend in [("172.30.0.10", 53), ("192.168.0.2", 30053)] {
                let e = entry(UDP, "10.0.5.5", frontend, (ep, 5353));
                assert!(stale(&e, &current, &previous));
            }
        }
        assert!(cleanup_needed(&previous, true, &current));
    }

    #[test]
    fn deleted_service_frontends_are_cleaned() {
        let previous = Frontends::of(&udp_cluster(true), Family::V4);
        let current = Frontends::of(&cluster(vec![], vec![]), Family::V4);
        assert!(current.is_empty());
        for frontend in [
            ("172.30.0.10", 53),
            ("198.51.100.10", 53),
            ("192.0.2.10", 53),
            ("192.168.0.2", 30053),
        ] {
            let e = entry(UDP, "10.0.5.5", frontend, ("10.0.0.1", 5353));
            assert!(stale(&e, &current, &previous), "{frontend:?}");
            // Not translated: somebody else's flow to that address now.
            let plain = entry(UDP, "10.0.5.5", frontend, (frontend.0, frontend.1));
            assert!(
                !stale(&plain, &current, &previous),
                "{frontend:?} untranslated"
            );
        }
        assert!(cleanup_needed(&previous, true, &current));
    }

    #[test]
    fn address_frontend_decides_over_an_equal_node_port() {
        // Service b listens on port 30053 of its ClusterIP, a has NodePort 30053.
        let a = service("a", &["172.30.0.10"], &[("p", Proto::Udp, 53, Some(30053))]);
        let b = service("b", &["172.30.0.11"], &[("p", Proto::Udp, 30053, None)]);
        let c = cluster(
            vec![a, b],
            vec![
                slice(
                    "a",
                    "a1",
                    &[("p", Proto::Udp, 53)],
                    vec![endpoint("10.0.0.1", true)],
                ),
                slice(
                    "b",
                    "b1",
                    &[("p", Proto::Udp, 30053)],
                    vec![endpoint("10.0.0.9", true)],
                ),
            ],
        );
        let f = Frontends::of(&c, Family::V4);
        let to_b = entry(UDP, "10.0.5.5", ("172.30.0.11", 30053), ("10.0.0.9", 30053));
        assert!(!stale(&to_b, &f, &f));
        let via_np = entry(UDP, "10.0.5.5", ("192.168.0.2", 30053), ("10.0.0.9", 30053));
        assert!(stale(&via_np, &f, &f));
    }

    #[test]
    fn a_shared_frontend_is_the_winners() {
        let mut a = service("a", &["172.30.0.10"], &[("p", Proto::Udp, 53, None)]);
        a.external_ips = vec![ip("192.0.2.10")];
        let mut b = service("b", &["172.30.0.11"], &[("p", Proto::Udp, 53, None)]);
        b.external_ips = vec![ip("192.0.2.10")];
        let c = cluster(
            vec![a, b],
            vec![
                slice(
                    "a",
                    "a1",
                    &[("p", Proto::Udp, 53)],
                    vec![endpoint("10.0.0.1", true)],
                ),
                slice(
                    "b",
                    "b1",
                    &[("p", Proto::Udp, 53)],
                    vec![endpoint("10.0.0.2", true)],
                ),
            ],
        );
        // ns/a wins the external IP (see crate::conflicts): entries that ns/b's endpoint
        // answers are stale, as that endpoint no longer gets the frontend's traffic.
        let f = Frontends::of(&c, Family::V4);
        assert_eq!(f.addrs[&(ip("192.0.2.10"), 53)], set(&["10.0.0.1"]));
        let to_b = entry(UDP, "10.0.5.5", ("192.0.2.10", 53), ("10.0.0.2", 53));
        assert!(stale(&to_b, &f, &f));
    }

    #[test]
    fn tcp_only_services_have_no_frontends() {
        let s = service(
            "web",
            &["172.30.0.20"],
            &[("http", Proto::Tcp, 80, Some(30080))],
        );
        let c = cluster(
            vec![s],
            vec![slice(
                "web",
                "w",
                &[("http", Proto::Tcp, 80)],
                vec![endpoint("10.0.0.1", true)],
            )],
        );
        assert!(Frontends::of(&c, Family::V4).is_empty());
        assert!(!cleanup_needed(
            &Frontends::default(),
            false,
            &Frontends::of(&c, Family::V4)
        ));
    }

    #[test]
    fn cleanup_needed_on_changes_only() {
        let a = Frontends::of(&udp_cluster(true), Family::V4);
        let b = Frontends::of(&udp_cluster(false), Family::V4);
        assert!(!cleanup_needed(&a, true, &a.clone()));
        assert!(cleanup_needed(&a, true, &b));
        assert!(cleanup_needed(&Frontends::default(), true, &a));
        assert!(cleanup_needed(&a, true, &Frontends::default()));
        assert!(!cleanup_needed(
            &Frontends::default(),
            true,
            &Frontends::default()
        ));
        // Unknown endpoints: a cleanup whenever UDP is around, before or now.
        assert!(cleanup_needed(&a, false, &a.clone()));
        assert!(cleanup_needed(&Frontends::default(), false, &a));
        assert!(cleanup_needed(&a, false, &Frontends::default()));
        assert!(!cleanup_needed(
            &Frontends::default(),
            false,
            &Frontends::default()
        ));
    }

    #[test]
    fn frontends_from_a_table_read_back() {
        let decl = |key| SetDecl {
            key,
            is_vmap: true,
            comment: None,
            timeout_secs: None,
            size: None,
        };
        let goto = Some(crate::ruleset::Value::Verdict(Verdict::Goto(
            "reject-chain".into(),
        )));
        let mut state = TableState::default();
        state.sets.insert(
            "service-ips".into(),
            SetState {
                decl: decl(KeyType::AddrProtoPort),
                elements: [
                    (
                        Key::AddrProtoPort(ip("172.30.0.10"), Proto::Udp, 53),
                        goto.clone(),
                    ),
                    (
                        Key::AddrProtoPort(ip("172.30.0.10"), Proto::Tcp, 53),
                        goto.clone(),
                    ),
                ]
                .into(),
            },
        );
        state.sets.insert(
            "no-endpoint-nodeports".into(),
            SetState {
                decl: decl(KeyType::ProtoPort),
                elements: [
                    (Key::ProtoPort(Proto::Udp, 30053), goto.clone()),
                    (Key::ProtoPort(Proto::Sctp, 30054), goto.clone()),
                ]
                .into(),
            },
        );
        state.sets.insert(
            "cluster-ips".into(),
            SetState {
                decl: SetDecl {
                    is_vmap: false,
                    ..decl(KeyType::Addr)
                },
                elements: [(Key::Addr(ip("172.30.0.10")), None)].into(),
            },
        );
        // Services without chains are known by their endpoint lists.
        let endpoint = Some(crate::ruleset::Value::Endpoint(ip("10.0.0.1"), 5353));
        state.sets.insert(
            "cluster-endpoints-1".into(),
            SetState {
                decl: SetDecl {
                    is_vmap: false,
                    ..decl(KeyType::AddrProtoPortIndex)
                },
                elements: [(
                    Key::AddrProtoPortIndex(ip("172.30.0.11"), Proto::Udp, 53, 0),
                    endpoint.clone(),
                )]
                .into(),
            },
        );
        state.sets.insert(
            "cluster-nodeport-endpoints-1".into(),
            SetState {
                decl: SetDecl {
                    is_vmap: false,
                    ..decl(KeyType::ProtoPortIndex)
                },
                elements: [(Key::ProtoPortIndex(Proto::Udp, 30055, 0), endpoint)].into(),
            },
        );
        let f = Frontends::from_table_state(Some(&state));
        assert_eq!(
            f.addrs,
            [
                ((ip("172.30.0.10"), 53), BTreeSet::new()),
                ((ip("172.30.0.11"), 53), BTreeSet::new())
            ]
            .into()
        );
        assert_eq!(
            f.node_ports,
            [(30053, BTreeSet::new()), (30055, BTreeSet::new())].into()
        );
        assert!(Frontends::from_table_state(None).is_empty());
        // What a restarted agent makes of an entry to a Service deleted meanwhile.
        let e = entry(UDP, "10.0.5.5", ("172.30.0.10", 53), ("10.0.0.1", 5353));
        assert!(stale(&e, &Frontends::default(), &f));
    }

    #[test]
    fn index_updates_like_a_rebuild() {
        let shared = |name: &str, cip: &str| {
            let mut s = service(name, &[cip], &[("p", Proto::Udp, 53, Some(30053))]);
            s.external_ips = vec![ip("192.0.2.10")];
            s
        };
        let one_slice = |svc: &str, eps: &[&str]| {
            slice(
                svc,
                &format!("{svc}1"),
                &[("p", Proto::Udp, 53)],
                eps.iter().map(|e| endpoint(e, true)).collect(),
            )
        };
        let before = cluster(
            vec![shared("a", "172.30.0.10"), shared("b", "172.30.0.11")],
            vec![one_slice("a", &["10.0.0.1"]), one_slice("b", &["10.0.0.2"])],
        );
        let after = cluster(
            vec![shared("b", "172.30.0.11")],
            vec![one_slice("b", &["10.0.0.3"])],
        );
        let mut index = FrontendIndex::build(&before, Family::V4);
        assert_eq!(index.current(), &Frontends::of(&before, Family::V4));
        let (a, b) = (ObjectName::new("ns", "a"), ObjectName::new("ns", "b"));
        let touched = index.update(&after, [&a, &b]);
        assert_eq!(index.current(), &Frontends::of(&after, Family::V4));
        assert_eq!(
            index.current().addrs[&(ip("192.0.2.10"), 53)],
            set(&["10.0.0.3"])
        );
        assert!(touched.addrs.contains(&(ip("172.30.0.10"), 53)));
        assert!(touched.addrs.contains(&(ip("192.0.2.10"), 53)));
        assert!(touched.node_ports.contains(&30053));
        // Only what was touched is compared and carried over.
        let mut previous = Frontends::of(&before, Family::V4);
        previous.replace(&touched, index.current());
        assert_eq!(&previous, index.current());
    }
}
