//! The flat path for large Services (17 to 8,192 endpoints without session affinity) against the
//! real kernel. Needs root: each test creates its own network namespace (`nftp-flat-<pid>-<n>`),
//! programs it with the agent's own syncer over netlink, checks the result with `nft` inside
//! it, and deletes it when done, even on panic.
//!
//! Covered: every destination kind (ClusterIP, external IP, load-balancer IP and NodePort, with
//! externalTrafficPolicy Cluster and Local, so cluster-wide and node-local lists) in both
//! families; the table loads, lists as `nftproxy render` writes it, `nft -f` loads the rendered
//! text, a full sync after every partial one finds nothing to change (the table reads back as
//! written), partial syncs across the classes' boundaries send only elements, and the
//! drift monitor is not notified of a large Service's change.

use std::collections::{BTreeMap, BTreeSet};

use dataplane::convert::{self, Objects};
use dataplane::model::{Cluster, ObjectName};
use dataplane::nft::build::{BuildConfig, LocalDetector};
use dataplane::nft::render;
use dataplane::nft::ruleset::Family;
use nftproxy::proxier::{ChangedServices, Syncer};
use serde_json::json;

mod common;
use common::Netns;

const NODE: &str = "node-a";

/// Endpoint `i` of the test's Services, on this node for every third.
fn endpoint(family: Family, i: usize) -> serde_json::Value {
    let addr = match family {
        Family::V4 => format!("10.180.{}.{}", i / 200, i % 200 + 1),
        Family::V6 => format!("fd00:10:180::{:x}", i + 1),
    };
    let node = if i.is_multiple_of(3) { NODE } else { "node-b" };
    json!({"addresses": [addr], "conditions": {"ready": true}, "nodeName": node})
}

/// A dual-stack LoadBalancer Service `web` (TCP 80, NodePort 30080, an external IP,
/// externalTrafficPolicy Local) with `web` endpoints, and a NodePort Service `dns` (UDP 53,
/// NodePort 30053, externalTrafficPolicy Cluster) with `dns` endpoints.
fn cluster(web: usize, dns: usize) -> Cluster {
    let mut o = Objects::default();
    o.nodes.push(
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
            "spec": {"podCIDRs": ["10.180.0.0/16", "fd00:10:180::/112"]},
            "status": {"addresses": [
                {"type": "InternalIP", "address": "192.168.0.2"},
                {"type": "InternalIP", "address": "2001:db8::2"}]},
        }))
        .unwrap(),
    );
    o.services.push(
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {
                "type": "LoadBalancer", "externalTrafficPolicy": "Local",
                "healthCheckNodePort": 32000,
                "clusterIP": "172.30.0.10", "clusterIPs": ["172.30.0.10", "fd00:172:30::10"],
                "ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "RequireDualStack",
                "externalIPs": ["192.168.9.9"],
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080,
                           "nodePort": 30080}]},
            "status": {"loadBalancer": {"ingress": [{"ip": "5.6.7.8"}]}},
        }))
        .unwrap(),
    );
    o.services.push(
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "dns", "namespace": "ns"},
            "spec": {
                "type": "NodePort",
                "clusterIP": "172.30.0.11", "clusterIPs": ["172.30.0.11", "fd00:172:30::11"],
                "ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "RequireDualStack",
                "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353,
                           "nodePort": 30053}]},
        }))
        .unwrap(),
    );
    for (svc, n, proto, port) in [("web", web, "TCP", 8080), ("dns", dns, "UDP", 5353)] {
        for family in Family::ALL {
            let eps: Vec<serde_json::Value> = (0..n).map(|i| endpoint(family, i)).collect();
            o.slices.push(
                serde_json::from_value(json!({
                    "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {"name": format!("{svc}-{}", family.k8s_name().to_lowercase()),
                                 "namespace": "ns",
                                 "labels": {"kubernetes.io/service-name": svc}},
                    "addressType": family.k8s_name(),
                    "ports": [{"name": if svc == "web" { "http" } else { "dns" },
                               "port": port, "protocol": proto}],
                    "endpoints": eps,
                }))
                .unwrap(),
            );
        }
    }
    let (cluster, skipped) = convert::cluster(&o, NODE, "");
    assert!(skipped.is_empty(), "{skipped:?}");
    cluster
}

fn config() -> BuildConfig {
    BuildConfig {
        node_name: NODE.to_string(),
        local_detector: LocalDetector::ClusterCidr(vec![
            "10.180.0.0/16".parse().unwrap(),
            "fd00:10:180::/112".parse().unwrap(),
        ]),
        ..BuildConfig::default()
    }
}

/// A partial sync of both Services, then a full one that must find nothing to change.
fn sync_and_check(syncer: &mut Syncer, c: &Cluster) -> BTreeMap<Family, usize> {
    let changed: BTreeSet<ObjectName> = c.services.keys().cloned().collect();
    let families = Family::ALL.iter().map(|f| (*f, false)).collect();
    let ops = syncer
        .sync_families(c, &config(), &families, ChangedServices::Services(&changed))
        .into_iter()
        .map(|(f, r)| (f, r.expect("the partial sync commits").ops))
        .collect();
    for (family, report) in syncer.sync(c, &config(), true).expect("a full sync") {
        assert_eq!(
            report.ops, 0,
            "{family:?}: the table does not read back as written"
        );
        assert!(!report.drift_repaired, "{family:?}");
    }
    ops
}

