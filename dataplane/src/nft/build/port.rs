//! One Service port's part of the nftables table, from its [`PortDecision`]: chains, sets and
//! map elements in nftproxy's shapes (see the module documentation of [`crate::nft::build`]).

use std::cell::LazyCell;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::{
    BIG_MAX_ENDPOINTS, CLUSTER_IPS, Detector, EXTERNAL_TO_CLUSTER_IPS, EndpointLists, FIREWALL_IPS,
    Fragment, LIST_MAX_ENDPOINTS, LOCAL_POLICY_NODEPORTS, LOCAL_POLICY_SERVICES,
    MARK_FOR_MASQUERADE, MASQUERADE_NODEPORTS, MASQUERADE_SERVICES, NO_ENDPOINT_NODEPORTS,
    NO_ENDPOINT_SERVICES, NODEPORT_TO_CLUSTER_IPS, NODEPORT_TO_SERVICE_PORTS, REJECT_NODEPORTS,
    REJECT_SERVICES, SERVICE_IPS, SERVICE_NODEPORTS, affinity, big, dnat_rule, empty_set,
    endpoint_base, goto, jump, local_policy_rules, regular, service_port_base, shared,
};
use crate::decision::{Frontend, FrontendKind, PortDecision, Target};
use crate::model::port_label;
use crate::model::{Service, ServicePort};
use crate::nft::regions::RegionSource;
use crate::nft::ruleset::{
    Action, ChainName, Key, KeyType, Match, Proto, REGION_MAX_ENDPOINTS, Rule, SetDecl, Value,
    Verdict, region_elements, region_offset,
};
use crate::topology::{Placement, PortEndpoint};

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

/// The map key of `frontend`: `ADDR . PROTO . PORT`, or `PROTO . PORT` for a node port.
fn key(frontend: Frontend, proto: Proto) -> Key {
    match frontend {
        Frontend::Addr(ip, port) => Key::AddrProtoPort(ip, proto, port),
        Frontend::NodePort(port) => Key::ProtoPort(proto, port),
    }
}

/// `services` for an address, `nodeports` for a node port.
fn pick(frontend: Frontend, services: &'static str, nodeports: &'static str) -> &'static str {
    match frontend {
        Frontend::Addr(..) => services,
        Frontend::NodePort(_) => nodeports,
    }
}

fn insert_element(part: &mut Fragment, set: &'static str, key: Key, value: Option<Verdict>) {
    part.elements.insert((set, key), value.map(Value::Verdict));
}

/// A large list's endpoints, shared by the lists of a port's frontends.
type ListEndpoints = Arc<[crate::nft::ruleset::Target]>;

/// Adds the endpoint list of `frontend`: with k ≤ [`LIST_MAX_ENDPOINTS`] endpoints, entry i of
/// the map for k endpoints DNATs to endpoint i; with more, the flat path's elements ([`big`]),
/// whose endpoints `shared` keeps for the port's other frontends.
fn list_elements(
    part: &mut Fragment,
    frontend: Frontend,
    proto: Proto,
    local: bool,
    eps: &[PortEndpoint],
    shared: &mut Option<ListEndpoints>,
) {
    let lists = EndpointLists::of(local, matches!(frontend, Frontend::NodePort(_)));
    if eps.len() > LIST_MAX_ENDPOINTS {
        let targets =
            shared.get_or_insert_with(|| eps.iter().map(|ep| (ep.addr, ep.port)).collect());
        return big::add_elements(part, lists, key(frontend, proto), targets.clone());
    }
    let map = lists.map(eps.len());
    for (i, ep) in (0u16..).zip(eps) {
        let key = key(frontend, proto)
            .list_entry(i)
            .expect("a destination key");
        part.elements
            .insert((map, key), Some(Value::Endpoint(ep.addr, ep.port)));
    }
}

/// Gives `frontend` session affinity with timeout `secs`: its clients are sent back to their
/// endpoint and recorded (see [`affinity`]).
fn affinity_elements(part: &mut Fragment, frontend: Frontend, proto: Proto, secs: u32) {
    let (services, nodeports) = affinity::timeout_sets(secs);
    let all = pick(
        frontend,
        affinity::AFFINITY_SERVICES,
        affinity::AFFINITY_NODEPORTS,
    );
    let timeout = pick(frontend, services, nodeports);
    for set in [all, timeout] {
        insert_element(part, set, key(frontend, proto), None);
    }
}

