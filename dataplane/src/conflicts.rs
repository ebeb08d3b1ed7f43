//! Conflicting frontends: which Service gets an address that several Services claim.
//!
//! Services come from the API and are not trusted: anyone who may create a Service can set
//! `spec.externalIPs` (or, with a permissive load-balancer controller,
//! `status.loadBalancer.ingress`) to another Service's ClusterIP and so intercept its traffic
//! (CVE-2020-8554), and a broken allocator can give two Services one ClusterIP. Whatever the
//! input, nftproxy programs one stated policy, decided here and only here, so that nftables
//! mode ([`crate::nft::build`], [`crate::nft::desired`]), iptables mode ([`crate::iptables`]), the UDP
//! conntrack cleanup ([`crate::conntrack`]) and `nftproxy trace` ([`crate::trace`]) agree:
//!
//! 1. **A ClusterIP keeps its own traffic.** An external IP or load-balancer IP that equals
//!    any Service's ClusterIP (whatever its ports and protocols) is not programmed for any
//!    Service: traffic to that address is ClusterIP traffic.
//! 2. **Otherwise the oldest claim wins.** Among Services with the same ClusterIP, the same
//!    external or load-balancer IP with the same protocol and port, or the same NodePort with
//!    the same protocol, the one with the oldest `metadata.creationTimestamp` wins, then the
//!    first by namespace/name; a Service without a timestamp loses to every Service with one
//!    ([`precedence`]). The losers' claim on that frontend is not programmed. The loser of a
//!    ClusterIP loses that ClusterIP for all its ports (a ClusterIP belongs to one Service);
//!    its other frontends (external IPs, load-balancer IPs, NodePorts) still work, as do a
//!    loser's other ports and addresses. The API server hands out NodePorts uniquely, so a
//!    NodePort claimed twice comes from a restored or broken allocator, or a hand-written dump;
//!    the older Service keeps it in every family.
//!
//! What a Service may program depends only on the Services that claim one of its addresses or
//! NodePorts. [`Services`] indexes them by address and by NodePort, so [`suppressed`] costs
//! O(claimants) in any snapshot of the model, and a change to one Service affects only its
//! [`neighbours`]: the change tracker reports them as changed too, and the desired table
//! re-plans just them.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

pub use crate::model::precedence;
use crate::model::{ObjectName, Service, ServicePort, Services};
use crate::net::{Family, Proto};

/// How a conflict's losers claimed the frontend: the `kind` label of
/// `nftproxy_frontend_conflicts`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ConflictKind {
    /// Two or more Services have the same ClusterIP.
    ClusterIp,
    /// An external IP equals a ClusterIP, or another Service's external or load-balancer IP
    /// with the same protocol and port.
    ExternalIp,
    /// A load-balancer IP equals a ClusterIP, or another Service's external or load-balancer
    /// IP with the same protocol and port.
    LoadBalancerIp,
    /// Two or more Services have the same NodePort on the same protocol.
    NodePort,
}

impl ConflictKind {
    pub const ALL: [ConflictKind; 4] = [
        ConflictKind::ClusterIp,
        ConflictKind::ExternalIp,
        ConflictKind::LoadBalancerIp,
        ConflictKind::NodePort,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ConflictKind::ClusterIp => "cluster-ip",
            ConflictKind::ExternalIp => "external-ip",
            ConflictKind::LoadBalancerIp => "load-balancer-ip",
            ConflictKind::NodePort => "node-port",
        }
    }

    /// How the losers claimed the frontend, in words.
    fn claim(self) -> &'static str {
        match self {
            ConflictKind::ClusterIp => "ClusterIP",
            ConflictKind::ExternalIp => "external IP",
            ConflictKind::LoadBalancerIp => "load-balancer IP",
            ConflictKind::NodePort => "NodePort",
        }
    }
}

impl fmt::Display for ConflictKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which rule of the policy decided a conflict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rule {
    /// The address is a ClusterIP: only its Service gets it.
    ClusterIpKeepsItsTraffic,
    /// The oldest Service (creationTimestamp, then namespace/name) gets it.
    OldestWins,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Rule::ClusterIpKeepsItsTraffic => "a ClusterIP keeps its own traffic",
            Rule::OldestWins => "the oldest Service wins (creationTimestamp, then namespace/name)",
        })
    }
}

