//! Builders for the Kubernetes objects the end-to-end suites feed to `nftproxy --from-file`
//! (Services, EndpointSlices, a Node, ServiceCIDRs) and for `KubeProxyConfiguration` files.
//!
//! Everything is written as JSON, which is valid YAML, so the files load exactly like
//! `kubectl get -o yaml` output would.
//!
//! ```
//! use nftproxy_tests::Proto;
//! use nftproxy_tests::cluster::{Endpoint, Objects, ProxyConfig, Service, Slice, node};
//! let objects = Objects::new()
//!     .with(node("test-node", &["192.168.0.2"], &[]))
//!     .with(
//!         Service::new("ns1", "svc1", "172.30.0.41")
//!             .load_balancer(&["1.2.3.4"])
//!             .port("p80", Proto::Tcp, 80)
//!             .node_port(3001),
//!     )
//!     .with(
//!         Slice::new("ns1", "svc1-a", "svc1")
//!             .port("p80", Proto::Tcp, 80)
//!             .endpoint(Endpoint::new("10.180.0.1").node("test-node")),
//!     );
//! let list: serde_json::Value = serde_json::from_str(&objects.to_yaml()).unwrap();
//! assert_eq!(list["kind"], "List");
//! assert_eq!(list["items"][1]["spec"]["ports"][0]["nodePort"], 3001);
//! let config = ProxyConfig::new("test-node").cluster_cidr("10.0.0.0/8").to_yaml();
//! assert!(config.contains("KubeProxyConfiguration"));
//! ```

use serde_json::{Map, Value, json};

use crate::probe::Proto;

fn k8s_proto(p: Proto) -> &'static str {
    match p {
        Proto::Tcp => "TCP",
        Proto::Udp => "UDP",
        Proto::Sctp => "SCTP",
    }
}

fn is_v6(ip: &str) -> bool {
    ip.contains(':')
}

/// A `kind: List` of objects.
#[derive(Clone, Debug, Default)]
pub struct Objects {
    items: Vec<Value>,
}

impl Objects {
    pub fn new() -> Objects {
        Objects::default()
    }

    /// Adds an object (a [`Service`], [`Slice`] or any JSON value).
    pub fn with(mut self, object: impl Into<Value>) -> Objects {
        self.push(object);
        self
    }

    pub fn push(&mut self, object: impl Into<Value>) {
        self.items.push(object.into());
    }

    /// Adds every object of `other`.
    pub fn extend(mut self, other: &Objects) -> Objects {
        self.items.extend(other.items.iter().cloned());
        self
    }

    pub fn items(&self) -> &[Value] {
        &self.items
    }

    /// The list as YAML (JSON) text.
    pub fn to_yaml(&self) -> String {
        let list = json!({"apiVersion": "v1", "kind": "List", "items": self.items});
        serde_json::to_string_pretty(&list).expect("serializable")
    }
}

/// A Node with `InternalIP` addresses and `spec.podCIDRs`.
pub fn node(name: &str, internal_ips: &[&str], pod_cidrs: &[&str]) -> Value {
    let addresses: Vec<Value> = internal_ips
        .iter()
        .map(|ip| json!({"type": "InternalIP", "address": ip}))
        .collect();
    let mut spec = Map::new();
    if let Some(first) = pod_cidrs.first() {
        spec.insert("podCIDR".into(), json!(first));
        spec.insert("podCIDRs".into(), json!(pod_cidrs));
    }
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "spec": spec,
        "status": {"addresses": addresses},
    })
}

/// A `networking.k8s.io/v1` ServiceCIDR.
pub fn service_cidr(name: &str, cidrs: &[&str]) -> Value {
    json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "ServiceCIDR",
        "metadata": {"name": name},
        "spec": {"cidrs": cidrs},
    })
}

/// A Service. Port modifiers ([`Service::node_port`], [`Service::target_port`]) apply to the
/// port added last.
#[derive(Clone, Debug)]
pub struct Service {
    metadata: Map<String, Value>,
    spec: Map<String, Value>,
    ingress: Vec<Value>,
}

impl Service {
    /// A `ClusterIP` Service with one cluster IP (its family decides `ipFamilies`).
    pub fn new(namespace: &str, name: &str, cluster_ip: &str) -> Service {
        Service::with_cluster_ips(namespace, name, &[cluster_ip])
    }

    /// A Service with one cluster IP per family (dual-stack when two are given).
    pub fn with_cluster_ips(namespace: &str, name: &str, cluster_ips: &[&str]) -> Service {
        let mut metadata = Map::new();
        metadata.insert("name".into(), json!(name));
        metadata.insert("namespace".into(), json!(namespace));
        let mut spec = Map::new();
        spec.insert("type".into(), json!("ClusterIP"));
        spec.insert("clusterIP".into(), json!(cluster_ips[0]));
        spec.insert("clusterIPs".into(), json!(cluster_ips));
        let families: Vec<&str> = cluster_ips
            .iter()
            .map(|ip| if is_v6(ip) { "IPv6" } else { "IPv4" })
            .collect();
        spec.insert("ipFamilies".into(), json!(families));
        spec.insert(
            "ipFamilyPolicy".into(),
            json!(if cluster_ips.len() > 1 {
                "RequireDualStack"
            } else {
                "SingleStack"
            }),
        );
        spec.insert("ports".into(), json!([]));
        Service {
            metadata,
            spec,
            ingress: Vec::new(),
        }
    }

