use super::*;
use crate::convert;
use crate::nft::build::{LocalDetector, NodePortAddresses};
use std::fmt::Write as _;

/// The Services of kube-proxy's `TestOverallIPTablesRules` (reference §1.14 / §1.16).
const OVERALL: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: svc1, namespace: ns1}
spec: {clusterIP: 172.30.0.41, ports: [{name: p80, port: 80, protocol: TCP}]}
---
apiVersion: v1
kind: Service
metadata: {name: svc2, namespace: ns2}
spec:
  type: LoadBalancer
  clusterIP: 172.30.0.42
  externalIPs: [192.168.99.22]
  externalTrafficPolicy: Local
  healthCheckNodePort: 30000
  ports: [{name: p80, port: 80, protocol: TCP, nodePort: 3001}]
status: {loadBalancer: {ingress: [{ip: 1.2.3.4}]}}
---
apiVersion: v1
kind: Service
metadata: {name: svc3, namespace: ns3}
spec:
  type: NodePort
  clusterIP: 172.30.0.43
  ports: [{name: p80, port: 80, protocol: TCP, nodePort: 3003}]
---
apiVersion: v1
kind: Service
metadata: {name: svc4, namespace: ns4}
spec:
  type: NodePort
  clusterIP: 172.30.0.44
  externalIPs: [192.168.99.33]
  ports: [{name: p80, port: 80, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {name: svc5, namespace: ns5}
spec:
  type: LoadBalancer
  clusterIP: 172.30.0.45
  loadBalancerSourceRanges: [" 203.0.113.0/25"]
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 10800}}
  ports: [{name: p80, port: 80, protocol: TCP, nodePort: 3002}]
