use std::collections::BTreeSet;

use serde_json::{Value, json};

use super::*;
use crate::convert;
use crate::iptables::{self, IptTable, IptablesOptions};
use crate::model::Cluster;
use crate::nft::build::{BuildConfig, LocalDetector, build};
use crate::trace::{Host, Outcome, Packet, trace};

const DNS_IP: &str = "172.30.0.10";

/// A Service object: `extra` is merged into its spec (`_lb` becomes its load-balancer ingress).
fn service(ns: &str, name: &str, created: Option<&str>, cluster_ip: &str, extra: Value) -> Value {
    let mut spec = json!({
        "clusterIP": cluster_ip,
        "ports": [
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
        ],
    });
    let mut status = json!({});
    for (k, v) in extra.as_object().unwrap() {
        if k == "_lb" {
            status = json!({"loadBalancer": {"ingress": v}});
        } else {
            spec[k] = v.clone();
        }
    }
    let mut meta = json!({"name": name, "namespace": ns});
    if let Some(t) = created {
        meta["creationTimestamp"] = json!(t);
    }
    json!({"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec, "status": status})
}

/// An EndpointSlice of `name` with `n` endpoints `PREFIX.1` … `PREFIX.n`, ports 53 UDP and TCP.
fn slice(ns: &str, name: &str, prefix: &str, n: usize) -> Value {
    let endpoints: Vec<Value> = (1..=n)
        .map(|i| json!({"addresses": [format!("{prefix}.{i}")]}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-x"), "namespace": ns,
                     "labels": {"kubernetes.io/service-name": name}},
        "addressType": "IPv4",
        "ports": [
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
        ],
        "endpoints": endpoints,
    })
}

/// The model of `objects` and this node (192.168.0.2, which serves NodePorts).
fn cluster(objects: &[Value]) -> Cluster {
    let mut objects = objects.to_vec();
    objects.push(json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": "node"},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.2"}]},
    }));
    let text =
        serde_json::to_string(&json!({"apiVersion": "v1", "kind": "List", "items": objects}))
            .unwrap();
    let (objects, skipped) = crate::input::parse_yaml(&text).unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    let (cluster, skipped) = convert::cluster(&objects, "node", "");
    assert!(skipped.is_empty(), "{skipped:?}");
    cluster
}

fn config() -> BuildConfig {
    BuildConfig {
        node_name: "node".into(),
        local_detector: LocalDetector::ClusterCidr(vec!["10.0.0.0/8".parse().unwrap()]),
        ..BuildConfig::default()
    }
}

fn name(s: &str) -> ObjectName {
    let (ns, n) = s.split_once('/').unwrap();
    ObjectName::new(ns, n)
}

/// The endpoints (as `IP:port`) a new connection to `dst` may reach, traced through the
/// nftables ruleset, from a pod and from the node itself (both must agree).
fn reach(c: &Cluster, proto: Proto, dst: &str) -> BTreeSet<String> {
    let table = build(c, &config(), Family::V4).table;
    let host = Host {
        local_addresses: vec!["192.168.0.2".parse().unwrap()],
    };
    let mut seen = Vec::new();
    for src in ["10.9.0.9", "192.168.0.2"] {
        let pkt = Packet {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            proto,
            iif: None,
        };
        let t = trace(&table, &host, &pkt);
        let out: BTreeSet<String> = t
            .outcomes
            .iter()
            .map(|o| match o {
                Outcome::Endpoint { addr, .. } => addr.to_string(),
                other => other.to_string(),
            })
            .collect();
        seen.push(out);
    }
    assert_eq!(seen[0], seen[1], "pod and node disagree on {dst}");
    seen.remove(0)
}

/// The targets of iptables mode's `nat NFTPROXY-SERVICES` rules for `-d IP --dport PORT`.
fn ipt_targets(c: &Cluster, proto: Proto, dst: &str) -> Vec<String> {
    let (ip, port) = dst.split_once(':').unwrap();
    let needle = format!("-p {0} -m {0} -d {ip} --dport {port} ", proto.name());
    ipt_rule_targets(c, iptables::SERVICES, &needle)
}

