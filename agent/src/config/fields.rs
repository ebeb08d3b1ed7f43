//! The typed model of kube-proxy's `KubeProxyConfiguration` (kubeproxy.config.k8s.io/v1alpha1),
//! field for field, including the nested client-connection, logging, per-mode, Windows,
//! detect-local and conntrack sections.
//!
//! Values are kept as written. As in Go, an absent field, `null` and the zero value are the
//! same thing for non-pointer fields; the fields that are pointers in Go (`masqueradeBit`,
//! `localhostNodePorts`, `maxPerCore`, `min`, the conntrack TCP timeouts, `oomScoreAdj`) are
//! `Option`s, because there `null` and zero differ. Defaulting is a separate step
//! (`defaults.rs`), so that warnings can tell what the file said from what it means.
//!
//! The model also serialises (camelCase, Go duration syntax): the defaulted model is the
//! effective configuration, and the default model lists every known key for the unknown-key
//! check, so a field added here is known, printed and (by the tests) covered at once.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

use super::values::{FlushFrequency, GoDuration, Quantity};

/// `null` reads as the zero value, as Go's decoder leaves a non-pointer field untouched.
fn nullable<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// kube-proxy's `KubeProxyConfiguration`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    #[serde(deserialize_with = "nullable")]
    pub api_version: String,
    #[serde(deserialize_with = "nullable")]
    pub kind: String,
    #[serde(deserialize_with = "nullable")]
    pub feature_gates: BTreeMap<String, bool>,
    #[serde(deserialize_with = "nullable")]
    pub client_connection: ClientConnectionConfiguration,
    #[serde(deserialize_with = "nullable")]
    pub logging: LoggingConfiguration,
    #[serde(deserialize_with = "nullable")]
    pub hostname_override: String,
    #[serde(deserialize_with = "nullable")]
    pub bind_address: String,
    #[serde(deserialize_with = "nullable")]
    pub healthz_bind_address: String,
    #[serde(deserialize_with = "nullable")]
    pub metrics_bind_address: String,
    #[serde(deserialize_with = "nullable")]
    pub bind_address_hard_fail: bool,
    #[serde(deserialize_with = "nullable")]
    pub enable_profiling: bool,
    #[serde(deserialize_with = "nullable")]
    pub show_hidden_metrics_for_version: String,
    #[serde(deserialize_with = "nullable")]
    pub mode: String,
    #[serde(deserialize_with = "nullable")]
    pub iptables: IptablesConfiguration,
    #[serde(deserialize_with = "nullable")]
    pub ipvs: IpvsConfiguration,
    #[serde(deserialize_with = "nullable")]
    pub nftables: NftablesConfiguration,
    #[serde(deserialize_with = "nullable")]
    pub winkernel: WinkernelConfiguration,
    #[serde(deserialize_with = "nullable")]
    pub detect_local_mode: String,
    #[serde(deserialize_with = "nullable")]
    pub detect_local: DetectLocalConfiguration,
    #[serde(rename = "clusterCIDR", deserialize_with = "nullable")]
    pub cluster_cidr: String,
    #[serde(deserialize_with = "nullable")]
    pub node_port_addresses: Vec<String>,
    pub oom_score_adj: Option<i32>,
    #[serde(deserialize_with = "nullable")]
    pub conntrack: ConntrackConfiguration,
    #[serde(deserialize_with = "nullable")]
    pub config_sync_period: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub port_range: String,
    #[serde(deserialize_with = "nullable")]
    pub windows_run_as_service: bool,
    /// Keys of the file kube-proxy does not know, with their full path (`nftables.bogus`)
    /// and, for a near miss in letter case, the known spelling. Filled by `parse`.
    #[serde(skip)]
    pub unknown_fields: Vec<UnknownField>,
}

/// A key of the file that is not a `KubeProxyConfiguration` field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownField {
    /// Full path, such as `nftables.bogus` or `logging.vmodule[0].file`.
    pub path: String,
    /// The known key it differs from only in letter case (`clusterCidr` → `clusterCIDR`).
    pub did_you_mean: Option<String>,
}

/// `clientConnection` (component-base's `ClientConnectionConfiguration`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ClientConnectionConfiguration {
    #[serde(deserialize_with = "nullable")]
    pub kubeconfig: String,
    #[serde(deserialize_with = "nullable")]
    pub accept_content_types: String,
    #[serde(deserialize_with = "nullable")]
    pub content_type: String,
    #[serde(deserialize_with = "nullable")]
    pub qps: f32,
    #[serde(deserialize_with = "nullable")]
    pub burst: i32,
}

