//! Builds the desired nftables table of one family from the cluster model.
//!
//! The shape follows kube-proxy's nftables mode (same base chains, hooks, priorities, map names
//! and chain names) with deliberate differences, because the kernel's work grows with the
//! number of sets, chains and rules: loading them, re-validating the whole table whenever a
//! rule or a `goto` element is added, and visiting every chain on every commit (see
//! docs/architecture.md):
//! - a Service port without session affinity and with at most [`LIST_MAX_ENDPOINTS`]
//!   endpoints has no chain at all. Each of its destinations (ClusterIP, external IP and
//!   load-balancer IP with the port, or the node port) has an endpoint list in the shared map
//!   for lists of its length: entry i of `cluster-endpoints-k` maps `ADDR . PROTO . PORT . i`
//!   to endpoint i. One fixed rule per k, `dnat to ip daddr . meta l4proto . th dport . numgen
//!   random mod k map @cluster-endpoints-k`, DNATs every such Service. What kube-proxy's
//!   external chains do is done by fixed rules too, keyed by sets of destinations
//!   (`masquerade-services`, `local-policy-services` and their NodePort twins). So the table's
//!   chains and rules do not grow with the cluster: adding, changing or deleting such a
//!   Service only adds and removes map elements;
//! - other Service ports keep a chain whose endpoint selection is one rule, `dnat to numgen
//!   random mod M offset O map @endpoints-N`, with its endpoints as intervals of the values `O
//!   .. O+M` in a shared endpoint map. With session affinity they keep kube-proxy's
//!   `endpoint-…` chains (which record the client), reached through a cascade of `numgen random
//!   mod (N-i) 0` rules, and so does a chain whose endpoint map has no free region left;
//! - hairpin traffic (an endpoint reaching itself through its Service) is masqueraded by one
//!   rule in `masquerading` that looks `ip saddr . ip daddr` up in the `hairpin-endpoints` set,
//!   instead of one rule per endpoint;
//! - ClusterIP traffic from outside the pod network is marked for masquerade by one rule in
//!   `services` (`ip daddr @cluster-ips`) instead of one rule per Service chain.

use std::cell::LazyCell;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use data_encoding::BASE32;
use ipnet::IpNet;
use sha2::{Digest, Sha256};

use crate::conflicts::{Suppressed, suppressed};
use crate::convert::slices_by_service;
use crate::model::{Cluster, EndpointSlice, Service, ServicePort};
use crate::ruleset::{
    Action, BaseChain, Chain, ChainName, ChainType, Family, Hook, Key, KeyType, Match, Proto, Rule,
    SLOT_MAX_ENDPOINTS, Set, SetDecl, Table, Value, Verdict, slot_elements, slot_offset,
};
use crate::slots::{SlotSource, Slots};
use crate::topology::{Categorized, NodeTopology, PortEndpoint, Usage, categorize};

/// How to tell traffic that comes from pods on this node (kube-proxy's `detectLocalMode`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LocalDetector {
    /// No detection: no ClusterIP masquerade, no pod short-circuit for eTP=Local.
    None,
    /// `ClusterCIDR`: the configured cluster CIDRs (first per family is used).
    ClusterCidr(Vec<IpNet>),
    /// `NodeCIDR`: the Node's `spec.podCIDRs`.
    NodeCidr,
    /// `BridgeInterface`: packets arriving on this bridge.
    BridgeInterface(String),
    /// `InterfaceNamePrefix`: packets arriving on interfaces named with this prefix.
    InterfaceNamePrefix(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// The Node object's primary IPs (kube-proxy's nftables default).
    Primary,
    /// Local addresses inside these CIDRs; a family without CIDRs, or a zero-length CIDR,
    /// means every local address of that family except loopback.
    Cidrs(Vec<IpNet>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuildConfig {
    pub node_name: String,
    pub masquerade_all: bool,
    /// Bit of the packet mark that asks for masquerade (kube-proxy default 14).
    pub masquerade_bit: u32,
    pub local_detector: LocalDetector,
    pub node_port_addresses: NodePortAddresses,
    /// This host's addresses (for CIDR `nodePortAddresses`).
    pub local_addresses: Vec<IpAddr>,
}

impl Default for BuildConfig {
    fn default() -> BuildConfig {
        BuildConfig {
            node_name: String::new(),
            masquerade_all: false,
            masquerade_bit: 14,
            local_detector: LocalDetector::None,
            node_port_addresses: NodePortAddresses::Primary,
            local_addresses: Vec::new(),
        }
    }
}

// Chain, set and map names, shared with kube-proxy so operators find their way around.
pub const SERVICES: &str = "services";
pub const MASQUERADING: &str = "masquerading";
pub const MARK_FOR_MASQUERADE: &str = "mark-for-masquerade";
pub const REJECT_CHAIN: &str = "reject-chain";
pub const FIREWALL_CHECK: &str = "firewall-check";
pub const SERVICE_ENDPOINTS_CHECK: &str = "service-endpoints-check";
pub const NODEPORT_ENDPOINTS_CHECK: &str = "nodeport-endpoints-check";
pub const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";
pub const CLUSTER_IPS: &str = "cluster-ips";
pub const NODEPORT_IPS: &str = "nodeport-ips";
pub const SERVICE_IPS: &str = "service-ips";
pub const SERVICE_NODEPORTS: &str = "service-nodeports";
pub const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
pub const FIREWALL_IPS: &str = "firewall-ips";
pub const HAIRPIN_ENDPOINTS: &str = "hairpin-endpoints";
pub const NODEPORTS: &str = "nodeports";
pub const MASQUERADE_SERVICES: &str = "masquerade-services";
pub const MASQUERADE_NODEPORTS: &str = "masquerade-nodeports";
pub const LOCAL_POLICY_SERVICES: &str = "local-policy-services";
pub const LOCAL_POLICY_NODEPORTS: &str = "local-policy-nodeports";

/// Most endpoints a Service port may have to be served by the shared endpoint lists rather
/// than a chain of its own; each k up to it has a map and a rule. First packets try the rules
/// in turn, so this stays small (15 missed lookups before the hit did not show in the
/// first-packet latency: docs/architecture.md).
pub const LIST_MAX_ENDPOINTS: usize = 16;

/// The four families of endpoint-list maps and the chains that DNAT through them: by frontend
/// (Service address or node port) and by which endpoints (all, or this node's for a Local
/// traffic policy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndpointLists {
    ClusterServices,
    LocalServices,
    ClusterNodePorts,
    LocalNodePorts,
}

impl EndpointLists {
    pub const ALL: [EndpointLists; 4] = [
        EndpointLists::ClusterServices,
        EndpointLists::LocalServices,
        EndpointLists::ClusterNodePorts,
        EndpointLists::LocalNodePorts,
    ];

    pub fn of(local: bool, nodeport: bool) -> EndpointLists {
        match (local, nodeport) {
            (false, false) => EndpointLists::ClusterServices,
            (true, false) => EndpointLists::LocalServices,
            (false, true) => EndpointLists::ClusterNodePorts,
            (true, true) => EndpointLists::LocalNodePorts,
        }
    }

    pub fn nodeport(self) -> bool {
        matches!(
            self,
            EndpointLists::ClusterNodePorts | EndpointLists::LocalNodePorts
        )
    }

    /// The chain that tries the maps of every k in turn.
    pub fn chain(self) -> &'static str {
        match self {
            EndpointLists::ClusterServices => "cluster-endpoints",
            EndpointLists::LocalServices => "local-endpoints",
            EndpointLists::ClusterNodePorts => "cluster-nodeport-endpoints",
            EndpointLists::LocalNodePorts => "local-nodeport-endpoints",
        }
    }

    /// The map of the lists with `k` endpoints (1 ≤ k ≤ [`LIST_MAX_ENDPOINTS`]).
    pub fn map(self, k: usize) -> &'static str {
        static NAMES: std::sync::LazyLock<Vec<Vec<String>>> = std::sync::LazyLock::new(|| {
            EndpointLists::ALL
                .iter()
                .map(|l| {
                    (1..=LIST_MAX_ENDPOINTS)
                        .map(|k| format!("{}-{k}", l.chain()))
                        .collect()
                })
                .collect()
        });
        &NAMES[self as usize][k - 1]
    }

    fn key_type(self) -> KeyType {
        if self.nodeport() {
            KeyType::ProtoPortIndex
        } else {
            KeyType::AddrProtoPortIndex
        }
    }
}

