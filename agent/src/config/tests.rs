//! Every `KubeProxyConfiguration` field is honoured (its value reaches `Settings`), warned
//! about (a warning names it) or rejected (the error names it), and `FIELDS`, the list the
//! per-field table must cover, is checked against the model itself so that a new field
//! cannot go untested or undocumented.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

use dataplane::nft::build::{LocalDetector, NodePortAddresses};
use serde::Deserialize;
use serde_json::{Value, json};

use super::*;
mod fields;

fn resolve(yaml: &str) -> Result<Settings, ConfigError> {
    let file = KubeProxyConfiguration::parse(yaml).expect("parses");
    Settings::resolve(&file, &Overrides::default())
}

/// A parse or resolve error as text, or the settings.
fn outcome(yaml: &str) -> Result<Settings, String> {
    let file = KubeProxyConfiguration::parse(yaml)?;
    Settings::resolve(&file, &Overrides::default()).map_err(|e| e.to_string())
}

/// The warnings that name `field`, as their field or in their message.
fn warnings_naming<'a>(s: &'a Settings, field: &str) -> Vec<&'a ConfigWarning> {
    s.warnings
        .iter()
        .filter(|w| w.field == field || w.message.contains(field))
        .collect()
}

/// kubeadm's `config.conf` as it writes it: every field present, most of them zero or null.
const KUBEADM_CONFIG: &str = include_str!("../../../tests/fixtures/kubeadm-kube-proxy-config.conf");

#[test]
fn kubeadm_stock_config_resolves_to_kube_proxy_defaults() {
    let file = KubeProxyConfiguration::parse(KUBEADM_CONFIG).expect("parses");
    // kubeadm's DaemonSet passes --hostname-override=$(NODE_NAME).
    let overrides = Overrides {
        hostname_override: Some("Node-1".into()),
        ..Overrides::default()
    };
    let s = Settings::resolve(&file, &overrides).expect("resolves");
    assert_eq!(s.mode, ProxyMode::Nftables);
    assert_eq!(s.node_name, "node-1");
    assert_eq!(s.sync_period, Duration::from_secs(30));
    assert_eq!(s.min_sync_period, Duration::from_secs(1));
    assert_eq!(s.healthz_bind_address, "0.0.0.0:10256");
    assert_eq!(s.metrics_bind_address, "127.0.0.1:10249");
    assert_eq!(
        s.kubeconfig.as_deref(),
        Some("/var/lib/kube-proxy/kubeconfig.conf")
    );
    assert_eq!(
        s.client,
        ClientSettings {
            qps: 5.0,
            burst: 10
        }
    );
    assert_eq!(s.oom_score_adj, -999);
    assert_eq!(s.build.masquerade_bit, 14);
    assert!(!s.build.masquerade_all);
    assert_eq!(s.build.node_port_addresses, NodePortAddresses::Primary);
    assert!(
        matches!(&s.build.local_detector, LocalDetector::ClusterCidr(c) if c.len() == 1),
        "{:?}",
        s.build.local_detector
    );
    assert_eq!(
        s.logging,
        LoggingSettings {
            format: LogFormat::Text,
            verbosity: 0
        }
    );
    // kube-proxy would write the conntrack sysctls from its defaults; nothing else differs.
    let fields: Vec<&str> = s.warnings.iter().map(|w| w.field.as_str()).collect();
    assert_eq!(fields, ["conntrack"], "{:#?}", s.warnings);
    let conntrack = &s.warnings[0].message;
    for expected in [
        "conntrack.maxPerCore=32768",
        "conntrack.min=131072",
        "nf_conntrack_max=",
        "nf_conntrack_tcp_timeout_established=86400",
        "nf_conntrack_tcp_timeout_close_wait=3600",
        "set them on the node",
    ] {
        assert!(conntrack.contains(expected), "{expected}: {conntrack}");
    }
}

