//! The conntrack backend against the real kernel. Needs root and the `conntrack` tool: every test
//! creates its own network namespace (`ip netns add nftp-ct-<pid>-<n>`), creates entries there
//! (with `conntrack -I`, or with real UDP traffic over loopback), lists and deletes them through
//! [`Conntrack`] opened inside it, checks the result with `conntrack -L`, and deletes the
//! namespace when done, even on panic. The root namespace's table is never touched.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::Instant;

use dataplane::conntrack::Tuple;
use dataplane::nft::ruleset::Family;
use nftproxy::conntrack::{Conntrack, Flow};

mod common;
use common::Netns;

const UDP: u8 = 17;
const TCP: u8 = 6;

/// The conntrack-specific helpers on the shared namespace.
trait ConntrackNs {
    fn open(&self) -> Conntrack;
    fn insert(&self, proto: u8, orig: (&str, u16, &str, u16), reply_src: (&str, u16), zone: u16);
    fn listed(&self) -> BTreeSet<Entry>;
}

impl ConntrackNs for Netns {
    /// Opens the backend inside the namespace; the socket stays in it.
    fn open(&self) -> Conntrack {
        self.run(|| Conntrack::open().expect("open ctnetlink socket"))
    }

    /// `conntrack -I` of a UDP or TCP entry from `orig` to `reply` (reply source = the
    /// endpoint), in `zone`.
    fn insert(&self, proto: u8, orig: (&str, u16, &str, u16), reply_src: (&str, u16), zone: u16) {
        let (src, sport, dst, dport) = orig;
        let p = if proto == TCP { "tcp" } else { "udp" };
        let (sport, dport) = (sport.to_string(), dport.to_string());
        let (rport, zone) = (reply_src.1.to_string(), zone.to_string());
        let mut argv = vec![
            "conntrack",
            "-I",
            "-p",
            p,
            "-s",
            src,
            "-d",
            dst,
            "--sport",
            &sport,
            "--dport",
            &dport,
            "-r",
            reply_src.0,
            "-q",
            src,
            "--reply-port-src",
            &rport,
            "--reply-port-dst",
            &sport,
            "-t",
            "300",
            "-w",
            &zone,
        ];
        if proto == TCP {
            argv.extend(["--state", "ESTABLISHED", "-u", "SEEN_REPLY,ASSURED"]);
        } else {
            argv.extend(["-u", "SEEN_REPLY"]);
        }
        self.exec(&argv);
    }

    /// The table as `conntrack -L` prints it, reduced to (proto, orig src, orig sport,
    /// orig dst, orig dport, reply src, zone).
    fn listed(&self) -> BTreeSet<Entry> {
        let mut out = BTreeSet::new();
        for family in ["ipv4", "ipv6"] {
            let text = self.exec(&["conntrack", "-L", "-f", family]);
            for line in text.lines() {
                out.insert(parse_line(line));
            }
        }
        out
    }
}

/// (proto, orig src, orig sport, orig dst, orig dport, reply src, zone)
type Entry = (u8, IpAddr, u16, IpAddr, u16, IpAddr, u16);

fn parse_line(line: &str) -> Entry {
    let field = |key: &str, nth: usize| -> &str {
        line.split_whitespace()
            .filter_map(|w| w.strip_prefix(key))
            .nth(nth)
            .unwrap_or_else(|| panic!("no {key} #{nth} in {line:?}"))
    };
    let proto: u8 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    let zone = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("zone="))
        .map_or(0, |z| z.parse().unwrap());
    (
        proto,
        field("src=", 0).parse().unwrap(),
        field("sport=", 0).parse().unwrap(),
        field("dst=", 0).parse().unwrap(),
        field("dport=", 0).parse().unwrap(),
        field("src=", 1).parse().unwrap(),
        zone,
    )
}

