//! Isolating a Service whose rules the kernel refuses, so that every other Service is still
//! synced.
//!
//! A refused nftables operation names its Service: per-Service chains and sets are named
//! `PREFIX-HASH-namespace/name/...`, and elements of the shared maps are keyed by a Service's
//! address and port (or node port) or lead to its chain. [`suspects`] reads that back against
//! the cluster. One suspect is quarantined at once. Several (an element message holds up to a
//! few hundred elements of many Services) are all set aside, so that the others are synced
//! right away, and then let back half at a time after each successful sync: a refusal among
//! those let back narrows the suspects down, as in a bisection, and the innocent ones are back
//! within a few syncs. A Service found alone is kept out with exponential backoff (from
//! `syncPeriod`) and tried again.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use dataplane::model::{Cluster, ObjectName};
use dataplane::nft::ruleset::{Key, Value, Verdict};
use dataplane::nft::transaction::Op;

use crate::backoff::Backoff;

/// Prefixes of the chains and sets that belong to one Service.
const SERVICE_PREFIXES: [&str; 6] = [
    "service-",
    "local-",
    "external-",
    "firewall-",
    "endpoint-",
    "affinity-",
];

/// The Service a per-Service chain or set belongs to (`service-HASH-ns/name/tcp/80`).
fn owner_of_name(name: &str) -> Option<ObjectName> {
    let rest = SERVICE_PREFIXES.iter().find_map(|p| name.strip_prefix(p))?;
    let (_hash, rest) = rest.split_once('-')?;
    let mut parts = rest.splitn(3, '/');
    let (ns, svc) = (parts.next()?, parts.next()?);
    (!ns.is_empty() && !svc.is_empty()).then(|| ObjectName::new(ns, svc))
}

/// The Services `matches` accepts.
fn frontend_owners(
    cluster: &Cluster,
    matches: impl Fn(&dataplane::model::Service) -> bool,
) -> Vec<ObjectName> {
    cluster
        .services
        .iter()
        .filter(|(_, s)| matches(s))
        .map(|(name, _)| name.clone())
        .collect()
}

fn has_address(s: &dataplane::model::Service, ip: IpAddr) -> bool {
    s.cluster_ips.contains(&ip) || s.external_ips.contains(&ip) || s.load_balancer_ips.contains(&ip)
}

/// The Services whose rules `op` (refused by the kernel or the encoder) belongs to.
pub fn suspects(op: &Op, cluster: &Cluster) -> BTreeSet<ObjectName> {
    let mut out = BTreeSet::new();
    match op {
        Op::AddChain { name, .. }
        | Op::FlushChain { name }
        | Op::DeleteChain { name }
        | Op::AddRules { chain: name, .. } => out.extend(owner_of_name(name)),
        Op::AddSet { name, .. } | Op::DeleteSet { name } => out.extend(owner_of_name(name)),
        Op::AddElements { elements, .. } => {
            for (key, value) in elements.iter() {
                let by_value = match value {
                    Some(Value::Verdict(Verdict::Goto(chain) | Verdict::Jump(chain))) => {
                        owner_of_name(&chain)
                    }
                    _ => None,
                };
                match by_value {
                    Some(owner) => {
                        out.insert(owner);
                    }
                    None => out.extend(key_owners(&key, cluster)),
                }
            }
        }
        Op::DeleteElements { keys, .. } => {
            for key in keys {
                out.extend(key_owners(key, cluster));
            }
        }
        Op::AddTable | Op::DeleteTable => {}
    }
    // Only Services the cluster still has can be set aside.
    out.retain(|name| cluster.services.contains_key(name));
    out
}

fn key_owners(key: &Key, cluster: &Cluster) -> Vec<ObjectName> {
    match *key {
        Key::AddrProtoPort(ip, proto, port) | Key::AddrProtoPortIndex(ip, proto, port, _) => {
            frontend_owners(cluster, |s| {
                has_address(s, ip)
                    && s.ports
                        .iter()
                        .any(|p| p.protocol == proto && p.port == port)
            })
        }
        Key::ProtoPort(proto, port) | Key::ProtoPortIndex(proto, port, _) => {
            frontend_owners(cluster, |s| {
                s.ports
                    .iter()
                    .any(|p| p.protocol == proto && p.node_port == Some(port))
            })
        }
        Key::Addr(ip) => frontend_owners(cluster, |s| has_address(s, ip)),
        _ => Vec::new(),
    }
}

/// One Service set aside.
#[derive(Debug)]
struct Entry {
    /// Found alone (rather than among several suspects).
    confirmed: bool,
    /// When it is tried again (confirmed ones).
    until: Instant,
    backoff: Backoff,
}

