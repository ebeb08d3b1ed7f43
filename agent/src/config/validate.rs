//! kube-proxy's validation of a defaulted `KubeProxyConfiguration` (upstream
//! `pkg/proxy/apis/config/validation` and component-base's logging validation), rejecting
//! what kube-proxy rejects with the field's path in the error. Checking also parses: the
//! result carries the values in the types nftproxy runs with.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use dataplane::convert::{parse_cidr_sloppy, parse_ip_sloppy};
use dataplane::nft::build::{LocalDetector, NodePortAddresses};
use ipnet::IpNet;

use super::defaults::{API_VERSION, KIND};
use super::fields::{
    ConntrackConfiguration, KubeProxyConfiguration, LoggingConfiguration, OutputRoutingOptions,
};
use super::values::GoDuration;
use super::{ConfigError, LogFormat, ProxyMode, invalid};

/// The longest interface name the kernel accepts (`IFNAMSIZ` less the terminating NUL).
const MAX_INTERFACE_NAME: usize = 15;

/// A validated configuration's values, parsed.
#[derive(Debug)]
pub(super) struct Checked {
    pub mode: ProxyMode,
    pub sync_period: Duration,
    pub min_sync_period: Duration,
    pub masquerade_bit: u32,
    pub masquerade_all: bool,
    pub bind_address: IpAddr,
    pub healthz_bind_address: SocketAddr,
    pub metrics_bind_address: SocketAddr,
    pub local_detector: LocalDetector,
    pub node_port_addresses: NodePortAddresses,
    pub burst: u32,
    pub oom_score_adj: i32,
    pub log_format: LogFormat,
}

/// Validates a configuration that went through `with_defaults`.
pub(super) fn check(c: &KubeProxyConfiguration) -> Result<Checked, ConfigError> {
    check_type(c)?;
    let mode = ProxyMode::parse(&c.mode, "mode")?;
    // kube-proxy checks the iptables bit whatever the mode.
    masquerade_bit("iptables.masqueradeBit", c.iptables.masquerade_bit)?;
    let section = ModeSection::of(c, mode);
    let masquerade_bit = masquerade_bit(&section.field("masqueradeBit"), section.masquerade_bit)?;
    let (sync_period, min_sync_period) = sync_periods(&section)?;
    check_conntrack(&c.conntrack)?;
    let oom_score_adj = oom_score_adj(c.oom_score_adj)?;
    let burst = non_negative("clientConnection.burst", c.client_connection.burst)?;
    positive("configSyncPeriod", c.config_sync_period)?;
    let bind_address = parse_ip_sloppy(&c.bind_address).ok_or_else(|| ConfigError::Invalid {
        field: "bindAddress".into(),
        message: format!("{:?} is not an IP address", c.bind_address),
    })?;
    let healthz_bind_address = host_port("healthzBindAddress", &c.healthz_bind_address)?;
    let metrics_bind_address = host_port("metricsBindAddress", &c.metrics_bind_address)?;
    check_port_range(&c.port_range)?;
    let node_port_addresses = node_port_addresses(&c.node_port_addresses, mode)?;
    check_hidden_metrics_version(&c.show_hidden_metrics_for_version)?;
    let local_detector = local_detector(c)?;
    let log_format = check_logging(&c.logging, &c.feature_gates)?;
    Ok(Checked {
        mode,
        sync_period,
        min_sync_period,
        masquerade_bit,
        masquerade_all: section.masquerade_all,
        bind_address,
        healthz_bind_address,
        metrics_bind_address,
        local_detector,
        node_port_addresses,
        burst,
        oom_score_adj,
        log_format,
    })
}

fn check_type(c: &KubeProxyConfiguration) -> Result<(), ConfigError> {
    if c.api_version != API_VERSION {
        return invalid(
            "apiVersion",
            format!("{:?} is not {API_VERSION:?}", c.api_version),
        );
    }
    if c.kind != KIND {
        return invalid("kind", format!("{:?} is not {KIND:?}", c.kind));
    }
    Ok(())
}

/// The section of the mode in use (`nftables` or `iptables`): the other one is not used.
struct ModeSection {
    name: &'static str,
    masquerade_bit: Option<i32>,
    masquerade_all: bool,
    sync_period: GoDuration,
    min_sync_period: GoDuration,
}

