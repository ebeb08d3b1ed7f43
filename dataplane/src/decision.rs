//! kube-proxy's decisions for one Service port in one IP family, made once and independent of
//! any backend: which frontends it is reached on (and which of them the conflict policy keeps),
//! which endpoints serve cluster-wide and node-local traffic, what happens to internal
//! (ClusterIP) and external (NodePort, external IP, load-balancer IP) traffic, the
//! load-balancer source ranges, masquerading, session affinity and the no-local-endpoint
//! accounting. The nftables builder ([`crate::nft::build`]), the iptables builder
//! ([`crate::iptables`]), the UDP conntrack cleanup ([`crate::conntrack`]), `nftproxy trace`
//! ([`crate::trace`]) and the health-check node ports all read it, so a fix to a rule is made
//! once; they only decide how to express it.
//!
//! The rules are kube-proxy's `syncProxyRules` (`pkg/proxy/nftables/proxier.go`) over
//! `CategorizeEndpoints` ([`crate::topology`]):
//!
//! | situation | ClusterIP | external IP, LB IP, NodePort |
//! |---|---|---|
//! | no usable endpoint anywhere | reject | reject |
//! | iTP=Local, no local endpoint | drop (counted `internal`) | per eTP |
//! | eTP=Local, no local endpoint | per iTP | drop, but the node's pods and the node itself still reach every endpoint (counted `external`) |

use std::collections::{BTreeSet, HashSet};
use std::net::IpAddr;

use ipnet::IpNet;

use crate::conflicts::Suppressed;
use crate::model::{Cluster, EndpointSlice, ObjectName, Service, ServicePort};
use crate::net::{Family, addr_bits};
use crate::settings::{BuildConfig, LocalDetector};
use crate::topology::{Categorized, NodeTopology, Placement, PortEndpoint, Usage, categorize};

/// How traffic from this node's pods is recognised in one family (kube-proxy's
/// `LocalTrafficDetector`, resolved from `detectLocalMode`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LocalTraffic {
    /// No detector for the family: no ClusterIP masquerade, no pod short-circuit.
    Unknown,
    /// Sources inside the pod CIDR (`ClusterCIDR`, `NodeCIDR`).
    Cidr(IpNet),
    /// Packets arriving on an interface with this name (`BridgeInterface`) or name prefix
    /// (`InterfaceNamePrefix`).
    Interface { name: String, prefix: bool },
}

impl LocalTraffic {
    /// The detector `config` gives `family` (for `NodeCIDR`, from the Node's pod CIDRs).
    pub fn of(config: &BuildConfig, cluster: &Cluster, family: Family) -> LocalTraffic {
        let from_cidrs = |cidrs: &[IpNet]| match cidrs.iter().find(|c| Family::of_net(c) == family)
        {
            Some(net) => LocalTraffic::Cidr(*net),
            None => LocalTraffic::Unknown,
        };
        match &config.local_detector {
            LocalDetector::None => LocalTraffic::Unknown,
            LocalDetector::ClusterCidr(cidrs) => from_cidrs(cidrs),
            LocalDetector::NodeCidr => from_cidrs(
                cluster
                    .node
                    .as_ref()
                    .map(|n| n.pod_cidrs.as_slice())
                    .unwrap_or(&[]),
            ),
            LocalDetector::BridgeInterface(name) => LocalTraffic::Interface {
                name: name.clone(),
                prefix: false,
            },
            LocalDetector::InterfaceNamePrefix(prefix) => LocalTraffic::Interface {
                name: prefix.clone(),
                prefix: true,
            },
        }
    }
}

/// What a family's decisions need beyond the Service and its endpoints, resolved once per
/// build.
#[derive(Clone, Debug)]
pub struct DecisionEnv {
    pub family: Family,
    /// This node's name (endpoints on it are local); empty: no endpoint is local.
    pub node_name: String,
    /// This node's `topology.kubernetes.io/zone`, for topology hints.
    pub zone: Option<String>,
    /// The Node's primary IP of the family (for the load-balancer source-range exception).
    pub node_ip: Option<IpAddr>,
    pub local_traffic: LocalTraffic,
    pub masquerade_all: bool,
}

impl DecisionEnv {
    pub fn new(cluster: &Cluster, config: &BuildConfig, family: Family) -> DecisionEnv {
        let node = cluster.node.as_ref();
        DecisionEnv {
            family,
            node_name: config.node_name.clone(),
            zone: node.and_then(|n| n.zone()).map(str::to_string),
            node_ip: node.and_then(|n| n.primary_ip(family)),
            local_traffic: LocalTraffic::of(config, cluster, family),
            masquerade_all: config.masquerade_all,
        }
    }

