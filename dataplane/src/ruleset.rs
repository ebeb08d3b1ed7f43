//! The typed nftables ruleset nftproxy programs, independent of how it reaches the kernel.
//!
//! Only the constructs nftproxy emits are modelled, so every backend (netlink encoder, text
//! renderer, packet tracer) can handle all of them exhaustively.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

/// Name of nftproxy's table in both families.
pub const TABLE: &str = "nftproxy";
pub const TABLE_COMMENT: &str = "rules for nftproxy";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::V4, Family::V6];

    /// nft's family keyword, also the address-match keyword (`ip daddr`, `ip6 daddr`).
    pub fn nft_name(self) -> &'static str {
        match self {
            Family::V4 => "ip",
            Family::V6 => "ip6",
        }
    }

    pub fn of(addr: &IpAddr) -> Family {
        match addr {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    pub fn of_net(net: &IpNet) -> Family {
        Family::of(&net.addr())
    }

    /// Kubernetes' name for the family, as used in metric labels.
    pub fn k8s_name(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    pub fn loopback(self) -> IpNet {
        match self {
            Family::V4 => "127.0.0.0/8".parse().expect("static CIDR"),
            Family::V6 => "::1/128".parse().expect("static CIDR"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proto {
    Tcp,
    Udp,
    Sctp,
}

impl Proto {
    pub fn number(self) -> u8 {
        match self {
            Proto::Tcp => 6,
            Proto::Udp => 17,
            Proto::Sctp => 132,
        }
    }

    pub fn from_number(n: u8) -> Option<Proto> {
        match n {
            6 => Some(Proto::Tcp),
            17 => Some(Proto::Udp),
            132 => Some(Proto::Sctp),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Sctp => "sctp",
        }
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

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
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    Addr(IpAddr),
    AddrProtoPort(IpAddr, Proto, u16),
    ProtoPort(Proto, u16),
    /// `A . A`: an address paired with itself, for `ip saddr . ip daddr` (hairpin) lookups.
    AddrPair(IpAddr),
}

impl Key {
    pub fn key_type(&self) -> KeyType {
        match self {
            Key::Addr(_) => KeyType::Addr,
            Key::AddrProtoPort(..) => KeyType::AddrProtoPort,
            Key::ProtoPort(..) => KeyType::ProtoPort,
            Key::AddrPair(_) => KeyType::AddrPair,
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
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Set {
    pub decl: SetDecl,
    /// Element key to its verdict (maps) or `None` (sets).
    pub elements: BTreeMap<Key, Option<Verdict>>,
}

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

    /// Repacks the chain and element B-trees densely. Filled Service by Service, in no key
    /// order, their nodes end up about two-thirds full; rebuilt from their sorted contents they
    /// are full (a 30k-Service table: 23 -> 13 MiB of elements).
    pub fn compact(&mut self) {
        self.chains = std::mem::take(&mut self.chains).into_iter().collect();
        for set in self.sets.values_mut() {
            set.elements = std::mem::take(&mut set.elements).into_iter().collect();
        }
    }
}