#[test]
fn the_shipped_configmap_resolves_with_only_the_conntrack_warning() {
    let manifests = include_str!("../../../packaging/configmap.yaml");
    let text = serde_yaml_ng::Deserializer::from_str(manifests)
        .filter_map(|doc| serde_yaml_ng::Value::deserialize(doc).ok())
        .find_map(|doc| doc["data"]["config.conf"].as_str().map(str::to_string))
        .expect("a ConfigMap with data.config.conf");
    let s = resolve(&text).unwrap();
    assert_eq!(s.mode, ProxyMode::Nftables);
    assert_eq!(s.metrics_bind_address, "0.0.0.0:10249");
    let fields: Vec<&str> = s.warnings.iter().map(|w| w.field.as_str()).collect();
    assert_eq!(fields, ["conntrack"], "{:#?}", s.warnings);
}

#[test]
fn json_and_comment_only_files_parse() {
    let s = resolve(r#"{"mode": "iptables", "nftables": {"masqueradeAll": true}}"#).unwrap();
    assert_eq!(s.mode, ProxyMode::Iptables);
    assert_eq!(
        KubeProxyConfiguration::parse(
            "# nothing set
"
        )
        .unwrap(),
        KubeProxyConfiguration::default()
    );
    let err = KubeProxyConfiguration::parse("- a list").unwrap_err();
    assert!(err.contains("KubeProxyConfiguration"), "{err}");
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
    assert_eq!(s.healthz_bind_address, "0.0.0.0:10256");
    assert_eq!(s.bind_address, IpAddr::from([0, 0, 0, 0]));
    assert!(s.iptables.localhost_node_ports && s.iptables.drop_invalid);
    assert_eq!(s.kubeconfig, None);
    let d = Settings::resolve(&KubeProxyConfiguration::default(), &Overrides::default()).unwrap();
    assert_eq!(d.effective, s.effective);
    assert_eq!(d.build, s.build);
}

#[test]
fn zero_values_mean_the_defaults() {
    let s = resolve("nftables: {syncPeriod: 0s, minSyncPeriod: 0s, masqueradeBit: null}").unwrap();
    assert_eq!(s.sync_period, Duration::from_secs(30));
    assert_eq!(s.min_sync_period, Duration::from_secs(1));
    assert_eq!(s.build.masquerade_bit, 14);
    // null reads as the zero value everywhere, not only where Go has a pointer.
    let s = resolve("clientConnection: null\nmode: null\nconntrack: {udpTimeout: null}").unwrap();
    assert_eq!(s.mode, ProxyMode::Nftables);
    assert_eq!(s.client.burst, 10);
}

#[test]
fn effective_configuration_reads_like_kube_proxy_configz() {
    let s = resolve("clusterCIDR: 10.0.0.0/8").unwrap();
    let e = &s.effective;
    assert_eq!(e["apiVersion"], "kubeproxy.config.k8s.io/v1alpha1");
    assert_eq!(e["kind"], "KubeProxyConfiguration");
    assert_eq!(e["mode"], "nftables");
    assert_eq!(e["nftables"]["syncPeriod"], "30s");
    assert_eq!(e["nftables"]["minSyncPeriod"], "1s");
    assert_eq!(e["nftables"]["masqueradeBit"], 14);
    assert_eq!(e["iptables"]["localhostNodePorts"], true);
    assert_eq!(e["ipvs"]["syncPeriod"], "30s");
    assert_eq!(e["ipvs"]["minSyncPeriod"], "0s");
    assert_eq!(e["configSyncPeriod"], "15m0s");
    assert_eq!(e["conntrack"]["maxPerCore"], 32768);
    assert_eq!(e["conntrack"]["min"], 131072);
    assert_eq!(e["conntrack"]["tcpEstablishedTimeout"], "24h0m0s");
    assert_eq!(e["conntrack"]["tcpCloseWaitTimeout"], "1h0m0s");
    assert_eq!(e["healthzBindAddress"], "0.0.0.0:10256");
    assert_eq!(e["metricsBindAddress"], "127.0.0.1:10249");
    assert_eq!(e["bindAddress"], "0.0.0.0");
    assert_eq!(e["oomScoreAdj"], -999);
    assert_eq!(e["detectLocalMode"], "ClusterCIDR");
    assert_eq!(e["clusterCIDR"], "10.0.0.0/8");
    assert_eq!(
        e["clientConnection"]["contentType"],
        "application/vnd.kubernetes.protobuf"
    );
    assert_eq!(e["clientConnection"]["qps"], 5.0);
    assert_eq!(e["clientConnection"]["burst"], 10);
    assert_eq!(e["logging"]["format"], "text");
    assert_eq!(e["logging"]["flushFrequency"], "5s");
    assert_eq!(e["logging"]["options"]["text"]["infoBufferSize"], "0");
    assert_eq!(e["featureGates"], json!({}));
    let s = resolve("mode: iptables\nlogging: {flushFrequency: 2000000000}").unwrap();
    assert_eq!(s.effective["mode"], "iptables");
    // A number of nanoseconds stays a number, as in Go.
    assert_eq!(s.effective["logging"]["flushFrequency"], 2_000_000_000);
}

#[test]
fn ipv6_bind_address_moves_the_default_listeners_to_ipv6() {
    let s = resolve("bindAddress: \"::\"").unwrap();
    assert_eq!(s.bind_address, IpAddr::V6(Ipv6Addr::UNSPECIFIED));
    assert_eq!(s.healthz_bind_address, "[::]:10256");
    assert_eq!(s.metrics_bind_address, "[::1]:10249");
    // An address without a port gets the default port.
    let s = resolve("healthzBindAddress: \"fd00::1\"\nmetricsBindAddress: 10.0.0.1").unwrap();
    assert_eq!(s.healthz_bind_address, "[fd00::1]:10256");
    assert_eq!(s.metrics_bind_address, "10.0.0.1:10249");
    assert_eq!(s.effective["healthzBindAddress"], "[fd00::1]:10256");
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
    assert!(matches!(s.build.local_detector, LocalDetector::ClusterCidr(ref c) if c.len() == 2));
    assert!(matches!(s.build.node_port_addresses, NodePortAddresses::Cidrs(ref c) if c.len() == 1));
}

#[test]
fn iptables_mode_defaults_and_fields() {
    let s = resolve("mode: iptables\niptables: {masqueradeBit: 5, localhostNodePorts: false}\n")
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
    // The nftables section does nothing in iptables mode: said once.
    assert_eq!(warnings_naming(&s, "nftables.masqueradeBit").len(), 1);
}

#[test]
fn an_empty_mode_keeps_nftables_and_says_so_about_iptables_settings() {
    let s = resolve("mode: \"\"\niptables: {minSyncPeriod: 10s}").unwrap();
    assert_eq!(s.mode, ProxyMode::Nftables);
    let w = warnings_naming(&s, "iptables.minSyncPeriod");
    assert_eq!(w.len(), 1);
    assert!(
        w[0].message
            .contains("kube-proxy would run in iptables mode"),
        "{}",
        w[0]
    );
}

#[test]
fn command_line_overrides_win() {
    let file = KubeProxyConfiguration::parse(
        "hostnameOverride: file-node\nmode: iptables\nclientConnection: {kubeconfig: /file}\n\
         logging: {format: text, verbosity: 1}",
    )
    .unwrap();
    let overrides = Overrides {
        hostname_override: Some(" Flag-Node ".into()),
        proxy_mode: Some("nftables".into()),
        kubeconfig: Some("/flag".into()),
        master: Some("https://10.0.0.1:6443".into()),
        verbosity: Some(4),
        log_format: Some("json".into()),
    };
    let s = Settings::resolve(&file, &overrides).unwrap();
    assert_eq!(s.node_name, "flag-node");
    assert_eq!(s.mode, ProxyMode::Nftables);
    assert_eq!(s.kubeconfig.as_deref(), Some("/flag"));
    assert_eq!(s.master.as_deref(), Some("https://10.0.0.1:6443"));
    assert_eq!(
        s.logging,
        LoggingSettings {
            format: LogFormat::Json,
            verbosity: 4
        }
    );
    assert_eq!(s.effective["hostnameOverride"], "flag-node");
    assert_eq!(s.effective["clientConnection"]["kubeconfig"], "/flag");
    assert_eq!(s.effective["logging"]["verbosity"], 4);
    // Empty flags are unset flags.
    let empty = Overrides {
        hostname_override: Some(String::new()),
        proxy_mode: Some(String::new()),
        kubeconfig: Some(String::new()),
        master: Some(String::new()),
        log_format: Some(String::new()),
        verbosity: None,
    };
    let s = Settings::resolve(&file, &empty).unwrap();
    assert_eq!(
        (s.node_name.as_str(), s.mode),
        ("file-node", ProxyMode::Iptables)
    );
    assert_eq!((s.kubeconfig.as_deref(), s.master), (Some("/file"), None));
}

#[test]
fn bad_command_line_values_name_the_flag() {
    let file = KubeProxyConfiguration::default();
    for (overrides, flag) in [
        (
            Overrides {
                proxy_mode: Some("ipvs".into()),
                ..Overrides::default()
            },
            "--proxy-mode",
        ),
        (
            Overrides {
                log_format: Some("xml".into()),
                ..Overrides::default()
            },
            "--log-format",
        ),
        (
            Overrides {
                hostname_override: Some("  ".into()),
                ..Overrides::default()
            },
            "--hostname-override",
        ),
        (
            Overrides {
                verbosity: Some(u32::MAX),
                ..Overrides::default()
            },
            "-v",
        ),
    ] {
        let err = Settings::resolve(&file, &overrides).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Invalid { field, .. } if field == flag),
            "{flag}: {err}"
        );
    }
}