/// A frontend claimed by more than one Service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Frontend {
    /// A ClusterIP, on every port and protocol.
    ClusterIp(IpAddr),
    /// An address with a protocol and port.
    Addr(IpAddr, Proto, u16),
    /// A NodePort with its protocol, on every NodePort address.
    NodePort(Proto, u16),
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Frontend::ClusterIp(ip) => write!(f, "{ip}"),
            Frontend::Addr(ip, proto, port) => write!(f, "{}/{proto}", SocketAddr::new(ip, port)),
            Frontend::NodePort(proto, port) => write!(f, "NodePort {port}/{proto}"),
        }
    }
}

/// One conflicting frontend: who gets it, whose claims are not programmed, and why.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Conflict {
    pub kind: ConflictKind,
    pub frontend: Frontend,
    pub winner: ObjectName,
    /// The Services whose claim (of `kind`) on the frontend is not programmed, in name order.
    pub losers: Vec<ObjectName>,
    pub rule: Rule,
}

impl fmt::Display for Conflict {
    /// `external-ip 172.30.0.10:53/udp: kube-system/kube-dns keeps it (its ClusterIP); not
    /// programmed as external IP of tenant/evil: a ClusterIP keeps its own traffic`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let losers: Vec<String> = self.losers.iter().map(ToString::to_string).collect();
        let why = match self.rule {
            Rule::ClusterIpKeepsItsTraffic => "its ClusterIP",
            Rule::OldestWins => "the oldest claimant",
        };
        write!(
            f,
            "{} {}: {} keeps it ({why}); not programmed as {} of {}: {}",
            self.kind,
            self.frontend,
            self.winner,
            self.kind.claim(),
            losers.join(", "),
            self.rule,
        )
    }
}

/// Whether `svc` claims `ip` as an external or load-balancer IP on `proto`/`port`. Only a
/// Service proxied in the address's family (one with a ClusterIP of that family) claims it.
fn claims_external(svc: &Service, ip: &IpAddr, proto: Proto, port: u16) -> bool {
    (svc.external_ips.contains(ip) || svc.load_balancer_ips.contains(ip))
        && svc.cluster_ip(Family::of(ip)).is_some()
        && svc
            .ports
            .iter()
            .any(|p| p.protocol == proto && p.port == port)
}

/// The Service whose ClusterIP `ip` is, among `claimants` (oldest first), if any.
fn cluster_ip_owner<'a>(claimants: &'a [Arc<Service>], ip: &IpAddr) -> Option<&'a Arc<Service>> {
    claimants.iter().find(|s| s.cluster_ips.contains(ip))
}

/// What of one Service's frontends is not programmed (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Suppressed {
    /// ClusterIPs another Service keeps.
    cluster_ips: Vec<IpAddr>,
    /// External or load-balancer IPs that are a ClusterIP: not programmed on any port.
    addrs: Vec<IpAddr>,
    /// External or load-balancer IPs lost on one protocol and port.
    frontends: Vec<(IpAddr, Proto, u16)>,
    /// NodePorts (protocol and port) another Service keeps.
    node_ports: Vec<(Proto, u16)>,
}

impl Suppressed {
    /// Nothing suppressed.
    pub const NONE: Suppressed = Suppressed {
        cluster_ips: Vec::new(),
        addrs: Vec::new(),
        frontends: Vec::new(),
        node_ports: Vec::new(),
    };

    pub fn is_empty(&self) -> bool {
        self.cluster_ips.is_empty()
            && self.addrs.is_empty()
            && self.frontends.is_empty()
            && self.node_ports.is_empty()
    }

    /// Whether the Service's NodePort `port` on `proto` is not programmed (another Service
    /// keeps it).
    pub fn node_port(&self, proto: Proto, port: u16) -> bool {
        self.node_ports.contains(&(proto, port))
    }

    /// The Service's ClusterIP of `family`, unless another Service keeps it.
    pub fn cluster_ip(&self, svc: &Service, family: Family) -> Option<IpAddr> {
        svc.cluster_ip(family)
            .filter(|ip| !self.cluster_ips.contains(ip))
    }

