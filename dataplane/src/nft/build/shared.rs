//! Large Services whose ports share one address list.
//!
//! A flat-path list ([`super::big`]) is per destination: a Service of two ports and 1,000
//! endpoints is 2,000 map elements, which the kernel takes over 1 ms to add (about 0.5 µs per
//! element at 100k Services). When every port of one protocol of a ClusterIP lists the same
//! endpoint addresses in the same order, and each port has one target port for all its
//! endpoints, the ports share one list of addresses instead: entry i of
//! `big-service-endpoints` maps `CLUSTER-IP . PROTO . i` to endpoint i's address, and
//! `service-target-ports` maps each `CLUSTER-IP . PROTO . PORT` to the port's target port. One
//! rule reads both: `dnat to ip daddr . meta l4proto . numgen random mod 2^J map
//! @big-service-endpoints : ip daddr . meta l4proto . th dport map @service-target-ports`,
//! drawn as on the flat path (the same classes, draws and fallback), from class sets keyed by
//! `CLUSTER-IP . PROTO`.
//!
//! The ClusterIP's own list is the one shared: external IPs, load-balancer IPs and TCP
//! NodePorts that share the ClusterIP's list (see `port`) are rewritten to it before the lists
//! are looked up, so they reach this one too. Ports that could not share all (a port with
//! session affinity, a Local internal policy, a short list, other endpoints or target ports
//! that differ by endpoint) keep a list each, for every port of that protocol: the class sets'
//! `CLUSTER-IP . PROTO` must never catch a port that has no target port here. A ClusterIP
//! belongs to one Service ([`crate::conflicts`]), so no other Service has elements under it.

use std::net::IpAddr;
use std::sync::{Arc, LazyLock};

use super::big::{self, BIG_CLASS_MIN, DRAWS};
use super::{BigList, Fragment, LIST_MAX_ENDPOINTS, empty_set, goto, jump, regular};
use crate::decision::{PortDecision, Target};
use crate::nft::ruleset::{
    Action, Chain, ChainName, Key, KeyType, Match, Proto, Rule, Set, SetDecl, Value,
};
use crate::topology::PortEndpoint;

/// The shared address lists: `CLUSTER-IP . PROTO . i` → address of endpoint i.
pub const SERVICE_ENDPOINTS: &str = "big-service-endpoints";
/// The target port of every port that reads a shared list: `CLUSTER-IP . PROTO . PORT` → port.
pub const SERVICE_TARGET_PORTS: &str = "service-target-ports";

const FIRST: &str = "big-service-first";

struct Names {
    class_sets: Vec<String>,
    chains: Vec<String>,
    draws: Vec<String>,
}

static NAMES: LazyLock<Names> = LazyLock::new(|| Names {
    class_sets: big::classes()
        .map(|j| format!("big-service-class-{j}"))
        .collect(),
    chains: big::classes().map(|j| format!("big-service-{j}")).collect(),
    draws: big::classes()
        .map(|j| format!("big-service-draw-{j}"))
        .collect(),
});

/// The class set of shared lists of class `j`: `CLUSTER-IP . PROTO` elements.
pub fn class_set(j: u32) -> &'static str {
    &NAMES.class_sets[(j - BIG_CLASS_MIN) as usize]
}

fn chain(j: u32) -> &'static str {
    &NAMES.chains[(j - BIG_CLASS_MIN) as usize]
}

fn draw(j: u32) -> &'static str {
    &NAMES.draws[(j - BIG_CLASS_MIN) as usize]
}

fn dnat(modulus: u32) -> Rule {
    Rule::new(
        vec![],
        Action::DnatShared {
            addresses: SERVICE_ENDPOINTS,
            ports: SERVICE_TARGET_PORTS,
            modulus,
        },
    )
}

/// The rules `cluster-endpoints` ends with (after every per-destination list), and the fixed
/// chains and sets they use.
pub(super) fn add_base(
    chains: &mut std::collections::BTreeMap<ChainName, Chain>,
    sets: &mut std::collections::BTreeMap<String, Set>,
    cluster_endpoints: &mut Vec<Rule>,
) {
    for j in big::classes() {
        let class: ChainName = chain(j).into();
        cluster_endpoints.push(Rule::new(
            vec![Match::AddrProtoInSet {
                set: class_set(j).into(),
            }],
            goto(&class),
        ));
        let mut draws: Vec<Rule> = (0..DRAWS)
            .map(|_| Rule::new(vec![], jump(draw(j))))
            .collect();
        draws.push(Rule::new(vec![], goto(&FIRST.into())));
        chains.insert(class, regular(draws));
        chains.insert(draw(j).into(), regular(vec![dnat(1 << j)]));
        let comment = format!(
            "ClusterIPs and protocols whose ports share {}..{} endpoints in @{SERVICE_ENDPOINTS}",
            (1 << (j - 1)) + 1,
            1 << j
        );
        sets.insert(class_set(j).into(), set(KeyType::AddrProto, comment));
    }
    chains.insert(FIRST.into(), regular(vec![dnat(1)]));
    sets.insert(
        SERVICE_ENDPOINTS.into(),
        empty_set(SetDecl::new(KeyType::AddrProtoIndex)),
    );
    sets.insert(
        SERVICE_TARGET_PORTS.into(),
        set(
            KeyType::AddrProtoPortToPort,
            format!("the target port of each Service port that reads @{SERVICE_ENDPOINTS}"),
        ),
    );
}