#[test]
fn unsupported_modes_are_rejected_with_a_reason() {
    for (mode, reason) in [
        ("ipvs", "no ipvs mode"),
        ("kernelspace", "Windows"),
        ("userspace", "not a proxy mode"),
        ("NFTABLES", "not a proxy mode"),
    ] {
        let err = outcome(&format!("mode: {mode}")).unwrap_err();
        assert!(
            err.contains("mode") && err.contains(reason),
            "{mode}: {err}"
        );
    }
}

#[test]
fn unknown_keys_are_warned_about_with_their_path() {
    let s = resolve(
        "bogus: 1\nnftables: {bogus: 1}\nclientConnection: {foo: x}\nclusterCidr: 10.0.0.0/8\n\
         logging: {vmodule: [{filePattern: a, verbosity: 1, extra: 2}], options: {text: {nope: 1}}}\n\
         featureGates: {AnyGate: true}\nconntrack: {max: 0}\n",
    )
    .unwrap();
    let fields: BTreeSet<&str> = s.warnings.iter().map(|w| w.field.as_str()).collect();
    for path in [
        "bogus",
        "nftables.bogus",
        "clientConnection.foo",
        "clusterCidr",
        "logging.vmodule[0].extra",
        "logging.options.text.nope",
        "conntrack.max",
    ] {
        assert!(fields.contains(path), "{path}: {:#?}", s.warnings);
    }
    // Gates are a free-form map, reported as gates, not as unknown keys.
    assert!(!fields.iter().any(|f| f.starts_with("featureGates.")));
    let near_miss = s
        .warnings
        .iter()
        .find(|w| w.field == "clusterCidr")
        .unwrap();
    assert!(near_miss.message.contains("\"clusterCIDR\""), "{near_miss}");
}

