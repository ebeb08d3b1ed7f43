//! Network-namespace test harness for nftproxy's end-to-end traffic tests.
//!
//! A [`Lab`] creates namespaces (a node, pods behind it, external hosts on uplinks) wired
//! with veth pairs that never touch the root namespace, runs the `nettest` echo server and
//! prober inside them, and deletes everything on drop. See `tests/harness.rs` for more.
//!
//! ```no_run
//! use nftproxy_tests::{Lab, Probe, Proto, Verdict, ip, sa};
//! # fn main() -> anyhow::Result<()> {
//! // In an integration test: Lab::with_nettest(env!("CARGO_BIN_EXE_nettest"))
//! let lab = Lab::new()?;
//! let node = lab.node("node")?;
//! let pod = lab.pod(&node, "pod-a", &[ip("10.180.0.2"), ip("fd00:10:180::2")])?;
//! let client = lab.external(&node, "client", &[ip("203.0.113.2")], &[ip("192.0.2.1")])?;
//! lab.echo(&pod, &[80, 53])?;
//! node.nft(
//!     "table ip t {
//!         chain nat { type nat hook prerouting priority dstnat; ip daddr 172.30.0.41 dnat to 10.180.0.2; }
//!         chain filter { type filter hook prerouting priority 0; ip daddr 172.30.0.42 drop; }
//!     }",
//! )?;
//! let r = lab.probe(&client, Proto::Tcp, sa("172.30.0.41:80"), 30)?;
//! assert_eq!(r.verdict(), Verdict::Endpoints {
//!     set: [sa("10.180.0.2:80")].into(),
//!     masqueraded: false,
//! });
//! let dropped = Probe::new(Proto::Udp, sa("172.30.0.42:53"), 3)
//!     .timeout(std::time::Duration::from_millis(300));
//! assert_eq!(lab.run_probe(&client, &dropped)?.verdict(), Verdict::Drop);
//! # Ok(()) }
//! ```

pub mod cluster;
pub mod connect_loop;
pub mod lab;
pub mod pod;
pub mod privilege;
pub mod probe;
pub mod sctp;
pub mod sock;

pub use lab::{
    Echo, Lab, NS_PREFIX, Ns, POD_GATEWAY_V4, POD_GATEWAY_V6, Proc, list_namespaces, target_binary,
};
pub use probe::{Attempt, Probe, ProbeResult, Proto, Verdict};

/// Parses an IP address literal; panics on a typo (for test tables).
pub fn ip(s: &str) -> std::net::IpAddr {
    s.parse().unwrap_or_else(|_| panic!("bad IP address {s:?}"))
}

/// Parses a socket address literal (`1.2.3.4:80`, `[fd00::1]:80`); panics on a typo.
pub fn sa(s: &str) -> std::net::SocketAddr {
    s.parse()
        .unwrap_or_else(|_| panic!("bad socket address {s:?}"))
}

/// The number in field `field=` of the first log line holding `message` for each family, IPv4
/// first: the families of a full sync run at once, so their lines come in either order. A
/// family without such a line is left out.
pub fn per_family_field(log: &str, message: &str, field: &str) -> Vec<usize> {
    ["IPv4", "IPv6"]
        .iter()
        .filter_map(|family| {
            let family = format!("family=\"{family}\"");
            let line = log
                .lines()
                .find(|l| l.contains(message) && l.contains(&family))?;
            let value = line.split(&format!("{field}=")).nth(1)?;
            value.split_whitespace().next()?.parse().ok()
        })
        .collect()
}

pub mod apiserver;
pub use apiserver::{ApiServer, RequestLog};