status: {loadBalancer: {ingress: [{ip: 5.6.7.8}]}}
---
apiVersion: v1
kind: Service
metadata: {name: svc6, namespace: ns6}
spec: {clusterIP: 172.30.0.46, ports: [{name: p80, port: 80, protocol: TCP}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc1-a, namespace: ns1, labels: {kubernetes.io/service-name: svc1}}
addressType: IPv4
ports: [{name: p80, port: 80, protocol: TCP}]
endpoints: [{addresses: [10.180.0.1]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc2-a, namespace: ns2, labels: {kubernetes.io/service-name: svc2}}
addressType: IPv4
ports: [{name: p80, port: 80, protocol: TCP}]
endpoints: [{addresses: [10.180.0.2]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc3-a, namespace: ns3, labels: {kubernetes.io/service-name: svc3}}
addressType: IPv4
ports: [{name: p80, port: 80, protocol: TCP}]
endpoints: [{addresses: [10.180.0.3]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc4-a, namespace: ns4, labels: {kubernetes.io/service-name: svc4}}
addressType: IPv4
ports: [{name: p80, port: 80, protocol: TCP}]
endpoints: [{addresses: [10.180.0.4]}, {addresses: [10.180.0.5], nodeName: test-node}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: svc5-a, namespace: ns5, labels: {kubernetes.io/service-name: svc5}}
addressType: IPv4
ports: [{name: p80, port: 80, protocol: TCP}]
endpoints: [{addresses: [10.180.0.3]}]
---
apiVersion: v1
kind: Node
metadata: {name: test-node}
status: {addresses: [{type: InternalIP, address: 192.168.0.2}]}
"#;

fn cluster(yaml: &str) -> Cluster {
    let (objects, skipped) = crate::input::parse_yaml(yaml).unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    let (cluster, skipped) = convert::cluster(&objects, "test-node", "");
    assert!(skipped.is_empty(), "{skipped:?}");
    cluster
}

fn config() -> BuildConfig {
    BuildConfig {
        node_name: "test-node".into(),
        local_detector: LocalDetector::ClusterCidr(vec!["10.0.0.0/8".parse().unwrap()]),
        // kube-proxy's iptables default: every local address.
        node_port_addresses: NodePortAddresses::Cidrs(vec![]),
        ..BuildConfig::default()
    }
}

fn rules<'a>(r: &'a IptRuleset, table: IptTable, chain: &str) -> &'a [String] {
    &r.tables[&table]
        .get(chain)
        .unwrap_or_else(|| panic!("no chain {chain} in {table:?}"))
        .rules
}

fn overall() -> IptRuleset {
    build(
        &cluster(OVERALL),
        &config(),
        &IptablesOptions::default(),
        Family::V4,
    )
}

#[test]
fn hashes_are_kube_proxys() {
    assert_eq!(port_proto_hash("ns1/svc1:p80", "tcp"), "XPGD46QRK7WJZT7O");
    assert_eq!(port_proto_hash("ns3/svc3:p80", "tcp"), "X27LE4BHSL4DOUIK");
    assert_eq!(port_proto_hash("ns4/svc4:p80", "tcp"), "4SW47YFZTEDKD3PK");
    assert_eq!(port_proto_hash("ns5/svc5:p80", "tcp"), "NUKIZ6OKUXPJNT4C");
    assert_eq!(
        endpoint_hash("ns4/svc4:p80", "tcp", "10.180.0.4:80".parse().unwrap()),
        "UKSFD7AGPMPPLUHC"
    );
    assert_eq!(
        endpoint_hash("ns4/svc4:p80", "tcp", "10.180.0.5:80".parse().unwrap()),
        "C6EBXVWJJZMIWKLZ"
    );
    // Names keep as much of the hash as iptables' 28 characters allow.
    assert_eq!(
        chain_name("SVC", "4SW47YFZTEDKD3PK"),
        "NFTPROXY-SVC-4SW47YFZTEDKD3P"
    );
    assert_eq!(
        chain_name("FW", "NUKIZ6OKUXPJNT4C"),
        "NFTPROXY-FW-NUKIZ6OKUXPJNT4C"
    );
    assert!(is_service_chain("NFTPROXY-SEP-UKSFD7AGPMPPLUH"));
    assert!(!is_service_chain("NFTPROXY-SERVICES"));
}

#[test]
fn overall_rules_have_kube_proxys_shape() {
    let r = overall();
    for table in r.tables.values() {
        for name in table.keys() {
            assert!(name.len() <= MAX_CHAIN_NAME, "{name}");
        }
    }
    let nat_services = rules(&r, IptTable::Nat, SERVICES);
    assert!(nat_services.contains(
        &"-m comment --comment \"ns1/svc1:p80 cluster IP\" -p tcp -m tcp -d 172.30.0.41 --dport 80 -j NFTPROXY-SVC-XPGD46QRK7WJZT7"
            .to_string()
    ));
    // The NodePort jump is last; localhost NodePorts are on (IPv4 default).
    assert_eq!(
        nat_services.last().unwrap(),
        "-m comment --comment \"nftproxy service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j NFTPROXY-NODEPORTS"
    );
    assert!(r.route_localnet);
    assert_eq!(
        r.tables[&IptTable::Nat][SERVICES].kind,
        ChainKind::Dispatch { tail: 1 }
    );
    assert!(rules(&r, IptTable::Nat, NODEPORTS).contains(
        &"-m comment --comment \"ns3/svc3:p80\" -p tcp -m tcp --dport 3003 -j NFTPROXY-EXT-X27LE4BHSL4DOUI"
            .to_string()
    ));
    assert_eq!(
        rules(&r, IptTable::Nat, "NFTPROXY-EXT-X27LE4BHSL4DOUI"),
        [
            "-m comment --comment \"masquerade traffic for ns3/svc3:p80 external destinations\" -j NFTPROXY-MARK-MASQ",
            "-j NFTPROXY-SVC-X27LE4BHSL4DOUI",
        ]
    );
    assert_eq!(
        rules(&r, IptTable::Nat, "NFTPROXY-SVC-4SW47YFZTEDKD3P"),
        [
            "-m comment --comment \"ns4/svc4:p80 cluster IP\" -p tcp -m tcp -d 172.30.0.44 --dport 80 ! -s 10.0.0.0/8 -j NFTPROXY-MARK-MASQ",
            "-m comment --comment \"ns4/svc4:p80 -> 10.180.0.4:80\" -m statistic --mode random --probability 0.5000000000 -j NFTPROXY-SEP-UKSFD7AGPMPPLUH",
            "-m comment --comment \"ns4/svc4:p80 -> 10.180.0.5:80\" -j NFTPROXY-SEP-C6EBXVWJJZMIWKL",
        ]
    );
    assert_eq!(
        rules(&r, IptTable::Nat, "NFTPROXY-SEP-UKSFD7AGPMPPLUH"),
        [
            "-m comment --comment \"ns4/svc4:p80\" -s 10.180.0.4 -j NFTPROXY-MARK-MASQ",
            "-m comment --comment \"ns4/svc4:p80\" -p tcp -m tcp -j DNAT --to-destination 10.180.0.4:80",
        ]
    );
    assert_eq!(
        rules(&r, IptTable::Nat, MARK_MASQ),
        ["-j MARK --or-mark 0x4000"]
    );
    assert_eq!(
        rules(&r, IptTable::Nat, POSTROUTING),
        [
            "-m mark ! --mark 0x4000/0x4000 -j RETURN",
            "-j MARK --xor-mark 0x4000",
            "-m comment --comment \"nftproxy service traffic requiring SNAT\" -j MASQUERADE --random-fully",
        ]
    );
    // svc2: eTP=Local without local endpoints: short-circuit rules only, then DROP in filter.
    let ext2 = rules(
        &r,
        IptTable::Nat,
        &chain_name("EXT", &port_proto_hash("ns2/svc2:p80", "tcp")),
    );
    assert_eq!(ext2.len(), 3, "{ext2:?}");
    assert!(ext2[0].contains("-s 10.0.0.0/8 -j NFTPROXY-SVC-"));
    assert!(ext2[1].contains("-m addrtype --src-type LOCAL -j NFTPROXY-MARK-MASQ"));
    assert!(ext2[2].contains("-m addrtype --src-type LOCAL -j NFTPROXY-SVC-"));
    let ext_services = rules(&r, IptTable::Filter, EXTERNAL_SERVICES);
    for want in [
        "-m comment --comment \"ns2/svc2:p80 has no local endpoints\" -m addrtype --dst-type LOCAL -p tcp -m tcp --dport 3001 -j DROP",
        "-m comment --comment \"ns2/svc2:p80 has no local endpoints\" -p tcp -m tcp -d 1.2.3.4 --dport 80 -j DROP",
        "-m comment --comment \"ns2/svc2:p80 has no local endpoints\" -p tcp -m tcp -d 192.168.99.22 --dport 80 -j DROP",
    ] {
        assert!(ext_services.contains(&want.to_string()), "{ext_services:?}");
    }
    assert_eq!(
        rules(&r, IptTable::Filter, NODEPORTS),
        [
            "-m comment --comment \"ns2/svc2:p80 health check node port\" -p tcp -m tcp --dport 30000 -j ACCEPT"
        ]
    );
    assert_eq!(
        rules(&r, IptTable::Filter, SERVICES),
        [
            "-m comment --comment \"ns6/svc6:p80 has no endpoints\" -p tcp -m tcp -d 172.30.0.46 --dport 80 -j REJECT"
        ]
    );
    assert_eq!(
        rules(&r, IptTable::Filter, PROXY_FIREWALL),
        [
            "-m comment --comment \"ns5/svc5:p80 traffic not accepted by NFTPROXY-FW-NUKIZ6OKUXPJNT4C\" -p tcp -m tcp -d 5.6.7.8 --dport 80 -j DROP"
        ]
    );
    assert_eq!(
        rules(&r, IptTable::Filter, FORWARD)[0],
        "-m conntrack --ctstate INVALID -j DROP"
    );
    // svc5: source ranges and affinity.
    let fw = rules(&r, IptTable::Nat, "NFTPROXY-FW-NUKIZ6OKUXPJNT4C");
    assert_eq!(
        fw,
        [
            "-m comment --comment \"ns5/svc5:p80 loadbalancer IP\" -s 203.0.113.0/25 -j NFTPROXY-EXT-NUKIZ6OKUXPJNT4",
            "-m comment --comment \"other traffic to ns5/svc5:p80 will be dropped by NFTPROXY-PROXY-FIREWALL\"",
        ]
    );
    let svc5 = rules(&r, IptTable::Nat, "NFTPROXY-SVC-NUKIZ6OKUXPJNT4");
    assert!(
        svc5[1].contains("-m recent --name NFTPROXY-SEP-"),
        "{svc5:?}"
    );
    assert!(svc5[1].contains("--rcheck --seconds 10800 --reap -j NFTPROXY-SEP-"));
    let sep5 = svc5[2].rsplit(' ').next().unwrap();
    assert!(
        rules(&r, IptTable::Nat, sep5)[1].contains("-m recent --name ")
            && rules(&r, IptTable::Nat, sep5)[1].contains(" --set -p tcp")
    );
    // No wrong-port reject, no unallocated-ClusterIP drop: svc1 has no filter rule at all.
    assert!(
        r.tables[&IptTable::Filter]
            .values()
            .flat_map(|c| &c.rules)
            .all(|rule| !rule.contains("172.30.0.41"))
    );
    assert_eq!(
        r.no_local_endpoints,
        NoLocalEndpoints {
            internal: 0,
            external: 1
        }
    );
}

#[test]
fn node_port_addresses_and_localhost() {
    let c = cluster(OVERALL);
    let tail = |r: &IptRuleset| r.tables[&IptTable::Nat][SERVICES].split().1.to_vec();
    // IPv6 never serves localhost NodePorts.
    let v6 = build(&c, &config(), &IptablesOptions::default(), Family::V6);
    assert!(
        tail(&v6)[0].ends_with("-m addrtype --dst-type LOCAL ! -d ::1/128 -j NFTPROXY-NODEPORTS")
    );
    assert!(!v6.route_localnet);
    assert!(!v6.tables[&IptTable::Filter].contains_key(LOCALNET_FIREWALL));
    // localhostNodePorts: false.
    let off = IptablesOptions {
        localhost_node_ports: false,
        ..IptablesOptions::default()
    };
    let v4 = build(&c, &config(), &off, Family::V4);
    assert!(tail(&v4)[0].ends_with("! -d 127.0.0.0/8 -j NFTPROXY-NODEPORTS"));
    assert!(!v4.route_localnet);
    // CIDRs: the local addresses inside them, loopback only with localhostNodePorts.
    let mut cfg = config();
    cfg.node_port_addresses = NodePortAddresses::Cidrs(vec![
        "127.0.0.0/8".parse().unwrap(),
        "192.168.0.0/24".parse().unwrap(),
    ]);
    cfg.local_addresses = ["127.0.0.1", "192.168.0.2", "10.9.9.9", "::1"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    let v4 = build(&c, &cfg, &IptablesOptions::default(), Family::V4);
    let t = tail(&v4);
    assert_eq!(t.len(), 2);
    assert!(t[0].ends_with("-d 127.0.0.1 -j NFTPROXY-NODEPORTS"));
    assert!(t[1].ends_with("-d 192.168.0.2 -j NFTPROXY-NODEPORTS"));
    assert!(v4.route_localnet);
    let v4 = build(&c, &cfg, &off, Family::V4);
    assert_eq!(tail(&v4).len(), 1);
    assert_eq!(
        v4.skipped_loopback,
        vec!["127.0.0.1".parse::<IpAddr>().unwrap()]
    );
    assert!(!v4.route_localnet);
    // Primary: the Node's IP only.
    cfg.node_port_addresses = NodePortAddresses::Primary;
    let v4 = build(&c, &cfg, &IptablesOptions::default(), Family::V4);
    assert_eq!(tail(&v4).len(), 1);
    assert!(tail(&v4)[0].ends_with("-d 192.168.0.2 -j NFTPROXY-NODEPORTS"));
    assert!(!v4.route_localnet);
}

/// `n` ClusterIP Services `ns/svc-i`, each with one endpoint (`endpoint(i)`).
fn many(n: usize, endpoint: impl Fn(usize) -> String) -> Cluster {
    let mut yaml = String::new();
    for i in 0..n {
        let _ = write!(
            yaml,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: svc-{i}, namespace: ns}}\n\
             spec: {{clusterIP: 172.30.{}.{}, ports: [{{name: http, port: 80, protocol: TCP}}]}}\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: svc-{i}-a, namespace: ns, labels: {{kubernetes.io/service-name: svc-{i}}}}}\n\
             addressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}]\n\
             endpoints: [{{addresses: [{}]}}]\n",
            i / 250,
            i % 250 + 1,
            endpoint(i)
        );
    }
    cluster(&yaml)
}