#[test]
fn alpha_logging_options_need_their_feature_gate() {
    let yaml = "logging: {options: {json: {splitStream: true, infoBufferSize: 64Ki}}}";
    let err = outcome(yaml).unwrap_err();
    assert!(err.contains("logging.options.json.splitStream"), "{err}");
    let s = resolve(&format!(
        "featureGates: {{LoggingAlphaOptions: true}}\n{yaml}"
    ))
    .unwrap();
    assert_eq!(
        warnings_naming(&s, "logging.options.json.splitStream").len(),
        1
    );
    assert_eq!(
        warnings_naming(&s, "logging.options.json.infoBufferSize").len(),
        1
    );
    let err =
        outcome("featureGates: {LoggingBetaOptions: false}\nlogging: {format: json}").unwrap_err();
    assert!(err.contains("logging.format"), "{err}");
}

#[test]
fn parse_errors_name_the_line() {
    let err = KubeProxyConfiguration::parse("mode: nftables\nnftables:\n  masqueradeBit: [x\n")
        .unwrap_err();
    assert!(err.contains("line 3"), "{err}");
    let err = KubeProxyConfiguration::parse("nftables:\n  syncPeriod: soon\n").unwrap_err();
    assert!(
        err.contains("nftables.syncPeriod") && err.contains("line 2"),
        "{err}"
    );
    // kube-proxy reads durations as strings only: a bare number is not one.
    let err = KubeProxyConfiguration::parse("configSyncPeriod: 30").unwrap_err();
    assert!(err.contains("configSyncPeriod"), "{err}");
}

