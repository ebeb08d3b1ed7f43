//! How the agent reaches the API server, and what to tell the operator when it cannot.
//!
//! kube-proxy's rules: `--kubeconfig` wins over `clientConnection.kubeconfig`; `--master`
//! replaces the server either names; with neither, the in-cluster service account is used.
//! nftproxy adds two things. `--master` alone uses the in-cluster credentials (token and CA)
//! with that server, which is what a node proxy needs: the in-cluster address is the
//! `default/kubernetes` Service's ClusterIP, and only a running Service proxy makes that
//! reachable; on this node, that proxy is nftproxy itself. And when the server the client
//! uses is such a ClusterIP and nothing answers, the problem and its fix are named in the log
//! and in `/healthz`.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dataplane::model::Cluster;
use kube::config::{KubeConfigOptions, Kubeconfig};

/// The kubelet's ServiceAccount mount.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// A TCP connection to the API server that takes longer than this has failed: the operator
/// hears about an unreachable server within seconds rather than after the client's default
/// 30 s.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the client's configuration came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A kubeconfig file (`--kubeconfig` or `clientConnection.kubeconfig`).
    Kubeconfig(PathBuf),
    /// The in-cluster service account with the server from `KUBERNETES_SERVICE_HOST`.
    InCluster,
    /// `--master` with the in-cluster service account's credentials.
    Master,
    /// `$KUBECONFIG` or `~/.kube/config` (outside a cluster: a developer's machine).
    Local,
}

/// The client configuration and how it was chosen.
pub struct Target {
    pub config: kube::Config,
    pub origin: Origin,
}

impl Target {
    /// The server as the client reaches it, e.g. `https://10.96.0.1:443`.
    pub fn server(&self) -> String {
        self.config
            .cluster_url
            .to_string()
            .trim_end_matches('/')
            .to_string()
    }

    /// The server's address when it is an IP literal.
    pub fn server_ip(&self) -> Option<IpAddr> {
        let host = self.config.cluster_url.host()?;
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .ok()
    }
}

/// What the agent was told about the API server.
#[derive(Clone, Debug, Default)]
pub struct Request {
    /// `--kubeconfig`.
    pub flag_kubeconfig: Option<PathBuf>,
    /// `clientConnection.kubeconfig`.
    pub config_kubeconfig: Option<PathBuf>,
    /// `--master`.
    pub master: Option<String>,
}

/// Chooses the client configuration as kube-proxy does (see the module doc).
pub async fn resolve(request: &Request) -> Result<Target, String> {
    let kubeconfig = request
        .flag_kubeconfig
        .clone()
        .or_else(|| request.config_kubeconfig.clone())
        .filter(|p| !p.as_os_str().is_empty());
    let master = request.master.clone().filter(|m| !m.trim().is_empty());
    let (mut config, origin) = match (kubeconfig, master) {
        (Some(path), master) => (from_file(&path, master.as_deref()).await?, Origin::Kubeconfig(path)),
        (None, Some(master)) => (with_service_account(&master).await?, Origin::Master),
        (None, None) if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() => (
            kube::Config::incluster().map_err(|e| {
                format!("in-cluster configuration: {e} (the ServiceAccount token and CA belong in {SERVICE_ACCOUNT_DIR})")
            })?,
            Origin::InCluster,
        ),
        (None, None) => (
            kube::Config::infer().await.map_err(|e| {
                format!(
                    "no API server configured ({e}); use --kubeconfig, clientConnection.kubeconfig, \
                     --master, run in a cluster, or use --from-file"
                )
            })?,
            Origin::Local,
        ),
    };
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    Ok(Target { config, origin })
}

async fn from_file(path: &Path, master: Option<&str>) -> Result<kube::Config, String> {
    let named = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let kubeconfig = Kubeconfig::read_from(path).map_err(|e| named(&e))?;
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|e| named(&e))?;
    if let Some(master) = master {
        config.cluster_url = master
            .parse()
            .map_err(|e| format!("--master {master:?}: {e}"))?;
    }
    Ok(config)
}

/// `--master` with the service account's token and CA: the kubeconfig kubeadm writes for
/// kube-proxy, with this server.
async fn with_service_account(master: &str) -> Result<kube::Config, String> {
    let dir = Path::new(SERVICE_ACCOUNT_DIR);
    let yaml = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: default\n  cluster:\n    server: {master:?}\n    certificate-authority: {ca:?}\nusers:\n- name: default\n  user:\n    tokenFile: {token:?}\ncontexts:\n- name: default\n  context: {{cluster: default, user: default}}\ncurrent-context: default\n",
        ca = dir.join("ca.crt").display().to_string(),
        token = dir.join("token").display().to_string(),
    );
    let kubeconfig =
        Kubeconfig::from_yaml(&yaml).map_err(|e| format!("--master {master:?}: {e}"))?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| {
            format!("--master {master:?} with the service account in {SERVICE_ACCOUNT_DIR}: {e}")
        })
}

