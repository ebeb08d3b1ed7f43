//! Conversion from Kubernetes API objects (k8s-openapi types) into the model, with validation.
//!
//! Every function returns a reason when the object cannot be used; callers skip that object,
//! log the reason and keep everything else working.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::SystemTime;

use ipnet::IpNet;
use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::api::networking::v1 as networking;
use k8s_openapi::jiff::Timestamp;

use crate::model::{
    Endpoint, EndpointPort, EndpointSlice, Endpoints, Hints, Node, ObjectName, Service,
    ServicePort, ServiceType, Shared, Slices,
};
use crate::net::{Family, Proto};

pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10800;

/// Why an object was not converted. `Ignored` objects are valid but not proxied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Skip {
    /// What is wrong (its metric label), and the message that says where.
    #[error("{1}")]
    Invalid(Invalid, String),
    #[error("not proxied: {0}")]
    Ignored(&'static str),
}

impl Skip {
    /// Short machine-readable reason, for metric labels (`nftproxy_invalid_objects`'s
    /// `reason` for invalid objects).
    pub fn label(&self) -> &'static str {
        match self {
            Skip::Invalid(kind, _) => kind.label(),
            Skip::Ignored(r) => r,
        }
    }

    /// The same problem, said of a part of the object (`at: message`).
    fn at(self, at: &str) -> Skip {
        match self {
            Skip::Invalid(kind, m) => Skip::Invalid(kind, format!("{at}: {m}")),
            ignored => ignored,
        }
    }
}

/// The kinds of invalid object, each with its metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Invalid {
    Ip,
    Cidr,
    /// A port, or another bounded number, out of its range.
    OutOfRange,
    UnknownProtocol,
    DuplicatePort,
    /// The object does not parse as its kind.
    Schema,
    MissingField,
    /// An enumerated field holds a value Kubernetes does not define.
    UnknownValue,
    Other,
}

impl Invalid {
    /// The `reason` label of `nftproxy_invalid_objects`.
    pub fn label(self) -> &'static str {
        match self {
            Invalid::Ip => "invalid_ip",
            Invalid::Cidr => "invalid_cidr",
            // The label predates other ranges (session affinity timeouts) counted with it.
            Invalid::OutOfRange => "port_out_of_range",
            Invalid::UnknownProtocol => "unknown_protocol",
            Invalid::DuplicatePort => "duplicate_port",
            Invalid::Schema => "schema",
            Invalid::MissingField => "missing_field",
            Invalid::UnknownValue => "unknown_value",
            Invalid::Other => "other",
        }
    }

    /// Every kind (metric tests).
    pub const ALL: [Invalid; 9] = [
        Invalid::Ip,
        Invalid::Cidr,
        Invalid::OutOfRange,
        Invalid::UnknownProtocol,
        Invalid::DuplicatePort,
        Invalid::Schema,
        Invalid::MissingField,
        Invalid::UnknownValue,
        Invalid::Other,
    ];
}

fn invalid<T>(kind: Invalid, msg: impl Into<String>) -> Result<T, Skip> {
    Err(Skip::Invalid(kind, msg.into()))
}

/// Parses an IP address the way Kubernetes' `ParseIPSloppy` does: IPv4 parts with leading zeros
/// are decimal (`172.30.0.041` is 172.30.0.41), not octal and not an error.
pub fn parse_ip_sloppy(s: &str) -> Option<IpAddr> {
    let s = s.trim();
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip);
    }
    let parts: Vec<&str> = s.split('.').collect();
    if parts.len() != 4 {
        return None;
    }
    let mut octets = [0u8; 4];
    for (o, p) in octets.iter_mut().zip(&parts) {
        if p.is_empty() || p.len() > 3 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *o = p.parse::<u8>().ok()?;
    }
    Some(IpAddr::V4(Ipv4Addr::from(octets)))
}

