//! What a flow does: the fate of its first packet as the reference table, the kernel and
//! the tracer see it.

use super::*;

// ------------------------------------------------------------------------------------------
// What a flow does.

/// The fate of a connection's first packet, as the table, the kernel or the tracer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Fate {
    /// Translated to one of these endpoints; `masq` if the source was rewritten.
    Endpoints {
        set: BTreeSet<SocketAddr>,
        masq: bool,
    },
    /// Not touched by nftproxy: it reached the node's own stack at its original destination.
    Host,
    Drop,
    Reject,
    Other(String),
}

impl fmt::Display for Fate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fate::Endpoints { set, masq } => {
                let list: Vec<String> = set.iter().map(ToString::to_string).collect();
                write!(
                    f,
                    "{}{}",
                    list.join(", "),
                    if *masq { " (masq)" } else { " (no masq)" }
                )
            }
            Fate::Host => f.write_str("\"\" (host)"),
            Fate::Drop => f.write_str("DROP"),
            Fate::Reject => f.write_str("REJECT"),
            Fate::Other(s) => write!(f, "?? {s}"),
        }
    }
}

/// `want` as written in the reference tables: "REJECT", "DROP", "" or "IP:port, IP:port".
pub(super) fn table_fate(want: &str, masq: bool) -> Fate {
    match want {
        "REJECT" => Fate::Reject,
        "DROP" => Fate::Drop,
        "" => Fate::Host,
        list => Fate::Endpoints {
            set: list.split(',').map(|s| sa(s.trim())).collect(),
            masq,
        },
    }
}

/// One row of a table.
#[derive(Clone, Debug)]
pub(super) struct Flow {
    pub(super) name: String,
    pub(super) proto: Proto,
    pub(super) src: IpAddr,
    pub(super) dst: SocketAddr,
    pub(super) want: Fate,
    /// What iptables mode does instead, and the documented difference that makes it so.
    pub(super) iptables: Option<(Fate, &'static str)>,
    /// UDP over IPv4 without a checksum (see [`Probe::no_udp_checksum`]).
    pub(super) no_udp_checksum: bool,
}

impl Flow {
    /// In iptables mode this flow ends as `want` (as in the tables), because of `why` (one of
    /// the differences above).
    pub(super) fn iptables(mut self, want: &str, masq: bool, why: &'static str) -> Flow {
        self.iptables = Some((table_fate(want, masq), why));
        self
    }

    /// Sends the flow's UDP datagrams without a checksum.
    pub(super) fn without_udp_checksum(mut self) -> Flow {
        self.no_udp_checksum = true;
        self
    }

    /// The expected fate in `mode`.
    pub(super) fn want(&self, mode: Mode) -> &Fate {
        match (&self.iptables, mode) {
            (Some((fate, _)), Mode::Iptables) => fate,
            _ => &self.want,
        }
    }
}

pub(super) fn flow(name: &str, proto: Proto, src: &str, dst: &str, want: &str, masq: bool) -> Flow {
    Flow {
        name: name.to_string(),
        proto,
        src: ip(src),
        dst: sa(dst),
        want: table_fate(want, masq),
        iptables: None,
        no_udp_checksum: false,
    }
}

pub(super) fn tcp(name: &str, src: &str, dst: &str, want: &str, masq: bool) -> Flow {
    flow(name, Proto::Tcp, src, dst, want, masq)
}

pub(super) fn nft_proto(p: Proto) -> NftProto {
    match p {
        Proto::Tcp => NftProto::Tcp,
        Proto::Udp => NftProto::Udp,
        Proto::Sctp => NftProto::Sctp,
    }
}

/// Adds up a probe's attempts. Masquerade: an endpoint saw another source address.
pub(super) fn kernel_fate(attempts: &[Attempt], dst: SocketAddr, node_addrs: &[IpAddr]) -> Fate {
    let total = attempts.len();
    let mut set = BTreeSet::new();
    let (mut masq_count, mut masq_sources) = (0, BTreeSet::new());
    let (mut refused, mut timeouts, mut errors) = (0, 0, BTreeMap::<String, usize>::new());
    for a in attempts {
        match a {
            Attempt::Answered { src, local, peer } => {
                set.insert(*local);
                if peer.ip() != src.ip() {
                    masq_count += 1;
                    masq_sources.insert(peer.ip());
                }
            }
            Attempt::Refused => refused += 1,
            Attempt::Timeout => timeouts += 1,
            Attempt::Error { error } => *errors.entry(error.clone()).or_default() += 1,
        }
    }
    masq_sources.retain(|a| *a != ip(MASQ_IP) && *a != ip(MASQ_IP6));
    if !masq_sources.is_empty() {
        return Fate::Other(format!(
            "source rewritten to {masq_sources:?}, not the node's"
        ));
    }
    let answered = total - refused - timeouts - errors.values().sum::<usize>();
    if masq_count > 0 && masq_count < answered {
        return Fate::Other(format!(
            "{masq_count} of {answered} answers masqueraded, by {set:?}"
        ));
    }
    let masq = masq_count > 0;
    if total > 0 && set.len() == 1 && set.contains(&dst) && node_addrs.contains(&dst.ip()) {
        if masq {
            return Fate::Other("the host answered a masqueraded packet".into());
        }
        if refused + timeouts + errors.len() == 0 {
            return Fate::Host;
        }
    }
    if total > 0 && answered == total {
        Fate::Endpoints { set, masq }
    } else if total > 0 && refused == total {
        Fate::Reject
    } else if total > 0 && timeouts == total {
        Fate::Drop
    } else {
        Fate::Other(format!(
            "answered by {set:?} ({answered}), refused {refused}, timeouts {timeouts}, errors {errors:?}"
        ))
    }
}

pub(super) fn tracer_fate(
    outcomes: &BTreeSet<Outcome>,
    dst: SocketAddr,
    node_addrs: &[IpAddr],
) -> Fate {
    let endpoints: Vec<(SocketAddr, bool)> = outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::Endpoint { addr, masquerade } => Some((*addr, *masquerade)),
            _ => None,
        })
        .collect();
    if !endpoints.is_empty() && endpoints.len() == outcomes.len() {
        let masq = endpoints[0].1;
        if endpoints.iter().any(|(_, m)| *m != masq) {
            return Fate::Other(format!("masquerade differs by endpoint: {outcomes:?}"));
        }
        return Fate::Endpoints {
            set: endpoints.into_iter().map(|(a, _)| a).collect(),
            masq,
        };
    }
    let only = |o: Outcome| outcomes.len() == 1 && outcomes.contains(&o);
    if only(Outcome::Drop) {
        Fate::Drop
    } else if only(Outcome::Reject) {
        Fate::Reject
    } else if only(Outcome::Untouched) && node_addrs.contains(&dst.ip()) {
        Fate::Host
    } else {
        Fate::Other(format!("{outcomes:?}"))
    }
}