impl ModeSection {
    fn of(c: &KubeProxyConfiguration, mode: ProxyMode) -> ModeSection {
        match mode {
            ProxyMode::Nftables => ModeSection {
                name: mode.name(),
                masquerade_bit: c.nftables.masquerade_bit,
                masquerade_all: c.nftables.masquerade_all,
                sync_period: c.nftables.sync_period,
                min_sync_period: c.nftables.min_sync_period,
            },
            ProxyMode::Iptables => ModeSection {
                name: mode.name(),
                masquerade_bit: c.iptables.masquerade_bit,
                masquerade_all: c.iptables.masquerade_all,
                sync_period: c.iptables.sync_period,
                min_sync_period: c.iptables.min_sync_period,
            },
        }
    }

    fn field(&self, name: &str) -> String {
        format!("{}.{name}", self.name)
    }
}

fn masquerade_bit(field: &str, bit: Option<i32>) -> Result<u32, ConfigError> {
    let bit = bit.unwrap_or(super::defaults::DEFAULT_MASQUERADE_BIT);
    match u32::try_from(bit) {
        Ok(b) if b <= 31 => Ok(b),
        _ => invalid(field, format!("{bit} must be within the range [0, 31]")),
    }
}

fn sync_periods(section: &ModeSection) -> Result<(Duration, Duration), ConfigError> {
    let sync_field = section.field("syncPeriod");
    let min_field = section.field("minSyncPeriod");
    let sync = positive(&sync_field, section.sync_period)?;
    let min = non_negative_duration(&min_field, section.min_sync_period)?;
    if min > sync {
        return invalid(
            &sync_field,
            format!(
                "{} must be greater than or equal to {min_field} ({})",
                section.sync_period, section.min_sync_period
            ),
        );
    }
    Ok((sync, min))
}

fn positive(field: &str, d: GoDuration) -> Result<Duration, ConfigError> {
    match d.to_std() {
        Some(d) if !d.is_zero() => Ok(d),
        _ => invalid(field, format!("{d} must be greater than 0")),
    }
}

fn non_negative_duration(field: &str, d: GoDuration) -> Result<Duration, ConfigError> {
    d.to_std().map_or_else(
        || invalid(field, format!("{d} must be greater than or equal to 0")),
        Ok,
    )
}

fn non_negative(field: &str, v: i32) -> Result<u32, ConfigError> {
    u32::try_from(v).or_else(|_| invalid(field, format!("{v} must be greater than or equal to 0")))
}

fn check_conntrack(c: &ConntrackConfiguration) -> Result<(), ConfigError> {
    if let Some(v) = c.max_per_core {
        non_negative("conntrack.maxPerCore", v)?;
    }
    if let Some(v) = c.min {
        non_negative("conntrack.min", v)?;
    }
    let durations = [
        ("conntrack.tcpEstablishedTimeout", c.tcp_established_timeout),
        ("conntrack.tcpCloseWaitTimeout", c.tcp_close_wait_timeout),
        ("conntrack.udpTimeout", Some(c.udp_timeout)),
        ("conntrack.udpStreamTimeout", Some(c.udp_stream_timeout)),
    ];
    for (field, d) in durations {
        non_negative_duration(field, d.unwrap_or_default())?;
    }
    Ok(())
}

fn oom_score_adj(v: Option<i32>) -> Result<i32, ConfigError> {
    let v = v.unwrap_or(super::defaults::DEFAULT_OOM_SCORE_ADJ);
    if (-1000..=1000).contains(&v) {
        Ok(v)
    } else {
        invalid(
            "oomScoreAdj",
            format!("{v} must be within the range [-1000, 1000]"),
        )
    }
}

/// Whether an address is IPv4 as Go's `ParseIPSloppy(s).To4() != nil` sees it (which
/// includes IPv4-mapped IPv6 addresses). Anything else defaults the listeners to IPv6.
pub(super) fn is_ipv4_sloppy(s: &str) -> bool {
    match parse_ip_sloppy(s) {
        Some(IpAddr::V4(_)) => true,
        Some(IpAddr::V6(v6)) => v6.to_ipv4_mapped().is_some(),
        None => false,
    }
}

/// Go's `net.SplitHostPort`: `host:port` or `[host]:port`.
fn split_host_port(s: &str) -> Option<(&str, &str)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        let port = after.strip_prefix(':')?;
        return (!host.contains('[') && !port.contains([']', '['])).then_some((host, port));
    }
    let (host, port) = s.rsplit_once(':')?;
    (!host.contains([':', '[', ']']) && !port.contains([']', '['])).then_some((host, port))
}

/// kube-proxy's `AppendPortIfNeeded`: an IP address without a port gets `port`; anything
/// else is left for validation to judge.
pub(super) fn append_port_if_needed(addr: &str, port: u16) -> String {
    if split_host_port(addr).is_some() {
        return addr.to_string();
    }
    match parse_ip_sloppy(addr) {
        Some(IpAddr::V4(_)) => format!("{addr}:{port}"),
        Some(IpAddr::V6(_)) => format!("[{addr}]:{port}"),
        None => addr.to_string(),
    }
}

