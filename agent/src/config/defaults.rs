//! kube-proxy's defaulting of `KubeProxyConfiguration` (upstream
//! `SetDefaults_KubeProxyConfiguration` and component-base's logging defaults): a zero,
//! empty or `null` value means the default below. nftproxy's one deliberate difference: an
//! empty `mode` means nftables, not iptables.

use super::fields::{
    ClientConnectionConfiguration, ConntrackConfiguration, IptablesConfiguration,
    IpvsConfiguration, KubeProxyConfiguration, LoggingConfiguration, NftablesConfiguration,
    OutputRoutingOptions,
};
use super::validate::{append_port_if_needed, is_ipv4_sloppy};
use super::values::{FlushFrequency, GoDuration, Quantity};

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

/// kube-proxy's default ports, appended to bind addresses given without one.
pub const METRICS_PORT: u16 = 10249;
pub const HEALTHZ_PORT: u16 = 10256;

pub const DEFAULT_MODE: &str = "nftables";
pub const DEFAULT_BIND_ADDRESS: &str = "0.0.0.0";
pub const DEFAULT_SYNC_PERIOD: GoDuration = GoDuration::from_secs(30);
pub const DEFAULT_MIN_SYNC_PERIOD: GoDuration = GoDuration::from_secs(1);
pub const DEFAULT_MASQUERADE_BIT: i32 = 14;
pub const DEFAULT_CONFIG_SYNC_PERIOD: GoDuration = GoDuration::from_secs(15 * 60);
/// kube-proxy's OOM score adjustment (the kubelet's `KubeProxyOOMScoreAdj`).
pub const DEFAULT_OOM_SCORE_ADJ: i32 = -999;
pub const DEFAULT_CONTENT_TYPE: &str = "application/vnd.kubernetes.protobuf";
pub const DEFAULT_QPS: f32 = 5.0;
pub const DEFAULT_BURST: i32 = 10;
pub const DEFAULT_CONNTRACK_MAX_PER_CORE: i32 = 32 * 1024;
pub const DEFAULT_CONNTRACK_MIN: i32 = 128 * 1024;
pub const DEFAULT_TCP_ESTABLISHED_TIMEOUT: GoDuration = GoDuration::from_secs(24 * 3600);
pub const DEFAULT_TCP_CLOSE_WAIT_TIMEOUT: GoDuration = GoDuration::from_secs(3600);
pub const DEFAULT_LOG_FORMAT: &str = "text";
pub const DEFAULT_LOG_FLUSH_FREQUENCY: GoDuration = GoDuration::from_secs(5);
pub const DEFAULT_DETECT_LOCAL_MODE: &str = "ClusterCIDR";

impl KubeProxyConfiguration {
    /// This configuration with kube-proxy's defaults filled in: what kube-proxy would run
    /// with (except `mode`, see the module comment).
    pub fn with_defaults(&self) -> KubeProxyConfiguration {
        let mut c = self.clone();
        default_str(&mut c.api_version, API_VERSION);
        default_str(&mut c.kind, KIND);
        default_str(&mut c.mode, DEFAULT_MODE);
        default_addresses(&mut c);
        c.oom_score_adj.get_or_insert(DEFAULT_OOM_SCORE_ADJ);
        default_iptables(&mut c.iptables);
        default_ipvs(&mut c.ipvs);
        default_nftables(&mut c.nftables);
        default_conntrack(&mut c.conntrack);
        default_duration(&mut c.config_sync_period, DEFAULT_CONFIG_SYNC_PERIOD);
        default_client_connection(&mut c.client_connection);
        default_logging(&mut c.logging);
        default_str(&mut c.detect_local_mode, DEFAULT_DETECT_LOCAL_MODE);
        c
    }
}

fn default_str(field: &mut String, default: &str) {
    if field.is_empty() {
        *field = default.to_string();
    }
}

fn default_duration(field: &mut GoDuration, default: GoDuration) {
    if field.is_zero() {
        *field = default;
    }
}

/// The listeners default to IPv4 or IPv6 wildcards after `bindAddress`'s family, and an
/// address given without a port gets the default port.
fn default_addresses(c: &mut KubeProxyConfiguration) {
    default_str(&mut c.bind_address, DEFAULT_BIND_ADDRESS);
    let (healthz, metrics) = if is_ipv4_sloppy(&c.bind_address) {
        ("0.0.0.0", "127.0.0.1")
    } else {
        ("[::]", "[::1]")
    };
    default_listener(&mut c.healthz_bind_address, healthz, HEALTHZ_PORT);
    default_listener(&mut c.metrics_bind_address, metrics, METRICS_PORT);
}

fn default_listener(field: &mut String, wildcard: &str, port: u16) {
    *field = if field.is_empty() {
        format!("{wildcard}:{port}")
    } else {
        append_port_if_needed(field, port)
    };
}

fn default_iptables(s: &mut IptablesConfiguration) {
    s.masquerade_bit.get_or_insert(DEFAULT_MASQUERADE_BIT);
    s.localhost_node_ports.get_or_insert(true);
    default_duration(&mut s.sync_period, DEFAULT_SYNC_PERIOD);
    default_duration(&mut s.min_sync_period, DEFAULT_MIN_SYNC_PERIOD);
}

/// Only the ipvs sync period has a default upstream; its minimum stays 0.
fn default_ipvs(s: &mut IpvsConfiguration) {
    default_duration(&mut s.sync_period, DEFAULT_SYNC_PERIOD);
}

fn default_nftables(s: &mut NftablesConfiguration) {
    s.masquerade_bit.get_or_insert(DEFAULT_MASQUERADE_BIT);
    default_duration(&mut s.sync_period, DEFAULT_SYNC_PERIOD);
    default_duration(&mut s.min_sync_period, DEFAULT_MIN_SYNC_PERIOD);
}

/// Only the pointer fields have defaults: a zero there means "leave the kernel's value".
fn default_conntrack(s: &mut ConntrackConfiguration) {
    s.max_per_core.get_or_insert(DEFAULT_CONNTRACK_MAX_PER_CORE);
    s.min.get_or_insert(DEFAULT_CONNTRACK_MIN);
    s.tcp_established_timeout
        .get_or_insert(DEFAULT_TCP_ESTABLISHED_TIMEOUT);
    s.tcp_close_wait_timeout
        .get_or_insert(DEFAULT_TCP_CLOSE_WAIT_TIMEOUT);
}

fn default_client_connection(s: &mut ClientConnectionConfiguration) {
    default_str(&mut s.content_type, DEFAULT_CONTENT_TYPE);
    if s.qps == 0.0 {
        s.qps = DEFAULT_QPS;
    }
    if s.burst == 0 {
        s.burst = DEFAULT_BURST;
    }
}

fn default_logging(s: &mut LoggingConfiguration) {
    default_str(&mut s.format, DEFAULT_LOG_FORMAT);
    if s.flush_frequency.duration.is_zero() {
        s.flush_frequency = FlushFrequency {
            duration: DEFAULT_LOG_FLUSH_FREQUENCY,
            as_string: true,
        };
    }
    default_output_routing(&mut s.options.text);
    default_output_routing(&mut s.options.json);
}

fn default_output_routing(s: &mut OutputRoutingOptions) {
    if s.info_buffer_size.0.is_empty() {
        s.info_buffer_size = Quantity("0".to_string());
    }
}