    /// Whether the Service's external or load-balancer IP `ip` is not programmed on
    /// `proto`/`port`.
    pub fn external(&self, ip: IpAddr, proto: Proto, port: u16) -> bool {
        self.addrs.contains(&ip) || self.frontends.contains(&(ip, proto, port))
    }

    /// `ips` of `family` that `port` is programmed on.
    pub fn kept<'a>(
        &'a self,
        ips: &'a [IpAddr],
        port: &'a ServicePort,
        family: Family,
    ) -> impl Iterator<Item = IpAddr> + 'a {
        ips.iter()
            .copied()
            .filter(move |ip| Family::of(ip) == family)
            .filter(move |ip| !self.external(*ip, port.protocol, port.port))
    }

    /// [`Service::externally_accessible`] with only the frontends programmed: a port whose
    /// every external and load-balancer IP and NodePort lost is served like one without any.
    pub fn externally_accessible(&self, svc: &Service, port: &ServicePort) -> bool {
        let kept = |ip: &IpAddr| !self.external(*ip, port.protocol, port.port);
        port.node_port
            .is_some_and(|np| !self.node_port(port.protocol, np))
            || svc.external_ips.iter().any(kept)
            || svc.load_balancer_ips.iter().any(kept)
    }
}

/// What of `svc`'s frontends is not programmed, given the Services of its cluster (of which it
/// is one). O(claimants of its addresses).
pub fn suppressed(services: &Services, svc: &Service) -> Suppressed {
    let mut out = Suppressed::default();
    for ip in &svc.cluster_ips {
        if services.is_shared(ip)
            && cluster_ip_owner(services.claimants(ip), ip).is_some_and(|w| w.name != svc.name)
        {
            out.cluster_ips.push(*ip);
        }
    }
    for ip in svc.external_ips.iter().chain(&svc.load_balancer_ips) {
        if out.addrs.contains(ip) || svc.cluster_ip(Family::of(ip)).is_none() {
            continue;
        }
        // Its own ClusterIP, too: traffic to a ClusterIP is ClusterIP traffic.
        if svc.cluster_ips.contains(ip) {
            out.addrs.push(*ip);
            continue;
        }
        if !services.is_shared(ip) {
            continue;
        }
        let claimants = services.claimants(ip);
        if cluster_ip_owner(claimants, ip).is_some() {
            out.addrs.push(*ip);
            continue;
        }
        for port in svc.ports.iter() {
            let key = (*ip, port.protocol, port.port);
            let winner = claimants
                .iter()
                .find(|s| claims_external(s, ip, port.protocol, port.port));
            if winner.is_some_and(|w| w.name != svc.name) && !out.frontends.contains(&key) {
                out.frontends.push(key);
            }
        }
    }
    for (proto, port) in svc.claimed_node_ports() {
        if services.is_node_port_shared(proto, port)
            && services
                .node_port_claimants(proto, port)
                .first()
                .is_some_and(|w| w.name != svc.name)
        {
            out.node_ports.push((proto, port));
        }
    }
    out
}

/// Whether a change from `old` to `new` (`None`: absent) may change how the conflicts of the
/// Services sharing an address with it are decided.
pub fn claims_differ(old: Option<&Service>, new: Option<&Service>) -> bool {
    match (old, new) {
        (Some(a), Some(b)) => {
            let ports = |s: &Service| -> Vec<(Proto, u16, Option<u16>)> {
                s.ports
                    .iter()
                    .map(|p| (p.protocol, p.port, p.node_port))
                    .collect()
            };
            a.cluster_ips != b.cluster_ips
                || a.external_ips != b.external_ips
                || a.load_balancer_ips != b.load_balancer_ips
                || a.creation_timestamp != b.creation_timestamp
                || a.name != b.name
                || ports(a) != ports(b)
        }
        (None, None) => false,
        _ => true,
    }
}

/// The other Services claiming one of the addresses or NodePorts `svc` claims, in `services`:
/// those whose conflicts a change of `svc` may decide differently. O(claimants).
pub fn neighbours<'a>(
    services: &'a Services,
    svc: &'a Service,
) -> impl Iterator<Item = &'a Arc<Service>> + 'a {
    let by_addr = svc
        .claimed_addrs()
        .flat_map(move |ip| services.claimants(&ip).iter());
    let by_node_port = svc
        .claimed_node_ports()
        .flat_map(move |(proto, port)| services.node_port_claimants(proto, port).iter());
    by_addr
        .chain(by_node_port)
        .filter(move |s| s.name != svc.name)
}

