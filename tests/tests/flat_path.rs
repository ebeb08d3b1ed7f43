//! Traffic through the flat path (Services of up to 8,192 endpoints as map elements, endpoints
//! drawn from shared maps; session affinity as entries of one shared map). Needs root: a lab of
//! network namespaces (a node, a client pod and one pod holding every endpoint address, whose
//! echo server answers on all of them), deleted at the end, also on failure.
//!
//! - A 1,000-endpoint Service programmed by `nftproxy run --once` spreads new UDP connections
//!   over all of its endpoints as a uniform choice would (chi-square).
//! - A Service growing from 1 endpoint to 200 and back, one endpoint per partial sync of the
//!   agent's syncer (the proxier the daemon's sync loop drives), never loses a UDP probe sent
//!   meanwhile: the lists move from map to map up to 16, then one key per change plus the
//!   class-set element at each power of two.
//! - A 100-endpoint Service with ClientIP affinity keeps each client on one endpoint, and a
//!   client whose endpoint is removed moves to another one and stays there, while the others
//!   keep theirs; the table has no chain for the Service.
//! - The two UDP ports of a 100-endpoint Service share one address list, each port DNATed to
//!   its own target port, before and after a partial sync that changes endpoints.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dataplane::convert::{self, Objects};
use dataplane::model::{Cluster, ObjectName};
use dataplane::nft::build::{BuildConfig, LocalDetector};
use dataplane::nft::ruleset::Family;
use nftproxy::proxier::{ChangedServices, Syncer};
use nftproxy_tests::{Lab, Ns, Probe, ProbeResult, Proto, ip, target_binary};
use serde_json::json;

const NODE: &str = "test-node";
const VIP: &str = "172.30.0.10";
const PORT: u16 = 53;
const TARGET_PORT: u16 = 5353;

/// Endpoint `i`: 10.181.0.0/16 upwards.
fn endpoint(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(
        u32::from(Ipv4Addr::new(10, 181, 0, 1)) + i as u32,
    ))
}

/// The client's further addresses, for connections that are all new to conntrack.
const SOURCES: usize = 60;

fn client_sources() -> Vec<IpAddr> {
    (1..=SOURCES as u8)
        .map(|i| IpAddr::from([10, 180, 1, i]))
        .collect()
}

struct Site {
    lab: Lab,
    node: Ns,
    client: Ns,
}

/// A node, a client pod and a pod answering on the first `n` endpoint addresses.
///
/// The node routes the endpoints' block through the pod's own address: a host route per
/// endpoint would make the node resolve a neighbour per endpoint, and the kernel's ARP table
/// (1,024 entries for all namespaces together) overflows and drops packets.
fn site(n: usize) -> Site {
    site_answering(n, &[TARGET_PORT])
}

/// [`site`], the pod answering on `ports`.
fn site_answering(n: usize, ports: &[u16]) -> Site {
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let mut sources = vec![ip("10.180.0.2")];
    sources.extend(client_sources());
    let client = lab.pod(&node, "client", &sources).unwrap();
    let eps = lab.pod(&node, "eps", &[ip("10.181.255.1")]).unwrap();
    let adds: Vec<String> = (0..n)
        .map(|i| format!("addr add {}/32 dev eth0", endpoint(i)))
        .collect();
    eps.ip_batch(&adds).unwrap();
    let link = eps.node_link().unwrap().to_string();
    node.add_route(&format!("10.181.0.0/20 via 10.181.255.1 dev {link}"))
        .unwrap();
    lab.echo(&eps, ports).unwrap();
    Site { lab, node, client }
}

/// This node and Service `ns/dns` (UDP 53 → 5353) with the endpoints `eps`, as API objects.
fn items(eps: &[usize]) -> Vec<serde_json::Value> {
    items_with(eps, false)
}

