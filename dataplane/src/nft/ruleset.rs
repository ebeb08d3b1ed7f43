//! The typed nftables ruleset nftproxy programs, independent of how it reaches the kernel.
//!
//! Only the constructs nftproxy emits are modelled, so every backend (netlink encoder, text
//! renderer, packet tracer) can handle all of them exhaustively.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

pub use crate::net::{Family, Proto};

/// Name of nftproxy's table in both families.
pub const TABLE: &str = "nftproxy";
pub const TABLE_COMMENT: &str = "rules for nftproxy";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChainType {
    Filter,
    Nat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Hook {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
}

impl Hook {
    pub fn name(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Input => "input",
            Hook::Forward => "forward",
            Hook::Output => "output",
            Hook::Postrouting => "postrouting",
        }
    }
}

/// Hook attachment of a base chain. Policy is always accept: nftproxy never drops by policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BaseChain {
    pub chain_type: ChainType,
    pub hook: Hook,
    pub priority: i32,
}

/// A chain's name. A Service chain's name is held by the table, the verdict-map element that
/// leads to it, the committed state and the transactions that write it: shared, not copied.
pub type ChainName = Arc<str>;

#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Chain {
    pub base: Option<BaseChain>,
    pub comment: Option<Arc<str>>,
    /// Shared with the transactions that write the chain, which would otherwise copy every
    /// rule of a cold sync.
    pub rules: Arc<Vec<Rule>>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rule {
    pub matches: Vec<Match>,
    pub action: Action,
    pub comment: Option<String>,
}

impl Rule {
    pub fn new(matches: Vec<Match>, action: Action) -> Rule {
        Rule {
            matches,
            action,
            comment: None,
        }
    }

    pub fn with_comment(mut self, comment: &str) -> Rule {
        self.comment = Some(comment.to_string());
        self
    }
}

/// A condition. All conditions of a rule must hold for its action to run.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Match {
    /// `ct state new`
    CtStateNew,
    /// `ip daddr [!=] NET` (a host prefix renders as a plain address)
    Daddr { net: IpNet, negate: bool },
    /// `ip saddr [!=] NET`
    Saddr { net: IpNet, negate: bool },
    /// `ip daddr @SET`
    DaddrInSet { set: String },
    /// `ip saddr @SET`
    SaddrInSet { set: String },
    /// `ip saddr . ip daddr @SET` (a set of [`Key::AddrPair`])
    SaddrDaddrInSet { set: String },
    /// `ct status dnat`: the connection's destination was translated.
    CtStatusDnat,
    /// `fib saddr type local`
    FibSaddrLocal,
    /// `fib daddr type local`
    FibDaddrLocal,
    /// `meta l4proto P`
    L4Proto(Proto),
    /// `ip daddr . meta l4proto . th dport @SET` (a set of [`Key::AddrProtoPort`])
    AddrProtoPortInSet { set: String },
    /// `meta l4proto . th dport @SET` (a set of [`Key::ProtoPort`])
    ProtoPortInSet { set: String },
    /// `ip daddr . meta l4proto @SET` (a set of [`Key::AddrProto`])
    AddrProtoInSet { set: String },
    /// `ct original ip daddr . meta l4proto . ct original proto-dst @SET` (a set of
    /// [`Key::AddrProtoPort`]): the connection's destination before DNAT. nft needs the rule to
    /// match `meta l4proto` first.
    CtOriginalAddrProtoPortInSet { set: String },
    /// `meta l4proto . ct original proto-dst @SET` (a set of [`Key::ProtoPort`]); nft needs the
    /// rule to match `meta l4proto` first.
    CtOriginalProtoPortInSet { set: String },
    /// `numgen random mod MODULUS VALUE`: true with probability 1/MODULUS for VALUE < MODULUS.
    Numgen { modulus: u32, value: u32 },
    /// `meta mark & MASK == 0`
    MarkUnset { mask: u32 },
    /// `iifname [!=] NAME` (`NAME*` when prefix)
    IifName {
        name: String,
        prefix: bool,
        negate: bool,
    },
}

