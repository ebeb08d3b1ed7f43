//! kube-proxy's iptables mode: the desired `filter` and `nat` rules of one family, the planner
//! that turns them into full or partial `iptables-restore` input, and the reading of
//! `iptables-save` output (stale chains, jump rules, cleanup of leftovers).
//!
//! The decisions are [`crate::decision`]'s (frontends, endpoint categorisation, traffic
//! policies, masquerade, load-balancer source ranges), as for nftables mode; the rule shapes are those of kube-proxy's `pkg/proxy/iptables`
//! (`TestOverallIPTablesRules`), in chains of nftproxy's own, jumped to from the built-in chains.
//!
//! # Where iptables mode differs from the nftables ruleset (as kube-proxy's two modes do)
//! * NodePorts are accepted on every local address when `nodePortAddresses` is unset, and on
//!   IPv4 loopback addresses too with `iptables.localhostNodePorts` (which needs
//!   `net.ipv4.conf.all.route_localnet=1`, see [`IptRuleset::route_localnet`]);
//! * health-check node ports are ACCEPTed in `filter` (a hole in a DROP-policy firewall);
//! * packets in conntrack state INVALID are dropped in `forward`;
//! * packets to a ClusterIP on a port it does not serve are not rejected, and packets to
//!   unallocated addresses of the ServiceCIDRs are not dropped.
//!
//! # Chain names
//! kube-proxy names a Service port's chains `KUBE-SVC-` + the first 16 characters of
//! base32(sha256(`ns/name:port` + protocol)) (`SVL`, `EXT`, `FW` alike, `SEP` hashes the
//! endpoint too). iptables allows 28 characters per chain name, so under the longer `NFTPROXY-`
//! prefix the hash keeps what fits: `NFTPROXY-SVC-` + 15 characters, `NFTPROXY-FW-` + 16. The
//! names are prefixes of kube-proxy's: `KUBE-SVC-4SW47YFZTEDKD3PK` is `NFTPROXY-SVC-4SW47YFZTEDKD3P`.
//!
//! # Restores
//! A **full** restore (first sync, after a failure, periodic) declares every chain of ours,
//! which flushes it (`--noflush` keeps everybody else's rules), refills all of them, deletes our
//! chains that are no longer wanted and repairs the jump rules in the built-in chains.
//!
//! A **partial** restore compares the desired rules with what the last successful restore
//! wrote ([`Tables`]) and touches only what changed: a changed per-Service chain is declared
//! (flushed) and refilled, a chain no longer wanted is flushed and deleted (`-X`), and the
//! dispatch chains that hold one rule per Service (`NFTPROXY-SERVICES`, `-NODEPORTS`, ...) are
//! edited in place, `-D` for the rules that went away and `-I ... 1` for new ones, so a partial
//! restore is O(changes) even with thousands of Services (kube-proxy rewrites its dispatch
//! chains on every sync). Their rule order does not matter (each rule matches its own address,
//! protocol and port), except for the NodePort jump that must stay last in
//! `nat NFTPROXY-SERVICES`: a change there rewrites the chain.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use data_encoding::BASE32;
use sha2::{Digest, Sha256};

use crate::conflicts::suppressed;
use crate::convert::slices_by_service;
use crate::decision::{DecisionEnv, LocalTraffic, NoLocalEndpoints, service_decisions};
use crate::model::{Cluster, EndpointSlice, Service, ServicePort};
use crate::net::{Family, Proto};
use crate::settings::{BuildConfig, NodePortIps, node_port_ips};

mod port;
mod restore;
mod save;

pub use restore::{Existing, Restore, plan_full, plan_partial};
pub use save::{SavedTable, jump_target, parse_save, plan_removal, tokens};