/// Longest chain-name base (kube-proxy keeps 16 of nftables' 256 bytes for prefixes).
const CHAIN_NAME_BASE_MAX: usize = 240;

/// `HASH-name` with HASH the first 8 base32 characters of sha256(name), truncated like
/// kube-proxy so chain names are identical to its own.
pub fn hash_and_truncate(name: &str) -> String {
    let digest = Sha256::digest(name.as_bytes());
    let encoded = BASE32.encode(&digest);
    let mut out = format!("{}-{name}", &encoded[..8]);
    if out.len() > CHAIN_NAME_BASE_MAX {
        let mut cut = CHAIN_NAME_BASE_MAX - 3;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push_str("...");
    }
    out
}

fn service_port_base(svc: &Service, port: &ServicePort) -> String {
    hash_and_truncate(&format!(
        "{}/{}/{}/{}",
        svc.name.namespace, svc.name.name, port.protocol, port.name
    ))
}

fn endpoint_base(svc: &Service, port: &ServicePort, ep: &PortEndpoint) -> String {
    let host = ep.addr.to_string().replace(':', ".");
    hash_and_truncate(&format!(
        "{}/{}/{}/{}__{}/{}",
        svc.name.namespace, svc.name.name, port.protocol, port.name, host, ep.port
    ))
}

fn host_net(ip: IpAddr) -> IpNet {
    IpNet::from(ip)
}

fn jump(chain: &str) -> Action {
    Action::Verdict(Verdict::Jump(chain.into()))
}

/// A `goto` that shares the target's name with the chain's table entry.
fn goto(chain: &ChainName) -> Action {
    Action::Verdict(Verdict::Goto(chain.clone()))
}

fn base(chain_type: ChainType, hook: Hook, priority: i32) -> Chain {
    Chain {
        base: Some(BaseChain {
            chain_type,
            hook,
            priority,
        }),
        comment: None,
        rules: Arc::default(),
    }
}

/// `[MATCHES] meta l4proto P dnat to EP`.
fn dnat_rule(mut matches: Vec<Match>, proto: Proto, ep: &PortEndpoint) -> Rule {
    matches.push(Match::L4Proto(proto));
    Rule::new(
        matches,
        Action::Dnat {
            addr: ep.addr,
            port: ep.port,
        },
    )
}

fn regular(mut rules: Vec<Rule>) -> Chain {
    // The table keeps these for as long as the Service exists, so spare capacity left by
    // building them would stay allocated too.
    for rule in &mut rules {
        rule.matches.shrink_to_fit();
    }
    rules.shrink_to_fit();
    Chain {
        base: None,
        comment: None,
        rules: Arc::new(rules),
    }
}

fn empty_set(decl: SetDecl) -> Set {
    Set {
        decl,
        elements: BTreeMap::new(),
    }
}

/// An empty map of endpoints (an endpoint map or an endpoint-list map).
fn endpoint_map(key: KeyType) -> Set {
    empty_set(SetDecl::new(key))
}

fn set(key: KeyType, is_vmap: bool, comment: &str) -> Set {
    empty_set(SetDecl {
        is_vmap,
        comment: Some(comment.into()),
        ..SetDecl::new(key)
    })
}

/// Local-traffic detection resolved for one family: (source is local, source is not local).
struct Detector {
    is_local: Option<Match>,
    is_not_local: Option<Match>,
}

