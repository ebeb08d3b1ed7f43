//! Self-tests of the namespace harness, without nftproxy: plain routing, hand-written nft
//! rules in the node namespace, and cleanup. Needs root.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::Result;
use nftproxy_tests::{Echo, Lab, Ns, Probe, Proto, Verdict, ip, list_namespaces, sa};

const A4: &str = "10.180.0.2";
const A6: &str = "fd00:10:180::2";
const B4: &str = "10.180.0.3";
const B6: &str = "fd00:10:180::3";
const CLIENT4: &str = "203.0.113.2";
const CLIENT6: &str = "2001:db8:2::2";
const NODE4: &str = "192.0.2.1";
const NODE6: &str = "2001:db8:1::1";

struct World {
    lab: Lab,
    node: Ns,
    a: Ns,
    b: Ns,
    client: Ns,
    echo: Echo,
}

fn world() -> Result<World> {
    assert!(
        nftproxy_tests::privilege::is_root(),
        "the namespace tests need root"
    );
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest"))?;
    let node = lab.node("node")?;
    let a = lab.pod(&node, "pod-a", &[ip(A4), ip(A6)])?;
    let b = lab.pod(&node, "pod-b", &[ip(B4), ip(B6)])?;
    let client = lab.external(
        &node,
        "client",
        &[ip(CLIENT4), ip(CLIENT6)],
        &[ip(NODE4), ip(NODE6)],
    )?;
    let echo = lab.echo(&b, &[80, 8443, 53])?;
    Ok(World {
        lab,
        node,
        a,
        b,
        client,
        echo,
    })
}

fn at(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(nftproxy_tests::ip(ip), port)
}

fn endpoints(set: &[SocketAddr], masqueraded: bool) -> Verdict {
    Verdict::Endpoints {
        set: set.iter().copied().collect(),
        masqueraded,
    }
}

#[test]
fn node_is_a_router() -> Result<()> {
    nftproxy_tests::require_root!(Ok(()));
    let w = world()?;
    assert_eq!(w.node.sysctl_get("net.ipv4.ip_forward")?, "1");
    assert_eq!(w.node.sysctl_get("net.ipv6.conf.all.forwarding")?, "1");
    assert_eq!(w.node.sysctl_get("net.ipv4.conf.all.rp_filter")?, "0");
    assert_eq!(w.a.sysctl_get("net.ipv4.ip_forward")?, "0");
    let routes = w.node.ip(&["route", "show"])?;
    assert!(
        routes.contains(&format!("{A4} dev {}", w.a.node_link().unwrap())),
        "{routes}"
    );
    assert!(w.node.exec(&["nft", "list", "ruleset"])?.trim().is_empty());
    assert_eq!(w.b.ips(), &[ip(B4), ip(B6)]);
    Ok(())
}

