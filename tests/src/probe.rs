//! What a probe asks for, what `nettest probe` prints per attempt, and how the attempts
//! add up to a verdict.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Transport protocol of a probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    Tcp,
    Udp,
    /// Hand-built INIT over a raw socket, answered by the echo's raw responder.
    Sctp,
}

impl Proto {
    pub const ALL: [Proto; 3] = [Proto::Tcp, Proto::Udp, Proto::Sctp];

    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Sctp => "sctp",
        }
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Proto {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "tcp" => Ok(Proto::Tcp),
            "udp" => Ok(Proto::Udp),
            "sctp" => Ok(Proto::Sctp),
            _ => Err(format!("unknown protocol {s:?} (tcp, udp, sctp)")),
        }
    }
}

/// Prefix of the report line an echo sends back: `nettest <local addr:port> <peer addr:port>`.
pub const REPORT_PREFIX: &str = "nettest ";

/// The report an echo sends for a connection/datagram/INIT it received.
pub fn format_report(local: SocketAddr, peer: SocketAddr) -> String {
    format!("{REPORT_PREFIX}{local} {peer}")
}

/// Parses an echo report into (endpoint local address, peer address seen by the endpoint).
pub fn parse_report(s: &str) -> Option<(SocketAddr, SocketAddr)> {
    let mut it = s.trim().strip_prefix(REPORT_PREFIX)?.split_whitespace();
    let local = it.next()?.parse().ok()?;
    let peer = it.next()?.parse().ok()?;
    Some((local, peer))
}

/// One attempt, as printed by `nettest probe` (one JSON object per line).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Attempt {
    /// An echo answered: `local` is the endpoint's own address (after DNAT), `peer` the
    /// client address it saw (after SNAT), `src` the probe's own source address.
    Answered {
        src: SocketAddr,
        local: SocketAddr,
        peer: SocketAddr,
    },
    /// ECONNREFUSED: a TCP RST, an ICMP port unreachable (nftables `reject`), or an SCTP
    /// ABORT without a report (no echo port).
    Refused,
    /// No answer within the per-attempt timeout (dropped).
    Timeout,
    /// Anything else (EHOSTUNREACH, a malformed answer, a bad SCTP checksum, ...).
    Error { error: String },
}

/// A probe: `count` attempts of `proto` to `dst` from one namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    pub proto: Proto,
    pub dst: SocketAddr,
    pub count: usize,
    /// Source address to bind (default: chosen by routing).
    pub src: Option<IpAddr>,
    /// Per-attempt timeout (connect/answer).
    pub timeout: Duration,
    /// How many attempts run at the same time.
    pub parallel: usize,
    /// Source port to bind (TCP and UDP; default: an ephemeral one per attempt). Every attempt
    /// then is the same flow, one after the other: conntrack keeps it on one endpoint.
    pub sport: Option<u16>,
    /// UDP over IPv4 without a checksum (a checksum field of 0, `SO_NO_CHECK`), which the
    /// protocol allows and a rule that rewrites a header must leave alone.
    pub no_udp_checksum: bool,
}

impl Probe {
    /// Defaults: 1 s per attempt, 8 attempts in flight.
    pub fn new(proto: Proto, dst: SocketAddr, count: usize) -> Probe {
        Probe {
            proto,
            dst,
            count,
            src: None,
            timeout: Duration::from_secs(1),
            parallel: 8,
            sport: None,
            no_udp_checksum: false,
        }
    }