    pub fn service_type(mut self, t: &str) -> Service {
        self.spec.insert("type".into(), json!(t));
        self
    }

    /// `type: NodePort`.
    pub fn node_port_type(self) -> Service {
        self.service_type("NodePort")
    }

    /// `type: LoadBalancer` with these `status.loadBalancer.ingress` IPs.
    pub fn load_balancer(mut self, ingress_ips: &[&str]) -> Service {
        self.ingress = ingress_ips.iter().map(|ip| json!({"ip": ip})).collect();
        self.service_type("LoadBalancer")
    }

    /// Adds a port (`name` may be empty for a single unnamed port).
    pub fn port(mut self, name: &str, proto: Proto, port: u16) -> Service {
        let mut p = Map::new();
        if !name.is_empty() {
            p.insert("name".into(), json!(name));
        }
        p.insert("protocol".into(), json!(k8s_proto(proto)));
        p.insert("port".into(), json!(port));
        self.ports().push(Value::Object(p));
        self
    }

    fn ports(&mut self) -> &mut Vec<Value> {
        self.spec
            .get_mut("ports")
            .and_then(Value::as_array_mut)
            .expect("ports array")
    }

    fn last_port(&mut self) -> &mut Map<String, Value> {
        self.ports()
            .last_mut()
            .and_then(Value::as_object_mut)
            .expect("add a port first")
    }

    /// `nodePort` of the last port.
    pub fn node_port(mut self, node_port: u16) -> Service {
        self.last_port().insert("nodePort".into(), json!(node_port));
        self
    }

    /// `targetPort` of the last port: a number (`"8443"`) or a container port name (`"web"`).
    pub fn target_port(mut self, target: &str) -> Service {
        let v = match target.parse::<u16>() {
            Ok(n) => json!(n),
            Err(_) => json!(target),
        };
        self.last_port().insert("targetPort".into(), v);
        self
    }

    pub fn external_ips(mut self, ips: &[&str]) -> Service {
        self.spec.insert("externalIPs".into(), json!(ips));
        self
    }

    pub fn source_ranges(mut self, ranges: &[&str]) -> Service {
        self.spec
            .insert("loadBalancerSourceRanges".into(), json!(ranges));
        self
    }

    /// `externalTrafficPolicy: Local`.
    pub fn external_local(mut self) -> Service {
        self.spec
            .insert("externalTrafficPolicy".into(), json!("Local"));
        self
    }

    /// `internalTrafficPolicy: Local`.
    pub fn internal_local(mut self) -> Service {
        self.spec
            .insert("internalTrafficPolicy".into(), json!("Local"));
        self
    }

    pub fn health_check_node_port(mut self, port: u16) -> Service {
        self.spec.insert("healthCheckNodePort".into(), json!(port));
        self
    }

    /// `sessionAffinity: ClientIP` with this timeout.
    pub fn client_ip_affinity(mut self, timeout_seconds: u32) -> Service {
        self.spec
            .insert("sessionAffinity".into(), json!("ClientIP"));
        self.spec.insert(
            "sessionAffinityConfig".into(),
            json!({"clientIP": {"timeoutSeconds": timeout_seconds}}),
        );
        self
    }

    pub fn label(mut self, key: &str, value: &str) -> Service {
        let labels = self
            .metadata
            .entry("labels")
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .expect("labels object");
        labels.insert(key.into(), json!(value));
        self
    }
}

impl From<Service> for Value {
    fn from(s: Service) -> Value {
        let mut v = json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": s.metadata,
            "spec": s.spec,
        });
        if !s.ingress.is_empty() {
            v["status"] = json!({"loadBalancer": {"ingress": s.ingress}});
        }
        v
    }
}

/// One endpoint of an EndpointSlice; ready, serving and not terminating unless told.
#[derive(Clone, Debug)]
pub struct Endpoint {
    ip: String,
    node: Option<String>,
    ready: bool,
    serving: bool,
    terminating: bool,
}

impl Endpoint {
    pub fn new(ip: &str) -> Endpoint {
        Endpoint {
            ip: ip.to_string(),
            node: None,
            ready: true,
            serving: true,
            terminating: false,
        }
    }

    /// `nodeName`.
    pub fn node(mut self, node: &str) -> Endpoint {
        self.node = Some(node.to_string());
        self
    }

    /// The `ready`, `serving` and `terminating` conditions.
    pub fn conditions(mut self, ready: bool, serving: bool, terminating: bool) -> Endpoint {
        self.ready = ready;
        self.serving = serving;
        self.terminating = terminating;
        self
    }

