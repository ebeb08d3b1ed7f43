use super::*;
use crate::input::parse_yaml;
use std::collections::BTreeSet;

/// `service` with the object's own name and no proxy name.
fn convert(svc: &core::Service) -> Result<Service, Skip> {
    service(svc, object_name(&svc.metadata), &mut Shared::default(), "")
}

#[test]
fn sloppy_ips_parse_leading_zeros_as_decimal() {
    assert_eq!(
        parse_ip_sloppy("172.30.0.041"),
        Some("172.30.0.41".parse().unwrap())
    );
    assert_eq!(
        parse_ip_sloppy("010.180.00.001"),
        Some("10.180.0.1".parse().unwrap())
    );
    assert_eq!(
        parse_ip_sloppy(" 1.2.3.4 "),
        Some("1.2.3.4".parse().unwrap())
    );
    assert_eq!(parse_ip_sloppy("fd00::1"), Some("fd00::1".parse().unwrap()));
    assert_eq!(parse_ip_sloppy("1.2.3.256"), None);
    assert_eq!(parse_ip_sloppy("1.2.3"), None);
    assert_eq!(parse_ip_sloppy("1.2.3.0004"), None);
    assert_eq!(
        parse_cidr_sloppy(" 203.0.113.000/025"),
        Some("203.0.113.0/25".parse().unwrap())
    );
    assert_eq!(
        parse_cidr_sloppy("10.1.2.3/8"),
        Some("10.0.0.0/8".parse().unwrap())
    );
}

#[test]
fn names_the_kernel_would_refuse_are_refused_here() {
    let svc = |ns: &str, name: &str, port: &str| -> core::Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": "172.30.0.1", "ports": [{"name": port, "port": 80}]}
        }))
        .unwrap()
    };
    let long = "a".repeat(MAX_NAME_LEN + 1);
    let ok = "a".repeat(MAX_NAME_LEN);
    assert!(convert(&svc(&ok, &ok, &ok)).is_ok());
    for (s, field) in [
        (svc(&long, "web", "http"), "metadata.namespace"),
        (svc("ns", &long, "http"), "metadata.name"),
        (svc("ns", "web", &long), "spec.ports[0].name"),
        (svc("ns", "we/b", "http"), "metadata.name"),
        (svc("ns", "web", "ht\ntp"), "spec.ports[0].name"),
    ] {
        let err = convert(&s).unwrap_err().to_string();
        assert!(err.contains(field), "{err}");
    }
}

#[test]
fn malformed_services_are_skipped_with_reasons() {
    let yaml = r#"
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: good, namespace: ns}
  spec: {clusterIP: 172.30.0.041, ports: [{port: 80}]}
- apiVersion: v1
  kind: Service
  metadata: {name: badip, namespace: ns}
  spec: {clusterIP: 172.30.0.300, ports: [{port: 80}]}
- apiVersion: v1
  kind: Service
  metadata: {name: port0, namespace: ns}
  spec: {clusterIP: 172.30.0.2, ports: [{port: 0}]}
- apiVersion: v1
  kind: Service
  metadata: {name: proto, namespace: ns}
  spec: {clusterIP: 172.30.0.3, ports: [{port: 80, protocol: ICMP}]}
- apiVersion: v1
  kind: Service
  metadata: {name: schema, namespace: ns}
  spec: {clusterIP: 172.30.0.4, ports: [{port: eighty}]}
- apiVersion: v1
  kind: Service
  metadata: {name: headless, namespace: ns}
  spec: {clusterIP: None, ports: [{port: 80}]}
"#;
    let (objects, mut skipped) = parse_yaml(yaml).unwrap();
    let (cluster, more) = cluster(&objects, "node", "");
    skipped.extend(more);
    assert_eq!(
        cluster
            .services
            .keys()
            .map(|k| k.to_string())
            .collect::<Vec<_>>(),
        vec!["ns/good"]
    );
    assert_eq!(
        *cluster.services[&ObjectName::new("ns", "good")].cluster_ips,
        ["172.30.0.41".parse::<IpAddr>().unwrap()]
    );
    let mut names: Vec<String> = skipped.iter().map(|s| s.name.clone()).collect();
    names.sort();
    assert_eq!(names, vec!["ns/badip", "ns/port0", "ns/proto", "ns/schema"]);
    let text: Vec<String> = skipped.iter().map(|s| s.to_string()).collect();
    assert!(
        text.iter()
            .any(|t| t.contains("ns/proto") && t.contains("ICMP")),
        "{text:?}"
    );
    assert!(
        text.iter()
            .any(|t| t.contains("ns/port0") && t.contains("out of range"))
    );
}