fn ep_of(i: usize) -> String {
    format!("10.180.{}.{}", i / 250, i % 250 + 1)
}

#[test]
fn partial_restores_touch_only_what_changed() {
    let opts = IptablesOptions::default();
    let before = build(&many(300, ep_of), &config(), &opts, Family::V4);
    let full = plan_full(&before, &Existing::default());
    assert!(full.full);
    assert_eq!(full.text.matches("COMMIT").count(), 2);
    assert!(full.text.starts_with("*filter\n"));
    // 300 Services: the dispatch rule, the SVC chain (masquerade + jump) and the SEP chain.
    assert!(full.rules_written[&IptTable::Nat] > 1500);
    // Nothing changed: nothing to restore.
    let written = before.tables.clone();
    assert!(plan_partial(&written, &before).is_empty());

    // One endpoint moves: its SVC chain is rewritten, the new SEP chain created, the old one
    // deleted; the dispatch chains are not touched.
    let after = build(
        &many(300, |i| if i == 7 { "10.99.0.7".into() } else { ep_of(i) }),
        &config(),
        &opts,
        Family::V4,
    );
    let p = plan_partial(&written, &after);
    assert!(!p.full);
    assert!(!p.text.contains("*filter"), "{}", p.text);
    assert_eq!(p.chains_written, 3, "{}", p.text);
    assert_eq!(p.chains_deleted, 1, "{}", p.text);
    assert_eq!(p.rules_written[&IptTable::Nat], 4, "{}", p.text);
    assert!(!p.text.contains(SERVICES), "{}", p.text);
    assert!(p.lines() <= 12, "{}", p.text);

    // A Service goes away: its dispatch rule is deleted, its chains flushed and deleted.
    let fewer = build(&many(299, ep_of), &config(), &opts, Family::V4);
    let p = plan_partial(&written, &fewer);
    assert_eq!(
        p.text.matches("-D NFTPROXY-SERVICES ").count(),
        1,
        "{}",
        p.text
    );
    assert_eq!(p.chains_deleted, 2, "{}", p.text);
    let x = p.text.find("-X ").unwrap();
    assert!(p.text.find("-D NFTPROXY-SERVICES").unwrap() < x);

    // A Service comes: one rule inserted at the top (the NodePort jump stays last).
    let more = build(&many(301, ep_of), &config(), &opts, Family::V4);
    let p = plan_partial(&written, &more);
    assert_eq!(
        p.text.matches("-I NFTPROXY-SERVICES 1 ").count(),
        1,
        "{}",
        p.text
    );
    assert_eq!(p.chains_written, 2, "{}", p.text);
    assert_eq!(p.rules_written[&IptTable::Nat], 5, "{}", p.text);

    // The Service loses its endpoints: dispatch rule out of nat, a REJECT into filter.
    let mut c = many(300, ep_of);
    c.slices.retain(|name, _| &*name.name != "svc-7-a");
    let gone = build(&c, &config(), &opts, Family::V4);
    let p = plan_partial(&written, &gone);
    assert!(
        p.text.contains("*filter\n-I NFTPROXY-SERVICES 1 "),
        "{}",
        p.text
    );
    assert!(p.text.contains("has no endpoints"), "{}", p.text);
    assert_eq!(
        p.text.matches("-D NFTPROXY-SERVICES ").count(),
        1,
        "{}",
        p.text
    );

    // The NodePort jump changes (an address appears): nat NFTPROXY-SERVICES is rewritten.
    let mut cfg = config();
    cfg.node_port_addresses = NodePortAddresses::Cidrs(vec!["192.168.0.0/24".parse().unwrap()]);
    cfg.local_addresses = vec!["192.168.0.2".parse().unwrap()];
    let a = build(&many(3, ep_of), &cfg, &opts, Family::V4);
    cfg.local_addresses.push("192.168.0.3".parse().unwrap());
    let b = build(&many(3, ep_of), &cfg, &opts, Family::V4);
    let p = plan_partial(&a.tables, &b);
    assert!(p.text.contains(":NFTPROXY-SERVICES - [0:0]"), "{}", p.text);
    assert_eq!(
        p.text.matches("-A NFTPROXY-SERVICES ").count(),
        5,
        "{}",
        p.text
    );
}