#[test]
fn pod_to_pod_is_answered_unmasqueraded() -> Result<()> {
    nftproxy_tests::require_root!(Ok(()));
    let w = world()?;
    for proto in Proto::ALL {
        for (dst, src) in [(B4, A4), (B6, A6)] {
            let r = w.lab.probe(&w.a, proto, at(dst, 80), 20)?;
            assert_eq!(
                r.verdict(),
                endpoints(&[at(dst, 80)], false),
                "{proto} to {dst}: {r}"
            );
            assert_eq!(r.peers_seen, BTreeSet::from([ip(src)]), "{proto}: {r}");
            assert_eq!(r.answered_total(), 20);
        }
    }
    // The external client reaches pods through the node, unNATed, too.
    let r = w.lab.probe(&w.client, Proto::Udp, at(B6, 53), 5)?;
    assert_eq!(r.verdict(), endpoints(&[at(B6, 53)], false), "{r}");
    assert_eq!(r.peers_seen, BTreeSet::from([ip(CLIENT6)]));
    // The echo logged what it answered.
    assert!(
        w.echo
            .events()
            .iter()
            .any(|e| e.contains(r#""event":"sctp""#))
    );
    Ok(())
}

#[test]
fn explicit_source_address() -> Result<()> {
    nftproxy_tests::require_root!(Ok(()));
    let w = world()?;
    // A second address on the client, used as the source on request.
    w.client.add_addr("eth0", ip("203.0.113.9"), 32)?;
    w.node.add_route(&format!(
        "203.0.113.9/32 dev {}",
        w.client.node_link().unwrap()
    ))?;
    for proto in Proto::ALL {
        let r = w.lab.run_probe(
            &w.client,
            &Probe::new(proto, at(B4, 8443), 5).src(ip("203.0.113.9")),
        )?;
        assert_eq!(
            r.verdict(),
            endpoints(&[at(B4, 8443)], false),
            "{proto}: {r}"
        );
        assert_eq!(
            r.peers_seen,
            BTreeSet::from([ip("203.0.113.9")]),
            "{proto}: {r}"
        );
    }
    Ok(())
}

#[test]
fn no_listener_is_refused() -> Result<()> {
    nftproxy_tests::require_root!(Ok(()));
    let w = world()?;
    for proto in Proto::ALL {
        for dst in [B4, B6] {
            let r = w.lab.probe(&w.a, proto, at(dst, 9999), 5)?;
            assert_eq!(r.verdict(), Verdict::Reject, "{proto} to {dst}: {r}");
        }
    }
    Ok(())
}

#[test]
fn nft_drop_is_a_timeout_and_reject_is_refused() -> Result<()> {
    nftproxy_tests::require_root!(Ok(()));
    let w = world()?;
    // Filtering happens in prerouting: without a route, forwarding would answer with an
    // ICMP "network unreachable" before any forward chain sees the packet.
    w.node.nft(
        "table inet t {
            chain pre {
                type filter hook prerouting priority 0;
                ip daddr 10.99.0.0/16 drop
                ip6 daddr fd00:99::/64 drop
                ip daddr 10.98.0.1 reject
                ip6 daddr fd00:98::1 reject
            }
        }",
    )?;
    for proto in Proto::ALL {
        for dst in ["10.99.0.1", "fd00:99::1"] {
            let probe = Probe::new(proto, at(dst, 80), 6).timeout(Duration::from_millis(300));
            let r = w.lab.run_probe(&w.a, &probe)?;
            assert_eq!(r.verdict(), Verdict::Drop, "{proto} to {dst}: {r}");
            assert!(r.elapsed < Duration::from_secs(2), "{r}");
        }
        for dst in ["10.98.0.1", "fd00:98::1"] {
            let r = w.lab.probe(&w.client, proto, at(dst, 80), 5)?;
            assert_eq!(r.verdict(), Verdict::Reject, "{proto} to {dst}: {r}");
        }
    }
    Ok(())
}

/// A destination the node has no route for is an ICMP "unreachable", an error: not a drop.
///
/// Caveat: IPv4 routing errors are rate limited per source by `net.ipv4.route.error_cost`
/// / `error_burst` (5 at once, then 1 per second), which exist only in the root namespace,
/// so they stay at their defaults: more attempts would turn into timeouts.
#[test]
fn unrouted_is_an_error_not_a_drop() -> Result<()> {
    nftproxy_tests::require_root!(Ok(()));
    let w = world()?;
    for proto in Proto::ALL {
        for dst in ["10.97.0.1", "fd00:97::1"] {
            let r = w.lab.probe(&w.a, proto, at(dst, 80), 1)?;
            assert!(
                matches!(r.verdict(), Verdict::Mixed(_)),
                "{proto} to {dst}: {r}"
            );
            assert_eq!(r.other_errors.len(), 1, "{r}");
            assert!(r.other_errors[0].contains("ENETUNREACH"), "{r}");
        }
    }
    Ok(())
}

/// DNAT for all three protocols (SCTP goes through conntrack/NAT as raw packets).
#[test]
fn dnat_from_pod_and_masquerade_from_outside() -> Result<()> {
    nftproxy_tests::require_root!(Ok(()));
    let w = world()?;
    let to_b = w.b.node_link().unwrap();
    w.node.nft(&format!(
        "table inet nat {{
            chain pre {{
                type nat hook prerouting priority dstnat;
                ip daddr 10.96.0.10 meta l4proto {{ tcp, udp, sctp }} th dport 7777 dnat ip to {B4}:80
                ip6 daddr fd00:96::10 meta l4proto {{ tcp, udp, sctp }} th dport 7777 dnat ip6 to [{B6}]:80
            }}
            chain post {{
                type nat hook postrouting priority srcnat;
                iifname \"up*\" oifname \"{to_b}\" masquerade
            }}
        }}"
    ))?;
    for proto in Proto::ALL {
        for (vip, endpoint, pod_src, node_ip) in [
            ("10.96.0.10", B4, A4, NODE4),
            ("fd00:96::10", B6, A6, NODE6),
        ] {
            let r = w.lab.probe(&w.a, proto, at(vip, 7777), 10)?;
            assert_eq!(
                r.verdict(),
                endpoints(&[at(endpoint, 80)], false),
                "{proto} via {vip}: {r}"
            );
            assert_eq!(r.peers_seen, BTreeSet::from([ip(pod_src)]), "{proto}: {r}");

            let r = w.lab.probe(&w.client, proto, at(vip, 7777), 10)?;
            assert_eq!(
                r.verdict(),
                endpoints(&[at(endpoint, 80)], true),
                "{proto} via {vip}: {r}"
            );
            assert_eq!(r.masqueraded, 10);
            // Masquerade picks the node's IP, as on a real node (the pod gateway address on
            // the veth is link-scoped, so it is never chosen).
            assert_eq!(r.peers_seen, BTreeSet::from([ip(node_ip)]), "{proto}: {r}");
        }
    }
    let conntrack = w.node.exec(&["conntrack", "-L", "-p", "sctp"])?;
    assert!(conntrack.contains("dport=7777"), "{conntrack}");
    Ok(())
}

