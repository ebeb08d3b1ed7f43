use std::collections::BTreeMap;
use std::net::IpAddr;

use serde_json::json;

use super::*;
use crate::convert::{Objects, cluster};
use crate::nft::build::{BuildConfig, build};
use crate::nft::ruleset::Family;

const NODE: &str = "node-a";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// Service `ns/web` (ClusterIP 172.30.0.10, TCP 80, NodePort 30080) with `eps` endpoints
/// (10.0.0.2 …) and affinity with `timeout` seconds, if any.
fn objects(eps: usize, timeout: Option<u32>) -> Objects {
    let mut spec = json!({
        "type": "NodePort", "clusterIP": "172.30.0.10", "clusterIPs": ["172.30.0.10"],
        "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080}],
    });
    if let Some(t) = timeout {
        spec["sessionAffinity"] = json!("ClientIP");
        spec["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": t}});
    }
    let endpoints: Vec<_> = (1..=eps)
        .map(|i| json!({"addresses": [format!("10.0.{}.{}", i / 250, i % 250 + 1)]}))
        .collect();
    let mut o = Objects::default();
    o.nodes.push(
        serde_json::from_value(json!({"metadata": {"name": NODE},
            "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.2"}]}}))
        .unwrap(),
    );
    o.services.push(
        serde_json::from_value(
            json!({"metadata": {"name": "web", "namespace": "ns"}, "spec": spec}),
        )
        .unwrap(),
    );
    o.slices.push(
        serde_json::from_value(json!({
            "metadata": {"name": "web-a", "namespace": "ns",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": endpoints,
        }))
        .unwrap(),
    );
    o
}

fn table(eps: usize, timeout: Option<u32>) -> Table {
    let (c, skipped) = cluster(&objects(eps, timeout), NODE, "");
    assert!(skipped.is_empty(), "{skipped:?}");
    let config = BuildConfig {
        node_name: NODE.into(),
        ..BuildConfig::default()
    };
    build(&c, &config, Family::V4).table
}

fn entry(client: &str, dest: &str, port: u16, endpoint: &str) -> Entry {
    Entry {
        client: ip(client),
        dest: ip(dest),
        proto: Proto::Tcp,
        port,
        endpoint: (ip(endpoint), 8080),
    }
}

#[test]
fn a_service_with_affinity_is_elements_only() {
    let plain = table(200, None);
    for eps in [1, 20, 200] {
        let t = table(eps, Some(600));
        assert_eq!(
            t.chains.keys().collect::<Vec<_>>(),
            plain.chains.keys().collect::<Vec<_>>(),
            "{eps} endpoints: the chains are the fixed ones"
        );
        let has = |set: &str, key: Key| t.sets[set].elements.contains_key(&key);
        let cip = Key::AddrProtoPort(ip("172.30.0.10"), Proto::Tcp, 80);
        let np = Key::ProtoPort(Proto::Tcp, 30080);
        let (services, nodeports) = timeout_sets(600);
        assert!(has(AFFINITY_SERVICES, cip) && has(services, cip));
        assert!(has(AFFINITY_NODEPORTS, np) && has(nodeports, np));
        // The timeout has its record rules: three protocols, two kinds of destination.
        assert_eq!(t.chains[SESSION_AFFINITY].rules.len(), 6);
    }
    assert!(!plain.sets.contains_key(timeout_sets(600).0));
    assert!(plain.chains[SESSION_AFFINITY].rules.is_empty());
    assert!(plain.sets[AFFINITY_SERVICES].elements.is_empty());
}

#[test]
fn entries_stay_while_their_endpoint_serves_their_destination() {
    let t = table(20, Some(600));
    let kept = [
        entry("10.1.0.1", "172.30.0.10", 80, "10.0.0.2"),
        // A NodePort entry, on any of the node's addresses.
        entry("10.1.0.1", "192.168.0.2", 30080, "10.0.0.21"),
    ];
    let stale = [
        // Not one of the Service's endpoints (any more).
        entry("10.1.0.2", "172.30.0.10", 80, "10.0.0.99"),
        entry("10.1.0.2", "192.168.0.2", 30080, "10.0.0.1"),
        // A destination without affinity: never looked up, and wrong should it get it.
        entry("10.1.0.3", "172.30.0.11", 80, "10.0.0.2"),
        entry("10.1.0.3", "172.30.0.10", 81, "10.0.0.2"),
    ];
    let all: Vec<Entry> = kept.iter().chain(&stale).copied().collect();
    assert_eq!(stale_entries(&t, &all), stale.to_vec());
    // Without affinity, every entry is stale.
    assert_eq!(stale_entries(&table(20, None), &all), all);
}