fn detector(config: &BuildConfig, cluster: &Cluster, family: Family) -> Detector {
    let from_cidrs = |cidrs: &[IpNet]| match cidrs.iter().find(|c| Family::of_net(c) == family) {
        Some(net) => Detector {
            is_local: Some(Match::Saddr {
                net: *net,
                negate: false,
            }),
            is_not_local: Some(Match::Saddr {
                net: *net,
                negate: true,
            }),
        },
        None => Detector {
            is_local: None,
            is_not_local: None,
        },
    };
    let iif = |name: &str, prefix: bool| Detector {
        is_local: Some(Match::IifName {
            name: name.to_string(),
            prefix,
            negate: false,
        }),
        is_not_local: Some(Match::IifName {
            name: name.to_string(),
            prefix,
            negate: true,
        }),
    };
    match &config.local_detector {
        LocalDetector::None => from_cidrs(&[]),
        LocalDetector::ClusterCidr(cidrs) => from_cidrs(cidrs),
        LocalDetector::NodeCidr => {
            let cidrs = cluster
                .node
                .as_ref()
                .map(|n| n.pod_cidrs.clone())
                .unwrap_or_default();
            from_cidrs(&cidrs)
        }
        LocalDetector::BridgeInterface(name) => iif(name, false),
        LocalDetector::InterfaceNamePrefix(prefix) => iif(prefix, true),
    }
}

/// Which local addresses accept NodePort traffic, per family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortIps {
    /// Every local address except loopback.
    All,
    List(Vec<IpAddr>),
}

/// The addresses `nodePortAddresses` selects for `family`. A CIDR list may select loopback
/// addresses: nftables mode never serves NodePorts on them ([`NodePortIps::without_loopback`]),
/// iptables mode may (`localhostNodePorts`).
pub fn node_port_ips(config: &BuildConfig, cluster: &Cluster, family: Family) -> NodePortIps {
    match &config.node_port_addresses {
        NodePortAddresses::Primary => NodePortIps::List(
            cluster
                .node
                .as_ref()
                .and_then(|n| n.primary_ip(family))
                .into_iter()
                .collect(),
        ),
        NodePortAddresses::Cidrs(cidrs) => {
            let mine: Vec<&IpNet> = cidrs
                .iter()
                .filter(|c| Family::of_net(c) == family)
                .collect();
            if mine.is_empty() || mine.iter().any(|c| c.prefix_len() == 0) {
                return NodePortIps::All;
            }
            let mut ips: Vec<IpAddr> = config
                .local_addresses
                .iter()
                .copied()
                .filter(|a| mine.iter().any(|c| c.contains(a)))
                .collect();
            ips.sort();
            ips.dedup();
            NodePortIps::List(ips)
        }
    }
}

impl NodePortIps {
    pub fn without_loopback(self) -> NodePortIps {
        match self {
            NodePortIps::All => NodePortIps::All,
            NodePortIps::List(mut ips) => {
                ips.retain(|a| !a.is_loopback());
                NodePortIps::List(ips)
            }
        }
    }
}

