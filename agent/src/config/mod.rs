//! kube-proxy's `KubeProxyConfiguration` (kubeproxy.config.k8s.io/v1alpha1), read so that
//! existing kube-proxy ConfigMaps work unchanged: every field is modelled (`fields`),
//! defaulted (`defaults`) and validated (`validate`) as kube-proxy does, and resolved into
//! nftproxy's settings. Fields nftproxy does not implement are accepted with a warning
//! (`warnings`) when their value would make kube-proxy behave differently; the warnings are
//! returned, not logged, so the caller logs each once.
//!
//! nftproxy's one deliberate difference from kube-proxy: an empty `mode` means nftables.

mod defaults;
mod fields;
mod unknown;
mod validate;
mod values;
mod warnings;

#[cfg(test)]
mod tests;

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dataplane::iptables::IptablesOptions;
use dataplane::nft::build::BuildConfig;

pub use defaults::{API_VERSION, HEALTHZ_PORT, KIND, METRICS_PORT};
pub use fields::{
    ClientConnectionConfiguration, ConntrackConfiguration, DetectLocalConfiguration, FormatOptions,
    IptablesConfiguration, IpvsConfiguration, KubeProxyConfiguration, LoggingConfiguration,
    NftablesConfiguration, OutputRoutingOptions, UnknownField, VModuleItem, WinkernelConfiguration,
};
pub use values::{FlushFrequency, GoDuration, Quantity};

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

/// A field accepted but not implemented (or not known): what nftproxy does instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigWarning {
    /// The field's path, such as `conntrack` or `nftables.bogus`.
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

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

    /// Parses YAML (or JSON) text. An error names the field's path and the line and column;
    /// keys kube-proxy does not know are kept in `unknown_fields`.
    pub fn parse(text: &str) -> Result<KubeProxyConfiguration, String> {
        let mut doc: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?;
        if doc.is_null() {
            return Ok(KubeProxyConfiguration::default());
        }
        doc.apply_merge().map_err(|e| e.to_string())?;
        // Typed from the text itself, not from `doc`, so errors keep their line and column.
        let mut config: KubeProxyConfiguration =
            serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?;
        config.unknown_fields = unknown::unknown_fields(&doc);
        Ok(config)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyMode {
    Nftables,
    Iptables,
}

impl ProxyMode {
    pub fn name(self) -> &'static str {
        match self {
            ProxyMode::Nftables => "nftables",
            ProxyMode::Iptables => "iptables",
        }
    }

    /// A mode as written in `field` (`mode` or `--proxy-mode`); empty means nftables.
    fn parse(value: &str, field: &str) -> Result<ProxyMode, ConfigError> {
        let use_instead = "use \"nftables\" (the default) or \"iptables\"";
        match value {
            "" | "nftables" => Ok(ProxyMode::Nftables),
            "iptables" => Ok(ProxyMode::Iptables),
            "ipvs" => invalid(
                field,
                format!("\"ipvs\" is not supported: nftproxy has no ipvs mode; {use_instead}"),
            ),
            "kernelspace" => invalid(
                field,
                format!(
                    "\"kernelspace\" is kube-proxy's Windows mode and nftproxy runs on Linux; \
                     {use_instead}"
                ),
            ),
            other => invalid(
                field,
                format!("{other:?} is not a proxy mode; {use_instead}"),
            ),
        }
    }
}

/// The log format: `logging.format` or `--log-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Command-line values that override the file.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    /// `--hostname-override` (wins over `hostnameOverride`).
    pub hostname_override: Option<String>,
    /// `--proxy-mode` (wins over `mode`).
    pub proxy_mode: Option<String>,
    /// `--kubeconfig` (wins over `clientConnection.kubeconfig`).
    pub kubeconfig: Option<String>,
    /// `--master`: the API server's address, overriding the kubeconfig's.
    pub master: Option<String>,
    /// `-v` / `--v` (wins over `logging.verbosity`).
    pub verbosity: Option<u32>,
    /// `--log-format` (wins over `logging.format`).
    pub log_format: Option<String>,
}

impl Overrides {
    /// `file` with the command-line values in place; each value is checked under its flag's
    /// name, so an error points at the command line rather than the file.
    fn apply_to(
        &self,
        file: &KubeProxyConfiguration,
    ) -> Result<KubeProxyConfiguration, ConfigError> {
        let mut c = file.clone();
        if let Some(mode) = non_empty(&self.proxy_mode) {
            ProxyMode::parse(mode, "--proxy-mode")?;
            c.mode = mode.to_string();
        }
        if let Some(name) = non_empty(&self.hostname_override) {
            if name.trim().is_empty() {
                return invalid("--hostname-override", "must not be blank");
            }
            c.hostname_override = name.trim().to_lowercase();
        }
        if let Some(path) = non_empty(&self.kubeconfig) {
            c.client_connection.kubeconfig = path.to_string();
        }
        if let Some(v) = self.verbosity {
            if v > i32::MAX as u32 {
                return invalid("-v", format!("{v} must be <= {}", i32::MAX));
            }
            c.logging.verbosity = v;
        }
        if let Some(format) = non_empty(&self.log_format) {
            validate::log_format(format, &c.feature_gates, "--log-format")?;
            c.logging.format = format.to_string();
        }
        Ok(c)
    }
}