/// The `default/kubernetes` Service's ClusterIP as the kubelet announces it to every container
/// (`KUBERNETES_PORT=tcp://10.96.0.1:443`). Overriding `KUBERNETES_SERVICE_HOST` leaves it in
/// place, so it still tells the ClusterIP apart from the control plane's address.
pub fn kubernetes_service_ip(env: impl Fn(&str) -> Option<String>) -> Option<IpAddr> {
    if let Some(addr) = env("KUBERNETES_PORT_443_TCP_ADDR")
        && let Ok(ip) = addr.trim().parse()
    {
        return Some(ip);
    }
    let port = env("KUBERNETES_PORT")?;
    let hostport = port.trim().strip_prefix("tcp://")?;
    let host = match hostport.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
        _ => hostport,
    };
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .ok()
}

/// Why `target` may be out of reach until nftproxy's own rules exist, if it is: its server is
/// the `kubernetes` Service's ClusterIP (from the in-cluster configuration or the kubelet's
/// variables), a ClusterIP of a known Service, or inside a known ServiceCIDR.
pub fn cluster_ip_problem(
    target: &Target,
    kubernetes_ip: Option<IpAddr>,
    cluster: &Cluster,
) -> Option<String> {
    let ip = target.server_ip()?;
    let why = if kubernetes_ip == Some(ip) || target.origin == Origin::InCluster {
        "the ClusterIP of the default/kubernetes Service (the in-cluster address)".to_string()
    } else if let Some(svc) = cluster
        .services
        .iter()
        .find(|(_, s)| s.cluster_ips.contains(&ip))
        .map(|(name, _)| name.to_string())
    {
        format!("the ClusterIP of Service {svc}")
    } else if let Some(cidr) = cluster
        .service_cidrs
        .values()
        .flatten()
        .find(|net| net.contains(&ip))
    {
        format!("inside ServiceCIDR {cidr}")
    } else {
        return None;
    };
    Some(format!(
        "the API server address {server} is {why}, which only a running Service proxy makes \
         reachable, and nftproxy is this node's Service proxy. Give nftproxy the control \
         plane's address: set KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT in the \
         nftproxy-api-server ConfigMap (packaging/configmap.yaml), or pass --master, or point \
         --kubeconfig / clientConnection.kubeconfig at a kubeconfig with the real endpoint \
         (kubeadm's kube-proxy ConfigMap has one)",
        server = target.server()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn target(url: &str, origin: Origin) -> Target {
        Target {
            config: kube::Config::new(url.parse().unwrap()),
            origin,
        }
    }

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn the_kubelets_variables_name_the_cluster_ip() {
        let ip: IpAddr = "10.96.0.1".parse().unwrap();
        assert_eq!(
            kubernetes_service_ip(env(&[("KUBERNETES_PORT", "tcp://10.96.0.1:443")])),
            Some(ip)
        );
        assert_eq!(
            kubernetes_service_ip(env(&[("KUBERNETES_PORT_443_TCP_ADDR", "10.96.0.1")])),
            Some(ip)
        );
        assert_eq!(
            kubernetes_service_ip(env(&[("KUBERNETES_PORT", "tcp://[fd00::1]:443")])),
            Some("fd00::1".parse().unwrap())
        );
        assert_eq!(kubernetes_service_ip(env(&[])), None);
        assert_eq!(
            kubernetes_service_ip(env(&[("KUBERNETES_PORT", "nonsense")])),
            None
        );
    }

    #[test]
    fn a_cluster_ip_server_is_named_with_the_fix() {
        let cluster = Cluster::default();
        let kube_ip = Some("10.96.0.1".parse().unwrap());
        let msg = cluster_ip_problem(
            &target("https://10.96.0.1:443", Origin::Kubeconfig("k".into())),
            kube_ip,
            &cluster,
        )
        .expect("the kubernetes ClusterIP");
        assert!(
            msg.contains("https://10.96.0.1") && msg.contains("default/kubernetes"),
            "{msg}"
        );
        assert!(
            msg.contains("KUBERNETES_SERVICE_HOST") && msg.contains("--master"),
            "{msg}"
        );
        // In-cluster configuration always uses the ClusterIP.
        assert!(
            cluster_ip_problem(
                &target("https://10.0.0.1:443", Origin::InCluster),
                None,
                &cluster
            )
            .is_some()
        );
        // The control plane's own address is fine.
        assert!(
            cluster_ip_problem(
                &target("https://192.0.2.10:6443", Origin::Master),
                kube_ip,
                &cluster
            )
            .is_none()
        );
        assert!(
            cluster_ip_problem(
                &target("https://api.example:6443", Origin::Master),
                kube_ip,
                &cluster
            )
            .is_none()
        );
    }

    #[test]
    fn known_service_cidrs_and_cluster_ips_count() {
        let mut cluster = Cluster::default();
        cluster
            .service_cidrs
            .insert("kubernetes".into(), vec!["10.100.0.0/16".parse().unwrap()]);
        let msg = cluster_ip_problem(
            &target("https://10.100.3.4", Origin::Master),
            None,
            &cluster,
        )
        .unwrap();
        assert!(msg.contains("ServiceCIDR 10.100.0.0/16"), "{msg}");
        assert!(
            cluster_ip_problem(
                &target("https://[fd00::1]:6443", Origin::Master),
                None,
                &cluster
            )
            .is_none()
        );
    }
}
