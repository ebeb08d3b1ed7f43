//! The Service model nftproxy computes rules from: validated, normalised, family-aware.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::ruleset::{Family, Proto};

/// `namespace/name` of a Kubernetes object.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectName {
    pub namespace: String,
    pub name: String,
}

impl ObjectName {
    pub fn new(namespace: &str, name: &str) -> ObjectName {
        ObjectName {
            namespace: namespace.to_string(),
            name: name.to_string(),
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

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    /// The port's name (may be empty for a single unnamed port).
    pub name: String,
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
    /// At most one per family.
    pub cluster_ips: Vec<IpAddr>,
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` whose `ipMode` is `VIP` or unset.
    pub load_balancer_ips: Vec<IpAddr>,
    pub load_balancer_source_ranges: Vec<IpNet>,
    pub external_policy_local: bool,
    pub internal_policy_local: bool,
    pub health_check_node_port: Option<u16>,
    /// ClientIP session affinity timeout in seconds.
    pub affinity_timeout: Option<u32>,
    pub ports: Vec<ServicePort>,
}

impl Service {
    pub fn cluster_ip(&self, family: Family) -> Option<IpAddr> {
        self.cluster_ips
            .iter()
            .copied()
            .find(|ip| Family::of(ip) == family)
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
    pub node_name: Option<String>,
    pub zone_hints: Vec<String>,
    pub node_hints: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointPort {
    pub name: String,
    pub protocol: Proto,
    pub port: u16,
}

/// A discovery.k8s.io/v1 EndpointSlice reduced to what the proxy needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSlice {
    pub name: ObjectName,
    pub service: ObjectName,
    pub family: Family,
    pub ports: Vec<EndpointPort>,
    pub endpoints: Vec<Endpoint>,
    /// `endpoints.kubernetes.io/last-change-trigger-time`, as written.
    pub trigger_time: Option<String>,
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
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cluster {
    pub services: BTreeMap<ObjectName, Service>,
    pub slices: BTreeMap<ObjectName, EndpointSlice>,
    pub node: Option<Node>,
    pub service_cidrs: BTreeMap<String, Vec<IpNet>>,
}

impl Cluster {
    /// The EndpointSlices of one Service, in name order.
    pub fn slices_of<'a>(
        &'a self,
        service: &'a ObjectName,
    ) -> impl Iterator<Item = &'a EndpointSlice> + 'a {
        self.slices.values().filter(move |s| &s.service == service)
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