/// `logging` (component-base's `LoggingConfiguration`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, rename_all = "camelCase")]
pub struct LoggingConfiguration {
    #[serde(deserialize_with = "nullable")]
    pub format: String,
    #[serde(deserialize_with = "nullable")]
    pub flush_frequency: FlushFrequency,
    #[serde(deserialize_with = "nullable")]
    pub verbosity: u32,
    #[serde(deserialize_with = "nullable")]
    pub vmodule: Vec<VModuleItem>,
    #[serde(deserialize_with = "nullable")]
    pub options: FormatOptions,
}

/// One `logging.vmodule` entry: a file pattern and its verbosity.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, rename_all = "camelCase")]
pub struct VModuleItem {
    #[serde(deserialize_with = "nullable")]
    pub file_pattern: String,
    #[serde(deserialize_with = "nullable")]
    pub verbosity: u32,
}

/// `logging.options`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct FormatOptions {
    #[serde(deserialize_with = "nullable")]
    pub text: OutputRoutingOptions,
    #[serde(deserialize_with = "nullable")]
    pub json: OutputRoutingOptions,
}

/// `logging.options.text` and `logging.options.json`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, rename_all = "camelCase")]
pub struct OutputRoutingOptions {
    #[serde(deserialize_with = "nullable")]
    pub split_stream: bool,
    #[serde(deserialize_with = "nullable")]
    pub info_buffer_size: Quantity,
}

/// `iptables`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, rename_all = "camelCase")]
pub struct IptablesConfiguration {
    pub masquerade_bit: Option<i32>,
    #[serde(deserialize_with = "nullable")]
    pub masquerade_all: bool,
    pub localhost_node_ports: Option<bool>,
    #[serde(deserialize_with = "nullable")]
    pub sync_period: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub min_sync_period: GoDuration,
}

/// `ipvs`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, rename_all = "camelCase")]
pub struct IpvsConfiguration {
    #[serde(deserialize_with = "nullable")]
    pub sync_period: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub min_sync_period: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub scheduler: String,
    #[serde(rename = "excludeCIDRs", deserialize_with = "nullable")]
    pub exclude_cidrs: Vec<String>,
    #[serde(rename = "strictARP", deserialize_with = "nullable")]
    pub strict_arp: bool,
    #[serde(deserialize_with = "nullable")]
    pub tcp_timeout: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub tcp_fin_timeout: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub udp_timeout: GoDuration,
}

/// `nftables`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, rename_all = "camelCase")]
pub struct NftablesConfiguration {
    pub masquerade_bit: Option<i32>,
    #[serde(deserialize_with = "nullable")]
    pub masquerade_all: bool,
    #[serde(deserialize_with = "nullable")]
    pub sync_period: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub min_sync_period: GoDuration,
}

/// `winkernel` (Windows only).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, rename_all = "camelCase")]
pub struct WinkernelConfiguration {
    #[serde(deserialize_with = "nullable")]
    pub network_name: String,
    #[serde(deserialize_with = "nullable")]
    pub source_vip: String,
    #[serde(rename = "enableDSR", deserialize_with = "nullable")]
    pub enable_dsr: bool,
    #[serde(deserialize_with = "nullable")]
    pub root_hns_endpoint_name: String,
    #[serde(deserialize_with = "nullable")]
    pub forward_health_check_vip: bool,
}

/// `detectLocal`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, rename_all = "camelCase")]
pub struct DetectLocalConfiguration {
    #[serde(deserialize_with = "nullable")]
    pub bridge_interface: String,
    #[serde(deserialize_with = "nullable")]
    pub interface_name_prefix: String,
}

/// `conntrack`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ConntrackConfiguration {
    pub max_per_core: Option<i32>,
    pub min: Option<i32>,
    pub tcp_established_timeout: Option<GoDuration>,
    pub tcp_close_wait_timeout: Option<GoDuration>,
    #[serde(deserialize_with = "nullable")]
    pub tcp_be_liberal: bool,
    #[serde(deserialize_with = "nullable")]
    pub udp_timeout: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub udp_stream_timeout: GoDuration,
}