fn set(key: KeyType, comment: String) -> Set {
    empty_set(SetDecl {
        comment: Some(comment),
        ..SetDecl::new(key)
    })
}

/// A port's ClusterIP list that it could share with the other ports of its protocol.
struct Candidate<'d> {
    cluster_ip: IpAddr,
    /// Its cluster-wide endpoints: more than a short list holds, few enough for the flat path.
    endpoints: &'d [PortEndpoint<'d>],
    /// The one target port of all its endpoints.
    target: u16,
}

/// The list `d` could share, if it may (see the module documentation).
fn candidate<'d>(d: &'d PortDecision<'_>) -> Option<Candidate<'d>> {
    let cluster_ip = d.cluster_ip()?;
    let endpoints = d.cluster_endpoints();
    let target = endpoints.first()?.port;
    let fits = endpoints.len() > LIST_MAX_ENDPOINTS
        && endpoints.len() <= big::BIG_MAX_ENDPOINTS
        && d.local_endpoints().len() <= big::BIG_MAX_ENDPOINTS;
    let ok = fits
        && d.has_frontends()
        && d.internal == Some(Target::Cluster)
        && d.affinity_timeout.is_none()
        && endpoints.iter().all(|ep| ep.port == target);
    ok.then_some(Candidate {
        cluster_ip,
        endpoints,
        target,
    })
}

/// Adds the shared lists of a Service's ports that can share one (each protocol's class-set
/// element and entries `CLUSTER-IP . PROTO . i` → address i) and says which ports read them:
/// for decision i, entry i is the target port its ClusterIP list is replaced by, or None
/// where it keeps its own. Empty (no allocation) when no port shares, as for most Services.
pub(super) fn add_lists(part: &mut Fragment, decisions: &[PortDecision<'_>]) -> Vec<Option<u16>> {
    let mut out = Vec::new();
    if decisions.len() < 2 {
        return out;
    }
    for proto in [Proto::Tcp, Proto::Udp, Proto::Sctp] {
        let ports: Vec<usize> = (0..decisions.len())
            .filter(|&i| decisions[i].port.protocol == proto)
            .collect();
        if ports.len() < 2 {
            continue;
        }
        // Every port of the protocol, or none.
        let candidates: Option<Vec<Candidate<'_>>> =
            ports.iter().map(|&i| candidate(&decisions[i])).collect();
        let Some(candidates) = candidates else {
            continue;
        };
        let first = &candidates[0];
        let alike = candidates.iter().all(|c| {
            c.cluster_ip == first.cluster_ip
                && c.endpoints.len() == first.endpoints.len()
                && c.endpoints
                    .iter()
                    .zip(first.endpoints)
                    .all(|(a, b)| a.addr == b.addr)
        });
        if !alike {
            continue;
        }
        out.resize(decisions.len(), None);
        for (&i, c) in ports.iter().zip(&candidates) {
            out[i] = Some(c.target);
        }
        let dest = Key::AddrProto(first.cluster_ip, proto);
        part.elements.insert(
            (class_set(big::class_of(first.endpoints.len())), dest),
            None,
        );
        // A shared list holds addresses: its entries' ports are 0 (see `Key::list_value`).
        let endpoints: Arc<[(IpAddr, u16)]> =
            first.endpoints.iter().map(|ep| (ep.addr, 0)).collect();
        part.lists.push(BigList {
            map: SERVICE_ENDPOINTS,
            dest,
            endpoints,
        });
    }
    out
}

/// The target-port element of a port that reads its protocol's shared list.
pub(super) fn add_target_port(
    part: &mut Fragment,
    cluster_ip: IpAddr,
    proto: Proto,
    port: u16,
    target: u16,
) {
    part.elements.insert(
        (
            SERVICE_TARGET_PORTS,
            Key::AddrProtoPort(cluster_ip, proto, port),
        ),
        Some(Value::Port(target)),
    );
}