    pub fn src(mut self, src: IpAddr) -> Probe {
        self.src = Some(src);
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Probe {
        self.timeout = timeout;
        self
    }

    pub fn parallel(mut self, parallel: usize) -> Probe {
        self.parallel = parallel.max(1);
        self
    }

    /// Sends every attempt from source port `port`, sequentially.
    pub fn sport(mut self, port: u16) -> Probe {
        self.sport = Some(port);
        self.parallel = 1;
        self
    }

    /// Sends UDP datagrams without a checksum (IPv4).
    pub fn no_udp_checksum(mut self) -> Probe {
        self.no_udp_checksum = true;
        self
    }

    /// Arguments for `nettest probe`.
    pub fn args(&self) -> Vec<String> {
        let mut a = vec![
            "probe".to_string(),
            "--proto".into(),
            self.proto.to_string(),
            "--dst".into(),
            self.dst.to_string(),
            "--count".into(),
            self.count.to_string(),
            "--timeout-ms".into(),
            self.timeout.as_millis().to_string(),
            "--parallel".into(),
            self.parallel.to_string(),
        ];
        if let Some(src) = self.src {
            a.extend(["--src".into(), src.to_string()]);
        }
        if let Some(sport) = self.sport {
            a.extend(["--sport".into(), sport.to_string()]);
        }
        if self.no_udp_checksum {
            a.push("--no-udp-checksum".into());
        }
        a
    }
}

/// The attempts of one probe, added up.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProbeResult {
    /// Answers per endpoint (the echo's local address and port, i.e. after DNAT).
    pub answered: BTreeMap<SocketAddr, usize>,
    /// Client addresses the endpoints saw.
    pub peers_seen: BTreeSet<IpAddr>,
    /// The probe's own source addresses.
    pub sources: BTreeSet<IpAddr>,
    /// Answered attempts where the endpoint saw a peer address other than the probe's source.
    pub masqueraded: usize,
    pub refused: usize,
    pub timeouts: usize,
    pub other_errors: Vec<String>,
    /// Wall time of the whole probe, including starting `nettest` in the namespace.
    pub elapsed: Duration,
}

/// What a probe's attempts amount to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every attempt was answered, by these endpoints; `masqueraded` if any endpoint saw
    /// a client address other than the probe's source address.
    Endpoints {
        set: BTreeSet<SocketAddr>,
        masqueraded: bool,
    },
    /// Every attempt was refused.
    Reject,
    /// Every attempt timed out.
    Drop,
    /// Anything else, summarized.
    Mixed(String),
}

impl ProbeResult {
    pub fn from_attempts<'a>(attempts: impl IntoIterator<Item = &'a Attempt>) -> ProbeResult {
        let mut r = ProbeResult::default();
        for a in attempts {
            match a {
                Attempt::Answered { src, local, peer } => {
                    *r.answered.entry(*local).or_default() += 1;
                    r.peers_seen.insert(peer.ip());
                    r.sources.insert(src.ip());
                    if peer.ip() != src.ip() {
                        r.masqueraded += 1;
                    }
                }
                Attempt::Refused => r.refused += 1,
                Attempt::Timeout => r.timeouts += 1,
                Attempt::Error { error } => r.other_errors.push(error.clone()),
            }
        }
        r
    }

    /// Adds another probe's attempts (and time) to these.
    pub fn absorb(&mut self, other: ProbeResult) {
        for (ep, n) in other.answered {
            *self.answered.entry(ep).or_default() += n;
        }
        self.peers_seen.extend(other.peers_seen);
        self.sources.extend(other.sources);
        self.masqueraded += other.masqueraded;
        self.refused += other.refused;
        self.timeouts += other.timeouts;
        self.other_errors.extend(other.other_errors);
        self.elapsed += other.elapsed;
    }

    /// True when every attempt was answered, by some but not all of `want`'s endpoints:
    /// random endpoint choices that more attempts would settle.
    pub fn short_of(&self, want: &Verdict) -> bool {
        let Verdict::Endpoints { set, .. } = want else {
            return false;
        };
        let got = self.endpoints();
        self.total() > 0
            && self.answered_total() == self.total()
            && got != *set
            && got.is_subset(set)
    }

    pub fn answered_total(&self) -> usize {
        self.answered.values().sum()
    }

    pub fn total(&self) -> usize {
        self.answered_total() + self.refused + self.timeouts + self.other_errors.len()
    }

    /// The endpoints that answered.
    pub fn endpoints(&self) -> BTreeSet<SocketAddr> {
        self.answered.keys().copied().collect()
    }

    pub fn verdict(&self) -> Verdict {
        let total = self.total();
        if total > 0 && self.answered_total() == total {
            Verdict::Endpoints {
                set: self.endpoints(),
                masqueraded: self.masqueraded > 0,
            }
        } else if total > 0 && self.refused == total {
            Verdict::Reject
        } else if total > 0 && self.timeouts == total {
            Verdict::Drop
        } else {
            Verdict::Mixed(self.to_string())
        }
    }
}