/// The static part of the table: base chains, helper chains and the (empty) shared maps.
pub fn base_table(config: &BuildConfig, cluster: &Cluster, family: Family) -> Table {
    let mut t = Table::new(family);
    let mark = 1u32 << config.masquerade_bit;
    let c = &mut t.chains;
    c.insert(
        "filter-prerouting-pre-dnat".into(),
        base(ChainType::Filter, Hook::Prerouting, -110),
    );
    c.insert(
        "filter-output-pre-dnat".into(),
        base(ChainType::Filter, Hook::Output, -110),
    );
    c.insert(
        "nat-prerouting".into(),
        base(ChainType::Nat, Hook::Prerouting, -100),
    );
    c.insert(
        "nat-output".into(),
        base(ChainType::Nat, Hook::Output, -100),
    );
    c.insert(
        "filter-input".into(),
        base(ChainType::Filter, Hook::Input, 0),
    );
    c.insert(
        "filter-forward".into(),
        base(ChainType::Filter, Hook::Forward, 0),
    );
    c.insert(
        "filter-output".into(),
        base(ChainType::Filter, Hook::Output, 0),
    );
    c.insert(
        "nat-postrouting".into(),
        base(ChainType::Nat, Hook::Postrouting, 100),
    );

    let new_jump = |target: &str| Rule::new(vec![Match::CtStateNew], jump(target));
    let push = |c: &mut BTreeMap<ChainName, Chain>, chain: &str, rule: Rule| {
        Arc::make_mut(&mut c.get_mut(chain).expect("base chain").rules).push(rule)
    };
    push(c, "filter-prerouting-pre-dnat", new_jump(FIREWALL_CHECK));
    push(c, "filter-output-pre-dnat", new_jump(FIREWALL_CHECK));
    push(c, "filter-input", new_jump(NODEPORT_ENDPOINTS_CHECK));
    push(c, "filter-input", new_jump(SERVICE_ENDPOINTS_CHECK));
    push(c, "filter-forward", new_jump(SERVICE_ENDPOINTS_CHECK));
    push(c, "filter-forward", new_jump(CLUSTER_IPS_CHECK));
    push(c, "filter-output", new_jump(SERVICE_ENDPOINTS_CHECK));
    push(c, "filter-output", new_jump(CLUSTER_IPS_CHECK));
    push(c, "nat-prerouting", Rule::new(vec![], jump(SERVICES)));
    push(c, "nat-output", Rule::new(vec![], jump(SERVICES)));
    push(c, "nat-postrouting", Rule::new(vec![], jump(MASQUERADING)));

    c.insert(
        MARK_FOR_MASQUERADE.into(),
        regular(vec![Rule::new(vec![], Action::MarkOr(mark))]),
    );
    c.insert(
        MASQUERADING.into(),
        regular(vec![
            Rule::new(
                vec![
                    Match::CtStatusDnat,
                    Match::SaddrDaddrInSet {
                        set: HAIRPIN_ENDPOINTS.into(),
                    },
                ],
                Action::MarkOr(mark),
            ),
            Rule::new(
                vec![Match::MarkUnset { mask: mark }],
                Action::Verdict(Verdict::Return),
            ),
            Rule::new(vec![], Action::MarkXor(mark)),
            Rule::new(vec![], Action::Masquerade),
        ]),
    );
    c.insert(
        REJECT_CHAIN.into(),
        Chain {
            base: None,
            comment: Some("helper for @no-endpoint-services / @no-endpoint-nodeports".into()),
            rules: Arc::new(vec![Rule::new(vec![], Action::Reject)]),
        },
    );
    c.insert(
        FIREWALL_CHECK.into(),
        regular(vec![Rule::new(
            vec![],
            Action::VmapAddrProtoPort {
                map: FIREWALL_IPS.into(),
            },
        )]),
    );
    c.insert(
        SERVICE_ENDPOINTS_CHECK.into(),
        regular(vec![Rule::new(
            vec![],
            Action::VmapAddrProtoPort {
                map: NO_ENDPOINT_SERVICES.into(),
            },
        )]),
    );

    let loopback = Match::Daddr {
        net: family.loopback(),
        negate: true,
    };
    let (nodeport_match, nodeport_check_match) =
        match node_port_ips(config, cluster, family).without_loopback() {
            NodePortIps::All => (vec![Match::FibDaddrLocal, loopback.clone()], vec![loopback]),
            NodePortIps::List(ips) => {
                let mut s = set(KeyType::Addr, false, "IPs that accept NodePort traffic");
                s.elements = ips.into_iter().map(|ip| (Key::Addr(ip), None)).collect();
                t.sets.insert(NODEPORT_IPS.into(), s);
                let m = Match::DaddrInSet {
                    set: NODEPORT_IPS.into(),
                };
                (vec![m.clone()], vec![m])
            }
        };
    let det = detector(config, cluster, family);
    // ClusterIP traffic from outside the pod network (or all of it with masqueradeAll) is
    // masqueraded: one rule for every ClusterIP instead of one per Service chain.
    let cluster_ip = Match::DaddrInSet {
        set: CLUSTER_IPS.into(),
    };
    let masquerade = if config.masquerade_all {
        Some(vec![cluster_ip])
    } else {
        det.is_not_local.clone().map(|m| vec![cluster_ip, m])
    };
    let mut services = Vec::new();
    if let Some(matches) = masquerade {
        services.push(Rule::new(matches, jump(MARK_FOR_MASQUERADE)));
    }
    let frontend_in = |set: &str| Match::AddrProtoPortInSet { set: set.into() };
    let nodeport_in = |set: &str| Match::ProtoPortInSet { set: set.into() };
    services.extend([
        Rule::new(
            vec![],
            Action::VmapAddrProtoPort {
                map: SERVICE_IPS.into(),
            },
        ),
        Rule::new(
            vec![frontend_in(LOCAL_POLICY_SERVICES)],
            goto(&LOCAL_POLICY_SERVICES.into()),
        ),
        Rule::new(
            vec![frontend_in(MASQUERADE_SERVICES)],
            jump(MARK_FOR_MASQUERADE),
        ),
        Rule::new(vec![], jump(EndpointLists::ClusterServices.chain())),
        Rule::new(vec![], jump(EndpointLists::LocalServices.chain())),
        Rule::new(nodeport_match, jump(NODEPORTS)),
    ]);
    let nodeports = vec![
        Rule::new(
            vec![],
            Action::VmapProtoPort {
                map: SERVICE_NODEPORTS.into(),
            },
        ),
        Rule::new(
            vec![nodeport_in(LOCAL_POLICY_NODEPORTS)],
            goto(&LOCAL_POLICY_NODEPORTS.into()),
        ),
        Rule::new(
            vec![nodeport_in(MASQUERADE_NODEPORTS)],
            jump(MARK_FOR_MASQUERADE),
        ),
        Rule::new(
            vec![],
            goto(&EndpointLists::ClusterNodePorts.chain().into()),
        ),
    ];
    // External traffic to a Service with externalTrafficPolicy Local (what each such
    // Service's external chain does in kube-proxy, shared).
    let local_policy = |cluster: EndpointLists, local: EndpointLists| {
        regular(local_policy_rules(
            &det,
            &cluster.chain().into(),
            Some(&local.chain().into()),
        ))
    };
    let c = &mut t.chains;
    c.insert(SERVICES.into(), regular(services));
    c.insert(NODEPORTS.into(), regular(nodeports));
    c.insert(
        LOCAL_POLICY_SERVICES.into(),
        local_policy(EndpointLists::ClusterServices, EndpointLists::LocalServices),
    );
    c.insert(
        LOCAL_POLICY_NODEPORTS.into(),
        local_policy(
            EndpointLists::ClusterNodePorts,
            EndpointLists::LocalNodePorts,
        ),
    );
    for lists in EndpointLists::ALL {
        let rules = (1..=LIST_MAX_ENDPOINTS)
            .map(|k| {
                Rule::new(
                    vec![],
                    Action::DnatIndexed {
                        map: lists.map(k).into(),
                        nodeport: lists.nodeport(),
                        modulus: k as u32,
                    },
                )
            })
            .collect();
        c.insert(lists.chain().into(), regular(rules));
    }
    c.insert(
        NODEPORT_ENDPOINTS_CHECK.into(),
        regular(vec![Rule::new(
            nodeport_check_match,
            Action::VmapProtoPort {
                map: NO_ENDPOINT_NODEPORTS.into(),
            },
        )]),
    );
    let mut cluster_ips_check = vec![
        Rule::new(
            vec![Match::DaddrInSet {
                set: CLUSTER_IPS.into(),
            }],
            Action::Reject,
        )
        .with_comment("Reject traffic to invalid ports of ClusterIPs"),
    ];
    for cidr in cluster.service_cidrs(family) {
        cluster_ips_check.push(
            Rule::new(
                vec![Match::Daddr {
                    net: cidr,
                    negate: false,
                }],
                Action::Verdict(Verdict::Drop),
            )
            .with_comment("Drop traffic to unallocated ClusterIPs"),
        );
    }
    c.insert(CLUSTER_IPS_CHECK.into(), regular(cluster_ips_check));

    t.sets.insert(
        CLUSTER_IPS.into(),
        set(KeyType::Addr, false, "Active ClusterIPs"),
    );
    t.sets.insert(
        HAIRPIN_ENDPOINTS.into(),
        set(
            KeyType::AddrPair,
            false,
            "endpoints masqueraded when they reach themselves through a Service",
        ),
    );
    for (name, key, comment) in [
        (
            SERVICE_IPS,
            KeyType::AddrProtoPort,
            "ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        (SERVICE_NODEPORTS, KeyType::ProtoPort, "NodePort traffic"),
        (
            NO_ENDPOINT_SERVICES,
            KeyType::AddrProtoPort,
            "vmap to drop or reject packets to services with no endpoints",
        ),
        (
            NO_ENDPOINT_NODEPORTS,
            KeyType::ProtoPort,
            "vmap to drop or reject packets to service nodeports with no endpoints",
        ),
        (
            FIREWALL_IPS,
            KeyType::AddrProtoPort,
            "destinations that are subject to LoadBalancerSourceRanges",
        ),
    ] {
        t.sets.insert(name.into(), set(key, true, comment));
    }
    for (name, key, comment) in [
        (
            MASQUERADE_SERVICES,
            KeyType::AddrProtoPort,
            "external IPs and load-balancer IPs of Services with externalTrafficPolicy Cluster",
        ),
        (
            MASQUERADE_NODEPORTS,
            KeyType::ProtoPort,
            "NodePorts of Services with externalTrafficPolicy Cluster",
        ),
        (
            LOCAL_POLICY_SERVICES,
            KeyType::AddrProtoPort,
            "external IPs and load-balancer IPs of Services with externalTrafficPolicy Local",
        ),
        (
            LOCAL_POLICY_NODEPORTS,
            KeyType::ProtoPort,
            "NodePorts of Services with externalTrafficPolicy Local",
        ),
    ] {
        t.sets.insert(name.into(), set(key, false, comment));
    }
    for lists in EndpointLists::ALL {
        for k in 1..=LIST_MAX_ENDPOINTS {
            t.sets
                .insert(lists.map(k).into(), endpoint_map(lists.key_type()));
        }
    }
    t
}

/// What kube-proxy's external chain of a Service with externalTrafficPolicy Local does: pod and
/// host sources go to all endpoints (`cluster`, host sources masqueraded), the rest to this
/// node's (`local`, if it has any).
fn local_policy_rules(det: &Detector, cluster: &ChainName, local: Option<&ChainName>) -> Vec<Rule> {
    let mut rules = Vec::new();
    if let Some(m) = &det.is_local {
        rules.push(
            Rule::new(vec![m.clone()], goto(cluster)).with_comment("short-circuit pod traffic"),
        );
    }
    rules.extend([
        Rule::new(vec![Match::FibSaddrLocal], jump(MARK_FOR_MASQUERADE))
            .with_comment("masquerade local traffic"),
        Rule::new(vec![Match::FibSaddrLocal], goto(cluster))
            .with_comment("short-circuit local traffic"),
    ]);
    rules.extend(local.map(|local| Rule::new(vec![], goto(local))));
    rules
}

/// Per-sync counts that feed kube-proxy's `no_local_endpoints` metric.
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

/// The result of building one family's table.
#[derive(Clone, Debug)]
pub struct Built {
    pub table: Table,
    pub no_local_endpoints: NoLocalEndpoints,
}

/// The endpoints of one Service port in one family, merged across slices (first wins).
pub fn port_endpoints(
    slices: &[&EndpointSlice],
    port: &ServicePort,
    family: Family,
    node_name: &str,
) -> Vec<PortEndpoint> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for slice in slices.iter().filter(|s| s.family == family) {
        let Some(sp) = slice
            .ports
            .iter()
            .find(|p| p.name == port.name && p.protocol == port.protocol)
        else {
            continue;
        };
        for e in &slice.endpoints {
            if !seen.insert((e.addr, sp.port)) {
                continue;
            }
            out.push(PortEndpoint {
                addr: e.addr,
                port: sp.port,
                ready: e.ready,
                serving: e.serving,
                terminating: e.terminating,
                local: e.node_name.as_deref() == Some(node_name) && !node_name.is_empty(),
                zone_hints: e.zone_hints.to_vec(),
                node_hints: e.node_hints.to_vec(),
            });
        }
    }
    out
}

