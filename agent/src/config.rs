//! kube-proxy's `KubeProxyConfiguration` (kubeproxy.config.k8s.io/v1alpha1), read so that
//! existing kube-proxy ConfigMaps work unchanged, and resolved into nftproxy's settings.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dataplane::build::{BuildConfig, LocalDetector, NodePortAddresses};
use dataplane::convert::parse_cidr_sloppy;
use dataplane::iptables::IptablesOptions;
use ipnet::IpNet;
use serde::Deserialize;

/// A configuration problem; the process exits with status 2 and this message.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Unparseable { path: PathBuf, message: String },
    #[error("invalid configuration: {field}: {message}")]
    Invalid { field: String, message: String },
}

fn invalid<T>(field: &str, message: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError::Invalid {
        field: field.to_string(),
        message: message.into(),
    })
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModeSection {
    pub masquerade_all: Option<bool>,
    pub masquerade_bit: Option<i64>,
    pub sync_period: Option<String>,
    pub min_sync_period: Option<String>,
    pub localhost_node_ports: Option<bool>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DetectLocalSection {
    pub bridge_interface: Option<String>,
    pub interface_name_prefix: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientConnectionSection {
    pub kubeconfig: Option<String>,
}

/// The fields of `KubeProxyConfiguration` nftproxy reads. Everything else is reported once as
/// ignored, so a kube-proxy ConfigMap loads as it is.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    pub mode: Option<String>,
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Option<String>,
    pub detect_local_mode: Option<String>,
    pub detect_local: Option<DetectLocalSection>,
    pub hostname_override: Option<String>,
    pub node_port_addresses: Option<Vec<String>>,
    pub nftables: Option<ModeSection>,
    pub iptables: Option<ModeSection>,
    pub metrics_bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub client_connection: Option<ClientConnectionSection>,
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_yaml_ng::Value>,
}

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";

impl KubeProxyConfiguration {
    pub fn load(path: &Path) -> Result<KubeProxyConfiguration, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Unreadable {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text).map_err(|message| ConfigError::Unparseable {
            path: path.to_path_buf(),
            message,
        })
    }

    /// Parses YAML text; the error names the line and column.
    pub fn parse(text: &str) -> Result<KubeProxyConfiguration, String> {
        if text.trim().is_empty() {
            return Ok(KubeProxyConfiguration::default());
        }
        serde_yaml_ng::from_str(text).map_err(|e| match e.location() {
            Some(l) => format!("line {} column {}: {e}", l.line(), l.column()),
            None => e.to_string(),
        })
    }

    /// Fields present in the file that nftproxy does not use.
    pub fn ignored_fields(&self) -> Vec<&str> {
        self.other.keys().map(String::as_str).collect()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyMode {
    Nftables,
    Iptables,
}

/// Command-line values that override the file.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub hostname_override: Option<String>,
    pub proxy_mode: Option<String>,
}

/// Everything the agent needs to run, validated.
#[derive(Clone, Debug)]
pub struct Settings {
    pub mode: ProxyMode,
    pub node_name: String,
    pub build: BuildConfig,
    pub sync_period: Duration,
    pub min_sync_period: Duration,
    pub metrics_bind_address: String,
    pub healthz_bind_address: String,
    pub kubeconfig: Option<String>,
    /// iptables mode only (`iptables.localhostNodePorts`, ...).
    pub iptables: IptablesOptions,
}

/// Parses a Go duration such as `1s`, `500ms`, `1m30s`, `1h`.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if s == "0" {
        return Some(Duration::ZERO);
    }
    let mut total = 0f64;
    let mut rest = s;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_end == 0 {
            return None;
        }
        let value: f64 = rest[..num_end].parse().ok()?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_end..];
    }
    Some(Duration::from_secs_f64(total))
}

fn system_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_lowercase())
        .unwrap_or_default()
}