/// What a rule does once all its matches hold.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Verdict(Verdict),
    /// `ip daddr . meta l4proto . th dport vmap @MAP`
    VmapAddrProtoPort {
        map: String,
    },
    /// `meta l4proto . th dport vmap @MAP`
    VmapProtoPort {
        map: String,
    },
    /// `reject` (ICMP port unreachable, so TCP clients see "connection refused")
    Reject,
    /// `dnat to ADDR:PORT` (the rule must also match `meta l4proto`)
    Dnat {
        addr: IpAddr,
        port: u16,
    },
    /// `masquerade fully-random`
    Masquerade,
    /// `meta mark set meta mark | BITS`
    MarkOr(u32),
    /// `meta mark set meta mark ^ BITS`
    MarkXor(u32),
    /// `update @SET { ip saddr }`: records the client for session affinity.
    UpdateSaddr {
        set: String,
    },
    /// `dnat ip to ip saddr . ip daddr . meta l4proto . th dport map @MAP` (a map of
    /// [`KeyType::AffinityClients`]): sends the client to the endpoint it was given last time it
    /// reached this destination. A miss leaves the packet alone.
    DnatAffinity {
        map: &'static str,
    },
    /// `update @MAP { ip saddr . ct original ip daddr . meta l4proto . ct original proto-dst
    /// timeout Ts : ip daddr . th dport }` after DNAT: records (or refreshes) the endpoint the
    /// client was given for the destination it asked for. nft needs the rule to match `meta
    /// l4proto` first.
    UpdateAffinity {
        map: &'static str,
        timeout_secs: u32,
    },
    /// `dnat ip to numgen random mod REGION_MODULUS offset OFFSET map @MAP`: picks one of the
    /// endpoints whose intervals tile the region starting at `offset` of endpoint map `map` (see
    /// [`region_elements`]). The rule must also match `meta l4proto`. Changing the endpoints changes
    /// only map elements, never the rule.
    DnatRegion {
        map: &'static str,
        offset: u32,
    },
    /// `dnat ip to ip daddr . meta l4proto . th dport . numgen random mod MODULUS map @MAP`
    /// (without `ip daddr .` for a NodePort map): the packet's own destination and a random
    /// index below `modulus` choose the endpoint, so one rule serves every Service whose
    /// endpoint list has `modulus` entries in `map` (a map of [`Key::AddrProtoPortIndex`] or
    /// [`Key::ProtoPortIndex`] keys). A miss leaves the packet alone.
    DnatIndexed {
        map: String,
        nodeport: bool,
        modulus: u32,
    },
    /// `ip daddr set ip daddr . meta l4proto . th dport map @MAP` (a map of
    /// [`KeyType::AddrProtoPortToAddr`]; without `ip daddr .` for a NodePort map of
    /// [`KeyType::ProtoPortToAddr`]): rewrites the destination address, so that the lookups
    /// after it see another destination's key (an external IP's or NodePort's ClusterIP,
    /// whose endpoint list it shares). DNAT later replaces the address in the packet and
    /// conntrack keeps the original one for the replies. A miss ends the rule, the packet
    /// unchanged.
    SetDaddr {
        map: &'static str,
        nodeport: bool,
    },
    /// `tcp dport set meta l4proto . th dport map @MAP` (a map of
    /// [`KeyType::ProtoPortToPort`]; the rule matches `meta l4proto tcp`): rewrites a NodePort
    /// to its Service port, with the TCP checksum (a UDP checksum of 0 would not survive the
    /// update, so UDP is never rewritten). A miss ends the rule.
    SetDport {
        map: &'static str,
    },
    /// `dnat ip to ip daddr . meta l4proto . numgen random mod MODULUS map @ADDRESSES : ip
    /// daddr . meta l4proto . th dport map @PORTS`: the address from a list the ports of one
    /// protocol of a ClusterIP share (a map of [`KeyType::AddrProtoIndex`]), the port from the
    /// destination's own target port (a map of [`KeyType::AddrProtoPortToPort`]). A miss in
    /// either leaves the packet alone.
    DnatShared {
        addresses: &'static str,
        ports: &'static str,
        modulus: u32,
    },
}

