//! A packet tracer over the ruleset model: what happens to the first packet of a connection.
//!
//! It walks the same base chains the kernel would (prerouting or, for packets the node sends
//! itself, output; then input or forward — a packet the node sends to one of its own addresses
//! passes output, then the prerouting filter and input; then postrouting) and follows every
//! branch of the random endpoint choice, so the result is the set of endpoints a connection may
//! reach.

use std::collections::BTreeSet;
use std::fmt;
use std::net::{IpAddr, SocketAddr};

use crate::conflicts::{self, Conflict, suppressed};
use crate::decision::{self, Frontend};
use crate::model::Cluster;
use crate::model::port_label;
use crate::nft::ruleset::{
    Action, Chain, Family, Key, Match, Proto, Table, Value, Verdict, region_at,
};

/// The first packet of a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packet {
    pub src: IpAddr,
    pub dst: SocketAddr,
    pub proto: Proto,
    /// Interface the packet arrives on (for interface-based local-traffic detection).
    pub iif: Option<String>,
}

/// Where the tracer stands: this host's addresses decide `fib ... type local` and whether the
/// packet comes from the node itself (output hooks) or from elsewhere (prerouting hooks).
#[derive(Clone, Debug, Default)]
pub struct Host {
    pub local_addresses: Vec<IpAddr>,
}

impl Host {
    fn is_local(&self, ip: &IpAddr) -> bool {
        self.local_addresses.contains(ip)
    }
}

/// One way the packet can go.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// Translated to this endpoint; `masquerade` says whether the source is rewritten.
    Endpoint {
        addr: SocketAddr,
        masquerade: bool,
    },
    Drop,
    Reject,
    /// nftproxy's rules do not touch the packet.
    Untouched,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Endpoint { addr, masquerade } => {
                write!(
                    f,
                    "{addr}{}",
                    if *masquerade { " (masqueraded)" } else { "" }
                )
            }
            Outcome::Drop => f.write_str("DROP"),
            Outcome::Reject => f.write_str("REJECT"),
            Outcome::Untouched => f.write_str("not handled by nftproxy"),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    /// Every possible outcome (several only when an endpoint is chosen at random).
    pub outcomes: BTreeSet<Outcome>,
    /// The comments of the Service chains the packet went through (`ns/name:port`).
    pub services: BTreeSet<String>,
    /// The chains visited, in order of first visit, for explanations.
    pub chains: Vec<String>,
    /// The destinations (`ADDR . PROTO . PORT`, or `PROTO . PORT` for a node port) whose
    /// endpoint list chose the endpoint: Services without a chain of their own. See
    /// [`Trace::name_services`].
    pub frontends: BTreeSet<Key>,
    /// The packet's destination and protocol.
    pub destination: Option<(SocketAddr, Proto)>,
    /// The destination the packet was rewritten to before the endpoint lists (an external IP
    /// or NodePort sharing its ClusterIP's list); its frontend is in
    /// [`Trace::frontends`] too.
    pub shared_list: Option<SocketAddr>,
    /// The endpoint was drawn on the flat path for large Services: a draw that misses (an index
    /// at or above the list's length) draws again, and after the last draw the destination's
    /// first endpoint is taken.
    pub redraws: bool,
    /// Conflicts over the packet's destination (several Services claim it; see
    /// [`crate::conflicts`]), filled in by [`Trace::name_services`].
    pub conflicts: Vec<Conflict>,
}