#[test]
fn a_cleanup_follows_endpoints_leaving_destinations_with_affinity() {
    // Three endpoints, 10.0.0.2 … 10.0.0.4, in `cluster-endpoints-3`.
    let t = table(3, Some(600));
    let cip = Key::AddrProtoPort(ip("172.30.0.10"), Proto::Tcp, 80);
    let other = Key::AddrProtoPort(ip("172.30.0.11"), Proto::Tcp, 80);
    let entry = |dest: Key, i: u16| dest.list_entry(i).unwrap();
    let ep = |s: &str| Some(Some(Value::Endpoint(ip(s), 8080)));
    let absent: Option<Option<Value>> = None;
    let list = "cluster-endpoints-3";
    let touched = |elements: &[(&str, Key, Option<Option<Value>>)]| {
        let mut out: BTreeMap<String, Vec<_>> = BTreeMap::new();
        for (set, key, was) in elements {
            out.entry(set.to_string())
                .or_default()
                .push((*key, was.clone()));
        }
        out.into_iter()
            .map(|(set, entries)| (set, entries.into_iter().collect()))
            .collect::<Delta>()
    };
    // An endpoint that left (index 2 held 10.0.0.9).
    assert!(cleanup_needed(
        &t,
        &touched(&[(list, entry(cip, 2), ep("10.0.0.9"))])
    ));
    // The list grew from two (in `cluster-endpoints-2`) to three: nothing left.
    let grew = [
        ("cluster-endpoints-2", entry(cip, 0), ep("10.0.0.2")),
        ("cluster-endpoints-2", entry(cip, 1), ep("10.0.0.3")),
        (list, entry(cip, 0), absent.clone()),
        (list, entry(cip, 1), absent.clone()),
        (list, entry(cip, 2), absent.clone()),
    ];
    assert!(!cleanup_needed(&t, &touched(&grew)));
    // The same endpoints moved between indices: nothing left.
    let moved = [
        (list, entry(cip, 0), ep("10.0.0.3")),
        (list, entry(cip, 1), ep("10.0.0.2")),
    ];
    assert!(!cleanup_needed(&t, &touched(&moved)));
    // A destination that gets affinity, not one that loses it.
    assert!(cleanup_needed(
        &t,
        &touched(&[(AFFINITY_SERVICES, cip, absent.clone())])
    ));
    assert!(!cleanup_needed(
        &t,
        &touched(&[(AFFINITY_SERVICES, other, Some(None))])
    ));
    // Destinations without affinity never call for one.
    assert!(!cleanup_needed(
        &t,
        &touched(&[(list, entry(other, 2), ep("10.0.0.9"))])
    ));
    assert!(!cleanup_needed(
        &table(3, None),
        &touched(&[(list, entry(cip, 2), ep("10.0.0.9"))])
    ));
    // A destination without affinity is skipped whole, and only it: the one after it in the
    // same map (its address is higher) is still looked at.
    let before = Key::AddrProtoPort(ip("172.30.0.9"), Proto::Tcp, 80);
    let mut run: Vec<_> = (0..3)
        .map(|i| (list, entry(before, i), absent.clone()))
        .collect();
    run.push((list, entry(cip, 2), ep("10.0.0.9")));
    assert!(cleanup_needed(&t, &touched(&run)));
}

#[test]
fn timeout_sets_are_named_once() {
    let (a, b) = timeout_sets(30);
    assert_eq!(
        (a, b),
        (
            "session-affinity-services-30",
            "session-affinity-nodeports-30"
        )
    );
    assert!(std::ptr::eq(a, timeout_sets(30).0));
    assert_eq!((timeout_of_set(a), timeout_of_set(b)), (Some(30), Some(30)));
    assert_eq!(timeout_of_set(AFFINITY_SERVICES), None);
    assert_eq!(timeout_of_set("session-affinity-services-x"), None);
}

#[test]
fn record_rules_put_node_ports_first() {
    let rules = record_rules(&BTreeSet::from([60, DEFAULT_TIMEOUT_SECS]));
    assert_eq!(rules.len(), 12);
    let nodeport = |r: &Rule| matches!(r.matches[1], Match::CtOriginalProtoPortInSet { .. });
    assert!(rules[..6].iter().all(nodeport));
    assert!(!rules[6..].iter().any(nodeport));
}