/// The Services claiming one address on one protocol and port, with how, oldest first.
type Claims<'a> = Vec<(&'a Arc<Service>, ConflictKind)>;

/// Every conflict among `services`: those of addresses in address order, then those of
/// NodePorts. O(conflicting frontends × claimants).
pub fn conflicts(services: &Services) -> Vec<Conflict> {
    let mut out = address_conflicts(services);
    for &(proto, port) in services.shared_node_ports() {
        if let [winner, losers @ ..] = services.node_port_claimants(proto, port) {
            out.push(conflict(
                ConflictKind::NodePort,
                Frontend::NodePort(proto, port),
                winner,
                losers.iter().map(|s| &s.name),
                Rule::OldestWins,
            ));
        }
    }
    out
}

/// The conflicts over addresses, in address order.
fn address_conflicts(services: &Services) -> Vec<Conflict> {
    let mut out = Vec::new();
    for ip in services.shared_addrs() {
        let claimants = services.claimants(ip);
        let owners: Vec<&Arc<Service>> = claimants
            .iter()
            .filter(|s| s.cluster_ips.contains(ip))
            .collect();
        if let [winner, losers @ ..] = &owners[..]
            && !losers.is_empty()
        {
            out.push(conflict(
                ConflictKind::ClusterIp,
                Frontend::ClusterIp(*ip),
                winner,
                losers.iter().map(|s| &s.name),
                Rule::OldestWins,
            ));
        }
        // The external claims on the address, per protocol and port, oldest first.
        let mut claims: BTreeMap<(Proto, u16), Claims<'_>> = BTreeMap::new();
        for s in claimants {
            if s.cluster_ip(Family::of(ip)).is_none() {
                continue;
            }
            let mut kinds = Vec::new();
            if s.external_ips.contains(ip) {
                kinds.push(ConflictKind::ExternalIp);
            }
            if s.load_balancer_ips.contains(ip) {
                kinds.push(ConflictKind::LoadBalancerIp);
            }
            for port in s.ports.iter() {
                for kind in &kinds {
                    let list = claims.entry((port.protocol, port.port)).or_default();
                    if !list.contains(&(s, *kind)) {
                        list.push((s, *kind));
                    }
                }
            }
        }
        for ((proto, port), list) in claims {
            let (winner, rule) = match owners.first() {
                Some(owner) => (*owner, Rule::ClusterIpKeepsItsTraffic),
                None => (list[0].0, Rule::OldestWins),
            };
            for kind in [ConflictKind::ExternalIp, ConflictKind::LoadBalancerIp] {
                let losers: Vec<&ObjectName> = list
                    .iter()
                    .filter(|(s, k)| *k == kind && s.name != winner.name)
                    .map(|(s, _)| &s.name)
                    .collect();
                if !losers.is_empty() {
                    out.push(conflict(
                        kind,
                        Frontend::Addr(*ip, proto, port),
                        winner,
                        losers,
                        rule,
                    ));
                }
            }
        }
    }
    out
}

fn conflict<'a>(
    kind: ConflictKind,
    frontend: Frontend,
    winner: &Service,
    losers: impl IntoIterator<Item = &'a ObjectName>,
    rule: Rule,
) -> Conflict {
    let mut losers: Vec<ObjectName> = losers.into_iter().cloned().collect();
    losers.sort();
    losers.dedup();
    Conflict {
        kind,
        frontend,
        winner: winner.name.clone(),
        losers,
        rule,
    }
}

/// The number of conflicts of each kind (every kind present, zero or not).
pub fn counts<'a>(
    conflicts: impl IntoIterator<Item = &'a Conflict>,
) -> BTreeMap<ConflictKind, usize> {
    let mut out: BTreeMap<ConflictKind, usize> =
        ConflictKind::ALL.iter().map(|k| (*k, 0)).collect();
    for c in conflicts {
        *out.entry(c.kind).or_default() += 1;
    }
    out
}

#[cfg(test)]
mod tests;