#[test]
fn full_restores_repair_jumps_and_delete_stale_chains() {
    let r = build(
        &many(2, ep_of),
        &config(),
        &IptablesOptions::default(),
        Family::V4,
    );
    let nat_jump = r
        .jumps
        .iter()
        .find(|j| j.table == IptTable::Nat && j.builtin == "PREROUTING")
        .unwrap();
    let save = format!(
        "# Generated by iptables-save\n*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
         :NFTPROXY-SERVICES - [0:0]\n:NFTPROXY-SVC-OLDOLDOLDOLDOLD - [0:0]\n:OTHER - [0:0]\n\
         -A PREROUTING {}\n-A PREROUTING {}\n-A PREROUTING -j OTHER\n\
         -A OUTPUT -m comment --comment \"old shape\" -j NFTPROXY-SERVICES\nCOMMIT\n",
        nat_jump.spec, nat_jump.spec
    );
    let existing = Existing::from_save(&save);
    assert_eq!(existing.jumps[&IptTable::Nat].len(), 3);
    let p = plan_full(&r, &existing);
    let nat = &p.text[p.text.find("*nat").unwrap()..];
    // One PREROUTING jump is kept, its duplicate and the old OUTPUT shape go.
    assert_eq!(nat.matches("-D PREROUTING ").count(), 1, "{nat}");
    assert!(nat.contains("-D OUTPUT -m comment --comment \"old shape\" -j NFTPROXY-SERVICES"));
    assert!(!nat.contains("-I PREROUTING"), "{nat}");
    assert!(nat.contains(
        "-I OUTPUT 1 -m comment --comment \"nftproxy service portals\" -j NFTPROXY-SERVICES"
    ));
    assert!(nat.contains("-I POSTROUTING 1 "));
    assert!(nat.contains(":NFTPROXY-SVC-OLDOLDOLDOLDOLD - [0:0]"));
    assert!(
        nat.trim_end()
            .ends_with("-X NFTPROXY-SVC-OLDOLDOLDOLDOLD\nCOMMIT"),
        "{nat}"
    );
    assert!(!nat.contains("OTHER"));
}

