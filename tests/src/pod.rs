//! Runs a binary in a lab namespace the way the kubelet runs the container of
//! `packaging/daemonset.yaml`: the container's arguments (with `$(VAR)` expanded), its
//! environment (the kubelet's service variables, then `envFrom` ConfigMaps, then `env`), and
//! its ConfigMap and ServiceAccount files at their mount paths, in a private mount namespace
//! so that nothing outside the process sees them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

use crate::lab::{Ns, Proc};

/// The kubelet's ServiceAccount mount.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The objects of `packaging/`, read from the repository.
pub struct Packaging {
    objects: Vec<Value>,
}

impl Packaging {
    /// Reads every YAML file of `packaging/`.
    pub fn load() -> Result<Packaging> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging");
        let mut objects = Vec::new();
        for entry in std::fs::read_dir(&dir).with_context(|| dir.display().to_string())? {
            let path = entry?.path();
            if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
                continue;
            }
            let text = std::fs::read_to_string(&path)?;
            for doc in serde_yaml_ng::Deserializer::from_str(&text) {
                let v: Value = serde::Deserialize::deserialize(doc)
                    .with_context(|| path.display().to_string())?;
                if !v.is_null() {
                    objects.push(v);
                }
            }
        }
        Ok(Packaging { objects })
    }

    /// The object of `kind` named `name`.
    pub fn object(&self, kind: &str, name: &str) -> Option<&Value> {
        self.objects
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
    }

    /// The object of `kind` named `name`, to change (the documented edits).
    pub fn object_mut(&mut self, kind: &str, name: &str) -> Option<&mut Value> {
        self.objects
            .iter_mut()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
    }

    /// The DaemonSet's only container.
    pub fn container(&self) -> Result<&Value> {
        let ds = self
            .objects
            .iter()
            .find(|o| o["kind"] == "DaemonSet")
            .ok_or_else(|| anyhow!("no DaemonSet in packaging/"))?;
        Ok(&ds["spec"]["template"]["spec"]["containers"][0])
    }

    fn config_map_data(&self, name: &str) -> Option<BTreeMap<String, String>> {
        let cm = self.object("ConfigMap", name)?;
        Some(
            cm["data"]
                .as_object()
                .map(|d| {
                    d.iter()
                        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                        .collect()
                })
                .unwrap_or_default(),
        )
    }

    fn volume(&self, name: &str) -> Result<&Value> {
        let ds = self
            .objects
            .iter()
            .find(|o| o["kind"] == "DaemonSet")
            .ok_or_else(|| anyhow!("no DaemonSet"))?;
        ds["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .and_then(|v| v.iter().find(|v| v["name"] == name))
            .ok_or_else(|| anyhow!("no volume {name:?}"))
    }
}

/// What the kubelet gives the container on one node.
pub struct PodEnv {
    /// The node's name (`spec.nodeName`).
    pub node_name: String,
    /// The `default/kubernetes` Service as the kubelet announces it (ClusterIP, port).
    pub kubernetes_service: (String, u16),
    /// The ServiceAccount files (`token`, `ca.crt`, `namespace`) mounted at
    /// [`SERVICE_ACCOUNT_DIR`].
    pub service_account: BTreeMap<String, String>,
}

/// The container's process as the kubelet would start it.
#[derive(Debug)]
pub struct Container {
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    /// Files by absolute path in the container.
    pub files: BTreeMap<PathBuf, String>,
}

