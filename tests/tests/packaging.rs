//! The manifests in packaging/: valid against the Kubernetes schemas offline, and the
//! ClusterRole grants exactly the API access the agent uses (compared with the requests the
//! real agent makes to the test API server). Also what a kube-proxy replacement's packaging
//! must get right: Linux nodes only, the API server's address from an optional ConfigMap, the
//! series labelled job="kube-proxy" for kube-prometheus, the image built with the pinned
//! toolchain, and the licence text.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use nftproxy_tests::apiserver::ApiServer;
use nftproxy_tests::{Lab, target_binary};
use serde_json::json;

fn packaging() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging")
}

fn repo_file(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The documents of a multi-document YAML file in packaging/.
fn documents(file: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(packaging().join(file)).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .collect()
}

/// The one document of `kind` named `name` in `file`.
fn object(file: &str, kind: &str, name: &str) -> serde_json::Value {
    let found: Vec<serde_json::Value> = documents(file)
        .into_iter()
        .filter(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .collect();
    assert_eq!(found.len(), 1, "one {kind} {name} in {file}");
    found.into_iter().next().unwrap()
}

fn daemonset() -> serde_json::Value {
    object("daemonset.yaml", "DaemonSet", "nftproxy")
}

fn manifests() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(packaging())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

#[test]
fn manifests_validate_against_kubernetes_schemas() {
    if nftproxy_tests::privilege::skip_without_tool("kubernetes-validate") {
        return;
    }
    let files = manifests();
    assert!(files.len() >= 4, "{files:?}");
    let out = Command::new("kubernetes-validate")
        .args(["--strict", "-k", "1.33.0"])
        .args(&files)
        .output()
        .expect("kubernetes-validate (pip install kubernetes-validate; .ci/run installs it)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    for line in text.lines().filter(|l| l.starts_with("WARN")) {
        // Only the Prometheus Operator's custom resources have no built-in schema.
        assert!(
            line.contains("kind ServiceMonitor") || line.contains("kind PodMonitor"),
            "unexpected warning: {line}"
        );
    }
    assert!(text.contains("daemonset/nftproxy against"), "{text}");
}

/// (API group, resource, verb) triples.
type Grants = BTreeSet<(String, String, String)>;

fn granted() -> Grants {
    let text = std::fs::read_to_string(packaging().join("rbac.yaml")).unwrap();
    let mut out = Grants::new();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let v: serde_json::Value = serde::Deserialize::deserialize(doc).unwrap();
        if v["kind"] != "ClusterRole" {
            continue;
        }
        for rule in v["rules"].as_array().unwrap() {
            for group in rule["apiGroups"].as_array().unwrap() {
                for res in rule["resources"].as_array().unwrap() {
                    for verb in rule["verbs"].as_array().unwrap() {
                        out.insert((
                            group.as_str().unwrap().to_string(),
                            res.as_str().unwrap().to_string(),
                            verb.as_str().unwrap().to_string(),
                        ));
                    }
                }
            }
        }
    }
    out
}

/// Maps a request to the RBAC permission it needs; `None` for discovery and other
/// non-resource paths every authenticated client may read.
fn needed(method: &str, uri: &str) -> Option<(String, String, String)> {
    let (path, query) = uri.split_once('?').unwrap_or((uri, ""));
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return None,
    };
    let rest = match rest {
        ["namespaces", _ns, rest @ ..] if !rest.is_empty() => rest,
        other => other,
    };
    let (resource, named) = match rest {
        [resource] => (*resource, false),
        [resource, _name] => (*resource, true),
        _ => return None,
    };
    let watch = query
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1");
    let verb = match (method, named, watch) {
        ("GET", _, true) => "watch",
        ("GET", false, false) => "list",
        ("GET", true, false) => "get",
        ("POST", _, _) => "create",
        ("PUT", _, _) => "update",
        ("PATCH", _, _) => "patch",
        ("DELETE", _, _) => "delete",
        _ => return None,
    };
    Some((group.to_string(), resource.to_string(), verb.to_string()))
}

#[test]
fn cluster_role_grants_exactly_what_the_agent_uses() {
    nftproxy_tests::require_root!();
    let lab = Lab::with_nettest(env!("CARGO_BIN_EXE_nettest")).unwrap();
    let node = lab.node("node").unwrap();
    let api = ApiServer::start_in(&node).unwrap();
    api.apply(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "test-node"},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.2"}]}
    }))
    .unwrap();
    api.apply(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "ns"},
        "spec": {"clusterIP": "172.30.0.10", "ports": [{"port": 80}]}
    }))
    .unwrap();
    let bin = target_binary("nftproxy").expect("build nftproxy first");
    let kubeconfig = api.kubeconfig();
    let agent = node
        .spawn(&[
            bin.to_str().unwrap(),
            "run",
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--hostname-override",
            "test-node",
        ])
        .unwrap();
    agent
        .wait_stderr(
            |l| l.contains("nftables sync committed"),
            Duration::from_secs(20),
        )
        .expect("first sync");
    // Let every watcher get past its initial list into its watch.
    std::thread::sleep(Duration::from_secs(2));
    let used: Grants = api
        .requests()
        .iter()
        .filter_map(|r| needed(&r.method, &r.uri))
        .collect();
    assert_eq!(
        granted(),
        used,
        "packaging/rbac.yaml must grant exactly the permissions the agent used"
    );
}

