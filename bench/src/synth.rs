//! The synthetic cluster: N Services with k endpoints each, as Kubernetes objects (written to a
//! file for the real agent) and as the model (converted by the agent's own code).
//!
//! Service `i` (0-based) is `ns-<i/100>/svc-<i>`, one TCP port `http` 80 → 8080:
//! * type by `i % 10`: 0–6 ClusterIP (70%), 7–8 NodePort (20%), 9 LoadBalancer (10%);
//! * dual-stack when `(i / 10) % 10 == 3` (10%, spread over all types);
//! * `externalTrafficPolicy: Local` for a quarter of the NodePorts and half of the
//!   LoadBalancers (10% of all Services);
//! * endpoints: k ready pods `10.64.0.0 + i*k + j` (IPv6 `fd00:10:64::` + the same offset); the
//!   first endpoint of every third Service runs on this node, the others on `node-<n>`;
//! * ClusterIP `172.16.0.10 + i` (ServiceCIDR 172.16.0.0/12, `fd00:172:16::/108`), NodePort
//!   `30000 + e` for the e-th NodePort/LoadBalancer Service (15,000 at 50k Services, so the
//!   node-port range is wider than Kubernetes' default 30000-32767, as a cluster this size
//!   needs), load-balancer IP `198.18.0.1 + i/10` (`2001:db8:1::1` + the same).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use anyhow::{Context, Result, bail};
use dataplane::convert::{self, Objects};
use dataplane::model::{Cluster, Endpoint, Hints, ObjectName, Site};
use dataplane::nft::ruleset::Family;
use serde_json::{Value, json};

/// The node the agent runs as.
pub const NODE: &str = "bench-node";
pub const NODE_IP_V4: &str = "192.168.0.2";
pub const NODE_IP_V6: &str = "2001:db8::2";
/// Pod network (`clusterCIDR`, detect-local) and ServiceCIDRs.
pub const CLUSTER_CIDR_V4: &str = "10.0.0.0/8";
pub const CLUSTER_CIDR_V6: &str = "fd00:10::/32";
pub const SERVICE_CIDR_V4: &str = "172.16.0.0/12";
pub const SERVICE_CIDR_V6: &str = "fd00:172:16::/108";
/// Service port and endpoint (target) port of every synthetic Service.
pub const PORT: u16 = 80;
pub const TARGET_PORT: u16 = 8080;

/// The agent configuration every run uses (written to a file for the child agent too).
pub fn kube_proxy_config() -> String {
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n\
         kind: KubeProxyConfiguration\n\
         mode: nftables\n\
         clusterCIDR: {CLUSTER_CIDR_V4},{CLUSTER_CIDR_V6}\n\
         hostnameOverride: {NODE}\n"
    )
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Kind {
    ClusterIp,
    NodePort,
    LoadBalancer,
}

/// Which synthetic cluster: every Service alike, or a mix like a real cluster's (see
/// `realistic.rs`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum, serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Shape {
    Uniform,
    Realistic,
}

impl Shape {
    pub fn name(self) -> &'static str {
        match self {
            Shape::Uniform => "uniform",
            Shape::Realistic => "realistic",
        }
    }
}

/// The ports a Service may have, in order: a Service with `p` ports has the first `p`.
/// (name, port, target port, protocol)
const PORTS: [(&str, u16, u16, &str); 3] = [
    ("http", PORT, TARGET_PORT, "TCP"),
    ("https", 443, 8443, "TCP"),
    ("dns", 53, 5353, "UDP"),
];

/// Endpoints per EndpointSlice in the realistic shape (the EndpointSlice controller's default
/// `--max-endpoints-per-slice`); the uniform shape keeps all of a family's in one slice.
pub const REALISTIC_SLICE_MAX: usize = 100;

/// The properties of synthetic Service `i`.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    pub index: usize,
    pub shape: Shape,
    pub kind: Kind,
    pub dual_stack: bool,
    pub etp_local: bool,
    /// `internalTrafficPolicy: Local`.
    pub itp_local: bool,
    /// `sessionAffinity: ClientIP`.
    pub affinity: bool,
    /// Number of ports (1 to 3, the first ones of `PORTS`).
    pub ports: usize,
    pub endpoints: usize,
    /// Offset of the first endpoint's address from `10.64.0.0` (and `fd00:10:64::`).
    pub endpoint_base: u32,
    /// The first port's node port (the others follow), for NodePort and LoadBalancer Services.
    pub node_port_base: Option<u16>,
    /// Offset of the load-balancer IP from `198.18.0.1` (and `2001:db8:1::1`).
    pub lb_index: u32,
}

