//! kube-proxy's packet-flow tables, run through the builder and the packet tracer.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};

use nftproxy_dataplane::convert;
use nftproxy_dataplane::model::Cluster;
use nftproxy_dataplane::nft::build::{BuildConfig, LocalDetector, build};
use nftproxy_dataplane::nft::ruleset::{Family, Proto};
use nftproxy_dataplane::trace::{Host, Outcome, Packet, trace};

fn fixture() -> Cluster {
    let text = include_str!("../../tests/fixtures/cluster-ip.yaml");
    let (objects, skipped) = nftproxy_dataplane::input::parse_yaml(text).unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    let (cluster, skipped) = convert::cluster(&objects, "test-node", "");
    assert!(skipped.is_empty(), "{skipped:?}");
    cluster
}

fn config() -> BuildConfig {
    BuildConfig {
        node_name: "test-node".into(),
        local_detector: LocalDetector::ClusterCidr(vec![
            "10.0.0.0/8".parse().unwrap(),
            "fd00:10::/32".parse().unwrap(),
        ]),
        ..BuildConfig::default()
    }
}

/// `expected`: "REJECT", "DROP", "" (untouched) or a comma-separated endpoint list.
fn check(cluster: &Cluster, src: &str, proto: Proto, dst: &str, expected: &str, masq: bool) {
    let src: IpAddr = src.parse().unwrap();
    let dst: SocketAddr = dst.parse().unwrap();
    let family = Family::of(&src);
    let table = build(cluster, &config(), family).table;
    let host = Host {
        local_addresses: vec![
            "192.168.0.2".parse().unwrap(),
            "2001:db8::1".parse().unwrap(),
        ],
    };
    let t = trace(
        &table,
        &host,
        &Packet {
            src,
            dst,
            proto,
            iif: None,
        },
    );
    let want: BTreeSet<Outcome> = match expected {
        "REJECT" => [Outcome::Reject].into(),
        "DROP" => [Outcome::Drop].into(),
        "" => [Outcome::Untouched].into(),
        list => list
            .split(", ")
            .map(|a| Outcome::Endpoint {
                addr: a.parse().unwrap(),
                masquerade: masq,
            })
            .collect(),
    };
    assert_eq!(t.outcomes, want, "{src} -> {dst} ({proto})");
}

#[test]
fn cluster_ip_general_ipv4() {
    let c = fixture();
    use Proto::*;
    check(
        &c,
        "10.180.0.2",
        Tcp,
        "172.30.0.41:80",
        "10.180.0.1:80",
        false,
    );
    check(
        &c,
        "10.180.0.1",
        Tcp,
        "172.30.0.41:80",
        "10.180.0.1:80",
        true,
    );
    check(
        &c,
        "10.180.0.2",
        Tcp,
        "172.30.0.42:80",
        "10.180.0.1:80, 10.180.2.1:80",
        false,
    );
    check(
        &c,
        "10.180.0.2",
        Tcp,
        "172.30.0.42:443",
        "10.180.0.1:8443, 10.180.2.1:8443",
        false,
    );
    check(
        &c,
        "10.180.0.2",
        Tcp,
        "172.30.0.42:53",
        "10.180.0.1:5353, 10.180.2.1:5353",
        false,
    );
    check(
        &c,
        "10.180.0.2",
        Udp,
        "172.30.0.42:53",
        "10.180.0.1:53, 10.180.2.1:53",
        false,
    );
    check(
        &c,
        "10.180.0.2",
        Sctp,
        "172.30.0.42:53",
        "10.180.0.1:53, 10.180.2.1:53",
        false,
    );
    check(&c, "10.180.0.2", Udp, "172.30.0.42:80", "REJECT", false);
    check(&c, "10.180.0.2", Tcp, "172.30.0.41:443", "REJECT", false);
    check(&c, "10.180.0.2", Tcp, "172.30.0.50:80", "DROP", false);
    // From outside the cluster CIDR: masqueraded. From the node itself: output hooks, same.
    check(
        &c,
        "203.0.113.2",
        Tcp,
        "172.30.0.41:80",
        "10.180.0.1:80",
        true,
    );
    check(
        &c,
        "192.168.0.2",
        Tcp,
        "172.30.0.41:80",
        "10.180.0.1:80",
        true,
    );
    check(&c, "192.168.0.2", Tcp, "172.30.0.50:80", "DROP", false);
}

#[test]
fn cluster_ip_general_ipv6() {
    let c = fixture();
    use Proto::*;
    let two = |p: u16| format!("[fd00:10:180::1]:{p}, [fd00:10:180::2:1]:{p}");
    check(
        &c,
        "fd00:10:180::2",
        Tcp,
        "[fd00:172:30::41]:80",
        "[fd00:10:180::1]:80",
        false,
    );
    check(
        &c,
        "fd00:10:180::1",
        Tcp,
        "[fd00:172:30::41]:80",
        "[fd00:10:180::1]:80",
        true,
    );
    check(
        &c,
        "fd00:10:180::2",
        Tcp,
        "[fd00:172:30::42]:80",
        &two(80),
        false,
    );
    check(
        &c,
        "fd00:10:180::2",
        Tcp,
        "[fd00:172:30::42]:443",
        &two(8443),
        false,
    );
    check(
        &c,
        "fd00:10:180::2",
        Tcp,
        "[fd00:172:30::42]:53",
        &two(5353),
        false,
    );
    check(
        &c,
        "fd00:10:180::2",
        Udp,
        "[fd00:172:30::42]:53",
        &two(53),
        false,
    );
    check(
        &c,
        "fd00:10:180::2",
        Sctp,
        "[fd00:172:30::42]:53",
        &two(53),
        false,
    );
    check(
        &c,
        "fd00:10:180::2",
        Udp,
        "[fd00:172:30::42]:80",
        "REJECT",
        false,
    );
    check(
        &c,
        "fd00:10:180::2",
        Tcp,
        "[fd00:172:30::41]:443",
        "REJECT",
        false,
    );
    check(
        &c,
        "fd00:10:180::2",
        Tcp,
        "[fd00:172:30::50]:80",
        "DROP",
        false,
    );
}

#[test]
fn dual_stack_and_no_endpoints() {
    let c = fixture();
    use Proto::*;
    check(
        &c,
        "10.180.0.2",
        Tcp,
        "172.30.0.43:80",
        "10.180.0.1:80, 10.180.2.1:80",
        false,
    );
    let both6 = "[fd00:10:180::1]:80, [fd00:10:180::2:1]:80";
    check(
        &c,
        "fd00:10:180::2",
        Tcp,
        "[fd00:172:30::43]:80",
        both6,
        false,
    );
    check(&c, "10.180.0.2", Tcp, "172.30.0.44:80", "REJECT", false);
    check(&c, "203.0.113.2", Tcp, "192.168.99.11:80", "REJECT", false);
    check(&c, "10.180.0.2", Tcp, "192.168.0.2:3001", "REJECT", false);
    check(&c, "203.0.113.2", Tcp, "192.168.0.2:3001", "REJECT", false);
    check(&c, "10.180.0.2", Tcp, "1.2.3.4:80", "REJECT", false);
    check(&c, "203.0.113.2", Tcp, "1.2.3.4:80", "REJECT", false);
    // The node to its own NodePort: output hooks, then (loopback) the input hook, whose
    // NodePort no-endpoint check rejects it, as the kernel does.
    check(&c, "192.168.0.2", Tcp, "192.168.0.2:3001", "REJECT", false);
}