fn entry_of(f: &Flow) -> Entry {
    (
        f.orig.proto,
        f.orig.src,
        f.orig.src_port,
        f.orig.dst,
        f.orig.dst_port,
        f.reply.src,
        f.zone,
    )
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// The fixture: UDP entries of a ClusterIP load-balanced over two endpoints (one in conntrack
/// zone 7), TCP entries to the same frontend, IPv6 UDP entries.
fn populate(ns: &Netns) {
    for (i, ep) in ["10.0.0.1", "10.0.0.2"].iter().cycle().take(6).enumerate() {
        ns.insert(
            UDP,
            ("10.0.5.5", 40000 + i as u16, "172.30.0.10", 53),
            (ep, 5353),
            0,
        );
    }
    ns.insert(
        UDP,
        ("10.0.5.6", 40000, "172.30.0.10", 53),
        ("10.0.0.2", 5353),
        7,
    );
    for (i, ep) in ["10.0.0.1", "10.0.0.2"].iter().enumerate() {
        ns.insert(
            TCP,
            ("10.0.5.5", 41000 + i as u16, "172.30.0.10", 53),
            (ep, 5353),
            0,
        );
    }
    for (i, ep) in ["fd00:10::1", "fd00:10::2"].iter().enumerate() {
        ns.insert(
            UDP,
            ("fd00:10::5", 40000 + i as u16, "fd00:172:30::10", 53),
            (ep, 5353),
            0,
        );
    }
}

#[test]
fn lists_and_deletes_exactly_the_chosen_udp_entries() {
    nftproxy_tests::require_root!();
    let ns = Netns::new("ct");
    populate(&ns);
    let before = ns.listed();
    assert_eq!(before.len(), 11, "{before:#?}");
    let mut ct = ns.open();

    let v4 = ct.list_udp(Family::V4).unwrap();
    let v6 = ct.list_udp(Family::V6).unwrap();
    assert_eq!(v4.len(), 7, "{v4:#?}");
    assert_eq!(v6.len(), 2, "{v6:#?}");
    assert!(ct.kernel_filters(), "the kernel rejected the dump filter");
    // Decoded like conntrack(8) prints them, ids included.
    let udp_listed: BTreeSet<Entry> = before.iter().filter(|e| e.0 == UDP).copied().collect();
    let udp_ours: BTreeSet<Entry> = v4.iter().chain(&v6).map(entry_of).collect();
    assert_eq!(udp_ours, udp_listed);
    assert!(v4.iter().chain(&v6).all(|f| f.id.is_some()));
    for f in v4.iter().chain(&v6) {
        assert_eq!(f.reply.dst, f.orig.src);
        assert_eq!(f.reply.dst_port, f.orig.src_port);
        assert_eq!(f.reply.src_port, 5353);
        assert_eq!(f.reply.proto, UDP);
    }
    let all_v4 = ct.list(Family::V4, None).unwrap();
    assert_eq!(all_v4.len(), 9, "TCP too: {all_v4:#?}");
    assert_eq!(all_v4.iter().filter(|f| f.orig.proto == TCP).count(), 2);

    // Delete the UDP entries to the second endpoints, in both families, in one call.
    let gone_eps = [ip("10.0.0.2"), ip("fd00:10::2")];
    let chosen: Vec<Flow> = v4
        .iter()
        .chain(&v6)
        .filter(|f| gone_eps.contains(&f.reply.src))
        .copied()
        .collect();
    assert_eq!(chosen.len(), 5);
    assert!(chosen.iter().any(|f| f.zone == 7));
    assert_eq!(ct.delete(&chosen).unwrap(), 5);

    let after = ns.listed();
    let want: BTreeSet<Entry> = before
        .iter()
        .filter(|e| !(e.0 == UDP && gone_eps.contains(&e.5)))
        .copied()
        .collect();
    assert_eq!(after, want);
    // TCP entries to the same endpoint stay.
    assert!(after.iter().any(|e| e.0 == TCP && e.5 == ip("10.0.0.2")));
    // Deleting again: the entries are gone, which is not an error.
    assert_eq!(ct.delete(&chosen).unwrap(), 0);
    assert_eq!(ct.delete(&[]).unwrap(), 0);
    assert_eq!(ns.listed(), want);
}

#[test]
fn an_entry_replaced_since_listing_is_left_alone() {
    nftproxy_tests::require_root!();
    let ns = Netns::new("ct");
    ns.insert(
        UDP,
        ("10.0.5.5", 40000, "172.30.0.10", 53),
        ("10.0.0.1", 5353),
        0,
    );
    let mut ct = ns.open();
    let flows = ct.list_udp(Family::V4).unwrap();
    assert_eq!(flows.len(), 1);
    let listed = flows[0];
    // Same tuple, another entry (the kernel compares the id it reported).
    let other = Flow {
        id: listed.id.map(|id| id.wrapping_add(1)),
        ..listed
    };
    assert_eq!(ct.delete(&[other]).unwrap(), 0);
    assert_eq!(ns.listed().len(), 1);
    assert_eq!(ct.delete(&[listed]).unwrap(), 1);
    assert!(ns.listed().is_empty());
}

#[test]
fn udp_cleanup_of_stale_frontend_entries() {
    nftproxy_tests::require_root!();
    use dataplane::conntrack::Frontends;
    let ns = Netns::new("ct");
    populate(&ns);
    let before = ns.listed();
    let mut ct = ns.open();
    // 10.0.0.2 stopped serving; the frontend stays.
    let mut current = Frontends::default();
    current.addrs.insert(
        (ip("172.30.0.10"), 53),
        std::sync::Arc::new([ip("10.0.0.1")].into()),
    );
    let stats = ct.clean_stale_udp(Family::V4, &current, &current).unwrap();
    assert_eq!((stats.listed, stats.stale, stats.deleted), (7, 4, 4));
    let want: BTreeSet<Entry> = before
        .iter()
        .filter(|e| !(e.0 == UDP && e.5 == ip("10.0.0.2")))
        .copied()
        .collect();
    assert_eq!(ns.listed(), want);
}

/// Many entries from real traffic over loopback: listing and batched deletion at scale.
#[test]
fn thousands_of_entries_are_listed_and_deleted_in_batches() {
    nftproxy_tests::require_root!();
    const N: usize = 20_000;
    // UNREPLIED UDP entries expire after 30 s: everything below takes far less.
    let ns = Netns::new("ct");
    // Connection tracking runs in a namespace only once something there needs it.
    ns.exec(&[
        "nft",
        "add table ip t; add chain ip t out { type filter hook output priority 0; }; add rule ip t out ct state new counter",
    ]);
    let sent = ns.run(|| {
        let server = UdpSocket::bind("127.0.0.1:5000").unwrap();
        let dst = server.local_addr().unwrap();
        // Distinct source ports, so that every datagram is a flow of its own.
        for port in 20_000..20_000 + N as u16 {
            let s = UdpSocket::bind(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port)).unwrap();
            s.send_to(b"x", dst).unwrap();
        }
        N
    });
    let count = || -> usize {
        ns.exec(&["cat", "/proc/sys/net/netfilter/nf_conntrack_count"])
            .trim()
            .parse()
            .unwrap()
    };
    assert!(count() >= sent, "{} entries", count());
    let mut ct = ns.open();

    let t = Instant::now();
    let flows = ct.list_udp(Family::V4).unwrap();
    let listed_in = t.elapsed();
    let ours: Vec<Flow> = flows
        .into_iter()
        .filter(|f| f.orig.dst_port == 5000)
        .collect();
    assert_eq!(ours.len(), N);
    assert!(ours.iter().all(|f| f.orig
        == Tuple {
            proto: UDP,
            src: ip("127.0.0.1"),
            dst: ip("127.0.0.1"),
            src_port: f.orig.src_port,
            dst_port: 5000,
        }));

    let t = Instant::now();
    let deleted = ct.delete(&ours).unwrap();
    let deleted_in = t.elapsed();
    assert_eq!(deleted, N);
    assert_eq!(ct.list_udp(Family::V4).unwrap().len(), 0);
    eprintln!("{N} UDP entries: listed in {listed_in:?}, deleted in {deleted_in:?}");
}