#[test]
fn dashboard_is_valid_json_and_uses_only_exported_metrics() {
    let text = std::fs::read_to_string(packaging().join("grafana-dashboard.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let exported: BTreeSet<String> = metrics::Metrics::new().family_names().into_iter().collect();
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            exprs.push(target["expr"].as_str().expect("expr").to_string());
        }
    }
    assert!(exprs.len() >= 10, "{exprs:?}");
    let mut referenced = BTreeSet::new();
    for expr in &exprs {
        let mut rest = expr.as_str();
        while let Some(start) = rest.find(|c: char| c.is_ascii_alphabetic() || c == '_') {
            rest = &rest[start..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            let word = &rest[..end];
            if word.starts_with("kubeproxy_") || word.starts_with("nftproxy_") {
                referenced.insert(word.to_string());
            }
            rest = &rest[end..];
        }
    }
    for name in &referenced {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| exported.contains(*f)))
            .unwrap_or(name);
        assert!(
            exported.contains(family),
            "{name} is not exported (exported: {exported:?})"
        );
    }
    assert!(referenced.len() >= 15, "{referenced:?}");
}

#[test]
fn daemonset_runs_on_linux_nodes_with_kube_proxys_arguments_and_probes() {
    let ds = daemonset();
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["nodeSelector"], json!({"kubernetes.io/os": "linux"}));
    assert_eq!(pod["hostNetwork"], true);
    // Names resolve through the node's DNS, not the cluster DNS Service this proxy programs.
    assert_eq!(pod["dnsPolicy"], "Default");
    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(
        args,
        [
            "run",
            "--config=/var/lib/nftproxy/config.conf",
            "--hostname-override=$(NODE_NAME)"
        ]
    );
    assert!(
        c["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "NODE_NAME"
                && e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName")
    );
    assert_eq!(
        c["livenessProbe"]["httpGet"],
        json!({"path": "/livez", "port": 10256})
    );
    assert_eq!(
        c["readinessProbe"]["httpGet"],
        json!({"path": "/healthz", "port": 10256})
    );
    assert!(
        c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["name"] == "config" && m["mountPath"] == "/var/lib/nftproxy")
    );
    // Never kube-proxy's selector: kube-proxy's DaemonSet would adopt or fight these pods.
    let labels = &ds["spec"]["template"]["metadata"]["labels"];
    assert!(labels.get("k8s-app").is_none(), "{labels}");
    assert_eq!(ds["spec"]["selector"]["matchLabels"], *labels);
}

#[test]
fn api_server_address_comes_from_an_optional_configmap() {
    let ds = daemonset();
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        c["envFrom"],
        json!([{"configMapRef": {"name": "nftproxy-api-server", "optional": true}}])
    );
    let cm = object("configmap.yaml", "ConfigMap", "nftproxy-api-server");
    assert_eq!(cm["metadata"]["namespace"], "kube-system");
    // Shipped empty (the kubelet's in-cluster values apply until the operator sets these), and
    // never anything but the two variables the in-cluster client reads.
    let data = cm["data"].as_object().expect("data is a map");
    for key in data.keys() {
        assert!(
            key == "KUBERNETES_SERVICE_HOST" || key == "KUBERNETES_SERVICE_PORT",
            "{key}"
        );
    }
    let text = std::fs::read_to_string(packaging().join("configmap.yaml")).unwrap();
    for hint in [
        "KUBERNETES_SERVICE_HOST",
        "KUBERNETES_SERVICE_PORT",
        "kubectl -n kube-system get cm kube-proxy -o jsonpath='{.data.kubeconfig\\.conf}'",
    ] {
        assert!(text.contains(hint), "configmap.yaml should document {hint}");
    }
    // The agent's own configuration: working defaults, metrics reachable by Prometheus.
    let config = object("configmap.yaml", "ConfigMap", "nftproxy");
    let conf: serde_json::Value =
        serde_yaml_ng::from_str(config["data"]["config.conf"].as_str().unwrap()).unwrap();
    assert_eq!(conf["kind"], "KubeProxyConfiguration");
    assert_eq!(conf["apiVersion"], "kubeproxy.config.k8s.io/v1alpha1");
    assert_eq!(conf["mode"], "nftables");
    assert_eq!(conf["metricsBindAddress"], "0.0.0.0:10249");
    assert_eq!(conf["healthzBindAddress"], "0.0.0.0:10256");
}

