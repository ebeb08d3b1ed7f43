//! The objects of a dump: `n` Services with `k` endpoints each, in the benchmark's uniform
//! shape (the same mix as `nftproxy-bench`'s synthetic cluster: 70% ClusterIP, 20% NodePort,
//! 10% LoadBalancer, 10% dual-stack, one TCP port), with the metadata every object has
//! (uid, resourceVersion, creationTimestamp, labels) in kubectl's key order, written in the four
//! formats a user may hand to `nftproxy run --from-file`.
//!
//! Objects are generated and written one at a time: the writer never holds the cluster.

use std::io::{BufWriter, Write};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{Value, json};

/// The node the agent runs as (`hostnameOverride` in [`kube_proxy_config`]).
pub const NODE: &str = "dump-node";

/// The four formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `kubectl get svc,endpointslices -A -o json`: one `kind: List` object, 4-space indent.
    ListJson,
    /// `kubectl get svc,endpointslices -A -o yaml`: one `kind: List` document.
    ListYaml,
    /// One YAML document per object, `---` between them.
    MultiYaml,
    /// One compact JSON object per line (`kubectl get -o json | jq -c '.items[]'`).
    JsonStream,
}

impl Format {
    pub const ALL: [Format; 4] = [
        Format::ListJson,
        Format::ListYaml,
        Format::MultiYaml,
        Format::JsonStream,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Format::ListJson => "kind: List, JSON",
            Format::ListYaml => "kind: List, YAML",
            Format::MultiYaml => "multi-document YAML",
            Format::JsonStream => "JSON stream",
        }
    }

    pub fn file_name(self) -> &'static str {
        match self {
            Format::ListJson => "list.json",
            Format::ListYaml => "list.yaml",
            Format::MultiYaml => "multi.yaml",
            Format::JsonStream => "stream.json",
        }
    }
}

/// The agent configuration every run uses.
pub fn kube_proxy_config() -> String {
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n\
         kind: KubeProxyConfiguration\n\
         mode: nftables\n\
         clusterCIDR: 10.0.0.0/8,fd00:10::/32\n\
         hostnameOverride: {NODE}\n"
    )
}

/// A fake but well-formed UID for object `i` of a kind.
fn uid(kind: u8, i: usize) -> String {
    format!("{kind:08x}-0000-4000-8000-{i:012x}")
}

fn v4(base: Ipv4Addr, offset: usize) -> String {
    Ipv4Addr::from(u32::from(base) + offset as u32).to_string()
}

fn v6(base: Ipv6Addr, offset: usize) -> String {
    Ipv6Addr::from(u128::from(base) + offset as u128).to_string()
}

/// Service `i` and its EndpointSlices (one per family), in the order kubectl lists them.
fn service_objects(i: usize, k: usize) -> (Value, Vec<Value>) {
    let ns = format!("ns-{}", i / 100);
    let name = format!("svc-{i}");
    let type_ = match i % 10 {
        0..=6 => "ClusterIP",
        7 | 8 => "NodePort",
        _ => "LoadBalancer",
    };
    let dual_stack = (i / 10) % 10 == 3;
    let mut cluster_ips = vec![v4(Ipv4Addr::new(172, 16, 0, 10), i)];
    let mut families = vec!["IPv4"];
    if dual_stack {
        cluster_ips.push(v6("fd00:172:16::a".parse().expect("literal"), i));
        families.push("IPv6");
    }
    let mut port = json!({"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080});
    if type_ != "ClusterIP" {
        port["nodePort"] = json!(30000 + (i / 10) * 3 + i % 10 - 7);
    }
    let mut spec = json!({
        "clusterIP": cluster_ips[0],
        "clusterIPs": cluster_ips,
        "internalTrafficPolicy": "Cluster",
        "ipFamilies": families,
        "ipFamilyPolicy": if dual_stack { "RequireDualStack" } else { "SingleStack" },
        "ports": [port],
        "selector": {"app": name},
        "sessionAffinity": "None",
        "type": type_,
    });
    let mut status = json!({"loadBalancer": {}});
    if type_ != "ClusterIP" {
        let local = (i / 10) % 4 == 1;
        spec["externalTrafficPolicy"] = json!(if local { "Local" } else { "Cluster" });
    }
    if type_ == "LoadBalancer" {
        let mut ingress =
            vec![json!({"ip": v4(Ipv4Addr::new(198, 18, 0, 1), i / 10), "ipMode": "VIP"})];
        if dual_stack {
            ingress.push(json!({"ip": v6("2001:db8:1::1".parse().expect("literal"), i / 10), "ipMode": "VIP"}));
        }
        status = json!({"loadBalancer": {"ingress": ingress}});
    }
    let service = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"app": name},
            "name": name,
            "namespace": ns,
            "resourceVersion": (1000 + i).to_string(),
            "uid": uid(1, i),
        },
        "spec": spec,
        "status": status,
    });
    let mut slices = Vec::new();
    for (f, family) in ["IPv4", "IPv6"].into_iter().enumerate() {
        if f == 1 && !dual_stack {
            break;
        }
        let endpoints: Vec<Value> = (0..k)
            .map(|j| {
                let addr = if f == 0 {
                    v4(Ipv4Addr::new(10, 64, 0, 0), i * k + j)
                } else {
                    v6("fd00:10:64::".parse().expect("literal"), i * k + j)
                };
                let node = if j == 0 && i.is_multiple_of(3) {
                    NODE.to_string()
                } else {
                    format!("node-{}", (i + j) % 100)
                };
                json!({
                    "addresses": [addr],
                    "conditions": {"ready": true, "serving": true, "terminating": false},
                    "nodeName": node,
                })
            })
            .collect();
        slices.push(json!({
            "addressType": family,
            "apiVersion": "discovery.k8s.io/v1",
            "endpoints": endpoints,
            "kind": "EndpointSlice",
            "metadata": {
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "generateName": format!("{name}-"),
                "generation": 1,
                "labels": {
                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                    "kubernetes.io/service-name": name,
                },
                "name": format!("{name}-{}", family.to_ascii_lowercase()),
                "namespace": ns,
                "resourceVersion": (100_000 + i * 2 + f).to_string(),
                "uid": uid(2, i * 2 + f),
            },
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        }));
    }
    (service, slices)
}