#[test]
fn removal_of_kube_proxy_leftovers() {
    let save = "\
*mangle
:PREROUTING ACCEPT [0:0]
:KUBE-IPTABLES-HINT - [0:0]
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-X27LE4BHSL4DOUIK - [0:0]
:KUBE-SEP-UKSFD7AGPMPPLUHC - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-POSTROUTING - [0:0]
:CNI-X - [0:0]
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING
-A KUBE-SERVICES -d 172.30.0.43/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-X27LE4BHSL4DOUIK
-A KUBE-SVC-X27LE4BHSL4DOUIK -j KUBE-SEP-UKSFD7AGPMPPLUHC
-A KUBE-SEP-UKSFD7AGPMPPLUHC -s 10.180.0.3/32 -j KUBE-MARK-MASQ
-A CNI-X -j KUBE-MARK-MASQ
COMMIT
";
    let saved = parse_save(save);
    assert!(saved["nat"].builtins.contains("PREROUTING"));
    let (text, removed) = plan_removal(&saved, is_kube_proxy_chain);
    // kubelet's hint stays; KUBE-MARK-MASQ stays because a CNI chain still uses it.
    assert!(!text.contains("KUBE-IPTABLES-HINT"));
    assert!(
        !removed.iter().any(|c| c.contains("KUBE-MARK-MASQ")),
        "{removed:?}"
    );
    assert!(removed.contains(&"mangle/KUBE-PROXY-CANARY".to_string()));
    assert!(removed.contains(&"nat/KUBE-SEP-UKSFD7AGPMPPLUHC".to_string()));
    assert!(text.contains(
        "-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n"
    ));
    assert!(text.contains("-X KUBE-POSTROUTING\n"));
    let (none, removed) = plan_removal(&saved, |c| c.starts_with(PREFIX));
    assert!(none.is_empty() && removed.is_empty());
}

#[test]
fn tokens_honour_quotes() {
    assert_eq!(
        tokens("-m comment --comment \"a b\" -j X"),
        ["-m", "comment", "--comment", "a b", "-j", "X"]
    );
    assert_eq!(
        jump_target("-m comment --comment \"-j Y\" -j X").as_deref(),
        Some("X")
    );
    assert_eq!(jump_target("-m comment --comment x"), None);
}