    fn topology(&self) -> NodeTopology<'_> {
        NodeTopology {
            node_name: &self.node_name,
            zone: self.zone.as_deref(),
        }
    }
}

/// Where traffic reaches a Service port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Frontend {
    /// A ClusterIP, external IP or load-balancer IP, and the port.
    Addr(IpAddr, u16),
    /// A node port, on the node's NodePort addresses.
    NodePort(u16),
}

/// How a Service claims a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FrontendKind {
    ClusterIp,
    ExternalIp,
    LoadBalancerIp,
    NodePort,
}

/// One frontend of a Service port, and whether it is programmed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortFrontend {
    pub kind: FrontendKind,
    pub frontend: Frontend,
    /// False when another Service keeps it ([`crate::conflicts`]). NodePorts are always kept.
    pub kept: bool,
}

/// The frontends of `port` in `family`: the ClusterIP, external IPs, load-balancer IPs (in the
/// Service's order) and the NodePort, each with the conflict policy's verdict. Empty for a
/// Service without a ClusterIP of the family (not proxied in it).
pub fn frontends(
    svc: &Service,
    port: &ServicePort,
    family: Family,
    suppressed: &Suppressed,
) -> Vec<PortFrontend> {
    let Some(cluster_ip) = svc.cluster_ip(family) else {
        return Vec::new();
    };
    let mut out = Vec::with_capacity(2);
    out.push(PortFrontend {
        kind: FrontendKind::ClusterIp,
        frontend: Frontend::Addr(cluster_ip, port.port),
        kept: suppressed.cluster_ip(svc, family).is_some(),
    });
    for (kind, ips) in [
        (FrontendKind::ExternalIp, &svc.external_ips),
        (FrontendKind::LoadBalancerIp, &svc.load_balancer_ips),
    ] {
        out.extend(
            ips.iter()
                .filter(|ip| Family::of(ip) == family)
                .map(|ip| PortFrontend {
                    kind,
                    frontend: Frontend::Addr(*ip, port.port),
                    kept: !suppressed.external(*ip, port.protocol, port.port),
                }),
        );
    }
    out.extend(port.node_port.map(|np| PortFrontend {
        kind: FrontendKind::NodePort,
        frontend: Frontend::NodePort(np),
        kept: !suppressed.node_port(port.protocol, np),
    }));
    out
}

/// The endpoints of one Service port in one family, merged across slices (the first of an
/// address and port wins).
pub fn port_endpoints<'a>(
    slices: &[&'a EndpointSlice],
    port: &ServicePort,
    family: Family,
    node_name: &str,
) -> Vec<PortEndpoint<'a>> {
    merged_endpoints(slices, port, family, node_name, true)
}

/// Whether no address appears twice among `family`'s endpoints of `slices`: then no port's
/// endpoints need merging, as an address and port can only repeat where an address does.
/// Checked once for a Service of several ports instead of once per port.
fn distinct_addresses(slices: &[&EndpointSlice], family: Family) -> bool {
    let of_family = || slices.iter().filter(|s| s.family == family);
    let n = of_family().map(|s| s.endpoints.len()).sum();
    let mut seen: HashSet<u128, foldhash::fast::RandomState> =
        HashSet::with_capacity_and_hasher(n, Default::default());
    of_family()
        .flat_map(|s| s.endpoints.refs())
        .all(|e| seen.insert(addr_bits(e.addr)))
}

/// [`port_endpoints`], merging only if `merge` (false: the addresses are known distinct).
fn merged_endpoints<'a>(
    slices: &[&'a EndpointSlice],
    port: &ServicePort,
    family: Family,
    node_name: &str,
    merge: bool,
) -> Vec<PortEndpoint<'a>> {
    // Hashed: a B-tree of a 5,000-endpoint Service's endpoints cost more than all the rest of
    // its decisions.
    let n = slices.iter().map(|s| s.endpoints.len()).sum();
    // Keyed by plain numbers, which hash in two steps where an `IpAddr` takes four.
    let mut seen: HashSet<(u128, u16), foldhash::fast::RandomState> =
        HashSet::with_capacity_and_hasher(if merge { n } else { 0 }, Default::default());
    let mut out = Vec::with_capacity(n);
    for slice in slices.iter().filter(|s| s.family == family) {
        let Some(sp) = slice
            .ports
            .iter()
            .find(|p| p.name == port.name && p.protocol == port.protocol)
        else {
            continue;
        };
        for e in slice.endpoints.refs() {
            if merge && !seen.insert((addr_bits(e.addr), sp.port)) {
                continue;
            }
            out.push(PortEndpoint {
                addr: e.addr,
                port: sp.port,
                ready: e.ready,
                serving: e.serving,
                terminating: e.terminating,
                placement: Placement::of(e.node_name(), node_name),
                site: e.site,
            });
        }
    }
    out
}