/// With session affinity (and more endpoints than the flat path takes), each endpoint gets a chain that records the client in its affinity
/// set and DNATs: (endpoint) → (chain, affinity set).
fn affinity_chains(
    part: &mut Fragment,
    d: &PortDecision<'_>,
) -> BTreeMap<(IpAddr, u16), (ChainName, String)> {
    let Some(timeout) = d.affinity_timeout else {
        return BTreeMap::new();
    };
    let proto = d.port.protocol;
    d.endpoints
        .all_reachable()
        .iter()
        .map(|ep| {
            let eb = endpoint_base(d.svc, d.port, ep);
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
                    port_label(d.svc, d.port),
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
        .collect()
}

/// The endpoints a connection through this port's frontends can be translated back to its
/// own source from: those kube-proxy's hairpin rule (`ip saddr EP jump mark-for-masquerade`)
/// masquerades.
///
/// A source on another node reaches this node's frontends from outside, where that traffic is
/// masqueraded anyway (ClusterIP traffic from outside the pod network, NodePort and external
/// traffic with externalTrafficPolicy Cluster) or goes to this node's endpoints (Local), except
/// where Local short-circuits pod traffic to the cluster list: only there can a pod on another
/// node be sent back to itself. So an endpoint the EndpointSlice places on another node needs
/// an element only for such a port; the others (this node's, and those of no known node) always.
/// The one path left out is ClusterIP traffic from a pod on another node that its own node
/// did not translate, which kube-proxy sends to one of the endpoints unmasqueraded (so its
/// replies bypass this node) unless it picked the pod itself.
fn hairpin_addresses<'d>(d: &'d PortDecision<'_>) -> impl Iterator<Item = IpAddr> + 'd {
    let short_circuit = d.external.is_some_and(|e| e.short_circuit);
    d.endpoints
        .all_reachable()
        .iter()
        .filter(move |ep| short_circuit || ep.placement != Placement::Elsewhere)
        .map(|ep| ep.addr)
}

/// Adds what one Service port contributes to the table. With `shared_target`, its ClusterIP
/// list is the one its protocol's ports share (see `shared`), read with that target port.
pub(super) fn add(
    part: &mut Fragment,
    d: &PortDecision<'_>,
    shared_target: Option<u16>,
    det: &Detector,
    regions: &mut RegionSource<'_>,
) {
    let proto = d.port.protocol;
    let svc = d.svc;
    // The names cost a SHA-256, and most Service ports have no chain.
    let names = LazyCell::new(|| ChainNames::of(svc, d.port));
    let comment = || port_label(svc, d.port);
    let cluster_ip = d.cluster_ip();
    if !d.has_frontends() {
        return;
    }
    let frontends: Vec<Frontend> = d.external_frontends().collect();
    let cip_key = cluster_ip.map(|ip| Key::AddrProtoPort(ip, proto, d.port.port));
    if let Some(ip) = cluster_ip {
        insert_element(part, CLUSTER_IPS, Key::Addr(ip), None);
    }

    if !d.has_endpoints() {
        if let Some(key) = cip_key {
            insert_element(part, REJECT_SERVICES, key, None);
        }
        for frontend in &frontends {
            let set = pick(*frontend, REJECT_SERVICES, REJECT_NODEPORTS);
            insert_element(part, set, key(*frontend, proto), None);
        }
        return;
    }
    part.no_local_endpoints.add(d.no_local_endpoints);

    let cluster_eps = d.cluster_endpoints();
    let local_eps = d.local_endpoints();
    // With at most `BIG_MAX_ENDPOINTS` endpoints, the Service port needs no chain: its
    // frontends' endpoint lists are map elements that the shared `…-endpoints` chains DNAT to
    // (through the flat path's chains above 16 endpoints), and session affinity is elements of
    // the sets that say which destinations have it (see `affinity`).
    let direct = cluster_eps.len() <= BIG_MAX_ENDPOINTS && local_eps.len() <= BIG_MAX_ENDPOINTS;
    // A chain's endpoints are DNATed to straight from the cascade; with session affinity each
    // gets an endpoint chain that also records the client.
    let affinity_chains = if direct {
        BTreeMap::new()
    } else {
        affinity_chains(part, d)
    };
    part.hairpin.extend(hairpin_addresses(d));
    let dispatch = |part: &mut Fragment,
                    chain: &ChainName,
                    eps: &[PortEndpoint],
                    regions: &mut RegionSource<'_>|
     -> Vec<Rule> {
        if affinity_chains.is_empty()
            && eps.len() <= REGION_MAX_ENDPOINTS
            && let Some(region) = regions.pick(chain)
        {
            let offset = region_offset(region.region);
            let targets: Vec<(IpAddr, u16)> = eps.iter().map(|ep| (ep.addr, ep.port)).collect();
            for (key, value) in region_elements(offset, &targets) {
                part.elements.insert((region.map_name(), key), Some(value));
            }
            return vec![Rule::new(
                vec![Match::L4Proto(proto)],
                Action::DnatRegion {
                    map: region.map_name(),
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

    if !direct && !cluster_eps.is_empty() {
        let mut chain = regular(dispatch(part, &names.cluster, cluster_eps, regions));
        chain.comment = Some(comment().into());
        part.chains.insert(names.cluster.clone(), chain);
    }
    if !direct && !local_eps.is_empty() {
        let mut chain = regular(dispatch(part, &names.local, local_eps, regions));
        chain.comment = Some(comment().into());
        part.chains.insert(names.local.clone(), chain);
    }
    // A large list's endpoints, made once for all the frontends that list them.
    let mut shared: [Option<ListEndpoints>; 2] = [None, None];
    let mut list = |part: &mut Fragment, frontend: Frontend, local: bool| {
        let eps = if local { local_eps } else { cluster_eps };
        if !eps.is_empty() {
            let shared = &mut shared[usize::from(local)];
            list_elements(part, frontend, proto, local, eps, shared);
        }
        if let Some(secs) = d.affinity_timeout {
            affinity_elements(part, frontend, proto, secs);
        }
    };

    // Internal (ClusterIP) traffic, unless another Service keeps the ClusterIP.
    if let (Some(cluster_ip), Some(cip_key), Some(target)) = (cluster_ip, cip_key, d.internal) {
        match target {
            Target::Cluster | Target::Local => {
                let local = target == Target::Local;
                if let Some(to) = shared_target {
                    shared::add_target_port(part, cluster_ip, proto, d.port.port, to);
                } else if direct {
                    list(part, Frontend::Addr(cluster_ip, d.port.port), local);
                } else {
                    let chain = if local { &names.local } else { &names.cluster };
                    let to = Some(Verdict::Goto(chain.clone()));
                    insert_element(part, SERVICE_IPS, cip_key, to);
                }
            }
            Target::Drop => {
                insert_element(part, NO_ENDPOINT_SERVICES, cip_key, Some(Verdict::Drop))
            }
            Target::Reject => unreachable!("a port without endpoints returned above"),
        }
    }

    // External (NodePort, external IP, load balancer IP) traffic.
    let Some(external) = d.external else {
        return;
    };
    if direct {
        // An external IP, load-balancer IP or TCP NodePort whose traffic goes to the same
        // endpoints as the ClusterIP's shares the ClusterIP's list: the packet's destination is
        // rewritten to the ClusterIP's before the lists are looked up, so a Service's endpoints
        // are in one list per port, not one per frontend. With session affinity each
        // destination keeps its own list, since a client is remembered per destination the
        // packet had at the lookup.
        let shared_cluster_ip = match (cluster_ip, d.internal) {
            (Some(ip), Some(Target::Cluster))
                if !external.short_circuit && d.affinity_timeout.is_none() =>
            {
                Some(ip)
            }
            _ => None,
        };
        for frontend in &frontends {
            let policy = if external.short_circuit {
                pick(*frontend, LOCAL_POLICY_SERVICES, LOCAL_POLICY_NODEPORTS)
            } else {
                pick(*frontend, MASQUERADE_SERVICES, MASQUERADE_NODEPORTS)
            };
            insert_element(part, policy, key(*frontend, proto), None);
            match (shared_cluster_ip, frontend) {
                (Some(ip), Frontend::Addr(..)) => {
                    part.elements.insert(
                        (EXTERNAL_TO_CLUSTER_IPS, key(*frontend, proto)),
                        Some(Value::Addr(ip)),
                    );
                    continue;
                }
                // Only TCP: rewriting a UDP port would break a checksum of 0.
                (Some(ip), Frontend::NodePort(_)) if proto == Proto::Tcp => {
                    let key = key(*frontend, proto);
                    part.elements
                        .insert((NODEPORT_TO_CLUSTER_IPS, key), Some(Value::Addr(ip)));
                    part.elements.insert(
                        (NODEPORT_TO_SERVICE_PORTS, key),
                        Some(Value::Port(d.port.port)),
                    );
                    continue;
                }
                _ => {}
            }
            list(part, *frontend, false);
            if external.short_circuit {
                list(part, *frontend, true);
            }
        }
    } else {
        let rules = if external.short_circuit {
            let local = (!local_eps.is_empty()).then_some(&names.local);
            local_policy_rules(det, &names.cluster, local)
        } else {
            vec![
                Rule::new(vec![], jump(MARK_FOR_MASQUERADE)),
                Rule::new(vec![], goto(&names.cluster)),
            ]
        };
        let mut chain = regular(rules);
        chain.comment = Some(comment().into());
        part.chains.insert(names.external.clone(), chain);
        let to_external = Some(Verdict::Goto(names.external.clone()));
        for frontend in &frontends {
            let map = pick(*frontend, SERVICE_IPS, SERVICE_NODEPORTS);
            insert_element(part, map, key(*frontend, proto), to_external.clone());
        }
    }
    if external.target == Target::Drop {
        for frontend in &frontends {
            let map = pick(*frontend, NO_ENDPOINT_SERVICES, NO_ENDPOINT_NODEPORTS);
            insert_element(part, map, key(*frontend, proto), Some(Verdict::Drop));
        }
    }

    // loadBalancerSourceRanges, checked before DNAT.
    if let Some(fw) = &d.firewall {
        let lb_ips: Vec<IpAddr> = d.kept_ips(FrontendKind::LoadBalancerIp).collect();
        let mut allowed = fw.ranges.clone();
        if fw.allow_lb_ips {
            allowed.extend(lb_ips.iter().map(|ip| IpNet::from(*ip)));
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
        chain.comment = Some(comment().into());
        part.chains.insert(names.firewall.clone(), chain);
        for ip in &lb_ips {
            insert_element(
                part,
                FIREWALL_IPS,
                Key::AddrProtoPort(*ip, proto, d.port.port),
                Some(Verdict::Goto(names.firewall.clone())),
            );
        }
    }
}
