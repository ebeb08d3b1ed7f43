//! ClusterIP load balancing through real nftables rules in a network-namespace lab, driven by
//! the real `nftproxy` binary: kube-proxy's TestClusterIPGeneral flows (IPv4, IPv6, dual-stack),
//! the no-endpoints reject, the spread of random choices, render/list round trips, malformed
//! input and idempotent re-runs.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use nftproxy_tests::{Lab, Ns, Probe, Proto, Verdict, ip, sa, target_binary};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

fn nftproxy(ns: &Ns, args: &[&str]) -> Output {
    let bin =
        target_binary("nftproxy").expect("build nftproxy first (cargo build --workspace --bins)");
    ns.command(bin)
        .args(args)
        .env("RUST_LOG", "info")
        .output()
        .expect("run nftproxy")
}

fn run_once(node: &Ns, file: &str) -> Output {
    let out = nftproxy(
        node,
        &[
            "run",
            "--once",
            "--from-file",
            fixture(file).to_str().unwrap(),
            "--config",
            fixture("cluster-ip-config.yaml").to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "nftproxy run --once failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The lab of kube-proxy's flow tests: a node (192.168.0.2, 2001:db8::1) with an external
/// client on its uplink, a client pod and endpoint pods behind it.
struct Topology {
    lab: Lab,
    node: Ns,
    client: Ns,
    ep1: Ns,
    external: Ns,
}

fn topology() -> Topology {
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let external = lab
        .external(
            &node,
            "ext",
            &[ip("203.0.113.2"), ip("2600:5200::1")],
            &[ip("192.168.0.2"), ip("2001:db8::1")],
        )
        .unwrap();
    // A real node has a default route; without one, packets to Service addresses that no rule
    // translates would be refused by routing before the filter hooks see them.
    let up = external.node_link().unwrap().to_string();
    node.add_route(&format!("default dev {up}")).unwrap();
    node.ip(&["-6", "route", "add", "default", "dev", &up])
        .unwrap();
    // The node's alternate addresses. Host-originated probes use them as source, so that the
    // masquerade (to the primary address, the first on the link) is visible to the endpoint.
    node.add_addr(&up, ip("192.168.1.2"), 32).unwrap();
    // IPv6 source selection would happily pick the alternate address as masquerade address;
    // deprecating it (preferred_lft 0) keeps it usable as an explicit source only.
    node.ip(&[
        "-6",
        "addr",
        "add",
        "2001:db8:1::2/128",
        "dev",
        &up,
        "nodad",
        "preferred_lft",
        "0",
    ])
    .unwrap();
    let client = lab
        .pod(&node, "client", &[ip("10.180.0.2"), ip("fd00:10:180::2")])
        .unwrap();
    let ep1 = lab
        .pod(&node, "ep1", &[ip("10.180.0.1"), ip("fd00:10:180::1")])
        .unwrap();
    let ep2 = lab
        .pod(&node, "ep2", &[ip("10.180.2.1"), ip("fd00:10:180::2:1")])
        .unwrap();
    let ep3 = lab.pod(&node, "ep3", &[ip("10.180.3.1")]).unwrap();
    for ep in [&ep1, &ep2, &ep3] {
        lab.echo(ep, &[80, 8443, 53, 5353, 8080, 9090]).unwrap();
    }
    Topology {
        lab,
        node,
        client,
        ep1,
        external,
    }
}

fn expect(
    t: &Topology,
    from: &Ns,
    src: Option<&str>,
    proto: Proto,
    dst: &str,
    want: &str,
    masq: bool,
) {
    let mut probe = Probe::new(proto, sa(dst), 12).timeout(Duration::from_millis(700));
    if let Some(src) = src {
        probe = probe.src(ip(src));
    }
    let want_verdict = match want {
        "REJECT" => Verdict::Reject,
        "DROP" => Verdict::Drop,
        list => Verdict::Endpoints {
            set: list.split(", ").map(sa).collect(),
            masqueraded: masq,
        },
    };
    let got = t.lab.probe_for(from, &probe, &want_verdict).unwrap();
    assert_eq!(
        got.verdict(),
        want_verdict,
        "{proto} {dst} from {}: {got}",
        from.label()
    );
}

#[test]
fn cluster_ip_general_ipv4() {
    nftproxy_tests::require_root!();
    let t = topology();
    run_once(&t.node, "cluster-ip.yaml");
    use Proto::*;
    let c = &t.client;
    expect(&t, c, None, Tcp, "172.30.0.41:80", "10.180.0.1:80", false);
    expect(
        &t,
        &t.ep1,
        None,
        Tcp,
        "172.30.0.41:80",
        "10.180.0.1:80",
        true,
    );
    let both = |p: u16| format!("10.180.0.1:{p}, 10.180.2.1:{p}");
    expect(&t, c, None, Tcp, "172.30.0.42:80", &both(80), false);
    expect(&t, c, None, Tcp, "172.30.0.42:443", &both(8443), false);
    expect(&t, c, None, Tcp, "172.30.0.42:53", &both(5353), false);
    expect(&t, c, None, Udp, "172.30.0.42:53", &both(53), false);
    expect(&t, c, None, Sctp, "172.30.0.42:53", &both(53), false);
    expect(&t, c, None, Udp, "172.30.0.42:80", "REJECT", false);
    expect(&t, c, None, Tcp, "172.30.0.41:443", "REJECT", false);
    expect(&t, c, None, Tcp, "172.30.0.50:80", "DROP", false);
    // kube-proxy's TestNoEndpointsReject, ClusterIP flow.
    expect(&t, c, None, Tcp, "172.30.0.44:80", "REJECT", false);
    // From outside the cluster CIDR, and from the node itself: masqueraded.
    expect(
        &t,
        &t.external,
        None,
        Tcp,
        "172.30.0.41:80",
        "10.180.0.1:80",
        true,
    );
    expect(
        &t,
        &t.node,
        Some("192.168.1.2"),
        Tcp,
        "172.30.0.41:80",
        "10.180.0.1:80",
        true,
    );
    expect(
        &t,
        &t.node,
        Some("192.168.1.2"),
        Tcp,
        "172.30.0.50:80",
        "DROP",
        false,
    );
    expect(
        &t,
        &t.node,
        Some("192.168.1.2"),
        Tcp,
        "172.30.0.41:443",
        "REJECT",
        false,
    );
}

#[test]
fn cluster_ip_general_ipv6() {
    nftproxy_tests::require_root!();
    let t = topology();
    run_once(&t.node, "cluster-ip.yaml");
    use Proto::*;
    let c = &t.client;
    let both = |p: u16| format!("[fd00:10:180::1]:{p}, [fd00:10:180::2:1]:{p}");
    expect(
        &t,
        c,
        None,
        Tcp,
        "[fd00:172:30::41]:80",
        "[fd00:10:180::1]:80",
        false,
    );
    expect(
        &t,
        &t.ep1,
        None,
        Tcp,
        "[fd00:172:30::41]:80",
        "[fd00:10:180::1]:80",
        true,
    );
    expect(&t, c, None, Tcp, "[fd00:172:30::42]:80", &both(80), false);
    expect(
        &t,
        c,
        None,
        Tcp,
        "[fd00:172:30::42]:443",
        &both(8443),
        false,
    );
    expect(&t, c, None, Tcp, "[fd00:172:30::42]:53", &both(5353), false);
    expect(&t, c, None, Udp, "[fd00:172:30::42]:53", &both(53), false);
    expect(&t, c, None, Sctp, "[fd00:172:30::42]:53", &both(53), false);
    expect(&t, c, None, Udp, "[fd00:172:30::42]:80", "REJECT", false);
    expect(&t, c, None, Tcp, "[fd00:172:30::41]:443", "REJECT", false);
    expect(&t, c, None, Tcp, "[fd00:172:30::50]:80", "DROP", false);
    expect(
        &t,
        &t.external,
        None,
        Tcp,
        "[fd00:172:30::41]:80",
        "[fd00:10:180::1]:80",
        true,
    );
    let node_src = Some("2001:db8:1::2");
    expect(
        &t,
        &t.node,
        node_src,
        Tcp,
        "[fd00:172:30::41]:80",
        "[fd00:10:180::1]:80",
        true,
    );
}

#[test]
fn dual_stack_service_on_both_cluster_ips() {
    nftproxy_tests::require_root!();
    let t = topology();
    run_once(&t.node, "cluster-ip.yaml");
    let c = &t.client;
    expect(
        &t,
        c,
        None,
        Proto::Tcp,
        "172.30.0.43:80",
        "10.180.0.1:80, 10.180.2.1:80",
        false,
    );
    expect(
        &t,
        c,
        None,
        Proto::Tcp,
        "[fd00:172:30::43]:80",
        "[fd00:10:180::1]:80, [fd00:10:180::2:1]:80",
        false,
    );
}

#[test]
fn random_choice_spreads_over_three_endpoints() {
    nftproxy_tests::require_root!();
    let t = topology();
    run_once(&t.node, "cluster-ip.yaml");
    assert_spread(&t, "172.30.0.45:80", 300, 3, 60..=141);
}

/// `connections` connections to `vip` all answered, by `endpoints` endpoints, each getting a
/// number of them within `each`.
fn assert_spread(
    t: &Topology,
    vip: &str,
    connections: usize,
    endpoints: usize,
    each: std::ops::RangeInclusive<usize>,
) {
    let r = t
        .lab
        .run_probe(&t.client, &Probe::new(Proto::Tcp, sa(vip), connections))
        .unwrap();
    assert_eq!(r.answered_total(), connections, "{r}");
    assert_eq!(r.answered.len(), endpoints, "{r}");
    for (ep, n) in &r.answered {
        assert!(
            each.contains(n),
            "{ep} got {n} of {connections} connections: {r}"
        );
    }
}

#[test]
fn a_service_with_more_endpoints_than_the_lists_take_spreads_over_all_of_them() {
    nftproxy_tests::require_root!();
    let t = topology();
    run_once(&t.node, "cluster-ip.yaml");
    // Eighteen endpoints: no chain, the flat path for large Services (class 5: 17 to 32).
    let listing = listing(&t.node);
    assert!(!listing.contains("ns5/svc9/"), "{listing}");
    let class: String = listing
        .lines()
        .skip_while(|l| !l.contains("set big-class-5 "))
        .take_while(|l| l.trim() != "}")
        .collect();
    assert!(class.contains("172.30.0.49 . tcp . 80"), "{class}");
    let map: String = listing
        .lines()
        .skip_while(|l| !l.contains("map big-endpoints "))
        .take_while(|l| l.trim() != "}")
        .collect();
    assert_eq!(
        map.matches("172.30.0.49 . tcp . 80 . ").count(),
        18,
        "{map}"
    );
    assert_spread(&t, "172.30.0.49:80", 900, 18, 20..=85);
}

#[test]
fn a_long_endpoint_list_spreads_over_all_of_its_endpoints() {
    nftproxy_tests::require_root!();
    let t = topology();
    run_once(&t.node, "cluster-ip.yaml");
    // Twelve endpoints: no chain, one list in the map for lists of twelve.
    let listing = listing(&t.node);
    assert!(!listing.contains("ns5/svc10/"), "{listing}");
    let map: String = listing
        .lines()
        .skip_while(|l| !l.contains("map cluster-endpoints-12 "))
        .take_while(|l| l.trim() != "}")
        .collect();
    assert_eq!(
        map.matches("172.30.0.46 . tcp . 80 . ").count(),
        12,
        "{map}"
    );
    assert_spread(&t, "172.30.0.46:80", 600, 12, 20..=85);
}

/// The text from `nft list table` for both families.
fn listing(ns: &Ns) -> String {
    ["ip", "ip6"]
        .iter()
        .map(|f| ns.exec(&["nft", "list", "table", f, "nftproxy"]).unwrap())
        .collect()
}

#[test]
fn render_loads_and_listings_reload_identically() {
    nftproxy_tests::require_root!();
    let t = topology();
    let out = nftproxy(
        &t.node,
        &[
            "render",
            "--from-file",
            fixture("cluster-ip.yaml").to_str().unwrap(),
            "--config",
            fixture("cluster-ip-config.yaml").to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered = String::from_utf8(out.stdout).unwrap();
    t.node.exec_input(&["nft", "-f", "-"], &rendered).unwrap();
    let first = listing(&t.node);
    t.node
        .exec(&["nft", "delete", "table", "ip", "nftproxy"])
        .unwrap();
    t.node
        .exec(&["nft", "delete", "table", "ip6", "nftproxy"])
        .unwrap();
    t.node.exec_input(&["nft", "-f", "-"], &first).unwrap();
    assert_eq!(listing(&t.node), first);

    // What the agent programs lists the same as what render prints, once loaded.
    t.node
        .exec(&["nft", "delete", "table", "ip", "nftproxy"])
        .unwrap();
    t.node
        .exec(&["nft", "delete", "table", "ip6", "nftproxy"])
        .unwrap();
    run_once(&t.node, "cluster-ip.yaml");
    assert_eq!(listing(&t.node), first);
    // And the rendered traffic works.
    expect(
        &t,
        &t.client,
        None,
        Proto::Tcp,
        "172.30.0.41:80",
        "10.180.0.1:80",
        false,
    );
}

/// The netlink messages each family's sync sent, IPv4 first.
fn committed_ops(stderr: &str) -> Vec<usize> {
    nftproxy_tests::per_family_field(stderr, "nftables sync committed", "messages")
}

#[test]
fn second_run_sends_nothing() {
    nftproxy_tests::require_root!();
    let t = topology();
    let first = run_once(&t.node, "cluster-ip.yaml");
    let sent = committed_ops(&String::from_utf8_lossy(&first.stderr));
    assert_eq!(sent.len(), 2, "one report per family");
    assert!(sent.iter().all(|n| *n > 0), "{sent:?}");
    let before = listing(&t.node);
    let second = run_once(&t.node, "cluster-ip.yaml");
    let sent = committed_ops(&String::from_utf8_lossy(&second.stderr));
    assert_eq!(
        sent,
        vec![0, 0],
        "the second run must send no netlink message"
    );
    assert_eq!(listing(&t.node), before);
}

/// `n` ClusterIP Services `ns/svc-I` (172.30.1.0/24 and up), without Service `skip`, each with
/// seventeen endpoints: more than the shared endpoint lists take, so each is on the flat path.
fn many_services(n: u16, skip: Option<u16>) -> String {
    use nftproxy_tests::cluster::{Endpoint, Objects, Service, Slice};
    let mut objects = Objects::new();
    for i in (0..n).filter(|i| Some(*i) != skip) {
        let name = format!("svc-{i:03}");
        objects.push(
            Service::new(
                "ns",
                &name,
                &format!("172.30.{}.{}", 1 + i / 250, i % 250 + 1),
            )
            .port("http", Proto::Tcp, 80),
        );
        let mut slice = Slice::new("ns", &format!("{name}-a"), &name).port("http", Proto::Tcp, 80);
        for j in 1..=17 {
            slice = slice.endpoint(Endpoint::new(&format!("10.180.{j}.1")));
        }
        objects.push(slice);
    }
    objects.to_yaml()
}

/// The elements of the flat path's `big-endpoints` map, from `nft list`.
fn big_elements(listing: &str) -> BTreeSet<String> {
    listing
        .lines()
        .skip_while(|l| !l.contains("map big-endpoints "))
        .take_while(|l| l.trim() != "}")
        .flat_map(|l| l.split(['{', ',']))
        .map(str::trim)
        .filter(|e| e.contains(" : ") && !e.starts_with("typeof"))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_restart_keeps_every_other_services_endpoints() {
    nftproxy_tests::require_root!();
    let t = topology();
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first.yaml");
    std::fs::write(&first, many_services(600, None)).unwrap();
    let run = |file: &Path| {
        nftproxy(
            &t.node,
            &[
                "run",
                "--once",
                "--from-file",
                file.to_str().unwrap(),
                "--config",
                fixture("cluster-ip-config.yaml").to_str().unwrap(),
            ],
        )
    };
    assert!(run(&first).status.success());
    let before = big_elements(&listing(&t.node));
    assert_eq!(before.len(), 600 * 17, "every endpoint on the flat path");

    // A new process with a Service deleted: the other Services' elements stay as they are
    // (only the deleted Service's objects change).
    let second = dir.path().join("second.yaml");
    std::fs::write(&second, many_services(600, Some(7))).unwrap();
    let out = run(&second);
    assert!(out.status.success());
    let after = big_elements(&listing(&t.node));
    let kept: BTreeSet<String> = before
        .iter()
        .filter(|e| !e.starts_with("172.30.1.8 . tcp . 80 . "))
        .cloned()
        .collect();
    assert_eq!(after, kept);
    let sent = committed_ops(&String::from_utf8_lossy(&out.stderr));
    assert!(
        sent[0] < 20,
        "IPv4 messages for one deleted Service: {sent:?}"
    );
}

#[test]
fn malformed_services_are_skipped_and_the_rest_works() {
    nftproxy_tests::require_root!();
    let t = topology();
    let out = run_once(&t.node, "malformed.yaml");
    let log = String::from_utf8_lossy(&out.stderr);
    for (name, reason) in [
        ("ns1/bad-ip", "invalid IP"),
        ("ns1/port-zero", "out of range"),
        ("ns1/bad-protocol", "unknown protocol"),
    ] {
        assert!(
            log.lines().any(|l| l.contains(name) && l.contains(reason)),
            "no log line names {name} with {reason:?}:\n{log}"
        );
    }
    let c = &t.client;
    // 172.30.0.041 and 10.180.00.001 are read as decimal, as Kubernetes does.
    expect(
        &t,
        c,
        None,
        Proto::Tcp,
        "172.30.0.41:80",
        "10.180.0.1:80",
        false,
    );
    expect(
        &t,
        c,
        None,
        Proto::Tcp,
        "172.30.0.42:80",
        "10.180.2.1:80",
        false,
    );
    let listing = listing(&t.node);
    for bad in ["172.30.0.43", "172.30.0.44"] {
        assert!(!listing.contains(bad), "{bad} was programmed:\n{listing}");
    }
}

#[test]
fn cleanup_removes_both_tables() {
    nftproxy_tests::require_root!();
    let t = topology();
    run_once(&t.node, "cluster-ip.yaml");
    let out = nftproxy(&t.node, &["cleanup"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tables = t.node.exec(&["nft", "list", "tables"]).unwrap();
    assert!(!tables.contains("nftproxy"), "{tables}");
}

/// ClientIP affinity in both families: the client's connections all reach the endpoint its
/// first one reached, and the affinity map lists the client (the IPv6 rules use registers that
/// nft 1.0.6 cannot write itself).
#[test]
fn client_ip_affinity_in_both_families() {
    nftproxy_tests::require_root!();
    let t = topology();
    run_once(&t.node, "affinity.yaml");
    for (family, client, dst, endpoints) in [
        (
            "ip",
            "10.180.0.2",
            "172.30.0.43:80",
            ["10.180.0.1:80", "10.180.2.1:80"],
        ),
        (
            "ip6",
            "fd00:10:180::2",
            "[fd00:172:30::43]:80",
            ["[fd00:10:180::1]:80", "[fd00:10:180::2:1]:80"],
        ),
    ] {
        let probe = |count: usize| {
            let p = Probe::new(Proto::Tcp, sa(dst), count)
                .parallel(4)
                .timeout(Duration::from_millis(700));
            t.lab.run_probe(&t.client, &p).unwrap()
        };
        let first = probe(1);
        let rest = probe(30);
        let reached: BTreeSet<_> = first.answered.keys().chain(rest.answered.keys()).collect();
        assert_eq!(reached.len(), 1, "{dst}: {first} / {rest}");
        assert_eq!(rest.answered_total(), 30, "{dst}: {rest}");
        let endpoint = **reached.first().unwrap();
        assert!(endpoints.map(sa).contains(&endpoint), "{dst}: {endpoint}");
        let map = t
            .node
            .exec(&["nft", "list", "map", family, "nftproxy", "affinity-clients"])
            .unwrap();
        let (ip, port) = (dst.rsplit_once(':').unwrap().0, 80);
        let ip = ip.trim_matches(['[', ']']);
        let entry = format!("{client} . {ip} . tcp . {port} ");
        assert!(map.contains(&entry), "{dst}: no `{entry}` in\n{map}");
    }
}