/// What one family's table needs from the cluster beyond the Service itself, resolved once per
/// build.
pub struct BuildEnv<'a> {
    config: &'a BuildConfig,
    family: Family,
    det: Detector,
    zone: Option<String>,
    node_ip: Option<IpAddr>,
}

impl<'a> BuildEnv<'a> {
    pub fn new(cluster: &Cluster, config: &'a BuildConfig, family: Family) -> BuildEnv<'a> {
        BuildEnv {
            config,
            family,
            det: detector(config, cluster, family),
            zone: cluster
                .node
                .as_ref()
                .and_then(|n| n.zone())
                .map(str::to_string),
            node_ip: cluster.node.as_ref().and_then(|n| n.primary_ip(family)),
        }
    }
}

/// What one Service contributes to a family's table: its own chains and sets, and its elements
/// of the shared maps (keyed by map name).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Part {
    pub chains: BTreeMap<ChainName, Chain>,
    pub sets: BTreeMap<String, Set>,
    pub elements: BTreeMap<(&'static str, Key), Option<Value>>,
    pub no_local_endpoints: NoLocalEndpoints,
}

impl Part {
    /// Creates the endpoint maps this part has elements in and `table` lacks: an endpoint map
    /// (see [`crate::ruleset::Action::DnatSlot`]) exists while it has elements.
    fn add_endpoint_maps(&self, table: &mut Table) {
        for (set, key) in self.elements.keys() {
            if key.key_type() == KeyType::Slot && !table.sets.contains_key(*set) {
                table
                    .sets
                    .insert(set.to_string(), endpoint_map(KeyType::Slot));
            }
        }
    }

