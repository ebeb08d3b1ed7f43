//! Warnings about fields nftproxy does not implement. A field is reported only when its value
//! would make kube-proxy behave differently from nftproxy, and the warning names the field
//! and says what nftproxy does instead. Unknown keys are reported with their full path.

use serde::Serialize;
use serde_json::Value as Json;

use super::defaults::{
    DEFAULT_CONFIG_SYNC_PERIOD, DEFAULT_CONTENT_TYPE, DEFAULT_LOG_FLUSH_FREQUENCY,
};
use super::fields::{ConntrackConfiguration, KubeProxyConfiguration, OutputRoutingOptions};
use super::{ConfigWarning, ProxyMode};

/// What the API client sends and accepts: nftproxy's client always speaks JSON.
const JSON: &str = "application/json";

/// Warnings for `file` as read, `config` defaulted (with overrides), running in `mode`.
/// `mode_was_empty`: no mode was given, so kube-proxy would have run in iptables mode.
pub(super) fn collect(
    file: &KubeProxyConfiguration,
    config: &KubeProxyConfiguration,
    mode: ProxyMode,
    mode_was_empty: bool,
) -> Vec<ConfigWarning> {
    let mut w = Warnings(Vec::new());
    w.unknown_fields(file);
    w.feature_gates(config);
    w.client_connection(config);
    w.logging(config);
    w.diagnostics(config);
    w.windows(config);
    w.ipvs(config);
    w.other_mode_section(config, mode, mode_was_empty);
    w.conntrack(&config.conntrack, mode);
    w.config_sync_period(config);
    w.port_range(config);
    w.0
}

struct Warnings(Vec<ConfigWarning>);

impl Warnings {
    fn add(&mut self, field: &str, message: impl Into<String>) {
        self.0.push(ConfigWarning {
            field: field.to_string(),
            message: message.into(),
        });
    }

    fn unknown_fields(&mut self, file: &KubeProxyConfiguration) {
        for unknown in &file.unknown_fields {
            let hint = match &unknown.did_you_mean {
                Some(known) => format!(" (did you mean {known:?}? keys are case-sensitive)"),
                None => String::new(),
            };
            self.add(
                &unknown.path,
                format!("not a KubeProxyConfiguration field; ignored{hint}"),
            );
        }
    }

    fn feature_gates(&mut self, c: &KubeProxyConfiguration) {
        if c.feature_gates.is_empty() {
            return;
        }
        let gates: Vec<String> = c
            .feature_gates
            .iter()
            .map(|(name, on)| format!("{name}={on}"))
            .collect();
        self.add(
            "featureGates",
            format!(
                "nftproxy has no feature gates; ignored: {} (LoggingAlphaOptions and \
                 LoggingBetaOptions still decide which logging options are accepted, as in \
                 kube-proxy)",
                gates.join(", ")
            ),
        );
    }

    fn client_connection(&mut self, c: &KubeProxyConfiguration) {
        let cc = &c.client_connection;
        if cc.content_type != DEFAULT_CONTENT_TYPE && cc.content_type != JSON {
            self.add(
                "clientConnection.contentType",
                format!(
                    "{:?} is ignored: nftproxy always sends {JSON} to the API server",
                    cc.content_type
                ),
            );
        }
        if !cc.accept_content_types.is_empty() && cc.accept_content_types != JSON {
            self.add(
                "clientConnection.acceptContentTypes",
                format!(
                    "{:?} is ignored: nftproxy always accepts {JSON} from the API server",
                    cc.accept_content_types
                ),
            );
        }
    }