/// [`items`], with ClientIP session affinity if `affinity`.
fn items_with(eps: &[usize], affinity: bool) -> Vec<serde_json::Value> {
    let endpoints: Vec<serde_json::Value> = eps
        .iter()
        .map(|i| json!({"addresses": [endpoint(*i).to_string()], "conditions": {"ready": true}}))
        .collect();
    vec![
        json!({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
            "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.2"}]},
        }),
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "dns", "namespace": "ns"},
            "spec": {"type": "ClusterIP", "clusterIP": VIP, "clusterIPs": [VIP],
                     "sessionAffinity": if affinity { "ClientIP" } else { "None" },
                     "ports": [{"name": "dns", "port": PORT, "protocol": "UDP",
                                "targetPort": TARGET_PORT}]},
        }),
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "dns-a", "namespace": "ns",
                         "labels": {"kubernetes.io/service-name": "dns"}},
            "addressType": "IPv4",
            "ports": [{"name": "dns", "port": TARGET_PORT, "protocol": "UDP"}],
            "endpoints": endpoints,
        }),
    ]
}

fn objects(eps: &[usize], affinity: bool) -> Objects {
    let [node, svc, slice]: [serde_json::Value; 3] = items_with(eps, affinity).try_into().unwrap();
    let mut o = Objects::default();
    o.nodes.push(serde_json::from_value(node).unwrap());
    o.services.push(serde_json::from_value(svc).unwrap());
    o.slices.push(serde_json::from_value(slice).unwrap());
    o
}

fn cluster(eps: &[usize]) -> Cluster {
    cluster_with(eps, false)
}

fn cluster_with(eps: &[usize], affinity: bool) -> Cluster {
    let (cluster, skipped) = convert::cluster(&objects(eps, affinity), NODE, "");
    assert!(skipped.is_empty(), "{skipped:?}");
    cluster
}

fn config() -> BuildConfig {
    BuildConfig {
        node_name: NODE.to_string(),
        local_detector: LocalDetector::ClusterCidr(vec!["10.180.0.0/16".parse().unwrap()]),
        ..BuildConfig::default()
    }
}

fn vip() -> SocketAddr {
    SocketAddr::new(ip(VIP), PORT)
}

/// Pearson's chi-square of `counts` against a uniform choice among `k` values.
fn chi_square(counts: impl Iterator<Item = usize>, k: usize, total: usize) -> f64 {
    let expected = total as f64 / k as f64;
    counts
        .map(|n| (n as f64 - expected).powi(2) / expected)
        .sum()
}