#[test]
fn go_durations() {
    assert_eq!(parse_duration("1m30s"), Some(Duration::from_secs(90)));
    assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
    assert_eq!(parse_duration("1h0m0s"), Some(Duration::from_secs(3600)));
    assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
    assert_eq!(parse_duration(".5s"), Some(Duration::from_millis(500)));
    assert_eq!(parse_duration("0"), Some(Duration::ZERO));
    assert_eq!(parse_duration("1us"), Some(Duration::from_micros(1)));
    assert_eq!(parse_duration("1\u{b5}s"), Some(Duration::from_micros(1)));
    assert_eq!(parse_duration("-1s"), None);
    assert_eq!(parse_duration("fast"), None);
    assert_eq!(parse_duration("1"), None);
    assert_eq!(parse_duration("1d"), None);
    assert_eq!(parse_duration(""), None);
    assert_eq!(parse_duration("."), None);
    assert_eq!(parse_duration("9999999999h"), None);
    assert_eq!(
        parse_duration("1ns340282366920938463463374607431768211455ns"),
        None
    );
    assert_eq!(GoDuration::parse("-1.5s"), Ok(GoDuration(-1_500_000_000)));
    assert_eq!(GoDuration::parse("+2m"), Ok(GoDuration::from_secs(120)));
}

#[test]
fn go_duration_strings() {
    for (nanos, text) in [
        (0, "0s"),
        (1, "1ns"),
        (1_500, "1.5\u{b5}s"),
        (1_500_000, "1.5ms"),
        (500_000_000, "500ms"),
        (1_000_000_000, "1s"),
        (1_500_000_000, "1.5s"),
        (59_000_000_000, "59s"),
        (60_000_000_000, "1m0s"),
        (61_500_000_000, "1m1.5s"),
        (90_000_000_000, "1m30s"),
        (900_000_000_000, "15m0s"),
        (3_600_000_000_000, "1h0m0s"),
        (86_400_000_000_000, "24h0m0s"),
        (-30_000_000_000, "-30s"),
    ] {
        assert_eq!(GoDuration(nanos).to_string(), text);
        assert_eq!(GoDuration::parse(text), Ok(GoDuration(nanos)), "{text}");
    }
}

#[test]
fn quantities() {
    for ok in ["0", "512", "64Ki", "1M", "1.5Gi", "1e3", "+1", "0.0"] {
        assert!(
            KubeProxyConfiguration::parse(&format!(
                "logging: {{options: {{text: {{infoBufferSize: \"{ok}\"}}}}}}"
            ))
            .is_ok(),
            "{ok}"
        );
    }
    let err = KubeProxyConfiguration::parse("logging: {options: {text: {infoBufferSize: 1KB}}}")
        .unwrap_err();
    assert!(err.contains("logging.options.text.infoBufferSize"), "{err}");
    assert!(Quantity("0".into()).is_zero() && Quantity("0Ki".into()).is_zero());
    assert!(!Quantity("1m".into()).is_zero());
}