#[test]
fn monitors_label_the_series_job_kube_proxy() {
    let ds = daemonset();
    let pod_labels = ds["spec"]["template"]["metadata"]["labels"].clone();
    let service = object("servicemonitor.yaml", "Service", "nftproxy-metrics");
    assert_eq!(service["spec"]["selector"], pod_labels);
    let sm = object("servicemonitor.yaml", "ServiceMonitor", "nftproxy");
    assert_eq!(
        sm["spec"]["selector"]["matchLabels"],
        service["metadata"]["labels"]
    );
    let pm = object("podmonitor.yaml", "PodMonitor", "nftproxy");
    assert_eq!(pm["spec"]["selector"]["matchLabels"], pod_labels);
    for (what, endpoints) in [
        ("ServiceMonitor", &sm["spec"]["endpoints"]),
        ("PodMonitor", &pm["spec"]["podMetricsEndpoints"]),
    ] {
        let endpoints = endpoints.as_array().unwrap();
        assert_eq!(endpoints.len(), 1, "{what}");
        let e = &endpoints[0];
        assert_eq!(e["port"], "metrics", "{what}");
        let relabelings = e["relabelings"].as_array().unwrap();
        // kube-prometheus's kube-proxy dashboard and KubeProxyDown alert select job="kube-proxy".
        assert!(
            relabelings.iter().any(|r| r["targetLabel"] == "job"
                && r["replacement"] == "kube-proxy"
                && r.get("sourceLabels").is_none()
                && r["action"] == "replace"),
            "{what}: {relabelings:?}"
        );
        // As kube-prometheus's kube-proxy PodMonitor: instance is the node name.
        assert!(
            relabelings.iter().any(|r| r["targetLabel"] == "instance"
                && r["sourceLabels"] == json!(["__meta_kubernetes_pod_node_name"])),
            "{what}: {relabelings:?}"
        );
    }
    let ports = ds["spec"]["template"]["spec"]["containers"][0]["ports"].clone();
    assert!(
        ports
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "metrics" && p["containerPort"] == 10249)
    );
}

/// The `channel` of rust-toolchain.toml.
fn pinned_toolchain() -> String {
    repo_file("rust-toolchain.toml")
        .lines()
        .find_map(|l| {
            let (key, value) = l.split_once('=')?;
            (key.trim() == "channel").then(|| value.trim().trim_matches('"').to_string())
        })
        .expect("rust-toolchain.toml has a channel")
}

#[test]
fn image_builds_with_the_pinned_toolchain() {
    let channel = pinned_toolchain();
    assert_eq!(
        channel
            .split('.')
            .filter(|p| p.parse::<u32>().is_ok())
            .count(),
        3,
        "rust-toolchain.toml pins a full version, not {channel:?}"
    );
    let dockerfile = std::fs::read_to_string(packaging().join("Dockerfile")).unwrap();
    let builder = dockerfile
        .lines()
        .find(|l| l.starts_with("FROM "))
        .expect("a FROM line");
    assert_eq!(
        builder,
        format!("FROM rust:{channel}-bookworm AS build"),
        "the builder image must be rust-toolchain.toml's exact version"
    );
    assert!(dockerfile.contains("cargo build --release --locked -p nftproxy"));
    assert!(dockerfile.contains("docker build -f packaging/Dockerfile"));
    // The build context leaves the build output and history out.
    let ignore = repo_file(".dockerignore");
    let patterns: Vec<&str> = ignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    for needed in ["target/", ".git/"] {
        assert!(patterns.contains(&needed), "{needed}: {patterns:?}");
    }
    for kept in ["examples", "Cargo.lock", "LICENSE", "rust-toolchain.toml"] {
        assert!(
            !patterns.iter().any(|p| p.trim_end_matches('/') == kept),
            "{kept} is needed by the build"
        );
    }
}

#[test]
fn license_is_the_apache_license_the_workspace_declares() {
    let license = repo_file("LICENSE");
    let head: Vec<&str> = license.lines().map(str::trim).take(4).collect();
    assert_eq!(
        head,
        [
            "",
            "Apache License",
            "Version 2.0, January 2004",
            "http://www.apache.org/licenses/"
        ]
    );
    for section in [
        "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
        "9. Accepting Warranty or Additional Liability.",
        "END OF TERMS AND CONDITIONS",
    ] {
        assert!(license.contains(section), "{section}");
    }
    assert!(
        repo_file("Cargo.toml").contains("license = \"Apache-2.0\""),
        "the workspace declares Apache-2.0"
    );
}