/// Every chain nftproxy creates in iptables mode starts with this.
pub const PREFIX: &str = "NFTPROXY-";
pub const SERVICES: &str = "NFTPROXY-SERVICES";
pub const EXTERNAL_SERVICES: &str = "NFTPROXY-EXTERNAL-SERVICES";
pub const NODEPORTS: &str = "NFTPROXY-NODEPORTS";
pub const POSTROUTING: &str = "NFTPROXY-POSTROUTING";
pub const MARK_MASQ: &str = "NFTPROXY-MARK-MASQ";
pub const FORWARD: &str = "NFTPROXY-FORWARD";
pub const PROXY_FIREWALL: &str = "NFTPROXY-PROXY-FIREWALL";
/// Blocks connections from outside to 127.0.0.0/8 that `route_localnet` would let in
/// (kubelet's and kube-proxy's `KUBE-FIREWALL`).
pub const LOCALNET_FIREWALL: &str = "NFTPROXY-FIREWALL";
/// An empty chain in `nat` and `filter`: if it disappears, someone flushed the tables and the
/// agent restores everything (kube-proxy's `KUBE-PROXY-CANARY`).
pub const CANARY: &str = "NFTPROXY-CANARY";

/// Longest chain name iptables accepts.
pub const MAX_CHAIN_NAME: usize = 28;

/// The iptables tables nftproxy writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IptTable {
    Filter,
    Nat,
}

impl IptTable {
    /// In restore order: `filter` refers to nothing in `nat`.
    pub const ALL: [IptTable; 2] = [IptTable::Filter, IptTable::Nat];

    pub fn name(self) -> &'static str {
        match self {
            IptTable::Filter => "filter",
            IptTable::Nat => "nat",
        }
    }
}

/// How a chain's rules may be edited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainKind {
    /// Rule order matters: a change rewrites the chain.
    Ordered,
    /// One rule per Service port (or address), in any order, followed by `tail` rules that
    /// must stay last: partial restores delete and insert single rules.
    Dispatch { tail: usize },
}

/// One chain: rule specifications as written after `-A CHAIN `.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IptChain {
    pub kind: ChainKind,
    pub rules: Vec<String>,
}

impl IptChain {
    fn ordered() -> IptChain {
        IptChain {
            kind: ChainKind::Ordered,
            rules: Vec::new(),
        }
    }

    fn dispatch() -> IptChain {
        IptChain {
            kind: ChainKind::Dispatch { tail: 0 },
            rules: Vec::new(),
        }
    }

    /// The order-independent rules and the pinned tail.
    fn split(&self) -> (&[String], &[String]) {
        let tail = match self.kind {
            ChainKind::Ordered => self.rules.len(),
            ChainKind::Dispatch { tail } => tail.min(self.rules.len()),
        };
        self.rules.split_at(self.rules.len() - tail)
    }
}

/// nftproxy's chains of one family, per table.
pub type Tables = BTreeMap<IptTable, BTreeMap<String, IptChain>>;

/// A rule in a built-in chain that sends packets into one of nftproxy's chains.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JumpRule {
    pub table: IptTable,
    /// `PREROUTING`, `INPUT`, `FORWARD`, `OUTPUT` or `POSTROUTING`.
    pub builtin: &'static str,
    /// The rule specification, `-j` target included.
    pub spec: String,
}

/// Options of kube-proxy's `iptables` configuration section that only this mode has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IptablesOptions {
    /// `iptables.localhostNodePorts` (default true): IPv4 NodePorts also on 127.0.0.0/8.
    pub localhost_node_ports: bool,
    /// Drop forwarded packets in conntrack state INVALID (kube-proxy does unless
    /// `conntrack.tcpBeLiberal`).
    pub drop_invalid: bool,
}

impl Default for IptablesOptions {
    fn default() -> IptablesOptions {
        IptablesOptions {
            localhost_node_ports: true,
            drop_invalid: true,
        }
    }
}

/// The desired iptables rules of one family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IptRuleset {
    pub family: Family,
    pub tables: Tables,
    /// Jump rules from the built-in chains, in the order kube-proxy ends up with them.
    pub jumps: Vec<JumpRule>,
    pub no_local_endpoints: NoLocalEndpoints,
    /// NodePorts are served on an IPv4 loopback address: `net.ipv4.conf.all.route_localnet`
    /// must be 1 (the kernel otherwise drops packets routed from 127.0.0.0/8).
    pub route_localnet: bool,
    /// Loopback addresses selected by `nodePortAddresses` that cannot serve NodePorts (IPv6,
    /// or `localhostNodePorts: false`), for a log message.
    pub skipped_loopback: Vec<IpAddr>,
}

