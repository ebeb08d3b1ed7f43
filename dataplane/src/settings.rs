//! The proxy's settings that shape its rules in every backend: the node, masquerading, the
//! local-traffic detector and the NodePort addresses.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::model::Cluster;
use crate::net::Family;

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