/// The targets of iptables mode's rules in `nat` chain `chain` that contain `needle`.
fn ipt_rule_targets(c: &Cluster, chain: &str, needle: &str) -> Vec<String> {
    let r = iptables::build(c, &config(), &IptablesOptions::default(), Family::V4);
    r.tables[&IptTable::Nat][chain]
        .rules
        .iter()
        .filter(|rule| rule.contains(needle))
        .map(|rule| rule.rsplit(" -j ").next().unwrap().to_string())
        .collect()
}

/// iptables mode's Service chain of `ns/name:port` over `proto`.
fn svc_chain(svc: &str, port: &str, proto: Proto) -> String {
    iptables::chain_name(
        "SVC",
        &iptables::port_proto_hash(&format!("{svc}:{port}"), proto.name()),
    )
}

fn eps(prefix: &str, n: usize, port: u16) -> BTreeSet<String> {
    (1..=n).map(|i| format!("{prefix}.{i}:{port}")).collect()
}

const OLD: Option<&str> = Some("2020-01-01T00:00:00Z");
const NEW: Option<&str> = Some("2024-06-01T12:00:00Z");

#[test]
fn a_tenant_external_ip_on_kube_dns_cluster_ip_is_not_programmed() {
    // The attacker is older than kube-dns, sorts first by name, and has fewer, as many and
    // more endpoints (a chain of its own) than kube-dns; kube-dns too, up to a chain.
    for (dns_eps, evil_eps) in [(2, 1), (2, 3), (2, 20), (20, 1), (20, 30)] {
        let c = cluster(&[
            service("kube-system", "kube-dns", NEW, DNS_IP, json!({})),
            slice("kube-system", "kube-dns", "10.1.0", dns_eps),
            service(
                "a-tenant",
                "evil",
                OLD,
                "172.30.0.99",
                json!({"externalIPs": [DNS_IP]}),
            ),
            slice("a-tenant", "evil", "10.2.0", evil_eps),
        ]);
        for proto in [Proto::Udp, Proto::Tcp] {
            assert_eq!(
                reach(&c, proto, "172.30.0.10:53"),
                eps("10.1.0", dns_eps, 53),
                "{dns_eps}/{evil_eps} endpoints, {proto}"
            );
            // The attacker's own ClusterIP still works.
            assert_eq!(
                reach(&c, proto, "172.30.0.99:53"),
                eps("10.2.0", evil_eps, 53)
            );
            // iptables mode decides the same.
            let dns_port = if proto == Proto::Udp {
                "dns"
            } else {
                "dns-tcp"
            };
            assert_eq!(
                ipt_targets(&c, proto, "172.30.0.10:53"),
                [svc_chain("kube-system/kube-dns", dns_port, proto)]
            );
        }
        let sup = suppressed(&c.services, &c.services[&name("a-tenant/evil")]);
        assert!(sup.external(DNS_IP.parse().unwrap(), Proto::Udp, 53));
        assert!(sup.external(DNS_IP.parse().unwrap(), Proto::Tcp, 8080));
        assert_eq!(
            sup.cluster_ip(&c.services[&name("a-tenant/evil")], Family::V4),
            Some("172.30.0.99".parse().unwrap())
        );
        assert!(suppressed(&c.services, &c.services[&name("kube-system/kube-dns")]).is_empty());
    }
}

