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
//! - a Service port without session affinity and with 17 to [`BIG_MAX_ENDPOINTS`] endpoints
//!   is map elements too, on the flat path for large Services (see the `big` module): dense
//!   keys `DEST . i` in one shared map per kind of list, a class-set element, and fixed chains
//!   that draw `numgen random mod 2^J` until an index below the list's length comes up;
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

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use data_encoding::BASE32;
use sha2::{Digest, Sha256};

use crate::conflicts::{Suppressed, suppressed};
use crate::convert::slices_by_service;
use crate::decision::{DecisionEnv, LocalTraffic, service_decisions};
use crate::model::{Cluster, EndpointSlice, Service, ServicePort};
use crate::nft::regions::{RegionSource, Regions};
use crate::nft::ruleset::{
    Action, Chain, ChainName, ElementMap, Family, Key, KeyType, Match, Proto, Rule, Set, SetDecl,
    Table, Value, Verdict,
};
use crate::topology::PortEndpoint;

pub use crate::decision::{NoLocalEndpoints, port_endpoints};
pub use crate::settings::{
    BuildConfig, LocalDetector, NodePortAddresses, NodePortIps, node_port_ips,
};

pub mod affinity;
mod base;
mod big;
pub mod diff;
mod port;
pub mod shared;

pub use big::{BIG_MAX_ENDPOINTS, BigList, DRAWS, class_of};

pub use base::base_table;

// Chain, set and map names, shared with kube-proxy so operators find their way around.
pub const SERVICES: &str = "services";
pub const MASQUERADING: &str = "masquerading";
pub const MARK_FOR_MASQUERADE: &str = "mark-for-masquerade";
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
pub const REJECT_SERVICES: &str = "reject-services";
pub const REJECT_NODEPORTS: &str = "reject-nodeports";
pub const FIREWALL_IPS: &str = "firewall-ips";
pub const HAIRPIN_ENDPOINTS: &str = "hairpin-endpoints";
pub const NODEPORTS: &str = "nodeports";
pub const MASQUERADE_SERVICES: &str = "masquerade-services";
pub const MASQUERADE_NODEPORTS: &str = "masquerade-nodeports";
pub const LOCAL_POLICY_SERVICES: &str = "local-policy-services";
pub const EXTERNAL_TO_CLUSTER_IPS: &str = "external-to-cluster-ips";
pub const NODEPORT_TO_CLUSTER_IPS: &str = "nodeport-to-cluster-ips";
pub const NODEPORT_TO_SERVICE_PORTS: &str = "nodeport-to-service-ports";
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

fn jump(chain: &str) -> Action {
    Action::Verdict(Verdict::Jump(chain.into()))
}

/// A `goto` that shares the target's name with the chain's table entry.
fn goto(chain: &ChainName) -> Action {
    Action::Verdict(Verdict::Goto(chain.clone()))
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
    Set::new(decl, ElementMap::new())
}

/// An empty map of endpoints (an endpoint map or an endpoint-list map).
fn endpoint_map(key: KeyType) -> Set {
    empty_set(SetDecl::new(key))
}

/// Local-traffic detection resolved for one family: (source is local, source is not local).
struct Detector {
    is_local: Option<Match>,
    is_not_local: Option<Match>,
}