impl IptRuleset {
    pub fn rule_count(&self, table: IptTable) -> usize {
        self.tables
            .get(&table)
            .map(|t| t.values().map(|c| c.rules.len()).sum())
            .unwrap_or(0)
    }

    pub fn chain_count(&self, table: IptTable) -> usize {
        self.tables.get(&table).map(BTreeMap::len).unwrap_or(0)
    }

    fn chain(&mut self, table: IptTable, name: &str) -> &mut IptChain {
        self.tables
            .entry(table)
            .or_default()
            .entry(name.to_string())
            .or_insert_with(IptChain::ordered)
    }

    fn push(&mut self, table: IptTable, name: &str, rule: String) {
        self.chain(table, name).rules.push(rule);
    }
}

// ------------------------------------------------------------------------------------------
// Names.

fn hash16(input: &str) -> String {
    let digest = Sha256::digest(input.as_bytes());
    BASE32.encode(&digest)[..16].to_string()
}

/// kube-proxy's `portProtoHash`: the first 16 characters of
/// base32(sha256(`ns/name:port` + protocol)).
pub fn port_proto_hash(service_port_name: &str, protocol: &str) -> String {
    hash16(&format!("{service_port_name}{protocol}"))
}

/// kube-proxy's endpoint-chain hash: the first 16 characters of
/// base32(sha256(`ns/name:port` + protocol + `IP:port`)).
pub fn endpoint_hash(service_port_name: &str, protocol: &str, endpoint: SocketAddr) -> String {
    hash16(&format!("{service_port_name}{protocol}{endpoint}"))
}

/// `NFTPROXY-<kind>-<hash>`, the hash cut to iptables' 28-character limit.
pub fn chain_name(kind: &str, hash: &str) -> String {
    let head = format!("{PREFIX}{kind}-");
    let keep = MAX_CHAIN_NAME.saturating_sub(head.len()).min(hash.len());
    format!("{head}{}", &hash[..keep])
}

/// Chains nftproxy creates per Service port or endpoint (deleted when no longer wanted).
pub fn is_service_chain(name: &str) -> bool {
    ["SVC-", "SVL-", "EXT-", "FW-", "SEP-"]
        .iter()
        .any(|k| name.strip_prefix(PREFIX).is_some_and(|r| r.starts_with(k)))
}

/// kube-proxy's iptables-mode chains (`nftproxy cleanup --kube-proxy`). kubelet's chains
/// (`KUBE-IPTABLES-HINT`, `KUBE-KUBELET-CANARY`, `KUBE-FIREWALL`, `KUBE-MARK-DROP`) stay.
pub fn is_kube_proxy_chain(name: &str) -> bool {
    matches!(
        name,
        "KUBE-SERVICES"
            | "KUBE-EXTERNAL-SERVICES"
            | "KUBE-NODEPORTS"
            | "KUBE-POSTROUTING"
            | "KUBE-MARK-MASQ"
            | "KUBE-FORWARD"
            | "KUBE-PROXY-FIREWALL"
            | "KUBE-PROXY-CANARY"
    ) || [
        "KUBE-SVC-",
        "KUBE-SVL-",
        "KUBE-EXT-",
        "KUBE-FW-",
        "KUBE-SEP-",
    ]
    .iter()
    .any(|p| name.starts_with(p))
}

/// `ns/name:port`, or `ns/name` for an unnamed port (kube-proxy's `ServicePortName.String()`).
fn port_name_string(svc: &Service, port: &ServicePort) -> String {
    if port.name.is_empty() {
        svc.name.to_string()
    } else {
        format!("{}:{}", svc.name, port.name)
    }
}

// ------------------------------------------------------------------------------------------
// Rule fragments.

fn comment(text: &str) -> String {
    format!("-m comment --comment \"{text}\"")
}

/// `-p tcp -m tcp` (the protocol match that `--dport` belongs to).
fn proto(p: Proto) -> String {
    format!("-p {0} -m {0}", p.name())
}

fn host(ip: IpAddr) -> String {
    ip.to_string()
}