/// What happens to traffic of one kind (internal or external) that reaches a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// DNAT to one of [`PortDecision::cluster_endpoints`].
    Cluster,
    /// DNAT to one of [`PortDecision::local_endpoints`].
    Local,
    /// No usable endpoint anywhere: rejected (ICMP unreachable, TCP reset).
    Reject,
    /// The traffic policy is Local and this node has no endpoint (others have): dropped.
    Drop,
}

impl Target {
    /// Whether the traffic reaches an endpoint.
    pub fn has_endpoints(self) -> bool {
        matches!(self, Target::Cluster | Target::Local)
    }
}

/// What happens to traffic to a port's NodePort, external IPs and load-balancer IPs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct External {
    /// For traffic from elsewhere.
    pub target: Target,
    /// externalTrafficPolicy Local with usable endpoints: traffic from this node's pods and
    /// from the node itself goes to the cluster endpoints (as if it had gone out to the load
    /// balancer and come back), whatever [`External::target`] says; the node's own traffic is
    /// masqueraded.
    pub short_circuit: bool,
    /// Traffic from elsewhere is masqueraded (externalTrafficPolicy Cluster); with Local it
    /// keeps its source.
    pub masquerade: bool,
}

/// Which ClusterIP traffic is masqueraded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InternalMasquerade {
    /// `masqueradeAll`.
    All,
    /// Traffic that does not come from this node's pods ([`LocalTraffic`]).
    NotFromPods,
    /// No detector for the family: none.
    None,
}

impl InternalMasquerade {
    pub fn of(env: &DecisionEnv) -> InternalMasquerade {
        if env.masquerade_all {
            InternalMasquerade::All
        } else if env.local_traffic == LocalTraffic::Unknown {
            InternalMasquerade::None
        } else {
            InternalMasquerade::NotFromPods
        }
    }
}

/// `loadBalancerSourceRanges` of the family: only these sources may reach the load-balancer
/// IPs (checked before DNAT; NodePorts are not subject to them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Firewall {
    /// The ranges (of the family, without zero-length ones, which mean everyone).
    pub ranges: Vec<IpNet>,
    /// A range holds the node's primary IP: the load-balancer IPs are allowed as sources too
    /// (the node's traffic to them may come back SNATed to them).
    pub allow_lb_ips: bool,
}

/// Per-sync counts that feed kube-proxy's `sync_proxy_rules_no_local_endpoints_total`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoLocalEndpoints {
    pub internal: u64,
    pub external: u64,
}

impl NoLocalEndpoints {
    pub fn add(&mut self, other: NoLocalEndpoints) {
        self.internal += other.internal;
        self.external += other.external;
    }

    pub fn sub(&mut self, other: NoLocalEndpoints) {
        self.internal = self.internal.saturating_sub(other.internal);
        self.external = self.external.saturating_sub(other.external);
    }
}

/// Everything kube-proxy decides for one Service port in one family, before any rule.
#[derive(Clone, Debug)]
pub struct PortDecision<'a> {
    pub svc: &'a Service,
    pub port: &'a ServicePort,
    pub family: Family,
    /// Every frontend of the family, kept or not ([`frontends`]).
    pub frontends: Vec<PortFrontend>,
    /// NodePorts, or external or load-balancer IPs that another Service does not keep, in any
    /// family (as [`Suppressed::externally_accessible`]): the port takes external traffic.
    /// kube-proxy's per-family ServicePort counts only the family's addresses; an external
    /// address of the other family alone therefore still makes a port "accessible" here
    /// (endpoint lists and counts as for external traffic, with no external frontend).
    pub externally_accessible: bool,
    /// Which endpoint lists the port needs.
    pub usage: Usage,
    /// The endpoints by use (kube-proxy's `CategorizeEndpoints`: ready first, serving
    /// terminating as fallback, topology hints all-or-nothing).
    pub endpoints: Categorized<'a>,
    /// Traffic to the ClusterIP; `None` when another Service keeps it.
    pub internal: Option<Target>,
    /// Traffic to the external frontends; `None` when the port is not externally accessible.
    pub external: Option<External>,
    /// Which ClusterIP traffic is masqueraded (endpoints reaching themselves always are).
    pub internal_masquerade: InternalMasquerade,
    /// Source ranges for the kept load-balancer IPs, when the port has endpoints.
    pub firewall: Option<Firewall>,
    /// ClientIP session affinity timeout in seconds.
    pub affinity_timeout: Option<u32>,
    /// What this port adds to the no-local-endpoints counts.
    pub no_local_endpoints: NoLocalEndpoints,
    /// The Service's health-check node port (LoadBalancer with externalTrafficPolicy Local),
    /// answered per Service by [`health_check`].
    pub health_check_node_port: Option<u16>,
}