impl Trace {
    /// Adds to `services` the Service ports (`ns/name:port`) of `cluster` that own
    /// [`Trace::frontends`]; the table alone does not name them. Where several Services claim
    /// a frontend, the one [`crate::conflicts`] gives it to owns it, and the conflicts over
    /// the packet's destination go to [`Trace::conflicts`].
    pub fn name_services(&mut self, cluster: &Cluster, family: Family) {
        let services = cluster.services.values();
        for svc in services.filter(|_| !self.frontends.is_empty()) {
            if svc.cluster_ip(family).is_none() {
                continue;
            }
            let sup = std::cell::LazyCell::new(|| suppressed(&cluster.services, svc));
            for port in svc.ports.iter() {
                let kept: Vec<Frontend> = decision::frontends(svc, port, family, &sup)
                    .into_iter()
                    .filter(|f| f.kept)
                    .map(|f| f.frontend)
                    .collect();
                let owns = |key: &Key| match *key {
                    Key::AddrProtoPort(ip, proto, p) => {
                        proto == port.protocol && kept.contains(&Frontend::Addr(ip, p))
                    }
                    Key::ProtoPort(proto, p) => {
                        proto == port.protocol && kept.contains(&Frontend::NodePort(p))
                    }
                    _ => false,
                };
                if self.frontends.iter().any(owns) {
                    self.services.insert(port_label(svc, port));
                }
            }
        }
        if let Some((dst, proto)) = self.destination {
            let hit = |f: &conflicts::Frontend| match *f {
                conflicts::Frontend::ClusterIp(ip) => ip == dst.ip(),
                conflicts::Frontend::Addr(ip, p, port) => {
                    ip == dst.ip() && p == proto && port == dst.port()
                }
                conflicts::Frontend::NodePort(p, port) => {
                    p == proto
                        && port == dst.port()
                        && self.frontends.contains(&Key::ProtoPort(p, port))
                }
            };
            self.conflicts = conflicts::conflicts(&cluster.services)
                .into_iter()
                .filter(|c| hit(&c.frontend))
                .collect();
        }
    }

    /// The endpoints the packet may reach, if it is translated at all.
    pub fn endpoints(&self) -> BTreeSet<SocketAddr> {
        self.outcomes
            .iter()
            .filter_map(|o| match o {
                Outcome::Endpoint { addr, .. } => Some(*addr),
                _ => None,
            })
            .collect()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct State {
    mark: u32,
    /// The destination address and port rules wrote into the packet (`ip daddr set`, `tcp
    /// dport set`), before DNAT.
    daddr: Option<IpAddr>,
    dport: Option<u16>,
    dnat: Option<SocketAddr>,
    masqueraded: bool,
}

impl State {
    /// The packet's destination address as the next rule sees it.
    fn dst(&self, pkt: &Packet) -> IpAddr {
        match (self.dnat, self.daddr) {
            (Some(d), _) => d.ip(),
            (None, Some(a)) => a,
            (None, None) => pkt.dst.ip(),
        }
    }

    /// The packet's destination port as the next rule sees it.
    fn port(&self, pkt: &Packet) -> u16 {
        match (self.dnat, self.dport) {
            (Some(d), _) => d.port(),
            (None, Some(p)) => p,
            (None, None) => pkt.dst.port(),
        }
    }
}

/// How a chain evaluation ended.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum End {
    /// Fell off the end or returned: continue in the caller.
    Continue(State),
    Accept(State),
    Drop,
    Reject,
}

struct Tracer<'a> {
    table: &'a Table,
    host: &'a Host,
    pkt: Packet,
    trace: Trace,
}