    /// Adds this part's chains and sets to `table`, and the endpoint maps its elements need.
    pub fn merge_structure_into(&self, table: &mut Table) {
        self.add_endpoint_maps(table);
        for (name, chain) in &self.chains {
            table.chains.insert(name.clone(), chain.clone());
        }
        for (name, set) in &self.sets {
            table.sets.insert(name.clone(), set.clone());
        }
    }

    /// Adds this part to `table`; an element of a map the table lacks is ignored, except that
    /// endpoint maps are created when their first element arrives.
    pub fn merge_into(&self, table: &mut Table) {
        self.merge_structure_into(table);
        for ((set, key), value) in &self.elements {
            if let Some(s) = table.sets.get_mut(*set) {
                s.elements.insert(*key, value.clone());
            }
        }
    }
}

/// What a Service port needs its endpoints for, with only the frontends it keeps (see
/// [`crate::conflicts`]): without its ClusterIP (another Service keeps it), only for external
/// traffic.
pub fn port_usage(
    svc: &Service,
    port: &ServicePort,
    cluster_ip: Option<IpAddr>,
    suppressed: &Suppressed,
) -> Usage {
    let external = suppressed.externally_accessible(svc, port);
    match cluster_ip {
        Some(_) => Usage::new(
            svc.internal_policy_local,
            svc.external_policy_local,
            external,
        ),
        None => Usage {
            uses_cluster: external,
            uses_local: svc.external_policy_local && external,
        },
    }
}

/// The part of `family`'s table that Service `svc` (with its EndpointSlices) accounts for.
/// `slots` gives the Service chains their endpoint-map regions; `suppressed` says which of its
/// frontends other Services keep ([`crate::conflicts::suppressed`] in the Service's cluster).
pub fn service_part<'s>(
    svc: &Service,
    slices: impl IntoIterator<Item = &'s EndpointSlice>,
    env: &BuildEnv<'_>,
    slots: &mut SlotSource<'_>,
    suppressed: &Suppressed,
) -> Part {
    let mut part = Part::default();
    // Not proxied in a family it has no ClusterIP of.
    if svc.cluster_ip(env.family).is_none() {
        return part;
    }
    let cluster_ip = suppressed.cluster_ip(svc, env.family);
    let slices: Vec<&EndpointSlice> = slices.into_iter().collect();
    let topo = NodeTopology {
        node_name: &env.config.node_name,
        zone: env.zone.as_deref(),
    };
    for port in &svc.ports {
        let endpoints = port_endpoints(&slices, port, env.family, &env.config.node_name);
        let ctx = PortContext {
            svc,
            port,
            family: env.family,
            cluster_ip,
            suppressed,
            det: &env.det,
            node_ip: env.node_ip,
        };
        let usage = port_usage(svc, port, cluster_ip, suppressed);
        let cat = categorize(&endpoints, usage, &topo);
        ctx.add(&mut part, &cat, usage, slots);
    }
    part
}

/// Builds the complete desired table of `family`.
pub fn build(cluster: &Cluster, config: &BuildConfig, family: Family) -> Built {
    let mut table = base_table(config, cluster, family);
    let mut counts = NoLocalEndpoints::default();
    let env = BuildEnv::new(cluster, config, family);
    let by_service = slices_by_service(&cluster.slices);
    let mut slots = Slots::new();
    for svc in cluster.services.values() {
        let slices = by_service.get(&svc.name).into_iter().flatten().copied();
        let sup = suppressed(&cluster.services, svc);
        let part = service_part(svc, slices, &env, &mut SlotSource::Assign(&mut slots), &sup);
        part.merge_into(&mut table);
        counts.add(part.no_local_endpoints);
    }
    table.fit_set_sizes(|_| None);
    Built {
        table,
        no_local_endpoints: counts,
    }
}

struct PortContext<'a> {
    svc: &'a Service,
    port: &'a ServicePort,
    family: Family,
    /// The Service's ClusterIP of the family, unless another Service keeps it.
    cluster_ip: Option<IpAddr>,
    /// The frontends other Services keep.
    suppressed: &'a Suppressed,
    det: &'a Detector,
    /// The Node's primary IP of this family (for the load-balancer source-range exception).
    node_ip: Option<IpAddr>,
}

fn insert_element(part: &mut Part, set: &'static str, key: Key, value: Option<Verdict>) {
    part.elements.insert((set, key), value.map(Value::Verdict));
}

/// The chains a Service port may have.
struct ChainNames {
    cluster: ChainName,
    local: ChainName,
    external: ChainName,
    firewall: ChainName,
}

impl ChainNames {
    fn of(svc: &Service, port: &ServicePort) -> ChainNames {
        let base = service_port_base(svc, port);
        ChainNames {
            cluster: format!("service-{base}").into(),
            local: format!("local-{base}").into(),
            external: format!("external-{base}").into(),
            firewall: format!("firewall-{base}").into(),
        }
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

/// Where external or internal traffic reaches a Service port.
#[derive(Clone, Copy, Debug)]
enum Frontend {
    /// A ClusterIP, external IP or load-balancer IP, and the port.
    Addr(IpAddr, u16),
    /// A node port on the node's NodePort addresses.
    NodePort(u16),
}

impl Frontend {
    fn key(self, proto: Proto) -> Key {
        match self {
            Frontend::Addr(ip, port) => Key::AddrProtoPort(ip, proto, port),
            Frontend::NodePort(port) => Key::ProtoPort(proto, port),
        }
    }

    /// `services` for an address, `nodeports` for a node port.
    fn pick(self, services: &'static str, nodeports: &'static str) -> &'static str {
        match self {
            Frontend::Addr(..) => services,
            Frontend::NodePort(_) => nodeports,
        }
    }
}

/// Adds the endpoint list of `frontend` (at most [`LIST_MAX_ENDPOINTS`] endpoints): entry i of
/// the map for k endpoints DNATs to endpoint i.
fn list_elements(
    part: &mut Part,
    frontend: Frontend,
    proto: Proto,
    local: bool,
    eps: &[PortEndpoint],
) {
    let lists = EndpointLists::of(local, matches!(frontend, Frontend::NodePort(_)));
    let map = lists.map(eps.len());
    for (i, ep) in (0u8..).zip(eps) {
        let key = frontend
            .key(proto)
            .list_entry(i)
            .expect("a destination key");
        part.elements
            .insert((map, key), Some(Value::Endpoint(ep.addr, ep.port)));
    }
}

impl PortContext<'_> {
    fn comment(&self) -> String {
        port_label(self.svc, self.port)
    }