/// Parses a CIDR sloppily (leading zeros, surrounding whitespace) and truncates host bits.
pub fn parse_cidr_sloppy(s: &str) -> Option<IpNet> {
    let s = s.trim();
    let (addr, len) = s.split_once('/')?;
    let addr = parse_ip_sloppy(addr)?;
    let len: u8 = len.trim().parse().ok()?;
    IpNet::new(addr, len).ok().map(|n| n.trunc())
}

pub fn parse_protocol(p: Option<&str>) -> Result<Proto, Skip> {
    match p.unwrap_or("TCP") {
        "TCP" => Ok(Proto::Tcp),
        "UDP" => Ok(Proto::Udp),
        "SCTP" => Ok(Proto::Sctp),
        other => invalid(
            Invalid::UnknownProtocol,
            format!("unknown protocol {other:?}"),
        ),
    }
}

fn parse_port(what: &str, p: i32) -> Result<u16, Skip> {
    match u16::try_from(p) {
        Ok(v) if v > 0 => Ok(v),
        _ => invalid(
            Invalid::OutOfRange,
            format!("{what} {p} is out of range 1-65535"),
        ),
    }
}

pub fn object_name(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> ObjectName {
    ObjectName::new(
        meta.namespace.as_deref().unwrap_or(""),
        meta.name.as_deref().unwrap_or(""),
    )
}

/// Whether this proxy instance handles the Service, given its `service-proxy-name` label.
/// An empty `proxy_name` handles only unlabelled Services, as kube-proxy does.
pub fn handled_by(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    proxy_name: &str,
) -> bool {
    let label = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_PROXY_NAME_LABEL));
    match label {
        None => proxy_name.is_empty(),
        Some(v) => !proxy_name.is_empty() && v == proxy_name,
    }
}

/// The longest namespace, Service name or port name Kubernetes allows (a DNS label). Names go
/// into chain names and comments, which nf_tables limits: a longer name from a file would make
/// the kernel refuse the whole transaction, so it is refused here, for its object alone.
pub const MAX_NAME_LEN: usize = 63;

/// Why `value` cannot be a namespace, name or port name, if it cannot.
fn bad_name(what: &str, value: &str) -> Option<String> {
    if value.len() > MAX_NAME_LEN {
        Some(format!(
            "{what} is {} bytes long; at most {MAX_NAME_LEN} are allowed",
            value.len()
        ))
    } else if value
        .chars()
        .any(|c| c.is_control() || c == '/' || c.is_whitespace())
    {
        Some(format!(
            "{what} {value:?} contains a control character, a space or '/'"
        ))
    } else {
        None
    }
}