impl Tracer<'_> {
    fn visit(&mut self, name: &str, chain: &Chain) {
        if !self.trace.chains.iter().any(|c| c == name) {
            self.trace.chains.push(name.to_string());
        }
        if let Some(c) = &chain.comment
            && (name.starts_with("service-")
                || name.starts_with("local-")
                || name.starts_with("external-"))
        {
            self.trace.services.insert(c.to_string());
        }
    }

    fn matches(&self, m: &Match, state: &State) -> bool {
        let dst = state.dst(&self.pkt);
        let port = state.port(&self.pkt);
        let src = self.pkt.src;
        let set_has = |set: &str, key: Key| self.element(set, &key).is_some();
        match m {
            Match::CtStateNew => true,
            Match::Daddr { net, negate } => net.contains(&dst) != *negate,
            Match::Saddr { net, negate } => net.contains(&src) != *negate,
            Match::DaddrInSet { set } => set_has(set, Key::Addr(dst)),
            // Affinity sets are filled at run time; a first connection has no entry.
            Match::SaddrInSet { .. } => false,
            Match::SaddrDaddrInSet { set } => src == dst && set_has(set, Key::AddrPair(src)),
            Match::CtStatusDnat => state.dnat.is_some(),
            Match::FibSaddrLocal => self.host.is_local(&src),
            Match::FibDaddrLocal => self.host.is_local(&dst),
            Match::L4Proto(p) => *p == self.pkt.proto,
            Match::AddrProtoPortInSet { set } => set_has(set, self.frontend(dst, port, false)),
            Match::ProtoPortInSet { set } => set_has(set, self.frontend(dst, port, true)),
            Match::AddrProtoInSet { set } => set_has(set, Key::AddrProto(dst, self.pkt.proto)),
            // The destination the client asked for, before DNAT.
            Match::CtOriginalAddrProtoPortInSet { set } => set_has(
                set,
                self.frontend(self.pkt.dst.ip(), self.pkt.dst.port(), false),
            ),
            Match::CtOriginalProtoPortInSet { set } => set_has(
                set,
                self.frontend(self.pkt.dst.ip(), self.pkt.dst.port(), true),
            ),
            Match::Numgen { .. } => unreachable!("numgen is handled by forking"),
            Match::MarkUnset { mask } => state.mark & mask == 0,
            Match::IifName {
                name,
                prefix,
                negate,
            } => {
                let hit = self.pkt.iif.as_deref().is_some_and(|iif| {
                    if *prefix {
                        iif.starts_with(name.as_str())
                    } else {
                        iif == name
                    }
                });
                hit != *negate
            }
        }
    }

    /// The value of element `key` of `set`, if the set has it.
    fn element(&self, set: &str, key: &Key) -> Option<Option<Value>> {
        self.table.sets.get(set)?.elements.get(key)
    }

    fn lookup(&self, map: &str, key: Key) -> Option<Verdict> {
        self.element(map, &key)??.verdict().cloned()
    }

    /// The packet's frontend key with destination `dst` and port `port`: `dst . proto . port`,
    /// or `proto . port` for a node port.
    fn frontend(&self, dst: IpAddr, port: u16, nodeport: bool) -> Key {
        let proto = self.pkt.proto;
        if nodeport {
            Key::ProtoPort(proto, port)
        } else {
            Key::AddrProtoPort(dst, proto, port)
        }
    }

    /// What `value` makes of entries `list . 0` … `list . modulus-1` of `map`, those it has.
    fn list_entries(
        &self,
        map: &str,
        list: Key,
        modulus: u32,
        value: impl Fn(Value) -> Option<SocketAddr>,
    ) -> Vec<SocketAddr> {
        (0..modulus)
            .filter_map(|i| {
                let key = list.list_entry(u16::try_from(i).ok()?)?;
                value(self.element(map, &key)??)
            })
            .collect()
    }

    /// The endpoints of the endpoint-map region that starts at `offset`.
    fn slot_targets(&self, map: &str, offset: u32) -> Vec<SocketAddr> {
        let Some(set) = self.table.sets.get(map) else {
            return Vec::new();
        };
        let region = region_at(offset);
        set.elements
            .iter()
            .filter_map(|(k, v)| match (k, v) {
                (Key::Interval { at, .. }, Some(Value::Endpoint(addr, port)))
                    if region_at(at) == region =>
                {
                    Some(SocketAddr::new(addr, port))
                }
                _ => None,
            })
            .collect()
    }

    fn chain(&mut self, name: &str, state: State, depth: usize) -> Vec<End> {
        let Some(chain) = self.table.chains.get(name) else {
            return vec![End::Continue(state)];
        };
        if depth > 32 {
            return vec![End::Drop];
        }
        self.visit(name, chain);
        self.rules(chain, 0, state, depth)
    }

    fn rules(&mut self, chain: &Chain, start: usize, state: State, depth: usize) -> Vec<End> {
        for i in start..chain.rules.len() {
            let rule = &chain.rules[i];
            let mut fork = false;
            let mut ok = true;
            for m in &rule.matches {
                match m {
                    Match::Numgen { modulus, .. } if *modulus > 1 => fork = true,
                    Match::Numgen { .. } => {}
                    other => ok &= self.matches(other, &state),
                }
            }
            if !ok {
                continue;
            }
            let taken = self.action(chain, i, &rule.action, state.clone(), depth);
            if !fork {
                return taken;
            }
            let mut all = taken;
            all.extend(self.rules(chain, i + 1, state, depth));
            return all;
        }
        vec![End::Continue(state)]
    }

    fn verdict(
        &mut self,
        chain: &Chain,
        i: usize,
        v: &Verdict,
        state: State,
        depth: usize,
    ) -> Vec<End> {
        match v {
            Verdict::Accept => vec![End::Accept(state)],
            Verdict::Drop => vec![End::Drop],
            Verdict::Return => vec![End::Continue(state)],
            Verdict::Goto(target) => self.chain(target, state, depth + 1),
            Verdict::Jump(target) => {
                let mut out = Vec::new();
                for end in self.chain(target, state, depth + 1) {
                    match end {
                        End::Continue(s) => out.extend(self.rules(chain, i + 1, s, depth)),
                        other => out.push(other),
                    }
                }
                // The flat path's draws reach the same endpoints again and again.
                out.sort();
                out.dedup();
                out
            }
        }
    }

    fn action(
        &mut self,
        chain: &Chain,
        i: usize,
        action: &Action,
        mut state: State,
        depth: usize,
    ) -> Vec<End> {
        let dst = state.dst(&self.pkt);
        let port = state.port(&self.pkt);
        let continue_here = |me: &mut Self, s: State| me.rules(chain, i + 1, s, depth);
        // A draw from a list of `modulus` entries: any of `targets`. A flat-path draw (see
        // `nft::build`'s `big`) misses for indices at or above the list's length: the packet
        // goes on to the next draw, and after the last to the fallback.
        let draw = |me: &mut Self, frontend: Key, targets: Vec<SocketAddr>, modulus: u32, s| {
            if targets.is_empty() {
                return continue_here(me, s);
            }
            me.trace.frontends.insert(frontend);
            let misses = targets.len() < modulus as usize;
            let mut ends = dnat_to_any(targets, &s);
            if misses {
                me.trace.redraws = true;
                ends.extend(continue_here(me, s));
            }
            ends
        };
        match action {
            Action::Verdict(v) => self.verdict(chain, i, v, state, depth),
            Action::VmapAddrProtoPort { map } | Action::VmapProtoPort { map } => {
                let nodeport = matches!(action, Action::VmapProtoPort { .. });
                match self.lookup(map, self.frontend(dst, port, nodeport)) {
                    Some(v) => self.verdict(chain, i, &v, state, depth),
                    None => continue_here(self, state),
                }
            }
            Action::Reject => vec![End::Reject],
            Action::Dnat { addr, port } => {
                state.dnat = Some(SocketAddr::new(*addr, *port));
                vec![End::Accept(state)]
            }
            Action::DnatRegion { map, offset } => {
                // Every endpoint with an interval in the region is a possible outcome.
                let targets = self.slot_targets(map, *offset);
                if targets.is_empty() {
                    return continue_here(self, state);
                }
                dnat_to_any(targets, &state)
            }
            Action::DnatIndexed {
                map,
                nodeport,
                modulus,
            } => {
                // Entry `numgen random mod modulus` of the destination's list: any of them.
                let frontend = self.frontend(dst, port, *nodeport);
                let targets = self.list_entries(map, frontend, *modulus, |v| match v {
                    Value::Endpoint(addr, port) => Some(SocketAddr::new(addr, port)),
                    _ => None,
                });
                draw(self, frontend, targets, *modulus, state)
            }
            Action::DnatShared {
                addresses,
                ports,
                modulus,
            } => {
                // Entry `numgen random mod modulus` of the ClusterIP's address list, with the
                // destination's own target port.
                let frontend = self.frontend(dst, port, false);
                let Some(Some(Value::Port(to))) = self.element(ports, &frontend) else {
                    return continue_here(self, state);
                };
                let list = Key::AddrProto(dst, self.pkt.proto);
                let targets = self.list_entries(addresses, list, *modulus, |v| match v {
                    Value::Addr(addr) => Some(SocketAddr::new(addr, to)),
                    _ => None,
                });
                draw(self, frontend, targets, *modulus, state)
            }
            Action::SetDaddr { map, nodeport } => {
                let frontend = self.frontend(dst, port, *nodeport);
                if let Some(Some(Value::Addr(addr))) = self.element(map, &frontend) {
                    state.daddr = Some(addr);
                    self.trace.frontends.insert(frontend);
                    self.trace.shared_list = Some(SocketAddr::new(addr, port));
                }
                continue_here(self, state)
            }
            Action::SetDport { map } => {
                if let Some(Some(Value::Port(to))) =
                    self.element(map, &self.frontend(dst, port, true))
                {
                    state.dport = Some(to);
                    if let Some(shared) = &mut self.trace.shared_list {
                        shared.set_port(to);
                    }
                }
                continue_here(self, state)
            }
            Action::Masquerade => {
                state.masqueraded = true;
                vec![End::Accept(state)]
            }
            Action::MarkOr(bits) => {
                state.mark |= bits;
                continue_here(self, state)
            }
            Action::MarkXor(bits) => {
                state.mark ^= bits;
                continue_here(self, state)
            }
            // Affinity entries are made at run time: a first connection has none, and
            // recording one changes nothing for the packet.
            Action::UpdateSaddr { .. }
            | Action::DnatAffinity { .. }
            | Action::UpdateAffinity { .. } => continue_here(self, state),
        }
    }

    /// Runs one base chain over every state; terminal drops and rejects are final.
    fn hook(
        &mut self,
        name: &str,
        states: Vec<State>,
        finals: &mut BTreeSet<Outcome>,
    ) -> Vec<State> {
        let mut out = Vec::new();
        for s in states {
            for end in self.chain(name, s, 0) {
                match end {
                    End::Continue(s) | End::Accept(s) => out.push(s),
                    End::Drop => {
                        finals.insert(Outcome::Drop);
                    }
                    End::Reject => {
                        finals.insert(Outcome::Reject);
                    }
                }
            }
        }
        out
    }
}