/// An `IP:port` listener address; the port must be 1-65535.
fn host_port(field: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    let Some((host, port)) = split_host_port(s) else {
        return invalid(
            field,
            format!("{s:?} must be IP:port, such as 0.0.0.0:10256"),
        );
    };
    let Some(ip) = parse_ip_sloppy(host) else {
        return invalid(field, format!("{host:?} must be a valid IP"));
    };
    match port.parse::<i64>().ok().and_then(|p| u16::try_from(p).ok()) {
        Some(p) if p > 0 => Ok(SocketAddr::new(ip, p)),
        _ => invalid(field, format!("{port:?} must be a valid port (1-65535)")),
    }
}

/// Kubernetes' `ParsePortRange`: empty, `port`, `low-high` or `base+offset`, within 65535.
fn check_port_range(s: &str) -> Result<(), ConfigError> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(());
    }
    let int = |t: &str| t.parse::<i64>().ok();
    let bounds = match (s.find('-'), s.find('+')) {
        (None, None) => int(s).map(|p| (p, p)),
        (Some(i), None) => int(&s[..i]).zip(int(&s[i + 1..])),
        (None, Some(i)) => int(&s[..i])
            .zip(int(&s[i + 1..]))
            .map(|(low, offset)| (low, low.saturating_add(offset))),
        (Some(_), Some(_)) => None,
    };
    match bounds {
        Some((low, high)) if low <= 65535 && high <= 65535 && low <= high => Ok(()),
        _ => invalid(
            "portRange",
            format!("{s:?} must be a valid port range (e.g. 300-2000)"),
        ),
    }
}

/// `nodePortAddresses`: `["primary"]`, or CIDRs; unset means the mode's default (the Node's
/// primary IPs in nftables mode, every local address in iptables mode).
fn node_port_addresses(list: &[String], mode: ProxyMode) -> Result<NodePortAddresses, ConfigError> {
    if list.is_empty() {
        return Ok(match mode {
            ProxyMode::Nftables => NodePortAddresses::Primary,
            ProxyMode::Iptables => NodePortAddresses::Cidrs(Vec::new()),
        });
    }
    let mut cidrs = Vec::new();
    for (i, raw) in list.iter().enumerate() {
        let field = format!("nodePortAddresses[{i}]");
        if raw == "primary" {
            if list.len() != 1 {
                return invalid(&field, "can't use both \"primary\" and CIDRs");
            }
            return Ok(NodePortAddresses::Primary);
        }
        match parse_cidr_sloppy(raw) {
            Some(net) => cidrs.push(net),
            None => return invalid(&field, format!("{raw:?} must be a valid CIDR")),
        }
    }
    Ok(NodePortAddresses::Cidrs(cidrs))
}

/// kube-proxy accepts only its own previous minor version here; nftproxy has no Kubernetes
/// version of its own, so it checks the `<major>.<minor>` form (and warns: no hidden metrics).
fn check_hidden_metrics_version(s: &str) -> Result<(), ConfigError> {
    if s.is_empty() {
        return Ok(());
    }
    let number = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    match s.split_once('.') {
        Some((major, minor)) if number(major) && number(minor) => Ok(()),
        _ => invalid(
            "showHiddenMetricsForVersion",
            format!("{s:?} must be a <major>.<minor> version such as \"1.33\""),
        ),
    }
}

fn local_detector(c: &KubeProxyConfiguration) -> Result<LocalDetector, ConfigError> {
    let detect = &c.detect_local;
    match c.detect_local_mode.as_str() {
        "ClusterCIDR" => {
            let cidrs = cluster_cidrs(&c.cluster_cidr)?;
            Ok(if cidrs.is_empty() {
                LocalDetector::None
            } else {
                LocalDetector::ClusterCidr(cidrs)
            })
        }
        "NodeCIDR" => Ok(LocalDetector::NodeCidr),
        "BridgeInterface" => {
            let name = interface("detectLocal.bridgeInterface", &detect.bridge_interface)?;
            Ok(LocalDetector::BridgeInterface(name))
        }
        "InterfaceNamePrefix" => {
            let prefix = interface(
                "detectLocal.interfaceNamePrefix",
                &detect.interface_name_prefix,
            )?;
            Ok(LocalDetector::InterfaceNamePrefix(prefix))
        }
        other => invalid(
            "detectLocalMode",
            format!(
                "{other:?} is not one of ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix"
            ),
        ),
    }
}