impl Spec {
    pub fn of(i: usize, k: usize) -> Spec {
        let kind = match i % 10 {
            0..=6 => Kind::ClusterIp,
            7 | 8 => Kind::NodePort,
            _ => Kind::LoadBalancer,
        };
        let bucket = i / 10;
        let etp_local = match kind {
            Kind::ClusterIp => false,
            Kind::NodePort => bucket % 4 == 1,
            Kind::LoadBalancer => bucket % 2 == 1,
        };
        let node_port_base = (i % 10)
            .checked_sub(7)
            .map(|e| 30000 + (bucket * 3 + e) as u16);
        Spec {
            index: i,
            shape: Shape::Uniform,
            kind,
            dual_stack: bucket % 10 == 3,
            etp_local,
            itp_local: false,
            affinity: false,
            ports: 1,
            endpoints: k,
            endpoint_base: (i * k) as u32,
            node_port_base,
            lb_index: bucket as u32,
        }
    }

    /// A plain single-stack ClusterIP Service with index `i` (for Services added by partial
    /// syncs).
    pub fn cluster_ip(i: usize, k: usize) -> Spec {
        Spec {
            kind: Kind::ClusterIp,
            dual_stack: false,
            etp_local: false,
            node_port_base: None,
            ..Spec::of(i, k)
        }
    }

    pub fn namespace(&self) -> String {
        format!("ns-{}", self.index / 100)
    }

    pub fn name(&self) -> String {
        format!("svc-{}", self.index)
    }

    pub fn object_name(&self) -> ObjectName {
        ObjectName::new(&self.namespace(), &self.name())
    }

    pub fn cluster_ip_v4(&self) -> Ipv4Addr {
        v4_offset(Ipv4Addr::new(172, 16, 0, 10), self.index as u32)
    }

    pub fn cluster_ip_v6(&self) -> Ipv6Addr {
        v6_offset("fd00:172:16::a", self.index as u128)
    }

    pub fn load_balancer_v4(&self) -> Ipv4Addr {
        v4_offset(Ipv4Addr::new(198, 18, 0, 1), self.lb_index)
    }

    pub fn endpoint_v4(&self, j: usize) -> Ipv4Addr {
        v4_offset(Ipv4Addr::new(10, 64, 0, 0), self.endpoint_base + j as u32)
    }

    fn endpoint_v6(&self, j: usize) -> Ipv6Addr {
        v6_offset("fd00:10:64::", u128::from(self.endpoint_base) + j as u128)
    }

    fn endpoint_node(&self, j: usize) -> String {
        if j == 0 && self.index.is_multiple_of(3) {
            NODE.to_string()
        } else {
            format!("node-{}", (self.index + j) % 100)
        }
    }