impl fmt::Display for ProbeResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "answered {{")?;
        for (i, (ep, n)) in self.answered.iter().enumerate() {
            write!(f, "{}{ep}: {n}", if i > 0 { ", " } else { "" })?;
        }
        write!(
            f,
            "}} peers {:?} masqueraded {} refused {} timeouts {}",
            self.peers_seen, self.masqueraded, self.refused, self.timeouts
        )?;
        if !self.other_errors.is_empty() {
            let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
            for e in &self.other_errors {
                *counts.entry(e).or_default() += 1;
            }
            write!(f, " errors {counts:?}")?;
        }
        write!(f, " in {:?}", self.elapsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn report_roundtrip() {
        let (l, p) = (sa("[fd00::2]:80"), sa("10.0.0.1:4000"));
        assert_eq!(parse_report(&format_report(l, p)), Some((l, p)));
        assert_eq!(parse_report("garbage"), None);
    }

    #[test]
    fn attempt_json() {
        let a = Attempt::Answered {
            src: sa("1.1.1.1:1"),
            local: sa("2.2.2.2:2"),
            peer: sa("3.3.3.3:3"),
        };
        let s = serde_json::to_string(&a).unwrap();
        assert_eq!(
            s,
            r#"{"result":"answered","src":"1.1.1.1:1","local":"2.2.2.2:2","peer":"3.3.3.3:3"}"#
        );
        assert_eq!(serde_json::from_str::<Attempt>(&s).unwrap(), a);
        assert_eq!(
            serde_json::to_string(&Attempt::Timeout).unwrap(),
            r#"{"result":"timeout"}"#
        );
    }

    #[test]
    fn short_of_a_subset_until_topped_up() {
        let ans = |local: &str| Attempt::Answered {
            src: sa("1.1.1.1:1"),
            local: sa(local),
            peer: sa("1.1.1.1:1"),
        };
        let want = Verdict::Endpoints {
            set: [sa("2.2.2.2:2"), sa("3.3.3.3:3")].into(),
            masqueraded: false,
        };
        let mut r = ProbeResult::from_attempts(&[ans("2.2.2.2:2"), ans("2.2.2.2:2")]);
        assert!(r.short_of(&want));
        // Not a subset, or not all answered: more attempts would not help.
        assert!(!ProbeResult::from_attempts(&[ans("4.4.4.4:4")]).short_of(&want));
        assert!(!ProbeResult::from_attempts(&[ans("2.2.2.2:2"), Attempt::Timeout]).short_of(&want));
        assert!(!r.short_of(&Verdict::Drop));
        r.absorb(ProbeResult::from_attempts(&[ans("3.3.3.3:3")]));
        assert!(!r.short_of(&want));
        assert_eq!(r.verdict(), want);
        assert_eq!(r.answered_total(), 3);
    }

    #[test]
    fn verdicts() {
        let ans = |peer: &str| Attempt::Answered {
            src: sa("1.1.1.1:1"),
            local: sa("2.2.2.2:2"),
            peer: sa(peer),
        };
        let r = ProbeResult::from_attempts(&[ans("1.1.1.1:1"), ans("1.1.1.1:5")]);
        assert_eq!(
            r.verdict(),
            Verdict::Endpoints {
                set: [sa("2.2.2.2:2")].into(),
                masqueraded: false
            }
        );
        let r = ProbeResult::from_attempts(&[ans("9.9.9.9:1")]);
        assert!(matches!(
            r.verdict(),
            Verdict::Endpoints {
                masqueraded: true,
                ..
            }
        ));
        assert_eq!(
            ProbeResult::from_attempts(&[Attempt::Refused]).verdict(),
            Verdict::Reject
        );
        assert_eq!(
            ProbeResult::from_attempts(&[Attempt::Timeout]).verdict(),
            Verdict::Drop
        );
        assert!(matches!(
            ProbeResult::from_attempts(&[Attempt::Timeout, Attempt::Refused]).verdict(),
            Verdict::Mixed(_)
        ));
        assert!(matches!(
            ProbeResult::from_attempts(&[]).verdict(),
            Verdict::Mixed(_)
        ));
    }
}