// `repr(u8)` puts the tag in a byte of its own, which lets `Option<Value>` keep [`Value::Endpoint`]
// beside it: 24 bytes instead of 32 for every map element.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Verdict {
    Accept,
    Drop,
    Return,
    Jump(ChainName),
    Goto(ChainName),
}

impl Verdict {
    /// The chain this verdict refers to, if any.
    pub fn target(&self) -> Option<&str> {
        match self {
            Verdict::Jump(c) | Verdict::Goto(c) => Some(c),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KeyType {
    /// `ipv4_addr` / `ipv6_addr`
    Addr,
    /// `ipv4_addr . inet_proto . inet_service`
    AddrProtoPort,
    /// `inet_proto . inet_service`
    ProtoPort,
    /// `ipv4_addr . ipv4_addr`
    AddrPair,
    /// An endpoint map: `typeof numgen random mod 2 : ip daddr . th dport`, `flags interval`
    /// (elements are [`Key::Interval`]).
    Interval,
    /// An endpoint-list map: `typeof ip daddr . meta l4proto . th dport . numgen random mod 2 :
    /// ip daddr . th dport` (elements are [`Key::AddrProtoPortIndex`]).
    AddrProtoPortIndex,
    /// A NodePort endpoint-list map: `typeof meta l4proto . th dport . numgen random mod 2 :
    /// ip daddr . th dport` (elements are [`Key::ProtoPortIndex`]).
    ProtoPortIndex,
    /// The session-affinity map, `typeof ip saddr . ip daddr . meta l4proto . th dport : ip
    /// daddr . th dport`, `flags dynamic,timeout`: the kernel fills it (see
    /// [`Action::UpdateAffinity`]); the desired table never holds its elements.
    AffinityClients,
    /// A map `ipv4_addr . inet_proto . inet_service : ipv4_addr` (elements are
    /// [`Key::AddrProtoPort`] with a [`Value::Addr`]), read by [`Action::SetDaddr`].
    AddrProtoPortToAddr,
    /// A map `inet_proto . inet_service : ipv4_addr` (elements are [`Key::ProtoPort`] with a
    /// [`Value::Addr`]), read by [`Action::SetDaddr`] for NodePorts.
    ProtoPortToAddr,
    /// A map `inet_proto . inet_service : inet_service` (elements are [`Key::ProtoPort`] with a
    /// [`Value::Port`]), read by [`Action::SetDport`].
    ProtoPortToPort,
    /// `ipv4_addr . inet_proto` (elements are [`Key::AddrProto`])
    AddrProto,
    /// A shared address list: `typeof ip daddr . meta l4proto . numgen random mod 2 : ip
    /// daddr` (elements are [`Key::AddrProtoIndex`] with a [`Value::Addr`]), read by
    /// [`Action::DnatShared`].
    AddrProtoIndex,
    /// A map `ipv4_addr . inet_proto . inet_service : inet_service` (elements are
    /// [`Key::AddrProtoPort`] with a [`Value::Port`]), read by [`Action::DnatShared`].
    AddrProtoPortToPort,
}

impl KeyType {
    /// Maps whose elements are endpoints ([`Value::Endpoint`]).
    pub fn holds_endpoints(self) -> bool {
        matches!(
            self,
            KeyType::Interval
                | KeyType::AddrProtoPortIndex
                | KeyType::ProtoPortIndex
                | KeyType::AffinityClients
        )
    }

    /// Maps nft declares with `typeof` (their keys or data include what no named type describes:
    /// `numgen`, or a port and an address as DNAT reads them).
    pub fn declared_by_typeof(self) -> bool {
        self.holds_endpoints() || self == KeyType::AddrProtoIndex
    }

    /// Maps whose elements have data other than a verdict: endpoints, addresses or ports.
    pub fn has_data(self) -> bool {
        self.holds_endpoints()
            || matches!(
                self,
                KeyType::AddrProtoPortToAddr
                    | KeyType::ProtoPortToAddr
                    | KeyType::ProtoPortToPort
                    | KeyType::AddrProtoIndex
                    | KeyType::AddrProtoPortToPort
            )
    }
}

/// Ordered as a derived `Ord` would order it (variants in declaration order, then fields in
/// order), with addresses compared as numbers: see `key_order`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Key {
    Addr(IpAddr),
    AddrProtoPort(IpAddr, Proto, u16),
    ProtoPort(Proto, u16),
    /// `A . A`: an address paired with itself, for `ip saddr . ip daddr` (hairpin) lookups.
    AddrPair(IpAddr),
    /// An interval of an endpoint map, the values `at ..= end - 1` (its [`Value::Endpoint`] is
    /// the endpoint they choose). The kernel stores it as two elements, a start at `at` with the
    /// endpoint as data and an interval end at `end`. Both bounds are the key, so an interval
    /// whose bounds change is replaced, never split or merged in place (the kernel refuses
    /// that).
    Interval {
        at: u32,
        end: u32,
    },
    /// Entry `index` of the endpoint list of a Service address and port.
    AddrProtoPortIndex(IpAddr, Proto, u16, u16),
    /// Entry `index` of the endpoint list of a NodePort.
    ProtoPortIndex(Proto, u16, u16),
    /// A ClusterIP and protocol whose ports share one address list.
    AddrProto(IpAddr, Proto),
    /// Entry `index` of the address list of a ClusterIP and protocol.
    AddrProtoIndex(IpAddr, Proto, u16),
}

/// What a map element maps its key to.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Value {
    Verdict(Verdict),
    /// The endpoint an endpoint-map interval chooses.
    Endpoint(IpAddr, u16),
    /// An address ([`KeyType::AddrProtoPortToAddr`], [`KeyType::ProtoPortToAddr`] and
    /// [`KeyType::AddrProtoIndex`] maps).
    Addr(IpAddr),
    /// A port ([`KeyType::ProtoPortToPort`] and [`KeyType::AddrProtoPortToPort`] maps).
    Port(u16),
}

impl From<Verdict> for Value {
    fn from(v: Verdict) -> Value {
        Value::Verdict(v)
    }
}

impl Value {
    /// The verdict of a verdict-map element.
    pub fn verdict(&self) -> Option<&Verdict> {
        match self {
            Value::Verdict(v) => Some(v),
            Value::Endpoint(..) | Value::Addr(_) | Value::Port(_) => None,
        }
    }
}

/// The `numgen random` modulus of [`Action::DnatRegion`] rules. Divisible by every k up to 16,
/// so up to 16 endpoints each get exactly 1/k of the values, as with kube-proxy's `numgen
/// random mod k`; with more endpoints the shares differ by at most one value in 2,882,880
/// divided by k (0.04% for 1,000 endpoints).
pub const REGION_MODULUS: u32 = 2_882_880;

/// A region of an endpoint map spans 2^22 values (more than [`REGION_MODULUS`]): 1,024 regions
/// per map.
pub const REGION_BITS: u32 = 22;
pub const REGIONS_PER_MAP: u32 = 1 << (32 - REGION_BITS);

/// Most endpoints one region can hold (every interval at least 16 values wide).
pub const REGION_MAX_ENDPOINTS: usize = (REGION_MODULUS / 16) as usize;

/// Number of endpoint maps per family, `endpoints-0` ..: a map's elements are checked against
/// every rule that uses the map when they are added, so each map serves only a slice of the
/// Services.
pub const ENDPOINT_MAPS: usize = 256;

/// Name of endpoint map `i` (`i < ENDPOINT_MAPS`).
pub fn endpoint_map_name(i: usize) -> &'static str {
    static NAMES: std::sync::LazyLock<Vec<String>> = std::sync::LazyLock::new(|| {
        (0..ENDPOINT_MAPS)
            .map(|i| format!("endpoints-{i}"))
            .collect()
    });
    &NAMES[i]
}