#[test]
fn large_services_load_list_as_rendered_and_change_by_elements() {
    nftproxy_tests::require_root!();
    let ns = Netns::new("flat");
    // 60 web endpoints (class 6; 20 on this node: class 5), 40 dns endpoints (class 6).
    let first = cluster(60, 40);
    let c = first.clone();
    ns.run(move || {
        let mut syncer = Syncer::new().expect("syncer");
        syncer.sync(&c, &config(), true).expect("cold sync");
        for (family, report) in syncer.sync(&c, &config(), true).expect("a full sync") {
            assert_eq!(report.ops, 0, "{family:?}");
        }
        // Endpoint counts across the boundaries: 16 / 17, 32 / 33, 64 / 65, and back.
        for (web, dns) in [(61, 40), (59, 33), (65, 32), (17, 17), (16, 16), (100, 300)] {
            sync_and_check(&mut syncer, &cluster(web, dns));
        }
        // Afresh, for a listing in the builder's order (an agent keeps each endpoint's index
        // while it stays, so after these changes the order is the history's).
        let mut nft = nftproxy::nftables::Nftables::open().expect("netlink");
        for family in Family::ALL {
            assert!(nft.delete_table(family).expect("delete the table"));
        }
        Syncer::new()
            .expect("syncer")
            .sync(&c, &config(), true)
            .expect("a fresh cold sync");
    });
    for family in Family::ALL {
        let listed = ns.exec(&["nft", "list", "table", family.nft_name(), "nftproxy"]);
        let desired = dataplane::nft::build::build(&first, &config(), family).table;
        let rendered = render::table_text(&desired);
        // The draws, the fallback and the dispatch, as nft reads them back.
        let ip = family.nft_name();
        for want in [
            format!(
                "dnat {ip} to {ip} daddr . meta l4proto . th dport . numgen random mod 64 map @big-endpoints"
            ),
            format!(
                "dnat {ip} to {ip} daddr . meta l4proto . th dport . numgen random mod 1 map @big-endpoints"
            ),
            format!(
                "dnat {ip} to meta l4proto . th dport . numgen random mod 64 map @big-nodeport-endpoints"
            ),
            format!("{ip} daddr . meta l4proto . th dport @big-class-6 goto big-6"),
            format!("{ip} daddr . meta l4proto . th dport @big-local-class-5 goto big-local-5"),
            "meta l4proto . th dport @big-nodeport-class-6 goto big-nodeport-6".to_string(),
            "meta l4proto . th dport @big-local-nodeport-class-5 goto big-local-nodeport-5"
                .to_string(),
        ] {
            assert!(
                listed.contains(&want),
                "{family:?}: no `{want}` in\n{listed}"
            );
            assert!(
                rendered.contains(&want),
                "{family:?}: render lacks `{want}`"
            );
        }
        let jumps = listed.matches("jump big-draw-6").count();
        assert_eq!(jumps, dataplane::nft::build::DRAWS, "{family:?}");
        // Every element the kernel lists, the renderer writes (and the other way round).
        let elements = |text: &str| -> BTreeSet<String> {
            text.split([',', '{', '}', '\n'])
                .map(str::trim)
                .filter(|e| e.contains(" . ") && e.contains(" : ") && !e.contains("typeof"))
                .map(str::to_string)
                .collect()
        };
        assert_eq!(elements(&listed), elements(&rendered), "{family:?}");
        // The rendered text loads with `nft -f`.
        let other = Netns::new("flat-f");
        let path = std::env::temp_dir().join(format!("{}.nft", other.name));
        std::fs::write(&path, &rendered).unwrap();
        let (ok, _, err) = other.try_exec(&["nft", "-f", path.to_str().unwrap()]);
        std::fs::remove_file(&path).ok();
        assert!(ok, "{family:?}: nft -f refused the rendered table: {err}");
    }
}

#[test]
fn an_endpoint_change_sends_a_few_elements() {
    nftproxy_tests::require_root!();
    let ns = Netns::new("flat");
    ns.run(|| {
        let mut syncer = Syncer::new().expect("syncer");
        syncer
            .sync(&cluster(1000, 40), &config(), true)
            .expect("cold sync");
        // One endpoint more, one fewer: a handful of messages whatever the Service's size (each
        // family: the ClusterIP, external, load-balancer and NodePort lists, local and
        // cluster-wide, and the hairpin element).
        for web in [1001, 1000, 999] {
            let ops = sync_and_check(&mut syncer, &cluster(web, 40));
            for (family, n) in ops {
                assert!(n <= 12, "{family:?}: {n} messages for one endpoint");
            }
        }
    });
}

/// The daemon's drift monitor hears none of a large Service's change, which is a few ops of
/// hundreds of elements (the kernel would build a notification per element for it), and
/// still hears a small change.
#[test]
fn a_large_services_change_is_not_notified_to_the_drift_monitor() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use nftproxy::nftables::monitor::Monitor;

    nftproxy_tests::require_root!();
    let ns = Netns::new("flat");
    ns.run(|| {
        let mut syncer = Syncer::new().expect("syncer");
        let portid = syncer.portid().expect("an nftables syncer");
        let mut monitor = Monitor::open(portid).expect("open the monitor");
        let missed = Arc::new(AtomicUsize::new(0));
        let counter = missed.clone();
        syncer.set_quieter(monitor.quieter(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        syncer
            .sync(&cluster(20, 150), &config(), true)
            .expect("cold sync");
        monitor.drain();

        // 133 endpoints fewer, then more again: hundreds of elements in a few ops.
        for dns in [17, 150] {
            let ops = sync_and_check(&mut syncer, &cluster(20, dns));
            assert!(ops.values().all(|&n| n < 20), "{ops:?}");
            assert_eq!(monitor.drain(), 0, "notified of a large change ({dns})");
        }
        sync_and_check(&mut syncer, &cluster(20, 151));
        assert!(monitor.drain() > 0, "no notification of a small change");
        assert_eq!(missed.load(Ordering::SeqCst), 0);
    });
}