/// Many attempts are fast, and random load balancing shows up in the per-endpoint counts.
#[test]
fn many_connections_spread_over_endpoints() -> Result<()> {
    nftproxy_tests::require_root!(Ok(()));
    let w = world()?;
    w.node.nft(&format!(
        "table ip nat {{
            chain pre {{
                type nat hook prerouting priority dstnat;
                ip daddr 10.96.0.20 tcp dport 80 dnat to numgen random mod 2 map {{ 0 : {B4} . 80, 1 : {B4} . 8443 }}
            }}
        }}"
    ))?;
    let r = w.lab.run_probe(
        &w.a,
        &Probe::new(Proto::Tcp, sa("10.96.0.20:80"), 300).parallel(8),
    )?;
    eprintln!("300 TCP connections: {r}");
    assert_eq!(
        r.endpoints(),
        BTreeSet::from([at(B4, 80), at(B4, 8443)]),
        "{r}"
    );
    assert_eq!(r.answered_total(), 300);
    assert!(r.answered.values().all(|&n| n > 90), "{r}");
    assert!(r.elapsed < Duration::from_secs(5), "{r}");
    Ok(())
}

#[test]
fn spawn_run_and_stop() -> Result<()> {
    nftproxy_tests::require_root!(Ok(()));
    let w = world()?;
    let out = w
        .node
        .run(&["sh", "-c", "echo out; echo err >&2; exit 3"])?;
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    assert!(w.node.exec(&["false"]).is_err());

    let mut cmd = w.node.command("sh");
    cmd.args(["-c", "echo \"hello $GREETING\"; exec sleep 1000"])
        .env("GREETING", "node");
    let mut p = w.node.spawn_command(cmd, "greeter")?;
    p.wait_stdout(|l| l == "hello node", Duration::from_secs(5))?;
    assert!(w.node.pids()?.contains(&p.pid()));
    assert!(p.try_wait()?.is_none());
    p.terminate(Duration::from_secs(2))?;
    assert!(!w.node.pids()?.contains(&p.pid()));

    // Stopping the echo turns answers into refusals.
    w.lab.stop_echo(&w.echo);
    let r = w.lab.probe(&w.a, Proto::Tcp, at(B4, 80), 3)?;
    assert_eq!(r.verdict(), Verdict::Reject, "{r}");
    Ok(())
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

#[test]
fn drop_removes_namespaces_and_processes() -> Result<()> {
    nftproxy_tests::require_root!(Ok(()));
    let w = world()?;
    let prefix = w.lab.prefix().to_string();
    let mut pids = vec![w.echo.pid];
    // Not owned by a Proc: the lab kills it by PID when it deletes the namespace.
    let orphan = w
        .node
        .exec(&["sh", "-c", "sleep 1000 >/dev/null 2>&1 & echo $!"])?;
    pids.push(orphan.trim().parse()?);
    let sleeper = w.a.spawn(&["sleep", "1000"])?;
    pids.push(sleeper.pid());
    assert_eq!(
        list_namespaces()?
            .iter()
            .filter(|n| n.starts_with(&prefix))
            .count(),
        4
    );
    assert!(pids.iter().all(|&p| alive(p)));
    drop(sleeper);
    drop(w);
    assert!(!list_namespaces()?.iter().any(|n| n.starts_with(&prefix)));
    for pid in pids {
        assert!(!alive(pid), "process {pid} survived");
    }

    // Also when the test panics.
    let prefix = std::panic::catch_unwind(|| {
        let w = world().unwrap();
        let _p = w.b.spawn(&["sleep", "1000"]).unwrap();
        std::panic::panic_any(w.lab.prefix().to_string());
    })
    .unwrap_err()
    .downcast::<String>()
    .unwrap();
    assert!(
        !list_namespaces()?
            .iter()
            .any(|n| n.starts_with(prefix.as_str()))
    );
    Ok(())
}

#[test]
fn addresses_are_usable() -> Result<()> {
    nftproxy_tests::require_root!(Ok(()));
    let w = world()?;
    let a4: IpAddr = ip(A4);
    assert_eq!(w.a.ipv4(), Some(a4));
    let addrs = w.client.ip(&["-br", "addr", "show", "dev", "eth0"])?;
    assert!(
        addrs.contains(CLIENT4) && addrs.contains(CLIENT6),
        "{addrs}"
    );
    assert!(!addrs.contains("tentative"), "{addrs}");
    Ok(())
}