impl Detector {
    fn of(local: &LocalTraffic) -> Detector {
        let (is_local, is_not_local) = match local {
            LocalTraffic::Unknown => (None, None),
            LocalTraffic::Cidr(net) => (
                Some(Match::Saddr {
                    net: *net,
                    negate: false,
                }),
                Some(Match::Saddr {
                    net: *net,
                    negate: true,
                }),
            ),
            LocalTraffic::Interface { name, prefix } => {
                let iif = |negate| Match::IifName {
                    name: name.clone(),
                    prefix: *prefix,
                    negate,
                };
                (Some(iif(false)), Some(iif(true)))
            }
        };
        Detector {
            is_local,
            is_not_local,
        }
    }
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

/// The result of building one family's table.
#[derive(Clone, Debug)]
pub struct Built {
    pub table: Table,
    pub no_local_endpoints: NoLocalEndpoints,
}

/// What one family's table needs from the cluster beyond the Service itself, resolved once per
/// build.
pub struct BuildEnv {
    decision: DecisionEnv,
    det: Detector,
}

impl BuildEnv {
    pub fn new(cluster: &Cluster, config: &BuildConfig, family: Family) -> BuildEnv {
        let decision = DecisionEnv::new(cluster, config, family);
        let det = Detector::of(&decision.local_traffic);
        BuildEnv { decision, det }
    }
}

/// What one Service contributes to a family's table: its own chains and sets, and its elements
/// of the shared maps (keyed by map name). The elements that grow with the Service's endpoints
/// are kept compact (`lists`, `hairpin`) rather than one B-tree entry each: building and
/// comparing a 5,000-endpoint Service's part that way cost milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fragment {
    pub chains: BTreeMap<ChainName, Chain>,
    pub sets: BTreeMap<String, Set>,
    /// Its elements of shared maps but for those below.
    pub elements: BTreeMap<(&'static str, Key), Option<Value>>,
    /// Its flat-path endpoint lists (elements `DEST . i` of their map: see the `big` module).
    pub lists: Vec<BigList>,
    /// Its endpoints' [`HAIRPIN_ENDPOINTS`] elements (`Key::AddrPair`), sorted, once each.
    pub hairpin: Vec<IpAddr>,
    pub no_local_endpoints: NoLocalEndpoints,
}

impl Fragment {
    /// Every element of shared maps this part holds: (map, key, value).
    pub fn all_elements(&self) -> impl Iterator<Item = (&'static str, Key, Option<Value>)> + '_ {
        let elements = self
            .elements
            .iter()
            .map(|((set, key), value)| (*set, *key, value.clone()));
        let lists = self.lists.iter().flat_map(BigList::elements);
        let hairpin = self
            .hairpin
            .iter()
            .map(|ip| (HAIRPIN_ENDPOINTS, Key::AddrPair(*ip), None));
        elements.chain(lists).chain(hairpin)
    }

    /// [`Fragment::all_elements`] in runs of one map, as they come (a map may have more than
    /// one run): the map's name and its run's (key, value) pairs. Whoever changes a map for a
    /// run finds it once per run, and a large Service's list is one run.
    pub fn element_runs(
        &self,
    ) -> impl Iterator<Item = (&'static str, Vec<(Key, Option<Value>)>)> + '_ {
        self.runs_of(|key, value| (key, value.cloned()))
    }

    /// [`Fragment::element_runs`], keys only.
    pub fn key_runs(&self) -> impl Iterator<Item = (&'static str, Vec<Key>)> + '_ {
        self.runs_of(|key, _| key)
    }

    /// The runs of one map, of what `item` makes of each element's key and value.
    fn runs_of<'a, T: 'a>(
        &'a self,
        item: impl Fn(Key, Option<&Value>) -> T + Copy + 'a,
    ) -> impl Iterator<Item = (&'static str, Vec<T>)> + 'a {
        let mut elements = self.elements.iter().peekable();
        let shared = std::iter::from_fn(move || {
            let ((set, key), value) = elements.next()?;
            let mut run = vec![item(*key, value.as_ref())];
            while let Some(((_, key), value)) = elements.next_if(|((s, _), _)| s == set) {
                run.push(item(*key, value.as_ref()));
            }
            Some((*set, run))
        });
        // A map's lists are one run: the builder sorts them by map and destination.
        let lists = self
            .lists
            .chunk_by(|a, b| a.map == b.map)
            .map(move |lists| {
                let mut run = Vec::with_capacity(lists.iter().map(|l| l.endpoints.len()).sum());
                // List by list: each extends the run at its exact length.
                for l in lists {
                    run.extend(
                        l.entries()
                            .map(|(key, target)| item(key, Some(&l.value(target)))),
                    );
                }
                (lists[0].map, run)
            });
        let hairpin = (!self.hairpin.is_empty()).then(|| {
            let run = self.hairpin.iter().map(|ip| item(Key::AddrPair(*ip), None));
            (HAIRPIN_ENDPOINTS, run.collect())
        });
        shared.chain(lists).chain(hairpin)
    }

    /// The session-affinity timeouts this part's destinations use (see [`affinity`]).
    pub fn affinity_timeouts(&self) -> impl Iterator<Item = u32> + '_ {
        self.elements
            .keys()
            .filter_map(|(set, _)| affinity::timeout_of_set(set))
    }

    /// Creates the endpoint maps this part has elements in and `table` lacks: an endpoint map
    /// (see [`crate::nft::ruleset::Action::DnatRegion`]) exists while it has elements.
    fn add_endpoint_maps(&self, table: &mut Table) {
        for (set, key) in self.elements.keys() {
            if key.key_type() == KeyType::Interval && !table.sets.contains_key(*set) {
                table
                    .sets
                    .insert(set.to_string(), endpoint_map(KeyType::Interval));
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
        for (set, key, value) in self.all_elements() {
            if let Some(s) = table.sets.get_mut(set) {
                s.elements_mut().insert(key, value);
            }
        }
    }
}

/// The part of `family`'s table that Service `svc` (with its EndpointSlices) accounts for.
/// `regions` gives the Service chains their endpoint-map regions; `suppressed` says which of its
/// frontends other Services keep ([`crate::conflicts::suppressed`] in the Service's cluster).
pub fn service_fragment<'s>(
    svc: &Service,
    slices: impl IntoIterator<Item = &'s EndpointSlice>,
    env: &BuildEnv,
    regions: &mut RegionSource<'_>,
    suppressed: &Suppressed,
) -> Fragment {
    let mut part = Fragment::default();
    // Not proxied in a family it has no ClusterIP of.
    if svc.cluster_ip(env.decision.family).is_none() {
        return part;
    }
    let slices: Vec<&EndpointSlice> = slices.into_iter().collect();
    let decisions = service_decisions(svc, &slices, suppressed, &env.decision);
    let shared_targets = shared::add_lists(&mut part, &decisions);
    for (i, decision) in decisions.iter().enumerate() {
        let shared_target = shared_targets.get(i).copied().flatten();
        port::add(&mut part, decision, shared_target, &env.det, regions);
    }
    // Ports may share endpoints.
    part.hairpin.sort_unstable();
    part.hairpin.dedup();
    // In the maps' key order, so that a map's lists come as one sorted run (see `runs_of`).
    part.lists
        .sort_unstable_by(|a, b| (a.map, a.dest).cmp(&(b.map, b.dest)));
    part
}

/// Builds the complete desired table of `family`.
pub fn build(cluster: &Cluster, config: &BuildConfig, family: Family) -> Built {
    let mut table = base_table(config, cluster, family);
    let mut counts = NoLocalEndpoints::default();
    let env = BuildEnv::new(cluster, config, family);
    let by_service = slices_by_service(&cluster.slices);
    let mut regions = Regions::new();
    for svc in cluster.services.values() {
        let slices = by_service.get(&svc.name).into_iter().flatten().copied();
        let sup = suppressed(&cluster.services, svc);
        let part = service_fragment(
            svc,
            slices,
            &env,
            &mut RegionSource::Assign(&mut regions),
            &sup,
        );
        for secs in part.affinity_timeouts() {
            affinity::add_timeout(&mut table, secs);
        }
        part.merge_into(&mut table);
        counts.add(part.no_local_endpoints);
    }
    table.fit_set_sizes(|_| None);
    Built {
        table,
        no_local_endpoints: counts,
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