    fn logging(&mut self, c: &KubeProxyConfiguration) {
        let l = &c.logging;
        if l.flush_frequency.duration != DEFAULT_LOG_FLUSH_FREQUENCY {
            self.add(
                "logging.flushFrequency",
                format!(
                    "{} is ignored: nftproxy writes each log line as it happens, with no \
                     periodic flush",
                    l.flush_frequency.duration
                ),
            );
        }
        if !l.vmodule.is_empty() {
            self.add(
                "logging.vmodule",
                format!(
                    "per-file verbosity is not supported; logging.verbosity ({}) applies to \
                     all of nftproxy's logs",
                    l.verbosity
                ),
            );
        }
        self.output_routing("logging.options.text", &l.options.text);
        self.output_routing("logging.options.json", &l.options.json);
    }

    fn output_routing(&mut self, prefix: &str, o: &OutputRoutingOptions) {
        if o.split_stream {
            self.add(
                &format!("{prefix}.splitStream"),
                "not supported: nftproxy writes all its logs to standard error",
            );
        }
        if !o.info_buffer_size.is_zero() {
            self.add(
                &format!("{prefix}.infoBufferSize"),
                format!(
                    "{:?} is ignored: nftproxy does not buffer its logs",
                    o.info_buffer_size.0
                ),
            );
        }
    }

    /// kube-proxy's Go-runtime diagnostics, which have no counterpart in nftproxy.
    fn diagnostics(&mut self, c: &KubeProxyConfiguration) {
        if c.enable_profiling {
            self.add(
                "enableProfiling",
                "ignored: nftproxy serves no /debug/pprof handlers (that is Go's profiler)",
            );
        }
        if !c.show_hidden_metrics_for_version.is_empty() {
            self.add(
                "showHiddenMetricsForVersion",
                format!(
                    "{:?} is ignored: nftproxy has no hidden (deprecated) metrics to show",
                    c.show_hidden_metrics_for_version
                ),
            );
        }
    }

    fn windows(&mut self, c: &KubeProxyConfiguration) {
        if c.windows_run_as_service {
            self.add(
                "windowsRunAsService",
                "ignored: Windows only; nftproxy runs on Linux",
            );
        }
        let changed = changed_fields("winkernel", &c.winkernel, &defaulted().winkernel);
        if !changed.is_empty() {
            self.add(
                "winkernel",
                format!(
                    "ignored: Windows only (kube-proxy's kernelspace mode); nftproxy runs on \
                     Linux: {}",
                    changed.join(", ")
                ),
            );
        }
    }

    fn ipvs(&mut self, c: &KubeProxyConfiguration) {
        let changed = changed_fields("ipvs", &c.ipvs, &defaulted().ipvs);
        if !changed.is_empty() {
            self.add(
                "ipvs",
                format!("ignored: nftproxy has no ipvs mode: {}", changed.join(", ")),
            );
        }
    }

    /// Each mode reads its own section; settings in the other one do nothing.
    fn other_mode_section(&mut self, c: &KubeProxyConfiguration, mode: ProxyMode, empty: bool) {
        let defaults = defaulted();
        let (other, changed) = match mode {
            ProxyMode::Nftables => (
                "iptables",
                changed_fields("iptables", &c.iptables, &defaults.iptables),
            ),
            ProxyMode::Iptables => (
                "nftables",
                changed_fields("nftables", &c.nftables, &defaults.nftables),
            ),
        };
        if changed.is_empty() {
            return;
        }
        let mut message = format!(
            "unused in {} mode ({}.* applies): {}",
            mode.name(),
            mode.name(),
            changed.join(", ")
        );
        if empty && mode == ProxyMode::Nftables {
            message.push_str(
                "; with mode \"\" kube-proxy would run in iptables mode and use them, while \
                 nftproxy's default is nftables (set mode: iptables to keep iptables)",
            );
        }
        self.add(other, message);
    }

    /// kube-proxy writes the conntrack sysctls at startup; nftproxy leaves them to the node.
    fn conntrack(&mut self, ct: &ConntrackConfiguration, mode: ProxyMode) {
        let (fields, sysctls) = conntrack_sysctls(ct);
        if sysctls.is_empty() {
            return;
        }
        let mut message = format!(
            "kube-proxy would set the node's conntrack sysctls from {}: {}; nftproxy does not \
             set sysctls: set them on the node (for example in /etc/sysctl.d) if you rely on \
             them",
            fields.join(", "),
            sysctls.join(", ")
        );
        if ct.tcp_be_liberal && mode == ProxyMode::Iptables {
            message.push_str(
                " (conntrack.tcpBeLiberal is honoured otherwise: no rule drops packets in \
                 conntrack state INVALID)",
            );
        }
        self.add("conntrack", message);
    }