/// Local-traffic detection as iptables fragments: (is local, is not local).
fn detector(local: &LocalTraffic) -> Option<(String, String)> {
    match local {
        LocalTraffic::Unknown => None,
        LocalTraffic::Cidr(net) => Some((format!("-s {net}"), format!("! -s {net}"))),
        LocalTraffic::Interface { name, prefix } => {
            let name = if *prefix {
                format!("{name}+")
            } else {
                name.clone()
            };
            Some((format!("-i {name}"), format!("! -i {name}")))
        }
    }
}

/// Which destinations the NodePort jump accepts.
enum NodePortDestinations {
    /// Every local address (`-m addrtype --dst-type LOCAL`), loopback excluded or not.
    Local {
        exclude_loopback: bool,
    },
    List(Vec<IpAddr>),
}

fn node_port_destinations(
    config: &BuildConfig,
    cluster: &Cluster,
    options: &IptablesOptions,
    family: Family,
    skipped: &mut Vec<IpAddr>,
) -> NodePortDestinations {
    let loopback_ok = family == Family::V4 && options.localhost_node_ports;
    match node_port_ips(config, cluster, family) {
        NodePortIps::All => NodePortDestinations::Local {
            exclude_loopback: !loopback_ok,
        },
        NodePortIps::List(mut ips) => {
            if !loopback_ok {
                skipped.extend(ips.iter().filter(|a| a.is_loopback()));
                ips.retain(|a| !a.is_loopback());
            }
            NodePortDestinations::List(ips)
        }
    }
}

// ------------------------------------------------------------------------------------------
// The ruleset.

/// The static chains, rules and jumps (everything but the Services).
fn base(config: &BuildConfig, options: &IptablesOptions, family: Family) -> IptRuleset {
    use IptTable::{Filter, Nat};
    let mut r = IptRuleset {
        family,
        tables: Tables::new(),
        jumps: Vec::new(),
        no_local_endpoints: NoLocalEndpoints::default(),
        route_localnet: false,
        skipped_loopback: Vec::new(),
    };
    let mark = format!("{:#x}", 1u32 << config.masquerade_bit);
    for (table, name) in [
        (Filter, SERVICES),
        (Filter, EXTERNAL_SERVICES),
        (Filter, NODEPORTS),
        (Filter, PROXY_FIREWALL),
        (Nat, SERVICES),
        (Nat, NODEPORTS),
    ] {
        *r.chain(table, name) = IptChain::dispatch();
    }
    r.chain(Filter, FORWARD);
    r.chain(Filter, CANARY);
    r.chain(Nat, CANARY);
    r.push(
        Nat,
        POSTROUTING,
        format!("-m mark ! --mark {mark}/{mark} -j RETURN"),
    );
    // Clear the mark so a packet that traverses the stack again is not masqueraded twice.
    r.push(Nat, POSTROUTING, format!("-j MARK --xor-mark {mark}"));
    r.push(
        Nat,
        POSTROUTING,
        format!(
            "{} -j MASQUERADE --random-fully",
            comment("nftproxy service traffic requiring SNAT")
        ),
    );
    r.push(Nat, MARK_MASQ, format!("-j MARK --or-mark {mark}"));
    if options.drop_invalid {
        r.push(
            Filter,
            FORWARD,
            "-m conntrack --ctstate INVALID -j DROP".to_string(),
        );
    }
    // Forward what we marked for masquerade (NodePort traffic) even under a DROP policy.
    r.push(
        Filter,
        FORWARD,
        format!(
            "{} -m mark --mark {mark}/{mark} -j ACCEPT",
            comment("nftproxy forwarding rules")
        ),
    );
    r.push(
        Filter,
        FORWARD,
        format!(
            "{} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
            comment("nftproxy forwarding conntrack rule")
        ),
    );
    let localnet = family == Family::V4 && options.localhost_node_ports;
    if localnet {
        // route_localnet lets packets from outside reach 127.0.0.0/8 (CVE-2020-8558): only
        // what was DNATed there (or answers) may.
        r.push(
            Filter,
            LOCALNET_FIREWALL,
            format!(
                "{} -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
                comment("block incoming localnet connections")
            ),
        );
    }

    let new = "-m conntrack --ctstate NEW ";
    let mut jump = |table, builtin, ct_new: bool, text: &str, target: &str| {
        r.jumps.push(JumpRule {
            table,
            builtin,
            spec: format!(
                "{}{} -j {target}",
                if ct_new { new } else { "" },
                comment(text)
            ),
        });
    };
    jump(
        Filter,
        "INPUT",
        true,
        "nftproxy externally-visible service portals",
        EXTERNAL_SERVICES,
    );
    jump(
        Filter,
        "FORWARD",
        true,
        "nftproxy externally-visible service portals",
        EXTERNAL_SERVICES,
    );
    jump(
        Filter,
        "INPUT",
        false,
        "nftproxy health check service ports",
        NODEPORTS,
    );
    jump(
        Filter,
        "FORWARD",
        true,
        "nftproxy service portals",
        SERVICES,
    );
    jump(Filter, "OUTPUT", true, "nftproxy service portals", SERVICES);
    jump(
        Filter,
        "FORWARD",
        false,
        "nftproxy forwarding rules",
        FORWARD,
    );
    jump(
        Filter,
        "INPUT",
        true,
        "nftproxy load balancer firewall",
        PROXY_FIREWALL,
    );
    jump(
        Filter,
        "OUTPUT",
        true,
        "nftproxy load balancer firewall",
        PROXY_FIREWALL,
    );
    jump(
        Filter,
        "FORWARD",
        true,
        "nftproxy load balancer firewall",
        PROXY_FIREWALL,
    );
    if localnet {
        jump(
            Filter,
            "INPUT",
            false,
            "nftproxy localnet firewall",
            LOCALNET_FIREWALL,
        );
        jump(
            Filter,
            "OUTPUT",
            false,
            "nftproxy localnet firewall",
            LOCALNET_FIREWALL,
        );
    }
    jump(Nat, "OUTPUT", false, "nftproxy service portals", SERVICES);
    jump(
        Nat,
        "PREROUTING",
        false,
        "nftproxy service portals",
        SERVICES,
    );
    jump(
        Nat,
        "POSTROUTING",
        false,
        "nftproxy postrouting rules",
        POSTROUTING,
    );
    r
}

