//! Valid clusters: objects the API server would accept, covering every Service feature, for
//! round trips through the builders and the kernel encoders.

use super::*;

// ---------------------------------------------------------------------------------------------
// Valid clusters: objects the API server would accept, covering every Service feature, for
// round trips through the builders and the kernel encoders.

/// One valid Service and its EndpointSlices, by index `i` (which keeps addresses and ports
/// unique across Services).
#[derive(Clone, Debug)]
pub struct ValidService {
    pub i: u8,
    pub service_type: &'static str,
    pub v4: bool,
    pub v6: bool,
    pub protocols: Vec<&'static str>,
    pub external_ip: bool,
    pub lb_ingress: bool,
    pub source_ranges: bool,
    pub local_external: bool,
    pub local_internal: bool,
    pub affinity: Option<u32>,
    /// Per slice: IPv6?, and its endpoints.
    pub slices: Vec<(bool, Vec<EndpointSpec>)>,
}

/// An endpoint: ready, serving, terminating, on this node, with a zone hint.
pub type EndpointSpec = (bool, bool, bool, bool, bool);

impl ValidService {
    pub fn objects(&self) -> Vec<Value> {
        let i = self.i;
        let mut ips = Vec::new();
        if self.v4 || !self.v6 {
            ips.push(format!("172.30.{}.{}", i / 200, i % 200 + 1));
        }
        if self.v6 {
            ips.push(format!("fd00:30::{:x}", u16::from(i) + 1));
        }
        let node_ports = self.service_type != "ClusterIP";
        let ports: Vec<Value> = self
            .protocols
            .iter()
            .enumerate()
            .map(|(k, proto)| {
                let mut p = json!({"name": format!("p{k}"), "protocol": proto, "port": 80 + k,
                                   "targetPort": 8080 + k});
                if node_ports {
                    p["nodePort"] = json!(30000 + usize::from(i) * 4 + k);
                }
                p
            })
            .collect();
        let mut spec = json!({
            "type": self.service_type,
            "clusterIP": ips[0],
            "clusterIPs": ips,
            "ports": ports,
            "externalTrafficPolicy": if self.local_external { "Local" } else { "Cluster" },
            "internalTrafficPolicy": if self.local_internal { "Local" } else { "Cluster" },
        });
        if self.external_ip {
            spec["externalIPs"] = json!([format!("203.0.113.{}", i % 250 + 1)]);
        }
        if self.source_ranges {
            spec["loadBalancerSourceRanges"] = json!(["192.0.2.0/24", "2001:db8::/64"]);
        }
        if self.service_type == "LoadBalancer" && self.local_external {
            spec["healthCheckNodePort"] = json!(32000 + u32::from(i));
        }
        if let Some(t) = self.affinity {
            spec["sessionAffinity"] = json!("ClientIP");
            spec["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": t}});
        }
        let name = format!("svc{i}");
        let mut service = json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": spec,
        });
        if self.lb_ingress {
            service["status"] = json!({"loadBalancer": {"ingress": [
                {"ip": format!("198.51.100.{}", i % 250 + 1)},
                {"ip": format!("2001:db8:1::{:x}", u16::from(i) + 1)},
                {"ip": "198.51.100.250", "ipMode": "Proxy"},
            ]}});
        }
        let mut out = vec![service];
        for (s, (v6, endpoints)) in self.slices.iter().enumerate() {
            let endpoints: Vec<Value> = endpoints
                .iter()
                .enumerate()
                .map(|(k, (ready, serving, terminating, local, hint))| {
                    let addr = if *v6 {
                        format!("fd00:1:{:x}:{s:x}::{:x}", i, k + 1)
                    } else {
                        format!("10.{}.{}.{}", 100 + i / 100, (i % 100) * 2 + s as u8 % 2, k + 1)
                    };
                    let mut e = json!({
                        "addresses": [addr],
                        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
                        "nodeName": if *local { "node" } else { "other-node" },
                        "zone": "zone-a",
                    });
                    if *hint {
                        e["hints"] = json!({"forZones": [{"name": "zone-a"}]});
                    }
                    e
                })
                .collect();
            let ports: Vec<Value> = self
                .protocols
                .iter()
                .enumerate()
                .map(|(k, proto)| json!({"name": format!("p{k}"), "protocol": proto, "port": 8080 + k}))
                .collect();
            out.push(json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": format!("{name}-{s}"), "namespace": "ns",
                             "labels": {"kubernetes.io/service-name": name}},
                "addressType": if *v6 { "IPv6" } else { "IPv4" },
                "ports": ports,
                "endpoints": endpoints,
            }));
        }
        out
    }
}

