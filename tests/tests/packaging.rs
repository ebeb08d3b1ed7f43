//! The manifests in packaging/: valid against the Kubernetes schemas offline, and the
//! ClusterRole grants exactly the API access the agent uses (compared with the requests the
//! real agent makes to the test API server).

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
        // Only the Prometheus Operator's custom resource has no built-in schema.
        assert!(
            line.contains("kind ServiceMonitor"),
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
