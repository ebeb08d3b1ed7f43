//! Session affinity (ClientIP) without a chain per endpoint: one map the kernel fills, shared by
//! every Service, so that a Service with affinity is map and set elements like any other.
//!
//! - `affinity-clients` maps `CLIENT . DEST . PROTO . PORT` to the endpoint the client was given
//!   for that destination (a ClusterIP, external or load-balancer IP with its port, or a node
//!   IP with a node port). Each endpoint-list chain first tries it for destinations in
//!   `session-affinity-services` (or `session-affinity-nodeports`): a hit DNATs to the recorded
//!   endpoint, a miss falls through to the random choice of the lists.
//! - After DNAT, the filter hooks' `session-affinity` chain records the endpoint chosen for a
//!   new connection, with the Service's timeout: one rule per protocol and timeout, keyed by
//!   the connection's original destination in the set `session-affinity-services-T` (or
//!   `-nodeports-T`). A connection that followed its entry refreshes it, as kube-proxy's
//!   `update @affinity-… { ip saddr }` does.
//! - An entry whose endpoint left the destination's endpoints is deleted by the agent after the
//!   sync that removed it ([`stale_entries`]), as kube-proxy deletes the endpoint's affinity set;
//!   the kernel cannot check the entry itself in a rule nft can list.
//!
//! Affinity is per destination rather than per Service port: a client that reaches one Service
//! port through its ClusterIP and through a node port is remembered for each separately.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{LazyLock, Mutex, PoisonError};

use super::{EndpointLists, LIST_MAX_ENDPOINTS};
use crate::nft::ruleset::{
    Action, Delta, Key, KeyType, Match, Proto, Rule, Set, SetDecl, Table, Value, Verdict, Was,
};

pub const AFFINITY_CLIENTS: &str = "affinity-clients";
pub const AFFINITY_SERVICES: &str = "session-affinity-services";
pub const AFFINITY_NODEPORTS: &str = "session-affinity-nodeports";
pub const SESSION_AFFINITY: &str = "session-affinity";

/// kube-proxy's default `timeoutSeconds`, the map's own timeout (each record rule gives its
/// own).
pub const DEFAULT_TIMEOUT_SECS: u32 = 10_800;

/// Most clients the map remembers (over all Services and destinations of the family); when it
/// is full, new clients get a random endpoint every time until entries expire.
pub const AFFINITY_CLIENTS_MAX: u32 = 1 << 20;

/// The sets naming the destinations whose clients are recorded with timeout `secs`: (address
/// destinations, node ports). Names are made once per timeout and kept (at most 86,400).
pub fn timeout_sets(secs: u32) -> (&'static str, &'static str) {
    static NAMES: LazyLock<Mutex<HashMap<u32, (&'static str, &'static str)>>> =
        LazyLock::new(Mutex::default);
    let mut names = NAMES.lock().unwrap_or_else(PoisonError::into_inner);
    *names.entry(secs).or_insert_with(|| {
        let services = format!("{AFFINITY_SERVICES}-{secs}");
        let nodeports = format!("{AFFINITY_NODEPORTS}-{secs}");
        (services.leak(), nodeports.leak())
    })
}

/// The timeout of a per-timeout set, if `set` is one.
pub fn timeout_of_set(set: &str) -> Option<u32> {
    [AFFINITY_SERVICES, AFFINITY_NODEPORTS]
        .iter()
        .find_map(|p| set.strip_prefix(p)?.strip_prefix('-')?.parse::<u32>().ok())
}

/// The timeouts `table` has record rules for: those of its per-timeout sets.
fn timeouts(table: &Table) -> BTreeSet<u32> {
    table
        .sets
        .keys()
        .filter_map(|s| timeout_of_set(s))
        .collect()
}

/// Adds the sets and record rules of `secs` to `table` unless it has them: a Service's part
/// brings the timeouts it uses, and a table without Services with affinity has no record
/// rule. (nft 1.0.6 lists a record rule without the `meta l4proto` match it needs to read it
/// back, so such a listing does not load again with `nft -f`.) Returns the number of rules
/// added.
pub fn add_timeout(table: &mut Table, secs: u32) -> usize {
    if table.sets.contains_key(timeout_sets(secs).0) {
        return 0;
    }
    for (set, decl) in set_decls(Some(secs)) {
        table.sets.insert(set.to_string(), decl);
    }
    let rules = record_rules(&timeouts(table));
    let added = rules.len()
        - table
            .chains
            .get(SESSION_AFFINITY)
            .map_or(0, |c| c.rules.len());
    table
        .chains
        .insert(SESSION_AFFINITY.into(), super::regular(rules));
    added
}