#[test]
fn the_conflict_names_both_services_and_the_rule() {
    let c = cluster(&[
        service("kube-system", "kube-dns", NEW, DNS_IP, json!({})),
        service(
            "tenant",
            "evil",
            OLD,
            "172.30.0.99",
            json!({"externalIPs": [DNS_IP]}),
        ),
    ]);
    let all = conflicts(&c.services);
    let want = |proto| Conflict {
        kind: ConflictKind::ExternalIp,
        frontend: Frontend::Addr(DNS_IP.parse().unwrap(), proto, 53),
        winner: name("kube-system/kube-dns"),
        losers: vec![name("tenant/evil")],
        rule: Rule::ClusterIpKeepsItsTraffic,
    };
    assert_eq!(all, vec![want(Proto::Tcp), want(Proto::Udp)]);
    let text = all[1].to_string();
    for part in [
        "external-ip",
        "172.30.0.10:53/udp",
        "tenant/evil",
        "kube-system/kube-dns",
        "a ClusterIP keeps its own traffic",
    ] {
        assert!(text.contains(part), "{text}");
    }
    let n = counts(&all);
    assert_eq!(n[&ConflictKind::ExternalIp], 2);
    assert_eq!(n[&ConflictKind::ClusterIp], 0);
    assert_eq!(n[&ConflictKind::LoadBalancerIp], 0);
}