    /// The Service object.
    pub fn service(&self) -> Value {
        let mut cluster_ips = vec![self.cluster_ip_v4().to_string()];
        let mut families = vec!["IPv4"];
        if self.dual_stack {
            cluster_ips.push(self.cluster_ip_v6().to_string());
            families.push("IPv6");
        }
        let ports: Vec<Value> = PORTS[..self.ports]
            .iter()
            .enumerate()
            .map(|(p, (name, port, target, proto))| {
                let mut v =
                    json!({"name": name, "port": port, "protocol": proto, "targetPort": target});
                if let Some(base) = self.node_port_base {
                    v["nodePort"] = json!(base + p as u16);
                }
                v
            })
            .collect();
        let type_ = match self.kind {
            Kind::ClusterIp => "ClusterIP",
            Kind::NodePort => "NodePort",
            Kind::LoadBalancer => "LoadBalancer",
        };
        let mut spec = json!({
            "type": type_,
            "clusterIP": cluster_ips[0],
            "clusterIPs": cluster_ips,
            "ipFamilies": families,
            "ipFamilyPolicy": if self.dual_stack { "RequireDualStack" } else { "SingleStack" },
            "ports": ports,
        });
        if self.kind != Kind::ClusterIp {
            spec["externalTrafficPolicy"] = json!(if self.etp_local { "Local" } else { "Cluster" });
        }
        if self.itp_local {
            spec["internalTrafficPolicy"] = json!("Local");
        }
        if self.affinity {
            spec["sessionAffinity"] = json!("ClientIP");
            spec["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": 10800}});
        }
        let mut svc = json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": self.name(), "namespace": self.namespace()},
            "spec": spec,
        });
        if self.kind == Kind::LoadBalancer {
            let mut ingress =
                vec![json!({"ip": self.load_balancer_v4().to_string(), "ipMode": "VIP"})];
            if self.dual_stack {
                let v6 = v6_offset("2001:db8:1::1", u128::from(self.lb_index));
                ingress.push(json!({"ip": v6.to_string(), "ipMode": "VIP"}));
            }
            svc["status"] = json!({"loadBalancer": {"ingress": ingress}});
        }
        svc
    }

    /// The EndpointSlices: per family, one (uniform shape) or one per
    /// [`REALISTIC_SLICE_MAX`] endpoints (realistic shape; at least one, possibly empty). The
    /// first slice of a family is named `<service>-<family>`.
    pub fn slices(&self) -> Vec<Value> {
        let mut out = Vec::new();
        for family in [Family::V4, Family::V6] {
            if family == Family::V6 && !self.dual_stack {
                continue;
            }
            let per_slice = match self.shape {
                Shape::Uniform => self.endpoints.max(1),
                Shape::Realistic => REALISTIC_SLICE_MAX,
            };
            let chunks = self.endpoints.div_ceil(per_slice).max(1);
            for c in 0..chunks {
                let range = c * per_slice..((c + 1) * per_slice).min(self.endpoints);
                out.push(self.slice(family, c, range));
            }
        }
        out
    }

    fn slice(&self, family: Family, chunk: usize, range: std::ops::Range<usize>) -> Value {
        let endpoints: Vec<Value> = range
            .map(|j| {
                let addr = match family {
                    Family::V4 => self.endpoint_v4(j).to_string(),
                    Family::V6 => self.endpoint_v6(j).to_string(),
                };
                json!({
                    "addresses": [addr],
                    "conditions": {"ready": true, "serving": true, "terminating": false},
                    "nodeName": self.endpoint_node(j),
                })
            })
            .collect();
        let mut name = slice_name(&self.name(), family);
        if chunk > 0 {
            name = format!("{name}-{chunk}");
        }
        let ports: Vec<Value> = PORTS[..self.ports]
            .iter()
            .map(
                |(name, _, target, proto)| json!({"name": name, "port": target, "protocol": proto}),
            )
            .collect();
        json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "namespace": self.namespace(),
                "labels": {"kubernetes.io/service-name": self.name()},
            },
            "addressType": family.k8s_name(),
            "ports": ports,
            "endpoints": endpoints,
        })
    }
}

fn slice_name(service: &str, family: Family) -> String {
    format!("{service}-{}", family.k8s_name().to_ascii_lowercase())
}

fn v4_offset(base: Ipv4Addr, offset: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(base) + offset)
}

fn v6_offset(base: &str, offset: u128) -> Ipv6Addr {
    let base: Ipv6Addr = base.parse().expect("static IPv6 address");
    Ipv6Addr::from(u128::from(base) + offset)
}

/// The Node and the ServiceCIDR objects.
pub fn base_objects() -> Vec<Value> {
    vec![
        json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": NODE, "labels": {"topology.kubernetes.io/zone": "zone-a"}},
            "spec": {"podCIDRs": ["10.0.0.0/24", "fd00:10::/112"]},
            "status": {"addresses": [
                {"type": "InternalIP", "address": NODE_IP_V4},
                {"type": "InternalIP", "address": NODE_IP_V6},
            ]},
        }),
        json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "ServiceCIDR",
            "metadata": {"name": "kubernetes"},
            "spec": {"cidrs": [SERVICE_CIDR_V4, SERVICE_CIDR_V6]},
        }),
    ]
}

/// The Service the latency probe connects to: `bench/echo`, ClusterIP `vip`:80, one endpoint
/// `endpoint`:8080 on this node.
pub fn echo_objects(vip: Ipv4Addr, endpoint: Ipv4Addr) -> Vec<Value> {
    vec![
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "echo", "namespace": "bench"},
            "spec": {
                "type": "ClusterIP",
                "clusterIP": vip.to_string(),
                "clusterIPs": [vip.to_string()],
                "ports": [{"name": "http", "port": PORT, "protocol": "TCP", "targetPort": TARGET_PORT}],
            },
        }),
        json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "echo-ipv4",
                "namespace": "bench",
                "labels": {"kubernetes.io/service-name": "echo"},
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": TARGET_PORT, "protocol": "TCP"}],
            "endpoints": [{
                "addresses": [endpoint.to_string()],
                "conditions": {"ready": true},
                "nodeName": NODE,
            }],
        }),
    ]
}

