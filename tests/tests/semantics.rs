//! kube-proxy's packet-flow tables (reference §7.1, §7.3–§7.8) replayed on a real kernel, plus
//! the semantics around them: session affinity, mixed protocols, multiple and named ports,
//! `service-proxy-name`, and every masquerade / detect-local mode.
//!
//! Each test builds the topology of kube-proxy's test harness (§7.0) in network namespaces:
//!
//! ```text
//!   ext (203.0.113.2, 203.0.113.130,        node "test-node"                  pod (10.0.0.2, fd00:10::2)
//!        2600:5200::1) ── upN ── 192.168.0.2 (primary), 192.168.1.2 (alt),  ── vpN ──
//!                                192.168.99.11 (externalIP), 2001:db8::1,       eps (10.180.0.1, 10.180.2.1,
//!   lbsrc (1.2.3.4, 5.6.7.8) ── upM         2001:db8:1::2 (alt)              ── vpN ──  10.0.1.1-5, fd00:10:180::1,
//!                                lo: 10.0.0.1, fd00:10::1 (masquerade)              fd00:10:180::2:1)
//! ```
//!
//! Every endpoint IP lives in one "eps" namespace behind the node (nodeName in the slices is
//! only metadata for local/remote). Node-originated flows run in the node namespace with the
//! table's source address, so they take the output hooks. The node runs an echo of its own on a
//! few ports, so a packet nftproxy leaves alone ("" in kube-proxy's tables) is *seen* to reach
//! the host stack (answered with the original destination) instead of being refused.
//!
//! For every flow three answers must agree: the reference table, the kernel (the real
//! `nftproxy run --once` binary programs the node, `nettest` probes), and the pure packet
//! tracer (`dataplane::trace` over `dataplane::nft::build` for the same files and the node's
//! addresses).
//!
//! Every suite runs in both modes (`name::nftables`, `name::iptables`: `--proxy-mode`). In
//! iptables mode the kernel must show kube-proxy's iptables-mode semantics: a flow whose
//! answer differs says so with [`Flow::iptables`] and names the documented difference (the
//! reference's §1.16); the tracer models the nftables ruleset only and is not consulted. Masquerade: an endpoint saw another source address than the prober used. The
//! node's address towards the pods (what masquerade picks) is 10.0.0.1 / fd00:10::1, like a
//! CNI bridge's address in the node's pod CIDR, so it differs from every probe source, also
//! from the node's own 192.168.0.2 (a masquerade to the prober's own address would only show
//! as a new source port, which an unrelated NAT port clash can also cause).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::Output;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dataplane::nft::build::build;
use dataplane::nft::ruleset::{Family, Proto as NftProto, Table};
use dataplane::trace::{Host, Outcome, Packet, trace};
use nftproxy::config::{KubeProxyConfiguration, Overrides, Settings};
use nftproxy_tests::cluster::{
    Endpoint, Objects, ProxyConfig, Service, Slice, node as node_object, service_cidr,
};
use nftproxy_tests::{Attempt, Lab, Ns, Probe, Proto, ip, sa, target_binary};

const NODE_NAME: &str = "test-node";
const POD: &str = "10.0.0.2";
const POD6: &str = "fd00:10::2";
/// A pod inside the cluster CIDR but outside this node's pod CIDR (10.0.0.0/24), on its own
/// node link, for the detect-local modes.
const POD2: &str = "10.1.0.2";
const EXT: &str = "203.0.113.2";
const EXT_BLOCKED: &str = "203.0.113.130";
const EXT6: &str = "2600:5200::1";
const NODE_IP: &str = "192.168.0.2";
const NODE_ALT: &str = "192.168.1.2";
const NODE_EXTERNAL_IP: &str = "192.168.99.11";
const NODE_IP6: &str = "2001:db8::1";
const NODE_ALT6: &str = "2001:db8:1::2";
/// The node's address towards its pods, which masquerade uses.
const MASQ_IP: &str = "10.0.0.1";
const MASQ_IP6: &str = "fd00:10::1";
const LB1: &str = "1.2.3.4";
const LB2: &str = "5.6.7.8";
const LB6: &str = "2001:db8:ff::4";
const ENDPOINT_IPS: &[&str] = &[
    "10.180.0.1",
    "10.180.0.2",
    "10.180.0.3",
    "10.180.1.1",
    "10.180.1.2",
    "10.180.1.3",
    "10.180.2.1",
    "10.0.1.1",
    "10.0.1.2",
    "10.0.1.3",
    "10.0.1.4",
    "10.0.1.5",
    "fd00:10:180::1",
    "fd00:10:180::2:1",
];
const ENDPOINT_PORTS: &[u16] = &[80, 53, 5353, 8080, 8443];
/// Ports the node itself answers on ("" flows: the packet reaches the host stack unchanged).
const NODE_PORTS: &[u16] = &[80, 3001, 3080];