pub(super) fn valid_service(i: u8) -> BoxedStrategy<ValidService> {
    let endpoint = (
        prop::bool::weighted(0.8),
        prop::bool::weighted(0.85),
        prop::bool::weighted(0.1),
        prop::bool::weighted(0.5),
        prop::bool::weighted(0.2),
    );
    let slice = (any::<bool>(), vec(endpoint, 0..40));
    (
        select(vec!["ClusterIP", "NodePort", "LoadBalancer"]),
        prop::bool::weighted(0.8),
        prop::bool::weighted(0.4),
        vec(select(vec!["TCP", "UDP", "SCTP"]), 1..4),
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.5),
        prop::bool::weighted(0.3),
        prop::bool::weighted(0.3),
        prop::bool::weighted(0.2),
        proptest::option::weighted(0.2, 1u32..=86400),
        vec(slice, 0..3),
    )
        .prop_map(
            move |(
                service_type,
                v4,
                v6,
                mut protocols,
                external_ip,
                lb_ingress,
                source_ranges,
                local_external,
                local_internal,
                affinity,
                slices,
            )| {
                protocols.dedup();
                ValidService {
                    i,
                    service_type,
                    v4,
                    v6,
                    protocols,
                    external_ip,
                    lb_ingress,
                    source_ranges,
                    local_external,
                    local_internal,
                    affinity,
                    slices,
                }
            },
        )
        .boxed()
}

/// A valid cluster as the objects of a file: Services with their slices, this node's Node
/// (`node`, dual-stack) and a ServiceCIDR.
#[derive(Clone, Debug)]
pub struct ValidCluster {
    pub services: Vec<ValidService>,
    pub node: bool,
}

impl ValidCluster {
    pub fn objects(&self) -> Vec<Value> {
        let mut out: Vec<Value> = self
            .services
            .iter()
            .flat_map(ValidService::objects)
            .collect();
        if self.node {
            out.push(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "node", "labels": {"topology.kubernetes.io/zone": "zone-a"}},
                "spec": {"podCIDRs": ["10.244.1.0/24", "fd00:244:1::/64"]},
                "status": {"addresses": [
                    {"type": "InternalIP", "address": "10.0.0.1"},
                    {"type": "InternalIP", "address": "fd00::1"},
                    {"type": "Hostname", "address": "node"},
                ]},
            }));
        }
        out.push(json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
            "metadata": {"name": "kubernetes"},
            "spec": {"cidrs": ["172.30.0.0/16", "fd00:30::/112"]},
        }));
        out
    }

    pub fn yaml(&self) -> String {
        render(&self.objects(), &Layout::Stream)
    }
}

pub fn valid_cluster(max_services: usize) -> BoxedStrategy<ValidCluster> {
    (
        vec(any::<prop::sample::Index>(), 0..max_services),
        prop::bool::weighted(0.8),
    )
        .prop_flat_map(|(slots, node)| {
            let services: Vec<BoxedStrategy<ValidService>> =
                (0..slots.len()).map(|i| valid_service(i as u8)).collect();
            (services, Just(node))
        })
        .prop_map(|(services, node)| ValidCluster { services, node })
        .boxed()
}