impl<'a> PortDecision<'a> {
    /// The ClusterIP, unless another Service keeps it.
    pub fn cluster_ip(&self) -> Option<IpAddr> {
        self.kept(FrontendKind::ClusterIp)
            .next()
            .and_then(|f| match f {
                Frontend::Addr(ip, _) => Some(ip),
                Frontend::NodePort(_) => None,
            })
    }

    /// The kept frontends of one kind.
    pub fn kept(&self, kind: FrontendKind) -> impl Iterator<Item = Frontend> + '_ {
        self.frontends
            .iter()
            .filter(move |f| f.kind == kind && f.kept)
            .map(|f| f.frontend)
    }

    /// The kept addresses of one kind (ClusterIP, external IPs or load-balancer IPs).
    pub fn kept_ips(&self, kind: FrontendKind) -> impl Iterator<Item = IpAddr> + '_ {
        self.kept(kind).filter_map(|f| match f {
            Frontend::Addr(ip, _) => Some(ip),
            Frontend::NodePort(_) => None,
        })
    }

    /// The NodePort, unless another Service keeps it.
    pub fn node_port(&self) -> Option<u16> {
        self.kept(FrontendKind::NodePort).find_map(|f| match f {
            Frontend::NodePort(np) => Some(np),
            Frontend::Addr(..) => None,
        })
    }

    /// Where external traffic reaches the port: the kept external IPs, load-balancer IPs and
    /// NodePort.
    pub fn external_frontends(&self) -> impl Iterator<Item = Frontend> + '_ {
        self.frontends
            .iter()
            .filter(|f| f.kind != FrontendKind::ClusterIp && f.kept)
            .map(|f| f.frontend)
    }

    /// Whether any frontend of the family is programmed.
    pub fn has_frontends(&self) -> bool {
        self.frontends.iter().any(|f| f.kept)
    }

    /// Some endpoint anywhere is usable (ready, or serving while terminating).
    pub fn has_endpoints(&self) -> bool {
        self.endpoints.has_any
    }

    /// Endpoints for Cluster-policy traffic (empty when the port does not need them).
    pub fn cluster_endpoints(&self) -> &[PortEndpoint<'a>] {
        &self.endpoints.cluster
    }

    /// Endpoints for Local-policy traffic (empty when the port does not need them, or this
    /// node has none).
    pub fn local_endpoints(&self) -> &[PortEndpoint<'a>] {
        &self.endpoints.local
    }

    /// The endpoint list internal traffic uses (`local` for internalTrafficPolicy Local).
    pub fn internal_local(&self) -> bool {
        self.svc.internal_policy_local
    }

    /// The endpoint list external traffic from elsewhere uses (`local` for
    /// externalTrafficPolicy Local).
    pub fn external_local(&self) -> bool {
        self.svc.external_policy_local
    }
}