/// Converts `svc`, whose name (from [`object_name`], or with strings the caller shares) is
/// `name`.
pub fn service(
    svc: &core::Service,
    name: ObjectName,
    shared: &mut Shared,
    proxy_name: &str,
) -> Result<Service, Skip> {
    if name.name.is_empty() {
        return invalid(Invalid::MissingField, "metadata.name is empty");
    }
    if let Some(reason) = bad_name("metadata.namespace", &name.namespace)
        .or_else(|| bad_name("metadata.name", &name.name))
    {
        return invalid(Invalid::Other, reason);
    }
    if !handled_by(&svc.metadata, proxy_name) {
        return Err(Skip::Ignored("service-proxy-name"));
    }
    let Some(spec) = &svc.spec else {
        return invalid(Invalid::MissingField, "spec is missing");
    };
    let service_type = match spec.type_.as_deref().unwrap_or("ClusterIP") {
        "ClusterIP" => ServiceType::ClusterIp,
        "NodePort" => ServiceType::NodePort,
        "LoadBalancer" => ServiceType::LoadBalancer,
        "ExternalName" => return Err(Skip::Ignored("external-name")),
        other => {
            return invalid(
                Invalid::UnknownValue,
                format!("unknown spec.type {other:?}"),
            );
        }
    };
    let mut raw_ips: Vec<&str> = spec
        .cluster_ips
        .as_ref()
        .map(|v| v.iter().map(String::as_str).collect())
        .unwrap_or_default();
    if raw_ips.is_empty()
        && let Some(ip) = &spec.cluster_ip
    {
        raw_ips.push(ip);
    }
    if raw_ips.is_empty() || raw_ips.iter().any(|ip| ip.is_empty() || *ip == "None") {
        return Err(Skip::Ignored("headless"));
    }
    // Vectors are sized up front (a vector grown by pushing starts at four), here and below:
    // each becomes a boxed slice, and one with spare capacity would be copied into it.
    let mut cluster_ips = Vec::with_capacity(raw_ips.len());
    for raw in raw_ips {
        let Some(ip) = parse_ip_sloppy(raw) else {
            return invalid(Invalid::Ip, format!("spec.clusterIPs: invalid IP {raw:?}"));
        };
        if cluster_ips
            .iter()
            .any(|c: &IpAddr| Family::of(c) == Family::of(&ip))
        {
            return invalid(
                Invalid::Other,
                format!("spec.clusterIPs: two addresses of the same family ({raw})"),
            );
        }
        cluster_ips.push(ip);
    }
    let mut external_ips = Vec::with_capacity(spec.external_ips.as_ref().map_or(0, Vec::len));
    for raw in spec.external_ips.iter().flatten() {
        match parse_ip_sloppy(raw) {
            Some(ip) => external_ips.push(ip),
            None => return invalid(Invalid::Ip, format!("spec.externalIPs: invalid IP {raw:?}")),
        }
    }
    let mut load_balancer_ips = Vec::new();
    if service_type == ServiceType::LoadBalancer {
        let ingress = svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref());
        load_balancer_ips.reserve_exact(ingress.map_or(0, Vec::len));
        for ing in ingress.into_iter().flatten() {
            if ing.ip_mode.as_deref() == Some("Proxy") {
                continue;
            }
            if let Some(raw) = &ing.ip {
                match parse_ip_sloppy(raw) {
                    Some(ip) => load_balancer_ips.push(ip),
                    None => {
                        return invalid(
                            Invalid::Ip,
                            format!("status.loadBalancer.ingress: invalid IP {raw:?}"),
                        );
                    }
                }
            }
        }
    }
    let mut load_balancer_source_ranges = Vec::with_capacity(
        spec.load_balancer_source_ranges
            .as_ref()
            .map_or(0, Vec::len),
    );
    for raw in spec.load_balancer_source_ranges.iter().flatten() {
        match parse_cidr_sloppy(raw) {
            Some(net) => load_balancer_source_ranges.push(net),
            None => {
                return invalid(
                    Invalid::Cidr,
                    format!("spec.loadBalancerSourceRanges: invalid CIDR {raw:?}"),
                );
            }
        }
    }
    let mut ports = Vec::with_capacity(spec.ports.as_ref().map_or(0, Vec::len));
    for (i, p) in spec.ports.iter().flatten().enumerate() {
        let protocol =
            parse_protocol(p.protocol.as_deref()).map_err(|e| e.at(&format!("spec.ports[{i}]")))?;
        let port = parse_port(&format!("spec.ports[{i}].port"), p.port)?;
        let node_port = match (service_type, p.node_port) {
            (ServiceType::ClusterIp, _) | (_, None) | (_, Some(0)) => None,
            (_, Some(np)) => Some(parse_port(&format!("spec.ports[{i}].nodePort"), np)?),
        };
        let name = p.name.clone().unwrap_or_default();
        if let Some(reason) = bad_name(&format!("spec.ports[{i}].name"), &name) {
            return invalid(Invalid::Other, reason);
        }
        if ports
            .iter()
            .any(|q: &ServicePort| *q.name == *name && q.protocol == protocol)
        {
            return invalid(
                Invalid::DuplicatePort,
                format!("spec.ports[{i}]: duplicate port name {name:?}"),
            );
        }
        if ports
            .iter()
            .any(|q: &ServicePort| q.port == port && q.protocol == protocol)
        {
            return invalid(
                Invalid::DuplicatePort,
                format!("spec.ports[{i}]: duplicate port {port}/{protocol}"),
            );
        }
        ports.push(ServicePort {
            name: shared.name(&name),
            protocol,
            port,
            node_port,
        });
    }
    let externally_reachable_type =
        service_type != ServiceType::ClusterIp || !external_ips.is_empty();
    let external_policy_local =
        externally_reachable_type && spec.external_traffic_policy.as_deref() == Some("Local");
    let internal_policy_local = spec.internal_traffic_policy.as_deref() == Some("Local");
    let health_check_node_port = match spec.health_check_node_port {
        Some(p) if service_type == ServiceType::LoadBalancer && external_policy_local && p != 0 => {
            Some(parse_port("spec.healthCheckNodePort", p)?)
        }
        _ => None,
    };
    let affinity_timeout = match spec.session_affinity.as_deref() {
        Some("ClientIP") => {
            let t = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match t {
                None => Some(DEFAULT_AFFINITY_TIMEOUT),
                Some(t) if (1..=86400).contains(&t) => Some(t as u32),
                Some(t) => {
                    return invalid(
                        Invalid::OutOfRange,
                        format!(
                            "spec.sessionAffinityConfig.clientIP.timeoutSeconds {t} is out of range 1-86400"
                        ),
                    );
                }
            }
        }
        None | Some("None") | Some("") => None,
        Some(other) => {
            return invalid(
                Invalid::UnknownValue,
                format!("unknown spec.sessionAffinity {other:?}"),
            );
        }
    };
    Ok(Service {
        name,
        service_type,
        cluster_ips: cluster_ips.into(),
        external_ips: external_ips.into(),
        load_balancer_ips: load_balancer_ips.into(),
        load_balancer_source_ranges: load_balancer_source_ranges.into(),
        external_policy_local,
        internal_policy_local,
        health_check_node_port,
        affinity_timeout,
        ports: shared.service_ports(&ports),
        creation_timestamp: svc.metadata.creation_timestamp.as_ref().map(|t| t.0),
    })
}