/// The Services kept out of the rules, and why.
#[derive(Debug)]
pub struct Quarantine {
    entries: BTreeMap<ObjectName, Entry>,
    /// Released but not yet proven innocent by a successful sync.
    on_probation: BTreeSet<ObjectName>,
    /// The backoff of confirmed Services let back on probation: refused again, they stay out
    /// longer.
    history: BTreeMap<ObjectName, Backoff>,
    base: Duration,
    cap: Duration,
}

/// What changed in the quarantine: Services to re-plan in every family.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Moves {
    pub quarantined: Vec<ObjectName>,
    pub released: Vec<ObjectName>,
}

impl Moves {
    pub fn is_empty(&self) -> bool {
        self.quarantined.is_empty() && self.released.is_empty()
    }

    pub fn names(&self) -> impl Iterator<Item = &ObjectName> {
        self.quarantined.iter().chain(&self.released)
    }
}

impl Quarantine {
    /// A confirmed Service is tried again after `base`, then twice as long each time, up to
    /// `cap`.
    pub fn new(base: Duration, cap: Duration) -> Quarantine {
        Quarantine {
            entries: BTreeMap::new(),
            on_probation: BTreeSet::new(),
            history: BTreeMap::new(),
            base,
            cap,
        }
    }

    pub fn contains(&self, name: &ObjectName) -> bool {
        self.entries.contains_key(name)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A sync was refused with these suspects: sets them aside.
    pub fn refused(&mut self, suspects: &BTreeSet<ObjectName>, now: Instant) -> Moves {
        let mut moves = Moves::default();
        // Among Services let back on probation, the refusal points at those suspected again.
        let confirmed = suspects.len() == 1;
        for name in suspects {
            self.on_probation.remove(name);
            let backoff = self
                .history
                .remove(name)
                .unwrap_or_else(|| Backoff::new(self.base, self.cap));
            let entry = self.entries.entry(name.clone()).or_insert(Entry {
                confirmed,
                until: now,
                backoff,
            });
            entry.confirmed |= confirmed;
            if entry.confirmed {
                entry.until = now + entry.backoff.failed();
            }
            moves.quarantined.push(name.clone());
        }
        moves
    }

    /// A sync succeeded (the Services on probation are innocent): lets back half of the
    /// unconfirmed suspects, and the confirmed ones whose time has come.
    pub fn synced(&mut self, now: Instant) -> Moves {
        for name in std::mem::take(&mut self.on_probation) {
            self.history.remove(&name);
        }
        let mut moves = Moves::default();
        let unconfirmed: Vec<ObjectName> = self
            .entries
            .iter()
            .filter(|(_, e)| !e.confirmed)
            .map(|(n, _)| n.clone())
            .collect();
        let half = unconfirmed.len().div_ceil(2);
        for name in unconfirmed.into_iter().take(half) {
            self.entries.remove(&name);
            self.on_probation.insert(name.clone());
            moves.released.push(name);
        }
        moves.released.extend(self.release_due(now));
        moves
    }

    /// Confirmed Services whose time has come go back (to be tried again).
    pub fn release_due(&mut self, now: Instant) -> Vec<ObjectName> {
        let due: Vec<ObjectName> = self
            .entries
            .iter()
            .filter(|(_, e)| e.confirmed && e.until <= now)
            .map(|(n, _)| n.clone())
            .collect();
        for name in &due {
            if let Some(e) = self.entries.remove(name) {
                self.history.insert(name.clone(), e.backoff);
            }
            self.on_probation.insert(name.clone());
        }
        due
    }

    /// When the next confirmed Service is due to be tried again, if any is set aside.
    pub fn next_release(&self) -> Option<Instant> {
        self.entries
            .values()
            .filter(|e| e.confirmed)
            .map(|e| e.until)
            .min()
    }

    /// Whether unconfirmed suspects wait to be let back (the next successful sync does).
    pub fn bisecting(&self) -> bool {
        self.entries.values().any(|e| !e.confirmed)
    }

    /// Takes the quarantined Services out of a snapshot of the cluster.
    pub fn apply(&self, cluster: &mut Cluster) {
        for name in self.entries.keys() {
            cluster.services.remove(name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dataplane::nft::ruleset::{Proto, Rule};
    use std::sync::Arc;

    fn cluster(names: &[(&str, &str)]) -> Cluster {
        let yaml: String = names
            .iter()
            .map(|(name, ip)| {
                format!(
                    "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\n\
                     spec: {{clusterIP: {ip}, type: NodePort, ports: [{{name: p, port: 80, nodePort: 3{}}}]}}\n",
                    &ip[ip.len() - 4..].replace('.', "")
                )
            })
            .collect();
        let (objects, _) = dataplane::input::parse_yaml(&yaml).unwrap();
        dataplane::convert::cluster(&objects, "node", "").0
    }

    fn n(name: &str) -> ObjectName {
        ObjectName::new("ns", name)
    }

    #[test]
    fn chain_and_set_names_name_their_service() {
        let c = cluster(&[("web", "172.30.0.10"), ("db", "172.30.0.11")]);
        let chain = |name: &str| Op::AddRules {
            chain: name.into(),
            rules: Arc::new(Vec::<Rule>::new()),
        };
        assert_eq!(
            suspects(&chain("service-ABCDEFGH-ns/web/tcp/p"), &c),
            [n("web")].into()
        );
        assert_eq!(
            suspects(&chain("external-ABCDEFGH-ns/db/tcp/p"), &c),
            [n("db")].into()
        );
        assert!(suspects(&chain("services"), &c).is_empty());
        assert!(suspects(&chain("service-ABCDEFGH-ns/gone/tcp/p"), &c).is_empty());
    }

    #[test]
    fn elements_name_the_services_they_belong_to() {
        let c = cluster(&[("web", "172.30.0.10"), ("db", "172.30.0.11")]);
        let op = Op::AddElements {
            set: "service-ips".into(),
            elements: vec![(
                Key::AddrProtoPort("172.30.0.10".parse().unwrap(), Proto::Tcp, 80),
                None,
            )]
            .into(),
        };
        assert_eq!(suspects(&op, &c), [n("web")].into());
        let list = Op::AddElements {
            set: "cluster-endpoints-1".into(),
            elements: vec![(
                Key::AddrProtoPortIndex("172.30.0.11".parse().unwrap(), Proto::Tcp, 80, 0),
                Some(Value::Endpoint("10.180.0.1".parse().unwrap(), 80)),
            )]
            .into(),
        };
        assert_eq!(suspects(&list, &c), [n("db")].into());
        let both = Op::DeleteElements {
            set: "service-ips".into(),
            keys: vec![
                Key::AddrProtoPort("172.30.0.10".parse().unwrap(), Proto::Tcp, 80),
                Key::Addr("172.30.0.11".parse().unwrap()),
            ],
        };
        assert_eq!(suspects(&both, &c), [n("web"), n("db")].into());
    }

    #[test]
    fn one_suspect_is_kept_out_with_backoff() {
        let t0 = Instant::now();
        let mut q = Quarantine::new(Duration::from_secs(30), Duration::from_secs(600));
        let m = q.refused(&[n("bad")].into(), t0);
        assert_eq!(m.quarantined, [n("bad")]);
        assert!(q.contains(&n("bad")));
        assert!(
            q.synced(t0 + Duration::from_secs(1)).is_empty(),
            "not yet due"
        );
        let due = q.next_release().unwrap();
        assert!(due >= t0 + Duration::from_secs(24) && due <= t0 + Duration::from_secs(36));
        let m = q.synced(due);
        assert_eq!(m.released, [n("bad")]);
        // Refused again: out for about twice as long.
        q.refused(&[n("bad")].into(), due);
        let again = q.next_release().unwrap() - due;
        assert!(again >= Duration::from_secs(48), "{again:?}");
    }

    #[test]
    fn several_suspects_are_narrowed_down_by_halves() {
        let t0 = Instant::now();
        let mut q = Quarantine::new(Duration::from_secs(30), Duration::from_secs(600));
        let suspects: BTreeSet<ObjectName> = ["a", "b", "c", "d"].iter().map(|s| n(s)).collect();
        q.refused(&suspects, t0);
        assert_eq!(q.len(), 4);
        assert!(q.bisecting());
        // The rest synced: half the suspects go back on probation.
        let m = q.synced(t0);
        assert_eq!(m.released, [n("a"), n("b")]);
        // They are refused again, and of them only b is named: b is the one.
        q.refused(&[n("b")].into(), t0);
        assert!(q.contains(&n("b")) && !q.contains(&n("a")));
        let m = q.synced(t0);
        assert_eq!(m.released, [n("c")], "c and d are let back in turn");
        let m = q.synced(t0);
        assert_eq!(m.released, [n("d")]);
        assert!(!q.bisecting());
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn quarantined_services_leave_the_snapshot() {
        let mut c = cluster(&[("web", "172.30.0.10"), ("db", "172.30.0.11")]);
        let mut q = Quarantine::new(Duration::from_secs(30), Duration::from_secs(600));
        q.refused(&[n("db")].into(), Instant::now());
        q.apply(&mut c);
        assert!(c.services.contains_key(&n("web")) && !c.services.contains_key(&n("db")));
    }
}