impl Settings {
    pub fn resolve(
        file: &KubeProxyConfiguration,
        overrides: &Overrides,
    ) -> Result<Settings, ConfigError> {
        if let Some(v) = &file.api_version
            && v != API_VERSION
        {
            return invalid("apiVersion", format!("{v:?} is not {API_VERSION:?}"));
        }
        if let Some(k) = &file.kind
            && k != "KubeProxyConfiguration"
        {
            return invalid("kind", format!("{k:?} is not \"KubeProxyConfiguration\""));
        }
        let (mode, mode_field) = match overrides.proxy_mode.as_deref().or(file.mode.as_deref()) {
            None | Some("") | Some("nftables") => (ProxyMode::Nftables, "nftables"),
            Some("iptables") => (ProxyMode::Iptables, "iptables"),
            Some(other) => {
                return invalid(
                    "mode",
                    format!("{other:?} is not supported (use \"nftables\" or \"iptables\")"),
                );
            }
        };
        let section = match mode {
            ProxyMode::Nftables => file.nftables.clone().unwrap_or_default(),
            ProxyMode::Iptables => file.iptables.clone().unwrap_or_default(),
        };
        let bit = section.masquerade_bit.unwrap_or(14);
        if !(0..=31).contains(&bit) {
            return invalid(
                &format!("{mode_field}.masqueradeBit"),
                format!("{bit} must be between 0 and 31"),
            );
        }
        let duration = |field: &str, v: &Option<String>, default: Duration| match v {
            None => Ok(default),
            Some(s) => match parse_duration(s) {
                Some(d) => Ok(d),
                None => invalid(
                    &format!("{mode_field}.{field}"),
                    format!("{s:?} is not a duration such as \"1s\" or \"30s\""),
                ),
            },
        };
        let sync_period = duration("syncPeriod", &section.sync_period, Duration::from_secs(30))?;
        let min_sync_period = duration(
            "minSyncPeriod",
            &section.min_sync_period,
            Duration::from_secs(1),
        )?;
        if sync_period.is_zero() {
            return invalid(
                &format!("{mode_field}.syncPeriod"),
                "must be greater than 0",
            );
        }

        let mut cluster_cidrs: Vec<IpNet> = Vec::new();
        if let Some(raw) = &file.cluster_cidr {
            for part in raw.split(',').filter(|p| !p.trim().is_empty()) {
                match parse_cidr_sloppy(part) {
                    Some(net) => cluster_cidrs.push(net),
                    None => return invalid("clusterCIDR", format!("{part:?} is not a CIDR")),
                }
            }
            let v4 = cluster_cidrs.iter().filter(|c| c.addr().is_ipv4()).count();
            if v4 > 1 || cluster_cidrs.len() - v4 > 1 {
                return invalid("clusterCIDR", "at most one CIDR per IP family");
            }
        }
        let detect = file.detect_local.clone().unwrap_or_default();
        let local_detector = match file.detect_local_mode.as_deref().unwrap_or("ClusterCIDR") {
            "" | "ClusterCIDR" => {
                if cluster_cidrs.is_empty() {
                    LocalDetector::None
                } else {
                    LocalDetector::ClusterCidr(cluster_cidrs)
                }
            }
            "NodeCIDR" => LocalDetector::NodeCidr,
            "BridgeInterface" => match detect.bridge_interface.filter(|b| !b.is_empty()) {
                Some(b) => LocalDetector::BridgeInterface(b),
                None => {
                    return invalid(
                        "detectLocal.bridgeInterface",
                        "required when detectLocalMode is BridgeInterface",
                    );
                }
            },
            "InterfaceNamePrefix" => match detect.interface_name_prefix.filter(|b| !b.is_empty()) {
                Some(p) => LocalDetector::InterfaceNamePrefix(p),
                None => {
                    return invalid(
                        "detectLocal.interfaceNamePrefix",
                        "required when detectLocalMode is InterfaceNamePrefix",
                    );
                }
            },
            other => {
                return invalid(
                    "detectLocalMode",
                    format!(
                        "{other:?} is not one of ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix"
                    ),
                );
            }
        };
        let node_port_addresses = match file.node_port_addresses.as_deref() {
            None | Some([]) => match mode {
                ProxyMode::Nftables => NodePortAddresses::Primary,
                ProxyMode::Iptables => NodePortAddresses::Cidrs(Vec::new()),
            },
            Some([p]) if p == "primary" => NodePortAddresses::Primary,
            Some(list) => {
                let mut cidrs = Vec::new();
                for raw in list {
                    if raw == "primary" {
                        return invalid(
                            "nodePortAddresses",
                            "\"primary\" cannot be combined with CIDRs",
                        );
                    }
                    match parse_cidr_sloppy(raw) {
                        Some(net) => cidrs.push(net),
                        None => {
                            return invalid("nodePortAddresses", format!("{raw:?} is not a CIDR"));
                        }
                    }
                }
                NodePortAddresses::Cidrs(cidrs)
            }
        };
        let node_name = overrides
            .hostname_override
            .clone()
            .filter(|h| !h.trim().is_empty())
            .or_else(|| {
                file.hostname_override
                    .clone()
                    .filter(|h| !h.trim().is_empty())
            })
            .map(|h| h.trim().to_lowercase())
            .unwrap_or_else(system_hostname);
        Ok(Settings {
            mode,
            build: BuildConfig {
                node_name: node_name.clone(),
                masquerade_all: section.masquerade_all.unwrap_or(false),
                masquerade_bit: bit as u32,
                local_detector,
                node_port_addresses,
                local_addresses: Vec::new(),
            },
            node_name,
            sync_period,
            min_sync_period,
            metrics_bind_address: file
                .metrics_bind_address
                .clone()
                .unwrap_or_else(|| "127.0.0.1:10249".into()),
            healthz_bind_address: file
                .healthz_bind_address
                .clone()
                .unwrap_or_else(|| "0.0.0.0:10256".into()),
            kubeconfig: file
                .client_connection
                .as_ref()
                .and_then(|c| c.kubeconfig.clone())
                .filter(|k| !k.is_empty()),
            iptables: IptablesOptions {
                localhost_node_ports: file
                    .iptables
                    .as_ref()
                    .and_then(|s| s.localhost_node_ports)
                    .unwrap_or(true),
                ..IptablesOptions::default()
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(yaml: &str) -> Result<Settings, ConfigError> {
        let file = KubeProxyConfiguration::parse(yaml).expect("parses");
        Settings::resolve(&file, &Overrides::default())
    }

    #[test]
    fn defaults_follow_kube_proxy_nftables_mode() {
        let s = resolve("").unwrap();
        assert_eq!(s.mode, ProxyMode::Nftables);
        assert_eq!(s.build.masquerade_bit, 14);
        assert_eq!(s.build.node_port_addresses, NodePortAddresses::Primary);
        assert_eq!(s.build.local_detector, LocalDetector::None);
        assert_eq!(s.sync_period, Duration::from_secs(30));
        assert_eq!(s.min_sync_period, Duration::from_secs(1));
        assert_eq!(s.metrics_bind_address, "127.0.0.1:10249");
    }

    #[test]
    fn fields_are_honoured() {
        let s = resolve(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             clusterCIDR: 10.0.0.0/8,fd00:10::/64\nhostnameOverride: Node-A\n\
             nodePortAddresses: [192.168.0.0/24]\nnftables: {masqueradeAll: true, masqueradeBit: 3, minSyncPeriod: 250ms}\n\
             conntrack: {maxPerCore: 0}\n",
        )
        .unwrap();
        assert_eq!(s.node_name, "node-a");
        assert!(s.build.masquerade_all);
        assert_eq!(s.build.masquerade_bit, 3);
        assert_eq!(s.min_sync_period, Duration::from_millis(250));
        assert!(
            matches!(s.build.local_detector, LocalDetector::ClusterCidr(ref c) if c.len() == 2)
        );
        assert!(
            matches!(s.build.node_port_addresses, NodePortAddresses::Cidrs(ref c) if c.len() == 1)
        );
    }

    #[test]
    fn iptables_mode_defaults_and_fields() {
        let s =
            resolve("mode: iptables\niptables: {masqueradeBit: 5, localhostNodePorts: false}\n")
                .unwrap();
        assert_eq!(s.mode, ProxyMode::Iptables);
        assert_eq!(s.build.masquerade_bit, 5);
        // kube-proxy's iptables mode serves NodePorts on every local address by default.
        assert_eq!(
            s.build.node_port_addresses,
            NodePortAddresses::Cidrs(vec![])
        );
        assert!(!s.iptables.localhost_node_ports);
        let s = Settings::resolve(
            &KubeProxyConfiguration::parse("nftables: {masqueradeBit: 3}").unwrap(),
            &Overrides {
                proxy_mode: Some("iptables".into()),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert_eq!(s.mode, ProxyMode::Iptables);
        assert_eq!(s.build.masquerade_bit, 14);
        assert!(s.iptables.localhost_node_ports);
    }

    #[test]
    fn invalid_values_name_the_field() {
        for (yaml, field) in [
            ("nftables: {masqueradeBit: 32}", "nftables.masqueradeBit"),
            ("clusterCIDR: 10.0.0.0/33", "clusterCIDR"),
            ("detectLocalMode: Magic", "detectLocalMode"),
            (
                "nodePortAddresses: [primary, 10.0.0.0/8]",
                "nodePortAddresses",
            ),
            ("nftables: {syncPeriod: soon}", "nftables.syncPeriod"),
            ("mode: ipvs", "mode"),
        ] {
            let err = resolve(yaml).unwrap_err().to_string();
            assert!(err.contains(field), "{yaml}: {err}");
        }
    }

    #[test]
    fn parse_errors_name_the_line() {
        let err = KubeProxyConfiguration::parse("mode: nftables\nnftables:\n  masqueradeBit: [x\n")
            .unwrap_err();
        assert!(err.contains("line 3"), "{err}");
    }

    #[test]
    fn go_durations() {
        assert_eq!(parse_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("1h0m0s"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("fast"), None);
        assert_eq!(parse_duration(""), None);
    }
}