/// Index of endpoint map `name`, if it is one.
pub fn endpoint_map_index(name: &str) -> Option<usize> {
    let i: usize = name.strip_prefix("endpoints-")?.parse().ok()?;
    (i < ENDPOINT_MAPS && endpoint_map_name(i) == name).then_some(i)
}

/// First value of region `region` of an endpoint map.
pub fn region_offset(region: u32) -> u32 {
    region << REGION_BITS
}

/// Region of an endpoint-map value.
pub fn region_at(at: u32) -> u32 {
    at >> REGION_BITS
}

/// The elements of the region at `offset` holding `targets` (at most [`REGION_MAX_ENDPOINTS`]):
/// endpoint `j` of k gets the values `offset + j*M/k ..= offset + (j+1)*M/k - 1`, where M is
/// [`REGION_MODULUS`].
pub fn region_elements(offset: u32, targets: &[(IpAddr, u16)]) -> Vec<(Key, Value)> {
    let k = targets.len() as u64;
    let bound = |j: u64| offset + (j * u64::from(REGION_MODULUS) / k) as u32;
    (0u64..)
        .zip(targets)
        .map(|(j, (addr, port))| {
            let key = Key::Interval {
                at: bound(j),
                end: bound(j + 1),
            };
            (key, Value::Endpoint(*addr, *port))
        })
        .collect()
}