    fn add(&self, part: &mut Part, cat: &Categorized, usage: Usage, slots: &mut SlotSource<'_>) {
        let proto = self.port.protocol;
        let port = self.port.port;
        let svc = self.svc;
        // The names cost a SHA-256, and most Service ports have no chain.
        let names = LazyCell::new(|| ChainNames::of(svc, self.port));
        let reject = Some(Verdict::Goto(REJECT_CHAIN.into()));
        let sup = self.suppressed;
        let lb_ips: Vec<IpAddr> = sup
            .kept(&svc.load_balancer_ips, self.port, self.family)
            .collect();
        // Where external traffic reaches the port (the frontends it keeps).
        let mut frontends: Vec<Frontend> = sup
            .kept(&svc.external_ips, self.port, self.family)
            .chain(lb_ips.iter().copied())
            .map(|ip| Frontend::Addr(ip, port))
            .collect();
        frontends.extend(self.port.node_port.map(Frontend::NodePort));
        if self.cluster_ip.is_none() && frontends.is_empty() {
            return;
        }
        let cip_key = self
            .cluster_ip
            .map(|ip| Key::AddrProtoPort(ip, proto, port));
        if let Some(ip) = self.cluster_ip {
            insert_element(part, CLUSTER_IPS, Key::Addr(ip), None);
        }

        if !cat.has_any {
            if let Some(key) = cip_key {
                insert_element(part, NO_ENDPOINT_SERVICES, key, reject.clone());
            }
            for frontend in &frontends {
                let map = frontend.pick(NO_ENDPOINT_SERVICES, NO_ENDPOINT_NODEPORTS);
                insert_element(part, map, frontend.key(proto), reject.clone());
            }
            return;
        }

        // Endpoints are DNATed to straight from the cascade; with session affinity each gets
        // an endpoint chain that also records the client.
        let affinity_chains: BTreeMap<(IpAddr, u16), (ChainName, String)> =
            match svc.affinity_timeout {
                None => BTreeMap::new(),
                Some(timeout) => cat
                    .all_reachable
                    .iter()
                    .map(|ep| {
                        let eb = endpoint_base(svc, self.port, ep);
                        let name: ChainName = format!("endpoint-{eb}").into();
                        let affinity = format!("affinity-{eb}");
                        let mut chain = regular(vec![
                            Rule::new(
                                vec![],
                                Action::UpdateSaddr {
                                    set: affinity.clone(),
                                },
                            ),
                            dnat_rule(vec![], proto, ep),
                        ]);
                        chain.comment = Some(
                            format!(
                                "{} -> {}",
                                self.comment(),
                                std::net::SocketAddr::new(ep.addr, ep.port)
                            )
                            .into(),
                        );
                        part.chains.insert(name.clone(), chain);
                        part.sets.insert(
                            affinity.clone(),
                            empty_set(SetDecl {
                                timeout_secs: Some(timeout),
                                ..SetDecl::new(KeyType::Addr)
                            }),
                        );
                        ((ep.addr, ep.port), (name, affinity))
                    })
                    .collect(),
            };
        for ep in &cat.all_reachable {
            insert_element(part, HAIRPIN_ENDPOINTS, Key::AddrPair(ep.addr), None);
        }
        let dispatch = |part: &mut Part,
                        chain: &ChainName,
                        eps: &[PortEndpoint],
                        slots: &mut SlotSource<'_>|
         -> Vec<Rule> {
            if affinity_chains.is_empty()
                && eps.len() <= SLOT_MAX_ENDPOINTS
                && let Some(slot) = slots.pick(chain)
            {
                let offset = slot_offset(slot.region);
                let targets: Vec<(IpAddr, u16)> = eps.iter().map(|ep| (ep.addr, ep.port)).collect();
                for (key, value) in slot_elements(offset, &targets) {
                    part.elements.insert((slot.map_name(), key), Some(value));
                }
                return vec![Rule::new(
                    vec![Match::L4Proto(proto)],
                    Action::DnatSlot {
                        map: slot.map_name(),
                        offset,
                    },
                )];
            }
            let mut rules = Vec::new();
            for ep in eps {
                if let Some((chain, affinity)) = affinity_chains.get(&(ep.addr, ep.port)) {
                    rules.push(Rule::new(
                        vec![Match::SaddrInSet {
                            set: affinity.clone(),
                        }],
                        goto(chain),
                    ));
                }
            }
            let n = eps.len();
            for (i, ep) in eps.iter().enumerate() {
                let remaining = (n - i) as u32;
                let matches = if remaining > 1 {
                    vec![Match::Numgen {
                        modulus: remaining,
                        value: 0,
                    }]
                } else {
                    vec![]
                };
                rules.push(match affinity_chains.get(&(ep.addr, ep.port)) {
                    Some((chain, _)) => Rule::new(matches, goto(chain)),
                    None => dnat_rule(matches, proto, ep),
                });
            }
            rules
        };

        let uses_cluster_chain = !cat.cluster.is_empty() && usage.uses_cluster;
        let uses_local_chain = !cat.local.is_empty() && usage.uses_local;
        // Without session affinity and with short enough endpoint lists, the Service port
        // needs no chain: its frontends' endpoint lists are map elements that the shared
        // `…-endpoints` chains DNAT to.
        let direct = affinity_chains.is_empty()
            && cat.cluster.len() <= LIST_MAX_ENDPOINTS
            && cat.local.len() <= LIST_MAX_ENDPOINTS;
        if !direct && uses_cluster_chain {
            let mut chain = regular(dispatch(part, &names.cluster, &cat.cluster, slots));
            chain.comment = Some(self.comment().into());
            part.chains.insert(names.cluster.clone(), chain);
        }
        if !direct && uses_local_chain {
            let mut chain = regular(dispatch(part, &names.local, &cat.local, slots));
            chain.comment = Some(self.comment().into());
            part.chains.insert(names.local.clone(), chain);
        }
        let list = |part: &mut Part, frontend: Frontend, local: bool| {
            let (eps, used) = if local {
                (&cat.local, uses_local_chain)
            } else {
                (&cat.cluster, uses_cluster_chain)
            };
            if used {
                list_elements(part, frontend, proto, local, eps);
            }
        };

        // Internal (ClusterIP) traffic, unless another Service keeps the ClusterIP.
        let has_internal = !(svc.internal_policy_local && cat.local.is_empty());
        if let (Some(cluster_ip), Some(cip_key)) = (self.cluster_ip, cip_key) {
            if has_internal {
                if direct {
                    list(
                        part,
                        Frontend::Addr(cluster_ip, port),
                        svc.internal_policy_local,
                    );
                } else {
                    let internal_chain = if svc.internal_policy_local {
                        &names.local
                    } else {
                        &names.cluster
                    };
                    insert_element(
                        part,
                        SERVICE_IPS,
                        cip_key,
                        Some(Verdict::Goto(internal_chain.clone())),
                    );
                }
            } else {
                part.no_local_endpoints.internal += 1;
                insert_element(part, NO_ENDPOINT_SERVICES, cip_key, Some(Verdict::Drop));
            }
        }

        // External (NodePort, external IP, load balancer IP) traffic.
        if !sup.externally_accessible(svc, self.port) {
            return;
        }
        let has_external = !(svc.external_policy_local && cat.local.is_empty());
        if direct {
            for frontend in &frontends {
                let policy = if svc.external_policy_local {
                    frontend.pick(LOCAL_POLICY_SERVICES, LOCAL_POLICY_NODEPORTS)
                } else {
                    frontend.pick(MASQUERADE_SERVICES, MASQUERADE_NODEPORTS)
                };
                insert_element(part, policy, frontend.key(proto), None);
                list(part, *frontend, false);
                if svc.external_policy_local {
                    list(part, *frontend, true);
                }
            }
        } else {
            let rules = if svc.external_policy_local {
                let local = uses_local_chain.then_some(&names.local);
                local_policy_rules(self.det, &names.cluster, local)
            } else {
                vec![
                    Rule::new(vec![], jump(MARK_FOR_MASQUERADE)),
                    Rule::new(vec![], goto(&names.cluster)),
                ]
            };
            let mut chain = regular(rules);
            chain.comment = Some(self.comment().into());
            part.chains.insert(names.external.clone(), chain);
            let to_external = Some(Verdict::Goto(names.external.clone()));
            for frontend in &frontends {
                let map = frontend.pick(SERVICE_IPS, SERVICE_NODEPORTS);
                insert_element(part, map, frontend.key(proto), to_external.clone());
            }
        }
        if !has_external {
            for frontend in &frontends {
                let map = frontend.pick(NO_ENDPOINT_SERVICES, NO_ENDPOINT_NODEPORTS);
                insert_element(part, map, frontend.key(proto), Some(Verdict::Drop));
            }
            part.no_local_endpoints.external += 1;
        }

        // loadBalancerSourceRanges, checked before DNAT.
        let ranges: Vec<IpNet> = svc
            .load_balancer_source_ranges
            .iter()
            .copied()
            .filter(|r| Family::of_net(r) == self.family && r.prefix_len() > 0)
            .collect();
        if !lb_ips.is_empty() && !ranges.is_empty() {
            let mut allowed = ranges.clone();
            let node_ip = self.node_ip;
            if node_ip.is_some_and(|ip| ranges.iter().any(|r| r.contains(&ip))) {
                allowed.extend(lb_ips.iter().map(|ip| host_net(*ip)));
            }
            let mut rules: Vec<Rule> = allowed
                .into_iter()
                .map(|net| {
                    Rule::new(
                        vec![Match::Saddr { net, negate: false }],
                        Action::Verdict(Verdict::Return),
                    )
                })
                .collect();
            rules.push(Rule::new(vec![], Action::Verdict(Verdict::Drop)));
            let mut chain = regular(rules);
            chain.comment = Some(self.comment().into());
            part.chains.insert(names.firewall.clone(), chain);
            for ip in &lb_ips {
                insert_element(
                    part,
                    FIREWALL_IPS,
                    Key::AddrProtoPort(*ip, proto, port),
                    Some(Verdict::Goto(names.firewall.clone())),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_names_match_kube_proxy() {
        assert_eq!(
            hash_and_truncate("ns1/svc1/tcp/p80"),
            "ULMVA6XW-ns1/svc1/tcp/p80"
        );
        assert_eq!(
            hash_and_truncate("ns2/svc2/tcp/p80"),
            "42NFTM6N-ns2/svc2/tcp/p80"
        );
        assert_eq!(
            hash_and_truncate("testing/service/tcp/http"),
            "P4ZYZVCF-testing/service/tcp/http"
        );
        assert_eq!(
            hash_and_truncate("ns1/svc1/tcp/p80__10.180.0.1/80"),
            "5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
        );
        assert_eq!(
            hash_and_truncate("testing/service/tcp/http__fd80.abcd.12..a1b2.c3d4.e5f6.9999/80"),
            "U7E2ET36-testing/service/tcp/http__fd80.abcd.12..a1b2.c3d4.e5f6.9999/80"
        );
        let long = hash_and_truncate(&"x".repeat(300));
        assert_eq!(long.len(), CHAIN_NAME_BASE_MAX);
        assert!(long.ends_with("..."));
    }
}