/// `clusterCIDR`: one CIDR or a dual-stack pair, comma-separated.
fn cluster_cidrs(raw: &str) -> Result<Vec<IpNet>, ConfigError> {
    if raw.is_empty() {
        return Ok(Vec::new());
    }
    let pair_hint =
        "must be a single CIDR or a dual-stack pair (e.g. 10.100.0.0/16,fde4:8dba:82e1::/48)";
    let parts: Vec<&str> = raw.split(',').collect();
    if parts.len() > 2 {
        return invalid("clusterCIDR", format!("{raw:?} {pair_hint}"));
    }
    let mut cidrs = Vec::new();
    for part in parts {
        match parse_cidr_sloppy(part) {
            Some(net) => cidrs.push(net),
            None => {
                return invalid(
                    "clusterCIDR",
                    format!("{part:?} must be a valid CIDR block (e.g. 10.100.0.0/16)"),
                );
            }
        }
    }
    if let [a, b] = cidrs.as_slice()
        && a.addr().is_ipv4() == b.addr().is_ipv4()
    {
        return invalid("clusterCIDR", format!("{raw:?} {pair_hint}"));
    }
    Ok(cidrs)
}

/// An interface name (or prefix) the detect-local rule matches: required, and no longer than
/// the kernel allows, or the rule could never match (and the kernel refuses it).
fn interface(field: &str, name: &str) -> Result<String, ConfigError> {
    if name.is_empty() {
        return invalid(field, "must not be empty when detectLocalMode uses it");
    }
    if name.len() > MAX_INTERFACE_NAME {
        return invalid(
            field,
            format!(
                "{name:?} is {} bytes; an interface name has at most {MAX_INTERFACE_NAME}",
                name.len()
            ),
        );
    }
    Ok(name.to_string())
}

/// component-base's logging validation.
fn check_logging(
    l: &LoggingConfiguration,
    gates: &BTreeMap<String, bool>,
) -> Result<LogFormat, ConfigError> {
    let format = log_format(&l.format, gates, "logging.format")?;
    max_int32("logging.verbosity", l.verbosity)?;
    if !l.vmodule.is_empty() && format != LogFormat::Text {
        return invalid("logging.vmodule", "only supported for the text log format");
    }
    for (i, item) in l.vmodule.iter().enumerate() {
        let field = format!("logging.vmodule[{i}]");
        if item.file_pattern.is_empty() {
            return invalid(&field, "file pattern must not be empty");
        }
        if item.file_pattern.contains(['=', ',']) {
            return invalid(
                &field,
                format!(
                    "file pattern {:?} must not contain '=' or ','",
                    item.file_pattern
                ),
            );
        }
        max_int32(&format!("{field}.verbosity"), item.verbosity)?;
    }
    check_output_routing("logging.options.text", &l.options.text, gates)?;
    check_output_routing("logging.options.json", &l.options.json, gates)?;
    Ok(format)
}

/// `text`, or `json` (a beta format kube-proxy gates on `LoggingBetaOptions`, on by default).
/// `field` names where the value came from: the file or the `--log-format` flag.
pub(super) fn log_format(
    value: &str,
    gates: &BTreeMap<String, bool>,
    field: &str,
) -> Result<LogFormat, ConfigError> {
    match value {
        "" | "text" => Ok(LogFormat::Text),
        "json" if gates.get("LoggingBetaOptions") == Some(&false) => invalid(
            field,
            "log format json is disabled by featureGates.LoggingBetaOptions=false",
        ),
        "json" => Ok(LogFormat::Json),
        other => invalid(
            field,
            format!("{other:?} is not a supported log format (text, json)"),
        ),
    }
}

/// klog takes verbosities as positive 32-bit signed numbers.
fn max_int32(field: &str, v: u32) -> Result<(), ConfigError> {
    if v > i32::MAX as u32 {
        return invalid(field, format!("{v} must be <= {}", i32::MAX));
    }
    Ok(())
}

/// Split streams and buffering are alpha options behind `LoggingAlphaOptions`.
fn check_output_routing(
    prefix: &str,
    o: &OutputRoutingOptions,
    gates: &BTreeMap<String, bool>,
) -> Result<(), ConfigError> {
    if gates.get("LoggingAlphaOptions") == Some(&true) {
        return Ok(());
    }
    let needs_gate = "needs featureGates.LoggingAlphaOptions=true (an alpha option)";
    if o.split_stream {
        return invalid(&format!("{prefix}.splitStream"), needs_gate);
    }
    if !o.info_buffer_size.is_zero() {
        return invalid(&format!("{prefix}.infoBufferSize"), needs_gate);
    }
    Ok(())
}