/// Cluster `ns/dns` (ClusterIP 172.30.0.10, UDP 53) with the serving endpoints `eps`.
fn dns_cluster(eps: &[&str]) -> dataplane::model::Cluster {
    let endpoints: String = eps
        .iter()
        .map(|a| format!("  - {{addresses: [\"{a}\"]}}\n"))
        .collect();
    let yaml = format!(
        r#"apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {{name: dns, namespace: ns}}
  spec:
    clusterIP: 172.30.0.10
    clusterIPs: [172.30.0.10]
    ipFamilies: [IPv4]
    ports:
    - {{name: dns, port: 53, protocol: UDP}}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {{name: dns-a, namespace: ns, labels: {{kubernetes.io/service-name: dns}}}}
  addressType: IPv4
  ports:
  - {{name: dns, port: 5353, protocol: UDP}}
  endpoints:
{endpoints}"#
    );
    let (cluster, skipped) = nftproxy::source::load_text(&yaml, "node-a", "").unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    cluster
}

/// The agent's bookkeeping: a sync that only adds serving endpoints to a UDP frontend that had
/// some lists nothing; one that removes an endpoint, and the first after a failed sync, clean.
/// An entry to an endpoint that never served (which the rules would never make) shows whether
/// a cleanup ran: any would delete it.
#[test]
fn udp_cleanup_is_skipped_after_pure_endpoint_additions() {
    nftproxy_tests::require_root!();
    use dataplane::conntrack::Frontends;
    use dataplane::model::ObjectName;
    use nftproxy::proxier::ChangedServices;
    use nftproxy::proxier::udp::UdpCleanup;

    let ns = Netns::new("ct");
    let mut udp = UdpCleanup::new(Family::V4, Some(ns.open()));
    let dns = BTreeSet::from([ObjectName::new("ns", "dns")]);
    let changed = ChangedServices::Services(&dns);
    let serving = (
        UDP,
        ("10.0.5.5", 40000, "172.30.0.10", 53),
        ("10.0.0.1", 5353),
    );
    let marker = (
        UDP,
        ("10.0.5.5", 40001, "172.30.0.10", 53),
        ("10.0.0.9", 5353),
    );
    let insert = |(proto, orig, reply)| ns.insert(proto, orig, reply, 0);

    udp.synced(
        &dns_cluster(&["10.0.0.1"]),
        ChangedServices::All,
        Some(Frontends::default()),
    );
    insert(serving);
    let kept = ns.listed();
    insert(marker);
    let both = ns.listed();
    assert_eq!(both.len(), 2, "{both:?}");

    udp.synced(&dns_cluster(&["10.0.0.1", "10.0.0.2"]), changed, None);
    assert_eq!(ns.listed(), both, "endpoint added: no cleanup");

    // A failed sync may have committed part of its rules: the next cleans, additions or not.
    udp.forget_index();
    let three = ["10.0.0.1", "10.0.0.2", "10.0.0.3"];
    udp.synced(&dns_cluster(&three), ChangedServices::All, None);
    assert_eq!(ns.listed(), kept, "first sync after a failed one");

    insert(marker);
    udp.synced(&dns_cluster(&three[..2]), changed, None);
    assert_eq!(ns.listed(), kept, "endpoint removed");
}
