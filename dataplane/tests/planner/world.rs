//! The generated clusters' building blocks: Service specs and the cluster and table they make.

use super::*;

/// The fewest endpoints that put a Service port on the flat path for large Services (more than
/// the shared endpoint lists take).
pub const LONG: u16 = LIST_MAX_ENDPOINTS as u16 + 1;

/// The fewest endpoints that give a Service port without session affinity a chain of its own
/// (more than the flat path takes).
pub const HUGE: u16 = BIG_MAX_ENDPOINTS as u16 + 1;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SvcSpec {
    pub id: u8,
    /// Endpoint e is 10.180+e/256.ID.e%256 (10.180.ID.e below 256).
    pub endpoints: Vec<u16>,
    pub node_port: bool,
    pub udp: bool,
    /// The last octet of the ClusterIP 172.30.0.N (default: `id`); Services with the same
    /// one conflict.
    pub cluster_ip: Option<u8>,
    /// External and load-balancer IPs: 172.30.0.N (maybe another Service's ClusterIP) or
    /// 192.0.2.N.
    pub external_ips: Vec<IpAddr>,
    pub load_balancer_ips: Vec<IpAddr>,
    /// The Service port (default 80).
    pub port: Option<u16>,
    /// `creationTimestamp`, in seconds after 2020-01-01.
    pub created: Option<u8>,
    pub affinity: bool,
    /// A second port, "q": the Service port plus one, to target port 8081 (node port plus 100).
    pub second_port: bool,
}

pub fn cluster(specs: &[SvcSpec]) -> Cluster {
    let mut c = Cluster::default();
    for s in specs {
        let name = ObjectName::new("ns", &format!("svc{}", s.id));
        let protocol = if s.udp { Proto::Udp } else { Proto::Tcp };
        c.services.insert(
            name.clone(),
            Arc::new(Service {
                name: name.clone(),
                service_type: if s.node_port {
                    ServiceType::NodePort
                } else {
                    ServiceType::ClusterIp
                },
                cluster_ips: vec![IpAddr::from([172, 30, 0, s.cluster_ip.unwrap_or(s.id)])].into(),
                external_ips: s.external_ips.clone().into(),
                load_balancer_ips: s.load_balancer_ips.clone().into(),
                load_balancer_source_ranges: vec![].into(),
                external_policy_local: false,
                internal_policy_local: false,
                health_check_node_port: None,
                // Timeouts of their own and the default one: a timeout's first Service and
                // its last add and remove record rules.
                affinity_timeout: s
                    .affinity
                    .then_some([60, 10_800, 300][usize::from(s.id) % 3]),
                ports: [("p", 0), ("q", 1)][..1 + usize::from(s.second_port)]
                    .iter()
                    .map(|&(name, i)| ServicePort {
                        name: name.into(),
                        protocol,
                        port: s.port.unwrap_or(80) + i,
                        node_port: s.node_port.then_some(30000 + 100 * i + u16::from(s.id)),
                    })
                    .collect(),
                creation_timestamp: s
                    .created
                    .map(|t| Timestamp::from_second(1_577_836_800 + i64::from(t)).unwrap()),
            }),
        );
        let slice = ObjectName::new("ns", &format!("svc{}-x", s.id));
        c.slices.insert(
            slice.clone(),
            EndpointSlice {
                name: slice,
                service: name,
                family: Family::V4,
                ports: [("p", 8080), ("q", 8081)]
                    .map(|(name, port)| EndpointPort {
                        name: name.into(),
                        protocol,
                        port,
                    })
                    .into(),
                endpoints: s
                    .endpoints
                    .iter()
                    .map(|e| Endpoint {
                        addr: IpAddr::from([10, 180 + (*e >> 8) as u8, s.id, *e as u8]),
                        ready: true,
                        serving: true,
                        terminating: false,
                        site: Site::new(Some("node"), Hints::default()),
                    })
                    .collect(),
                trigger_time: None,
            },
        );
    }
    c
}

pub fn config() -> BuildConfig {
    BuildConfig {
        node_name: "node".into(),
        local_detector: LocalDetector::ClusterCidr(vec!["10.0.0.0/8".parse().unwrap()]),
        ..BuildConfig::default()
    }
}

pub fn table(specs: &[SvcSpec]) -> Table {
    build(&cluster(specs), &config(), Family::V4).table
}

/// `t` without its choice of endpoint-map regions and of the order of the flat path's lists: every `DnatRegion` rule becomes one `dnat` rule
/// per endpoint of its region, in order, and the endpoint maps go. Two tables that agree here
/// send every connection to the same endpoints with the same odds.
pub fn without_regions(t: &Table) -> Table {
    let mut out = t.clone();
    out.sets.retain(|_, s| s.decl.key != KeyType::Interval);
    // Set sizes depend on history too (a set keeps its size while it fits).
    for set in out.sets.values_mut() {
        set.decl.size = None;
    }
    for chain in out.chains.values_mut() {
        let rules = chain
            .rules
            .iter()
            .flat_map(|rule| match &rule.action {
                Action::DnatRegion { map, offset } => t.sets[*map]
                    .elements
                    .iter()
                    .filter_map(|(k, v)| match (k, v) {
                        (Key::Interval { at, .. }, Some(Value::Endpoint(addr, port)))
                            if region_at(at) == region_at(*offset) =>
                        {
                            Some(Rule::new(rule.matches.clone(), Action::Dnat { addr, port }))
                        }
                        _ => None,
                    })
                    .collect(),
                _ => vec![rule.clone()],
            })
            .collect();
        *chain = Chain {
            rules: Arc::new(rules),
            ..chain.clone()
        };
    }
    // The flat path's lists keep each endpoint's index while it stays (history too): sorted per
    // destination, as a fresh build has them.
    let big_maps = EndpointLists::ALL.map(EndpointLists::big_map);
    for map in big_maps.into_iter().chain([shared::SERVICE_ENDPOINTS]) {
        let Some(set) = out.sets.get_mut(map) else {
            continue;
        };
        let mut by_dest: BTreeMap<Key, Vec<Option<Value>>> = BTreeMap::new();
        for (key, value) in set.elements.iter() {
            let (dest, _) = key.list_destination().expect("a list entry");
            by_dest.entry(dest).or_default().push(value.clone());
        }
        set.elements = std::sync::Arc::new(
            by_dest
                .into_iter()
                .flat_map(|(dest, mut values)| {
                    values.sort();
                    (0u16..)
                        .zip(values)
                        .map(move |(i, v)| (dest.list_entry(i).unwrap(), v))
                })
                .collect(),
        );
    }
    out
}