fn non_empty(v: &Option<String>) -> Option<&str> {
    v.as_deref().filter(|s| !s.is_empty())
}

/// The API client's request rate limit (`clientConnection.qps` and `burst`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClientSettings {
    pub qps: f32,
    pub burst: u32,
}

/// `logging.format` and `logging.verbosity`, after `--log-format` and `-v`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoggingSettings {
    pub format: LogFormat,
    pub verbosity: u32,
}

/// Everything the agent needs to run, validated.
#[derive(Clone, Debug)]
pub struct Settings {
    pub mode: ProxyMode,
    pub node_name: String,
    pub build: BuildConfig,
    pub sync_period: Duration,
    pub min_sync_period: Duration,
    /// `host:port`, defaulted (`127.0.0.1:10249`, `[::1]:10249` for an IPv6 `bindAddress`).
    pub metrics_bind_address: String,
    /// `host:port`, defaulted (`0.0.0.0:10256`, `[::]:10256` for an IPv6 `bindAddress`).
    pub healthz_bind_address: String,
    pub kubeconfig: Option<String>,
    /// `--master`: overrides the kubeconfig's API server address.
    pub master: Option<String>,
    /// iptables mode only (`iptables.localhostNodePorts`, `conntrack.tcpBeLiberal`).
    pub iptables: IptablesOptions,
    /// `bindAddress`: the node's primary IP when not a wildcard (kube-proxy binds nothing
    /// to it, despite the name).
    pub bind_address: IpAddr,
    /// `bindAddressHardFail`: failing to bind the metrics or health port is fatal.
    pub bind_address_hard_fail: bool,
    pub client: ClientSettings,
    pub logging: LoggingSettings,
    /// `enableProfiling` (warned about: nftproxy has no profiling handlers).
    pub enable_profiling: bool,
    /// `oomScoreAdj`, for the agent's own process.
    pub oom_score_adj: i32,
    /// Fields accepted but not implemented, and unknown keys; log each once.
    pub warnings: Vec<ConfigWarning>,
    /// The defaulted configuration as kube-proxy's `/configz` would show it, with the
    /// effective mode and the command-line overrides applied.
    pub effective: serde_json::Value,
}

/// Parses a Go duration such as `1s`, `500ms`, `1m30s`, `1h`; negative durations are `None`.
pub fn parse_duration(s: &str) -> Option<Duration> {
    GoDuration::parse(s.trim()).ok()?.to_std()
}

fn system_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_lowercase())
        .unwrap_or_default()
}

/// The node's name: `hostnameOverride` (after `--hostname-override`), else the hostname.
fn node_name(c: &KubeProxyConfiguration) -> Result<String, ConfigError> {
    if c.hostname_override.is_empty() {
        return Ok(system_hostname());
    }
    let name = c.hostname_override.trim();
    if name.is_empty() {
        return invalid("hostnameOverride", "must not be blank");
    }
    Ok(name.to_lowercase())
}

impl Settings {
    pub fn resolve(
        file: &KubeProxyConfiguration,
        overrides: &Overrides,
    ) -> Result<Settings, ConfigError> {
        let merged = overrides.apply_to(file)?;
        let node_name = node_name(&merged)?;
        let config = merged.with_defaults();
        let checked = validate::check(&config)?;
        let mode_was_empty = merged.mode.is_empty();
        let warnings = warnings::collect(file, &config, checked.mode, mode_was_empty);
        Ok(Settings {
            mode: checked.mode,
            build: BuildConfig {
                node_name: node_name.clone(),
                masquerade_all: checked.masquerade_all,
                masquerade_bit: checked.masquerade_bit,
                local_detector: checked.local_detector,
                node_port_addresses: checked.node_port_addresses,
                local_addresses: Vec::new(),
            },
            node_name,
            sync_period: checked.sync_period,
            min_sync_period: checked.min_sync_period,
            metrics_bind_address: checked.metrics_bind_address.to_string(),
            healthz_bind_address: checked.healthz_bind_address.to_string(),
            kubeconfig: Some(config.client_connection.kubeconfig.clone()).filter(|k| !k.is_empty()),
            master: non_empty(&overrides.master).map(|m| m.trim().to_string()),
            iptables: IptablesOptions {
                localhost_node_ports: config.iptables.localhost_node_ports.unwrap_or(true),
                drop_invalid: !config.conntrack.tcp_be_liberal,
            },
            bind_address: checked.bind_address,
            bind_address_hard_fail: config.bind_address_hard_fail,
            client: ClientSettings {
                qps: config.client_connection.qps,
                burst: checked.burst,
            },
            logging: LoggingSettings {
                format: checked.log_format,
                verbosity: config.logging.verbosity,
            },
            enable_profiling: config.enable_profiling,
            oom_score_adj: checked.oom_score_adj,
            warnings,
            effective: serde_json::to_value(&config).unwrap_or(serde_json::Value::Null),
        })
    }
}