/// kube-proxy's decision for `port` of `svc` in `env.family`, given its endpoints of the
/// family ([`port_endpoints`]) and what of its frontends other Services keep.
pub fn decide<'a>(
    svc: &'a Service,
    port: &'a ServicePort,
    endpoints: Vec<PortEndpoint<'a>>,
    suppressed: &Suppressed,
    env: &DecisionEnv,
) -> PortDecision<'a> {
    let frontends = frontends(svc, port, env.family, suppressed);
    let cluster_ip_kept = frontends
        .iter()
        .any(|f| f.kind == FrontendKind::ClusterIp && f.kept);
    let externally_accessible = suppressed.externally_accessible(svc, port);
    // Without its ClusterIP (another Service keeps it), the port needs endpoints only for
    // external traffic.
    let usage = if cluster_ip_kept {
        Usage::new(
            svc.internal_policy_local,
            svc.external_policy_local,
            externally_accessible,
        )
    } else {
        Usage {
            uses_cluster: externally_accessible,
            uses_local: svc.external_policy_local && externally_accessible,
        }
    };
    let cat = categorize(endpoints, usage, &env.topology());
    let target = |policy_local: bool| {
        if !cat.has_any {
            Target::Reject
        } else if !policy_local {
            Target::Cluster
        } else if cat.local.is_empty() {
            Target::Drop
        } else {
            Target::Local
        }
    };
    let internal = cluster_ip_kept.then(|| target(svc.internal_policy_local));
    let external = externally_accessible.then(|| External {
        target: target(svc.external_policy_local),
        short_circuit: svc.external_policy_local && cat.has_any,
        masquerade: !svc.external_policy_local,
    });
    let no_local_endpoints = NoLocalEndpoints {
        internal: u64::from(internal == Some(Target::Drop)),
        external: u64::from(external.is_some_and(|e| e.target == Target::Drop)),
    };
    let has_lb_ips = frontends
        .iter()
        .any(|f| f.kind == FrontendKind::LoadBalancerIp && f.kept);
    let firewall = (cat.has_any && has_lb_ips)
        .then(|| {
            let ranges: Vec<IpNet> = svc
                .load_balancer_source_ranges
                .iter()
                .copied()
                .filter(|r| Family::of_net(r) == env.family && r.prefix_len() > 0)
                .collect();
            let allow_lb_ips = env
                .node_ip
                .is_some_and(|ip| ranges.iter().any(|r| r.contains(&ip)));
            Firewall {
                ranges,
                allow_lb_ips,
            }
        })
        .filter(|fw| !fw.ranges.is_empty());
    PortDecision {
        svc,
        port,
        family: env.family,
        frontends,
        externally_accessible,
        usage,
        endpoints: cat,
        internal,
        external,
        internal_masquerade: InternalMasquerade::of(env),
        firewall,
        affinity_timeout: svc.affinity_timeout,
        no_local_endpoints,
        health_check_node_port: svc.health_check_node_port,
    }
}

/// The decisions for every port of `svc` in `env.family` (none for a Service without a
/// ClusterIP of the family: it is not proxied in it). `slices` are the Service's
/// EndpointSlices; `suppressed` says which of its frontends other Services keep
/// ([`crate::conflicts::suppressed`]).
pub fn service_decisions<'a>(
    svc: &'a Service,
    slices: &[&'a EndpointSlice],
    suppressed: &Suppressed,
    env: &DecisionEnv,
) -> Vec<PortDecision<'a>> {
    if svc.cluster_ip(env.family).is_none() {
        return Vec::new();
    }
    // One pass over the addresses instead of one merge per port (a 5,000-endpoint Service of
    // three ports hashed its endpoints three times).
    let merge = svc.ports.len() < 2 || !distinct_addresses(slices, env.family);
    svc.ports
        .iter()
        .map(|port| {
            let endpoints = merged_endpoints(slices, port, env.family, &env.node_name, merge);
            decide(svc, port, endpoints, suppressed, env)
        })
        .collect()
}

/// A Service's health-check node port (LoadBalancer with externalTrafficPolicy Local) and
/// what it answers: the number of distinct IPs of its ready endpoints on this node, per family
/// (kube-proxy's `LocalReadyEndpoints`: terminating endpoints are not ready, so a node whose
/// endpoints are all terminating answers 503 and the load balancer drains it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub node_port: u16,
    /// Indexed by [`Family::ALL`] order: IPv4, IPv6.
    pub local_ready: [usize; 2],
}

impl HealthCheck {
    pub fn local_ready(&self, family: Family) -> usize {
        self.local_ready[usize::from(family == Family::V6)]
    }
}

/// The health check of `svc` (a Service of `cluster`), if it has one.
pub fn health_check(cluster: &Cluster, svc: &Service, node_name: &str) -> Option<HealthCheck> {
    let node_port = svc.health_check_node_port?;
    let count = |family| local_ready_endpoints(cluster, &svc.name, family, node_name);
    Some(HealthCheck {
        node_port,
        local_ready: [count(Family::V4), count(Family::V6)],
    })
}

/// Distinct IPs of the Service's ready endpoints of `family` on node `node_name`, over all its
/// slices with ports (kube-proxy counts every port of the slices, whether the Service has it
/// or not).
pub fn local_ready_endpoints(
    cluster: &Cluster,
    name: &ObjectName,
    family: Family,
    node_name: &str,
) -> usize {
    if node_name.is_empty() {
        return 0;
    }
    cluster
        .slices_of(name)
        .filter(|s| s.family == family && !s.ports.is_empty())
        .flat_map(|s| s.endpoints.iter())
        .filter(|e| e.ready && e.node_name() == Some(node_name))
        .map(|e| e.addr)
        .collect::<BTreeSet<IpAddr>>()
        .len()
}

#[cfg(test)]
mod tests;
