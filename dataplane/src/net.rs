//! IP families and transport protocols, as every backend names them.

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

/// An address as a plain number, which hashes in one step where an `IpAddr` takes four (the
/// endpoints of a Service of thousands are hashed to merge and to keep their order). Equal for
/// an IPv4 address and the IPv6 address `::a.b.c.d`: use it where one family is compared.
pub fn addr_bits(addr: IpAddr) -> u128 {
    match addr {
        IpAddr::V4(a) => a.to_bits().into(),
        IpAddr::V6(a) => a.to_bits(),
    }
}

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