/// Each kind of invalid object carries its metric label (`nftproxy_invalid_objects`'s
/// `reason`), whatever its message says.
#[test]
fn invalid_objects_carry_their_metric_label() {
    let service = |spec: serde_json::Value| -> Skip {
        let svc: core::Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": spec,
        }))
        .unwrap();
        convert(&svc).unwrap_err()
    };
    let port = |p: serde_json::Value| serde_json::json!({"clusterIP": "172.30.0.1", "ports": [p]});
    let cases = [
        (
            service(serde_json::json!({"clusterIP": "1.2.3"})),
            "invalid_ip",
        ),
        (
            service(
                serde_json::json!({"clusterIP": "172.30.0.1", "externalIPs": ["unknown protocol"]}),
            ),
            "invalid_ip",
        ),
        (
            service(
                serde_json::json!({"clusterIP": "172.30.0.1", "loadBalancerSourceRanges": ["x"]}),
            ),
            "invalid_cidr",
        ),
        (
            service(port(serde_json::json!({"port": 0}))),
            "port_out_of_range",
        ),
        (
            service(port(serde_json::json!({"port": 80, "protocol": "ICMP"}))),
            "unknown_protocol",
        ),
        (
            service(
                serde_json::json!({"clusterIP": "172.30.0.1", "ports": [{"port": 80, "name": "a"}, {"port": 80, "name": "b"}]}),
            ),
            "duplicate_port",
        ),
        (
            service(serde_json::json!({"type": "Weird", "clusterIP": "172.30.0.1"})),
            "unknown_value",
        ),
        (
            service(serde_json::json!({"clusterIPs": ["172.30.0.1", "172.30.0.2"]})),
            "other",
        ),
        (
            service(
                serde_json::json!({"clusterIP": "172.30.0.1", "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}}}),
            ),
            "port_out_of_range",
        ),
    ];
    for (skip, label) in cases {
        assert!(matches!(skip, Skip::Invalid(..)), "{skip}");
        assert_eq!(skip.label(), label, "{skip}");
    }
    let no_spec: core::Service =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "web"}})).unwrap();
    assert_eq!(service_label(&no_spec), "missing_field");
    let (_, skipped) = parse_yaml(
        "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {ports: [{port: eighty}]}\n",
    )
    .unwrap();
    assert_eq!(skipped[0].skip.label(), "schema");
    assert_eq!(Skip::Ignored("headless").label(), "headless");
    let labels: BTreeSet<&str> = Invalid::ALL.iter().map(|k| k.label()).collect();
    assert_eq!(labels.len(), Invalid::ALL.len());
}

fn service_label(svc: &core::Service) -> &'static str {
    convert(svc).unwrap_err().label()
}

#[test]
fn slices_of_other_proxies_and_headless_services_are_ignored() {
    let slice = |name: &str, extra_label: &str| {
        format!(
            r#"
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: {name}
    namespace: ns
    labels: {{kubernetes.io/service-name: web{extra_label}}}
  addressType: IPv4
  ports: [{{port: 80}}]
  endpoints: [{{addresses: [10.0.0.1]}}]"#
        )
    };
    let yaml = format!(
        "apiVersion: v1\nkind: List\nitems:{}{}{}",
        slice("plain", ""),
        slice("other", ", service.kubernetes.io/service-proxy-name: other"),
        slice("headless", ", service.kubernetes.io/headless: ''"),
    );
    let (objects, skipped) = parse_yaml(&yaml).unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    let names = |proxy_name: &str| -> Vec<String> {
        let (cluster, skipped) = cluster(&objects, "node", proxy_name);
        assert!(skipped.is_empty(), "ignored, not invalid: {skipped:?}");
        cluster.slices.keys().map(|k| k.to_string()).collect()
    };
    assert_eq!(names(""), vec!["ns/plain"]);
    assert_eq!(names("other"), vec!["ns/other"]);
}