/// A random choice among `targets`: each is a possible outcome.
fn dnat_to_any(targets: Vec<SocketAddr>, state: &State) -> Vec<End> {
    targets
        .into_iter()
        .map(|target| {
            let mut s = state.clone();
            s.dnat = Some(target);
            End::Accept(s)
        })
        .collect()
}

/// Traces the first packet of a connection through `table` on `host`.
pub fn trace(table: &Table, host: &Host, pkt: &Packet) -> Trace {
    let from_host = host.is_local(&pkt.src);
    let mut t = Tracer {
        table,
        host,
        pkt: pkt.clone(),
        trace: Trace::default(),
    };
    let mut finals = BTreeSet::new();
    let start = vec![State {
        mark: 0,
        daddr: None,
        dport: None,
        dnat: None,
        masqueraded: false,
    }];
    let (pre, nat) = if from_host {
        ("filter-output-pre-dnat", "nat-output")
    } else {
        ("filter-prerouting-pre-dnat", "nat-prerouting")
    };
    let states = t.hook(pre, start, &mut finals);
    let states = t.hook(nat, states, &mut finals);
    let mut after_filter = Vec::new();
    for s in states {
        let dst = s.dst(pkt);
        let filters: &[&str] = match (from_host, host.is_local(&dst)) {
            // A packet the node sends to itself leaves through the output hooks and comes back
            // in over loopback: the prerouting filter and the input hook see it as well (NAT
            // was decided on output), so e.g. the NodePort no-endpoint check rejects it.
            (true, true) => &[
                "filter-output",
                "filter-prerouting-pre-dnat",
                "filter-input",
            ],
            (true, false) => &["filter-output"],
            (false, true) => &["filter-input"],
            (false, false) => &["filter-forward"],
        };
        let mut states = vec![s];
        for filter in filters {
            states = t.hook(filter, states, &mut finals);
        }
        after_filter.extend(states);
    }
    for s in t.hook("nat-postrouting", after_filter, &mut finals) {
        finals.insert(match s.dnat {
            Some(addr) => Outcome::Endpoint {
                addr,
                masquerade: s.masqueraded,
            },
            None => Outcome::Untouched,
        });
    }
    t.trace.outcomes = finals;
    t.trace.destination = Some((pkt.dst, pkt.proto));
    t.trace
}