/// Rebuilds endpoint-map intervals from the elements the kernel lists, `(value,
/// Some(endpoint))` for a start and `(value, None)` for an interval end, in any order: each
/// start ends at the next end above it. A start without an end is left out.
pub fn region_elements_from_bounds(
    mut bounds: Vec<(u32, Option<(IpAddr, u16)>)>,
) -> Vec<(Key, Value)> {
    bounds.sort_by_key(|(at, target)| (*at, target.is_some()));
    let mut keys = Vec::new();
    let mut open: Option<(u32, IpAddr, u16)> = None;
    for (at, target) in bounds {
        match target {
            Some((addr, port)) => open = Some((at, addr, port)),
            None => {
                if let Some((start, addr, port)) = open.take() {
                    keys.push((
                        Key::Interval { at: start, end: at },
                        Value::Endpoint(addr, port),
                    ));
                }
            }
        }
    }
    keys
}

impl Key {
    /// Entry `index` of the endpoint list of a destination (`ADDR . PROTO . PORT`, or `PROTO .
    /// PORT` for a node port); `None` for other keys.
    pub fn list_entry(self, index: u16) -> Option<Key> {
        match self {
            Key::AddrProtoPort(addr, proto, port) => {
                Some(Key::AddrProtoPortIndex(addr, proto, port, index))
            }
            Key::ProtoPort(proto, port) => Some(Key::ProtoPortIndex(proto, port, index)),
            Key::AddrProto(addr, proto) => Some(Key::AddrProtoIndex(addr, proto, index)),
            _ => None,
        }
    }

    /// What an entry of a list (`self` the entry or its destination) maps `target` to: the
    /// endpoint, or only its address in an address list that the ports of a ClusterIP share
    /// (such lists hold their entries as the address with port 0).
    pub fn list_value(&self, (addr, port): Target) -> Value {
        match self {
            Key::AddrProto(..) | Key::AddrProtoIndex(..) => Value::Addr(addr),
            _ => Value::Endpoint(addr, port),
        }
    }

    /// The destination and index of an endpoint-list entry ([`Key::list_entry`] reversed).
    pub fn list_destination(self) -> Option<(Key, u16)> {
        match self {
            Key::AddrProtoPortIndex(addr, proto, port, i) => {
                Some((Key::AddrProtoPort(addr, proto, port), i))
            }
            Key::ProtoPortIndex(proto, port, i) => Some((Key::ProtoPort(proto, port), i)),
            Key::AddrProtoIndex(addr, proto, i) => Some((Key::AddrProto(addr, proto), i)),
            _ => None,
        }
    }

