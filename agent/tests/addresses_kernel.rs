//! This host's addresses from the real kernel over rtnetlink. Needs root: every test creates
//! its own network namespace (`nftp-addr-<pid>-<n>`) with a veth pair, dumps and watches
//! the addresses from a thread inside it, changes them with `ip addr`, and compares with what
//! `ip -j addr` lists. Nothing outside the namespace is touched.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use nftproxy::addresses::{AddressWatch, local_addresses};

mod common;
use common::Netns;

/// A namespace with `lo` up and a veth pair, `d0` holding a few addresses.
fn namespace() -> Netns {
    let ns = Netns::new("addr");
    ns.exec(&[
        "ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1",
    ]);
    ns.exec(&["ip", "link", "set", "d0", "up"]);
    ns.exec(&["ip", "link", "set", "d1", "up"]);
    ns.exec(&["ip", "addr", "add", "192.0.2.7/24", "dev", "d0"]);
    ns.exec(&["ip", "addr", "add", "2001:db8::7/64", "dev", "d0", "nodad"]);
    // Point to point: the local address is ours, the peer's is not.
    ns.exec(&[
        "ip", "addr", "add", "10.9.0.1", "peer", "10.9.0.2", "dev", "d0",
    ]);
    ns
}

/// The local addresses `ip -j addr` lists.
fn listed(ns: &Netns) -> BTreeSet<IpAddr> {
    let v: serde_json::Value = serde_json::from_str(&ns.exec(&["ip", "-j", "addr"])).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
        .filter_map(|a| a["local"].as_str().and_then(|s| s.parse().ok()))
        .collect()
}

fn ips(list: &[&str]) -> BTreeSet<IpAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

#[test]
fn a_dump_lists_every_local_address() {
    nftproxy_tests::require_root!();
    let ns = namespace();
    let dumped: BTreeSet<IpAddr> = ns.run(local_addresses).into_iter().collect();
    assert_eq!(dumped, listed(&ns));
    for want in ips(&["127.0.0.1", "::1", "192.0.2.7", "2001:db8::7", "10.9.0.1"]) {
        assert!(dumped.contains(&want), "{want} missing from {dumped:?}");
    }
    assert!(!dumped.contains(&"10.9.0.2".parse().unwrap()), "{dumped:?}");
}

#[test]
fn the_watch_applies_each_change() {
    nftproxy_tests::require_root!();
    let ns = namespace();
    let name = ns.name.clone();
    let ip = move |args: &[&str]| {
        let st = std::process::Command::new("ip")
            .args(["netns", "exec", &name, "ip", "addr"])
            .args(args)
            .status()
            .unwrap();
        assert!(st.success(), "ip addr {args:?}");
    };
    let seen = ns.run(move || {
        let mut watch = AddressWatch::open().unwrap();
        let mut seen = vec![watch.addresses()];
        let mut step = |args: &[&str]| {
            ip(args);
            let start = Instant::now();
            watch.wait().unwrap();
            assert!(start.elapsed() < Duration::from_secs(5));
            seen.push(watch.addresses());
        };
        step(&["add", "198.51.100.9/32", "dev", "d0"]);
        step(&["del", "192.0.2.7/24", "dev", "d0"]);
        step(&["add", "2001:db8:1::9/128", "dev", "d0", "nodad"]);
        // An interface going down takes its IPv6 addresses with it, in one burst.
        step(&["flush", "dev", "d0", "scope", "global"]);
        seen
    });
    let sets: Vec<BTreeSet<IpAddr>> = seen.into_iter().map(|v| v.into_iter().collect()).collect();
    let has = |i: usize, ip: &str| sets[i].contains(&ip.parse().unwrap());
    assert!(has(0, "192.0.2.7") && !has(0, "198.51.100.9"));
    assert!(has(1, "198.51.100.9") && has(1, "192.0.2.7"));
    assert!(!has(2, "192.0.2.7") && has(2, "198.51.100.9"));
    assert!(has(3, "2001:db8:1::9"));
    assert_eq!(
        sets[4],
        ips(&["127.0.0.1", "::1"])
            .union(&link_local(&sets[4]))
            .copied()
            .collect()
    );
    assert_eq!(sets[4], listed(&ns));
}

/// The IPv6 link-local addresses of `set` (the kernel gives `d0` and `d1` one; `flush scope global`
/// leaves it).
fn link_local(set: &BTreeSet<IpAddr>) -> BTreeSet<IpAddr> {
    set.iter()
        .copied()
        .filter(|ip| matches!(ip, IpAddr::V6(v6) if v6.segments()[0] == 0xfe80))
        .collect()
}