    fn config_sync_period(&mut self, c: &KubeProxyConfiguration) {
        if c.config_sync_period != DEFAULT_CONFIG_SYNC_PERIOD {
            self.add(
                "configSyncPeriod",
                format!(
                    "{} is ignored: nftproxy's watches are not resynced periodically; each \
                     change is applied as it arrives",
                    c.config_sync_period
                ),
            );
        }
    }

    fn port_range(&mut self, c: &KubeProxyConfiguration) {
        if !c.port_range.trim().is_empty() {
            self.add(
                "portRange",
                format!(
                    "{:?} is ignored: it configured the removed userspace proxy and is used \
                     by neither the nftables nor the iptables mode",
                    c.port_range
                ),
            );
        }
    }
}

/// The default configuration, defaulted: what "not set" means for each section.
fn defaulted() -> KubeProxyConfiguration {
    KubeProxyConfiguration::default().with_defaults()
}

/// `section.field=value` for each field of `actual` that differs from `default`.
fn changed_fields<T: Serialize>(section: &str, actual: &T, default: &T) -> Vec<String> {
    let (Ok(Json::Object(actual)), Ok(Json::Object(default))) =
        (serde_json::to_value(actual), serde_json::to_value(default))
    else {
        return Vec::new();
    };
    actual
        .iter()
        .filter(|(name, value)| default.get(*name) != Some(value))
        .map(|(name, value)| format!("{section}.{name}={value}"))
        .collect()
}

/// The conntrack fields in use and the sysctls kube-proxy would write from them (upstream:
/// a zero or unset value leaves the kernel's setting alone).
fn conntrack_sysctls(ct: &ConntrackConfiguration) -> (Vec<String>, Vec<String>) {
    let (mut fields, mut sysctls) = (Vec::new(), Vec::new());
    let per_core = ct.max_per_core.unwrap_or(0);
    if per_core > 0 {
        let floor = ct.min.unwrap_or(0);
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let max = (i64::from(per_core) * cpus as i64).max(i64::from(floor));
        fields.push(format!("conntrack.maxPerCore={per_core}"));
        fields.push(format!("conntrack.min={floor}"));
        sysctls.push(format!(
            "net.netfilter.nf_conntrack_max={max} (max of {per_core} x {cpus} CPUs and {floor}, \
             with the nf_conntrack hashsize raised to at least {})",
            max / 4
        ));
    }
    let timeouts = [
        (
            "tcpEstablishedTimeout",
            "nf_conntrack_tcp_timeout_established",
            ct.tcp_established_timeout.unwrap_or_default(),
        ),
        (
            "tcpCloseWaitTimeout",
            "nf_conntrack_tcp_timeout_close_wait",
            ct.tcp_close_wait_timeout.unwrap_or_default(),
        ),
        ("udpTimeout", "nf_conntrack_udp_timeout", ct.udp_timeout),
        (
            "udpStreamTimeout",
            "nf_conntrack_udp_timeout_stream",
            ct.udp_stream_timeout,
        ),
    ];
    for (field, sysctl, d) in timeouts {
        if d.0 > 0 {
            fields.push(format!("conntrack.{field}={d}"));
            sysctls.push(format!("net.netfilter.{sysctl}={}", d.whole_secs()));
        }
    }
    if ct.tcp_be_liberal {
        fields.push("conntrack.tcpBeLiberal=true".to_string());
        sysctls.push("net.netfilter.nf_conntrack_tcp_be_liberal=1".to_string());
    }
    (fields, sysctls)
}