/// Converts an EndpointSlice. Like Services, slices another proxy handles and those of headless
/// Services are ignored: the EndpointSlice controller copies a Service's labels to its slices,
/// and kube-proxy selects both kinds by the same labels.
pub fn endpoint_slice(
    slice: &discovery::EndpointSlice,
    name: ObjectName,
    shared: &mut Shared,
    proxy_name: &str,
) -> Result<EndpointSlice, Skip> {
    let labels = slice.metadata.labels.as_ref();
    let Some(service) = labels.and_then(|l| l.get(SERVICE_NAME_LABEL)) else {
        return Err(Skip::Ignored("no-service-name-label"));
    };
    if !handled_by(&slice.metadata, proxy_name) {
        return Err(Skip::Ignored("service-proxy-name"));
    }
    if labels.is_some_and(|l| l.contains_key(HEADLESS_LABEL)) {
        return Err(Skip::Ignored("headless"));
    }
    let family = match slice.address_type.as_str() {
        "IPv4" => Family::V4,
        "IPv6" => Family::V6,
        "FQDN" => return Err(Skip::Ignored("fqdn")),
        other => {
            return invalid(
                Invalid::UnknownValue,
                format!("unknown addressType {other:?}"),
            );
        }
    };
    // Sized up front, as a Service's: most slices hold one to three endpoints.
    let mut ports = Vec::with_capacity(slice.ports.as_ref().map_or(0, Vec::len));
    for (i, p) in slice.ports.iter().flatten().enumerate() {
        let protocol =
            parse_protocol(p.protocol.as_deref()).map_err(|e| e.at(&format!("ports[{i}]")))?;
        let Some(port) = p.port else {
            // A port without a number means "all ports"; the proxy cannot use it.
            continue;
        };
        let port = parse_port(&format!("ports[{i}].port"), port)?;
        ports.push(EndpointPort {
            name: shared.name(p.name.as_deref().unwrap_or_default()),
            protocol,
            port,
        });
    }
    let mut endpoints = Endpoints::with_capacity(family, slice.endpoints.len());
    for (i, ep) in slice.endpoints.iter().enumerate() {
        let Some(raw) = ep.addresses.first() else {
            continue;
        };
        let Some(addr) = parse_ip_sloppy(raw) else {
            return invalid(
                Invalid::Ip,
                format!("endpoints[{i}]: invalid address {raw:?}"),
            );
        };
        if Family::of(&addr) != family {
            return invalid(
                Invalid::Other,
                format!(
                    "endpoints[{i}]: address {raw} does not match addressType {}",
                    slice.address_type
                ),
            );
        }
        let c = ep.conditions.as_ref();
        let hints = ep.hints.as_ref();
        endpoints.push(Endpoint {
            addr,
            ready: c.and_then(|c| c.ready).unwrap_or(true),
            serving: c.and_then(|c| c.serving).unwrap_or(true),
            terminating: c.and_then(|c| c.terminating).unwrap_or(false),
            site: shared.site(
                ep.node_name.as_deref(),
                Hints {
                    zones: hints
                        .and_then(|h| h.for_zones.as_ref())
                        .map(|z| z.iter().map(|z| z.name.clone()).collect())
                        .unwrap_or_default(),
                    nodes: hints
                        .and_then(|h| h.for_nodes.as_ref())
                        .map(|n| n.iter().map(|n| n.name.clone()).collect())
                        .unwrap_or_default(),
                },
            ),
        });
    }
    Ok(EndpointSlice {
        service: ObjectName {
            namespace: name.namespace.clone(),
            name: service.as_str().into(),
        },
        name,
        family,
        ports: shared.endpoint_ports(&ports),
        endpoints,
        trigger_time: slice
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(TRIGGER_TIME_ANNOTATION))
            .and_then(|t| t.parse::<Timestamp>().ok())
            .and_then(since_epoch),
    })
}