impl Container {
    /// The container of `packaging` on a node described by `pod`.
    pub fn from_packaging(packaging: &Packaging, pod: &PodEnv) -> Result<Container> {
        let c = packaging.container()?;
        let (svc_ip, svc_port) = &pod.kubernetes_service;
        let host = if svc_ip.contains(':') {
            format!("[{svc_ip}]")
        } else {
            svc_ip.clone()
        };
        // The kubelet's service links for `default/kubernetes` (port name https).
        let mut env: BTreeMap<String, String> = [
            ("KUBERNETES_SERVICE_HOST", svc_ip.clone()),
            ("KUBERNETES_SERVICE_PORT", svc_port.to_string()),
            ("KUBERNETES_SERVICE_PORT_HTTPS", svc_port.to_string()),
            ("KUBERNETES_PORT", format!("tcp://{host}:{svc_port}")),
            (
                &format!("KUBERNETES_PORT_{svc_port}_TCP"),
                format!("tcp://{host}:{svc_port}"),
            ),
            (
                &format!("KUBERNETES_PORT_{svc_port}_TCP_PROTO"),
                "tcp".into(),
            ),
            (
                &format!("KUBERNETES_PORT_{svc_port}_TCP_PORT"),
                svc_port.to_string(),
            ),
            (
                &format!("KUBERNETES_PORT_{svc_port}_TCP_ADDR"),
                svc_ip.clone(),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        env.insert(
            "PATH".into(),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
        );
        for from in c["envFrom"].as_array().into_iter().flatten() {
            let Some(name) = from["configMapRef"]["name"].as_str() else {
                bail!("envFrom other than configMapRef: {from}");
            };
            match packaging.config_map_data(name) {
                Some(data) => env.extend(data),
                None if from["configMapRef"]["optional"] == true => {}
                None => bail!("envFrom ConfigMap {name} is not in packaging/"),
            }
        }
        for var in c["env"].as_array().into_iter().flatten() {
            let name = var["name"]
                .as_str()
                .ok_or_else(|| anyhow!("env without a name"))?;
            let value = if let Some(v) = var["value"].as_str() {
                v.to_string()
            } else if var["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName" {
                pod.node_name.clone()
            } else {
                bail!("env {name}: unsupported source {var}");
            };
            env.insert(name.to_string(), value);
        }
        let args = c["args"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(|a| expand(a, &env))
            .collect();
        let mut files = BTreeMap::new();
        for m in c["volumeMounts"].as_array().into_iter().flatten() {
            let name = m["name"].as_str().unwrap_or_default();
            let path = PathBuf::from(m["mountPath"].as_str().unwrap_or_default());
            let volume = packaging.volume(name)?;
            if let Some(cm) = volume["configMap"]["name"].as_str() {
                let data = packaging
                    .config_map_data(cm)
                    .ok_or_else(|| anyhow!("volume {name}: ConfigMap {cm} not in packaging/"))?;
                for (key, text) in data {
                    files.insert(path.join(key), text);
                }
            }
        }
        for (key, text) in &pod.service_account {
            files.insert(Path::new(SERVICE_ACCOUNT_DIR).join(key), text.clone());
        }
        Ok(Container { args, env, files })
    }

    /// Starts `binary` (the image's entrypoint) with the container's arguments, environment
    /// and files, inside `ns` and a private mount namespace. The files are put on fresh
    /// tmpfs mounts over `/var/lib` and `/run` (`/var/run`), which only this process sees.
    pub fn spawn(&self, ns: &Ns, binary: &Path, stage: &Path) -> Result<Proc> {
        for (path, text) in &self.files {
            let rel = container_path(path)?;
            let dest = stage.join(rel);
            std::fs::create_dir_all(dest.parent().expect("a file has a parent"))?;
            std::fs::write(&dest, text)?;
        }
        std::fs::create_dir_all(stage.join("var/lib"))?;
        std::fs::create_dir_all(stage.join("run"))?;
        let script = format!(
            "set -e\nmount -t tmpfs nftpt-pod /var/lib\nmount -t tmpfs nftpt-pod /run\n\
             cp -a {stage}/var/lib/. /var/lib/\ncp -a {stage}/run/. /run/\nexec env -i \"$@\"",
            stage = stage.display()
        );
        let mut cmd = ns.command("unshare");
        cmd.args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            &script,
            "pod",
        ]);
        for (k, v) in &self.env {
            cmd.arg(format!("{k}={v}"));
        }
        cmd.arg(binary).args(&self.args);
        ns.spawn_command(cmd, "pod")
    }
}

/// Where a container path is staged: `/var/run/...` is `/run/...`; only `/var/lib` and
/// `/run` can hold files.
fn container_path(path: &Path) -> Result<PathBuf> {
    let s = path.to_str().ok_or_else(|| anyhow!("non-UTF-8 path"))?;
    let s = s
        .strip_prefix("/var/run/")
        .map(|r| format!("/run/{r}"))
        .unwrap_or(s.to_string());
    if !(s.starts_with("/var/lib/") || s.starts_with("/run/")) {
        bail!("{s}: only files under /var/lib and /run can be mounted");
    }
    Ok(PathBuf::from(s.trim_start_matches('/')))
}

/// Kubernetes' `$(VAR)` expansion in arguments (`$$` escapes; unknown names stay as they are).
fn expand(arg: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = arg;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(stripped) = after.strip_prefix('$') {
            out.push('$');
            rest = stripped;
        } else if let Some(body) = after.strip_prefix('(')
            && let Some(end) = body.find(')')
            && let Some(v) = env.get(&body[..end])
        {
            out.push_str(v);
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_expand_like_the_kubelets() {
        let env: BTreeMap<String, String> = [("NODE_NAME".to_string(), "n1".to_string())].into();
        assert_eq!(
            expand("--hostname-override=$(NODE_NAME)", &env),
            "--hostname-override=n1"
        );
        assert_eq!(
            expand("$$(NODE_NAME) $(OTHER)", &env),
            "$(NODE_NAME) $(OTHER)"
        );
    }

    #[test]
    fn paths_stage_under_var_lib_and_run() {
        assert_eq!(
            container_path(Path::new("/var/run/secrets/x/token")).unwrap(),
            PathBuf::from("run/secrets/x/token")
        );
        assert!(container_path(Path::new("/etc/passwd")).is_err());
    }
}