#[test]
fn a_thousand_endpoints_share_the_connections_evenly() {
    nftproxy_tests::require_root!();
    const N: usize = 1000;
    const CONNECTIONS: usize = 30_000;
    let s = site(N);
    let eps: Vec<usize> = (0..N).collect();
    let file = tempfile::NamedTempFile::new().unwrap();
    let text = serde_json::to_string(&json!({
        "apiVersion": "v1", "kind": "List",
        "items": items(&eps),
    }))
    .unwrap();
    std::fs::write(file.path(), text).unwrap();
    let out = s
        .node
        .command(target_binary("nftproxy").unwrap())
        .args([
            "run",
            "--once",
            "--hostname-override",
            NODE,
            "--from-file",
            file.path().to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listing = s
        .node
        .exec(&["nft", "list", "set", "ip", "nftproxy", "big-class-10"])
        .unwrap();
    assert!(listing.contains("172.30.0.10 . udp . 53"), "{listing}");

    // Each connection must be new to conntrack: a source port used again within the UDP
    // timeout would follow its earlier connection to the same endpoint. So the connections come
    // from 60 source addresses, 500 each (a few repeated ports among 28k per address).
    let mut r = ProbeResult::default();
    for src in &client_sources() {
        let probe = Probe::new(Proto::Udp, vip(), CONNECTIONS / SOURCES)
            .src(*src)
            .parallel(32);
        r.absorb(s.lab.run_probe(&s.client, &probe).unwrap());
    }
    assert_eq!(r.answered_total(), CONNECTIONS, "{r}");
    assert_eq!(r.refused + r.timeouts, 0, "{r}");
    let want: BTreeSet<SocketAddr> = (0..N)
        .map(|i| SocketAddr::new(endpoint(i), TARGET_PORT))
        .collect();
    let got: BTreeSet<SocketAddr> = r.answered.keys().copied().collect();
    assert_eq!(got, want, "every endpoint answers, and only they");
    // 999 degrees of freedom: mean 999, standard deviation 44.7. Six standard deviations
    // above the mean happens by chance about once in a billion runs; a choice that favoured a
    // tenth of the endpoints by a fifth (e.g. a modulus that does not divide evenly) would
    // add about 3,000.
    let chi2 = chi_square(r.answered.values().copied(), N, CONNECTIONS);
    eprintln!("chi-square over {N} endpoints, {CONNECTIONS} connections: {chi2:.0}");
    assert!(chi2 < 999.0 + 6.0 * 44.7, "chi-square {chi2:.0}: {r}");
    let (min, max) = (
        r.answered.values().min().unwrap(),
        r.answered.values().max().unwrap(),
    );
    eprintln!("connections per endpoint: min {min}, max {max} (expected 30)");
}

/// Runs `f` on a thread inside network namespace `ns` (the agent's netlink sockets stay there).
fn in_netns<T: Send>(ns: &Ns, f: impl FnOnce() -> T + Send) -> T {
    nftproxy_tests::apiserver::in_netns(ns.name(), f).expect("enter the namespace")
}

#[test]
fn a_service_growing_to_200_endpoints_and_back_never_loses_a_probe() {
    nftproxy_tests::require_root!();
    const N: usize = 200;
    let s = site(N);
    let changed: BTreeSet<ObjectName> = [ObjectName::new("ns", "dns")].into();
    let families = [(Family::V4, false)].into();
    let done = AtomicBool::new(false);
    let (syncs, probes) = std::thread::scope(|scope| {
        let node = &s.node;
        let done = &done;
        let changes = scope.spawn(move || {
            in_netns(node, || {
                let mut syncer = Syncer::new().expect("a syncer");
                syncer
                    .sync(&cluster(&[0]), &config(), true)
                    .expect("the first sync");
                let mut syncs = 0;
                let up = 2..=N;
                let down = (1..N).rev();
                for n in up.chain(down) {
                    let eps: Vec<usize> = (0..n).collect();
                    let report = syncer
                        .sync_families(
                            &cluster(&eps),
                            &config(),
                            &families,
                            ChangedServices::Services(&changed),
                        )
                        .remove(&Family::V4)
                        .expect("IPv4")
                        .expect("the partial sync commits");
                    assert!(report.ops > 0, "{n} endpoints: nothing sent");
                    syncs += 1;
                    // Probes in flight across every change.
                    std::thread::sleep(Duration::from_millis(10));
                }
                done.store(true, Ordering::SeqCst);
                syncs
            })
        });
        // New UDP connections (a fresh source port each) while the endpoints change.
        let mut all = ProbeResult::default();
        // The first probe waits for the first sync to have programmed the Service.
        while all.answered_total() == 0 {
            all = s
                .lab
                .run_probe(&s.client, &Probe::new(Proto::Udp, vip(), 1))
                .unwrap();
        }
        let mut rounds = 0;
        while !done.load(Ordering::SeqCst) {
            let r = s
                .lab
                .run_probe(&s.client, &Probe::new(Proto::Udp, vip(), 64).parallel(16))
                .unwrap();
            all.absorb(r);
            rounds += 1;
        }
        let syncs = changes.join().expect("the changes");
        assert!(
            rounds > 5,
            "only {rounds} rounds of probes ran during the changes"
        );
        (syncs, all)
    });
    assert_eq!(syncs, 2 * (N - 1));
    let sent = probes.answered_total() + probes.refused + probes.timeouts;
    eprintln!(
        "{sent} probes during {syncs} partial syncs, {} endpoints answered",
        probes.answered.len()
    );
    assert_eq!(probes.refused, 0, "{probes}");
    assert_eq!(probes.timeouts, 0, "{probes}");
    assert!(probes.other_errors.is_empty(), "{probes}");
    // The probes saw the Service at many sizes: far more than the 16 of the lists.
    assert!(probes.answered.len() > 100, "{probes}");
}

/// The one endpoint that answered every probe of `r`, if all were answered by one.
fn one_endpoint(r: &ProbeResult) -> Option<SocketAddr> {
    let all_answered = r.refused + r.timeouts == 0 && r.other_errors.is_empty();
    match (all_answered, r.answered.len()) {
        (true, 1) => r.answered.keys().next().copied(),
        _ => None,
    }
}

#[test]
fn client_ip_affinity_keeps_each_client_on_one_of_100_endpoints() {
    nftproxy_tests::require_root!();
    const N: usize = 100;
    const CLIENTS: usize = 30;
    let s = site(N);
    let changed: BTreeSet<ObjectName> = [ObjectName::new("ns", "dns")].into();
    let families = [(Family::V4, false)].into();
    let mut syncer = in_netns(&s.node, || Syncer::new().expect("a syncer"));
    let all: Vec<usize> = (0..N).collect();
    in_netns(&s.node, || {
        syncer
            .sync(&cluster_with(&all, true), &config(), true)
            .expect("the first sync")
    });
    let chains = s.node.exec(&["nft", "list", "chains", "ip"]).unwrap();
    // Service and endpoint chains are named after the Service port (`…-ns/dns/udp/dns…`).
    assert!(
        !chains.contains("ns/dns/"),
        "a chain for the Service or its endpoints: {chains}"
    );
    // Each client: a first connection alone (it makes the client's entry), then more, each
    // new to conntrack (a fresh source port), in parallel.
    let sources = client_sources();
    let round = |clients: &[IpAddr]| -> Vec<(IpAddr, ProbeResult)> {
        clients
            .iter()
            .map(|src| {
                let mut r = s
                    .lab
                    .run_probe(&s.client, &Probe::new(Proto::Udp, vip(), 1).src(*src))
                    .unwrap();
                let more = Probe::new(Proto::Udp, vip(), 19).src(*src).parallel(4);
                r.absorb(s.lab.run_probe(&s.client, &more).unwrap());
                (*src, r)
            })
            .collect()
    };
    let first = round(&sources[..CLIENTS]);
    let mut chosen = std::collections::BTreeMap::new();
    for (src, r) in &first {
        let ep = one_endpoint(r).unwrap_or_else(|| panic!("{src} spread over endpoints: {r}"));
        chosen.insert(*src, ep);
    }
    let distinct: BTreeSet<&SocketAddr> = chosen.values().collect();
    eprintln!("{CLIENTS} clients stayed on {} endpoints", distinct.len());
    // 30 clients choosing among 100 endpoints: fewer than 10 distinct is next to impossible.
    assert!(distinct.len() >= 10, "{chosen:?}");
    let entries = s
        .node
        .exec(&["nft", "list", "map", "ip", "nftproxy", "affinity-clients"])
        .unwrap();
    assert!(
        entries.contains("10.180.1.1 . 172.30.0.10 . udp . 53"),
        "{entries}"
    );

    // The endpoints of the first five clients go; the others stay.
    let moved: Vec<IpAddr> = sources[..5].to_vec();
    let removed: BTreeSet<IpAddr> = moved.iter().map(|c| chosen[c].ip()).collect();
    let remaining: Vec<usize> = all
        .iter()
        .copied()
        .filter(|i| !removed.contains(&endpoint(*i)))
        .collect();
    in_netns(&s.node, || {
        syncer
            .sync_families(
                &cluster_with(&remaining, true),
                &config(),
                &families,
                ChangedServices::Services(&changed),
            )
            .remove(&Family::V4)
            .expect("IPv4")
            .expect("the partial sync commits")
    });
    let entries = s
        .node
        .exec(&["nft", "list", "map", "ip", "nftproxy", "affinity-clients"])
        .unwrap();
    for ip in &removed {
        assert!(
            !entries.contains(&format!(": {ip} . ")),
            "an entry still leads to removed endpoint {ip}: {entries}"
        );
    }
    let second = round(&sources[..CLIENTS]);
    for (src, r) in &second {
        let ep = one_endpoint(r).unwrap_or_else(|| panic!("{src} spread over endpoints: {r}"));
        if moved.contains(src) {
            assert!(!removed.contains(&ep.ip()), "{src} still reached {ep}");
        } else if !removed.contains(&chosen[src].ip()) {
            assert_eq!(ep, chosen[src], "{src} moved although its endpoint stayed");
        }
    }
}

/// Service `ns/dns` with two UDP ports, 53 → 5353 and 54 → 5354, and the endpoints `eps`.
fn two_port_cluster(eps: &[usize]) -> Cluster {
    let [node, mut svc, mut slice]: [serde_json::Value; 3] =
        items_with(eps, false).try_into().unwrap();
    svc["spec"]["ports"] = json!([
        {"name": "dns", "port": PORT, "protocol": "UDP", "targetPort": TARGET_PORT},
        {"name": "alt", "port": PORT + 1, "protocol": "UDP", "targetPort": TARGET_PORT + 1},
    ]);
    slice["ports"] = json!([
        {"name": "dns", "port": TARGET_PORT, "protocol": "UDP"},
        {"name": "alt", "port": TARGET_PORT + 1, "protocol": "UDP"},
    ]);
    let mut o = Objects::default();
    o.nodes.push(serde_json::from_value(node).unwrap());
    o.services.push(serde_json::from_value(svc).unwrap());
    o.slices.push(serde_json::from_value(slice).unwrap());
    let (cluster, skipped) = convert::cluster(&o, NODE, "");
    assert!(skipped.is_empty(), "{skipped:?}");
    cluster
}

#[test]
fn two_ports_share_one_address_list_and_keep_their_target_ports() {
    nftproxy_tests::require_root!();
    const N: usize = 100;
    let s = site_answering(N + 5, &[TARGET_PORT, TARGET_PORT + 1]);
    let mut syncer = in_netns(&s.node, || Syncer::new().expect("a syncer"));
    let all: Vec<usize> = (0..N).collect();
    in_netns(&s.node, || {
        syncer
            .sync(&two_port_cluster(&all), &config(), true)
            .expect("the first sync")
    });
    let list = |map: &str| {
        s.node
            .exec(&["nft", "list", "map", "ip", "nftproxy", map])
            .unwrap()
    };
    let shared = list("big-service-endpoints");
    assert!(shared.contains("172.30.0.10 . udp . 99 : "), "{shared}");
    let ports = list("service-target-ports");
    for want in [
        "172.30.0.10 . udp . 53 : 5353",
        "172.30.0.10 . udp . 54 : 5354",
    ] {
        assert!(ports.contains(want), "{ports}");
    }
    assert!(!list("big-endpoints").contains("172.30.0.10"));
    // Every endpoint answers on each port, at that port's target port, and only they.
    let check = |eps: &[usize]| {
        for (port, target) in [(PORT, TARGET_PORT), (PORT + 1, TARGET_PORT + 1)] {
            let mut r = ProbeResult::default();
            for src in &client_sources()[..30] {
                let probe = Probe::new(Proto::Udp, SocketAddr::new(ip(VIP), port), 50)
                    .src(*src)
                    .parallel(16);
                r.absorb(s.lab.run_probe(&s.client, &probe).unwrap());
            }
            assert_eq!(r.refused + r.timeouts, 0, "port {port}: {r}");
            let want: BTreeSet<SocketAddr> = eps
                .iter()
                .map(|i| SocketAddr::new(endpoint(*i), target))
                .collect();
            let got: BTreeSet<SocketAddr> = r.answered.keys().copied().collect();
            assert_eq!(got, want, "port {port}");
        }
    };
    check(&all);
    // Ten endpoints go and five come, in one partial sync: the list keeps the others' indices.
    let changed: BTreeSet<ObjectName> = [ObjectName::new("ns", "dns")].into();
    let now: Vec<usize> = (10..N + 5).collect();
    in_netns(&s.node, || {
        syncer
            .sync_families(
                &two_port_cluster(&now),
                &config(),
                &[(Family::V4, false)].into(),
                ChangedServices::Services(&changed),
            )
            .remove(&Family::V4)
            .expect("IPv4")
            .expect("the partial sync commits")
    });
    check(&now);
}