/// A time at or after 1970 (a trigger time before it would be before any sync anyway). Not
/// `SystemTime::from`: that needs jiff's `std` feature, which this crate alone does not enable.
fn since_epoch(t: Timestamp) -> Option<SystemTime> {
    let secs = u64::try_from(t.as_second()).ok()?;
    let nanos = u32::try_from(t.subsec_nanosecond()).ok()?;
    SystemTime::UNIX_EPOCH.checked_add(std::time::Duration::new(secs, nanos))
}

pub fn node(node: &core::Node) -> Result<Node, Skip> {
    let name = node.metadata.name.clone().unwrap_or_default();
    if name.is_empty() {
        return invalid(Invalid::MissingField, "metadata.name is empty");
    }
    let spec = node.spec.as_ref();
    let mut pod_cidrs = Vec::new();
    let raw_cidrs: Vec<&String> = match spec.and_then(|s| s.pod_cidrs.as_ref()) {
        Some(v) if !v.is_empty() => v.iter().collect(),
        _ => spec.and_then(|s| s.pod_cidr.as_ref()).into_iter().collect(),
    };
    for raw in raw_cidrs {
        match parse_cidr_sloppy(raw) {
            Some(n) => pod_cidrs.push(n),
            None => {
                return invalid(
                    Invalid::Cidr,
                    format!("spec.podCIDRs: invalid CIDR {raw:?}"),
                );
            }
        }
    }
    let mut addresses = Vec::new();
    let status_addrs = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    for kind in ["InternalIP", "ExternalIP"] {
        for a in status_addrs
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == kind)
        {
            if let Some(ip) = parse_ip_sloppy(&a.address) {
                addresses.push(ip);
            }
        }
    }
    Ok(Node {
        name,
        labels: node.metadata.labels.clone().unwrap_or_default(),
        pod_cidrs,
        addresses,
        deleting: node.metadata.deletion_timestamp.is_some(),
        taint_keys: spec
            .and_then(|s| s.taints.as_ref())
            .map(|t| t.iter().map(|t| t.key.clone()).collect())
            .unwrap_or_default(),
    })
}