/// The sets naming the destinations with affinity (`None`: all of them, for the lookups) or
/// those whose clients are remembered for `secs`.
fn set_decls(secs: Option<u32>) -> [(&'static str, Set); 2] {
    let what = match secs {
        Some(t) => format!("with session affinity, their clients remembered for {t} s"),
        None => "with session affinity".to_string(),
    };
    let (services, nodeports) = match secs {
        Some(t) => timeout_sets(t),
        None => (AFFINITY_SERVICES, AFFINITY_NODEPORTS),
    };
    let decl = |key, comment: String| {
        super::empty_set(SetDecl {
            comment: Some(comment),
            ..SetDecl::new(key)
        })
    };
    [
        (
            services,
            decl(KeyType::AddrProtoPort, format!("destinations {what}")),
        ),
        (
            nodeports,
            decl(KeyType::ProtoPort, format!("NodePorts {what}")),
        ),
    ]
}

/// What every table has: the map, the lookup sets, and the `session-affinity` chain (empty
/// until a Service with affinity brings its timeout's rules).
pub fn add_base(table: &mut Table) {
    table
        .sets
        .insert(AFFINITY_CLIENTS.into(), super::empty_set(clients_decl()));
    for (set, decl) in set_decls(None) {
        table.sets.insert(set.to_string(), decl);
    }
    table
        .chains
        .insert(SESSION_AFFINITY.into(), super::regular(Vec::new()));
}

/// The first rule of an endpoint-list chain: clients of a destination with affinity go back to
/// their endpoint.
pub fn lookup_rule(lists: EndpointLists) -> Rule {
    let guard = if lists.nodeport() {
        Match::ProtoPortInSet {
            set: AFFINITY_NODEPORTS.into(),
        }
    } else {
        Match::AddrProtoPortInSet {
            set: AFFINITY_SERVICES.into(),
        }
    };
    Rule::new(
        vec![guard],
        Action::DnatAffinity {
            map: AFFINITY_CLIENTS,
        },
    )
}

/// The rules of the `session-affinity` chain: for each timeout and protocol, record the client
/// of a destination with that timeout. Node ports first: should a Service address use a port
/// number that is also a node port, its own timeout is the one that stays.
pub fn record_rules(timeouts: &BTreeSet<u32>) -> Vec<Rule> {
    let mut rules = Vec::new();
    for nodeport in [true, false] {
        for &secs in timeouts {
            let (services, nodeports) = timeout_sets(secs);
            for proto in [Proto::Tcp, Proto::Udp, Proto::Sctp] {
                let member = if nodeport {
                    Match::CtOriginalProtoPortInSet {
                        set: nodeports.into(),
                    }
                } else {
                    Match::CtOriginalAddrProtoPortInSet {
                        set: services.into(),
                    }
                };
                rules.push(Rule::new(
                    vec![Match::L4Proto(proto), member],
                    Action::UpdateAffinity {
                        map: AFFINITY_CLIENTS,
                        timeout_secs: secs,
                    },
                ));
            }
        }
    }
    rules
}

/// The rule each filter base chain ends with: new connections that were DNATed are recorded.
pub fn record_jump() -> Rule {
    Rule::new(
        vec![Match::CtStateNew, Match::CtStatusDnat],
        Action::Verdict(Verdict::Jump(SESSION_AFFINITY.into())),
    )
}

/// The declaration of `affinity-clients`.
pub fn clients_decl() -> SetDecl {
    SetDecl {
        comment: Some("clients of Services with session affinity, and their endpoints".into()),
        timeout_secs: Some(DEFAULT_TIMEOUT_SECS),
        size: Some(AFFINITY_CLIENTS_MAX),
        ..SetDecl::new(KeyType::AffinityClients)
    }
}

/// Whether a sync that touched `touched` (per set, each element's key and what it was before:
/// absent, or present with this value) may have
/// left entries of `table`'s map stale: a destination got affinity (entries from an earlier
/// time may lead anywhere), or an endpoint left the endpoint lists of a destination that has
/// it. Adding endpoints makes nothing stale, and listing the map costs O(clients), so a
/// scale-up lists nothing.
pub fn cleanup_needed(table: &Table, touched: &Delta) -> bool {
    let now = |set: &str, key: &Key| table.sets.get(set)?.elements.get(key);
    // A destination that got affinity decides alone: looked for first, before a large
    // Service's thousands of list entries are compared.
    let affinity_sets = [AFFINITY_SERVICES, AFFINITY_NODEPORTS];
    for set in affinity_sets {
        let mut keys = touched.get(set).into_iter().flatten();
        if keys.any(|(key, was)| was.is_none() && now(set, key).is_some()) {
            return true;
        }
    }
    // Per destination: None without affinity (looked up once: a Service of thousands of
    // endpoints touches thousands of keys of one destination), else the endpoints its touched
    // entries held, and hold now.
    type Endpoints = HashSet<(IpAddr, u16), foldhash::fast::RandomState>;
    let mut lists: HashMap<Key, Option<(Endpoints, Endpoints)>, foldhash::fast::RandomState> =
        HashMap::default();
    for (set, keys) in touched {
        if affinity_sets.contains(&set.as_str()) {
            continue;
        }
        let entries = keys.entries();
        let mut i = 0;
        while let Some((key, was)) = entries.get(i) {
            i += 1;
            let Some((dest, _)) = key.list_destination() else {
                continue;
            };
            let lists = lists
                .entry(dest)
                .or_insert_with(|| has_affinity(table, &dest).then(Default::default));
            let Some((before, after)) = lists else {
                // The rest of the destination's entries (keys in order: they come together)
                // are skipped at once: a large Service's list is thousands of them.
                let same =
                    |(k, _): &(Key, Was)| k.list_destination().is_some_and(|(d, _)| d == dest);
                i += entries[i..].partition_point(same);
                continue;
            };
            let endpoint = |v: Option<Option<Value>>| match v {
                Some(Some(Value::Endpoint(addr, port))) => Some((addr, port)),
                _ => None,
            };
            before.extend(endpoint(was.clone()));
            after.extend(endpoint(now(set, key)));
        }
    }
    lists
        .values()
        .flatten()
        .any(|(before, after)| !before.is_subset(after))
}

/// Whether destination `dest` (an address key, or a node port's) has session affinity.
fn has_affinity(table: &Table, dest: &Key) -> bool {
    let set = match dest {
        Key::ProtoPort(..) => AFFINITY_NODEPORTS,
        _ => AFFINITY_SERVICES,
    };
    table
        .sets
        .get(set)
        .is_some_and(|s| s.elements.contains_key(dest))
}

/// One entry of `affinity-clients`, as the kernel lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Entry {
    pub client: IpAddr,
    pub dest: IpAddr,
    pub proto: Proto,
    pub port: u16,
    pub endpoint: (IpAddr, u16),
}