/// Builds the complete desired iptables rules of `family`.
pub fn build(
    cluster: &Cluster,
    config: &BuildConfig,
    options: &IptablesOptions,
    family: Family,
) -> IptRuleset {
    let mut r = base(config, options, family);
    let env = DecisionEnv::new(cluster, config, family);
    let det = detector(&env.local_traffic);
    let by_service = slices_by_service(&cluster.slices);
    for svc in cluster.services.values() {
        // Not proxied in a family it has no ClusterIP of.
        if svc.cluster_ip(family).is_none() {
            continue;
        }
        // The frontends other Services keep (the same decision as nftables mode's).
        let sup = suppressed(&cluster.services, svc);
        let slices: &[&EndpointSlice] = by_service.get(&svc.name).map(Vec::as_slice).unwrap_or(&[]);
        for decision in service_decisions(svc, slices, &sup, &env) {
            port::add(&mut r, &decision, det.as_ref());
        }
    }

    // The jump to the NodePorts must be the last rule of nat NFTPROXY-SERVICES.
    let note =
        comment("nftproxy service nodeports; NOTE: this must be the last rule in this chain");
    let mut skipped = Vec::new();
    let tail: Vec<String> =
        match node_port_destinations(config, cluster, options, family, &mut skipped) {
            NodePortDestinations::Local { exclude_loopback } => {
                r.route_localnet = family == Family::V4 && !exclude_loopback;
                let not_loopback = if exclude_loopback {
                    format!(" ! -d {}", family.loopback())
                } else {
                    String::new()
                };
                vec![format!(
                    "{note} -m addrtype --dst-type LOCAL{not_loopback} -j {NODEPORTS}"
                )]
            }
            NodePortDestinations::List(ips) => {
                r.route_localnet = ips.iter().any(|a| a.is_ipv4() && a.is_loopback());
                ips.iter()
                    .map(|ip| format!("{note} -d {} -j {NODEPORTS}", host(*ip)))
                    .collect()
            }
        };
    r.skipped_loopback = skipped;
    let services = r.chain(IptTable::Nat, SERVICES);
    services.kind = ChainKind::Dispatch { tail: tail.len() };
    services.rules.extend(tail);
    r
}

#[cfg(test)]
mod tests;