/// The Node this agent runs as and the cluster's ServiceCIDR.
fn base_objects() -> Vec<Value> {
    vec![
        json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"labels": {"topology.kubernetes.io/zone": "zone-a"}, "name": NODE},
            "spec": {"podCIDRs": ["10.0.0.0/24", "fd00:10::/112"]},
            "status": {"addresses": [
                {"address": "192.168.0.2", "type": "InternalIP"},
                {"address": "2001:db8::2", "type": "InternalIP"},
            ]},
        }),
        json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "ServiceCIDR",
            "metadata": {"name": "kubernetes"},
            "spec": {"cidrs": ["172.16.0.0/12", "fd00:172:16::/108"]},
        }),
    ]
}

/// Every object, one at a time: the Node and ServiceCIDR, then `kubectl get svc,endpointslices`
/// order (all Services, then all EndpointSlices).
fn for_each_object(n: usize, k: usize, mut f: impl FnMut(&Value) -> Result<()>) -> Result<()> {
    for o in base_objects() {
        f(&o)?;
    }
    for i in 0..n {
        f(&service_objects(i, k).0)?;
    }
    for i in 0..n {
        for s in service_objects(i, k).1 {
            f(&s)?;
        }
    }
    Ok(())
}

/// `value` as pretty JSON with kubectl's 4-space indent.
fn pretty_json(value: &Value) -> Result<String> {
    let mut out = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    serde::Serialize::serialize(value, &mut ser)?;
    Ok(String::from_utf8(out)?)
}

/// Writes `text` with every line but the first indented by `indent`, as a nested value.
fn write_indented(w: &mut impl Write, text: &str, first: &str, indent: &str) -> Result<()> {
    for (n, line) in text.lines().enumerate() {
        w.write_all(if n == 0 { first } else { indent }.as_bytes())?;
        w.write_all(line.as_bytes())?;
        w.write_all(b"\n")?;
    }
    Ok(())
}

/// Writes the dump of `n` Services with `k` endpoints in `format`; returns its size in bytes.
pub fn write(path: &Path, format: Format, n: usize, k: usize) -> Result<u64> {
    let file = std::fs::File::create(path).with_context(|| format!("{}", path.display()))?;
    let mut w = BufWriter::new(file);
    match format {
        Format::ListJson => {
            w.write_all(b"{\n    \"apiVersion\": \"v1\",\n    \"items\": [\n")?;
            let mut first = true;
            for_each_object(n, k, |o| {
                if !first {
                    w.write_all(b",\n")?;
                }
                first = false;
                let text = pretty_json(o)?;
                let mut lines = text.lines().peekable();
                while let Some(line) = lines.next() {
                    w.write_all(b"        ")?;
                    w.write_all(line.as_bytes())?;
                    if lines.peek().is_some() {
                        w.write_all(b"\n")?;
                    }
                }
                Ok(())
            })?;
            w.write_all(
                b"\n    ],\n    \"kind\": \"List\",\n    \"metadata\": {\n        \"resourceVersion\": \"\"\n    }\n}\n",
            )?;
        }
        Format::ListYaml => {
            w.write_all(b"apiVersion: v1\nitems:\n")?;
            for_each_object(n, k, |o| {
                write_indented(&mut w, &serde_yaml_ng::to_string(o)?, "- ", "  ")
            })?;
            w.write_all(b"kind: List\nmetadata:\n  resourceVersion: \"\"\n")?;
        }
        Format::MultiYaml => {
            for_each_object(n, k, |o| {
                w.write_all(b"---\n")?;
                w.write_all(serde_yaml_ng::to_string(o)?.as_bytes())?;
                Ok(())
            })?;
        }
        Format::JsonStream => {
            for_each_object(n, k, |o| {
                serde_json::to_writer(&mut w, o)?;
                w.write_all(b"\n")?;
                Ok(())
            })?;
        }
    }
    w.flush()?;
    Ok(std::fs::metadata(path)?.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every format holds the same objects, which the agent's conversion accepts.
    #[test]
    fn the_formats_hold_the_same_valid_objects() {
        let dir = std::env::temp_dir().join(format!("nftproxy-dumps-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut seen = Vec::new();
        for format in Format::ALL {
            let path = dir.join(format.file_name());
            write(&path, format, 45, 3).unwrap();
            let text = std::fs::read_to_string(&path).unwrap();
            let (objects, skipped) = dataplane::input::parse_yaml(&text).unwrap();
            assert!(skipped.is_empty(), "{format:?}: {skipped:?}");
            let (cluster, skipped) = dataplane::convert::cluster(&objects, NODE, "");
            assert!(skipped.is_empty(), "{format:?}: {skipped:?}");
            assert!(cluster.node.is_some(), "{format:?}");
            seen.push((cluster.services.len(), cluster.slices.len()));
        }
        std::fs::remove_dir_all(&dir).unwrap();
        // 45 Services, 10 of them (30-39) dual-stack.
        assert!(seen.iter().all(|s| *s == (45, 55)), "{seen:?}");
    }
}