#[test]
fn a_load_balancer_ip_on_a_cluster_ip_is_not_programmed() {
    for evil_eps in [1, 3, 20] {
        let c = cluster(&[
            service("kube-system", "kube-dns", NEW, DNS_IP, json!({})),
            slice("kube-system", "kube-dns", "10.1.0", 2),
            service(
                "tenant",
                "evil",
                OLD,
                "172.30.0.99",
                json!({"type": "LoadBalancer", "_lb": [{"ip": DNS_IP}, {"ip": "203.0.113.7"}],
                       "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053}]}),
            ),
            slice("tenant", "evil", "10.2.0", evil_eps),
        ]);
        assert_eq!(
            reach(&c, Proto::Udp, "172.30.0.10:53"),
            eps("10.1.0", 2, 53)
        );
        // Its other load-balancer IP and its NodePort still work.
        assert_eq!(
            reach(&c, Proto::Udp, "203.0.113.7:53"),
            eps("10.2.0", evil_eps, 53)
        );
        assert_eq!(
            reach(&c, Proto::Udp, "192.168.0.2:30053"),
            eps("10.2.0", evil_eps, 53)
        );
        assert_eq!(
            ipt_targets(&c, Proto::Udp, "172.30.0.10:53"),
            [svc_chain("kube-system/kube-dns", "dns", Proto::Udp)]
        );
        let all = conflicts(&c.services);
        assert_eq!(all.len(), 1, "{all:?}");
        assert_eq!(all[0].kind, ConflictKind::LoadBalancerIp);
        assert_eq!(all[0].winner, name("kube-system/kube-dns"));
    }
}

#[test]
fn of_two_services_with_one_cluster_ip_the_older_keeps_it() {
    let ip = "172.30.0.20";
    // Whatever the names, the input order and the endpoint counts.
    for (older, newer) in [("ns/a", "ns/b"), ("ns/b", "ns/a"), ("zz/x", "aa/y")] {
        for (older_eps, newer_eps) in [(1, 2), (2, 1), (20, 1), (1, 20)] {
            for reversed in [false, true] {
                let (on, oname) = older.split_once('/').unwrap();
                let (nn, nname) = newer.split_once('/').unwrap();
                let mut objects = vec![
                    service(on, oname, OLD, ip, json!({})),
                    slice(on, oname, "10.1.0", older_eps),
                    service(nn, nname, NEW, ip, json!({"externalIPs": ["198.51.100.1"]})),
                    slice(nn, nname, "10.2.0", newer_eps),
                ];
                if reversed {
                    objects.reverse();
                }
                let c = cluster(&objects);
                assert_eq!(
                    reach(&c, Proto::Tcp, "172.30.0.20:53"),
                    eps("10.1.0", older_eps, 53),
                    "{older} {older_eps} eps, {newer} {newer_eps} eps"
                );
                // The loser keeps its external IP.
                assert_eq!(
                    reach(&c, Proto::Tcp, "198.51.100.1:53"),
                    eps("10.2.0", newer_eps, 53)
                );
                assert_eq!(
                    ipt_targets(&c, Proto::Tcp, "172.30.0.20:53"),
                    [svc_chain(older, "dns-tcp", Proto::Tcp)]
                );
                let all = conflicts(&c.services);
                assert_eq!(
                    all,
                    vec![Conflict {
                        kind: ConflictKind::ClusterIp,
                        frontend: Frontend::ClusterIp(ip.parse().unwrap()),
                        winner: name(older),
                        losers: vec![name(newer)],
                        rule: Rule::OldestWins,
                    }]
                );
            }
        }
    }
}

#[test]
fn one_external_ip_and_port_goes_to_the_older_service() {
    let ext = json!({"externalIPs": ["198.51.100.1"]});
    let c = cluster(&[
        service("b", "old", OLD, "172.30.0.1", ext.clone()),
        slice("b", "old", "10.1.0", 1),
        service("a", "new", NEW, "172.30.0.2", ext.clone()),
        slice("a", "new", "10.2.0", 3),
    ]);
    for proto in [Proto::Udp, Proto::Tcp] {
        assert_eq!(reach(&c, proto, "198.51.100.1:53"), eps("10.1.0", 1, 53));
    }
    let all = conflicts(&c.services);
    assert_eq!(all.len(), 2);
    assert!(all.iter().all(|x| x.winner == name("b/old")
        && x.losers == [name("a/new")]
        && x.rule == Rule::OldestWins
        && x.kind == ConflictKind::ExternalIp));

    // An external IP against a load-balancer IP: the same pool, the older wins.
    let c = cluster(&[
        service("b", "old", NEW, "172.30.0.1", ext.clone()),
        service(
            "a",
            "lb",
            OLD,
            "172.30.0.2",
            json!({"type": "LoadBalancer", "_lb": [{"ip": "198.51.100.1"}]}),
        ),
        slice("a", "lb", "10.2.0", 1),
    ]);
    assert_eq!(
        reach(&c, Proto::Udp, "198.51.100.1:53"),
        eps("10.2.0", 1, 53)
    );
    assert!(
        conflicts(&c.services)
            .iter()
            .all(|x| x.kind == ConflictKind::ExternalIp && x.winner == name("a/lb"))
    );
}

#[test]
fn one_external_ip_on_different_ports_is_no_conflict() {
    let c = cluster(&[
        service(
            "a",
            "dns",
            OLD,
            "172.30.0.1",
            json!({"externalIPs": ["198.51.100.1"]}),
        ),
        slice("a", "dns", "10.1.0", 1),
        service(
            "b",
            "web",
            NEW,
            "172.30.0.2",
            json!({"externalIPs": ["198.51.100.1"], "ports": [{"name": "dns", "port": 80}]}),
        ),
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-x", "namespace": "b",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "dns", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.2.0.1"]}],
        }),
    ]);
    assert!(c.services.is_shared(&"198.51.100.1".parse().unwrap()));
    assert!(conflicts(&c.services).is_empty());
    for svc in c.services.values() {
        assert!(suppressed(&c.services, svc).is_empty(), "{}", svc.name);
    }
    assert_eq!(
        reach(&c, Proto::Tcp, "198.51.100.1:53"),
        eps("10.1.0", 1, 53)
    );
    assert_eq!(
        reach(&c, Proto::Tcp, "198.51.100.1:80"),
        eps("10.2.0", 1, 8080)
    );
}