    pub fn key_type(&self) -> KeyType {
        match self {
            Key::Addr(_) => KeyType::Addr,
            Key::AddrProtoPort(..) => KeyType::AddrProtoPort,
            Key::ProtoPort(..) => KeyType::ProtoPort,
            Key::AddrPair(_) => KeyType::AddrPair,
            Key::Interval { .. } => KeyType::Interval,
            Key::AddrProtoPortIndex(..) => KeyType::AddrProtoPortIndex,
            Key::ProtoPortIndex(..) => KeyType::ProtoPortIndex,
            Key::AddrProto(..) => KeyType::AddrProto,
            Key::AddrProtoIndex(..) => KeyType::AddrProtoIndex,
        }
    }
}

/// Declaration of a named set or map (everything but its elements).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SetDecl {
    pub key: KeyType,
    /// A verdict map rather than a plain set.
    pub is_vmap: bool,
    pub comment: Option<String>,
    /// Element timeout in seconds; makes the set `dynamic,timeout` (session affinity).
    pub timeout_secs: Option<u32>,
    /// The most elements the set may hold (nft's `size`), see [`Table::fit_set_sizes`].
    pub size: Option<u32>,
}

impl SetDecl {
    /// A plain set of `key`s, without options.
    pub fn new(key: KeyType) -> SetDecl {
        SetDecl {
            key,
            is_vmap: false,
            comment: None,
            timeout_secs: None,
            size: None,
        }
    }

    /// Whether the kernel keeps the set in a hash table, which it sizes by `size`: every set
    /// but interval maps and sets with timeouts.
    pub fn hashed(&self) -> bool {
        self.timeout_secs.is_none() && self.key != KeyType::Interval
    }

    /// Whether the kernel fills the set (`flags dynamic,timeout`): the agent adds no element.
    pub fn dynamic(&self) -> bool {
        self.timeout_secs.is_some()
    }
}

/// The smallest `size` a hashed set is given.
pub const SET_SIZE_MIN: u32 = 96;

/// The `size` a hashed set of `n` elements is given: room for twice as many, of the form 3·2^k.
/// The kernel gives the set a power of two of hash buckets, at least 4/3 of its size, and
/// every bucket costs memory the kernel zeroes when it creates the set; 3·2^k needs exactly
/// 4/3 (a power of two would need 8/3).
pub fn fresh_set_size(n: usize) -> u32 {
    let want = n.saturating_mul(2).max(SET_SIZE_MIN as usize);
    let k = want.div_ceil(3).next_power_of_two();
    u32::try_from(k.saturating_mul(3)).unwrap_or(3 << 30)
}

/// Whether a hashed set of `size` still suits `n` elements: at most three quarters full, and not
/// more than four times the size it would be given now.
pub fn set_size_fits(size: u32, n: usize) -> bool {
    let size = u64::from(size);
    (n as u64) * 4 <= size * 3 && size <= u64::from(fresh_set_size(n)) * 4
}

pub mod elements;
mod key_order;
pub mod touched;

pub use elements::{ElementMap, Target};
pub use touched::Touched;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Set {
    pub decl: SetDecl,
    /// Shared with the transactions that add them (see
    /// [`crate::nft::transaction::Elements::Shared`]), so that a cold start's elements exist once.
    pub elements: Arc<ElementMap>,
}

impl Set {
    pub fn new(decl: SetDecl, elements: ElementMap) -> Set {
        Set {
            decl,
            elements: Arc::new(elements),
        }
    }

    /// The elements, to change them: copied first only if a transaction still shares them.
    pub fn elements_mut(&mut self) -> &mut ElementMap {
        Arc::make_mut(&mut self.elements)
    }
}

/// What an element of a set was before a change: absent (`None`), or present with this value.
pub type Was = Option<Option<Value>>;

/// The elements a change touched, per set, with what each was before it (the same everywhere
/// else). Recorded as the change is made, it is what a planner needs to plan the change
/// without a copy of the table as it was.
pub type Delta = BTreeMap<String, Touched>;

/// One family's complete desired table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    pub family: Family,
    pub chains: BTreeMap<ChainName, Chain>,
    pub sets: BTreeMap<String, Set>,
}

impl Table {
    pub fn new(family: Family) -> Table {
        Table {
            family,
            chains: BTreeMap::new(),
            sets: BTreeMap::new(),
        }
    }