    fn to_value(&self) -> Value {
        let mut e = json!({
            "addresses": [self.ip],
            "conditions": {
                "ready": self.ready,
                "serving": self.serving,
                "terminating": self.terminating,
            },
        });
        if let Some(n) = &self.node {
            e["nodeName"] = json!(n);
        }
        e
    }
}

/// A `discovery.k8s.io/v1` EndpointSlice of one Service. The address type follows the first
/// endpoint (IPv4 if there is none, unless [`Slice::ipv6`]).
#[derive(Clone, Debug)]
pub struct Slice {
    namespace: String,
    name: String,
    service: String,
    ipv6: bool,
    ports: Vec<Value>,
    endpoints: Vec<Endpoint>,
}

impl Slice {
    pub fn new(namespace: &str, name: &str, service: &str) -> Slice {
        Slice {
            namespace: namespace.into(),
            name: name.into(),
            service: service.into(),
            ipv6: false,
            ports: Vec::new(),
            endpoints: Vec::new(),
        }
    }

    /// `addressType: IPv6` (also implied by an IPv6 first endpoint).
    pub fn ipv6(mut self) -> Slice {
        self.ipv6 = true;
        self
    }

    /// Adds a port; `name` must equal the Service port's name (empty for an unnamed one).
    pub fn port(mut self, name: &str, proto: Proto, port: u16) -> Slice {
        let mut p = Map::new();
        if !name.is_empty() {
            p.insert("name".into(), json!(name));
        }
        p.insert("protocol".into(), json!(k8s_proto(proto)));
        p.insert("port".into(), json!(port));
        self.ports.push(Value::Object(p));
        self
    }

    pub fn endpoint(mut self, e: Endpoint) -> Slice {
        self.endpoints.push(e);
        self
    }

    pub fn endpoints(mut self, eps: impl IntoIterator<Item = Endpoint>) -> Slice {
        self.endpoints.extend(eps);
        self
    }
}

impl From<Slice> for Value {
    fn from(s: Slice) -> Value {
        let v6 = s.ipv6 || s.endpoints.first().is_some_and(|e| is_v6(&e.ip));
        json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": s.name,
                "namespace": s.namespace,
                "labels": {"kubernetes.io/service-name": s.service},
            },
            "addressType": if v6 { "IPv6" } else { "IPv4" },
            "ports": s.ports,
            "endpoints": s.endpoints.iter().map(Endpoint::to_value).collect::<Vec<_>>(),
        })
    }
}

/// A `KubeProxyConfiguration` (kubeproxy.config.k8s.io/v1alpha1), mode nftables.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    v: Map<String, Value>,
}

impl ProxyConfig {
    pub fn new(hostname_override: &str) -> ProxyConfig {
        let mut v = Map::new();
        v.insert(
            "apiVersion".into(),
            json!("kubeproxy.config.k8s.io/v1alpha1"),
        );
        v.insert("kind".into(), json!("KubeProxyConfiguration"));
        v.insert("mode".into(), json!("nftables"));
        v.insert("hostnameOverride".into(), json!(hostname_override));
        ProxyConfig { v }
    }

    /// `clusterCIDR` (comma-separated, one per family).
    pub fn cluster_cidr(mut self, cidrs: &str) -> ProxyConfig {
        self.v.insert("clusterCIDR".into(), json!(cidrs));
        self
    }

    pub fn node_port_addresses(mut self, list: &[&str]) -> ProxyConfig {
        self.v.insert("nodePortAddresses".into(), json!(list));
        self
    }

    /// `nftables.masqueradeAll` and `iptables.masqueradeAll` (each mode reads its own
    /// section, so the file works with `--proxy-mode` either way).
    pub fn masquerade_all(mut self, on: bool) -> ProxyConfig {
        for mode in ["nftables", "iptables"] {
            self.section(mode).insert("masqueradeAll".into(), json!(on));
        }
        self
    }

    fn section(&mut self, name: &str) -> &mut Map<String, Value> {
        self.v
            .entry(name)
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .expect("mode section object")
    }

    /// `detectLocalMode`: ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix.
    pub fn detect_local_mode(mut self, mode: &str) -> ProxyConfig {
        self.v.insert("detectLocalMode".into(), json!(mode));
        self
    }

    fn detect_local(&mut self) -> &mut Map<String, Value> {
        self.v
            .entry("detectLocal")
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .expect("detectLocal object")
    }

    /// `detectLocalMode: BridgeInterface` with this interface.
    pub fn bridge_interface(mut self, name: &str) -> ProxyConfig {
        self.detect_local()
            .insert("bridgeInterface".into(), json!(name));
        self.detect_local_mode("BridgeInterface")
    }

    /// `detectLocalMode: InterfaceNamePrefix` with this prefix.
    pub fn interface_name_prefix(mut self, prefix: &str) -> ProxyConfig {
        self.detect_local()
            .insert("interfaceNamePrefix".into(), json!(prefix));
        self.detect_local_mode("InterfaceNamePrefix")
    }

    pub fn to_yaml(&self) -> String {
        serde_json::to_string_pretty(&self.v).expect("serializable")
    }
}