#[test]
fn missing_timestamps_lose_to_any_and_then_names_decide() {
    let ip = "172.30.0.20";
    // "a/first" sorts first but has no timestamp: the timestamped one wins.
    let c = cluster(&[
        service("a", "first", None, ip, json!({})),
        service("z", "last", NEW, ip, json!({})),
    ]);
    assert_eq!(conflicts(&c.services)[0].winner, name("z/last"));
    // Neither has one: namespace/name decides.
    let c = cluster(&[
        service("z", "last", None, ip, json!({})),
        service("a", "first", None, ip, json!({})),
    ]);
    assert_eq!(conflicts(&c.services)[0].winner, name("a/first"));
    // One timestamp: namespace before name.
    let c = cluster(&[
        service("b", "a", OLD, ip, json!({})),
        service("a", "b", OLD, ip, json!({})),
    ]);
    assert_eq!(conflicts(&c.services)[0].winner, name("a/b"));
}

#[test]
fn an_external_ip_equal_to_its_own_cluster_ip_is_no_conflict() {
    let c = cluster(&[
        service(
            "a",
            "self",
            OLD,
            "172.30.0.1",
            json!({"externalIPs": ["172.30.0.1"]}),
        ),
        slice("a", "self", "10.1.0", 2),
    ]);
    assert!(conflicts(&c.services).is_empty());
    let svc = &c.services[&name("a/self")];
    assert!(suppressed(&c.services, svc).external("172.30.0.1".parse().unwrap(), Proto::Udp, 53));
    assert_eq!(reach(&c, Proto::Udp, "172.30.0.1:53"), eps("10.1.0", 2, 53));
}

#[test]
fn the_address_index_follows_inserts_updates_and_removals() {
    let mut c = cluster(&[
        service("kube-system", "kube-dns", NEW, DNS_IP, json!({})),
        service(
            "tenant",
            "evil",
            OLD,
            "172.30.0.99",
            json!({"externalIPs": [DNS_IP]}),
        ),
    ]);
    let dns: IpAddr = DNS_IP.parse().unwrap();
    let claimants = |c: &Cluster| -> Vec<String> {
        c.services
            .claimants(&dns)
            .iter()
            .map(|s| s.name.to_string())
            .collect()
    };
    // Oldest first.
    assert_eq!(claimants(&c), ["tenant/evil", "kube-system/kube-dns"]);
    assert_eq!(c.services.shared_addrs().collect::<Vec<_>>(), [&dns]);
    let before = c.clone();
    // The tenant drops the external IP.
    let mut evil = Service::clone(&c.services[&name("tenant/evil")]);
    evil.external_ips = Box::default();
    c.services.insert(evil.name.clone(), evil);
    assert_eq!(claimants(&c), ["kube-system/kube-dns"]);
    assert!(!c.services.is_shared(&dns) && c.services.shared_addrs().next().is_none());
    // A snapshot keeps its own index.
    assert_eq!(claimants(&before), ["tenant/evil", "kube-system/kube-dns"]);
    assert_ne!(before, c);
    c.services.remove(&name("kube-system/kube-dns"));
    assert!(c.services.claimants(&dns).is_empty());
    assert_eq!(c.services.len(), 1);
}

#[test]
fn neighbours_are_the_other_claimants() {
    let c = cluster(&[
        service("kube-system", "kube-dns", NEW, DNS_IP, json!({})),
        service(
            "tenant",
            "evil",
            OLD,
            "172.30.0.99",
            json!({"externalIPs": [DNS_IP]}),
        ),
        service("other", "alone", OLD, "172.30.0.50", json!({})),
    ]);
    let of = |n: &str| -> Vec<String> {
        neighbours(&c.services, &c.services[&name(n)])
            .map(|s| s.name.to_string())
            .collect()
    };
    assert_eq!(of("tenant/evil"), ["kube-system/kube-dns"]);
    assert_eq!(of("kube-system/kube-dns"), ["tenant/evil"]);
    assert!(of("other/alone").is_empty());
    let dns = &c.services[&name("kube-system/kube-dns")];
    let mut moved = Service::clone(dns);
    assert!(!claims_differ(Some(dns), Some(&moved)));
    moved.affinity_timeout = Some(10);
    assert!(
        !claims_differ(Some(dns), Some(&moved)),
        "affinity decides no conflict"
    );
    moved.ports = moved.ports[1..].into();
    assert!(claims_differ(Some(dns), Some(&moved)));
    assert!(claims_differ(None, Some(dns)));
}

