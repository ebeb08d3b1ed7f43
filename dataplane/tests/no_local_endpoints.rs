//! kube-proxy's TestNoEndpointsMetric (reference §7.12): how many Service ports have endpoints,
//! but none on this node, per traffic policy — the counts behind
//! `kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy}`.

use nftproxy_dataplane::convert;
use nftproxy_dataplane::model::Cluster;
use nftproxy_dataplane::nft::build::{BuildConfig, LocalDetector, NoLocalEndpoints, build};
use nftproxy_dataplane::nft::ruleset::Family;

/// Service 172.30.1.1:80/TCP (type NodePort, nodePort 123, when eTP is set) with ready
/// endpoints 10.0.1.1, .2, .3 on these nodes; `None` = no EndpointSlice at all.
fn cluster(itp_local: bool, etp_local: bool, nodes: Option<&[&str]>) -> Cluster {
    let mut spec = String::from("clusterIP: 172.30.1.1\n");
    if itp_local {
        spec.push_str("    internalTrafficPolicy: Local\n");
    }
    if etp_local {
        spec.push_str(
            "    type: NodePort\n    externalTrafficPolicy: Local\n    \
             ports: [{name: p80, port: 80, protocol: TCP, nodePort: 123}]\n",
        );
    } else {
        spec.push_str("    ports: [{name: p80, port: 80, protocol: TCP}]\n");
    }
    let mut yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: svc1, namespace: ns1}}\nspec:\n    {spec}"
    );
    if let Some(nodes) = nodes {
        yaml.push_str(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {name: svc1-a, namespace: ns1, labels: {kubernetes.io/service-name: svc1}}\n\
             addressType: IPv4\nports: [{name: p80, port: 80, protocol: TCP}]\n",
        );
        yaml.push_str(if nodes.is_empty() {
            "endpoints: []\n"
        } else {
            "endpoints:\n"
        });
        for (i, node) in nodes.iter().enumerate() {
            yaml.push_str(&format!(
                "- {{addresses: [10.0.1.{}], conditions: {{ready: true}}, nodeName: {node}}}\n",
                i + 1
            ));
        }
    }
    let (objects, skipped) = nftproxy_dataplane::input::parse_yaml(&yaml).unwrap();
    assert!(skipped.is_empty(), "{skipped:?}\n{yaml}");
    let (cluster, skipped) = convert::cluster(&objects, "test-node", "");
    assert!(skipped.is_empty(), "{skipped:?}\n{yaml}");
    assert_eq!(cluster.services.len(), 1, "{yaml}");
    cluster
}

fn counts(cluster: &Cluster) -> (u64, u64) {
    let config = BuildConfig {
        node_name: "test-node".into(),
        local_detector: LocalDetector::ClusterCidr(vec!["10.0.0.0/8".parse().unwrap()]),
        ..BuildConfig::default()
    };
    // An IPv4-only Service counts nothing in the IPv6 table.
    assert_eq!(
        build(cluster, &config, Family::V6).no_local_endpoints,
        NoLocalEndpoints::default()
    );
    let n = build(cluster, &config, Family::V4).no_local_endpoints;
    (n.internal, n.external)
}

/// Case number, iTP Local, eTP Local, endpoint nodes, expected (internal, external).
type Case<'a> = (u8, bool, bool, Option<&'a [&'a str]>, (u64, u64));

#[test]
fn no_local_endpoints_counts() {
    let some_local: &[&str] = &["test-node", "node1", "node2"];
    let all_remote: &[&str] = &["node0", "node1", "node2"];
    #[rustfmt::skip]
    let cases: [Case; 8] = [
        (1, true,  false, Some(some_local), (0, 0)),
        (2, false, true,  Some(some_local), (0, 0)),
        (3, true,  true,  Some(some_local), (0, 0)),
        (4, true,  false, Some(all_remote), (1, 0)),
        (5, false, true,  Some(all_remote), (0, 1)),
        (6, true,  true,  Some(all_remote), (1, 1)),
        // No endpoints at all is the reject case, which counts as neither: no slice, and a
        // slice without endpoints.
        (7, true,  true,  None,             (0, 0)),
        (7, true,  true,  Some(&[]),        (0, 0)),
    ];
    for (case, itp, etp, nodes, want) in cases {
        let c = cluster(itp, etp, nodes);
        assert_eq!(
            counts(&c),
            want,
            "case {case}: iTP Local {itp}, eTP Local {etp}, endpoints on {nodes:?}"
        );
    }
}