/// The Services of a cluster of `n` Services of `shape` (`k` endpoints each in the uniform
/// shape; `seed` draws the realistic one).
pub fn specs(shape: Shape, n: usize, k: usize, seed: u64) -> Vec<Spec> {
    match shape {
        Shape::Uniform => (0..n).map(|i| Spec::of(i, k)).collect(),
        Shape::Realistic => crate::realistic::specs(n, seed),
    }
}

/// The Node, the ServiceCIDR and the Services with their EndpointSlices.
pub fn objects_of(specs: &[Spec]) -> Vec<Value> {
    let mut out = base_objects();
    for spec in specs {
        out.push(spec.service());
        out.extend(spec.slices());
    }
    out
}

/// The Node, the ServiceCIDR and `n` Services with `k` endpoints each.
#[cfg(test)]
pub fn objects(n: usize, k: usize) -> Vec<Value> {
    objects_of(&specs(Shape::Uniform, n, k, 0))
}

/// Converts objects with the agent's own conversion code (as its file source does).
pub fn to_cluster(objects: &[Value]) -> Result<Cluster> {
    let mut typed = Objects::default();
    for o in objects {
        match o["kind"].as_str() {
            Some("Service") => typed.services.push(serde_json::from_value(o.clone())?),
            Some("EndpointSlice") => typed.slices.push(serde_json::from_value(o.clone())?),
            Some("Node") => typed.nodes.push(serde_json::from_value(o.clone())?),
            Some("ServiceCIDR") => typed.service_cidrs.push(serde_json::from_value(o.clone())?),
            other => bail!("unexpected kind {other:?}"),
        }
    }
    let (cluster, skipped) = convert::cluster(&typed, NODE, "");
    if let Some(s) = skipped.first() {
        bail!(
            "synthetic object rejected: {} {}: {}",
            s.kind,
            s.name,
            s.skip
        );
    }
    Ok(cluster)
}

/// Adds the objects to a model (Services and EndpointSlices only).
pub fn add_to_cluster(cluster: &mut Cluster, objects: &[Value]) -> Result<()> {
    let more = to_cluster(objects)?;
    cluster.services.extend(more.services);
    cluster.slices.extend(more.slices);
    Ok(())
}

/// Removes a Service and its EndpointSlices from a model, by name, as the agent does when
/// their deletions are watched (a scan of every slice would pull the whole model through the
/// CPU caches before the sync being measured).
pub fn remove_service(cluster: &mut Cluster, name: &ObjectName) {
    cluster.services.remove(name);
    let slices: Vec<ObjectName> = cluster.slices_of(name).map(|s| s.name.clone()).collect();
    for slice in &slices {
        cluster.slices.remove(slice);
    }
}

/// Adds a ready endpoint (on another node) to the IPv4 slice of Service `spec`.
pub fn add_endpoint(cluster: &mut Cluster, spec: &Spec, addr: Ipv4Addr) -> Result<()> {
    let slice = ObjectName::new(&spec.namespace(), &slice_name(&spec.name(), Family::V4));
    // Slices has no get_mut (it would bypass its Service index): modify a copy, put it back.
    let mut s = cluster
        .slices
        .get(&slice)
        .with_context(|| format!("no EndpointSlice {slice}"))?
        .clone();
    s.endpoints.push(Endpoint {
        addr: IpAddr::V4(addr),
        ready: true,
        serving: true,
        terminating: false,
        site: Site::new(Some("node-extra"), Hints::default()),
    });
    cluster.slices.insert(slice, s);
    Ok(())
}

/// Removes the endpoint `addr` from the IPv4 slice of Service `spec`.
pub fn remove_endpoint(cluster: &mut Cluster, spec: &Spec, addr: Ipv4Addr) -> Result<()> {
    let slice = ObjectName::new(&spec.namespace(), &slice_name(&spec.name(), Family::V4));
    // Slices has no get_mut (it would bypass its Service index): modify a copy, put it back.
    let mut s = cluster
        .slices
        .get(&slice)
        .with_context(|| format!("no EndpointSlice {slice}"))?
        .clone();
    let before = s.endpoints.len();
    s.endpoints.retain(|e| e.addr != IpAddr::V4(addr));
    if s.endpoints.len() == before {
        bail!("{slice} has no endpoint {addr}");
    }
    cluster.slices.insert(slice, s);
    Ok(())
}

/// Counts of the generated cluster, for the report.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ModelStats {
    pub services: usize,
    pub cluster_ip: usize,
    pub node_port: usize,
    pub load_balancer: usize,
    pub dual_stack: usize,
    pub etp_local: usize,
    pub itp_local: usize,
    pub affinity: usize,
    pub multi_port: usize,
    pub endpoints_v4: usize,
    pub endpoints_v6: usize,
    /// Services by endpoint count: 0, 1-3, 4-16, 17-99, 100-999, 1000 and more.
    pub by_endpoints: [usize; 6],
    pub endpoints_max: usize,
}