/// A NodePort Service (ports 53 UDP and TCP) whose ports have node ports `udp` and `tcp`.
fn node_port_service(
    ns: &str,
    n: &str,
    created: Option<&str>,
    ip: &str,
    udp: u16,
    tcp: u16,
) -> Value {
    service(
        ns,
        n,
        created,
        ip,
        json!({"type": "NodePort", "ports": [
            {"name": "dns", "port": 53, "protocol": "UDP", "nodePort": udp},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP", "nodePort": tcp},
        ]}),
    )
}

/// The targets of iptables mode's `nat NFTPROXY-NODEPORTS` rules for `--dport PORT`.
fn ipt_node_port_targets(c: &Cluster, proto: Proto, port: u16) -> Vec<String> {
    let needle = format!("-p {0} -m {0} --dport {port} ", proto.name());
    ipt_rule_targets(c, iptables::NODEPORTS, &needle)
}

#[test]
fn one_node_port_goes_to_the_older_service_in_both_modes() {
    // Named so that the newer Service comes last (a full build's last write) and first (the
    // first iptables rule) alike: only the policy decides.
    for (old, new) in [("a/old", "b/new"), ("b/old", "a/new")] {
        let (old_ns, old_n) = old.split_once('/').unwrap();
        let (new_ns, new_n) = new.split_once('/').unwrap();
        let c = cluster(&[
            node_port_service(old_ns, old_n, OLD, "172.30.0.1", 30053, 30054),
            slice(old_ns, old_n, "10.1.0", 2),
            node_port_service(new_ns, new_n, NEW, "172.30.0.2", 30053, 30054),
            slice(new_ns, new_n, "10.2.0", 2),
        ]);
        for (proto, port) in [(Proto::Udp, 30053), (Proto::Tcp, 30054)] {
            let dst = format!("192.168.0.2:{port}");
            assert_eq!(
                reach(&c, proto, &dst),
                eps("10.1.0", 2, 53),
                "{old} {proto:?}"
            );
            let ext = |svc: &str, p: &str| {
                iptables::chain_name(
                    "EXT",
                    &iptables::port_proto_hash(&format!("{svc}:{p}"), proto.name()),
                )
            };
            let p = if proto == Proto::Udp {
                "dns"
            } else {
                "dns-tcp"
            };
            assert_eq!(ipt_node_port_targets(&c, proto, port), [ext(old, p)]);
        }
        // The loser keeps its ClusterIP.
        assert_eq!(reach(&c, Proto::Udp, "172.30.0.2:53"), eps("10.2.0", 2, 53));
        let all = conflicts(&c.services);
        assert_eq!(all.len(), 2, "{all:?}");
        // In protocol order, then port order.
        for (x, frontend) in all.iter().zip([
            Frontend::NodePort(Proto::Tcp, 30054),
            Frontend::NodePort(Proto::Udp, 30053),
        ]) {
            assert_eq!(x.kind, ConflictKind::NodePort);
            assert_eq!(x.frontend, frontend);
            assert_eq!(x.winner, name(old));
            assert_eq!(x.losers, [name(new)]);
            assert_eq!(x.rule, Rule::OldestWins);
        }
        assert_eq!(counts(&all)[&ConflictKind::NodePort], 2);
        assert!(
            all[0]
                .to_string()
                .starts_with(&format!("node-port NodePort 30054/tcp: {old} keeps it")),
            "{}",
            all[0]
        );
    }
}