pub fn service_cidr(cidr: &networking::ServiceCIDR) -> Result<(String, Vec<IpNet>), Skip> {
    let name = cidr.metadata.name.clone().unwrap_or_default();
    let mut nets = Vec::new();
    for raw in cidr
        .spec
        .as_ref()
        .and_then(|s| s.cidrs.as_ref())
        .into_iter()
        .flatten()
    {
        match parse_cidr_sloppy(raw) {
            Some(n) => nets.push(n),
            None => return invalid(Invalid::Cidr, format!("spec.cidrs: invalid CIDR {raw:?}")),
        }
    }
    Ok((name, nets))
}

/// A problem with one object of an input document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    pub kind: String,
    pub name: String,
    pub skip: Skip,
}

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "skipping {} {:?}: {}", self.kind, self.name, self.skip)
    }
}

/// The raw objects of an input document, by kind, before conversion.
#[derive(Clone, Debug, Default)]
pub struct Objects {
    pub services: Vec<core::Service>,
    pub slices: Vec<discovery::EndpointSlice>,
    pub nodes: Vec<core::Node>,
    pub service_cidrs: Vec<networking::ServiceCIDR>,
}

/// Converts parsed objects into a cluster model for the node `node_name`, collecting every
/// object that had to be skipped (ignored kinds such as headless Services are not reported).
pub fn cluster(
    objects: &Objects,
    node_name: &str,
    proxy_name: &str,
) -> (crate::model::Cluster, Vec<Skipped>) {
    let mut cluster = crate::model::Cluster::default();
    let mut shared = Shared::default();
    let mut skipped = Vec::new();
    let mut report = |kind: &str, name: ObjectName, skip: Skip| {
        if let Skip::Invalid(..) = skip {
            skipped.push(Skipped {
                kind: kind.to_string(),
                name: name.to_string(),
                skip,
            });
        }
    };
    for s in &objects.services {
        let name = object_name(&s.metadata);
        match service(s, name.clone(), &mut shared, proxy_name) {
            Ok(svc) => {
                cluster.services.insert(name, Arc::new(svc));
            }
            Err(e) => report("Service", name, e),
        }
    }
    for s in &objects.slices {
        let name = object_name(&s.metadata);
        match endpoint_slice(s, name.clone(), &mut shared, proxy_name) {
            Ok(slice) => {
                cluster.slices.insert(name, slice);
            }
            Err(e) => report("EndpointSlice", name, e),
        }
    }
    for n in &objects.nodes {
        if n.metadata.name.as_deref() != Some(node_name) {
            continue;
        }
        match node(n) {
            Ok(node) => cluster.node = Some(node),
            Err(e) => report("Node", object_name(&n.metadata), e),
        }
    }
    for c in &objects.service_cidrs {
        match service_cidr(c) {
            Ok((name, nets)) => {
                cluster.service_cidrs.insert(name, nets);
            }
            Err(e) => report("ServiceCIDR", object_name(&c.metadata), e),
        }
    }
    (cluster, skipped)
}

/// Groups slices by the Service they belong to, each group in slice name order.
pub fn slices_by_service(slices: &Slices) -> BTreeMap<&ObjectName, Vec<&EndpointSlice>> {
    slices
        .services()
        .map(|service| (service, slices.of_service(service).collect()))
        .collect()
}

#[cfg(test)]
mod tests;