/// The upper ends of `ModelStats::by_endpoints`' buckets.
pub const ENDPOINT_BUCKETS: [usize; 6] = [0, 3, 16, 99, 999, usize::MAX];

#[cfg(test)]
pub fn stats(n: usize, k: usize) -> ModelStats {
    stats_of(&specs(Shape::Uniform, n, k, 0))
}

pub fn stats_of(specs: &[Spec]) -> ModelStats {
    let mut s = ModelStats {
        services: specs.len(),
        ..ModelStats::default()
    };
    for spec in specs {
        match spec.kind {
            Kind::ClusterIp => s.cluster_ip += 1,
            Kind::NodePort => s.node_port += 1,
            Kind::LoadBalancer => s.load_balancer += 1,
        }
        s.dual_stack += usize::from(spec.dual_stack);
        s.etp_local += usize::from(spec.etp_local);
        s.itp_local += usize::from(spec.itp_local);
        s.affinity += usize::from(spec.affinity);
        s.multi_port += usize::from(spec.ports > 1);
        let k = spec.endpoints;
        s.endpoints_v4 += k;
        if spec.dual_stack {
            s.endpoints_v6 += k;
        }
        let bucket = ENDPOINT_BUCKETS
            .iter()
            .position(|&max| k <= max)
            .unwrap_or(5);
        s.by_endpoints[bucket] += 1;
        s.endpoints_max = s.endpoints_max.max(k);
    }
    s
}

/// Writes the objects as a multi-document YAML stream (one JSON object per document), which
/// `nftproxy run --from-file` reads like `kubectl get -o yaml` output.
pub fn write_file(path: &std::path::Path, objects: &[Value]) -> Result<u64> {
    use std::io::Write;
    let file = std::fs::File::create(path).with_context(|| format!("{}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    for o in objects {
        w.write_all(b"---\n")?;
        serde_json::to_writer(&mut w, o)?;
        w.write_all(b"\n")?;
    }
    w.flush()?;
    Ok(std::fs::metadata(path)?.len())
}

/// Per-family object counts of a built table.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct TableStats {
    pub chains: usize,
    pub rules: usize,
    pub elements: usize,
    pub sets: usize,
}

pub fn table_stats(table: &dataplane::nft::ruleset::Table) -> TableStats {
    TableStats {
        chains: table.chains.len(),
        rules: table.chains.values().map(|c| c.rules.len()).sum(),
        elements: table.sets.values().map(|s| s.elements.len()).sum(),
        sets: table.sets.len(),
    }
}

/// Index → Spec for Services beyond the generated ones (partial syncs add these).
pub fn extra_spec(n: usize, r: usize, k: usize) -> Spec {
    Spec::cluster_ip(n + r, k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_and_conversion() {
        let s = stats(1000, 5);
        assert_eq!(
            (s.cluster_ip, s.node_port, s.load_balancer),
            (700, 200, 100)
        );
        assert_eq!((s.dual_stack, s.etp_local), (100, 100));
        let cluster = to_cluster(&objects(1000, 5)).expect("synthetic objects convert");
        assert_eq!(cluster.services.len(), 1000);
        assert_eq!(cluster.slices.len(), 1100);
        assert!(cluster.node.is_some());
        let local = cluster
            .services
            .values()
            .filter(|s| s.external_policy_local)
            .count();
        assert_eq!(local, 100);
        let with_node_port = cluster
            .services
            .values()
            .filter(|s| s.ports[0].node_port.is_some())
            .count();
        assert_eq!(with_node_port, 300);
    }

    #[test]
    fn partial_changes_apply() {
        let mut cluster = to_cluster(&objects(100, 5)).unwrap();
        let spec = Spec::of(50, 5);
        let addr = Ipv4Addr::new(10, 128, 0, 1);
        add_endpoint(&mut cluster, &spec, addr).unwrap();
        remove_endpoint(&mut cluster, &spec, addr).unwrap();
        assert!(remove_endpoint(&mut cluster, &spec, addr).is_err());
        let extra = extra_spec(100, 0, 5);
        let mut objects = vec![extra.service()];
        objects.extend(extra.slices());
        add_to_cluster(&mut cluster, &objects).unwrap();
        assert_eq!(cluster.services.len(), 101);
        remove_service(&mut cluster, &extra.object_name());
        assert_eq!(cluster.services.len(), 100);
        assert_eq!(cluster.slices.len(), 110);
    }
}