#[test]
fn one_node_port_on_two_protocols_is_no_conflict() {
    // UDP 30053 for one Service, TCP 30053 for the other: two frontends.
    let c = cluster(&[
        node_port_service("a", "udp", OLD, "172.30.0.1", 30053, 30060),
        slice("a", "udp", "10.1.0", 1),
        node_port_service("b", "tcp", NEW, "172.30.0.2", 30061, 30053),
        slice("b", "tcp", "10.2.0", 1),
    ]);
    assert_eq!(
        reach(&c, Proto::Udp, "192.168.0.2:30053"),
        eps("10.1.0", 1, 53)
    );
    assert_eq!(
        reach(&c, Proto::Tcp, "192.168.0.2:30053"),
        eps("10.2.0", 1, 53)
    );
    assert!(conflicts(&c.services).is_empty());
}

#[test]
fn the_node_port_index_follows_updates_and_names_neighbours() {
    let mut c = cluster(&[
        node_port_service("a", "old", OLD, "172.30.0.1", 30053, 30054),
        node_port_service("b", "new", NEW, "172.30.0.2", 30053, 30055),
    ]);
    let claimants = |c: &Cluster, proto, port| -> Vec<String> {
        c.services
            .node_port_claimants(proto, port)
            .iter()
            .map(|s| s.name.to_string())
            .collect()
    };
    assert_eq!(claimants(&c, Proto::Udp, 30053), ["a/old", "b/new"]);
    assert_eq!(claimants(&c, Proto::Tcp, 30055), ["b/new"]);
    assert_eq!(
        c.services.shared_node_ports().collect::<Vec<_>>(),
        [&(Proto::Udp, 30053)]
    );
    let of = |c: &Cluster, n: &str| -> Vec<String> {
        neighbours(&c.services, &c.services[&name(n)])
            .map(|s| s.name.to_string())
            .collect()
    };
    assert_eq!(of(&c, "b/new"), ["a/old"]);
    let old = c.services[&name("a/old")].clone();
    // Moving a node port changes who may claim what.
    let mut moved = Service::clone(&old);
    let mut ports = moved.ports.to_vec();
    ports[0].node_port = Some(30056);
    moved.ports = ports.into();
    assert!(claims_differ(Some(&old), Some(&moved)));
    c.services.insert(moved.name.clone(), moved);
    assert_eq!(claimants(&c, Proto::Udp, 30053), ["b/new"]);
    assert!(!c.services.is_node_port_shared(Proto::Udp, 30053));
    assert!(c.services.shared_node_ports().next().is_none());
    assert!(of(&c, "b/new").is_empty());
    assert!(conflicts(&c.services).is_empty());
    c.services.remove(&name("b/new"));
    assert!(c.services.node_port_claimants(Proto::Udp, 30053).is_empty());
}

#[test]
fn a_change_of_a_service_sharing_a_node_port_is_planned_alone() {
    use crate::nft::desired::{Desired, Updated};
    let objects = |n_new: usize| {
        vec![
            node_port_service("a", "old", OLD, "172.30.0.1", 30053, 30054),
            slice("a", "old", "10.1.0", 2),
            node_port_service("b", "new", NEW, "172.30.0.2", 30053, 30054),
            slice("b", "new", "10.2.0", n_new),
        ]
    };
    let before = cluster(&objects(2));
    let mut desired = Desired::build(&before, &config(), Family::V4);
    // Before NodePorts were resolved by the policy, both Services wrote the node ports'
    // elements, and every change of either rebuilt the whole table.
    for n in [3, 1, 2] {
        let after = cluster(&objects(n));
        let updated = desired.update(&after, &config(), [&name("b/new")]);
        assert!(
            matches!(updated, Updated::Scope(_)),
            "{n}: not a partial update"
        );
        assert_eq!(desired.table(), &build(&after, &config(), Family::V4).table);
        assert_eq!(
            reach(&after, Proto::Udp, "192.168.0.2:30053"),
            eps("10.1.0", 2, 53)
        );
        assert_eq!(
            reach(&after, Proto::Udp, "172.30.0.2:53"),
            eps("10.2.0", n, 53)
        );
    }
}