    /// Sizes the hashed sets for their elements, keeping the size `kept` gives a set (or else
    /// the size it has) where that still fits ([`set_size_fits`]).
    ///
    /// Without a size the kernel starts a set's hash table tiny and doubles it as elements
    /// arrive, and while it doubles, an insert waits for the resize to finish: loading 400k
    /// elements took twice the kernel time it takes in tables sized up front. A size is also a
    /// limit, so a set that fills up is given a new size, which recreates it.
    pub fn fit_set_sizes(&mut self, kept: impl Fn(&str) -> Option<u32>) {
        for (name, set) in &mut self.sets {
            if !set.decl.hashed() {
                // A set the kernel fills keeps the limit it was declared with.
                if !set.decl.dynamic() {
                    set.decl.size = None;
                }
                continue;
            }
            let n = set.elements.len();
            set.decl.size = match kept(name).or(set.decl.size) {
                Some(size) if set_size_fits(size, n) => Some(size),
                _ => Some(fresh_set_size(n)),
            };
        }
    }

    /// Whether every hashed set named in `names` still fits its size.
    pub fn set_sizes_fit<'a>(&self, names: impl IntoIterator<Item = &'a str>) -> bool {
        names.into_iter().all(|name| {
            self.sets.get(name).is_none_or(|s| {
                s.decl.dynamic()
                    || match s.decl.size {
                        Some(size) => set_size_fits(size, s.elements.len()),
                        None => !s.decl.hashed(),
                    }
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_sizes_leave_room_and_fit_the_kernels_buckets() {
        for n in [0, 1, 47, 48, 49, 1000, 150_000, 2_000_000] {
            let size = fresh_set_size(n);
            assert!(
                size as usize >= 2 * n && size >= SET_SIZE_MIN,
                "{n}: {size}"
            );
            assert!(
                size as usize <= (4 * n).max(2 * SET_SIZE_MIN as usize),
                "{n}: {size}"
            );
            assert!(
                (size / 3).is_power_of_two() && size.is_multiple_of(3),
                "{n}: {size}"
            );
            assert!(set_size_fits(size, n));
        }
        assert!(!set_size_fits(96, 73), "more than three quarters full");
        assert!(set_size_fits(96, 72));
        assert!(!set_size_fits(fresh_set_size(100_000), 10), "far too big");
    }

    #[test]
    fn map_elements_stay_small() {
        // Every element of every map is a (Key, Option<Value>) in the desired table, in the
        // committed state and in a cold start's transaction: 30k Services hold 376k of them.
        assert!(std::mem::size_of::<Key>() <= 24);
        assert!(std::mem::size_of::<Option<Value>>() <= 24);
    }

    #[test]
    fn intervals_tile_the_region_and_read_back() {
        let targets: Vec<(IpAddr, u16)> = (1..=7u8)
            .map(|i| (IpAddr::from([10, 0, 0, i]), 8080))
            .collect();
        let offset = region_offset(3);
        let elements = region_elements(offset, &targets);
        let mut next = offset;
        for ((key, value), target) in elements.iter().zip(&targets) {
            let Key::Interval { at, end } = *key else {
                panic!("not an interval: {key:?}")
            };
            assert_eq!(at, next);
            assert!(end - at == REGION_MODULUS / 7 || end - at == REGION_MODULUS / 7 + 1);
            assert_eq!(*value, Value::Endpoint(target.0, target.1));
            next = end;
        }
        assert_eq!(next, offset + REGION_MODULUS);
        assert!(region_at(next - 1) == 3 && REGION_MODULUS < 1 << REGION_BITS);

        // As the kernel lists them: starts with data, ends without, adjacent ones sharing a value.
        let mut bounds: Vec<(u32, Option<(IpAddr, u16)>)> = Vec::new();
        for (key, value) in &elements {
            let (Key::Interval { at, end }, Value::Endpoint(addr, port)) = (key, value) else {
                unreachable!()
            };
            bounds.push((*end, None));
            bounds.push((*at, Some((*addr, *port))));
        }
        bounds.reverse();
        assert_eq!(region_elements_from_bounds(bounds), elements);
    }
}