const DROP_TIMEOUT: Duration = Duration::from_millis(400);
/// Flows expected to be answered (or refused) take milliseconds; the generous timeout lets TCP
/// retransmit a SYN (after 1 s) that a busy host dropped.
const ANSWER_TIMEOUT: Duration = Duration::from_millis(3000);

// ------------------------------------------------------------------------------------------
// The two modes.

/// The backend `nftproxy run --proxy-mode` programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Nftables,
    Iptables,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Nftables => "nftables",
            Mode::Iptables => "iptables",
        }
    }
}

/// Runs each suite in both modes, as `suite::nftables` and `suite::iptables`.
macro_rules! in_both_modes {
    ($($suite:ident),* $(,)?) => {$(
        mod $suite {
            #[test]
            fn nftables() {
                nftproxy_tests::require_root!();
                super::$suite(super::Mode::Nftables)
            }
            #[test]
            fn iptables() {
                nftproxy_tests::require_root!();
                super::$suite(super::Mode::Iptables)
            }
        }
    )*};
}

// Where kube-proxy's iptables mode differs from its nftables mode (reference §1.16); the only
// reasons a flow may expect something else in iptables mode.

/// iptables mode does not reject packets to a port a ClusterIP does not serve: they are
/// routed on like any packet (here: out of the node's uplink, unanswered).
const NO_WRONG_PORT_REJECT: &str = "no reject for ports a ClusterIP does not serve";
/// iptables mode does not drop packets to unallocated addresses of the ServiceCIDRs.
const NO_UNALLOCATED_DROP: &str = "no drop for unallocated ClusterIPs";
/// iptables mode serves NodePorts on every local address when `nodePortAddresses` is unset
/// (nftables mode: the Node's primary addresses).
const NODE_PORTS_ON_ALL_ADDRESSES: &str = "NodePorts on every local address by default";
/// iptables mode serves IPv4 NodePorts on 127.0.0.1 (`localhostNodePorts`, route_localnet).
const LOCALHOST_NODE_PORTS: &str = "NodePorts on 127.0.0.1";
/// Found by this suite, faithful to kube-proxy: iptables mode rejects (or drops) traffic to
/// external and load-balancer IPs without (local) endpoints in `KUBE-EXTERNAL-SERVICES`, which
/// only INPUT and FORWARD jump to: the node's own traffic to a load-balancer IP (not a local
/// address) is not rejected but routed on (here: unanswered).
const NO_LB_REJECT_FROM_HOST: &str = "no reject of the node's own traffic to a load-balancer IP";

// ------------------------------------------------------------------------------------------
// Objects shared by the tables.

fn base_objects() -> Objects {
    Objects::new()
        .with(node_object(
            NODE_NAME,
            &[NODE_IP, NODE_IP6],
            &["10.0.0.0/24", "fd00:10::/64"],
        ))
        .with(service_cidr(
            "kubernetes",
            &["172.30.0.0/16", "fd00:10:96::/112"],
        ))
}

/// kube-proxy's harness configuration, with our default `nodePortAddresses` (primary).
fn base_config() -> ProxyConfig {
    ProxyConfig::new(NODE_NAME).cluster_cidr("10.0.0.0/8,fd00:10::/64")
}

fn ep(ip: &str) -> Endpoint {
    Endpoint::new(ip)
}

/// An endpoint written as in the reference: `(ready, serving, terminating)` and a node.
fn ep_rst(ip: &str, r: bool, s: bool, t: bool, node: &str) -> Endpoint {
    Endpoint::new(ip).conditions(r, s, t).node(node)
}

#[path = "semantics/features.rs"]
mod features;
#[path = "semantics/flow.rs"]
mod flow;
#[path = "semantics/tables.rs"]
mod tables;
#[path = "semantics/world.rs"]
mod world;

use self::features::*;
use self::flow::*;
use self::tables::*;
use self::world::*;

in_both_modes!(
    hairpin,
    no_endpoints_reject,
    load_balancer,
    node_ports_ipv4,
    node_ports_ipv6,
    external_traffic_policy_local,
    external_traffic_policy_cluster,
    internal_traffic_policy,
    terminating_endpoints_external_policy_local,
    terminating_endpoints_external_policy_cluster,
    session_affinity,
    mixed_protocol_load_balancer,
    multiple_ports_and_named_target_port,
    services_of_another_proxy_are_not_programmed,
    internal_external_masquerade,
    masquerade_and_detect_local_modes,
);