/// The entries of `affinity-clients` that `table` no longer justifies: an entry stays only if
/// its destination has affinity and the endpoint is still one of the destination's (in any of
/// its endpoint lists). Entries of destinations without affinity are never looked up, but
/// would be if the destination got affinity again, perhaps for another Service.
pub fn stale_entries(table: &Table, entries: &[Entry]) -> Vec<Entry> {
    let mut allowed: HashMap<Key, HashSet<(IpAddr, u16)>> = HashMap::new();
    entries
        .iter()
        .filter(|e| {
            let addr = Key::AddrProtoPort(e.dest, e.proto, e.port);
            let nodeport = Key::ProtoPort(e.proto, e.port);
            let dest = if has_affinity(table, &addr) {
                addr
            } else if has_affinity(table, &nodeport) {
                nodeport
            } else {
                return true;
            };
            let endpoints = allowed
                .entry(dest)
                .or_insert_with(|| destination_endpoints(table, dest));
            !endpoints.contains(&e.endpoint)
        })
        .copied()
        .collect()
}

/// Every endpoint in the endpoint lists of destination `dest` (both kinds: all endpoints and
/// this node's).
fn destination_endpoints(table: &Table, dest: Key) -> HashSet<(IpAddr, u16)> {
    let nodeport = matches!(dest, Key::ProtoPort(..));
    let (Some(first), Some(last)) = (dest.list_entry(0), dest.list_entry(u16::MAX)) else {
        return HashSet::new();
    };
    let mut out = HashSet::new();
    for local in [false, true] {
        let lists = EndpointLists::of(local, nodeport);
        let maps = (1..=LIST_MAX_ENDPOINTS)
            .map(|k| lists.map(k))
            .chain([lists.big_map()]);
        for map in maps {
            let Some(set) = table.sets.get(map) else {
                continue;
            };
            for (_, value) in set.elements.between(first, last) {
                if let Some(Value::Endpoint(addr, port)) = value {
                    out.insert((addr, port));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
